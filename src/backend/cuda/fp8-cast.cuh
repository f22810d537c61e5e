/* fp8-cast.cuh: per-tensor FP8's cast pass (docs/numerics.md 3.1, 3.2),
 * shared by quantize_tensor_fp8.cu and the fused outputs of act.cu and
 * norm.cu, bit for bit with src/backend/cpu/quantize_tensor_fp8.c.
 *
 * The pass is a template over a Map that turns the 8 values a thread loads
 * into the values it casts: the identity for a quantize, or, for a fused
 * output under current scaling, the op's own function of its input (an
 * activation; a norm with its row statistics). The op then needs no
 * high-precision copy of its output: a first pass takes the amax of the
 * values as they would be stored, and this one computes them again from
 * the input and casts them, reading the input twice instead of writing and
 * reading the copy (6 bytes an element of bf16 instead of 8). The values
 * are the same operations in the same order as the op's kernel, so the
 * bits are those of quantizing its stored output.
 *
 * A Map:
 *   enum { POSITIONAL };   1: uses (m, k) (the tiled pass only), 0: not
 *   void operator()(int64_t m, int64_t k, float (&v)[8]) const;
 *                          v: row m's elements k..k+7 as loaded (zeros
 *                          outside the tensor, which no store reads back)
 *
 * Two forms. The flat pass (the amax alone, or the rowwise cast alone) is a
 * grid-stride loop over 8-element chunks that loads 64 bytes (the amax) or
 * 32 (the cast) a thread at once, with as many blocks as the device holds,
 * which sweep the tensor together. The cast + transpose pass is the tile of
 * quantize-tile.h (128 x 64: a quad of 4 rows x 8 columns a thread): the
 * rowwise bytes go straight out, the columnwise ones through the transposed
 * shared tile, 16 bytes a store.
 *
 * Pass order: a pass that follows the tensor's producer reads it from the
 * end (rev), where the producer's last writes may still sit in L2. */
#ifndef OPFUSE_CUDA_FP8_CAST_CUH
#define OPFUSE_CUDA_FP8_CAST_CUH

#include <float.h>

#include "backend/cuda/quantize-tile.h"

enum {
    OPF_F8C_VEC = 8,           /* elements per thread access */
    OPF_F8C_TILE_K = 64,       /* columns of a cast + transpose tile (OPF_QT_ROWS rows) */
    OPF_F8C_TILE_THREADS = OPF_F8C_TILE_K / OPF_F8C_VEC * OPF_QT_QUADS, /* one quad each: 256 */
    OPF_F8C_FLAT_THREADS = 256,
    OPF_F8C_FLAT_BLOCKS = 8,   /* per SM, all resident: 2048 threads of <= 32 registers */
    OPF_F8C_FLAT_BYTES = 64,   /* input bytes an amax-pass thread loads at once (a cast
                                  thread half: 32 registers hold no more beside its bytes) */
};

/* Where the scale comes from: the amax on the device (current scaling) or
 * the delayed state's slot in device memory (delayed scaling). */
typedef struct opf_f8c_scale {
    const unsigned *amax_bits;  /* current: the amax as bits; NULL for delayed */
    const float    *scale;      /* delayed: the slot's scale; NULL: 1 (the amax pass) */
    float           fp8_max, eps;
    bool            pow2;
} opf_f8c_scale;

/* The identity Map: a quantize of the tensor itself. */
struct opf_f8c_same {
    enum { POSITIONAL = 0 };
    __device__ __forceinline__ void operator()(int64_t, int64_t, float (&)[8]) const {}
};

__device__ __forceinline__ float opf_f8c_scale_of(const opf_f8c_scale &src)
{
    if (!src.amax_bits) return src.scale ? *src.scale : 1.0f;
    return opf_dev_scale_from_amax(__uint_as_float(*src.amax_bits), src.fp8_max, src.pow2,
                                   src.eps, FLT_MAX);
}

/* 8 bytes cvt(fl(v * s)), element 0 in the low byte. */
__device__ __forceinline__ uint2 opf_f8c_cast8(const float (&v)[8], float s, bool e4m3)
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
__device__ __forceinline__ void opf_f8c_block_amax(unsigned key, unsigned *amax, unsigned *amax2)
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

/* ---- the flat pass ----------------------------------------------------------
 * A grid-stride loop over 8-element chunks, U at a time (16-byte loads when
 * vec), chunk c being chunk nv - 1 - c when rev; then the tail element by
 * element. CAST false: the amax pass (the scale arguments unused). AMAX:
 * the amax of the values into *amax (and *amax2). */
template <typename T, bool CAST, bool AMAX, class Map>
__global__ void __launch_bounds__(OPF_F8C_FLAT_THREADS, OPF_F8C_FLAT_BLOCKS)
opf_f8c_flat_kernel(const T *__restrict__ x, int64_t n, bool vec, bool rev, opf_f8c_scale src,
                    bool e4m3, uint8_t *__restrict__ q, float *sinv, unsigned *amax,
                    unsigned *amax2, Map map)
{
    static_assert(!Map::POSITIONAL, "the flat pass knows no rows");
    constexpr int VEC = OPF_F8C_VEC;
    constexpr int U = (CAST ? OPF_F8C_FLAT_BYTES / 2 : OPF_F8C_FLAT_BYTES) / (VEC * (int)sizeof(T));
    float s = CAST ? opf_f8c_scale_of(src) : 1.0f;
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
            map(0, 0, v[u]);
            if (AMAX)
#pragma unroll
                for (int i = 0; i < VEC; i++) key = max(key, opf_dev_amax_key(v[u][i]));
            if (CAST && c < nv)
                *(uint2 *)(q + (rev ? nv - 1 - c : c) * VEC) = opf_f8c_cast8(v[u], s, e4m3);
        }
    }
    for (int64_t i = nv * VEC + i0; i < n; i += stride) {
        float v[VEC] = {opf_dev_widen<T>(x[i])};
        map(0, 0, v);
        if (AMAX) key = max(key, opf_dev_amax_key(v[0]));
        if (CAST) q[i] = opf_dev_to_fp8(v[0] * s, e4m3);
    }
    if (AMAX) opf_f8c_block_amax(key, amax, amax2);
}

/* ---- cast + transpose -------------------------------------------------------
 * One OPF_QT_ROWS x TILE_K tile per block, the last first when rev. VEC_IO:
 * K % 8 == 0 and M % 16 == 0 (and aligned bases), so every 8-element row
 * access and 16-byte columnwise store is whole or outside; otherwise
 * element accesses with bounds checks. AMAX: as the flat pass. */
template <typename T, bool VEC_IO, bool AMAX, class Map>
__global__ void __launch_bounds__(OPF_F8C_TILE_THREADS)
opf_f8c_tile_kernel(const T *__restrict__ x, int64_t M, int64_t K, bool rev, opf_f8c_scale src,
                    bool e4m3, uint8_t *__restrict__ q, uint8_t *__restrict__ qt, float *sinv,
                    float *sinv_col, unsigned *amax, unsigned *amax2, Map map)
{
    constexpr int VEC = OPF_F8C_VEC, TILE_K = OPF_F8C_TILE_K;
    __shared__ __align__(16) uint32_t tile[TILE_K][OPF_QT_QUADS];
    float s = opf_f8c_scale_of(src);
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
        map(m + j, k, v);
        if (AMAX)
#pragma unroll
            for (int i = 0; i < VEC; i++) key = max(key, opf_dev_amax_key(v[i]));
        b[j] = opf_f8c_cast8(v, s, e4m3);
    }
    opf_qtile_store_rows(q, b, M, K, m, k, VEC_IO);
    opf_qtile_put<TILE_K>(tile, b, tc, qd);
    if (AMAX) opf_f8c_block_amax(key, amax, amax2);  /* has a barrier: the tile is complete after it */
    else __syncthreads();
    opf_qtile_store_t<TILE_K, OPF_F8C_TILE_THREADS>(tile, qt, m0, k0, M, K, VEC_IO);
}

/* ---- host side -------------------------------------------------------------- */

/* Blocks for a flat pass over n elements: no more than the device holds
 * at once (the sweep of the flat pass). */
static inline unsigned opf_f8c_flat_grid(const opf_cuda_state *s, int64_t n)
{
    int64_t want = (n / OPF_F8C_VEC + OPF_F8C_FLAT_THREADS) / OPF_F8C_FLAT_THREADS;
    int64_t cap = (int64_t)s->sm_count * OPF_F8C_FLAT_BLOCKS;
    return (unsigned)(want < cap ? want : cap);
}

/* Whether the cast pass of out can take a Map: a positional one needs the
 * tiled pass (out has its columnwise copy). */
template <class Map> static inline bool opf_f8c_takes(const opf_tensor *out)
{
    return !Map::POSITIONAL || (out->spec.usage & OPF_USAGE_COLUMNWISE);
}

/* The cast pass of x [M, K] into out (rowwise, or both copies) with the
 * values map gives; with their amax into *amax (and *amax2) when amax is not
 * NULL. rev: from the end (the pass order of the file's header). The caller
 * has checked opf_f8c_takes<Map>(out). */
template <typename T, class Map>
static opf_status opf_f8c_cast(opf_ctx *ctx, opf_cuda_state *s, const void *xv, int64_t M,
                               int64_t K, bool rev, const opf_f8c_scale &src, bool e4m3,
                               opf_tensor *out, unsigned *amax, unsigned *amax2, const Map &map)
{
    const T *x = (const T *)xv;
    cudaStream_t st = s->stream;
    uint8_t *q = (uint8_t *)out->data[OPF_COMP_DATA];
    float *sinv = (float *)out->data[OPF_COMP_SCALE_INV];
    if (!(out->spec.usage & OPF_USAGE_COLUMNWISE)) {
        if constexpr (Map::POSITIONAL) {
            return opf_error(ctx, OPF_ERR_UNSUPPORTED, "quantize (fp8 cast): a positional map "
                             "without a columnwise copy (see opf_f8c_takes)");
        } else {
            unsigned grid = opf_f8c_flat_grid(s, M * K);
            bool vec = opf_cuda_aligned16(x) && opf_cuda_aligned16(q);
            if (amax)
                opf_f8c_flat_kernel<T, true, true, Map><<<grid, OPF_F8C_FLAT_THREADS, 0, st>>>(
                    x, M * K, vec, rev, src, e4m3, q, sinv, amax, amax2, map);
            else
                opf_f8c_flat_kernel<T, true, false, Map><<<grid, OPF_F8C_FLAT_THREADS, 0, st>>>(
                    x, M * K, vec, rev, src, e4m3, q, sinv, NULL, NULL, map);
            OPF_CUDA_LAUNCHED(ctx, "quantize (fp8 cast)");
            return OPF_OK;
        }
    }
    uint8_t *qt = (uint8_t *)out->data[OPF_COMP_COL_DATA];
    float *sinv_col = (float *)out->data[OPF_COMP_COL_SCALE_INV];
    /* at least one block: an empty tensor still gets its scale_inv */
    dim3 grid((unsigned)(K > 0 ? (K + OPF_F8C_TILE_K - 1) / OPF_F8C_TILE_K : 1),
              (unsigned)(M > 0 ? (M + OPF_QT_ROWS - 1) / OPF_QT_ROWS : 1));
    bool vec = K % OPF_F8C_VEC == 0 && M % 16 == 0 && opf_cuda_aligned16(x) &&
               opf_cuda_aligned16(q) && opf_cuda_aligned16(qt);
    const int nt = OPF_F8C_TILE_THREADS;
    if (vec && amax)
        opf_f8c_tile_kernel<T, true, true, Map><<<grid, nt, 0, st>>>(
            x, M, K, rev, src, e4m3, q, qt, sinv, sinv_col, amax, amax2, map);
    else if (vec)
        opf_f8c_tile_kernel<T, true, false, Map><<<grid, nt, 0, st>>>(
            x, M, K, rev, src, e4m3, q, qt, sinv, sinv_col, NULL, NULL, map);
    else if (amax)
        opf_f8c_tile_kernel<T, false, true, Map><<<grid, nt, 0, st>>>(
            x, M, K, rev, src, e4m3, q, qt, sinv, sinv_col, amax, amax2, map);
    else
        opf_f8c_tile_kernel<T, false, false, Map><<<grid, nt, 0, st>>>(
            x, M, K, rev, src, e4m3, q, qt, sinv, sinv_col, NULL, NULL, map);
    OPF_CUDA_LAUNCHED(ctx, "quantize (fp8 cast + transpose)");
    return OPF_OK;
}

/* Current scaling's scale source for quantizer q: the amax already in out's
 * amax component (as bits). */
static inline opf_f8c_scale opf_f8c_current(const opf_quantizer *q, const opf_tensor *out)
{
    opf_f8c_scale src = {(const unsigned *)out->data[OPF_COMP_AMAX], NULL,
                         opf_fp8_max(q->qdtype), q->amax_epsilon, q->pow2_scales};
    return src;
}

#endif
