/* scale.cu: amax, the delayed-scaling update and the scale swizzle on the
 * GPU (backend/scale.h), bit for bit with src/backend/cpu/scale.c.
 *
 * amax: a grid-stride pass of amax keys (|x| as bits, NaN as 0), one
 * integer atomicMax per block into the fp32 result (max is order-free).
 *
 * delayed_update: one block per slot over every state of a batch (its
 * threads split the history's rows), the states' descriptors passed in the
 * kernel's parameters (copied at launch:
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
        for (int i = 0; i < VEC; i++) key = opf_dev_amax_max(key, v[i]);  /* pads are 0 */
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

/* The CPU's update_slot for slot j of state s, by one block: a is this
 * step's amax. The rows 1..L-1 go through in chunks of blockDim.x, one row
 * a thread: each chunk reads its rows, then (after a barrier) writes each
 * one a row lower, so every row is read before it is overwritten (a
 * chunk's first write lands in the previous chunk's last row, read a
 * barrier ago). The window's max is taken on the way (fmaxf skips NaN; the
 * values are amaxes, so the order of the max does not change its bits). */
__device__ void update_slot(const opf_delayed_arrays &s, int j, float a)
{
    __shared__ float warp_max[THREADS / 32];
    float *h = s.history + j;
    __syncthreads();  /* every thread has read row 0 (a) before it is cleared */
    if (a == 0.0f) return;  /* no roll, scale unchanged */
    bool lead = threadIdx.x == 0;
    if (!isfinite(a)) {  /* rare: one atomic per such slot */
        if (lead && s.nonfinite) atomicAdd((unsigned long long *)s.nonfinite, 1ull);
        if (s.reject_nonfinite) {
            if (lead) h[0] = 0.0f;
            return;
        }
    }
    int64_t n = s.n, L = s.len;
    float amax = 0.0f;
    for (int64_t c = 1; c < L; c += blockDim.x) {
        int64_t i = c + threadIdx.x;
        float v = i < L ? h[i * n] : 0.0f;
        amax = fmaxf(amax, v);
        __syncthreads();
        if (i >= 2 && i < L) h[(i - 1) * n] = v;
    }
    amax = fmaxf(amax, a);
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();  /* also: every write of the roll is done */
    if (!lead) return;
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) amax = fmaxf(amax, warp_max[w]);
    if (L > 1) h[(L - 1) * n] = a;
    h[0] = 0.0f;
    if (s.algo == OPF_AMAX_MOST_RECENT) amax = a;
    s.scale[j] = delayed_scale(amax, s.scaled_max, s.scale[j]);
}

/* One block a slot (the history rows are the parallel dimension: a slot's
 * roll is L serial load-store pairs for one thread, ~0.1 ms at L = 1024). */
__global__ void delayed_kernel(const __grid_constant__ state_batch b)
{
    int64_t g = blockIdx.x;
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
        /* a block a slot, of one warp up to 8: as many threads as the longest history has rows */
        int64_t slots = b.first[b.count];
        int rows = 32;
        for (int k = 0; k < b.count && rows < THREADS; k++)
            while (rows < THREADS && rows < b.s[k].len - 1) rows *= 2;
        delayed_kernel<<<(unsigned)slots, rows, 0, s->stream>>>(b);
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
