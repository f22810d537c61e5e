/* forward_linear_scale_add.c: the forward-only fusion of basic_linear +
 * constant_scale + add_extra_input(in_place), the anchor's fused op
 * (ForwardLinearScaleAdd): y = s * x W^T + extra in one GEMM, the scale as
 * alpha and the extra input as the accumulated C.
 *
 * Conditions: the add is in place (its opf_inplace_config); the linear is
 * not row tensor-parallel (opfuse has no tensor parallelism yet: always).
 *
 * Numerics (docs/numerics.md 5.3): the fprop GEMM of basic_linear (its own
 * operand quantization, linear-impl.h) with alpha = fl32(s) accumulating
 * onto a copy of the extra input, rounded to the extra input's dtype (the
 * output dtype of an in-place add_extra_input; never quantized, as in the
 * anchor). Unfused, the linear output is rounded to the activation dtype,
 * then multiplied by fl32(s) and rounded again. Where the GEMM applies alpha
 * to the fp32 sum itself (plain, MXFP8, FP8 block) the fused result for f32
 * activations is bitwise the unfused one; per-tensor FP8 and NVFP4 fold s
 * into their scale product alpha' (one rounding instead of two), which
 * differs in the last bit at most.
 *
 * Contexts: the linear's by basic_linear's setup_context; constant_scale and
 * the add keep nothing; the covered ops after the first get the previous-op
 * gradient quantizer the unfused runner would give them. */
#include "ops/basic/linear-impl.h"

typedef struct flsadd_fwd {
    opf_linear_fwd lin;    /* the linear part, resolved by basic_linear itself */
    opf_tensor     extra;  /* the add's extra input, shape of the output */
    double         scale;  /* constant_scale's factor, applied as fl32(scale) */
} flsadd_fwd;
static const opf_field flsadd_fwd_fields[] = {
    OPF_F_LINEAR_FWD(flsadd_fwd, lin), OPF_F_TENSOR_Q(flsadd_fwd, extra),
    OPF_F_FLOAT(flsadd_fwd, scale)};
OPF_SCHEMA(flsadd_fwd_schema, flsadd_fwd, flsadd_fwd_fields);
_Static_assert(offsetof(flsadd_fwd, lin) == 0, "after_fake reads the linear part first");

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const flsadd_fwd *a = args;
    opf_spec lin_out[1 + OPF_OP_MAX_EXTRA];
    opf_status st = opf_linear_forward_fake(&a->lin, lin_out, aux);
    if (st) return st;
    /* the in-place add's output: the extra input's dtype */
    return opf_fused_add_out_spec(&lin_out[0], &a->extra.spec, &outs[0]);
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    flsadd_fwd *a = args;
    opf_status st = opf_fused_linear_add_resolve(op, env, &a->lin, &a->extra);
    if (st) return st;
    const opf_op *scale = opf_op_basic(op, 1);
    a->scale = ((const opf_constant_scale_config *)opf_op_config_const(scale))->scale;
    return OPF_OK;  /* the runner runs the fake, then the linear's after_fake */
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const flsadd_fwd *a = args;
    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = (float)a->scale;  /* constant_scale multiplies by fl32(s) */
    return opf_fused_linear_add_fprop(ctx, &a->lin, aux, &o, &a->extra, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    return opf_fused_linear_setup_context(op, octx, &((const flsadd_fwd *)args)->lin, outs, aux);
}

const opf_op_class opf_op_class_forward_linear_scale_add =
    OPF_FORWARD_FUSED_CLASS("forward_linear_scale_add", 3, &flsadd_fwd_schema);

/* basic_linear, constant_scale, then an in-place add_extra_input. */
static int match(opf_op *const *ops, int n, const opf_recipe *recipe, void *user)
{
    return n >= 3 && opf_op_is_class(ops[0], "basic_linear") &&
                   opf_op_is_class(ops[1], "constant_scale") &&
                   opf_op_is_class(ops[2], "add_extra_input") && opf_op_in_place(ops[2])
               ? 3
               : 0;
}

opf_status opf_fuse_forward_linear_scale_add(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                             const opf_recipe *recipe, void *user,
                                             opf_op **ops_out, int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, opf_fusion_build_class,
                           (void *)"forward_linear_scale_add", ops_out, n_out);
}
