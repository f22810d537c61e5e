/* test_act_math.c: the fp32 exp, tanh and sigmoid of act-math.h (numerics.md
 * 6.3.1) against double precision: a dense sweep of [-20, 20] (every 127th
 * fp32 pattern) and of exp's whole finite range, one million random
 * patterns over every float, and the special values; the documented maximum
 * ulp errors are asserted. Then the bits: a SIMD loop and a scalar loop over
 * the same inputs agree (bit for bit, but for the payload and sign of NaN
 * results: see same_value). The activation kernels built on them are
 * tested in tests/backend/test_act.c.
 *
 * OPF_TEST_EXHAUSTIVE=1 checks every fp32 input instead of the sweeps
 * (minutes; the errors act-math.h documents come from this run). */
#include <float.h>
#include <stdint.h>

#include "test.h"

#include "backend/cpu/act-math.h"

/* The documented bounds (act-math.h, numerics.md 6.3.1). */
#define EXP_MAX_ULP 0.98
#define TANH_MAX_ULP 1.07
#define SIGMOID_MAX_ULP 2.49

/* ---- the error of one value -------------------------------------------------- */

/* |y - ref| in units of the last place of ref's fp32 binade (2^-149 below
 * 2^-126); +inf counts as 2^128, and is exact where ref rounds to it. */
static double ulp_err(float y, double ref)
{
    if (isnan(ref) || isnan(y)) return isnan(ref) && isnan(y) ? 0.0 : INFINITY;
    if (isinf((float)ref) && y == (float)ref) return 0.0;
    double yv = isinf(y) ? copysign(0x1p128, y) : (double)y;
    int e = ref == 0.0 ? -126 : ilogb(ref);
    e = e < -126 ? -126 : e > 127 ? 127 : e;
    return fabs(yv - ref) / ldexp(1.0, e - 23);
}

typedef struct fn_case {
    const char *name;
    float (*f)(float);
    double (*ref)(double);
    double max_ulp;
    double tiny_ref;  /* errors are measured where |ref| >= tiny_ref */
} fn_case;

static float f_exp(float x) { return opf_expf_impl(x); }
static float f_tanh(float x) { return opf_tanhf_impl(x); }
static float f_sigmoid(float x) { return opf_sigmoidf_impl(x); }
static double r_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* sigmoid: 1/(1 + e^-z) is 0 where e^-z overflows fp32, below z = -88.7,
 * whose exact values are subnormal; act-math.h excepts them. */
static const fn_case fns[] = {
    {"exp", f_exp, exp, EXP_MAX_ULP, 0.0},
    {"tanh", f_tanh, tanh, TANH_MAX_ULP, 0.0},
    {"sigmoid", f_sigmoid, r_sigmoid, SIGMOID_MAX_ULP, FLT_MIN},
};
#define N_FNS ((int)(sizeof fns / sizeof fns[0]))

typedef struct worst {
    double ulp;
    float x;
    long long n;
} worst;

static void note(worst *w, const fn_case *c, float x)
{
    double ref = c->ref(x);
    w->n++;
    if (fabs(ref) < c->tiny_ref) return;
    double e = ulp_err(c->f(x), ref);
    if (e > w->ulp) w->ulp = e, w->x = x;
}

static void report(const fn_case *c, const char *what, const worst *w)
{
    printf("  %-8s %-28s max %.3f ulp at %a (%.9g), %lld inputs\n", c->name, what, w->ulp,
           (double)w->x, (double)w->x, w->n);
    CHECK(w->ulp <= c->max_ulp, "%s over %s: %.3f ulp at %a, documented %.2f", c->name, what, w->ulp,
          (double)w->x, c->max_ulp);
}

/* Every stride-th fp32 pattern of [lo, hi] (finite, lo < hi), both signs
 * of the magnitudes by walking the patterns of each sign's half. */
static void sweep(const fn_case *c, float lo, float hi, uint32_t stride, const char *what)
{
    worst w = {0};
    for (int neg = 0; neg < 2; neg++) {
        float end = neg ? -lo : hi;
        if (end <= 0.0f) continue;
        uint32_t top = opf_f32_bits(end), sign = neg ? 0x80000000u : 0u;
        for (uint64_t b = 0; b <= top; b += stride) {
            float x = opf_bits_f32((uint32_t)b | sign);
            if (x >= lo && x <= hi) note(&w, c, x);
        }
    }
    report(c, what, &w);
}

static void random_patterns(const fn_case *c, int n)
{
    unsigned long long seed = 77;
    worst w = {0};
    for (int i = 0; i < n; i++) {
        float x = opf_bits_f32((uint32_t)opf_test_rand_u64(&seed));
        if (isnan(x)) {
            CHECK(isnan(c->f(x)), "%s(NaN %08x) is not NaN", c->name, opf_f32_bits(x));
            continue;
        }
        note(&w, c, x);
    }
    report(c, "random fp32 patterns", &w);
}

/* Every fp32 pattern, on all threads. */
static void exhaustive(const fn_case *c)
{
    double best = 0.0;
    uint32_t where = 0;
    long long bad_nan = 0;
    #pragma omp parallel
    {
        double my = 0.0;
        uint32_t my_at = 0;
        #pragma omp for schedule(static) reduction(+ : bad_nan)
        for (int64_t b = 0; b <= 0xFFFFFFFFll; b++) {
            float x = opf_bits_f32((uint32_t)b);
            if (isnan(x)) {
                bad_nan += !isnan(c->f(x));
                continue;
            }
            double ref = c->ref(x);
            if (fabs(ref) < c->tiny_ref) continue;
            double e = ulp_err(c->f(x), ref);
            if (e > my) my = e, my_at = (uint32_t)b;
        }
        #pragma omp critical
        if (my > best) best = my, where = my_at;
    }
    worst w = {best, opf_bits_f32(where), 1ll << 32};
    report(c, "every fp32 input", &w);
    CHECK(bad_nan == 0, "%s: %lld NaN inputs gave a number", c->name, bad_nan);
}

/* ---- special values --------------------------------------------------------------- */

static bool same_bits(float a, float b) { return opf_f32_bits(a) == opf_f32_bits(b); }

/* The same bits, or both NaN: IEEE 754 does not say which input NaN an
 * operation returns (x86 returns the first operand's), and a compiler may
 * commute dx = f'(x)·dy differently in two loops, so NaN payloads and signs
 * may differ. Every non-NaN result must match bit for bit. */
static bool same_value(float a, float b) { return same_bits(a, b) || (isnan(a) && isnan(b)); }

static void test_special(void)
{
    const float inf = INFINITY, qnan = NAN, nnan = -NAN;
    const float snan = opf_bits_f32(0x7F800001u);
    /* tanh: signed zeros, ±1 from 9.02 on, x itself below 2^-12, NaN */
    CHECK(same_bits(opf_tanhf_impl(0.0f), 0.0f) && same_bits(opf_tanhf_impl(-0.0f), -0.0f),
          "tanh(±0) is not ±0");
    CHECK(opf_tanhf_impl(inf) == 1.0f && opf_tanhf_impl(-inf) == -1.0f, "tanh(±inf) is not ±1");
    CHECK(opf_tanhf_impl(FLT_MAX) == 1.0f && opf_tanhf_impl(-FLT_MAX) == -1.0f, "tanh(±max)");
    CHECK(isnan(opf_tanhf_impl(qnan)) && isnan(opf_tanhf_impl(nnan)) && isnan(opf_tanhf_impl(snan)),
          "tanh(NaN) is not NaN");
    int wrong = 0;  /* every 7th pattern */
    for (uint32_t b = opf_f32_bits(9.02f); b < opf_f32_bits(30.0f); b += 7) {
        float x = opf_bits_f32(b);
        wrong += opf_tanhf_impl(x) != 1.0f || opf_tanhf_impl(-x) != -1.0f;
    }
    CHECK(wrong == 0, "tanh is not ±1 at %d inputs of |x| in [9.02, 30)", wrong);
    wrong = 0;
    for (uint32_t b = 0; b < opf_f32_bits(0x1p-12f); b += 1009) {
        float x = opf_bits_f32(b);
        wrong += !same_bits(opf_tanhf_impl(x), x) || !same_bits(opf_tanhf_impl(-x), -x);
    }
    CHECK(wrong == 0, "tanh(x) != x at %d inputs of |x| < 2^-12", wrong);
    /* both sides of the switch at 0.75 */
    const float around[] = {nextafterf(0.75f, 0.0f), 0.75f, nextafterf(0.75f, 1.0f)};
    for (int i = 0; i < 3; i++)
        CHECK(ulp_err(opf_tanhf_impl(around[i]), tanh(around[i])) <= TANH_MAX_ULP, "tanh(%a)",
              (double)around[i]);
    CHECK(opf_tanhf_impl(around[0]) <= opf_tanhf_impl(around[1]) &&
          opf_tanhf_impl(around[1]) <= opf_tanhf_impl(around[2]), "tanh is not monotonic at 0.75");

    /* exp: exact at 0 and the infinities, overflow and underflow thresholds */
    CHECK(opf_expf_impl(0.0f) == 1.0f && opf_expf_impl(-0.0f) == 1.0f, "exp(±0) != 1");
    CHECK(opf_expf_impl(inf) == inf && same_bits(opf_expf_impl(-inf), 0.0f), "exp(±inf)");
    CHECK(isnan(opf_expf_impl(qnan)) && isnan(opf_expf_impl(nnan)) && isnan(opf_expf_impl(snan)),
          "exp(NaN) is not NaN");
    const float big = 0x1.62e42ep+6f;  /* 88.72283: the largest x with e^x < FLT_MAX + ulp/2 */
    CHECK(isfinite(opf_expf_impl(big)) && opf_expf_impl(nextafterf(big, inf)) == inf,
          "exp overflows at %a / %a", (double)opf_expf_impl(big),
          (double)opf_expf_impl(nextafterf(big, inf)));
    CHECK(opf_expf_impl(FLT_MAX) == inf && same_bits(opf_expf_impl(-FLT_MAX), 0.0f), "exp(±max)");
    const float small = -0x1.9fe368p+6f;  /* -103.97208: e^x just above 2^-150 */
    CHECK(opf_expf_impl(small) == 0x1p-149f &&
              same_bits(opf_expf_impl(nextafterf(small, -inf)), 0.0f),
          "exp underflows at %a / %a", (double)opf_expf_impl(small),
          (double)opf_expf_impl(nextafterf(small, -inf)));
    /* e^x at x = k ln2 rounded, near every power of two 2^k down through the subnormals */
    wrong = 0;
    for (int k = -149; k <= 127; k++) {
        float x = (float)(k * 0.6931471805599453);
        wrong += ulp_err(opf_expf_impl(x), exp((double)x)) > EXP_MAX_ULP;
    }
    CHECK(wrong == 0, "exp misses at %d of the points k ln2", wrong);

    /* sigmoid: 1/2 at 0, the limits, NaN */
    CHECK(opf_sigmoidf_impl(0.0f) == 0.5f && opf_sigmoidf_impl(-0.0f) == 0.5f, "sigmoid(0) != 1/2");
    CHECK(opf_sigmoidf_impl(inf) == 1.0f && same_bits(opf_sigmoidf_impl(-inf), 0.0f),
          "sigmoid(±inf)");
    CHECK(opf_sigmoidf_impl(20.0f) == 1.0f && opf_sigmoidf_impl(-100.0f) == 0.0f, "sigmoid limits");
    CHECK(isnan(opf_sigmoidf_impl(qnan)) && isnan(opf_sigmoidf_impl(snan)), "sigmoid(NaN)");

    /* max(v, 0) of ReLU and SReLU' as fmaxf(v, 0.0f) gives it: +0 for -0 and NaN */
    const float odd[] = {-0.0f, qnan, nnan, -inf};
    for (int i = 0; i < 4; i++)
        CHECK(same_bits(opf_act_relu_f(odd[i], 0.0f), 0.0f) &&
              same_bits(opf_act_relu_df(odd[i], 0.0f), 0.0f) &&
              same_bits(opf_act_srelu_f(odd[i], 0.0f), 0.0f) &&
              same_bits(opf_act_srelu_df(odd[i], 0.0f), 0.0f),
              "relu / srelu of %a is not +0", (double)odd[i]);
}

/* ---- SIMD and scalar loops give the same bits --------------------------------------- */

/* Called through a volatile pointer, so no compiler can vectorize the loop. */
static float (*volatile scalar_fn[N_FNS])(float) = {f_exp, f_tanh, f_sigmoid};

static void simd_loop(int fi, const float *x, float *y, int64_t n)
{
    switch (fi) {
    case 0:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] = opf_expf_impl(x[i]);
        break;
    case 1:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] = opf_tanhf_impl(x[i]);
        break;
    default:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] = opf_sigmoidf_impl(x[i]);
    }
}

/* Inputs of every kind: the special values, then random patterns and
 * normals of three scales. */
static float *mixed_inputs(int64_t n, unsigned long long seed)
{
    static const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, FLT_MAX, -FLT_MAX,
                                    FLT_MIN, -FLT_MIN, 0x1p-149f, -0x1p-149f, 0.75f, -0.75f,
                                    9.02f, -9.02f, 88.72283f, -103.97208f, 7.0f, -7.0f, 1.0f, -1.0f};
    float *x = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        if (i < (int64_t)(sizeof special / sizeof special[0])) {
            x[i] = special[i];
            continue;
        }
        switch (i % 4) {
        case 0: x[i] = opf_bits_f32((uint32_t)opf_test_rand_u64(&seed)); break;
        case 1: x[i] = opf_test_normal(&seed, 0.5f); break;
        case 2: x[i] = opf_test_normal(&seed, 3.0f); break;
        default: x[i] = opf_test_normal(&seed, 30.0f);
        }
    }
    return x;
}

static void test_simd_vs_scalar(void)
{
    const int64_t n = 100003;  /* odd: every loop has a tail */
    float *x = mixed_inputs(n, 3), *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
    for (int fi = 0; fi < N_FNS; fi++) {
        for (int64_t len = 1; len <= 67; len++) {  /* every tail length of 16 lanes, several times */
            simd_loop(fi, x + len, a, len);
            int bad = 0;
            for (int64_t i = 0; i < len; i++) bad += !same_value(a[i], scalar_fn[fi](x[len + i]));
            CHECK(bad == 0, "%s: SIMD and scalar loops differ at %d of %lld", fns[fi].name, bad,
                  (long long)len);
        }
        simd_loop(fi, x, a, n);
        int bad = 0;
        for (int64_t i = 0; i < n; i++) {
            b[i] = scalar_fn[fi](x[i]);
            bad += !same_value(a[i], b[i]);
        }
        CHECK(bad == 0, "%s: SIMD and scalar loops differ at %d of %lld", fns[fi].name, bad,
              (long long)n);
    }
    free(x), free(a), free(b);
}

int main(void)
{
    const char *ex = getenv("OPF_TEST_EXHAUSTIVE");
    test_special();
    printf("ulp errors against double precision:\n");
    for (int i = 0; i < N_FNS; i++) {
        if (ex && *ex && *ex != '0') {
            exhaustive(&fns[i]);
            continue;
        }
        sweep(&fns[i], -20.0f, 20.0f, 127, "[-20, 20], every 127th");
        if (i == 0) sweep(&fns[i], -104.0f, 89.0f, 1021, "[-104, 89], every 1021st");
        random_patterns(&fns[i], 1000000);
    }
    test_simd_vs_scalar();
    TEST_DONE();
}
