/* cpu-impl.h: small helpers shared by the CPU reference kernels. */
#ifndef OPFUSE_CPU_IMPL_H
#define OPFUSE_CPU_IMPL_H

#include "core/codec-impl.h"
#include "opfuse/dtype.h"
#include "opfuse/tensor.h"

/* Reads n elements of a plain f32/bf16/f16 array starting at element i0 into
 * fp32 (exact). */
static inline void opf_cpu_load_f32(const void *src, opf_dtype dt, int64_t i0, int64_t n,
                                    float *dst)
{
    switch (dt) {
    case OPF_F32: {
        const float *s = (const float *)src + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = s[i];
        break;
    }
    case OPF_BF16: {
        const uint16_t *s = (const uint16_t *)src + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = opf_bf16_to_f32_impl(s[i]);
        break;
    }
    case OPF_F16: {
        const uint16_t *s = (const uint16_t *)src + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = opf_f16_to_f32_impl(s[i]);
        break;
    }
    default:
        for (int64_t i = 0; i < n; i++) dst[i] = 0.0f;  /* unreachable: validated above */
    }
}

/* amax of n fp32 values as numerics.md defines it: NaN ignored, from 0. */
static inline float opf_cpu_amax(const float *v, int64_t n)
{
    float a = 0.0f;
#pragma omp simd reduction(max : a)
    for (int64_t i = 0; i < n; i++) {
        float x = v[i] < 0 ? -v[i] : v[i];
        if (x > a) a = x;  /* false for NaN */
    }
    return a;
}

#endif
