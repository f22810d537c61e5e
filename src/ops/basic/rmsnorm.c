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
 * count. The sums, loads and checks it shares with layernorm.c and
 * l2normalization.c are in norm_common.c. */
#include <math.h>

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

/* ---- the math of one row (order in the file comment) ----------------------
 * The output row doubles as the buffer of the terms being summed. */

static float rms_row_rsigma(const float *x, int64_t H, float rn, float eps, float *t)
{
    float mu;
    float m2 = opf_norm_row_m2(x, H, rn, t, &mu);
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
    float c = opf_norm_lane_sum(dx, H) * rn;
    for (int64_t j = 0; j < H; j++) {
        float e = g[j] * dz[j];
        float cy = c * y[j];
        dx[j] = rs * (e - cy);
    }
}

/* ---- the class -------------------------------------------------------------- */

static opf_status init(opf_ctx *ctx, opf_op *op) { return opf_norm_init(ctx, op, false); }

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    rms_fwd *a = args;
    const opf_norm_config *c = opf_op_config_const(op);
    opf_status st = opf_norm_check_input(env->ctx, op, "input", env->x, c->hidden);
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
    opf_status st = opf_norm_load_as(ctx, &a->x, act, xs, &x);
    if (!st) st = opf_norm_load_gamma(ctx, &a->weight, a->zero_centered, g);
    if (st) return st;
    float rn = 1.0f / (float)H, eps = (float)a->eps;
    float *rs = aux[0].data[0];
    int nt = opf_norm_threads(ctx, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_row_fwd(x + r * H, H, rn, eps, g, z + r * H, &rs[r]);
    return opf_op_store_f32(ctx, z, act, &a->next_q, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    opf_norm_save(octx, &((const rms_fwd *)args)->x, aux, 1);
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    rms_bwd *a = args;
    const opf_norm_config *c = opf_op_config_const(op);
    opf_status st = opf_norm_check_bwd(env->ctx, op, octx, env->dy, c->hidden, 2);
    if (st) return st;
    a->dy = *env->dy;
    a->x = octx->saved[0];
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
    opf_status st = opf_norm_load_as(ctx, &a->x, act, xs, &x);
    if (!st) st = opf_norm_load_as(ctx, &a->dy, act, dzs, &dz);
    if (!st) st = opf_norm_load_gamma(ctx, &a->weight, a->zero_centered, g);
    if (st) return st;
    const float *rs = a->rsigma.data[0];
    float rn = 1.0f / (float)H;
    int nt = opf_norm_threads(ctx, n);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        rms_row_bwd(x + r * H, dz + r * H, H, rn, rs[r], g, y + r * H, dx + r * H);
    opf_norm_param_grads(dz, y, rows, H, dg, NULL, nt);
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

OPF_NORM_CLASS(rmsnorm, opf_norm_config, &rms_fwd_schema, &opf_rmsnorm_bwd_schema);
