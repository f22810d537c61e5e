/* gemm.c (cpu): the reference GEMM of docs/numerics.md 5.3 on the CPU.
 *
 * Each operand becomes an fp32 matrix read as op(i, k), i indexing D's rows
 * (B) or columns (A), k the reduction:
 *   plain f32           the caller's memory, no copy
 *   plain bf16 / f16    converted (exact)
 *   MXFP8               dequantized exactly, fl(q * 2^(E-127)) (1.5)
 *   per-tensor FP8      the raw FP8 values; the two scale_inv move into alpha
 *   FP8 block           the raw FP8 values; the block scales enter per chunk
 *   NVFP4               e2m1 * e4m3 block scale (exact in fp32); the global
 *                       scales move into alpha
 * and OpenBLAS sgemm sums the products in fp32 (its own order inside a call).
 *
 * What each format computes (acc = the fp32 sum, D before the epilogue):
 *   plain, MXFP8:    D = fl(alpha * acc)
 *   per-tensor FP8:  acc = sum qa*qb, D = fl(alpha' * acc) with
 *                    alpha' = fl(alpha * fl(sA_inv * sB_inv)), the anchor's
 *                    acc = sa_inv * sb_inv * sum(qa qb) with one rounding
 *   NVFP4:           acc = sum (qa sfa)(qb sfb), D = fl(alpha' * acc) with
 *                    alpha' = fl(fl(fl(alpha * amax_A) * amax_B) * c),
 *                    c = fl32(1/7225344) = 0x34149B93
 *   FP8 block:       per 128-wide K chunk P = sum_chunk qa*qb (one sgemm),
 *                    y = fmaf(fl(P * sa), sb, y) (1D x 1D, 1D x 2D) or
 *                    y = fmaf(fl(P * sb), sa, y) (2D x 1D), "a" = B (rows of
 *                    D), "b" = A; D = fl(alpha * y). Exact in the chunk and
 *                    scale structure of the anchor's CuBLASRefBlockwiseGemm;
 *                    the sum inside a chunk is OpenBLAS's, so it is checked
 *                    with a tolerance, not bitwise.
 * Alpha is applied once to the whole sum (sgemm runs with alpha 1, so its
 * per-panel partial sums are not rounded through alpha).
 *
 * Epilogue per element (5.5): t = fl(alpha' * acc); t = fl(t + bias[n]);
 * with accumulate t = fl(t + fl(beta * D_old)) (block scaling first rounds t
 * to D's dtype, as the anchor does); then D = RNE(t) in D's dtype, or for an
 * FP8 D the per-tensor quantize kernel runs on the fp32 result.
 *
 * Determinism: D is cut into fixed tiles (sizes independent of the thread
 * count); each tile is one single-threaded sgemm call, OpenMP spreads the
 * tiles. The sums of an element therefore never depend on the thread count.
 * OpenBLAS is switched to one thread for the duration of the call (a
 * process-wide setting, restored afterwards).
 *
 * Scratch (fp32 operands, the fp32 result, per-thread chunk tiles) comes from
 * the context workspace, reserved here on first use. */
#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/cpu/cpu-impl.h"
#include "backend/scale-math.h"
#include "core/codec-impl.h"
#include "core/core-impl.h"

enum {
    TILE_M = 512, TILE_N = 1024,    /* largest tiles of the one-sgemm path */
    BTILE_M = 256, BTILE_N = 512,   /* largest tiles of the block-scaling path */
    TILE_MIN = 128,                 /* tiles shrink down to this edge */
    TILE_COUNT = 16,                /* ... until there are this many */
    CHUNK_K = 128,                  /* FP8 block scaling reduction chunk */
    WS_ALIGN = 64,                  /* floats: workspace parts start 256-byte aligned */
};

/* fl32(1/7225344) = 1 / (6 * 448)^2, the NVFP4 global-scale product (5.3). */
#define NVFP4_ALPHA_C_BITS 0x34149B93u

/* An operand as fp32: element (i, k) at p[i*ld + k] when kmajor, else at
 * p[k*ld + i]. Block scaling adds the scale grid of the copy it reads. */
typedef struct gemm_operand {
    const float *p;
    int64_t      ld;
    bool         kmajor;
    float        global;       /* per-tensor FP8: scale_inv; NVFP4: the copy's amax */
    const float *bscale;       /* FP8 block: scale_inv grid of the copy */
    int64_t      bscale_ld;
    bool         bscale_2d;
} gemm_operand;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

enum { GEMM_SERIAL_WORK = 1 << 20 };  /* M*N*K below which one thread runs the GEMM */

static int num_threads(opf_ctx *ctx)
{
    int t = opf_ctx_num_threads(ctx);
    return t > 0 ? t : omp_get_max_threads();
}

/* ---- operand decoding ---------------------------------------------------- */

/* Plain bf16/f16 [R, C] to fp32, row by row. */
static void decode_plain(const opf_tensor *t, int64_t R, int64_t C, float *out, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < R; r++)
        opf_cpu_load_f32(t->data[OPF_COMP_DATA], t->spec.dtype, r * C, C, out + r * C);
}

/* Raw FP8 bytes [R, C] to their fp32 values, no scale (per-tensor and block). */
static void decode_fp8_raw(const uint8_t *q, opf_dtype qd, int64_t R, int64_t C, float *out, int nt)
{
    float lut[256];
    opf_fp8_decode_table(qd, lut);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) out[r * C + c] = lut[q[r * C + c]];
}

/* MXFP8 copy to the logical [R, C] fp32 matrix: fl(q * 2^(E-127)) (1.5).
 * Rowwise scales are (r, c/32); columnwise (r/32, c), swizzled on the
 * transposed view (4.4). */
static void decode_mxfp8(const opf_tensor *t, bool rowwise, int64_t R, int64_t C, float *out,
                         int nt)
{
    opf_layout L;
    opf_spec_layout(&t->spec, &L);
    float lut[256], e8[256];
    opf_fp8_decode_table(t->spec.qdtype, lut);
    for (int e = 0; e < 256; e++) e8[e] = opf_e8m0_to_f32_impl((uint8_t)e);
    bool swz = (t->spec.flags & OPF_SPEC_SWIZZLED) != 0;
    const uint8_t *q = t->data[rowwise ? OPF_COMP_DATA : OPF_COMP_COL_DATA];
    const uint8_t *s = t->data[rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV];
    const opf_component_desc *sd = &L.comp[rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV];
    if (rowwise) {
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < C / 32; j++) {
                size_t si = swz ? opf_swizzle_index(r, j, sd->cols) : (size_t)(r * sd->cols + j);
                float sf = e8[s[si]];
                for (int64_t c = j * 32; c < j * 32 + 32; c++)
                    out[r * C + c] = lut[q[r * C + c]] * sf;
            }
        return;
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t rb = 0; rb < R / 32; rb++)
        for (int64_t c = 0; c < C; c++) {
            size_t si = swz ? opf_swizzle_index(c, rb, sd->rows) : (size_t)(rb * sd->cols + c);
            float sf = e8[s[si]];
            for (int64_t r = rb * 32; r < rb * 32 + 32; r++)
                out[r * C + c] = lut[q[r * C + c]] * sf;
        }
}

/* NVFP4 stored copy [R, C] (C along K) to fp32 e2m1 * e4m3 block scale,
 * exact; the global scale is left out (it goes into alpha). */
static void decode_nvfp4(const opf_tensor *t, bool rowwise, int64_t R, int64_t C, float *out,
                         int nt)
{
    opf_layout L;
    opf_spec_layout(&t->spec, &L);
    float fp4[16], e4[256];
    for (int c = 0; c < 16; c++) fp4[c] = opf_e2m1_to_f32_impl((uint8_t)c);
    opf_fp8_decode_table(OPF_E4M3, e4);
    bool swz = (t->spec.flags & OPF_SPEC_SWIZZLED) != 0;
    const uint8_t *q = t->data[rowwise ? OPF_COMP_DATA : OPF_COMP_COL_DATA];
    const uint8_t *s = t->data[rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV];
    int64_t sc = L.comp[rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV].cols;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = q + r * (C / 2);
        for (int64_t j = 0; j < C / 16; j++) {
            size_t si = swz ? opf_swizzle_index(r, j, sc) : (size_t)(r * sc + j);
            float sf = e4[s[si]];
            for (int64_t c = j * 16; c < j * 16 + 16; c += 2) {
                uint8_t byte = row[c / 2];
                out[r * C + c] = fp4[byte & 15] * sf;
                out[r * C + c + 1] = fp4[byte >> 4] * sf;
            }
        }
    }
}

/* Fills *o for one operand. rowwise: the layout reads the rowwise copy, and
 * the logical 2D view is [idx, K]; else it reads the columnwise copy and the
 * view is [K, idx]. Copies of per-tensor FP8, block and NVFP4 are stored as
 * [idx, K] either way (columnwise copies are transposed, 4.2). */
static void prepare_operand(const opf_tensor *t, bool rowwise, int64_t idx, int64_t K, float *buf,
                            int nt, gemm_operand *o)
{
    memset(o, 0, sizeof *o);
    o->global = 1.0f;
    opf_scaling sc = t->spec.scaling;
    if (sc == OPF_SCALING_NONE || sc == OPF_SCALING_MXFP8) {
        int64_t R = rowwise ? idx : K, C = rowwise ? K : idx;
        o->ld = C;
        o->kmajor = rowwise;
        if (sc == OPF_SCALING_MXFP8)
            decode_mxfp8(t, rowwise, R, C, buf, nt);
        else if (t->spec.dtype != OPF_F32)
            decode_plain(t, R, C, buf, nt);
        o->p = sc == OPF_SCALING_NONE && t->spec.dtype == OPF_F32 ? t->data[OPF_COMP_DATA] : buf;
        return;
    }
    o->p = buf;
    o->ld = K;
    o->kmajor = true;
    const void *q = t->data[rowwise ? OPF_COMP_DATA : OPF_COMP_COL_DATA];
    const void *s = t->data[rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV];
    if (sc == OPF_SCALING_NVFP4_1D || sc == OPF_SCALING_NVFP4_2D) {
        decode_nvfp4(t, rowwise, idx, K, buf, nt);
        o->global = *(const float *)t->data[rowwise ? OPF_COMP_AMAX : OPF_COMP_COL_AMAX];
        return;
    }
    decode_fp8_raw(q, t->spec.qdtype, idx, K, buf, nt);
    if (sc == OPF_SCALING_TENSOR) {
        o->global = *(const float *)s;
        return;
    }
    opf_layout L;
    opf_spec_layout(&t->spec, &L);
    o->bscale = s;
    o->bscale_ld = L.comp[rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV].cols;
    o->bscale_2d = sc == OPF_SCALING_BLOCK_2D;
}

/* scale_inv of operand row i in K chunk kb. 1D grids are (kb, i), 2D grids
 * (i/128, kb), in both copies alike (4.2). */
static inline float block_scale(const gemm_operand *o, int64_t i, int64_t kb)
{
    return o->bscale_2d ? o->bscale[(i / CHUNK_K) * o->bscale_ld + kb]
                        : o->bscale[kb * o->bscale_ld + i];
}

/* ---- the products ---------------------------------------------------------- */

/* Tile edges from the shape alone, never the thread count, so the sums of
 * an element cannot depend on it. Large tiles keep OpenBLAS's repacking of
 * the operands low; an edge halves (down to TILE_MIN) while that adds tiles
 * and there are fewer than TILE_COUNT to share out. */
static void pick_tiles(int64_t M, int64_t N, int64_t max_m, int64_t max_n, int64_t *tm,
                       int64_t *tn)
{
    int64_t a = max_m, b = max_n;
    while (opf_ceil_div(M, a) * opf_ceil_div(N, b) < TILE_COUNT) {
        bool can_a = a > TILE_MIN && M > a / 2, can_b = b > TILE_MIN && N > b / 2;
        if (can_b && (b >= a || !can_a)) b /= 2;
        else if (can_a) a /= 2;
        else break;
    }
    *tm = a;
    *tn = b;
}

/* Y[m0.., n0..] = op(B) op(A)^T for one tile, one single-threaded sgemm. */
static void tile_sgemm(const gemm_operand *a, const gemm_operand *b, int64_t m0, int64_t mt,
                       int64_t n0, int64_t nt, int64_t k0, int64_t kt, float *y, int64_t ldy)
{
    const float *bp = b->kmajor ? b->p + m0 * b->ld + k0 : b->p + k0 * b->ld + m0;
    const float *ap = a->kmajor ? a->p + n0 * a->ld + k0 : a->p + k0 * a->ld + n0;
    cblas_sgemm(CblasRowMajor, b->kmajor ? CblasNoTrans : CblasTrans,
                a->kmajor ? CblasTrans : CblasNoTrans, (int)mt, (int)nt, (int)kt, 1.0f, bp,
                (int)b->ld, ap, (int)a->ld, 0.0f, y, (int)ldy);
}

/* Y [M, N] (row stride ldy) = sum over K, fixed TILE_M x TILE_N tiles. */
static void gemm_tiles(const gemm_operand *a, const gemm_operand *b, int64_t M, int64_t N,
                       int64_t K, float *y, int64_t ldy, int nthr)
{
    int64_t em, en;
    pick_tiles(M, N, TILE_M, TILE_N, &em, &en);
    int64_t tm = opf_ceil_div(M, em), tn = opf_ceil_div(N, en);
#pragma omp parallel for num_threads(nthr) schedule(dynamic, 1) if (nthr > 1)
    for (int64_t t = 0; t < tm * tn; t++) {
        int64_t m0 = t / tn * em, n0 = t % tn * en;
        int64_t mt = min64(em, M - m0), nt = min64(en, N - n0);
        float *yt = y + m0 * ldy + n0;
        if (K == 0) {
            for (int64_t i = 0; i < mt; i++) memset(yt + i * ldy, 0, (size_t)nt * sizeof(float));
            continue;
        }
        tile_sgemm(a, b, m0, mt, n0, nt, 0, K, yt, ldy);
    }
}

/* One chunk of 5.3's block rule on a row: y = fmaf(fl(p*sa), sb, y), or
 * y = fmaf(fl(p*sb), sa, y) when the row operand is 2D-scaled. */
#define CHUNK_FMA_BODY                                                                    \
    if (!a2d) {                                                                           \
        _Pragma("omp simd") for (int64_t j = 0; j < n; j++) y[j] = fmaf(p[j] * sa, sb[j], y[j]); \
    } else {                                                                              \
        _Pragma("omp simd") for (int64_t j = 0; j < n; j++) y[j] = fmaf(p[j] * sb[j], sa, y[j]); \
    }

static void chunk_fma_generic(float *restrict y, const float *restrict p,
                              const float *restrict sb, float sa, int64_t n, bool a2d)
{
    CHUNK_FMA_BODY
}

#if defined(__GNUC__) && defined(__x86_64__)
/* The same loop where the CPU has FMA: fmaf becomes a vector instruction
 * instead of a libm call; the result is the same correctly rounded fma. */
__attribute__((target("avx2,fma"))) static void chunk_fma_hw(float *restrict y,
                                                             const float *restrict p,
                                                             const float *restrict sb, float sa,
                                                             int64_t n, bool a2d)
{
    CHUNK_FMA_BODY
}
static bool have_fma(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
#define chunk_fma_hw chunk_fma_generic
static bool have_fma(void) { return false; }
#endif

typedef void (*chunk_fma_fn)(float *restrict, const float *restrict, const float *restrict, float,
                             int64_t, bool);

/* One BTILE tile of the block-scaled GEMM: y (row stride ldy) accumulates
 * every K chunk; scratch holds BTILE_M*BTILE_N + BTILE_N floats. */
static void block_tile(const gemm_operand *a, const gemm_operand *b, int64_t m0, int64_t mt,
                       int64_t n0, int64_t nt, int64_t K, float *y, int64_t ldy, float *scratch,
                       chunk_fma_fn fma_row)
{
    float *p = scratch, *sb = scratch + BTILE_M * BTILE_N;
    for (int64_t i = 0; i < mt; i++) memset(y + i * ldy, 0, (size_t)nt * sizeof(float));
    bool a2d = b->bscale_2d;  /* the row operand ("a" of 5.3) is B */
    for (int64_t kb = 0; kb * CHUNK_K < K; kb++) {
        int64_t k0 = kb * CHUNK_K, kt = min64(CHUNK_K, K - k0);
        tile_sgemm(a, b, m0, mt, n0, nt, k0, kt, p, nt);
        for (int64_t j = 0; j < nt; j++) sb[j] = block_scale(a, n0 + j, kb);
        for (int64_t i = 0; i < mt; i++)
            fma_row(y + i * ldy, p + i * nt, sb, block_scale(b, m0 + i, kb), nt, a2d);
    }
}

static void gemm_block(const gemm_operand *a, const gemm_operand *b, int64_t M, int64_t N,
                       int64_t K, float *y, int64_t ldy, float *scratch, int nthr)
{
    chunk_fma_fn fma_row = have_fma() ? chunk_fma_hw : chunk_fma_generic;
    int64_t em, en;
    pick_tiles(M, N, BTILE_M, BTILE_N, &em, &en);
    int64_t tm = opf_ceil_div(M, em), tn = opf_ceil_div(N, en);
    size_t per_thread = BTILE_M * BTILE_N + BTILE_N;
#pragma omp parallel for num_threads(nthr) schedule(dynamic, 1) if (nthr > 1)
    for (int64_t t = 0; t < tm * tn; t++) {
        int64_t m0 = t / tn * em, n0 = t % tn * en;
        float *s = scratch + (size_t)omp_get_thread_num() * per_thread;
        block_tile(a, b, m0, min64(em, M - m0), n0, min64(en, N - n0), K, y + m0 * ldy + n0,
                   ldy, s, fma_row);
    }
}

/* ---- epilogue ---------------------------------------------------------------- */

typedef struct epilogue {
    float       alpha;        /* applied when != 1 */
    const float *bias;        /* fp32 [N] or NULL */
    bool        accumulate;
    float       beta;
    bool        round_first;  /* block scaling: round to D's dtype before adding C */
    opf_dtype   dt;           /* D's dtype (f32 for an FP8 D: the fp32 result) */
} epilogue;

/* Rows go through the epilogue in pieces of this many elements, each step a
 * simple loop the compiler vectorizes. */
enum { EPI_CHUNK = 256 };

/* t[j] = RNE(t[j]) in dt, back in fp32. */
static void round_row(opf_dtype dt, float *restrict t, int64_t n)
{
    if (dt == OPF_BF16) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) t[j] = opf_bf16_to_f32_impl(opf_f32_to_bf16_impl(t[j]));
    } else if (dt == OPF_F16) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) t[j] = opf_f16_to_f32_impl(opf_f32_to_f16_impl(t[j]));
    }
}

/* out[i0 + j] = epilogue(y[j]) for a row of n elements; out may alias y. */
static void epilogue_row(const epilogue *e, const float *y, void *out, int64_t i0, int64_t n)
{
    float t[EPI_CHUNK], c[EPI_CHUNK];
    for (int64_t j0 = 0; j0 < n; j0 += EPI_CHUNK) {
        int64_t len = min64(EPI_CHUNK, n - j0);
        memcpy(t, y + j0, (size_t)len * sizeof(float));
        if (e->alpha != 1.0f) {
            float alpha = e->alpha;
#pragma omp simd
            for (int64_t j = 0; j < len; j++) t[j] = alpha * t[j];
        }
        if (e->bias) {
            const float *b = e->bias + j0;
#pragma omp simd
            for (int64_t j = 0; j < len; j++) t[j] = t[j] + b[j];
        }
        if (e->accumulate) {
            float beta = e->beta;
            opf_cpu_load_f32(out, e->dt, i0 + j0, len, c);
            if (e->round_first) round_row(e->dt, t, len);
#pragma omp simd
            for (int64_t j = 0; j < len; j++) t[j] = t[j] + beta * c[j];
        }
        opf_cpu_store_f32(t, e->dt, out, i0 + j0, len);
    }
}

static void run_epilogue(const epilogue *e, const float *y, void *out, int64_t M, int64_t N,
                         int nthr)
{
    if (e->alpha == 1.0f && !e->bias && !e->accumulate && e->dt == OPF_F32 && (void *)y == out)
        return;
#pragma omp parallel for num_threads(nthr) schedule(static) if (nthr > 1)
    for (int64_t i = 0; i < M; i++) epilogue_row(e, y + i * N, out, i * N, N);
}

/* ---- the kernel ------------------------------------------------------------ */

/* Workspace parts, in floats from the base; SIZE_MAX when absent. */
typedef struct ws_plan {
    size_t y, abuf, bbuf, bias, scratch, total;
} ws_plan;

static size_t ws_take(size_t *off, size_t n)
{
    size_t at = *off;
    *off += (n + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN;
    return at;
}

static bool needs_buffer(const opf_tensor *t)
{
    return t->spec.scaling != OPF_SCALING_NONE || t->spec.dtype != OPF_F32;
}

static float fold_alpha(const opf_gemm_args *g, const gemm_operand *a, const gemm_operand *b)
{
    float alpha = g->opts->alpha;
    switch (g->a->spec.scaling) {
    case OPF_SCALING_TENSOR: return alpha * (a->global * b->global);
    case OPF_SCALING_NVFP4_1D:
    case OPF_SCALING_NVFP4_2D:
        return ((alpha * a->global) * b->global) * opf_bits_f32(NVFP4_ALPHA_C_BITS);
    default: return alpha;
    }
}

/* The fp32 result goes straight into D when D is plain f32 and not read. */
static bool result_in_d(const opf_gemm_args *g)
{
    return !g->opts->out_quantizer && g->d->spec.dtype == OPF_F32 && !g->opts->accumulate;
}

static ws_plan plan_workspace(const opf_gemm_args *g, bool block, int nthr)
{
    size_t M = (size_t)g->m, N = (size_t)g->n, K = (size_t)g->k, off = 0;
    ws_plan w = {SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX, 0};
    if (!result_in_d(g)) w.y = ws_take(&off, M * N);
    if (needs_buffer(g->a)) w.abuf = ws_take(&off, N * K);
    if (needs_buffer(g->b)) w.bbuf = ws_take(&off, M * K);
    if (g->opts->bias) w.bias = ws_take(&off, N);
    if (block) w.scratch = ws_take(&off, (size_t)nthr * (BTILE_M * BTILE_N + BTILE_N));
    w.total = off;
    return w;
}

/* An FP8 D: the per-tensor quantize kernel on the fp32 result (5.3). y may
 * live in the workspace: that kernel takes no scratch from it. */
static opf_status quantize_output(opf_ctx *ctx, const opf_gemm_args *g, float *y)
{
    opf_tensor in;
    memset(&in, 0, sizeof in);
    in.spec = opf_spec_make(2, (int64_t[]){g->m, g->n}, OPF_F32);
    in.data[OPF_COMP_DATA] = y;
    opf_tensor out = *g->d;  /* same memory, viewed as quantized from fp32 */
    out.spec.dtype = OPF_F32;
    const opf_backend_i *be = opf_backend_get(OPF_DEVICE_CPU);
    opf_quantize_kernel qk = be ? be->quantize[OPF_SCALING_TENSOR] : NULL;
    if (!qk)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "gemm: no per-tensor FP8 quantize kernel for "
                         "the FP8 output");
    return qk(ctx, g->opts->out_quantizer, &in, &out, &g->out_state);
}

static void compute(const opf_gemm_args *g, float *base, const ws_plan *w, float *y, int nthr)
{
    bool a_row = g->layout == OPF_GEMM_TN, b_row = g->layout != OPF_GEMM_NT;  /* 5.1 */
    gemm_operand a, b;
    prepare_operand(g->a, a_row, g->n, g->k, w->abuf != SIZE_MAX ? base + w->abuf : NULL, nthr, &a);
    prepare_operand(g->b, b_row, g->m, g->k, w->bbuf != SIZE_MAX ? base + w->bbuf : NULL, nthr, &b);
    opf_scaling sc = g->a->spec.scaling;
    bool block = sc == OPF_SCALING_BLOCK_1D || sc == OPF_SCALING_BLOCK_2D;
    int prev = openblas_get_num_threads();
    if (prev != 1) openblas_set_num_threads(1);
    if (block)
        gemm_block(&a, &b, g->m, g->n, g->k, y, g->n, base + w->scratch, nthr);
    else
        gemm_tiles(&a, &b, g->m, g->n, g->k, y, g->n, nthr);
    if (prev != 1) openblas_set_num_threads(prev);

    const opf_gemm_options *o = g->opts;
    epilogue e = {fold_alpha(g, &a, &b), NULL, o->accumulate, o->beta, block,
                  o->out_quantizer ? OPF_F32 : g->d->spec.dtype};
    if (o->bias) {
        float *bias = base + w->bias;
        opf_cpu_load_f32(o->bias->data[OPF_COMP_DATA], o->bias->spec.dtype, 0, g->n, bias);
        e.bias = bias;
    }
    void *out = o->out_quantizer ? (void *)y : g->d->data[OPF_COMP_DATA];
    run_epilogue(&e, y, out, g->m, g->n, nthr);
}

opf_status opf_cpu_gemm(opf_ctx *ctx, const opf_gemm_args *g)
{
    if (g->m == 0 || g->n == 0)  /* nothing to sum; an FP8 D still gets its scale and amax */
        return g->opts->out_quantizer ? quantize_output(ctx, g, NULL) : OPF_OK;
    if (g->m > INT_MAX || g->n > INT_MAX || g->k > INT_MAX)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "gemm: M=%lld, N=%lld, K=%lld exceed the BLAS "
                         "int range", (long long)g->m, (long long)g->n, (long long)g->k);
    /* below ~2 MFLOP a parallel region costs more than it splits */
    int nthr = (double)g->m * (double)g->n * (double)g->k < GEMM_SERIAL_WORK ? 1 : num_threads(ctx);
    opf_scaling sc = g->a->spec.scaling;
    bool block = sc == OPF_SCALING_BLOCK_1D || sc == OPF_SCALING_BLOCK_2D;
    ws_plan w = plan_workspace(g, block, nthr);
    float *base = NULL;
    if (w.total) {
        opf_status st = opf_ctx_workspace_reserve(ctx, w.total * sizeof(float));
        if (st) return st;
        base = opf_ctx_workspace(ctx, w.total * sizeof(float));
    }
    float *y = result_in_d(g) ? (float *)g->d->data[OPF_COMP_DATA] : base + w.y;
    compute(g, base, &w, y, nthr);
    return g->opts->out_quantizer ? quantize_output(ctx, g, y) : OPF_OK;
}

/* The groups one after another: each is an independent GEMM with its own
 * workspace use, so the results are those of count single calls. */
opf_status opf_cpu_grouped_gemm(opf_ctx *ctx, int count, const opf_gemm_args *args)
{
    opf_status st = OPF_OK;
    for (int i = 0; i < count && !st; i++) st = opf_cpu_gemm(ctx, &args[i]);
    return st;
}
