/* scale.cu: amax, the delayed-scaling update and the scale swizzle on the
 * GPU (backend/scale.h), bit for bit with src/backend/cpu/scale.c.
 *
 * amax: a grid-stride pass of amax keys (|x| as bits, NaN as 0), one
 * integer atomicMax per block into the fp32 result (max is order-free).
 *
 * delayed_update: one thread per slot over every state of a batch, the
 * states' descriptors passed in the kernel's parameters (copied at launch:
 * nothing for the caller to keep alive, no host synchronization), the slot
 * found by binary search over the prefix sums of the states' slot counts.
 * Its arrays are device memory, and so is the count of non-finite amaxes,
 * which a slot that meets one bumps with an atomic: the host reads the
 * count when it asks for it (quant/delayed.c), never here.
 *
 * swizzle: one thread per 4 bytes of the swizzled layout (numerics.md 4.4:
 * 4 consecutive columns of one row), read or written as one word. */
#include <float.h>

#include "backend/cuda/cuda-impl.h"

enum {
    THREADS = 256,
    VEC = 8,
    BATCH = 56,  /* delayed-scaling states per launch: the parameters stay under 4 KiB */
};

/* ---- amax ----------------------------------------------------------------- */

template <opf_dtype D>
__global__ void amax_kernel(const void *x, int64_t n, bool vec, unsigned *amax)
{
    __shared__ unsigned warp_max[THREADS / 32];
    typedef typename opf_dev_plain<D>::store S;
    unsigned key = 0;
    int64_t nc = (n + VEC - 1) / VEC, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nc; c += stride) {
        int w = n - c * VEC < VEC ? (int)(n - c * VEC) : VEC;
        float v[VEC];
        opf_dev_load8_as<D>((const S *)x + c * VEC, vec && w == VEC, w, v);
#pragma unroll
        for (int i = 0; i < VEC; i++) key = max(key, opf_dev_amax_key(v[i]));  /* pads are 0 */
    }
    key = opf_dev_max_lanes(key, 32);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = key;
    __syncthreads();
    if (threadIdx.x < 32) {
        key = opf_dev_max_lanes(threadIdx.x < THREADS / 32 ? warp_max[threadIdx.x] : 0u, 32);
        if (threadIdx.x == 0 && key) atomicMax(amax, key);
    }
}

/* ---- delayed update ------------------------------------------------------- */

typedef struct state_batch {
    opf_delayed_arrays s[BATCH];
    int64_t            first[BATCH + 1];  /* first[k]: state k's first slot; first[count]: all */
    int                count;
} state_batch;
static_assert(sizeof(state_batch) <= 4096, "delayed_kernel's parameters must fit in 4 KiB");
static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "the count is one 64-bit word");

/* numerics.md 2.2, as opf_delayed_scale. */
__device__ __forceinline__ float delayed_scale(float amax, float scaled_max, float prev)
{
    float s = isfinite(amax) && amax > 0.0f ? __fdiv_rn(scaled_max, amax) : prev;
    return isinf(s) ? FLT_MAX : s;
}

/* The CPU's update_slot: slot j of state s with this step's amax a. */
__device__ void update_slot(const opf_delayed_arrays &s, int j, float a)
{
    if (a == 0.0f) return;  /* no roll, scale unchanged */
    float *h = s.history + j;
    if (!isfinite(a)) {  /* rare: an atomic per such slot */
        if (s.nonfinite) atomicAdd((unsigned long long *)s.nonfinite, 1ull);
        if (s.reject_nonfinite) {
            h[0] = 0.0f;
            return;
        }
    }
    int64_t n = s.n, L = s.len;
    float amax = 0.0f;  /* the window: a and the L-1 previous amaxes; fmaxf skips NaN */
    for (int64_t i = 1; i < L; i++) amax = fmaxf(amax, h[i * n]);
    amax = fmaxf(amax, a);
    for (int64_t i = 1; i + 1 < L; i++) h[i * n] = h[(i + 1) * n];
    if (L > 1) h[(L - 1) * n] = a;
    h[0] = 0.0f;
    if (s.algo == OPF_AMAX_MOST_RECENT) amax = a;
    s.scale[j] = delayed_scale(amax, s.scaled_max, s.scale[j]);
}

__global__ void delayed_kernel(const __grid_constant__ state_batch b)
{
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= b.first[b.count]) return;
    int lo = opf_dev_chunk_owner(b.first, b.count, g);  /* the last state with first <= g */
    const opf_delayed_arrays &s = b.s[lo];
    int j = (int)(g - b.first[lo]);
    float a = s.reduced && s.reduced[j] != 0.0f ? s.reduced[j] : s.history[j];
    update_slot(s, j, a);
}

/* ---- swizzle ---------------------------------------------------------------- */

/* Word q of the swizzled layout holds S[i][j0..j0+3]. */
__device__ __forceinline__ void swizzle_word(int64_t q, int64_t C, int64_t *i, int64_t *j0)
{
    int64_t blk = q >> 7, r = (q & 127) << 2, cb = C >> 2;
    *i = blk / cb * 128 + ((r >> 2) & 3) * 32 + (r >> 4);
    *j0 = blk % cb * 4;
}

__global__ void swizzle_kernel(const uint8_t *src, uint8_t *dst, int64_t R, int64_t C,
                               bool transposed, bool to_swizzled, bool words)
{
    int64_t nq = R * C / 4, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < nq; q += stride) {
        int64_t i, j0;
        swizzle_word(q, C, &i, &j0);
        /* where byte k of the word sits on the compact side */
        int64_t at = transposed ? j0 * R + i : i * C + j0, step = transposed ? R : 1;
        if (to_swizzled) {
            __align__(4) uint8_t b[4];
            if (words && !transposed) *(uint32_t *)b = *(const uint32_t *)(src + at);
            else for (int k = 0; k < 4; k++) b[k] = src[at + k * step];
            if (words) ((uint32_t *)dst)[q] = *(const uint32_t *)b;
            else for (int k = 0; k < 4; k++) dst[4 * q + k] = b[k];
        } else {
            __align__(4) uint8_t b[4];
            if (words) *(uint32_t *)b = ((const uint32_t *)src)[q];
            else for (int k = 0; k < 4; k++) b[k] = src[4 * q + k];
            if (words && !transposed) *(uint32_t *)(dst + at) = *(const uint32_t *)b;
            else for (int k = 0; k < 4; k++) dst[at + k * step] = b[k];
        }
    }
}

/* ---- host side ------------------------------------------------------------------ */

static opf_status cuda_amax(opf_ctx *ctx, const opf_tensor *x, float *amax)
{
    const char *fn = "amax";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    int64_t n = opf_spec_numel(&x->spec);
    const void *xs = x->data[OPF_COMP_DATA];
    OPF_CUDA_TRY(ctx, fn, cudaMemsetAsync(amax, 0, sizeof *amax, s->stream));
    if (n == 0) return OPF_OK;
    return opf_dev_with_dtype(x->spec.dtype, [&](auto d) {
        amax_kernel<decltype(d)::value><<<opf_cuda_grid(s, (n + VEC - 1) / VEC, THREADS), THREADS, 0,
                                          s->stream>>>(xs, n, opf_cuda_aligned16(xs), (unsigned *)amax);
        OPF_CUDA_LAUNCHED(ctx, fn);
        return OPF_OK;
    });
}

static opf_status cuda_delayed_update(opf_ctx *ctx, const opf_delayed_arrays *states, int count)
{
    const char *fn = "delayed_update";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    for (int k0 = 0; k0 < count; k0 += BATCH) {
        state_batch b;
        b.count = 0;
        b.first[0] = 0;
        for (int k = k0; k < count && k < k0 + BATCH; k++) {
            if (states[k].n <= 0) continue;
            b.s[b.count] = states[k];
            b.first[b.count + 1] = b.first[b.count] + states[k].n;
            b.count++;
        }
        if (b.count == 0) continue;
        int64_t slots = b.first[b.count];
        delayed_kernel<<<(unsigned)((slots + THREADS - 1) / THREADS), THREADS, 0, s->stream>>>(b);
        OPF_CUDA_LAUNCHED(ctx, fn);
    }
    return OPF_OK;
}

static opf_status cuda_swizzle(opf_ctx *ctx, const uint8_t *src, uint8_t *dst, int64_t rows,
                               int64_t cols, bool transposed, bool to_swizzled)
{
    const char *fn = "swizzle";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    int64_t nq = rows * cols / 4;
    if (nq == 0) return OPF_OK;
    bool words = ((uintptr_t)src & 3u) == 0 && ((uintptr_t)dst & 3u) == 0;
    swizzle_kernel<<<opf_cuda_grid(s, nq, THREADS), THREADS, 0, s->stream>>>(
        src, dst, rows, cols, transposed, to_swizzled, words);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

extern "C" const opf_scale_kernels opf_cuda_scale = {
    /* .amax = */ cuda_amax,
    /* .delayed_update = */ cuda_delayed_update,
    /* .swizzle = */ cuda_swizzle,
};
