/* l2normalization.c: "l2normalization", y = x * rsqrt(sum(x^2) + eps) over
 * the last dim, no parameters (the anchor's basic op). The input (plain or
 * quantized, logical dtype f32/bf16/f16) is decoded to fp32, every step is
 * fp32, and y and dx are plain in the input's dtype: like TE's op, it neither
 * quantizes its output for the next op nor dx for the previous one, so those
 * neighbours quantize the plain tensors themselves. Saved for backward: x and
 * rnorm ([rows] fp32).
 *
 * The math and its exact fp32 order (every sum a warp's tree, as in
 * layernorm.c and rmsnorm.c) are the backend's: backend/norm.h, the CPU
 * reference in backend/cpu/norm.c. eps = 0 with an all-zero row gives
 * r = inf and NaN outputs, as in TE. This file validates and dispatches; the
 * loads, checks and dispatch it shares with layernorm.c and rmsnorm.c are in
 * norm_common.c. */
#include "ops/basic/norm-impl.h"

typedef struct l2n_fwd {
    opf_tensor x;  /* [..., H], plain or quantized */
    double     eps;
} l2n_fwd;
static const opf_field l2n_fwd_fields[] = {OPF_F_TENSOR_Q(l2n_fwd, x), OPF_F_FLOAT(l2n_fwd, eps)};
OPF_SCHEMA(l2n_fwd_schema, l2n_fwd, l2n_fwd_fields);

typedef struct l2n_bwd {
    opf_tensor dy;     /* [..., H] */
    opf_tensor x;      /* the forward input */
    opf_tensor rnorm;  /* [rows] fp32 */
} l2n_bwd;
static const opf_field l2n_bwd_fields[] = {
    OPF_F_TENSOR_Q(l2n_bwd, dy), OPF_F_TENSOR_Q(l2n_bwd, x), OPF_F_TENSOR(l2n_bwd, rnorm)};
OPF_SCHEMA(l2n_bwd_schema, l2n_bwd, l2n_bwd_fields);

/* ---- the class -------------------------------------------------------------- */

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    return opf_norm_check_eps(ctx, op, ((const opf_l2norm_config *)opf_op_config(op))->eps);
}

/* t: at least 1-D with a float logical dtype. */
static opf_status check_input(opf_ctx *ctx, const opf_op *op, const char *what, const opf_tensor *t)
{
    if (t->spec.ndim < 1)
        return opf_error(ctx, OPF_ERR_SHAPE, "l2normalization \"%s\": %s is a scalar (0-D), "
                         "need at least one dim", opf_op_name(op), what);
    return opf_norm_check_dtype(ctx, op, what, t);
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    l2n_fwd *a = args;
    opf_status st = check_input(env->ctx, op, "input", env->x);
    if (st) return st;
    a->x = *env->x;
    a->eps = ((const opf_l2norm_config *)opf_op_config_const(op))->eps;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const opf_spec *x = &((const l2n_fwd *)args)->x.spec;
    int64_t H = x->shape[x->ndim - 1], rows = H ? opf_spec_numel(x) / H : 0;
    outs[0] = opf_spec_make(x->ndim, x->shape, x->dtype);
    aux[0] = opf_spec_make(1, &rows, OPF_F32);
    return OPF_OK;
}

/* A quantized input is seen as TE's dequantize returns it: decoded to fp32,
 * then rounded to its logical dtype, the dtype of y and dx (the kernels
 * round x to that dtype). */
static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const l2n_fwd *a = args;
    const opf_norm_kernels *k =
        opf_backend_kernels(ctx, "l2normalization", a->x.spec.device, OPF_KERNELS_NORM);
    opf_tensor x;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->x, &x);
    return st ? st : k->l2norm_fwd(ctx, &x, (float)a->eps, &outs[0], &aux[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    opf_norm_save(octx, &((const l2n_fwd *)args)->x, aux, 1);
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    l2n_bwd *a = args;
    opf_status st = opf_norm_check_saved(env->ctx, op, octx, 2);
    if (!st) st = check_input(env->ctx, op, "gradient", env->dy);
    if (st) return st;
    const opf_tensor *x = &octx->saved[0];
    const opf_spec *ds = &env->dy->spec, *xs = &x->spec;
    if (ds->shape[ds->ndim - 1] != xs->shape[xs->ndim - 1] || opf_spec_numel(ds) != opf_spec_numel(xs))
        return opf_error(env->ctx, OPF_ERR_SHAPE,
                         "l2normalization \"%s\": gradient has %lld elements of %lld features, "
                         "the input had %lld of %lld", opf_op_name(op), (long long)opf_spec_numel(ds),
                         (long long)ds->shape[ds->ndim - 1], (long long)opf_spec_numel(xs),
                         (long long)xs->shape[xs->ndim - 1]);
    a->dy = *env->dy;
    a->x = *x;
    a->rnorm = octx->saved[1];
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const opf_spec *x = &((const l2n_bwd *)args)->x.spec;
    grads[0] = opf_spec_make(x->ndim, x->shape, x->dtype);
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const l2n_bwd *a = args;
    const opf_norm_kernels *k =
        opf_backend_kernels(ctx, "l2normalization", a->x.spec.device, OPF_KERNELS_NORM);
    opf_tensor dy, x;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->dy, &dy);
    if (!st) st = opf_op_plain_view(ctx, &a->x, &x);
    return st ? st : k->l2norm_bwd(ctx, &dy, &x, &a->rnorm, &grads[0]);
}

OPF_NORM_CLASS(l2normalization, opf_l2norm_config, &l2n_fwd_schema, &l2n_bwd_schema);
