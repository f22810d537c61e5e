/* layernorm.c: "layernorm", LayerNorm over the last dim (numerics.md 6.1,
 * 6.2; te-ops.md section 5). Parameters weight (gamma: ones, or zeros when
 * zero-centred) and bias (beta: zeros) of the config's dtype. The input is
 * taken in that dtype, as TE casts it to the module dtype: decoded, and
 * rounded to the dtype when it arrives in another one or quantized. Every
 * step is fp32; the output is rounded to the dtype or quantized with the
 * next op's input quantizer, dx likewise with the previous op's grad-output
 * quantizer. Saved for backward: x, mu and rsigma ([rows] fp32 each).
 *
 * The exact fp32 order, per row of H values, rn = fl(1/H), no FMA. Every
 * sum S(t_j) is taken like a warp's reduction (TE reduces in trees): lane
 * l = j mod 32 adds its terms left to right, then the 32 lanes fold in
 * halves (lane i += lane i+16, then i+8, i+4, i+2, i+1); a sequential sum
 * loses too much to an offset mean in fp32.
 *   mu   = S(x_j) * rn
 *   m2   = S(fl(d_j * d_j)),  d_j = fl(x_j - mu)       (second pass)
 *   rs   = 1.0f / sqrtf(fl(rn * m2) + eps)              each operation rounded once
 *   z_j  = fl(g_j * fl(rs * d_j)) + beta_j,  g_j = gamma_j (+ 1.0f zero-centred)
 * backward, with y_j = fl(rs * d_j) and e_j = fl(g_j * dz_j):
 *   a    = S(e_j) * rn,  c = S(fl(e_j * y_j)) * rn
 *   dx_j = rs * fl(e_j - fl(fl(c * y_j) + a))
 *   dgamma_j = S over rows of fl(dz_j * y_j), dbeta_j = S over rows of dz_j
 *   (rows fold the same way, row r in lane r mod 32)
 * TE's kernels use other trees and rsqrtf and may contract to FMA, so this
 * agrees with TE within te-ops.md 8.1 tolerances, not bit for bit
 * (numerics.md 9.6). Rows run in parallel and column sums in blocks of
 * columns; the order inside each is fixed, so no bit depends on the thread
 * count. */
#include <math.h>
#include <omp.h>

#include "ops/ops-impl.h"

typedef struct ln_fwd {
    opf_tensor    x;       /* [..., H], plain or quantized */
    opf_tensor    weight;  /* gamma [H]; its dtype is the op's dtype */
    opf_tensor    bias;    /* beta [H] */
    opf_quantizer next_q;  /* the next op's input quantizer, or none */
    double        eps;
    bool          zero_centered;
} ln_fwd;
static const opf_field ln_fwd_fields[] = {
    OPF_F_TENSOR_Q(ln_fwd, x),     OPF_F_TENSOR(ln_fwd, weight),  OPF_F_TENSOR(ln_fwd, bias),
    OPF_F_QUANT(ln_fwd, next_q),   OPF_F_FLOAT(ln_fwd, eps),      OPF_F_BOOL(ln_fwd, zero_centered)};
OPF_SCHEMA(ln_fwd_schema, ln_fwd, ln_fwd_fields);

typedef struct ln_bwd {
    opf_tensor    dy;      /* [..., H] */
    opf_tensor    x;       /* the forward input */
    opf_tensor    mu;      /* [rows] fp32 */
    opf_tensor    rsigma;  /* [rows] fp32 */
    opf_tensor    weight, bias;
    opf_quantizer dx_q;    /* the previous op's grad-output quantizer, or none */
    bool          zero_centered;
} ln_bwd;
static const opf_field ln_bwd_fields[] = {
    OPF_F_TENSOR_Q(ln_bwd, dy),   OPF_F_TENSOR_Q(ln_bwd, x),    OPF_F_TENSOR(ln_bwd, mu),
    OPF_F_TENSOR(ln_bwd, rsigma), OPF_F_TENSOR(ln_bwd, weight), OPF_F_TENSOR(ln_bwd, bias),
    OPF_F_QUANT(ln_bwd, dx_q),    OPF_F_BOOL(ln_bwd, zero_centered)};
OPF_SCHEMA(ln_bwd_schema, ln_bwd, ln_bwd_fields);

enum { LN_PAR_MIN = 1 << 15, LN_COL_BLOCK = 64, LN_LANES = 32 };

static bool is_act_dtype(opf_dtype d) { return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16; }

static int ln_threads(opf_ctx *ctx, int64_t work)
{
    int t = opf_ctx_num_threads(ctx);
    if (work < LN_PAR_MIN) return 1;
    return t > 0 ? t : omp_get_max_threads();
}

/* Values of t as the op's dtype `act` sees them (TE casts to the module
 * dtype): decoded to fp32, then rounded to act unless already plain act. */
static opf_status load_as(opf_ctx *ctx, const opf_tensor *t, opf_dtype act, float *ws,
                          const float **out)
{
    opf_status st = opf_op_load_f32(ctx, t, ws, out);
    if (st || act == OPF_F32 || (t->spec.scaling == OPF_SCALING_NONE && t->spec.dtype == act))
        return st;
    const float *v = *out;
    int64_t n = opf_spec_numel(&t->spec);
    for (int64_t i = 0; i < n; i++)
        ws[i] = act == OPF_BF16 ? opf_bf16_to_f32(opf_f32_to_bf16(v[i]))
                                : opf_f16_to_f32(opf_f32_to_f16(v[i]));
    *out = ws;
    return OPF_OK;
}

/* g_j = gamma_j, + 1 in fp32 when zero-centred (numerics.md 6.1). */
static opf_status load_gamma(opf_ctx *ctx, const opf_tensor *w, bool zero_centered, float *g)
{
    int64_t n = w->spec.shape[0];
    opf_status st = opf_convert(w->data[0], w->spec.dtype, g, OPF_F32, (size_t)n);
    if (!st && zero_centered)
        for (int64_t j = 0; j < n; j++) g[j] = g[j] + 1.0f;
    return st;
}

/* S(t_0 .. t_{n-1}) as in the file comment: 32 lanes, lane l adds t_l,
 * t_{l+32}, ... left to right, then the lanes fold in halves. */
static float lane_sum(const float *t, int64_t n)
{
    float p[LN_LANES] = {0};
    int64_t j0 = 0;
    for (; j0 + LN_LANES <= n; j0 += LN_LANES)
        for (int l = 0; l < LN_LANES; l++) p[l] += t[j0 + l];
    for (int64_t l = 0; j0 + l < n; l++) p[l] += t[j0 + l];
    for (int off = LN_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++) p[l] += p[l + off];
    return p[0];
}

/* Folds the lane rows of acc in halves into acc[0] (w columns). */
static void fold_columns(float (*acc)[LN_COL_BLOCK], int64_t w)
{
    for (int off = LN_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++)
            for (int64_t j = 0; j < w; j++) acc[l][j] += acc[l + off][j];
}

/* dg[j] = S over rows of fl(dz[r,j] * y[r,j]) and db[j] = S over rows of
 * dz[r,j] in one pass, row r in lane r mod 32; columns are independent. */
static void param_grads(const float *dz, const float *y, int64_t rows, int64_t H, float *dg,
                        float *db, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t j0 = 0; j0 < H; j0 += LN_COL_BLOCK) {
        int64_t w = j0 + LN_COL_BLOCK < H ? LN_COL_BLOCK : H - j0;
        float ag[LN_LANES][LN_COL_BLOCK], ab[LN_LANES][LN_COL_BLOCK];
        memset(ag, 0, sizeof ag);
        memset(ab, 0, sizeof ab);
        for (int64_t r = 0; r < rows; r++) {
            const float *dr = dz + r * H + j0, *yr = y + r * H + j0;
            float *qg = ag[r % LN_LANES], *qb = ab[r % LN_LANES];
            for (int64_t j = 0; j < w; j++) {
                qg[j] += dr[j] * yr[j];
                qb[j] += dr[j];
            }
        }
        fold_columns(ag, w);
        fold_columns(ab, w);
        memcpy(dg + j0, ag[0], (size_t)w * sizeof(float));
        memcpy(db + j0, ab[0], (size_t)w * sizeof(float));
    }
}

/* ---- the math of one row (order in the file comment) ----------------------
 * The output row doubles as the buffer of the terms being summed. */

static void ln_row_fwd(const float *x, int64_t H, float rn, float eps, const float *g,
                       const float *b, float *z, float *mu_out, float *rs_out)
{
    float mu = lane_sum(x, H) * rn;
    for (int64_t j = 0; j < H; j++) {
        float d = x[j] - mu;
        z[j] = d * d;
    }
    float m2 = lane_sum(z, H);
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
    float a = lane_sum(dx, H) * rn;
    for (int64_t j = 0; j < H; j++) dx[j] = dx[j] * y[j];
    float c = lane_sum(dx, H) * rn;
    for (int64_t j = 0; j < H; j++) {
        float e = g[j] * dz[j];
        float cy = c * y[j];
        float t = cy + a;
        dx[j] = rs * (e - t);
    }
}

/* ---- the class -------------------------------------------------------------- */

/* Sets every element of a plain f32/bf16/f16 tensor to 1. */
static void fill_one(opf_tensor *t)
{
    int64_t n = opf_spec_numel(&t->spec);
    if (t->spec.dtype == OPF_F32) {
        float *p = t->data[0];
        for (int64_t i = 0; i < n; i++) p[i] = 1.0f;
    } else {
        uint16_t one = t->spec.dtype == OPF_BF16 ? opf_f32_to_bf16(1.0f) : opf_f32_to_f16(1.0f);
        uint16_t *p = t->data[0];
        for (int64_t i = 0; i < n; i++) p[i] = one;
    }
}

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_norm_config *c = opf_op_config(op);
    const char *n = opf_op_name(op);
    if (c->hidden < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "layernorm \"%s\": hidden size %lld < 1", n,
                         (long long)c->hidden);
    if (!(c->eps >= 0.0) || !isfinite(c->eps))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "layernorm \"%s\": eps %g must be finite and >= 0",
                         n, c->eps);
    if (!is_act_dtype(c->dtype))
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "layernorm \"%s\": dtype %s, expected f32, bf16 or f16", n,
                         opf_dtype_name(c->dtype));
    opf_spec s = opf_spec_make(1, &c->hidden, c->dtype);
    int iw = opf_op_add_param(ctx, op, "weight", &s);
    if (iw < 0) return (opf_status)-iw;
    int ib = opf_op_add_param(ctx, op, "bias", &s);
    if (ib < 0) return (opf_status)-ib;
    if (!c->zero_centered_gamma) fill_one(&opf_op_param(op, iw)->value);  /* params start at 0 */
    return OPF_OK;
}

/* x: at least 1-D, last dim H, a float logical dtype. */
static opf_status check_input(opf_ctx *ctx, const opf_op *op, const char *what,
                              const opf_tensor *t, int64_t H)
{
    const opf_spec *s = &t->spec;
    if (s->ndim < 1 || s->shape[s->ndim - 1] != H)
        return opf_error(ctx, OPF_ERR_SHAPE, "layernorm \"%s\": %s has %lld features, hidden size is %lld",
                         opf_op_name(op), what, (long long)(s->ndim ? s->shape[s->ndim - 1] : 0),
                         (long long)H);
    if (!is_act_dtype(s->dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "layernorm \"%s\": %s dtype %s, expected f32, bf16 or f16",
                         opf_op_name(op), what, opf_dtype_name(s->dtype));
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    ln_fwd *a = args;
    const opf_norm_config *c = opf_op_config_const(op);
    opf_status st = check_input(env->ctx, op, "input", env->x, c->hidden);
    if (st) return st;
    a->x = *env->x;
    a->weight = opf_op_param(op, 0)->value;
    a->bias = opf_op_param(op, 1)->value;
    a->next_q = opf_q_or_none(env->next_input_q);
    a->eps = c->eps;
    a->zero_centered = c->zero_centered_gamma;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const ln_fwd *a = args;
    int64_t H = a->weight.spec.shape[0], rows = opf_spec_numel(&a->x.spec) / H;
    opf_spec plain = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, a->weight.spec.dtype);
    aux[0] = opf_spec_make(1, &rows, OPF_F32);
    aux[1] = opf_spec_make(1, &rows, OPF_F32);
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const ln_fwd *a = args;
    opf_dtype act = a->weight.spec.dtype;
    int64_t H = a->weight.spec.shape[0], n = opf_spec_numel(&a->x.spec), rows = n / H;
    float *xs = opf_op_scratch(ctx, n), *g = opf_op_scratch(ctx, H), *b = opf_op_scratch(ctx, H);
    float *z = opf_op_scratch(ctx, n);
    if (!xs || !g || !b || !z) return opf_error(ctx, OPF_ERR_NO_MEMORY, "layernorm: no scratch");
    const float *x;
    opf_status st = load_as(ctx, &a->x, act, xs, &x);
    if (!st) st = load_gamma(ctx, &a->weight, a->zero_centered, g);
    if (!st) st = opf_convert(a->bias.data[0], act, b, OPF_F32, (size_t)H);
    if (st) return st;
    float rn = 1.0f / (float)H, eps = (float)a->eps;
    float *mu = aux[0].data[0], *rs = aux[1].data[0];
    int nt = ln_threads(ctx, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        ln_row_fwd(x + r * H, H, rn, eps, g, b, z + r * H, &mu[r], &rs[r]);
    return opf_op_store_f32(ctx, z, act, &a->next_q, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const ln_fwd *a = args;
    opf_tensor_retain(&a->x, &octx->saved[0]);
    opf_tensor_retain(&aux[0], &octx->saved[1]);
    opf_tensor_retain(&aux[1], &octx->saved[2]);
    octx->n_saved = 3;
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    ln_bwd *a = args;
    const opf_norm_config *c = opf_op_config_const(op);
    if (octx->n_saved != 3)
        return opf_error(env->ctx, OPF_ERR_STATE, "layernorm \"%s\": context holds %d tensors, want 3",
                         opf_op_name(op), octx->n_saved);
    const opf_tensor *x = &octx->saved[0];
    opf_status st = check_input(env->ctx, op, "gradient", env->dy, c->hidden);
    if (st) return st;
    if (opf_spec_numel(&env->dy->spec) != opf_spec_numel(&x->spec))
        return opf_error(env->ctx, OPF_ERR_SHAPE,
                         "layernorm \"%s\": gradient has %lld elements, the input had %lld",
                         opf_op_name(op), (long long)opf_spec_numel(&env->dy->spec),
                         (long long)opf_spec_numel(&x->spec));
    a->dy = *env->dy;
    a->x = *x;
    a->mu = octx->saved[1];
    a->rsigma = octx->saved[2];
    a->weight = opf_op_param(op, 0)->value;
    a->bias = opf_op_param(op, 1)->value;
    a->dx_q = octx->prev_grad_q;
    a->zero_centered = c->zero_centered_gamma;
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const ln_bwd *a = args;
    opf_spec plain = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, a->weight.spec.dtype);
    grads[1] = a->weight.spec;
    grads[2] = a->bias.spec;
    return opf_op_out_spec(&plain, &a->dx_q, &grads[0]);
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const ln_bwd *a = args;
    opf_dtype act = a->weight.spec.dtype;
    int64_t H = a->weight.spec.shape[0], n = opf_spec_numel(&a->x.spec), rows = n / H;
    float *xs = opf_op_scratch(ctx, n), *dzs = opf_op_scratch(ctx, n), *g = opf_op_scratch(ctx, H);
    float *y = opf_op_scratch(ctx, n), *dx = opf_op_scratch(ctx, n);
    float *dg = opf_op_scratch(ctx, H), *db = opf_op_scratch(ctx, H);
    if (!xs || !dzs || !g || !y || !dx || !dg || !db)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "layernorm: no scratch");
    const float *x, *dz;
    opf_status st = load_as(ctx, &a->x, act, xs, &x);
    if (!st) st = load_as(ctx, &a->dy, act, dzs, &dz);
    if (!st) st = load_gamma(ctx, &a->weight, a->zero_centered, g);
    if (st) return st;
    const float *mu = a->mu.data[0], *rs = a->rsigma.data[0];
    float rn = 1.0f / (float)H;
    int nt = ln_threads(ctx, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        ln_row_bwd(x + r * H, dz + r * H, H, rn, mu[r], rs[r], g, y + r * H, dx + r * H);
    param_grads(dz, y, rows, H, dg, db, nt);
    st = opf_convert(dg, OPF_F32, grads[1].data[0], grads[1].spec.dtype, (size_t)H);
    if (!st) st = opf_convert(db, OPF_F32, grads[2].data[0], grads[2].spec.dtype, (size_t)H);
    if (!st) st = opf_op_store_f32(ctx, dx, act, &a->dx_q, &grads[0]);
    return st;
}

const opf_op_class opf_op_class_layernorm = {
    .abi_version = OPF_OP_ABI_VERSION,
    .name = "layernorm",
    .module_type = "layernorm",
    .config_size = sizeof(opf_norm_config),
    .fwd_schema = &ln_fwd_schema,
    .bwd_schema = &ln_bwd_schema,
    .fusible = true,
    .init = init,
    .resolve_fwd = resolve_fwd,
    .setup_context = setup_context,
    .resolve_bwd = resolve_bwd,
    .forward_fake = forward_fake,
    .forward_impl = forward_impl,
    .backward_fake = backward_fake,
    .backward_impl = backward_impl,
};
