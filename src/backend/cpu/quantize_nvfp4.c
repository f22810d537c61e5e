/* quantize_nvfp4.c: the CPU reference NVFP4 quantizer and decoder
 * (docs/numerics.md 3.4.1-3.4.5, layouts 4.2 and 4.4).
 *
 * Copies. The rowwise copy quantizes x [M, K] in 1x16 blocks along K. The
 * columnwise copy is stored transposed, [K, M], in 1x16 blocks along M; with
 * q->rht every such block is first rounded to bf16 (exact for bf16 inputs;
 * the anchor only accepts bf16) and rotated by opf_rht16. In 2D mode every
 * 16x16 tile is quantized once and both copies hold the same codes.
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

/* amax of n fp32 values (NaN ignored, from 0) on the bit patterns: |x| of
 * non-NaN values orders like its integer bits, NaN patterns lie above inf's.
 * Branch-free so that the compiler vectorizes it. */
static float nvfp4_amax(const float *v, int64_t n)
{
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = opf_f32_bits(v[i]) & 0x7FFFFFFFu;
        a = a > 0x7F800000u ? 0u : a;
        m = a > m ? a : m;
    }
    return opf_bits_f32(m);
}

/* 3.4.2 steps 2-4: the e4m3 block scale of block amax b and its encode factor. */
static uint8_t nvfp4_block_scale(float b, const nvfp4_global *g, float *enc)
{
    float d = b * g->enc_div6;
    /* d and e are never NaN (b is an amax, S_enc > 0), so compares clamp. */
    uint8_t sf = opf_f32_to_e4m3_impl(d < FLT_MAX ? d : FLT_MAX);
    float e = 1.0f / (opf_e4m3_to_f32_impl(sf) * g->dec);  /* sf = 0 gives +inf */
    *enc = e < FLT_MAX ? e : FLT_MAX;
    return sf;
}

/* 3.4.5: the documented software stochastic rounding of v to an e2m1 code:
 * t = fma(u, step(a), a), q = min(floor(t / step(t)) * step(t), 6), sign of v,
 * NaN -> +6. u has 8 significant bits and step is a power of two, so u * step
 * is exact and one rounded add is the fma. floor(t / step(t)) * step(t) is
 * the largest E2M1 magnitude <= t (the grid spacing is step(t) on each of
 * [0,2), [2,4), [4,inf)), so q is counted off the grid, branch-free. */
static uint8_t nvfp4_round_sr(float v, uint8_t r8)
{
    uint32_t bits = opf_f32_bits(v), abits = bits & 0x7FFFFFFFu;
    float a = opf_bits_f32(abits), u = (float)r8 * (1.0f / 256.0f);
    /* step(a) = 0.5, 1, 2 built from its exponent, without branches */
    uint32_t up = (uint32_t)(a >= 2.0f) + (uint32_t)(a >= 4.0f);
    float t = a + u * opf_bits_f32(0x3F000000u + (up << 23));
    uint32_t code = (uint32_t)(t >= 0.5f) + (t >= 1.0f) + (t >= 1.5f) + (t >= 2.0f) +
                    (t >= 3.0f) + (t >= 4.0f) + (t >= 6.0f);
    code |= (bits >> 28) & 0x8u;
    return (uint8_t)(abits > 0x7F800000u ? 0x7u : code);  /* NaN -> +6 */
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

/* Casts n <= 16 values scaled by enc; r8 NULL means round to nearest even. */
static void nvfp4_cast(const float *v, int n, float enc, const uint8_t *r8, uint8_t *codes)
{
    if (r8) {
        for (int i = 0; i < n; i++) codes[i] = nvfp4_round_sr(v[i] * enc, r8[i]);
        return;
    }
    for (int i = 0; i < n; i++) codes[i] = opf_f32_to_e2m1_impl(v[i] * enc);
}

/* Packs 16 codes into stored row `row` of dst starting at element col
 * (a multiple of 16: even elements in the low nibble). */
static void nvfp4_put16(const nvfp4_dst *d, int64_t row, int64_t col, const uint8_t *codes)
{
    uint8_t *p = d->data + (row * d->cols + col) / 2;
    for (int i = 0; i < NVFP4_BLOCK; i += 2) p[i / 2] = (uint8_t)(codes[i] | (codes[i + 1] << 4));
}

static void nvfp4_put_scale(const nvfp4_dst *d, int64_t i, int64_t j, uint8_t sf)
{
    size_t at = d->swizzled ? opf_swizzle_index(i, j, d->scale_cols)
                            : (size_t)(i * d->scale_cols + j);
    d->scale[at] = sf;
}

/* Quantizes one stored block (1D): values v of stored row `row`, elements
 * col..col+15. */
static void nvfp4_block_1d(const nvfp4_src *s, const nvfp4_dst *d, int64_t row, int64_t col,
                           const float *v)
{
    float enc;
    uint8_t sf = nvfp4_block_scale(nvfp4_amax(v, NVFP4_BLOCK), &d->g, &enc);
    uint8_t r8[16], codes[16];
    if (d->stochastic)
        nvfp4_random16(s, d->copy_id, (uint64_t)(row * d->cols + col) / NVFP4_BLOCK, r8);
    nvfp4_cast(v, NVFP4_BLOCK, enc, d->stochastic ? r8 : NULL, codes);
    nvfp4_put16(d, row, col, codes);
    nvfp4_put_scale(d, row, col / NVFP4_BLOCK, sf);
}

/* ---- the passes --------------------------------------------------------- */

/* Threads for a pass over n elements: one below NVFP4_PAR_MIN, where the
 * fork costs more than the work. */
static int nvfp4_threads(opf_ctx *ctx, int64_t n)
{
    int t = opf_ctx_num_threads(ctx);
    if (n < NVFP4_PAR_MIN) return 1;
    return t > 0 ? t : omp_get_max_threads();
}

/* Loads the 16 x 16 input tile at (m0, k0) into t[i][j] = x[m0+i][k0+j]. */
static void nvfp4_load_tile(const nvfp4_src *s, int64_t m0, int64_t k0, float t[16][16])
{
    for (int i = 0; i < NVFP4_BLOCK; i++)
        opf_cpu_load_f32(s->x, s->dt, (m0 + i) * s->k + k0, NVFP4_BLOCK, t[i]);
}

/* Column j of a tile as the columnwise block: bf16-rounded and rotated with
 * RHT (3.4.3), the raw values otherwise. */
static void nvfp4_col_block(const nvfp4_src *s, float t[16][16], int j, float v[16])
{
    for (int i = 0; i < NVFP4_BLOCK; i++) v[i] = t[i][j];
    if (!s->rht) return;
    if (s->dt != OPF_BF16)  /* the anchor takes bf16 only: round f32/f16 inputs to it */
        for (int i = 0; i < NVFP4_BLOCK; i++)
            v[i] = opf_bf16_to_f32_impl(opf_f32_to_bf16_impl(v[i]));
    opf_rht16(v, v, s->sign_mask);
}

/* A_row: amax of the whole input. */
static float nvfp4_amax_rows(const nvfp4_src *s)
{
    float a = 0.0f;
    int64_t n = s->m * s->k;
#pragma omp parallel for num_threads(s->threads) reduction(max : a) schedule(static)
    for (int64_t i0 = 0; i0 < n; i0 += 1024) {
        float v[1024];
        int64_t len = n - i0 < 1024 ? n - i0 : 1024;
        opf_cpu_load_f32(s->x, s->dt, i0, len, v);
        float b = nvfp4_amax(v, len);
        if (b > a) a = b;
    }
    return a;
}

/* A_col with RHT: amax of the bf16-rounded rotated values. */
static float nvfp4_amax_rht(const nvfp4_src *s)
{
    float a = 0.0f;
#pragma omp parallel for num_threads(s->threads) reduction(max : a) schedule(static)
    for (int64_t m0 = 0; m0 < s->m; m0 += NVFP4_BLOCK) {
        float t[16][16], v[16];
        for (int64_t k0 = 0; k0 < s->k; k0 += NVFP4_BLOCK) {
            nvfp4_load_tile(s, m0, k0, t);
            for (int j = 0; j < NVFP4_BLOCK; j++) {
                nvfp4_col_block(s, t, j, v);
                float b = nvfp4_amax(v, NVFP4_BLOCK);
                if (b > a) a = b;
            }
        }
    }
    return a;
}

static void nvfp4_rowwise_1d(const nvfp4_src *s, const nvfp4_dst *d)
{
#pragma omp parallel for num_threads(s->threads) schedule(static)
    for (int64_t m = 0; m < s->m; m++) {
        float v[16];
        for (int64_t k0 = 0; k0 < s->k; k0 += NVFP4_BLOCK) {
            opf_cpu_load_f32(s->x, s->dt, m * s->k + k0, NVFP4_BLOCK, v);
            nvfp4_block_1d(s, d, m, k0, v);
        }
    }
}

/* Columnwise copy [K, M]: block (k, m0..m0+15) is column k of the tile. */
static void nvfp4_colwise_1d(const nvfp4_src *s, const nvfp4_dst *d)
{
#pragma omp parallel for num_threads(s->threads) schedule(static)
    for (int64_t m0 = 0; m0 < s->m; m0 += NVFP4_BLOCK) {
        float t[16][16], v[16];
        for (int64_t k0 = 0; k0 < s->k; k0 += NVFP4_BLOCK) {
            nvfp4_load_tile(s, m0, k0, t);
            for (int j = 0; j < NVFP4_BLOCK; j++) {
                nvfp4_col_block(s, t, j, v);
                nvfp4_block_1d(s, d, k0 + j, m0, v);
            }
        }
    }
}

/* Quantizes one 16x16 tile (3.4.4) into codes[i][j] and returns its scale. */
static uint8_t nvfp4_tile_2d(const nvfp4_src *s, const nvfp4_global *g, bool sr, int64_t m0,
                             int64_t k0, uint8_t codes[16][16])
{
    float t[16][16], enc;
    nvfp4_load_tile(s, m0, k0, t);
    uint8_t sf = nvfp4_block_scale(nvfp4_amax(&t[0][0], 256), g, &enc);
    for (int i = 0; i < NVFP4_BLOCK; i++) {
        uint8_t r8[16];
        if (sr) nvfp4_random16(s, 0, (uint64_t)((m0 + i) * s->k + k0) / NVFP4_BLOCK, r8);
        nvfp4_cast(t[i], NVFP4_BLOCK, enc, sr ? r8 : NULL, codes[i]);
    }
    return sf;
}

/* 2D: each tile is quantized once and written to whichever copies exist
 * (row or col NULL when absent); both share the same global scale. */
static void nvfp4_quantize_2d(const nvfp4_src *s, const nvfp4_dst *row, const nvfp4_dst *col)
{
    const nvfp4_dst *any = row ? row : col;
#pragma omp parallel for num_threads(s->threads) schedule(static)
    for (int64_t m0 = 0; m0 < s->m; m0 += NVFP4_BLOCK) {
        uint8_t codes[16][16], ct[16];
        for (int64_t k0 = 0; k0 < s->k; k0 += NVFP4_BLOCK) {
            uint8_t sf = nvfp4_tile_2d(s, &any->g, any->stochastic, m0, k0, codes);
            for (int i = 0; row && i < NVFP4_BLOCK; i++) {
                nvfp4_put16(row, m0 + i, k0, codes[i]);
                nvfp4_put_scale(row, m0 + i, k0 / NVFP4_BLOCK, sf);
            }
            for (int j = 0; col && j < NVFP4_BLOCK; j++) {
                for (int i = 0; i < NVFP4_BLOCK; i++) ct[i] = codes[i][j];
                nvfp4_put16(col, k0 + j, m0, ct);
                nvfp4_put_scale(col, k0 + j, m0 / NVFP4_BLOCK, sf);
            }
        }
    }
}

/* ---- entry points ------------------------------------------------------- */

/* What the dispatcher does not already guarantee. opf_spec_layout has checked
 * that M and K are multiples of 16, so every block and tile is whole. */
static opf_status nvfp4_check(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                              const opf_tensor *out, const opf_layout *L)
{
    opf_dtype dt = in->spec.dtype;
    if (dt != OPF_F32 && dt != OPF_BF16 && dt != OPF_F16)
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: input dtype %s, want f32/bf16/f16", kFn,
                         opf_dtype_name(dt));
    if (opf_spec_numel(&in->spec) != L->m * L->k)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: input has %lld elements, output %lld x %lld",
                         kFn, (long long)opf_spec_numel(&in->spec), (long long)L->m,
                         (long long)L->k);
    if (q->rht && out->spec.scaling == OPF_SCALING_NVFP4_2D &&
        (out->spec.usage & OPF_USAGE_COLUMNWISE))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED,
                         "%s: the Hadamard transform cannot apply to 2D (16x16) tiles, whose "
                         "columnwise copy is the transpose of the rowwise one", kFn);
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L->comp[c].present && !out->data[c])
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: output component %d is NULL", kFn, c);
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
    a[n++] = nvfp4_amax_rows(s);
    if (s->rht) a[n++] = nvfp4_amax_rht(s);
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
                                  opf_tensor *out, uint64_t rng_seed, uint64_t rng_offset)
{
    opf_layout L;
    opf_status st = opf_spec_layout(&out->spec, &L);
    if (st != OPF_OK) return nvfp4_layout_error(ctx, st, kFn);
    if ((st = nvfp4_check(ctx, q, in, out, &L)) != OPF_OK) return st;
    bool row = out->spec.usage & OPF_USAGE_ROWWISE, col = out->spec.usage & OPF_USAGE_COLUMNWISE;
    bool is2d = out->spec.scaling == OPF_SCALING_NVFP4_2D;
    nvfp4_src s = {in->data[OPF_COMP_DATA], in->spec.dtype, L.m, L.k, q->rht && col,
                   q->rht_sign_mask, rng_seed, rng_offset, nvfp4_threads(ctx, L.m * L.k)};
    float a_row = 0.0f, a_col = 0.0f;
    if ((st = nvfp4_amaxes(ctx, q, &s, &a_row, &a_col)) != OPF_OK) return st;

    nvfp4_dst dr = {0}, dc = {0};
    if (row) dr = nvfp4_make_dst(out, &L, false, a_row, q->stochastic);
    if (col) dc = nvfp4_make_dst(out, &L, true, a_col, q->stochastic);
    if (is2d) {
        nvfp4_quantize_2d(&s, row ? &dr : NULL, col ? &dc : NULL);
    } else {
        if (row) nvfp4_rowwise_1d(&s, &dr);
        if (col) nvfp4_colwise_1d(&s, &dc);
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
#pragma omp parallel for num_threads(nvfp4_threads(ctx, rows * cols)) schedule(static)
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
