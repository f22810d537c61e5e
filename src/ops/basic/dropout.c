/* dropout.c: in training, y = x * mask / (1 - p) with a Bernoulli(1 - p) keep
 * mask drawn from the context's Philox stream; dx = dy * mask / (1 - p) with
 * the saved mask. In eval (kwargs training = false), y = x (a copy) and dy
 * passes through. NULL kwargs mean training.
 *
 * The mask is defined so that CPU and CUDA draw the same bits: a forward
 * reserves ceil(n / 4) Philox counters with opf_ctx_rng_advance (offset o,
 * key seed); element e takes word e % 4 of
 *     philox4x32_10(counter {lo32(o + e/4), hi32(o + e/4), 0, 0},
 *                   key {lo32(seed), hi32(seed)})
 * and is kept when that word >= (uint32_t)(p * 2^32). Kept values are
 * fl32(v * s) with s = fl32(1 / (1 - p)) (the quotient in double), dropped
 * ones v * 0. The mask is saved as a U8 tensor (1 = kept) for backward. */
#include <math.h>

#include "backend/elem.h"
#include "ops/ops-impl.h"

typedef struct dropout_fwd {
    opf_tensor x;
    double     p;
    bool       training;  /* kwarg */
} dropout_fwd;
static const opf_field dropout_fwd_fields[] = {
    OPF_F_TENSOR_Q(dropout_fwd, x), OPF_F_FLOAT(dropout_fwd, p),
    OPF_F(dropout_fwd, training, OPF_FIELD_BOOL, OPF_FIELD_KWARG)};
OPF_SCHEMA(dropout_fwd_schema, dropout_fwd, dropout_fwd_fields);

typedef struct dropout_bwd {
    opf_tensor dy;
    opf_tensor mask;      /* U8, present only when training */
    double     p;
    bool       training;
} dropout_bwd;
static const opf_field dropout_bwd_fields[] = {
    OPF_F_TENSOR_Q(dropout_bwd, dy), OPF_F_OPT(dropout_bwd, mask), OPF_F_FLOAT(dropout_bwd, p),
    OPF_F_BOOL(dropout_bwd, training)};
OPF_SCHEMA(dropout_bwd_schema, dropout_bwd, dropout_bwd_fields);

static const opf_field dropout_kwargs_fields[] = {
    OPF_F(opf_dropout_kwargs, training, OPF_FIELD_BOOL, OPF_FIELD_KWARG)};
OPF_SCHEMA(dropout_kwargs_schema, opf_dropout_kwargs, dropout_kwargs_fields);

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    double p = ((const opf_dropout_config *)opf_op_config(op))->p;
    if (!(p >= 0.0 && p < 1.0))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "dropout \"%s\": p %g outside [0, 1)",
                         opf_op_name(op), p);
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    dropout_fwd *a = args;
    const opf_dropout_kwargs *kw = env->kwargs;
    bool training = kw ? kw->training : true;
    if (training && !opf_is_act_dtype(env->x->spec.dtype))
        return opf_error(env->ctx, OPF_ERR_DTYPE, "dropout \"%s\": input dtype %s, expected "
                         "f32/bf16/f16", opf_op_name(op), opf_dtype_name(env->x->spec.dtype));
    a->x = *env->x;
    a->p = ((const opf_dropout_config *)opf_op_config(op))->p;
    a->training = training;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const dropout_fwd *a = args;
    if (!a->training) {
        outs[0] = a->x.spec;
        return OPF_OK;
    }
    outs[0] = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, a->x.spec.dtype);
    aux[0] = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, OPF_U8);
    return OPF_OK;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const dropout_fwd *a = args;
    if (!a->training) return opf_op_copy_tensor(ctx, "dropout", &a->x, &outs[0]);
    const opf_elem_kernels *k = opf_op_elem(ctx, "dropout", &a->x);
    opf_tensor x;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->x, &x);
    if (st) return st;
    uint64_t seed = 0, n = (uint64_t)opf_spec_numel(&a->x.spec);
    opf_ctx_get_rng(ctx, &seed, NULL);
    uint64_t offset = opf_ctx_rng_advance(ctx, (n + 3) / 4);
    return k->dropout_fwd(ctx, &x, a->p, seed, offset, &outs[0], &aux[0]);
}

/* attrs[0] = training; saved[0] = the mask when training. */
static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const dropout_fwd *a = args;
    octx->attrs[0] = a->training;
    if (a->training) opf_tensor_retain(&aux[0], &octx->saved[octx->n_saved++]);
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    dropout_bwd *a = args;
    bool training = octx->attrs[0] != 0;
    const opf_tensor *dy = env->dy;
    if (training) {
        const opf_tensor *m = &octx->saved[0];
        if (opf_spec_numel(&dy->spec) != opf_spec_numel(&m->spec) || !opf_is_act_dtype(dy->spec.dtype)) {
            char b[160], c[160];
            opf_spec_str(&dy->spec, b, sizeof b);
            opf_spec_str(&m->spec, c, sizeof c);
            return opf_error(env->ctx, opf_spec_numel(&dy->spec) != opf_spec_numel(&m->spec)
                             ? OPF_ERR_SHAPE : OPF_ERR_DTYPE,
                             "dropout \"%s\": gradient %s does not fit the forward's mask %s "
                             "(a float gradient of the output's size)", opf_op_name(op), b, c);
        }
        a->mask = *m;
    }
    a->dy = *dy;
    a->p = ((const opf_dropout_config *)opf_op_config(op))->p;
    a->training = training;
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const dropout_bwd *a = args;
    if (a->training) grads[0] = opf_spec_make(a->dy.spec.ndim, a->dy.spec.shape, a->dy.spec.dtype);
    else grads[0].ndim = OPF_GRAD_PASSTHROUGH;
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const dropout_bwd *a = args;
    if (!a->training) return OPF_OK;  /* the runner passes dy on */
    const opf_elem_kernels *k = opf_op_elem(ctx, "dropout", &a->dy);
    opf_tensor dy;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, &a->dy, &dy);
    return st ? st : k->dropout_bwd(ctx, &dy, &a->mask, a->p, &grads[0]);
}

const opf_op_class opf_op_class_dropout = {
    OPF_OP_CLASS_HEAD("dropout", sizeof(opf_dropout_config), &dropout_fwd_schema,
                      &dropout_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(init, setup_context),
    .kwargs_schema = &dropout_kwargs_schema,
    .inplace = true,  /* x is read whole before y is stored */
};
