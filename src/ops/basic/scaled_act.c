/* scaled_act.c: the scaled activations of a mixture-of-experts MLP (the
 * anchor's ScaledSwiGLU, ScaledSReLU and ScaledClampedQGeGLU),
 * the activation between the two grouped linears (ops/fused/grouped_mlp.c):
 *
 *   class                  kind (backend/act.h)    x -> y
 *   scaled_swiglu          OPF_ACT_SWIGLU          [..., 2H] -> [..., H]
 *   scaled_srelu           OPF_ACT_SRELU           [..., H]  -> [..., H]
 *   scaled_clamped_qgeglu  OPF_ACT_CLAMPED_SWIGLU  [..., 2H] -> [..., H]
 *                          (limit 7, alpha 1.702: the clamped quick-GELU GLU)
 *
 *   extra input 0: scales, rows = numel(x) / cols(x) (or / 2H) values (plain
 *   f32/bf16/f16, any shape with that many elements, e.g. [rows])
 *   y_rj = fl(u_rj * s_r), u = the unscaled activation (a GLU's f(a)·b is
 *   one fp32 product, numerics.md 6.3; a GLU gates the first half)
 *   backward, g_rj = fl(dy_rj * s_r): dx = the activation's backward of g,
 *   ds_r = sum over j, left to right, of fl(u_rj * dy_rj)
 * The math is the backend's scaled kernels (backend/act.h), all fp32 with
 * one rounding at the end: y to x's dtype or quantized with the next op's
 * input quantizer, dx likewise with the previous op's grad-output
 * quantizer, ds to the scales' dtype. (TE's Python op rounds the
 * activation to the activation dtype before scaling; we keep fp32
 * throughout, like every other activation here.) Saved for backward: x and
 * the scales. The interleaved GLU layout of the anchor is not offered.
 * Config: opf_scaled_act_config (opfuse/ops.h), NULL for the defaults. */
#include <math.h>

#include "ops/basic/act-impl.h"

typedef struct sact_fwd {
    opf_tensor    x;       /* [..., cols], plain or quantized */
    opf_tensor    scales;  /* rows values, plain float */
    opf_quantizer next_q;  /* the next op's input quantizer, or none */
    int           act;     /* opf_act_kind */
    double        alpha, limit;
} sact_fwd;
static const opf_field sact_fwd_fields[] = {
    OPF_F_TENSOR_Q(sact_fwd, x), OPF_F_TENSOR(sact_fwd, scales), OPF_F_QUANT(sact_fwd, next_q),
    OPF_F_ENUM(sact_fwd, act),   OPF_F_FLOAT(sact_fwd, alpha),   OPF_F_FLOAT(sact_fwd, limit)};
OPF_SCHEMA(sact_fwd_schema, sact_fwd, sact_fwd_fields);

typedef struct sact_bwd {
    opf_tensor    x;       /* the saved input */
    opf_tensor    scales;  /* the saved scales */
    opf_tensor    dy;      /* the shape of y */
    opf_quantizer grad_q;  /* quantizer for dx, or none */
    int           act;
    double        alpha, limit;
} sact_bwd;
static const opf_field sact_bwd_fields[] = {
    OPF_F_TENSOR_Q(sact_bwd, x), OPF_F_TENSOR(sact_bwd, scales), OPF_F_TENSOR_Q(sact_bwd, dy),
    OPF_F_QUANT(sact_bwd, grad_q), OPF_F_ENUM(sact_bwd, act),    OPF_F_FLOAT(sact_bwd, alpha),
    OPF_F_FLOAT(sact_bwd, limit)};
OPF_SCHEMA(sact_bwd_schema, sact_bwd, sact_bwd_fields);

static const opf_scaled_act_config default_config = {.limit = 7.0, .alpha = 1.702};

const int opf_scaled_act_in_mlp = 1;

/* activation_recompute_in_mlp asks the fused grouped MLP for something a
 * lone activation cannot do: say so once (eagerly and while compiling). */
static void warn_recompute(opf_op *op, const opf_fwd_env *env)
{
    const opf_scaled_act_config *c = opf_op_config(op);
    if (!c->activation_recompute_in_mlp || env->kwargs == &opf_scaled_act_in_mlp) return;
    char key[96];
    snprintf(key, sizeof key, "activation_recompute_in_mlp:%s", opf_op_name(op));
    opf_ctx_warn_once(env->ctx, key, "%s \"%s\": activation_recompute_in_mlp is set but the op "
                      "runs outside a fused grouped MLP (not grouped_linear + it + grouped_linear "
                      "under the fusion's conditions, or fusions off); it is not recomputed",
                      opf_op_class_of(op)->name, opf_op_name(op));
}

int opf_scaled_act_kind_of(const opf_op *op)
{
    const opf_op_class *c = opf_op_class_of(op);
    return c == &opf_op_class_scaled_swiglu ? OPF_ACT_SWIGLU
         : c == &opf_op_class_scaled_srelu ? OPF_ACT_SRELU
         : c == &opf_op_class_scaled_clamped_qgeglu ? OPF_ACT_CLAMPED_SWIGLU : -1;
}

static int64_t out_cols(opf_act_kind k, int64_t cols) { return opf_act_is_glu(k) ? cols / 2 : cols; }

static opf_spec out_plain(opf_act_kind k, const opf_spec *x)
{
    opf_spec s = opf_spec_make(x->ndim, x->shape, x->dtype);
    s.shape[s.ndim - 1] = out_cols(k, s.shape[s.ndim - 1]);
    s.device = x->device;
    return s;
}

static opf_act_params params_of(int act, double alpha, double limit)
{
    return (opf_act_params){(float)alpha, (float)limit};
}

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_scaled_act_config *c = opf_op_config(op);
    if (opf_scaled_act_kind_of(op) != OPF_ACT_CLAMPED_SWIGLU) return OPF_OK;
    if (!(c->limit > 0.0) || !isfinite((float)c->limit) || !isfinite((float)c->alpha))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "scaled_clamped_qgeglu \"%s\": limit %g must be "
                         "> 0 and finite and alpha %g finite in fp32 (defaults 7, 1.702)",
                         opf_op_name(op), c->limit, c->alpha);
    return OPF_OK;
}

static opf_status check_x(opf_ctx *ctx, const opf_op *op, const opf_tensor *x)
{
    const char *cls = opf_op_class_of(op)->name, *name = opf_op_name(op);
    if (!x) return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": input is NULL", cls, name);
    if (!opf_is_act_dtype(x->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s \"%s\": input dtype %s, expected f32/bf16/f16",
                         cls, name, opf_dtype_name(x->spec.dtype));
    bool glu = opf_act_is_glu((opf_act_kind)opf_scaled_act_kind_of(op));
    if (x->spec.ndim < 1 || (glu && x->spec.shape[x->spec.ndim - 1] % 2))
        return opf_error(ctx, OPF_ERR_SHAPE, "%s \"%s\": input has %lld features, it needs an "
                         "even number (two halves)", cls, name,
                         (long long)(x->spec.ndim ? x->spec.shape[x->spec.ndim - 1] : -1));
    return OPF_OK;
}

static opf_status check_scales(opf_ctx *ctx, const opf_op *op, const opf_tensor *s, int64_t rows)
{
    const char *cls = opf_op_class_of(op)->name, *name = opf_op_name(op);
    if (!s || !s->data[OPF_COMP_DATA])
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": extra input 0 (the per-row scales) "
                         "is missing", cls, name);
    if (s->spec.scaling != OPF_SCALING_NONE || !opf_is_act_dtype(s->spec.dtype) ||
        opf_spec_numel(&s->spec) != rows) {
        char b[160];
        opf_spec_str(&s->spec, b, sizeof b);
        return opf_error(ctx, OPF_ERR_SHAPE, "%s \"%s\": scales are %s, expected %lld plain "
                         "f32/bf16/f16 values (one per row)", cls, name, b, (long long)rows);
    }
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    sact_fwd *a = args;
    const opf_scaled_act_config *c = opf_op_config(op);
    opf_status st = check_x(env->ctx, op, env->x);
    if (!st) st = check_scales(env->ctx, op, env->extra_in[0], opf_act_rows(&env->x->spec));
    if (st) return st;
    warn_recompute(op, env);
    a->x = *env->x;
    a->scales = *env->extra_in[0];
    a->next_q = opf_q_or_none(env->next_input_q);
    a->act = opf_scaled_act_kind_of(op);
    a->alpha = a->act == OPF_ACT_CLAMPED_SWIGLU ? c->alpha : opf_act_default_alpha(a->act);
    a->limit = a->act == OPF_ACT_CLAMPED_SWIGLU ? c->limit : 0.0;
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const sact_fwd *a = args;
    opf_spec plain = out_plain(a->act, &a->x.spec);
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const sact_fwd *a = args;
    const char *who = "scaled activation";
    const opf_act_kernels *K = opf_backend_kernels(ctx, who, a->x.spec.device, OPF_KERNELS_ACT);
    if (!K) return OPF_ERR_UNSUPPORTED;
    int64_t rows = opf_act_rows(&a->x.spec), cols = opf_act_cols(&a->x.spec);
    const float *x, *s;
    float *y;
    opf_status st = opf_act_load(ctx, who, &a->x, &x);
    if (!st) st = opf_act_load(ctx, who, &a->scales, &s);
    if (!st) st = opf_act_scratch(ctx, who, rows * out_cols(a->act, cols), &y);
    if (!st) st = K->scaled_glu_fwd(ctx, a->act, params_of(a->act, a->alpha, a->limit), x, s, y,
                                    rows, cols);
    return st ? st : opf_op_store_f32(ctx, y, a->x.spec.dtype, &a->next_q, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const sact_fwd *a = args;
    opf_tensor_retain(&a->x, &octx->saved[0]);
    opf_tensor_retain(&a->scales, &octx->saved[1]);
    octx->n_saved = 2;
    return OPF_OK;
}

static opf_status check_dy(opf_ctx *ctx, const opf_op *op, const opf_tensor *x, const opf_tensor *dy)
{
    const char *cls = opf_op_class_of(op)->name, *name = opf_op_name(op);
    if (!dy) return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": dy is NULL", cls, name);
    if (!opf_is_act_dtype(dy->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s \"%s\": gradient dtype %s, expected f32/bf16/f16",
                         cls, name, opf_dtype_name(dy->spec.dtype));
    opf_spec want = out_plain((opf_act_kind)opf_scaled_act_kind_of(op), &x->spec);
    bool same = dy->spec.ndim == want.ndim;
    for (int i = 0; same && i < want.ndim; i++) same = dy->spec.shape[i] == want.shape[i];
    if (same) return OPF_OK;
    char got[160], exp[160];
    opf_spec_str(&dy->spec, got, sizeof got);
    opf_spec_str(&want, exp, sizeof exp);
    return opf_error(ctx, OPF_ERR_SHAPE, "%s \"%s\": gradient is %s, the output was %s", cls, name,
                     got, exp);
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *bargs)
{
    sact_bwd *b = bargs;
    const opf_scaled_act_config *c = opf_op_config(op);
    if (octx->n_saved != 2)
        return opf_error(env->ctx, OPF_ERR_STATE, "%s \"%s\": context holds %d tensors, want 2 "
                         "(x, scales)", opf_op_class_of(op)->name, opf_op_name(op), octx->n_saved);
    opf_status st = check_dy(env->ctx, op, &octx->saved[0], env->dy);
    if (st) return st;
    b->x = octx->saved[0];
    b->scales = octx->saved[1];
    b->dy = *env->dy;
    b->grad_q = octx->prev_grad_q;
    b->act = opf_scaled_act_kind_of(op);
    b->alpha = b->act == OPF_ACT_CLAMPED_SWIGLU ? c->alpha : opf_act_default_alpha(b->act);
    b->limit = b->act == OPF_ACT_CLAMPED_SWIGLU ? c->limit : 0.0;
    return OPF_OK;
}

static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    const sact_bwd *b = bargs;
    opf_spec plain = opf_spec_make(b->x.spec.ndim, b->x.spec.shape, b->x.spec.dtype);
    plain.device = b->x.spec.device;
    grads[1] = b->scales.spec;  /* no parameters: grads[1] is extra input 0's */
    return opf_op_out_spec(&plain, &b->grad_q, &grads[0]);
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const sact_bwd *b = bargs;
    const char *who = "scaled activation";
    const opf_act_kernels *K = opf_backend_kernels(ctx, who, b->x.spec.device, OPF_KERNELS_ACT);
    if (!K) return OPF_ERR_UNSUPPORTED;
    int64_t n = opf_spec_numel(&b->x.spec), rows = opf_act_rows(&b->x.spec);
    int64_t cols = opf_act_cols(&b->x.spec), h = out_cols(b->act, cols);
    const float *x, *s, *dy;
    float *dx, *ds, *work;
    opf_status st = opf_act_load(ctx, who, &b->x, &x);
    if (!st) st = opf_act_load(ctx, who, &b->scales, &s);
    if (!st) st = opf_act_load(ctx, who, &b->dy, &dy);
    if (!st) st = opf_act_scratch(ctx, who, n, &dx);
    if (!st) st = opf_act_scratch(ctx, who, rows, &ds);
    if (!st) st = opf_act_scratch(ctx, who, 2 * rows * h, &work);
    if (!st) st = K->scaled_glu_bwd(ctx, b->act, params_of(b->act, b->alpha, b->limit), x, s, dy,
                                    dx, ds, work, rows, cols);
    if (!st) st = opf_op_store_f32(ctx, ds, grads[1].spec.dtype, NULL, &grads[1]);
    return st ? st : opf_op_store_f32(ctx, dx, b->x.spec.dtype, &b->grad_q, &grads[0]);
}

#define SCALED_ACT_CLASS(cls_name)                                                        \
    {OPF_OP_CLASS_HEAD(#cls_name, sizeof(opf_scaled_act_config), &sact_fwd_schema,        \
                       &sact_bwd_schema),                                                 \
     OPF_OP_CLASS_STD_HOOKS(init, setup_context), .config_default = &default_config,      \
     .n_extra_in = 1}
const opf_op_class opf_op_class_scaled_swiglu = SCALED_ACT_CLASS(scaled_swiglu);
const opf_op_class opf_op_class_scaled_srelu = SCALED_ACT_CLASS(scaled_srelu);
const opf_op_class opf_op_class_scaled_clamped_qgeglu = SCALED_ACT_CLASS(scaled_clamped_qgeglu);
