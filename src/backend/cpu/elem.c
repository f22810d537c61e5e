/* elem.c: the CPU reference kernels of the element-wise family (elem.h):
 * bias and dbias (plain, scaled per row, and with dx quantized: dbias_q's
 * composition, every device's fallback), constant scale, add, dropout, cast
 * and cast+transpose, fill and copy.
 *
 * Element-wise kernels walk their tensors in blocks of ELEM_BLOCK elements:
 * each block is read into fp32 on the stack (opf_cpu_load_f32), computed, and
 * rounded into the output (opf_cpu_store_f32). Every element's value depends
 * on that element alone, so neither the blocks nor the OpenMP split over them
 * can change a bit; large tensors (over PAR_MIN elements) spread their blocks
 * over the threads. dbias sums each column in lanesum.h's order (row r in
 * lane r mod 32), items of columns on the threads, so its split is exact too. */
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/lanesum.h"
#include "backend/cpu/cpu-impl.h"
#include "core/core-impl.h"

enum {
    ELEM_BLOCK = 4096,    /* elements per block; a multiple of 4 (one Philox draw) */
    COLSUM_COLS = 64,     /* columns per column-sum work item */
    TR_TILE = 32,         /* cast+transpose tile edge */
};
#define PAR_MIN ((int64_t)65536)  /* below this a parallel region costs more than it splits */

/* for (int64_t i = 0; i < n; i++) BODY, on the context's threads when big:
 * OpenMP's if(false) still enters the runtime (a team of one, a few tenths
 * of a microsecond), which costs a tiny tensor more than its work, so small
 * calls run the plain loop. Either way the iterations compute the same. */
#define ELEM_FOR(big, i, n, ...)                                                   \
    do {                                                                           \
        if (big) {                                                                 \
            _Pragma("omp parallel for schedule(static)")                           \
            for (int64_t i = 0; i < (n); i++) __VA_ARGS__                          \
        } else {                                                                   \
            for (int64_t i = 0; i < (n); i++) __VA_ARGS__                          \
        }                                                                          \
    } while (0)

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t numel(const opf_tensor *t) { return opf_spec_numel(&t->spec); }
static const void *cdata(const opf_tensor *t) { return t->data[OPF_COMP_DATA]; }
static void *data(opf_tensor *t) { return t->data[OPF_COMP_DATA]; }
static int64_t nblocks(int64_t n) { return (n + ELEM_BLOCK - 1) / ELEM_BLOCK; }

/* Plain memory: the caller keeps src and dst apart unless they are equal. */
static opf_status copy(opf_ctx *ctx, const void *src, void *dst, size_t nbytes)
{
    if (src != dst && nbytes) memcpy(dst, src, nbytes);
    return OPF_OK;
}

/* ---- bias, scale, add ----------------------------------------------------- */

static opf_status bias_add(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *bias, opf_tensor *y)
{
    int64_t n = numel(bias), rows = n ? numel(x) / n : 0;
    const void *xs = cdata(x), *bs = cdata(bias);
    opf_dtype xd = x->spec.dtype, bd = bias->spec.dtype, yd = y->spec.dtype;
    void *ys = data(y);
    ELEM_FOR(rows * n > PAR_MIN, r, rows, {
        float v[ELEM_BLOCK], b[ELEM_BLOCK];
        for (int64_t j0 = 0; j0 < n; j0 += ELEM_BLOCK) {
            int64_t w = min64(ELEM_BLOCK, n - j0);
            opf_cpu_load_f32(xs, xd, r * n + j0, w, v);
            opf_cpu_load_f32(bs, bd, j0, w, b);
            for (int64_t j = 0; j < w; j++) v[j] = v[j] + b[j];
            opf_cpu_store_f32(v, yd, ys, r * n + j0, w);
        }
    });
    return OPF_OK;
}

void opf_cpu_colsum(const void *x, opf_dtype dt, const void *s, opf_dtype st, int64_t rows,
                    int64_t cols, void *out, opf_dtype ot)
{
    int64_t items = (cols + COLSUM_COLS - 1) / COLSUM_COLS;
    ELEM_FOR(rows * cols > PAR_MIN, it, items, {
        int64_t j0 = it * COLSUM_COLS, w = min64(COLSUM_COLS, cols - j0);
        float acc[OPF_SUM_LANES][COLSUM_COLS], v[COLSUM_COLS], sr;
        memset(acc, 0, sizeof acc);
        for (int64_t r = 0; r < rows; r++) {
            float *a = acc[r % OPF_SUM_LANES];
            opf_cpu_load_f32(x, dt, r * cols + j0, w, v);
            if (s) {
                opf_cpu_load_f32(s, st, r, 1, &sr);
                for (int64_t j = 0; j < w; j++) a[j] += v[j] * sr;
            } else {
                for (int64_t j = 0; j < w; j++) a[j] += v[j];
            }
        }
        opf_lane_fold_cols(&acc[0][0], COLSUM_COLS, w);
        opf_cpu_store_f32(acc[0], ot, out, j0, w);
    });
}

static opf_status dbias(opf_ctx *ctx, const opf_tensor *dy, opf_tensor *db)
{
    int64_t n = numel(db), rows = n ? numel(dy) / n : 0;
    opf_cpu_colsum(cdata(dy), dy->spec.dtype, NULL, OPF_F32, rows, n, data(db), db->spec.dtype);
    return OPF_OK;
}

opf_status opf_dbias_q_composed(opf_ctx *ctx, const opf_backend_i *be, const opf_tensor *dy,
                                opf_tensor *db, const opf_qout *dx)
{
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_status st = be->elem->dbias(ctx, dy, db);
    if (!st) st = opf_qout_from_plain(ctx, be, dx, dy);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static opf_status dbias_q(opf_ctx *ctx, const opf_tensor *dy, opf_tensor *db, const opf_qout *dx)
{
    return opf_dbias_q_composed(ctx, opf_backend_get(OPF_DEVICE_CPU), dy, db, dx);
}

/* Rows wider than ELEM_BLOCK go block by block; s[r] is read once per row. */
static opf_status scaled_bias_add(opf_ctx *ctx, const opf_tensor *acc, const opf_tensor *s,
                                  const opf_tensor *bias, opf_tensor *y)
{
    int64_t n = numel(bias), rows = n ? numel(acc) / n : 0;
    ELEM_FOR(rows * n > PAR_MIN, r, rows, {
        float v[ELEM_BLOCK], b[ELEM_BLOCK], sr;
        opf_cpu_load_f32(cdata(s), s->spec.dtype, r, 1, &sr);
        for (int64_t j0 = 0; j0 < n; j0 += ELEM_BLOCK) {
            int64_t w = min64(ELEM_BLOCK, n - j0);
            opf_cpu_load_f32(cdata(acc), acc->spec.dtype, r * n + j0, w, v);
            opf_cpu_load_f32(cdata(bias), bias->spec.dtype, j0, w, b);
            for (int64_t j = 0; j < w; j++) v[j] = v[j] + sr * b[j];
            opf_cpu_store_f32(v, y->spec.dtype, data(y), r * n + j0, w);
        }
    });
    return OPF_OK;
}

/* Two passes, each exact under any split: db as dbias's column sums of
 * fl(dy * s[r]), ds one row per iteration (left to right). */
static opf_status scaled_dbias(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *s,
                               const opf_tensor *bias, opf_tensor *db, opf_tensor *ds)
{
    int64_t n = numel(db), rows = n ? numel(dy) / n : 0;
    opf_cpu_colsum(cdata(dy), dy->spec.dtype, cdata(s), s->spec.dtype, rows, n, data(db),
                   db->spec.dtype);
    ELEM_FOR(rows * n > PAR_MIN, r, rows, {
        float v[ELEM_BLOCK], b[ELEM_BLOCK], sum = 0.0f;
        for (int64_t j0 = 0; j0 < n; j0 += ELEM_BLOCK) {
            int64_t w = min64(ELEM_BLOCK, n - j0);
            opf_cpu_load_f32(cdata(dy), dy->spec.dtype, r * n + j0, w, v);
            opf_cpu_load_f32(cdata(bias), bias->spec.dtype, j0, w, b);
            for (int64_t j = 0; j < w; j++) sum += v[j] * b[j];
        }
        opf_cpu_store_f32(&sum, ds->spec.dtype, data(ds), r, 1);
    });
    return OPF_OK;
}

static opf_status scale(opf_ctx *ctx, const opf_tensor *x, float s, opf_tensor *y)
{
    int64_t n = numel(x), nb = nblocks(n);
    ELEM_FOR(n > PAR_MIN, b, nb, {
        int64_t i0 = b * ELEM_BLOCK, w = min64(ELEM_BLOCK, n - i0);
        float v[ELEM_BLOCK];
        opf_cpu_load_f32(cdata(x), x->spec.dtype, i0, w, v);
        for (int64_t i = 0; i < w; i++) v[i] = s * v[i];
        opf_cpu_store_f32(v, y->spec.dtype, data(y), i0, w);
    });
    return OPF_OK;
}

static opf_status add(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b, opf_tensor *out)
{
    int64_t n = numel(out), nb = nblocks(n);
    ELEM_FOR(n > PAR_MIN, k, nb, {
        int64_t i0 = k * ELEM_BLOCK, w = min64(ELEM_BLOCK, n - i0);
        float u[ELEM_BLOCK], v[ELEM_BLOCK];
        opf_cpu_load_f32(cdata(a), a->spec.dtype, i0, w, u);
        opf_cpu_load_f32(cdata(b), b->spec.dtype, i0, w, v);
        for (int64_t i = 0; i < w; i++) u[i] = u[i] + v[i];
        opf_cpu_store_f32(u, out->spec.dtype, data(out), i0, w);
    });
    return OPF_OK;
}

/* ---- Philox draws ---------------------------------------------------------------- */

/* words[i] = the Philox word of element i0 + i for i < w, i0 a multiple of 4:
 * word e % 4 of counter {offset + e/4, stream, 0} under key seed. */
static void philox_block(uint64_t seed, uint64_t offset, uint32_t stream, int64_t i0, int64_t w,
                         uint32_t *restrict words)
{
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    for (int64_t g = 0; g * 4 < w; g++) {
        uint64_t c = offset + (uint64_t)(i0 / 4 + g);
        const uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), stream, 0};
        uint32_t r[4];
        opf_philox4x32_10(ctr, key, r);
        for (int j = 0; j < 4 && 4 * g + j < w; j++) words[4 * g + j] = r[j];
    }
}

/* ---- dropout ----------------------------------------------------------------------- */

/* v[i] *= (mask[i] ? s : 0) for one block. */
static void apply_mask(float *restrict v, const uint8_t *restrict mask, float s, int64_t w)
{
    for (int64_t i = 0; i < w; i++) v[i] = v[i] * (mask[i] ? s : 0.0f);
}

static opf_status dropout_fwd(opf_ctx *ctx, const opf_tensor *x, double p, uint64_t seed,
                              uint64_t offset, opf_tensor *y, opf_tensor *mask)
{
    int64_t n = numel(x), nb = nblocks(n);
    const uint32_t thr = (uint32_t)(p * 4294967296.0);
    const float s = (float)(1.0 / (1.0 - p));
    uint8_t *m = data(mask);
    ELEM_FOR(n > PAR_MIN, b, nb, {
        int64_t i0 = b * ELEM_BLOCK, w = min64(ELEM_BLOCK, n - i0);
        float v[ELEM_BLOCK];
        uint32_t r[ELEM_BLOCK];
        philox_block(seed, offset, 0, i0, w, r);
        for (int64_t i = 0; i < w; i++) m[i0 + i] = r[i] >= thr;
        opf_cpu_load_f32(cdata(x), x->spec.dtype, i0, w, v);
        apply_mask(v, m + i0, s, w);
        opf_cpu_store_f32(v, y->spec.dtype, data(y), i0, w);
    });
    return OPF_OK;
}

static opf_status dropout_bwd(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *mask, double p,
                              opf_tensor *dx)
{
    int64_t n = numel(dy), nb = nblocks(n);
    const float s = (float)(1.0 / (1.0 - p));
    const uint8_t *m = cdata(mask);
    ELEM_FOR(n > PAR_MIN, b, nb, {
        int64_t i0 = b * ELEM_BLOCK, w = min64(ELEM_BLOCK, n - i0);
        float v[ELEM_BLOCK];
        opf_cpu_load_f32(cdata(dy), dy->spec.dtype, i0, w, v);
        apply_mask(v, m + i0, s, w);
        opf_cpu_store_f32(v, dx->spec.dtype, data(dx), i0, w);
    });
    return OPF_OK;
}

/* ---- cast, cast+transpose ---------------------------------------------------------------- */

static opf_status cast(opf_ctx *ctx, const opf_tensor *x, opf_tensor *y)
{
    int64_t n = numel(x), nb = nblocks(n);
    if (x->spec.dtype == y->spec.dtype)  /* the bits as they are (NaN payloads too) */
        return copy(ctx, cdata(x), data(y), opf_dtype_nbytes(x->spec.dtype, (size_t)n));
    ELEM_FOR(n > PAR_MIN, b, nb, {
        int64_t i0 = b * ELEM_BLOCK, w = min64(ELEM_BLOCK, n - i0);
        float v[ELEM_BLOCK];
        opf_cpu_load_f32(cdata(x), x->spec.dtype, i0, w, v);
        opf_cpu_store_f32(v, y->spec.dtype, data(y), i0, w);
    });
    return OPF_OK;
}

/* One TR_TILE x TR_TILE tile at (r0, c0) of x [R, C] into y_t [C, R]. */
static void transpose_tile(const opf_tensor *x, opf_tensor *y_t, int64_t R, int64_t C, int64_t r0,
                           int64_t c0)
{
    int64_t h = min64(TR_TILE, R - r0), w = min64(TR_TILE, C - c0);
    float t[TR_TILE][TR_TILE], col[TR_TILE];
    for (int64_t i = 0; i < h; i++)
        opf_cpu_load_f32(cdata(x), x->spec.dtype, (r0 + i) * C + c0, w, t[i]);
    for (int64_t j = 0; j < w; j++) {
        for (int64_t i = 0; i < h; i++) col[i] = t[i][j];
        opf_cpu_store_f32(col, y_t->spec.dtype, data(y_t), (c0 + j) * R + r0, h);
    }
}

static opf_status cast_transpose(opf_ctx *ctx, const opf_tensor *x, opf_tensor *y, opf_tensor *y_t)
{
    int64_t R, C;
    opf_shape_2d(&x->spec, &R, &C);
    opf_status st = y ? cast(ctx, x, y) : OPF_OK;
    if (st || R == 0 || C == 0) return st;
    int64_t tr = (R + TR_TILE - 1) / TR_TILE, tc = (C + TR_TILE - 1) / TR_TILE;
    #pragma omp parallel for schedule(static) if (R * C > PAR_MIN)
    for (int64_t k = 0; k < tr * tc; k++)
        transpose_tile(x, y_t, R, C, k / tc * TR_TILE, k % tc * TR_TILE);
    return OPF_OK;
}

/* ---- fill ---------------------------------------------------------------------------------- */

/* n copies of the elem_size-byte pattern at `one` into dst. */
static void fill_pattern(void *dst, const void *one, size_t elem_size, int64_t n)
{
    unsigned char *d = dst;
    #pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t i = 0; i < n; i++) memcpy(d + (size_t)i * elem_size, one, elem_size);
}

static opf_status fill(opf_ctx *ctx, double value, opf_tensor *t)
{
    int64_t n = numel(t);
    float f = (float)value;
    union { float f; uint16_t h; uint8_t u8; int32_t i32; int64_t i64; } one;
    switch (t->spec.dtype) {
    case OPF_F32: one.f = f; break;
    case OPF_BF16: one.h = opf_f32_to_bf16_impl(f); break;
    case OPF_F16: one.h = opf_f32_to_f16_impl(f); break;
    case OPF_U8: one.u8 = (uint8_t)value; break;
    case OPF_I32: one.i32 = (int32_t)value; break;
    case OPF_I64: one.i64 = (int64_t)value; break;
    default:  /* any other dtype takes zero only */
        if (n) memset(data(t), 0, opf_dtype_nbytes(t->spec.dtype, (size_t)n));
        return OPF_OK;
    }
    fill_pattern(data(t), &one, opf_dtype_nbytes(t->spec.dtype, 1), n);
    return OPF_OK;
}

static opf_status fill_uniform(opf_ctx *ctx, uint64_t seed, uint64_t offset, uint32_t stream,
                               double bound, opf_tensor *t)
{
    int64_t n = numel(t), nb = nblocks(n);
    ELEM_FOR(n > PAR_MIN, b, nb, {
        int64_t i0 = b * ELEM_BLOCK, w = min64(ELEM_BLOCK, n - i0);
        float v[ELEM_BLOCK];
        uint32_t r[ELEM_BLOCK];
        philox_block(seed, offset, stream, i0, w, r);
        for (int64_t i = 0; i < w; i++) {
            double u = (double)(r[i] >> 8) * (1.0 / 16777216.0);
            v[i] = (float)(bound * (2.0 * u - 1.0));
        }
        opf_cpu_store_f32(v, t->spec.dtype, data(t), i0, w);
    });
    return OPF_OK;
}

const opf_elem_kernels opf_cpu_elem = {
    .bias_add = bias_add,
    .dbias = dbias,
    .dbias_q = dbias_q,
    .scaled_bias_add = scaled_bias_add,
    .scaled_dbias = scaled_dbias,
    .scale = scale,
    .add = add,
    .dropout_fwd = dropout_fwd,
    .dropout_bwd = dropout_bwd,
    .cast = cast,
    .cast_transpose = cast_transpose,
    .fill = fill,
    .fill_uniform = fill_uniform,
    .copy = copy,
};
