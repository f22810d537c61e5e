/* scale-impl.h: the scale-from-amax primitives of docs/numerics.md section 2,
 * shared by the per-tensor FP8, FP8 block, delayed-state and NVFP4 code. */
#ifndef OPFUSE_SCALE_IMPL_H
#define OPFUSE_SCALE_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "opfuse/dtype.h"

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

/* numerics.md 2.2: the delayed-scaling scale fl(scaled_max / amax) when amax
 * is finite and > 0, else prev; an infinite result becomes FLT_MAX. */
float opf_delayed_scale(float amax, float scaled_max, float prev);

/* numerics.md 2.3: scale_inv of a block scale, fl32(1/s) through double
 * (equal to the correctly rounded fp32 reciprocal). */
static inline float opf_block_scale_inv(float s) { return (float)(1.0 / (double)s); }

/* The scaling step every FP8 recipe shares: q[i] = cvt(fl(x[i] * s)) with the
 * saturating RNE conversion of 1.3 to qdtype (e4m3 or e5m2). */
void opf_fp8_scale_cast(const float *restrict x, int64_t n, float s, opf_dtype qdtype,
                        uint8_t *restrict q);

/* The same with one scale per element: q[i] = cvt(fl(x[i] * s[i])). */
void opf_fp8_scale_cast_each(const float *restrict x, const float *restrict s, int64_t n,
                             opf_dtype qdtype, uint8_t *restrict q);

/* lut[b] = the fp32 value of FP8 byte b of qdtype (e4m3 or e5m2), exact. */
void opf_fp8_decode_table(opf_dtype qdtype, float lut[256]);

#endif
