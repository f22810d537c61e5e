/* norm.c: the CPU reference kernels for LayerNorm, RMSNorm and L2
 * normalization, forward and backward, and the add + RMSNorm backward. The
 * order of every fp32 operation is the one norm.h specifies. Rows run in
 * parallel, each on one thread with row buffers of its own; the column sums
 * of dgamma/dbeta run in blocks of columns. The order inside a row or a
 * column never changes, so no bit depends on the thread count. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "backend/cpu/cpu-impl.h"
#include "backend/backend-impl.h"
#include "backend/lanesum.h"
#include "core/core-impl.h"

enum {
    COL_BLOCK = 64,     /* columns per block of a column sum */
    PAR_MIN = 1 << 15,  /* below this many elements one thread is faster */
};

/* n floats of scratch (at least one), or NULL. */
static float *scratch(opf_ctx *ctx, int64_t n)
{
    return opf_ctx_scratch_push(ctx, (size_t)(n > 0 ? n : 1) * sizeof(float));
}

static opf_status no_scratch(opf_ctx *ctx, const char *who, size_t mark, int64_t n)
{
    opf_ctx_scratch_pop(ctx, mark);
    return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %lld floats", who, (long long)n);
}

/* ---- the sums (norm.h) ---------------------------------------------------------- */

/* One row's statistics: *mu = S(x_j) * rn and the returned
 * m2 = S(fl(d_j * d_j)), d_j = fl(x_j - mu); t (n floats) gets the squares. */
static float row_m2(const float *x, int64_t n, float rn, float *t, float *mu_out)
{
    float mu = opf_lane_sum(x, n) * rn;
    for (int64_t j = 0; j < n; j++) {
        float d = x[j] - mu;
        t[j] = d * d;
    }
    *mu_out = mu;
    return opf_lane_sum(t, n);
}

/* Column sums over the rows of [rows, H]: dg[j] = S_rows(fl(dz[r,j] * y[r,j]))
 * and, unless db is NULL, db[j] = S_rows(dz[r,j]), row r in lane r mod 32. */
static void param_grads(const float *dz, const float *y, int64_t rows, int64_t H, float *dg,
                        float *db, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t j0 = 0; j0 < H; j0 += COL_BLOCK) {
        int64_t w = j0 + COL_BLOCK < H ? COL_BLOCK : H - j0;
        float ag[OPF_NORM_LANES][COL_BLOCK], ab[OPF_NORM_LANES][COL_BLOCK];
        memset(ag, 0, sizeof ag);
        if (db) memset(ab, 0, sizeof ab);
        for (int64_t r = 0; r < rows; r++) {
            const float *dr = dz + r * H + j0, *yr = y + r * H + j0;
            float *qg = ag[r % OPF_NORM_LANES], *qb = ab[r % OPF_NORM_LANES];
            for (int64_t j = 0; j < w; j++) qg[j] += dr[j] * yr[j];
            if (db)
                for (int64_t j = 0; j < w; j++) qb[j] += dr[j];
        }
        opf_lane_fold_cols(&ag[0][0], COL_BLOCK, w);
        memcpy(dg + j0, ag[0], (size_t)w * sizeof(float));
        if (db) {
            opf_lane_fold_cols(&ab[0][0], COL_BLOCK, w);
            memcpy(db + j0, ab[0], (size_t)w * sizeof(float));
        }
    }
}

/* ---- rows in and out ------------------------------------------------------------ */

/* Row r of plain t ([rows, H]) as fp32 seen in dtype act: read in place when
 * t is f32 and act is f32; else widened into buf and, unless t is of dtype
 * act already (or act is f32), rounded to act. */
static const float *row_in(const opf_tensor *t, int64_t r, int64_t H, opf_dtype act, float *buf)
{
    opf_dtype dt = t->spec.dtype;
    if (dt == OPF_F32 && act == OPF_F32) return (const float *)t->data[0] + r * H;
    opf_cpu_load_f32(t->data[0], dt, r * H, H, buf);
    if (act == OPF_BF16 && dt != act)
        for (int64_t j = 0; j < H; j++) buf[j] = opf_bf16_to_f32_impl(opf_f32_to_bf16_impl(buf[j]));
    else if (act == OPF_F16 && dt != act)
        for (int64_t j = 0; j < H; j++) buf[j] = opf_f16_to_f32_impl(opf_f32_to_f16_impl(buf[j]));
    return buf;
}

/* Where row r of plain t is computed in fp32: in place when t is f32, else buf. */
static float *row_out(opf_tensor *t, int64_t r, int64_t H, float *buf)
{
    return t->spec.dtype == OPF_F32 ? (float *)t->data[0] + r * H : buf;
}

/* Writes n fp32 values v into plain t from element i0, each rounded once to
 * t's dtype (nothing to do when they were computed in place). */
static void store(const float *v, opf_tensor *t, int64_t i0, int64_t n)
{
    switch (t->spec.dtype) {
    case OPF_F32: {
        float *d = (float *)t->data[0] + i0;
        if (d != v) memcpy(d, v, (size_t)n * sizeof(float));
        break;
    }
    case OPF_BF16: {
        uint16_t *d = (uint16_t *)t->data[0] + i0;
        for (int64_t i = 0; i < n; i++) d[i] = opf_f32_to_bf16_impl(v[i]);
        break;
    }
    case OPF_F16: {
        uint16_t *d = (uint16_t *)t->data[0] + i0;
        for (int64_t i = 0; i < n; i++) d[i] = opf_f32_to_f16_impl(v[i]);
        break;
    }
    default:
        break;  /* unreachable: the ops validate dtypes */
    }
}

/* g_j = gamma_j (+ 1.0f zero-centred), H floats. */
static void load_gamma(const opf_tensor *w, bool zero_centered, float *g)
{
    int64_t H = w->spec.shape[0];
    opf_cpu_load_f32(w->data[0], w->spec.dtype, 0, H, g);
    if (zero_centered)
        for (int64_t j = 0; j < H; j++) g[j] = g[j] + 1.0f;
}

/* Per-thread row buffers: k rows of H floats for each thread. */
static float *thread_rows(float *bufs, int k, int64_t H)
{
    return bufs + (int64_t)omp_get_thread_num() * k * H;
}

/* Whether row_in copies t's rows: the backward then keeps a whole fp32
 * copy of dz (filled row by row) for the column sums of dgamma/dbeta. */
static bool needs_copy(const opf_tensor *t, opf_dtype act)
{
    return !(t->spec.dtype == OPF_F32 && act == OPF_F32);
}

/* ---- the workspace of a LayerNorm/RMSNorm call --------------------------------- */

typedef struct row_ws {
    opf_dtype act;   /* the compute dtype: gamma's */
    int64_t   H, rows;
    int       nt;    /* threads */
    float     rn;    /* fl(1/H) */
    size_t    mark;  /* the scratch to pop at the end */
    float    *g;     /* gamma in fp32 (+ 1 zero-centred), then n_vec - 1 more H-vectors */
    float    *bufs;  /* per-thread row buffers (thread_rows) */
    float    *y;     /* backward: [rows, H] y for the column sums */
    float    *dzs;   /* backward: dz in fp32 when row_in copies it, else NULL */
} row_ws;

/* Scratch for a call over x with gamma: n_vec H-vectors, k row buffers per
 * thread and, for a backward (dz not NULL), y and the copy of dz. */
static opf_status ws_begin(opf_ctx *ctx, const char *who, const opf_tensor *x,
                           const opf_tensor *gamma, bool zero_centered, const opf_tensor *dz,
                           int n_vec, int k, row_ws *w)
{
    w->act = gamma->spec.dtype;
    w->H = gamma->spec.shape[0];
    int64_t n = opf_spec_numel(&x->spec), H = w->H;
    w->rows = n / H;
    w->nt = opf_cpu_threads(ctx, n, PAR_MIN);
    w->rn = 1.0f / (float)H;
    w->mark = opf_ctx_scratch_mark(ctx);
    w->g = scratch(ctx, n_vec * H);
    w->bufs = scratch(ctx, (int64_t)w->nt * k * H);
    bool copy = dz && needs_copy(dz, w->act);
    w->y = dz ? scratch(ctx, n) : NULL;
    w->dzs = copy ? scratch(ctx, n) : NULL;
    if (!w->g || !w->bufs || (dz && !w->y) || (copy && !w->dzs))
        return no_scratch(ctx, who, w->mark, (n_vec + (int64_t)w->nt * k) * H + (dz ? 2 * n : 0));
    load_gamma(gamma, zero_centered, w->g);
    return OPF_OK;
}

/* The end of a backward: dgamma and, unless dbeta is NULL, dbeta from the
 * column sums (w->g + H and + 2H hold them), then the scratch popped. */
static void bwd_end(opf_ctx *ctx, const opf_tensor *dz, row_ws *w, opf_tensor *dgamma,
                    opf_tensor *dbeta)
{
    float *dg = w->g + w->H, *db = dbeta ? w->g + 2 * w->H : NULL;
    param_grads(w->dzs ? w->dzs : dz->data[0], w->y, w->rows, w->H, dg, db, w->nt);
    store(dg, dgamma, 0, w->H);
    if (dbeta) store(db, dbeta, 0, w->H);
    opf_ctx_scratch_pop(ctx, w->mark);
}

/* ---- LayerNorm (the row buffer z doubles as the terms being summed) ------------ */

static void ln_row_fwd(const float *x, int64_t H, float rn, float eps, const float *g,
                       const float *b, float *z, float *mu_out, float *rs_out)
{
    float mu;
    float m2 = row_m2(x, H, rn, z, &mu);
    float var = rn * m2;
    float rs = 1.0f / sqrtf(var + eps);
    for (int64_t j = 0; j < H; j++) {
        float y = rs * (x[j] - mu);
        float gy = g[j] * y;
        z[j] = gy + b[j];
    }
    *mu_out = mu;
    *rs_out = rs;
}

/* Writes y (kept for dgamma) and dx of one row. */
static void ln_row_bwd(const float *x, const float *dz, int64_t H, float rn, float mu, float rs,
                       const float *g, float *y, float *dx)
{
    for (int64_t j = 0; j < H; j++) {
        y[j] = rs * (x[j] - mu);
        dx[j] = g[j] * dz[j];
    }
    float a = opf_lane_sum(dx, H) * rn;
    for (int64_t j = 0; j < H; j++) dx[j] = dx[j] * y[j];
    float c = opf_lane_sum(dx, H) * rn;
    for (int64_t j = 0; j < H; j++) {
        float e = g[j] * dz[j];
        float cy = c * y[j];
        float t = cy + a;
        dx[j] = rs * (e - t);
    }
}

/* The rows of a LayerNorm (beta set) or RMSNorm (beta NULL) forward. Called
 * inside a parallel region, or alone when one thread does all the rows: a
 * region of one thread still costs a tiny tensor more than its rows (the
 * orphaned `omp for` then runs every row in order, the same bits). */
typedef struct ln_fwd_args {
    const row_ws     *w;
    const opf_tensor *x;
    opf_tensor       *z;
    float             eps;
    const float      *b;       /* LayerNorm's beta; NULL for RMSNorm */
    float            *mu, *rs;  /* mu NULL for RMSNorm */
} ln_fwd_args;

static void rms_row_fwd(const float *x, int64_t H, float rn, float eps, const float *g, float *z,
                        float *rs);

static void ln_fwd_rows(const ln_fwd_args *a)
{
    const row_ws *w = a->w;
    int64_t H = w->H;
    float *xb = thread_rows(w->bufs, 2, H), *zb = xb + H;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < w->rows; r++) {
        float *zr = row_out(a->z, r, H, zb);
        const float *xr = row_in(a->x, r, H, w->act, xb);
        if (a->b)
            ln_row_fwd(xr, H, w->rn, a->eps, w->g, a->b, zr, &a->mu[r], &a->rs[r]);
        else
            rms_row_fwd(xr, H, w->rn, a->eps, w->g, zr, &a->rs[r]);
        store(zr, a->z, r * H, H);
    }
}

static opf_status cpu_layernorm_fwd(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                    const opf_tensor *beta, float eps, bool zero_centered,
                                    opf_tensor *z, opf_tensor *mu_t, opf_tensor *rs_t)
{
    row_ws w;
    opf_status st = ws_begin(ctx, "layernorm_fwd", x, gamma, zero_centered, NULL, 2, 2, &w);
    if (st) return st;
    int64_t H = w.H;
    float *b = w.g + H, *mu = mu_t->data[0], *rs = rs_t->data[0];
    opf_cpu_load_f32(beta->data[0], beta->spec.dtype, 0, H, b);
    ln_fwd_args a = {&w, x, z, eps, b, mu, rs};
    if (w.nt > 1) {
#pragma omp parallel num_threads(w.nt)
        ln_fwd_rows(&a);
    } else {
        ln_fwd_rows(&a);
    }
    opf_ctx_scratch_pop(ctx, w.mark);
    return OPF_OK;
}

/* dx_j += dadd_j (fp32, dadd read unrounded) before dx's one rounding. */
static void add_row(float *dx, const opf_tensor *dadd, int64_t r, int64_t H, float *buf)
{
    const float *a = row_in(dadd, r, H, OPF_F32, buf);
    for (int64_t j = 0; j < H; j++) dx[j] = dx[j] + a[j];
}

static opf_status cpu_layernorm_bwd(opf_ctx *ctx, const opf_tensor *dz, const opf_tensor *x,
                                    const opf_tensor *mu_t, const opf_tensor *rs_t,
                                    const opf_tensor *gamma, bool zero_centered,
                                    const opf_tensor *dadd, opf_tensor *dx, opf_tensor *dgamma,
                                    opf_tensor *dbeta)
{
    row_ws w;
    opf_status st = ws_begin(ctx, "layernorm_bwd", x, gamma, zero_centered, dz, 3, 3, &w);
    if (st) return st;
    int64_t H = w.H;
    const float *mu = mu_t->data[0], *rs = rs_t->data[0];
#pragma omp parallel num_threads(w.nt)
    {
        float *xb = thread_rows(w.bufs, 3, H), *dxb = xb + H, *ab = dxb + H;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < w.rows; r++) {
            const float *dzr = row_in(dz, r, H, w.act, w.dzs ? w.dzs + r * H : NULL);
            float *dxr = row_out(dx, r, H, dxb);
            ln_row_bwd(row_in(x, r, H, w.act, xb), dzr, H, w.rn, mu[r], rs[r], w.g, w.y + r * H,
                       dxr);
            if (dadd) add_row(dxr, dadd, r, H, ab);
            store(dxr, dx, r * H, H);
        }
    }
    bwd_end(ctx, dz, &w, dgamma, dbeta);
    return OPF_OK;
}

/* ---- RMSNorm --------------------------------------------------------------------- */

static void rms_row_fwd(const float *x, int64_t H, float rn, float eps, const float *g, float *z,
                        float *rs_out)
{
    float mu;
    float m2 = row_m2(x, H, rn, z, &mu);
    float var = rn * m2;
    float mu2 = mu * mu;
    float ms = var + mu2;
    float rs = 1.0f / sqrtf(ms + eps);
    for (int64_t j = 0; j < H; j++) {
        float y = rs * x[j];
        z[j] = g[j] * y;
    }
    *rs_out = rs;
}

/* Writes y (kept for dgamma) and dx of one row. */
static void rms_row_bwd(const float *x, const float *dz, int64_t H, float rn, float rs,
                        const float *g, float *y, float *dx)
{
    for (int64_t j = 0; j < H; j++) {
        y[j] = rs * x[j];
        float e = g[j] * dz[j];
        dx[j] = e * y[j];
    }
    float c = opf_lane_sum(dx, H) * rn;
    for (int64_t j = 0; j < H; j++) {
        float e = g[j] * dz[j];
        float cy = c * y[j];
        dx[j] = rs * (e - cy);
    }
}

static opf_status cpu_rmsnorm_fwd(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                  float eps, bool zero_centered, opf_tensor *z, opf_tensor *rs_t)
{
    row_ws w;
    opf_status st = ws_begin(ctx, "rmsnorm_fwd", x, gamma, zero_centered, NULL, 1, 2, &w);
    if (st) return st;
    ln_fwd_args a = {&w, x, z, eps, NULL, NULL, rs_t->data[0]};
    if (w.nt > 1) {
#pragma omp parallel num_threads(w.nt)
        ln_fwd_rows(&a);
    } else {
        ln_fwd_rows(&a);
    }
    opf_ctx_scratch_pop(ctx, w.mark);
    return OPF_OK;
}

static opf_status cpu_rmsnorm_bwd(opf_ctx *ctx, const opf_tensor *dz, const opf_tensor *x,
                                  const opf_tensor *rs_t, const opf_tensor *gamma,
                                  bool zero_centered, const opf_tensor *dadd, opf_tensor *dx,
                                  opf_tensor *dgamma)
{
    row_ws w;
    opf_status st = ws_begin(ctx, "rmsnorm_bwd", x, gamma, zero_centered, dz, 2, 3, &w);
    if (st) return st;
    int64_t H = w.H;
    const float *rs = rs_t->data[0];
#pragma omp parallel num_threads(w.nt)
    {
        float *xb = thread_rows(w.bufs, 3, H), *dxb = xb + H, *ab = dxb + H;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < w.rows; r++) {
            const float *dzr = row_in(dz, r, H, w.act, w.dzs ? w.dzs + r * H : NULL);
            float *dxr = row_out(dx, r, H, dxb);
            rms_row_bwd(row_in(x, r, H, w.act, xb), dzr, H, w.rn, rs[r], w.g, w.y + r * H, dxr);
            if (dadd) add_row(dxr, dadd, r, H, ab);
            store(dxr, dx, r * H, H);
        }
    }
    bwd_end(ctx, dz, &w, dgamma, NULL);
    return OPF_OK;
}

/* ---- L2 normalization (the row buffer y doubles as the squares) ----------------- */

static void l2n_row_fwd(const float *x, int64_t H, float eps, float *y, float *r_out)
{
    for (int64_t j = 0; j < H; j++) y[j] = x[j] * x[j];
    float r = 1.0f / sqrtf(opf_lane_sum(y, H) + eps);
    for (int64_t j = 0; j < H; j++) y[j] = x[j] * r;
    *r_out = r;
}

static void l2n_row_bwd(const float *x, const float *dy, int64_t H, float r, float *dx)
{
    for (int64_t j = 0; j < H; j++) {
        float y = x[j] * r;
        dx[j] = dy[j] * y;
    }
    float c = opf_lane_sum(dx, H);
    for (int64_t j = 0; j < H; j++) {
        float y = x[j] * r;
        float cy = c * y;
        dx[j] = r * (dy[j] - cy);
    }
}

/* The last dim of t and its rows (0 rows when H is 0). */
static int64_t rows_of(const opf_tensor *t, int64_t *H)
{
    *H = t->spec.shape[t->spec.ndim - 1];
    return *H ? opf_spec_numel(&t->spec) / *H : 0;
}

static opf_status cpu_l2norm_fwd(opf_ctx *ctx, const opf_tensor *x, float eps, opf_tensor *y,
                                 opf_tensor *rnorm)
{
    int64_t H, rows = rows_of(x, &H);
    int nt = opf_cpu_threads(ctx, rows * H, PAR_MIN);
    size_t mark = opf_ctx_scratch_mark(ctx);
    float *bufs = scratch(ctx, (int64_t)nt * 2 * H), *rn = rnorm->data[0];
    if (!bufs) return no_scratch(ctx, "l2norm_fwd", mark, (int64_t)nt * 2 * H);
#pragma omp parallel num_threads(nt)
    {
        float *xb = thread_rows(bufs, 2, H), *yb = xb + H;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *yr = row_out(y, r, H, yb);
            l2n_row_fwd(row_in(x, r, H, y->spec.dtype, xb), H, eps, yr, &rn[r]);
            store(yr, y, r * H, H);
        }
    }
    opf_ctx_scratch_pop(ctx, mark);
    return OPF_OK;
}

static opf_status cpu_l2norm_bwd(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *x,
                                 const opf_tensor *rnorm, opf_tensor *dx)
{
    int64_t H, rows = rows_of(x, &H);
    int nt = opf_cpu_threads(ctx, rows * H, PAR_MIN);
    size_t mark = opf_ctx_scratch_mark(ctx);
    float *bufs = scratch(ctx, (int64_t)nt * 3 * H);
    if (!bufs) return no_scratch(ctx, "l2norm_bwd", mark, (int64_t)nt * 3 * H);
    const float *rn = rnorm->data[0];
#pragma omp parallel num_threads(nt)
    {
        float *xb = thread_rows(bufs, 3, H), *dyb = xb + H, *dxb = dyb + H;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *dxr = row_out(dx, r, H, dxb);
            l2n_row_bwd(row_in(x, r, H, dx->spec.dtype, xb), row_in(dy, r, H, OPF_F32, dyb), H,
                        rn[r], dxr);
            store(dxr, dx, r * H, H);
        }
    }
    opf_ctx_scratch_pop(ctx, mark);
    return OPF_OK;
}

/* ---- a quantized z: the composition (norm.h, qout.h) --------------------- */

opf_status opf_norm_fwd_q_composed(opf_ctx *ctx, const opf_backend_i *be, const opf_tensor *x,
                                   const opf_tensor *gamma, const opf_tensor *beta, float eps,
                                   bool zero_centered, const opf_qout *z, opf_tensor *mu,
                                   opf_tensor *rsigma)
{
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_tensor t;
    opf_status st = opf_qout_begin(ctx, z, &t);
    if (!st && beta)
        st = be->norm->layernorm_fwd(ctx, x, gamma, beta, eps, zero_centered, &t, mu, rsigma);
    else if (!st)
        st = be->norm->rmsnorm_fwd(ctx, x, gamma, eps, zero_centered, &t, rsigma);
    if (!st) st = opf_qout_end(ctx, be, z, &t);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static opf_status cpu_layernorm_fwd_q(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                      const opf_tensor *beta, float eps, bool zero_centered,
                                      const opf_qout *z, opf_tensor *mu, opf_tensor *rsigma)
{
    return opf_norm_fwd_q_composed(ctx, opf_backend_get(OPF_DEVICE_CPU), x, gamma, beta, eps,
                                   zero_centered, z, mu, rsigma);
}

static opf_status cpu_rmsnorm_fwd_q(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                    float eps, bool zero_centered, const opf_qout *z,
                                    opf_tensor *rsigma)
{
    return opf_norm_fwd_q_composed(ctx, opf_backend_get(OPF_DEVICE_CPU), x, gamma, NULL, eps,
                                   zero_centered, z, NULL, rsigma);
}

const opf_norm_kernels opf_cpu_norm = {
    .layernorm_fwd = cpu_layernorm_fwd,
    .layernorm_bwd = cpu_layernorm_bwd,
    .rmsnorm_fwd = cpu_rmsnorm_fwd,
    .rmsnorm_bwd = cpu_rmsnorm_bwd,
    .l2norm_fwd = cpu_l2norm_fwd,
    .l2norm_bwd = cpu_l2norm_bwd,
    .layernorm_fwd_q = cpu_layernorm_fwd_q,
    .rmsnorm_fwd_q = cpu_rmsnorm_fwd_q,
};
