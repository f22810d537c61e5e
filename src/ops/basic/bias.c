/* bias.c: y = x + b along the last dim; db = sum of dy over the other dims,
 * dx = dy. Computed in fp32, stored in the activation dtype.
 *
 * The context records the previous op's grad-output quantizer ("prevQ",
 * the anchor's basic op), which BackwardActivationBias reads through the fuser, and
 * drops it under a backward override, which quantizes no gradient. With a
 * prevQ and a plain dy, dx is dy quantized with it in the same entry as db
 * (elem.h's dbias_q: on the GPU one read of dy for db and the amax, then
 * the cast), so the previous op (a BasicLinear) takes it as it is: the
 * bits and the one amax-history update it made itself from the plain dy.
 * Otherwise dx = dy passes through as it came (no copy: the runner hands dy
 * on), and the op that consumes it quantizes it. */
#include "backend/backend-impl.h"
#include "ops/ops-impl.h"

typedef struct bias_fwd {
    opf_tensor    x;       /* [..., n], plain or quantized (decoded) */
    opf_tensor    b;       /* [n] */
    opf_quantizer next_q;  /* quantize the output for the next op */
    int           bwd_override; /* the recipe's opf_backward_override */
} bias_fwd;
static const opf_field bias_fwd_fields[] = {
    OPF_F_TENSOR_Q(bias_fwd, x), OPF_F_TENSOR(bias_fwd, b), OPF_F_QUANT(bias_fwd, next_q),
    OPF_F_ENUM(bias_fwd, bwd_override)};
OPF_SCHEMA(bias_fwd_schema, bias_fwd, bias_fwd_fields);

typedef struct bias_bwd {
    opf_tensor    dy;    /* [..., n], plain or quantized (decoded) */
    opf_tensor    b;     /* for the gradient's spec */
    opf_quantizer dx_q;  /* prevQ, or none: dx passes through */
} bias_bwd;
static const opf_field bias_bwd_fields[] = {OPF_F_TENSOR_Q(bias_bwd, dy), OPF_F_TENSOR(bias_bwd, b),
                                            OPF_F_QUANT(bias_bwd, dx_q)};
OPF_SCHEMA(bias_bwd_schema, bias_bwd, bias_bwd_fields);

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_bias_config *c = opf_op_config(op);
    if (c->size < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "bias \"%s\": size %lld < 1", opf_op_name(op),
                         (long long)c->size);
    opf_spec s = opf_spec_make(1, &c->size, c->dtype);
    int i = opf_op_add_param(ctx, op, "bias", &s);
    return i < 0 ? (opf_status)-i : OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    bias_fwd *a = args;
    const opf_tensor *x = env->x;
    int64_t n = opf_op_param(op, 0)->value.spec.shape[0];
    if (x->spec.ndim < 1 || x->spec.shape[x->spec.ndim - 1] != n)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "bias \"%s\": input has %lld features, bias has %lld",
                         opf_op_name(op), (long long)(x->spec.ndim ? x->spec.shape[x->spec.ndim - 1] : 0),
                         (long long)n);
    a->x = *x;
    a->b = opf_op_param(op, 0)->value;
    a->next_q = opf_q_or_none(env->next_input_q);
    a->bwd_override = env->recipe ? env->recipe->backward_override : OPF_BACKWARD_NONE;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const bias_fwd *a = args;
    opf_spec plain = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, a->x.spec.dtype);
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const bias_fwd *a = args;
    const opf_elem_kernels *k = opf_op_elem(ctx, "bias", &a->x);
    opf_tensor x, y;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->x, &x);
    if (!st) st = opf_op_kernel_out(ctx, &outs[0], &y);
    if (!st) st = k->bias_add(ctx, &x, &a->b, &y);
    return st ? st : opf_op_finish_out(ctx, &y, a->x.spec.dtype, &a->next_q, &outs[0]);
}

/* The runner filled octx->prev_grad_q; an override nulls it. */
static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const bias_fwd *a = args;
    if (a->bwd_override != OPF_BACKWARD_NONE) octx->prev_grad_q = opf_quantizer_default();
    return OPF_OK;
}

/* Whether dx is dy quantized with prevQ (else dy passes through). */
static bool quantizes_dx(const bias_bwd *a)
{
    return a->dx_q.scaling != OPF_SCALING_NONE && a->dy.spec.scaling == OPF_SCALING_NONE;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    bias_bwd *a = args;
    const opf_tensor *dy = env->dy;
    int64_t n = opf_op_param(op, 0)->value.spec.shape[0];
    if (!dy) return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "bias \"%s\": dy is NULL", opf_op_name(op));
    if (!opf_is_act_dtype(dy->spec.dtype))
        return opf_error(env->ctx, OPF_ERR_DTYPE, "bias \"%s\": gradient dtype %s, expected "
                         "f32/bf16/f16", opf_op_name(op), opf_dtype_name(dy->spec.dtype));
    if (dy->spec.ndim < 1 || dy->spec.shape[dy->spec.ndim - 1] != n)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "bias \"%s\": gradient has %lld features "
                         "(ndim %d), the bias has %lld", opf_op_name(op),
                         (long long)(dy->spec.ndim ? dy->spec.shape[dy->spec.ndim - 1] : 0),
                         dy->spec.ndim, (long long)n);
    a->dy = *dy;
    a->b = opf_op_param(op, 0)->value;
    a->dx_q = octx->prev_grad_q;  /* nulled under an override (setup_context) */
    opf_spec qs, plain = opf_spec_make(dy->spec.ndim, dy->spec.shape, dy->spec.dtype);
    opf_status st = quantizes_dx(a) ? opf_quantizer_spec(&a->dx_q, &plain, &qs) : OPF_OK;
    if (st)
        return opf_error(env->ctx, st, "bias \"%s\": the gradient cannot take the previous op's "
                         "%s format: %s", opf_op_name(op), opf_scaling_name(a->dx_q.scaling),
                         opf_last_error(NULL));
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const bias_bwd *a = args;
    grads[1] = a->b.spec;
    if (!quantizes_dx(a)) {
        grads[0].ndim = OPF_GRAD_PASSTHROUGH;
        return OPF_OK;
    }
    opf_spec plain = opf_spec_make(a->dy.spec.ndim, a->dy.spec.shape, a->dy.spec.dtype);
    plain.device = a->dy.spec.device;
    return opf_op_out_spec(&plain, &a->dx_q, &grads[0]);
}

/* db = the column sums of dy (elem.h: fp32, in lanesum.h's order); a
 * quantized dx in the same entry, or (stochastic rounding: the generator's
 * advance is opf_quantize's) after it. */
static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const bias_bwd *a = args;
    const opf_elem_kernels *k = opf_op_elem(ctx, "bias", &a->dy);
    opf_tensor dy;
    opf_quantize_state qs;
    opf_qout o;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->dy, &dy);
    if (st || !quantizes_dx(a)) return st ? st : k->dbias(ctx, &dy, &grads[1]);
    if (opf_op_qout(&a->dx_q, dy.spec.dtype, &grads[0], &qs, &o))
        return k->dbias_q(ctx, &dy, &grads[1], &o);
    st = k->dbias(ctx, &dy, &grads[1]);
    return st ? st : opf_quantize(ctx, &a->dx_q, &dy, &grads[0]);
}

const opf_op_class opf_op_class_bias = {
    OPF_OP_CLASS_HEAD("bias", sizeof(opf_bias_config), &bias_fwd_schema, &bias_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(init, setup_context),
    .inplace = true,  /* x is read whole before y is stored */
};
