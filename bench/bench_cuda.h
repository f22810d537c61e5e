/* bench_cuda.h: what the GPU benchmarks share (bench_cuda.c,
 * bench_cuda_train.c): their common start. */
#ifndef OPFUSE_BENCH_CUDA_H
#define OPFUSE_BENCH_CUDA_H

#include <stdio.h>
#include <string.h>

#include "backend/cuda/cuda.h"
#include "opfuse.h"

/* Takes a leading `--out FILE` off argv (*out_path, else NULL), makes a
 * CUDA context and prints "bench WHO on <GPU>". Returns 0 with *ctx made,
 * or the benchmark's exit status with *ctx NULL: 0 when the machine has no
 * GPU (skipped), 1 on another failure. */
static inline int opf_bench_cuda_open(const char *who, int *argc, char ***argv,
                                      const char **out_path, opf_ctx **ctx)
{
    *out_path = NULL;
    if (*argc >= 2 && !strcmp((*argv)[0], "--out")) {
        *out_path = (*argv)[1];
        *argc -= 2, *argv += 2;
    }
    *ctx = NULL;
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
