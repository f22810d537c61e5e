/* codec-impl.h: the scalar codecs of numerics.md section 1 as static inline
 * functions, so hot loops in any layer (quantize kernels, loaders) inline them;
 * dtype.c wraps each one as the exported opf_f32_to_X / opf_X_to_f32.
 *
 * Encoders work on the fp32 bit pattern with integer arithmetic only, so the
 * result cannot depend on the FPU rounding mode or on flush-to-zero /
 * denormals-are-zero flags the host program may have set. They are written as
 * straight-line selects (no data-dependent branches) so the compiler can
 * vectorize a loop over them. Decoders are exact and integer-only too (an
 * fp32 operation, even an exact one, would keep GCC from if-converting them
 * while -ftrapping-math is on).
 *
 * NaN conventions (numerics.md 1.3 for the narrow formats; the rest follow
 * ml_dtypes / numpy, which the oracle test checks bit for bit):
 *   fp32 -> bf16  sign kept, canonical quiet NaN 0x7FC0
 *   fp32 -> fp16  sign kept, payload truncated to 10 bits (at least 1)
 *   fp32 -> e4m3 / e5m2  0x7F (sign dropped);  fp32 -> e2m1  +6 (code 7)
 *   decodes: bf16 / fp16 keep sign and payload; e4m3, e5m2, e8m0 NaN codes
 *   give the canonical quiet NaN 0x7FC00000 with the code's sign. */
#ifndef OPFUSE_CODEC_IMPL_H
#define OPFUSE_CODEC_IMPL_H

#include <stdint.h>

#include "core/core-impl.h"

#define OPF_F32_ABS_MASK 0x7FFFFFFFu
#define OPF_F32_INF_BITS 0x7F800000u
#define OPF_F32_QNAN_BITS 0x7FC00000u

/* The FP8 and FP4 encoders work on a 16-bit key: the top half of the fp32
 * pattern with "some low-half bit is set" folded into bit 0. Every decision
 * they make reads the same on the key as on the full pattern: they round at
 * fp32 bit 20 or higher (bits 16.. of the sticky region stay non-zero exactly
 * when they were), and every boundary they compare against has its low 17
 * bits zero. 16-bit lanes halve the vector work of the hot loops. */
static inline uint16_t opf_f32_key16_impl(float x)
{
    uint32_t u = opf_f32_bits(x);
    return (uint16_t)((u >> 16) | ((u & 0xFFFFu) != 0));
}

/* How many entries of the ascending table t[0..n) the magnitude key a
 * exceeds. Codes of a sign-magnitude format grow with the magnitude, so the
 * count of decision boundaries passed is the code. A boundary where the tie
 * rounds up (to the even code above) is stored as its key minus 1. */
static inline int16_t opf_count_above_impl(int16_t a, const int16_t *t, int n)
{
    int16_t c = 0;
#pragma GCC unroll 8
    for (int k = 0; k < n; k++) c = (int16_t)(c + (a > t[k]));
    return c;
}

/* fp32 -> FP8 on the key (numerics.md 1.3): RNE, saturating, NaN -> 0x7F,
 * the sign kept otherwise (zeros too). rebias is the key of 2^-bias, where
 * the format's exponent field 0 sits; shift drops the key's surplus mantissa
 * bits. The magnitude is clamped to [2^-bias, max]: everything above max
 * (inf included) then encodes to max exactly. Below the smallest normal the
 * normal formula gives at most the true code and the subnormal boundary count
 * gives it exactly (on normals the count stops at the smallest normal code
 * and the formula is exact), so the code is the larger of the two. */
static inline uint8_t opf_fp8_encode_impl(float x, int16_t rebias, int shift, int16_t max_key,
                                          const int16_t *sub, int nsub)
{
    uint16_t h = opf_f32_key16_impl(x);
    int16_t s = (int16_t)((h >> 8) & 0x80), a = (int16_t)(h & 0x7FFF);
    int16_t ac = a < max_key ? a : max_key;
    ac = ac > rebias ? ac : rebias;
    int16_t r = (int16_t)(ac - rebias);
    int16_t c = (int16_t)((r + (1 << (shift - 1)) - 1 + ((r >> shift) & 1)) >> shift);
    int16_t cs = opf_count_above_impl(a, sub, nsub);
    c = c > cs ? c : cs;
    return (uint8_t)(a > 0x7F80 ? 0x7F : (s | c));
}

/* Drops the low `shift` bits of v with round to nearest even. A carry out of
 * the mantissa moves into the exponent field, which is the correct result. */
static inline uint32_t opf_rne_shift_impl(uint32_t v, unsigned shift)
{
    uint32_t half_minus_1 = (1u << (shift - 1)) - 1u;
    return (v + half_minus_1 + ((v >> shift) & 1u)) >> shift;
}

/* fp32 bits of m * 2^k for 0 <= m < 2^w, w <= 10 (exact; the result must be
 * a normal fp32). The leading 1 is moved up to bit w - 1 in fixed-size steps
 * (8, 4, 2, 1, only those w needs): fixed shifts and selects vectorize where
 * per-lane variable shifts may not. */
#define OPF_NORMALIZE_STEP(step)                                                      \
    do {                                                                              \
        uint32_t c_ = n < (1u << (t - (step) + 1));  /* leading 1 >= step below t */ \
        n = c_ ? n << (step) : n;                                                     \
        lshift += c_ ? (uint32_t)(step) : 0u;                                         \
    } while (0)

static inline uint32_t opf_small_int_bits_impl(uint32_t m, int w, int k)
{
    const int t = w - 1;
    uint32_t n = m, lshift = 0;
    if (t >= 8) OPF_NORMALIZE_STEP(8);
    if (t >= 4) OPF_NORMALIZE_STEP(4);
    if (t >= 2) OPF_NORMALIZE_STEP(2);
    if (t >= 1) OPF_NORMALIZE_STEP(1);
    /* n = 1.f * 2^t, so m * 2^k = 1.f * 2^(t + k - lshift). */
    uint32_t mant = (n & ((1u << t) - 1u)) << (23 - t);
    return m ? (((uint32_t)(127 + t + k) - lshift) << 23) | mant : 0u;
}
#undef OPF_NORMALIZE_STEP

/* ---- bf16 ------------------------------------------------------------- */

static inline uint16_t opf_f32_to_bf16_impl(float x)
{
    uint32_t u = opf_f32_bits(x);
    /* RNE on the low 16 bits; FLT_MAX and anything above 0x1.FEFFFFp127
     * carries into the exponent and becomes inf, as IEEE overflow does. */
    uint32_t r = opf_rne_shift_impl(u, 16);
    uint32_t nan = ((u >> 16) & 0x8000u) | 0x7FC0u;
    return (uint16_t)((u & OPF_F32_ABS_MASK) > OPF_F32_INF_BITS ? nan : r);
}

static inline float opf_bf16_to_f32_impl(uint16_t h)
{
    return opf_bits_f32((uint32_t)h << 16);
}

/* ---- fp16 ------------------------------------------------------------- */

/* fp32 magnitudes below 2^-14 (the fp16 min normal) onto the subnormal grid
 * of 2^-24: value = mant * 2^(e - 150), so the grid index is mant >> (126 - e)
 * rounded to nearest even. Inputs below 2^-25 shift by >= 25 and give 0. */
static inline uint32_t opf_f16_subnormal_impl(uint32_t a)
{
    int e = (int)(a >> 23);
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    int sh = 126 - e;
    sh = sh < 1 ? 1 : sh > 31 ? 31 : sh;  /* keeps the shift defined on every lane */
    uint32_t q = mant >> sh, rem = mant & ((1u << sh) - 1u), half = 1u << (sh - 1);
    return q + (uint32_t)(rem > half || (rem == half && (q & 1u)));
}

static inline uint16_t opf_f32_to_f16_impl(float x)
{
    uint32_t u = opf_f32_bits(x), a = u & OPF_F32_ABS_MASK, s = (u >> 16) & 0x8000u;
    uint32_t h = opf_rne_shift_impl(a - 0x38000000u, 13);  /* rebias 127 -> 15 */
    h = a < 0x38800000u ? opf_f16_subnormal_impl(a) : h;
    h = a >= 0x477FF000u ? 0x7C00u : h;  /* >= 65520 (the tie above 65504) and inf */
    uint32_t payload = (a & 0x7FFFFFu) >> 13;
    uint32_t nan = 0x7C00u | (payload ? payload : 1u);
    h = a > OPF_F32_INF_BITS ? nan : h;
    return (uint16_t)(s | h);
}

static inline float opf_f16_to_f32_impl(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t norm = ((e + 112u) << 23) | (m << 13);
    uint32_t special = OPF_F32_INF_BITS | (m << 13);
    uint32_t sub = opf_small_int_bits_impl(m, 10, -24);
    uint32_t mag = e == 0 ? sub : e == 31 ? special : norm;
    return opf_bits_f32(s | mag);
}

/* ---- e4m3 (numerics.md 1.1, 1.3) -------------------------------------- */

static inline uint8_t opf_f32_to_e4m3_impl(float x)
{
    /* Keys of the boundaries between subnormal codes k and k+1, (k + 1/2) *
     * 2^-9; for odd k the tie goes up to the even code, hence the - 1. The
     * last one leads to code 8, the smallest normal 2^-6. */
    static const int16_t sub[8] = {
        0x3A80, 0x3B40 - 1, 0x3BA0, 0x3BE0 - 1, 0x3C10, 0x3C30 - 1, 0x3C50, 0x3C70 - 1,
    };
    /* Exponent rebias 127 -> 7 (key 0x3C00 = 2^-7), 3 mantissa bits kept of
     * the key's 7, max 448 = key 0x43E0. */
    return opf_fp8_encode_impl(x, 0x3C00, 4, 0x43E0, sub, 8);
}

static inline float opf_e4m3_to_f32_impl(uint8_t q)
{
    uint32_t s = (uint32_t)(q & 0x80u) << 24, e = (q >> 3) & 0xFu, m = q & 0x7u;
    uint32_t norm = ((e + 120u) << 23) | (m << 20);
    uint32_t sub = opf_small_int_bits_impl(m, 3, -9);
    uint32_t mag = e == 0 ? sub : norm;
    mag = (q & 0x7Fu) == 0x7Fu ? OPF_F32_QNAN_BITS : mag;
    return opf_bits_f32(s | mag);
}

/* ---- e5m2 ------------------------------------------------------------- */

static inline uint8_t opf_f32_to_e5m2_impl(float x)
{
    /* Subnormal boundaries (k + 1/2) * 2^-16, odd-k ties round up. */
    static const int16_t sub[4] = {0x3700, 0x37C0 - 1, 0x3820, 0x3860 - 1};
    /* Rebias 127 -> 15 (key 0x3800 = 2^-15), 2 of 7 mantissa bits kept,
     * max 57344 = key 0x4760. */
    return opf_fp8_encode_impl(x, 0x3800, 5, 0x4760, sub, 4);
}

static inline float opf_e5m2_to_f32_impl(uint8_t q)
{
    uint32_t s = (uint32_t)(q & 0x80u) << 24, e = (q >> 2) & 0x1Fu, m = q & 0x3u;
    uint32_t norm = ((e + 112u) << 23) | (m << 21);
    uint32_t sub = opf_small_int_bits_impl(m, 2, -16);
    uint32_t mag = e == 0 ? sub : norm;
    mag = e == 31 ? (m ? OPF_F32_QNAN_BITS : OPF_F32_INF_BITS) : mag;
    return opf_bits_f32(s | mag);
}

/* ---- e2m1 (numerics.md 1.3 decision table) ---------------------------- */

static inline uint8_t opf_f32_to_e2m1_impl(float x)
{
    /* Keys of 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: ties at 0.75, 1.75 and 3.5
     * go up to the even code. */
    static const int16_t bounds[7] = {
        0x3E80, 0x3F40 - 1, 0x3FA0, 0x3FE0 - 1, 0x4020, 0x4060 - 1, 0x40A0,
    };
    uint16_t h = opf_f32_key16_impl(x);
    int16_t s = (int16_t)((h >> 12) & 0x8), a = (int16_t)(h & 0x7FFF);
    int16_t c = (int16_t)(s | opf_count_above_impl(a, bounds, 7));  /* inf passes all: 6 */
    return (uint8_t)(a > 0x7F80 ? 0x7 : c);
}

static inline float opf_e2m1_to_f32_impl(uint8_t code)
{
    static const float values[16] = {
        0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
    };
    return values[code & 0xFu];
}

/* ---- e8m0 (numerics.md 1.4) ------------------------------------------- */

/* Rounds up to a power of two. The sign bit is ignored, as in the anchor's
 * bit-manipulation fallback (its exponent extraction drops bit 31); inputs are
 * amax-derived, so in practice never negative. */
static inline uint8_t opf_f32_to_e8m0_impl(float x)
{
    uint32_t a = opf_f32_bits(x) & OPF_F32_ABS_MASK;
    uint32_t e = a >> 23, m = a & 0x7FFFFFu;
    uint32_t up = (m != 0) & (e != 254) & !(e == 0 && m <= 0x400000u);
    uint32_t r = e + up;
    r = a == OPF_F32_INF_BITS ? 254u : r;
    r = a > OPF_F32_INF_BITS ? 255u : r;
    return (uint8_t)r;
}

static inline float opf_e8m0_to_f32_impl(uint8_t e)
{
    uint32_t b = (uint32_t)e << 23;
    b = e == 0 ? 0x00400000u : b;  /* 2^-127 is an fp32 subnormal */
    b = e == 255 ? OPF_F32_QNAN_BITS : b;
    return opf_bits_f32(b);
}

#endif
