/* test_scale.c: the scale family of the CPU kernel table (backend/scale.h)
 * called directly: amax of f32/bf16/f16 tensors with NaN and infinities
 * against a plain loop, on one thread and many; the delayed-scaling update
 * over several states at once against a slot-by-slot reference of
 * docs/numerics.md 3.1 (reduced amaxes, zero amaxes, NaN in the window, both
 * algorithms, history 1); the scale swizzle both ways and transposed. */
#include <float.h>

#include "backend/backend-impl.h"
#include "backend/scale-math.h"
#include "test.h"

static const opf_scale_kernels *K;

static int same(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

static uint32_t rng = 12345u;
static uint32_t next_u32(void)
{
    rng = rng * 1664525u + 1013904223u;
    return rng >> 8;
}
static float next_f(void) { return ((float)(next_u32() % 20001) - 10000.0f) / 997.0f; }

/* ---- amax ----------------------------------------------------------------- */

static void test_amax_dtype(opf_ctx *ctx, opf_dtype dt, int64_t n)
{
    float *x = malloc(sizeof(float) * (size_t)n), want = 0.0f;
    for (int64_t i = 0; i < n; i++) x[i] = next_f();
    x[n / 3] = NAN;
    x[n / 2] = -1000.5f;  /* the largest magnitude, negative */
    x[1] = -NAN;
    opf_spec s = opf_spec_make(1, (int64_t[]){n}, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    CHECK_OK(ctx, opf_convert(x, OPF_F32, t.data[0], dt, (size_t)n));
    float *back = malloc(sizeof(float) * (size_t)n);
    opf_convert(t.data[0], dt, back, OPF_F32, (size_t)n);  /* the values the kernel sees */
    for (int64_t i = 0; i < n; i++)
        if (!isnan(back[i]) && fabsf(back[i]) > want) want = fabsf(back[i]);
    float got = -1.0f;
    CHECK_OK(ctx, K->amax(ctx, &t, &got));
    CHECK(same(got, want), "amax %s n=%lld: %g, want %g", opf_dtype_name(dt), (long long)n,
          (double)got, (double)want);
    /* An infinity wins; an all-NaN tensor gives 0. */
    back[n - 1] = -INFINITY;
    opf_convert(back, OPF_F32, t.data[0], dt, (size_t)n);
    CHECK_OK(ctx, K->amax(ctx, &t, &got));
    CHECK(got == INFINITY, "amax %s with -inf: %g", opf_dtype_name(dt), (double)got);
    for (int64_t i = 0; i < n; i++) back[i] = NAN;
    opf_convert(back, OPF_F32, t.data[0], dt, (size_t)n);
    CHECK_OK(ctx, K->amax(ctx, &t, &got));
    CHECK(same(got, 0.0f), "amax %s all NaN: %g", opf_dtype_name(dt), (double)got);
    opf_tensor_release(&t);
    free(x);
    free(back);
}

static void test_amax(opf_ctx *ctx)
{
    const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    const int64_t ns[] = {3, 37, 100003};  /* the last one runs on several threads */
    for (int d = 0; d < 3; d++)
        for (int i = 0; i < 3; i++) test_amax_dtype(ctx, dts[d], ns[i]);
}

/* ---- delayed update ------------------------------------------------------- */

/* numerics.md 3.1 for one slot, written out independently of the kernel. */
static void ref_slot(float *h, int n, int L, float *scale, float scaled_max, opf_amax_algo algo,
                     float a)
{
    if (a == 0.0f) return;
    float amax = a;
    for (int i = 1; i < L; i++)
        if (!isnan(h[i * n]) && (isnan(amax) || h[i * n] > amax)) amax = h[i * n];
    if (algo == OPF_AMAX_MOST_RECENT) amax = a;
    for (int i = 1; i + 1 < L; i++) h[i * n] = h[(i + 1) * n];
    if (L > 1) h[(L - 1) * n] = a;
    h[0] = 0.0f;
    if (isfinite(amax) && amax > 0.0f) {
        float s = scaled_max / amax;
        *scale = isinf(s) ? FLT_MAX : s;
    }
}

enum { NS = 3 };

static void test_delayed_update(opf_ctx *ctx)
{
    const int n[NS] = {5, 1, 4}, len[NS] = {4, 1, 2};
    const opf_amax_algo algo[NS] = {OPF_AMAX_MAX, OPF_AMAX_MOST_RECENT, OPF_AMAX_MAX};
    float hist[NS][32], scale[NS][8], red[NS][8], rh[NS][32], rs[NS][8];
    opf_delayed_arrays st[NS];
    for (int k = 0; k < NS; k++) {
        for (int i = 0; i < n[k] * len[k]; i++) hist[k][i] = fabsf(next_f());
        for (int j = 0; j < n[k]; j++) scale[k][j] = 1.0f + (float)j, red[k][j] = 0.0f;
        st[k] = (opf_delayed_arrays){.history = hist[k], .scale = scale[k], .n = n[k],
                                     .len = len[k], .scaled_max = 224.0f, .algo = algo[k]};
    }
    hist[0][1] = 0.0f;         /* slot 1 of state 0 saw nothing: untouched */
    hist[0][2 * 5 + 3] = NAN;  /* NaN in slot 3's window is skipped */
    for (int i = 0; i < 4; i++) hist[0][i * 5 + 4] = i ? 0.0f : 1e-45f;  /* 224 / 1e-45: inf */
    st[2].reduced = red[2];    /* state 2 reduced: slot 0 from the reduction, others local */
    red[2][0] = 50.0f;
    hist[2][2] = NAN;          /* a NaN amax: rolled in, scale kept */
    memcpy(rh, hist, sizeof hist);
    memcpy(rs, scale, sizeof scale);
    for (int k = 0; k < NS; k++)
        for (int j = 0; j < n[k]; j++) {
            float a = st[k].reduced && red[k][j] != 0.0f ? red[k][j] : rh[k][j];
            ref_slot(rh[k] + j, n[k], len[k], &rs[k][j], 224.0f, algo[k], a);
        }
    CHECK_OK(ctx, K->delayed_update(ctx, st, NS));
    for (int k = 0; k < NS; k++) {
        CHECK(memcmp(hist[k], rh[k], sizeof(float) * (size_t)(n[k] * len[k])) == 0,
              "state %d: history differs from the reference", k);
        for (int j = 0; j < n[k]; j++)
            CHECK(same(scale[k][j], rs[k][j]), "state %d slot %d: scale %g, want %g", k, j,
                  (double)scale[k][j], (double)rs[k][j]);
    }
    CHECK(same(scale[0][1], 2.0f), "zero amax keeps the scale: %g", (double)scale[0][1]);
    CHECK(same(scale[0][4], FLT_MAX), "tiny amax: %g", (double)scale[0][4]);
    CHECK(same(scale[2][0], 224.0f / 50.0f), "reduced amax: %g", (double)scale[2][0]);
}

/* ---- swizzle -------------------------------------------------------------- */

static void test_swizzle(opf_ctx *ctx)
{
    enum { R = 256, C = 8 };
    static uint8_t src[R * C], swz[R * C], want[R * C], back[R * C];
    for (int i = 0; i < R * C; i++) src[i] = (uint8_t)next_u32();
    for (int t = 0; t < 2; t++) {
        bool tr = t == 1;
        CHECK_OK(ctx, K->swizzle(ctx, src, swz, R, C, tr, true));
        for (int i = 0; i < R; i++)
            for (int j = 0; j < C; j++)
                want[opf_swizzle_index(i, j, C)] = tr ? src[j * R + i] : src[i * C + j];
        CHECK(memcmp(swz, want, sizeof want) == 0, "swizzle (transposed %d)", t);
        CHECK_OK(ctx, K->swizzle(ctx, swz, back, R, C, tr, false));
        CHECK(memcmp(back, src, sizeof src) == 0, "unswizzle round trip (transposed %d)", t);
    }
}

int main(void)
{
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    K = opf_backend_get(OPF_DEVICE_CPU)->scale;
    test_amax(ctx);
    test_delayed_update(ctx);
    test_swizzle(ctx);
    CHECK(opf_fp8_max(OPF_E4M3) == 448.0f && opf_fp8_max(OPF_E5M2) == 57344.0f, "fp8 maxima");
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
