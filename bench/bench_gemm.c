/* bench_gemm.c: `opfuse bench gemm`: opf_gemm (TN, y = x W^T) against a plain
 * OpenBLAS sgemm of the same shape measured in the same run, median of
 * several runs each. fp32 operands at a few shapes, then pre-quantized
 * operands of every recipe at 1024^3 (the quantization itself is not timed).
 *
 *     opfuse bench gemm [M N K]   one fp32 shape instead of the default list */
#include <cblas.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "opfuse.h"

enum { REPS = 5 };

/* One operand configuration: how x and W are quantized (or not). */
typedef struct gemm_case {
    const char *name;
    opf_scaling x_scaling, w_scaling;
    opf_dtype   x_dtype, out_dtype;  /* plain dtype of x and W; output dtype */
} gemm_case;

static const gemm_case quant_cases[] = {
    {"bf16", OPF_SCALING_NONE, OPF_SCALING_NONE, OPF_BF16, OPF_BF16},
    {"fp8 current", OPF_SCALING_TENSOR, OPF_SCALING_TENSOR, OPF_BF16, OPF_BF16},
    {"mxfp8", OPF_SCALING_MXFP8, OPF_SCALING_MXFP8, OPF_BF16, OPF_BF16},
    {"fp8 block 1Dx2D", OPF_SCALING_BLOCK_1D, OPF_SCALING_BLOCK_2D, OPF_BF16, OPF_BF16},
    {"nvfp4 1Dx2D", OPF_SCALING_NVFP4_1D, OPF_SCALING_NVFP4_2D, OPF_BF16, OPF_BF16},
};

static void fill(float *v, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        v[i] = (float)((seed >> 8) * (1.0 / 16777216.0)) - 0.5f;
    }
}

/* A plain tensor of dtype dt filled from fp32 values. */
static opf_status make_plain(opf_ctx *ctx, int64_t r, int64_t c, opf_dtype dt, const float *v,
                             opf_tensor *t)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){r, c}, dt);
    opf_status st = opf_tensor_alloc(ctx, &s, t);
    if (st) return st;
    return opf_convert(v, OPF_F32, t->data[OPF_COMP_DATA], dt, (size_t)(r * c));
}

/* The operand as the case wants it: plain, or quantized rowwise (TN). */
static opf_status make_operand(opf_ctx *ctx, int64_t r, int64_t c, opf_dtype dt, opf_scaling sc,
                               const float *v, opf_tensor *out)
{
    opf_tensor plain;
    opf_status st = make_plain(ctx, r, c, dt, v, &plain);
    if (st || sc == OPF_SCALING_NONE) {
        *out = plain;
        return st;
    }
    opf_quantizer q = opf_quantizer_default();
    q.scaling = sc;
    q.qdtype = (sc == OPF_SCALING_NVFP4_1D || sc == OPF_SCALING_NVFP4_2D) ? OPF_E2M1 : OPF_E4M3;
    q.usage = OPF_USAGE_ROWWISE;
    q.pow2_scales = sc == OPF_SCALING_BLOCK_1D || sc == OPF_SCALING_BLOCK_2D;
    st = opf_quantize_alloc(ctx, &q, &plain, out);
    opf_tensor_release(&plain);
    return st;
}

/* Median times of opf_gemm and of the peer sgemm. The runs alternate, so
 * both see the same machine state (caches, other processes, OpenBLAS's
 * spinning helper threads). Returns false when opf_gemm fails. */
static bool time_pair(opf_ctx *ctx, const opf_tensor *w, const opf_tensor *x, opf_tensor *y,
                      int64_t M, int64_t N, int64_t K, const float *xv, const float *wv,
                      float *yv, double *t_opf, double *t_blas)
{
    opf_gemm_options o = opf_gemm_options_default();
    double to[REPS], tb[REPS];
    if (opf_gemm(ctx, w, x, OPF_GEMM_TN, &o, y)) return false;  /* warm-up, workspace */
    for (int r = 0; r < REPS; r++) {
        double t0 = opf_bench_now() * 1e3;
        opf_gemm(ctx, w, x, OPF_GEMM_TN, &o, y);
        double t1 = opf_bench_now() * 1e3;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, xv,
                    (int)K, wv, (int)K, 0.0f, yv, (int)N);
        double t2 = opf_bench_now() * 1e3;
        to[r] = t1 - t0;
        tb[r] = t2 - t1;
    }
    *t_opf = opf_bench_median(to, REPS);
    *t_blas = opf_bench_median(tb, REPS);
    return true;
}

/* One row of the table; returns 0 or 1 on failure. */
static int bench_case(opf_ctx *ctx, int64_t M, int64_t N, int64_t K, const gemm_case *c)
{
    float *xv = malloc((size_t)(M * K) * sizeof(float));
    float *wv = malloc((size_t)(N * K) * sizeof(float));
    float *yv = malloc((size_t)(M * N) * sizeof(float));
    opf_tensor x = {0}, w = {0}, y = {0};
    int rc = 1;
    if (!xv || !wv || !yv) goto done;
    fill(xv, (size_t)(M * K), 1u);
    fill(wv, (size_t)(N * K), 2u);
    opf_spec ys = opf_spec_make(2, (int64_t[]){M, N}, c->out_dtype);
    if (make_operand(ctx, M, K, c->x_dtype, c->x_scaling, xv, &x) ||
        make_operand(ctx, N, K, c->x_dtype, c->w_scaling, wv, &w) ||
        opf_tensor_alloc(ctx, &ys, &y)) {
        fprintf(stderr, "bench gemm %s: setup failed: %s\n", c->name, opf_last_error(ctx));
        goto done;
    }
    double t_opf, t_blas;
    if (!time_pair(ctx, &w, &x, &y, M, N, K, xv, wv, yv, &t_opf, &t_blas)) {
        fprintf(stderr, "bench gemm %s: %s\n", c->name, opf_last_error(ctx));
        goto done;
    }
    char shape[48];
    snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
    printf("%-16s %-18s %10.2f %10.2f %8.2f %8.1f\n", shape, c->name, t_opf, t_blas,
           t_opf / t_blas, 2e-6 * (double)M * N * K / t_opf);
    rc = 0;
done:
    opf_tensor_release(&x);
    opf_tensor_release(&w);
    opf_tensor_release(&y);
    free(xv);
    free(wv);
    free(yv);
    return rc;
}

int opf_bench_gemm(int argc, char **argv)
{
    int64_t shapes[][3] = {{256, 1024, 1024}, {1024, 1024, 1024}, {2048, 2048, 2048}};
    int nshapes = 3;
    if (argc >= 3) {
        for (int i = 0; i < 3; i++) shapes[0][i] = atoll(argv[i]);
        nshapes = 1;
        if (shapes[0][0] <= 0 || shapes[0][1] <= 0 || shapes[0][2] <= 0) {
            fprintf(stderr, "bench gemm: M N K must be positive\n");
            return 1;
        }
    }
    opf_ctx_options co = opf_ctx_options_default();
    opf_ctx *ctx;
    if (opf_ctx_create(&co, &ctx)) {
        fprintf(stderr, "bench gemm: %s\n", opf_last_error(NULL));
        return 1;
    }
    printf("opf_gemm (TN, y = x W^T) vs OpenBLAS sgemm on fp32 copies, median of %d runs\n", REPS);
    printf("%-16s %-18s %10s %10s %8s %8s\n", "MxNxK", "operands", "opf ms", "sgemm ms",
           "ratio", "GFLOP/s");
    const gemm_case f32 = {"f32", OPF_SCALING_NONE, OPF_SCALING_NONE, OPF_F32, OPF_F32};
    int rc = 0;
    for (int s = 0; s < nshapes; s++)
        rc |= bench_case(ctx, shapes[s][0], shapes[s][1], shapes[s][2], &f32);
    if (nshapes > 1)
        for (size_t i = 0; i < sizeof quant_cases / sizeof quant_cases[0]; i++)
            rc |= bench_case(ctx, 1024, 1024, 1024, &quant_cases[i]);
    opf_ctx_destroy(ctx);
    return rc;
}
