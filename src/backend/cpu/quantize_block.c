/* quantize_block.c: FP8 block scaling on the CPU, docs/numerics.md 3.5 and
 * 4.2: 1D (1x128 blocks along rows; the columnwise copy is the transpose
 * with 1x128 blocks along its rows, computed independently from the input)
 * and 2D (128x128 tiles; the columnwise copy is the same bytes transposed,
 * with the transposed tile grid). One fp32 scale_inv per block. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/cpu/cpu-impl.h"
#include "core/core-impl.h"
#include "quant/scale-impl.h"

enum {
    BLK = 128,         /* block edge */
    COLW = 32,         /* columns per work item of the 1D columnwise pass */
    TILE = 64,         /* transpose tile edge for dequantization */
    PAR_MIN = 1 << 15, /* below this many elements one thread is faster */
};

/* What every block needs to compute its scale and cast (2.1, 3.5). */
typedef struct block_args {
    const void *x;
    opf_dtype   dt;        /* input dtype */
    int64_t     M, K;
    float       fp8_max;
    bool        pow2;
    float       eps;
    float       vinf;      /* value_for_inf: max finite of the input dtype */
    opf_dtype   qd;
} block_args;

static int nthreads(opf_ctx *ctx, int64_t n)
{
    int t = ctx ? opf_ctx_num_threads(ctx) : 0;
    if (n < PAR_MIN) return 1;
    return t > 0 ? t : omp_get_max_threads();
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Scales v[0..n) of one block: writes the bytes and returns scale_inv. */
static float cast_block(const block_args *a, const float *v, int64_t n, uint8_t *q)
{
    float s = opf_scale_from_amax(opf_cpu_amax(v, n), a->fp8_max, a->pow2, a->eps, a->vinf);
    opf_fp8_scale_cast(v, n, s, a->qd, q);
    return opf_block_scale_inv(s);
}

/* 1D rowwise: q [M,K], sinv element (kb, m) at kb*ld + m. */
static void rowwise_1d(const block_args *a, uint8_t *q, float *sinv, int64_t ld, int nt)
{
    int64_t M = a->M, K = a->K, nkb = opf_ceil_div(K, BLK);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float v[BLK];
        for (int64_t kb = 0; kb < nkb; kb++) {
            int64_t k0 = kb * BLK, n = min64(BLK, K - k0);
            opf_cpu_load_f32(a->x, a->dt, m * K + k0, n, v);
            sinv[kb * ld + m] = cast_block(a, v, n, q + m * K + k0);
        }
    }
}

/* Column amaxes of a rows x cols tile (NaN ignored), vertically so that the
 * loop runs along the contiguous columns. */
static void column_amax(float (*tile)[COLW], int64_t rows, int64_t cols, float *amax)
{
    for (int64_t c = 0; c < cols; c++) amax[c] = 0.0f;
    for (int64_t r = 0; r < rows; r++)
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) {
            float v = fabsf(tile[r][c]);
            amax[c] = v > amax[c] ? v : amax[c];  /* false for NaN */
        }
}

/* Writes the rows x cols byte tile b transposed into qt [K,M] at (k0, m0). */
static void put_transposed(uint8_t (*b)[COLW], int64_t rows, int64_t cols, uint8_t *qt,
                           int64_t M, int64_t m0, int64_t k0)
{
    for (int64_t c = 0; c < cols; c++)
        for (int64_t r = 0; r < rows; r++) qt[(k0 + c) * M + m0 + r] = b[r][c];
}

/* 1D columnwise: qt [K,M] (the transpose) with 1x128 blocks along its rows,
 * i.e. 128x1 blocks of the input; sinv element (mb, k) at mb*ld + k. Each
 * work item takes up to 128 rows x COLW columns. */
static void colwise_1d(const block_args *a, uint8_t *qt, float *sinv, int64_t ld, int nt)
{
    int64_t M = a->M, K = a->K, nmb = opf_ceil_div(M, BLK), nkc = opf_ceil_div(K, COLW);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < nmb * nkc; t++) {
        int64_t mb = t / nkc, m0 = mb * BLK, k0 = t % nkc * COLW;
        int64_t rows = min64(BLK, M - m0), cols = min64(COLW, K - k0);
        float tile[BLK][COLW], amax[COLW], s[COLW];
        uint8_t b[BLK][COLW];
        for (int64_t r = 0; r < rows; r++)
            opf_cpu_load_f32(a->x, a->dt, (m0 + r) * K + k0, cols, tile[r]);
        column_amax(tile, rows, cols, amax);
        for (int64_t c = 0; c < cols; c++) {
            s[c] = opf_scale_from_amax(amax[c], a->fp8_max, a->pow2, a->eps, a->vinf);
            sinv[mb * ld + k0 + c] = opf_block_scale_inv(s[c]);
        }
        for (int64_t r = 0; r < rows; r++) opf_fp8_scale_cast_each(tile[r], s, cols, a->qd, b[r]);
        put_transposed(b, rows, cols, qt, M, m0, k0);
    }
}

/* 2D: one scale per 128x128 tile (valid elements only). q [M,K] with sinv
 * (mb, kb) at mb*ld + kb; qt [K,M] with csinv (kb, mb) at kb*cld + mb.
 * Either output may be NULL. The tile is read twice (amax, then cast) in
 * strips of COLW columns, which stay in cache. */
static void tiles_2d(const block_args *a, uint8_t *q, float *sinv, int64_t ld, uint8_t *qt,
                     float *csinv, int64_t cld, int nt)
{
    int64_t M = a->M, K = a->K, nmb = opf_ceil_div(M, BLK), nkb = opf_ceil_div(K, BLK);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < nmb * nkb; t++) {
        int64_t mb = t / nkb, kb = t % nkb, m0 = mb * BLK, k0 = kb * BLK;
        int64_t rows = min64(BLK, M - m0), cols = min64(BLK, K - k0);
        float v[BLK], amax = 0.0f;
        for (int64_t r = 0; r < rows; r++) {
            opf_cpu_load_f32(a->x, a->dt, (m0 + r) * K + k0, cols, v);
            float ar = opf_cpu_amax(v, cols);
            amax = ar > amax ? ar : amax;
        }
        float s = opf_scale_from_amax(amax, a->fp8_max, a->pow2, a->eps, a->vinf);
        for (int64_t c0 = 0; c0 < cols; c0 += COLW) {
            int64_t w = min64(COLW, cols - c0);
            uint8_t b[BLK][COLW];
            for (int64_t r = 0; r < rows; r++) {
                opf_cpu_load_f32(a->x, a->dt, (m0 + r) * K + k0 + c0, w, v);
                opf_fp8_scale_cast(v, w, s, a->qd, b[r]);
                if (q) memcpy(q + (m0 + r) * K + k0 + c0, b[r], (size_t)w);
            }
            if (qt) put_transposed(b, rows, w, qt, M, m0, k0 + c0);
        }
        if (sinv) sinv[mb * ld + kb] = opf_block_scale_inv(s);
        if (csinv) csinv[kb * cld + mb] = opf_block_scale_inv(s);
    }
}

opf_status opf_cpu_quantize_block(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                  opf_tensor *out, uint64_t rng_seed, uint64_t rng_offset)
{
    opf_layout L;
    opf_status st = opf_spec_layout(&out->spec, &L);
    if (st) return opf_error(ctx, st, "quantize (fp8 block): %s", opf_last_error(NULL));
    block_args a = {
        .x = in->data[OPF_COMP_DATA], .dt = in->spec.dtype, .M = L.m, .K = L.k,
        .fp8_max = opf_fp8_max(out->spec.qdtype), .pow2 = q->pow2_scales,
        .eps = q->amax_epsilon, .vinf = opf_input_max_finite(in->spec.dtype),
        .qd = out->spec.qdtype,
    };
    int nt = nthreads(ctx, L.m * L.k);
    bool row = out->spec.usage & OPF_USAGE_ROWWISE, col = out->spec.usage & OPF_USAGE_COLUMNWISE;
    uint8_t *qr = row ? out->data[OPF_COMP_DATA] : NULL;
    uint8_t *qc = col ? out->data[OPF_COMP_COL_DATA] : NULL;
    float *sr = row ? out->data[OPF_COMP_SCALE_INV] : NULL;
    float *sc = col ? out->data[OPF_COMP_COL_SCALE_INV] : NULL;
    int64_t ldr = L.comp[OPF_COMP_SCALE_INV].cols, ldc = L.comp[OPF_COMP_COL_SCALE_INV].cols;
    if (out->spec.scaling == OPF_SCALING_BLOCK_2D) {
        tiles_2d(&a, qr, sr, ldr, qc, sc, ldc, nt);
        return OPF_OK;
    }
    if (row) rowwise_1d(&a, qr, sr, ldr, nt);
    if (col) colwise_1d(&a, qc, sc, ldc, nt);
    return OPF_OK;
}

/* Rowwise decode: out[m,k] = fl(q[m,k] * scale_inv of its block). */
static void dequant_row(const opf_tensor *t, const opf_layout *L, const float *lut, float *out,
                        int nt)
{
    const uint8_t *q = t->data[OPF_COMP_DATA];
    const float *s = t->data[OPF_COMP_SCALE_INV];
    int64_t M = L->m, K = L->k, ld = L->comp[OPF_COMP_SCALE_INV].cols;
    bool two_d = t->spec.scaling == OPF_SCALING_BLOCK_2D;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            float si = two_d ? s[m / BLK * ld + k / BLK] : s[k / BLK * ld + m];
            out[m * K + k] = lut[q[m * K + k]] * si;
        }
}

/* Columnwise decode of qt [K,M], transposed back tile by tile. */
static void dequant_col(const opf_tensor *t, const opf_layout *L, const float *lut, float *out,
                        int nt)
{
    const uint8_t *qt = t->data[OPF_COMP_COL_DATA];
    const float *s = t->data[OPF_COMP_COL_SCALE_INV];
    int64_t M = L->m, K = L->k, ld = L->comp[OPF_COMP_COL_SCALE_INV].cols;
    int64_t tm = opf_ceil_div(M, TILE), tk = opf_ceil_div(K, TILE);
    bool two_d = t->spec.scaling == OPF_SCALING_BLOCK_2D;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t tt = 0; tt < tm * tk; tt++) {
        int64_t m0 = tt / tk * TILE, k0 = tt % tk * TILE;
        int64_t m1 = min64(m0 + TILE, M), k1 = min64(k0 + TILE, K);
        for (int64_t m = m0; m < m1; m++)
            for (int64_t k = k0; k < k1; k++) {
                float si = two_d ? s[k / BLK * ld + m / BLK] : s[m / BLK * ld + k];
                out[m * K + k] = lut[qt[k * M + m]] * si;
            }
    }
}

opf_status opf_cpu_dequantize_block(opf_ctx *ctx, const opf_tensor *t, unsigned which, float *out)
{
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    if (st) return opf_error(ctx, st, "dequantize (fp8 block): %s", opf_last_error(NULL));
    float lut[256];
    opf_fp8_decode_table(t->spec.qdtype, lut);
    int nt = nthreads(ctx, L.m * L.k);
    if (which == OPF_USAGE_COLUMNWISE) dequant_col(t, &L, lut, out, nt);
    else dequant_row(t, &L, lut, out, nt);
    return OPF_OK;
}
