/* constant_scale.c: y = s * x and dx = s * dy for a constant s. Each product
 * is one fp32 multiply by fl32(s), stored in the activation dtype; the output
 * may be quantized for the next op (numerics.md 6.1/6.3 store rules). */
#include <math.h>

#include "backend/elem.h"
#include "ops/ops-impl.h"

typedef struct scale_fwd {
    opf_tensor    x;
    double        scale;
    opf_quantizer next_q;
} scale_fwd;
static const opf_field scale_fwd_fields[] = {
    OPF_F_TENSOR_Q(scale_fwd, x), OPF_F_FLOAT(scale_fwd, scale), OPF_F_QUANT(scale_fwd, next_q)};
OPF_SCHEMA(scale_fwd_schema, scale_fwd, scale_fwd_fields);

typedef struct scale_bwd {
    opf_tensor dy;
    double     scale;
} scale_bwd;
static const opf_field scale_bwd_fields[] = {OPF_F_TENSOR_Q(scale_bwd, dy), OPF_F_FLOAT(scale_bwd, scale)};
OPF_SCHEMA(scale_bwd_schema, scale_bwd, scale_bwd_fields);

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_constant_scale_config *c = opf_op_config(op);
    if (!isfinite(c->scale) || fabs(c->scale) > 3.4028234663852886e38)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "constant_scale \"%s\": scale %g is not a finite "
                         "fp32 value", opf_op_name(op), c->scale);
    return OPF_OK;
}

/* Float inputs only: the op decodes quantized inputs but cannot scale ints. */
static opf_status check_float(opf_ctx *ctx, const opf_op *op, const char *what, const opf_spec *s)
{
    if (opf_is_act_dtype(s->dtype)) return OPF_OK;
    return opf_error(ctx, OPF_ERR_DTYPE, "constant_scale \"%s\": %s dtype %s, expected f32/bf16/f16",
                     opf_op_name(op), what, opf_dtype_name(s->dtype));
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    scale_fwd *a = args;
    opf_status st = check_float(env->ctx, op, "input", &env->x->spec);
    if (st) return st;
    a->x = *env->x;
    a->scale = ((const opf_constant_scale_config *)opf_op_config(op))->scale;
    a->next_q = opf_q_or_none(env->next_input_q);
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const scale_fwd *a = args;
    opf_spec plain = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, a->x.spec.dtype);
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

/* out = fl32(fl32(s) * t) by the device's kernel; a quantized out gets the
 * fp32 product through opf_op_store_f32 with q. */
static opf_status scale_into(opf_ctx *ctx, const opf_tensor *t, double scale,
                             const opf_quantizer *q, opf_tensor *out)
{
    const opf_elem_kernels *k = opf_op_elem(ctx, "constant_scale", t);
    opf_tensor x, y;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, t, &x);
    if (!st) st = opf_op_kernel_out(ctx, out, &y);
    if (!st) st = k->scale(ctx, &x, (float)scale, &y);
    return st ? st : opf_op_finish_out(ctx, &y, t->spec.dtype, q, out);
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const scale_fwd *a = args;
    return scale_into(ctx, &a->x, a->scale, &a->next_q, &outs[0]);
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    scale_bwd *a = args;
    opf_status st = check_float(env->ctx, op, "gradient", &env->dy->spec);
    if (st) return st;
    a->dy = *env->dy;
    a->scale = ((const opf_constant_scale_config *)opf_op_config(op))->scale;
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const scale_bwd *a = args;
    grads[0] = opf_spec_make(a->dy.spec.ndim, a->dy.spec.shape, a->dy.spec.dtype);
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const scale_bwd *a = args;
    return scale_into(ctx, &a->dy, a->scale, NULL, &grads[0]);
}

const opf_op_class opf_op_class_constant_scale = {
    OPF_OP_CLASS_HEAD("constant_scale", sizeof(opf_constant_scale_config), &scale_fwd_schema,
                      &scale_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(init, NULL),
    .inplace = true,  /* x is read whole before y is stored */
};
