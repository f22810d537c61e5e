/* quantize_block.c: FP8 block scaling on the CPU, docs/numerics.md 3.5 and
 * 4.2: 1D (1x128 blocks along rows; the columnwise copy is the transpose
 * with 1x128 blocks along its rows, computed independently from the input)
 * and 2D (128x128 tiles; the columnwise copy is the same bytes transposed,
 * with the transposed tile grid). One fp32 scale_inv per block. */
#include <omp.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/cpu/cpu-impl.h"
#include "backend/scale-math.h"
#include "core/core-impl.h"

enum {
    BLK = 128,         /* block edge */
    RUN = 512,         /* columns per rowwise run: short enough that loading a run and
                        * casting it overlap (2048 was 40% slower) */
    PANEL = 4096,      /* columns per work item of the columnwise and 2D passes (a
                        * multiple of BLK): whole rows of most tensors, which stream
                        * from memory fastest (2048 was 10-15% slower) */
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

/* Where the copies go; a NULL data pointer means the copy is not wanted.
 * 1D: rowwise sinv (kb, m) at kb*ld + m, columnwise (mb, k) at mb*cld + k.
 * 2D: rowwise sinv (mb, kb) at mb*ld + kb, columnwise (kb, mb) at kb*cld + mb. */
typedef struct block_out {
    uint8_t *q, *qt;
    float   *sinv, *csinv;
    int64_t  ld, cld;
} block_out;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline float block_scale(const block_args *a, float amax)
{
    return opf_scale_from_amax_impl(amax, a->fp8_max, a->pow2, a->eps, a->vinf);
}

/* 1D rowwise blocks of row m, columns [k0, k0 + n) (k0 a multiple of BLK),
 * from its fp32 values v, RUN columns at a time: the block amaxes, then
 * their scales in one vectorized loop, then one cast of the run with each
 * element's block scale (long loops rather than one short loop per block). */
static void row_blocks(const block_args *a, const block_out *o, int64_t m, int64_t k0, int64_t n,
                       const float *v)
{
    for (int64_t j0 = 0; j0 < n; j0 += RUN) {
        int64_t len = min64(RUN, n - j0), nb = opf_ceil_div(len, BLK);
        const float *vr = v + j0;
        float s[RUN / BLK], sinv[RUN / BLK], e[RUN];
        for (int64_t j = 0; j < nb; j++) {
            int64_t w = min64(BLK, len - j * BLK);
            s[j] = w == BLK ? opf_cpu_amax(vr + j * BLK, BLK) : opf_cpu_amax(vr + j * BLK, w);
        }
#pragma omp simd
        for (int64_t j = 0; j < nb; j++) {
            s[j] = block_scale(a, s[j]);
            sinv[j] = opf_block_scale_inv(s[j]);
        }
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < BLK; i++) e[j * BLK + i] = s[j];
        opf_cpu_fp8_cast_each(vr, e, len, a->qd, o->q + m * a->K + k0 + j0);
        for (int64_t j = 0; j < nb; j++) o->sinv[((k0 + j0) / BLK + j) * o->ld + m] = sinv[j];
    }
}

/* Casts rows [m0, m0 + rows) of the w columns at k0 with one scale per
 * column s[c] into the byte tile b (row stride BLK), and copies them into
 * the rowwise data when wanted. */
static void cast_rows(const block_args *a, const block_out *o, int64_t m0, int64_t rows,
                      int64_t k0, int64_t w, const float *s, bool to_q, uint8_t *b)
{
    float v[BLK];
    for (int64_t r = 0; r < rows; r++) {
        opf_cpu_load_f32(a->x, a->dt, (m0 + r) * a->K + k0, w, v);
        opf_cpu_fp8_cast_each(v, s, w, a->qd, b + r * BLK);
        if (to_q) memcpy(o->q + (m0 + r) * a->K + k0, b + r * BLK, (size_t)w);
    }
}

/* 1D rowwise only: one streaming pass, row by row. */
static void rowwise_1d(const block_args *a, const block_out *o, int nt)
{
    int64_t M = a->M, K = a->K;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float v[RUN];
        for (int64_t k0 = 0; k0 < K; k0 += RUN) {
            int64_t n = min64(RUN, K - k0);
            opf_cpu_load_f32(a->x, a->dt, m * K + k0, n, v);
            opf_cpu_prefetch(a->x, a->dt, m * K + k0 + n, RUN, M * K);
            row_blocks(a, o, m, k0, n, v);
        }
    }
}

/* The scales of one band of BLK rows from its column amaxes cm: 1D gives
 * every column its block scale; 2D gives every column the scale of its tile
 * (the amax of the tile's columns). Writes the columnwise (1D, 2D) and
 * rowwise (2D) scale_inv of the band. */
static void band_scales(const block_args *a, const block_out *o, bool two_d, int64_t mb,
                        int64_t k0, int64_t n, const int32_t *cm, float *s)
{
    if (!two_d) {
#pragma omp simd
        for (int64_t k = 0; k < n; k++) s[k] = block_scale(a, opf_bits_f32((uint32_t)cm[k]));
        for (int64_t k = 0; k < n; k++) o->csinv[mb * o->cld + k0 + k] = opf_block_scale_inv(s[k]);
        return;
    }
    for (int64_t j = 0; j < n; j += BLK) {
        int64_t w = min64(BLK, n - j), kb = (k0 + j) / BLK;
        int32_t tm = 0;
        for (int64_t k = 0; k < w; k++) tm = cm[j + k] > tm ? cm[j + k] : tm;
        float sc = block_scale(a, opf_bits_f32((uint32_t)tm));
        for (int64_t k = 0; k < w; k++) s[j + k] = sc;
        if (o->sinv) o->sinv[mb * o->ld + kb] = opf_block_scale_inv(sc);
        if (o->csinv) o->csinv[kb * o->cld + mb] = opf_block_scale_inv(sc);
    }
}

/* 1D with a columnwise copy, and 2D: work items of one band of BLK rows x
 * PANEL columns. A first pass streams the rows (1D rowwise blocks when
 * wanted, and the column amaxes); a second, over the same input now in
 * cache, casts BLK-column tiles with the column scales into the rowwise
 * data (2D) and transposed into the columnwise data. In 1D the two copies
 * are computed independently from the input (3.5); in 2D they are the same
 * bytes. Inline, and called with a constant two_d by each pass below, so
 * that its loops are compiled for each mode. */
static inline void band(const block_args *a, const block_out *o, bool two_d, int64_t t)
{
    int64_t M = a->M, K = a->K, np = opf_ceil_div(K, PANEL);
    int64_t mb = t / np, m0 = mb * BLK, k0 = t % np * PANEL;
    int64_t rows = min64(BLK, M - m0), n = min64(PANEL, K - k0);
    float v[PANEL], s[PANEL];
    int32_t cm[PANEL] = {0};
    uint8_t b[BLK * BLK];
    for (int64_t r = 0; r < rows; r++) {
        opf_cpu_load_f32(a->x, a->dt, (m0 + r) * K + k0, n, v);
        if (!two_d && o->q) row_blocks(a, o, m0 + r, k0, n, v);
#pragma omp simd
        for (int64_t k = 0; k < n; k++) {
            int32_t key = opf_cpu_amax_key(v[k]);
            cm[k] = key > cm[k] ? key : cm[k];
        }
    }
    band_scales(a, o, two_d, mb, k0, n, cm, s);
    for (int64_t j = 0; j < n; j += BLK) {
        int64_t w = min64(BLK, n - j);
        cast_rows(a, o, m0, rows, k0 + j, w, s + j, two_d && o->q, b);
        if (o->qt) opf_transpose_bytes(b, BLK, o->qt + (k0 + j) * M + m0, M, rows, w);
    }
}

static void bands_1d(const block_args *a, const block_out *o, int nt)
{
    int64_t items = opf_ceil_div(a->M, BLK) * opf_ceil_div(a->K, PANEL);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < items; t++) band(a, o, false, t);
}

static void bands_2d(const block_args *a, const block_out *o, int nt)
{
    int64_t items = opf_ceil_div(a->M, BLK) * opf_ceil_div(a->K, PANEL);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < items; t++) band(a, o, true, t);
}

opf_status opf_cpu_quantize_block(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                  opf_tensor *out, const opf_quantize_state *qs)
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
    int nt = opf_cpu_threads(ctx, L.m * L.k, PAR_MIN);
    bool row = out->spec.usage & OPF_USAGE_ROWWISE, col = out->spec.usage & OPF_USAGE_COLUMNWISE;
    block_out o = {
        .q = row ? out->data[OPF_COMP_DATA] : NULL,
        .qt = col ? out->data[OPF_COMP_COL_DATA] : NULL,
        .sinv = row ? out->data[OPF_COMP_SCALE_INV] : NULL,
        .csinv = col ? out->data[OPF_COMP_COL_SCALE_INV] : NULL,
        .ld = L.comp[OPF_COMP_SCALE_INV].cols,
        .cld = L.comp[OPF_COMP_COL_SCALE_INV].cols,
    };
    if (out->spec.scaling == OPF_SCALING_BLOCK_2D) bands_2d(&a, &o, nt);
    else if (col) bands_1d(&a, &o, nt);
    else rowwise_1d(&a, &o, nt);
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
    int nt = opf_cpu_threads(ctx, L.m * L.k, PAR_MIN);
    if (which == OPF_USAGE_COLUMNWISE) dequant_col(t, &L, lut, out, nt);
    else dequant_row(t, &L, lut, out, nt);
    return OPF_OK;
}
