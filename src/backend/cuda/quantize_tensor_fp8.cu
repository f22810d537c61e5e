/* quantize_tensor_fp8.cu: per-tensor FP8 on the GPU, bit for bit with
 * src/backend/cpu/quantize_tensor_fp8.c (docs/numerics.md 3.1, 3.2).
 *
 * Current scaling: one pass for the amax (an integer max of |x| bit
 * patterns, NaN ignored), then one fused cast + transpose pass that derives
 * the scale from that amax on every thread (no host round trip); a tensor
 * that fits one wave takes both in one cooperative launch (below). Delayed
 * scaling: the scale is read from the state's device memory, and the cast
 * pass computes the amax itself, into the tensor and max-accumulated into
 * the slot's entry of history row 0, also in device memory (no host sync).
 *
 * The cast + transpose pass is the tile of quantize-tile.h (128 x 64: a
 * quad of 4 rows x 8 columns a thread): the rowwise bytes go straight out,
 * the columnwise ones through the transposed shared tile, 16 bytes a store.
 * The flat passes (the amax, and the rowwise cast alone) load 64 bytes (the
 * amax) or 32 (the cast) a thread at once, with as many blocks as the
 * device holds, which sweep the tensor together.
 *
 * Pass order: a pass that follows the tensor's producer (the amax pass, the
 * delayed cast, the cast after a fused amax) reads it from the end, where
 * the producer's last writes may still sit in L2; the cast after the amax
 * pass reads from the start, where that pass ended. */
#include <float.h>
#include <stdlib.h>

#include <cooperative_groups.h>

#include "backend/cuda/quantize-tile.h"

enum {
    VEC = 8,            /* elements per thread access */
    TILE_K = 64,        /* columns of a cast + transpose tile (OPF_QT_ROWS rows) */
    TILE_THREADS = TILE_K / VEC * OPF_QT_QUADS,  /* one quad each: 256 */
    FLAT_THREADS = 256,
    FLAT_BLOCKS = 8,    /* per SM, all resident: 2048 threads of <= 32 registers */
    FLAT_BYTES = 64,    /* input bytes an amax-pass thread loads at once (a cast
                           thread half: 32 registers hold no more beside its bytes) */
    DQ_THREADS = 256,
    DQ_TILE = 32,       /* edge of the dequantizing transpose tile */
};

/* Where the scale comes from: the amax on the device (current scaling) or
 * the delayed state's slot in device memory (delayed scaling). */
typedef struct scale_src {
    const unsigned *amax_bits;  /* current: the amax as bits; NULL for delayed */
    const float    *scale;      /* delayed: the slot's scale; NULL: 1 (the amax pass) */
    float           fp8_max, eps;
    bool            pow2;
} scale_src;

__device__ __forceinline__ float scale_of(const scale_src &src)
{
    if (!src.amax_bits) return src.scale ? *src.scale : 1.0f;
    return opf_dev_scale_from_amax(__uint_as_float(*src.amax_bits), src.fp8_max, src.pow2,
                                   src.eps, FLT_MAX);
}

/* 8 bytes cvt(fl(v * s)), element 0 in the low byte. */
__device__ __forceinline__ uint2 cast8(const float v[VEC], float s, bool e4m3)
{
    uint32_t w[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint32_t lo = opf_dev_to_fp8x2(make_float2(v[4 * h] * s, v[4 * h + 1] * s), e4m3);
        uint32_t hi = opf_dev_to_fp8x2(make_float2(v[4 * h + 2] * s, v[4 * h + 3] * s), e4m3);
        w[h] = lo | hi << 16;
    }
    return make_uint2(w[0], w[1]);
}

/* The block's max key into *amax and, if not NULL, *amax2 (one atomic each
 * per block). */
__device__ __forceinline__ void block_amax(unsigned key, unsigned *amax, unsigned *amax2)
{
    __shared__ unsigned warp_max[32];
    for (int o = 16; o > 0; o >>= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    if (lane == 0) warp_max[warp] = key;
    __syncthreads();
    if (warp == 0) {
        key = lane < nwarps ? warp_max[lane] : 0u;
        for (int o = 16; o > 0; o >>= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, o));
        if (lane == 0 && key) {
            atomicMax(amax, key);
            if (amax2) atomicMax(amax2, key);
        }
    }
}

/* ---- flat passes: the amax alone, or the rowwise cast -------------------
 * A grid-stride loop over 8-element chunks, U at a time (16-byte loads when
 * vec), chunk c being chunk nv - 1 - c when rev; then the tail element by
 * element. CAST false: the amax pass (the scale arguments unused). AMAX:
 * the amax of x into *amax (and *amax2). */
template <typename T, bool CAST, bool AMAX>
__global__ void __launch_bounds__(FLAT_THREADS, FLAT_BLOCKS)
flat_kernel(const T *__restrict__ x, int64_t n, bool vec, bool rev, scale_src src, bool e4m3,
            uint8_t *__restrict__ q, float *sinv, unsigned *amax, unsigned *amax2)
{
    constexpr int U = (CAST ? FLAT_BYTES / 2 : FLAT_BYTES) / (VEC * (int)sizeof(T));
    float s = CAST ? scale_of(src) : 1.0f;
    if (CAST && blockIdx.x == 0 && threadIdx.x == 0) *sinv = __frcp_rn(s);  /* 2.3 */
    unsigned key = 0;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t nv = vec ? n / VEC : 0;
    for (int64_t c0 = i0; c0 < nv; c0 += U * stride) {
        float v[U][VEC];
#pragma unroll
        for (int u = 0; u < U; u++) {  /* all loads first */
            int64_t c = c0 + u * stride;
            if (c < nv) opf_dev_load8<T>(x + (rev ? nv - 1 - c : c) * VEC, v[u]);
            else
#pragma unroll
                for (int i = 0; i < VEC; i++) v[u][i] = 0.0f;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int64_t c = c0 + u * stride;
            if (AMAX)
#pragma unroll
                for (int i = 0; i < VEC; i++) key = opf_dev_amax_max(key, v[u][i]);
            if (CAST && c < nv) *(uint2 *)(q + (rev ? nv - 1 - c : c) * VEC) = cast8(v[u], s, e4m3);
        }
    }
    for (int64_t i = nv * VEC + i0; i < n; i += stride) {
        float v = opf_dev_widen<T>(x[i]);
        if (AMAX) key = opf_dev_amax_max(key, v);
        if (CAST) q[i] = opf_dev_to_fp8(v * s, e4m3);
    }
    if (AMAX) block_amax(key, amax, amax2);
}

/* ---- cast + transpose -----------------------------------------------------
 * One OPF_QT_ROWS x TILE_K tile per block, the last first when rev. VEC_IO:
 * K % 8 == 0 and M % 16 == 0 (and aligned bases), so every 8-element row
 * access and 16-byte columnwise store is whole or outside; otherwise
 * element accesses with bounds checks. AMAX: as flat_kernel. */
template <typename T, bool VEC_IO, bool AMAX>
__global__ void __launch_bounds__(TILE_THREADS)
cast_transpose_kernel(const T *__restrict__ x, int64_t M, int64_t K, bool rev, scale_src src,
                      bool e4m3, uint8_t *__restrict__ q, uint8_t *__restrict__ qt, float *sinv,
                      float *sinv_col, unsigned *amax, unsigned *amax2)
{
    __shared__ __align__(16) uint32_t tile[TILE_K][OPF_QT_QUADS];
    float s = scale_of(src);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        float r = __frcp_rn(s);
        *sinv = r;
        *sinv_col = r;
    }
    int64_t by = rev ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
    int64_t bx = rev ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    int64_t m0 = by * OPF_QT_ROWS, k0 = bx * TILE_K;
    int tc = threadIdx.x % (TILE_K / VEC), qd = threadIdx.x / (TILE_K / VEC);
    int64_t m = m0 + 4 * qd, k = k0 + tc * VEC;
    opf_quad<T> qv;
    opf_qtile_load<T>(x, M, K, m, k, VEC_IO, qv);
    unsigned key = 0;
    uint2 b[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float v[VEC];
        opf_quad_row(qv, j, v);
        if (AMAX)
#pragma unroll
            for (int i = 0; i < VEC; i++) key = opf_dev_amax_max(key, v[i]);
        b[j] = cast8(v, s, e4m3);
    }
    opf_qtile_store_rows(q, b, M, K, m, k, VEC_IO);
    opf_qtile_put<TILE_K>(tile, b, tc, qd);
    if (AMAX) block_amax(key, amax, amax2);  /* has a barrier: the tile is complete after it */
    else __syncthreads();
    opf_qtile_store_t<TILE_K, TILE_THREADS>(tile, qt, m0, k0, M, K, VEC_IO);
}

/* ---- current scaling in one pass ------------------------------------------
 * Where the whole tensor fits in one wave of cast + transpose tiles (on an
 * H200 about 6.5M elements of a 2-byte input, 4.3M of an f32 one with both
 * copies: every block resident, its quad in registers), one cooperative
 * launch does what the memset, the amax pass and the cast pass do: block 0
 * zeroes the amax, the grid syncs, each block max-accumulates its tile's
 * amax, the grid syncs again, and every thread derives the scale from the
 * final amax and casts the quad it still holds.
 * The input is read once, not twice, and a step's graph has one node where
 * it had three. The amax is the same max, the scale the same function of
 * it and the cast the same: the bits are the two-pass path's. COL: the
 * columnwise copy too (the tile's transpose), else the rowwise bytes only. */
template <typename T, bool COL>
__global__ void __launch_bounds__(TILE_THREADS)
one_pass_kernel(const T *__restrict__ x, int64_t M, int64_t K, bool vec, scale_src src, bool e4m3,
                uint8_t *__restrict__ q, uint8_t *__restrict__ qt, float *sinv, float *sinv_col,
                unsigned *amax)
{
    __shared__ __align__(16) uint32_t tile[TILE_K][OPF_QT_QUADS];  /* COL only */
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    bool first = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
    if (first) *amax = 0u;
    int64_t m0 = (int64_t)blockIdx.y * OPF_QT_ROWS, k0 = (int64_t)blockIdx.x * TILE_K;
    int tc = threadIdx.x % (TILE_K / VEC), qd = threadIdx.x / (TILE_K / VEC);
    int64_t m = m0 + 4 * qd, k = k0 + tc * VEC;
    opf_quad<T> qv;
    opf_qtile_load<T>(x, M, K, m, k, vec, qv);
    unsigned key = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float v[VEC];
        opf_quad_row(qv, j, v);
#pragma unroll
        for (int i = 0; i < VEC; i++) key = opf_dev_amax_max(key, v[i]);
    }
    grid.sync();  /* the amax is zero before any block adds to it */
    block_amax(key, amax, NULL);
    grid.sync();  /* every block's amax is in */
    float s = opf_dev_scale_from_amax(__uint_as_float(__ldcg(amax)), src.fp8_max, src.pow2,
                                      src.eps, FLT_MAX);
    if (first) {
        float r = __frcp_rn(s);
        *sinv = r;
        if (COL) *sinv_col = r;
    }
    uint2 b[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float v[VEC];
        opf_quad_row(qv, j, v);
        b[j] = cast8(v, s, e4m3);
    }
    opf_qtile_store_rows(q, b, M, K, m, k, vec);
    if constexpr (COL) {
        opf_qtile_put<TILE_K>(tile, b, tc, qd);
        __syncthreads();
        opf_qtile_store_t<TILE_K, TILE_THREADS>(tile, qt, m0, k0, M, K, vec);
    }
}

static unsigned long long one_pass_calls;  /* opf_cuda_fp8_one_pass_calls */

extern "C" unsigned long long opf_cuda_fp8_one_pass_calls(void)
{
    return __atomic_load_n(&one_pass_calls, __ATOMIC_RELAXED);
}

/* Current scaling in one pass (above) when the device runs cooperative
 * launches, the tensor is not empty and its tiles fit one wave;
 * OPF_CUDA_FP8_ONE_PASS=0 turns it off (read at each call, so a test and a
 * benchmark can run both paths in one process). *done: whether it ran. */
template <typename T, bool COL>
static opf_status one_pass_try(opf_ctx *ctx, opf_cuda_state *s, const T *x, int64_t M, int64_t K,
                               const scale_src &src, bool e4m3, opf_tensor *out, bool *done)
{
    const char *fn = "quantize (fp8 current scaling, one pass)";
    static unsigned long long known;  /* a bit per device */
    static int wave[64];  /* resident blocks an SM, per device (0: no cooperative launch) */
    int other = 0, *w = s->device >= 0 && s->device < 64 ? &wave[s->device] : &other;
    *done = false;
    const char *env = getenv("OPF_CUDA_FP8_ONE_PASS");
    if ((env && env[0] == '0') || M <= 0 || K <= 0) return OPF_OK;
    if (opf_cuda_once_needed(&known, s->device)) {
        int coop = 0, per_sm = 0;
        OPF_CUDA_TRY(ctx, fn,
                     cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, s->device));
        if (coop)
            OPF_CUDA_TRY(ctx, fn, cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                      &per_sm, one_pass_kernel<T, COL>, TILE_THREADS, 0));
        __atomic_store_n(w, per_sm, __ATOMIC_RELAXED);
        opf_cuda_once_done(&known, s->device);
    }
    int64_t gx = (K + TILE_K - 1) / TILE_K, gy = (M + OPF_QT_ROWS - 1) / OPF_QT_ROWS;
    if (gx * gy > (int64_t)__atomic_load_n(w, __ATOMIC_RELAXED) * s->sm_count) return OPF_OK;
    uint8_t *q = (uint8_t *)out->data[OPF_COMP_DATA];
    uint8_t *qt = COL ? (uint8_t *)out->data[OPF_COMP_COL_DATA] : NULL;
    bool vec = K % VEC == 0 && opf_cuda_aligned16(x) && opf_cuda_aligned16(q) &&
               (!COL || (M % 16 == 0 && opf_cuda_aligned16(qt)));
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)gx, (unsigned)gy);
    cfg.blockDim = dim3(TILE_THREADS);
    cfg.stream = s->stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    cudaError_t e = cudaLaunchKernelEx(&cfg, one_pass_kernel<T, COL>, x, M, K, vec, src, e4m3, q,
                                       qt, (float *)out->data[OPF_COMP_SCALE_INV],
                                       COL ? (float *)out->data[OPF_COMP_COL_SCALE_INV] : NULL,
                                       (unsigned *)out->data[OPF_COMP_AMAX]);
    if (e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported) {
        (void)cudaGetLastError();  /* refused before it ran, nothing written: two passes */
        return OPF_OK;
    }
    OPF_CUDA_TRY(ctx, fn, e);
    __atomic_fetch_add(&one_pass_calls, 1, __ATOMIC_RELAXED);
    *done = true;
    return OPF_OK;
}

/* ---- dequantize ---------------------------------------------------------- */

/* fl(q * scale_inv). A NaN code gives the CPU's bits: its decode is the
 * quiet NaN 0x7FC00000 with the code's sign, which the CPU's multiply
 * passes through (the GPU's would canonicalize it). */
__device__ __forceinline__ float dequant1(uint8_t q, float sinv, bool e4m3)
{
    float v = opf_dev_from_fp8(q, e4m3);
    return isnan(v) ? __uint_as_float((uint32_t)(q & 0x80u) << 24 | 0x7FC00000u) : v * sinv;
}

__global__ void dequant_kernel(const uint8_t *__restrict__ q, int64_t n, const float *sinv_p,
                               bool e4m3, float *__restrict__ out)
{
    float sinv = *sinv_p;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = dequant1(q[i], sinv, e4m3);
}

/* out[m*K + k] from qt[k*M + m] through a DQ_TILE^2 tile. */
__global__ void dequant_t_kernel(const uint8_t *__restrict__ qt, int64_t M, int64_t K,
                                 const float *sinv_p, bool e4m3, float *__restrict__ out)
{
    __shared__ uint8_t tile[DQ_TILE][DQ_TILE + 1];
    float sinv = *sinv_p;
    int64_t m0 = (int64_t)blockIdx.x * DQ_TILE, k0 = (int64_t)blockIdx.y * DQ_TILE;
    for (int r = threadIdx.y; r < DQ_TILE; r += blockDim.y) {
        int64_t k = k0 + r, m = m0 + threadIdx.x;
        if (k < K && m < M) tile[r][threadIdx.x] = qt[k * M + m];
    }
    __syncthreads();
    for (int r = threadIdx.y; r < DQ_TILE; r += blockDim.y) {
        int64_t m = m0 + r, k = k0 + threadIdx.x;
        if (k < K && m < M) out[m * K + k] = dequant1(tile[threadIdx.x][r], sinv, e4m3);
    }
}

/* ---- host side ----------------------------------------------------------- */

/* Blocks for a flat pass over n elements: no more than the device holds
 * at once (the sweep of flat_kernel). */
static unsigned flat_grid(const opf_cuda_state *s, int64_t n)
{
    int64_t want = (n / VEC + FLAT_THREADS) / FLAT_THREADS, cap = (int64_t)s->sm_count * FLAT_BLOCKS;
    return (unsigned)(want < cap ? want : cap);
}

template <typename T>
static opf_status launch_amax(opf_ctx *ctx, opf_cuda_state *s, const void *x, int64_t n,
                              unsigned *amax)
{
    scale_src none = {NULL, NULL, 0.0f, 0.0f, false};
    flat_kernel<T, false, true><<<flat_grid(s, n), FLAT_THREADS, 0, s->stream>>>(
        (const T *)x, n, opf_cuda_aligned16(x), true, none, true, NULL, NULL, amax, NULL);
    OPF_CUDA_LAUNCHED(ctx, "quantize (fp8 amax)");
    return OPF_OK;
}

/* The rowwise cast alone; with its amax when amax is not NULL. */
template <typename T>
static void launch_row(cudaStream_t st, unsigned grid, const T *x, int64_t n, bool vec, bool rev,
                       const scale_src &src, bool e4m3, uint8_t *q, float *sinv, unsigned *amax,
                       unsigned *amax2)
{
    if (amax)
        flat_kernel<T, true, true><<<grid, FLAT_THREADS, 0, st>>>(x, n, vec, rev, src, e4m3, q,
                                                                  sinv, amax, amax2);
    else
        flat_kernel<T, true, false><<<grid, FLAT_THREADS, 0, st>>>(x, n, vec, rev, src, e4m3, q,
                                                                   sinv, NULL, NULL);
}

/* Cast + transpose; with the amax when amax is not NULL. */
template <typename T, bool VEC_IO>
static void launch_tiles(cudaStream_t st, dim3 grid, const T *x, int64_t M, int64_t K, bool rev,
                         const scale_src &src, bool e4m3, uint8_t *q, uint8_t *qt, float *sinv,
                         float *sinv_col, unsigned *amax, unsigned *amax2)
{
    if (amax)
        cast_transpose_kernel<T, VEC_IO, true><<<grid, TILE_THREADS, 0, st>>>(
            x, M, K, rev, src, e4m3, q, qt, sinv, sinv_col, amax, amax2);
    else
        cast_transpose_kernel<T, VEC_IO, false><<<grid, TILE_THREADS, 0, st>>>(
            x, M, K, rev, src, e4m3, q, qt, sinv, sinv_col, NULL, NULL);
}

/* The cast pass (rowwise, or both copies); rev: from the end (the pass
 * order of the file's header). */
template <typename T>
static opf_status launch_cast(opf_ctx *ctx, opf_cuda_state *s, const void *xv, int64_t M,
                              int64_t K, bool rev, const scale_src &src, bool e4m3,
                              opf_tensor *out, unsigned *amax, unsigned *amax2)
{
    const T *x = (const T *)xv;
    uint8_t *q = (uint8_t *)out->data[OPF_COMP_DATA];
    float *sinv = (float *)out->data[OPF_COMP_SCALE_INV];
    if (!(out->spec.usage & OPF_USAGE_COLUMNWISE)) {
        bool vec = opf_cuda_aligned16(x) && opf_cuda_aligned16(q);
        launch_row<T>(s->stream, flat_grid(s, M * K), x, M * K, vec, rev, src, e4m3, q, sinv,
                      amax, amax2);
        OPF_CUDA_LAUNCHED(ctx, "quantize (fp8 cast)");
        return OPF_OK;
    }
    uint8_t *qt = (uint8_t *)out->data[OPF_COMP_COL_DATA];
    float *sinv_col = (float *)out->data[OPF_COMP_COL_SCALE_INV];
    /* at least one block: an empty tensor still gets its scale_inv */
    dim3 grid((unsigned)(K > 0 ? (K + TILE_K - 1) / TILE_K : 1),
              (unsigned)(M > 0 ? (M + OPF_QT_ROWS - 1) / OPF_QT_ROWS : 1));
    bool vec = K % VEC == 0 && M % 16 == 0 && opf_cuda_aligned16(x) && opf_cuda_aligned16(q) &&
               opf_cuda_aligned16(qt);
    if (vec)
        launch_tiles<T, true>(s->stream, grid, x, M, K, rev, src, e4m3, q, qt, sinv, sinv_col,
                              amax, amax2);
    else
        launch_tiles<T, false>(s->stream, grid, x, M, K, rev, src, e4m3, q, qt, sinv, sinv_col,
                               amax, amax2);
    OPF_CUDA_LAUNCHED(ctx, "quantize (fp8 cast + transpose)");
    return OPF_OK;
}

/* Current scaling with an amax reduction hook: the amax goes to the host,
 * through the hook and back (the hook is host code), by counted copies: a
 * user's host hook is the one reason this path waits for the device. */
static opf_status reduce_amax(opf_ctx *ctx, const opf_quantizer *q, float *amax_dev)
{
    const char *fn = "quantize (fp8 current scaling)";
    float amax = 0.0f;
    opf_status st = opf_cuda_copy(ctx, &amax, amax_dev, sizeof amax, OPF_CUDA_D2H);
    if (st) return st;
    float local = amax;
    if ((st = q->amax_reduce(q->amax_reduce_user, &amax, 1)) != OPF_OK)
        return opf_error(ctx, st, "%s: amax reduction failed with %s (local amax %g); nothing "
                         "written", fn, opf_status_str(st), (double)local);
    return opf_cuda_copy(ctx, amax_dev, &amax, sizeof amax, OPF_CUDA_H2D);
}

template <typename T>
static opf_status quantize_typed(opf_ctx *ctx, opf_cuda_state *s, const opf_quantizer *q,
                                 const opf_tensor *in, opf_tensor *out,
                                 const opf_quantize_state *qs)
{
    int64_t M, K;
    opf_shape_2d(&in->spec, &M, &K);
    const void *x = in->data[OPF_COMP_DATA];
    unsigned *amax = (unsigned *)out->data[OPF_COMP_AMAX];
    bool e4m3 = q->qdtype == OPF_E4M3;
    scale_src src = {NULL, NULL, opf_fp8_max(q->qdtype), q->amax_epsilon, q->pow2_scales};
    opf_status st;
    if (!q->delayed && !q->amax_reduce) {
        bool done;
        st = (out->spec.usage & OPF_USAGE_COLUMNWISE)
                 ? one_pass_try<T, true>(ctx, s, (const T *)x, M, K, src, e4m3, out, &done)
                 : one_pass_try<T, false>(ctx, s, (const T *)x, M, K, src, e4m3, out, &done);
        if (st || done) return st;
    }
    OPF_CUDA_TRY(ctx, "quantize (fp8)", cudaMemsetAsync(amax, 0, sizeof(float), s->stream));
    if (q->delayed) {
        /* Both in the state's device memory: history row 0 holds amaxes
         * (>= 0), whose bit patterns order as their values, so the integer
         * atomicMax of the amax key max-accumulates the float (3.1). */
        src.scale = qs->delayed_scale;
        return launch_cast<T>(ctx, s, x, M, K, true, src, e4m3, out, amax,
                              (unsigned *)qs->delayed_amax);
    }
    if ((st = launch_amax<T>(ctx, s, x, M * K, amax))) return st;
    if (q->amax_reduce && (st = reduce_amax(ctx, q, (float *)amax))) return st;
    src.amax_bits = amax;
    return launch_cast<T>(ctx, s, x, M, K, false, src, e4m3, out, NULL, NULL);
}

extern "C" opf_status opf_cuda_quantize_tensor_fp8(opf_ctx *ctx, const opf_quantizer *q,
                                                   const opf_tensor *in, opf_tensor *out,
                                                   const opf_quantize_state *qs)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "quantize (fp8)");
    if (!s) return OPF_ERR_STATE;
    switch (in->spec.dtype) {
    case OPF_F32: return quantize_typed<float>(ctx, s, q, in, out, qs);
    case OPF_BF16: return quantize_typed<__nv_bfloat16>(ctx, s, q, in, out, qs);
    case OPF_F16: return quantize_typed<__half>(ctx, s, q, in, out, qs);
    default:
        return opf_error(ctx, OPF_ERR_DTYPE, "quantize (fp8): input dtype %s, expected f32/bf16/f16",
                         opf_dtype_name(in->spec.dtype));
    }
}

/* Current scaling's cast pass alone (cuda.h): the amax is already in out's
 * amax component, max-accumulated by the kernel that wrote in. */
template <typename T>
static opf_status cast_typed(opf_ctx *ctx, opf_cuda_state *s, const opf_quantizer *q,
                             const opf_tensor *in, opf_tensor *out)
{
    int64_t M, K;
    opf_shape_2d(&in->spec, &M, &K);
    scale_src src = {(const unsigned *)out->data[OPF_COMP_AMAX], NULL, opf_fp8_max(q->qdtype),
                     q->amax_epsilon, q->pow2_scales};
    return launch_cast<T>(ctx, s, in->data[OPF_COMP_DATA], M, K, true, src, q->qdtype == OPF_E4M3,
                          out, NULL, NULL);
}

extern "C" opf_status opf_cuda_quantize_tensor_fp8_cast(opf_ctx *ctx, const opf_quantizer *q,
                                                        const opf_tensor *in, opf_tensor *out)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "quantize (fp8 cast)");
    if (!s) return OPF_ERR_STATE;
    switch (in->spec.dtype) {
    case OPF_F32: return cast_typed<float>(ctx, s, q, in, out);
    case OPF_BF16: return cast_typed<__nv_bfloat16>(ctx, s, q, in, out);
    case OPF_F16: return cast_typed<__half>(ctx, s, q, in, out);
    default:
        return opf_error(ctx, OPF_ERR_DTYPE, "quantize (fp8 cast): input dtype %s",
                         opf_dtype_name(in->spec.dtype));
    }
}

extern "C" opf_status opf_cuda_dequantize_tensor_fp8(opf_ctx *ctx, const opf_tensor *t,
                                                     unsigned which, float *out)
{
    const char *fn = "dequantize (fp8)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    int64_t M, K;
    opf_shape_2d(&t->spec, &M, &K);
    if (M * K == 0) return OPF_OK;  /* an empty tensor: no grid to launch */
    bool col = which == OPF_USAGE_COLUMNWISE, e4m3 = t->spec.qdtype == OPF_E4M3;
    const uint8_t *d = (const uint8_t *)t->data[col ? OPF_COMP_COL_DATA : OPF_COMP_DATA];
    const float *sinv = (const float *)t->data[col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV];
    if (!col) {
        dequant_kernel<<<opf_cuda_grid(s, M * K, DQ_THREADS), DQ_THREADS, 0, s->stream>>>(d, M * K, sinv,
                                                                                   e4m3, out);
    } else {
        dim3 grid((unsigned)((M + DQ_TILE - 1) / DQ_TILE), (unsigned)((K + DQ_TILE - 1) / DQ_TILE));
        dequant_t_kernel<<<grid, dim3(DQ_TILE, 8), 0, s->stream>>>(d, M, K, sinv, e4m3, out);
    }
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}
