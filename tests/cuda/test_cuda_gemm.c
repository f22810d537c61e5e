/* test_cuda_gemm.c: the cuBLASLt GEMM against the CPU GEMM on the same
 * operands (plain, per-tensor FP8) for every layout, output dtype, alpha,
 * accumulate and bias, within tolerances of docs/numerics.md 8; and the
 * runtime's errors: out of memory, no CUDA state, operands on two devices. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "cuda_test.h"

enum { M = 96, N = 160, K = 256 };

/* Relative error allowed for a D dtype: fp32 sums in another order, then
 * the rounding of D. Hopper's FP8 tensor cores accumulate with fewer bits
 * than fp32 inside each MMA, with split accumulation too (measured: ~2e-4). */
static double tolerance(opf_dtype d, bool fp8)
{
    double t = d == OPF_BF16 ? 8e-3 : d == OPF_F16 ? 1e-3 : 1e-5;
    return fp8 && t < 1e-3 ? 1e-3 : t;
}

/* The 2D shapes of A and B for a layout (gemm.h). */
static void operand_shapes(opf_gemm_layout l, int64_t a[2], int64_t b[2])
{
    int64_t an[2] = {N, K}, ak[2] = {K, N}, bm[2] = {M, K}, bk[2] = {K, M};
    memcpy(a, l == OPF_GEMM_TN ? an : ak, sizeof an);
    memcpy(b, l == OPF_GEMM_NT ? bk : bm, sizeof bm);
}

typedef struct gemm_case {
    opf_gemm_layout layout;
    opf_dtype       in, out;
    bool            fp8, split, bias, accumulate, fp8_out;
    float           alpha;
} gemm_case;

/* Host D as fp32 values (dequantized for an FP8 D). */
static void d_values(opf_ctx *ctx, const opf_tensor *d, float *out)
{
    if (d->spec.scaling == OPF_SCALING_NONE) {
        opf_convert(d->data[OPF_COMP_DATA], d->spec.dtype, out, OPF_F32, M * N);
        return;
    }
    opf_cpu_dequantize_tensor_fp8(ctx, d, OPF_USAGE_ROWWISE, out);
}

static void run_case(opf_ctx *ctx, const gemm_case *c)
{
    int64_t as[2], bs[2];
    operand_shapes(c->layout, as, bs);
    float a[N * K], b[M * K], bias[N], d0[M * N], ref[M * N], got[M * N];
    /* uniform in [-1, 1): sums stay well inside the f16 range */
    for (int i = 0; i < N * K; i++) a[i] = cuda_test_unit();
    for (int i = 0; i < M * K; i++) b[i] = cuda_test_unit();
    for (int i = 0; i < N; i++) bias[i] = cuda_test_unit();
    for (int i = 0; i < M * N; i++) d0[i] = 100.0f * cuda_test_unit();
    opf_spec sa = opf_spec_make(2, as, c->in), sb = opf_spec_make(2, bs, c->in);
    opf_spec sbias = opf_spec_make(1, (int64_t[]){N}, OPF_BF16);
    opf_spec sd = opf_spec_make(2, (int64_t[]){M, N}, c->out);
    opf_tensor ha, hb, hbias, hd, ga, gb, gbias, gd, back;
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sa, a, &ha));
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sb, b, &hb));
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sbias, bias, &hbias));
    opf_quantizer oq = opf_quantizer_default();
    oq.scaling = OPF_SCALING_TENSOR, oq.qdtype = OPF_E4M3, oq.usage = OPF_USAGE_ROWWISE;
    if (c->fp8_out) CHECK_OK(ctx, opf_quantizer_spec(&oq, &sd, &sd));
    if (c->fp8) {  /* both operands as per-tensor FP8 with both copies, on the CPU */
        opf_quantizer q = oq;
        q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
        opf_tensor qa, qb;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &ha, &qa));
        q.qdtype = c->split ? OPF_E5M2 : OPF_E4M3;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &hb, &qb));
        opf_tensor_release(&ha);
        opf_tensor_release(&hb);
        ha = qa, hb = qb;
    }
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sd, &hd));
    if (!c->fp8_out) opf_convert(d0, OPF_F32, hd.data[OPF_COMP_DATA], c->out, M * N);
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
    opf_gemm_args g = {&ga, &gb, c->layout, &o, &gd, M, N, K};
    CHECK_OK(ctx, opf_cuda_gemm(ctx, &g));
    CHECK_OK(ctx, cuda_test_download(ctx, &gd, &back));
    d_values(ctx, &hd, ref);
    d_values(ctx, &back, got);
    double err = cuda_test_rel_err(got, ref, M * N);
    double tol = tolerance(c->fp8_out ? OPF_E4M3 : c->out, c->fp8);
    if (c->fp8_out) tol = 0.07;  /* one e4m3 step either way where the sums round apart */
    printf("  %s %s%s -> %s%s alpha %g%s%s: rel err %.2e (tol %.0e)\n",
           c->layout == OPF_GEMM_TN ? "TN" : c->layout == OPF_GEMM_NN ? "NN" : "NT",
           c->fp8 ? "fp8 " : "", opf_dtype_name(c->in), c->fp8_out ? "fp8 " : "",
           opf_dtype_name(c->out), (double)c->alpha, c->bias ? " bias" : "",
           c->accumulate ? " accumulate" : "", err, tol);
    CHECK(err <= tol, "gemm case: rel err %.3e > %.1e", err, tol);
    opf_tensor *hs[] = {&ha, &hb, &hbias, &hd, &back}, *gs[] = {&ga, &gb, &gbias, &gd};
    for (int i = 0; i < 5; i++) opf_tensor_release(hs[i]);
    for (int i = 0; i < 4; i++) opf_cuda_tensor_free(ctx, gs[i]);
}

static void test_gemm(opf_ctx *ctx)
{
    static const opf_dtype plain[] = {OPF_F32, OPF_BF16, OPF_F16};
    static const opf_dtype outs[] = {OPF_F32, OPF_BF16, OPF_F16};
    for (int l = 0; l < OPF_GEMM_LAYOUT_COUNT; l++)
        for (int i = 0; i < 3; i++)
            for (int o = 0; o < 3; o++) {
                gemm_case c = {(opf_gemm_layout)l, plain[i], outs[o], false, false,
                               (l + o) % 2 == 0, o == 1, false, o == 2 ? 0.5f : 1.0f};
                run_case(ctx, &c);
            }
    for (int l = 0; l < OPF_GEMM_LAYOUT_COUNT; l++)
        for (int o = 0; o < 3; o++)
            for (int split = 0; split < 2; split++) {
                gemm_case c = {(opf_gemm_layout)l, OPF_BF16, outs[o], true, split == 1,
                               o != 0, o == 1 && !split, false, split ? 0.5f : 1.0f};
                run_case(ctx, &c);
            }
    for (int l = 0; l < OPF_GEMM_LAYOUT_COUNT; l++) {
        gemm_case c = {(opf_gemm_layout)l, OPF_BF16, OPF_BF16, true, false, false, false, true, 1.0f};
        run_case(ctx, &c);
    }
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
                "A is on device 1, B on device 0");
    opf_tensor_release(&h);
    opf_tensor_release(&d);
    opf_cuda_tensor_free(ctx, &g);
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_gemm(ctx);
    test_errors(ctx);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
