/* add_extra_input.c: y = x + extra (a residual added from an extra input);
 * dx = dy (passed through) and d(extra) = dy: the eager runner and the
 * compiler hand dy itself on (backward_is_dy), the impl's copy serves
 * runners that need distinct memory.
 *
 * The sum is one fp32 add of the decoded values, stored in the output dtype:
 * x's dtype, or with in_place the extra input's dtype (the anchor adds into
 * the extra buffer, so the result has its dtype). Our tensors are immutable
 * views, so in_place still writes a new output; it is accepted for API parity
 * and tells the fuser that ForwardLinearBiasAdd may accumulate the GEMM into
 * the extra input's buffer. A NULL config means not in place. */
#include "ops/ops-impl.h"

typedef struct add_fwd {
    opf_tensor x;
    opf_tensor extra;
    bool       in_place;
} add_fwd;
static const opf_field add_fwd_fields[] = {
    OPF_F_TENSOR_Q(add_fwd, x), OPF_F_TENSOR_Q(add_fwd, extra), OPF_F_BOOL(add_fwd, in_place)};
OPF_SCHEMA(add_fwd_schema, add_fwd, add_fwd_fields);

static const opf_inplace_config default_config = {.in_place = false};

static opf_status check_inputs(opf_ctx *ctx, const opf_op *op, const opf_tensor *x,
                               const opf_tensor *extra)
{
    const char *name = opf_op_name(op);
    if (!extra)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "add_extra_input \"%s\": extra input 0 is missing",
                         name);
    return opf_op_check_addends(ctx, op, "input", x, "extra input", extra);
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    add_fwd *a = args;
    opf_status st = check_inputs(env->ctx, op, env->x, env->extra_in[0]);
    if (st) return st;
    a->x = *env->x;
    a->extra = *env->extra_in[0];
    a->in_place = ((const opf_inplace_config *)opf_op_config(op))->in_place;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const add_fwd *a = args;
    opf_dtype dt = a->in_place ? a->extra.spec.dtype : a->x.spec.dtype;
    outs[0] = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, dt);
    return OPF_OK;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const add_fwd *a = args;
    return opf_op_add(ctx, "add_extra_input", &a->x, &a->extra, &outs[0]);
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    ((opf_dy_args *)args)->dy = *env->dy;
    return OPF_OK;
}

/* dx passes dy through; the extra input's gradient is dy's copy (same spec,
 * so a quantized dy stays quantized bit for bit). */
static opf_status backward_fake(const void *args, opf_spec *grads)
{
    grads[0].ndim = OPF_GRAD_PASSTHROUGH;
    grads[1] = ((const opf_dy_args *)args)->dy.spec;
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    return opf_op_copy_tensor(ctx, "add_extra_input", &((const opf_dy_args *)args)->dy, &grads[1]);
}

const opf_op_class opf_op_class_add_extra_input = {
    OPF_OP_CLASS_HEAD("add_extra_input", sizeof(opf_inplace_config), &add_fwd_schema,
                      &opf_dy_args_schema),
    OPF_OP_CLASS_STD_HOOKS(NULL, NULL),
    .config_default = &default_config,
    .n_extra_in = 1,
    .inplace = true,         /* x is read whole before y is stored */
    .backward_is_dy = true,  /* dx and d(extra) are dy: runners pass it on */
};
