/* cuda-impl.h: what the .cu files of the CUDA backend share: the per-context
 * state, the call-checking macros and the device helpers (codecs, amax keys,
 * scale-from-amax) that must round exactly as the CPU reference does. */
#ifndef OPFUSE_CUDA_IMPL_H
#define OPFUSE_CUDA_IMPL_H

#include <string.h>

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
#include "core/device-impl.h"
#include "backend/scale-math.h"
}

/* A freed device block waiting for reuse. */
typedef struct opf_cuda_block {
    void  *ptr;
    size_t size;  /* the size class */
} opf_cuda_block;

typedef struct opf_cuda_algo_entry opf_cuda_algo_entry;
/* cuDNN's handle and attention plans (cudnn_attn.cu); NULL until first used. */
struct opf_cudnn_state;

/* Where the kernels queue work and what they may scribble on: the context's
 * stream with its cuBLASLt workspace and scratch, or the side queue's own
 * (device-impl.h's side_begin). Kernels read them from the state, which
 * holds the lane in use; the other waits in opf_cuda_state.other. */
typedef struct opf_cuda_lane {
    cudaStream_t stream;
    void        *lt_ws;
    void        *ws;
    size_t       ws_bytes;
} opf_cuda_lane;

typedef struct opf_cuda_state {
    int              device;
    int              sm_count;
    cudaStream_t     stream;        /* where work is queued: own_stream or the caller's */
    cudaStream_t     own_stream;    /* the context's own (created and destroyed here) */
    cudaEvent_t      switched;      /* orders a newly set stream after the old one */
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
    /* scratch outgrown after a capture: captured graphs may still read it,
     * so it is freed with the state, not at the growth */
    void           **ws_retired;
    int              n_retired;
    bool             captured;      /* a capture has begun on this context */
    /* a check made on the device inside a capture (nn.cu's embedding), read
     * at the next host wait: the first bad (row << 32 | id), ~0 when none */
    unsigned long long *deferred_bad;
    bool             deferred_armed;  /* a captured check exists: read it */
    /* GEMM algorithm cache, with each key's cuBLASLt descriptors (gemm.cu;
     * opf_cuda_algo_cache_clear frees them) */
    opf_cuda_algo_entry *algos;
    int              n_algos, cap_algos;
    struct opf_cudnn_state *cudnn;  /* OPF_CUDA_ATTENTION=cudnn's (cudnn_attn.cu) */
    /* the side queue (runtime.cu's opf_cuda_side_*), other.stream NULL until
     * the first fork: while on_side, stream, lt_ws, ws and ws_bytes above
     * are the side's and `other` holds the context's; otherwise `other`
     * holds the side's */
    opf_cuda_lane    other;
    bool             on_side;
    cudaEvent_t      side_fork, side_done;
    int              side_mode;     /* OPF_CUDA_SIDE: 0 never (default), 1 always, 2 auto (by size) */
} opf_cuda_state;

#ifdef __cplusplus
extern "C" {
#endif
/* The state of ctx (held in the context, set by opf_cuda_ctx_init), or NULL
 * (and an OPF_ERR_STATE message naming fn). */
opf_cuda_state *opf_cuda_state_of(opf_ctx *ctx, const char *fn);
/* Waits for ctx's stream, counted in its opf_sync_stats: the one way the
 * backend makes the host wait (a training step must not reach it). */
opf_status opf_cuda_stream_sync(opf_ctx *ctx, opf_cuda_state *s, const char *fn);
/* Device scratch of at least bytes, valid until the next call that asks
 * for more (stream-ordered: earlier kernels may still read the old one, so
 * growing syncs first). */
opf_status opf_cuda_scratch(opf_ctx *ctx, opf_cuda_state *s, size_t bytes, void **out);
/* Puts the other lane (the side queue's or the context's) in the state's
 * stream, lt_ws, ws and ws_bytes, which every kernel reads, and the one in
 * use in s->other (runtime.cu). */
void opf_cuda_swap_lanes(opf_cuda_state *s);

/* Empties the GEMM algorithm cache and frees its cuBLASLt descriptors
 * (gemm.cu). */
void opf_cuda_algo_cache_clear(opf_cuda_state *s);
/* D = alpha op(A) op(B) in fp32 (no TF32), cuBLASLt's column-major terms:
 * D m x n (ld m), op(A) m x k, op(B) k x n; batch matrices, each operand
 * sa / sb / sd elements after the one before (gemm.cu). */
opf_status opf_cuda_sgemm_batched(opf_ctx *ctx, opf_cuda_state *s, bool ta, bool tb, int64_t m,
                                  int64_t n, int64_t k, float alpha, const float *A, int64_t lda,
                                  int64_t sa, const float *B, int64_t ldb, int64_t sb, float *D,
                                  int64_t sd, int64_t batch);
/* After a host wait (stream or copy): a bad token a captured embedding
 * found on the device since the last read, as OPF_ERR_INVALID_ARG naming
 * the row and the id (runtime.cu). OPF_OK when none or nothing captured. */
opf_status opf_cuda_deferred_check(opf_ctx *ctx, opf_cuda_state *s);
/* nn.h's attention entries; nn.cu's pick one by OPF_CUDA_ATTENTION: auto
 * (the default) cuDNN's where the library loads, else flash2; flash2 the
 * tiled tensor-core kernels (flash.cu: D 64 or 128 and 16-byte aligned
 * arrays, else the GEMMs; for in_dt bf16 or f16 16-bit products on
 * mma.sync, S and P in registers, reading and writing that dtype's storage;
 * TF32 for the rest); flash the same with WMMA for 16-bit too; gemm batched
 * fp32 GEMMs (attn.cu; in_dt unused); exact nn.cu's own, the CPU's bits;
 * cudnn and cudnn-atomic cuDNN's fused flash attention (cudnn_attn.cu:
 * in_dt bf16 or f16, D a multiple of 8 up to 128, T >= 2, 16-byte aligned
 * arrays, else flash2's entries; OPF_ERR_UNSUPPORTED naming why where cuDNN
 * is not built in or does not load). qkv_t, dout_t and dqkv_t: the arrays'
 * storage dtypes (nn.h). o: fp32 here, nn.h's o_t around these through
 * opf_cuda_attn_fwd_typed_o (cuDNN's entries take o_t themselves). */
opf_status opf_cuda_attn_fwd_gemm(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, float *o,
                                  float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                  opf_dtype in_dt);
opf_status opf_cuda_attn_bwd_gemm(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const float *o,
                                  const float *lse, const void *dout, opf_dtype dout_t, void *dqkv,
                                  opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H, int64_t D,
                                  opf_dtype in_dt);
opf_status opf_cuda_attn_fwd_flash(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, float *o,
                                   float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                   opf_dtype in_dt);
opf_status opf_cuda_attn_fwd_flash2(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, float *o,
                                    float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                    opf_dtype in_dt);
opf_status opf_cuda_attn_bwd_flash(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const float *o,
                                   const float *lse, const void *dout, opf_dtype dout_t,
                                   void *dqkv, opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H,
                                   int64_t D, opf_dtype in_dt);
opf_status opf_cuda_attn_bwd_flash2(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t,
                                    const float *o, const float *lse, const void *dout,
                                    opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t, int64_t B,
                                    int64_t T, int64_t H, int64_t D, opf_dtype in_dt);
/* flash2's backward with dQ added inside the dK dV kernel, in a fixed order
 * (OPF_CUDA_ATTENTION=flash1p; its forward is flash2's). */
opf_status opf_cuda_attn_bwd_flash1p(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t,
                                     const float *o, const float *lse, const void *dout,
                                     opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t, int64_t B,
                                     int64_t T, int64_t H, int64_t D, opf_dtype in_dt);
/* How the cuDNN entries run: AUTO (the default path) cuDNN where the
 * library loads, else flash2's entries, silently; flash2 also for a
 * backward whose deterministic dP workspace would pass 1 GiB, and, with a
 * warning once, for a call whose graph cuDNN refuses or whose workspace
 * does not fit (cudnn_attn.cu; no such call on the H200); ON cuDNN, or
 * OPF_ERR_UNSUPPORTED naming why it does not load; ATOMIC as ON with the
 * backward's dQ through cuDNN's atomic fp32 accumulator (faster, not
 * deterministic) instead of its deterministic kernel. Calls cuDNN does not
 * take (cudnn_attn.cu: cudnn_fits) go to flash2 in every mode. */
typedef enum opf_cudnn_use { OPF_CUDNN_AUTO, OPF_CUDNN_ON, OPF_CUDNN_ATOMIC } opf_cudnn_use;
opf_status opf_cuda_attn_fwd_cudnn(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, void *o,
                                   opf_dtype o_t, float *lse, int64_t B, int64_t T, int64_t H,
                                   int64_t D, opf_dtype in_dt, opf_cudnn_use mode);
opf_status opf_cuda_attn_bwd_cudnn(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t,
                                   const void *o, opf_dtype o_t, const float *lse,
                                   const void *dout, opf_dtype dout_t, void *dqkv,
                                   opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H, int64_t D,
                                   opf_dtype in_dt, opf_cudnn_use mode);
/* The entries above with an fp32 o (all but cuDNN's), as one type. */
typedef opf_status (*opf_cuda_attn_fwd_o32_fn)(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t,
                                               float *o, float *lse, int64_t B, int64_t T,
                                               int64_t H, int64_t D, opf_dtype in_dt);
typedef opf_status (*opf_cuda_attn_bwd_o32_fn)(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t,
                                               const float *o, const float *lse,
                                               const void *dout, opf_dtype dout_t, void *dqkv,
                                               opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H,
                                               int64_t D, opf_dtype in_dt);
/* nn.h's attention entries (o stored as o_t) over an entry f with an fp32
 * o (attn.cu), the one place such paths convert o: the forward runs f into
 * o itself when o_t is f32, else into fp32 device scratch that one cast
 * then rounds into o (RNE, each value once: the CPU's bits where f gives
 * its fp32 o); the backward hands f o itself when f32, else o widened into
 * device scratch (exact). A missing scratch is OPF_ERR_NO_MEMORY naming fn
 * and the bytes. */
opf_status opf_cuda_attn_fwd_typed_o(opf_ctx *ctx, const char *fn, opf_cuda_attn_fwd_o32_fn f,
                                     const void *qkv, opf_dtype qkv_t, void *o, opf_dtype o_t,
                                     float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                     opf_dtype in_dt);
opf_status opf_cuda_attn_bwd_typed_o(opf_ctx *ctx, const char *fn, opf_cuda_attn_bwd_o32_fn f,
                                     const void *qkv, opf_dtype qkv_t, const void *o,
                                     opf_dtype o_t, const float *lse, const void *dout,
                                     opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t, int64_t B,
                                     int64_t T, int64_t H, int64_t D, opf_dtype in_dt);
/* Frees cuDNN's handle and plans of a CUDA state (runtime.cu's destroy,
 * after the stream is idle). NULL: no-op. */
void opf_cudnn_state_free(struct opf_cudnn_state *c);
/* n values of plain dtype xt at x into y as yt, on the context's stream
 * (elem.cu's cast: widening exact, narrowing RNE). */
opf_status opf_cuda_attn_cast(opf_ctx *ctx, const void *x, opf_dtype xt, void *y, opf_dtype yt,
                              int64_t n);
/* The arrays of an attention call as kernels of one input dtype in_t and
 * one output dtype out_t take them (attn.cu): qkv and dout (NULL: none) the
 * caller's or copies cast into device scratch; dqkv (NULL: none) the
 * caller's or scratch that close casts into it. Open marks the context's
 * scratch and close (after the kernels, passing their status on) pops it.
 * A missing scratch is OPF_ERR_NO_MEMORY naming fn, the array and the
 * bytes. nq: qkv's values, B T 3C. */
typedef struct opf_cuda_attn_io {
    const void *qkv, *dout;
    void       *dqkv;
    void       *out;  /* the caller's dqkv, of out_t */
    opf_dtype   out_t, kernel_out_t;
    int64_t     nq;
    size_t      mark;
} opf_cuda_attn_io;
opf_status opf_cuda_attn_io_open(opf_ctx *ctx, const char *fn, opf_cuda_attn_io *io,
                                 const void *qkv, opf_dtype qkv_t, const void *dout,
                                 opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t, opf_dtype in_t,
                                 opf_dtype out_t, int64_t nq);
opf_status opf_cuda_attn_io_close(opf_ctx *ctx, const opf_cuda_attn_io *io, opf_status st);
/* An fp32 attention body run on typed storage: the arrays widened, dqkv
 * written through fp32 (the gemm and exact paths). */
typedef opf_status (*opf_cuda_attn_fwd_fn)(opf_ctx *ctx, const float *qkv, float *o, float *lse,
                                           int64_t B, int64_t T, int64_t H, int64_t D);
typedef opf_status (*opf_cuda_attn_bwd_fn)(opf_ctx *ctx, const float *qkv, const float *o,
                                           const float *lse, const float *dout, float *dqkv,
                                           int64_t B, int64_t T, int64_t H, int64_t D);
opf_status opf_cuda_attn_fwd_f32(opf_ctx *ctx, opf_cuda_attn_fwd_fn body, const void *qkv,
                                 opf_dtype qkv_t, float *o, float *lse, int64_t B, int64_t T,
                                 int64_t H, int64_t D, const char *fn);
opf_status opf_cuda_attn_bwd_f32(opf_ctx *ctx, opf_cuda_attn_bwd_fn body, const void *qkv,
                                 opf_dtype qkv_t, const float *o, const float *lse,
                                 const void *dout, opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t,
                                 int64_t B, int64_t T, int64_t H, int64_t D, const char *fn);
/* Bytes rounded up to 256: scratch regions carved from one allocation each
 * start aligned for any access. */
static inline size_t opf_cuda_pad256(size_t bytes) { return (bytes + 255) / 256 * 256; }

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

/* A setting made once per device and kernel (cudaFuncSetAttribute applies
 * to the current device only): *flags holds a bit per device, read and set
 * atomically (contexts on several threads); a device past 63 is always
 * still to do, which only repeats a cheap call. */
static inline bool opf_cuda_once_needed(const unsigned long long *flags, int dev)
{
    return dev < 0 || dev > 63 || !((__atomic_load_n(flags, __ATOMIC_ACQUIRE) >> dev) & 1ull);
}
static inline void opf_cuda_once_done(unsigned long long *flags, int dev)
{
    if (dev >= 0 && dev <= 63) __atomic_fetch_or(flags, 1ull << dev, __ATOMIC_RELEASE);
}

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

/* Amax keys. numerics.md's amax (NaN ignored, from 0) is kept as a key:
 * the bits of the float max(|v|), a NaN counting 0, so that an integer max
 * or atomicMax of keys (the keys of floats >= 0 order as the floats) merges
 * partial amaxes. opf_dev_amax_acc max-accumulates |v| into such a float in
 * one FMNMX (fmaxf returns the number when v is NaN); opf_dev_amax_max does
 * it on a key. Masking the NaNs out of an integer key took four ALU
 * instructions an element, in kernels whose ALU is their bottleneck. */
__device__ __forceinline__ float opf_dev_amax_acc(float m, float v) { return fmaxf(m, fabsf(v)); }

__device__ __forceinline__ unsigned opf_dev_amax_max(unsigned key, float v)
{
    return __float_as_uint(opf_dev_amax_acc(__uint_as_float(key), v));
}

/* Merges a warp's amax keys into *amax (one atomic a warp; 0 adds nothing). */
__device__ __forceinline__ void opf_dev_warp_amax(unsigned key, unsigned *amax)
{
    for (int o = 16; o; o >>= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, o));
    if ((threadIdx.x & 31) == 0 && key) atomicMax(amax, key);
}

/* Asynchronous 16-byte copies global -> shared (cp.async; both addresses
 * 16-byte aligned): issue, commit the thread's issued copies as a group,
 * wait until at most PENDING of its groups are still in flight. */
__device__ __forceinline__ void opf_dev_copy16_async(void *smem, const void *g)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g) : "memory");
}
__device__ __forceinline__ void opf_dev_copies_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int PENDING> __device__ __forceinline__ void opf_dev_copies_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

/* The owner of chunk c in a multi-tensor launch (optim.cu, nn.cu's
 * clipping, scale.cu's delayed update): the last k < count with first[k] <=
 * c, first[] the prefix sums of the tensors' chunk (or slot) counts. */
__device__ __forceinline__ int opf_dev_chunk_owner(const int64_t *first, int count, int64_t c)
{
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= c) lo = mid;
        else hi = mid - 1;
    }
    return lo;
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

/* Loads 8 elements x[0..8) as fp32: 16-byte loads (two for f32); x must be
 * 16-byte aligned. */
template <typename T> __device__ __forceinline__ void opf_dev_load8(const T *x, float v[8])
{
    if (sizeof(T) == 2) {
        uint4 u = *(const uint4 *)x;
        const T *h = (const T *)&u;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = opf_dev_widen<T>(h[i]);
    } else {
        float4 a = *(const float4 *)x, b = *(const float4 *)(x + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
}

/* Loads the n <= 8 elements of x[0..n) that exist, zeros after: the tail
 * path of the tiled kernels (0 is neutral for every amax). */
template <typename T>
__device__ __forceinline__ void opf_dev_load8_part(const T *x, int n, float v[8])
{
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = i < n ? opf_dev_widen<T>(x[i]) : 0.0f;
}

/* 8 bytes cvt(fl(v[i] * s[i])), element 0 in the low byte. */
__device__ __forceinline__ uint2 opf_dev_cast8(const float v[8], const float s[8], bool e4m3)
{
    uint32_t w[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint32_t lo = opf_dev_to_fp8x2(make_float2(v[4 * h] * s[4 * h], v[4 * h + 1] * s[4 * h + 1]), e4m3);
        uint32_t hi = opf_dev_to_fp8x2(make_float2(v[4 * h + 2] * s[4 * h + 2], v[4 * h + 3] * s[4 * h + 3]),
                                       e4m3);
        w[h] = lo | hi << 16;
    }
    return make_uint2(w[0], w[1]);
}

/* Stores the 8 bytes b to q[0..n), n <= 8: whole when vec (q 8-byte
 * aligned, n == 8), else byte by byte. */
__device__ __forceinline__ void opf_dev_store8(uint8_t *q, uint2 b, int n, bool vec)
{
    if (vec) {
        *(uint2 *)q = b;
        return;
    }
    const uint8_t *bb = (const uint8_t *)&b;
    for (int i = 0; i < n; i++) q[i] = bb[i];
}

/* The max of key over the lanes xor-reachable through masks below `width`
 * (a power of two): the lanes of one block of width threads. */
__device__ __forceinline__ unsigned opf_dev_max_lanes(unsigned key, int width)
{
    for (int o = 1; o < width; o <<= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, o));
    return key;
}

/* numerics.md 1.4: fp32 -> E8M0, rounding up (as opf_f32_to_e8m0_impl). */
__device__ __forceinline__ uint8_t opf_dev_to_e8m0(float x)
{
    unsigned a = __float_as_uint(x) & 0x7FFFFFFFu, e = a >> 23, m = a & 0x7FFFFFu;
    unsigned r = e + ((m != 0) & (e != 254) & !(e == 0 && m <= 0x400000u));
    r = a == 0x7F800000u ? 254u : r;
    return (uint8_t)(a > 0x7F800000u ? 255u : r);
}

/* 1.4: the encode multiplier 2^(127-E); E=254 -> 2^-127, E=255 -> NaN. */
__device__ __forceinline__ float opf_dev_e8m0_mult(uint8_t e)
{
    unsigned b = (unsigned)(254 - e) << 23;
    b = e == 254 ? 0x00400000u : b;
    return __uint_as_float(e == 255 ? 0x7FC00000u : b);
}

/* 1.4: the decode scale 2^(E-127); E=0 -> 2^-127, E=255 -> NaN. */
__device__ __forceinline__ float opf_dev_e8m0_scale(uint8_t e)
{
    unsigned b = (unsigned)e << 23;
    b = e == 0 ? 0x00400000u : b;
    return __uint_as_float(e == 255 ? 0x7FC00000u : b);
}

/* fl(fp8(q) * s) with the CPU's NaN bits: its decode of a NaN code is the
 * quiet NaN with the code's sign, which x86 multiplies pass through, and a
 * NaN scale with a number gives the scale's 0x7FC00000 (the GPU would
 * canonicalize both). */
__device__ __forceinline__ float opf_dev_dequant(uint8_t q, float s, bool e4m3)
{
    float v = opf_dev_from_fp8(q, e4m3), r = v * s;
    if (!isnan(r)) return r;
    return __uint_as_float(isnan(v) ? (uint32_t)(q & 0x80u) << 24 | 0x7FC00000u : 0x7FC00000u);
}

/* numerics.md 4.4: where S[i][j] of a scale matrix with C columns (a
 * multiple of 4) lives in the GEMM-swizzled layout. */
__device__ __forceinline__ int64_t opf_dev_swizzle_index(int64_t i, int64_t j, int64_t C)
{
    return (((i >> 7) * (C >> 2) + (j >> 2)) << 9) + ((i & 31) << 4) + (((i >> 5) & 3) << 2) +
           (j & 3);
}

/* Whether p allows 16-byte accesses. */
static inline bool opf_cuda_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Grid size of a grid-stride loop over n items at `threads` per block. */
static inline unsigned opf_cuda_grid(const opf_cuda_state *s, int64_t n, int threads)
{
    int64_t want = (n + threads - 1) / threads, cap = (int64_t)s->sm_count * 16;
    return (unsigned)(want < 1 ? 1 : want < cap ? want : cap);
}

/* The columnwise copy of a quantized ROWS x COLS byte tile in shared memory:
 * row k of qt ([K, M], transposed) gets tile column k, 16 bytes (16 tile rows)
 * a store; neighbouring lanes read neighbouring columns (no bank conflicts).
 * vec: 16-byte stores (M % 16 == 0 and qt aligned), else byte by byte at the
 * edges. The caller has synchronized after writing the tile. */
template <int ROWS, int COLS, int NTHREADS>
__device__ __forceinline__ void opf_dev_store_tile_t(const uint8_t (&tile)[ROWS][COLS], uint8_t *qt,
                                                     int64_t m0, int64_t k0, int64_t M, int64_t K,
                                                     bool vec)
{
    for (int it = threadIdx.x; it < COLS * (ROWS / 16); it += NTHREADS) {
        int c = it % COLS, mc = it / COLS;
        int64_t kc = k0 + c, m = m0 + mc * 16;
        if (kc >= K || m >= M) continue;
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            w[j] = tile[mc * 16 + 4 * j][c] | tile[mc * 16 + 4 * j + 1][c] << 8 |
                   tile[mc * 16 + 4 * j + 2][c] << 16 | (uint32_t)tile[mc * 16 + 4 * j + 3][c] << 24;
        if (vec) {
            *(uint4 *)(qt + kc * M + m) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
            const uint8_t *bb = (const uint8_t *)w;
            for (int i = 0; i < 16 && m + i < M; i++) qt[kc * M + m + i] = bb[i];
        }
    }
}

/* Philox4x32-10 on the device, the same function as src/core/philox.c (the
 * CPU's), so dropout, stochastic rounding and initial values draw the same
 * words for the same (counter, key) on both devices. */
__device__ __forceinline__ uint4 opf_dev_philox(uint4 c, uint2 k)
{
#pragma unroll
    for (int r = 0; r < 10; r++) {
        uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

/* The words of counter `ctr` (a 64-bit index: counter {lo, hi, stream, 0})
 * under the 64-bit seed, as the CPU kernels form them. */
__device__ __forceinline__ uint4 opf_dev_philox_at(uint64_t seed, uint64_t ctr, uint32_t stream)
{
    return opf_dev_philox(make_uint4((uint32_t)ctr, (uint32_t)(ctr >> 32), stream, 0u),
                          make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
}


/* ---- celem: the CPU's bits for plain dtypes and NaNs (elem, optim) --------
 * The CPU reference converts with the codecs of src/core/codec-impl.h and
 * computes with x86 SSE/AVX arithmetic; these give the same bits where the
 * GPU's own would differ: f16 NaN payloads kept both ways (the hardware
 * canonicalizes), bf16 NaN as sign | 0x7FC0, and NaN results as x86 makes
 * them (below). */

/* x86's NaN of a NaN result r = a op b: the first NaN operand, quieted; with
 * no NaN operand (inf - inf, 0 * inf, 0 / 0) the "indefinite" 0xFFC00000.
 * The GPU gives 0x7FFFFFFF for all. Operands in the CPU source's order (when
 * both are NaN the CPU compiler's operand order decides: equal NaNs agree).
 * Written as selects, not branches: a branch per add split the chains of
 * ordered sums into blocks the compiler would not schedule across, so each
 * term's loads and arithmetic waited on the previous add. */
__device__ __forceinline__ float opf_dev_x86_nan(float r, float a, float b)
{
    const unsigned ua = __float_as_uint(a), ub = __float_as_uint(b);
    const unsigned q = (ua << 1) > 0xFF000000u   ? ua | 0x00400000u
                       : (ub << 1) > 0xFF000000u ? ub | 0x00400000u
                                                 : 0xFFC00000u;
    return (__float_as_uint(r) << 1) > 0xFF000000u ? __uint_as_float(q) : r;
}
/* One IEEE fp32 operation each, never contracted into an FMA (the CPU
 * builds with -ffp-contract=off), NaNs as x86's. */
__device__ __forceinline__ float opf_dev_add(float a, float b)
{
    return opf_dev_x86_nan(__fadd_rn(a, b), a, b);
}
__device__ __forceinline__ float opf_dev_sub(float a, float b)
{
    return opf_dev_x86_nan(__fsub_rn(a, b), a, b);
}
__device__ __forceinline__ float opf_dev_mul(float a, float b)
{
    return opf_dev_x86_nan(__fmul_rn(a, b), a, b);
}
__device__ __forceinline__ float opf_dev_div(float a, float b)
{
    return opf_dev_x86_nan(__fdiv_rn(a, b), a, b);
}
__device__ __forceinline__ float opf_dev_sqrt(float a)
{
    return opf_dev_x86_nan(__fsqrt_rn(a), a, a);
}

/* The storage of a plain f32/bf16/f16 element. */
template <opf_dtype D> struct opf_dev_plain { typedef uint16_t store; };
template <> struct opf_dev_plain<OPF_F32> { typedef float store; };

/* Exact widening, as opf_cpu_load_f32 (f16 NaN payloads kept unquieted). */
template <opf_dtype D>
__host__ __device__ __forceinline__ float opf_dev_to_f32(typename opf_dev_plain<D>::store v)
{
    float f;
    if (D == OPF_F32) {
        memcpy(&f, &v, 4);
        return f;
    }
    uint16_t h16;
    memcpy(&h16, &v, 2);
    uint32_t h = h16, b = h << 16;
    if (D == OPF_F16) {
        if ((h & 0x7C00u) != 0x7C00u || !(h & 0x3FFu)) {
            __half_raw r;
            r.x = (unsigned short)h;
            return __half2float(__half(r));
        }
        b = (h & 0x8000u) << 16 | 0x7F800000u | (h & 0x3FFu) << 13;
    }
    memcpy(&f, &b, 4);
    return f;
}

/* fp32 -> D with RNE, as opf_cpu_store_f32: bf16 NaN -> sign | 0x7FC0, f16
 * NaN keeps the top payload bits (1 if they are 0). */
template <opf_dtype D>
__host__ __device__ __forceinline__ typename opf_dev_plain<D>::store opf_dev_from_f32(float x)
{
    typename opf_dev_plain<D>::store out;
    if (D == OPF_F32) {
        memcpy(&out, &x, 4);
        return out;
    }
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t a = u & 0x7FFFFFFFu, s16 = (u >> 16) & 0x8000u, pl = (a & 0x7FFFFFu) >> 13;
    uint16_t h;
    if (D == OPF_BF16) {
        __nv_bfloat16 b = __float2bfloat16_rn(x);
        memcpy(&h, &b, 2);
        h = a > 0x7F800000u ? (uint16_t)(s16 | 0x7FC0u) : h;
    } else {
        __half f = __float2half_rn(x);
        memcpy(&h, &f, 2);
        h = a > 0x7F800000u ? (uint16_t)(s16 | 0x7C00u | (pl ? pl : 1u)) : h;
    }
    memcpy(&out, &h, 2);
    return out;
}

/* 8 elements of a plain array at p as fp32: 16-byte loads when vec (p
 * 16-byte aligned, all 8 exist), else the n that exist (zeros after). */
template <opf_dtype D>
__device__ __forceinline__ void opf_dev_load8_as(const void *p, bool vec, int n, float v[8])
{
    typedef typename opf_dev_plain<D>::store S;
    const S *x = (const S *)p;
    if (vec) {
        __align__(16) S e[8];
        *(uint4 *)e = *(const uint4 *)x;
        if (sizeof(S) == 4) *(uint4 *)(e + 4) = *(const uint4 *)(x + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = opf_dev_to_f32<D>(e[i]);
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = i < n ? opf_dev_to_f32<D>(x[i]) : 0.0f;
}

/* The inverse: 8 (vec) or the first n values rounded into p. */
template <opf_dtype D>
__device__ __forceinline__ void opf_dev_store8_as(void *p, bool vec, int n, const float v[8])
{
    typedef typename opf_dev_plain<D>::store S;
    S *y = (S *)p;
    __align__(16) S e[8];
#pragma unroll
    for (int i = 0; i < 8; i++) e[i] = opf_dev_from_f32<D>(v[i]);
    if (vec) {
        *(uint4 *)y = *(const uint4 *)e;
        if (sizeof(S) == 4) *(uint4 *)(y + 4) = *(const uint4 *)(e + 4);
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)  /* constant indices: e stays in registers */
        if (i < n) y[i] = e[i];
}

/* A dtype as a type, to hand a run-time f32/bf16/f16 dtype to templates:
 *     opf_dev_with_dtype(dt, [&](auto d) { return run<decltype(d)::value>(...); }); */
template <opf_dtype D> struct opf_dev_dtype { static constexpr opf_dtype value = D; };
template <class F> static inline opf_status opf_dev_with_dtype(opf_dtype dt, F f)
{
    switch (dt) {
    case OPF_F32: return f(opf_dev_dtype<OPF_F32>());
    case OPF_BF16: return f(opf_dev_dtype<OPF_BF16>());
    default: return f(opf_dev_dtype<OPF_F16>());
    }
}

/* ---- 16-byte stores (optimizer, cast+transpose) ------------------------------
 * 8 values of a plain dtype packed into registers and stored with one
 * st.global.v4 per 16 bytes. Written as PTX: a uint4 store of reinterpreted
 * or packed words comes out of the compiler as scalar stores, which split
 * each warp's store into four times the transactions. */
__device__ __forceinline__ void opf_dev_st16(void *p, uint32_t a, uint32_t b, uint32_t c, uint32_t d)
{
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}

/* v[0..8) as D into p, 16-byte aligned. */
template <opf_dtype D> __device__ __forceinline__ void opf_dev_store8_vec(void *p, const float v[8])
{
    if constexpr (D == OPF_F32) {
        opf_dev_st16(p, __float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                     __float_as_uint(v[3]));
        opf_dev_st16((float *)p + 4, __float_as_uint(v[4]), __float_as_uint(v[5]),
                     __float_as_uint(v[6]), __float_as_uint(v[7]));
    } else {
        uint32_t u[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            u[i] = (uint32_t)opf_dev_from_f32<D>(v[2 * i]) |
                   (uint32_t)opf_dev_from_f32<D>(v[2 * i + 1]) << 16;
        opf_dev_st16(p, u[0], u[1], u[2], u[3]);
    }
}

#endif
