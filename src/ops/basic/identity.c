/* identity.c: y = x; dx = dy (passed through unchanged). */
#include "ops/ops-impl.h"

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    ((opf_x_args *)args)->x = *env->x;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const opf_x_args *)args)->x.spec;
    return OPF_OK;
}

/* Copies every component (a quantized input stays quantized); in place
 * (y's memory is x's) there is nothing to copy. */
static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    return opf_op_copy_tensor(ctx, "identity", &((const opf_x_args *)args)->x, &outs[0]);
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *b)
{
    ((opf_dy_args *)b)->dy = *env->dy;
    return OPF_OK;
}

static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    grads[0].ndim = OPF_GRAD_PASSTHROUGH;
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    return OPF_OK;  /* pass-through: the runner hands dy on as dx */
}

const opf_op_class opf_op_class_identity = {
    OPF_OP_CLASS_HEAD("identity", 0, &opf_x_args_schema, &opf_dy_args_schema),
    OPF_OP_CLASS_STD_HOOKS(NULL, NULL),
    .inplace = true,  /* the copy skips equal memory */
};
