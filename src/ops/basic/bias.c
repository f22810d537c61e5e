/* bias.c: y = x + b along the last dim; db = sum of dy over the other dims,
 * dx = dy. Computed in fp32, stored in the activation dtype.
 *
 * The context records the previous op's grad-output quantizer ("prevQ",
 * te-ops.md 5), which BackwardActivationBias reads through the fuser, and
 * drops it under a backward override, which quantizes no gradient. dx = dy
 * passes through as it came: the op that consumes it quantizes it. */
#include "backend/elem.h"
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
    opf_tensor dy;
    opf_tensor b;  /* for the gradient's spec */
} bias_bwd;
static const opf_field bias_bwd_fields[] = {OPF_F_TENSOR_Q(bias_bwd, dy), OPF_F_TENSOR(bias_bwd, b)};
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

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    bias_bwd *a = args;
    a->dy = *env->dy;
    a->b = opf_op_param(op, 0)->value;
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const bias_bwd *a = args;
    grads[0].ndim = OPF_GRAD_PASSTHROUGH;
    grads[1] = a->b.spec;
    return OPF_OK;
}

/* db = the column sums of dy (elem.h: fp32, in lanesum.h's order). */
static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const bias_bwd *a = args;
    const opf_elem_kernels *k = opf_op_elem(ctx, "bias", &a->dy);
    opf_tensor dy;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->dy, &dy);
    return st ? st : k->dbias(ctx, &dy, &grads[1]);
}

const opf_op_class opf_op_class_bias = {
    OPF_OP_CLASS_HEAD("bias", sizeof(opf_bias_config), &bias_fwd_schema, &bias_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(init, setup_context),
    .inplace = true,  /* x is read whole before y is stored */
};
