/* test_cuda_grouped_gemm.c: GroupedLinear's grouped GEMM on the GPU
 * (opf_cuda_grouped_gemm) against the CPU's (opf_cpu_grouped_gemm) on the
 * same groups: sizes that differ, empty groups (no rows; bf16), bf16 and FP8
 * per-tensor operands, each layout GroupedLinear uses (TN forward, NN
 * dgrad, NT wgrad), with and without bias, within numerics.md 8's GEMM
 * tolerances. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "cuda_test.h"

enum { G = 6, N = 96, K = 160 };

/* Rows per group: empty ones, sizes that are not multiples of anything. */
static const int64_t group_m[G] = {37, 0, 128, 5, 0, 211};

typedef struct group {
    opf_tensor ha, hb, hd, ga, gb, gd, hbias, gbias;
    opf_gemm_options o, go;
    int64_t m, n, k;
} group;

/* The 2D shapes of A and B for a layout (gemm.h). */
static void operand_shapes(opf_gemm_layout l, int64_t m, int64_t n, int64_t k, int64_t a[2],
                           int64_t b[2])
{
    int64_t an[2] = {n, k}, ak[2] = {k, n}, bm[2] = {m, k}, bk[2] = {k, m};
    memcpy(a, l == OPF_GEMM_TN ? an : ak, sizeof an);
    memcpy(b, l == OPF_GEMM_NT ? bk : bm, sizeof bm);
}

/* A host tensor of random values in [-1, 1), quantized per tensor to E4M3
 * (both copies) when fp8; and its device copy. */
static void operand(opf_ctx *ctx, int ndim, const int64_t *shape, bool fp8, opf_tensor *h,
                    opf_tensor *g)
{
    int64_t n = ndim == 1 ? shape[0] : shape[0] * shape[1];
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = cuda_test_unit();
    opf_spec s = opf_spec_make(ndim, shape, OPF_BF16);
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &s, x, h));
    if (fp8) {
        opf_quantizer q = opf_quantizer_default();
        q.scaling = OPF_SCALING_TENSOR, q.qdtype = OPF_E4M3;
        q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
        opf_tensor qh;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, h, &qh));
        opf_tensor_release(h);
        *h = qh;
    }
    CHECK_OK(ctx, cuda_test_upload(ctx, h, g));
    free(x);
}

static void run_case(opf_ctx *ctx, opf_gemm_layout layout, bool fp8, bool bias, opf_dtype out)
{
    group gr[G];
    opf_gemm_args cpu[G], gpu[G];
    /* wgrad (NT) reduces over the group's rows: k = rows, D [N, K] per group;
     * its empty groups are left to the op (which fills them), so wgrad takes
     * the non-empty ones; so does FP8 (the op quantizes no empty group) */
    int count = 0;
    for (int i = 0; i < G; i++) {
        group *g = &gr[count];
        bool wgrad = layout == OPF_GEMM_NT;
        if ((wgrad || fp8) && group_m[i] == 0) continue;
        g->m = wgrad ? N : group_m[i], g->n = wgrad ? K : N, g->k = wgrad ? group_m[i] : K;
        if (layout == OPF_GEMM_NN) g->n = K, g->k = N;
        int64_t as[2], bs[2];
        operand_shapes(layout, g->m, g->n, g->k, as, bs);
        operand(ctx, 2, as, fp8, &g->ha, &g->ga);
        operand(ctx, 2, bs, fp8, &g->hb, &g->gb);
        operand(ctx, 1, &g->n, false, &g->hbias, &g->gbias);
        opf_spec sd = opf_spec_make(2, (int64_t[]){g->m, g->n}, out);
        CHECK_OK(ctx, opf_tensor_alloc(ctx, &sd, &g->hd));
        CHECK_OK(ctx, cuda_test_alloc(ctx, &sd, &g->gd));
        g->o = opf_gemm_options_default();
        g->o.bias = bias && count % 2 == 0 ? &g->hbias : NULL;
        g->go = g->o;
        g->go.bias = g->o.bias ? &g->gbias : NULL;
        cpu[count] = (opf_gemm_args){&g->ha, &g->hb, layout, &g->o, &g->hd, g->m, g->n, g->k, {0}};
        gpu[count] = (opf_gemm_args){&g->ga, &g->gb, layout, &g->go, &g->gd, g->m, g->n, g->k, {0}};
        count++;
    }
    CHECK_OK(ctx, opf_cpu_grouped_gemm(ctx, count, cpu));
    CHECK_OK(ctx, opf_cuda_grouped_gemm(ctx, count, gpu));
    double tol = out == OPF_BF16 ? 8e-3 : fp8 ? 1e-3 : 1e-5, worst = 0.0;
    for (int i = 0; i < count; i++) {
        group *g = &gr[i];
        int64_t n = g->m * g->n;
        opf_tensor back;
        CHECK_OK(ctx, cuda_test_download(ctx, &g->gd, &back));
        size_t bytes = sizeof(float) * (size_t)(n ? n : 1);
        float *ref = malloc(bytes), *got = malloc(bytes);
        opf_convert(g->hd.data[OPF_COMP_DATA], out, ref, OPF_F32, (size_t)n);
        opf_convert(back.data[OPF_COMP_DATA], out, got, OPF_F32, (size_t)n);
        double err = n ? cuda_test_rel_err(got, ref, n) : 0.0;
        worst = err > worst ? err : worst;
        CHECK(err <= tol, "group %d (%lld x %lld x %lld): rel err %.3e > %.1e", i, (long long)g->m,
              (long long)g->n, (long long)g->k, err, tol);
        free(ref), free(got);
        opf_tensor *ts[] = {&back,  &g->ha, &g->hb, &g->hd,   &g->ga,
                            &g->gb, &g->gd, &g->hbias, &g->gbias};
        for (int t = 0; t < 9; t++) opf_tensor_release(ts[t]);
    }
    printf("  %s %s -> %s%s, %d groups: worst rel err %.2e (tol %.0e)\n",
           layout == OPF_GEMM_TN ? "TN" : layout == OPF_GEMM_NN ? "NN" : "NT",
           fp8 ? "fp8 e4m3" : "bf16", opf_dtype_name(out), bias ? " bias" : "", count, worst, tol);
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    for (int l = 0; l < OPF_GEMM_LAYOUT_COUNT; l++)
        for (int fp8 = 0; fp8 < 2; fp8++) {
            run_case(ctx, (opf_gemm_layout)l, fp8, l == 0, OPF_BF16);
            run_case(ctx, (opf_gemm_layout)l, fp8, false, OPF_F32);
        }
    CHECK_OK(ctx, opf_cuda_grouped_gemm(ctx, 0, NULL));  /* no groups: nothing to do */
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
