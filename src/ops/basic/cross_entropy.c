/* cross_entropy.c: "cross_entropy", the mean softmax cross-entropy of logits
 * x [..., V] against int32 targets (extra input 0, x's leading shape;
 * negative targets are ignored) into an f32 [1] loss. The forward keeps only
 * the logsumexp per row; the backward forms each probability once, as
 * dx = (softmax - onehot) * dloss / count (backend/nn.h), rounded to x's
 * dtype or quantized with the previous op's grad-output quantizer. */
#include "ops/basic/nn-impl.h"

typedef struct xent_fwd {
    opf_tensor x;        /* logits [..., V], plain or quantized */
    opf_tensor targets;  /* int32 [...] */
} xent_fwd;
static const opf_field xent_fwd_fields[] = {OPF_F_TENSOR_Q(xent_fwd, x),
                                            OPF_F_TENSOR(xent_fwd, targets)};
OPF_SCHEMA(cross_entropy_fwd_schema, xent_fwd, xent_fwd_fields);

typedef struct xent_bwd {
    opf_tensor    dy;       /* [1]: the gradient of the loss */
    opf_tensor    x, targets;
    opf_tensor    lse;      /* f32 [rows] */
    opf_quantizer dx_q;     /* the previous op's grad-output quantizer, or none */
} xent_bwd;
static const opf_field xent_bwd_fields[] = {
    OPF_F_TENSOR(xent_bwd, dy),  OPF_F_TENSOR_Q(xent_bwd, x), OPF_F_TENSOR(xent_bwd, targets),
    OPF_F_TENSOR(xent_bwd, lse), OPF_F_QUANT(xent_bwd, dx_q)};
OPF_SCHEMA(cross_entropy_bwd_schema, xent_bwd, xent_bwd_fields);

static int64_t rows_of(const opf_spec *x) { return opf_spec_numel(x) / x->shape[x->ndim - 1]; }

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    xent_fwd *a = args;
    const opf_tensor *x = env->x, *t = env->extra_in[0];
    if (!t)
        return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "cross_entropy \"%s\": no targets (extra "
                         "input 0)", opf_op_name(op));
    opf_status st = opf_nn_check_float(env->ctx, op, "logits", x);
    if (!st) st = opf_nn_check_dtype(env->ctx, op, "targets", t, OPF_I32);
    if (st) return st;
    if (x->spec.ndim < 1 || x->spec.shape[x->spec.ndim - 1] < 1 ||
        opf_spec_numel(&t->spec) != rows_of(&x->spec))
        return opf_error(env->ctx, OPF_ERR_SHAPE, "cross_entropy \"%s\": %lld targets for %lld "
                         "rows of logits", opf_op_name(op), (long long)opf_spec_numel(&t->spec),
                         (long long)(x->spec.ndim ? rows_of(&x->spec) : 0));
    a->x = *x;
    a->targets = *t;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const xent_fwd *a = args;
    int64_t one = 1, rows = rows_of(&a->x.spec);
    outs[0] = opf_spec_make(1, &one, OPF_F32);
    aux[0] = opf_spec_make(1, &rows, OPF_F32);
    return OPF_OK;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const xent_fwd *a = args;
    const opf_nn_kernels *k = opf_nn_kernels_of(ctx, "cross_entropy", &a->x);
    const void *x;
    opf_dtype xt;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_nn_in_typed(ctx, &a->x, &x, &xt);
    int64_t V = a->x.spec.shape[a->x.spec.ndim - 1];
    return st ? st : k->xent_fwd(ctx, x, xt, a->targets.data[0], aux[0].data[0], outs[0].data[0],
                                 rows_of(&a->x.spec), V);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const xent_fwd *a = args;
    opf_tensor_retain(&a->x, &octx->saved[0]);
    opf_tensor_retain(&a->targets, &octx->saved[1]);
    opf_tensor_retain(&aux[0], &octx->saved[2]);
    octx->n_saved = 3;
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    xent_bwd *a = args;
    const opf_tensor *dy = env->dy;
    if (octx->n_saved != 3 || opf_spec_numel(&dy->spec) != 1 || dy->spec.dtype != OPF_F32 ||
        dy->spec.scaling != OPF_SCALING_NONE)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "cross_entropy \"%s\": the loss gradient must be "
                         "one plain f32 value, got %lld of %s", opf_op_name(op),
                         (long long)opf_spec_numel(&dy->spec), opf_dtype_name(dy->spec.dtype));
    a->dy = *dy;
    a->x = octx->saved[0];
    a->targets = octx->saved[1];
    a->lse = octx->saved[2];
    a->dx_q = octx->prev_grad_q;
    return OPF_OK;
}

/* dx only: the targets get none. */
static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const xent_bwd *a = args;
    opf_spec plain = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, a->x.spec.dtype);
    return opf_op_out_spec(&plain, &a->dx_q, &grads[0]);
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const xent_bwd *a = args;
    const opf_nn_kernels *k = opf_nn_kernels_of(ctx, "cross_entropy", &a->x);
    const void *x;
    void *dx;
    opf_dtype xt, dxt;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_nn_in_typed(ctx, &a->x, &x, &xt);
    if (!st) st = opf_nn_out_typed(ctx, &grads[0], &dx, &dxt);
    int64_t V = a->x.spec.shape[a->x.spec.ndim - 1];
    if (!st)
        st = k->xent_bwd(ctx, x, xt, a->targets.data[0], a->lse.data[0], a->dy.data[0], dx, dxt,
                         rows_of(&a->x.spec), V);
    return st ? st : opf_nn_finish(ctx, dx, a->x.spec.dtype, &a->dx_q, &grads[0]);
}

OPF_NN_CLASS(cross_entropy, 0, NULL, NULL, 1);
