/* rmsnorm.c: "rmsnorm", RMSNorm over the last dim (numerics.md 6.1, 6.2;
 * te-ops.md section 5). One parameter, weight (gamma: ones, or zeros when
 * zero-centred), of the config's dtype. The input is taken in that dtype, as
 * TE casts it to the module dtype: decoded, and rounded to the dtype when it
 * arrives in another one or quantized. Every step is fp32; the output is
 * rounded to the dtype or quantized with the next op's input quantizer, dx
 * likewise with the previous op's grad-output quantizer. Saved for backward:
 * x and rsigma ([rows] fp32).
 *
 * The exact fp32 order, per row of H values, rn = fl(1/H), no FMA. Every
 * sum S(t_j) is taken like a warp's reduction (TE reduces in trees): lane
 * l = j mod 32 adds its terms left to right, then the 32 lanes fold in
 * halves (lane i += lane i+16, then i+8, i+4, i+2, i+1). The mean square is
 * rebuilt from the mean and the centred sum, as TE's shared statistics do:
 *   mu   = S(x_j) * rn
 *   m2   = S(fl(d_j * d_j)),  d_j = fl(x_j - mu)       (second pass)
 *   rs   = 1.0f / sqrtf(fl(fl(rn * m2) + fl(mu * mu)) + eps)   each step rounded once
 *   z_j  = fl(g_j * fl(rs * x_j)),  g_j = gamma_j (+ 1.0f zero-centred)
 * backward, with y_j = fl(rs * x_j) and e_j = fl(g_j * dz_j):
 *   c    = S(fl(e_j * y_j)) * rn
 *   dx_j = rs * fl(e_j - fl(c * y_j))
 *   dgamma_j = S over rows of fl(dz_j * y_j)  (row r in lane r mod 32)
 * TE's kernels use other trees and rsqrtf and may contract to FMA, so this
 * agrees with TE within te-ops.md 8.1 tolerances, not bit for bit
 * (numerics.md 9.6). Rows run in parallel and column sums in blocks of
 * columns; the order inside each is fixed, so no bit depends on the thread
 * count. */
#include <math.h>
#include <omp.h>

#include "ops/basic/norm-impl.h"

typedef struct rms_fwd {
    opf_tensor    x;       /* [..., H], plain or quantized */
    opf_tensor    weight;  /* gamma [H]; its dtype is the op's dtype */
    opf_quantizer next_q;  /* the next op's input quantizer, or none */
    double        eps;
    bool          zero_centered;
} rms_fwd;
static const opf_field rms_fwd_fields[] = {
    OPF_F_TENSOR_Q(rms_fwd, x), OPF_F_TENSOR(rms_fwd, weight), OPF_F_QUANT(rms_fwd, next_q),
    OPF_F_FLOAT(rms_fwd, eps),  OPF_F_BOOL(rms_fwd, zero_centered)};
OPF_SCHEMA(rms_fwd_schema, rms_fwd, rms_fwd_fields);

/* The backward args live in norm-impl.h: BackwardAddRMSNorm shares them. */
typedef opf_rmsnorm_bwd rms_bwd;
static const opf_field rms_bwd_fields[] = {
    OPF_F_TENSOR_Q(rms_bwd, dy),   OPF_F_TENSOR_Q(rms_bwd, x), OPF_F_TENSOR(rms_bwd, rsigma),
    OPF_F_TENSOR(rms_bwd, weight), OPF_F_QUANT(rms_bwd, dx_q), OPF_F_BOOL(rms_bwd, zero_centered)};
const opf_schema opf_rmsnorm_bwd_schema = {"rms_bwd", sizeof(rms_bwd),
                                           (int)(sizeof rms_bwd_fields / sizeof rms_bwd_fields[0]),
                                           rms_bwd_fields};

enum { RMS_PAR_MIN = 1 << 15, RMS_COL_BLOCK = 64, RMS_LANES = 32 };

static bool is_act_dtype(opf_dtype d) { return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16; }

static int rms_threads(opf_ctx *ctx, int64_t work)
{
    int t = opf_ctx_num_threads(ctx);
    if (work < RMS_PAR_MIN) return 1;
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
    float p[RMS_LANES] = {0};
    int64_t j0 = 0;
    for (; j0 + RMS_LANES <= n; j0 += RMS_LANES)
        for (int l = 0; l < RMS_LANES; l++) p[l] += t[j0 + l];
    for (int64_t l = 0; j0 + l < n; l++) p[l] += t[j0 + l];
    for (int off = RMS_LANES / 2; off; off >>= 1)
        for (int l = 0; l < off; l++) p[l] += p[l + off];
    return p[0];
}

/* out[j] = S over rows of fl(a[r,j] * b[r,j]), row r in lane r mod 32;
 * columns are independent. */
static void column_dot(const float *a, const float *b, int64_t rows, int64_t H, float *out, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t j0 = 0; j0 < H; j0 += RMS_COL_BLOCK) {
        int64_t w = j0 + RMS_COL_BLOCK < H ? RMS_COL_BLOCK : H - j0;
        float acc[RMS_LANES][RMS_COL_BLOCK];
        memset(acc, 0, sizeof acc);
        for (int64_t r = 0; r < rows; r++) {
            const float *ar = a + r * H + j0, *br = b + r * H + j0;
            float *q = acc[r % RMS_LANES];
            for (int64_t j = 0; j < w; j++) q[j] += ar[j] * br[j];
        }
        for (int off = RMS_LANES / 2; off; off >>= 1)
            for (int l = 0; l < off; l++)
                for (int64_t j = 0; j < w; j++) acc[l][j] += acc[l + off][j];
        memcpy(out + j0, acc[0], (size_t)w * sizeof(float));
    }
}

/* ---- the math of one row (order in the file comment) ----------------------
 * The output row doubles as the buffer of the terms being summed. */

static float rms_row_rsigma(const float *x, int64_t H, float rn, float eps, float *t)
{
    float mu = lane_sum(x, H) * rn;
    for (int64_t j = 0; j < H; j++) {
        float d = x[j] - mu;
        t[j] = d * d;
    }
    float m2 = lane_sum(t, H);
    float var = rn * m2;
    float mu2 = mu * mu;
    float ms = var + mu2;
    return 1.0f / sqrtf(ms + eps);
}

static void rms_row_fwd(const float *x, int64_t H, float rn, float eps, const float *g, float *z,
                        float *rs_out)
{
    float rs = rms_row_rsigma(x, H, rn, eps, z);
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
    float c = lane_sum(dx, H) * rn;
    for (int64_t j = 0; j < H; j++) {
        float e = g[j] * dz[j];
        float cy = c * y[j];
        dx[j] = rs * (e - cy);
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
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "rmsnorm \"%s\": hidden size %lld < 1", n,
                         (long long)c->hidden);
    if (!(c->eps >= 0.0) || !isfinite(c->eps))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "rmsnorm \"%s\": eps %g must be finite and >= 0",
                         n, c->eps);
    if (!is_act_dtype(c->dtype))
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "rmsnorm \"%s\": dtype %s, expected f32, bf16 or f16", n,
                         opf_dtype_name(c->dtype));
    opf_spec s = opf_spec_make(1, &c->hidden, c->dtype);
    int iw = opf_op_add_param(ctx, op, "weight", &s);
    if (iw < 0) return (opf_status)-iw;
    if (!c->zero_centered_gamma) fill_one(&opf_op_param(op, iw)->value);  /* params start at 0 */
    return OPF_OK;
}

/* t: at least 1-D, last dim H, a float logical dtype. */
static opf_status check_input(opf_ctx *ctx, const opf_op *op, const char *what,
                              const opf_tensor *t, int64_t H)
{
    const opf_spec *s = &t->spec;
    if (s->ndim < 1 || s->shape[s->ndim - 1] != H)
        return opf_error(ctx, OPF_ERR_SHAPE, "rmsnorm \"%s\": %s has %lld features, hidden size is %lld",
                         opf_op_name(op), what, (long long)(s->ndim ? s->shape[s->ndim - 1] : 0),
                         (long long)H);
    if (!is_act_dtype(s->dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "rmsnorm \"%s\": %s dtype %s, expected f32, bf16 or f16",
                         opf_op_name(op), what, opf_dtype_name(s->dtype));
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    rms_fwd *a = args;
    const opf_norm_config *c = opf_op_config_const(op);
    opf_status st = check_input(env->ctx, op, "input", env->x, c->hidden);
    if (st) return st;
    a->x = *env->x;
    a->weight = opf_op_param(op, 0)->value;
    a->next_q = opf_q_or_none(env->next_input_q);
    a->eps = c->eps;
    a->zero_centered = c->zero_centered_gamma;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const rms_fwd *a = args;
    int64_t H = a->weight.spec.shape[0], rows = opf_spec_numel(&a->x.spec) / H;
    opf_spec plain = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, a->weight.spec.dtype);
    aux[0] = opf_spec_make(1, &rows, OPF_F32);
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const rms_fwd *a = args;
    opf_dtype act = a->weight.spec.dtype;
    int64_t H = a->weight.spec.shape[0], n = opf_spec_numel(&a->x.spec), rows = n / H;
    float *xs = opf_op_scratch(ctx, n), *g = opf_op_scratch(ctx, H), *z = opf_op_scratch(ctx, n);
    if (!xs || !g || !z) return opf_error(ctx, OPF_ERR_NO_MEMORY, "rmsnorm: no scratch");
    const float *x;
    opf_status st = load_as(ctx, &a->x, act, xs, &x);
    if (!st) st = load_gamma(ctx, &a->weight, a->zero_centered, g);
    if (st) return st;
    float rn = 1.0f / (float)H, eps = (float)a->eps;
    float *rs = aux[0].data[0];
    int nt = rms_threads(ctx, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_row_fwd(x + r * H, H, rn, eps, g, z + r * H, &rs[r]);
    return opf_op_store_f32(ctx, z, act, &a->next_q, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const rms_fwd *a = args;
    opf_tensor_retain(&a->x, &octx->saved[0]);
    opf_tensor_retain(&aux[0], &octx->saved[1]);
    octx->n_saved = 2;
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    rms_bwd *a = args;
    const opf_norm_config *c = opf_op_config_const(op);
    if (octx->n_saved != 2)
        return opf_error(env->ctx, OPF_ERR_STATE, "rmsnorm \"%s\": context holds %d tensors, want 2",
                         opf_op_name(op), octx->n_saved);
    const opf_tensor *x = &octx->saved[0];
    opf_status st = check_input(env->ctx, op, "gradient", env->dy, c->hidden);
    if (st) return st;
    if (opf_spec_numel(&env->dy->spec) != opf_spec_numel(&x->spec))
        return opf_error(env->ctx, OPF_ERR_SHAPE,
                         "rmsnorm \"%s\": gradient has %lld elements, the input had %lld",
                         opf_op_name(op), (long long)opf_spec_numel(&env->dy->spec),
                         (long long)opf_spec_numel(&x->spec));
    a->dy = *env->dy;
    a->x = *x;
    a->rsigma = octx->saved[1];
    a->weight = opf_op_param(op, 0)->value;
    a->dx_q = octx->prev_grad_q;
    a->zero_centered = c->zero_centered_gamma;
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const rms_bwd *a = args;
    opf_spec plain = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, a->weight.spec.dtype);
    grads[1] = a->weight.spec;
    return opf_op_out_spec(&plain, &a->dx_q, &grads[0]);
}

opf_status opf_rmsnorm_bwd_f32(opf_ctx *ctx, const opf_rmsnorm_bwd *a, float *dx, float *dg)
{
    opf_dtype act = a->weight.spec.dtype;
    int64_t H = a->weight.spec.shape[0], n = opf_spec_numel(&a->x.spec), rows = n / H;
    float *xs = opf_op_scratch(ctx, n), *dzs = opf_op_scratch(ctx, n), *g = opf_op_scratch(ctx, H);
    float *y = opf_op_scratch(ctx, n);
    if (!xs || !dzs || !g || !y) return opf_error(ctx, OPF_ERR_NO_MEMORY, "rmsnorm: no scratch");
    const float *x, *dz;
    opf_status st = load_as(ctx, &a->x, act, xs, &x);
    if (!st) st = load_as(ctx, &a->dy, act, dzs, &dz);
    if (!st) st = load_gamma(ctx, &a->weight, a->zero_centered, g);
    if (st) return st;
    const float *rs = a->rsigma.data[0];
    float rn = 1.0f / (float)H;
    int nt = rms_threads(ctx, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        rms_row_bwd(x + r * H, dz + r * H, H, rn, rs[r], g, y + r * H, dx + r * H);
    column_dot(dz, y, rows, H, dg, nt);
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const rms_bwd *a = args;
    int64_t H = a->weight.spec.shape[0], n = opf_spec_numel(&a->x.spec);
    float *dx = opf_op_scratch(ctx, n), *dg = opf_op_scratch(ctx, H);
    if (!dx || !dg) return opf_error(ctx, OPF_ERR_NO_MEMORY, "rmsnorm: no scratch");
    opf_status st = opf_rmsnorm_bwd_f32(ctx, a, dx, dg);
    if (!st) st = opf_convert(dg, OPF_F32, grads[1].data[0], grads[1].spec.dtype, (size_t)H);
    if (!st) st = opf_op_store_f32(ctx, dx, a->weight.spec.dtype, &a->dx_q, &grads[0]);
    return st;
}

const opf_op_class opf_op_class_rmsnorm = {
    .abi_version = OPF_OP_ABI_VERSION,
    .name = "rmsnorm",
    .module_type = "rmsnorm",
    .config_size = sizeof(opf_norm_config),
    .fwd_schema = &rms_fwd_schema,
    .bwd_schema = &opf_rmsnorm_bwd_schema,
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
