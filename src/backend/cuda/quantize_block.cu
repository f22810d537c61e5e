/* quantize_block.cu: FP8 block scaling on the GPU, bit for bit with
 * src/backend/cpu/quantize_block.c (docs/numerics.md 3.5, 4.2).
 *
 * One block of 512 threads per 128 x 128 tile, the tile of quantize-tile.h:
 * read once with 16-byte loads into registers, a quad of 4 rows x 8
 * columns a thread (the 16 threads along a row are a half warp), the last
 * tile first (the pass order of quantize_tensor_fp8.cu):
 *   1D rowwise: a 1x128 block is the 16 lanes of a half warp (a shuffle
 *     reduction); the bytes go straight out.
 *   1D columnwise: the column amaxes of the tile (128x1 blocks) across the
 *     warps through shared memory, one scale per column, and the cast bytes
 *     through the transposed shared tile into the transposed copy, 16 bytes
 *     a store.
 *   2D: the tile's amax from the same column amaxes; one scale for both
 *     copies (the same bytes, the columnwise one transposed).
 * Scales: fp32 scale_inv = fl32(1/s) (2.3), in the layouts of
 * 4.2. Any shape: edge tiles read zeros outside the tensor, which leave
 * every amax as the CPU's amax of the valid elements. */
#include "backend/cuda/quantize-tile.h"

enum {
    BLK = 128,
    VEC = 8,
    TC = BLK / VEC,                /* threads along a row: 16 (a half warp) */
    THREADS = TC * OPF_QT_QUADS,   /* a quad each: 512 */
    WARPS = THREADS / 32,
    DQ_THREADS = 256,
};
static_assert((int)BLK == (int)OPF_QT_ROWS, "a tile is one 128 x 128 block");

typedef enum blk_mode { B_ROW = 0, B_COL = 1, B_2D = 2 } blk_mode;

/* Where the copies go; NULL data: the copy is not wanted.
 * 1D: rowwise sinv (kb, m) at kb*ld + m, columnwise (mb, k) at mb*cld + k.
 * 2D: rowwise sinv (mb, kb) at mb*ld + kb, columnwise (kb, mb) at kb*cld + mb. */
typedef struct blk_out {
    uint8_t *q, *qt;   /* [M, K] and its transpose [K, M] */
    float   *sinv, *csinv;
    int64_t  ld, cld;
} blk_out;

/* What a block's scale needs (2.1, 3.5). */
typedef struct blk_scale {
    float fp8_max, eps, vinf;
    bool  pow2;
} blk_scale;

__device__ __forceinline__ float scale_of(const blk_scale &b, unsigned key)
{
    return opf_dev_scale_from_amax(__uint_as_float(key), b.fp8_max, b.pow2, b.eps, b.vinf);
}

/* 2.3: fl32(1/s). opf_block_scale_inv goes through double, whose 53 bits
 * (>= 2 * 24 + 2) make its double rounding innocuous: the same value as the
 * correctly rounded fp32 reciprocal, which costs far less here. */
__device__ __forceinline__ float scale_inv(float s) { return __frcp_rn(s); }

/* The amaxes of the 4 rows a half warp holds (rk[j]: this thread's part
 * of row m + j), reduced and scattered: after the xor-8 and xor-4 steps
 * lane bits 3..2 name the row a lane keeps (2 * bit3 + bit2), after xor 2
 * and 1 every lane holds its row's amax. 5 shuffles where a reduction per
 * row takes 16, and one scale per lane where each row's took one each. */
__device__ __forceinline__ float row_amax_scatter(const float (&rk)[4], int lane)
{
    bool up8 = lane & 8, up4 = lane & 4;
    float y0 = __shfl_xor_sync(0xFFFFFFFFu, up8 ? rk[0] : rk[2], 8);
    float y1 = __shfl_xor_sync(0xFFFFFFFFu, up8 ? rk[1] : rk[3], 8);
    float k0 = fmaxf(up8 ? rk[2] : rk[0], y0), k1 = fmaxf(up8 ? rk[3] : rk[1], y1);
    float m = fmaxf(up4 ? k1 : k0, __shfl_xor_sync(0xFFFFFFFFu, up4 ? k0 : k1, 4));
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    return fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
}

/* 1D rowwise blocks: a half warp holds one row's 128 columns, each thread
 * the quad at rows m..m+3, columns k..k+7. On the way, the quad's column
 * amaxes into ck (one widening of each row for both; amaxes as floats,
 * opf_dev_amax_acc). */
template <typename T>
__device__ __forceinline__ void row_blocks(const opf_quad<T> &qv, const blk_out &o,
                                           const blk_scale &bs, int64_t m, int64_t k, int64_t M,
                                           int64_t K, bool e4m3, bool vec, float (&ck)[VEC])
{
    float rk[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float v[VEC];
        opf_quad_row(qv, j, v);
        rk[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            rk[j] = opf_dev_amax_acc(rk[j], v[i]);
            ck[i] = opf_dev_amax_acc(ck[i], v[i]);
        }
    }
    int lane = threadIdx.x % 32, jr = (lane >> 3 & 1) * 2 + (lane >> 2 & 1);
    float mine = scale_of(bs, __float_as_uint(row_amax_scatter(rk, lane)));
    if (lane % 4 == 0 && m + jr < M) o.sinv[k / BLK * o.ld + m + jr] = scale_inv(mine);
    uint2 b[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float v[VEC], s[VEC];
        float sc = __shfl_sync(0xFFFFFFFFu, mine, (lane & 16) | (j >> 1) << 3 | (j & 1) << 2);
        opf_quad_row(qv, j, v);
#pragma unroll
        for (int i = 0; i < VEC; i++) s[i] = sc;
        b[j] = opf_dev_cast8(v, s, e4m3);
    }
    opf_qtile_store_rows(o.q, b, M, K, m, k, vec);
}

/* The column amaxes of the thread's quad, max-accumulated into ck. */
template <typename T>
__device__ __forceinline__ void quad_column_keys(const opf_quad<T> &qv, float (&ck)[VEC])
{
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float v[VEC];
        opf_quad_row(qv, j, v);
#pragma unroll
        for (int i = 0; i < VEC; i++) ck[i] = opf_dev_amax_acc(ck[i], v[i]);
    }
}

/* The column amax keys of the tile into key[column] from those of the
 * threads' quads (ck): the two quads of a warp, then across the warps. */
__device__ __forceinline__ void column_keys(const float (&ck)[VEC], int tc,
                                            unsigned (&part)[WARPS][BLK], unsigned (&key)[BLK])
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < VEC; i++) {
        unsigned c = __float_as_uint(ck[i]);
        unsigned k = max(c, __shfl_xor_sync(0xFFFFFFFFu, c, 16));
        if (lane < 16) part[warp][tc * VEC + i] = k;
    }
    __syncthreads();
    if (threadIdx.x < BLK) {
        unsigned k = 0;
#pragma unroll
        for (int w = 0; w < WARPS; w++) k = max(k, part[w][threadIdx.x]);
        key[threadIdx.x] = k;
    }
    __syncthreads();
}

/* The scale of each column: its own (1D, columnwise scales) or the tile's
 * (2D, the max over the columns: both copies' scales). */
template <int MODE>
__device__ __forceinline__ void tile_scales(const unsigned (&key)[BLK], const blk_out &o,
                                            const blk_scale &bs, int64_t mb, int64_t kb,
                                            int64_t K, float (&s)[BLK])
{
    int64_t k = kb * BLK + threadIdx.x;
    if (MODE == B_COL && threadIdx.x < BLK) {
        s[threadIdx.x] = scale_of(bs, key[threadIdx.x]);
        if (k < K) o.csinv[mb * o.cld + k] = scale_inv(s[threadIdx.x]);
    }
    if (MODE == B_2D && threadIdx.x < 32) {
        unsigned t = 0;
        for (int c = threadIdx.x; c < BLK; c += 32) t = max(t, key[c]);
        float sc = scale_of(bs, opf_dev_max_lanes(t, 32));
        for (int c = threadIdx.x; c < BLK; c += 32) s[c] = sc;
        if (threadIdx.x == 0 && o.sinv) o.sinv[mb * o.ld + kb] = scale_inv(sc);
        if (threadIdx.x == 0 && o.csinv) o.csinv[kb * o.cld + mb] = scale_inv(sc);
    }
    __syncthreads();
}

/* Blocks of 512 threads an SM holds at once (the register budget): three
 * where a 2D tile of 2-byte elements fits in 40 registers (packed quads),
 * else two (at most 64: without the bound some modes take more, one block). */
template <typename T, int MODE> constexpr int min_blocks()
{
    return MODE == B_2D && sizeof(T) == 2 ? 3 : 2;
}

/* VEC_IO: K % 8 == 0, M % 16 == 0 and aligned bases: every 8-element row
 * access and 16-byte transposed store is whole or outside. */
template <typename T, int MODE, bool VEC_IO>
__global__ void __launch_bounds__(THREADS, min_blocks<T, MODE>())
block_kernel(const T *__restrict__ x, int64_t M, int64_t K, blk_out o, blk_scale bs, bool e4m3)
{
    __shared__ __align__(16) uint32_t tile[BLK][OPF_QT_QUADS];
    __shared__ unsigned part[WARPS][BLK];
    __shared__ unsigned key[BLK];
    __shared__ float s[BLK];
    int tc = threadIdx.x % TC, qd = threadIdx.x / TC;
    int64_t mb = gridDim.y - 1 - blockIdx.y, kb = gridDim.x - 1 - blockIdx.x;
    int64_t m0 = mb * BLK, k0 = kb * BLK, m = m0 + 4 * qd, k = k0 + tc * VEC;
    opf_quad<T> qv;
    opf_qtile_load<T>(x, M, K, m, k, VEC_IO, qv);
    float ck[VEC] = {0};
    if (MODE != B_2D && o.q) row_blocks(qv, o, bs, m, k, M, K, e4m3, VEC_IO, ck);
    else quad_column_keys(qv, ck);
    if (MODE == B_ROW) return;
    column_keys(ck, tc, part, key);
    tile_scales<MODE>(key, o, bs, mb, kb, K, s);
    float sc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; i++) sc[i] = s[tc * VEC + i];
    uint2 b[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float v[VEC];
        opf_quad_row(qv, j, v);
        b[j] = opf_dev_cast8(v, sc, e4m3);
    }
    if (MODE == B_2D && o.q) opf_qtile_store_rows(o.q, b, M, K, m, k, VEC_IO);
    if (!o.qt) return;
    opf_qtile_put<BLK>(tile, b, tc, qd);
    __syncthreads();
    opf_qtile_store_t<BLK, THREADS>(tile, o.qt, m0, k0, M, K, VEC_IO);
}

/* ---- dequantize: fl(fp8(q) * scale_inv of its block) (1.5) --------------- */

__global__ void block_dequant_kernel(const uint8_t *__restrict__ q, const float *__restrict__ s,
                                     int64_t M, int64_t K, int64_t ld, bool col, bool two_d,
                                     bool e4m3, float *__restrict__ out)
{
    int64_t n = M * K, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int64_t m = i / K, k = i % K;
        float si;
        if (!col) si = two_d ? s[m / BLK * ld + k / BLK] : s[k / BLK * ld + m];
        else si = two_d ? s[k / BLK * ld + m / BLK] : s[m / BLK * ld + k];
        out[i] = opf_dev_dequant(col ? q[k * M + m] : q[i], si, e4m3);
    }
}

/* ---- host side ----------------------------------------------------------- */

template <typename T, int MODE>
static void launch_mode(cudaStream_t st, const T *x, int64_t M, int64_t K, const blk_out &o,
                        const blk_scale &bs, bool e4m3)
{
    dim3 grid((unsigned)((K + BLK - 1) / BLK), (unsigned)((M + BLK - 1) / BLK));
    bool vec = K % VEC == 0 && M % 16 == 0 && opf_cuda_aligned16(x) &&
               (!o.q || opf_cuda_aligned16(o.q)) && (!o.qt || opf_cuda_aligned16(o.qt));
    if (vec) block_kernel<T, MODE, true><<<grid, THREADS, 0, st>>>(x, M, K, o, bs, e4m3);
    else block_kernel<T, MODE, false><<<grid, THREADS, 0, st>>>(x, M, K, o, bs, e4m3);
}

template <typename T>
static void launch(cudaStream_t st, const void *x, int64_t M, int64_t K, const blk_out &o,
                   const blk_scale &bs, bool e4m3, bool two_d)
{
    const T *xt = (const T *)x;
    if (two_d) launch_mode<T, B_2D>(st, xt, M, K, o, bs, e4m3);
    else if (o.qt) launch_mode<T, B_COL>(st, xt, M, K, o, bs, e4m3);
    else launch_mode<T, B_ROW>(st, xt, M, K, o, bs, e4m3);
}

extern "C" opf_status opf_cuda_quantize_block(opf_ctx *ctx, const opf_quantizer *q,
                                              const opf_tensor *in, opf_tensor *out,
                                              const opf_quantize_state *qs)
{
    const char *fn = "quantize (fp8 block)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    opf_layout L;
    opf_status st = opf_spec_layout(&out->spec, &L);
    if (st) return opf_error(ctx, st, "%s: %s", fn, opf_last_error(NULL));
    if (L.m == 0 || L.k == 0) return OPF_OK;
    bool row = out->spec.usage & OPF_USAGE_ROWWISE, col = out->spec.usage & OPF_USAGE_COLUMNWISE;
    blk_out o = {
        row ? (uint8_t *)out->data[OPF_COMP_DATA] : NULL,
        col ? (uint8_t *)out->data[OPF_COMP_COL_DATA] : NULL,
        row ? (float *)out->data[OPF_COMP_SCALE_INV] : NULL,
        col ? (float *)out->data[OPF_COMP_COL_SCALE_INV] : NULL,
        L.comp[OPF_COMP_SCALE_INV].cols, L.comp[OPF_COMP_COL_SCALE_INV].cols,
    };
    blk_scale bs = {opf_fp8_max(out->spec.qdtype), q->amax_epsilon,
                    opf_input_max_finite(in->spec.dtype), q->pow2_scales};
    bool e4m3 = out->spec.qdtype == OPF_E4M3, two_d = out->spec.scaling == OPF_SCALING_BLOCK_2D;
    const void *x = in->data[OPF_COMP_DATA];
    switch (in->spec.dtype) {
    case OPF_F32: launch<float>(s->stream, x, L.m, L.k, o, bs, e4m3, two_d); break;
    case OPF_BF16: launch<__nv_bfloat16>(s->stream, x, L.m, L.k, o, bs, e4m3, two_d); break;
    case OPF_F16: launch<__half>(s->stream, x, L.m, L.k, o, bs, e4m3, two_d); break;
    default:
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: input dtype %s, expected f32/bf16/f16", fn,
                         opf_dtype_name(in->spec.dtype));
    }
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

extern "C" opf_status opf_cuda_dequantize_block(opf_ctx *ctx, const opf_tensor *t,
                                                unsigned which, float *out)
{
    const char *fn = "dequantize (fp8 block)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    if (st) return opf_error(ctx, st, "%s: %s", fn, opf_last_error(NULL));
    if (L.m * L.k == 0) return OPF_OK;
    bool col = which == OPF_USAGE_COLUMNWISE;
    int sc = col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV;
    block_dequant_kernel<<<opf_cuda_grid(s, L.m * L.k, DQ_THREADS), DQ_THREADS, 0, s->stream>>>(
        (const uint8_t *)t->data[col ? OPF_COMP_COL_DATA : OPF_COMP_DATA],
        (const float *)t->data[sc], L.m, L.k, L.comp[sc].cols, col,
        t->spec.scaling == OPF_SCALING_BLOCK_2D, t->spec.qdtype == OPF_E4M3, out);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}
