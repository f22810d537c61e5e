/* rht.c: the 16-point random Hadamard transform of numerics.md 3.4.3, applied
 * to the columnwise NVFP4 copies of activations and gradients.
 *
 * y_c = sum_r x_r * s_r * H16[r][c] / 4 with s_r = -1 where bit r of the sign
 * mask is set (0xD7E8 by default) and H16 the Sylvester Hadamard matrix.
 *
 * Summation order (fixed, so the CUDA kernel can reproduce it): for each c the
 * accumulator starts at +0.0f and adds the terms for r = 0, 1, ..., 15 one by
 * one, each addition rounded to fp32 (RNE). Each term is fl(x_r * 0.25) with
 * the sign applied afterwards, which equals fl(x_r * (+-0.25)) exactly. The
 * sum is then rounded to bf16 (RNE) and widened back to fp32, as TE does
 * before taking the amax and quantizing; a NaN sum gives the canonical +NaN
 * (0x7FC00000), whatever NaN the adds propagated (the quantizer ignores NaN
 * in amaxes and encodes every NaN to +6 anyway). Columns whose terms agree
 * in sign pattern over r = 0..j share those first j + 1 additions (the
 * compiler's common subexpressions: the same operations in the same order,
 * 171 adds instead of 256 per column). The tensor core sums the 16 products
 * in an internal order, so in rare double-rounding cases TE can differ from
 * this fixed order before the bf16 round (numerics.md 3.4.3, caveat).
 *
 * The inputs are used as given: the anchor only accepts bf16, so callers
 * round f32/f16 inputs to bf16 first (the NVFP4 quantizer does). */
#include <stdint.h>

#include "core/codec-impl.h"
#include "opfuse/quant.h"
#include "quant/scale-impl.h"

/* Bit r of kHadamardNeg[c] is set where H16[r][c] = -1, i.e. where
 * popcount(r AND c) is odd. Column 0 is all +1. */
static const uint16_t kHadamardNeg[16] = {
    0x0000, 0xAAAA, 0xCCCC, 0x6666, 0xF0F0, 0x5A5A, 0x3C3C, 0x9696,
    0xFF00, 0x55AA, 0x33CC, 0x9966, 0x0FF0, 0xA55A, 0xC33C, 0x6996,
};

/* Column k of y from column k of x, for every k < w: the loop over columns
 * is the one that vectorizes, and inside it the loops over r and c unroll,
 * so that acc[] lives in registers and whether a term enters as p or as its
 * negation is known at compile time (the data sign s_r is folded into p).
 * acc[c] adds its 16 terms in the order r = 0..15 in every lane. A column is
 * read whole before it is written, so x and y may be the same tile. NaN
 * results are made canonical because which NaN operand an add returns
 * depends on the operand order the compiler picks. */
void opf_rht16_cols(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t w,
                    uint16_t sign_mask)
{
    uint32_t flip[16];
    for (int r = 0; r < 16; r++) flip[r] = ((sign_mask >> r) & 1u) << 31;
#pragma omp simd
    for (int64_t k = 0; k < w; k++) {
        float acc[16];
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) acc[c] = 0.0f;
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
            float t = x[r * ldx + k] * 0.25f;  /* exact unless it underflows */
            float p = opf_bits_f32(opf_f32_bits(t) ^ flip[r]), n = -p;
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++) acc[c] = acc[c] + ((kHadamardNeg[c] >> r) & 1u ? n : p);
        }
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) {
            /* opf_f32_to_bf16_impl and back, in place: RNE on the low 16 bits (a
             * carry into the exponent is the correct result, inf included). */
            uint32_t b = opf_f32_bits(acc[c]);
            uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
            r = (b & OPF_F32_ABS_MASK) > OPF_F32_INF_BITS ? OPF_F32_QNAN_BITS : r;
            y[c * ldy + k] = opf_bits_f32(r);
        }
    }
}

void opf_rht16(const float *x, float *y, uint16_t sign_mask)
{
    opf_rht16_cols(x, 1, y, 1, 1, sign_mask);
}
