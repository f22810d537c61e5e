/* make_extra_output.c: y = x and extra output 0 = x (a residual branch taken
 * off the main path; a quantized x stays quantized). The eager runner and
 * the compiler hand x itself on for both (forward_is_input); the impl's
 * copies serve runners that need distinct memory;
 * dx = dy + d(extra), where a missing extra gradient counts as zero (then dy
 * passes through unchanged). The sum is one fp32 add of the decoded values,
 * stored plain in dy's dtype.
 *
 * in_place is accepted for API parity: it tells the fuser that
 * BackwardLinearAdd may accumulate its dgrad into the extra gradient. A NULL
 * config means not in place. */
#include "ops/ops-impl.h"

typedef struct make_bwd {
    opf_tensor dy;
    opf_tensor dextra;      /* present only when has_dextra */
    bool       has_dextra;  /* a value, so the fake never looks at data */
} make_bwd;
static const opf_field make_bwd_fields[] = {
    OPF_F_TENSOR_Q(make_bwd, dy), OPF_F_OPT(make_bwd, dextra), OPF_F_BOOL(make_bwd, has_dextra)};
OPF_SCHEMA(make_bwd_schema, make_bwd, make_bwd_fields);

static const opf_inplace_config default_config = {.in_place = false};

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    ((opf_x_args *)args)->x = *env->x;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = outs[1] = ((const opf_x_args *)args)->x.spec;
    return OPF_OK;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const opf_tensor *x = &((const opf_x_args *)args)->x;
    opf_status st = opf_op_copy_tensor(ctx, "make_extra_output", x, &outs[0]);
    return st ? st : opf_op_copy_tensor(ctx, "make_extra_output", x, &outs[1]);
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    make_bwd *a = args;
    const opf_tensor *de = env->dextra_out[0];
    if (de) {
        opf_status st =
            opf_op_check_addends(env->ctx, op, "gradient", env->dy, "extra gradient", de);
        if (st) return st;
        a->dextra = *de;
    }
    a->dy = *env->dy;
    a->has_dextra = de != NULL;
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const make_bwd *a = args;
    if (a->has_dextra) grads[0] = opf_spec_make(a->dy.spec.ndim, a->dy.spec.shape, a->dy.spec.dtype);
    else grads[0].ndim = OPF_GRAD_PASSTHROUGH;
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const make_bwd *a = args;
    if (!a->has_dextra) return OPF_OK;  /* pass-through: the runner hands dy on */
    return opf_op_add(ctx, "make_extra_output", &a->dy, &a->dextra, &grads[0]);
}

const opf_op_class opf_op_class_make_extra_output = {
    OPF_OP_CLASS_HEAD("make_extra_output", sizeof(opf_inplace_config), &opf_x_args_schema,
                      &make_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(NULL, NULL),
    .config_default = &default_config,
    .n_extra_out = 1,
    .inplace = true,           /* the copies skip equal memory (y == x) */
    .forward_is_input = true,  /* y and the extra output are x: runners pass it on */
};
