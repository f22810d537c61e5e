/* embedding.c: "embedding", token + position embedding. x: int32 token ids
 * [..., T]; y [..., T, width] = wte[id] + wpe[t] in fp32, rounded to the
 * config's dtype (or quantized with the next op's input quantizer).
 * Backward: dwte by a scatter-add of dy over the rows in order, dwpe summed
 * over the batch in order (backend/nn.h); the ids get no gradient. */
#include "ops/basic/nn-impl.h"

typedef struct emb_fwd {
    opf_tensor    x;       /* int32 ids [..., T] */
    opf_tensor    wte;     /* [V, C] */
    opf_tensor    wpe;     /* [P, C], P >= T */
    opf_quantizer next_q;  /* the next op's input quantizer, or none */
} emb_fwd;
static const opf_field emb_fwd_fields[] = {
    OPF_F_TENSOR(emb_fwd, x), OPF_F_TENSOR(emb_fwd, wte), OPF_F_TENSOR(emb_fwd, wpe),
    OPF_F_QUANT(emb_fwd, next_q)};
OPF_SCHEMA(embedding_fwd_schema, emb_fwd, emb_fwd_fields);

typedef struct emb_bwd {
    opf_tensor dy;   /* [..., T, C] */
    opf_tensor x;    /* the forward's ids */
    opf_tensor wte, wpe;  /* for the gradients' specs */
} emb_bwd;
static const opf_field emb_bwd_fields[] = {
    OPF_F_TENSOR_Q(emb_bwd, dy), OPF_F_TENSOR(emb_bwd, x), OPF_F_TENSOR(emb_bwd, wte),
    OPF_F_TENSOR(emb_bwd, wpe)};
OPF_SCHEMA(embedding_bwd_schema, emb_bwd, emb_bwd_fields);

static const opf_embedding_config default_config = {256, 64, 64, OPF_F32};

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_embedding_config *c = opf_op_config(op);
    if (c->vocab < 1 || c->context < 1 || c->width < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "embedding \"%s\": vocab %lld, context %lld and "
                         "width %lld must be >= 1", opf_op_name(op), (long long)c->vocab,
                         (long long)c->context, (long long)c->width);
    if (c->dtype != OPF_F32 && c->dtype != OPF_BF16 && c->dtype != OPF_F16)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "embedding \"%s\": dtype %s, expected f32, bf16 "
                         "or f16", opf_op_name(op), opf_dtype_name(c->dtype));
    opf_spec te = opf_spec_make(2, (int64_t[]){c->vocab, c->width}, c->dtype);
    opf_spec pe = opf_spec_make(2, (int64_t[]){c->context, c->width}, c->dtype);
    int i = opf_op_add_param(ctx, op, "wte", &te);
    if (i >= 0) i = opf_op_add_param(ctx, op, "wpe", &pe);
    return i < 0 ? (opf_status)-i : OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    emb_fwd *a = args;
    const opf_embedding_config *c = opf_op_config_const(op);
    const opf_spec *s = &env->x->spec;
    opf_status st = opf_nn_check_dtype(env->ctx, op, "input", env->x, OPF_I32);
    if (st) return st;
    if (s->ndim < 1 || s->ndim >= OPF_MAX_DIMS || s->shape[s->ndim - 1] > c->context)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "embedding \"%s\": input of %d dims with %lld "
                         "positions, the context holds %lld", opf_op_name(op), s->ndim,
                         (long long)(s->ndim ? s->shape[s->ndim - 1] : 0), (long long)c->context);
    a->x = *env->x;
    a->wte = opf_op_param(op, 0)->value;
    a->wpe = opf_op_param(op, 1)->value;
    a->next_q = opf_q_or_none(env->next_input_q);
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const emb_fwd *a = args;
    opf_spec plain = a->x.spec;
    plain.shape[plain.ndim++] = a->wte.spec.shape[1];
    plain = opf_spec_make(plain.ndim, plain.shape, a->wte.spec.dtype);
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const emb_fwd *a = args;
    const opf_nn_kernels *k = opf_nn_kernels_of(ctx, "embedding", &a->x);
    int64_t rows = opf_spec_numel(&a->x.spec), T = a->x.spec.shape[a->x.spec.ndim - 1];
    const float *wte, *wpe;
    float *y;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_nn_in(ctx, &a->wte, &wte);
    if (!st) st = opf_nn_in(ctx, &a->wpe, &wpe);
    if (!st) st = opf_nn_out(ctx, &outs[0], &y);
    if (!st)
        st = k->embed_fwd(ctx, a->x.data[0], wte, wpe, y, rows, T, a->wte.spec.shape[1],
                          a->wte.spec.shape[0]);
    return st ? st : opf_nn_finish(ctx, y, a->wte.spec.dtype, &a->next_q, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    opf_tensor_retain(&((const emb_fwd *)args)->x, &octx->saved[0]);
    octx->n_saved = 1;
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    emb_bwd *a = args;
    int64_t C = opf_op_param(op, 0)->value.spec.shape[1];
    int64_t want = octx->n_saved == 1 ? opf_spec_numel(&octx->saved[0].spec) * C : -1;
    if (opf_spec_numel(&env->dy->spec) != want)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "embedding \"%s\": gradient has %lld elements, "
                         "the output had %lld", opf_op_name(op),
                         (long long)opf_spec_numel(&env->dy->spec), (long long)want);
    a->dy = *env->dy;
    a->x = octx->saved[0];
    a->wte = opf_op_param(op, 0)->value;
    a->wpe = opf_op_param(op, 1)->value;
    return OPF_OK;
}

/* No dx: token ids are not differentiable. */
static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const emb_bwd *a = args;
    grads[1] = a->wte.spec;
    grads[2] = a->wpe.spec;
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const emb_bwd *a = args;
    const opf_nn_kernels *k = opf_nn_kernels_of(ctx, "embedding", &a->dy);
    int64_t rows = opf_spec_numel(&a->x.spec), T = a->x.spec.shape[a->x.spec.ndim - 1];
    int64_t V = a->wte.spec.shape[0], C = a->wte.spec.shape[1], P = a->wpe.spec.shape[0];
    const float *dy;
    float *dte, *dpe;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_nn_in(ctx, &a->dy, &dy);
    if (!st) st = opf_nn_out(ctx, &grads[1], &dte);
    if (!st) st = opf_nn_out(ctx, &grads[2], &dpe);
    if (!st) st = k->embed_bwd(ctx, a->x.data[0], dy, dte, dpe, rows, T, C, V, P);
    if (!st) st = opf_nn_finish(ctx, dte, a->wte.spec.dtype, NULL, &grads[1]);
    return st ? st : opf_nn_finish(ctx, dpe, a->wpe.spec.dtype, NULL, &grads[2]);
}

OPF_NN_CLASS(embedding, sizeof(opf_embedding_config), &default_config, init, 0);
