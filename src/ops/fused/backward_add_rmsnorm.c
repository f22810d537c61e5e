/* backward_add_rmsnorm.c: BackwardAddRMSNorm (te-ops.md 6), a backward-only
 * fusion of MakeExtraOutput(in_place = false) + RMSNorm: the RMSNorm
 * backward adds the gradient of the residual branch (MakeExtraOutput's extra
 * output) into dx before dx is rounded, like nvte_rmsnorm_bwd_add
 * (numerics.md 6.2). A missing extra gradient counts as zero.
 *
 * It consumes what the unfused forwards saved: nothing for MakeExtraOutput,
 * [x, rsigma] for RMSNorm, read through RMSNorm's own resolve_bwd, and runs
 * RMSNorm's backward kernel with the residual gradient (norm-impl.h,
 * backend/norm.h). dx is plain in RMSNorm's dtype, as MakeExtraOutput hands
 * it on unfused; so in f32 the result is the unfused one bit for bit, and in
 * bf16/f16 it saves one rounding (dx_rms is not rounded before the add). */
#include "ops/basic/norm-impl.h"

typedef struct bar_bwd {
    opf_rmsnorm_bwd rms;     /* RMSNorm's backward args, dx_q none */
    opf_tensor      dextra;  /* gradient of MakeExtraOutput's extra output */
    bool            has_dextra;
} bar_bwd;
static const opf_field bar_bwd_fields[] = {
    {"rms", offsetof(bar_bwd, rms), OPF_FIELD_BUNDLE, 0, &opf_rmsnorm_bwd_schema},
    OPF_F_OPT(bar_bwd, dextra), OPF_F_BOOL(bar_bwd, has_dextra)};
OPF_SCHEMA(bar_bwd_schema, bar_bwd, bar_bwd_fields);

static opf_spec dx_spec(const opf_rmsnorm_bwd *r)
{
    opf_spec s = opf_spec_make(r->x.spec.ndim, r->x.spec.shape, r->weight.spec.dtype);
    s.device = r->x.spec.device;
    return s;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *bargs)
{
    bar_bwd *b = bargs;
    opf_op *mk = opf_op_basic(op, 0), *rms = opf_op_basic(op, 1);
    opf_bwd_env renv = {.ctx = env->ctx, .dy = env->dy};
    opf_status st = opf_op_class_of(rms)->resolve_bwd(rms, &octx[1], &renv, &b->rms);
    if (st) return st;
    b->rms.dx_q = opf_quantizer_default();
    /* MakeExtraOutput's own checks of the extra gradient against its dy (RMSNorm's dx) */
    opf_tensor dx = {.spec = dx_spec(&b->rms)};
    opf_bwd_env menv = {.ctx = env->ctx, .dy = &dx, .dextra_out = {env->dextra_out[0]}};
    _Alignas(16) unsigned char margs[OPF_OP_ARGS_MAX];
    if ((st = opf_op_class_of(mk)->resolve_bwd(mk, &octx[0], &menv, margs))) return st;
    b->has_dextra = env->dextra_out[0] != NULL;
    if (b->has_dextra) b->dextra = *env->dextra_out[0];
    return OPF_OK;
}

static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    const bar_bwd *b = bargs;
    grads[0] = dx_spec(&b->rms);
    grads[1] = b->rms.weight.spec;  /* MakeExtraOutput has no parameters; RMSNorm's weight */
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const bar_bwd *b = bargs;
    return opf_rmsnorm_backward(ctx, &b->rms, b->has_dextra ? &b->dextra : NULL, &grads[0],
                                &grads[1]);
}

const opf_op_class opf_op_class_backward_add_rmsnorm =
    OPF_BACKWARD_FUSED_CLASS("backward_add_rmsnorm", 2, &bar_bwd_schema);

/* MakeExtraOutput (not in place) directly followed by RMSNorm. */
static int match(opf_op *const *ops, int n, const opf_recipe *recipe, void *user)
{
    if (n < 2 || strcmp(opf_op_class_of(ops[0])->name, "make_extra_output") ||
        strcmp(opf_op_class_of(ops[1])->name, "rmsnorm"))
        return 0;
    const opf_inplace_config *c = opf_op_config_const(ops[0]);
    return c && c->in_place ? 0 : 2;
}

opf_status opf_fuse_backward_add_rmsnorm(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                         const opf_recipe *recipe, void *user, opf_op **ops_out,
                                         int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, opf_fusion_build_class,
                           (void *)"backward_add_rmsnorm", ops_out, n_out);
}
