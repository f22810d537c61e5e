/* quantize_nvfp4.c: the CPU reference NVFP4 quantizer and decoder
 * (docs/numerics.md 3.4.1-3.4.5, layouts 4.2 and 4.4).
 *
 * Copies. The rowwise copy quantizes x [M, K] in 1x16 blocks along K. The
 * columnwise copy is stored transposed, [K, M], in 1x16 blocks along M; with
 * q->rht every such block is first rounded to bf16 (exact for bf16 inputs;
 * the anchor only accepts bf16) and rotated as opf_rht16 does. In 2D mode
 * every 16x16 tile is quantized once and both copies hold the same codes.
 *
 * Passes. The rowwise copy alone streams row by row. Anything else runs
 * over groups of 16 rows, column panel by column panel: the group's input is
 * loaded once (giving the rowwise blocks of its rows too), rotated when RHT
 * is on, scaled per column (1D columnwise blocks, or 16x16 tiles), cast, and
 * its columnwise codes are packed two rows per byte and transposed into
 * [K, M/2] for 8 groups at a time. With RHT a first pass over the groups
 * gives both global amaxes (A_col needs the rotated values), so the
 * transform runs twice per element.
 *
 * Stochastic rounding (3.4.5), our Philox mapping, to be reproduced by the
 * CUDA kernel: for the stored element e of a copy (row-major index inside
 * that copy's [rows, cols] data) the 16-element group b = e / 16 draws
 *     counter = {lo32(off + b), hi32(off + b), copy_id, 0},
 *     key     = {lo32(seed), hi32(seed)},   out = Philox4x32-10(counter, key)
 * with copy_id 0 for the rowwise copy and 1 for the columnwise copy, and
 * element e uses byte e % 4 (little-endian) of word (e % 16) / 4, u = r8/256.
 * b stays below ceil(M*K/16), the counters the dispatcher reserves per copy.
 * 2D tiles are drawn once with the rowwise indices and copy_id 0, so the two
 * copies stay identical.
 *
 * Amaxes: AMAX always holds A_row; COL_AMAX holds A_col, the amax of the
 * rotated values when the columnwise copy exists and is rotated, else A_row.
 * q->amax_reduce (if set) sees {A_row} or {A_row, A_col} (rotated copy)
 * before anything is written.
 *
 * Every element is computed independently and amaxes are maxima, so the bytes
 * do not depend on the OpenMP thread count. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <omp.h>

#include "backend/backend-impl.h"
#include "backend/cpu/cpu-impl.h"
#include "backend/scale-math.h"
#include "core/codec-impl.h"
#include "core/core-impl.h"

#define NVFP4_BLOCK 16
#define NVFP4_PAR_MIN (1 << 14)

static const char *const kFn = "opf_quantize(nvfp4)";

/* Global encode/decode scales of one copy (3.4.1). */
typedef struct nvfp4_global {
    float enc;       /* S_enc */
    float dec;       /* S_dec = fl(1/S_enc) */
    float enc_div6;  /* fl(S_enc * fl32(1/6)), the first factor of 3.4.2 step 2 */
} nvfp4_global;

/* Where one copy goes and how it rounds. */
typedef struct nvfp4_dst {
    uint8_t     *data;        /* packed e2m1 [rows, cols] */
    uint8_t     *scale;       /* e4m3 [scale_rows, scale_cols], compact or swizzled */
    int64_t      cols;        /* stored row length in elements */
    int64_t      scale_cols;
    bool         swizzled;
    nvfp4_global g;
    bool         stochastic;
    uint32_t     copy_id;     /* Philox counter word 2 */
} nvfp4_dst;

/* The input and the options every pass reads. */
typedef struct nvfp4_src {
    const void *x;
    opf_dtype   dt;
    int64_t     m, k;
    bool        rht;
    uint16_t    sign_mask;
    uint64_t    seed, offset;
    int         threads;
} nvfp4_src;

static nvfp4_global nvfp4_global_scale(float amax)
{
    nvfp4_global g;
    float s = 2688.0f / amax;        /* 2688 = 448 * 6 */
    s = fminf(s, FLT_MAX);           /* also maps a NaN amax to FLT_MAX */
    if (amax == 0.0f || s == 0.0f) s = 1.0f;
    g.enc = s;
    g.dec = 1.0f / s;
    g.enc_div6 = s * 0x1.555556p-3f; /* fl32(1/6) = 0x3E2AAAAB */
    return g;
}

/* 3.4.2 steps 2-4 for n blocks with amaxes b: the e4m3 block scales sf and
 * the encode factors enc. d and e are never NaN (b is an amax, S_enc > 0),
 * so compares clamp; sf = 0 gives e = +inf, clamped to FLT_MAX. Selects and
 * one division per block, so that the loop vectorizes across blocks. */
static void nvfp4_block_scales(const float *restrict b, int64_t n, const nvfp4_global *g,
                               uint8_t *restrict sf, float *restrict enc)
{
    float div6 = g->enc_div6, dec = g->dec;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) {
        float d = b[j] * div6;
        uint8_t f = opf_f32_to_e4m3_impl(d < FLT_MAX ? d : FLT_MAX);
        float e = 1.0f / (opf_e4m3_to_f32_impl(f) * dec);
        sf[j] = f;
        enc[j] = e < FLT_MAX ? e : FLT_MAX;
    }
}

/* 3.4.5: the documented software stochastic rounding of v to an e2m1 code:
 * t = fma(u, step(a), a), q = min(floor(t / step(t)) * step(t), 6), sign of v,
 * NaN -> +6. u has 8 significant bits and step is a power of two, so u * step
 * is exact and one rounded add is the fma. floor(t / step(t)) * step(t) is
 * the largest E2M1 magnitude <= t (the grid spacing is step(t) on each of
 * [0,2), [2,4), [4,inf)), so q is counted off the grid, branch-free. */
static inline uint8_t nvfp4_round_sr(float v, uint8_t r8)
{
    uint32_t bits = opf_f32_bits(v), abits = bits & 0x7FFFFFFFu;
    float a = opf_bits_f32(abits), u = (float)r8 * (1.0f / 256.0f);
    /* step(a) = 0.5, 1, 2 built from its exponent, without branches */
    uint32_t up = (uint32_t)(a >= 2.0f) + (uint32_t)(a >= 4.0f);
    float t = a + u * opf_bits_f32(0x3F000000u + (up << 23));
    uint32_t code = (uint32_t)(t >= 0.5f) + (t >= 1.0f) + (t >= 1.5f) + (t >= 2.0f) +
                    (t >= 3.0f) + (t >= 4.0f) + (t >= 6.0f);
    code |= (bits >> 28) & 0x8u;
    return (uint8_t)(abits > 0x7F800000u ? 0x7u : code);
}

/* The 16 random bytes of element group b of a copy (see the file comment). */
static void nvfp4_random16(const nvfp4_src *s, uint32_t copy_id, uint64_t b, uint8_t r8[16])
{
    uint64_t c = s->offset + b;
    uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), copy_id, 0};
    uint32_t key[2] = {(uint32_t)s->seed, (uint32_t)(s->seed >> 32)};
    uint32_t w[4];
    opf_philox4x32_10(ctr, key, w);
    for (int i = 0; i < 16; i++) r8[i] = (uint8_t)(w[i / 4] >> (8 * (i % 4)));
}

/* codes[i] = the e2m1 code of fl(v[i] * enc[i]): round to nearest even, or
 * stochastic with the random bytes r8 when r8 is not NULL. */
static void nvfp4_codes(const float *restrict v, const float *restrict enc, int64_t n,
                        const uint8_t *restrict r8, uint8_t *restrict codes)
{
    if (r8) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) codes[i] = nvfp4_round_sr(v[i] * enc[i], r8[i]);
        return;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; i++) codes[i] = opf_f32_to_e2m1_impl(v[i] * enc[i]);
}

/* Two codes per byte, the even element in the low nibble (1.2). */
static void nvfp4_pack(const uint8_t *restrict codes, int64_t n, uint8_t *restrict out)
{
#pragma omp simd
    for (int64_t i = 0; i < n / 2; i++)
        out[i] = (uint8_t)(codes[2 * i] | codes[2 * i + 1] << 4);
}

static inline void nvfp4_put_scale(const nvfp4_dst *d, int64_t i, int64_t j, uint8_t sf)
{
    size_t at = d->swizzled ? opf_cpu_swizzle_index(i, j, d->scale_cols)
                            : (size_t)(i * d->scale_cols + j);
    d->scale[at] = sf;
}

/* ---- the passes --------------------------------------------------------- */

enum {
    BLK = NVFP4_BLOCK,
    RUN = 512,     /* elements of a row handled at a time: short enough that
                    * loading a run and casting it overlap */
    CP = 512,      /* columns per work item of the passes over 16-row groups */
    GROUPS = 8,    /* 16-row groups per work item: 64 bytes per columnwise row */
};

_Static_assert(CP <= RUN, "nvfp4_row_run takes the rows of a group: CP elements");

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Rowwise 1x16 blocks of row m, elements [k0, k0 + n) of it, from their fp32
 * values v: block amaxes, scales across the blocks, one cast of the run. */
static void nvfp4_row_run(const nvfp4_src *s, const nvfp4_dst *d, int64_t m, int64_t k0,
                          int64_t n, const float *v)
{
    int64_t nb = n / BLK;
    float b[RUN / BLK] = {0}, enc[RUN / BLK], e[RUN];  /* = {0}: for -Wmaybe-uninitialized */
    uint8_t sf[RUN / BLK], r8[RUN], codes[RUN];
    for (int64_t j = 0; j < nb; j++) b[j] = opf_cpu_amax(v + j * BLK, BLK);
    nvfp4_block_scales(b, nb, &d->g, sf, enc);
    for (int64_t j = 0; j < nb; j++)
        for (int i = 0; i < BLK; i++) e[j * BLK + i] = enc[j];
    if (d->stochastic)
        for (int64_t j = 0; j < nb; j++)
            nvfp4_random16(s, d->copy_id, (uint64_t)(m * d->cols + k0) / BLK + j, r8 + j * BLK);
    nvfp4_codes(v, e, n, d->stochastic ? r8 : NULL, codes);
    nvfp4_pack(codes, n, d->data + (m * d->cols + k0) / 2);
    for (int64_t j = 0; j < nb; j++) nvfp4_put_scale(d, m, k0 / BLK + j, sf[j]);
}

/* A_row: amax of the whole input. */
static float nvfp4_amax_rows(const nvfp4_src *s)
{
    return opf_cpu_input_amax(s->x, s->dt, s->m * s->k, s->threads);
}

/* Loads the 16 x w input tile at (m0, k0) into t (row stride CP). */
static void nvfp4_load_group(const nvfp4_src *s, int64_t m0, int64_t k0, int64_t w, float *t)
{
    for (int r = 0; r < BLK; r++)
        opf_cpu_load_f32(s->x, s->dt, (m0 + r) * s->k + k0, w, t + r * CP);
}

/* With RHT (3.4.3), each column of the loaded tile becomes its rotated
 * block, rounded to bf16 first (exact for bf16 inputs; the anchor only
 * accepts bf16). */
static void nvfp4_rotate_group(const nvfp4_src *s, int64_t w, float *t)
{
    if (!s->rht) return;
    if (s->dt != OPF_BF16)
        for (int r = 0; r < BLK; r++) {
            float *restrict row = t + r * CP;
#pragma omp simd
            for (int64_t k = 0; k < w; k++)
                row[k] = opf_bf16_to_f32_impl(opf_f32_to_bf16_impl(row[k]));
        }
    opf_rht16_cols(t, CP, t, CP, w, s->sign_mask);
}

/* b[k] = amax of column k of the 16 x w tile t (row stride CP). */
static void nvfp4_column_amax(const float *t, int64_t w, float *b)
{
    int32_t cm[CP];
    for (int64_t k = 0; k < w; k++) cm[k] = 0;
    for (int r = 0; r < BLK; r++) {
        const float *restrict row = t + r * CP;
#pragma omp simd
        for (int64_t k = 0; k < w; k++) {
            int32_t key = opf_cpu_amax_key(row[k]);
            cm[k] = key > cm[k] ? key : cm[k];
        }
    }
    for (int64_t k = 0; k < w; k++) b[k] = opf_bits_f32((uint32_t)cm[k]);
}

/* With RHT, one pass gives both amaxes: A_row of the input and A_col of the
 * bf16-rounded rotated values. */
static void nvfp4_amax_rht(const nvfp4_src *s, float *a_row, float *a_col)
{
    int64_t ng = s->m / BLK, nc = opf_ceil_div(s->k, CP);
    float ar = 0.0f, ac = 0.0f;
#pragma omp parallel for num_threads(s->threads) reduction(max : ar, ac) schedule(static)
    for (int64_t t = 0; t < ng * nc; t++) {
        int64_t m0 = t / nc * BLK, k0 = t % nc * CP, w = min64(CP, s->k - k0);
        float tile[BLK * CP];
        nvfp4_load_group(s, m0, k0, w, tile);
        for (int r = 0; r < BLK; r++) {
            float b = opf_cpu_amax(tile + r * CP, w);
            ar = b > ar ? b : ar;
        }
        nvfp4_rotate_group(s, w, tile);
        for (int r = 0; r < BLK; r++) {
            float b = opf_cpu_amax(tile + r * CP, w);
            ac = b > ac ? b : ac;
        }
    }
    *a_row = ar;
    *a_col = ac;
}

static void nvfp4_rowwise_1d(const nvfp4_src *s, const nvfp4_dst *d)
{
#pragma omp parallel for num_threads(s->threads) schedule(static)
    for (int64_t m = 0; m < s->m; m++) {
        float v[RUN];
        for (int64_t k0 = 0; k0 < s->k; k0 += RUN) {
            int64_t n = min64(RUN, s->k - k0);
            opf_cpu_load_f32(s->x, s->dt, m * s->k + k0, n, v);
            opf_cpu_prefetch(s->x, s->dt, m * s->k + k0 + n, RUN, s->m * s->k);
            nvfp4_row_run(s, d, m, k0, n, v);
        }
    }
}

/* What a pass over 16-row groups writes: the rowwise copy of 1D blocks
 * (row1d), and for 2D tiles or the columnwise copy the codes of the group,
 * scaled per column (2D: per tile, a function of the column too). */
typedef struct nvfp4_pass {
    const nvfp4_dst *row1d;  /* rowwise 1x16 blocks, or NULL */
    const nvfp4_dst *row2d;  /* rowwise copy of 16x16 tiles, or NULL */
    const nvfp4_dst *col;    /* columnwise copy, or NULL */
    bool             two_d;
} nvfp4_pass;

/* The per-column encode factors of one group: 1D columnwise blocks (the
 * scales go to the columnwise copy), or 16x16 tiles (to both copies). */
static void nvfp4_group_scales(const nvfp4_pass *p, const float *t, int64_t m0, int64_t k0,
                               int64_t w, float *enc)
{
    float b[CP], eb[CP / BLK];
    uint8_t sf[CP];
    nvfp4_column_amax(t, w, b);
    if (!p->two_d) {
        nvfp4_block_scales(b, w, &p->col->g, sf, enc);
        for (int64_t k = 0; k < w; k++) nvfp4_put_scale(p->col, k0 + k, m0 / BLK, sf[k]);
        return;
    }
    const nvfp4_dst *any = p->row2d ? p->row2d : p->col;
    for (int64_t j = 0; j < w / BLK; j++) b[j] = opf_cpu_amax(b + j * BLK, BLK);
    nvfp4_block_scales(b, w / BLK, &any->g, sf, eb);
    for (int64_t j = 0; j < w / BLK; j++) {
        for (int i = 0; i < BLK; i++) enc[j * BLK + i] = eb[j];
        for (int i = 0; p->row2d && i < BLK; i++)
            nvfp4_put_scale(p->row2d, m0 + i, (k0 / BLK) + j, sf[j]);
        for (int i = 0; p->col && i < BLK; i++)
            nvfp4_put_scale(p->col, k0 + j * BLK + i, m0 / BLK, sf[j]);
    }
}

/* The random bytes of the group's codes: 2D tiles draw with the rowwise
 * indices (copy 0), columnwise blocks with theirs (see the file comment). */
static void nvfp4_group_random(const nvfp4_src *s, const nvfp4_pass *p, int64_t m0, int64_t k0,
                               int64_t w, uint8_t *r8)
{
    uint8_t b[16];
    if (p->two_d) {
        for (int r = 0; r < BLK; r++)
            for (int64_t j = 0; j < w / BLK; j++)
                nvfp4_random16(s, 0, (uint64_t)((m0 + r) * s->k + k0) / BLK + j,
                               r8 + r * CP + j * BLK);
        return;
    }
    for (int64_t k = 0; k < w; k++) {
        nvfp4_random16(s, 1, (uint64_t)((k0 + k) * s->m + m0) / BLK, b);
        for (int r = 0; r < BLK; r++) r8[r * CP + k] = b[r];
    }
}

/* One 16-row group at (m0, k0), w columns: rowwise 1D blocks of its rows,
 * then the codes scaled per column; the 2D rowwise copy takes them along
 * the rows, the columnwise copy as pairs of rows packed into 8 rows of pk
 * (row stride CP), to be transposed by the caller. */
static void nvfp4_group(const nvfp4_src *s, const nvfp4_pass *p, int64_t m0, int64_t k0,
                        int64_t w, uint8_t *pk)
{
    float t[BLK * CP], enc[CP];
    uint8_t codes[BLK * CP], r8[BLK * CP];
    nvfp4_load_group(s, m0, k0, w, t);
    /* The rowwise copy takes the input rows, before any rotation. */
    for (int r = 0; p->row1d && r < BLK; r++) nvfp4_row_run(s, p->row1d, m0 + r, k0, w, t + r * CP);
    if (!p->row2d && !p->col) return;
    nvfp4_rotate_group(s, w, t);
    nvfp4_group_scales(p, t, m0, k0, w, enc);
    bool sr = (p->col ? p->col : p->row2d)->stochastic;
    if (sr) nvfp4_group_random(s, p, m0, k0, w, r8);
    for (int r = 0; r < BLK; r++)
        nvfp4_codes(t + r * CP, enc, w, sr ? r8 + r * CP : NULL, codes + r * CP);
    if (p->row2d)
        for (int r = 0; r < BLK; r++)
            nvfp4_pack(codes + r * CP, w, p->row2d->data + ((m0 + r) * s->k + k0) / 2);
    if (!p->col) return;
    for (int j = 0; j < BLK / 2; j++) {
        const uint8_t *restrict lo = codes + 2 * j * CP, *restrict hi = lo + CP;
        uint8_t *restrict out = pk + j * CP;
#pragma omp simd
        for (int64_t k = 0; k < w; k++) out[k] = (uint8_t)(lo[k] | hi[k] << 4);
    }
}

/* The passes over 16-row groups, in work items of GROUPS groups x CP
 * columns; the columnwise bytes of a work item are transposed into [K, M/2]
 * at its end, 8 * GROUPS bytes per columnwise row. */
static void nvfp4_group_pass(const nvfp4_src *s, const nvfp4_pass *p)
{
    int64_t rows = GROUPS * BLK, ni = opf_ceil_div(s->m, rows), nc = opf_ceil_div(s->k, CP);
#pragma omp parallel for num_threads(s->threads) schedule(static)
    for (int64_t t = 0; t < ni * nc; t++) {
        int64_t m0 = t / nc * rows, k0 = t % nc * CP, w = min64(CP, s->k - k0);
        int64_t ng = min64(GROUPS, (s->m - m0) / BLK);
        uint8_t pk[GROUPS * BLK / 2 * CP];
        for (int64_t g = 0; g < ng; g++)
            nvfp4_group(s, p, m0 + g * BLK, k0, w, pk + g * (BLK / 2) * CP);
        if (p->col)
            opf_transpose_bytes(pk, CP, p->col->data + (k0 * p->col->cols + m0) / 2,
                                p->col->cols / 2, ng * BLK / 2, w);
    }
}

/* ---- entry points ------------------------------------------------------- */

/* What the dispatcher does not already guarantee (the CUDA entry checks the
 * same). opf_spec_layout has checked that M and K are multiples of 16, so
 * every block and tile is whole. */
opf_status opf_nvfp4_check(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                           const opf_tensor *out, const opf_layout *L, const char *fn)
{
    opf_dtype dt = in->spec.dtype;
    if (dt != OPF_F32 && dt != OPF_BF16 && dt != OPF_F16)
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: input dtype %s, want f32/bf16/f16", fn,
                         opf_dtype_name(dt));
    if (opf_spec_numel(&in->spec) != L->m * L->k)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: input has %lld elements, output %lld x %lld",
                         fn, (long long)opf_spec_numel(&in->spec), (long long)L->m,
                         (long long)L->k);
    if (q->rht && out->spec.scaling == OPF_SCALING_NVFP4_2D &&
        (out->spec.usage & OPF_USAGE_COLUMNWISE))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED,
                         "%s: the Hadamard transform cannot apply to 2D (16x16) tiles, whose "
                         "columnwise copy is the transpose of the rowwise one", fn);
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L->comp[c].present && !out->data[c])
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: output component %d is NULL", fn, c);
    return OPF_OK;
}

/* Fills a destination for one copy; zeroes its scales so the padding is
 * deterministic. */
static nvfp4_dst nvfp4_make_dst(const opf_tensor *out, const opf_layout *L, bool col, float amax,
                                bool stochastic)
{
    nvfp4_dst d;
    opf_component dc = col ? OPF_COMP_COL_DATA : OPF_COMP_DATA;
    opf_component sc = col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV;
    d.data = out->data[dc];
    d.scale = out->data[sc];
    d.cols = L->comp[dc].cols;
    d.scale_cols = L->comp[sc].cols;
    d.swizzled = (out->spec.flags & OPF_SPEC_SWIZZLED) != 0;
    d.g = nvfp4_global_scale(amax);
    d.stochastic = stochastic;
    d.copy_id = col ? 1u : 0u;
    memset(d.scale, 0, L->comp[sc].nbytes);
    return d;
}

/* 3.4.1: A_row (always: the AMAX component always exists), A_col when the
 * columnwise copy is rotated, and the optional reduction; writes nothing. */
static opf_status nvfp4_amaxes(opf_ctx *ctx, const opf_quantizer *q, const nvfp4_src *s,
                               float *a_row, float *a_col)
{
    float a[2];
    int n = 0;
    if (s->rht) nvfp4_amax_rht(s, &a[0], &a[1]), n = 2;
    else a[n++] = nvfp4_amax_rows(s);
    if (q->amax_reduce) {
        opf_status st = q->amax_reduce(q->amax_reduce_user, a, n);
        if (st != OPF_OK)
            return opf_error(ctx, st, "%s: amax reduction of %d value(s) failed: %s", kFn, n,
                             opf_status_str(st));
    }
    *a_row = a[0];
    *a_col = a[n - 1];
    return OPF_OK;
}

/* opf_spec_layout failed on a spec the dispatcher accepted: relay its
 * message (copied first: it lives in the buffer opf_error writes). */
static opf_status nvfp4_layout_error(opf_ctx *ctx, opf_status st, const char *fn)
{
    char msg[256];
    snprintf(msg, sizeof msg, "%s", opf_last_error(NULL));
    return opf_error(ctx, st, "%s: %s", fn, msg);
}

opf_status opf_cpu_quantize_nvfp4(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                  opf_tensor *out, const opf_quantize_state *qs)
{
    opf_layout L;
    opf_status st = opf_spec_layout(&out->spec, &L);
    if (st != OPF_OK) return nvfp4_layout_error(ctx, st, kFn);
    if ((st = opf_nvfp4_check(ctx, q, in, out, &L, kFn)) != OPF_OK) return st;
    bool row = out->spec.usage & OPF_USAGE_ROWWISE, col = out->spec.usage & OPF_USAGE_COLUMNWISE;
    bool is2d = out->spec.scaling == OPF_SCALING_NVFP4_2D;
    nvfp4_src s = {in->data[OPF_COMP_DATA], in->spec.dtype, L.m, L.k, q->rht && col,
                   q->rht_sign_mask, qs->rng_seed, qs->rng_offset,
                   opf_cpu_threads(ctx, L.m * L.k, NVFP4_PAR_MIN)};
    float a_row = 0.0f, a_col = 0.0f;
    if ((st = nvfp4_amaxes(ctx, q, &s, &a_row, &a_col)) != OPF_OK) return st;

    nvfp4_dst dr = {0}, dc = {0};
    if (row) dr = nvfp4_make_dst(out, &L, false, a_row, q->stochastic);
    if (col) dc = nvfp4_make_dst(out, &L, true, a_col, q->stochastic);
    /* Rowwise 1D blocks alone stream row by row; everything else runs over
     * 16-row groups, which also give the rowwise blocks when both copies
     * are wanted, so the input is read from memory once. */
    if (!is2d && !col) {
        nvfp4_rowwise_1d(&s, &dr);
    } else {
        nvfp4_pass p = {!is2d && row ? &dr : NULL, is2d && row ? &dr : NULL, col ? &dc : NULL,
                        is2d};
        nvfp4_group_pass(&s, &p);
    }
    if (out->data[OPF_COMP_AMAX]) *(float *)out->data[OPF_COMP_AMAX] = a_row;
    if (out->data[OPF_COMP_COL_AMAX]) *(float *)out->data[OPF_COMP_COL_AMAX] = a_col;
    return OPF_OK;
}

/* Decodes one copy: out[r*cols + c] (or transposed back for the columnwise
 * copy) = fp4 * float(sf) * S_dec (1.5; fp4 * sf is exact). A rotated (RHT)
 * columnwise copy decodes to the rotated values: the inverse transform is
 * only ever applied implicitly, inside the wgrad GEMM (3.4.3). */
opf_status opf_cpu_dequantize_nvfp4(opf_ctx *ctx, const opf_tensor *t, unsigned which, float *out)
{
    const char *fn = "opf_dequantize(nvfp4)";
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    if (st != OPF_OK) return nvfp4_layout_error(ctx, st, fn);
    if (which != OPF_USAGE_ROWWISE && which != OPF_USAGE_COLUMNWISE)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: which = %u, want rowwise (1) or "
                         "columnwise (2)", fn, which);
    bool col = which == OPF_USAGE_COLUMNWISE;
    opf_component dcomp = col ? OPF_COMP_COL_DATA : OPF_COMP_DATA;
    opf_component scomp = col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV;
    opf_component acomp = col ? OPF_COMP_COL_AMAX : OPF_COMP_AMAX;
    if (!L.comp[dcomp].present || !t->data[dcomp] || !t->data[scomp] || !t->data[acomp])
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the tensor has no %s copy", fn,
                         col ? "columnwise" : "rowwise");
    const uint8_t *data = t->data[dcomp], *scale = t->data[scomp];
    int64_t rows = L.comp[dcomp].rows, cols = L.comp[dcomp].cols, sc = L.comp[scomp].cols;
    bool swz = (t->spec.flags & OPF_SPEC_SWIZZLED) != 0;
    float dec = nvfp4_global_scale(*(const float *)t->data[acomp]).dec;
    int nt = opf_cpu_threads(ctx, rows * cols, NVFP4_PAR_MIN);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c0 = 0; c0 < cols; c0 += NVFP4_BLOCK) {
            int64_t j = c0 / NVFP4_BLOCK;
            float sf = opf_e4m3_to_f32_impl(scale[swz ? opf_swizzle_index(r, j, sc)
                                                      : (size_t)(r * sc + j)]);
            const uint8_t *p = data + (r * cols + c0) / 2;
            for (int i = 0; i < NVFP4_BLOCK; i++) {
                float v = opf_e2m1_to_f32_impl((uint8_t)(i % 2 ? p[i / 2] >> 4 : p[i / 2]));
                int64_t c = c0 + i;
                out[col ? c * rows + r : r * cols + c] = (v * sf) * dec;
            }
        }
    }
    return OPF_OK;
}
