/* bench_act.c: `opfuse bench act`: forward and backward time of the
 * activation ops on one f32 tensor through the eager fuser (a seq of one
 * op), median of 201 calls after 5 warm-ups. Gated ops halve the last dim.
 * The peer, measured in the same run: the same forward formula as a plain
 * loop over the C library's tanhf / expf into a preallocated output (no op,
 * no allocation, no rounding pass; the loops without a libm call are
 * vectorized), which is what the activations computed before act-math.h.
 *
 *     opfuse bench act [rows cols]   default 128 1024 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>

#include "bench.h"
#include "opfuse.h"

/* Median microseconds of the forward and of the backward of op cls on x. */
static int act_us(opf_ctx *ctx, const char *cls, const opf_tensor *x, double *fwd, double *bwd)
{
    opf_seq *seq;
    opf_op *op;
    if (opf_seq_create(ctx, &seq) || opf_op_create(ctx, cls, NULL, cls, &op) ||
        opf_seq_append(seq, op))
        return -1;
    opf_seq_call call = opf_seq_call_default();
    enum { REPS = 201 };
    static double tf[REPS], tb[REPS];
    for (int r = -5; r < REPS; r++) {
        opf_tensor y, dx;
        double t0 = opf_bench_now();
        if (opf_seq_forward(seq, x, &call, &y, NULL)) return -1;
        double t1 = opf_bench_now();
        if (opf_seq_backward(seq, &y, NULL, &dx, NULL)) return -1;  /* dy = y */
        double t2 = opf_bench_now();
        opf_tensor_release(&dx);
        opf_tensor_release(&y);
        if (r >= 0) tf[r] = (t1 - t0) * 1e6, tb[r] = (t2 - t1) * 1e6;
    }
    opf_seq_destroy(seq);
    qsort(tf, REPS, sizeof tf[0], opf_bench_cmp_double);
    qsort(tb, REPS, sizeof tb[0], opf_bench_cmp_double);
    *fwd = tf[REPS / 2], *bwd = tb[REPS / 2];
    return 0;
}

/* The peer's forward of op cls: y = f(x) with libm (gated: f(a) b per row),
 * the function chosen once, outside the loop. */
static void libm_forward(const char *cls, const float *x, float *y, int64_t rows, int64_t cols)
{
    enum { GELU, RELU, SWISH } k = !strcmp(cls, "gelu") || !strcmp(cls, "geglu") ? GELU
                                 : !strcmp(cls, "relu") ? RELU : SWISH;
    const float alpha = !strcmp(cls, "qgelu") ? 1.702f : 1.0f;
    bool gated = !strcmp(cls, "geglu") || !strcmp(cls, "swiglu");
    int64_t h = gated ? cols / 2 : cols;
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * cols, *b = a + h;
        float *o = y + r * h;
        if (k == GELU)
            for (int64_t j = 0; j < h; j++)
                o[j] = a[j] * (0.5f + 0.5f * tanhf(a[j] * (0.79788456f + 0.03567741f * a[j] * a[j])));
        else if (k == RELU)
#pragma omp simd
            for (int64_t j = 0; j < h; j++) o[j] = a[j] > 0.0f ? a[j] : 0.0f;
        else
            for (int64_t j = 0; j < h; j++) o[j] = a[j] / (1.0f + expf(-alpha * a[j]));
        if (gated)
#pragma omp simd
            for (int64_t j = 0; j < h; j++) o[j] *= b[j];
    }
}

/* Median microseconds of the peer's forward. */
static double libm_us(const char *cls, const float *x, float *y, int64_t rows, int64_t cols)
{
    enum { REPS = 51 };
    double t[REPS];
    for (int r = -2; r < REPS; r++) {
        double t0 = opf_bench_now();
        libm_forward(cls, x, y, rows, cols);
        if (r >= 0) t[r] = (opf_bench_now() - t0) * 1e6;
    }
    return opf_bench_median(t, REPS);
}

int opf_bench_act(int argc, char **argv)
{
    int64_t rows = argc >= 2 ? atoll(argv[0]) : 128, cols = argc >= 2 ? atoll(argv[1]) : 1024;
    if (rows < 1 || cols < 2 || cols % 2) {
        fprintf(stderr, "bench act: rows >= 1 and an even cols >= 2\n");
        return 1;
    }
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    float *xv = malloc(sizeof(float) * (size_t)(rows * cols));
    unsigned s = 12345;
    for (int64_t i = 0; i < rows * cols; i++) {  /* about N(0, 1.7): GELU inputs of an MLP */
        s = s * 1664525u + 1013904223u;
        xv[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 6.0f;
    }
    opf_tensor x;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {rows, cols}, .dtype = OPF_F32}, xv, &x);
    printf("activation ops, f32 [%lld, %lld], %d threads, median of 201 calls\n\n", (long long)rows,
           (long long)cols, omp_get_max_threads());
    printf("| %-14s | %9s | %9s | %13s | %13s | %12s | %10s |\n", "op", "fwd us", "bwd us",
           "fwd+bwd us", "ns/element", "libm fwd us", "fwd ratio");
    printf("|----------------|-----------|-----------|---------------|---------------|"
           "-------------:|-----------:|\n");
    float *yv = malloc(sizeof(float) * (size_t)(rows * cols));
    static const char *const ops[] = {"gelu", "qgelu", "silu", "relu", "geglu", "swiglu"};
    int rc = 0;
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        double f, b;
        if (act_us(ctx, ops[i], &x, &f, &b)) {
            fprintf(stderr, "bench act %s: %s\n", ops[i], opf_last_error(ctx));
            rc = 1;
            continue;
        }
        double peer = libm_us(ops[i], xv, yv, rows, cols);
        printf("| %-14s | %9.1f | %9.1f | %13.1f | %13.3f | %12.1f | %9.2fx |\n", ops[i], f, b,
               f + b, (f + b) * 1e3 / (double)(rows * cols), peer, peer / f);
    }
    printf("\nfwd ratio: the libm loop's time over the op's forward (> 1: the op is faster, though it\n"
           "also runs the fuser and allocates its output)\n");
    free(xv);
    free(yv);
    opf_ctx_destroy(ctx);
    return rc;
}
