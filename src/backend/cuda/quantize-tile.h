/* quantize-tile.h: the cast + transpose tile that the FP8 per-tensor and
 * block-scaling kernels share (quantize_tensor_fp8.cu, quantize_block.cu).
 *
 * A tile is 128 rows x COLS columns of an [M, K] tensor, one block of
 * (COLS / 8) x 32 threads. Each thread owns a quad: 4 consecutive rows of 8
 * columns, read with 16-byte loads (8 lanes read a whole 128-byte line).
 * After the cast the thread turns its 4 x 8 bytes into 8 column words (the
 * 4 rows of one column each, by byte permutes) and writes them into a
 * transposed shared tile: tile row c holds the 128 bytes of column c, so a
 * thread reads 16 bytes of the columnwise copy at once and 8 lanes store a
 * whole 128-byte line of it.
 *
 * Bank conflicts: word q of tile row c sits at q ^ swz(c), swz a multiple
 * of the quads per warp picked by c / 8 (the writer's lane along the row).
 * The 32 lanes writing column word i then hit 32 banks, and the 8 lanes
 * reading one tile row cover its 32 words. */
#ifndef OPFUSE_QUANTIZE_TILE_H
#define OPFUSE_QUANTIZE_TILE_H

#include "backend/cuda/cuda-impl.h"

enum {
    OPF_QT_ROWS = 128,  /* rows of a tile */
    OPF_QT_QUADS = 32,  /* quads of a column: the words of a tile row */
};

/* Where quad q of tile row c lives in that row. */
template <int COLS> __device__ __forceinline__ int opf_qtile_slot(int c, int q)
{
    constexpr int quads_per_warp = 32 / (COLS / 8);
    return q ^ (c / 8 * quads_per_warp);
}

/* A thread's quad as loaded: 4 rows of 8 elements. 2-byte types stay
 * packed (16 registers, not 32) until opf_quad_row widens a row where it
 * is used, which leaves room for more blocks on an SM. */
template <typename T> struct __align__(16) opf_quad {
    uint32_t w[4][2 * sizeof(T)];
};

/* Row j of the quad as fp32 (exact). */
template <typename T>
__device__ __forceinline__ void opf_quad_row(const opf_quad<T> &q, int j, float (&v)[8])
{
    const T *e = reinterpret_cast<const T *>(q.w[j]);
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = opf_dev_widen<T>(e[i]);
}

/* The thread's quad of x: rows m..m+3, columns k..k+7; zeros outside the
 * tensor (neutral for every amax). vec: 16-byte loads of the whole chunks
 * (K % 8 == 0, x 16-byte aligned). */
template <typename T>
__device__ __forceinline__ void opf_qtile_load(const T *x, int64_t M, int64_t K, int64_t m,
                                               int64_t k, bool vec, opf_quad<T> &q)
{
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int n = m + j >= M || k >= K ? 0 : K - k < 8 ? (int)(K - k) : 8;
        const T *p = x + (m + j) * K + k;
        uint4 *d = reinterpret_cast<uint4 *>(q.w[j]);
        if (vec && n == 8) {
#pragma unroll
            for (int h = 0; h < (int)sizeof(T) / 2; h++) d[h] = reinterpret_cast<const uint4 *>(p)[h];
        } else {
            T *e = reinterpret_cast<T *>(q.w[j]);
#pragma unroll
            for (int i = 0; i < 8; i++) e[i] = i < n ? p[i] : T(0.0f);
        }
    }
}

/* The quad's cast bytes (b[j]: row m + j) into the rowwise copy q [M, K]. */
__device__ __forceinline__ void opf_qtile_store_rows(uint8_t *q, const uint2 (&b)[4], int64_t M,
                                                     int64_t K, int64_t m, int64_t k, bool vec)
{
#pragma unroll
    for (int j = 0; j < 4; j++)
        if (m + j < M && k < K) opf_dev_store8(q + (m + j) * K + k, b[j], K - k < 8 ? (int)(K - k) : 8, vec);
}

/* o[i] byte j = a[j] byte i: a 4 x 4 byte transpose. */
__device__ __forceinline__ void opf_qtile_transpose4(uint32_t a0, uint32_t a1, uint32_t a2,
                                                     uint32_t a3, uint32_t *o)
{
    uint32_t lo01 = __byte_perm(a0, a1, 0x5140), hi01 = __byte_perm(a0, a1, 0x7362);
    uint32_t lo23 = __byte_perm(a2, a3, 0x5140), hi23 = __byte_perm(a2, a3, 0x7362);
    o[0] = __byte_perm(lo01, lo23, 0x5410);
    o[1] = __byte_perm(lo01, lo23, 0x7632);
    o[2] = __byte_perm(hi01, hi23, 0x5410);
    o[3] = __byte_perm(hi01, hi23, 0x7632);
}

/* The quad's cast bytes (b[j]: tile rows 4 qd + j, columns 8 tc..8 tc+7)
 * into the transposed tile, one word per column. */
template <int COLS>
__device__ __forceinline__ void opf_qtile_put(uint32_t (&tile)[COLS][OPF_QT_QUADS],
                                              const uint2 (&b)[4], int tc, int qd)
{
    uint32_t w[8];
    opf_qtile_transpose4(b[0].x, b[1].x, b[2].x, b[3].x, w);
    opf_qtile_transpose4(b[0].y, b[1].y, b[2].y, b[3].y, w + 4);
    int slot = opf_qtile_slot<COLS>(8 * tc, qd);
#pragma unroll
    for (int i = 0; i < 8; i++) tile[8 * tc + i][slot] = w[i];
}

/* The columnwise copy of the tile: row k0 + c of qt ([K, M], transposed)
 * gets tile row c, 16 bytes (4 quads) a store. vec: 16-byte stores (M % 16
 * == 0, qt aligned), else byte by byte at the edges. The caller has
 * synchronized after the last opf_qtile_put. */
template <int COLS, int NTHREADS>
__device__ __forceinline__ void opf_qtile_store_t(const uint32_t (&tile)[COLS][OPF_QT_QUADS],
                                                  uint8_t *qt, int64_t m0, int64_t k0, int64_t M,
                                                  int64_t K, bool vec)
{
    for (int it = threadIdx.x; it < COLS * (OPF_QT_QUADS / 4); it += NTHREADS) {
        int c = it / (OPF_QT_QUADS / 4), ch = it % (OPF_QT_QUADS / 4);
        int64_t kc = k0 + c, m = m0 + 16 * ch;
        if (kc >= K || m >= M) continue;
        /* Quad 4 ch + i sits at s ^ i: word (s & 3) ^ i of the aligned four. */
        int s = opf_qtile_slot<COLS>(c, 4 * ch);
        uint4 u = *(const uint4 *)&tile[c][s & ~3];
        if (s & 1) u = make_uint4(u.y, u.x, u.w, u.z);
        if (s & 2) u = make_uint4(u.z, u.w, u.x, u.y);
        if (vec) {
            *(uint4 *)(qt + kc * M + m) = u;
        } else {
            const uint8_t *bb = (const uint8_t *)&u;
            for (int i = 0; i < 16 && m + i < M; i++) qt[kc * M + m + i] = bb[i];
        }
    }
}

#endif
