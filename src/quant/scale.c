/* scale.c: scale-from-amax primitives (docs/numerics.md 2.1 and 2.2). */
#include <float.h>
#include <math.h>

#include "core/codec-impl.h"
#include "core/core-impl.h"
#include "quant/scale-impl.h"

float opf_fp8_max(opf_dtype qdtype)
{
    switch (qdtype) {
    case OPF_E4M3: return 448.0f;
    case OPF_E5M2: return 57344.0f;
    default:       return 0.0f;
    }
}

float opf_input_max_finite(opf_dtype in_dtype)
{
    switch (in_dtype) {
    case OPF_BF16: return 0x1.FEp127f;
    case OPF_F16:  return 65504.0f;
    default:       return FLT_MAX;
    }
}

float opf_scale_from_amax(float amax, float fp8_max, bool pow2, float eps, float value_for_inf)
{
    if (amax < eps) amax = eps;  /* a NaN amax fails the test and stays NaN */
    if (isinf(amax) || isnan(amax) || amax == 0.0f) return 1.0f;
    float s = fp8_max / amax;
    if (isinf(s)) s = value_for_inf;
    /* Largest power of two <= s: drop the mantissa bits. */
    if (pow2) s = opf_bits_f32(opf_f32_bits(s) & 0xFF800000u);
    return s;
}

float opf_delayed_scale(float amax, float scaled_max, float prev)
{
    float s = (isfinite(amax) && amax > 0.0f) ? scaled_max / amax : prev;
    return isinf(s) ? FLT_MAX : s;
}

/* The loops are marked simd: the codecs are branch-free, and -O2's cost
 * model would otherwise not vectorize them. */
void opf_fp8_scale_cast(const float *restrict x, int64_t n, float s, opf_dtype qdtype,
                        uint8_t *restrict q)
{
    if (qdtype == OPF_E4M3) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = opf_f32_to_e4m3_impl(x[i] * s);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = opf_f32_to_e5m2_impl(x[i] * s);
    }
}

void opf_fp8_scale_cast_each(const float *restrict x, const float *restrict s, int64_t n,
                             opf_dtype qdtype, uint8_t *restrict q)
{
    if (qdtype == OPF_E4M3) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = opf_f32_to_e4m3_impl(x[i] * s[i]);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = opf_f32_to_e5m2_impl(x[i] * s[i]);
    }
}

void opf_fp8_decode_table(opf_dtype qdtype, float lut[256])
{
    for (int b = 0; b < 256; b++)
        lut[b] = qdtype == OPF_E4M3 ? opf_e4m3_to_f32_impl((uint8_t)b)
                                 : opf_e5m2_to_f32_impl((uint8_t)b);
}
