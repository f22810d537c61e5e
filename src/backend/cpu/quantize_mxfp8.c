/* quantize_mxfp8.c: MXFP8 on the CPU, docs/numerics.md 3.3, 4.2-4.4.
 * Rowwise 1x32 and columnwise 32x1 blocks, computed independently from the
 * input (optionally one 32x32 amax driving both); both copies keep the
 * [M,K] shape; E8M0 scales, compact or GEMM-swizzled. */
#include <omp.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/cpu/cpu-impl.h"
#include "backend/scale-math.h"
#include "core/codec-impl.h"
#include "core/core-impl.h"

enum {
    MX = 32,           /* block edge */
    RUN = 512,         /* columns per run of the rowwise-only pass: short enough that
                        * loading a run and casting it overlap */
    PANEL = 4096,      /* columns per work item of the other passes (a multiple of MX):
                        * whole rows of most tensors, which stream from memory fastest */
    COLW = 64,         /* columns per work item of the columnwise dequantization */
    PAR_MIN = 1 << 15, /* below this many elements one thread is faster */
};

/* Where the scales go: compact row-major or swizzled (4.3, 4.4). */
typedef struct mx_scales {
    uint8_t *row;     /* [roundup(M,128)][ld_row] compact; NULL when absent */
    uint8_t *col;     /* [roundup(M/32,4)][ld_col] compact; NULL when absent */
    int64_t  ld_row;  /* roundup(K/32, 4) */
    int64_t  ld_col;  /* roundup(K, 128) */
    int64_t  c_col;   /* roundup(M/32, 4): swizzle C of the transposed view */
    bool     swizzled;
} mx_scales;

typedef struct mx_args {
    const void *x;
    opf_dtype   dt;
    int64_t     M, K;
    opf_dtype   qd;
    float       rcp;  /* fl32(1/fp8_max) */
    uint8_t    *qr, *qc;  /* rowwise / columnwise data, NULL when absent */
} mx_args;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Index of the rowwise scale of (row m, block kb) and of the columnwise
 * scale of (row block yb, column k); the columnwise swizzle works on the
 * transposed view (4.4). */
static inline size_t row_idx(const mx_scales *S, int64_t m, int64_t kb)
{
    return S->swizzled ? opf_cpu_swizzle_index(m, kb, S->ld_row) : (size_t)(m * S->ld_row + kb);
}
static inline size_t col_idx(const mx_scales *S, int64_t yb, int64_t k)
{
    return S->swizzled ? opf_cpu_swizzle_index(k, yb, S->c_col) : (size_t)(yb * S->ld_col + k);
}

/* 3.3 steps 3-4: E = float_to_e8m0(fl(A * R)). */
static inline uint8_t block_exp(float rcp, float amax)
{
    return opf_f32_to_e8m0_impl(amax * rcp);
}

/* 1.4: the encode multiplier 2^(127-E) built from bits; E=254 -> 2^-127,
 * E=255 -> NaN. Selects only, so that loops over blocks vectorize. */
static inline float exp_mult(uint8_t e)
{
    uint32_t b = (uint32_t)(254 - e) << 23;
    b = e == 254 ? 0x00400000u : b;
    b = e == 255 ? OPF_F32_QNAN_BITS : b;
    return opf_bits_f32(b);
}

/* Rowwise blocks of row m, columns [k0, k0 + n) (n a multiple of MX), from
 * its fp32 values v: the block exponents first, then one cast of the whole
 * run with each element's block multiplier (long vectorized loops rather
 * than one short loop per block). */
static void row_blocks(const mx_args *a, const mx_scales *S, int64_t m, int64_t k0, int64_t n,
                       const float *v)
{
    uint8_t e[PANEL / MX];
    float am[PANEL / MX], mult[PANEL / MX], s[PANEL];
    int64_t nb = n / MX;
    for (int64_t j = 0; j < nb; j++) am[j] = opf_cpu_amax(v + j * MX, MX);
#pragma omp simd
    for (int64_t j = 0; j < nb; j++) {
        e[j] = block_exp(a->rcp, am[j]);
        mult[j] = exp_mult(e[j]);
    }
    for (int64_t j = 0; j < nb; j++)
        for (int64_t i = 0; i < MX; i++) s[j * MX + i] = mult[j];
    opf_cpu_fp8_cast_each(v, s, n, a->qd, a->qr + m * a->K + k0);
    for (int64_t j = 0; j < nb; j++) S->row[row_idx(S, m, k0 / MX + j)] = e[j];
}

/* Rowwise only: one streaming pass, row by row. */
static void rowwise(const mx_args *a, const mx_scales *S, int nt)
{
    int64_t M = a->M, K = a->K;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float v[RUN];
        for (int64_t k0 = 0; k0 < K; k0 += RUN) {
            int64_t n = min64(RUN, K - k0);
            opf_cpu_load_f32(a->x, a->dt, m * K + k0, n, v);
            opf_cpu_prefetch(a->x, a->dt, m * K + k0 + n, RUN, M * K);
            row_blocks(a, S, m, k0, n, v);
        }
    }
}

/* The multipliers of one band of MX rows from its column amaxes cm, and
 * its scales: 1D columnwise blocks give every column its own (columnwise
 * scales); 2D tiles give every column the exponent of its tile, the amax of
 * the tile's columns (both copies' scales). */
static void band_scales(const mx_args *a, const mx_scales *S, bool two_d, int64_t yb,
                        int64_t k0, int64_t n, const int32_t *cm, float *mult)
{
    int64_t m0 = yb * MX;
    uint8_t e[PANEL];
    if (!two_d) {
#pragma omp simd
        for (int64_t k = 0; k < n; k++) {
            e[k] = block_exp(a->rcp, opf_bits_f32((uint32_t)cm[k]));
            mult[k] = exp_mult(e[k]);
        }
        for (int64_t k = 0; k < n; k++) S->col[col_idx(S, yb, k0 + k)] = e[k];
        return;
    }
    for (int64_t j = 0; j < n; j += MX) {
        int32_t tm = 0;
        for (int64_t k = 0; k < MX; k++) tm = cm[j + k] > tm ? cm[j + k] : tm;
        uint8_t et = block_exp(a->rcp, opf_bits_f32((uint32_t)tm));
        for (int64_t k = 0; k < MX; k++) mult[j + k] = exp_mult(et);
        for (int64_t i = 0; S->row && i < MX; i++) S->row[row_idx(S, m0 + i, (k0 + j) / MX)] = et;
        for (int64_t k = 0; S->col && k < MX; k++) S->col[col_idx(S, yb, k0 + j + k)] = et;
    }
}

/* With a columnwise copy (32x1 blocks, same [M, K] layout), and 32x32
 * tiles: work items of one band of MX rows x PANEL columns. A first pass
 * streams the rows (1D rowwise blocks when wanted, and the column amaxes);
 * a second casts the same rows, now in cache, with the column multipliers:
 * into the columnwise copy (1D, computed independently from the input), or
 * into both copies, which then hold the same bytes (2D). Inline, and called
 * with a constant two_d by each pass below, so that its loops are compiled
 * for each mode. */
static inline void band(const mx_args *a, const mx_scales *S, bool two_d, int64_t t)
{
    int64_t K = a->K, np = opf_ceil_div(K, PANEL);
    int64_t yb = t / np, m0 = yb * MX, k0 = t % np * PANEL, n = min64(PANEL, K - k0);
    float v[PANEL], mult[PANEL];
    int32_t cm[PANEL] = {0};
    for (int64_t r = 0; r < MX; r++) {
        opf_cpu_load_f32(a->x, a->dt, (m0 + r) * K + k0, n, v);
        if (!two_d && a->qr) row_blocks(a, S, m0 + r, k0, n, v);
#pragma omp simd
        for (int64_t k = 0; k < n; k++) {
            int32_t key = opf_cpu_amax_key(v[k]);
            cm[k] = key > cm[k] ? key : cm[k];
        }
    }
    band_scales(a, S, two_d, yb, k0, n, cm, mult);
    for (int64_t r = 0; r < MX; r++) {
        uint8_t *dst = two_d && a->qr ? a->qr : a->qc, *row = dst + (m0 + r) * K + k0;
        opf_cpu_load_f32(a->x, a->dt, (m0 + r) * K + k0, n, v);
        opf_cpu_fp8_cast_each(v, mult, n, a->qd, row);
        if (two_d && a->qr && a->qc) memcpy(a->qc + (m0 + r) * K + k0, row, (size_t)n);
    }
}

static void colwise(const mx_args *a, const mx_scales *S, int nt)
{
    int64_t items = a->M / MX * opf_ceil_div(a->K, PANEL);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < items; t++) band(a, S, false, t);
}

static void tiles_2d(const mx_args *a, const mx_scales *S, int nt)
{
    int64_t items = a->M / MX * opf_ceil_div(a->K, PANEL);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < items; t++) band(a, S, true, t);
}

static void scales_of(const opf_tensor *t, const opf_layout *L, mx_scales *S)
{
    bool row = t->spec.usage & OPF_USAGE_ROWWISE, col = t->spec.usage & OPF_USAGE_COLUMNWISE;
    S->row = row ? t->data[OPF_COMP_SCALE_INV] : NULL;
    S->col = col ? t->data[OPF_COMP_COL_SCALE_INV] : NULL;
    S->ld_row = L->comp[OPF_COMP_SCALE_INV].cols;
    S->ld_col = L->comp[OPF_COMP_COL_SCALE_INV].cols;
    S->c_col = L->comp[OPF_COMP_COL_SCALE_INV].rows;
    S->swizzled = (t->spec.flags & OPF_SPEC_SWIZZLED) != 0;
}

opf_status opf_cpu_quantize_mxfp8(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                  opf_tensor *out, const opf_quantize_state *qs)
{
    opf_layout L;
    opf_status st = opf_spec_layout(&out->spec, &L);
    if (st) return opf_error(ctx, st, "quantize (mxfp8): %s", opf_last_error(NULL));
    mx_scales S;
    scales_of(out, &L, &S);
    /* 3.3 step 3: multiply by the rounded reciprocal 0x3B124925 / 0x37924925. */
    mx_args a = {
        .x = in->data[OPF_COMP_DATA], .dt = in->spec.dtype, .M = L.m, .K = L.k,
        .qd = out->spec.qdtype, .rcp = 1.0f / opf_fp8_max(out->spec.qdtype),
        .qr = S.row ? out->data[OPF_COMP_DATA] : NULL,
        .qc = S.col ? out->data[OPF_COMP_COL_DATA] : NULL,
    };
    int nt = opf_cpu_threads(ctx, L.m * L.k, PAR_MIN);
    if (q->mxfp8_2d || (out->spec.flags & OPF_SPEC_MXFP8_2D)) tiles_2d(&a, &S, nt);
    else if (a.qc) colwise(&a, &S, nt);
    else rowwise(&a, &S, nt);
    return OPF_OK;
}

opf_status opf_cpu_dequantize_mxfp8(opf_ctx *ctx, const opf_tensor *t, unsigned which, float *out)
{
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    if (st) return opf_error(ctx, st, "dequantize (mxfp8): %s", opf_last_error(NULL));
    mx_scales S;
    scales_of(t, &L, &S);
    float lut[256], pow2[256];
    opf_fp8_decode_table(t->spec.qdtype, lut);
    for (int e = 0; e < 256; e++) pow2[e] = opf_e8m0_to_f32_impl((uint8_t)e);
    int64_t M = L.m, K = L.k;
    int nt = opf_cpu_threads(ctx, M * K, PAR_MIN);
    if (which == OPF_USAGE_ROWWISE) {
        const uint8_t *q = t->data[OPF_COMP_DATA];
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t kb = 0; kb < K / MX; kb++) {
                float s = pow2[S.row[row_idx(&S, m, kb)]];
                for (int64_t i = kb * MX; i < kb * MX + MX; i++)
                    out[m * K + i] = lut[q[m * K + i]] * s;
            }
        return OPF_OK;
    }
    const uint8_t *q = t->data[OPF_COMP_COL_DATA];
    int64_t nkc = opf_ceil_div(K, COLW);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t tt = 0; tt < M / MX * nkc; tt++) {
        int64_t yb = tt / nkc, k0 = tt % nkc * COLW, cols = min64(COLW, K - k0);
        float s[COLW];
        for (int64_t c = 0; c < cols; c++) s[c] = pow2[S.col[col_idx(&S, yb, k0 + c)]];
        for (int64_t m = yb * MX; m < yb * MX + MX; m++)
            for (int64_t c = 0; c < cols; c++) out[m * K + k0 + c] = lut[q[m * K + k0 + c]] * s[c];
    }
    return OPF_OK;
}
