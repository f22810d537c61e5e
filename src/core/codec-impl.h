/* codec-impl.h: the scalar codecs of numerics.md section 1 as static inline
 * functions, so hot loops in any layer (quantize kernels, loaders) inline them;
 * dtype.c wraps each one as the exported opf_f32_to_X / opf_X_to_f32.
 *
 * Encoders work on the fp32 bit pattern, with integer arithmetic except the
 * one fp32 add that rounds FP8/FP4 subnormals (opf_narrow_encode_impl), so no
 * flush-to-zero / denormals-are-zero flag the host program may have set can
 * change a result. They are written as straight-line selects (no
 * data-dependent branches) so the compiler can vectorize a loop over them;
 * files with hot loops over the FP8/FP4 encoders are compiled with
 * -fno-trapping-math, without which GCC will not if-convert that fp32 add.
 * Decoders are exact and integer-only (an fp32 operation, even an exact one,
 * would keep GCC from if-converting them while -ftrapping-math is on).
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

/* Drops the low `shift` bits of v with round to nearest even. A carry out of
 * the mantissa moves into the exponent field, which is the correct result. */
static inline uint32_t opf_rne_shift_impl(uint32_t v, unsigned shift)
{
    uint32_t half_minus_1 = (1u << (shift - 1)) - 1u;
    return (v + half_minus_1 + ((v >> shift) & 1u)) >> shift;
}

/* fp32 -> a narrow sign-magnitude float format (FP8, FP4; numerics.md 1.3):
 * RNE, saturating at max (inf too), NaN -> nan_code, the sign (moved down
 * by sign_shift) kept otherwise, zeros too.
 * Normal codes are the fp32 pattern rebased and shifted: rebias is the fp32
 * pattern of the value whose code would be 0 (2^(1 - bias - 1)), shift the
 * number of fp32 mantissa bits dropped, rounded to nearest even; a carry
 * moves into the exponent field, which is the correct code. rebias has its
 * low shift + 1 bits clear, so the parity bit is read on |x| itself and the
 * constants fold into one add.
 * Below the smallest normal the code is |x| in units of the smallest
 * subnormal, rounded to nearest even by one fp32 add: magic is 2^23 units,
 * so the sum's ulp is one unit (the classic denormal trick of float -> half).
 * The add rounds the way every fp32 operation of the kernels rounds (the
 * default nearest-even mode); flush-to-zero and denormals-are-zero cannot
 * change it (magic is far from the subnormals, and a subnormal |x| encodes
 * to 0 either way).
 * Straight-line selects on 32-bit lanes, narrowed once at the end: the form
 * GCC vectorizes best (measured: about 0.16 ns per element with AVX-512). */
static inline uint32_t opf_narrow_encode_impl(float x, uint32_t max_bits, uint32_t norm_bits,
                                              uint32_t rebias, unsigned shift, float magic,
                                              unsigned sign_shift, uint32_t nan_code)
{
    uint32_t u = opf_f32_bits(x), a = u & OPF_F32_ABS_MASK;
    uint32_t c = a < max_bits ? a : max_bits;
    uint32_t normal = (c + ((1u << (shift - 1)) - 1u - rebias) + ((c >> shift) & 1u)) >> shift;
    uint32_t sub = opf_f32_bits(opf_bits_f32(c) + magic) - opf_f32_bits(magic);
    uint32_t code = c < norm_bits ? sub : normal;
    uint32_t sign = (u >> sign_shift) & (0x80000000u >> sign_shift);
    return a > OPF_F32_INF_BITS ? nan_code : (code | sign);
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
    /* max 448 = 0x43E00000, smallest normal 2^-6, code 0 at 2^-7, 3 of 23
     * mantissa bits kept, subnormal unit 2^-9 (magic 2^14), NaN 0x7F. */
    return (uint8_t)opf_narrow_encode_impl(x, 0x43E00000u, 0x3C800000u, 0x3C000000u, 20, 0x1p14f,
                                           24, 0x7Fu);
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
    /* max 57344 = 0x47600000, smallest normal 2^-14, code 0 at 2^-15, 2
     * mantissa bits kept, subnormal unit 2^-16 (magic 2^7), NaN 0x7F. */
    return (uint8_t)opf_narrow_encode_impl(x, 0x47600000u, 0x38800000u, 0x38000000u, 21, 0x1p7f,
                                           24, 0x7Fu);
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
    /* The decision table of 1.3 is this format's RNE: max 6 = 0x40C00000,
     * smallest normal 1, code 0 at 0.5, 1 mantissa bit kept, subnormal unit
     * 0.5 (magic 2^22), sign in bit 3, NaN -> +6 (code 7). */
    return (uint8_t)opf_narrow_encode_impl(x, 0x40C00000u, 0x3F800000u, 0x3F000000u, 22, 0x1p22f,
                                           28, 0x7u);
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
