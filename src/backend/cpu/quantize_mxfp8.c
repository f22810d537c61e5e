/* quantize_mxfp8.c: MXFP8 on the CPU, docs/numerics.md 3.3, 4.2-4.4.
 * Rowwise 1x32 and columnwise 32x1 blocks, computed independently from the
 * input (optionally one 32x32 amax driving both); both copies keep the
 * [M,K] shape; E8M0 scales, compact or GEMM-swizzled. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/cpu/cpu-impl.h"
#include "core/codec-impl.h"
#include "core/core-impl.h"
#include "quant/scale-impl.h"

enum {
    MX = 32,           /* block edge */
    COLW = 64,         /* columns per work item of the columnwise passes */
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
} mx_args;

static int nthreads(opf_ctx *ctx, int64_t n)
{
    int t = ctx ? opf_ctx_num_threads(ctx) : 0;
    if (n < PAR_MIN) return 1;
    return t > 0 ? t : omp_get_max_threads();
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Index of the rowwise scale of (row m, block kb) and of the columnwise
 * scale of (row block yb, column k); the columnwise swizzle works on the
 * transposed view (4.4). */
static inline size_t row_idx(const mx_scales *S, int64_t m, int64_t kb)
{
    return S->swizzled ? opf_swizzle_index(m, kb, S->ld_row) : (size_t)(m * S->ld_row + kb);
}
static inline size_t col_idx(const mx_scales *S, int64_t yb, int64_t k)
{
    return S->swizzled ? opf_swizzle_index(k, yb, S->c_col) : (size_t)(yb * S->ld_col + k);
}

/* 3.3 steps 3-4: E = float_to_e8m0(fl(A * R)). */
static inline uint8_t block_exp(const mx_args *a, float amax)
{
    return opf_f32_to_e8m0_impl(amax * a->rcp);
}

/* 1.4: the encode multiplier 2^(127-E) built from bits; E=254 -> 2^-127. */
static inline float exp_mult(uint8_t e)
{
    if (e == 255) return opf_bits_f32(0x7FC00000u);
    if (e == 254) return opf_bits_f32(0x00400000u);
    return opf_bits_f32((uint32_t)(254 - e) << 23);
}

static void rowwise(const mx_args *a, uint8_t *q, const mx_scales *S, int nt)
{
    int64_t M = a->M, K = a->K, nkb = K / MX;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float v[MX];
        for (int64_t kb = 0; kb < nkb; kb++) {
            opf_cpu_load_f32(a->x, a->dt, m * K + kb * MX, MX, v);
            uint8_t e = block_exp(a, opf_cpu_amax(v, MX));
            opf_fp8_scale_cast(v, MX, exp_mult(e), a->qd, q + m * K + kb * MX);
            S->row[row_idx(S, m, kb)] = e;
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

/* 32x1 blocks: each work item takes 32 rows x up to COLW columns. */
static void colwise(const mx_args *a, uint8_t *q, const mx_scales *S, int nt)
{
    int64_t M = a->M, K = a->K, nyb = M / MX, nkc = opf_ceil_div(K, COLW);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < nyb * nkc; t++) {
        int64_t yb = t / nkc, m0 = yb * MX, k0 = t % nkc * COLW, cols = min64(COLW, K - k0);
        float tile[MX][COLW], amax[COLW], mult[COLW];
        for (int64_t r = 0; r < MX; r++) opf_cpu_load_f32(a->x, a->dt, (m0 + r) * K + k0, cols, tile[r]);
        column_amax(tile, MX, cols, amax);
        for (int64_t c = 0; c < cols; c++) {
            uint8_t e = block_exp(a, amax[c]);
            mult[c] = exp_mult(e);
            S->col[col_idx(S, yb, k0 + c)] = e;
        }
        for (int64_t r = 0; r < MX; r++)
            opf_fp8_scale_cast_each(tile[r], mult, cols, a->qd, q + (m0 + r) * K + k0);
    }
}

/* 32x32 blocks: one amax per tile drives both copies, which get the same
 * bytes; either data pointer may be NULL. */
static void tiles_2d(const mx_args *a, uint8_t *qr, uint8_t *qc, const mx_scales *S, int nt)
{
    int64_t M = a->M, K = a->K, nyb = M / MX, nkb = K / MX;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < nyb * nkb; t++) {
        int64_t yb = t / nkb, kb = t % nkb, m0 = yb * MX, k0 = kb * MX;
        float tile[MX][MX], amax = 0.0f;
        for (int64_t r = 0; r < MX; r++) {
            opf_cpu_load_f32(a->x, a->dt, (m0 + r) * K + k0, MX, tile[r]);
            float ar = opf_cpu_amax(tile[r], MX);
            amax = ar > amax ? ar : amax;
        }
        uint8_t e = block_exp(a, amax);
        float mult = exp_mult(e);
        for (int64_t r = 0; r < MX; r++) {
            uint8_t b[MX];
            opf_fp8_scale_cast(tile[r], MX, mult, a->qd, b);
            if (qr) memcpy(qr + (m0 + r) * K + k0, b, MX);
            if (qc) memcpy(qc + (m0 + r) * K + k0, b, MX);
        }
        for (int64_t i = 0; i < MX; i++) {
            if (S->row) S->row[row_idx(S, m0 + i, kb)] = e;
            if (S->col) S->col[col_idx(S, yb, k0 + i)] = e;
        }
    }
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
                                  opf_tensor *out, uint64_t rng_seed, uint64_t rng_offset)
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
    };
    int nt = nthreads(ctx, L.m * L.k);
    uint8_t *qr = S.row ? out->data[OPF_COMP_DATA] : NULL;
    uint8_t *qc = S.col ? out->data[OPF_COMP_COL_DATA] : NULL;
    if (q->mxfp8_2d || (out->spec.flags & OPF_SPEC_MXFP8_2D)) {
        tiles_2d(&a, qr, qc, &S, nt);
        return OPF_OK;
    }
    if (qr) rowwise(&a, qr, &S, nt);
    if (qc) colwise(&a, qc, &S, nt);
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
    int nt = nthreads(ctx, M * K);
    if (which == OPF_USAGE_ROWWISE) {
        const uint8_t *q = t->data[OPF_COMP_DATA];
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t kb = 0; kb < K / MX; kb++) {
                float s = pow2[S.row[row_idx(&S, m, kb)]];
                for (int64_t i = kb * MX; i < kb * MX + MX; i++) out[m * K + i] = lut[q[m * K + i]] * s;
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
