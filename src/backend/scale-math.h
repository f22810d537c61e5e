/* scale-math.h: the scale-from-amax primitives of docs/numerics.md section 2,
 * shared by the per-tensor FP8, FP8 block, delayed-state and NVFP4 code, and
 * the helpers of the quantizers that are not per-element loops: the FP8
 * decode table, the byte transpose of the transposed columnwise copies and
 * the Hadamard transform of NVFP4 column blocks.
 *
 * The backend owns them (src/backend/cpu/scale_math.c): its CPU kernels use
 * them, and the quant layer above it includes this header for the host-side
 * values (FP8 maxima, the Hadamard transform of opf_rht16). */
#ifndef OPFUSE_BACKEND_SCALE_MATH_H
#define OPFUSE_BACKEND_SCALE_MATH_H

#include <stdbool.h>
#include <stdint.h>

#include "core/core-impl.h"
#include "opfuse/dtype.h"
#include "opfuse/quant.h"

/* Largest finite value of an FP8 element dtype: 448 (e4m3), 57344 (e5m2);
 * 0 for any other dtype. */
float opf_fp8_max(opf_dtype qdtype);

/* Largest finite value of a high-precision input dtype (FLT_MAX, BF16_MAX =
 * 0x1.FEp127, FP16_MAX = 65504): value_for_inf of FP8 block scaling (3.5).
 * FLT_MAX for any other dtype. */
float opf_input_max_finite(opf_dtype in_dtype);

/* numerics.md 2.1: compute_scale_from_amax. amax below eps is raised to eps;
 * an amax that is 0, infinite or NaN gives 1; an infinite quotient gives
 * value_for_inf; pow2 keeps only sign and exponent. */
float opf_scale_from_amax(float amax, float fp8_max, bool pow2, float eps, float value_for_inf);

/* The same as straight-line selects (the special cases tested on the bit
 * pattern), so that a loop over many block amaxes vectorizes; the kernels'
 * files are compiled with -fno-trapping-math, which lets GCC evaluate the
 * quotient unconditionally. */
static inline float opf_scale_from_amax_impl(float amax, float fp8_max, bool pow2, float eps,
                                             float value_for_inf)
{
    float a = amax < eps ? eps : amax;  /* a NaN amax fails the test and stays NaN */
    uint32_t ab = opf_f32_bits(a) & 0x7FFFFFFFu;
    float s = fp8_max / a;
    s = (opf_f32_bits(s) & 0x7FFFFFFFu) == 0x7F800000u ? value_for_inf : s;
    /* Largest power of two <= s: drop the mantissa bits. */
    s = pow2 ? opf_bits_f32(opf_f32_bits(s) & 0xFF800000u) : s;
    return ab >= 0x7F800000u || ab == 0 ? 1.0f : s;
}

/* numerics.md 2.2: the delayed-scaling scale fl(scaled_max / amax) when amax
 * is finite and > 0, else prev; an infinite result becomes FLT_MAX. */
float opf_delayed_scale(float amax, float scaled_max, float prev);

/* numerics.md 2.3: scale_inv of a block scale, fl32(1/s) through double
 * (equal to the correctly rounded fp32 reciprocal). */
static inline float opf_block_scale_inv(float s) { return (float)(1.0 / (double)s); }

/* lut[b] = the fp32 value of FP8 byte b of qdtype (e4m3 or e5m2), exact. */
void opf_fp8_decode_table(opf_dtype qdtype, float lut[256]);

/* dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols: the byte
 * transpose behind every transposed columnwise copy. */
void opf_transpose_bytes(const uint8_t *src, int64_t lds, uint8_t *dst, int64_t ldd, int64_t rows,
                         int64_t cols);

/* numerics.md 3.4.3 on the columns of a 16 x w fp32 tile: column k of x
 * (x[r * ldx + k], r = 0..15) is transformed as opf_rht16 does (the same
 * summation order, see scale_math.c) into column k of y (y[c * ldy + k]). x and y
 * may be the same tile. */
void opf_rht16_cols(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t w,
                    uint16_t sign_mask);

/* The checks of an NVFP4 quantize entry (fn names it in messages) that the
 * dispatcher does not make: input dtype and size, 2D tiles with a rotated
 * columnwise copy, missing output components (cpu/quantize_nvfp4.c). */
opf_status opf_nvfp4_check(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                           const opf_tensor *out, const opf_layout *L, const char *fn);

#endif
