/* backward_linear_scale.c: the backward-only fusion of basic_linear +
 * constant_scale, the anchor's fused op (BackwardLinearScale): the scale s is folded
 * into alpha of both backward GEMMs, dx = s * dy W and dW = s * dy^T x,
 * instead of first writing s * dy.
 *
 * Conditions: the linear is not column tensor-parallel (opfuse has no
 * tensor parallelism yet, so it always fuses).
 *
 * It consumes exactly what the unfused forwards saved: constant_scale keeps
 * nothing; the linear's context is read by basic_linear's own resolve_bwd
 * (quantizers, operands, dx quantizer, main_grad). The GEMM's dy operand is
 * the incoming gradient itself (quantized with the linear's grad-output
 * quantizer under a recipe) and alpha = fl32(s) scales the fp32 sums
 * (numerics 5.3). Unfused, fl(fl32(s) * dy) is rounded to dy's dtype and
 * that is quantized: for a power-of-two s both give the same bits (without
 * underflow), otherwise they differ by roundings of dy and, under a
 * recipe, by which values are quantized (a delayed-scaling amax records dy,
 * not s * dy: its scale is still the one for the tensor the GEMM reads). */
#include "ops/basic/linear-impl.h"

typedef struct bls_bwd {
    opf_linear_bwd lin;    /* the linear part, resolved by basic_linear itself */
    double         scale;  /* constant_scale's factor, applied as fl32(scale) */
} bls_bwd;
static const opf_field bls_bwd_fields[] = {OPF_F_LINEAR_BWD(bls_bwd, lin),
                                           OPF_F_FLOAT(bls_bwd, scale)};
OPF_SCHEMA(bls_bwd_schema, bls_bwd, bls_bwd_fields);

/* grads: dx, then the covered ops' parameters: the weight for the linear,
 * none for constant_scale. */
static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    return opf_linear_backward_fake(&((const bls_bwd *)bargs)->lin, grads);
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                              void *bargs)
{
    bls_bwd *b = bargs;
    opf_op *lin = opf_op_basic(op, 0), *scale = opf_op_basic(op, 1);
    /* the linear's part sees the scale's incoming gradient as its dy; its
     * checks (float dtype, [rows, out_features]) are the scale's and more */
    opf_bwd_env le = {.ctx = env->ctx, .dy = env->dy, .prev_grad_q = env->prev_grad_q};
    opf_status st = opf_linear_resolve_bwd(lin, &octx[0], &le, &b->lin);
    if (st) return st;
    b->scale = ((const opf_constant_scale_config *)opf_op_config_const(scale))->scale;
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const bls_bwd *b = bargs;
    return opf_linear_backward(ctx, &b->lin, (float)b->scale, NULL, grads);
}

const opf_op_class opf_op_class_backward_linear_scale =
    OPF_BACKWARD_FUSED_CLASS("backward_linear_scale", 2, &bls_bwd_schema);

/* basic_linear followed by constant_scale. */
static int match(opf_op *const *ops, int n, const opf_recipe *recipe, void *user)
{
    return n >= 2 && opf_op_is_class(ops[0], "basic_linear") &&
                   opf_op_is_class(ops[1], "constant_scale")
               ? 2
               : 0;
}

opf_status opf_fuse_backward_linear_scale(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                          const opf_recipe *recipe, void *user,
                                          opf_op **ops_out, int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, opf_fusion_build_class,
                           (void *)"backward_linear_scale", ops_out, n_out);
}
