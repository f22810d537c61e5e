/* quantize_mxfp8.cu: MXFP8 on the GPU, bit for bit with
 * src/backend/cpu/quantize_mxfp8.c (docs/numerics.md 3.3, 4.2-4.4).
 *
 * One block of threads per TILE_M x TILE_K tile (two bands of 32 rows),
 * read once with 16-byte loads into registers. Rowwise 1x32 blocks are the
 * 8-element chunks of 4 neighbouring lanes (a shuffle reduction); the
 * columnwise 32x1 blocks and the 32x32 tiles reduce the column amaxes of a
 * band across the warps through shared memory, one thread per (band,
 * column), and a 32x32 tile is then the 32 lanes of one warp. Both copies
 * keep the [M, K] layout, so every data store is 8 contiguous bytes; the
 * E8M0 scales go to the compact or the swizzled layout. */
#include "backend/cuda/cuda-impl.h"

enum {
    MX = 32,                  /* block edge */
    TILE_M = 64,              /* two bands */
    TILE_K = 128,
    VEC = 8,                  /* elements per thread access */
    THREADS = 256,
    TC = TILE_K / VEC,        /* threads along a row: 16 */
    TR = THREADS / TC,        /* rows read at once: 16 */
    PASSES = TILE_M / TR,     /* rows per thread: 4, bands p / 2 */
    WARPS = THREADS / 32,
    DQ_THREADS = 256,
};
static_assert(2 * TILE_K == THREADS, "one thread per (band, column) of a tile");

typedef enum mx_mode { MX_ROW = 0, MX_COL = 1, MX_2D = 2 } mx_mode;

/* Where the copies and scales go; NULL data: the copy is not wanted. */
typedef struct mx_out {
    uint8_t *qr, *qc;       /* [M, K] each */
    uint8_t *sr, *sc;       /* rowwise [.., ld_row], columnwise [.., ld_col] E8M0 */
    int64_t  ld_row;        /* roundup(K/32, 4) */
    int64_t  ld_col;        /* roundup(K, 128) */
    int64_t  c_col;         /* roundup(M/32, 4): the columnwise swizzle's C */
    bool     swizzled;
} mx_out;

__device__ __forceinline__ int64_t row_idx(const mx_out &o, int64_t m, int64_t kb)
{
    return o.swizzled ? opf_dev_swizzle_index(m, kb, o.ld_row) : m * o.ld_row + kb;
}
__device__ __forceinline__ int64_t col_idx(const mx_out &o, int64_t yb, int64_t k)
{
    return o.swizzled ? opf_dev_swizzle_index(k, yb, o.c_col) : yb * o.ld_col + k;
}

/* 3.3 steps 3-4: the exponent of a block from its amax key. */
__device__ __forceinline__ uint8_t block_exp(unsigned key, float rcp)
{
    return opf_dev_to_e8m0(__uint_as_float(key) * rcp);
}

/* Rowwise 1x32 blocks of the thread's rows: 4 lanes a block. */
__device__ __forceinline__ void row_blocks(const float (&v)[PASSES][VEC], const mx_out &o,
                                           int64_t m0, int tr, int64_t k, int64_t M, int64_t K,
                                           float rcp, bool e4m3, bool vec)
{
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        unsigned key = 0;
#pragma unroll
        for (int i = 0; i < VEC; i++) key = opf_dev_amax_max(key, v[p][i]);
        key = opf_dev_max_lanes(key, 4);
        uint8_t e = block_exp(key, rcp);
        float s[VEC], mult = opf_dev_e8m0_mult(e);
#pragma unroll
        for (int i = 0; i < VEC; i++) s[i] = mult;
        int64_t m = m0 + tr + p * TR;
        if (m >= M || k >= K) continue;
        opf_dev_store8(o.qr + m * K + k, opf_dev_cast8(v[p], s, e4m3), VEC, vec);
        if ((threadIdx.x & 3) == 0) o.sr[row_idx(o, m, k / MX)] = e;
    }
}

/* The column amax keys of the tile's two bands into key[band][column]:
 * the thread's rows, then the two rows of a warp, then across the warps. */
__device__ __forceinline__ void column_keys(const float (&v)[PASSES][VEC], int tc,
                                            unsigned (&part)[WARPS][2][TILE_K],
                                            unsigned (&key)[2][TILE_K])
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int b = 0; b < 2; b++)
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            unsigned k = opf_dev_amax_max(opf_dev_amax_max(0u, v[2 * b][i]), v[2 * b + 1][i]);
            k = max(k, __shfl_xor_sync(0xFFFFFFFFu, k, 16));
            if (lane < 16) part[warp][b][tc * VEC + i] = k;
        }
    __syncthreads();
    int b = threadIdx.x / TILE_K, c = threadIdx.x % TILE_K;
    unsigned k = 0;
#pragma unroll
    for (int w = 0; w < WARPS; w++) k = max(k, part[w][b][c]);
    key[b][c] = k;
}

/* The multiplier of each (band, column) from its key, and the scales:
 * 1D gives each column its own (columnwise scales); 2D gives the 32
 * columns of a tile, the lanes of one warp, the exponent of their max
 * (both copies' scales). One thread per (band, column). */
template <int MODE>
__device__ __forceinline__ void band_scales(const unsigned (&key)[2][TILE_K], const mx_out &o,
                                            int64_t m0, int64_t k0, int64_t M, int64_t K,
                                            float rcp, float (&mult)[2][TILE_K])
{
    int b = threadIdx.x / TILE_K, c = threadIdx.x % TILE_K;
    int64_t k = k0 + c, yb = m0 / MX + b;
    bool valid = k < K && yb * MX < M;
    unsigned kc = key[b][c];
    if (MODE == MX_2D) kc = opf_dev_max_lanes(kc, 32);
    uint8_t e = block_exp(kc, rcp);
    mult[b][c] = opf_dev_e8m0_mult(e);
    if (!valid) return;
    if (o.sc) o.sc[col_idx(o, yb, k)] = e;
    if (MODE == MX_2D && o.sr) o.sr[row_idx(o, yb * MX + threadIdx.x % 32, k / MX)] = e;
}

template <typename T, int MODE, bool VEC_IO>
__global__ void __launch_bounds__(THREADS)
mx_kernel(const T *__restrict__ x, int64_t M, int64_t K, mx_out o, float rcp, bool e4m3)
{
    __shared__ unsigned part[WARPS][2][TILE_K];
    __shared__ unsigned key[2][TILE_K];
    __shared__ float mult[2][TILE_K];
    int tc = threadIdx.x % TC, tr = threadIdx.x / TC;
    int64_t m0 = (int64_t)blockIdx.y * TILE_M, k0 = (int64_t)blockIdx.x * TILE_K;
    int64_t k = k0 + tc * VEC;
    float v[PASSES][VEC];
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        int64_t m = m0 + tr + p * TR;
        bool in = m < M && k < K;  /* K % 32 == 0: a chunk is whole or outside */
        if (VEC_IO && in) opf_dev_load8<T>(x + m * K + k, v[p]);
        else opf_dev_load8_part<T>(x + m * K + k, in ? VEC : 0, v[p]);
    }
    if (MODE != MX_2D && o.qr) row_blocks(v, o, m0, tr, k, M, K, rcp, e4m3, VEC_IO);
    if (MODE == MX_ROW) return;
    column_keys(v, tc, part, key);
    band_scales<MODE>(key, o, m0, k0, M, K, rcp, mult);
    __syncthreads();
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        int64_t m = m0 + tr + p * TR;
        if (m >= M || k >= K) continue;
        float s[VEC];
#pragma unroll
        for (int i = 0; i < VEC; i++) s[i] = mult[p / 2][tc * VEC + i];
        uint2 b = opf_dev_cast8(v[p], s, e4m3);
        if (o.qc) opf_dev_store8(o.qc + m * K + k, b, VEC, VEC_IO);
        if (MODE == MX_2D && o.qr) opf_dev_store8(o.qr + m * K + k, b, VEC, VEC_IO);
    }
}

/* ---- dequantize: out[m, k] = fp8(q) * 2^(E-127) (1.5), any output type -- */

template <typename O> __device__ __forceinline__ O narrow(float v);
template <> __device__ __forceinline__ float narrow<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}

/* 8 elements a thread (K % 32 == 0: they share a row and a rowwise
 * block): one 8-byte load, one 16- or 32-byte store. */
template <typename O>
__global__ void mx_dequant8_kernel(const uint8_t *__restrict__ q, int64_t M, int64_t K, mx_out o,
                                   bool col, bool e4m3, O *__restrict__ out)
{
    int64_t n = M * K / VEC, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < n; c += stride) {
        int64_t i = c * VEC, m = i / K, k = i % K;
        uint2 b = *(const uint2 *)(q + i);
        const uint8_t *bb = (const uint8_t *)&b;
        float rs = col ? 0.0f : opf_dev_e8m0_scale(o.sr[row_idx(o, m, k / MX)]);
        __align__(16) O r[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float sj = col ? opf_dev_e8m0_scale(o.sc[col_idx(o, m / MX, k + j)]) : rs;
            r[j] = narrow<O>(opf_dev_dequant(bb[j], sj, e4m3));
        }
#pragma unroll
        for (int h = 0; h < (int)(VEC * sizeof(O) / 16); h++)
            ((uint4 *)(out + i))[h] = ((const uint4 *)r)[h];
    }
}

template <typename O>
__global__ void mx_dequant_kernel(const uint8_t *__restrict__ q, int64_t M, int64_t K, mx_out o,
                                  bool col, bool e4m3, O *__restrict__ out)
{
    int64_t n = M * K, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int64_t m = i / K, k = i % K;
        uint8_t e = col ? o.sc[col_idx(o, m / MX, k)] : o.sr[row_idx(o, m, k / MX)];
        out[i] = narrow<O>(opf_dev_dequant(q[i], opf_dev_e8m0_scale(e), e4m3));
    }
}

/* ---- host side ----------------------------------------------------------- */

static opf_status out_of(opf_ctx *ctx, const opf_tensor *t, const char *fn, mx_out *o,
                         int64_t *M, int64_t *K)
{
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    if (st) return opf_error(ctx, st, "%s: %s", fn, opf_last_error(NULL));
    bool row = t->spec.usage & OPF_USAGE_ROWWISE, col = t->spec.usage & OPF_USAGE_COLUMNWISE;
    o->qr = row ? (uint8_t *)t->data[OPF_COMP_DATA] : NULL;
    o->qc = col ? (uint8_t *)t->data[OPF_COMP_COL_DATA] : NULL;
    o->sr = row ? (uint8_t *)t->data[OPF_COMP_SCALE_INV] : NULL;
    o->sc = col ? (uint8_t *)t->data[OPF_COMP_COL_SCALE_INV] : NULL;
    o->ld_row = L.comp[OPF_COMP_SCALE_INV].cols;
    o->ld_col = L.comp[OPF_COMP_COL_SCALE_INV].cols;
    o->c_col = L.comp[OPF_COMP_COL_SCALE_INV].rows;
    o->swizzled = (t->spec.flags & OPF_SPEC_SWIZZLED) != 0;
    *M = L.m, *K = L.k;
    return OPF_OK;
}

template <typename T, int MODE>
static void launch_mode(cudaStream_t st, const T *x, int64_t M, int64_t K, const mx_out &o,
                        float rcp, bool e4m3)
{
    dim3 grid((unsigned)((K + TILE_K - 1) / TILE_K), (unsigned)((M + TILE_M - 1) / TILE_M));
    bool vec = opf_cuda_aligned16(x) && (!o.qr || ((uintptr_t)o.qr & 7u) == 0) &&
               (!o.qc || ((uintptr_t)o.qc & 7u) == 0);
    if (vec) mx_kernel<T, MODE, true><<<grid, THREADS, 0, st>>>(x, M, K, o, rcp, e4m3);
    else mx_kernel<T, MODE, false><<<grid, THREADS, 0, st>>>(x, M, K, o, rcp, e4m3);
}

template <typename T>
static void launch(cudaStream_t st, const void *x, int64_t M, int64_t K, const mx_out &o,
                   float rcp, bool e4m3, bool two_d)
{
    const T *xt = (const T *)x;
    if (two_d) launch_mode<T, MX_2D>(st, xt, M, K, o, rcp, e4m3);
    else if (o.qc) launch_mode<T, MX_COL>(st, xt, M, K, o, rcp, e4m3);
    else launch_mode<T, MX_ROW>(st, xt, M, K, o, rcp, e4m3);
}

extern "C" opf_status opf_cuda_quantize_mxfp8(opf_ctx *ctx, const opf_quantizer *q,
                                              const opf_tensor *in, opf_tensor *out,
                                              const opf_quantize_state *qs)
{
    const char *fn = "quantize (mxfp8)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    mx_out o;
    int64_t M = 0, K = 0;
    opf_status st = out_of(ctx, out, fn, &o, &M, &K);
    if (st) return st;
    if (M == 0 || K == 0) return OPF_OK;
    /* 3.3 step 3: multiply by the rounded reciprocal 0x3B124925 / 0x37924925. */
    float rcp = 1.0f / opf_fp8_max(out->spec.qdtype);
    bool e4m3 = out->spec.qdtype == OPF_E4M3;
    bool two_d = q->mxfp8_2d || (out->spec.flags & OPF_SPEC_MXFP8_2D);
    const void *x = in->data[OPF_COMP_DATA];
    switch (in->spec.dtype) {
    case OPF_F32: launch<float>(s->stream, x, M, K, o, rcp, e4m3, two_d); break;
    case OPF_BF16: launch<__nv_bfloat16>(s->stream, x, M, K, o, rcp, e4m3, two_d); break;
    case OPF_F16: launch<__half>(s->stream, x, M, K, o, rcp, e4m3, two_d); break;
    default:
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: input dtype %s, expected f32/bf16/f16", fn,
                         opf_dtype_name(in->spec.dtype));
    }
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

template <typename O>
static opf_status dequantize(opf_ctx *ctx, const opf_tensor *t, unsigned which, O *out)
{
    const char *fn = "dequantize (mxfp8)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    mx_out o;
    int64_t M = 0, K = 0;
    opf_status st = out_of(ctx, t, fn, &o, &M, &K);
    if (st || M * K == 0) return st;
    bool col = which == OPF_USAGE_COLUMNWISE, e4m3 = t->spec.qdtype == OPF_E4M3;
    const uint8_t *q = col ? o.qc : o.qr;
    if (((uintptr_t)q & 7u) == 0 && opf_cuda_aligned16(out))
        mx_dequant8_kernel<O><<<opf_cuda_grid(s, M * K / VEC, DQ_THREADS), DQ_THREADS, 0, s->stream>>>(
            q, M, K, o, col, e4m3, out);
    else
        mx_dequant_kernel<O><<<opf_cuda_grid(s, M * K, DQ_THREADS), DQ_THREADS, 0, s->stream>>>(
            q, M, K, o, col, e4m3, out);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

extern "C" opf_status opf_cuda_dequantize_mxfp8(opf_ctx *ctx, const opf_tensor *t,
                                                unsigned which, float *out)
{
    return dequantize<float>(ctx, t, which, out);
}

extern "C" opf_status opf_cuda_dequantize_mxfp8_bf16(opf_ctx *ctx, const opf_tensor *t,
                                                     unsigned which, void *out)
{
    return dequantize<__nv_bfloat16>(ctx, t, which, (__nv_bfloat16 *)out);
}
