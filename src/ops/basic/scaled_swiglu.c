/* scaled_swiglu.c: "scaled_swiglu", SwiGLU with a per-row scale (the
 * anchor's ScaledSwiGLU, te-ops.md 5), the activation between the two
 * grouped linears of a mixture-of-experts MLP (ops/fused/grouped_mlp.c).
 *
 *   x [..., 2H] = [a | b] (a, the first half, is activated: numerics.md 6.3)
 *   extra input 0: scales, rows = numel(x) / 2H values (plain f32/bf16/f16,
 *   any shape with that many elements, e.g. [rows] or x's leading shape)
 *   y_rj  = fl(fl(silu(a_rj) * b_rj) * s_r)                      [..., H]
 *   backward, g_rj = fl(dy_rj * s_r):
 *   da_rj = f'(a_rj) * g_rj * b_rj,  db_rj = silu(a_rj) * g_rj   (as SwiGLU)
 *   ds_r  = sum over j, left to right, of fl(fl(silu(a_rj) * b_rj) * dy_rj)
 * The math is the backend's scaled GLU kernel of kind SwiGLU
 * (backend/act.h), all fp32 with one rounding at the end: y to x's dtype
 * or quantized with the next op's input quantizer, dx likewise with the
 * previous op's grad-output quantizer, ds to the scales' dtype. (TE's
 * Python op rounds the SwiGLU output to the activation dtype before
 * scaling; we keep fp32 throughout, like every other activation here.) Saved for backward: x and the scales.
 * The interleaved GLU layout of the anchor is not offered. Takes no config. */
#include "ops/basic/act-impl.h"

typedef struct ssg_fwd {
    opf_tensor    x;       /* [..., 2H], plain or quantized */
    opf_tensor    scales;  /* rows values, plain float */
    opf_quantizer next_q;  /* the next op's input quantizer, or none */
} ssg_fwd;
static const opf_field ssg_fwd_fields[] = {
    OPF_F_TENSOR_Q(ssg_fwd, x), OPF_F_TENSOR(ssg_fwd, scales), OPF_F_QUANT(ssg_fwd, next_q)};
OPF_SCHEMA(ssg_fwd_schema, ssg_fwd, ssg_fwd_fields);

typedef struct ssg_bwd {
    opf_tensor    x;       /* the saved input */
    opf_tensor    scales;  /* the saved scales */
    opf_tensor    dy;      /* [..., H] */
    opf_quantizer grad_q;  /* quantizer for dx, or none */
} ssg_bwd;
static const opf_field ssg_bwd_fields[] = {
    OPF_F_TENSOR_Q(ssg_bwd, x), OPF_F_TENSOR(ssg_bwd, scales), OPF_F_TENSOR_Q(ssg_bwd, dy),
    OPF_F_QUANT(ssg_bwd, grad_q)};
OPF_SCHEMA(ssg_bwd_schema, ssg_bwd, ssg_bwd_fields);

static opf_spec out_plain(const opf_spec *x)
{
    opf_spec s = opf_spec_make(x->ndim, x->shape, x->dtype);
    s.shape[s.ndim - 1] /= 2;
    s.device = x->device;
    return s;
}

static opf_status check_x(opf_ctx *ctx, const opf_op *op, const opf_tensor *x)
{
    const char *name = opf_op_name(op);
    if (!x) return opf_error(ctx, OPF_ERR_INVALID_ARG, "scaled_swiglu \"%s\": input is NULL", name);
    if (!opf_is_act_dtype(x->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "scaled_swiglu \"%s\": input dtype %s, expected "
                         "f32/bf16/f16", name, opf_dtype_name(x->spec.dtype));
    if (x->spec.ndim < 1 || x->spec.shape[x->spec.ndim - 1] % 2)
        return opf_error(ctx, OPF_ERR_SHAPE, "scaled_swiglu \"%s\": input has %lld features, it "
                         "needs an even number (two halves)", name,
                         (long long)(x->spec.ndim ? x->spec.shape[x->spec.ndim - 1] : -1));
    return OPF_OK;
}

static opf_status check_scales(opf_ctx *ctx, const opf_op *op, const opf_tensor *s, int64_t rows)
{
    const char *name = opf_op_name(op);
    if (!s || !s->data[OPF_COMP_DATA])
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "scaled_swiglu \"%s\": extra input 0 (the "
                         "per-row scales) is missing", name);
    if (s->spec.scaling != OPF_SCALING_NONE || !opf_is_act_dtype(s->spec.dtype) ||
        opf_spec_numel(&s->spec) != rows) {
        char b[160];
        opf_spec_str(&s->spec, b, sizeof b);
        return opf_error(ctx, OPF_ERR_SHAPE, "scaled_swiglu \"%s\": scales are %s, expected %lld "
                         "plain f32/bf16/f16 values (one per row)", name, b, (long long)rows);
    }
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    ssg_fwd *a = args;
    opf_status st = check_x(env->ctx, op, env->x);
    if (!st) st = check_scales(env->ctx, op, env->extra_in[0], opf_act_rows(&env->x->spec));
    if (st) return st;
    a->x = *env->x;
    a->scales = *env->extra_in[0];
    a->next_q = opf_q_or_none(env->next_input_q);
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const ssg_fwd *a = args;
    opf_spec plain = out_plain(&a->x.spec);
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

/* SwiGLU's row of the activation table. */
static opf_act_params swiglu_params(void)
{
    return (opf_act_params){(float)opf_act_default_alpha(OPF_ACT_SWIGLU), 0.0f};
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const ssg_fwd *a = args;
    const char *who = "scaled_swiglu";
    const opf_act_kernels *K = opf_backend_kernels(ctx, who, a->x.spec.device, OPF_KERNELS_ACT);
    if (!K) return OPF_ERR_UNSUPPORTED;
    int64_t n = opf_spec_numel(&a->x.spec), rows = opf_act_rows(&a->x.spec);
    const float *x, *s;
    float *y;
    opf_status st = opf_act_load(ctx, who, &a->x, &x);
    if (!st) st = opf_act_load(ctx, who, &a->scales, &s);
    if (!st) st = opf_act_scratch(ctx, who, n / 2, &y);
    if (!st) st = K->scaled_glu_fwd(ctx, OPF_ACT_SWIGLU, swiglu_params(), x, s, y, rows,
                                    opf_act_cols(&a->x.spec));
    return st ? st : opf_op_store_f32(ctx, y, a->x.spec.dtype, &a->next_q, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const ssg_fwd *a = args;
    opf_tensor_retain(&a->x, &octx->saved[0]);
    opf_tensor_retain(&a->scales, &octx->saved[1]);
    octx->n_saved = 2;
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *bargs)
{
    ssg_bwd *b = bargs;
    const char *name = opf_op_name(op);
    if (octx->n_saved != 2)
        return opf_error(env->ctx, OPF_ERR_STATE, "scaled_swiglu \"%s\": context holds %d tensors, "
                         "want 2 (x, scales)", name, octx->n_saved);
    const opf_tensor *x = &octx->saved[0], *dy = env->dy;
    if (!dy) return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "scaled_swiglu \"%s\": dy is NULL", name);
    if (!opf_is_act_dtype(dy->spec.dtype))
        return opf_error(env->ctx, OPF_ERR_DTYPE, "scaled_swiglu \"%s\": gradient dtype %s, "
                         "expected f32/bf16/f16", name, opf_dtype_name(dy->spec.dtype));
    opf_spec want = out_plain(&x->spec);
    bool same = dy->spec.ndim == want.ndim;
    for (int i = 0; same && i < want.ndim; i++) same = dy->spec.shape[i] == want.shape[i];
    if (!same) {
        char got[160], exp[160];
        opf_spec_str(&dy->spec, got, sizeof got);
        opf_spec_str(&want, exp, sizeof exp);
        return opf_error(env->ctx, OPF_ERR_SHAPE, "scaled_swiglu \"%s\": gradient is %s, the "
                         "output was %s", name, got, exp);
    }
    b->x = *x;
    b->scales = octx->saved[1];
    b->dy = *dy;
    b->grad_q = octx->prev_grad_q;
    return OPF_OK;
}

static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    const ssg_bwd *b = bargs;
    opf_spec plain = opf_spec_make(b->x.spec.ndim, b->x.spec.shape, b->x.spec.dtype);
    plain.device = b->x.spec.device;
    grads[1] = b->scales.spec;  /* no parameters: grads[1] is extra input 0's */
    return opf_op_out_spec(&plain, &b->grad_q, &grads[0]);
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const ssg_bwd *b = bargs;
    const char *who = "scaled_swiglu";
    const opf_act_kernels *K = opf_backend_kernels(ctx, who, b->x.spec.device, OPF_KERNELS_ACT);
    if (!K) return OPF_ERR_UNSUPPORTED;
    int64_t n = opf_spec_numel(&b->x.spec), rows = opf_act_rows(&b->x.spec);
    const float *x, *s, *dy;
    float *dx, *ds, *work;
    opf_status st = opf_act_load(ctx, who, &b->x, &x);
    if (!st) st = opf_act_load(ctx, who, &b->scales, &s);
    if (!st) st = opf_act_load(ctx, who, &b->dy, &dy);
    if (!st) st = opf_act_scratch(ctx, who, n, &dx);
    if (!st) st = opf_act_scratch(ctx, who, rows, &ds);
    if (!st) st = opf_act_scratch(ctx, who, n, &work);
    if (!st) st = K->scaled_glu_bwd(ctx, OPF_ACT_SWIGLU, swiglu_params(), x, s, dy, dx, ds, work,
                                    rows, opf_act_cols(&b->x.spec));
    if (!st) st = opf_op_store_f32(ctx, ds, grads[1].spec.dtype, NULL, &grads[1]);
    return st ? st : opf_op_store_f32(ctx, dx, b->x.spec.dtype, &b->grad_q, &grads[0]);
}

const opf_op_class opf_op_class_scaled_swiglu = {
    OPF_OP_CLASS_HEAD("scaled_swiglu", 0, &ssg_fwd_schema, &ssg_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(NULL, setup_context),
    .n_extra_in = 1,
};
