/* test_act.c: the CPU backend's activation entries (backend/act.h), called
 * directly. For every kind: fwd and bwd against the element functions of
 * act-math.h applied one value at a time in the order the header states
 * (bit for bit, but for the payload and sign of NaN results), on sizes
 * below and above the threshold where OpenMP splits, and in place; the
 * element functions against FP64 formulas (numerics.md 6.3); dact_dbias
 * against bwd and a column sum in row order; the scaled GLUs against their
 * formula; the table's kinds and GLU flags. */
#include <float.h>

#include "test.h"

#include "backend/backend-impl.h"
#include "backend/cpu/act-math.h"

static const char *const kind_names[OPF_ACT_COUNT] = {
    "gelu", "qgelu", "relu", "srelu", "silu", "glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu",
    "clamped_swiglu"};

/* The slope each kind's op class passes (act-impl.h) and ClampedSwiGLU's usual limit. */
static opf_act_params params_of(opf_act_kind k)
{
    static const float alpha[OPF_ACT_COUNT] = {
        [OPF_ACT_QGELU] = 1.702f, [OPF_ACT_SILU] = 1.0f, [OPF_ACT_QGEGLU] = 1.702f,
        [OPF_ACT_SWIGLU] = 1.0f, [OPF_ACT_CLAMPED_SWIGLU] = 1.702f};
    return (opf_act_params){alpha[k], k == OPF_ACT_CLAMPED_SWIGLU ? 7.0f : 0.0f};
}

static bool same_value(float a, float b)
{
    return opf_f32_bits(a) == opf_f32_bits(b) || (isnan(a) && isnan(b));
}

/* n values: the edges of the element functions first, then normals of
 * three scales and, every fifth, a random bit pattern. */
static float *inputs(int64_t n, unsigned long long seed)
{
    static const float edge[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, FLT_MAX, -FLT_MAX,
                                 0x1p-149f, 0.75f, -0.75f, 9.02f, 88.72283f, -103.97208f,
                                 7.0f, -7.0f, 7.5f, -7.5f};
    const int64_t n_edge = (int64_t)(sizeof edge / sizeof edge[0]);
    const float sigma[] = {0.5f, 3.0f, 30.0f};
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++)
        x[i] = i < n_edge ? edge[i]
               : i % 5 == 0 ? opf_bits_f32((uint32_t)opf_test_rand_u64(&seed))
                            : opf_test_normal(&seed, sigma[i % 3]);
    return x;
}

/* ClampedSwiGLU's clamps, one value at a time (numerics.md 6.3). */
static float clamp_a(float a, float L) { return a < L ? a : L; }
static float clamp_b(float b, float L) { return (b > -L ? (b < L ? b : L) : -L) + 1.0f; }

/* y, dx of one row of a GLU kind, scalar. */
static void glu_row_ref(opf_act_kind k, opf_act_params p, const float *x, const float *g, int64_t h,
                        float *y, float *dx)
{
    for (int64_t j = 0; j < h; j++) {
        const float a = x[j], b = x[h + j];
        if (k != OPF_ACT_CLAMPED_SWIGLU) {
            y[j] = opf_act_f_impl(k, a, p.alpha) * b;
            dx[j] = opf_act_df_impl(k, a, p.alpha) * g[j] * b;
            dx[h + j] = opf_act_f_impl(k, a, p.alpha) * g[j];
            continue;
        }
        const float L = p.limit, fa = opf_act_swish_f(clamp_a(a, L), p.alpha);
        y[j] = fa * clamp_b(b, L);
        dx[j] = (a <= L ? opf_act_swish_df(a, p.alpha) : 0.0f) * g[j] * clamp_b(b, L);
        dx[h + j] = b >= -L && b <= L ? fa * g[j] : 0.0f;
    }
}

static int count_diff(const float *a, const float *b, int64_t n)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !same_value(a[i], b[i]);
    return bad;
}

/* fwd and bwd of kind k on [rows, cols] against the scalar reference. */
static void check_kind(opf_ctx *ctx, const opf_act_kernels *K, opf_act_kind k, int64_t rows,
                       int64_t cols, unsigned long long seed)
{
    const bool glu = opf_act_is_glu(k);
    const int64_t n = rows * cols, ny = glu ? n / 2 : n, h = cols / 2;
    const opf_act_params p = params_of(k);
    float *x = inputs(n, seed), *dy = inputs(ny, seed + 1);
    float *y = malloc(sizeof(float) * ny), *dx = malloc(sizeof(float) * n);
    float *yr = malloc(sizeof(float) * ny), *dxr = malloc(sizeof(float) * n);
    CHECK_OK(ctx, K->fwd(ctx, k, p, x, y, rows, cols));
    CHECK_OK(ctx, K->bwd(ctx, k, p, x, dy, dx, rows, cols));
    for (int64_t r = 0; glu && r < rows; r++)
        glu_row_ref(k, p, x + r * cols, dy + r * h, h, yr + r * h, dxr + r * cols);
    for (int64_t i = 0; !glu && i < n; i++) {
        yr[i] = opf_act_f_impl(k, x[i], p.alpha);
        dxr[i] = opf_act_df_impl(k, x[i], p.alpha) * dy[i];
    }
    int bad_y = count_diff(y, yr, ny), bad_dx = count_diff(dx, dxr, n);
    CHECK(bad_y == 0 && bad_dx == 0, "%s [%lld, %lld]: y differs at %d, dx at %d", kind_names[k],
          (long long)rows, (long long)cols, bad_y, bad_dx);
    if (!glu) {  /* in place, both directions */
        float *t = malloc(sizeof(float) * n);
        memcpy(t, x, sizeof(float) * n);
        CHECK_OK(ctx, K->fwd(ctx, k, p, t, t, rows, cols));
        CHECK(!memcmp(t, y, sizeof(float) * n), "%s: fwd in place differs", kind_names[k]);
        memcpy(t, dy, sizeof(float) * n);
        CHECK_OK(ctx, K->bwd(ctx, k, p, x, t, t, rows, cols));
        CHECK(!memcmp(t, dx, sizeof(float) * n), "%s: bwd in place differs", kind_names[k]);
        free(t);
    }
    free(x), free(dy), free(y), free(dx), free(yr), free(dxr);
}

static void test_kinds(opf_ctx *ctx, const opf_act_kernels *K)
{
    /* [rows, cols]: one element, odd tails, and above 32768 elements (threads) */
    static const int64_t shapes[][2] = {{1, 2}, {3, 34}, {7, 30}, {64, 1024}, {129, 514}};
    for (int k = 0; k < OPF_ACT_COUNT; k++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            check_kind(ctx, K, (opf_act_kind)k, shapes[s][0], shapes[s][1], 11 + 7 * s + 100 * k);
    /* no rows, or no columns: nothing is read or written */
    float guard = 1.0f;
    CHECK_OK(ctx, K->fwd(ctx, OPF_ACT_SWIGLU, params_of(OPF_ACT_SWIGLU), &guard, &guard, 0, 8));
    CHECK_OK(ctx, K->fwd(ctx, OPF_ACT_GELU, params_of(OPF_ACT_GELU), &guard, &guard, 5, 0));
    CHECK(guard == 1.0f, "an empty call wrote %g", (double)guard);
}

/* ---- the element functions against FP64 (numerics.md 6.3) ------------------------- */

static double ref_f(opf_act_fn fn, double x, double alpha)
{
    switch (fn) {
    case OPF_ACT_FN_GELU:
        return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    case OPF_ACT_FN_RELU: return x > 0.0 ? x : 0.0;
    case OPF_ACT_FN_SRELU: return x > 0.0 ? x * x : 0.0;
    case OPF_ACT_FN_SIGMOID: return 1.0 / (1.0 + exp(-x));
    default: return x / (1.0 + exp(-alpha * x));
    }
}

/* The FP64 derivative, by a central difference of ref_f away from ReLU's kinks. */
static double ref_df(opf_act_fn fn, double x, double alpha)
{
    const double e = 1e-6 * (fabs(x) > 1.0 ? fabs(x) : 1.0);
    return (ref_f(fn, x + e, alpha) - ref_f(fn, x - e, alpha)) / (2.0 * e);
}

static void test_against_fp64(void)
{
    unsigned long long seed = 5;
    for (int k = 0; k < OPF_ACT_COUNT; k++) {
        const opf_act_kind kind = (opf_act_kind)k;
        const opf_act_fn fn = opf_act_fn_of(kind);
        const float alpha = params_of(kind).alpha;
        double worst_f = 0.0, worst_df = 0.0;
        for (int i = 0; i < 20000; i++) {
            float x = opf_test_normal(&seed, i % 2 ? 1.0f : 6.0f);
            if (fabsf(x) < 1e-3f) continue;  /* ReLU's kink and SReLU's */
            double rf = ref_f(fn, x, alpha), rd = ref_df(fn, x, alpha);
            double ef = fabs(opf_act_f_impl(kind, x, alpha) - rf) / fmax(fabs(rf), 1.0);
            double ed = fabs(opf_act_df_impl(kind, x, alpha) - rd) / fmax(fabs(rd), 1.0);
            worst_f = ef > worst_f ? ef : worst_f;
            worst_df = ed > worst_df ? ed : worst_df;
        }
        CHECK(worst_f < 1e-5 && worst_df < 1e-4, "%s: f off by %.3g, f' by %.3g (relative above 1)",
              kind_names[k], worst_f, worst_df);
    }
}

/* ---- dact + dbias, the scaled GLUs ------------------------------------------------ */

static void test_dact_dbias(opf_ctx *ctx, const opf_act_kernels *K)
{
    const opf_act_kind kinds[] = {OPF_ACT_GELU, OPF_ACT_RELU, OPF_ACT_SILU};
    const int64_t rows = 97, cols = 384, n = rows * cols;  /* above 32768: threads */
    float *x = inputs(n, 21), *dy = inputs(n, 22), *dx = malloc(sizeof(float) * n);
    float *dxr = malloc(sizeof(float) * n), *db = malloc(sizeof(float) * cols);
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        const opf_act_params p = params_of(kinds[i]);
        CHECK_OK(ctx, K->dact_dbias(ctx, kinds[i], p, x, dy, dx, db, rows, cols));
        CHECK_OK(ctx, K->bwd(ctx, kinds[i], p, x, dy, dxr, rows, cols));
        CHECK(!memcmp(dx, dxr, sizeof(float) * n), "%s: dact differs from bwd",
              kind_names[kinds[i]]);
        int bad = 0;
        for (int64_t j = 0; j < cols; j++)
            bad += !same_value(db[j], opf_test_lane_colsum(dxr, rows, cols, j));
        CHECK(bad == 0, "%s: dbias differs from the lane-order column sum at %d of %lld",
              kind_names[kinds[i]], bad, (long long)cols);
    }
    free(x), free(dy), free(dx), free(dxr), free(db);
}

/* y, dx and ds of one scaled row, in the order the header states. */
static float scaled_row_ref(opf_act_kind k, float alpha, const float *x, float s, const float *dy,
                            int64_t h, float *y, float *dx)
{
    float ds = 0.0f;
    for (int64_t j = 0; j < h; j++) {
        const float a = x[j], b = x[h + j], fa = opf_act_f_impl(k, a, alpha), g = dy[j] * s;
        y[j] = fa * b * s;
        dx[j] = opf_act_df_impl(k, a, alpha) * g * b;
        dx[h + j] = fa * g;
        ds += fa * b * dy[j];
    }
    return ds;
}

static void test_scaled(opf_ctx *ctx, const opf_act_kernels *K)
{
    const opf_act_kind kinds[] = {OPF_ACT_SWIGLU, OPF_ACT_GEGLU, OPF_ACT_GLU};
    const int64_t shapes[][2] = {{5, 34}, {70, 1024}};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        for (size_t si = 0; si < 2; si++) {
            const int64_t rows = shapes[si][0], cols = shapes[si][1], h = cols / 2, n = rows * cols;
            const opf_act_params p = params_of(kinds[i]);
            float *x = inputs(n, 31 + si), *s = inputs(rows, 41), *dy = inputs(n / 2, 51);
            float *y = malloc(sizeof(float) * n / 2), *dx = malloc(sizeof(float) * n);
            float *ds = malloc(sizeof(float) * rows), *work = malloc(sizeof(float) * n);
            float *yr = malloc(sizeof(float) * n / 2), *dxr = malloc(sizeof(float) * n);
            CHECK_OK(ctx, K->scaled_glu_fwd(ctx, kinds[i], p, x, s, y, rows, cols));
            CHECK_OK(ctx, K->scaled_glu_bwd(ctx, kinds[i], p, x, s, dy, dx, ds, work, rows, cols));
            int bad_ds = 0;
            for (int64_t r = 0; r < rows; r++)
                bad_ds += !same_value(ds[r], scaled_row_ref(kinds[i], p.alpha, x + r * cols, s[r],
                                                            dy + r * h, h, yr + r * h,
                                                            dxr + r * cols));
            int bad_y = count_diff(y, yr, n / 2), bad_dx = count_diff(dx, dxr, n);
            CHECK(bad_y == 0 && bad_dx == 0 && bad_ds == 0,
                  "scaled %s [%lld, %lld]: y differs at %d, dx at %d, ds at %d",
                  kind_names[kinds[i]], (long long)rows, (long long)cols, bad_y, bad_dx, bad_ds);
            free(x), free(s), free(dy), free(y), free(dx), free(ds), free(work);
            free(yr), free(dxr);
        }
}

int main(void)
{
    opf_ctx *ctx;
    opf_ctx_options o = opf_ctx_options_default();
    if (opf_ctx_create(&o, &ctx) != OPF_OK) return 1;
    const opf_backend_i *be = opf_backend_get(OPF_DEVICE_CPU);
    const opf_act_kernels *K = be ? be->act : NULL;
    CHECK(K && K->fwd && K->bwd && K->dact_dbias && K->scaled_glu_fwd && K->scaled_glu_bwd,
          "the CPU table lacks activation entries");
    if (!K) TEST_DONE();
    for (int k = 0; k < OPF_ACT_COUNT; k++)
        CHECK(opf_act_is_glu((opf_act_kind)k) == (k >= OPF_ACT_GLU), "%s: GLU flag", kind_names[k]);
    test_kinds(ctx, K);
    test_against_fp64();
    test_dact_dbias(ctx, K);
    test_scaled(ctx, K);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
