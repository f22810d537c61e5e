/* bench_quantize.c: `opfuse bench quantize`: quantize throughput per format
 * (bytes read + bytes written per second) against memcpy of the input in the
 * same run, on 1 thread and on all threads.
 *
 *     opfuse bench quantize [M K]      default 4096 x 4096 bf16 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "apps.h"
#include "bench.h"
#include "opfuse.h"

enum { REPS = 7 };

typedef struct qcase {
    const char *name;
    opf_scaling scaling;
    opf_dtype qdtype;
    unsigned usage;
    bool rht;
} qcase;

static const qcase qcases[] = {
    {"fp8 current, row", OPF_SCALING_TENSOR, OPF_E4M3, 1, false},
    {"fp8 current, row+col", OPF_SCALING_TENSOR, OPF_E4M3, 3, false},
    {"fp8 delayed, row+col", OPF_SCALING_TENSOR, OPF_E4M3, 3, false},
    {"fp8 block1d, row", OPF_SCALING_BLOCK_1D, OPF_E4M3, 1, false},
    {"fp8 block1d, row+col", OPF_SCALING_BLOCK_1D, OPF_E4M3, 3, false},
    {"fp8 block2d, row+col", OPF_SCALING_BLOCK_2D, OPF_E4M3, 3, false},
    {"mxfp8, row", OPF_SCALING_MXFP8, OPF_E4M3, 1, false},
    {"mxfp8, row+col", OPF_SCALING_MXFP8, OPF_E4M3, 3, false},
    {"nvfp4, row", OPF_SCALING_NVFP4_1D, OPF_E2M1, 1, false},
    {"nvfp4, row+col (RHT)", OPF_SCALING_NVFP4_1D, OPF_E2M1, 3, true},
};

/* Median seconds of one quantization. */
static double time_quantize(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *x,
                            opf_tensor *out)
{
    double t[REPS];
    opf_quantize(ctx, q, x, out);  /* warm up */
    for (int r = 0; r < REPS; r++) {
        double t0 = opf_bench_now();
        opf_quantize(ctx, q, x, out);
        t[r] = opf_bench_now() - t0;
    }
    qsort(t, REPS, sizeof t[0], opf_bench_cmp_double);
    return t[REPS / 2];
}

static double time_memcpy(void *dst, const void *src, size_t n)
{
    double t[REPS];
    memcpy(dst, src, n);
    for (int r = 0; r < REPS; r++) {
        double t0 = opf_bench_now();
        memcpy(dst, src, n);
        t[r] = opf_bench_now() - t0;
        ((volatile char *)dst)[r] = ((const char *)src)[r];
    }
    qsort(t, REPS, sizeof t[0], opf_bench_cmp_double);
    return t[REPS / 2];
}

int opf_bench_quantize(int argc, char **argv)
{
    int64_t M = argc >= 2 ? atoll(argv[0]) : 4096, K = argc >= 2 ? atoll(argv[1]) : 4096;
    size_t n = (size_t)(M * K), in_bytes = n * 2;
    uint16_t *xb = malloc(in_bytes);
    void *copy = malloc(in_bytes);
    opf_ctx *ctx;
    opf_delayed_state *ds;
    if (!xb || !copy || opf_ctx_create(NULL, &ctx)) return 1;
    opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0, 16, OPF_AMAX_MAX, false, 1, &ds);
    uint64_t s = 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        xb[i] = opf_f32_to_bf16(((int)(s >> 40) - (1 << 23)) * (4.0f / (1 << 23)));
    }
    opf_tensor x;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {M, K}, .dtype = OPF_BF16}, xb, &x);
    int nthreads = omp_get_max_threads();
    double mc = time_memcpy(copy, xb, in_bytes), mc_gbs = 2.0 * in_bytes / mc / 1e9;
    printf("quantize bf16 [%lld, %lld]; GB/s = (bytes read + bytes written) / time, median of %d\n",
           (long long)M, (long long)K, REPS);
    printf("peer: memcpy of the %zu input bytes, 1 thread: %.2f ms, %.1f GB/s (read+write)\n\n",
           in_bytes, mc * 1e3, mc_gbs);
    printf("| %-22s | %9s | %9s | %11s | %9s | %11s |\n", "format", "ms 1 thr", "GB/s 1 thr",
           "vs memcpy", "ms all", "GB/s all");
    printf("|------------------------|-----------|-----------|-------------|-----------|-------------|\n");
    int rc = 0;
    for (size_t i = 0; i < sizeof qcases / sizeof qcases[0]; i++) {
        const qcase *c = &qcases[i];
        opf_quantizer q = opf_quantizer_default();
        q.scaling = c->scaling;
        q.qdtype = c->qdtype;
        q.usage = c->usage;
        q.rht = c->rht;
        if (strstr(c->name, "delayed")) q.delayed = ds;
        opf_tensor out;
        if (opf_quantize_alloc(ctx, &q, &x, &out)) {
            fprintf(stderr, "%s: %s\n", c->name, opf_last_error(ctx));
            rc = 1;
            continue;
        }
        size_t bytes = in_bytes + opf_tensor_buffer_bytes(&out);
        omp_set_num_threads(1);
        double t1 = time_quantize(ctx, &q, &x, &out);
        omp_set_num_threads(nthreads);
        double tn = time_quantize(ctx, &q, &x, &out);
        printf("| %-22s | %9.2f | %9.1f | %10.2fx | %9.2f | %11.1f |\n", c->name, t1 * 1e3,
               bytes / t1 / 1e9, bytes / t1 / 1e9 / mc_gbs, tn * 1e3, bytes / tn / 1e9);
        opf_tensor_release(&out);
    }
    printf("\n(all = %d threads; 'vs memcpy' = 1-thread quantize GB/s over 1-thread memcpy GB/s)\n",
           nthreads);
    opf_delayed_state_destroy(ds);
    opf_ctx_destroy(ctx);
    free(xb), free(copy);
    return rc;
}
