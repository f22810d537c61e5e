/* cuda-impl.h: what the .cu files of the CUDA backend share: the per-context
 * state, the call-checking macros and the device helpers (codecs, amax keys,
 * scale-from-amax) that must round exactly as the CPU reference does. */
#ifndef OPFUSE_CUDA_IMPL_H
#define OPFUSE_CUDA_IMPL_H

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "backend/cuda/cuda.h"
/* The C headers of the library, with C linkage. */
extern "C" {
#include "backend/backend-impl.h"
#include "core/core-impl.h"
#include "backend/scale-math.h"
}

/* A freed device block waiting for reuse. */
typedef struct opf_cuda_block {
    void  *ptr;
    size_t size;  /* the size class */
} opf_cuda_block;

enum { OPF_CUDA_PENDING_MAX = 4096 };  /* delayed-scaling slots between flushes */

typedef struct opf_cuda_algo_entry opf_cuda_algo_entry;

/* A delayed-scaling slot whose amax waits on the device for the next
 * opf_cuda_delayed_flush (history row 0 lives on the host). */
typedef struct opf_cuda_pending {
    opf_delayed_state *state;
    int                slot;
} opf_cuda_pending;

typedef struct opf_cuda_state {
    int              device;
    int              sm_count;
    cudaStream_t     stream;
    cublasLtHandle_t lt;
    void            *lt_ws;         /* cuBLASLt workspace */
    size_t           lt_ws_bytes;
    /* caching allocator: free blocks by size class; live blocks by pointer */
    opf_cuda_block  *free_list;
    int              n_free, cap_free;
    opf_cuda_block  *live;
    int              n_live, cap_live;
    size_t           cached_bytes;
    opf_alloc_stats  stats;
    /* pinned host staging for copies */
    void            *pinned;
    size_t           pinned_bytes;
    cudaEvent_t      staged[2];     /* the two halves of the staging buffer */
    /* device scratch of the kernels (grows; never shrinks) */
    void            *ws;
    size_t           ws_bytes;
    /* delayed scaling: one device amax per (state, slot) quantized since the
     * last flush, max-accumulated by the cast kernels */
    opf_cuda_pending *pending;
    int              n_pending;
    unsigned        *pending_amax;  /* device [OPF_CUDA_PENDING_MAX], amax bits */
    /* GEMM algorithm cache (gemm.cu) */
    opf_cuda_algo_entry *algos;
    int              n_algos, cap_algos;
} opf_cuda_state;

#ifdef __cplusplus
extern "C" {
#endif
/* The state of ctx, or NULL (and an OPF_ERR_STATE message naming fn). */
opf_cuda_state *opf_cuda_state_of(opf_ctx *ctx, const char *fn);
/* Device scratch of at least bytes, valid until the next call that asks
 * for more (stream-ordered: earlier kernels may still read the old one, so
 * growing syncs first). */
opf_status opf_cuda_scratch(opf_ctx *ctx, opf_cuda_state *s, size_t bytes, void **out);
/* The status of a failed CUDA runtime call, with its message. */
opf_status opf_cuda_fail(opf_ctx *ctx, cudaError_t e, const char *fn, const char *call);
opf_status opf_cublas_fail(opf_ctx *ctx, cublasStatus_t e, const char *fn, const char *call);
#ifdef __cplusplus
}
#endif

/* Every CUDA / cuBLAS call goes through these: on failure the function
 * returns a status naming fn, the call and CUDA's message. */
#define OPF_CUDA_TRY(ctx, fn, call)                                        \
    do {                                                                   \
        cudaError_t e_ = (call);                                           \
        if (e_ != cudaSuccess) return opf_cuda_fail((ctx), e_, (fn), #call); \
    } while (0)
#define OPF_CUBLAS_TRY(ctx, fn, call)                                      \
    do {                                                                   \
        cublasStatus_t e_ = (call);                                        \
        if (e_ != CUBLAS_STATUS_SUCCESS)                                   \
            return opf_cublas_fail((ctx), e_, (fn), #call);                \
    } while (0)
/* After a launch: the launch error, if any. */
#define OPF_CUDA_LAUNCHED(ctx, fn) OPF_CUDA_TRY(ctx, fn, cudaGetLastError())

/* ---- device helpers ------------------------------------------------------ */

/* Loads element i of a plain f32/bf16/f16 array as fp32 (exact). */
template <typename T> __device__ __forceinline__ float opf_dev_widen(T v);
template <> __device__ __forceinline__ float opf_dev_widen<float>(float v) { return v; }
template <> __device__ __forceinline__ float opf_dev_widen<__nv_bfloat16>(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float opf_dev_widen<__half>(__half v)
{
    return __half2float(v);
}

/* The amax key of numerics.md's amax: |v| as bits, 0 for NaN, so the max of
 * keys is the amax (NaN ignored, from 0) and an integer atomicMax merges. */
__device__ __forceinline__ unsigned opf_dev_amax_key(float v)
{
    unsigned a = __float_as_uint(v) & 0x7FFFFFFFu;
    return a > 0x7F800000u ? 0u : a;
}

/* fp32 -> e4m3 / e5m2: RNE, saturating, NaN -> 0x7F (1.3); the hardware
 * cvt.rn.satfinite does exactly this. */
__device__ __forceinline__ uint8_t opf_dev_to_fp8(float x, bool e4m3)
{
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
}

/* Two at a time: the low byte is x.x. */
__device__ __forceinline__ uint16_t opf_dev_to_fp8x2(float2 x, bool e4m3)
{
    return (uint16_t)__nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
}

/* FP8 byte -> fp32, exact (through fp16, which holds every e4m3/e5m2 value). */
__device__ __forceinline__ float opf_dev_from_fp8(uint8_t q, bool e4m3)
{
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, e4m3 ? __NV_E4M3 : __NV_E5M2);
    return __half2float(__half(h));
}

/* numerics.md 2.1, as opf_scale_from_amax_impl (backend/scale-math.h). */
__device__ __forceinline__ float opf_dev_scale_from_amax(float amax, float fp8_max, bool pow2,
                                                         float eps, float value_for_inf)
{
    float a = amax < eps ? eps : amax;
    unsigned ab = __float_as_uint(a) & 0x7FFFFFFFu;
    float s = __fdiv_rn(fp8_max, a);
    s = (__float_as_uint(s) & 0x7FFFFFFFu) == 0x7F800000u ? value_for_inf : s;
    s = pow2 ? __uint_as_float(__float_as_uint(s) & 0xFF800000u) : s;
    return ab >= 0x7F800000u || ab == 0 ? 1.0f : s;
}

/* Grid size of a grid-stride loop over n items at `threads` per block. */
static inline unsigned opf_cuda_grid(const opf_cuda_state *s, int64_t n, int threads)
{
    int64_t want = (n + threads - 1) / threads, cap = (int64_t)s->sm_count * 16;
    return (unsigned)(want < 1 ? 1 : want < cap ? want : cap);
}

#endif
