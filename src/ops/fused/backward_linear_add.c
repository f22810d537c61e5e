/* backward_linear_add.c: the backward-only fusion of
 * make_extra_output(in_place) + basic_linear, the anchor's fused op
 * (BackwardLinearAdd): the linear's dgrad GEMM accumulates into the
 * gradient of the residual branch, dx = dy W + d(extra), in one pass.
 *
 * Conditions: make_extra_output is in place (its opf_inplace_config); the
 * linear is not column tensor-parallel (opfuse has no tensor parallelism
 * yet: always true).
 *
 * It consumes exactly what the unfused forwards saved: make_extra_output
 * keeps nothing, the linear's context is read by basic_linear's own
 * resolve_bwd (so quantizers, operands and the wgrad are the basic op's).
 * Without a gradient for the extra output the dgrad is plain (unfused,
 * make_extra_output then passes the linear's dx through: same bits). With
 * one, the dgrad GEMM adds onto it with beta = 1 and rounds once to the
 * activation dtype (numerics 5.3): make_extra_output stores its sum plain,
 * so dx is never quantized here. Unfused, the dgrad is rounded to the
 * activation dtype before the add; for f32 activations the two agree
 * bitwise, otherwise the fused sum is the more precise. */
#include "ops/basic/linear-impl.h"

typedef struct bla_bwd {
    opf_linear_bwd lin;        /* the linear part, resolved by basic_linear itself */
    opf_tensor     dextra;     /* gradient of make_extra_output's extra output */
    bool           has_dextra; /* a value, so the fake never looks at data */
} bla_bwd;
static const opf_field bla_bwd_fields[] = {
    OPF_F_LINEAR_BWD(bla_bwd, lin), OPF_F_OPT(bla_bwd, dextra), OPF_F_BOOL(bla_bwd, has_dextra)};
OPF_SCHEMA(bla_bwd_schema, bla_bwd, bla_bwd_fields);

/* grads: dx, then the covered ops' parameters: none for make_extra_output,
 * the weight for the linear. */
static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    const bla_bwd *b = bargs;
    opf_status st = opf_linear_backward_fake(&b->lin, grads);
    if (st || !b->has_dextra) return st;
    return opf_fused_check_sum(&grads[0], &b->dextra.spec, "the input gradient",
                               "the extra output gradient");
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                              void *bargs)
{
    bla_bwd *b = bargs;
    opf_op *lin = opf_op_basic(op, 1);
    opf_bwd_env le = {.ctx = env->ctx, .dy = env->dy, .prev_grad_q = env->prev_grad_q};
    opf_status st = opf_linear_resolve_bwd(lin, &octx[1], &le, &b->lin);
    if (st) return st;
    const opf_tensor *de = env->dextra_out[0];  /* make_extra_output's only extra output */
    b->has_dextra = de != NULL;
    if (de) {
        b->dextra = *de;
        b->lin.dx_q = opf_quantizer_default();  /* make_extra_output's sum is plain */
    }
    return OPF_OK;  /* the runner runs the fake */
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const bla_bwd *b = bargs;
    return opf_linear_backward(ctx, &b->lin, 1.0f, b->has_dextra ? &b->dextra : NULL, grads);
}

const opf_op_class opf_op_class_backward_linear_add =
    OPF_BACKWARD_FUSED_CLASS("backward_linear_add", 2, &bla_bwd_schema);

/* An in-place make_extra_output followed by basic_linear. */
static int match(opf_op *const *ops, int n, const opf_recipe *recipe, void *user)
{
    return n >= 2 && opf_op_is_class(ops[0], "make_extra_output") && opf_op_in_place(ops[0]) &&
                   opf_op_is_class(ops[1], "basic_linear")
               ? 2
               : 0;
}

opf_status opf_fuse_backward_linear_add(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                        const opf_recipe *recipe, void *user, opf_op **ops_out,
                                        int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, opf_fusion_build_class,
                           (void *)"backward_linear_add", ops_out, n_out);
}
