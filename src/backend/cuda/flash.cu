/* flash.cu: causal self-attention (backend/nn.h's attn_fwd / attn_bwd) as
 * FlashAttention-2 style tiled kernels on the tensor cores
 * (OPF_CUDA_ATTENTION=flash2, and unset where cuDNN does not load; flash and
 * flash1p; nn.cu): the
 * [T, T] scores live a tile at a time in shared memory or registers, never
 * in global memory. qkv's logical dtype picks the products: bf16 and f16
 * the 16-bit kernels (with flash2 the mma.sync ones of the last section,
 * with flash1p the same with one backward kernel, with flash the WMMA ones
 * of the section before), anything else these TF32 ones. The
 * kernels read qkv and do in one dtype (fp32 for TF32, E for the 16-bit
 * ones) and the 16-bit ones write dqkv as E or fp32: a caller's array
 * stored otherwise goes through a cast copy (the host section).
 *
 * The TF32 products are WMMA m16n16k8 with fp32 accumulation: q,
 * k, v, do, p and ds are rounded to TF32 (10 mantissa bits) as they enter
 * shared memory; everything else (the softmax, its running max and sum, lse,
 * D_i, the accumulators) is fp32, and so is o (attn.cu's
 * opf_cuda_attn_fwd_typed_o stores it as nn.h's o_t).
 * The results differ from the CPU's by about TF32's rounding (test_cuda_nn
 * bounds them). A block is 4 warps over a 64-row tile of one (batch, head),
 * each warp 16 rows of it:
 *   forward   per query tile, key tiles 0 .. diagonal: S = Q K^T (a warp's
 *             16 x 64 strip), the online softmax of its rows in shared
 *             memory (running max m, sum l, factor alpha), O = alpha O + P V
 *             with O in registers; o = O / l, lse = m + log l.
 *   backward  D_i = do_i . o_i (fp32); per key tile, query tiles from the
 *             diagonal down: P = exp(S - lse), dP = dO V^T, dS = P (dP - D_i)
 *             scale, dV += P^T dO, dK += dS^T Q; per query tile, key tiles up
 *             to the diagonal: dQ += dS K. Two kernels, no atomics: the sums
 *             are in a fixed order (deterministic).
 * Tiles above the diagonal are skipped, and on the diagonal a warp skips the
 * 16-column groups its rows cannot see. Partial tiles (T not a multiple of
 * 64) are zero rows, masked. D is 64 or 128 (a template); other D, and
 * operands not 16-byte aligned, take attn.cu's batched GEMMs. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <type_traits>

#include "backend/cuda/cuda-impl.h"

using namespace nvcuda;

enum {
    TILE    = 64,          /* queries or keys per tile */
    NWARP   = 4,           /* warp w: rows 16w .. 16w + 15 of the block's tile */
    THREADS = 32 * NWARP,
    SLD     = TILE + 8,    /* row stride of a score strip (padded: fewer bank conflicts) */
    MAX_TILES = 65535,     /* gridDim.y */
};
static const float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> frag_b;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> frag_bt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> frag_c;
enum { NACC = frag_c::num_elements };

/* One (batch, head) of the block: rows of q, k, v at q, q + C, q + 2C (row
 * stride 3C); of o and do at stride C; lse and D_i at bh * T. */
typedef struct flash_dims {
    int64_t T, H, C;
    int     tiles;  /* ceil(T / TILE) */
    float   scale;  /* 1 / sqrt(D) */
} flash_dims;

typedef struct flash_head {
    int64_t bh, q, o;  /* offsets of the head's row 0 in qkv and in o / do */
} flash_head;

static __device__ flash_head flash_head_of(const flash_dims &f, int D)
{
    int64_t bh = blockIdx.x, b = bh / f.H, h = bh % f.H;
    return {bh, b * f.T * 3 * f.C + h * D, b * f.T * f.C + h * D};
}

static __device__ __forceinline__ float tf32(float x) { return wmma::__float_to_tf32(x); }

/* Rows of the tile from t0 that exist: min(TILE, T - t0). */
static __device__ __forceinline__ int tile_rows(int64_t T, int64_t t0)
{
    return T - t0 < TILE ? (int)(T - t0) : TILE;
}

/* Rows [0, n) of a TILE x D tile (row stride ld) into dst (row stride
 * D + 8), rounded to TF32; rows n .. TILE - 1 zero. The whole block, 16-byte
 * loads (src 16-byte aligned, ld a multiple of 4). */
template <int D>
static __device__ void load_tile(float *dst, const float *src, int64_t ld, int n)
{
    constexpr int V4 = D / 4;
    for (int e = threadIdx.x; e < TILE * V4; e += THREADS) {
        int r = e / V4, c = e % V4 * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < n) v = __ldg((const float4 *)(src + r * ld + c));
        v = make_float4(tf32(v.x), tf32(v.y), tf32(v.z), tf32(v.w));
        *(float4 *)(dst + r * (D + 8) + c) = v;
    }
}

/* A warp's strip of scores: s[r][16n + c] = a[r] . bk[16n + c] for the
 * column groups n0 <= n < n1; a 16 x D and bk TILE x D at row stride D + 8,
 * s at SLD. */
template <int D>
static __device__ void strip_abt(float *s, const float *a, const float *bk, int n0, int n1)
{
    for (int n = n0; n < n1; n++) {
        frag_c c;
        wmma::fill_fragment(c, 0.0f);
#pragma unroll
        for (int k = 0; k < D; k += 8) {
            frag_a fa;
            frag_bt fb;
            wmma::load_matrix_sync(fa, a + k, D + 8);
            wmma::load_matrix_sync(fb, bk + n * 16 * (D + 8) + k, D + 8);
            wmma::mma_sync(c, fa, fb, c);
        }
        wmma::store_matrix_sync(s + n * 16, c, SLD, wmma::mem_row_major);
    }
}

/* acc[nd] += p[., k0 .. k1) b[k0 .. k1, 16 nd ..): a warp's 16 x D
 * accumulator; p a strip (stride SLD), b a TILE x D tile (stride D + 8). */
template <int D>
static __device__ void strip_ab(frag_c (&acc)[D / 16], const float *p, const float *b, int k0,
                                int k1)
{
    for (int k = k0; k < k1; k += 8) {
        frag_a fa;
        wmma::load_matrix_sync(fa, p + k, SLD);
#pragma unroll
        for (int nd = 0; nd < D / 16; nd++) {
            frag_b fb;
            wmma::load_matrix_sync(fb, b + k * (D + 8) + nd * 16, D + 8);
            wmma::mma_sync(acc[nd], fa, fb, acc[nd]);
        }
    }
}

/* A warp's accumulators into its 16 rows of buf (stride D + 8), then the
 * rows that exist (n of them) to dst (row stride ld), times mul[r] when mul
 * is not NULL. buf must be rows only this warp reads. */
template <int D>
static __device__ void strip_store(frag_c (&acc)[D / 16], float *buf, float *dst, int64_t ld,
                                   int n, const float *mul)
{
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++)
        wmma::store_matrix_sync(buf + nd * 16, acc[nd], D + 8, wmma::mem_row_major);
    __syncwarp();
    constexpr int V4 = D / 4;
    for (int e = threadIdx.x % 32; e < 16 * V4; e += 32) {
        int r = e / V4, c = e % V4 * 4;
        if (r >= n) break;
        float4 v = *(const float4 *)(buf + r * (D + 8) + c);
        if (mul) v = make_float4(v.x * mul[r], v.y * mul[r], v.z * mul[r], v.w * mul[r]);
        *(float4 *)(dst + r * ld + c) = v;
    }
}

/* The row (0..15) of each element of this lane's accumulator fragment: the
 * fragment layout is the hardware's, so it is read back from a loaded
 * matrix whose elements are their own row numbers (scratch: 16 x 16 at
 * stride SLD, this warp's). */
template <typename F>
static __device__ void frag_rows(float *scratch, int ld, int rows[NACC])
{
    static_assert(F::num_elements == NACC, "an accumulator of 8 floats a lane");
    int lane = threadIdx.x % 32;
    for (int e = lane; e < 256; e += 32) scratch[e / 16 * ld + e % 16] = (float)(e / 16);
    __syncwarp();
    F m;
    wmma::load_matrix_sync(m, scratch, ld, wmma::mem_row_major);
#pragma unroll
    for (int i = 0; i < NACC; i++) rows[i] = (int)m.x[i];
    __syncwarp();
}

/* The online softmax of a warp's strip (16 query rows from i, keys from j0;
 * columns < ncol computed): two lanes a row, each every other column.
 * Scores in log2 units (s * scale * log2 e); m and l are the row's running
 * max and sum (both lanes hold them); P (TF32) replaces S, and the factor
 * that rescales the row's O goes to alpha[row]. */
static __device__ void online_softmax(float *S, int64_t i, int64_t j0, int64_t T, int ncol,
                                      float sl2, float &m, float &l, float *alpha)
{
    int lane = threadIdx.x % 32, r = lane / 2;
    float *s = S + r * SLD, mt = -INFINITY;
    i += r;
    for (int c = lane % 2; c < ncol; c += 2)
        if (j0 + c <= i && j0 + c < T) mt = fmaxf(mt, s[c] * sl2);
    mt = fmaxf(mt, __shfl_xor_sync(0xFFFFFFFFu, mt, 1));
    float mn = fmaxf(m, mt), sum = 0.0f;  /* finite: key 0 of tile 0, and the
                                           * diagonal's first, are every row's */
    for (int c = lane % 2; c < TILE; c += 2) {
        bool ok = c < ncol && j0 + c <= i && j0 + c < T;
        float p = ok ? exp2f(s[c] * sl2 - mn) : 0.0f;
        s[c] = tf32(p);
        sum += p;
    }
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    float a = exp2f(m - mn);  /* 0 on the first tile (m = -inf) */
    l = l * a + sum;
    m = mn;
    if (lane % 2 == 0) alpha[r] = a;
    __syncwarp();
}

/* acc *= f[row] per element (rows: frag_rows). */
template <typename F, int N>
static __device__ void scale_rows(F (&acc)[N], const int rows[NACC], const float *f)
{
    float g[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++) g[i] = f[rows[i]];
#pragma unroll
    for (int nd = 0; nd < N; nd++)
#pragma unroll
        for (int i = 0; i < NACC; i++) acc[nd].x[i] *= g[i];
}

/* Shared memory of the forward: K, V tiles (Q first passes through K's),
 * the score strips, a float per row. */
template <int D> static constexpr size_t fwd_smem_bytes()
{
    return sizeof(float) * (2 * TILE * (D + 8) + TILE * SLD + TILE);
}

/* A block per (batch, head) x query tile, the longest (last) tiles first. */
template <int D>
__global__ void __launch_bounds__(THREADS) flash_fwd_kernel(const float *qkv, float *o, float *lse,
                                                            flash_dims f)
{
    extern __shared__ __align__(128) float sm[];
    float *Ks = sm, *Vs = Ks + TILE * (D + 8), *Ss = Vs + TILE * (D + 8), *rowf = Ss + TILE * SLD;
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int qt = f.tiles - 1 - (int)blockIdx.y;
    int64_t i0 = (int64_t)qt * TILE, ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const float *q = qkv + hd.q, *k = q + f.C, *v = k + f.C;
    float *Sw = Ss + w * 16 * SLD, *alpha = rowf + w * 16;
    float sl2 = f.scale * LOG2E;

    int rows[NACC];
    frag_rows<frag_c>(Sw, SLD, rows);
    load_tile<D>(Ks, q + i0 * ld, ld, tile_rows(T, i0));
    __syncthreads();
    frag_a qf[D / 8];  /* the warp's 16 query rows, for every key tile */
#pragma unroll
    for (int kk = 0; kk < D / 8; kk++)
        wmma::load_matrix_sync(qf[kk], Ks + w * 16 * (D + 8) + kk * 8, D + 8);
    frag_c acc[D / 16];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) wmma::fill_fragment(acc[nd], 0.0f);
    float m = -INFINITY, l = 0.0f;

    for (int kt = 0; kt <= qt; kt++) {
        int64_t j0 = (int64_t)kt * TILE;
        __syncthreads();  /* every warp is done with the last K, V (and Q) */
        int nk = tile_rows(T, j0);
        load_tile<D>(Ks, k + j0 * ld, ld, nk);
        load_tile<D>(Vs, v + j0 * ld, ld, nk);
        __syncthreads();
        int ng = kt == qt ? w + 1 : TILE / 16;  /* column groups this warp's rows see */
        for (int n = 0; n < ng; n++) {
            frag_c c;
            wmma::fill_fragment(c, 0.0f);
#pragma unroll
            for (int kk = 0; kk < D / 8; kk++) {
                frag_bt fb;
                wmma::load_matrix_sync(fb, Ks + n * 16 * (D + 8) + kk * 8, D + 8);
                wmma::mma_sync(c, qf[kk], fb, c);
            }
            wmma::store_matrix_sync(Sw + n * 16, c, SLD, wmma::mem_row_major);
        }
        __syncwarp();
        online_softmax(Sw, i0 + w * 16, j0, T, 16 * ng, sl2, m, l, alpha);
        scale_rows(acc, rows, alpha);
        strip_ab<D>(acc, Sw, Vs, 0, 16 * ng);
    }

    /* o = O / l, lse = m + log l (natural units) */
    __syncwarp();  /* every lane has read the last alpha */
    int r = lane / 2;
    int64_t i = i0 + w * 16 + r;
    if (lane % 2 == 0) {
        alpha[r] = 1.0f / l;
        if (i < T) lse[hd.bh * T + i] = (m + log2f(l)) * LN2;
    }
    __syncthreads();  /* K's rows become the warps' output buffers */
    int n = min(16, tile_rows(T, i0) - w * 16);
    if (n > 0)
        strip_store<D>(acc, Ks + w * 16 * (D + 8), o + hd.o + (i0 + w * 16) * f.C, f.C, n, alpha);
}

/* A stored value as fp32 (exact). */
static __device__ __forceinline__ float f32_of(float x) { return x; }
static __device__ __forceinline__ float f32_of(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float f32_of(__half x) { return __half2float(x); }

/* D_i = do_i . o_i of every (batch, head, row) x = bh * T + i (lse's
 * layout), into di: a warp a row; do of its storage type S. */
template <typename S>
static __global__ void flash_delta_kernel(const float *o, const S *dout, float *di, int64_t rows,
                                          flash_dims f, int D)
{
    int lane = threadIdx.x % 32;
    int64_t nw = (int64_t)gridDim.x * blockDim.x / 32, H = f.C / D;
    for (int64_t x = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; x < rows; x += nw) {
        int64_t bh = x / f.T, i = x % f.T, off = (bh / H * f.T + i) * f.C + bh % H * D;
        float s = 0.0f;
        for (int d = lane; d < D; d += 32) s += f32_of(dout[off + d]) * o[off + d];
        for (int sh = 16; sh; sh >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, sh);
        if (lane == 0) di[x] = s;
    }
}

/* Shared memory of each backward kernel: four tiles, two strips, lse and
 * D_i of a query tile. */
template <int D> static constexpr size_t bwd_smem_bytes()
{
    return sizeof(float) * (4 * TILE * (D + 8) + 2 * TILE * SLD + 2 * TILE);
}

/* The backward kernels' shared memory: the block's own two tiles (K, V
 * for dK and dV; Q, dO for dQ) and warp w's 16 rows of them, the two tiles
 * it loops over, w's two score strips, lse (log2 units) and D_i of the
 * current query tile. */
typedef struct bwd_smem {
    float *own[2], *own_w[2], *loop[2], *strip[2], *lse2, *dis;
} bwd_smem;

/* The backward kernels' arguments: nn.h's, and di the D_i of every row.
 * qkv and dout are fp32 for the TF32 kernels, E for the 16-bit ones, whose
 * dqkv is E when out16, else fp32. */
typedef struct bwd_args {
    const void  *qkv, *dout;
    const float *lse, *di;
    void        *dqkv;
    flash_dims   f;
    bool         out16;
    float       *dq_acc;   /* flash1p: dQ's fp32 sums, [B*H, T, D] */
    int         *dq_turn;  /* flash1p: parts added to each (bh, 64-query tile), zeroed */
} bwd_args;

template <int D> static __device__ bwd_smem bwd_smem_of()
{
    extern __shared__ __align__(128) float sm[];
    bwd_smem m;
    int w = threadIdx.x / 32;
    float *strips = sm + 4 * TILE * (D + 8);
    for (int p = 0; p < 2; p++) {
        m.own[p] = sm + p * TILE * (D + 8);
        m.own_w[p] = m.own[p] + w * 16 * (D + 8);
        m.loop[p] = sm + (2 + p) * TILE * (D + 8);
        m.strip[p] = strips + p * TILE * SLD + w * 16 * SLD;
    }
    m.lse2 = strips + 2 * TILE * SLD;
    m.dis = m.lse2 + TILE;
    return m;
}

/* lse (in log2 units) and D_i of the ROWS query rows from i0 (n rows; 0
 * past), the whole block of NT threads. */
template <int ROWS = TILE, int NT = THREADS>
static __device__ void load_rows(float *lse2, float *dis, const float *lse, const float *di,
                                 int64_t i0, int n)
{
    for (int e = threadIdx.x; e < ROWS; e += NT) {
        lse2[e] = e < n ? lse[i0 + e] * LOG2E : 0.0f;
        dis[e] = e < n ? di[i0 + e] : 0.0f;
    }
}

/* dK, dV: a block per (batch, head) x key tile j0, query tiles from the
 * diagonal to the end. Warp w holds its 16 keys' dK and dV in registers;
 * its strips are transposed (rows keys, columns queries). */
template <int D> __global__ void __launch_bounds__(THREADS) flash_dkv_kernel(bwd_args a)
{
    bwd_smem m = bwd_smem_of<D>();
    const flash_dims &f = a.f;
    float *Ks = m.own[0], *Vs = m.own[1], *Qs = m.loop[0], *dOs = m.loop[1];
    float *Kw = m.own_w[0], *Vw = m.own_w[1], *Pw = m.strip[0], *dSw = m.strip[1];
    int w = threadIdx.x / 32, lane = threadIdx.x % 32, kt = (int)blockIdx.y;
    int64_t j0 = (int64_t)kt * TILE, ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const float *q = (const float *)a.qkv + hd.q, *dO = (const float *)a.dout + hd.o;
    float sl2 = f.scale * LOG2E;

    int nk = tile_rows(T, j0);
    load_tile<D>(Ks, q + f.C + j0 * ld, ld, nk);
    load_tile<D>(Vs, q + 2 * f.C + j0 * ld, ld, nk);
    frag_c dk[D / 16], dv[D / 16];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) {
        wmma::fill_fragment(dk[nd], 0.0f);
        wmma::fill_fragment(dv[nd], 0.0f);
    }

    for (int qt = kt; qt < f.tiles; qt++) {
        int64_t i0 = (int64_t)qt * TILE;
        int nq = tile_rows(T, i0);
        __syncthreads();  /* every warp is done with the last Q, dO */
        load_tile<D>(Qs, q + i0 * ld, ld, nq);
        load_tile<D>(dOs, dO + i0 * f.C, f.C, nq);
        load_rows(m.lse2, m.dis, a.lse + hd.bh * T, a.di + hd.bh * T, i0, nq);
        __syncthreads();
        int g0 = qt == kt ? w : 0;  /* on the diagonal, queries below 16w see none of these keys */
        strip_abt<D>(Pw, Kw, Qs, g0, TILE / 16);   /* S^T */
        strip_abt<D>(dSw, Vw, dOs, g0, TILE / 16); /* dP^T */
        __syncwarp();
        for (int e = lane; e < 16 * TILE; e += 32) {
            int r = e / TILE, c = e % TILE;
            int64_t j = j0 + w * 16 + r, i = i0 + c;
            bool ok = c >= 16 * g0 && i >= j && i < T;
            float p = ok ? exp2f(Pw[r * SLD + c] * sl2 - m.lse2[c]) : 0.0f;
            float ds = ok ? p * (dSw[r * SLD + c] - m.dis[c]) * f.scale : 0.0f;
            Pw[r * SLD + c] = tf32(p);
            dSw[r * SLD + c] = tf32(ds);
        }
        __syncwarp();
        strip_ab<D>(dv, Pw, dOs, 16 * g0, TILE);  /* dV += P^T dO */
        strip_ab<D>(dk, dSw, Qs, 16 * g0, TILE);  /* dK += dS^T Q */
    }
    /* the warp's own K and V rows (only it reads them) hold dK and dV on their way out */
    int n = min(16, nk - w * 16);
    if (n <= 0) return;
    float *row = (float *)a.dqkv + hd.q + (j0 + w * 16) * ld;
    strip_store<D>(dk, Kw, row + f.C, ld, n, NULL);
    strip_store<D>(dv, Vw, row + 2 * f.C, ld, n, NULL);
}

/* dQ: a block per (batch, head) x query tile i0 (the longest first), key
 * tiles up to the diagonal; warp w holds its 16 queries' dQ in registers. */
template <int D> __global__ void __launch_bounds__(THREADS) flash_dq_kernel(bwd_args a)
{
    bwd_smem m = bwd_smem_of<D>();
    const flash_dims &f = a.f;
    float *Qs = m.own[0], *dOs = m.own[1], *Ks = m.loop[0], *Vs = m.loop[1];
    float *Qw = m.own_w[0], *dOw = m.own_w[1], *Sw = m.strip[0], *dPw = m.strip[1];
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int qt = f.tiles - 1 - (int)blockIdx.y;
    int64_t i0 = (int64_t)qt * TILE, ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const float *q = (const float *)a.qkv + hd.q;
    float sl2 = f.scale * LOG2E;

    int nq = tile_rows(T, i0);
    load_tile<D>(Qs, q + i0 * ld, ld, nq);
    load_tile<D>(dOs, (const float *)a.dout + hd.o + i0 * f.C, f.C, nq);
    load_rows(m.lse2, m.dis, a.lse + hd.bh * T, a.di + hd.bh * T, i0, nq);
    frag_c dq[D / 16];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) wmma::fill_fragment(dq[nd], 0.0f);

    for (int kt = 0; kt <= qt; kt++) {
        int64_t j0 = (int64_t)kt * TILE;
        __syncthreads();  /* every warp is done with the last K, V */
        int nk = tile_rows(T, j0);
        load_tile<D>(Ks, q + f.C + j0 * ld, ld, nk);
        load_tile<D>(Vs, q + 2 * f.C + j0 * ld, ld, nk);
        __syncthreads();
        int ng = kt == qt ? w + 1 : TILE / 16;
        strip_abt<D>(Sw, Qw, Ks, 0, ng);    /* S */
        strip_abt<D>(dPw, dOw, Vs, 0, ng);  /* dP */
        __syncwarp();
        for (int e = lane; e < 16 * TILE; e += 32) {
            int r = e / TILE, c = e % TILE;
            int64_t i = i0 + w * 16 + r, j = j0 + c;
            bool ok = c < 16 * ng && j <= i && i < T;
            float p = ok ? exp2f(Sw[r * SLD + c] * sl2 - m.lse2[w * 16 + r]) : 0.0f;
            float ds = ok ? p * (dPw[r * SLD + c] - m.dis[w * 16 + r]) * f.scale : 0.0f;
            Sw[r * SLD + c] = tf32(ds);
        }
        __syncwarp();
        strip_ab<D>(dq, Sw, Ks, 0, 16 * ng);  /* dQ += dS K */
    }
    int n = min(16, nq - w * 16);
    if (n > 0) strip_store<D>(dq, Qw, (float *)a.dqkv + hd.q + (i0 + w * 16) * ld, ld, n, NULL);
}

/* ---- 16-bit inputs ------------------------------------------------------------
 * When qkv's logical dtype is bf16 or f16 its values are exact in that type,
 * so q, k, v are read in it (E, the caller's storage or an exact copy) and
 * the products run as WMMA m16n16k16 in that type with fp32 accumulation;
 * p, ds and do are rounded to it (as FlashAttention and cuDNN do; do is
 * read as E too, while D_i takes do as stored), the softmax,
 * m, l, lse, D_i and the accumulators stay fp32. E is __nv_bfloat16 or
 * __half. Shared memory per element halves, so a block is NW16 = 8 warps
 * over its own 128-row tile (queries in the forward and dQ, keys in dK dV)
 * and loops over 64-row tiles of the other side, as the TF32 kernels do.
 *
 * A warp's strip is 16 rows of SLD16 = 76 floats: scores from the tensor
 * cores, read back a row per lane pair (lane 2r + h: columns 8k + 4h ..
 * 8k + 4h + 3, float4), then overwritten in place by p (and ds) in E at a
 * row stride of 2 SLD16 elements: p in elements 0..63, ds in 64..127 of the
 * row's 304 bytes. 76 = 12 mod 32 words, so the float4 reads, the WMMA
 * stores of the scores, the 8-byte writes of p and the WMMA loads of p all
 * hit distinct banks. */
enum {
    NW16      = 8,
    OWN16     = 16 * NW16,  /* rows of a block's own tile */
    THREADS16 = 32 * NW16,
    SLD16     = TILE + 12,
    PLD16     = 2 * SLD16,  /* row stride of p and ds in a strip, in elements */
};

template <typename E> struct frag16 {
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major> a;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major> b;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major> bt;
};
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc16;

/* Two floats rounded to E, the first in the low half (the lower address). */
template <typename E> static __device__ __forceinline__ uint32_t pack2(float x, float y);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float x, float y)
{
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* Rows [0, n) of a ROWS x D tile of E (row stride ld) into dst (row
 * stride D + 8); rows n .. ROWS - 1 zero. The whole block, 16-byte loads
 * and stores (src 16-byte aligned, ld a multiple of 8). */
template <typename E, int D, int ROWS>
static __device__ void load_tile16(E *dst, const E *src, int64_t ld, int n)
{
    constexpr int V8 = D / 8;
    for (int e = threadIdx.x; e < ROWS * V8; e += THREADS16) {
        int r = e / V8, c = e % V8 * 8;
        uint4 u = make_uint4(0, 0, 0, 0);
        if (r < n) u = __ldg((const uint4 *)(src + r * ld + c));
        *(uint4 *)(dst + r * (D + 8) + c) = u;
    }
}

/* Rows of the tile of `rows` from t0 that exist. */
static __device__ __forceinline__ int rows_from(int64_t T, int64_t t0, int rows)
{
    return T - t0 < rows ? (int)(T - t0) : rows;
}

/* s[r][16n + c] = a[r] . bk[16n + c] for n0 <= n < n1 (a warp's strip of
 * scores, float at SLD16); a 16 x D in fragments, bk TILE x D (E at stride
 * D + 8). */
template <typename E, int D>
static __device__ void strip_abt16(float *s, const typename frag16<E>::a (&fa)[D / 16],
                                   const E *bk, int n0, int n1)
{
    for (int n = n0; n < n1; n++) {
        acc16 c;
        wmma::fill_fragment(c, 0.0f);
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            typename frag16<E>::bt fb;
            wmma::load_matrix_sync(fb, bk + n * 16 * (D + 8) + kk * 16, D + 8);
            wmma::mma_sync(c, fa[kk], fb, c);
        }
        wmma::store_matrix_sync(s + n * 16, c, SLD16, wmma::mem_row_major);
    }
}

/* The same with a 16 x D from shared memory (E at stride D + 8). */
template <typename E, int D>
static __device__ void strip_abt16(float *s, const E *a, const E *bk, int n0, int n1)
{
    typename frag16<E>::a fa[D / 16];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) wmma::load_matrix_sync(fa[kk], a + kk * 16, D + 8);
    strip_abt16<E, D>(s, fa, bk, n0, n1);
}

/* acc[nd] += p[., k0 .. k1) b[k0 .. k1, 16 nd ..): p E in a strip (stride
 * PLD16), b a TILE x D tile (stride D + 8). */
template <typename E, int D>
static __device__ void strip_ab16(acc16 (&acc)[D / 16], const E *p, const E *b, int k0, int k1)
{
    for (int k = k0; k < k1; k += 16) {
        typename frag16<E>::a fa;
        wmma::load_matrix_sync(fa, p + k, PLD16);
#pragma unroll
        for (int nd = 0; nd < D / 16; nd++) {
            typename frag16<E>::b fb;
            wmma::load_matrix_sync(fb, b + k * (D + 8) + nd * 16, D + 8);
            wmma::mma_sync(acc[nd], fa, fb, acc[nd]);
        }
    }
}

/* The dtype of E, and results stored as O (fp32, or E rounded as
 * opf_dev_from_f32 rounds: the bits of the CPU's fp32 -> E). */
template <typename E> struct e_dtype { static constexpr opf_dtype value = OPF_BF16; };
template <> struct e_dtype<__half> { static constexpr opf_dtype value = OPF_F16; };

template <typename E> static __device__ __forceinline__ uint32_t round2(float x, float y)
{
    constexpr opf_dtype DT = e_dtype<E>::value;
    return (uint32_t)opf_dev_from_f32<DT>(x) | (uint32_t)opf_dev_from_f32<DT>(y) << 16;
}
static __device__ __forceinline__ void store2(float *p, float x, float y)
{
    *(float2 *)p = make_float2(x, y);
}
template <typename E> static __device__ __forceinline__ void store2(E *p, float x, float y)
{
    *(uint32_t *)p = round2<E>(x, y);
}
static __device__ __forceinline__ void store4(float *p, float4 v) { *(float4 *)p = v; }
template <typename E> static __device__ __forceinline__ void store4(E *p, float4 v)
{
    *(uint2 *)p = make_uint2(round2<E>(v.x, v.y), round2<E>(v.z, v.w));
}

/* A warp's 16 x D accumulators out through its strip, 64 columns at a time:
 * the rows that exist (n) to dst (O, row stride ld), times mul[r] when mul
 * is not NULL. The warp must be done reading the strip. */
template <int D, typename O>
static __device__ void strip_out16(acc16 (&acc)[D / 16], float *strip, O *dst, int64_t ld, int n,
                                   const float *mul)
{
    int lane = threadIdx.x % 32;
    for (int c0 = 0; c0 < D; c0 += TILE) {
        __syncwarp();
#pragma unroll
        for (int nd = 0; nd < TILE / 16; nd++)
            wmma::store_matrix_sync(strip + nd * 16, acc[c0 / 16 + nd], SLD16,
                                    wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 16 * TILE / 4; e += 32) {
            int r = e / (TILE / 4), c = e % (TILE / 4) * 4;
            if (r >= n) break;
            float4 v = *(const float4 *)(strip + r * SLD16 + c);
            if (mul) v = make_float4(v.x * mul[r], v.y * mul[r], v.z * mul[r], v.w * mul[r]);
            store4(dst + r * ld + c0 + c, v);
        }
    }
}

/* This lane's 32 values of a strip (row lane / 2; columns col32(e)). */
static __device__ __forceinline__ int col32(int e)
{
    return 8 * (e / 4) + 4 * (threadIdx.x % 2) + e % 4;
}

static __device__ __forceinline__ void read32(const float *strip, float x[32])
{
    const float *s = strip + threadIdx.x % 32 / 2 * SLD16 + 4 * (threadIdx.x % 2);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float4 v = *(const float4 *)(s + 8 * k);
        x[4 * k] = v.x, x[4 * k + 1] = v.y, x[4 * k + 2] = v.z, x[4 * k + 3] = v.w;
    }
}

/* The lane's 32 values, rounded to E, into p (a strip's E view, stride
 * PLD16) at the same places. */
template <typename E> static __device__ __forceinline__ void write32(E *p, const float x[32])
{
    E *d = p + threadIdx.x % 32 / 2 * PLD16 + 4 * (threadIdx.x % 2);
#pragma unroll
    for (int k = 0; k < 8; k++)
        *(uint2 *)(d + 8 * k) = make_uint2(pack2<E>(x[4 * k], x[4 * k + 1]),
                                           pack2<E>(x[4 * k + 2], x[4 * k + 3]));
}

/* The online softmax of a warp's strip (rows from i, keys from j0, columns
 * < ncol computed), two lanes a row: m and l as online_softmax's (log2
 * units), P (E) over S, the factor that rescales the row's O to alpha[row]. */
template <typename E>
static __device__ void online_softmax16(float *S, int64_t i, int64_t j0, int64_t T, int ncol,
                                        float sl2, float &m, float &l, float *alpha)
{
    int lane = threadIdx.x % 32, r = lane / 2;
    float x[32], mt = -INFINITY;
    read32(S, x);
    i += r;
#pragma unroll
    for (int e = 0; e < 32; e++) {
        int c = col32(e);
        if (!(c < ncol && j0 + c <= i && j0 + c < T)) x[e] = -INFINITY;
        mt = fmaxf(mt, x[e]);
    }
    mt = fmaxf(mt, __shfl_xor_sync(0xFFFFFFFFu, mt, 1));
    /* finite: key j0 is every row's (j0 <= the warp's first row) */
    float mn = fmaxf(m, mt * sl2), sum = 0.0f;
#pragma unroll
    for (int e = 0; e < 32; e++) {
        x[e] = exp2f(__fmaf_rn(x[e], sl2, -mn));  /* -inf: 0 */
        sum += x[e];
    }
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    float a = exp2f(m - mn);  /* 0 on the first tile (m = -inf) */
    l = l * a + sum;
    m = mn;
    __syncwarp();  /* every lane has read its scores */
    write32<E>((E *)S, x);
    if (lane % 2 == 0) alpha[r] = a;
    __syncwarp();
}

/* Column groups of a loop tile from j0 that a warp's rows from iw see in the
 * forward and dQ (keys j0 + 16n <= iw + 15): 0 .. TILE / 16. */
static __device__ __forceinline__ int groups_seen(int64_t iw, int64_t j0, int64_t T)
{
    if (iw >= T || iw < j0) return 0;
    return (int)min((int64_t)TILE / 16, (iw - j0) / 16 + 1);
}

template <typename E, int D> static constexpr size_t fwd16_smem_bytes()
{
    return sizeof(E) * 2 * TILE * (D + 8) + sizeof(float) * NW16 * 16 * (SLD16 + 1);
}

/* A block per (batch, head) x 128-query tile (the longest first): K and V
 * tiles (the block's Q first passes through both), the warps' strips, a
 * float per row. */
template <typename E, int D>
__global__ void __launch_bounds__(THREADS16) flash16_fwd_kernel(const E *qkv, float *o,
                                                                float *lse, flash_dims f)
{
    extern __shared__ __align__(128) float sm[];
    E *Ks = (E *)sm, *Vs = Ks + TILE * (D + 8);
    float *Ss = (float *)(Vs + TILE * (D + 8)), *rowf = Ss + NW16 * 16 * SLD16;
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t i0 = (int64_t)(f.tiles - 1 - (int)blockIdx.y) * OWN16, iw = i0 + 16 * w;
    int64_t ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const E *q = qkv + hd.q, *k = q + f.C, *v = k + f.C;
    float *Sw = Ss + w * 16 * SLD16, *alpha = rowf + w * 16;
    float sl2 = f.scale * LOG2E;

    int rows[NACC];
    frag_rows<acc16>(Sw, SLD16, rows);
    load_tile16<E, D, OWN16>(Ks, q + i0 * ld, ld, rows_from(T, i0, OWN16));
    __syncthreads();
    typename frag16<E>::a qf[D / 16];  /* the warp's 16 query rows, for every key tile */
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        wmma::load_matrix_sync(qf[kk], Ks + w * 16 * (D + 8) + kk * 16, D + 8);
    acc16 acc[D / 16];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) wmma::fill_fragment(acc[nd], 0.0f);
    float m = -INFINITY, l = 0.0f;

    int kend = (int)((min(i0 + OWN16, T) - 1) / TILE);
    for (int kt = 0; kt <= kend; kt++) {
        int64_t j0 = (int64_t)kt * TILE;
        __syncthreads();  /* every warp is done with the last K, V (and Q) */
        int nk = rows_from(T, j0, TILE);
        load_tile16<E, D, TILE>(Ks, k + j0 * ld, ld, nk);
        load_tile16<E, D, TILE>(Vs, v + j0 * ld, ld, nk);
        __syncthreads();
        int ng = groups_seen(iw, j0, T);
        if (!ng) continue;
        strip_abt16<E, D>(Sw, qf, Ks, 0, ng);
        __syncwarp();
        online_softmax16<E>(Sw, iw, j0, T, 16 * ng, sl2, m, l, alpha);
        scale_rows(acc, rows, alpha);
        strip_ab16<E, D>(acc, (const E *)Sw, Vs, 0, 16 * ng);
    }

    /* o = O / l, lse = m + log l (natural units) */
    __syncwarp();  /* every lane has read the last alpha */
    int r = lane / 2;
    if (lane % 2 == 0) {
        alpha[r] = 1.0f / l;
        if (iw + r < T) lse[hd.bh * T + iw + r] = (m + log2f(l)) * LN2;
    }
    if (iw < T)
        strip_out16<D>(acc, Sw, o + hd.o + iw * f.C, f.C, (int)min((int64_t)16, T - iw), alpha);
}

/* The 16-bit backward kernels' shared memory: the block's own two tiles
 * (OWN16 rows: K, V for dK dV; Q, dO for dQ), the two TILE-row tiles it
 * loops over, the warps' strips, lse (log2 units) and D_i of OWN16 rows. */
template <typename E, int D> static constexpr size_t bwd16_smem_bytes()
{
    return sizeof(E) * (2 * OWN16 + 2 * TILE) * (D + 8) +
           sizeof(float) * (NW16 * 16 * SLD16 + 2 * OWN16);
}

template <typename E> struct bwd16_smem {
    E     *own[2], *own_w[2], *loop[2];
    float *strip, *lse2, *dis;
};

template <typename E, int D> static __device__ bwd16_smem<E> bwd16_smem_of()
{
    extern __shared__ __align__(128) float sm[];
    bwd16_smem<E> m;
    int w = threadIdx.x / 32;
    E *t = (E *)sm;
    for (int p = 0; p < 2; p++) {
        m.own[p] = t + p * OWN16 * (D + 8);
        m.own_w[p] = m.own[p] + w * 16 * (D + 8);
        m.loop[p] = t + 2 * OWN16 * (D + 8) + p * TILE * (D + 8);
    }
    float *strips = (float *)(t + (2 * OWN16 + 2 * TILE) * (D + 8));
    m.strip = strips + w * 16 * SLD16;
    m.lse2 = strips + NW16 * 16 * SLD16;
    m.dis = m.lse2 + OWN16;
    return m;
}

/* The dK dV kernels' query tile from i0 (n rows that exist; q and dO the
 * head's row 0) between two barriers: Q and dO through load(dst, src, ld,
 * n) (the kernel's loader of TILE rows), lse (log2 units) and D_i; NT
 * threads. */
template <int NT, typename E, typename L>
static __device__ void dkv_query_tile(L load, E *Qs, E *dOs, float *lse2, float *dis, const E *q,
                                      const E *dO, const bwd_args &a, int64_t bh, int64_t i0,
                                      int n)
{
    int64_t C = a.f.C, T = a.f.T;
    __syncthreads();  /* every warp is done with the last Q, dO */
    load(Qs, q + i0 * 3 * C, 3 * C, n);
    load(dOs, dO + i0 * C, C, n);
    load_rows<TILE, NT>(lse2, dis, a.lse + bh * T, a.di + bh * T, i0, n);
    __syncthreads();
}

/* dK, dV: a block per (batch, head) x 128-key tile, the 64-query tiles from
 * its first key to the end. Warp w holds its 16 keys' dK and dV in
 * registers; its strip is transposed (rows keys, columns queries): S^T,
 * then dP^T, then P^T and dS^T side by side in E. */
template <typename E, int D>
__global__ void __launch_bounds__(THREADS16) flash16_dkv_kernel(bwd_args a)
{
    bwd16_smem<E> m = bwd16_smem_of<E, D>();
    const flash_dims &f = a.f;
    E *Qs = m.loop[0], *dOs = m.loop[1], *Kw = m.own_w[0], *Vw = m.own_w[1];
    float *Sw = m.strip;
    E *Pw = (E *)Sw, *dSw = Pw + TILE;
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t j0 = (int64_t)blockIdx.y * OWN16, jw = j0 + 16 * w, j = jw + lane / 2;
    int64_t ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const E *q = (const E *)a.qkv + hd.q, *dO = (const E *)a.dout + hd.o;
    float sl2 = f.scale * LOG2E;

    int nk = rows_from(T, j0, OWN16);
    load_tile16<E, D, OWN16>(m.own[0], q + f.C + j0 * ld, ld, nk);
    load_tile16<E, D, OWN16>(m.own[1], q + 2 * f.C + j0 * ld, ld, nk);
    acc16 dk[D / 16], dv[D / 16];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) {
        wmma::fill_fragment(dk[nd], 0.0f);
        wmma::fill_fragment(dv[nd], 0.0f);
    }

    auto load = [](E *dst, const E *src, int64_t ld, int n) {
        load_tile16<E, D, TILE>(dst, src, ld, n);
    };
    int qtiles = (int)((T + TILE - 1) / TILE);
    for (int qt = (int)(j0 / TILE); qt < qtiles; qt++) {
        int64_t i0 = (int64_t)qt * TILE;
        int nq = rows_from(T, i0, TILE);
        dkv_query_tile<THREADS16>(load, Qs, dOs, m.lse2, m.dis, q, dO, a, hd.bh, i0, nq);
        /* query groups below g0 see none of the warp's keys; 4: none does */
        int g0 = jw >= T ? TILE / 16 : jw <= i0 ? 0 : (int)min((int64_t)TILE / 16, (jw - i0) / 16);
        if (g0 == TILE / 16) continue;
        float p[32], x[32];
        strip_abt16<E, D>(Sw, Kw, Qs, g0, TILE / 16);  /* S^T */
        __syncwarp();
        read32(Sw, x);
#pragma unroll
        for (int e = 0; e < 32; e++) {
            int c = col32(e);
            bool ok = c >= 16 * g0 && i0 + c >= j && i0 + c < T;
            p[e] = ok ? exp2f(__fmaf_rn(x[e], sl2, -m.lse2[c])) : 0.0f;
        }
        __syncwarp();
        strip_abt16<E, D>(Sw, Vw, dOs, g0, TILE / 16);  /* dP^T */
        __syncwarp();
        read32(Sw, x);
#pragma unroll
        for (int e = 0; e < 32; e++) x[e] = p[e] * (x[e] - m.dis[col32(e)]) * f.scale;  /* p 0: 0 */
        __syncwarp();
        write32<E>(Pw, p);
        write32<E>(dSw, x);
        __syncwarp();
        strip_ab16<E, D>(dv, Pw, dOs, 16 * g0, TILE);  /* dV += P^T dO */
        strip_ab16<E, D>(dk, dSw, Qs, 16 * g0, TILE);  /* dK += dS^T Q */
    }
    if (jw >= T) return;
    int n = (int)min((int64_t)16, T - jw);
    auto out = [&](auto *row) {
        strip_out16<D>(dk, Sw, row + f.C, ld, n, NULL);
        strip_out16<D>(dv, Sw, row + 2 * f.C, ld, n, NULL);
    };
    if (a.out16) out((E *)a.dqkv + hd.q + jw * ld);
    else out((float *)a.dqkv + hd.q + jw * ld);
}

/* dQ: a block per (batch, head) x 128-query tile (the longest first), the
 * 64-key tiles up to its last query; warp w holds its 16 queries' dQ in
 * registers; its strip: S, then dP, then dS in E. */
template <typename E, int D>
__global__ void __launch_bounds__(THREADS16) flash16_dq_kernel(bwd_args a)
{
    bwd16_smem<E> m = bwd16_smem_of<E, D>();
    const flash_dims &f = a.f;
    E *Ks = m.loop[0], *Vs = m.loop[1], *Qw = m.own_w[0], *dOw = m.own_w[1];
    float *Sw = m.strip;
    E *dSw = (E *)Sw;
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t i0 = (int64_t)(f.tiles - 1 - (int)blockIdx.y) * OWN16, iw = i0 + 16 * w;
    int64_t i = iw + lane / 2, ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const E *q = (const E *)a.qkv + hd.q;
    float sl2 = f.scale * LOG2E;

    int nq = rows_from(T, i0, OWN16);
    load_tile16<E, D, OWN16>(m.own[0], q + i0 * ld, ld, nq);
    load_tile16<E, D, OWN16>(m.own[1], (const E *)a.dout + hd.o + i0 * f.C, f.C, nq);
    load_rows<OWN16, THREADS16>(m.lse2, m.dis, a.lse + hd.bh * T, a.di + hd.bh * T, i0, nq);
    acc16 dq[D / 16];
#pragma unroll
    for (int nd = 0; nd < D / 16; nd++) wmma::fill_fragment(dq[nd], 0.0f);

    int kend = (int)((min(i0 + OWN16, T) - 1) / TILE);
    for (int kt = 0; kt <= kend; kt++) {
        int64_t j0 = (int64_t)kt * TILE;
        __syncthreads();  /* every warp is done with the last K, V */
        int nk = rows_from(T, j0, TILE);
        load_tile16<E, D, TILE>(Ks, q + f.C + j0 * ld, ld, nk);
        load_tile16<E, D, TILE>(Vs, q + 2 * f.C + j0 * ld, ld, nk);
        __syncthreads();
        int ng = groups_seen(iw, j0, T);
        if (!ng) continue;
        float lse2 = m.lse2[i - i0], di = m.dis[i - i0], p[32], x[32];
        strip_abt16<E, D>(Sw, Qw, Ks, 0, ng);  /* S */
        __syncwarp();
        read32(Sw, x);
#pragma unroll
        for (int e = 0; e < 32; e++) {
            int c = col32(e);
            bool ok = c < 16 * ng && j0 + c <= i && i < T;
            p[e] = ok ? exp2f(__fmaf_rn(x[e], sl2, -lse2)) : 0.0f;
        }
        __syncwarp();
        strip_abt16<E, D>(Sw, dOw, Vs, 0, ng);  /* dP */
        __syncwarp();
        read32(Sw, x);
#pragma unroll
        for (int e = 0; e < 32; e++) x[e] = p[e] * (x[e] - di) * f.scale;
        __syncwarp();
        write32<E>(dSw, x);
        __syncwarp();
        strip_ab16<E, D>(dq, dSw, Ks, 0, 16 * ng);  /* dQ += dS K */
    }
    if (iw >= T) return;
    int n = (int)min((int64_t)16, T - iw);
    if (a.out16) strip_out16<D>(dq, Sw, (E *)a.dqkv + hd.q + iw * ld, ld, n, NULL);
    else strip_out16<D>(dq, Sw, (float *)a.dqkv + hd.q + iw * ld, ld, n, NULL);
}

/* ---- flash2: the 16-bit kernels on mma.sync (OPF_CUDA_ATTENTION=flash2) ----
 * FlashAttention-2's structure: S and P never leave the registers. A block
 * is 8 warps over 128 query rows, warp w rows 16w .. 16w + 15; key tiles of
 * 64 rows (K and V, of E) double-buffered in shared memory: the next
 * tile's rows are loaded into registers before the current one's products
 * and stored into the other buffer after them, one barrier a tile. Q stays
 * in registers as A fragments for the whole loop.
 *
 * Layouts (PTX ISA, mma.m16n8k16 with 16-bit A and B, f32 C and D;
 * g = lane / 4, t = lane % 4; a register of A or B holds two elements, the
 * lower index in its low half):
 *   A (16 x 16, row): a0 a1 (row g, k 2t, 2t+1), a2 a3 (row g+8, k 2t, 2t+1),
 *                     a4 a5 (row g, k 2t+8, 2t+9), a6 a7 (row g+8, k 2t+8, 2t+9)
 *   B (16 x 8, col):  b0 b1 (k 2t, 2t+1, col g), b2 b3 (k 2t+8, 2t+9, col g)
 *   C (16 x 8, f32):  c0 c1 (row g, col 2t, 2t+1), c2 c3 (row g+8, col 2t, 2t+1)
 *   ldmatrix.x4: lane l gives the address of row l % 8 of matrix l / 8 (16
 *     bytes); register j gets matrix j's (row g, cols 2t, 2t+1), with .trans
 *     its (rows 2t, 2t+1, col g).
 * So: K row-major in shared memory (rows keys) read by ldmatrix.x4 gives
 * B = K^T for two 8-key n-tiles (matrices: keys 0-7 d 0-7, keys 0-7 d 8-15,
 * keys 8-15 d 0-7, keys 8-15 d 8-15); V row-major read by ldmatrix.x4.trans
 * gives B = V for two 8-column n-tiles (keys 0-7 d 0-7, keys 8-15 d 0-7,
 * keys 0-7 d 8-15, keys 8-15 d 8-15). The C fragments of S's n-tiles 2k and
 * 2k + 1 are, element for element, the A fragment of P's k-step k (keys 16k
 * .. 16k + 15): {c0 c1 | c2 c3 of 2k, c0 c1 | c2 c3 of 2k+1}. A lane holds
 * rows g and g + 8; a row's 4 lanes are 4g .. 4g + 3 (shuffles xor 1, 2).
 * Shared tiles are D 16-bit elements a row, their 16-byte chunks XOR
 * swizzled by row % 8 (flash2_at): the 8 rows an ldmatrix matrix reads
 * fall in 8 different bank groups. */
enum {
    F2_ROWS    = 128,  /* rows of a block's own tile (queries; dK dV's keys) */
    F2_KEYS    = 64,   /* rows of a loop tile */
    F2_THREADS = 32 * F2_ROWS / 16,
};
static_assert((int)F2_KEYS == (int)TILE, "flash2's loop tiles are TILE rows (dkv_query_tile)");

/* Element (r, c) of a swizzled tile of D columns. */
template <int D> static __device__ __forceinline__ int flash2_at(int r, int c)
{
    return r * D + ((c / 8) ^ (r % 8)) * 8 + c % 8;
}

/* ldmatrix.x4 (TRANS: .trans) from the shared address p. */
#define F2_LDSM(form)                                                                       \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4" form ".shared.b16 {%0, %1, %2, %3}, [%4];\n" \
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])                           \
                 : "r"(a)                                                                   \
                 : "memory")
template <bool TRANS> static __device__ __forceinline__ void ldsm4(uint32_t (&b)[4], const void *p)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    if constexpr (TRANS) F2_LDSM(".trans");
    else F2_LDSM("");
}
#undef F2_LDSM

/* c += a b: one m16n8k16 with fp32 accumulation. */
#define F2_MMA(ty)                                                                   \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." ty "." ty ".f32 {%0, %1, %2, %3}, " \
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                            \
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                             \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename E>
static __device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4],
                                                uint32_t b0, uint32_t b1)
{
    if constexpr (std::is_same<E, __half>::value) F2_MMA("f16");
    else F2_MMA("bf16");
}
#undef F2_MMA

/* A thread's share of a ROWS-row tile in flight: 8-element chunks of E. */
template <int D, int ROWS> struct flash2_stage {
    enum { N = ROWS * D / 8 / F2_THREADS };
    uint4 x[N];
};

/* Rows [0, n) of a tile of E (row stride ld) into s; rows past n zero. */
template <typename E, int D, int ROWS>
static __device__ __forceinline__ void flash2_fetch(flash2_stage<D, ROWS> &s, const E *src,
                                                    int64_t ld, int n)
{
#pragma unroll
    for (int i = 0; i < flash2_stage<D, ROWS>::N; i++) {
        int e = threadIdx.x + i * F2_THREADS, r = e / (D / 8), c = e % (D / 8) * 8;
        s.x[i] = make_uint4(0, 0, 0, 0);
        if (r < n) s.x[i] = __ldg((const uint4 *)(src + r * ld + c));
    }
}

/* s into a swizzled tile. */
template <typename E, int D, int ROWS>
static __device__ __forceinline__ void flash2_put(E *tile, const flash2_stage<D, ROWS> &s)
{
#pragma unroll
    for (int i = 0; i < flash2_stage<D, ROWS>::N; i++) {
        int e = threadIdx.x + i * F2_THREADS, r = e / (D / 8), c = e % (D / 8) * 8;
        *(uint4 *)(tile + flash2_at<D>(r, c)) = s.x[i];
    }
}

/* Both at once (the backward's tiles: no load ahead). */
template <typename E, int D, int ROWS>
static __device__ void flash2_load(E *tile, const E *src, int64_t ld, int n)
{
    flash2_stage<D, ROWS> s;
    flash2_fetch<E, D, ROWS>(s, src, ld, n);
    flash2_put<E, D, ROWS>(tile, s);
}

/* The warp's 16 query rows from q (n of them exist) as A fragments, a
 * k-step of 16 columns each, straight from global memory. */
template <typename E, int D>
static __device__ void flash2_q(uint32_t (&qa)[D / 16][4], const E *q, int64_t ld, int n)
{
    int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) {  /* a0a1, a2a3, a4a5, a6a7 */
            int r = g + 8 * (j % 2), c = 16 * kk + 8 * (j / 2) + 2 * t;
            qa[kk][j] = r < n ? __ldg((const unsigned int *)(q + r * ld + c)) : 0u;
        }
}

/* k-step kk of the A fragments of 16 rows of a swizzled tile (rows from a
 * multiple of 8): matrices rows 0-7 k 0-7, rows 8-15 k 0-7, rows 0-7 k
 * 8-15, rows 8-15 k 8-15. */
template <typename E, int D>
static __device__ __forceinline__ void flash2_a(uint32_t (&a)[4], const E *rows, int kk)
{
    int lane = threadIdx.x % 32;
    ldsm4<false>(a, rows + flash2_at<D>(lane / 8 % 2 * 8 + lane % 8, 16 * kk + lane / 16 * 8));
}

/* s = A B^T for the n-tiles below nt of NJ (8 columns each; the rest stay
 * 0): A the warp's 16 rows, k-step kk's fragments from af(a, kk); B rows of
 * a swizzled tile (from a multiple of 8). */
template <typename E, int D, int NJ, typename AF>
static __device__ __forceinline__ void flash2_abt(float (&s)[NJ][4], AF af, const E *rows, int nt)
{
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < NJ; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4];
        af(a, kk);
#pragma unroll
        for (int jp = 0; jp < NJ / 2; jp++) {
            if (2 * jp >= nt) break;
            uint32_t b[4];
            ldsm4<false>(b, rows + flash2_at<D>(16 * jp + lane / 16 * 8 + lane % 8,
                                                16 * kk + lane / 8 % 2 * 8));
            mma16816<E>(s[2 * jp], a, b[0], b[1]);
            mma16816<E>(s[2 * jp + 1], a, b[2], b[3]);
        }
    }
}

/* The online softmax on the fragments of the warp's rows from iw (rows g
 * and g + 8 of the lane: r 0 and 1), keys from j0; edge: the tile reaches
 * past a row or past T, so elements are masked. m (log2 units) is the
 * row's running max, l this lane's part of its sum; o is rescaled, s
 * becomes P (fp32, not yet rounded). */
template <int D>
static __device__ __forceinline__ void flash2_softmax(float (&s)[F2_KEYS / 8][4],
                                                      float (&o)[D / 8][4], int64_t iw, int64_t j0,
                                                      int64_t T, bool edge, float sl2,
                                                      float (&m)[2], float (&l)[2])
{
    int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < F2_KEYS / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int64_t i = iw + g + 8 * (e / 2), c = j0 + 8 * j + 2 * t + e % 2;
            if (edge && !(c <= i && c < T)) s[j][e] = -INFINITY;
            mt[e / 2] = fmaxf(mt[e / 2], s[j][e]);
        }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xFFFFFFFFu, mt[r], 1));
        mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xFFFFFFFFu, mt[r], 2));
        /* finite: key j0 is every row's (j0 <= iw), and key 0 even past T */
        float mn = fmaxf(m[r], mt[r] * sl2);
        alpha[r] = exp2f(m[r] - mn);  /* 0 on the first tile (m = -inf) */
        m[r] = mn;
        l[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < F2_KEYS / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            s[j][e] = exp2f(__fmaf_rn(s[j][e], sl2, -m[e / 2]));  /* -inf: 0 */
            l[e / 2] += s[j][e];
        }
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[nd][e] *= alpha[e / 2];
}

/* o += a B, o the NO 8-column n-tiles from column c0: B rows 16 kk .. 16 kk +
 * 15 of a swizzled tile of D columns (rows from a multiple of 8), read by
 * ldmatrix.trans. */
template <typename E, int D, int NO>
static __device__ __forceinline__ void flash2_ab(float (&o)[NO][4], const uint32_t (&a)[4],
                                                 const E *rows, int kk, int c0)
{
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int dp = 0; dp < NO / 2; dp++) {
        uint32_t b[4];
        ldsm4<true>(b, rows + flash2_at<D>(16 * kk + lane / 8 % 2 * 8 + lane % 8,
                                           c0 + 16 * dp + lane / 16 * 8));
        mma16816<E>(o[2 * dp], a, b[0], b[1]);
        mma16816<E>(o[2 * dp + 1], a, b[2], b[3]);
    }
}

/* o += P B: P from s (NJ n-tiles, NJ / 2 k-steps) rounded to E, as A
 * fragments straight from the registers; B rows of a swizzled tile (from a
 * multiple of 8), k-steps that hold an n-tile below nt. */
template <typename E, int D, int NJ>
static __device__ __forceinline__ void flash2_pv(float (&o)[D / 8][4], const float (&s)[NJ][4],
                                                 const E *rows, int nt)
{
#pragma unroll
    for (int kk = 0; kk < NJ / 2; kk++) {
        if (2 * kk >= nt) break;
        const float *lo = s[2 * kk], *hi = s[2 * kk + 1];
        uint32_t a[4] = {pack2<E>(lo[0], lo[1]), pack2<E>(lo[2], lo[3]), pack2<E>(hi[0], hi[1]),
                         pack2<E>(hi[2], hi[3])};
        flash2_ab<E, D, D / 8>(o, a, rows, kk, 0);
    }
}

/* The warp's 16 x D accumulator to its rows from dst (O, row stride ld;
 * rows < n exist), row g + 8r times mul[r]. */
template <int D, typename O>
static __device__ __forceinline__ void flash2_store(const float (&acc)[D / 8][4], O *dst,
                                                    int64_t ld, int n, const float (&mul)[2])
{
    int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (g + 8 * r >= n) continue;
        O *row = dst + (g + 8 * r) * ld;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++)
            store2(row + 8 * nd + 2 * t, acc[nd][2 * r] * mul[r], acc[nd][2 * r + 1] * mul[r]);
    }
}

template <int D> static __device__ __forceinline__ void zero_acc(float (&acc)[D / 8][4])
{
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
}

template <typename E, int D> static constexpr size_t flash2_smem_bytes()
{
    return sizeof(E) * 4 * F2_KEYS * D;  /* K and V, two buffers each */
}

/* A block per (batch, head) x 128-query tile (the longest first); D 64 at
 * two blocks an SM (128 registers a thread). */
template <typename E, int D>
__global__ void __launch_bounds__(F2_THREADS, D == 64 ? 2 : 1)
    flash2_fwd_kernel(const E *qkv, float *o, float *lse, flash_dims f)
{
    extern __shared__ __align__(128) float sm[];
    E *Kb = (E *)sm, *Vb = Kb + 2 * F2_KEYS * D;
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int64_t i0 = (int64_t)(f.tiles - 1 - (int)blockIdx.y) * F2_ROWS;
    int64_t iw = i0 + 16 * (threadIdx.x / 32), ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const E *q = qkv + hd.q, *k = q + f.C, *v = k + f.C;
    float sl2 = f.scale * LOG2E;

    flash2_stage<D, F2_KEYS> ks, vs;
    flash2_fetch<E, D, F2_KEYS>(ks, k, ld, rows_from(T, 0, F2_KEYS));
    flash2_fetch<E, D, F2_KEYS>(vs, v, ld, rows_from(T, 0, F2_KEYS));
    int nw = iw < T ? rows_from(T, iw, 16) : 0;
    uint32_t qa[D / 16][4];
    flash2_q<E, D>(qa, q + iw * ld, ld, nw);
    auto qf = [&](uint32_t (&a)[4], int kk) {
        a[0] = qa[kk][0], a[1] = qa[kk][1], a[2] = qa[kk][2], a[3] = qa[kk][3];
    };
    float acc[D / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    zero_acc<D>(acc);
    flash2_put<E, D, F2_KEYS>(Kb, ks);
    flash2_put<E, D, F2_KEYS>(Vb, vs);
    __syncthreads();

    int kend = (int)((min(i0 + F2_ROWS, T) - 1) / F2_KEYS);
    for (int kt = 0; kt <= kend; kt++) {
        int64_t j0 = (int64_t)kt * F2_KEYS, jn = j0 + F2_KEYS;
        if (kt < kend) {  /* the next tile, in flight during this one's products */
            flash2_fetch<E, D, F2_KEYS>(ks, k + jn * ld, ld, rows_from(T, jn, F2_KEYS));
            flash2_fetch<E, D, F2_KEYS>(vs, v + jn * ld, ld, rows_from(T, jn, F2_KEYS));
        }
        const E *Ks = Kb + (kt & 1) * F2_KEYS * D, *Vs = Vb + (kt & 1) * F2_KEYS * D;
        if (iw < T && j0 <= iw) {  /* j0 a multiple of 64, iw of 16: else no row sees j0 */
            int nt = (int)min((int64_t)F2_KEYS / 8, (iw + 15 - j0) / 8 + 1);  /* n-tiles seen */
            float s[F2_KEYS / 8][4];
            flash2_abt<E, D, F2_KEYS / 8>(s, qf, Ks, nt);
            flash2_softmax<D>(s, acc, iw, j0, T, jn > iw || jn > T, sl2, m, l);
            flash2_pv<E, D, F2_KEYS / 8>(acc, s, Vs, nt);
        }
        if (kt < kend) {
            flash2_put<E, D, F2_KEYS>(Kb + ((kt + 1) & 1) * F2_KEYS * D, ks);
            flash2_put<E, D, F2_KEYS>(Vb + ((kt + 1) & 1) * F2_KEYS * D, vs);
        }
        __syncthreads();  /* the next buffer is written; every warp is done with this one */
    }
    if (iw >= T) return;

    /* o = O / l, lse = m + log l (natural units) */
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 1);
        l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 2);
        inv[r] = 1.0f / l[r];
        int64_t i = iw + g + 8 * r;
        if (t == 0 && i < T) lse[hd.bh * T + i] = (m[r] + log2f(l[r])) * LN2;
    }
    flash2_store<D>(acc, o + hd.o + iw * f.C, f.C, nw, inv);
}

/* flash2's backward: flash16's split (D_i first, then dK dV per key tile
 * and dQ per query tile, no atomics), every product on mma.sync with the
 * forward's layouts and S, dP, P, dS in registers, in chunks of 32 columns
 * (fewer registers). Tiles are loaded synchronously (no load ahead: the
 * accumulators leave no registers for it at D 128). */
enum { F2_CHUNK = 32 };

/* ---- flash1p: dQ inside the dK dV kernel (OPF_CUDA_ATTENTION=flash1p) ----
 * flash2's dQ kernel recomputes S, P, dP and dS; flash1p instead lets the dK
 * dV block of key tile J (128 keys) add dS K_J into dQ for each 64-query
 * tile i it visits: its warps put their dS^T rows (rounded to E, the values
 * dK's product takes) into a shared tile, then warp w computes the 16 x D/2
 * part of queries 16 (w % 4) .., columns (w / 4) D / 2 .. over the 128 keys.
 * The parts of tile i are summed in fp32 in global scratch (dq_acc) in a
 * fixed order, ascending J, whatever the schedule (FlashAttention-3's
 * deterministic mode): dq_turn[bh, i] counts the parts added; block J waits
 * until it reads J, adds its part and sets J + 1. Block 0 stores its part
 * (so dq_acc needs no zeroing); the last part's block, J = i / 2 (tile i
 * holds the diagonal of its keys), writes acc + part to dqkv as the output
 * type instead, so there is no third kernel.
 *
 * Deadlock freedom: block J waits only on blocks J' < J of its (batch,
 * head), whose linear index bh + J' B H is smaller (the key tile is the
 * grid's y, the slowest-changing index). Blocks start in linear order, so
 * those are resident or done when J waits; the lowest unfinished block waits
 * on nothing, so it finishes, and by induction every block does. The query
 * tiles run from the last down: block J - 1 then walks the same tiles a tile
 * ahead of J, which waits about a tile at its start, where ascending tiles
 * would hold every block to block 0's pace through the tiles below 2J. */

/* A gpu-scope acquire load and release store (the turn counters). */
static __device__ __forceinline__ int ld_acquire(const int *p)
{
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void st_release(int *p, int v)
{
    asm volatile("st.release.gpu.global.s32 [%0], %1;\n" : : "l"(p), "r"(v) : "memory");
}

/* The warp's chunk of dS^T (x: its 16 keys x the 32 queries from c0, as C
 * fragments) rounded to E into the block's dS^T tile (F2_ROWS keys x
 * F2_KEYS queries, swizzled). */
template <typename E>
static __device__ __forceinline__ void flash1p_put(E *dst, const float (&x)[F2_CHUNK / 8][4],
                                                   int c0)
{
    int w = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < F2_CHUNK / 8; j++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            *(uint32_t *)(dst + flash2_at<F2_KEYS>(16 * w + g + 8 * r, c0 + 8 * j + 2 * t)) =
                pack2<E>(x[j][2 * r], x[j][2 * r + 1]);
}

/* Zeros over the warp's rows of the dS^T tile from query c0 (a chunk that
 * sees none of its keys: the dQ product reads it). */
template <typename E> static __device__ __forceinline__ void flash1p_put0(E *dst, int c0)
{
    const float z[F2_CHUNK / 8][4] = {};
    flash1p_put<E>(dst, z, c0);
}

/* Thread 0 waits until the tile's turn counter reads `turn`, with backoff;
 * the barrier then orders every thread's reads of dq_acc after the acquire
 * (the parts before were released with their writes). */
static __device__ void flash1p_wait(const int *cnt, int turn)
{
    if (threadIdx.x == 0) {
        unsigned ns = 32;
        while (ld_acquire(cnt) < turn) {
            __nanosleep(ns);
            ns = ns < 1024 ? 2 * ns : ns;
        }
    }
    __syncthreads();
}

/* Key tile kt's part of query tile qt's dQ (dS^T tile dSt, K in Ko), added
 * in its turn. Every thread of the block calls it, after the warps' puts.
 * A warp's D / 2 columns go in passes of 32 (16 accumulators a lane: D 128
 * has no registers for 32 beside dK and dV). */
template <typename E, int D>
static __device__ void flash1p_dq(const bwd_args &a, const E *dSt, const E *Ko, int64_t bh, int kt,
                                  int qt)
{
    enum { PASS = 32 };
    const flash_dims &f = a.f;
    int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int qr = 16 * (w % 4);
    int64_t i0 = (int64_t)qt * F2_KEYS, j0 = (int64_t)kt * F2_ROWS, T = f.T;
    /* k-steps of keys past the tile's last query hold only zeros: skipped */
    int ksteps = (int)min((int64_t)F2_ROWS / 16, (i0 + F2_KEYS - 1 - j0) / 16 + 1);
    int qtiles = (int)((T + F2_KEYS - 1) / F2_KEYS);
    int *cnt = a.dq_turn + bh * qtiles + qt;
    bool last = qt * F2_KEYS / F2_ROWS == kt;  /* the diagonal's key tile adds last */
    float *acc = a.dq_acc + (bh * T + i0) * D;
    int64_t ld = 3 * f.C, q = (bh / f.H * T + i0) * ld + bh % f.H * D;
    __syncthreads();  /* dSt is whole: every warp has put its rows */
#pragma unroll
    for (int pass = 0; pass < D / 2 / PASS; pass++) {
        int dc = w / 4 * (D / 2) + pass * PASS;
        float part[PASS / 8][4];
#pragma unroll
        for (int n = 0; n < PASS / 8; n++) part[n][0] = part[n][1] = part[n][2] = part[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < F2_ROWS / 16; kk++) {
            if (kk >= ksteps) break;
            uint32_t x[4];  /* A = dS (rows queries, k keys) from dS^T: ldmatrix.trans */
            ldsm4<true>(x, dSt + flash2_at<F2_KEYS>(16 * kk + lane / 16 * 8 + lane % 8,
                                                     qr + lane / 8 % 2 * 8));
            flash2_ab<E, D, PASS / 8>(part, x, Ko, kk, dc);
        }
        /* the first pass waits (all threads: the barrier); the parts before
         * kt's are then in acc */
        if (kt > 0 && pass == 0) flash1p_wait(cnt, kt);
        auto add = [&](auto *out, int64_t ld) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int64_t row = qr + g + 8 * r;
                if (i0 + row >= T) continue;
#pragma unroll
                for (int n = 0; n < PASS / 8; n++) {
                    int64_t c = dc + 8 * n + 2 * t;
                    float2 v = make_float2(part[n][2 * r], part[n][2 * r + 1]);
                    if (kt > 0) {  /* from L2 (__ldcg): the sums were written on other SMs */
                        float2 s = __ldcg((const float2 *)(acc + row * D + c));
                        v = make_float2(s.x + v.x, s.y + v.y);
                    }
                    if (out) store2(out + row * ld + c, v.x, v.y);
                    else __stcg((float2 *)(acc + row * D + c), v);
                }
            }
        };
        if (!last) add((float *)NULL, 0);
        else if (a.out16) add((E *)a.dqkv + q, ld);
        else add((float *)a.dqkv + q, ld);
    }
    if (last) return;  /* no block adds after this one */
    /* each thread's writes visible at gpu scope before the barrier, the
     * barrier before the release: the next block's reads see every part */
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) st_release(cnt, kt + 1);
}

/* dK, dV: a block per (batch, head) x 128-key tile (K, V in shared memory;
 * warp w keys 16w ..), the 64-query tiles from its first key to the end.
 * With the warp's keys as rows: S^T = K Q^T, P^T = exp(S^T - lse), dP^T =
 * V dO^T, dS^T = P^T (dP^T - D_i) scale, dV += P^T dO, dK += dS^T Q. */
template <typename E, int D, bool DQ>
__global__ void __launch_bounds__(F2_THREADS) flash2_dkv_kernel(bwd_args a)
{
    extern __shared__ __align__(128) float sm[];
    E *Ko = (E *)sm, *Vo = Ko + F2_ROWS * D, *Qs = Vo + F2_ROWS * D, *dOs = Qs + F2_KEYS * D;
    float *lse2 = (float *)(dOs + F2_KEYS * D), *dis = lse2 + F2_KEYS;
    E *dSt = (E *)(dis + F2_KEYS);  /* DQ: the dS^T tile (flash1p) */
    const flash_dims &f = a.f;
    int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int64_t j0 = (int64_t)blockIdx.y * F2_ROWS, jw = j0 + 16 * w, ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const E *q = (const E *)a.qkv + hd.q, *dO = (const E *)a.dout + hd.o;
    float sl2 = f.scale * LOG2E;

    int nk = rows_from(T, j0, F2_ROWS);
    flash2_load<E, D, F2_ROWS>(Ko, q + f.C + j0 * ld, ld, nk);
    flash2_load<E, D, F2_ROWS>(Vo, q + 2 * f.C + j0 * ld, ld, nk);
    const E *Kw = Ko + 16 * w * D, *Vw = Vo + 16 * w * D;
    auto kf = [&](uint32_t (&x)[4], int kk) { flash2_a<E, D>(x, Kw, kk); };
    auto vf = [&](uint32_t (&x)[4], int kk) { flash2_a<E, D>(x, Vw, kk); };
    auto load = [](E *dst, const E *src, int64_t ld, int n) {
        flash2_load<E, D, F2_KEYS>(dst, src, ld, n);
    };
    float dk[D / 8][4], dv[D / 8][4];
    zero_acc<D>(dk);
    zero_acc<D>(dv);

    int qtiles = (int)((T + F2_KEYS - 1) / F2_KEYS), q0 = (int)(j0 / F2_KEYS);
    if (DQ && jw >= T) {  /* keys past T: their dS^T rows stay zero */
        flash1p_put0<E>(dSt, 0);
        flash1p_put0<E>(dSt, F2_CHUNK);
    }
    for (int n = 0; n < qtiles - q0; n++) {
        int qt = DQ ? qtiles - 1 - n : q0 + n;  /* flash1p: from the last down */
        int64_t i0 = (int64_t)qt * F2_KEYS;
        int nq = rows_from(T, i0, F2_KEYS);
        /* its first barrier: every warp is also done reading dSt */
        dkv_query_tile<F2_THREADS>(load, Qs, dOs, lse2, dis, q, dO, a, hd.bh, i0, nq);
#pragma unroll
        for (int c0 = 0; c0 < F2_KEYS; c0 += F2_CHUNK) {
            if (jw >= T) break;
            int64_t ic = i0 + c0;                /* the chunk's first query */
            if (ic + F2_CHUNK - 1 < jw) {        /* it sees none of the warp's keys */
                if constexpr (DQ) flash1p_put0<E>(dSt, c0);
                continue;
            }
            bool edge = ic < jw + 15 || ic + F2_CHUNK > T;
            float p[F2_CHUNK / 8][4], x[F2_CHUNK / 8][4];
            flash2_abt<E, D, F2_CHUNK / 8>(p, kf, Qs + c0 * D, F2_CHUNK / 8);   /* S^T */
            flash2_abt<E, D, F2_CHUNK / 8>(x, vf, dOs + c0 * D, F2_CHUNK / 8);  /* dP^T */
#pragma unroll
            for (int j = 0; j < F2_CHUNK / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int c = c0 + 8 * j + 2 * t + e % 2;  /* query i0 + c */
                    int64_t key = jw + g + 8 * (e / 2);
                    bool ok = !edge || (i0 + c >= key && i0 + c < T);
                    float pe = ok ? exp2f(__fmaf_rn(p[j][e], sl2, -lse2[c])) : 0.0f;
                    p[j][e] = pe;
                    x[j][e] = pe * (x[j][e] - dis[c]) * f.scale;
                }
            flash2_pv<E, D, F2_CHUNK / 8>(dv, p, dOs + c0 * D, F2_CHUNK / 8);  /* dV += P^T dO */
            flash2_pv<E, D, F2_CHUNK / 8>(dk, x, Qs + c0 * D, F2_CHUNK / 8);   /* dK += dS^T Q */
            if constexpr (DQ) flash1p_put<E>(dSt, x, c0);
        }
        if constexpr (DQ) flash1p_dq<E, D>(a, dSt, Ko, hd.bh, (int)blockIdx.y, qt);
    }
    if (jw >= T) return;
    const float one[2] = {1.0f, 1.0f};
    auto out = [&](auto *row) {
        flash2_store<D>(dk, row + f.C, ld, rows_from(T, jw, 16), one);
        flash2_store<D>(dv, row + 2 * f.C, ld, rows_from(T, jw, 16), one);
    };
    if (a.out16) out((E *)a.dqkv + hd.q + jw * ld);
    else out((float *)a.dqkv + hd.q + jw * ld);
}

/* dQ: a block per (batch, head) x 128-query tile (the longest first; warp
 * w queries 16w .., Q and dO as A fragments in registers), the 64-key tiles
 * up to its last query: S = Q K^T, P = exp(S - lse), dP = dO V^T, dS = P
 * (dP - D_i) scale, dQ += dS K. */
template <typename E, int D>
__global__ void __launch_bounds__(F2_THREADS) flash2_dq_kernel(bwd_args a)
{
    extern __shared__ __align__(128) float sm[];
    E *Ks = (E *)sm, *Vs = Ks + F2_KEYS * D;
    const flash_dims &f = a.f;
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int64_t i0 = (int64_t)(f.tiles - 1 - (int)blockIdx.y) * F2_ROWS;
    int64_t iw = i0 + 16 * (threadIdx.x / 32), ld = 3 * f.C, T = f.T;
    flash_head hd = flash_head_of(f, D);
    const E *q = (const E *)a.qkv + hd.q;
    float sl2 = f.scale * LOG2E;

    int nw = iw < T ? rows_from(T, iw, 16) : 0;
    uint32_t qa[D / 16][4], da[D / 16][4];
    flash2_q<E, D>(qa, q + iw * ld, ld, nw);
    flash2_q<E, D>(da, (const E *)a.dout + hd.o + iw * f.C, f.C, nw);
    auto qf = [&](uint32_t (&x)[4], int kk) {
        x[0] = qa[kk][0], x[1] = qa[kk][1], x[2] = qa[kk][2], x[3] = qa[kk][3];
    };
    auto df = [&](uint32_t (&x)[4], int kk) {
        x[0] = da[kk][0], x[1] = da[kk][1], x[2] = da[kk][2], x[3] = da[kk][3];
    };
    float lse2[2], di[2], dq[D / 8][4];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int64_t i = iw + g + 8 * r;
        lse2[r] = i < T ? a.lse[hd.bh * T + i] * LOG2E : 0.0f;
        di[r] = i < T ? a.di[hd.bh * T + i] : 0.0f;
    }
    zero_acc<D>(dq);

    int kend = (int)((min(i0 + F2_ROWS, T) - 1) / F2_KEYS);
    for (int kt = 0; kt <= kend; kt++) {
        int64_t j0 = (int64_t)kt * F2_KEYS;
        int nk = rows_from(T, j0, F2_KEYS);
        __syncthreads();  /* every warp is done with the last K, V */
        flash2_load<E, D, F2_KEYS>(Ks, q + f.C + j0 * ld, ld, nk);
        flash2_load<E, D, F2_KEYS>(Vs, q + 2 * f.C + j0 * ld, ld, nk);
        __syncthreads();
        if (iw >= T || j0 > iw) continue;  /* no row of the warp sees key j0 */
#pragma unroll
        for (int c0 = 0; c0 < F2_KEYS; c0 += F2_CHUNK) {
            int64_t jc = j0 + c0;  /* the chunk's first key */
            if (jc > iw + 15) break;
            int nt = (int)min((int64_t)F2_CHUNK / 8, (iw + 15 - jc) / 8 + 1);  /* n-tiles seen */
            bool edge = jc + F2_CHUNK > iw || jc + F2_CHUNK > T;
            float p[F2_CHUNK / 8][4], x[F2_CHUNK / 8][4];
            flash2_abt<E, D, F2_CHUNK / 8>(p, qf, Ks + c0 * D, nt);  /* S */
            flash2_abt<E, D, F2_CHUNK / 8>(x, df, Vs + c0 * D, nt);  /* dP */
#pragma unroll
            for (int j = 0; j < F2_CHUNK / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int r = e / 2;
                    int64_t i = iw + g + 8 * r, c = jc + 8 * j + 2 * t + e % 2;
                    bool ok = !edge || (c <= i && c < T);
                    float pe = ok ? exp2f(__fmaf_rn(p[j][e], sl2, -lse2[r])) : 0.0f;
                    x[j][e] = pe * (x[j][e] - di[r]) * f.scale;
                }
            flash2_pv<E, D, F2_CHUNK / 8>(dq, x, Ks + c0 * D, nt);  /* dQ += dS K */
        }
    }
    const float one[2] = {1.0f, 1.0f};
    if (iw >= T) return;
    if (a.out16) flash2_store<D>(dq, (E *)a.dqkv + hd.q + iw * ld, ld, nw, one);
    else flash2_store<D>(dq, (float *)a.dqkv + hd.q + iw * ld, ld, nw, one);
}

/* ---- host -------------------------------------------------------------------- */

/* Whether the flash kernels take this call: D 64 or 128, the grid within
 * CUDA's limits, every array 16-byte aligned. */
static bool flash_fits(int64_t B, int64_t T, int64_t H, int64_t D, const void *const *p, int np)
{
    if ((D != 64 && D != 128) || (T + TILE - 1) / TILE > MAX_TILES || B * H > INT32_MAX)
        return false;
    for (int i = 0; i < np; i++)
        if (!opf_cuda_aligned16(p[i])) return false;
    return true;
}

/* tiles: of `rows` rows (a grid's y). */
static flash_dims flash_dims_of(int64_t T, int64_t H, int64_t D, int rows)
{
    return {T, H, H * D, (int)((T + rows - 1) / rows), 1.0f / sqrtf((float)D)};
}

/* Launches kernel K on NT threads a block; its first launch on a device
 * allows it dynamic shared memory past 48 KB there (a per-device setting, as
 * in norm.cu). Each K is its own instantiation, so each has its own flags. */
template <auto K, int NT, typename... A>
static opf_status flash_launch(opf_ctx *ctx, opf_cuda_state *s, dim3 grid, size_t smem,
                               const char *fn, A... args)
{
    static unsigned long long opted;  /* a bit per device */
    if (opf_cuda_once_needed(&opted, s->device)) {
        OPF_CUDA_TRY(ctx, fn, cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   (int)smem));
        opf_cuda_once_done(&opted, s->device);
    }
    K<<<grid, NT, smem, s->stream>>>(args...);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

static bool is16(opf_dtype dt) { return dt == OPF_BF16 || dt == OPF_F16; }

/* Rows of a block's own tile (a grid's y) for qkv's logical dtype dt. */
static int own_rows(opf_dtype dt) { return is16(dt) ? (int)OWN16 : (int)TILE; }

/* The dtype the kernels of logical dtype dt read qkv and do in: dt for the
 * 16-bit kernels, fp32 for TF32. */
static opf_dtype kernel_dtype(opf_dtype dt) { return is16(dt) ? dt : OPF_F32; }

/* flash2's forward (qkv of E). */
template <typename E, int D>
static opf_status flash2_fwd(opf_ctx *ctx, opf_cuda_state *s, const E *qkv, float *o,
                             float *lse, int64_t B, int64_t T, int64_t H, const char *fn)
{
    flash_dims f = flash_dims_of(T, H, D, F2_ROWS);
    dim3 grid((unsigned)(B * H), (unsigned)f.tiles);
    return flash_launch<flash2_fwd_kernel<E, D>, F2_THREADS>(
        ctx, s, grid, flash2_smem_bytes<E, D>(), fn, qkv, o, lse, f);
}

/* The 16-bit forward (qkv of E): flash2's kernel when v2. */
template <typename E, int D>
static opf_status flash16_fwd(opf_ctx *ctx, opf_cuda_state *s, const E *qkv, float *o,
                              float *lse, int64_t B, int64_t T, int64_t H, bool v2,
                              const char *fn)
{
    if (v2) return flash2_fwd<E, D>(ctx, s, qkv, o, lse, B, T, H, fn);
    flash_dims f = flash_dims_of(T, H, D, OWN16);
    dim3 grid((unsigned)(B * H), (unsigned)f.tiles);
    return flash_launch<flash16_fwd_kernel<E, D>, THREADS16>(
        ctx, s, grid, fwd16_smem_bytes<E, D>(), fn, qkv, o, lse, f);
}

/* The forward of qkv's logical dtype dt (qkv of kernel_dtype(dt)): bf16 and
 * f16 the 16-bit kernels, anything else TF32. */
template <int D>
static opf_status flash_fwd(opf_ctx *ctx, opf_cuda_state *s, const void *qkv, float *o,
                            float *lse, int64_t B, int64_t T, int64_t H, opf_dtype dt, bool v2,
                            const char *fn)
{
    if (dt == OPF_BF16)
        return flash16_fwd<__nv_bfloat16, D>(ctx, s, (const __nv_bfloat16 *)qkv, o, lse, B, T, H,
                                             v2, fn);
    if (dt == OPF_F16)
        return flash16_fwd<__half, D>(ctx, s, (const __half *)qkv, o, lse, B, T, H, v2, fn);
    flash_dims f = flash_dims_of(T, H, D, TILE);
    dim3 grid((unsigned)(B * H), (unsigned)f.tiles);
    return flash_launch<flash_fwd_kernel<D>, THREADS>(ctx, s, grid, fwd_smem_bytes<D>(), fn,
                                                      (const float *)qkv, o, lse, f);
}

/* The 16-bit backward's kernels: flash's (WMMA), flash2's two on mma.sync,
 * or flash1p's one (dQ added in the dK dV kernel). */
typedef enum flash_bwd_kind { BWD_WMMA, BWD_FLASH2, BWD_FLASH1P } flash_bwd_kind;

/* flash2's backward (one_pass: flash1p's); its grid is flash16's (F2_ROWS
 * is OWN16). */
template <typename E, int D>
static opf_status flash2_bwd(opf_ctx *ctx, opf_cuda_state *s, dim3 grid, const bwd_args &a,
                             bool one_pass, const char *fn)
{
    static_assert((int)F2_ROWS == (int)OWN16, "flash2's tiles are flash16's");
    size_t smem = sizeof(E) * (2 * F2_ROWS + 2 * F2_KEYS) * D + sizeof(float) * 2 * F2_KEYS;
    if (one_pass)  /* and the dS^T tile */
        return flash_launch<flash2_dkv_kernel<E, D, true>, F2_THREADS>(
            ctx, s, grid, smem + sizeof(E) * F2_ROWS * F2_KEYS, fn, a);
    opf_status st =
        flash_launch<flash2_dkv_kernel<E, D, false>, F2_THREADS>(ctx, s, grid, smem, fn, a);
    if (st) return st;
    return flash_launch<flash2_dq_kernel<E, D>, F2_THREADS>(ctx, s, grid,
                                                            sizeof(E) * 2 * F2_KEYS * D, fn, a);
}

template <typename E, int D>
static opf_status flash16_bwd(opf_ctx *ctx, opf_cuda_state *s, dim3 grid, const bwd_args &a,
                              flash_bwd_kind kind, const char *fn)
{
    if (kind != BWD_WMMA) return flash2_bwd<E, D>(ctx, s, grid, a, kind == BWD_FLASH1P, fn);
    size_t smem = bwd16_smem_bytes<E, D>();
    opf_status st = flash_launch<flash16_dkv_kernel<E, D>, THREADS16>(ctx, s, grid, smem, fn, a);
    if (st) return st;
    return flash_launch<flash16_dq_kernel<E, D>, THREADS16>(ctx, s, grid, smem, fn, a);
}

/* The backward's kernels of qkv's logical dtype dt (bf16 and f16: kind's),
 * a's arrays of kernel_dtype(dt). */
template <int D>
static opf_status flash_bwd(opf_ctx *ctx, opf_cuda_state *s, const bwd_args &a, int64_t BH,
                            opf_dtype dt, flash_bwd_kind kind, const char *fn)
{
    dim3 grid((unsigned)BH, (unsigned)a.f.tiles);
    if (dt == OPF_BF16) return flash16_bwd<__nv_bfloat16, D>(ctx, s, grid, a, kind, fn);
    if (dt == OPF_F16) return flash16_bwd<__half, D>(ctx, s, grid, a, kind, fn);
    opf_status st =
        flash_launch<flash_dkv_kernel<D>, THREADS>(ctx, s, grid, bwd_smem_bytes<D>(), fn, a);
    if (st) return st;
    return flash_launch<flash_dq_kernel<D>, THREADS>(ctx, s, grid, bwd_smem_bytes<D>(), fn, a);
}

/* D_i of every row into di, from do as stored (dout_t): the fp32 values
 * every path multiplies, whatever dtype the kernels read do in. */
static opf_status flash_delta(opf_ctx *ctx, opf_cuda_state *s, const float *o, const void *dout,
                              opf_dtype dout_t, float *di, int64_t rows, const flash_dims &f,
                              int D, const char *fn)
{
    unsigned grid = opf_cuda_grid(s, 32 * rows, 256);
    if (dout_t == OPF_BF16)
        flash_delta_kernel<<<grid, 256, 0, s->stream>>>(o, (const __nv_bfloat16 *)dout, di, rows,
                                                        f, D);
    else if (dout_t == OPF_F16)
        flash_delta_kernel<<<grid, 256, 0, s->stream>>>(o, (const __half *)dout, di, rows, f, D);
    else
        flash_delta_kernel<<<grid, 256, 0, s->stream>>>(o, (const float *)dout, di, rows, f, D);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* The forward with qkv as the kernels read it (io's). */
static opf_status attn_fwd_tiled(opf_ctx *ctx, const void *qkv, float *o, float *lse, int64_t B,
                                 int64_t T, int64_t H, int64_t D, opf_dtype in_dt, bool v2,
                                 const char *fn)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (B <= 0 || T <= 0 || H <= 0) return OPF_OK;
    return D == 64 ? flash_fwd<64>(ctx, s, qkv, o, lse, B, T, H, in_dt, v2, fn)
                   : flash_fwd<128>(ctx, s, qkv, o, lse, B, T, H, in_dt, v2, fn);
}

/* qkv as the kernels read it: the caller's when stored as kernel_dtype(in_dt)
 * (a 16-bit model's), else a copy cast to it (exact: qkv's values are exact
 * in in_dt, and the 16-bit kernels rounded the fp32 values to it anyway). */
static opf_status attn_fwd_typed(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, float *o,
                                 float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                 opf_dtype in_dt, bool v2, const char *fn)
{
    const void *p[] = {qkv, o};
    if (!flash_fits(B, T, H, D, p, 2))
        return opf_cuda_attn_fwd_gemm(ctx, qkv, qkv_t, o, lse, B, T, H, D, in_dt);
    opf_dtype kt = kernel_dtype(in_dt);
    opf_cuda_attn_io io;
    opf_status st = opf_cuda_attn_io_open(ctx, fn, &io, qkv, qkv_t, NULL, kt, NULL, kt, kt, kt,
                                          B * T * 3 * H * D);
    if (st) return st;
    st = attn_fwd_tiled(ctx, io.qkv, o, lse, B, T, H, D, in_dt, v2, fn);
    return opf_cuda_attn_io_close(ctx, &io, st);
}

opf_status opf_cuda_attn_fwd_flash(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, float *o,
                                   float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                   opf_dtype in_dt)
{
    return attn_fwd_typed(ctx, qkv, qkv_t, o, lse, B, T, H, D, in_dt, false,
                          "attention forward (cuda flash)");
}

opf_status opf_cuda_attn_fwd_flash2(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, float *o,
                                    float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                    opf_dtype in_dt)
{
    return attn_fwd_typed(ctx, qkv, qkv_t, o, lse, B, T, H, D, in_dt, true,
                          "attention forward (cuda flash2)");
}

/* D_i from do as stored, then the kernels on io's arrays. flash1p's
 * kernel also takes dQ's fp32 sums and turn counters from the scratch
 * after D_i; only the counters are zeroed (block 0 stores its part). */
static opf_status attn_bwd_tiled(opf_ctx *ctx, const opf_cuda_attn_io &io, const float *o,
                                 const float *lse, const void *dout, opf_dtype dout_t, int64_t B,
                                 int64_t T, int64_t H, int64_t D, opf_dtype in_dt,
                                 flash_bwd_kind kind, const char *fn)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (B <= 0 || T <= 0 || H <= 0) return OPF_OK;
    bool one_pass = kind == BWD_FLASH1P && is16(in_dt);
    size_t rows = (size_t)(B * H * T), di_bytes = opf_cuda_pad256(sizeof(float) * rows);
    size_t acc_bytes = one_pass ? sizeof(float) * rows * (size_t)D : 0;
    size_t turn_bytes = one_pass ? sizeof(int) * (size_t)(B * H * ((T + TILE - 1) / TILE)) : 0;
    void *ws;
    opf_status st = opf_cuda_scratch(ctx, s, di_bytes + acc_bytes + turn_bytes, &ws);
    if (st) return st;
    float *di = (float *)ws;
    flash_dims f = flash_dims_of(T, H, D, own_rows(in_dt));
    if ((st = flash_delta(ctx, s, o, dout, dout_t, di, B * H * T, f, (int)D, fn))) return st;
    bwd_args a = {io.qkv, io.dout, lse, di, io.dqkv, f, io.kernel_out_t != OPF_F32, NULL, NULL};
    if (one_pass) {
        a.dq_acc = (float *)((char *)ws + di_bytes);
        a.dq_turn = (int *)((char *)ws + di_bytes + acc_bytes);
        OPF_CUDA_TRY(ctx, fn, cudaMemsetAsync(a.dq_turn, 0, turn_bytes, s->stream));
    }
    return D == 64 ? flash_bwd<64>(ctx, s, a, B * H, in_dt, kind, fn)
                   : flash_bwd<128>(ctx, s, a, B * H, in_dt, kind, fn);
}

/* qkv and do as the kernels read them (as attn_fwd_typed's qkv); the 16-bit
 * kernels write dqkv as E when it is stored so (each fp32 value rounded
 * once, as a cast after them would), else fp32, cast after them when
 * dqkv_t is neither. */
static opf_status attn_bwd_typed(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const float *o,
                                 const float *lse, const void *dout, opf_dtype dout_t, void *dqkv,
                                 opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H, int64_t D,
                                 opf_dtype in_dt, flash_bwd_kind kind, const char *fn)
{
    const void *p[] = {qkv, o, dout, dqkv};
    if (!flash_fits(B, T, H, D, p, 4))
        return opf_cuda_attn_bwd_gemm(ctx, qkv, qkv_t, o, lse, dout, dout_t, dqkv, dqkv_t, B, T, H,
                                      D, in_dt);
    opf_dtype kt = kernel_dtype(in_dt), ot = dqkv_t == kt ? kt : OPF_F32;
    opf_cuda_attn_io io;
    opf_status st = opf_cuda_attn_io_open(ctx, fn, &io, qkv, qkv_t, dout, dout_t, dqkv, dqkv_t, kt,
                                          ot, B * T * 3 * H * D);
    if (st) return st;
    st = attn_bwd_tiled(ctx, io, o, lse, dout, dout_t, B, T, H, D, in_dt, kind, fn);
    return opf_cuda_attn_io_close(ctx, &io, st);
}

opf_status opf_cuda_attn_bwd_flash(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const float *o,
                                   const float *lse, const void *dout, opf_dtype dout_t,
                                   void *dqkv, opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H,
                                   int64_t D, opf_dtype in_dt)
{
    return attn_bwd_typed(ctx, qkv, qkv_t, o, lse, dout, dout_t, dqkv, dqkv_t, B, T, H, D, in_dt,
                          BWD_WMMA, "attention backward (cuda flash)");
}

opf_status opf_cuda_attn_bwd_flash2(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t,
                                    const float *o, const float *lse, const void *dout,
                                    opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t, int64_t B,
                                    int64_t T, int64_t H, int64_t D, opf_dtype in_dt)
{
    return attn_bwd_typed(ctx, qkv, qkv_t, o, lse, dout, dout_t, dqkv, dqkv_t, B, T, H, D, in_dt,
                          BWD_FLASH2, "attention backward (cuda flash2)");
}

opf_status opf_cuda_attn_bwd_flash1p(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t,
                                     const float *o, const float *lse, const void *dout,
                                     opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t, int64_t B,
                                     int64_t T, int64_t H, int64_t D, opf_dtype in_dt)
{
    return attn_bwd_typed(ctx, qkv, qkv_t, o, lse, dout, dout_t, dqkv, dqkv_t, B, T, H, D, in_dt,
                          BWD_FLASH1P, "attention backward (cuda flash1p)");
}
