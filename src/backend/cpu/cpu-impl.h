/* cpu-impl.h: small helpers shared by the CPU reference kernels. They are
 * inline and written as plain loops over restrict pointers without calls, so
 * that the compiler vectorizes them inside each kernel's own loops. */
#ifndef OPFUSE_CPU_IMPL_H
#define OPFUSE_CPU_IMPL_H

#include <omp.h>
#include <stdbool.h>

#include "core/codec-impl.h"
#include "opfuse/context.h"
#include "opfuse/dtype.h"
#include "opfuse/tensor.h"

/* Threads for a pass over `work` elements: one below par_min, where the fork
 * costs more than the work, else the context's count (0: OpenMP's default).
 * ctx may be NULL (the default). */
static inline int opf_cpu_threads(const opf_ctx *ctx, int64_t work, int64_t par_min)
{
    int t = ctx ? opf_ctx_num_threads(ctx) : 0;
    if (work < par_min) return 1;
    return t > 0 ? t : omp_get_max_threads();
}

/* Reads n elements of a plain f32/bf16/f16 array starting at element i0 into
 * fp32 (exact). */
static inline void opf_cpu_load_f32(const void *src, opf_dtype dt, int64_t i0, int64_t n,
                                    float *restrict dst)
{
    switch (dt) {
    case OPF_F32: {
        const float *restrict s = (const float *)src + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = s[i];
        break;
    }
    case OPF_BF16: {
        const uint16_t *restrict s = (const uint16_t *)src + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = opf_bf16_to_f32_impl(s[i]);
        break;
    }
    case OPF_F16: {
        const uint16_t *restrict s = (const uint16_t *)src + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = opf_f16_to_f32_impl(s[i]);
        break;
    }
    default:
        for (int64_t i = 0; i < n; i++) dst[i] = 0.0f;  /* unreachable: validated above */
    }
}

/* Asks for n elements of a plain f32/bf16/f16 array, from element i0, to be
 * brought into the cache (a hint; elements past `total` are skipped). The
 * kernels read a run of input and then compute on it; prefetching the next
 * run first lets the memory transfer overlap that computation, which the
 * hardware prefetchers alone do not achieve. */
static inline void opf_cpu_prefetch(const void *src, opf_dtype dt, int64_t i0, int64_t n,
                                    int64_t total)
{
#if defined(__GNUC__)
    if (i0 >= total) return;
    if (i0 + n > total) n = total - i0;
    size_t esz = dt == OPF_F32 ? 4 : 2;
    const char *p = (const char *)src + (size_t)i0 * esz;
    for (size_t b = 0; b < (size_t)n * esz; b += 64) __builtin_prefetch(p + b);
#else
    (void)src, (void)dt, (void)i0, (void)n, (void)total;
#endif
}

/* The magnitude of v as an integer that orders like |v| for every non-NaN v
 * and is 0 for NaN, so that amaxes (NaN ignored, from 0) become integer max
 * reductions, which vectorize on every SIMD level. Signed: the values fit,
 * and signed compares are the cheap ones. */
static inline int32_t opf_cpu_amax_key(float v)
{
    int32_t a = (int32_t)(opf_f32_bits(v) & OPF_F32_ABS_MASK);
    return a > (int32_t)OPF_F32_INF_BITS ? 0 : a;
}

/* amax of n fp32 values as numerics.md defines it: NaN ignored, from 0. */
static inline float opf_cpu_amax(const float *restrict v, int64_t n)
{
    int32_t m = 0;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; i++) {
        int32_t a = opf_cpu_amax_key(v[i]);
        m = a > m ? a : m;
    }
    return opf_bits_f32((uint32_t)m);
}

/* amax of a plain f32/bf16/f16 array of n elements (NaN ignored, from 0),
 * exact, on nt threads: a max reduction of the integer keys, on the 16-bit
 * patterns themselves for bf16/f16 (their magnitudes order the same way). */
static inline float opf_cpu_input_amax(const void *x, opf_dtype dt, int64_t n, int nt)
{
    int32_t m = 0;
    if (dt == OPF_F32) {
        const float *u = x;
#pragma omp parallel for simd num_threads(nt) reduction(max : m) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            int32_t a = opf_cpu_amax_key(u[i]);
            m = a > m ? a : m;
        }
        return opf_bits_f32((uint32_t)m);
    }
    const uint16_t *h = x;
    int32_t inf = dt == OPF_BF16 ? 0x7F80 : 0x7C00;
#pragma omp parallel for simd num_threads(nt) reduction(max : m) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        int32_t a = h[i] & 0x7FFF;
        a = a > inf ? 0 : a;
        m = a > m ? a : m;
    }
    return dt == OPF_BF16 ? opf_bf16_to_f32_impl((uint16_t)m) : opf_f16_to_f32_impl((uint16_t)m);
}

/* q[i] = cvt(fl(x[i] * s)) for the FP8 dtype qd (e4m3 or e5m2), numerics.md
 * 1.3: the scaling step every FP8 recipe shares. */
static inline void opf_cpu_fp8_cast(const float *restrict x, int64_t n, float s, opf_dtype qd,
                                    uint8_t *restrict q)
{
    if (qd == OPF_E4M3) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = opf_f32_to_e4m3_impl(x[i] * s);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = opf_f32_to_e5m2_impl(x[i] * s);
    }
}

/* q[i] = cvt(fl(x_f[i0 + i] * s)) straight from a plain f32/bf16/f16 array:
 * one loop per input and element dtype, with the widening inside. */
#define OPF_CPU_CAST_LOOP(T, widen, enc)                                        \
    do {                                                                        \
        const T *restrict x_ = (const T *)src + i0;                             \
        _Pragma("omp simd")                                                     \
        for (int64_t i = 0; i < n; i++) q[i] = enc(widen(x_[i]) * s);          \
    } while (0)
#define OPF_CPU_F32_ID(v) (v)

static inline void opf_cpu_fp8_cast_from(const void *src, opf_dtype dt, int64_t i0, int64_t n,
                                         float s, opf_dtype qd, uint8_t *restrict q)
{
    bool e4 = qd == OPF_E4M3;
    switch (dt) {
    case OPF_F32:
        if (e4) OPF_CPU_CAST_LOOP(float, OPF_CPU_F32_ID, opf_f32_to_e4m3_impl);
        else OPF_CPU_CAST_LOOP(float, OPF_CPU_F32_ID, opf_f32_to_e5m2_impl);
        break;
    case OPF_BF16:
        if (e4) OPF_CPU_CAST_LOOP(uint16_t, opf_bf16_to_f32_impl, opf_f32_to_e4m3_impl);
        else OPF_CPU_CAST_LOOP(uint16_t, opf_bf16_to_f32_impl, opf_f32_to_e5m2_impl);
        break;
    case OPF_F16:
        if (e4) OPF_CPU_CAST_LOOP(uint16_t, opf_f16_to_f32_impl, opf_f32_to_e4m3_impl);
        else OPF_CPU_CAST_LOOP(uint16_t, opf_f16_to_f32_impl, opf_f32_to_e5m2_impl);
        break;
    default:
        break;  /* unreachable: validated above */
    }
}
#undef OPF_CPU_F32_ID
#undef OPF_CPU_CAST_LOOP

/* The same with one scale per element: q[i] = cvt(fl(x[i] * s[i])). */
static inline void opf_cpu_fp8_cast_each(const float *restrict x, const float *restrict s,
                                         int64_t n, opf_dtype qd, uint8_t *restrict q)
{
    if (qd == OPF_E4M3) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = opf_f32_to_e4m3_impl(x[i] * s[i]);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) q[i] = opf_f32_to_e5m2_impl(x[i] * s[i]);
    }
}

/* opf_swizzle_index (numerics.md 4.4) inline, for C a multiple of 4 and
 * i, j >= 0: one per block in the hot loops, where a call would cost more
 * than the block's scale. */
static inline size_t opf_cpu_swizzle_index(int64_t i, int64_t j, int64_t C)
{
    uint64_t ui = (uint64_t)i, uj = (uint64_t)j;
    return (size_t)((((ui >> 7) * ((uint64_t)C >> 2) + (uj >> 2)) << 9) + ((ui & 31u) << 4) +
                    (((ui >> 5) & 3u) << 2) + (uj & 3u));
}

/* ---- elem family (src/backend/cpu/elem.c) ---- */

/* out[j] (cols values of dtype ot) = the column sum over the rows of
 * fl(x[r, j] * s[r]), or of x[r, j] when s is NULL, in lanesum.h's order;
 * x [rows, cols] of dtype dt, s [rows] of dtype st. */
void opf_cpu_colsum(const void *x, opf_dtype dt, const void *s, opf_dtype st, int64_t rows,
                    int64_t cols, void *out, opf_dtype ot);

/* Writes n fp32 values into a plain f32/bf16/f16 array from element i0,
 * rounded (RNE) to its dtype: the inverse of opf_cpu_load_f32. */
static inline void opf_cpu_store_f32(const float *restrict src, opf_dtype dt, void *dst, int64_t i0,
                                     int64_t n)
{
    switch (dt) {
    case OPF_F32: {
        float *restrict d = (float *)dst + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = src[i];
        break;
    }
    case OPF_BF16: {
        uint16_t *restrict d = (uint16_t *)dst + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = opf_f32_to_bf16_impl(src[i]);
        break;
    }
    case OPF_F16: {
        uint16_t *restrict d = (uint16_t *)dst + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = opf_f32_to_f16_impl(src[i]);
        break;
    }
    default:
        break;  /* unreachable: validated by the caller */
    }
}

#endif
