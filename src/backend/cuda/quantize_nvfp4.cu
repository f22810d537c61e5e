/* quantize_nvfp4.cu: NVFP4 on the GPU, bit for bit with
 * src/backend/cpu/quantize_nvfp4.c (docs/numerics.md 3.4, layouts 4.2-4.4).
 *
 * Two passes, as on the CPU: the global amaxes first (A_row of the input;
 * with the Hadamard transform also A_col of the rotated values, so the
 * transform runs in both passes), kept on the device as amax keys; then one
 * pass that derives the global scales from them on every thread.
 *
 * Without the transform the amax pass streams the input, 16-byte loads,
 * several in flight a thread. Otherwise both passes loop over TM x TK tiles
 * on one wave of resident blocks: the block stages a tile in shared memory
 * as fp32 from registers, issues the 16-byte loads of its next tile, then
 * works on the staged one, so that the loads are in flight during the work.
 * By phase:
 *   columns  one thread per (16-row group, column): the columnwise block
 *            (rotated first with RHT), or the column's part of a 16x16 tile
 *            (the tile amax is 16 lanes of a warp); its codes are packed two
 *            rows a byte into a shared [TK][TM/2] tile of the transposed copy;
 *   rows     one thread per (row, 16-column block): the rowwise block, or the
 *            row's part of a 16x16 tile; 8 bytes a store;
 *   store    the transposed tile, 8 contiguous bytes a thread.
 * Stochastic rounding draws the CPU's Philox words: one call per 16-element
 * block, counter = offset + the block's index in its copy, copy id 0 for the
 * rowwise and 1 for the columnwise copy (2D tiles: the rowwise indices). */
#include <float.h>

#include <type_traits>

#include "backend/cuda/cuda-impl.h"

enum {
    BLK = 16,                 /* block edge */
    TM = 64,                  /* tile rows: four 16-row groups */
    TK = 64,                  /* tile columns: four 16-column blocks */
    THREADS = 256,
    GROUPS = TM / BLK,
    SROW = TK + 4,            /* shared row stride in floats: see row_phase */
    DQ_THREADS = 256,
};
static_assert(GROUPS * TK == THREADS, "the column phase: one thread per (group, column)");
static_assert(TM * (TK / BLK) == THREADS, "the row phase: one thread per (row, block)");
static_assert(TK * (TM / BLK) == THREADS, "the store phase: one thread per 8 bytes");

/* What a pass does (template flags). */
enum {
    F_ROW = 1,    /* rowwise copy */
    F_COL = 2,    /* columnwise copy */
    F_2D = 4,     /* 16x16 tiles (else 1x16 blocks) */
    F_RHT = 8,    /* the columnwise copy is rotated */
    F_AMAX = 16,  /* the amax pass: keys only, no copy */
};

/* The copies, their scales and the options. NULL data: copy not wanted. */
typedef struct fp4_out {
    uint8_t  *qr, *qc;         /* [M, K/2], [K, M/2] */
    uint8_t  *sr, *sc;         /* e4m3 [roundup(M,128), ld_r], [roundup(K,128), ld_c] */
    int64_t   ld_r, ld_c;      /* roundup(K/16, 4), roundup(M/16, 4) */
    bool      swizzled;
    unsigned *keys;            /* device: amax keys {A_row, A_col} */
    float    *amax, *col_amax; /* the AMAX components (written by block 0) */
    bool      sr_on;           /* stochastic rounding */
    uint64_t  seed, offset;
    uint32_t  sign_mask;       /* RHT signs */
    bool      vec;             /* 16-byte loads */
} fp4_out;

/* ---- numerics (the CPU's operations, one by one) ------------------------ */

/* 3.4.1: S_enc, S_dec and fl(S_enc * fl32(1/6)) from an amax. */
typedef struct fp4_global { float enc, dec, div6; } fp4_global;

__device__ __forceinline__ fp4_global global_scale(float amax)
{
    float s = fminf(__fdiv_rn(2688.0f, amax), FLT_MAX);
    if (amax == 0.0f || s == 0.0f) s = 1.0f;
    fp4_global g = {s, __fdiv_rn(1.0f, s), __fmul_rn(s, 0x1.555556p-3f)};
    return g;
}

/* 3.4.2 steps 2-4: the e4m3 scale of a block of amax b, and its encode
 * factor (sf = 0 gives +inf, clamped to FLT_MAX). */
__device__ __forceinline__ uint8_t block_scale(float b, const fp4_global &g, float *enc)
{
    float d = __fmul_rn(b, g.div6);
    uint8_t f = opf_dev_to_fp8(d < FLT_MAX ? d : FLT_MAX, true);
    float e = __fdiv_rn(1.0f, __fmul_rn(opf_dev_from_fp8(f, true), g.dec));
    *enc = e < FLT_MAX ? e : FLT_MAX;
    return f;
}

/* fp32 -> e2m1, RNE, saturating, NaN -> +6: opf_f32_to_e2m1_impl
 * (core/codec-impl.h) in float operations (the ALU is this file's
 * bottleneck; the FP32 pipe has room). x is clamped to [-6, 6] (NaN -> 6,
 * -0 kept); c = |x| rounds to the grid of its binade by one add of
 * m = 1.5 * 2^22 * p, p = max(2^floor(log2 c), 1), whose ulp p / 2 is the
 * grid's step (0.5 below 2, 1 below 4, 2 above) and whose even units are
 * the even codes; then bits(c + m) = bits(m) + k, k the grid steps, and
 * the code is k + 2 log2 p. Checked against the CPU's on all 2^32 inputs. */
__device__ __forceinline__ uint32_t e2m1_rne(float x)
{
    float cl = fmaxf(fminf(x, 6.0f), -6.0f), c = fabsf(cl);
    uint32_t pb = max(__float_as_uint(c) & 0x7F800000u, 0x3F800000u);
    uint32_t cm = __float_as_uint(__fadd_rn(c, __fmul_rn(__uint_as_float(pb), 0x1.8p22f)));
    /* bits(m) = pb + 0x0B400000; 2 log2 p = (pb >> 22) - 254 */
    return cm - pb + (pb >> 22) - (0x0B400000u + 254u) + ((__float_as_uint(cl) >> 28) & 8u);
}

/* 3.4.5 stochastic rounding with the random byte r8 (nvfp4_round_sr). */
__device__ __forceinline__ uint32_t e2m1_sr(float v, uint32_t r8)
{
    uint32_t bits = __float_as_uint(v), abits = bits & 0x7FFFFFFFu;
    float a = __uint_as_float(abits), u = (float)r8 * (1.0f / 256.0f);
    uint32_t up = (uint32_t)(a >= 2.0f) + (uint32_t)(a >= 4.0f);
    float t = __fmaf_rn(u, __uint_as_float(0x3F000000u + (up << 23)), a);  /* u * step exact */
    uint32_t code = (uint32_t)(t >= 0.5f) + (t >= 1.0f) + (t >= 1.5f) + (t >= 2.0f) +
                    (t >= 3.0f) + (t >= 4.0f) + (t >= 6.0f);
    code |= (bits >> 28) & 0x8u;
    return abits > 0x7F800000u ? 0x7u : code;
}

/* The 16 codes of fl(v[i] * enc), packed two a byte (even element low),
 * with the random words w when stochastic. */
__device__ __forceinline__ uint2 codes16(const float (&v)[BLK], float enc, bool sr, uint4 w)
{
    uint32_t word[2] = {0u, 0u}, r[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < BLK; i++) {
        float s = __fmul_rn(v[i], enc);
        uint32_t c = sr ? e2m1_sr(s, (r[i / 4] >> (8 * (i % 4))) & 0xFFu) : e2m1_rne(s);
        word[i / 8] |= c << (4 * (i % 8));
    }
    return make_uint2(word[0], word[1]);
}

/* v[2i], v[2i+1] -> bf16 -> fp32, RNE (cvt.rn.bf16x2.f32: one
 * instruction a pair). A NaN keeps only its NaN-ness (the CPU's is
 * 0x7FC00000, the GPU's 0x7FFF0000): what reads these values, the amax
 * (NaN ignored) and the e2m1 codes (NaN -> +6), sees any NaN alike. */
__device__ __forceinline__ void round_bf16(float (&v)[BLK])
{
#pragma unroll
    for (int i = 0; i < BLK; i += 2) {
        __nv_bfloat162 h = __floats2bfloat162_rn(v[i], v[i + 1]);
        v[i] = __low2float(h), v[i + 1] = __high2float(h);
    }
}

/* 2^bitlength(j): the columns whose sums differ after adding rows 0..j. */
__host__ __device__ constexpr int sum_classes(int j)
{
    return j >= 8 ? 16 : j >= 4 ? 8 : j >= 2 ? 4 : j >= 1 ? 2 : 1;
}

/* 3.4.3, in place: y_c = sum over r = 0..15 of fl(x_r * 0.25) * s_r * H[r][c],
 * each y_c summed from +0 in the order r = 0, 1, ..., 15 with one rounding
 * per add, then rounded to bf16: opf_rht16_cols (cpu/scale_math.c). Columns
 * whose signs agree over r = 0..j share those additions (H[r][c] depends on
 * c mod 2^bitlength(r) only): the same operations in the same order, 171
 * adds instead of 256, descending c so that a shared sum is read before it
 * is overwritten. */
__device__ __forceinline__ void rht16(float (&v)[BLK], uint32_t sign_mask)
{
    float t[BLK], acc[BLK];
#pragma unroll
    for (int r = 0; r < BLK; r++)
        t[r] = __uint_as_float(__float_as_uint(__fmul_rn(v[r], 0.25f)) ^ (((sign_mask >> r) & 1u) << 31));
    acc[0] = __fadd_rn(0.0f, t[0]);
#pragma unroll
    for (int j = 1; j < BLK; j++) {
#pragma unroll
        for (int c = sum_classes(j) - 1; c >= 0; c--) {
            float a = acc[c & (sum_classes(j - 1) - 1)];
            acc[c] = __popc(c & j) & 1 ? __fsub_rn(a, t[j]) : __fadd_rn(a, t[j]);
        }
    }
#pragma unroll
    for (int c = 0; c < BLK; c++) v[c] = acc[c];
    round_bf16(v);
}

/* The max of the 16 values' amax keys. */
__device__ __forceinline__ unsigned keys16(const float (&v)[BLK])
{
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < BLK; i++) m = opf_dev_amax_acc(m, v[i]);
    return __float_as_uint(m);
}

__device__ __forceinline__ int64_t scale_at(const fp4_out &o, int64_t i, int64_t j, int64_t ld)
{
    return o.swizzled ? opf_dev_swizzle_index(i, j, ld) : i * ld + j;
}

/* ---- the phases ---------------------------------------------------------- */

/* The tile's input bits in registers: a thread's TILE_CHUNKS chunks of 8
 * elements, loaded while the block works on the tile before (the loads
 * stay in flight until the tile is staged). */
enum { TILE_CHUNKS = TM * TK / 8 / THREADS };
template <typename T> struct chunk8 { uint4 u[sizeof(T) / 2]; };
template <typename T> struct tile_regs { chunk8<T> c[TILE_CHUNKS]; };

/* The n (8 or 0) elements at x: 16-byte loads when vec, zeros outside. */
template <typename T>
__device__ __forceinline__ void fetch8(const T *x, bool vec, int n, chunk8<T> &c)
{
    if (vec && n == 8) {
#pragma unroll
        for (int i = 0; i < (int)(sizeof(T) / 2); i++) c.u[i] = ((const uint4 *)x)[i];
        return;
    }
    typedef typename std::conditional<sizeof(T) == 2, uint16_t, uint32_t>::type B;
    B e[8];
#pragma unroll
    for (int i = 0; i < 8; i++) e[i] = i < n ? ((const B *)x)[i] : (B)0;
    memcpy(&c, e, sizeof c);
}

/* The 8 elements of c as fp32 (exact); returns their amax key. */
template <typename T>
__device__ __forceinline__ unsigned widen8(const chunk8<T> &c, float (&v)[8])
{
    T h[8];
    memcpy(h, &c, sizeof h);
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = opf_dev_widen<T>(h[i]), m = opf_dev_amax_acc(m, v[i]);
    return __float_as_uint(m);
}

/* The thread's chunks of the tile at (m0, k0) (K % 16 == 0, so an
 * 8-element chunk is whole or outside). */
template <typename T>
__device__ __forceinline__ void fetch_tile(const T *x, int64_t M, int64_t K, int64_t m0,
                                           int64_t k0, bool vec, tile_regs<T> &R)
{
#pragma unroll
    for (int p = 0; p < TILE_CHUNKS; p++) {
        int it = threadIdx.x + p * THREADS, r = it / (TK / 8), c = it % (TK / 8) * 8;
        int64_t m = m0 + r, k = k0 + c;
        fetch8<T>(x + m * K + k, vec, m < M && k < K ? 8 : 0, R.c[p]);
    }
}

/* The fetched tile into t as fp32; returns the thread's amax key. */
template <typename T>
__device__ __forceinline__ unsigned stage_tile(const tile_regs<T> &R, float (&t)[TM][SROW])
{
    unsigned key = 0;
#pragma unroll
    for (int p = 0; p < TILE_CHUNKS; p++) {
        int it = threadIdx.x + p * THREADS, r = it / (TK / 8), c = it % (TK / 8) * 8;
        float v[8];
        key = max(key, widen8<T>(R.c[p], v));
        *(float4 *)&t[r][c] = make_float4(v[0], v[1], v[2], v[3]);
        *(float4 *)&t[r][c + 4] = make_float4(v[4], v[5], v[6], v[7]);
    }
    return key;
}

/* A grid-stride loop over the tiles, row band by row band: each staged in
 * t, then body(m0, k0); the next tile's loads are issued before the body
 * runs. SYNC: the body reads t (or enc2d) up to its end, so staging the
 * next tile waits for the block. Returns the thread's amax key of the
 * input. */
template <typename T, bool SYNC, typename Body>
__device__ __forceinline__ unsigned tile_loop(const T *x, int64_t M, int64_t K, bool vec,
                                              float (&t)[TM][SROW], Body body)
{
    int64_t tiles_k = (K + TK - 1) / TK, n = tiles_k * ((M + TM - 1) / TM);
    unsigned key = 0;
    tile_regs<T> R;
    int64_t tile = blockIdx.x;  /* uniform in the block */
    if (tile < n) fetch_tile<T>(x, M, K, tile / tiles_k * TM, tile % tiles_k * TK, vec, R);
    for (; tile < n; tile += gridDim.x) {
        int64_t m0 = tile / tiles_k * TM, k0 = tile % tiles_k * TK, next = tile + gridDim.x;
        if (SYNC) __syncthreads();
        key = max(key, stage_tile<T>(R, t));
        __syncthreads();
        if (next < n) fetch_tile<T>(x, M, K, next / tiles_k * TM, next % tiles_k * TK, vec, R);
        body(m0, k0);
    }
    return key;
}

/* One thread per (group g, column c): the column's 16 values, rotated with
 * RHT (rounded to bf16 first, as the anchor takes only bf16). Returns their
 * amax key; F_AMAX stops there. 1D: the columnwise block's scale and codes
 * into ct; 2D: the tile's scale (both copies) into enc2d. */
template <typename T, int F>
__device__ __forceinline__ unsigned column_phase(const float (&t)[TM][SROW], const fp4_out &o,
                                                 int64_t M, int64_t K, int64_t m0, int64_t k0,
                                                 const fp4_global &gr, const fp4_global &gc,
                                                 uint8_t (&ct)[TK][TM / 2],
                                                 float (&enc2d)[GROUPS][TK / BLK])
{
    int c = threadIdx.x % TK, g = threadIdx.x / TK;
    int64_t k = k0 + c, mg = m0 + g * BLK;
    bool valid = k < K && mg < M;
    float v[BLK];
#pragma unroll
    for (int i = 0; i < BLK; i++) v[i] = t[g * BLK + i][c];
    if (F & F_RHT) {
        if (!std::is_same<T, __nv_bfloat16>::value) round_bf16(v);  /* f32 and f16 to bf16 */
        rht16(v, o.sign_mask);
    }
    unsigned key = keys16(v);
    if (F & F_AMAX) return key;
    if (F & F_2D) {
        key = opf_dev_max_lanes(key, BLK);  /* the 16 columns of the tile */
        float enc;
        uint8_t sf = block_scale(__uint_as_float(key), gr, &enc);
        if (c % BLK == 0) enc2d[g][c / BLK] = enc;
        if (!valid) return key;
        int i = c % BLK;
        if (o.qr) o.sr[scale_at(o, mg + i, k / BLK, o.ld_r)] = sf;
        if (o.qc) o.sc[scale_at(o, k, mg / BLK, o.ld_c)] = sf;
        return key;
    }
    float enc;
    uint8_t sf = block_scale(__uint_as_float(key), gc, &enc);
    uint4 w = make_uint4(0, 0, 0, 0);
    if (o.sr_on) w = opf_dev_philox_at(o.seed, o.offset + (uint64_t)(k * M + mg) / BLK, 1u);
    *(uint2 *)&ct[c][g * BLK / 2] = codes16(v, enc, o.sr_on, w);
    if (valid) o.sc[scale_at(o, k, mg / BLK, o.ld_c)] = sf;
    return key;
}

/* One thread per (row r, block j): a warp takes 8 rows, lane = 8 j + r % 8,
 * so that a store of the warp is 8 runs of 32 contiguous bytes, and the 8
 * lanes of a quarter warp read 8 rows, which SROW % 32 == 4 puts in
 * distinct banks. */
template <int F>
__device__ __forceinline__ void row_phase(const float (&t)[TM][SROW], const fp4_out &o, int64_t M,
                                          int64_t K, int64_t m0, int64_t k0, const fp4_global &gr,
                                          uint8_t (&ct)[TK][TM / 2],
                                          const float (&enc2d)[GROUPS][TK / BLK])
{
    int lane = threadIdx.x % 32, j = lane / 8, r = threadIdx.x / 32 * 8 + lane % 8;
    int64_t m = m0 + r, k = k0 + j * BLK;
    bool valid = m < M && k < K;
    float v[BLK];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        float4 f = *(const float4 *)&t[r][j * BLK + 4 * q];
        v[4 * q] = f.x, v[4 * q + 1] = f.y, v[4 * q + 2] = f.z, v[4 * q + 3] = f.w;
    }
    float enc;
    uint8_t sf = 0;
    if (F & F_2D) enc = enc2d[r / BLK][j];
    else sf = block_scale(__uint_as_float(keys16(v)), gr, &enc);
    uint4 w = make_uint4(0, 0, 0, 0);
    if (o.sr_on) w = opf_dev_philox_at(o.seed, o.offset + (uint64_t)(m * K + k) / BLK, 0u);
    uint2 q = codes16(v, enc, o.sr_on, w);
    if (valid && (F & F_ROW)) {
        *(uint2 *)(o.qr + (m * K + k) / 2) = q;
        if (!(F & F_2D)) o.sr[scale_at(o, m, k / BLK, o.ld_r)] = sf;
    }
    if (!((F & F_2D) && (F & F_COL))) return;
    /* 2D: the same codes make the transposed copy; lane ^ 1 holds row r ^ 1 */
    uint2 p = make_uint2(__shfl_xor_sync(0xFFFFFFFFu, q.x, 1), __shfl_xor_sync(0xFFFFFFFFu, q.y, 1));
    uint2 lo = r % 2 ? p : q, hi = r % 2 ? q : p;
    int h = r % 2;  /* the even row's thread writes columns 0..7, the odd 8..15 */
    uint32_t wl = h ? lo.y : lo.x, wh = h ? hi.y : hi.x;
#pragma unroll
    for (int i = 0; i < 8; i++)
        ct[j * BLK + 8 * h + i][r / 2] = (uint8_t)(((wl >> (4 * i)) & 0xFu) | ((wh >> (4 * i)) & 0xFu) << 4);
}

/* The transposed tile: column c's TM/2 bytes to row k0 + c of [K, M/2]. */
__device__ __forceinline__ void store_phase(const uint8_t (&ct)[TK][TM / 2], const fp4_out &o,
                                            int64_t M, int64_t K, int64_t m0, int64_t k0)
{
    int c = threadIdx.x / GROUPS, g = threadIdx.x % GROUPS;
    int64_t k = k0 + c, m = m0 + g * BLK;
    if (k < K && m < M) *(uint2 *)(o.qc + k * (M / 2) + m / 2) = *(const uint2 *)&ct[c][g * BLK / 2];
}

/* The block's max of key into *dst (one atomic: a max, in any order). */
__device__ __forceinline__ void block_key_max(unsigned key, unsigned *dst)
{
    __shared__ unsigned warp_max[THREADS / 32];
    key = opf_dev_max_lanes(key, 32);
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = key;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < THREADS / 32; w++) key = max(key, warp_max[w]);
    if (key) atomicMax(dst, key);
}

/* The amax pass without RHT: A_row only, a grid-stride loop over the
 * n8 chunks of 8 elements with AMAX_UNROLL chunks in flight a thread (a
 * max of keys: any order gives the same bits). */
enum { AMAX_UNROLL = 4 };
template <typename T>
__global__ void __launch_bounds__(THREADS) fp4_amax_flat_kernel(const T *__restrict__ x,
                                                                int64_t n8, fp4_out o)
{
    int64_t stride = (int64_t)gridDim.x * THREADS;
    unsigned key = 0;
    for (int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x; i < n8; i += AMAX_UNROLL * stride) {
        chunk8<T> c[AMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < AMAX_UNROLL; u++)
            fetch8<T>(x + (i + u * stride) * 8, o.vec, i + u * stride < n8 ? 8 : 0, c[u]);
        float v[8];
#pragma unroll
        for (int u = 0; u < AMAX_UNROLL; u++) key = max(key, widen8<T>(c[u], v));
    }
    block_key_max(key, &o.keys[0]);
}

/* The amax pass with RHT: the tiles on one wave of blocks (few atomics on
 * the two keys): A_row of the input, A_col of the rotated columns. */
template <typename T>
__global__ void __launch_bounds__(THREADS) fp4_amax_rht_kernel(const T *__restrict__ x,
                                                               int64_t M, int64_t K, fp4_out o)
{
    enum { F = F_AMAX | F_RHT };
    __shared__ __align__(16) float t[TM][SROW];
    __shared__ __align__(16) uint8_t ct[TK][TM / 2];  /* unused: the column phase stops early */
    __shared__ float enc2d[GROUPS][TK / BLK];
    unsigned col_key = 0;
    fp4_global none = {1.0f, 1.0f, 1.0f};
    unsigned row_key = tile_loop<T, true>(x, M, K, o.vec, t, [&](int64_t m0, int64_t k0) {
        col_key = max(col_key, column_phase<T, F>(t, o, M, K, m0, k0, none, none, ct, enc2d));
    });
    block_key_max(row_key, &o.keys[0]);
    __syncthreads();
    block_key_max(col_key, &o.keys[1]);
}

/* The cast pass: the tiles on a wave of resident blocks. */
template <typename T, int F>
__global__ void __launch_bounds__(THREADS) fp4_kernel(const T *__restrict__ x, int64_t M, int64_t K,
                                                      fp4_out o)
{
    __shared__ __align__(16) float t[TM][SROW];
    __shared__ __align__(16) uint8_t ct[TK][TM / 2];
    __shared__ float enc2d[GROUPS][TK / BLK];
    float a_row = __uint_as_float(o.keys[0]), a_col = __uint_as_float(o.keys[1]);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        if (o.amax) *o.amax = a_row;
        if (o.col_amax) *o.col_amax = a_col;
    }
    fp4_global gr = global_scale(a_row), gc = global_scale(a_col);
    /* with a columnwise copy the sync before the store phase already
     * follows every read of t and enc2d */
    tile_loop<T, !(F & F_COL)>(x, M, K, o.vec, t, [&](int64_t m0, int64_t k0) {
        if ((F & F_COL) || (F & F_2D)) {
            column_phase<T, F>(t, o, M, K, m0, k0, gr, gc, ct, enc2d);
            __syncthreads();
        }
        if ((F & F_ROW) || (F & F_2D)) row_phase<F>(t, o, M, K, m0, k0, gr, ct, enc2d);
        if (!(F & F_COL)) return;
        __syncthreads();
        store_phase(ct, o, M, K, m0, k0);
    });
}

/* ---- dequantize ----------------------------------------------------------
 * One thread per 16-element block of a stored copy [rows, cols]: its 8
 * bytes and scale. FULL: fl(fl(fp4 * sf) * S_dec) in fp32 to the logical
 * [M, K] (a columnwise copy transposed back), as the CPU; else fp4 * sf
 * (exact) in bf16, in the stored layout: the GEMM's operand, whose S_dec
 * goes into alpha. */

/* fl(fl(v * sf) * dec) with the CPU's NaN bits: a NaN scale code gives the
 * quiet NaN with its sign, which x86 multiplies pass through. */
__device__ __forceinline__ float decode_full(float v, uint8_t sf, float dec)
{
    float s = opf_dev_from_fp8(sf, true), r = __fmul_rn(__fmul_rn(v, s), dec);
    return isnan(s) ? __uint_as_float((uint32_t)(sf & 0x80u) << 24 | 0x7FC00000u) : r;
}

__device__ __forceinline__ float e2m1_value(uint32_t code)
{
    /* 0, 0.5, 1, 1.5, 2, 3, 4, 6 from the code: exponent and mantissa bits */
    uint32_t e = (code >> 1) & 3u, m = code & 1u;
    uint32_t mag = e == 0 ? (m ? 0x3F000000u : 0u) : ((e + 126u) << 23) | (m << 22);
    return __uint_as_float(mag | (code & 8u) << 28);
}

template <bool FULL>
__global__ void fp4_dequant_kernel(const uint8_t *__restrict__ q, const uint8_t *__restrict__ s,
                                   int64_t rows, int64_t cols, int64_t ld, bool swizzled,
                                   bool col, bool vec, const float *amax, void *out)
{
    float dec = FULL ? global_scale(*amax).dec : 1.0f;
    int64_t nb = rows * cols / BLK, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += stride) {
        int64_t r = b / (cols / BLK), jb = b % (cols / BLK), c0 = jb * BLK;
        uint2 w = *(const uint2 *)(q + b * (BLK / 2));
        uint8_t sf = s[swizzled ? opf_dev_swizzle_index(r, jb, ld) : r * ld + jb];
        float v[BLK];
#pragma unroll
        for (int i = 0; i < BLK; i++) {
            float e = e2m1_value(((i < 8 ? w.x : w.y) >> (4 * (i % 8))) & 0xFu);
            v[i] = FULL ? decode_full(e, sf, dec) : __fmul_rn(e, opf_dev_from_fp8(sf, true));
        }
        if (!FULL) {
            __align__(16) __nv_bfloat16 h[BLK];
#pragma unroll
            for (int i = 0; i < BLK; i++) h[i] = __float2bfloat16_rn(v[i]);
            __nv_bfloat16 *o = (__nv_bfloat16 *)out + b * BLK;
            if (vec) ((uint4 *)o)[0] = ((const uint4 *)h)[0], ((uint4 *)o)[1] = ((const uint4 *)h)[1];
            else for (int i = 0; i < BLK; i++) o[i] = h[i];
        } else if (col) {
#pragma unroll
            for (int i = 0; i < BLK; i++) ((float *)out)[(c0 + i) * rows + r] = v[i];
        } else if (vec) {
            float4 *o = (float4 *)((float *)out + b * BLK);
#pragma unroll
            for (int i = 0; i < BLK / 4; i++) o[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        } else {
            for (int i = 0; i < BLK; i++) ((float *)out)[b * BLK + i] = v[i];
        }
    }
}

/* ---- host side ----------------------------------------------------------- */

static const char *const kFn = "quantize (nvfp4)";

/* One wave of KERNEL's blocks (as many as fit an SM, on every SM), fewer
 * for fewer tiles: a grid-stride loop with no second, partial wave. */
template <auto KERNEL>
static unsigned wave_of(unsigned sms, int64_t M, int64_t K)
{
    static const int per_sm = [] {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, KERNEL, THREADS, 0) != cudaSuccess) n = 0;
        return n > 0 ? n : 1;
    }();
    int64_t tiles = ((K + TK - 1) / TK) * ((M + TM - 1) / TM), wave = (int64_t)sms * per_sm;
    return (unsigned)(tiles < wave ? tiles : wave);
}

template <typename T, int F>
static void launch_f(cudaStream_t st, const void *x, int64_t M, int64_t K, const fp4_out &o,
                     unsigned sms)
{
    fp4_kernel<T, F><<<wave_of<fp4_kernel<T, F>>(sms, M, K), THREADS, 0, st>>>((const T *)x, M, K, o);
}

/* The quantize pass for the copies and options of o. */
template <typename T>
static void launch_cast(cudaStream_t st, const void *x, int64_t M, int64_t K, const fp4_out &o,
                        unsigned sms, bool two_d, bool rht)
{
    bool row = o.qr != NULL, col = o.qc != NULL;
    if (two_d) {
        if (row && col) launch_f<T, F_2D | F_ROW | F_COL>(st, x, M, K, o, sms);
        else if (row) launch_f<T, F_2D | F_ROW>(st, x, M, K, o, sms);
        else launch_f<T, F_2D | F_COL>(st, x, M, K, o, sms);
    } else if (!col) {
        launch_f<T, F_ROW>(st, x, M, K, o, sms);
    } else if (rht) {
        if (row) launch_f<T, F_ROW | F_COL | F_RHT>(st, x, M, K, o, sms);
        else launch_f<T, F_COL | F_RHT>(st, x, M, K, o, sms);
    } else {
        if (row) launch_f<T, F_ROW | F_COL>(st, x, M, K, o, sms);
        else launch_f<T, F_COL>(st, x, M, K, o, sms);
    }
}

/* The amax pass (amax), else the cast. */
template <typename T>
static void launch_typed(cudaStream_t st, const void *x, int64_t M, int64_t K, const fp4_out &o,
                         unsigned sms, bool amax, bool two_d, bool rht)
{
    if (!amax) {
        launch_cast<T>(st, x, M, K, o, sms, two_d, rht);
    } else if (rht) {
        unsigned grid = wave_of<fp4_amax_rht_kernel<T>>(sms, M, K);
        fp4_amax_rht_kernel<T><<<grid, THREADS, 0, st>>>((const T *)x, M, K, o);
    } else {
        unsigned grid = wave_of<fp4_amax_flat_kernel<T>>(sms, M, K);
        fp4_amax_flat_kernel<T><<<grid, THREADS, 0, st>>>((const T *)x, M * K / 8, o);
    }
}

static opf_status launch(opf_ctx *ctx, cudaStream_t st, const opf_tensor *in, int64_t M,
                         int64_t K, const fp4_out &o, unsigned sms, bool amax, bool two_d,
                         bool rht)
{
    const void *x = in->data[OPF_COMP_DATA];
    switch (in->spec.dtype) {
    case OPF_F32: launch_typed<float>(st, x, M, K, o, sms, amax, two_d, rht); break;
    case OPF_BF16: launch_typed<__nv_bfloat16>(st, x, M, K, o, sms, amax, two_d, rht); break;
    case OPF_F16: launch_typed<__half>(st, x, M, K, o, sms, amax, two_d, rht); break;
    default:
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: input dtype %s, want f32/bf16/f16", kFn,
                         opf_dtype_name(in->spec.dtype));
    }
    OPF_CUDA_LAUNCHED(ctx, amax ? "quantize (nvfp4 amax)" : kFn);
    return OPF_OK;
}

/* The amax reduction hook (host code) on {A_row} or {A_row, A_col}: the
 * keys go to the host and back (an amax key is the amax's bits). */
static opf_status reduce_amaxes(opf_ctx *ctx, opf_cuda_state *s, const opf_quantizer *q,
                                unsigned *keys, bool rht)
{
    float a[2];
    int n = rht ? 2 : 1;
    OPF_CUDA_TRY(ctx, kFn, cudaMemcpyAsync(a, keys, sizeof a, cudaMemcpyDeviceToHost, s->stream));
    OPF_CUDA_TRY(ctx, kFn, cudaStreamSynchronize(s->stream));
    opf_status st = q->amax_reduce(q->amax_reduce_user, a, n);
    if (st != OPF_OK)
        return opf_error(ctx, st, "%s: amax reduction of %d value(s) failed: %s", kFn, n,
                         opf_status_str(st));
    a[1] = a[n - 1];
    OPF_CUDA_TRY(ctx, kFn, cudaMemcpyAsync(keys, a, sizeof a, cudaMemcpyHostToDevice, s->stream));
    OPF_CUDA_TRY(ctx, kFn, cudaStreamSynchronize(s->stream));
    return OPF_OK;
}

extern "C" opf_status opf_cuda_quantize_nvfp4(opf_ctx *ctx, const opf_quantizer *q,
                                              const opf_tensor *in, opf_tensor *out,
                                              const opf_quantize_state *qs)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, kFn);
    if (!s) return OPF_ERR_STATE;
    opf_layout L;
    opf_status st = opf_spec_layout(&out->spec, &L);
    if (st) return opf_error(ctx, st, "%s: %s", kFn, opf_last_error(NULL));
    if ((st = opf_nvfp4_check(ctx, q, in, out, &L, kFn))) return st;
    bool row = out->spec.usage & OPF_USAGE_ROWWISE, col = out->spec.usage & OPF_USAGE_COLUMNWISE;
    bool two_d = out->spec.scaling == OPF_SCALING_NVFP4_2D, rht = q->rht && col;
    fp4_out o;
    memset(&o, 0, sizeof o);
    o.qr = row ? (uint8_t *)out->data[OPF_COMP_DATA] : NULL;
    o.qc = col ? (uint8_t *)out->data[OPF_COMP_COL_DATA] : NULL;
    o.sr = row ? (uint8_t *)out->data[OPF_COMP_SCALE_INV] : NULL;
    o.sc = col ? (uint8_t *)out->data[OPF_COMP_COL_SCALE_INV] : NULL;
    o.ld_r = L.comp[OPF_COMP_SCALE_INV].cols;
    o.ld_c = L.comp[OPF_COMP_COL_SCALE_INV].cols;
    o.swizzled = (out->spec.flags & OPF_SPEC_SWIZZLED) != 0;
    o.amax = (float *)out->data[OPF_COMP_AMAX];
    o.col_amax = (float *)out->data[OPF_COMP_COL_AMAX];
    o.sr_on = q->stochastic;
    o.seed = qs->rng_seed, o.offset = qs->rng_offset;
    o.sign_mask = q->rht_sign_mask;
    o.vec = opf_cuda_aligned16(in->data[OPF_COMP_DATA]);
    if ((st = opf_cuda_scratch(ctx, s, 2 * sizeof(unsigned), (void **)&o.keys))) return st;
    OPF_CUDA_TRY(ctx, kFn, cudaMemsetAsync(o.keys, 0, 2 * sizeof(unsigned), s->stream));
    /* the padding of the scales is zero, as on the CPU; an empty tensor
     * has amaxes 0 */
    const opf_component zeroed[] = {OPF_COMP_SCALE_INV, OPF_COMP_COL_SCALE_INV, OPF_COMP_AMAX,
                                    OPF_COMP_COL_AMAX};
    for (int i = 0; i < 4; i++) {
        opf_component c = zeroed[i];
        if (L.comp[c].present && L.comp[c].nbytes && (i < 2 || L.m * L.k == 0))
            OPF_CUDA_TRY(ctx, kFn, cudaMemsetAsync(out->data[c], 0, L.comp[c].nbytes, s->stream));
    }
    if (L.m * L.k == 0) return OPF_OK;
    unsigned sms = (unsigned)s->sm_count;
    if ((st = launch(ctx, s->stream, in, L.m, L.k, o, sms, true, two_d, rht))) return st;
    if (!rht) {  /* A_col = A_row */
        OPF_CUDA_TRY(ctx, kFn, cudaMemcpyAsync(o.keys + 1, o.keys, sizeof(unsigned),
                                               cudaMemcpyDeviceToDevice, s->stream));
    }
    if (q->amax_reduce && (st = reduce_amaxes(ctx, s, q, o.keys, rht))) return st;
    return launch(ctx, s->stream, in, L.m, L.k, o, sms, false, two_d, rht);
}

/* Decodes copy `which` of t: FULL to fp32 [M, K], else fp4 * sf to bf16 in
 * the stored layout. */
template <bool FULL>
static opf_status dequantize(opf_ctx *ctx, const opf_tensor *t, unsigned which, void *out,
                             const char *fn)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    if (st) return opf_error(ctx, st, "%s: %s", fn, opf_last_error(NULL));
    if (which != OPF_USAGE_ROWWISE && which != OPF_USAGE_COLUMNWISE)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: which = %u, want rowwise (1) or "
                         "columnwise (2)", fn, which);
    bool col = which == OPF_USAGE_COLUMNWISE;
    opf_component dc = col ? OPF_COMP_COL_DATA : OPF_COMP_DATA;
    opf_component sc = col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV;
    opf_component ac = col ? OPF_COMP_COL_AMAX : OPF_COMP_AMAX;
    if (!L.comp[dc].present || !t->data[dc] || !t->data[sc] || (FULL && !t->data[ac]))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the tensor has no %s copy", fn,
                         col ? "columnwise" : "rowwise");
    int64_t rows = L.comp[dc].rows, cols = L.comp[dc].cols;
    if (rows * cols == 0) return OPF_OK;
    fp4_dequant_kernel<FULL><<<opf_cuda_grid(s, rows * cols / BLK, DQ_THREADS), DQ_THREADS, 0,
                               s->stream>>>(
        (const uint8_t *)t->data[dc], (const uint8_t *)t->data[sc], rows, cols, L.comp[sc].cols,
        (t->spec.flags & OPF_SPEC_SWIZZLED) != 0, col, opf_cuda_aligned16(out),
        (const float *)t->data[ac], out);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

extern "C" opf_status opf_cuda_dequantize_nvfp4(opf_ctx *ctx, const opf_tensor *t,
                                                unsigned which, float *out)
{
    return dequantize<true>(ctx, t, which, out, "dequantize (nvfp4)");
}

extern "C" opf_status opf_cuda_dequantize_nvfp4_bf16(opf_ctx *ctx, const opf_tensor *t,
                                                     unsigned which, void *out)
{
    return dequantize<false>(ctx, t, which, out, "dequantize (nvfp4, bf16)");
}
