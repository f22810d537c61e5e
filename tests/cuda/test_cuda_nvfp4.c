/* test_cuda_nvfp4.c: NVFP4 on the GPU against the CPU reference, byte for
 * byte (docs/numerics.md 3.4): 1x16 blocks and 16x16 tiles, every usage and
 * input dtype, round to nearest even and stochastic rounding, with and
 * without the Hadamard transform, compact and swizzled scales, on random
 * data with edge values and on shapes that cut the kernel's 64x64 tiles;
 * stochastic rounding repeatable for one seed and offset; the amax
 * reduction hook; the refused 2D + RHT case; and the NVFP4 GEMM (decoded
 * to bf16) against the CPU GEMM in every layout. Every failing case is
 * printed with its first differing byte per component. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "core/codec-impl.h"
#include "cuda_test.h"

static const opf_dtype in_dtypes[] = {OPF_F32, OPF_BF16, OPF_F16};
static const unsigned usages[] = {OPF_USAGE_ROWWISE, OPF_USAGE_COLUMNWISE,
                                  OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE};
enum { BOTH = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE };

static opf_quantizer fp4_quantizer(bool two_d, bool rht, bool sr, bool swz, unsigned usage)
{
    opf_quantizer q = opf_quantizer_default();
    q.scaling = two_d ? OPF_SCALING_NVFP4_2D : OPF_SCALING_NVFP4_1D;
    q.qdtype = OPF_E2M1;
    q.usage = usage;
    q.rht = rht;
    q.stochastic = sr;
    q.swizzled = swz;
    return q;
}

typedef struct mode { const char *name; bool two_d, rht, sr; } mode;
static const mode modes[] = {
    {"1d", false, false, false},     {"1d rht", false, true, false},
    {"1d sr", false, false, true},   {"1d rht sr", false, true, true},
    {"2d", true, false, false},      {"2d sr", true, false, true},
};
enum { N_MODES = sizeof modes / sizeof modes[0] };

static int failures;

static void one_case(opf_ctx *ctx, const opf_quantizer *q, const opf_spec *sp, const float *x,
                     const char *tag)
{
    char what[224], ss[96];
    opf_spec_str(sp, ss, sizeof ss);
    snprintf(what, sizeof what, "%s %s usage %u%s%s", tag, ss, q->usage,
             q->swizzled ? " swizzled" : "", q->rht ? " rht" : "");
    if (!cuda_test_check_quantize(ctx, q, q, sp, x, what)) failures++;
}

/* Every mode x usage x dtype x shape on data with edge values (inf and NaN
 * every other case); scales alternate compact / swizzled. RHT only where
 * the columnwise copy is not 2D. */
static void test_sweep(opf_ctx *ctx)
{
    static const struct { int nd; int64_t s[3]; } sh[] = {
        {2, {16, 16}},  {2, {48, 80}},   {2, {64, 64}},    {2, {80, 144}}, {3, {2, 64, 96}},
        {2, {16, 2000}}, {2, {400, 16}}, {2, {272, 1040}}, {2, {512, 1024}},
    };
    int count = 0;
    for (int mi = 0; mi < N_MODES; mi++)
        for (size_t si = 0; si < sizeof sh / sizeof sh[0]; si++)
            for (int di = 0; di < 3; di++)
                for (int ui = 0; ui < 3; ui++, count++) {
                    opf_spec sp = opf_spec_make(sh[si].nd, sh[si].s, in_dtypes[di]);
                    int64_t n = opf_spec_numel(&sp);
                    float *x = malloc((size_t)n * sizeof *x);
                    cuda_test_fill(x, n, 1.0f, 7, count % 2 == 0);
                    opf_quantizer q = fp4_quantizer(modes[mi].two_d, modes[mi].rht, modes[mi].sr,
                                                    count % 3 == 1, usages[ui]);
                    one_case(ctx, &q, &sp, x, modes[mi].name);
                    free(x);
                }
    printf("  sweep: %d cases\n", count);
}

/* Whole tensors at the edges: zeros (amax 0), -0, tiny (subnormal block
 * scales and codes), huge (S_enc far below 1), all inf, all NaN, one inf
 * among tiny values; and a sign mask other than the default. */
static void test_edges(opf_ctx *ctx)
{
    static const float fill[] = {0.0f, -0.0f, 1e-40f, 1e-30f, 3e38f, INFINITY, NAN};
    enum { R = 80, C = 96 };
    static float x[R * C];
    for (size_t fi = 0; fi < sizeof fill / sizeof fill[0] + 2; fi++)
        for (int mi = 0; mi < N_MODES; mi++) {
            for (int i = 0; i < R * C; i++)
                x[i] = fi < sizeof fill / sizeof fill[0] ? fill[fi] * (i % 3 ? 1.0f : -1.0f)
                                                          : 1e-6f * cuda_test_unit();
            if (fi == sizeof fill / sizeof fill[0] + 1) x[R * C / 2 + 7] = INFINITY;
            for (int di = 0; di < 3; di++) {
                opf_spec sp = opf_spec_make(2, (int64_t[]){R, C}, in_dtypes[di]);
                opf_quantizer q = fp4_quantizer(modes[mi].two_d, modes[mi].rht, modes[mi].sr,
                                                fi % 2 == 0, BOTH);
                if (fi == 2) q.rht_sign_mask = 0x1234;
                char tag[64];
                snprintf(tag, sizeof tag, "edge %zu %s", fi, modes[mi].name);
                one_case(ctx, &q, &sp, x, tag);
            }
        }
}

/* Stochastic rounding: counters whose low word wraps (offset near 2^32),
 * and the GPU twice at one seed and offset gives the same bytes, another
 * offset other bytes. */
static void test_sr_repeat(opf_ctx *ctx)
{
    enum { R = 128, C = 256 };
    static float x[R * C];
    cuda_test_fill(x, R * C, 1.0f, 0, false);
    opf_spec sp = opf_spec_make(2, (int64_t[]){R, C}, OPF_BF16);
    opf_quantizer q = fp4_quantizer(false, true, true, false, BOTH);
    opf_ctx_set_rng(ctx, 0x0123456789ABCDEFull, 0xFFFFFFF0ull);
    one_case(ctx, &q, &sp, x, "sr offset wrap");
    opf_tensor hin, din, out[3], host[3];
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sp, x, &hin));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hin, &din));
    opf_spec qs;
    CHECK_OK(ctx, opf_quantizer_spec(&q, &sp, &qs));
    for (int i = 0; i < 3; i++) {
        opf_quantize_state st = {.rng_seed = 42, .rng_offset = i == 2 ? 1000 : 7};
        CHECK_OK(ctx, cuda_test_alloc(ctx, &qs, &out[i]));
        CHECK_OK(ctx, cuda_test_table(OPF_DEVICE_CUDA)->quantize[q.scaling](ctx, &q, &din, &out[i], &st));
        CHECK_OK(ctx, cuda_test_download(ctx, &out[i], &host[i]));
    }
    CHECK(opf_test_same_bytes(&host[0], &host[1]), "SR: one seed and offset gave two results");
    CHECK(!opf_test_same_bytes(&host[0], &host[2]), "SR: offsets 7 and 1000 gave the same bytes");
    for (int i = 0; i < 3; i++) opf_tensor_release(&out[i]), opf_tensor_release(&host[i]);
    opf_tensor_release(&hin);
    opf_tensor_release(&din);
}

static opf_status reduce_to_at_least_100(void *user, float *amax, int n)
{
    (void)user;
    for (int i = 0; i < n; i++)
        if (amax[i] < 100.0f) amax[i] = 100.0f + (float)i;
    return OPF_OK;
}

/* The amax reduction hook sees {A_row} or {A_row, A_col} on both devices;
 * 2D tiles with a rotated columnwise copy are refused. */
static void test_reduce_and_errors(opf_ctx *ctx)
{
    enum { R = 96, C = 160 };
    static float x[R * C];
    cuda_test_fill(x, R * C, 0.01f, 0, false);
    opf_spec sp = opf_spec_make(2, (int64_t[]){R, C}, OPF_BF16);
    for (int rht = 0; rht < 2; rht++) {
        opf_quantizer q = fp4_quantizer(false, rht, false, false, BOTH);
        q.amax_reduce = reduce_to_at_least_100;
        one_case(ctx, &q, &sp, x, "amax reduction");
    }
    opf_quantizer q = fp4_quantizer(true, false, false, false, BOTH);
    opf_tensor hin, din, dq;
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sp, x, &hin));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hin, &din));
    opf_spec qs;
    CHECK_OK(ctx, opf_quantizer_spec(&q, &sp, &qs));
    CHECK_OK(ctx, cuda_test_alloc(ctx, &qs, &dq));
    q.rht = true;
    opf_quantize_state st = {0};
    CHECK_FAILS(ctx, cuda_test_table(OPF_DEVICE_CUDA)->quantize[q.scaling](ctx, &q, &din, &dq, &st),
                OPF_ERR_UNSUPPORTED, "Hadamard", "2D");
    opf_tensor_release(&hin);
    opf_tensor_release(&din);
    opf_tensor_release(&dq);
}

/* ---- GEMM ---------------------------------------------------------------- */

/* The GEMM's bf16 decode of a copy (fp4 * its block scale, in the stored
 * layout) against the host's decode of the same bytes: every code under
 * random scale bytes, a NaN scale among them (compared as NaN), each copy,
 * compact and swizzled scales. */
static void test_decode_bf16(opf_ctx *ctx)
{
    enum { R = 64, C = 160 };
    static float x[R * C], want[R * C], got[R * C];
    cuda_test_fill(x, R * C, 1.0f, 0, false);
    for (int swz = 0; swz < 2; swz++) {
        opf_spec sp = opf_spec_make(2, (int64_t[]){R, C}, OPF_BF16);
        opf_quantizer q = fp4_quantizer(false, false, false, swz, BOTH);
        opf_tensor hx, hq, dq, dout, back;
        CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sp, x, &hx));
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &hx, &hq));
        opf_layout L;
        CHECK_OK(ctx, opf_spec_layout(&hq.spec, &L));
        for (int col = 0; col < 2; col++) {  /* random bytes in both copies */
            opf_component dc = col ? OPF_COMP_COL_DATA : OPF_COMP_DATA;
            opf_component sc = col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV;
            uint8_t *d = hq.data[dc], *sf = hq.data[sc];
            for (size_t i = 0; i < L.comp[dc].nbytes; i++) d[i] = (uint8_t)cuda_test_u32();
            for (size_t i = 0; i < L.comp[sc].nbytes; i++) sf[i] = (uint8_t)cuda_test_u32();
            sf[col ? 5 : 3] = 0x7F;  /* NaN; a swizzled layout moves it, still in use */
        }
        CHECK_OK(ctx, cuda_test_upload(ctx, &hq, &dq));
        for (int col = 0; col < 2; col++) {
            opf_component dc = col ? OPF_COMP_COL_DATA : OPF_COMP_DATA;
            opf_component sc = col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV;
            int64_t rows = L.comp[dc].rows, cols = L.comp[dc].cols, ld = L.comp[sc].cols;
            const uint8_t *d = hq.data[dc], *sf = hq.data[sc];
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++) {
                    int64_t j = c / 16;
                    int64_t si = swz ? (int64_t)opf_swizzle_index(r, j, ld) : r * ld + j;
                    uint8_t code = (uint8_t)(d[(r * cols + c) / 2] >> (4 * (c % 2)) & 0xF);
                    want[r * cols + c] = opf_e2m1_to_f32_impl(code) * opf_e4m3_to_f32_impl(sf[si]);
                }
            opf_spec so = opf_spec_make(2, (int64_t[]){rows, cols}, OPF_BF16);
            CHECK_OK(ctx, cuda_test_alloc(ctx, &so, &dout));
            CHECK_OK(ctx, opf_cuda_dequantize_nvfp4_bf16(ctx, &dq, col ? OPF_USAGE_COLUMNWISE
                                                                      : OPF_USAGE_ROWWISE,
                                                         dout.data[OPF_COMP_DATA]));
            CHECK_OK(ctx, cuda_test_download(ctx, &dout, &back));
            opf_convert(back.data[OPF_COMP_DATA], OPF_BF16, got, OPF_F32, (size_t)(rows * cols));
            /* want in bf16 and back: the product is exact in bf16, so the
             * round trip changes no finite value */
            static uint16_t wb16[R * C];
            static float wb[R * C];
            opf_convert(want, OPF_F32, wb16, OPF_BF16, (size_t)(rows * cols));
            opf_convert(wb16, OPF_BF16, wb, OPF_F32, (size_t)(rows * cols));
            int64_t bad = 0, nan = 0;
            for (int64_t i = 0; i < rows * cols; i++) {
                nan += isnan(want[i]);
                bool ok = isnan(want[i]) ? isnan(got[i])
                                         : !memcmp(&wb[i], &got[i], 4) &&
                                               !memcmp(&wb[i], &want[i], 4);
                if (!ok && bad++ < 3)
                    printf("  decode %s%s [%lld]: want %a got %a\n", col ? "col" : "row",
                           swz ? " swizzled" : "", (long long)i, (double)want[i], (double)got[i]);
            }
            printf("  decode bf16 %s%s: %lld values (%lld under the NaN scale), %lld differ\n",
                   col ? "columnwise" : "rowwise", swz ? " swizzled" : "", (long long)(rows * cols),
                   (long long)nan, (long long)bad);
            CHECK(bad == 0 && nan > 0, "nvfp4 bf16 decode: %lld differ, %lld NaN", (long long)bad,
                  (long long)nan);
            opf_tensor_release(&dout), opf_tensor_release(&back);
        }
        opf_tensor *ts[] = {&hx, &hq, &dq};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) opf_tensor_release(ts[i]);
    }
}

typedef struct gemm_case {
    opf_gemm_layout layout;
    opf_dtype       out;
    bool            a_2d, rht, bias, accumulate;
    float           alpha;
} gemm_case;

/* Both operands quantized on the CPU (both copies), the same bytes on the
 * GPU; D within the tolerance of docs/numerics.md 8 (the decoded operands
 * are exact: only the order of the fp32 sums and D's rounding differ). */
static void gemm_case_run(opf_ctx *ctx, const gemm_case *c)
{
    enum { M = 96, N = 160, K = 256 };
    int64_t as[2] = {N, K}, bs[2] = {M, K};
    if (c->layout != OPF_GEMM_TN) as[0] = K, as[1] = N;
    if (c->layout == OPF_GEMM_NT) bs[0] = K, bs[1] = M;
    static float a[N * K], b[M * K], bias[N], d0[M * N], ref[M * N], got[M * N];
    for (int i = 0; i < N * K; i++) a[i] = cuda_test_unit();
    for (int i = 0; i < M * K; i++) b[i] = cuda_test_unit();
    for (int i = 0; i < N; i++) bias[i] = cuda_test_unit();
    for (int i = 0; i < M * N; i++) d0[i] = 10.0f * cuda_test_unit();
    opf_spec sa = opf_spec_make(2, as, OPF_BF16), sb = opf_spec_make(2, bs, OPF_BF16);
    opf_spec sbias = opf_spec_make(1, (int64_t[]){N}, OPF_BF16);
    opf_spec sd = opf_spec_make(2, (int64_t[]){M, N}, c->out);
    opf_tensor ha, hb, qa, qb, hbias, hd, ga, gb, gbias, gd, back;
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sa, a, &ha));
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sb, b, &hb));
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sbias, bias, &hbias));
    opf_quantizer q = fp4_quantizer(c->a_2d, false, false, false, BOTH);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &ha, &qa));
    q = fp4_quantizer(false, c->rht, false, true, BOTH);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &hb, &qb));
    if (c->rht) {  /* NT reads both columnwise copies: both rotated */
        opf_tensor_release(&qa);
        q = fp4_quantizer(false, true, false, false, BOTH);
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &ha, &qa));
    }
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sd, &hd));
    opf_convert(d0, OPF_F32, hd.data[OPF_COMP_DATA], c->out, (size_t)(M * N));
    CHECK_OK(ctx, cuda_test_upload(ctx, &qa, &ga));
    CHECK_OK(ctx, cuda_test_upload(ctx, &qb, &gb));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hbias, &gbias));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hd, &gd));
    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = c->alpha, o.accumulate = c->accumulate, o.beta = 0.5f;
    o.bias = c->bias ? &hbias : NULL;
    CHECK_OK(ctx, opf_gemm(ctx, &qa, &qb, c->layout, &o, &hd));
    o.bias = c->bias ? &gbias : NULL;
    opf_gemm_args g = {&ga, &gb, c->layout, &o, &gd, M, N, K, {0}};
    CHECK_OK(ctx, opf_cuda_gemm(ctx, &g));
    CHECK_OK(ctx, cuda_test_download(ctx, &gd, &back));
    opf_convert(hd.data[OPF_COMP_DATA], c->out, ref, OPF_F32, (size_t)(M * N));
    opf_convert(back.data[OPF_COMP_DATA], c->out, got, OPF_F32, (size_t)(M * N));
    double err = cuda_test_rel_err(got, ref, M * N), tol = c->out == OPF_BF16 ? 8e-3 : 1e-5;
    printf("  gemm %s nvfp4%s%s -> %s alpha %g%s%s: rel err %.2e (tol %.0e)\n",
           c->layout == OPF_GEMM_TN ? "TN" : c->layout == OPF_GEMM_NN ? "NN" : "NT",
           c->a_2d ? " (A 2d)" : "", c->rht ? " rht" : "", opf_dtype_name(c->out),
           (double)c->alpha, c->bias ? " bias" : "", c->accumulate ? " accumulate" : "", err, tol);
    CHECK(err <= tol, "nvfp4 gemm: rel err %.3e > %.1e", err, tol);
    opf_tensor *ts[] = {&ha, &hb, &qa, &qb, &hbias, &hd, &ga, &gb, &gbias, &gd, &back};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) opf_tensor_release(ts[i]);
}

static void test_gemm(opf_ctx *ctx)
{
    static const gemm_case cases[] = {
        {OPF_GEMM_TN, OPF_BF16, false, false, false, false, 1.0f},
        {OPF_GEMM_TN, OPF_F32, true, false, true, false, 0.5f},
        {OPF_GEMM_TN, OPF_F32, false, false, false, true, 1.0f},
        {OPF_GEMM_NN, OPF_BF16, true, false, false, false, 1.0f},
        {OPF_GEMM_NN, OPF_F32, false, false, false, true, 2.0f},
        {OPF_GEMM_NT, OPF_F32, false, true, false, false, 1.0f},
        {OPF_GEMM_NT, OPF_BF16, false, true, false, true, 1.0f},
        {OPF_GEMM_NT, OPF_F32, false, false, false, false, 1.0f},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) gemm_case_run(ctx, &cases[i]);
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_sweep(ctx);
    test_edges(ctx);
    test_sr_repeat(ctx);
    test_reduce_and_errors(ctx);
    printf("  %d quantize cases differ from the CPU\n", failures);
    test_decode_bf16(ctx);
    test_gemm(ctx);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
