/* bench_cuda.h: what the GPU benchmarks share (bench_cuda.c,
 * bench_cuda_train.c): their common start. */
#ifndef OPFUSE_BENCH_CUDA_H
#define OPFUSE_BENCH_CUDA_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda.h"
#include "opfuse.h"

/* Takes the leading options off argv, in any order: `--out FILE`
 * (*out_path, else NULL) and, where only is not NULL, `--only LIST` (*only,
 * else NULL); then the n_dims sizes that may follow (dims[i] keeps its
 * default where none is given; a size that is not a positive integer is an
 * error). Makes a CUDA context and prints "bench WHO on <GPU>". Returns 0
 * with *ctx made, or the benchmark's exit status with *ctx NULL: 0 when the
 * machine has no GPU (skipped), 2 on bad arguments, 1 on another failure. */
static inline int opf_bench_cuda_open(const char *who, int argc, char **argv,
                                      const char **out_path, const char **only, int64_t *dims,
                                      int n_dims, opf_ctx **ctx)
{
    *out_path = NULL;
    *ctx = NULL;
    if (only) *only = NULL;
    for (; argc >= 2 && argv[0][0] == '-'; argc -= 2, argv += 2) {
        if (!strcmp(argv[0], "--out")) *out_path = argv[1];
        else if (only && !strcmp(argv[0], "--only")) *only = argv[1];
        else break;
    }
    for (int i = 0; i < argc; i++) {
        char *end;
        long long v = strtoll(argv[i], &end, 10);
        if (i >= n_dims || *end || end == argv[i] || v < 1) {
            fprintf(stderr, "bench %s: argument \"%s\" is not %s\n", who, argv[i],
                    i >= n_dims ? "an option this benchmark takes" : "a positive size");
            return 2;
        }
        dims[i] = v;
    }
    opf_ctx_options o = opf_ctx_options_default();
    o.device = OPF_DEVICE_CUDA;
    opf_status st = opf_ctx_create(&o, ctx);
    if (st) {
        printf("bench %s: skipped: %s\n", who, opf_last_error(NULL));
        return st == OPF_ERR_UNSUPPORTED ? 0 : 1;
    }
    char name[128] = "";
    opf_cuda_device_name(*ctx, name, sizeof name);
    printf("bench %s on %s\n", who, name);
    return 0;
}

#endif
