/* rmsnorm.c: "rmsnorm", RMSNorm over the last dim (numerics.md 6.1, 6.2;
 * the anchor's basic op). One parameter, weight (gamma: ones, or zeros when
 * zero-centred), of the config's dtype. The input is taken in that dtype, as
 * TE casts it to the module dtype: decoded, and rounded to the dtype when it
 * arrives in another one or quantized. Every step is fp32; the output is
 * rounded to the dtype or quantized with the next op's input quantizer, dx
 * likewise with the previous op's grad-output quantizer. Saved for backward:
 * x and rsigma ([rows] fp32).
 *
 * The math and its exact fp32 order (every sum a warp's tree, so a CUDA
 * kernel reproduces it bit for bit) are the backend's: backend/norm.h, the
 * CPU reference in backend/cpu/norm.c. This file validates and dispatches;
 * the loads, checks and dispatch it shares with layernorm.c and
 * l2normalization.c are in norm_common.c. */
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
OPF_SHARED_SCHEMA(opf_rmsnorm_bwd_schema, opf_rmsnorm_bwd, rms_bwd_fields);

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

/* z through rmsnorm_fwd_q, as layernorm.c's forward. */
static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const rms_fwd *a = args;
    const opf_norm_kernels *k =
        opf_backend_kernels(ctx, "rmsnorm", a->x.spec.device, OPF_KERNELS_NORM);
    opf_tensor x, z;
    opf_quantize_state qs;
    opf_qout o;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->x, &x);
    if (!st && opf_op_qout(&a->next_q, a->weight.spec.dtype, &outs[0], &qs, &o))
        return k->rmsnorm_fwd_q(ctx, &x, &a->weight, (float)a->eps, a->zero_centered, &o,
                                &aux[0]);
    if (!st) st = opf_op_kernel_out(ctx, &outs[0], &z);
    if (!st)
        st = k->rmsnorm_fwd(ctx, &x, &a->weight, (float)a->eps, a->zero_centered, &z, &aux[0]);
    return st ? st : opf_op_finish_out(ctx, &z, a->weight.spec.dtype, &a->next_q, &outs[0]);
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

opf_status opf_rmsnorm_backward(opf_ctx *ctx, const opf_rmsnorm_bwd *a, const opf_tensor *dadd,
                                opf_tensor *dx, opf_tensor *dgamma)
{
    const opf_norm_kernels *k =
        opf_backend_kernels(ctx, "rmsnorm", a->x.spec.device, OPF_KERNELS_NORM);
    opf_tensor dz, x, da, dxp;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->dy, &dz);
    if (!st) st = opf_op_plain_view(ctx, &a->x, &x);
    if (!st && dadd) st = opf_op_plain_view(ctx, dadd, &da);
    if (!st) st = opf_op_kernel_out(ctx, dx, &dxp);
    if (!st)
        st = k->rmsnorm_bwd(ctx, &dz, &x, &a->rsigma, &a->weight, a->zero_centered,
                            dadd ? &da : NULL, &dxp, dgamma);
    return st ? st : opf_op_finish_out(ctx, &dxp, a->weight.spec.dtype, &a->dx_q, dx);
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    return opf_rmsnorm_backward(ctx, args, NULL, &grads[0], &grads[1]);
}

OPF_NORM_CLASS(rmsnorm, opf_norm_config, &rms_fwd_schema, &opf_rmsnorm_bwd_schema);
