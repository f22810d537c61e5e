/* test_linear.c: basic_linear and grouped_linear under every recipe x dtype.
 *
 * - forward y, dx, dW against an FP64 reference built from the DEQUANTIZED
 *   quantized operands (quantized here with the op's own quantizers), so only
 *   the GEMM's fp32 error remains: |got - ref| <= 1e-5 + 1e-3 * sum|a||b|
 *   (numerics.md 8.3: fp32 GEMMs use fp16 tolerances) plus the output dtype's
 *   rounding; then a loose relative-Frobenius check against the unquantized
 *   FP64 result with the recipe's quantization tolerance (numerics.md 8.3);
 * - an input / gradient that arrives pre-quantized gives the same bits as
 *   quantizing inside (stochastic rounding replayed from the same Philox
 *   state);
 * - main_grad accumulation over two calls, overwrite with is_first_microbatch
 *   = 1, no returned weight gradient;
 * - the is_first_microbatch weight cache (reused after the weight changes,
 *   refreshed with 1 into the same buffer, dropped by a recipe reset);
 * - quantized outputs for the next op (y) and the previous op (dx): equal to
 *   quantizing the plain output;
 * - finite differences of the FP64 reference, fake-vs-real conformance, bad
 *   inputs (each leaves the op's state unchanged). */
#include <float.h>
#include <stdint.h>

#include "test.h"

#include "core/core-impl.h"
#include "op/op-impl.h"

enum { B0 = 2, B1 = 32, IN = 128, OUT = 96, ROWS = B0 * B1 };
#define OFF0 1000003ull /* Philox offset replayed before quantizing gradients */
#define DT(d) (1u << (d))
#define ALL_DT (DT(OPF_F32) | DT(OPF_BF16) | DT(OPF_F16))

static opf_ctx *ctx;
static unsigned long long rng = 0x5EEDull;

typedef struct rcase {
    const char     *name;
    opf_recipe_kind kind;
    opf_format      format;
    unsigned        dtypes;
    double          qtol_fwd, qtol_bwd;  /* relative Frobenius vs unquantized FP64 */
    int             variant;             /* 1: MXFP8 32x32 weights; 2: NVFP4 without RHT, SR, 2D */
} rcase;

static const rcase recipes[] = {
    {"none", OPF_RECIPE_NONE, OPF_FORMAT_E4M3, ALL_DT, 0, 0, 0},
    {"delayed-e4m3", OPF_RECIPE_DELAYED, OPF_FORMAT_E4M3, ALL_DT, 0.125, 0.125, 0},
    {"delayed-hybrid", OPF_RECIPE_DELAYED, OPF_FORMAT_HYBRID, DT(OPF_BF16), 0.125, 0.25, 0},
    {"current", OPF_RECIPE_CURRENT, OPF_FORMAT_HYBRID, ALL_DT, 0.125, 0.25, 0},
    {"block", OPF_RECIPE_BLOCK, OPF_FORMAT_E4M3, ALL_DT, 0.125, 0.125, 0},
    {"mxfp8", OPF_RECIPE_MXFP8, OPF_FORMAT_E4M3, ALL_DT, 0.125, 0.125, 0},
    {"nvfp4", OPF_RECIPE_NVFP4, OPF_FORMAT_E2M1, DT(OPF_F32) | DT(OPF_BF16), 0.25, 0.25, 0},
    {"mxfp8-2d", OPF_RECIPE_MXFP8, OPF_FORMAT_HYBRID, DT(OPF_BF16), 0.125, 0.25, 1},
    {"nvfp4-plain", OPF_RECIPE_NVFP4, OPF_FORMAT_E2M1, DT(OPF_BF16), 0.25, 0.25, 2},
};
#define N_RECIPES ((int)(sizeof recipes / sizeof recipes[0]))

static opf_recipe make_recipe(const rcase *rc)
{
    opf_recipe r = opf_recipe_default(rc->kind);
    r.format = rc->format;
    if (rc->kind == OPF_RECIPE_DELAYED) r.amax_history_len = 8;
    r.mxfp8_2d_weights = rc->variant == 1;
    if (rc->variant == 2) r.nvfp4_rht = r.nvfp4_stochastic = r.nvfp4_2d_weights = false;
    return r;
}

/* ---- tensors ---------------------------------------------------------------------- */

static void *xmalloc(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

/* A plain tensor of N(0, sigma) values rounded to dt. */
static opf_tensor rand_tensor(int ndim, const int64_t *shape, opf_dtype dt, float sigma)
{
    opf_spec s = opf_spec_make(ndim, shape, dt);
    int64_t n = opf_spec_numel(&s);
    float *v = xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(&rng, sigma);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    CHECK_OK(ctx, opf_convert(v, OPF_F32, t.data[OPF_COMP_DATA], dt, (size_t)n));
    free(v);
    return t;
}

/* Values of one copy of t (plain: its values) in double, logical order. */
static double *values(const opf_tensor *t, unsigned which)
{
    int64_t n = opf_spec_numel(&t->spec);
    opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
    opf_tensor f;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &f));
    if (t->spec.scaling == OPF_SCALING_NONE)
        CHECK_OK(ctx, opf_convert(t->data[OPF_COMP_DATA], t->spec.dtype, f.data[0], OPF_F32, (size_t)n));
    else
        CHECK_OK(ctx, opf_dequantize(ctx, t, which, &f));
    double *d = xmalloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) d[i] = ((const float *)f.data[0])[i];
    opf_tensor_release(&f);
    return d;
}

static opf_quantizer op_q(const opf_op *op, opf_tensor_role role, int gemm)
{
    const opf_quantizer *q = opf_op_quantizer(op, role, gemm);
    return q ? *q : opf_quantizer_default();
}

/* t quantized with q (a new reference to t itself when q is none). */
static opf_tensor quantized(const opf_quantizer *q, const opf_tensor *t)
{
    opf_tensor out;
    if (q->scaling == OPF_SCALING_NONE) opf_tensor_retain(t, &out);
    else CHECK_OK(ctx, opf_quantize_alloc(ctx, q, t, &out));
    return out;
}

static void set_rng(uint64_t off)
{
    uint64_t seed;
    opf_ctx_get_rng(ctx, &seed, NULL);
    opf_ctx_set_rng(ctx, seed, off);
}

/* ---- FP64 references -------------------------------------------------------------- */

/* D[m, n] = sum_k P[m*pm + k*pk] * Q[n*qn + k*qk]; S[m, n] = the sum of |products|. */
static void ref_mm(const double *P, int64_t pm, int64_t pk, const double *Q, int64_t qn, int64_t qk,
                   int64_t M, int64_t N, int64_t K, double *D, double *S)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double d = 0, s = 0;
            for (int64_t k = 0; k < K; k++) {
                double p = P[m * pm + k * pk] * Q[n * qn + k * qk];
                d += p;
                s += fabs(p);
            }
            D[m * N + n] = d;
            if (S) S[m * N + n] = s;
        }
}
/* y = x W^T, dx = dy W, dW = dy^T x for x [M,K], W [N,K], dy [M,N]. */
static void ref_fprop(const double *x, const double *w, int64_t M, int64_t N, int64_t K, double *y, double *s)
{
    ref_mm(x, K, 1, w, K, 1, M, N, K, y, s);
}
static void ref_dgrad(const double *dy, const double *w, int64_t M, int64_t N, int64_t K, double *dx, double *s)
{
    ref_mm(dy, N, 1, w, 1, K, M, K, N, dx, s);
}
static void ref_wgrad(const double *dy, const double *x, int64_t M, int64_t N, int64_t K, double *dw, double *s)
{
    ref_mm(dy, 1, N, x, 1, K, N, K, M, dw, s);
}

static double out_rtol(opf_dtype dt) { return dt == OPF_F32 ? 1.3e-6 : dt == OPF_BF16 ? 1.6e-2 : 1e-3; }

/* |got - ref| <= 1e-5 + 1e-3 * S + rtol_out * |ref| everywhere. */
static void check_gemm(const char *what, const char *tag, const double *got, const double *ref,
                       const double *S, int64_t n, opf_dtype out_dt)
{
    int64_t bad = 0, worst = 0;
    double wr = 0;
    for (int64_t i = 0; i < n; i++) {
        double tol = 1e-5 + 1e-3 * S[i] + out_rtol(out_dt) * fabs(ref[i]), e = fabs(got[i] - ref[i]);
        if (!(e <= tol)) bad++;
        if (e / tol > wr) wr = e / tol, worst = i;
    }
    CHECK(bad == 0, "%s %s: %lld of %lld outside the GEMM tolerance (worst [%lld] got %.9g ref %.9g)",
          tag, what, (long long)bad, (long long)n, (long long)worst, got[worst], ref[worst]);
}

static void check_fro(const char *what, const char *tag, const double *got, const double *ref,
                      int64_t n, double tol)
{
    double e = 0, r = 0;
    for (int64_t i = 0; i < n; i++) e += (got[i] - ref[i]) * (got[i] - ref[i]), r += ref[i] * ref[i];
    double rel = sqrt(e / (r > 0 ? r : 1));
    CHECK(rel <= tol, "%s %s: relative error %.4f vs unquantized > %.4f", tag, what, rel, tol);
}

/* ---- conformance ------------------------------------------------------------------ */

static void strip_data(const opf_schema *s, const void *args, unsigned char *buf)
{
    memcpy(buf, args, s->size);
    opf_slot slots[32];
    int n = opf_schema_slots(s, buf, slots, 32);
    for (int i = 0; i < n && i < 32; i++) {
        memset(slots[i].tensor->data, 0, sizeof slots[i].tensor->data);
        slots[i].tensor->buf = NULL;
    }
}

static void none_specs(opf_spec *s, int n)
{
    memset(s, 0, sizeof *s * (size_t)n);
    for (int i = 0; i < n; i++) s[i].ndim = OPF_SPEC_NONE_NDIM;
}

/* An aux the forward makes but does not save: present, spec not compared. */
static const opf_tensor AUX_UNSAVED;

/* The fake on data-free args of the last forward: y's spec, and each aux
 * spec against the tensor the context saved from it (want_aux[i] NULL:
 * that aux must be absent). */
static void conform_fwd(const char *tag, opf_op *op, const opf_tensor *y,
                        const opf_tensor *const want_aux[OPF_OP_MAX_AUX])
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char buf[OPF_OP_ARGS_MAX];
    strip_data(c->fwd_schema, op->fwd_args, buf);
    opf_spec os[1 + OPF_OP_MAX_EXTRA], as[OPF_OP_MAX_AUX];
    none_specs(os, 1 + OPF_OP_MAX_EXTRA);
    none_specs(as, OPF_OP_MAX_AUX);
    CHECK_OK(NULL, c->forward_fake(buf, os, as));
    CHECK(opf_spec_equal(&os[0], &y->spec), "%s: fake output differs", tag);
    for (int i = 0; i < OPF_OP_MAX_AUX; i++) {
        if (!want_aux[i]) CHECK(as[i].ndim < 0, "%s: fake aux %d should be absent", tag, i);
        else if (want_aux[i] == &AUX_UNSAVED) CHECK(as[i].ndim >= 0, "%s: fake aux %d missing", tag, i);
        else CHECK(opf_spec_equal(&as[i], &want_aux[i]->spec), "%s: fake aux %d differs", tag, i);
    }
}

static void conform_bwd(const char *tag, opf_op *op, const opf_tensor *dx, const bool *has_grad)
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char buf[OPF_OP_ARGS_MAX];
    strip_data(c->bwd_schema, op->bwd_args, buf);
    int np = opf_op_num_params(op), n = 1 + np + c->n_extra_in;
    opf_spec gs[1 + OPF_OP_MAX_PARAMS + OPF_OP_MAX_EXTRA];
    none_specs(gs, n);
    CHECK_OK(NULL, c->backward_fake(buf, gs));
    CHECK(opf_spec_equal(&gs[0], &dx->spec), "%s: fake dx differs", tag);
    for (int i = 0; i < np; i++)
        CHECK(has_grad[i] ? opf_spec_equal(&gs[1 + i], &opf_op_param(op, i)->grad.spec) : gs[1 + i].ndim < 0,
              "%s: fake grad of param %d differs", tag, i);
    for (int i = 0; i < c->n_extra_in; i++)
        CHECK(gs[1 + np + i].ndim < 0, "%s: extra input %d gets no gradient", tag, i);
}

/* ---- basic_linear: numerics -------------------------------------------------------- */

static opf_op *new_linear(const char *name, opf_dtype dt, bool main_grad, const opf_recipe *r)
{
    opf_basic_linear_config c = {IN, OUT, dt, main_grad};
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, "basic_linear", &c, name, &op));
    if (op && r) CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, r));
    return op;
}

/* What one case quantizes on the test side and the references built on it. */
typedef struct lcase {
    opf_tensor x, dy, xq, wq, dyq;
    double    *y_ref, *y_s, *dx_ref, *dx_s, *dw_ref, *dw_s;
    double    *y_true, *dx_true, *dw_true;
} lcase;

static void lcase_build(lcase *L, opf_op *op, opf_dtype dt, float sx)
{
    int64_t xs[3] = {B0, B1, IN}, ys[3] = {B0, B1, OUT};
    L->x = rand_tensor(3, xs, dt, sx);
    L->dy = rand_tensor(3, ys, dt, 1.0f);
    opf_quantizer qx = op_q(op, OPF_ROLE_INPUT, 0), qw = op_q(op, OPF_ROLE_WEIGHT, 0),
                  qg = op_q(op, OPF_ROLE_GRAD_OUTPUT, 0);
    L->xq = quantized(&qx, &L->x);
    L->wq = quantized(&qw, &opf_op_param(op, 0)->value);
    set_rng(OFF0);
    L->dyq = quantized(&qg, &L->dy);
    double *xr = values(&L->xq, OPF_USAGE_ROWWISE), *xc = values(&L->xq, OPF_USAGE_COLUMNWISE),
           *wr = values(&L->wq, OPF_USAGE_ROWWISE), *wc = values(&L->wq, OPF_USAGE_COLUMNWISE),
           *gr = values(&L->dyq, OPF_USAGE_ROWWISE), *gc = values(&L->dyq, OPF_USAGE_COLUMNWISE),
           *x = values(&L->x, 0), *w = values(&opf_op_param(op, 0)->value, 0), *g = values(&L->dy, 0);
    size_t ny = ROWS * OUT * sizeof(double), nx = ROWS * IN * sizeof(double), nw = OUT * IN * sizeof(double);
    L->y_ref = xmalloc(ny), L->y_s = xmalloc(ny), L->y_true = xmalloc(ny);
    L->dx_ref = xmalloc(nx), L->dx_s = xmalloc(nx), L->dx_true = xmalloc(nx);
    L->dw_ref = xmalloc(nw), L->dw_s = xmalloc(nw), L->dw_true = xmalloc(nw);
    ref_fprop(xr, wr, ROWS, OUT, IN, L->y_ref, L->y_s);
    ref_dgrad(gr, wc, ROWS, OUT, IN, L->dx_ref, L->dx_s);
    ref_wgrad(gc, xc, ROWS, OUT, IN, L->dw_ref, L->dw_s);
    ref_fprop(x, w, ROWS, OUT, IN, L->y_true, NULL);
    ref_dgrad(g, w, ROWS, OUT, IN, L->dx_true, NULL);
    ref_wgrad(g, x, ROWS, OUT, IN, L->dw_true, NULL);
    free(xr), free(xc), free(wr), free(wc), free(gr), free(gc), free(x), free(w), free(g);
}

static void lcase_free(lcase *L)
{
    opf_tensor *t[] = {&L->x, &L->dy, &L->xq, &L->wq, &L->dyq};
    for (int i = 0; i < 5; i++) opf_tensor_release(t[i]);
    double *d[] = {L->y_ref, L->y_s, L->dx_ref, L->dx_s, L->dw_ref, L->dw_s, L->y_true, L->dx_true, L->dw_true};
    for (int i = 0; i < 9; i++) free(d[i]);
}

static opf_status fwd(opf_op *op, const opf_tensor *x, const opf_recipe *r, bool grad, const void *kw,
                      const opf_quantizer *next_q, const opf_quantizer *prev_q, opf_op_ctx *octx,
                      opf_tensor *y)
{
    opf_fwd_env env = {.ctx = ctx, .x = x, .recipe = r, .requires_grad = grad, .kwargs = kw,
                       .next_input_q = next_q, .prev_grad_q = prev_q};
    return opf_op_forward(op, &env, octx, y);
}

static opf_status bwd(opf_op *op, opf_op_ctx *octx, const opf_tensor *dy, opf_tensor *dx)
{
    opf_bwd_env env = {.ctx = ctx, .dy = dy};
    set_rng(OFF0);
    return opf_op_backward(op, octx, &env, dx, NULL);
}

static bool bits_equal(const opf_tensor *a, const opf_tensor *b) { return opf_test_same_bytes(a, b); }

/* An int field (enum) of the op's last resolved args, found through the schema. */
static int args_enum(const opf_op *op, bool backward, const char *name)
{
    const opf_op_class *c = opf_op_class_of(op);
    const opf_field *f = opf_schema_field(backward ? c->bwd_schema : c->fwd_schema, name);
    CHECK(f && f->kind == OPF_FIELD_ENUM, "field %s", name);
    return f ? *(const int *)((backward ? op->bwd_args : op->fwd_args) + f->offset) : -1;
}

/* Delayed scaling: one step on data like the test's, then the amax/scale
 * update, so the scales fit the tensors (step 0 uses scale 1). */
static void warm_delayed(opf_op *op, const opf_recipe *r, opf_dtype dt, float sx)
{
    int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
    opf_tensor x = rand_tensor(2, xs, dt, sx), dy = rand_tensor(2, ys, dt, 1.0f), y, dx;
    opf_op_ctx oc = {0};
    CHECK_OK(ctx, fwd(op, &x, r, true, NULL, NULL, NULL, &oc, &y));
    CHECK_OK(ctx, bwd(op, &oc, &dy, &dx));
    for (int b = 0; b < 2; b++)
        CHECK_OK(ctx, opf_recipe_state_update(ctx, opf_op_recipe_state(op), b, NULL, NULL));
    CHECK(opf_delayed_state_scale(opf_recipe_state_delayed(opf_op_recipe_state(op), false))[1] != 1.0f,
          "delayed warm-up moved the weight scale");
    opf_tensor *t[] = {&x, &dy, &y, &dx};
    for (int i = 0; i < 4; i++) opf_tensor_release(t[i]);
    opf_op_zero_grad(op);
}

/* dst's delayed scales and histories become src's. */
static void copy_delayed(opf_op *dst, const opf_op *src)
{
    for (int b = 0; b < 2; b++) {
        opf_delayed_state *s = opf_recipe_state_delayed(opf_op_recipe_state(src), b),
                          *d = opf_recipe_state_delayed(opf_op_recipe_state(dst), b);
        if (!s || !d) continue;
        int n = opf_delayed_state_slots(s), L = opf_delayed_state_history_len(s);
        memcpy(opf_delayed_state_scale(d), opf_delayed_state_scale(s), sizeof(float) * (size_t)n);
        memcpy(opf_delayed_state_history(d), opf_delayed_state_history(s), sizeof(float) * (size_t)(n * L));
    }
}

/* main_grad: += over two calls, = with is_first_microbatch 1, no weight
 * gradient returned; dW against the case's reference. */
static void check_main_grad(const char *tag, const opf_op *op, const opf_recipe *r, opf_dtype dt,
                            const lcase *L)
{
    opf_op *mg = new_linear("fc_mg", dt, true, r);
    if (r) copy_delayed(mg, op);
    opf_param *mp = opf_op_param(mg, 0);
    double *m1 = NULL, *m2 = NULL, *m3 = NULL;
    opf_basic_linear_kwargs k1 = {1};
    for (int call = 0; call < 3; call++) {
        opf_op_ctx oc = {0};
        opf_tensor yc, dxc;
        CHECK_OK(ctx, fwd(mg, &L->x, r, true, call == 2 ? &k1 : NULL, NULL, NULL, &oc, &yc));
        CHECK_OK(ctx, bwd(mg, &oc, &L->dy, &dxc));
        if (call == 0) conform_bwd(tag, mg, &dxc, (bool[]){false});
        double *m = values(&mp->main_grad, 0);
        *(call == 0 ? &m1 : call == 1 ? &m2 : &m3) = m;
        opf_tensor_release(&yc);
        opf_tensor_release(&dxc);
    }
    check_gemm("main_grad", tag, m1, L->dw_ref, L->dw_s, OUT * IN, OPF_F32);
    bool twice = true, same = !memcmp(m1, m3, OUT * IN * sizeof(double));
    for (int i = 0; i < OUT * IN; i++) twice &= m2[i] == 2.0 * m1[i];
    CHECK(twice && same, "%s: main_grad accumulates (%d) and is overwritten by is_first_microbatch=1 (%d)",
          tag, twice, same);
    CHECK(!mp->has_grad, "%s: main_grad returns no weight gradient", tag);
    free(m1), free(m2), free(m3);
    opf_op_destroy(mg);
}

/* Forward, backward, pre-quantized inputs, conformance for one recipe x dtype. */
static void test_basic_case(const rcase *rc, opf_dtype dt, float sx)
{
    char tag[96];
    snprintf(tag, sizeof tag, "basic_linear %s %s sx=%g", rc->name, opf_dtype_name(dt), sx);
    opf_recipe rec = make_recipe(rc), *r = rc->kind ? &rec : NULL;
    opf_op *op = new_linear("fc1", dt, false, r);
    if (!op) return;
    if (rc->kind == OPF_RECIPE_DELAYED) warm_delayed(op, r, dt, sx);
    lcase L;
    lcase_build(&L, op, dt, sx);

    opf_op_ctx oa = {0}, ob = {0};
    opf_tensor ya, yb, dxa, dxb;
    CHECK_OK(ctx, fwd(op, &L.x, r, true, NULL, NULL, NULL, &oa, &ya));
    const opf_tensor *aux[OPF_OP_MAX_AUX] = {r ? &oa.saved[1] : NULL, r ? &oa.saved[0] : NULL};
    conform_fwd(tag, op, &ya, aux);
    CHECK(args_enum(op, false, "x_mode") == (r ? 1 : 0), "%s: a plain x is quantized inside", tag);
    CHECK_OK(ctx, fwd(op, &L.xq, r, true, NULL, NULL, NULL, &ob, &yb));
    CHECK(args_enum(op, false, "x_mode") == 0, "%s: a pre-quantized x is used as is", tag);
    CHECK(bits_equal(&ya, &yb), "%s: pre-quantized input gives other bits", tag);
    double *y = values(&ya, 0);
    check_gemm("y", tag, y, L.y_ref, L.y_s, ROWS * OUT, dt);
    if (r) check_fro("y", tag, y, L.y_true, ROWS * OUT, rc->qtol_fwd);

    opf_param *p = opf_op_param(op, 0);
    opf_op_zero_grad(op);
    CHECK_OK(ctx, bwd(op, &oa, &L.dy, &dxa));
    conform_bwd(tag, op, &dxa, (bool[]){true});
    CHECK(args_enum(op, true, "dy_mode") == (r ? 1 : 0), "%s: a plain dy is quantized inside", tag);
    double *dx = values(&dxa, 0), *dw = values(&p->grad, 0);
    opf_op_zero_grad(op);
    CHECK_OK(ctx, bwd(op, &ob, &L.dyq, &dxb));
    CHECK(args_enum(op, true, "dy_mode") == 0, "%s: a pre-quantized dy is used as is", tag);
    CHECK(bits_equal(&dxa, &dxb), "%s: pre-quantized dy gives another dx", tag);
    double *dw2 = values(&p->grad, 0);
    CHECK(!memcmp(dw, dw2, OUT * IN * sizeof(double)), "%s: pre-quantized dy gives another dW", tag);
    check_gemm("dx", tag, dx, L.dx_ref, L.dx_s, ROWS * IN, dt);
    check_gemm("dW", tag, dw, L.dw_ref, L.dw_s, OUT * IN, dt);
    if (r) {
        check_fro("dx", tag, dx, L.dx_true, ROWS * IN, rc->qtol_bwd);
        check_fro("dW", tag, dw, L.dw_true, OUT * IN, rc->qtol_bwd);
    }
    CHECK(!oa.valid && !ob.valid, "%s: backward consumes the contexts", tag);

    check_main_grad(tag, op, r, dt, &L);

    free(y), free(dx), free(dw), free(dw2);
    opf_tensor *t[] = {&ya, &yb, &dxa, &dxb};
    for (int i = 0; i < 4; i++) opf_tensor_release(t[i]);
    lcase_free(&L);
    opf_op_destroy(op);
}

/* ---- basic_linear: the weight cache -------------------------------------------------- */

static void scale_weight(opf_param *p, float s)
{
    int64_t n = opf_spec_numel(&p->value.spec);
    float *v = xmalloc((size_t)n * sizeof(float));
    opf_convert(p->value.data[0], p->value.spec.dtype, v, OPF_F32, (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] *= s;
    opf_convert(v, OPF_F32, p->value.data[0], p->value.spec.dtype, (size_t)n);
    free(v);
}

static void test_weight_cache(const rcase *rc)
{
    char tag[64];
    snprintf(tag, sizeof tag, "weight cache %s", rc->name);
    opf_recipe rec = make_recipe(rc);
    opf_op *op = new_linear("fc_cache", OPF_BF16, false, &rec);
    opf_param *p = opf_op_param(op, 0);
    int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
    opf_tensor x = rand_tensor(2, xs, OPF_BF16, 1.0f), dy = rand_tensor(2, ys, OPF_BF16, 1.0f);
    opf_basic_linear_kwargs k0 = {0}, k1 = {1};
    opf_tensor y1, y1r, y0, yn, y1b, dxa, dxb, dxc;
    CHECK_OK(ctx, fwd(op, &x, &rec, false, &k1, NULL, NULL, NULL, &y1));
    CHECK(p->qvalue_valid && p->qvalue.spec.usage == (OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE),
          "%s: is_first_microbatch=1 caches both copies", tag);
    /* forward_impl writes the cache into the buffer it already has (a
     * compiled graph records that memory once) */
    const void *buf = p->qvalue.data[OPF_COMP_DATA];
    CHECK_OK(ctx, fwd(op, &x, &rec, false, &k1, NULL, NULL, NULL, &y1r));
    CHECK(buf && p->qvalue.data[OPF_COMP_DATA] == buf && bits_equal(&y1r, &y1),
          "%s: a second is_first_microbatch=1 reuses the cache's buffer", tag);
    scale_weight(p, 1.5f);
    CHECK_OK(ctx, fwd(op, &x, &rec, false, &k0, NULL, NULL, NULL, &y0));
    CHECK(bits_equal(&y0, &y1), "%s: is_first_microbatch=0 must reuse the cached weight", tag);
    CHECK_OK(ctx, fwd(op, &x, &rec, false, NULL, NULL, NULL, NULL, &yn));
    CHECK(!bits_equal(&yn, &y1), "%s: without kwargs the changed weight is used", tag);
    CHECK_OK(ctx, fwd(op, &x, &rec, false, &k1, NULL, NULL, NULL, &y1b));
    CHECK(bits_equal(&y1b, &yn) && p->qvalue.data[OPF_COMP_DATA] == buf,
          "%s: is_first_microbatch=1 refreshes the cache in place, bit for bit", tag);
    if (rc->kind != OPF_RECIPE_DELAYED) {  /* a delayed scale moves with the amax history */
        opf_quantizer qw = op_q(op, OPF_ROLE_WEIGHT, 0);
        qw.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
        opf_tensor wq = quantized(&qw, &p->value);
        CHECK(bits_equal(&wq, &p->qvalue), "%s: the cache holds the new weight quantized", tag);
        opf_tensor_release(&wq);
    }
    /* dgrad through the cache (read or written) equals dgrad through a
     * fresh quantization */
    opf_op_ctx oa = {0}, ob = {0}, oc1 = {0};
    opf_tensor t1, t2, t3;
    CHECK_OK(ctx, fwd(op, &x, &rec, true, &k0, NULL, NULL, &oa, &t1));
    CHECK_OK(ctx, bwd(op, &oa, &dy, &dxa));
    CHECK_OK(ctx, fwd(op, &x, &rec, true, NULL, NULL, NULL, &ob, &t2));
    CHECK_OK(ctx, bwd(op, &ob, &dy, &dxb));
    CHECK_OK(ctx, fwd(op, &x, &rec, true, &k1, NULL, NULL, &oc1, &t3));
    CHECK(oc1.saved[0].data[OPF_COMP_DATA] == buf, "%s: backward reads the cache", tag);
    CHECK_OK(ctx, bwd(op, &oc1, &dy, &dxc));
    CHECK(bits_equal(&dxa, &dxb) && bits_equal(&t1, &t2), "%s: backward through the cache", tag);
    CHECK(bits_equal(&dxc, &dxb) && bits_equal(&t3, &t2), "%s: backward through a written cache",
          tag);
    /* a recipe reset drops the cache */
    CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, &rec));
    opf_op_ctx oc = {0};
    opf_tensor yz;
    memset(&yz, 0, sizeof yz);
    CHECK_FAILS(ctx, fwd(op, &x, &rec, true, &k0, NULL, NULL, &oc, &yz), OPF_ERR_STATE,
                "fc_cache", "is_first_microbatch=0");
    CHECK(!oc.valid && !yz.data[0], "%s: a failed forward leaves no context or output", tag);
    opf_tensor *t[] = {&x, &dy, &y1, &y1r, &y0, &yn, &y1b, &dxa, &dxb, &dxc, &t1, &t2, &t3};
    for (int i = 0; i < 13; i++) opf_tensor_release(t[i]);
    opf_op_destroy(op);
}

/* ---- basic_linear: quantized outputs ------------------------------------------------- */

/* y quantized with the next op's input quantizer and dx with the previous
 * op's grad-output quantizer equal quantizing the plain outputs (per-tensor
 * FP8 from an f32 GEMM result: bitwise; from bf16: within E4M3 rounding). */
static void test_quantized_outputs(const rcase *rc, opf_dtype dt)
{
    char tag[80];
    snprintf(tag, sizeof tag, "quantized outputs %s %s", rc->name, opf_dtype_name(dt));
    opf_recipe rec = make_recipe(rc);
    opf_op *op = new_linear("fc_q", dt, false, &rec), *nb = new_linear("fc_nb", dt, false, &rec);
    opf_quantizer nq = op_q(nb, OPF_ROLE_INPUT, 0), pq = op_q(nb, OPF_ROLE_GRAD_OUTPUT, 0);
    int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
    opf_tensor x = rand_tensor(2, xs, dt, 2.0f), dy = rand_tensor(2, ys, dt, 0.5f);
    opf_op_ctx o0 = {0}, o1 = {0};
    opf_tensor yp, yq, dxp, dxq, ref;
    CHECK_OK(ctx, fwd(op, &x, &rec, true, NULL, NULL, NULL, &o0, &yp));
    CHECK_OK(ctx, fwd(op, &x, &rec, true, NULL, &nq, &pq, &o1, &yq));
    const opf_tensor *aux[OPF_OP_MAX_AUX] = {&o1.saved[1], &o1.saved[0]};
    conform_fwd(tag, op, &yq, aux);
    bool tensor_fp8 = nq.scaling == OPF_SCALING_TENSOR;
    CHECK(yq.spec.scaling == nq.scaling, "%s: y is %s", tag, opf_scaling_name(yq.spec.scaling));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &nq, &yp, &ref));
    if (!tensor_fp8 || dt == OPF_F32) {
        CHECK(opf_test_same_bytes(&yq, &ref), "%s: y differs from quantizing the plain y", tag);
    } else {
        double *a = values(&yq, OPF_USAGE_ROWWISE), *b = values(&yp, 0), amax = 0;
        int64_t bad = 0;
        for (int i = 0; i < ROWS * OUT; i++) amax = fmax(amax, fabs(b[i]));
        for (int i = 0; i < ROWS * OUT; i++) bad += !(fabs(a[i] - b[i]) <= 0.0675 * fabs(b[i]) + 1e-3 * amax);
        CHECK(bad == 0, "%s: %lld FP8 y values off", tag, (long long)bad);
        free(a), free(b);
    }
    opf_tensor_release(&ref);
    uint64_t after;
    CHECK_OK(ctx, bwd(op, &o0, &dy, &dxp));
    opf_ctx_get_rng(ctx, NULL, &after);  /* the plain backward used the dy draws only */
    CHECK_OK(ctx, bwd(op, &o1, &dy, &dxq));
    conform_bwd(tag, op, &dxq, (bool[]){true});
    set_rng(after);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &pq, &dxp, &ref));
    if (!tensor_fp8 || dt == OPF_F32)
        CHECK(opf_test_same_bytes(&dxq, &ref), "%s: dx differs from quantizing the plain dx", tag);
    else
        CHECK(dxq.spec.scaling == OPF_SCALING_TENSOR, "%s: dx is FP8", tag);
    opf_tensor *t[] = {&x, &dy, &yp, &yq, &dxp, &dxq, &ref};
    for (int i = 0; i < 7; i++) opf_tensor_release(t[i]);
    opf_op_destroy(op);
    opf_op_destroy(nb);
}

/* ---- inputs quantized in another format ----------------------------------------------- */

/* t's values (one copy decoded) as a plain tensor of dtype dt. */
static opf_tensor decoded(const opf_tensor *t, opf_dtype dt)
{
    opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, dt);
    opf_tensor d;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &d));
    CHECK_OK(ctx, opf_dequantize(ctx, t, OPF_USAGE_ROWWISE, &d));
    return d;
}

/* An MXFP8 x (or dy) reaching a current-scaling op, or an op without a
 * recipe, is decoded and re-quantized: the bits of running on its plain
 * values (exact in bf16). */
static void test_recast(void)
{
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT), mx = opf_recipe_default(OPF_RECIPE_MXFP8);
    opf_op *src = new_linear("fc_src", OPF_BF16, false, &mx);
    opf_quantizer qm = op_q(src, OPF_ROLE_INPUT, 0), qg = op_q(src, OPF_ROLE_GRAD_OUTPUT, 0);
    int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
    opf_tensor x = rand_tensor(2, xs, OPF_BF16, 1.0f), dy = rand_tensor(2, ys, OPF_BF16, 1.0f);
    opf_tensor xm = quantized(&qm, &x), dym = quantized(&qg, &dy);
    opf_tensor xp = decoded(&xm, OPF_BF16), dyp = decoded(&dym, OPF_BF16);
    for (int k = 0; k < 2; k++) {
        const opf_recipe *r = k ? &cur : NULL;
        opf_op *op = new_linear(k ? "fc_cur" : "fc_hp", OPF_BF16, false, r);
        opf_op_ctx o1 = {0}, o2 = {0};
        opf_tensor y1, y2, dx1, dx2;
        CHECK_OK(ctx, fwd(op, &xm, r, true, NULL, NULL, NULL, &o1, &y1));
        CHECK(args_enum(op, false, "x_mode") == 2, "recast %d: x is decoded and re-quantized", k);
        const opf_tensor *aux[OPF_OP_MAX_AUX] = {&o1.saved[1], r ? &o1.saved[0] : NULL};
        conform_fwd("recast", op, &y1, aux);
        CHECK_OK(ctx, fwd(op, &xp, r, true, NULL, NULL, NULL, &o2, &y2));
        CHECK(bits_equal(&y1, &y2), "recast %d: y of an mxfp8 x equals y of its values", k);
        opf_op_zero_grad(op);
        CHECK_OK(ctx, bwd(op, &o1, &dym, &dx1));
        CHECK(args_enum(op, true, "dy_mode") == 2, "recast %d: dy is decoded", k);
        conform_bwd("recast", op, &dx1, (bool[]){true});
        double *g1 = values(&opf_op_param(op, 0)->grad, 0);
        opf_op_zero_grad(op);
        CHECK_OK(ctx, bwd(op, &o2, &dyp, &dx2));
        double *g2 = values(&opf_op_param(op, 0)->grad, 0);
        CHECK(bits_equal(&dx1, &dx2) && !memcmp(g1, g2, OUT * IN * sizeof(double)),
              "recast %d: gradients of an mxfp8 dy equal those of its values", k);
        free(g1), free(g2);
        opf_tensor *t[] = {&y1, &y2, &dx1, &dx2};
        for (int i = 0; i < 4; i++) opf_tensor_release(t[i]);
        opf_op_destroy(op);
    }
    opf_tensor *t[] = {&x, &dy, &xm, &dym, &xp, &dyp};
    for (int i = 0; i < 6; i++) opf_tensor_release(t[i]);
    opf_op_destroy(src);
}

/* ---- two linears in a seq ------------------------------------------------------------- */

/* fc_a -> fc_b through the fuser: fc_a emits y quantized with fc_b's input
 * quantizer, which fc_b uses as is; fc_b hands back dx quantized with fc_a's
 * grad-output quantizer, which fc_a uses as is. */
static void test_seq_pair(const rcase *rc)
{
    char tag[64];
    snprintf(tag, sizeof tag, "seq pair %s", rc->name);
    opf_recipe rec = make_recipe(rc);
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_basic_linear_config ca = {IN, OUT, OPF_BF16, false}, cb = {OUT, IN, OPF_BF16, false};
    opf_op *a, *b;
    CHECK_OK(ctx, opf_op_create(ctx, "basic_linear", &ca, "fc_a", &a));
    CHECK_OK(ctx, opf_op_create(ctx, "basic_linear", &cb, "fc_b", &b));
    CHECK_OK(ctx, opf_seq_append(seq, a));
    CHECK_OK(ctx, opf_seq_append(seq, b));
    int64_t xs[2] = {ROWS, IN};
    opf_tensor x = rand_tensor(2, xs, OPF_BF16, 1.0f), dy = rand_tensor(2, xs, OPF_BF16, 1.0f), y, dx;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &rec;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    CHECK(args_enum(b, false, "x_mode") == 0, "%s: fc_b takes fc_a's quantized y as is", tag);
    double *xv = values(&x, 0), *wa = values(&opf_op_param(a, 0)->value, 0),
           *wb = values(&opf_op_param(b, 0)->value, 0), *h = xmalloc(ROWS * OUT * 8),
           *yr = xmalloc(ROWS * IN * 8), *yv = values(&y, 0);
    ref_fprop(xv, wa, ROWS, OUT, IN, h, NULL);
    ref_fprop(h, wb, ROWS, IN, OUT, yr, NULL);
    check_fro("y", tag, yv, yr, ROWS * IN, 2 * rc->qtol_fwd);
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));
    CHECK(args_enum(a, true, "dy_mode") == 0, "%s: fc_a takes fc_b's quantized dx as is", tag);
    CHECK(dx.data[0] && opf_op_param(a, 0)->has_grad && opf_op_param(b, 0)->has_grad,
          "%s: gradients reach both linears", tag);
    free(xv), free(wa), free(wb), free(h), free(yr), free(yv);
    opf_tensor *t[] = {&x, &dy, &y, &dx};
    for (int i = 0; i < 4; i++) opf_tensor_release(t[i]);
    opf_seq_destroy(seq);
}

/* ---- finite differences of the reference ------------------------------------------- */

/* L(x, W) = sum dy * (x W^T): dL/dx = dy W, dL/dW = dy^T x. */
static void test_reference_fd(void)
{
    enum { M = 3, N = 4, K = 5 };
    double x[M * K], w[N * K], dy[M * N], y[M * N], dx[M * K], dw[N * K];
    for (int i = 0; i < M * K; i++) x[i] = opf_test_normal(&rng, 1.0f);
    for (int i = 0; i < N * K; i++) w[i] = opf_test_normal(&rng, 1.0f);
    for (int i = 0; i < M * N; i++) dy[i] = opf_test_normal(&rng, 1.0f);
    ref_dgrad(dy, w, M, N, K, dx, NULL);
    ref_wgrad(dy, x, M, N, K, dw, NULL);
    double h = 1e-6, worst = 0;
    for (int which = 0; which < 2; which++) {
        double *v = which ? w : x, *g = which ? dw : dx;
        for (int i = 0; i < (which ? N * K : M * K); i++) {
            double keep = v[i], l[2];
            for (int s = 0; s < 2; s++) {
                v[i] = keep + (s ? -h : h);
                ref_fprop(x, w, M, N, K, y, NULL);
                l[s] = 0;
                for (int j = 0; j < M * N; j++) l[s] += dy[j] * y[j];
            }
            v[i] = keep;
            worst = fmax(worst, fabs((l[0] - l[1]) / (2 * h) - g[i]));
        }
    }
    CHECK(worst < 1e-6, "finite differences of the linear reference: worst %g", worst);
}

/* ---- basic_linear: bad inputs ------------------------------------------------------ */

static void test_basic_errors(void)
{
    opf_op *op = NULL;
    opf_basic_linear_config bad = {0, 16, OPF_BF16, false};
    CHECK_FAILS(ctx, opf_op_create(ctx, "basic_linear", &bad, "fcb", &op), OPF_ERR_INVALID_ARG,
                "fcb", "in_features 0");
    bad = (opf_basic_linear_config){16, 16, OPF_E4M3, false};
    CHECK_FAILS(ctx, opf_op_create(ctx, "basic_linear", &bad, "fcb", &op), OPF_ERR_INVALID_ARG,
                "fcb", "e4m3");
    CHECK(!op, "no op after a bad config");

    opf_recipe mx = opf_recipe_default(OPF_RECIPE_MXFP8), nv = opf_recipe_default(OPF_RECIPE_NVFP4);
    op = new_linear("fc_err", OPF_BF16, false, NULL);
    opf_param *p = opf_op_param(op, 0);
    opf_tensor w0;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &p->value.spec, &w0));
    memcpy(w0.data[0], p->value.data[0], OUT * IN * 2);
    int64_t s1[2] = {ROWS, 100}, s2[2] = {ROWS, IN}, s3[2] = {ROWS - 8, IN}, s4[2] = {ROWS, OUT + 1};
    opf_tensor xw = rand_tensor(2, s1, OPF_BF16, 1), x = rand_tensor(2, s2, OPF_BF16, 1),
               x56 = rand_tensor(2, s3, OPF_BF16, 1), dyw = rand_tensor(2, s4, OPF_BF16, 1), y, dx;
    opf_spec is = opf_spec_make(2, s2, OPF_I32);
    opf_tensor xi;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &is, &xi));
    memset(xi.data[0], 0, ROWS * IN * 4);
    opf_op_ctx oc = {0};
    memset(&y, 0, sizeof y);
    CHECK_FAILS(ctx, fwd(op, &xw, NULL, true, NULL, NULL, NULL, &oc, &y), OPF_ERR_SHAPE, "basic_linear",
                "fc_err", "100 features", "expects 128");
    CHECK_FAILS(ctx, fwd(op, &xi, NULL, true, NULL, NULL, NULL, &oc, &y), OPF_ERR_DTYPE, "fc_err", "i32");
    opf_basic_linear_kwargs k0 = {0}, k5 = {5};
    CHECK_FAILS(ctx, fwd(op, &x, NULL, true, &k5, NULL, NULL, &oc, &y), OPF_ERR_INVALID_ARG,
                "is_first_microbatch 5");
    CHECK_FAILS(ctx, fwd(op, &x, &mx, true, &k0, NULL, NULL, &oc, &y), OPF_ERR_STATE, "fc_err",
                "there is none");
    CHECK_FAILS(ctx, fwd(op, &x56, &mx, true, NULL, NULL, NULL, &oc, &y), OPF_ERR_SHAPE, "fc_err", "32");
    opf_op *h = new_linear("fc_h", OPF_F16, false, NULL);
    opf_tensor xh = rand_tensor(2, s2, OPF_F16, 1);
    CHECK_FAILS(ctx, fwd(h, &xh, &nv, true, NULL, NULL, NULL, &oc, &y), OPF_ERR_UNSUPPORTED, "fc_h",
                "nvfp4", "f16");
    CHECK(!oc.valid && !y.data[0] && !p->qvalue_valid && !memcmp(w0.data[0], p->value.data[0], OUT * IN * 2),
          "failed forwards leave the op unchanged");
    opf_bwd_env be = {.ctx = ctx, .dy = &dyw};
    CHECK_FAILS(ctx, opf_op_backward(op, &oc, &be, &dx, NULL), OPF_ERR_STATE, "fc_err", "backward");
    CHECK_OK(ctx, fwd(op, &x, NULL, true, NULL, NULL, NULL, &oc, &y));
    CHECK_FAILS(ctx, opf_op_backward(op, &oc, &be, &dx, NULL), OPF_ERR_SHAPE, "fc_err", "97");
    CHECK(oc.valid && !p->has_grad, "a failed backward keeps the context");
    be.dy = &y;  /* [ROWS, OUT]: right shape */
    CHECK_OK(ctx, opf_op_backward(op, &oc, &be, &dx, NULL));
    CHECK_FAILS(ctx, opf_op_backward(op, &oc, &be, &dx, NULL), OPF_ERR_STATE, "fc_err");
    opf_tensor *t[] = {&w0, &xw, &x, &x56, &dyw, &xi, &xh, &y, &dx};
    for (int i = 0; i < 9; i++) opf_tensor_release(t[i]);
    opf_op_destroy(op);
    opf_op_destroy(h);
}

/* The class: quantizer callbacks, init values. */
static void test_basic_class(void)
{
    const opf_op_class *c = opf_op_class_find("basic_linear");
    CHECK(c && c->n_gemms == 1 && !strcmp(c->module_type, "linear") && c->kwargs_schema,
          "basic_linear class");
    opf_op *op = new_linear("fc_cls", OPF_F32, false, NULL);
    CHECK(!c->unsupported_reason, "basic_linear runs inside a compiled graph");
    CHECK(!c->input_quantizer(op) && !c->grad_output_quantizer(op), "no quantizers without a recipe");
    opf_recipe r = opf_recipe_default(OPF_RECIPE_NVFP4);
    CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, &r));
    const opf_quantizer *iq = c->input_quantizer(op);
    CHECK(iq && iq->scaling == OPF_SCALING_NVFP4_1D && iq->rht && !iq->stochastic, "input quantizer");
    const opf_quantizer *gq = c->grad_output_quantizer(op);
    CHECK(gq && gq->rht && gq->stochastic, "grad-output quantizer");
    /* Kaiming-uniform: inside +-1/sqrt(in), mean ~0, variance ~b^2/3 */
    const float *w = opf_op_param(op, 0)->value.data[0];
    double b = 1.0 / sqrt((double)IN), mean = 0, var = 0, mx = 0;
    for (int i = 0; i < OUT * IN; i++) mean += w[i], var += (double)w[i] * w[i], mx = fmax(mx, fabs(w[i]));
    mean /= OUT * IN, var /= OUT * IN;
    CHECK(mx < b && fabs(mean) < 0.02 * b && fabs(var / (b * b / 3) - 1) < 0.05,
          "weight init: max %g (bound %g), mean %g, var %g", mx, b, mean, var);
    opf_op *op2 = new_linear("fc_cls2", OPF_F32, false, NULL);
    CHECK(memcmp(w, opf_op_param(op2, 0)->value.data[0], OUT * IN * 4) != 0, "ops draw fresh weights");
    opf_op_destroy(op);
    opf_op_destroy(op2);
}

/* ---- grouped_linear -------------------------------------------------------------------- */

enum { G = 3, GIN = 64, GOUT = 32 };
static const int64_t gsplit[G] = {32, 0, 64};
#define GROWS 96

static opf_op *new_grouped(const char *name, opf_dtype dt, bool bias, const opf_recipe *r)
{
    opf_grouped_linear_config c = {G, GIN, GOUT, bias, dt, false};
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, "grouped_linear", &c, name, &op));
    if (op && r) CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, r));
    return op;
}

static opf_tensor split_tensor(const int64_t *v, int n)
{
    opf_spec s = opf_spec_make(1, (int64_t[]){n}, OPF_I64);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    memcpy(t.data[0], v, sizeof(int64_t) * (size_t)n);
    return t;
}

/* A row block [off, off+m) of a plain tensor as its own tensor (copied). */
static opf_tensor rows_of(const opf_tensor *t, int64_t off, int64_t m)
{
    int64_t M, K;
    opf_shape_2d(&t->spec, &M, &K);
    opf_spec s = opf_spec_make(2, (int64_t[]){m, K}, t->spec.dtype);
    opf_tensor r;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &r));
    size_t e = opf_dtype_nbytes(t->spec.dtype, 1);
    memcpy(r.data[0], (char *)t->data[0] + (size_t)(off * K) * e, (size_t)(m * K) * e);
    return r;
}

/* Group g of a grouped case: quantize x_g, W_g, dy_g here as the op does
 * (dy's stochastic rounding continues the Philox stream in group order),
 * then y_g, dx_g, dW_g (and db_g) against FP64 on those values and, loosely,
 * on the unquantized ones. */
static void check_group(const char *tag, const rcase *rc, opf_op *op, int g, int64_t off,
                        const opf_tensor *x, const opf_tensor *dy, const double *yv,
                        const double *dxv, const double *dw)
{
    int64_t m = gsplit[g];
    bool bias = opf_op_num_params(op) > G, r = rc->kind != OPF_RECIPE_NONE;
    opf_dtype dt = x->spec.dtype;
    opf_param *pw = opf_op_param(op, g);
    opf_tensor xg = rows_of(x, off, m), dyg = rows_of(dy, off, m);
    opf_quantizer qx = op_q(op, OPF_ROLE_INPUT, g), qw = op_q(op, OPF_ROLE_WEIGHT, g),
                  qg = op_q(op, OPF_ROLE_GRAD_OUTPUT, g);
    opf_tensor xq = quantized(&qx, &xg), wq = quantized(&qw, &pw->value), gq = quantized(&qg, &dyg);
    double *xr = values(&xq, 1), *xc = values(&xq, 2), *wr = values(&wq, 1), *wc = values(&wq, 2),
           *gr = values(&gq, 1), *gc = values(&gq, 2), *gp = values(&dyg, 0);
    double *yr = xmalloc(m * GOUT * 8), *ysum = xmalloc(m * GOUT * 8), *dxr = xmalloc(m * GIN * 8),
           *dxs = xmalloc(m * GIN * 8), *dwr = xmalloc(GOUT * GIN * 8), *dws = xmalloc(GOUT * GIN * 8);
    ref_fprop(xr, wr, m, GOUT, GIN, yr, ysum);
    if (bias) {
        double *b = values(&opf_op_param(op, G + g)->value, 0), *db = values(&opf_op_param(op, G + g)->grad, 0);
        double dbr[GOUT], dbs[GOUT];
        for (int j = 0; j < GOUT; j++) {
            dbr[j] = dbs[j] = 0;
            for (int64_t i = 0; i < m; i++) dbr[j] += gp[i * GOUT + j], dbs[j] += fabs(gp[i * GOUT + j]);
        }
        for (int64_t i = 0; i < m * GOUT; i++) yr[i] += b[i % GOUT], ysum[i] += fabs(b[i % GOUT]);
        check_gemm("db", tag, db, dbr, dbs, GOUT, dt);
        free(b), free(db);
    }
    ref_dgrad(gr, wc, m, GOUT, GIN, dxr, dxs);
    ref_wgrad(gc, xc, m, GOUT, GIN, dwr, dws);
    check_gemm("y", tag, yv + off * GOUT, yr, ysum, m * GOUT, dt);
    check_gemm("dx", tag, dxv + off * GIN, dxr, dxs, m * GIN, dt);
    check_gemm("dW", tag, dw, dwr, dws, GOUT * GIN, dt);
    if (r) {  /* against the unquantized values */
        double *xp = values(&xg, 0), *wp = values(&pw->value, 0);
        ref_fprop(xp, wp, m, GOUT, GIN, yr, NULL);
        ref_wgrad(gp, xp, m, GOUT, GIN, dwr, NULL);
        if (!bias) check_fro("y", tag, yv + off * GOUT, yr, m * GOUT, rc->qtol_fwd);
        check_fro("dW", tag, dw, dwr, GOUT * GIN, rc->qtol_bwd);
        free(xp), free(wp);
    }
    free(xr), free(xc), free(wr), free(wc), free(gr), free(gc), free(gp);
    free(yr), free(ysum), free(dxr), free(dxs), free(dwr), free(dws);
    opf_tensor *t[] = {&xg, &dyg, &xq, &wq, &gq};
    for (int i = 0; i < 5; i++) opf_tensor_release(t[i]);
}

static void test_grouped_case(const rcase *rc, opf_dtype dt, bool bias)
{
    char tag[96];
    snprintf(tag, sizeof tag, "grouped_linear %s %s%s", rc->name, opf_dtype_name(dt), bias ? " bias" : "");
    opf_recipe rec = make_recipe(rc), *r = rc->kind ? &rec : NULL;
    opf_op *op = new_grouped("experts", dt, bias, r);
    if (!op) return;
    for (int i = 0; bias && i < G; i++) {  /* nonzero biases */
        opf_tensor b = rand_tensor(1, (int64_t[]){GOUT}, dt, 0.5f);
        memcpy(opf_op_param(op, G + i)->value.data[0], b.data[0], opf_dtype_nbytes(dt, GOUT));
        opf_tensor_release(&b);
    }
    int64_t xs[2] = {GROWS, GIN}, ys[2] = {GROWS, GOUT};
    opf_tensor x = rand_tensor(2, xs, dt, 1.0f), dy = rand_tensor(2, ys, dt, 1.0f), sp = split_tensor(gsplit, G);
    const opf_tensor *extra[1] = {&sp};
    opf_fwd_env env = {.ctx = ctx, .x = &x, .extra_in = {extra[0]}, .recipe = r, .requires_grad = true};
    opf_op_ctx oc = {0};
    opf_tensor y, dx, dsp;
    CHECK_OK(ctx, opf_op_forward(op, &env, &oc, &y));
    const opf_tensor *aux[OPF_OP_MAX_AUX] = {r ? &oc.saved[2] : NULL, r ? &oc.saved[1] : NULL, NULL,
                                             &oc.saved[0]};
    conform_fwd(tag, op, &y, aux);
    opf_bwd_env be = {.ctx = ctx, .dy = &dy};
    opf_op_zero_grad(op);
    set_rng(OFF0);
    CHECK_OK(ctx, opf_op_backward(op, &oc, &be, &dx, &dsp));
    bool has[2 * G];
    for (int i = 0; i < 2 * G; i++) has[i] = bias || i < G;
    conform_bwd(tag, op, &dx, has);
    CHECK(!dsp.data[0], "%s: the split sizes get no gradient", tag);

    /* per group: quantize here as the op does (dy's stochastic rounding in
     * group order from OFF0), then the FP64 references */
    double *yv = values(&y, 0), *dxv = values(&dx, 0);
    set_rng(OFF0);
    int64_t off = 0;
    for (int g = 0; g < G; off += gsplit[g], g++) {
        int64_t m = gsplit[g];
        opf_param *pw = opf_op_param(op, g);
        double *dw = values(&pw->grad, 0);
        if (!m) {
            bool zero = true;
            for (int i = 0; i < GOUT * GIN; i++) zero &= dw[i] == 0;
            if (bias) {
                double *db = values(&opf_op_param(op, G + g)->grad, 0);
                for (int i = 0; i < GOUT; i++) zero &= db[i] == 0;
                free(db);
            }
            CHECK(zero, "%s: empty group %d has zero gradients", tag, g);
            free(dw);
            continue;
        }
        check_group(tag, rc, op, g, off, &x, &dy, yv, dxv, dw);
        free(dw);
    }
    free(yv), free(dxv);
    opf_tensor *t[] = {&x, &dy, &sp, &y, &dx};
    for (int i = 0; i < 5; i++) opf_tensor_release(t[i]);
    opf_op_destroy(op);
}

/* A quantized x or dy reaching grouped_linear is decoded: the bits of its
 * plain values, under a recipe too. */
static void test_grouped_recast(void)
{
    opf_recipe mx = opf_recipe_default(OPF_RECIPE_MXFP8), cur = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_op *src = new_linear("fc_src2", OPF_BF16, false, &mx);
    opf_quantizer qm = op_q(src, OPF_ROLE_INPUT, 0);
    int64_t xs[2] = {GROWS, GIN}, ys[2] = {GROWS, GOUT};
    opf_tensor x = rand_tensor(2, xs, OPF_BF16, 1.0f), dy = rand_tensor(2, ys, OPF_BF16, 1.0f),
               sp = split_tensor(gsplit, G);
    opf_tensor xm = quantized(&qm, &x), dym = quantized(&qm, &dy), xp = decoded(&xm, OPF_BF16),
               dyp = decoded(&dym, OPF_BF16);
    for (int k = 0; k < 2; k++) {
        const opf_recipe *r = k ? &cur : NULL;
        opf_op *op = new_grouped("experts_rc", OPF_BF16, true, r);
        opf_tensor y[2], dx[2], dsp[2];
        double *g[2];
        for (int v = 0; v < 2; v++) {
            opf_fwd_env env = {.ctx = ctx, .x = v ? &xp : &xm, .extra_in = {&sp}, .recipe = r,
                               .requires_grad = true};
            opf_op_ctx oc = {0};
            CHECK_OK(ctx, opf_op_forward(op, &env, &oc, &y[v]));
            if (!v) {
                const opf_tensor *aux[OPF_OP_MAX_AUX] = {r ? &oc.saved[2] : NULL, r ? &oc.saved[1] : NULL,
                                                         r ? &AUX_UNSAVED : &oc.saved[2], &oc.saved[0]};
                conform_fwd("grouped recast", op, &y[v], aux);
            }
            opf_bwd_env be = {.ctx = ctx, .dy = v ? &dyp : &dym};
            opf_op_zero_grad(op);
            CHECK_OK(ctx, opf_op_backward(op, &oc, &be, &dx[v], &dsp[v]));
            g[v] = values(&opf_op_param(op, 2)->grad, 0);
        }
        CHECK(bits_equal(&y[0], &y[1]) && bits_equal(&dx[0], &dx[1]) &&
              !memcmp(g[0], g[1], GOUT * GIN * sizeof(double)),
              "grouped recast %d: quantized x / dy give the bits of their values", k);
        for (int v = 0; v < 2; v++) opf_tensor_release(&y[v]), opf_tensor_release(&dx[v]), free(g[v]);
        opf_op_destroy(op);
    }
    opf_tensor *t[] = {&x, &dy, &sp, &xm, &dym, &xp, &dyp};
    for (int i = 0; i < 7; i++) opf_tensor_release(t[i]);
    opf_op_destroy(src);
}

static void test_grouped_errors(void)
{
    opf_op *op = NULL;
    opf_grouped_linear_config bad = {33, 16, 16, true, OPF_BF16, false};
    CHECK_FAILS(ctx, opf_op_create(ctx, "grouped_linear", &bad, "gb", &op), OPF_ERR_INVALID_ARG,
                "gb", "33 groups with bias", "66 parameters", "1..64");
    CHECK(!op, "no op after a bad config");
    bad = (opf_grouped_linear_config){65, 16, 16, false, OPF_BF16, false};
    CHECK_FAILS(ctx, opf_op_create(ctx, "grouped_linear", &bad, "gb", &op), OPF_ERR_INVALID_ARG,
                "gb", "65 groups", "65 parameters", "1..64");
    CHECK(!op, "no op after a bad config");
    op = new_grouped("moe", OPF_BF16, true, NULL);
    /* split sizes from data, weights through a reference: a compiled graph
     * runs the op eagerly */
    const opf_op_class *gc = opf_op_class_of(op);
    const char *why = gc->unsupported_reason ? gc->unsupported_reason(op) : NULL;
    CHECK(why && strstr(why, "split sizes"), "grouped_linear gives a reason to run eagerly");
    int64_t xs[2] = {GROWS, GIN}, wsz[2] = {GROWS, GIN + 1};
    opf_tensor x = rand_tensor(2, xs, OPF_BF16, 1), xw = rand_tensor(2, wsz, OPF_BF16, 1);
    int64_t wrong[G] = {32, 0, 65}, neg[G] = {100, -4, 0};
    opf_tensor sw = split_tensor(wrong, G), sn = split_tensor(neg, G), s2 = split_tensor(gsplit, 2),
               sok = split_tensor(gsplit, G), sf, y, dx, dsp;
    opf_spec fs = opf_spec_make(1, (int64_t[]){G}, OPF_F32);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &fs, &sf));
    memset(sf.data[0], 0, 12);
    opf_op_ctx oc = {0};
    memset(&y, 0, sizeof y);
    opf_fwd_env env = {.ctx = ctx, .x = &x, .extra_in = {&sw}, .requires_grad = true};
    CHECK_FAILS(ctx, opf_op_forward(op, &env, &oc, &y), OPF_ERR_SHAPE, "moe", "sum to 97", "only 96 rows");
    env.extra_in[0] = &sn;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, &oc, &y), OPF_ERR_INVALID_ARG, "moe", "split size 1", "-4");
    env.extra_in[0] = &s2;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, &oc, &y), OPF_ERR_SHAPE, "moe", "i64[2]", "i64[3]");
    env.extra_in[0] = &sf;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, &oc, &y), OPF_ERR_SHAPE, "moe", "f32");
    env.extra_in[0] = NULL;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, &oc, &y), OPF_ERR_INVALID_ARG, "moe", "split sizes");
    env.extra_in[0] = &sok;
    env.x = &xw;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, &oc, &y), OPF_ERR_SHAPE, "moe", "65 features", "64");
    opf_recipe mx = opf_recipe_default(OPF_RECIPE_MXFP8);
    int64_t odd[G] = {16, 16, 64};
    opf_tensor so = split_tensor(odd, G);
    env.x = &x;
    env.extra_in[0] = &so;
    env.recipe = &mx;
    CHECK_FAILS(ctx, opf_op_forward(op, &env, &oc, &y), OPF_ERR_SHAPE, "moe", "group 0");
    CHECK(!oc.valid && !y.data[0], "failed grouped forwards leave nothing");
    opf_bwd_env be = {.ctx = ctx, .dy = &x};
    CHECK_FAILS(ctx, opf_op_backward(op, &oc, &be, &dx, &dsp), OPF_ERR_STATE, "moe");
    env.recipe = NULL;
    env.extra_in[0] = &sok;
    CHECK_OK(ctx, opf_op_forward(op, &env, &oc, &y));
    CHECK_FAILS(ctx, opf_op_backward(op, &oc, &be, &dx, &dsp), OPF_ERR_SHAPE, "moe", "[96, 64]", "[96, 32]");
    be.dy = &y;
    CHECK_OK(ctx, opf_op_backward(op, &oc, &be, &dx, &dsp));
    const opf_op_class *c = opf_op_class_of(op);
    CHECK(c->n_extra_in == 1 && !c->input_quantizer && !c->grad_output_quantizer, "grouped class");
    opf_tensor *t[] = {&x, &xw, &sw, &sn, &s2, &sok, &sf, &so, &y, &dx};
    for (int i = 0; i < 10; i++) opf_tensor_release(t[i]);
    opf_op_destroy(op);
}

/* The plain data flow of a grouped op's last forward/backward against FP64
 * on the given (original, unquantized) x, W_g, b_g, dy: dx, dW_g, db_g and,
 * with check_y, y, all within the fp32-GEMM tolerance (numerics.md 8.3). */
static void check_grouped_plain(const char *tag, opf_op *op, const int64_t *split, int nG,
                                int64_t in, int64_t out, const opf_tensor *x, const opf_tensor *dy,
                                const opf_tensor *y, const opf_tensor *dx, bool check_y)
{
    bool bias = opf_op_num_params(op) > nG;
    opf_dtype dt = x->spec.dtype;
    double *xv = values(x, 0), *gv = values(dy, 0), *yv = values(y, 0), *dxv = values(dx, 0);
    int64_t off = 0;
    for (int g = 0; g < nG; off += split[g], g++) {
        int64_t m = split[g];
        double *w = values(&opf_op_param(op, g)->value, 0), *dw = values(&opf_op_param(op, g)->grad, 0);
        double *yr = xmalloc((size_t)(m * out + 1) * 8), *ys = xmalloc((size_t)(m * out + 1) * 8),
               *dxr = xmalloc((size_t)(m * in + 1) * 8), *dxs = xmalloc((size_t)(m * in + 1) * 8),
               *dwr = xmalloc((size_t)(out * in) * 8), *dws = xmalloc((size_t)(out * in) * 8);
        ref_fprop(xv + off * in, w, m, out, in, yr, ys);
        ref_dgrad(gv + off * out, w, m, out, in, dxr, dxs);
        ref_wgrad(gv + off * out, xv + off * in, m, out, in, dwr, dws);
        if (bias) {
            double *b = values(&opf_op_param(op, nG + g)->value, 0),
                   *db = values(&opf_op_param(op, nG + g)->grad, 0);
            double *dbr = xmalloc((size_t)out * 8), *dbs = xmalloc((size_t)out * 8);
            for (int64_t j = 0; j < out; j++) {
                dbr[j] = dbs[j] = 0;
                for (int64_t i = 0; i < m; i++)
                    dbr[j] += gv[(off + i) * out + j], dbs[j] += fabs(gv[(off + i) * out + j]);
            }
            for (int64_t i = 0; i < m * out; i++) yr[i] += b[i % out], ys[i] += fabs(b[i % out]);
            check_gemm("db", tag, db, dbr, dbs, out, dt);
            free(b), free(db), free(dbr), free(dbs);
        }
        if (check_y) check_gemm("y", tag, yv + off * out, yr, ys, m * out, dt);
        check_gemm("dx", tag, dxv + off * in, dxr, dxs, m * in, dt);
        check_gemm("dW", tag, dw, dwr, dws, out * in, dt);
        free(w), free(dw), free(yr), free(ys), free(dxr), free(dxs), free(dwr), free(dws);
    }
    free(xv), free(gv), free(yv), free(dxv);
}

/* 12 groups with bias (24 parameters, past the old limit of 8): every
 * group's y, dx, dW, db against FP64; the recipe state holds 12 GEMMs. */
static void test_grouped_many(void)
{
    enum { NG = 12, MI = 32, MO = 16 };
    static const int64_t split[NG] = {16, 0, 32, 16, 48, 16, 0, 32, 16, 16, 64, 32};
    int64_t rows = 0;
    for (int g = 0; g < NG; g++) rows += split[g];
    opf_grouped_linear_config c = {NG, MI, MO, true, OPF_F32, false};
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, "grouped_linear", &c, "experts12", &op));
    if (!op) return;
    CHECK(opf_op_num_params(op) == 2 * NG && op->n_gemms == NG, "12 groups: 24 parameters, 12 GEMMs");
    for (int i = 0; i < NG; i++) {
        opf_tensor b = rand_tensor(1, (int64_t[]){MO}, OPF_F32, 0.5f);
        memcpy(opf_op_param(op, NG + i)->value.data[0], b.data[0], MO * sizeof(float));
        opf_tensor_release(&b);
    }
    opf_tensor x = rand_tensor(2, (int64_t[]){rows, MI}, OPF_F32, 2.0f),
               dy = rand_tensor(2, (int64_t[]){rows, MO}, OPF_F32, 0.5f), sp = split_tensor(split, NG),
               y, dx, dsp;
    opf_fwd_env env = {.ctx = ctx, .x = &x, .extra_in = {&sp}, .requires_grad = true};
    opf_op_ctx oc = {0};
    CHECK_OK(ctx, opf_op_forward(op, &env, &oc, &y));
    const opf_tensor *aux[OPF_OP_MAX_AUX] = {NULL, NULL, NULL, &oc.saved[0]};
    conform_fwd("grouped 12", op, &y, aux);
    opf_bwd_env be = {.ctx = ctx, .dy = &dy};
    opf_op_zero_grad(op);
    CHECK_OK(ctx, opf_op_backward(op, &oc, &be, &dx, &dsp));
    bool has[2 * NG];
    for (int i = 0; i < 2 * NG; i++) has[i] = true;
    conform_bwd("grouped 12", op, &dx, has);
    check_grouped_plain("grouped 12", op, split, NG, MI, MO, &x, &dy, &y, &dx, true);
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);
    CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, &cur));
    opf_quantizer q11 = op_q(op, OPF_ROLE_GRAD_OUTPUT, NG - 1);
    CHECK(opf_op_recipe_state(op) && q11.scaling == OPF_SCALING_TENSOR,
          "grouped 12: the recipe state has a quantizer for GEMM 11");
    opf_tensor *t[] = {&x, &dy, &sp, &y, &dx};
    for (int i = 0; i < 5; i++) opf_tensor_release(t[i]);
    opf_op_destroy(op);
}

/* The recipe's backward override (numerics 3.7): the forward is bitwise the
 * same; high_precision grads are plain GEMMs on the original x, W_g, dy;
 * dequantized grads (plain GEMMs on the decoded saved operands) are within
 * the recipe's tolerance of them. */
static void test_grouped_override(const rcase *rc)
{
    char tag[96];
    opf_recipe base = make_recipe(rc);
    opf_dtype dt = OPF_BF16;
    opf_op *ops[3];
    opf_tensor y[3], dx[3], dsp;
    int64_t xs[2] = {GROWS, GIN}, ys[2] = {GROWS, GOUT};
    opf_tensor x = rand_tensor(2, xs, dt, 1.0f), dy = rand_tensor(2, ys, dt, 1.0f), sp = split_tensor(gsplit, G);
    for (int k = 0; k < 3; k++) {
        opf_recipe r = base;
        r.backward_override = (opf_backward_override)k;
        snprintf(tag, sizeof tag, "grouped override %s %d", rc->name, k);
        ops[k] = new_grouped("experts_ovr", dt, true, NULL);
        for (int i = 0; i < 2 * G; i++) {  /* op 0's weights everywhere, nonzero biases */
            opf_param *p = opf_op_param(ops[k], i), *p0 = opf_op_param(ops[0], i);
            if (k == 0 && i >= G) {
                opf_tensor b = rand_tensor(1, (int64_t[]){GOUT}, dt, 0.5f);
                memcpy(p->value.data[0], b.data[0], opf_dtype_nbytes(dt, GOUT));
                opf_tensor_release(&b);
            }
            if (k) memcpy(p->value.data[0], p0->value.data[0],
                          opf_dtype_nbytes(dt, (size_t)opf_spec_numel(&p->value.spec)));
        }
        opf_fwd_env env = {.ctx = ctx, .x = &x, .extra_in = {&sp}, .recipe = &r, .requires_grad = true};
        opf_op_ctx oc = {0};
        CHECK_OK(ctx, opf_op_forward(ops[k], &env, &oc, &y[k]));
        /* high precision saves no packs: the plain x and the parameters */
        const opf_tensor *aux[OPF_OP_MAX_AUX] = {k == 1 ? &AUX_UNSAVED : &oc.saved[2],
                                                 k == 1 ? &AUX_UNSAVED : &oc.saved[1], NULL, &oc.saved[0]};
        conform_fwd(tag, ops[k], &y[k], aux);
        CHECK(k != 1 || (!oc.saved[1].data[0] && oc.saved[2].spec.scaling == OPF_SCALING_NONE &&
                         oc.saved[2].data[0] == x.data[0]),
              "%s: high precision keeps the original input, no packs", tag);
        opf_bwd_env be = {.ctx = ctx, .dy = &dy};
        opf_op_zero_grad(ops[k]);
        set_rng(OFF0);
        CHECK_OK(ctx, opf_op_backward(ops[k], &oc, &be, &dx[k], &dsp));
        bool has[2 * G];
        for (int i = 0; i < 2 * G; i++) has[i] = true;
        conform_bwd(tag, ops[k], &dx[k], has);
        CHECK(dx[k].spec.scaling == OPF_SCALING_NONE && dx[k].spec.dtype == dt, "%s: dx is plain", tag);
        CHECK(bits_equal(&y[k], &y[0]), "%s: the forward is bitwise unchanged", tag);
    }
    CHECK(!bits_equal(&dx[1], &dx[0]) && !bits_equal(&dx[2], &dx[0]),
          "grouped override %s: the overrides change the backward", rc->name);
    snprintf(tag, sizeof tag, "grouped override %s high_precision", rc->name);
    check_grouped_plain(tag, ops[1], gsplit, G, GIN, GOUT, &x, &dy, &y[1], &dx[1], false);
    snprintf(tag, sizeof tag, "grouped override %s dequantized", rc->name);
    double *a = values(&dx[2], 0), *b = values(&dx[1], 0);
    check_fro("dx", tag, a, b, GROWS * GIN, rc->qtol_bwd);
    free(a), free(b);
    for (int i = 0; i < 2 * G; i++) {
        if (i < G && !gsplit[i]) continue;
        int64_t n = opf_spec_numel(&opf_op_param(ops[1], i)->grad.spec);
        a = values(&opf_op_param(ops[2], i)->grad, 0), b = values(&opf_op_param(ops[1], i)->grad, 0);
        check_fro(i < G ? "dW" : "db", tag, a, b, n, rc->qtol_bwd);
        free(a), free(b);
    }
    for (int k = 0; k < 3; k++) opf_tensor_release(&y[k]), opf_tensor_release(&dx[k]), opf_op_destroy(ops[k]);
    opf_tensor *t[] = {&x, &dy, &sp};
    for (int i = 0; i < 3; i++) opf_tensor_release(t[i]);
}

int main(void)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 20240611;
    if (opf_ctx_create(&o, &ctx) != OPF_OK) return 1;
    static const float scales[] = {1.0f, 0.03f, 16.0f};
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    int si = 0;
    for (int ri = 0; ri < N_RECIPES; ri++)
        for (int di = 0; di < 3; di++)
            if (recipes[ri].dtypes & DT(dts[di])) test_basic_case(&recipes[ri], dts[di], scales[si++ % 3]);
    for (int ri = 1; ri < N_RECIPES; ri++) {
        test_weight_cache(&recipes[ri]);
        test_quantized_outputs(&recipes[ri], OPF_F32);
        test_quantized_outputs(&recipes[ri], OPF_BF16);
        test_seq_pair(&recipes[ri]);
    }
    test_recast();
    test_reference_fd();
    test_basic_class();
    test_basic_errors();
    for (int ri = 0; ri < N_RECIPES; ri++) {
        bool bf = (recipes[ri].dtypes & DT(OPF_BF16)) != 0;
        test_grouped_case(&recipes[ri], bf ? OPF_BF16 : OPF_F32, ri % 2 == 0);
    }
    test_grouped_case(&recipes[0], OPF_F32, true);
    test_grouped_case(&recipes[3], OPF_F16, false);
    test_grouped_recast();
    test_grouped_errors();
    test_grouped_many();
    for (int ri = 3; ri < N_RECIPES; ri++)  /* every recipe that allows an override */
        if (recipes[ri].dtypes & DT(OPF_BF16)) test_grouped_override(&recipes[ri]);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
