/* act.c: the activation table (f, f', gated flag per op) and the generic
 * resolve / fake / impl / backward every activation class plugs in
 * (act-impl.h). Formulas, constants and their grouping follow
 * docs/numerics.md 6.3 exactly; everything is fp32, with exp and tanh
 * from act-math.h (6.3.1). Each element-function pair has its own loops
 * (opf_act_fn_kind), so f and f' inline and the loops vectorize. */
#include <math.h>

#include "ops/basic/act-impl.h"
#include "ops/basic/act-math.h"

/* ---- the element functions (numerics.md 6.3) ------------------------------ */

/* exp, tanh and σ come from act-math.h (numerics.md 6.3.1), not the C
 * library: the same bits on every libc, in SIMD loops and in a CUDA mirror.
 * fmaxf and fminf are written as the selects they equal (+0 for ±0 and NaN
 * in max(v, 0), the limit for a NaN in a clamp), and every select as
 * opf_select_f32_impl, so that the loops vectorize (act-math.h says why). */

/* σ(z) = 1/(1+exp(-z)) with an accurate exp. */
static inline float sigmoidf_(float z) { return opf_sigmoidf_impl(z); }

static inline float gelu_f(float x, float alpha)
{
    return x * (0.5f + 0.5f * opf_tanhf_impl(x * (0.79788456f + 0.03567741f * x * x)));
}

/* The derivative uses its own tanh argument and constants (not a reuse of
 * f's), as the anchor's kernel does. */
static inline float gelu_df(float x, float alpha)
{
    const float t = opf_tanhf_impl(0.79788456f * x * (1.0f + 0.044715f * x * x));
    return 0.5f * x * ((1.0f - t * t) * (0.79788456f + 0.1070322243f * x * x)) + 0.5f * (1.0f + t);
}

/* x·σ(αx): QGELU (α = 1.702), SiLU (α = 1: 1·x == x exactly), ClampedSwiGLU. */
static inline float swish_f(float x, float alpha) { return x * sigmoidf_(alpha * x); }

/* αx·σ'(αx) + σ(αx) with σ' = σ(1-σ). */
static inline float swish_df(float x, float alpha)
{
    const float c = alpha * x, s = sigmoidf_(c);
    return c * (s * (1.0f - s)) + s;
}

/* max(v, 0) as fmaxf(v, 0.0f) gives it. */
static inline float max0(float v) { return opf_select_f32_impl(v > 0.0f, v, 0.0f); }

static inline float relu_f(float x, float alpha) { return max0(x); }
static inline float relu_df(float x, float alpha)
{
    return opf_select_f32_impl(x > 0.0f, 1.0f, 0.0f);
}
static inline float srelu_f(float x, float alpha)
{
    return opf_select_f32_impl(x > 0.0f, x * x, 0.0f);
}
static inline float srelu_df(float x, float alpha) { return max0(2.0f * x); }

static inline float sigmoid_f(float x, float alpha) { return sigmoidf_(x); }
static inline float sigmoid_df(float x, float alpha)
{
    const float s = sigmoidf_(x);
    return s * (1.0f - s);
}

static const opf_act_row act_table[] = {
    [OPF_ACT_GELU]           = {"gelu", gelu_f, gelu_df, OPF_ACT_FN_GELU, 0.0, false, false},
    [OPF_ACT_QGELU]          = {"qgelu", swish_f, swish_df, OPF_ACT_FN_SWISH, 1.702, false, false},
    [OPF_ACT_RELU]           = {"relu", relu_f, relu_df, OPF_ACT_FN_RELU, 0.0, false, false},
    [OPF_ACT_SRELU]          = {"srelu", srelu_f, srelu_df, OPF_ACT_FN_SRELU, 0.0, false, false},
    [OPF_ACT_SILU]           = {"silu", swish_f, swish_df, OPF_ACT_FN_SWISH, 1.0, false, false},
    [OPF_ACT_GLU]            = {"glu", sigmoid_f, sigmoid_df, OPF_ACT_FN_SIGMOID, 0.0, true, false},
    [OPF_ACT_GEGLU]          = {"geglu", gelu_f, gelu_df, OPF_ACT_FN_GELU, 0.0, true, false},
    [OPF_ACT_QGEGLU]         = {"qgeglu", swish_f, swish_df, OPF_ACT_FN_SWISH, 1.702, true, false},
    [OPF_ACT_REGLU]          = {"reglu", relu_f, relu_df, OPF_ACT_FN_RELU, 0.0, true, false},
    [OPF_ACT_SREGLU]         = {"sreglu", srelu_f, srelu_df, OPF_ACT_FN_SRELU, 0.0, true, false},
    [OPF_ACT_SWIGLU]         = {"swiglu", swish_f, swish_df, OPF_ACT_FN_SWISH, 1.0, true, false},
    [OPF_ACT_CLAMPED_SWIGLU] = {"clamped_swiglu", swish_f, swish_df, OPF_ACT_FN_SWISH, 1.702, true,
                                true},
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

/* ---- the loops -----------------------------------------------------------------
 * One set per element-function pair, generated by ACT_LOOPS so that f and f'
 * inline and every loop vectorizes (#pragma omp simd). Each lane rounds as
 * the scalar code does (IEEE fp32 operations, no FMA contraction), so the
 * bits depend neither on the vector width nor on where OpenMP splits. Gated
 * rows are [a | b] of width 2h; ClampedSwiGLU has its own gated loops. A
 * value a select discards is still computed (f'(a) above the limit, x·x of
 * SReLU below 0): GCC will not if-convert a conditional fp32 operation, which
 * may trap, and so would not vectorize. OpenMP splits elements (plain) or
 * rows (gated) above 32768 elements; the plain loops say if (parallel: ...),
 * since a bare if clause on "parallel for simd" also turns SIMD off below
 * the threshold (OpenMP 5.0 gave simd an if clause). */

typedef struct act_kernel {
    float alpha, limit;
} act_kernel;

typedef struct act_loops {
    void (*plain_fwd)(float alpha, const float *x, float *y, int64_t n);
    void (*plain_bwd)(float alpha, const float *x, const float *dy, float *dx, int64_t n);
    void (*gated_fwd)(const act_kernel *K, const float *x, float *y, int64_t rows, int64_t h);
    void (*gated_bwd)(const act_kernel *K, const float *x, const float *dy, float *dx, int64_t rows,
                      int64_t h);
} act_loops;

/* Plain: y = f(x), dx = f'(x)·dy. Gated: y = f(a)·b; da = f'(a)·g·b, db = f(a)·g. */
#define ACT_LOOPS(name, F, DF)                                                                  \
    static void name##_plain_fwd(float alpha, const float *x, float *y, int64_t n)              \
    {                                                                                           \
        _Pragma("omp parallel for simd schedule(static) if (parallel : n > 32768)")             \
        for (int64_t i = 0; i < n; i++) y[i] = F(x[i], alpha);                                  \
    }                                                                                           \
    static void name##_plain_bwd(float alpha, const float *x, const float *dy, float *dx,       \
                                 int64_t n)                                                     \
    {                                                                                           \
        _Pragma("omp parallel for simd schedule(static) if (parallel : n > 32768)")             \
        for (int64_t i = 0; i < n; i++) dx[i] = DF(x[i], alpha) * dy[i];                        \
    }                                                                                           \
    static void name##_gated_fwd(const act_kernel *K, const float *x, float *y, int64_t rows,   \
                                 int64_t h)                                                     \
    {                                                                                           \
        const float alpha = K->alpha;                                                           \
        _Pragma("omp parallel for schedule(static) if (rows * h > 32768)")                      \
        for (int64_t i = 0; i < rows; i++) {                                                    \
            const float *xa = x + i * 2 * h, *xb = xa + h;                                      \
            float *yi = y + i * h;                                                              \
            _Pragma("omp simd")                                                                 \
            for (int64_t j = 0; j < h; j++) yi[j] = F(xa[j], alpha) * xb[j];                    \
        }                                                                                       \
    }                                                                                           \
    static void name##_gated_bwd(const act_kernel *K, const float *x, const float *dy,          \
                                 float *dx, int64_t rows, int64_t h)                            \
    {                                                                                           \
        const float alpha = K->alpha;                                                           \
        _Pragma("omp parallel for schedule(static) if (rows * h > 32768)")                      \
        for (int64_t i = 0; i < rows; i++) {                                                    \
            const float *xa = x + i * 2 * h, *xb = xa + h, *gi = dy + i * h;                    \
            float *da = dx + i * 2 * h, *db = da + h;                                           \
            _Pragma("omp simd")                                                                 \
            for (int64_t j = 0; j < h; j++) {                                                   \
                const float a = xa[j], b = xb[j], g = gi[j];                                    \
                da[j] = DF(a, alpha) * g * b;                                                   \
                db[j] = F(a, alpha) * g;                                                        \
            }                                                                                   \
        }                                                                                       \
    }

ACT_LOOPS(gelu, gelu_f, gelu_df)
ACT_LOOPS(swish, swish_f, swish_df)
ACT_LOOPS(relu, relu_f, relu_df)
ACT_LOOPS(srelu, srelu_f, srelu_df)
ACT_LOOPS(sigmoid, sigmoid_f, sigmoid_df)

#define ACT_LOOPS_ROW(name) {name##_plain_fwd, name##_plain_bwd, name##_gated_fwd, name##_gated_bwd}
static const act_loops loops_of[] = {
    [OPF_ACT_FN_GELU]    = ACT_LOOPS_ROW(gelu),
    [OPF_ACT_FN_SWISH]   = ACT_LOOPS_ROW(swish),
    [OPF_ACT_FN_RELU]    = ACT_LOOPS_ROW(relu),
    [OPF_ACT_FN_SRELU]   = ACT_LOOPS_ROW(srelu),
    [OPF_ACT_FN_SIGMOID] = ACT_LOOPS_ROW(sigmoid),
};
_Static_assert(sizeof loops_of / sizeof loops_of[0] == OPF_ACT_FN_COUNT,
               "one set of loops per opf_act_fn_kind");

/* fminf(v, hi) and fmaxf(v, lo) for a finite bound: the bound for a NaN v. */
static inline float min_limit(float v, float hi) { return opf_select_f32_impl(v < hi, v, hi); }
static inline float max_limit(float v, float lo) { return opf_select_f32_impl(v > lo, v, lo); }

/* ClampedSwiGLU: a' = min(a, L), b' = clamp(b, -L, L) + 1, y = swish(a')·b'. */
static void clamped_swiglu_fwd(const act_kernel *K, const float *x, float *y, int64_t rows,
                               int64_t h)
{
    const float alpha = K->alpha, L = K->limit;
    #pragma omp parallel for schedule(static) if (rows * h > 32768)
    for (int64_t i = 0; i < rows; i++) {
        const float *xa = x + i * 2 * h, *xb = xa + h;
        float *yi = y + i * h;
        #pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            const float a = min_limit(xa[j], L), b = min_limit(max_limit(xb[j], -L), L) + 1.0f;
            yi[j] = swish_f(a, alpha) * b;
        }
    }
}

/* da = f'(a)·g·b' (0 where a > L), db = f(a')·g (0 where |b| > L, or b is NaN). */
static void clamped_swiglu_bwd(const act_kernel *K, const float *x, const float *dy, float *dx,
                               int64_t rows, int64_t h)
{
    const float alpha = K->alpha, L = K->limit;
    #pragma omp parallel for schedule(static) if (rows * h > 32768)
    for (int64_t i = 0; i < rows; i++) {
        const float *xa = x + i * 2 * h, *xb = xa + h, *gi = dy + i * h;
        float *da = dx + i * 2 * h, *db = da + h;
        #pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            const float a = xa[j], b = xb[j], g = gi[j];
            const bool b_live = (b >= -L) & (b <= L);
            const float bc = min_limit(max_limit(b, -L), L) + 1.0f;
            const float fa = swish_f(min_limit(a, L), alpha), dfa = swish_df(a, alpha);
            da[j] = opf_select_f32_impl(a <= L, dfa, 0.0f) * g * bc;
            db[j] = opf_select_f32_impl(b_live, fa * g, 0.0f);
        }
    }
}

void opf_act_apply_f32(opf_act_kind k, float alpha, const float *x, float *y, int64_t n)
{
    loops_of[act_table[k].fn].plain_fwd(alpha, x, y, n);
}

void opf_act_apply_df_f32(opf_act_kind k, float alpha, const float *x, const float *dy, float *dx,
                          int64_t n)
{
    loops_of[act_table[k].fn].plain_bwd(alpha, x, dy, dx, n);
}

static act_kernel kernel_of(double alpha, double limit)
{
    return (act_kernel){(float)alpha, (float)limit};
}

opf_status opf_act_forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const opf_act_fwd *a = args;
    const opf_act_row *row = &act_table[a->act];
    act_kernel K = kernel_of(a->alpha, a->limit);
    int64_t n = opf_spec_numel(&a->x.spec), ny = opf_spec_numel(&outs[0].spec);
    float *xs = opf_op_scratch(ctx, n), *y = opf_op_scratch(ctx, ny);
    if (!xs || !y)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %lld floats", row->name,
                         (long long)(n + ny));
    const float *x;
    opf_status st = opf_op_load_f32(ctx, &a->x, xs, &x);
    if (st) return st;
    if (row->gated) {
        int64_t h = a->x.spec.shape[a->x.spec.ndim - 1] / 2;
        (row->clamped ? clamped_swiglu_fwd : loops_of[row->fn].gated_fwd)(&K, x, y,
                                                                          h ? ny / h : 0, h);
    } else {
        loops_of[row->fn].plain_fwd(K.alpha, x, y, n);
    }
    return opf_op_store_f32(ctx, y, a->x.spec.dtype, &a->next_q, &outs[0]);
}

opf_status opf_act_backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const opf_act_bwd *b = bargs;
    const opf_act_row *row = &act_table[b->act];
    act_kernel K = kernel_of(b->alpha, b->limit);
    int64_t n = opf_spec_numel(&b->x.spec), ny = opf_spec_numel(&b->dy.spec);
    float *xs = opf_op_scratch(ctx, n), *dys = opf_op_scratch(ctx, ny), *dx = opf_op_scratch(ctx, n);
    if (!xs || !dys || !dx)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %lld floats", row->name,
                         (long long)(2 * n + ny));
    const float *x, *dy;
    opf_status st = opf_op_load_f32(ctx, &b->x, xs, &x);
    if (!st) st = opf_op_load_f32(ctx, &b->dy, dys, &dy);
    if (st) return st;
    if (row->gated) {
        int64_t h = b->x.spec.shape[b->x.spec.ndim - 1] / 2;
        (row->clamped ? clamped_swiglu_bwd : loops_of[row->fn].gated_bwd)(&K, x, dy, dx,
                                                                          h ? ny / h : 0, h);
    } else {
        loops_of[row->fn].plain_bwd(K.alpha, x, dy, dx, n);
    }
    return opf_op_store_f32(ctx, dx, b->x.spec.dtype, &b->grad_q, &grads[0]);
}
