/* act.c: the activation op classes, generated from OPF_ACT_CLASSES
 * (act-impl.h), and the resolve / fake / impl they share. The impls are
 * dispatchers: widen the input to fp32, run the backend's kernel of the
 * class's kind (backend/act.h, numerics.md 6.3), round or quantize the
 * result. Each class's init and resolve entries carry its kind, so no call
 * compares names. */
#include <math.h>

#include "ops/basic/act-impl.h"

/* ---- the table -------------------------------------------------------------------- */

typedef struct act_row {
    const char         *name;
    const opf_op_class *cls;
    double              alpha;
} act_row;

#define ACT_ROW(n, kind, alpha) [kind] = {#n, &opf_op_class_##n, alpha},
#define ACT_ONE(n, kind, alpha) +1
static const act_row act_rows[] = {OPF_ACT_CLASSES(ACT_ROW)};
_Static_assert(0 OPF_ACT_CLASSES(ACT_ONE) == OPF_ACT_COUNT &&
                   sizeof act_rows / sizeof act_rows[0] == OPF_ACT_COUNT,
               "one activation class per opf_act_kind");
#undef ACT_ONE
#undef ACT_ROW

int opf_act_kind_of(const opf_op *op)
{
    const opf_op_class *c = opf_op_class_of(op);
    for (int k = 0; k < OPF_ACT_COUNT; k++)
        if (act_rows[k].cls == c) return k;
    return -1;
}

double opf_act_default_alpha(opf_act_kind k) { return act_rows[k].alpha; }

/* ---- schemas -------------------------------------------------------------------- */

static const opf_field act_fwd_fields[] = {
    OPF_F_TENSOR_Q(opf_act_fwd, x), OPF_F_QUANT(opf_act_fwd, next_q), OPF_F_ENUM(opf_act_fwd, act),
    OPF_F_FLOAT(opf_act_fwd, alpha), OPF_F_FLOAT(opf_act_fwd, limit)};
OPF_SCHEMA(act_fwd_schema, opf_act_fwd, act_fwd_fields);

static const opf_field act_bwd_fields[] = {
    OPF_F_TENSOR_Q(opf_act_bwd, x), OPF_F_TENSOR_Q(opf_act_bwd, dy),
    OPF_F_QUANT(opf_act_bwd, grad_q), OPF_F_ENUM(opf_act_bwd, act),
    OPF_F_FLOAT(opf_act_bwd, alpha), OPF_F_FLOAT(opf_act_bwd, limit)};
OPF_SCHEMA(act_bwd_schema, opf_act_bwd, act_bwd_fields);

/* ---- traced half -------------------------------------------------------------- */

static opf_status act_init(opf_ctx *ctx, opf_op *op, opf_act_kind k)
{
    if (k != OPF_ACT_CLAMPED_SWIGLU) return OPF_OK;
    const opf_clamped_swiglu_config *c = opf_op_config(op);
    if (!(c->limit > 0.0) || !isfinite((float)c->limit))
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "clamped_swiglu \"%s\": limit %g must be > 0 and finite in fp32 (default 7)",
                         opf_op_name(op), c->limit);
    if (!isfinite((float)c->alpha))
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "clamped_swiglu \"%s\": alpha %g must be finite in fp32 (default 1.702)",
                         opf_op_name(op), c->alpha);
    return OPF_OK;
}

/* "[4,63]" */
static void shape_str(const opf_spec *s, char *buf, size_t size)
{
    size_t n = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < s->ndim && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", i ? "," : "", (long long)s->shape[i]);
    if (n < size) snprintf(buf + n, size - n, "]");
}

/* The plain spec of y for an input spec x (last dim halved when gated). */
static opf_spec act_out_plain(const opf_spec *x, bool gated)
{
    opf_spec s = opf_spec_make(x->ndim, x->shape, x->dtype);
    if (gated) s.shape[s.ndim - 1] /= 2;
    return s;
}

/* Fills the kind-dependent fields shared by both directions. */
static void act_params(opf_op *op, opf_act_kind k, int *act, double *alpha, double *limit)
{
    *act = k;
    *alpha = act_rows[k].alpha;
    *limit = 0.0;
    if (k == OPF_ACT_CLAMPED_SWIGLU) {
        const opf_clamped_swiglu_config *c = opf_op_config(op);
        *alpha = c->alpha;
        *limit = c->limit;
    }
}

static opf_status act_resolve_fwd(opf_act_kind k, opf_op *op, const opf_fwd_env *env, void *args)
{
    opf_act_fwd *a = args;
    const opf_tensor *x = env->x;
    const char *cls = act_rows[k].name, *name = opf_op_name(op);
    if (!x) return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": input is NULL", cls, name);
    if (!opf_is_act_dtype(x->spec.dtype))
        return opf_error(env->ctx, OPF_ERR_DTYPE, "%s \"%s\": input dtype %s, expected f32/bf16/f16",
                         cls, name, opf_dtype_name(x->spec.dtype));
    if (x->spec.ndim < 1)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "%s \"%s\": input has ndim %d, needs at least 1",
                         cls, name, x->spec.ndim);
    int64_t last = x->spec.shape[x->spec.ndim - 1];
    if (opf_act_is_glu(k) && last % 2)
        return opf_error(env->ctx, OPF_ERR_SHAPE,
                         "%s \"%s\": input has %lld features, a gated activation needs an even "
                         "number (two halves)", cls, name, (long long)last);
    a->x = *x;
    a->next_q = opf_q_or_none(env->next_input_q);
    act_params(op, k, &a->act, &a->alpha, &a->limit);
    return OPF_OK;
}

static opf_status act_setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                    const opf_tensor *outs, const opf_tensor *aux)
{
    const opf_act_fwd *a = args;
    opf_tensor_retain(&a->x, &octx->saved[octx->n_saved++]);
    return OPF_OK;
}

static opf_status act_resolve_bwd(opf_act_kind k, opf_op *op, const opf_op_ctx *octx,
                                  const opf_bwd_env *env, void *bargs)
{
    opf_act_bwd *b = bargs;
    const char *cls = act_rows[k].name, *name = opf_op_name(op);
    if (octx->n_saved < 1)
        return opf_error(env->ctx, OPF_ERR_STATE, "%s \"%s\": no saved input for backward", cls, name);
    const opf_tensor *x = &octx->saved[0], *dy = env->dy;
    if (!dy) return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": dy is NULL", cls, name);
    if (!opf_is_act_dtype(dy->spec.dtype))
        return opf_error(env->ctx, OPF_ERR_DTYPE, "%s \"%s\": gradient dtype %s, expected f32/bf16/f16",
                         cls, name, opf_dtype_name(dy->spec.dtype));
    opf_spec want = act_out_plain(&x->spec, opf_act_is_glu(k));
    bool same = dy->spec.ndim == want.ndim;
    for (int i = 0; same && i < want.ndim; i++) same = dy->spec.shape[i] == want.shape[i];
    if (!same) {
        char got[96], exp[96];
        shape_str(&dy->spec, got, sizeof got);
        shape_str(&want, exp, sizeof exp);
        return opf_error(env->ctx, OPF_ERR_SHAPE, "%s \"%s\": gradient has shape %s, the output was %s",
                         cls, name, got, exp);
    }
    b->x = *x;
    b->dy = *dy;
    /* The quantizer the previous op asked for when the forward ran (as the
     * anchor's fuser hands it on). */
    b->grad_q = octx->prev_grad_q;
    act_params(op, k, &b->act, &b->alpha, &b->limit);
    return OPF_OK;
}

/* ---- pure half ------------------------------------------------------------------- */

static opf_status act_forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const opf_act_fwd *a = args;
    if ((unsigned)a->act >= OPF_ACT_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "act.fwd: act %d outside 0..%d", a->act,
                         OPF_ACT_COUNT - 1);
    opf_spec plain = act_out_plain(&a->x.spec, opf_act_is_glu((opf_act_kind)a->act));
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

static opf_status act_backward_fake(const void *bargs, opf_spec *grads)
{
    const opf_act_bwd *b = bargs;
    if ((unsigned)b->act >= OPF_ACT_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "act.bwd: act %d outside 0..%d", b->act,
                         OPF_ACT_COUNT - 1);
    opf_spec plain = act_out_plain(&b->x.spec, false);
    return opf_op_out_spec(&plain, &b->grad_q, &grads[0]);
}

static opf_act_params params_of(double alpha, double limit)
{
    return (opf_act_params){(float)alpha, (float)limit};
}

opf_status opf_act_scratch(opf_ctx *ctx, const char *who, int64_t n, float **out)
{
    *out = opf_op_scratch(ctx, n);
    if (!*out)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %lld floats", who, (long long)n);
    return OPF_OK;
}

opf_status opf_act_load(opf_ctx *ctx, const char *who, const opf_tensor *t, const float **out)
{
    float *ws;
    opf_status st = opf_act_scratch(ctx, who, opf_spec_numel(&t->spec), &ws);
    return st ? st : opf_op_load_f32(ctx, t, ws, out);
}

/* The kernels of the activation op `who` on x's device. */
static const opf_act_kernels *kernels_of(opf_ctx *ctx, const char *who, const opf_tensor *x)
{
    return opf_backend_kernels(ctx, who, x->spec.device, OPF_KERNELS_ACT);
}

/* The backend's fwd_q from x (plain, or decoded) into the plain or quantized
 * output; stochastic rounding through opf_op_store_f32 (the fp32 entry). */
opf_status opf_act_forward(opf_ctx *ctx, const opf_act_fwd *a, opf_tensor *outs)
{
    const opf_act_kind k = (opf_act_kind)a->act;
    const char *who = act_rows[k].name;
    const opf_act_kernels *K = kernels_of(ctx, who, &a->x);
    if (!K) return OPF_ERR_UNSUPPORTED;
    opf_quantize_state qs;
    opf_qout o;
    opf_tensor xv;
    opf_act_params prm = params_of(a->alpha, a->limit);
    if (opf_op_qout(&a->next_q, a->x.spec.dtype, &outs[0], &qs, &o)) {
        opf_status st = opf_op_plain_view(ctx, &a->x, &xv);
        return st ? st : K->fwd_q(ctx, k, prm, &xv, &o);
    }
    const float *x;
    float *y;
    opf_status st = opf_act_load(ctx, who, &a->x, &x);
    if (!st) st = opf_act_scratch(ctx, who, opf_spec_numel(&outs[0].spec), &y);
    if (!st) st = K->fwd(ctx, k, prm, x, y, opf_act_rows(&a->x.spec), opf_act_cols(&a->x.spec));
    return st ? st : opf_op_store_f32(ctx, y, a->x.spec.dtype, &a->next_q, &outs[0]);
}

static opf_status act_forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs,
                                   opf_tensor *aux)
{
    (void)aux;
    return opf_act_forward(ctx, args, outs);
}

/* bwd_q likewise. */
static opf_status act_backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const opf_act_bwd *b = bargs;
    const opf_act_kind k = (opf_act_kind)b->act;
    const char *who = act_rows[k].name;
    const opf_act_kernels *K = kernels_of(ctx, who, &b->x);
    if (!K) return OPF_ERR_UNSUPPORTED;
    opf_quantize_state qs;
    opf_qout o;
    opf_tensor xv, dyv;
    opf_act_params prm = params_of(b->alpha, b->limit);
    if (opf_op_qout(&b->grad_q, b->x.spec.dtype, &grads[0], &qs, &o)) {
        opf_status st = opf_op_plain_view(ctx, &b->x, &xv);
        if (!st) st = opf_op_plain_view(ctx, &b->dy, &dyv);
        return st ? st : K->bwd_q(ctx, k, prm, &xv, &dyv, &o);
    }
    const float *x, *dy;
    float *dx;
    opf_status st = opf_act_load(ctx, who, &b->x, &x);
    if (!st) st = opf_act_load(ctx, who, &b->dy, &dy);
    if (!st) st = opf_act_scratch(ctx, who, opf_spec_numel(&b->x.spec), &dx);
    if (!st) st = K->bwd(ctx, k, prm, x, dy, dx, opf_act_rows(&b->x.spec),
                         opf_act_cols(&b->x.spec));
    return st ? st : opf_op_store_f32(ctx, dx, b->x.spec.dtype, &b->grad_q, &grads[0]);
}

/* ---- the classes ------------------------------------------------------------------
 * One per table row; its init and resolve entries pass the row's kind. Only
 * ClampedSwiGLU takes a config. */
#define ACT_CONFIG_SIZE(kind) ((kind) == OPF_ACT_CLAMPED_SWIGLU ? sizeof(opf_clamped_swiglu_config) : 0)
#define ACT_CLASS(n, kind, alpha)                                                             \
    static opf_status n##_init(opf_ctx *ctx, opf_op *op) { return act_init(ctx, op, kind); }  \
    static opf_status n##_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)         \
    {                                                                                         \
        return act_resolve_fwd(kind, op, env, args);                                          \
    }                                                                                         \
    static opf_status n##_resolve_bwd(opf_op *op, const opf_op_ctx *octx,                     \
                                      const opf_bwd_env *env, void *bargs)                    \
    {                                                                                         \
        return act_resolve_bwd(kind, op, octx, env, bargs);                                   \
    }                                                                                         \
    const opf_op_class opf_op_class_##n = {                                                   \
        OPF_OP_CLASS_HEAD(#n, ACT_CONFIG_SIZE(kind), &act_fwd_schema, &act_bwd_schema),       \
        .init          = n##_init,                                                            \
        .resolve_fwd   = n##_resolve_fwd,                                                     \
        .setup_context = act_setup_context,                                                   \
        .resolve_bwd   = n##_resolve_bwd,                                                     \
        .forward_fake  = act_forward_fake,                                                    \
        .forward_impl  = act_forward_impl,                                                    \
        .backward_fake = act_backward_fake,                                                   \
        .backward_impl = act_backward_impl,                                                   \
        .inplace       = kind < OPF_ACT_GLU,                                                  \
    };
OPF_ACT_CLASSES(ACT_CLASS)
#undef ACT_CLASS
#undef ACT_CONFIG_SIZE
