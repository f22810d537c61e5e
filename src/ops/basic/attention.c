/* attention.c: "attention", causal multi-head self-attention over a packed
 * qkv input [B, T, 3C] (what a QKV Linear gives) into y [B, T, C] in x's
 * logical dtype. As the anchor computes attention, nothing is quantized: a
 * quantized qkv is decoded, the math is fp32 (backend/nn.h: online softmax
 * one key at a time, so no [T, T] matrix), and the next op quantizes y
 * itself. A plain qkv, dy or dqkv goes to the kernels in its own dtype (no
 * fp32 copy). Saved for backward: qkv, the output o in y's dtype (the
 * kernels round each fp32 value once; y is a copy of it, as the anchor
 * saves O in the activation dtype) and the logsumexp per softmax row
 * ([B, H, T], fp32); the backward recomputes the scores from them, its row
 * term from o as saved. dqkv is rounded to x's dtype or quantized with the
 * previous op's grad-output quantizer. */
#include "ops/basic/nn-impl.h"

typedef struct attn_fwd {
    opf_tensor x;      /* qkv [B, T, 3C], plain or quantized */
    int64_t    heads;
} attn_fwd;
static const opf_field attn_fwd_fields[] = {OPF_F_TENSOR_Q(attn_fwd, x), OPF_F_INT(attn_fwd, heads)};
OPF_SCHEMA(attention_fwd_schema, attn_fwd, attn_fwd_fields);

typedef struct attn_bwd {
    opf_tensor    dy;    /* [B, T, C] */
    opf_tensor    x;     /* the forward's qkv */
    opf_tensor    o;     /* [B, T, C] in x's logical dtype: the forward's output */
    opf_tensor    lse;   /* f32 [B, H, T] */
    opf_quantizer dx_q;  /* the previous op's grad-output quantizer, or none */
    int64_t       heads;
} attn_bwd;
static const opf_field attn_bwd_fields[] = {
    OPF_F_TENSOR_Q(attn_bwd, dy), OPF_F_TENSOR_Q(attn_bwd, x), OPF_F_TENSOR(attn_bwd, o),
    OPF_F_TENSOR(attn_bwd, lse),  OPF_F_QUANT(attn_bwd, dx_q),  OPF_F_INT(attn_bwd, heads)};
OPF_SCHEMA(attention_bwd_schema, attn_bwd, attn_bwd_fields);

static const opf_attention_config default_config = {1};

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_attention_config *c = opf_op_config(op);
    if (c->heads < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "attention \"%s\": heads %lld < 1",
                         opf_op_name(op), (long long)c->heads);
    return OPF_OK;
}

/* x is [B, T, 3C] with C a multiple of the heads. */
static opf_status check_qkv(opf_ctx *ctx, const opf_op *op, const opf_tensor *x, int64_t H)
{
    const opf_spec *s = &x->spec;
    opf_status st = opf_nn_check_float(ctx, op, "input", x);
    if (st) return st;
    int64_t w = s->ndim == 3 ? s->shape[2] : 0;
    if (s->ndim != 3 || w % 3 || (w / 3) % H || w == 0)
        return opf_error(ctx, OPF_ERR_SHAPE, "attention \"%s\": input must be qkv [B, T, 3 * width] "
                         "with width a multiple of %lld heads; got %d dims, last %lld",
                         opf_op_name(op), (long long)H, s->ndim, (long long)w);
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    attn_fwd *a = args;
    a->heads = ((const opf_attention_config *)opf_op_config_const(op))->heads;
    opf_status st = check_qkv(env->ctx, op, env->x, a->heads);
    a->x = *env->x;
    return st;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const attn_fwd *a = args;
    const int64_t *s = a->x.spec.shape;
    int64_t y[3] = {s[0], s[1], s[2] / 3}, lse[3] = {s[0], a->heads, s[1]};
    outs[0] = opf_spec_make(3, y, a->x.spec.dtype);
    aux[0] = opf_spec_make(3, lse, OPF_F32);
    aux[1] = opf_spec_make(3, y, a->x.spec.dtype);
    return OPF_OK;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const attn_fwd *a = args;
    const opf_nn_kernels *k = opf_nn_kernels_of(ctx, "attention", &a->x);
    const int64_t *s = a->x.spec.shape;
    const void *qkv;
    opf_dtype qt;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_nn_in_typed(ctx, &a->x, &qkv, &qt);
    if (!st)
        st = k->attn_fwd(ctx, qkv, qt, aux[1].data[0], aux[1].spec.dtype, aux[0].data[0], s[0],
                         s[1], a->heads, s[2] / 3 / a->heads, a->x.spec.dtype);
    return st ? st : opf_op_copy_tensor(ctx, "attention", &aux[1], &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    opf_tensor_retain(&((const attn_fwd *)args)->x, &octx->saved[0]);
    opf_tensor_retain(&aux[1], &octx->saved[1]);
    opf_tensor_retain(&aux[0], &octx->saved[2]);
    octx->n_saved = 3;
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    attn_bwd *a = args;
    int64_t want = octx->n_saved == 3 ? opf_spec_numel(&octx->saved[1].spec) : -1;
    if (opf_spec_numel(&env->dy->spec) != want)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "attention \"%s\": gradient has %lld elements, "
                         "the output had %lld", opf_op_name(op),
                         (long long)opf_spec_numel(&env->dy->spec), (long long)want);
    a->dy = *env->dy;
    a->x = octx->saved[0];
    a->o = octx->saved[1];
    a->lse = octx->saved[2];
    a->dx_q = octx->prev_grad_q;
    a->heads = ((const opf_attention_config *)opf_op_config_const(op))->heads;
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const attn_bwd *a = args;
    opf_spec plain = opf_spec_make(3, a->x.spec.shape, a->x.spec.dtype);
    return opf_op_out_spec(&plain, &a->dx_q, &grads[0]);
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    const attn_bwd *a = args;
    const opf_nn_kernels *k = opf_nn_kernels_of(ctx, "attention", &a->x);
    const int64_t *s = a->x.spec.shape;
    const void *qkv, *dy;
    void *dx;
    opf_dtype qt, dyt, dxt;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_nn_in_typed(ctx, &a->x, &qkv, &qt);
    if (!st) st = opf_nn_in_typed(ctx, &a->dy, &dy, &dyt);
    if (!st) st = opf_nn_out_typed(ctx, &grads[0], &dx, &dxt);
    if (!st)
        st = k->attn_bwd(ctx, qkv, qt, a->o.data[0], a->o.spec.dtype, a->lse.data[0], dy, dyt, dx,
                         dxt, s[0], s[1], a->heads, s[2] / 3 / a->heads, a->x.spec.dtype);
    return st ? st : opf_nn_finish(ctx, dx, a->x.spec.dtype, &a->dx_q, &grads[0]);
}

OPF_NN_CLASS(attention, sizeof(opf_attention_config), &default_config, init, 0);
