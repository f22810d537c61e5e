/* quantize.c: quantizes the activation (forward) and/or its gradient
 * (backward) with the op's own recipe quantizers, roles INPUT and
 * GRAD_OUTPUT of a one-GEMM "quantize" module. Without a recipe, with the
 * direction switched off, or for a tensor that is already quantized, the
 * direction is the identity (forward: a copy; backward: dy passes through).
 * A NULL config is the anchor's default: forward on, backward off. */
#include "ops/ops-impl.h"

typedef struct quantize_fwd {
    opf_tensor    x;
    opf_quantizer q;  /* NONE: copy x */
} quantize_fwd;
static const opf_field quantize_fwd_fields[] = {
    OPF_F_TENSOR_Q(quantize_fwd, x), OPF_F_QUANT(quantize_fwd, q)};
OPF_SCHEMA(quantize_fwd_schema, quantize_fwd, quantize_fwd_fields);

typedef struct quantize_bwd {
    opf_tensor    dy;
    opf_quantizer q;  /* NONE: dy passes through */
} quantize_bwd;
static const opf_field quantize_bwd_fields[] = {
    OPF_F_TENSOR_Q(quantize_bwd, dy), OPF_F_QUANT(quantize_bwd, q)};
OPF_SCHEMA(quantize_bwd_schema, quantize_bwd, quantize_bwd_fields);

static const opf_quantize_config default_config = {.forward = true, .backward = false};

/* The op's quantizer for a role when that direction is on, else NULL. A
 * recipe's backward override turns the backward quantization off (the anchor
 * runs the backward in high precision then, numerics.md 3.7). */
static const opf_quantizer *role_q(const opf_op *op, opf_tensor_role role)
{
    const opf_quantize_config *c = opf_op_config_const(op);
    bool on = role == OPF_ROLE_INPUT ? c->forward : c->backward;
    const opf_recipe_state *rs = opf_op_recipe_state(op);
    if (role == OPF_ROLE_GRAD_OUTPUT && rs &&
        opf_recipe_state_recipe(rs)->backward_override != OPF_BACKWARD_NONE)
        on = false;
    return on ? opf_op_quantizer(op, role, 0) : NULL;
}

/* The neighbours get stable copies in the op (opf_op_quantizer's result is
 * overwritten by the next call): q kept in *slot, *has whether there is one. */
static const opf_quantizer *keep(const opf_quantizer *q, opf_quantizer *slot, bool *has)
{
    if ((*has = q != NULL)) *slot = *q;
    return q ? slot : NULL;
}

/* The op object itself is never const. */
static const opf_quantizer *input_quantizer(const opf_op *op)
{
    opf_op *m = (opf_op *)op;
    return keep(role_q(op, OPF_ROLE_INPUT), &m->in_q, &m->has_in_q);
}

static const opf_quantizer *grad_output_quantizer(const opf_op *op)
{
    opf_op *m = (opf_op *)op;
    return keep(role_q(op, OPF_ROLE_GRAD_OUTPUT), &m->grad_q, &m->has_grad_q);
}

/* One direction's args: t, and the op's quantizer of role when the direction
 * is on and t is plain (else none); errors when t cannot be quantized with it. */
static opf_status resolve_dir(opf_ctx *ctx, const opf_op *op, const char *what,
                              const opf_tensor *t, opf_tensor_role role, opf_tensor *t_arg,
                              opf_quantizer *q_arg)
{
    const opf_quantizer *q = role_q(op, role);
    if (t->spec.scaling != OPF_SCALING_NONE) q = NULL;
    opf_spec s;
    opf_status st = q ? opf_quantizer_spec(q, &t->spec, &s) : OPF_OK;
    if (st)
        return opf_error(ctx, st, "quantize \"%s\": %s: %s", opf_op_name(op), what,
                         opf_last_error(NULL));
    *t_arg = *t;
    *q_arg = q ? *q : opf_quantizer_default();
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    quantize_fwd *a = args;
    return resolve_dir(env->ctx, op, "input", env->x, OPF_ROLE_INPUT, &a->x, &a->q);
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const quantize_fwd *a = args;
    return opf_op_out_spec(&a->x.spec, &a->q, &outs[0]);
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const quantize_fwd *a = args;
    if (a->q.scaling == OPF_SCALING_NONE) return opf_op_copy_tensor(ctx, "quantize", &a->x, &outs[0]);
    return opf_quantize(ctx, &a->q, &a->x, &outs[0]);
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    quantize_bwd *a = args;
    return resolve_dir(env->ctx, op, "gradient", env->dy, OPF_ROLE_GRAD_OUTPUT, &a->dy, &a->q);
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const quantize_bwd *a = args;
    if (a->q.scaling == OPF_SCALING_NONE) {
        grads[0].ndim = OPF_GRAD_PASSTHROUGH;
        return OPF_OK;
    }
    return opf_op_out_spec(&a->dy.spec, &a->q, &grads[0]);
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const quantize_bwd *a = args;
    if (a->q.scaling == OPF_SCALING_NONE) return OPF_OK;  /* the runner passes dy on */
    return opf_quantize(ctx, &a->q, &a->dy, &grads[0]);
}

const opf_op_class opf_op_class_quantize = {
    OPF_OP_CLASS_HEAD("quantize", sizeof(opf_quantize_config), &quantize_fwd_schema,
                      &quantize_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(NULL, NULL),
    .module_type = "quantize",
    .config_default = &default_config,
    .n_gemms = 1,
    .input_quantizer = input_quantizer,
    .grad_output_quantizer = grad_output_quantizer,
    .inplace = true,  /* the copy skips equal memory */
};
