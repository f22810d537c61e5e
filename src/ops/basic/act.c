/* act.c: the activation table (f, f', gated flag per op) and the generic
 * resolve / fake / impl / backward every activation class plugs in
 * (act-impl.h). Formulas, constants and their grouping follow
 * docs/numerics.md 6.3 exactly; everything is fp32. */
#include <math.h>

#include "ops/basic/act-impl.h"

/* ---- the element functions (numerics.md 6.3) ------------------------------ */

/* σ(z) = 1/(1+expf(-z)) with the accurate expf. */
static float sigmoidf_(float z) { return 1.0f / (1.0f + expf(-z)); }

static float gelu_f(float x, float alpha)
{
    return x * (0.5f + 0.5f * tanhf(x * (0.79788456f + 0.03567741f * x * x)));
}

/* The derivative uses its own tanh argument and constants (not a reuse of
 * f's), as the anchor's kernel does. */
static float gelu_df(float x, float alpha)
{
    const float t = tanhf(0.79788456f * x * (1.0f + 0.044715f * x * x));
    return 0.5f * x * ((1.0f - t * t) * (0.79788456f + 0.1070322243f * x * x)) + 0.5f * (1.0f + t);
}

/* x·σ(αx): QGELU (α = 1.702), SiLU (α = 1: 1·x == x exactly), ClampedSwiGLU. */
static float swish_f(float x, float alpha) { return x * sigmoidf_(alpha * x); }

/* αx·σ'(αx) + σ(αx) with σ' = σ(1-σ). */
static float swish_df(float x, float alpha)
{
    const float c = alpha * x, s = sigmoidf_(c);
    return c * (s * (1.0f - s)) + s;
}

static float relu_f(float x, float alpha) { return fmaxf(x, 0.0f); }
static float relu_df(float x, float alpha) { return x > 0.0f ? 1.0f : 0.0f; }
static float srelu_f(float x, float alpha) { return x > 0.0f ? x * x : 0.0f; }
static float srelu_df(float x, float alpha) { return fmaxf(2.0f * x, 0.0f); }

static float sigmoid_f(float x, float alpha) { return sigmoidf_(x); }
static float sigmoid_df(float x, float alpha)
{
    const float s = sigmoidf_(x);
    return s * (1.0f - s);
}

static const opf_act_row act_table[] = {
    [OPF_ACT_GELU]           = {"gelu", gelu_f, gelu_df, 0.0, false, false},
    [OPF_ACT_QGELU]          = {"qgelu", swish_f, swish_df, 1.702, false, false},
    [OPF_ACT_RELU]           = {"relu", relu_f, relu_df, 0.0, false, false},
    [OPF_ACT_SRELU]          = {"srelu", srelu_f, srelu_df, 0.0, false, false},
    [OPF_ACT_SILU]           = {"silu", swish_f, swish_df, 1.0, false, false},
    [OPF_ACT_GLU]            = {"glu", sigmoid_f, sigmoid_df, 0.0, true, false},
    [OPF_ACT_GEGLU]          = {"geglu", gelu_f, gelu_df, 0.0, true, false},
    [OPF_ACT_QGEGLU]         = {"qgeglu", swish_f, swish_df, 1.702, true, false},
    [OPF_ACT_REGLU]          = {"reglu", relu_f, relu_df, 0.0, true, false},
    [OPF_ACT_SREGLU]         = {"sreglu", srelu_f, srelu_df, 0.0, true, false},
    [OPF_ACT_SWIGLU]         = {"swiglu", swish_f, swish_df, 1.0, true, false},
    [OPF_ACT_CLAMPED_SWIGLU] = {"clamped_swiglu", swish_f, swish_df, 1.702, true, true},
};
_Static_assert(sizeof act_table / sizeof act_table[0] == OPF_ACT_COUNT,
               "one activation row per opf_act_kind");

const opf_act_row *opf_act_row_at(opf_act_kind k) { return &act_table[k]; }

/* The row of an op's class; -1 when the class is not an activation. */
static int act_kind_of(const opf_op *op)
{
    const char *name = opf_op_class_of(op)->name;
    for (int k = 0; k < OPF_ACT_COUNT; k++)
        if (!strcmp(act_table[k].name, name)) return k;
    return -1;
}

/* ---- schemas -------------------------------------------------------------------- */

static const opf_field act_fwd_fields[] = {
    OPF_F_TENSOR_Q(opf_act_fwd, x), OPF_F_QUANT(opf_act_fwd, next_q), OPF_F_ENUM(opf_act_fwd, act),
    OPF_F_FLOAT(opf_act_fwd, alpha), OPF_F_FLOAT(opf_act_fwd, limit)};
const opf_schema opf_act_fwd_schema = {"act.fwd", sizeof(opf_act_fwd),
                                       (int)(sizeof act_fwd_fields / sizeof act_fwd_fields[0]),
                                       act_fwd_fields};

static const opf_field act_bwd_fields[] = {
    OPF_F_TENSOR_Q(opf_act_bwd, x), OPF_F_TENSOR_Q(opf_act_bwd, dy),
    OPF_F_QUANT(opf_act_bwd, grad_q), OPF_F_ENUM(opf_act_bwd, act),
    OPF_F_FLOAT(opf_act_bwd, alpha), OPF_F_FLOAT(opf_act_bwd, limit)};
const opf_schema opf_act_bwd_schema = {"act.bwd", sizeof(opf_act_bwd),
                                       (int)(sizeof act_bwd_fields / sizeof act_bwd_fields[0]),
                                       act_bwd_fields};

/* ---- traced half -------------------------------------------------------------- */

opf_status opf_act_init(opf_ctx *ctx, opf_op *op)
{
    int k = act_kind_of(op);
    if (k < 0)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": not an activation class",
                         opf_op_class_of(op)->name, opf_op_name(op));
    if (!act_table[k].clamped) return OPF_OK;
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

static bool is_act_dtype(opf_dtype d) { return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16; }

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
static void act_params(opf_op *op, int k, int *act, double *alpha, double *limit)
{
    *act = k;
    *alpha = act_table[k].alpha;
    *limit = 0.0;
    if (act_table[k].clamped) {
        const opf_clamped_swiglu_config *c = opf_op_config(op);
        *alpha = c->alpha;
        *limit = c->limit;
    }
}

opf_status opf_act_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    opf_act_fwd *a = args;
    const opf_tensor *x = env->x;
    const char *cls = opf_op_class_of(op)->name, *name = opf_op_name(op);
    int k = act_kind_of(op);
    if (k < 0)
        return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": not an activation", cls, name);
    if (!x) return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": input is NULL", cls, name);
    if (!is_act_dtype(x->spec.dtype))
        return opf_error(env->ctx, OPF_ERR_DTYPE, "%s \"%s\": input dtype %s, expected f32/bf16/f16",
                         cls, name, opf_dtype_name(x->spec.dtype));
    if (x->spec.ndim < 1)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "%s \"%s\": input has ndim %d, needs at least 1",
                         cls, name, x->spec.ndim);
    int64_t last = x->spec.shape[x->spec.ndim - 1];
    if (act_table[k].gated && last % 2)
        return opf_error(env->ctx, OPF_ERR_SHAPE,
                         "%s \"%s\": input has %lld features, a gated activation needs an even "
                         "number (two halves)", cls, name, (long long)last);
    a->x = *x;
    a->next_q = opf_q_or_none(env->next_input_q);
    act_params(op, k, &a->act, &a->alpha, &a->limit);
    return OPF_OK;
}

opf_status opf_act_setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                 const opf_tensor *outs, const opf_tensor *aux)
{
    const opf_act_fwd *a = args;
    opf_tensor_retain(&a->x, &octx->saved[octx->n_saved++]);
    return OPF_OK;
}

opf_status opf_act_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                               void *bargs)
{
    opf_act_bwd *b = bargs;
    const char *cls = opf_op_class_of(op)->name, *name = opf_op_name(op);
    int k = act_kind_of(op);
    if (k < 0 || octx->n_saved < 1)
        return opf_error(env->ctx, OPF_ERR_STATE, "%s \"%s\": no saved input for backward", cls, name);
    const opf_tensor *x = &octx->saved[0], *dy = env->dy;
    if (!dy) return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": dy is NULL", cls, name);
    if (!is_act_dtype(dy->spec.dtype))
        return opf_error(env->ctx, OPF_ERR_DTYPE, "%s \"%s\": gradient dtype %s, expected f32/bf16/f16",
                         cls, name, opf_dtype_name(dy->spec.dtype));
    opf_spec want = act_out_plain(&x->spec, act_table[k].gated);
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
    /* The quantizer the previous op asked for when the forward ran (te-ops 3.9). */
    b->grad_q = octx->prev_grad_q;
    act_params(op, k, &b->act, &b->alpha, &b->limit);
    return OPF_OK;
}

/* ---- pure half ------------------------------------------------------------------- */

opf_status opf_act_forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const opf_act_fwd *a = args;
    if ((unsigned)a->act >= OPF_ACT_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "act.fwd: act %d outside 0..%d", a->act,
                         OPF_ACT_COUNT - 1);
    opf_spec plain = act_out_plain(&a->x.spec, act_table[a->act].gated);
    return opf_op_out_spec(&plain, &a->next_q, &outs[0]);
}

opf_status opf_act_backward_fake(const void *bargs, opf_spec *grads)
{
    const opf_act_bwd *b = bargs;
    if ((unsigned)b->act >= OPF_ACT_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "act.bwd: act %d outside 0..%d", b->act,
                         OPF_ACT_COUNT - 1);
    opf_spec plain = act_out_plain(&b->x.spec, false);
    return opf_op_out_spec(&plain, &b->grad_q, &grads[0]);
}

/* The element kernels. Gated rows are [a | b] of width 2h; ClampedSwiGLU
 * clamps a from above and b on both sides, then offsets b by 1. */
typedef struct act_kernel {
    const opf_act_row *row;
    float alpha, limit;
} act_kernel;

static void plain_fwd(const act_kernel *K, const float *x, float *y, int64_t n)
{
    #pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) y[i] = K->row->f(x[i], K->alpha);
}

static void plain_bwd(const act_kernel *K, const float *x, const float *dy, float *dx, int64_t n)
{
    #pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) dx[i] = K->row->df(x[i], K->alpha) * dy[i];
}

static void gated_fwd(const act_kernel *K, const float *x, float *y, int64_t rows, int64_t h)
{
    const opf_act_row *r = K->row;
    const float L = K->limit;
    #pragma omp parallel for schedule(static) if (rows * h > 32768)
    for (int64_t i = 0; i < rows; i++) {
        const float *xa = x + i * 2 * h, *xb = xa + h;
        for (int64_t j = 0; j < h; j++) {
            float a = xa[j], b = xb[j];
            if (r->clamped) {
                a = fminf(a, L);
                b = fminf(fmaxf(b, -L), L) + 1.0f;
            }
            y[i * h + j] = r->f(a, K->alpha) * b;
        }
    }
}

/* da = f'(a)·g·b (0 where a > limit), db = f(a)·g (0 where |b| > limit). */
static void gated_bwd(const act_kernel *K, const float *x, const float *dy, float *dx,
                      int64_t rows, int64_t h)
{
    const opf_act_row *r = K->row;
    const float L = K->limit;
    #pragma omp parallel for schedule(static) if (rows * h > 32768)
    for (int64_t i = 0; i < rows; i++) {
        const float *xa = x + i * 2 * h, *xb = xa + h;
        float *da = dx + i * 2 * h, *db = da + h;
        for (int64_t j = 0; j < h; j++) {
            const float a = xa[j], g = dy[i * h + j];
            float b = xb[j], fa, dfa;
            bool b_live = true;
            if (r->clamped) {
                b_live = b >= -L && b <= L;
                b = fminf(fmaxf(b, -L), L) + 1.0f;
                fa = r->f(fminf(a, L), K->alpha);
                dfa = a <= L ? r->df(a, K->alpha) : 0.0f;
            } else {
                fa = r->f(a, K->alpha);
                dfa = r->df(a, K->alpha);
            }
            da[j] = dfa * g * b;
            db[j] = b_live ? fa * g : 0.0f;
        }
    }
}

static act_kernel kernel_of(int act, double alpha, double limit)
{
    return (act_kernel){&act_table[act], (float)alpha, (float)limit};
}

opf_status opf_act_forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const opf_act_fwd *a = args;
    act_kernel K = kernel_of(a->act, a->alpha, a->limit);
    int64_t n = opf_spec_numel(&a->x.spec), ny = opf_spec_numel(&outs[0].spec);
    float *xs = opf_op_scratch(ctx, n), *y = opf_op_scratch(ctx, ny);
    if (!xs || !y)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %lld floats", K.row->name,
                         (long long)(n + ny));
    const float *x;
    opf_status st = opf_op_load_f32(ctx, &a->x, xs, &x);
    if (st) return st;
    if (K.row->gated) {
        int64_t h = a->x.spec.shape[a->x.spec.ndim - 1] / 2;
        gated_fwd(&K, x, y, h ? ny / h : 0, h);
    } else {
        plain_fwd(&K, x, y, n);
    }
    return opf_op_store_f32(ctx, y, a->x.spec.dtype, &a->next_q, &outs[0]);
}

opf_status opf_act_backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const opf_act_bwd *b = bargs;
    act_kernel K = kernel_of(b->act, b->alpha, b->limit);
    int64_t n = opf_spec_numel(&b->x.spec), ny = opf_spec_numel(&b->dy.spec);
    float *xs = opf_op_scratch(ctx, n), *dys = opf_op_scratch(ctx, ny), *dx = opf_op_scratch(ctx, n);
    if (!xs || !dys || !dx)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %lld floats", K.row->name,
                         (long long)(2 * n + ny));
    const float *x, *dy;
    opf_status st = opf_op_load_f32(ctx, &b->x, xs, &x);
    if (!st) st = opf_op_load_f32(ctx, &b->dy, dys, &dy);
    if (st) return st;
    if (K.row->gated) {
        int64_t h = b->x.spec.shape[b->x.spec.ndim - 1] / 2;
        gated_bwd(&K, x, dy, dx, h ? ny / h : 0, h);
    } else {
        plain_bwd(&K, x, dy, dx, n);
    }
    return opf_op_store_f32(ctx, dx, b->x.spec.dtype, &b->grad_q, &grads[0]);
}
