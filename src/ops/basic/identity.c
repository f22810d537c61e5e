/* identity.c: y = x; dx = dy (passed through unchanged). */
#include "ops/ops-impl.h"

typedef struct identity_fwd {
    opf_tensor x;
} identity_fwd;
static const opf_field identity_fwd_fields[] = {OPF_F_TENSOR_Q(identity_fwd, x)};
OPF_SCHEMA(identity_fwd_schema, identity_fwd, identity_fwd_fields);

typedef struct identity_bwd {
    opf_tensor dy;
} identity_bwd;
static const opf_field identity_bwd_fields[] = {OPF_F_TENSOR_Q(identity_bwd, dy)};
OPF_SCHEMA(identity_bwd_schema, identity_bwd, identity_bwd_fields);

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    ((identity_fwd *)args)->x = *env->x;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const identity_fwd *)args)->x.spec;
    return OPF_OK;
}

/* Copies every component (a quantized input stays quantized); in place
 * (y's memory is x's) there is nothing to copy. */
static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    return opf_op_copy_tensor(ctx, "identity", &((const identity_fwd *)args)->x, &outs[0]);
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *b)
{
    ((identity_bwd *)b)->dy = *env->dy;
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
    OPF_OP_CLASS_HEAD("identity", 0, &identity_fwd_schema, &identity_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(NULL, NULL),
    .inplace = true,  /* the copy skips equal memory */
};
