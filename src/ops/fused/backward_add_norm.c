/* backward_add_norm.c: the backward-only fusions of MakeExtraOutput
 * (in_place = false) + a norm, whose backward adds the gradient of the
 * residual branch (MakeExtraOutput's extra output) into dx before dx is
 * rounded (numerics.md 6.2). A missing extra gradient counts as zero.
 *
 *   backward_add_rmsnorm    make_extra_output, rmsnorm   (the anchor's fused ops,
 *                           BackwardAddRMSNorm; nvte_rmsnorm_bwd_add)
 *   backward_add_layernorm  make_extra_output, layernorm (opfuse's: the
 *                           anchor fuses only RMSNorm; a pre-LN transformer's
 *                           residual gradient costs a pass of its own there)
 *
 * Each consumes what the unfused forwards saved: nothing for
 * MakeExtraOutput, the norm's own context read through the norm's own
 * resolve_bwd, and runs the norm's backward kernel with the residual
 * gradient (norm-impl.h, backend/norm.h). dx is plain in the norm's dtype,
 * as MakeExtraOutput hands it on unfused; so in f32 the result is the
 * unfused one bit for bit, and in bf16/f16 it saves one rounding (the
 * norm's dx is not rounded before the add). */
#include "ops/basic/norm-impl.h"

/* The norm's backward args first (resolved by the norm itself), then the
 * extra gradient: one layout per norm, the same tail. */
#define BAN_ARGS(name, norm_t)                                                                  \
    typedef struct name {                                                                       \
        norm_t     norm;        /* the norm's backward args, dx_q none */                        \
        opf_tensor dextra;      /* gradient of MakeExtraOutput's extra output */                 \
        bool       has_dextra;                                                                  \
    } name
BAN_ARGS(bar_bwd, opf_rmsnorm_bwd);
BAN_ARGS(bal_bwd, opf_layernorm_bwd);
static const opf_field bar_bwd_fields[] = {
    {"rms", offsetof(bar_bwd, norm), OPF_FIELD_BUNDLE, 0, &opf_rmsnorm_bwd_schema},
    OPF_F_OPT(bar_bwd, dextra), OPF_F_BOOL(bar_bwd, has_dextra)};
OPF_SCHEMA(bar_bwd_schema, bar_bwd, bar_bwd_fields);
static const opf_field bal_bwd_fields[] = {
    {"ln", offsetof(bal_bwd, norm), OPF_FIELD_BUNDLE, 0, &opf_layernorm_bwd_schema},
    OPF_F_OPT(bal_bwd, dextra), OPF_F_BOOL(bal_bwd, has_dextra)};
OPF_SCHEMA(bal_bwd_schema, bal_bwd, bal_bwd_fields);

/* dx: plain [..., H] of the norm's dtype (its weight's). */
static opf_spec dx_spec(const opf_tensor *x, const opf_tensor *weight)
{
    opf_spec s = opf_spec_make(x->spec.ndim, x->spec.shape, weight->spec.dtype);
    s.device = x->spec.device;
    return s;
}

/* The norm (basic op 1) resolves its part into norm, dx_of makes its dx
 * plain and gives its spec; then MakeExtraOutput's own checks of the extra
 * gradient against its dy (that dx). */
static opf_status resolve_parts(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                                void *norm, void (*dx_of)(void *norm, opf_spec *dxs),
                                opf_tensor *dextra, bool *has_dextra)
{
    opf_op *mk = opf_op_basic(op, 0), *nm = opf_op_basic(op, 1);
    opf_bwd_env nenv = {.ctx = env->ctx, .dy = env->dy};
    opf_status st = opf_op_class_of(nm)->resolve_bwd(nm, &octx[1], &nenv, norm);
    if (st) return st;
    opf_tensor dx = {0};
    dx_of(norm, &dx.spec);
    opf_bwd_env menv = {.ctx = env->ctx, .dy = &dx, .dextra_out = {env->dextra_out[0]}};
    _Alignas(16) unsigned char margs[OPF_OP_ARGS_MAX];
    if ((st = opf_op_class_of(mk)->resolve_bwd(mk, &octx[0], &menv, margs))) return st;
    *has_dextra = env->dextra_out[0] != NULL;
    if (*has_dextra) *dextra = *env->dextra_out[0];
    return OPF_OK;
}

/* ---- add + RMSNorm ---------------------------------------------------------------- */

/* The fused dx is plain: no quantizer; its spec. */
static void rms_dx(void *norm, opf_spec *dxs)
{
    opf_rmsnorm_bwd *r = norm;
    r->dx_q = opf_quantizer_default();
    *dxs = dx_spec(&r->x, &r->weight);
}

static opf_status rms_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                                  void *bargs)
{
    bar_bwd *b = bargs;
    return resolve_parts(op, octx, env, &b->norm, rms_dx, &b->dextra, &b->has_dextra);
}

static opf_status rms_backward_fake(const void *bargs, opf_spec *grads)
{
    const bar_bwd *b = bargs;
    grads[0] = dx_spec(&b->norm.x, &b->norm.weight);
    grads[1] = b->norm.weight.spec;  /* MakeExtraOutput has no parameters; the norm's */
    return OPF_OK;
}

static opf_status rms_backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const bar_bwd *b = bargs;
    return opf_rmsnorm_backward(ctx, &b->norm, b->has_dextra ? &b->dextra : NULL, &grads[0],
                                &grads[1]);
}

const opf_op_class opf_op_class_backward_add_rmsnorm = {
    OPF_OP_CLASS_HEAD("backward_add_rmsnorm", 0, NULL, &bar_bwd_schema),
    .resolve_bwd = rms_resolve_bwd, .backward_fake = rms_backward_fake,
    .backward_impl = rms_backward_impl, .covers = 2};

/* ---- add + LayerNorm -------------------------------------------------------------- */

static void ln_dx(void *norm, opf_spec *dxs)
{
    opf_layernorm_bwd *l = norm;
    l->dx_q = opf_quantizer_default();
    *dxs = dx_spec(&l->x, &l->weight);
}

static opf_status ln_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                                 void *bargs)
{
    bal_bwd *b = bargs;
    return resolve_parts(op, octx, env, &b->norm, ln_dx, &b->dextra, &b->has_dextra);
}

static opf_status ln_backward_fake(const void *bargs, opf_spec *grads)
{
    const bal_bwd *b = bargs;
    grads[0] = dx_spec(&b->norm.x, &b->norm.weight);
    grads[1] = b->norm.weight.spec;
    grads[2] = b->norm.bias.spec;
    return OPF_OK;
}

static opf_status ln_backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const bal_bwd *b = bargs;
    return opf_layernorm_backward(ctx, &b->norm, b->has_dextra ? &b->dextra : NULL, &grads[0],
                                  &grads[1], &grads[2]);
}

const opf_op_class opf_op_class_backward_add_layernorm = {
    OPF_OP_CLASS_HEAD("backward_add_layernorm", 0, NULL, &bal_bwd_schema),
    .resolve_bwd = ln_resolve_bwd, .backward_fake = ln_backward_fake,
    .backward_impl = ln_backward_impl, .covers = 2};

/* ---- the fusions -------------------------------------------------------------------- */

/* MakeExtraOutput (not in place) directly followed by the norm named user. */
static int match(opf_op *const *ops, int n, const opf_recipe *recipe, void *user)
{
    const char *norm = user;
    return n >= 2 && opf_op_is_class(ops[0], "make_extra_output") &&
                   !opf_op_in_place(ops[0]) && opf_op_is_class(ops[1], norm)
               ? 2
               : 0;
}

static opf_status build(opf_ctx *ctx, opf_op *const *ops, int n, const opf_recipe *recipe,
                        void *user, opf_op **fused)
{
    const char *cls = strcmp(user, "rmsnorm") ? "backward_add_layernorm" : "backward_add_rmsnorm";
    return opf_fused_op_create(ctx, cls, ops, n, fused);
}

opf_status opf_fuse_backward_add_rmsnorm(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                         const opf_recipe *recipe, void *user, opf_op **ops_out,
                                         int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, build, (void *)"rmsnorm", ops_out,
                           n_out);
}

opf_status opf_fuse_backward_add_layernorm(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                           const opf_recipe *recipe, void *user, opf_op **ops_out,
                                           int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, build, (void *)"layernorm", ops_out,
                           n_out);
}
