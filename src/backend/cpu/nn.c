/* nn.c: the CPU reference kernels of backend/nn.h (embedding, causal
 * attention, cross-entropy, sum of squares), in the order nn.h fixes. Work
 * is split over independent units (rows, columns, batch x head, chunks
 * summed in order afterwards), so the bits never depend on the thread count. */
#include <math.h>
#include <string.h>

#include "backend/cpu/act-math.h"
#include "backend/cpu/cpu-impl.h"
#include "backend/elem.h"
#include "backend/lanesum.h"
#include "backend/nn.h"
#include "core/core-impl.h"

enum { SUMSQ_CHUNK = 4096, PAR_MIN = 1 << 14 };

static opf_status embed_fwd(opf_ctx *ctx, const int32_t *tok, const float *wte, const float *wpe,
                            float *y, int64_t rows, int64_t T, int64_t C, int64_t V)
{
    for (int64_t r = 0; r < rows; r++)
        if (tok[r] < 0 || tok[r] >= V)
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "embedding: token %d at row %lld is outside "
                             "the vocabulary [0, %lld)", (int)tok[r], (long long)r, (long long)V);
#pragma omp parallel for schedule(static) if (rows * C >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *e = wte + (int64_t)tok[r] * C, *p = wpe + (r % T) * C;
        float *o = y + r * C;
        for (int64_t c = 0; c < C; c++) o[c] = e[c] + p[c];
    }
    return OPF_OK;
}

/* Columns split across threads; each walks every row in order. */
static opf_status embed_bwd(opf_ctx *ctx, const int32_t *tok, const float *dy, float *dwte,
                            float *dwpe, int64_t rows, int64_t T, int64_t C, int64_t V, int64_t P)
{
    memset(dwte, 0, sizeof(float) * (size_t)(V * C));
    memset(dwpe, 0, sizeof(float) * (size_t)(P * C));
#pragma omp parallel for schedule(static) if (rows * C >= PAR_MIN)
    for (int64_t c = 0; c < C; c++)
        for (int64_t r = 0; r < rows; r++) {
            float g = dy[r * C + c];
            dwte[(int64_t)tok[r] * C + c] += g;
            dwpe[(r % T) * C + c] += g;
        }
    return OPF_OK;
}

/* ---- causal attention -------------------------------------------------------
 * nn.h fixes the order: q_i . k_j is a dot product left to right over d;
 * the forward's softmax runs online over j = 0..i, one key at a time
 * (running max m, sum l, accumulator acc rescaled by expf(m - m')); the
 * backward walks rows i in order and keys j = 0..i within a row, adding
 * p dO into dv_j, ds k_j into dq_i and ds q_i into dk_j.
 *
 * The dots of a row do not depend on each other, so a row computes all of
 * them at once against a transposed copy of the head's K (and V), the keys
 * across the vector lanes and d in order within each: every dot is still
 * the same left-to-right sum. Likewise the expf calls of a row run in a loop
 * of their own, once the running maxes they need are known, so they
 * overlap; expf(0) is 1 exactly (C17 F.10.3.1), so a running max that did
 * not move costs no call. What chains from key to key (acc, l, dq) runs for
 * ROWS rows side by side, key by key: each row's chain is the same, and the
 * chains overlap instead of waiting on each other. dv_j and dk_j still take
 * their rows' terms in ascending i. */

enum { ROWS = 4, KEYS = 16 };  /* rows side by side; keys of a dots block */

/* The per-head work arrays, rows of ld = T rounded up to KEYS floats (the
 * padding zero): K and V transposed ([D][ld]), then for each of ROWS rows
 * its scores, second dots and two factors ([ld] each). */
typedef struct attn_ws { float *kt, *vt, *s, *s2, *f1, *f2; int64_t ld; } attn_ws;

static int64_t attn_ws_ld(int64_t T) { return (T + KEYS - 1) / KEYS * KEYS; }

static size_t attn_ws_floats(int64_t T, int64_t D)
{
    return (size_t)((2 * D + 4 * ROWS) * attn_ws_ld(T));
}

/* Row r's arrays are at r * ld of each. */
static attn_ws attn_ws_at(float *base, int64_t T, int64_t D)
{
    int64_t ld = attn_ws_ld(T);
    attn_ws w = {base, base + ld * D, base + 2 * ld * D, 0, 0, 0, ld};
    w.s2 = w.s + ROWS * ld, w.f1 = w.s2 + ROWS * ld, w.f2 = w.f1 + ROWS * ld;
    return w;
}

/* expf(x), with the call skipped for x = 0 (the result is the same 1). */
static inline float exp_or_one(float x) { return x == 0.0f ? 1.0f : expf(x); }

/* dst[d][j] = x_j[d] for rows j < T of stride ldx, dst's rows ld long
 * and zero past T. */
static void transpose_head(const float *x, int64_t ldx, int64_t T, int64_t D, int64_t ld,
                           float *restrict dst)
{
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = T; j < ld; j++) dst[d * ld + j] = 0.0f;
    for (int64_t j = 0; j < T; j++)
        for (int64_t d = 0; d < D; d++) dst[d * ld + j] = x[j * ldx + d];
}

/* out[j] = a . x_j (left to right over d) for j < n rounded up to KEYS, xt
 * transposed [D][ld]: a block of KEYS dots at a time, its sums in registers. */
static void dots(const float *a, const float *restrict xt, int64_t ld, int64_t D, int64_t n,
                 float *restrict out)
{
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
        float acc[KEYS] = {0};
        for (int64_t d = 0; d < D; d++) {
            const float *restrict x = xt + d * ld + j0;
            float ad = a[d];
#pragma omp simd
            for (int j = 0; j < KEYS; j++) acc[j] += ad * x[j];
        }
        for (int j = 0; j < KEYS; j++) out[j0 + j] = acc[j];
    }
}

static float dot(const float *a, const float *b, int64_t n)
{
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One (batch, head) of the forward, ROWS rows at a time. Inlined into
 * attn_fwd_head once per common head size, a constant D there. */
static inline __attribute__((always_inline)) void
attn_fwd_head_d(const float *qkv, float *o, float *lse, int64_t T, int64_t C, int64_t D,
                float scale, attn_ws w)
{
    transpose_head(qkv + C, 3 * C, T, D, w.ld, w.kt);
    for (int64_t i0 = 0; i0 < T; i0 += ROWS) {
        int nr = T - i0 < ROWS ? (int)(T - i0) : ROWS;
        float m[ROWS], l[ROWS];
        for (int r = 0; r < nr; r++) {
            int64_t i = i0 + r;
            float *s = w.s + r * w.ld, *f1 = w.f1 + r * w.ld, *f2 = w.f2 + r * w.ld;
            dots(qkv + i * 3 * C, w.kt, w.ld, D, i + 1, s);
            /* the running max before and after each key, then the factors
             * c = e^(m - m') and p = e^(s - m') */
            float mr = -INFINITY;
            for (int64_t j = 0; j <= i; j++) {
                float sj = s[j] * scale, mn = sj > mr ? sj : mr;
                s[j] = sj, f1[j] = mr, f2[j] = mn;
                mr = mn;
            }
            for (int64_t j = 0; j <= i; j++) {
                float c = exp_or_one(f1[j] - f2[j]), pj = exp_or_one(s[j] - f2[j]);
                f1[j] = c, f2[j] = pj;
            }
            float *acc = o + i * C;
            for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
            m[r] = mr, l[r] = 0.0f;
        }
        /* l = l c + p, acc = acc c + p v_j, key by key, the rows side by side */
        for (int64_t j = 0; j < i0 + nr; j++) {
            const float *restrict v = qkv + j * 3 * C + 2 * C;
            for (int r = (int)(j > i0 ? j - i0 : 0); r < nr; r++) {
                float *restrict acc = o + (i0 + r) * C;
                float c = w.f1[r * w.ld + j], pj = w.f2[r * w.ld + j];
                l[r] = l[r] * c + pj;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[d] = acc[d] * c + pj * v[d];
            }
        }
        for (int r = 0; r < nr; r++) {
            float *acc = o + (i0 + r) * C;
            for (int64_t d = 0; d < D; d++) acc[d] = acc[d] / l[r];
            lse[i0 + r] = m[r] + logf(l[r]);
        }
    }
}

/* One (batch, head) of the backward, ROWS rows at a time; its dq, dk, dv
 * columns are its own. Inlined as attn_fwd_head_d is. */
static inline __attribute__((always_inline)) void
attn_bwd_head_d(const float *qkv, const float *o, const float *lse, const float *dout,
                float *dqkv, int64_t T, int64_t C, int64_t D, float scale, attn_ws w)
{
    transpose_head(qkv + C, 3 * C, T, D, w.ld, w.kt);
    transpose_head(qkv + 2 * C, 3 * C, T, D, w.ld, w.vt);
    for (int64_t i = 0; i < T; i++)
        for (int64_t d = 0; d < D; d++)
            dqkv[i * 3 * C + d] = dqkv[i * 3 * C + C + d] = dqkv[i * 3 * C + 2 * C + d] = 0.0f;
    for (int64_t i0 = 0; i0 < T; i0 += ROWS) {
        int nr = T - i0 < ROWS ? (int)(T - i0) : ROWS;
        for (int r = 0; r < nr; r++) {
            int64_t i = i0 + r;
            const float *dO = dout + i * C;
            float *s = w.s + r * w.ld, *s2 = w.s2 + r * w.ld, Di = dot(dO, o + i * C, D);
            dots(qkv + i * 3 * C, w.kt, w.ld, D, i + 1, s);
            dots(dO, w.vt, w.ld, D, i + 1, s2);
            for (int64_t j = 0; j <= i; j++) {  /* p and ds */
                float p = expf(s[j] * scale - lse[i]);
                w.f1[r * w.ld + j] = p, w.f2[r * w.ld + j] = p * (s2[j] - Di) * scale;
            }
        }
        for (int64_t j = 0; j < i0 + nr; j++) {
            const float *restrict k = qkv + j * 3 * C + C;
            float *restrict dk = dqkv + j * 3 * C + C, *restrict dv = dk + C;
            for (int r = (int)(j > i0 ? j - i0 : 0); r < nr; r++) {
                int64_t i = i0 + r;
                const float *restrict q = qkv + i * 3 * C, *restrict dO = dout + i * C;
                float *restrict dq = dqkv + i * 3 * C;
                float p = w.f1[r * w.ld + j], ds = w.f2[r * w.ld + j];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) dv[d] += p * dO[d];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) dq[d] += ds * k[d];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) dk[d] += ds * q[d];
            }
        }
    }
}

/* The heads with D a constant where it is one of the common sizes (whole
 * vectors, no remainder loops), else as it comes. */
#define ATTN_BY_D(call, D)                                                     \
    switch (D) {                                                               \
    case 16: call(16); break;                                                  \
    case 32: call(32); break;                                                  \
    case 64: call(64); break;                                                  \
    case 128: call(128); break;                                                \
    default: call(D); break;                                                   \
    }

static void attn_fwd_head(const float *qkv, float *o, float *lse, int64_t T, int64_t C, int64_t D,
                          float scale, attn_ws w)
{
#define FWD(d) attn_fwd_head_d(qkv, o, lse, T, C, d, scale, w)
    ATTN_BY_D(FWD, D)
#undef FWD
}

static void attn_bwd_head(const float *qkv, const float *o, const float *lse, const float *dout,
                          float *dqkv, int64_t T, int64_t C, int64_t D, float scale, attn_ws w)
{
#define BWD(d) attn_bwd_head_d(qkv, o, lse, dout, dqkv, T, C, d, scale, w)
    ATTN_BY_D(BWD, D)
#undef BWD
}

/* ---- attention's storage dtypes ---------------------------------------------------
 * The heads run on fp32; a 16-bit qkv, o, do or dqkv goes through an fp32
 * copy in the context's scratch (widening is exact, and o and dqkv round
 * once at the end: the bits of an fp32 run, rounded). */

/* n fp32 values of scratch for `what`, or NULL with the error set. */
static float *attn_scratch(opf_ctx *ctx, const char *what, int64_t n, opf_status *st)
{
    size_t bytes = sizeof(float) * (size_t)(n > 0 ? n : 1);
    float *p = opf_ctx_scratch_push(ctx, bytes);
    if (!p) *st = opf_error(ctx, OPF_ERR_NO_MEMORY, "attention: no scratch for %s (%zu bytes)",
                            what, bytes);
    return p;
}

/* *v: x (n values of dtype t) as fp32: x itself when f32, else a copy. */
static opf_status attn_widen(opf_ctx *ctx, const char *what, const void *x, opf_dtype t,
                             int64_t n, const float **v)
{
    if (t == OPF_F32) {
        *v = x;
        return OPF_OK;
    }
    opf_status st = OPF_OK;
    float *w = attn_scratch(ctx, what, n, &st);
    if (w) opf_cpu_load_f32(x, t, 0, n, w);
    *v = w;
    return st;
}

/* Threads for the heads of a call and their work arrays in scratch (NULL
 * with the error set when there is none). */
static float *attn_ws_alloc(opf_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t D, int *nt,
                            opf_status *st)
{
    *nt = B * H > 1 ? opf_cpu_threads(ctx, T * T * H * D, PAR_MIN) : 1;
    return attn_scratch(ctx, "the heads' work arrays", (int64_t)*nt * attn_ws_floats(T, D), st);
}

static opf_status attn_fwd(opf_ctx *ctx, const void *qkv_in, opf_dtype qkv_t, void *o_out,
                           opf_dtype o_t, float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                           opf_dtype in_dt)
{
    int64_t C = H * D, no = B * T * C;
    float scale = 1.0f / sqrtf((float)D);
    size_t mark = opf_ctx_scratch_mark(ctx);
    const float *qkv;
    float *o = o_out, *ws = NULL;
    int nt;
    opf_status st = attn_widen(ctx, "the fp32 copy of qkv", qkv_in, qkv_t, B * T * 3 * C, &qkv);
    if (!st && o_t != OPF_F32) o = attn_scratch(ctx, "the fp32 o", no, &st);
    if (!st) ws = attn_ws_alloc(ctx, B, T, H, D, &nt, &st);
    if (!st) {
#pragma omp parallel for num_threads(nt) schedule(dynamic)
        for (int64_t bh = 0; bh < B * H; bh++) {
            int64_t b = bh / H, h = bh % H;
            attn_ws w = attn_ws_at(ws + omp_get_thread_num() * attn_ws_floats(T, D), T, D);
            attn_fwd_head(qkv + b * T * 3 * C + h * D, o + b * T * C + h * D, lse + bh * T, T,
                          C, D, scale, w);
        }
        if (o != o_out) opf_cpu_store_f32(o, o_t, o_out, 0, no);
    }
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static void attn_bwd_heads(const float *qkv, const float *o, const float *lse, const float *dout,
                           float *dqkv, int64_t B, int64_t T, int64_t H, int64_t D, float *ws,
                           int nt)
{
    int64_t C = H * D;
    float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel for num_threads(nt) schedule(dynamic)
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        attn_ws w = attn_ws_at(ws + omp_get_thread_num() * attn_ws_floats(T, D), T, D);
        attn_bwd_head(qkv + b * T * 3 * C + h * D, o + b * T * C + h * D, lse + bh * T,
                      dout + b * T * C + h * D, dqkv + b * T * 3 * C + h * D, T, C, D, scale, w);
    }
}

static opf_status attn_bwd(opf_ctx *ctx, const void *qkv_in, opf_dtype qkv_t, const void *o_in,
                           opf_dtype o_t, const float *lse, const void *dout_in, opf_dtype dout_t,
                           void *dqkv_out, opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H,
                           int64_t D, opf_dtype in_dt)
{
    int64_t nq = B * T * 3 * H * D, no = B * T * H * D;
    size_t mark = opf_ctx_scratch_mark(ctx);
    const float *qkv, *o, *dout;
    float *dqkv = dqkv_out;
    opf_status st = attn_widen(ctx, "the fp32 copy of qkv", qkv_in, qkv_t, nq, &qkv);
    if (!st) st = attn_widen(ctx, "the fp32 copy of o", o_in, o_t, no, &o);
    if (!st) st = attn_widen(ctx, "the fp32 copy of do", dout_in, dout_t, no, &dout);
    if (!st && dqkv_t != OPF_F32) dqkv = attn_scratch(ctx, "the fp32 copy of dqkv", nq, &st);
    int nt;
    float *ws = st ? NULL : attn_ws_alloc(ctx, B, T, H, D, &nt, &st);
    if (!st) {
        attn_bwd_heads(qkv, o, lse, dout, dqkv, B, T, H, D, ws, nt);
        if (dqkv != dqkv_out) opf_cpu_store_f32(dqkv, dqkv_t, dqkv_out, 0, nq);
    }
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

/* Row r of x (dtype xt) is read XENT_BLOCK values at a time into fp32 on
 * the stack: a multiple of 32, so value j is in lane j mod 32 of its block. */
enum { XENT_BLOCK = 1024 };

/* lse of row r: m + logf(S(expf(x_j - m))), m the max (x_0 when it is NaN),
 * expf act-math.h's (nn.h). */
static float row_lse(const void *x, opf_dtype xt, int64_t r, int64_t V)
{
    float v[XENT_BLOCK], m = 0.0f, p[OPF_SUM_LANES] = {0};
    for (int64_t j0 = 0; j0 < V; j0 += XENT_BLOCK) {
        int64_t w = V - j0 < XENT_BLOCK ? V - j0 : XENT_BLOCK;
        opf_cpu_load_f32(x, xt, r * V + j0, w, v);
        if (j0 == 0) m = v[0];
        for (int64_t j = 0; j < w; j++) m = v[j] > m ? v[j] : m;
    }
    for (int64_t j0 = 0; j0 < V; j0 += XENT_BLOCK) {
        int64_t w = V - j0 < XENT_BLOCK ? V - j0 : XENT_BLOCK;
        opf_cpu_load_f32(x, xt, r * V + j0, w, v);
        for (int64_t j = 0; j < w; j++) p[j % OPF_SUM_LANES] += opf_expf_impl(v[j] - m);
    }
    return m + logf(opf_lane_fold(p));
}

static int64_t count_targets(const int32_t *tgt, int64_t rows)
{
    int64_t n = 0;
    for (int64_t r = 0; r < rows; r++) n += tgt[r] >= 0;
    return n;
}

static opf_status xent_fwd(opf_ctx *ctx, const void *x, opf_dtype xt, const int32_t *tgt,
                           float *lse, float *loss, int64_t rows, int64_t V)
{
#pragma omp parallel for schedule(static) if (rows * V >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) lse[r] = tgt[r] >= 0 ? row_lse(x, xt, r, V) : 0.0f;
    double s = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        float xt_r;
        if (tgt[r] < 0) continue;
        opf_cpu_load_f32(x, xt, r * V + tgt[r], 1, &xt_r);
        s += (double)(lse[r] - xt_r);
    }
    int64_t n = count_targets(tgt, rows);
    loss[0] = n ? (float)(s / (double)n) : 0.0f;
    return OPF_OK;
}

static opf_status xent_bwd(opf_ctx *ctx, const void *x, opf_dtype xt, const int32_t *tgt,
                           const float *lse, const float *dloss, void *dx, opf_dtype dxt,
                           int64_t rows, int64_t V)
{
    int64_t n = count_targets(tgt, rows);
    float g = n ? dloss[0] / (float)n : 0.0f;
#pragma omp parallel for schedule(static) if (rows * V >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float v[XENT_BLOCK];
        for (int64_t j0 = 0; j0 < V; j0 += XENT_BLOCK) {
            int64_t w = V - j0 < XENT_BLOCK ? V - j0 : XENT_BLOCK;
            opf_cpu_load_f32(x, xt, r * V + j0, w, v);
            for (int64_t j = 0; j < w; j++)
                v[j] = tgt[r] < 0 ? 0.0f : (opf_expf_impl(v[j] - lse[r]) - (j0 + j == tgt[r])) * g;
            opf_cpu_store_f32(v, dxt, dx, r * V + j0, w);
        }
    }
    return OPF_OK;
}

/* lanesum.h's order in double, twice: each chunk of SUMSQ_CHUNK values is a
 * lane sum of its squares (lane l = i mod 32 in the chunk), then the chunk
 * sums are one (chunk c in lane c mod 32): lane l adds its chunks' sums in
 * chunk order, the lanes on the threads. */
static opf_status sumsq(opf_ctx *ctx, const void *x, opf_dtype dt, int64_t n, double *out)
{
    int64_t nc = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    double lanes[OPF_SUM_LANES] = {0};
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
    for (int l = 0; l < OPF_SUM_LANES; l++)
        for (int64_t c = l; c < nc; c += OPF_SUM_LANES) {
            float buf[SUMSQ_CHUNK];
            double p[OPF_SUM_LANES] = {0};
            int64_t i0 = c * SUMSQ_CHUNK, len = n - i0 < SUMSQ_CHUNK ? n - i0 : SUMSQ_CHUNK;
            opf_cpu_load_f32(x, dt, i0, len, buf);
            for (int64_t i = 0; i < len; i++) p[i % OPF_SUM_LANES] += (double)buf[i] * buf[i];
            lanes[l] += opf_lane_fold_d(p);
        }
    *out = opf_lane_fold_d(lanes);
    return OPF_OK;
}

static opf_status sumsq_acc(opf_ctx *ctx, const opf_nn_span *x, int count, double *acc, bool add)
{
    for (int k = 0; k < count; k++) {
        double s;
        opf_status st = sumsq(ctx, x[k].x, x[k].dt, x[k].n, &s);
        if (st) return st;
        *acc = add || k ? *acc + s : s;
    }
    return OPF_OK;
}

/* The factor's multiply is the element-wise scale entry's. */
static opf_status clip_scale(opf_ctx *ctx, const opf_nn_span *x, int count, const double *sumsq,
                             double max_norm)
{
    double norm = sqrt(*sumsq);
    if (!isfinite(norm) || norm <= max_norm) return OPF_OK;
    float f = (float)(max_norm / (norm + 1e-6));
    for (int k = 0; k < count; k++) {
        if (x[k].n <= 0) continue;
        opf_tensor t;
        opf_status st = opf_tensor_wrap(&(opf_spec){.ndim = 1, .shape = {x[k].n}, .dtype = x[k].dt},
                                        x[k].x, &t);
        if (!st) st = opf_cpu_elem.scale(ctx, &t, f, &t);
        if (st) return st;
    }
    return OPF_OK;
}

const opf_nn_kernels opf_cpu_nn = {
    .embed_fwd = embed_fwd,
    .embed_bwd = embed_bwd,
    .attn_fwd = attn_fwd,
    .attn_bwd = attn_bwd,
    .xent_fwd = xent_fwd,
    .xent_bwd = xent_bwd,
    .sumsq = sumsq,
    .sumsq_acc = sumsq_acc,
    .clip_scale = clip_scale,
};
