/* forward_linear_bias_add.c: the forward-only fusions of basic_linear
 * (+ bias) + add_extra_input(in_place), the anchor's fused op (ForwardLinearBiasAdd).
 * The anchor's class takes the bias as optional; a class here covers a fixed
 * number of ops, so there are two:
 *
 *   forward_linear_bias_add   basic_linear, bias, add_extra_input (3 ops)
 *   forward_linear_add        basic_linear, add_extra_input       (2 ops)
 *
 * built by one fusion function (a greedy anchor scan: the linear, then an
 * optional bias, then the in-place add that must follow).
 *
 * Conditions: the add is in place (its opf_inplace_config), which is what
 * lets the GEMM accumulate into the residual's buffer; the linear is not row
 * tensor-parallel (opfuse has no tensor parallelism yet: always true).
 *
 * Numerics (docs/numerics.md 5.3): the fprop GEMM of basic_linear (its own
 * operand quantization, linear-impl.h) accumulating onto a copy of the extra
 * input, D = fl(fl(fl(alpha' * acc) + bias) + extra), rounded to the extra
 * input's dtype: the output dtype of an in-place add_extra_input. As in the
 * anchor the output is never quantized (the add passes no quantizer on).
 * The unfused ops round the GEMM output (and the bias output) to the
 * activation dtype first; the fused op does not, so it is at least as
 * precise and, for f32 activations, bitwise equal.
 *
 * Contexts: the linear's by basic_linear's setup_context; bias and add keep
 * nothing; the covered ops after the first get the previous-op gradient
 * quantizer the unfused runner would give them. */
#include "ops/basic/linear-impl.h"

typedef struct flbadd_fwd {
    opf_linear_fwd lin;      /* the linear part, resolved by basic_linear itself */
    opf_tensor     bias;     /* [out_features]; absent in forward_linear_add */
    opf_tensor     extra;    /* the add's extra input, shape of the output */
    bool           has_bias; /* the 3-op class (a value, so the fake never looks at data) */
} flbadd_fwd;
static const opf_field flbadd_fwd_fields[] = {
    OPF_F_LINEAR_FWD(flbadd_fwd, lin),
    OPF_F(flbadd_fwd, bias, OPF_FIELD_TENSOR, OPF_FIELD_OPTIONAL),
    OPF_F_TENSOR_Q(flbadd_fwd, extra), OPF_F_BOOL(flbadd_fwd, has_bias)};
OPF_SCHEMA(flbadd_fwd_schema, flbadd_fwd, flbadd_fwd_fields);
_Static_assert(offsetof(flbadd_fwd, lin) == 0, "after_fake reads the linear part first");

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const flbadd_fwd *a = args;
    opf_spec lin_out[1 + OPF_OP_MAX_EXTRA];
    opf_status st = opf_linear_forward_fake(&a->lin, lin_out, aux);
    if (st) return st;
    const opf_spec *y = &lin_out[0];
    int64_t n = y->shape[y->ndim - 1];
    if (a->has_bias && (a->bias.spec.ndim != 1 || a->bias.spec.shape[0] != n))
        return opf_error(NULL, OPF_ERR_SHAPE, "the linear has %lld outputs, the bias %lld values",
                         (long long)n, (long long)(a->bias.spec.ndim ? a->bias.spec.shape[0] : 0));
    /* the in-place add's output: the extra input's dtype */
    return opf_fused_add_out_spec(y, &a->extra.spec, &outs[0]);
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    flbadd_fwd *a = args;
    opf_status st = opf_fused_linear_add_resolve(op, env, &a->lin, &a->extra);
    if (st) return st;
    a->has_bias = opf_op_num_basic(op) == 3;
    if (a->has_bias) a->bias = opf_op_param(opf_op_basic(op, 1), 0)->value;
    return OPF_OK;  /* the runner runs the fake, then the linear's after_fake */
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const flbadd_fwd *a = args;
    opf_gemm_options o = opf_gemm_options_default();
    o.bias = a->has_bias ? &a->bias : NULL;
    return opf_fused_linear_add_fprop(ctx, &a->lin, aux, &o, &a->extra, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    return opf_fused_linear_setup_context(op, octx, &((const flbadd_fwd *)args)->lin, outs, aux);
}

const opf_op_class opf_op_class_forward_linear_bias_add =
    OPF_FORWARD_FUSED_CLASS("forward_linear_bias_add", 3, &flbadd_fwd_schema);
const opf_op_class opf_op_class_forward_linear_add =
    OPF_FORWARD_FUSED_CLASS("forward_linear_add", 2, &flbadd_fwd_schema);

/* basic_linear, an optional bias, then an in-place add_extra_input. */
static int match(opf_op *const *ops, int n, const opf_recipe *recipe, void *user)
{
    if (n < 2 || !opf_op_is_class(ops[0], "basic_linear")) return 0;
    int k = opf_op_is_class(ops[1], "bias") ? 2 : 1;
    return n > k && opf_op_is_class(ops[k], "add_extra_input") && opf_op_in_place(ops[k]) ? k + 1
                                                                                         : 0;
}

static opf_status build(opf_ctx *ctx, opf_op *const *ops, int n, const opf_recipe *recipe,
                        void *user, opf_op **fused)
{
    const char *cls = n == 3 ? "forward_linear_bias_add" : "forward_linear_add";
    return opf_fused_op_create(ctx, cls, ops, n, fused);
}

opf_status opf_fuse_forward_linear_bias_add(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                            const opf_recipe *recipe, void *user,
                                            opf_op **ops_out, int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, build, NULL, ops_out, n_out);
}
