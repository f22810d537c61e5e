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
 * before taking the amax and quantizing. The tensor core sums the 16 products
 * in an internal order, so in rare double-rounding cases TE can differ from
 * this fixed order before the bf16 round (numerics.md 3.4.3, caveat).
 *
 * The inputs are used as given: the anchor only accepts bf16, so callers
 * round f32/f16 inputs to bf16 first (the NVFP4 quantizer does). */
#include <stdint.h>

#include "core/codec-impl.h"
#include "opfuse/quant.h"

/* Bit r of kHadamardNeg[c] is set where H16[r][c] = -1, i.e. where
 * popcount(r AND c) is odd. Column 0 is all +1. */
static const uint16_t kHadamardNeg[16] = {
    0x0000, 0xAAAA, 0xCCCC, 0x6666, 0xF0F0, 0x5A5A, 0x3C3C, 0x9696,
    0xFF00, 0x55AA, 0x33CC, 0x9966, 0x0FF0, 0xA55A, 0xC33C, 0x6996,
};

void opf_rht16(const float *x, float *y, uint16_t sign_mask)
{
    float acc[16] = {0.0f};
    /* Loop over r outside so that the 16 independent sums vectorize; each
     * acc[c] still adds its terms in the order r = 0..15. */
    for (int r = 0; r < 16; r++) {
        float t = x[r] * 0.25f;  /* exact unless it underflows */
        float p = ((sign_mask >> r) & 1u) ? -t : t, n = -p;
        for (int c = 0; c < 16; c++) acc[c] = acc[c] + (((kHadamardNeg[c] >> r) & 1u) ? n : p);
    }
    /* Written last so that x and y may be the same array. */
    for (int c = 0; c < 16; c++) y[c] = opf_bf16_to_f32_impl(opf_f32_to_bf16_impl(acc[c]));
}
