/* test_cuda_gemm.c: the cuBLASLt GEMM against the CPU GEMM on the same
 * operands (plain, per-tensor FP8, FP8 block 1D x 2D and 1D x 1D, MXFP8)
 * for every layout, output dtype, alpha, accumulate and bias, within
 * tolerances of docs/numerics.md 8; and the errors: out of memory, no CUDA
 * state, operands on two devices, 2D x 2D block operands. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "cuda_test.h"

/* Default shape; block-scaled cases take multiples of 128 (BM, BN, BK). */
enum { M = 96, N = 160, K = 256, BM = 256, BN = 384, BK = 512 };

/* Relative error allowed for a D dtype: fp32 sums in another order, then
 * the rounding of D. Hopper's FP8 tensor cores accumulate with fewer bits
 * than fp32 inside each MMA, with split accumulation too (measured: ~2e-4). */
static double tolerance(opf_dtype d, bool fp8)
{
    double t = d == OPF_BF16 ? 8e-3 : d == OPF_F16 ? 1e-3 : 1e-5;
    return fp8 && t < 1e-3 ? 1e-3 : t;
}

/* The 2D shapes of A and B for a layout (gemm.h). */
static void operand_shapes(opf_gemm_layout l, int64_t m, int64_t n, int64_t k, int64_t a[2],
                           int64_t b[2])
{
    int64_t an[2] = {n, k}, ak[2] = {k, n}, bm[2] = {m, k}, bk[2] = {k, m};
    memcpy(a, l == OPF_GEMM_TN ? an : ak, sizeof an);
    memcpy(b, l == OPF_GEMM_NT ? bk : bm, sizeof bm);
}

typedef struct gemm_case {
    opf_gemm_layout layout;
    opf_dtype       in, out;
    bool            fp8, split, bias, accumulate, fp8_out;
    float           alpha;
    opf_scaling     sa, sb;  /* with fp8: the operands' formats (NONE: per-tensor) */
} gemm_case;

/* Host D as fp32 values (dequantized for an FP8 D). */
static void d_values(opf_ctx *ctx, const opf_tensor *d, float *out)
{
    if (d->spec.scaling == OPF_SCALING_NONE) {
        opf_convert(d->data[OPF_COMP_DATA], d->spec.dtype, out, OPF_F32,
                    (size_t)opf_spec_numel(&d->spec));
        return;
    }
    opf_cpu_dequantize_tensor_fp8(ctx, d, OPF_USAGE_ROWWISE, out);
}

static const char *scaling_str(const gemm_case *c)
{
    if (!c->fp8) return "";
    if (c->sa == OPF_SCALING_MXFP8) return "mxfp8 ";
    if (c->sa == OPF_SCALING_NONE) return "fp8 ";
    return c->sa == OPF_SCALING_BLOCK_2D ? "block 2d x 1d " :
           c->sb == OPF_SCALING_BLOCK_2D ? "block 1d x 2d " : "block 1d x 1d ";
}

static void run_case(opf_ctx *ctx, const gemm_case *c)
{
    bool blk = c->sa == OPF_SCALING_BLOCK_1D || c->sa == OPF_SCALING_BLOCK_2D;
    int64_t m = blk ? BM : M, n = blk ? BN : N, k = blk ? BK : K, as[2], bs[2];
    operand_shapes(c->layout, m, n, k, as, bs);
    float *a = malloc(sizeof(float) * (size_t)(n * k)), *b = malloc(sizeof(float) * (size_t)(m * k));
    float *bias = malloc(sizeof(float) * (size_t)n), *d0 = malloc(sizeof(float) * (size_t)(m * n));
    float *ref = malloc(sizeof(float) * (size_t)(m * n)), *got = malloc(sizeof(float) * (size_t)(m * n));
    /* uniform in [-1, 1): sums stay well inside the f16 range */
    for (int64_t i = 0; i < n * k; i++) a[i] = cuda_test_unit();
    for (int64_t i = 0; i < m * k; i++) b[i] = cuda_test_unit();
    for (int64_t i = 0; i < n; i++) bias[i] = cuda_test_unit();
    for (int64_t i = 0; i < m * n; i++) d0[i] = 100.0f * cuda_test_unit();
    opf_spec sa = opf_spec_make(2, as, c->in), sb = opf_spec_make(2, bs, c->in);
    opf_spec sbias = opf_spec_make(1, (int64_t[]){n}, OPF_BF16);
    opf_spec sd = opf_spec_make(2, (int64_t[]){m, n}, c->out);
    opf_tensor ha, hb, hbias, hd, ga, gb, gbias, gd, back;
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sa, a, &ha));
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sb, b, &hb));
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sbias, bias, &hbias));
    opf_quantizer oq = opf_quantizer_default();
    oq.scaling = OPF_SCALING_TENSOR, oq.qdtype = OPF_E4M3, oq.usage = OPF_USAGE_ROWWISE;
    if (c->fp8_out) CHECK_OK(ctx, opf_quantizer_spec(&oq, &sd, &sd));
    if (c->fp8) {  /* both operands quantized with both copies, on the CPU */
        opf_quantizer q = oq;
        q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
        q.scaling = c->sa ? c->sa : OPF_SCALING_TENSOR;
        opf_tensor qa, qb;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &ha, &qa));
        q.scaling = c->sb ? c->sb : OPF_SCALING_TENSOR;
        q.qdtype = c->split && !c->sb ? OPF_E5M2 : OPF_E4M3;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &hb, &qb));
        opf_tensor_release(&ha);
        opf_tensor_release(&hb);
        ha = qa, hb = qb;
    }
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sd, &hd));
    if (!c->fp8_out) opf_convert(d0, OPF_F32, hd.data[OPF_COMP_DATA], c->out, (size_t)(m * n));
    CHECK_OK(ctx, cuda_test_upload(ctx, &ha, &ga));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hb, &gb));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hbias, &gbias));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hd, &gd));

    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = c->alpha, o.accumulate = c->accumulate, o.beta = 0.25f;
    o.split_accumulator = c->split;
    o.out_quantizer = c->fp8_out ? &oq : NULL;
    o.bias = c->bias ? &hbias : NULL;
    CHECK_OK(ctx, opf_gemm(ctx, &ha, &hb, c->layout, &o, &hd));
    o.bias = c->bias ? &gbias : NULL;
    opf_gemm_args g = {&ga, &gb, c->layout, &o, &gd, m, n, k, {0}};
    CHECK_OK(ctx, opf_cuda_gemm(ctx, &g));
    CHECK_OK(ctx, cuda_test_download(ctx, &gd, &back));
    d_values(ctx, &hd, ref);
    d_values(ctx, &back, got);
    double err = cuda_test_rel_err(got, ref, m * n);
    double tol = tolerance(c->fp8_out ? OPF_E4M3 : c->out, c->fp8);
    if (c->fp8_out) tol = 0.07;  /* one e4m3 step either way where the sums round apart */
    printf("  %s %s%s -> %s%s alpha %g%s%s: rel err %.2e (tol %.0e)\n",
           c->layout == OPF_GEMM_TN ? "TN" : c->layout == OPF_GEMM_NN ? "NN" : "NT",
           scaling_str(c), opf_dtype_name(c->in), c->fp8_out ? "fp8 " : "",
           opf_dtype_name(c->out), (double)c->alpha, c->bias ? " bias" : "",
           c->accumulate ? " accumulate" : "", err, tol);
    CHECK(err <= tol, "gemm case: rel err %.3e > %.1e", err, tol);
    opf_tensor *hs[] = {&ha, &hb, &hbias, &hd, &back}, *gs[] = {&ga, &gb, &gbias, &gd};
    for (int i = 0; i < 5; i++) opf_tensor_release(hs[i]);
    for (int i = 0; i < 4; i++) opf_tensor_release(gs[i]);
    float *bufs[] = {a, b, bias, d0, ref, got};
    for (int i = 0; i < 6; i++) free(bufs[i]);
}

static void test_gemm(opf_ctx *ctx)
{
    static const opf_dtype plain[] = {OPF_F32, OPF_BF16, OPF_F16};
    static const opf_dtype outs[] = {OPF_F32, OPF_BF16, OPF_F16};
    for (int l = 0; l < OPF_GEMM_LAYOUT_COUNT; l++)
        for (int i = 0; i < 3; i++)
            for (int o = 0; o < 3; o++) {
                gemm_case c = {(opf_gemm_layout)l, plain[i], outs[o], false, false,
                               (l + o) % 2 == 0, o == 1, false, o == 2 ? 0.5f : 1.0f, 0, 0};
                run_case(ctx, &c);
            }
    for (int l = 0; l < OPF_GEMM_LAYOUT_COUNT; l++)
        for (int o = 0; o < 3; o++)
            for (int split = 0; split < 2; split++) {
                gemm_case c = {(opf_gemm_layout)l, OPF_BF16, outs[o], true, split == 1,
                               o != 0, o == 1 && !split, false, split ? 0.5f : 1.0f, 0, 0};
                run_case(ctx, &c);
            }
    for (int l = 0; l < OPF_GEMM_LAYOUT_COUNT; l++) {
        gemm_case c = {(opf_gemm_layout)l, OPF_BF16, OPF_BF16, true, false, false, false, true, 1.0f,
                       0, 0};
        run_case(ctx, &c);
    }
}

/* FP8 block scaling through cuBLASLt (1x128 activations x 128x128 weights,
 * the reverse, and 1x128 x 1x128 as in wgrad) and MXFP8 through dequantize
 * + bf16 GEMM, every layout. */
static void test_block_mxfp8(opf_ctx *ctx)
{
    static const opf_scaling pairs[][2] = {
        {OPF_SCALING_BLOCK_2D, OPF_SCALING_BLOCK_1D}, {OPF_SCALING_BLOCK_1D, OPF_SCALING_BLOCK_1D},
        {OPF_SCALING_BLOCK_1D, OPF_SCALING_BLOCK_2D}, {OPF_SCALING_MXFP8, OPF_SCALING_MXFP8},
    };
    static const opf_dtype outs[] = {OPF_BF16, OPF_F32};
    for (int p = 0; p < 4; p++)
        for (int l = 0; l < OPF_GEMM_LAYOUT_COUNT; l++)
            for (int o = 0; o < 2; o++) {
                bool extra = l == 0 && o == 0;  /* bias and accumulate once per pair */
                gemm_case c = {(opf_gemm_layout)l, OPF_BF16, outs[o], true, true, extra, extra,
                               false, o ? 0.5f : 1.0f, pairs[p][0], pairs[p][1]};
                run_case(ctx, &c);
            }
}

/* 2D x 2D block operands: refused with the reason. */
static void test_block_2d_2d(opf_ctx *ctx)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){128, 128}, OPF_BF16);
    float x[128 * 128];
    cuda_test_fill(x, 128 * 128, 1.0f, 0, false);
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_BLOCK_2D, q.qdtype = OPF_E4M3;
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    opf_tensor h, hq, g, d;
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &s, x, &h));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &h, &hq));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hq, &g));
    CHECK_OK(ctx, cuda_test_alloc(ctx, &s, &d));
    opf_gemm_options o = opf_gemm_options_default();
    opf_gemm_args a = {&g, &g, OPF_GEMM_TN, &o, &d, 128, 128, 128, {0}};
    CHECK_FAILS(ctx, opf_cuda_gemm(ctx, &a), OPF_ERR_UNSUPPORTED, "2D x 2D", "1D");
    opf_tensor_release(&h);
    opf_tensor_release(&hq);
    opf_tensor_release(&g);
    opf_tensor_release(&d);
}

static void test_errors(opf_ctx *ctx)
{
    void *p = NULL;
    CHECK_FAILS(ctx, opf_cuda_alloc(ctx, (size_t)1 << 50, &p), OPF_ERR_NO_MEMORY, "opf_cuda_alloc",
                "1125899906842624 bytes asked", "free");
    opf_alloc_stats st;
    opf_cuda_alloc_stats(ctx, &st);
    CHECK(st.bytes_live == 0, "live bytes %zu after the tests", st.bytes_live);
    CHECK(st.bytes_peak > 0 && st.n_alloc == st.n_free, "peak %zu, %llu allocs, %llu frees",
          st.bytes_peak, (unsigned long long)st.n_alloc, (unsigned long long)st.n_free);
    /* A freed block is reused for the next allocation of its size class. */
    void *q1 = NULL, *q2 = NULL;
    CHECK_OK(ctx, opf_cuda_alloc(ctx, 3000, &q1));
    opf_cuda_free(ctx, q1);
    CHECK_OK(ctx, opf_cuda_alloc(ctx, 2900, &q2));
    CHECK(q1 == q2, "the cached block was not reused");
    opf_cuda_free(ctx, q2);

    opf_ctx *bare = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &bare));
    CHECK_FAILS(bare, opf_cuda_alloc(bare, 16, &p), OPF_ERR_STATE, "no CUDA state");
    opf_ctx_destroy(bare);

    /* Operands on two devices: the quant layer names both. */
    opf_spec s = opf_spec_make(2, (int64_t[]){32, 32}, OPF_BF16);
    float x[32 * 32] = {0};
    opf_tensor h, g, d;
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &s, x, &h));
    CHECK_OK(ctx, cuda_test_upload(ctx, &h, &g));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &d));
    CHECK_FAILS(ctx, opf_gemm(ctx, &g, &h, OPF_GEMM_TN, NULL, &d), OPF_ERR_INVALID_ARG,
                "A is on cuda, B on cpu");
    opf_tensor_release(&h);
    opf_tensor_release(&d);
    opf_tensor_release(&g);
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_gemm(ctx);
    test_block_mxfp8(ctx);
    test_block_2d_2d(ctx);
    test_errors(ctx);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
