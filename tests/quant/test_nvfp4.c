/* test_nvfp4.c: NVFP4 quantizer properties (docs/numerics.md 3.4): round-trip
 * error within the E2M1 tolerances, the Hadamard transform, 2D copies,
 * swizzled scales, thread-count independence, stochastic-rounding
 * determinism, the amax reduction hook, and the kernel's error paths. The
 * bit-exact comparison with an independent model is tests/oracle/test_quant_nvfp4.py. */
#include <float.h>

#include "backend/backend-impl.h"
#include "test.h"

static const uint16_t kMask = 0xD7E8;

/* 1 where T[r][c] = s_r * H16[r][c] / 4 is negative: popcount(r & c) plus
 * the sign bit r, mod 2. */
static int t_negative(int r, int c)
{
    int p = (kMask >> r) & 1;
    for (int b = r & c; b; b >>= 1) p ^= b & 1;
    return p;
}

static opf_quantizer nvfp4_q(bool two_d, bool rht, bool sr, unsigned usage)
{
    opf_quantizer q = opf_quantizer_default();
    q.scaling = two_d ? OPF_SCALING_NVFP4_2D : OPF_SCALING_NVFP4_1D;
    q.qdtype = OPF_E2M1;
    q.usage = usage;
    q.rht = rht;
    q.rht_sign_mask = kMask;
    q.stochastic = sr;
    return q;
}

static const unsigned kBoth = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;

/* A plain f32 [m, k] tensor of N(0, sigma) values. */
static opf_tensor make_input(opf_ctx *ctx, int64_t m, int64_t k, float sigma,
                             unsigned long long seed)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){m, k}, OPF_F32);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    float *x = t.data[OPF_COMP_DATA];
    for (int64_t i = 0; i < m * k; i++) x[i] = opf_test_normal(&seed, sigma);
    return t;
}

static float *dequant(opf_ctx *ctx, const opf_tensor *q, unsigned which, opf_tensor *out)
{
    opf_spec s = opf_spec_make(q->spec.ndim, q->spec.shape, OPF_F32);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, out));
    CHECK_OK(ctx, opf_dequantize(ctx, q, which, out));
    return out->data[OPF_COMP_DATA];
}

static float amax_of(const float *x, int64_t n)
{
    float a = 0;
    for (int64_t i = 0; i < n; i++) a = fabsf(x[i]) > a ? fabsf(x[i]) : a;
    return a;
}

/* |got - want| <= 0.125 * amax + 0.25 * |want| everywhere (numerics.md 8.3,
 * nvfp4 tolerances with atol scaled by the tensor's amax). */
static int count_outside(const float *got, const float *want, int64_t n, float amax)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += !(fabsf(got[i] - want[i]) <= 0.125f * amax + 0.25f * fabsf(want[i]));
    return bad;
}

/* The inverse of the transposed RHT: x[m][k] from the decoded rotated copy
 * (given back in [M, K] order), in double. T is orthonormal, so the inverse
 * is T^T: x_r = sum_c y_c * s_r * H[r][c] / 4. */
static void inverse_rht(const float *y, double *x, int64_t m, int64_t k)
{
    for (int64_t kk = 0; kk < k; kk++)
        for (int64_t m0 = 0; m0 < m; m0 += 16)
            for (int r = 0; r < 16; r++) {
                double acc = 0;
                for (int c = 0; c < 16; c++) {
                    acc += (t_negative(r, c) ? -0.25 : 0.25) * y[(m0 + c) * k + kk];
                }
                x[(m0 + r) * k + kk] = acc;
            }
}

static void test_round_trip(opf_ctx *ctx)
{
    const int64_t m = 64, k = 128;
    for (int mode = 0; mode < 3; mode++) {
        bool two_d = mode == 2, rht = mode == 1;
        opf_tensor x = make_input(ctx, m, k, 3.0f, 100 + mode), xq, r, c;
        const float *xv = x.data[OPF_COMP_DATA];
        opf_quantizer q = nvfp4_q(two_d, rht, false, kBoth);
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));
        float amax = amax_of(xv, m * k);
        CHECK(*(float *)xq.data[OPF_COMP_AMAX] == amax, "mode %d: stored amax", mode);
        float *rv = dequant(ctx, &xq, OPF_USAGE_ROWWISE, &r);
        CHECK(count_outside(rv, xv, m * k, amax) == 0, "mode %d rowwise round trip", mode);
        float *cv = dequant(ctx, &xq, OPF_USAGE_COLUMNWISE, &c);
        if (rht) {
            /* Decoded rotated values, rotated back: the error is the rotated
             * copy's, spread by an orthonormal map. */
            double *back = malloc(sizeof(double) * m * k);
            inverse_rht(cv, back, m, k);
            double err = 0, ref = 0;
            for (int64_t i = 0; i < m * k; i++) {
                err += (back[i] - xv[i]) * (back[i] - xv[i]);
                ref += (double)xv[i] * xv[i];
            }
            CHECK(sqrt(err / ref) < 0.15, "rht round trip relative error %g", sqrt(err / ref));
            free(back);
        } else {
            CHECK(count_outside(cv, xv, m * k, amax) == 0, "mode %d columnwise round trip", mode);
        }
        if (two_d)
            CHECK(memcmp(rv, cv, sizeof(float) * m * k) == 0, "2D copies decode identically");
        opf_tensor_release(&r);
        opf_tensor_release(&c);
        opf_tensor_release(&xq);
        opf_tensor_release(&x);
    }
}

static void test_zero_and_special(opf_ctx *ctx)
{
    opf_tensor x = make_input(ctx, 32, 32, 1.0f, 7), xq, r;
    float *xv = x.data[OPF_COMP_DATA];
    memset(xv, 0, sizeof(float) * 32 * 32);
    opf_quantizer q = nvfp4_q(false, true, false, kBoth);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));
    CHECK(*(float *)xq.data[OPF_COMP_AMAX] == 0.0f && *(float *)xq.data[OPF_COMP_COL_AMAX] == 0.0f,
          "zero tensor amaxes");
    float *rv = dequant(ctx, &xq, OPF_USAGE_ROWWISE, &r);
    CHECK(amax_of(rv, 32 * 32) == 0.0f, "zero tensor decodes to zero");
    opf_tensor_release(&r);
    opf_tensor_release(&xq);

    /* One inf: global scale 1; the inf encodes as +6 at scale 448. */
    xv[5] = INFINITY;
    xv[40] = 1.0f;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));
    const uint8_t *d = xq.data[OPF_COMP_DATA], *s = xq.data[OPF_COMP_SCALE_INV];
    CHECK(isinf(*(float *)xq.data[OPF_COMP_AMAX]), "amax is inf");
    CHECK((d[2] >> 4) == 0x7 && s[0] == 0x7E, "inf -> code 7 (%x), scale 448 (%x)", d[2] >> 4,
          s[0]);
    opf_tensor_release(&xq);
    opf_tensor_release(&x);
}

static void test_rht16(void)
{
    float x[16], y[16];
    for (int r = 0; r < 16; r++) {
        memset(x, 0, sizeof x);
        x[r] = 1.0f;
        opf_rht16(x, y, kMask);
        int ok = 1;
        for (int c = 0; c < 16; c++) {
            ok &= y[c] == (t_negative(r, c) ? -0.25f : 0.25f);
        }
        CHECK(ok, "impulse %d gives row %d of diag(s) H16 / 4", r, r);
    }
    /* Orthonormal: applying the unsigned transform twice gives x back
     * (H16 H16 = 16 I), exactly for these small integers. In place. */
    for (int i = 0; i < 16; i++) x[i] = (float)(i * 3 - 20);
    memcpy(y, x, sizeof x);
    opf_rht16(y, y, 0);
    opf_rht16(y, y, 0);
    CHECK(memcmp(x, y, sizeof x) == 0, "H16/4 is its own inverse");
    /* The result is rounded to bf16. */
    for (int i = 0; i < 16; i++) x[i] = 1.0f + (float)i * 0x1p-12f;
    opf_rht16(x, y, kMask);
    int bf16 = 1;
    for (int c = 0; c < 16; c++) bf16 &= opf_bf16_to_f32(opf_f32_to_bf16(y[c])) == y[c];
    CHECK(bf16, "outputs are bf16 values");
}

/* Quantizes x with a context of `threads` threads; returns the buffer bytes. */
static uint8_t *quantize_bytes(int threads, const opf_tensor *x, const opf_quantizer *q,
                               uint64_t offset, size_t *n)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.num_threads = threads;
    o.seed = 42;
    o.offset = offset;
    opf_ctx *ctx;
    CHECK_OK(NULL, opf_ctx_create(&o, &ctx));
    opf_tensor xq;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, q, x, &xq));
    opf_layout L;
    CHECK_OK(NULL, opf_spec_layout(&xq.spec, &L));
    uint8_t *bytes = calloc(1, L.total_bytes);
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present)
            memcpy(bytes + L.comp[c].offset, xq.data[c], L.comp[c].nbytes);
    *n = L.total_bytes;
    opf_tensor_release(&xq);
    opf_ctx_destroy(ctx);
    return bytes;
}

static void test_threads_and_sr(opf_ctx *ctx)
{
    opf_tensor x = make_input(ctx, 256, 512, 1.0f, 99);
    for (int mode = 0; mode < 4; mode++) {
        opf_quantizer q = nvfp4_q(mode == 3, mode != 3, mode >= 1, kBoth);
        q.swizzled = mode == 2;
        size_t n1, n2, n3, n4;
        uint8_t *a = quantize_bytes(1, &x, &q, 5, &n1), *b = quantize_bytes(2, &x, &q, 5, &n2);
        CHECK(n1 == n2 && memcmp(a, b, n1) == 0, "mode %d: 1 vs 2 threads differ", mode);
        uint8_t *c = quantize_bytes(2, &x, &q, 5, &n3), *d = quantize_bytes(1, &x, &q, 6, &n4);
        CHECK(memcmp(b, c, n1) == 0, "mode %d: same seed/offset is deterministic", mode);
        if (q.stochastic)
            CHECK(memcmp(a, d, n1) != 0, "mode %d: another offset gives other bits", mode);
        free(a), free(b), free(c), free(d);
    }
    opf_tensor_release(&x);
}

static void test_swizzled_decode(opf_ctx *ctx)
{
    opf_tensor x = make_input(ctx, 160, 96, 2.0f, 3);
    for (int two_d = 0; two_d < 2; two_d++) {
        opf_quantizer q = nvfp4_q(two_d, false, false, kBoth);
        opf_tensor a, b, da, db;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &a));
        q.swizzled = true;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &b));
        for (unsigned w = OPF_USAGE_ROWWISE; w <= OPF_USAGE_COLUMNWISE; w++) {
            float *va = dequant(ctx, &a, w, &da), *vb = dequant(ctx, &b, w, &db);
            CHECK(memcmp(va, vb, sizeof(float) * 160 * 96) == 0, "swizzled decode, copy %u", w);
            opf_tensor_release(&da);
            opf_tensor_release(&db);
        }
        opf_tensor_release(&a);
        opf_tensor_release(&b);
    }
    opf_tensor_release(&x);
}

static opf_status double_amax(void *user, float *amax, int n)
{
    *(int *)user = n;
    for (int i = 0; i < n; i++) amax[i] *= 2.0f;
    return OPF_OK;
}

static opf_status failing_reduce(void *user, float *amax, int n) { return OPF_ERR_DEVICE; }

static void test_amax_reduce(opf_ctx *ctx)
{
    opf_tensor x = make_input(ctx, 32, 64, 1.0f, 17), xq, plain;
    float a = amax_of(x.data[OPF_COMP_DATA], 32 * 64);
    opf_quantizer q = nvfp4_q(false, true, false, kBoth);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &plain));
    int seen = 0;
    q.amax_reduce = double_amax;
    q.amax_reduce_user = &seen;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));
    CHECK(seen == 2, "reduce saw %d amaxes, want 2 (row, rotated col)", seen);
    CHECK(*(float *)xq.data[OPF_COMP_AMAX] == 2 * a, "reduced row amax stored");
    CHECK(*(float *)xq.data[OPF_COMP_COL_AMAX] == 2 * *(float *)plain.data[OPF_COMP_COL_AMAX],
          "reduced col amax stored");
    opf_tensor_release(&xq);

    q.usage = OPF_USAGE_ROWWISE;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));
    CHECK(seen == 1, "rowwise only: reduce saw %d amaxes", seen);
    opf_tensor_release(&xq);

    /* A failing reduction leaves the output untouched. */
    q.usage = kBoth;
    q.amax_reduce = failing_reduce;
    opf_spec s;
    CHECK_OK(NULL, opf_quantizer_spec(&q, &x.spec, &s));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &xq));
    opf_layout L;
    CHECK_OK(NULL, opf_spec_layout(&s, &L));
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present) memset(xq.data[c], 0xAB, L.comp[c].nbytes);
    CHECK_FAILS(ctx, opf_quantize(ctx, &q, &x, &xq), OPF_ERR_DEVICE, "nvfp4", "amax reduction");
    int untouched = 1;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        for (size_t i = 0; L.comp[c].present && i < L.comp[c].nbytes; i++)
            untouched &= ((uint8_t *)xq.data[c])[i] == 0xAB;
    CHECK(untouched, "failed quantize wrote to its output");
    opf_tensor_release(&xq);
    opf_tensor_release(&plain);
    opf_tensor_release(&x);
}

static void test_errors(opf_ctx *ctx)
{
    const opf_quantize_state no_state = {0};
    opf_tensor x = make_input(ctx, 32, 32, 1.0f, 1), xq, bad;
    opf_quantizer q = nvfp4_q(false, false, false, kBoth);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));

    /* 2D tiles with a rotated columnwise copy cannot both hold. */
    opf_quantizer q2 = nvfp4_q(true, true, false, kBoth);
    CHECK_FAILS(ctx, opf_quantize_alloc(ctx, &q2, &x, &bad), OPF_ERR_UNSUPPORTED, "nvfp4",
                "Hadamard", "2D");

    /* Direct kernel calls: inputs the dispatcher would normally catch. */
    opf_tensor wrong = x;
    wrong.spec.dtype = OPF_E4M3;
    CHECK_FAILS(ctx, opf_cpu_quantize_nvfp4(ctx, &q, &wrong, &xq, &no_state), OPF_ERR_DTYPE,
                "opf_quantize(nvfp4)", "e4m3");
    wrong = x;
    wrong.spec.shape[0] = 16;
    CHECK_FAILS(ctx, opf_cpu_quantize_nvfp4(ctx, &q, &wrong, &xq, &no_state), OPF_ERR_SHAPE,
                "opf_quantize(nvfp4)", "512", "32 x 32");
    opf_tensor out = xq;
    out.data[OPF_COMP_COL_SCALE_INV] = NULL;
    CHECK_FAILS(ctx, opf_cpu_quantize_nvfp4(ctx, &q, &x, &out, &no_state), OPF_ERR_INVALID_ARG,
                "opf_quantize(nvfp4)", "component 3");
    out = xq;
    out.spec.shape[0] = 8;
    CHECK_FAILS(ctx, opf_cpu_quantize_nvfp4(ctx, &q, &x, &out, &no_state), OPF_ERR_SHAPE,
                "opf_quantize(nvfp4)", "multiples of 16");
    float buf[32 * 32];
    CHECK_FAILS(ctx, opf_cpu_dequantize_nvfp4(ctx, &xq, 3, buf), OPF_ERR_INVALID_ARG,
                "opf_dequantize(nvfp4)", "which = 3");
    CHECK_FAILS(ctx, opf_cpu_dequantize_nvfp4(ctx, &out, OPF_USAGE_ROWWISE, buf), OPF_ERR_SHAPE,
                "opf_dequantize(nvfp4)", "multiples of 16");
    out = xq;
    out.spec.usage = OPF_USAGE_ROWWISE;
    out.data[OPF_COMP_COL_DATA] = out.data[OPF_COMP_COL_SCALE_INV] = NULL;
    CHECK_FAILS(ctx, opf_cpu_dequantize_nvfp4(ctx, &out, OPF_USAGE_COLUMNWISE, buf),
                OPF_ERR_INVALID_ARG, "opf_dequantize(nvfp4)", "no columnwise copy");
    opf_tensor_release(&xq);
    opf_tensor_release(&x);
}

int main(void)
{
    opf_ctx *ctx;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    test_rht16();
    test_round_trip(ctx);
    test_zero_and_special(ctx);
    test_swizzled_decode(ctx);
    test_threads_and_sr(ctx);
    test_amax_reduce(ctx);
    test_errors(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
