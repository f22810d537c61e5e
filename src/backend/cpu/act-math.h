/* act-math.h: the fp32 exp, tanh and sigmoid of the activations
 * (docs/numerics.md 6.3.1), and on them the element functions f and f' of
 * every activation kind (6.3; GELU in its sigmoid form, so no kind calls
 * tanh today: it stays, tested, for the tanh-gated kinds of 6.3 such as
 * SiTU-GLU), as static inline functions written with fp32
 * +, -, *, / and integer operations on the bit pattern only. Their results
 * depend on no C library, so a loop over them vectorizes (no calls, no
 * data-dependent branches: both paths of a select are computed) and the same
 * code gives the same bits in a scalar loop, a SIMD loop, and a CUDA kernel
 * (NaN results are NaN everywhere; which payload and sign they carry is the
 * hardware's and compiler's choice). The CUDA kernels (cuda/act.cu) include
 * this header: under nvcc every function is OPF_HD, host and device, so both
 * devices run this one source.
 *
 * No FMA, by choice: every product and sum rounds on its own, as the rest of
 * the library's kernels do (CMake builds with -ffp-contract=off). Baseline
 * x86-64 has no FMA instruction, where fmaf is a library call that would
 * stop vectorization; without FMA the same bits come out on every target.
 * The CUDA build keeps it so: nvcc compiles with -fmad=false and IEEE
 * division and square root (no --use_fast_math). Must not be built with
 * -ffast-math, which would fold the (v + magic) - magic rounding step
 * below; assumes round-to-nearest-even and no flush-to-zero, as all fp32
 * code of the library does.
 *
 * Errors against the exact value (double-precision libm as the reference),
 * measured over every finite fp32 input (tests/ops/test_act_math.c with
 * OPF_TEST_EXHAUSTIVE=1; numerics.md 6.3.1):
 *   opf_expf_impl      0.976 ulp, subnormal results included
 *   opf_tanhf_impl     1.066 ulp (glibc 2.36's tanhf: 2.19)
 *   opf_sigmoidf_impl  2.481 ulp where the result is normal; the two fp32
 *                      roundings of 1/(1 + e) bound it, not the exp: the
 *                      same formula on glibc's 0.502-ulp expf has the same
 *                      2.481. Below z = -87.34 the exact value is
 *                      subnormal (not measured); below -88.73 e^-z
 *                      overflows and the formula gives 0
 * Exact: tanh(±0) = ±0, tanh(x) = x for |x| < 2^-12 and ±1 for |x| >= 9.02;
 * exp(±0) = 1, exp(-inf) = 0, exp(+inf) = +inf, exp overflows to +inf above
 * 88.72283 and goes through the subnormals to 0 below -103.97208; NaN in,
 * NaN out (a quiet NaN, sign not specified). */
#ifndef OPFUSE_ACT_MATH_H
#define OPFUSE_ACT_MATH_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/act.h"
#include "core/core-impl.h"

#ifdef __FAST_MATH__
#error "act-math.h needs IEEE fp32 arithmetic: build without -ffast-math"
#endif

/* 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer, which then sits in
 * the low bits of the sum's pattern (0x4B400000 + k). */
#define OPF_MATH_MAGIC 0x1.8p23f
#define OPF_MATH_MAGIC_BITS 0x4B400000u

/* c ? a : b, selected on the bit patterns. With a plain ?: and a constant
 * arm (a clamp), GCC threads jumps into a path of folded constants that may
 * trap; under -ftrapping-math the loop then keeps its branches and only
 * vectorizes with AVX-512 masks. The mask form vectorizes on SSE2 up. */
static inline OPF_HD float opf_select_f32_impl(bool c, float a, float b)
{
    const uint32_t m = 0u - (uint32_t)c;
    return opf_bits_f32((opf_f32_bits(a) & m) | (opf_f32_bits(b) & ~m));
}

/* e^x. Range reduction (Cody and Waite; Tang, ACM TOMS 15(2), 1989):
 * k = round(x log2 e), r = x - k ln2 with ln2 split in two, ln2_hi having
 * 15 significant bits so k ln2_hi is exact for |k| <= 150; then
 * e^x = 2^k e^r with |r| <= 0.3467 and e^r = 1 + r + r^2 Q(r), Q of degree 4
 * fitted minimax for the relative error of e^r (scripts/fit_act_math.py:
 * 3.1e-9 before rounding). 2^k is applied as two exact powers of two
 * 2^k1 2^k2 (k1 = floor((k + 160) / 2) - 80), so results from the largest
 * float down through the subnormals round once. x is clamped to
 * [-104, 89] first: beyond, the result is 0 or +inf all the same, and k
 * stays in [-150, 128]. A NaN passes the clamps (the comparisons are
 * false) and makes p NaN, whatever garbage its pattern gives k. */
static inline OPF_HD float opf_expf_impl(float x)
{
    const float log2e = 0x1.715476p+0f, ln2_hi = 0x1.62e4p-1f, ln2_lo = 0x1.7f7d1cp-20f;
    const float q0 = 0x1.fffffcp-2f, q1 = 0x1.555492p-3f, q2 = 0x1.5558f2p-5f,
                q3 = 0x1.123a0ap-7f, q4 = 0x1.6a23f2p-10f;
    float z = opf_select_f32_impl(x > 89.0f, 89.0f, x);
    z = opf_select_f32_impl(z < -104.0f, -104.0f, z);
    const float t = z * log2e + OPF_MATH_MAGIC;
    const float k = t - OPF_MATH_MAGIC;
    const float r = (z - k * ln2_hi) - k * ln2_lo;
    const float q = (((q4 * r + q3) * r + q2) * r + q1) * r + q0;
    const float p = 1.0f + (r + (r * r) * q);
    /* k + 160 in [10, 288], unsigned so a NaN's garbage wraps without UB */
    const uint32_t u = opf_f32_bits(t) - OPF_MATH_MAGIC_BITS + 160u, u1 = u >> 1;
    const float s1 = opf_bits_f32((u1 + 47u) << 23);      /* 2^(u1 - 80)     */
    const float s2 = opf_bits_f32((u - u1 + 47u) << 23);  /* 2^(k - u1 + 80) */
    return p * s1 * s2;
}

/* tanh x, on a = |x| with x's sign put back on the result's pattern:
 *   a < 0.75:  a + a (a^2 P(a^2)), P of degree 5 fitted minimax for the
 *              relative error of tanh (scripts/fit_act_math.py: 1.6e-9)
 *   otherwise: 1 - 2 / (e^{2a} + 1)
 * The switch at 0.75 (tanh = 0.635) keeps 2/(e^{2a}+1) below 0.37, so its
 * rounding errors move the result by at most ~0.6 ulp; closer to
 * atanh(1/2) = 0.549 the error grows to 1.4 ulp. For a > 9.1 the fraction
 * falls below half an ulp of 1 and the result is 1 exactly (e^{2a} = +inf
 * gives 2/inf = 0 the same way). a NaN fails a < 0.75 and comes back NaN. */
static inline OPF_HD float opf_tanhf_impl(float x)
{
    const float p0 = -0x1.55554ap-2f, p1 = 0x1.110db8p-3f, p2 = -0x1.b97d3cp-5f,
                p3 = 0x1.5f785ap-6f, p4 = -0x1.f5d36cp-8f, p5 = 0x1.c753c8p-10f;
    const uint32_t sign = opf_f32_bits(x) & 0x80000000u;
    const float a = opf_bits_f32(opf_f32_bits(x) & 0x7FFFFFFFu);
    const float u = a * a;
    const float p = ((((p5 * u + p4) * u + p3) * u + p2) * u + p1) * u + p0;
    const float small = a + a * (u * p);
    const float big = 1.0f - 2.0f / (opf_expf_impl(2.0f * a) + 1.0f);
    const float t = opf_select_f32_impl(a < 0.75f, small, big);
    return opf_bits_f32(opf_f32_bits(t) | sign);
}

/* σ(z) = 1/(1 + e^-z), numerics.md 6.3's formula with the exp above. */
static inline OPF_HD float opf_sigmoidf_impl(float z) { return 1.0f / (1.0f + opf_expf_impl(-z)); }

/* ---- the element functions (numerics.md 6.3) ------------------------------------
 * f and f' of one fp32 value; alpha is the slope of the x·σ(αx) family and
 * unused by the others. fmaxf and fminf are written as the selects they
 * equal (+0 for ±0 and NaN in max(v, 0)), and every select as
 * opf_select_f32_impl, so that loops over them vectorize. */

/* GELU's tanh form as the sigmoid it equals, 0.5 (1 + tanh z) = σ(2z):
 * f = x / (1 + e^{-2z}), z = x (0.79788456 + 0.03567741 x^2), and
 * f' = s + 2x z' s (1 - s), s = σ(2z), z' = 0.79788456 + 0.1070322243 x^2.
 * One exp and one division: no tanh (whose two branches a select computes
 * both of), a third of the instructions of the tanh form. It is also the
 * more accurate form where x < 0: there 1 + tanh z cancels (at x = -5 the
 * tanh form loses a third of the value; x / (1 + e) keeps the exp's few
 * ulp). Overflow goes the same way: e^{-2z} = +inf gives f = -0 and s = 0. */
static inline OPF_HD float opf_act_gelu_f(float x, float alpha)
{
    const float z = x * (0.79788456f + 0.03567741f * x * x);
    return x / (1.0f + opf_expf_impl(-2.0f * z));
}

static inline OPF_HD float opf_act_gelu_df(float x, float alpha)
{
    const float x2 = x * x;
    const float s = 1.0f / (1.0f + opf_expf_impl(-2.0f * (x * (0.79788456f + 0.03567741f * x2))));
    return s + ((2.0f * x) * (0.79788456f + 0.1070322243f * x2)) * (s * (1.0f - s));
}

/* x·σ(αx): QGELU (α = 1.702), SiLU (α = 1: 1·x == x exactly), ClampedSwiGLU. */
static inline OPF_HD float opf_act_swish_f(float x, float alpha)
{
    return x * opf_sigmoidf_impl(alpha * x);
}

/* αx·σ'(αx) + σ(αx) with σ' = σ(1-σ). */
static inline OPF_HD float opf_act_swish_df(float x, float alpha)
{
    const float c = alpha * x, s = opf_sigmoidf_impl(c);
    return c * (s * (1.0f - s)) + s;
}

/* max(v, 0) as fmaxf(v, 0.0f) gives it. */
static inline OPF_HD float opf_act_max0(float v) { return opf_select_f32_impl(v > 0.0f, v, 0.0f); }

static inline OPF_HD float opf_act_relu_f(float x, float alpha) { return opf_act_max0(x); }
static inline OPF_HD float opf_act_relu_df(float x, float alpha)
{
    return opf_select_f32_impl(x > 0.0f, 1.0f, 0.0f);
}
static inline OPF_HD float opf_act_srelu_f(float x, float alpha)
{
    return opf_select_f32_impl(x > 0.0f, x * x, 0.0f);
}
static inline OPF_HD float opf_act_srelu_df(float x, float alpha) { return opf_act_max0(2.0f * x); }

static inline OPF_HD float opf_act_sigmoid_f(float x, float alpha) { return opf_sigmoidf_impl(x); }
static inline OPF_HD float opf_act_sigmoid_df(float x, float alpha)
{
    const float s = opf_sigmoidf_impl(x);
    return s * (1.0f - s);
}

/* The element-function pair of a kind. Kinds that share a pair share its
 * loops (cpu/act.c has one vectorized set per pair). */
typedef enum opf_act_fn {
    OPF_ACT_FN_GELU    = 0,  /* GELU, GEGLU */
    OPF_ACT_FN_SWISH   = 1,  /* QGELU, SiLU and their GLUs, ClampedSwiGLU */
    OPF_ACT_FN_RELU    = 2,
    OPF_ACT_FN_SRELU   = 3,
    OPF_ACT_FN_SIGMOID = 4,  /* GLU's gate */
    OPF_ACT_FN_COUNT
} opf_act_fn;

static inline OPF_HD opf_act_fn opf_act_fn_of(opf_act_kind k)
{
    switch (k) {
    case OPF_ACT_GELU: case OPF_ACT_GEGLU: return OPF_ACT_FN_GELU;
    case OPF_ACT_RELU: case OPF_ACT_REGLU: return OPF_ACT_FN_RELU;
    case OPF_ACT_SRELU: case OPF_ACT_SREGLU: return OPF_ACT_FN_SRELU;
    case OPF_ACT_GLU: return OPF_ACT_FN_SIGMOID;
    default: return OPF_ACT_FN_SWISH;
    }
}

/* f (deriv false) or f' of kind k at one value, for scalar callers (tests,
 * references): the same bits as the loops of cpu/act.c (the gate of a GLU
 * kind is not applied, nor ClampedSwiGLU's clamps). */
static inline OPF_HD float opf_act_scalar_impl(opf_act_kind k, float x, float alpha, bool deriv)
{
    switch (opf_act_fn_of(k)) {
    case OPF_ACT_FN_GELU: return deriv ? opf_act_gelu_df(x, alpha) : opf_act_gelu_f(x, alpha);
    case OPF_ACT_FN_RELU: return deriv ? opf_act_relu_df(x, alpha) : opf_act_relu_f(x, alpha);
    case OPF_ACT_FN_SRELU: return deriv ? opf_act_srelu_df(x, alpha) : opf_act_srelu_f(x, alpha);
    case OPF_ACT_FN_SIGMOID:
        return deriv ? opf_act_sigmoid_df(x, alpha) : opf_act_sigmoid_f(x, alpha);
    default: return deriv ? opf_act_swish_df(x, alpha) : opf_act_swish_f(x, alpha);
    }
}
static inline OPF_HD float opf_act_f_impl(opf_act_kind k, float x, float alpha)
{
    return opf_act_scalar_impl(k, x, alpha, false);
}
static inline OPF_HD float opf_act_df_impl(opf_act_kind k, float x, float alpha)
{
    return opf_act_scalar_impl(k, x, alpha, true);
}

#endif
