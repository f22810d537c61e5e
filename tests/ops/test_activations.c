/* test_activations.c: the activation ops (gelu ... clamped_swiglu): every op x
 * dtype (f32, bf16, f16) x output/grad quantizer recipe against an FP64
 * reference written here from numerics.md 6.3, bit-exact quantized outputs,
 * finite differences of the reference, fake-vs-real conformance, and bad
 * inputs. */
#include "test.h"

#include "op/op-impl.h"
#include "backend/cpu/act-math.h"

/* ---- FP64 reference (numerics.md 6.3, same constants) ---------------------- */

typedef struct ref_p {
    double alpha, limit;
} ref_p;

static double r_sig(double z) { return 1.0 / (1.0 + exp(-z)); }
static double r_gelu(double x, const ref_p *p)
{
    return x * (0.5 + 0.5 * tanh(x * (0.79788456 + 0.03567741 * x * x)));
}
static double r_dgelu(double x, const ref_p *p)
{
    double t = tanh(0.79788456 * x * (1.0 + 0.044715 * x * x));
    return 0.5 * x * (1.0 - t * t) * (0.79788456 + 0.1070322243 * x * x) + 0.5 * (1.0 + t);
}
static double r_swish(double x, const ref_p *p) { return x * r_sig(p->alpha * x); }
static double r_dswish(double x, const ref_p *p)
{
    double c = p->alpha * x, s = r_sig(c);
    return c * s * (1.0 - s) + s;
}
static double r_relu(double x, const ref_p *p) { return x > 0 ? x : 0.0; }
static double r_drelu(double x, const ref_p *p) { return x > 0 ? 1.0 : 0.0; }
static double r_srelu(double x, const ref_p *p) { return x > 0 ? x * x : 0.0; }
static double r_dsrelu(double x, const ref_p *p) { return x > 0 ? 2.0 * x : 0.0; }
static double r_sigf(double x, const ref_p *p) { return r_sig(x); }
static double r_dsigf(double x, const ref_p *p) { return r_sig(x) * (1.0 - r_sig(x)); }

typedef double (*ref_fn)(double, const ref_p *);

typedef struct act_case {
    const char *name;
    ref_fn      f, df;
    double      alpha;
    bool        gated, clamped;
    double      kink;  /* where f' jumps (skip in finite differences); NAN: none */
} act_case;

static const act_case cases[] = {
    {"gelu", r_gelu, r_dgelu, 0, false, false, NAN},
    {"qgelu", r_swish, r_dswish, 1.702, false, false, NAN},
    {"relu", r_relu, r_drelu, 0, false, false, 0.0},
    {"srelu", r_srelu, r_dsrelu, 0, false, false, 0.0},
    {"silu", r_swish, r_dswish, 1.0, false, false, NAN},
    {"glu", r_sigf, r_dsigf, 0, true, false, NAN},
    {"geglu", r_gelu, r_dgelu, 0, true, false, NAN},
    {"qgeglu", r_swish, r_dswish, 1.702, true, false, NAN},
    {"reglu", r_relu, r_drelu, 0, true, false, 0.0},
    {"sreglu", r_srelu, r_dsrelu, 0, true, false, 0.0},
    {"swiglu", r_swish, r_dswish, 1.0, true, false, NAN},
    {"clamped_swiglu", r_swish, r_dswish, 1.702, true, true, NAN},
};
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))

/* y of one (a, b) pair of a gated op. */
static double ref_gated_y(const act_case *c, const ref_p *p, double a, double b)
{
    if (c->clamped) {
        a = fmin(a, p->limit);
        b = fmin(fmax(b, -p->limit), p->limit) + 1.0;
    }
    return c->f(a, p) * b;
}

/* y and dx of x (n elements, rows of width w) for incoming dy. */
static void ref_act(const act_case *c, const ref_p *p, const double *x, const double *dy, int64_t n,
                    int64_t w, double *y, double *dx)
{
    if (!c->gated) {
        for (int64_t i = 0; i < n; i++) {
            y[i] = c->f(x[i], p);
            dx[i] = c->df(x[i], p) * dy[i];
        }
        return;
    }
    int64_t h = w / 2, rows = n / w;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < h; j++) {
            double a = x[r * w + j], b = x[r * w + h + j], g = dy[r * h + j];
            y[r * h + j] = ref_gated_y(c, p, a, b);
            double fa = c->f(c->clamped ? fmin(a, p->limit) : a, p);
            double dfa = c->clamped && a > p->limit ? 0.0 : c->df(a, p);
            double bb = c->clamped ? fmin(fmax(b, -p->limit), p->limit) + 1.0 : b;
            bool live = !c->clamped || fabs(b) <= p->limit;
            dx[r * w + j] = g * dfa * bb;
            dx[r * w + h + j] = live ? g * fa : 0.0;
        }
}

/* ---- the fp32 formulas, transcribed from numerics.md 6.3 and 6.3.1 -----------
 * (GELU in its sigmoid form). With exp from act-math.h (6.3.1, no C library), an f32 op must
 * reproduce these bits: this pins the constants and their grouping, which
 * tolerances alone cannot see. */

static float s32(float z) { return 1.0f / (1.0f + opf_expf_impl(-z)); }
static float f32_f(int ci, float x, float alpha)
{
    switch (ci) {
    case 0: case 6: return x / (1.0f + opf_expf_impl(-2.0f * (x * (0.79788456f + 0.03567741f * x * x))));
    case 2: case 8: return fmaxf(x, 0.0f);
    case 3: case 9: return x > 0.0f ? x * x : 0.0f;
    case 5: return s32(x);
    default: return x * s32(alpha * x);
    }
}
static float f32_df(int ci, float x, float alpha)
{
    switch (ci) {
    case 0: case 6: {
        float s = s32(2.0f * (x * (0.79788456f + 0.03567741f * (x * x))));
        return s + ((2.0f * x) * (0.79788456f + 0.1070322243f * (x * x))) * (s * (1.0f - s));
    }
    case 2: case 8: return x > 0.0f ? 1.0f : 0.0f;
    case 3: case 9: return fmaxf(2.0f * x, 0.0f);
    case 5: return s32(x) * (1.0f - s32(x));
    default: {
        float c = alpha * x, s = s32(c);
        return c * (s * (1.0f - s)) + s;
    }
    }
}

/* y and dx of case ci by the transcribed fp32 formulas; x is [rows, w]. */
static void fp32_expected(int ci, const float *x, const float *dy, int64_t rows, int64_t h,
                          float *y, float *dx)
{
    const act_case *c = &cases[ci];
    const float L = 7.0f, alpha = c->clamped ? 1.702f : (float)c->alpha;
    int64_t w = c->gated ? 2 * h : h;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < h; j++) {
            int64_t o = r * h + j;
            if (!c->gated) {
                y[o] = f32_f(ci, x[o], alpha);
                dx[o] = f32_df(ci, x[o], alpha) * dy[o];
                continue;
            }
            float a = x[r * w + j], b = x[r * w + h + j], fa, dfa, bb = b;
            bool live = true;
            if (c->clamped) {
                live = b >= -L && b <= L;
                bb = fminf(fmaxf(b, -L), L) + 1.0f;
                fa = f32_f(ci, fminf(a, L), alpha);
                dfa = a <= L ? f32_df(ci, a, alpha) : 0.0f;
            } else {
                fa = f32_f(ci, a, alpha);
                dfa = f32_df(ci, a, alpha);
            }
            y[o] = fa * bb;
            dx[r * w + j] = dfa * dy[o] * bb;
            dx[r * w + h + j] = live ? fa * dy[o] : 0.0f;
        }
}

static void test_fp32_bits(opf_ctx *ctx)
{
    unsigned long long seed = 5;
    const int64_t rows = 512, h = 96;  /* above the kernels' OpenMP threshold */
    for (int ci = 0; ci < N_CASES; ci++) {
        const act_case *c = &cases[ci];
        int64_t w = c->gated ? 2 * h : h, nx = rows * w, ny = rows * h;
        float *x = malloc(sizeof(float) * (size_t)nx), *dy = malloc(sizeof(float) * (size_t)ny);
        float *y = malloc(sizeof(float) * (size_t)ny), *dx = malloc(sizeof(float) * (size_t)nx);
        const float sig[3] = {0.2f, 1.5f, 5.0f};
        for (int64_t i = 0; i < nx; i++) x[i] = opf_test_normal(&seed, sig[i % 3]);
        for (int64_t i = 0; i < ny; i++) dy[i] = opf_test_normal(&seed, 1.0f);
        fp32_expected(ci, x, dy, rows, h, y, dx);
        opf_spec xs = opf_spec_make(2, (int64_t[]){rows, w}, OPF_F32);
        opf_spec ys = opf_spec_make(2, (int64_t[]){rows, h}, OPF_F32);
        opf_tensor xt, dyt, out[1], dxt;
        CHECK_OK(ctx, opf_tensor_wrap(&xs, x, &xt));
        CHECK_OK(ctx, opf_tensor_wrap(&ys, dy, &dyt));
        const opf_clamped_swiglu_config cfg = {.limit = 7.0, .alpha = 1.702};
        opf_op *op;
        CHECK_OK(ctx, opf_op_create(ctx, c->name, c->clamped ? &cfg : NULL, NULL, &op));
        opf_fwd_env env = {.ctx = ctx, .x = &xt, .requires_grad = true};
        opf_bwd_env benv = {.ctx = ctx, .dy = &dyt};
        opf_op_ctx octx = {0};
        CHECK_OK(ctx, opf_op_forward(op, &env, &octx, out));
        CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dxt, NULL));
        CHECK(!memcmp(out[0].data[0], y, sizeof(float) * (size_t)ny), "%s: fp32 y differs from the "
              "numerics.md 6.3 formula", c->name);
        CHECK(!memcmp(dxt.data[0], dx, sizeof(float) * (size_t)nx), "%s: fp32 dx differs from the "
              "numerics.md 6.3 formula", c->name);
        opf_tensor_release(&out[0]);
        opf_tensor_release(&dxt);
        opf_op_destroy(op);
        free(x), free(dy), free(y), free(dx);
    }
}

/* ---- finite differences of the reference ----------------------------------- */

static bool near_kink(const act_case *c, const ref_p *p, double v, double b_side, double h)
{
    if (!isnan(c->kink) && fabs(v - c->kink) < 2 * h) return true;
    if (c->clamped) return fabs(v - p->limit) < 2 * h || fabs(fabs(b_side) - p->limit) < 2 * h;
    return false;
}

static void test_fd(void)
{
    unsigned long long seed = 11;
    const double h = 1e-5;
    for (int ci = 0; ci < N_CASES; ci++) {
        const act_case *c = &cases[ci];
        ref_p p = {c->alpha, 7.0};
        int bad = 0, checked = 0;
        for (int t = 0; t < 400; t++) {
            double sig = (double[]){0.3, 1.5, 6.0}[t % 3];
            double a = opf_test_normal(&seed, (float)sig), b = opf_test_normal(&seed, (float)sig);
            double g = opf_test_normal(&seed, 1.0f);
            double x[2] = {a, b}, y[2], dx[2], dy[1] = {g};
            if (!c->gated) {
                if (near_kink(c, &p, a, 0, h)) continue;
                ref_act(c, &p, x, dy, 1, 1, y, dx);
                double fd = (c->f(a + h, &p) - c->f(a - h, &p)) / (2 * h) * g;
                bad += fabs(fd - dx[0]) > 1e-6 * (1 + fabs(dx[0]));
                checked++;
                continue;
            }
            if (near_kink(c, &p, a, b, h) || near_kink(c, &p, b, b, h)) continue;
            ref_act(c, &p, x, dy, 2, 2, y, dx);
            double fda = (ref_gated_y(c, &p, a + h, b) - ref_gated_y(c, &p, a - h, b)) / (2 * h) * g;
            double fdb = (ref_gated_y(c, &p, a, b + h) - ref_gated_y(c, &p, a, b - h)) / (2 * h) * g;
            bad += fabs(fda - dx[0]) > 1e-6 * (1 + fabs(dx[0]));
            bad += fabs(fdb - dx[1]) > 1e-6 * (1 + fabs(dx[1]));
            checked++;
        }
        CHECK(bad == 0 && checked > 300, "%s: %d of %d finite-difference mismatches", c->name, bad,
              checked);
    }
}

/* ---- recipes of the output / grad quantizers ------------------------------- */

typedef enum recipe { R_NONE, R_DELAYED, R_CURRENT, R_BLOCK, R_MXFP8, R_NVFP4, R_COUNT } recipe;
static const char *const recipe_names[R_COUNT] = {"none", "delayed", "current", "block", "mxfp8",
                                                  "nvfp4"};

/* A quantizer of recipe r. Delayed ones use state st, given a power-of-two
 * scale that fits amax (as a previous step's update would). */
static opf_quantizer make_q(recipe r, opf_delayed_state *st, double amax)
{
    opf_quantizer q = opf_quantizer_default();
    switch (r) {
    case R_DELAYED: {
        q.scaling = OPF_SCALING_TENSOR;
        q.qdtype = opf_delayed_state_dtype(st);
        q.delayed = st;
        double fmax = q.qdtype == OPF_E4M3 ? 448.0 : 57344.0;
        opf_delayed_state_scale(st)[0] = (float)exp2(floor(log2(fmax / (amax > 0 ? amax : 1.0))));
        break;
    }
    case R_CURRENT: q.scaling = OPF_SCALING_TENSOR; break;
    case R_BLOCK: q.scaling = OPF_SCALING_BLOCK_1D; q.pow2_scales = true; break;
    case R_MXFP8: q.scaling = OPF_SCALING_MXFP8; break;
    case R_NVFP4: q.scaling = OPF_SCALING_NVFP4_1D; q.qdtype = OPF_E2M1; break;
    default: break;
    }
    return q;
}

/* ---- tolerances (numerics.md 8.3) ------------------------------------------------- */

typedef struct tol {
    double rtol, atol;
} tol;

static tol dtype_tol(opf_dtype d)
{
    return d == OPF_F32 ? (tol){1.3e-6, 1e-5} : d == OPF_BF16 ? (tol){1.6e-2, 1e-5} : (tol){1e-3, 1e-5};
}

/* Quantized outputs: the element dtype's tolerances, atol scaled by amax. */
static tol quant_tol(opf_dtype qd, double amax)
{
    tol t = qd == OPF_E4M3 ? (tol){0.125, 0.0675} : (tol){0.25, 0.125};
    t.atol *= amax > 1.0 ? amax : 1.0;
    return t;
}

static double amax_of(const double *v, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(v[i]));
    return m;
}

/* Elements outside |t - r| <= atol + rtol |r|; *first gets the first one. */
static int64_t count_bad(const double *t, const double *r, int64_t n, tol T, int64_t *first)
{
    int64_t bad = 0;
    *first = -1;
    for (int64_t i = 0; i < n; i++)
        if (!(fabs(t[i] - r[i]) <= T.atol + T.rtol * fabs(r[i])) && bad++ == 0) *first = i;
    return bad;
}

/* ---- tensors ------------------------------------------------------------------- */

/* ---- fake-vs-real conformance ---------------------------------------------------- */

/* A copy of args with every tensor's memory detached (specs only). */
static void detach(const opf_schema *s, const void *args, unsigned char *copy)
{
    memcpy(copy, args, s->size);
    opf_slot slots[16];
    int n = opf_schema_slots(s, copy, slots, 16);
    for (int i = 0; i < n && i < 16; i++) {
        memset(slots[i].tensor->data, 0, sizeof slots[i].tensor->data);
        slots[i].tensor->buf = NULL;
    }
}

static void check_fwd_fake(opf_op *op, const opf_tensor *out, const char *what)
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char copy[OPF_OP_ARGS_MAX];
    detach(c->fwd_schema, op->fwd_args, copy);
    opf_spec outs[1 + OPF_OP_MAX_EXTRA], aux[OPF_OP_MAX_AUX];
    for (int i = 0; i < 1 + OPF_OP_MAX_EXTRA; i++) outs[i].ndim = OPF_SPEC_NONE_NDIM;
    for (int i = 0; i < OPF_OP_MAX_AUX; i++) aux[i].ndim = OPF_SPEC_NONE_NDIM;
    CHECK_OK(NULL, c->forward_fake(copy, outs, aux));
    char a[128], b[128];
    opf_spec_str(&outs[0], a, sizeof a);
    opf_spec_str(&out->spec, b, sizeof b);
    CHECK(opf_spec_equal(&outs[0], &out->spec), "%s: fake output %s, real %s", what, a, b);
    int n_aux = 0;
    for (int i = 0; i < OPF_OP_MAX_AUX; i++) n_aux += aux[i].ndim >= 0;
    CHECK(n_aux == 0 && outs[1].ndim < 0, "%s: fake made %d aux specs", what, n_aux);
}

static void check_bwd_fake(opf_op *op, const opf_tensor *dx, const char *what)
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char copy[OPF_OP_ARGS_MAX];
    detach(c->bwd_schema, op->bwd_args, copy);
    opf_spec g[1 + OPF_OP_MAX_PARAMS + OPF_OP_MAX_EXTRA];
    for (int i = 0; i < 1 + OPF_OP_MAX_PARAMS + OPF_OP_MAX_EXTRA; i++) g[i].ndim = OPF_SPEC_NONE_NDIM;
    CHECK_OK(NULL, c->backward_fake(copy, g));
    char a[128], b[128];
    opf_spec_str(&g[0], a, sizeof a);
    opf_spec_str(&dx->spec, b, sizeof b);
    CHECK(opf_spec_equal(&g[0], &dx->spec), "%s: fake dx %s, real %s", what, a, b);
}

/* ---- one op x dtype x recipe ------------------------------------------------------- */

typedef struct shape {
    int     ndim;
    int64_t s[3];  /* the output's shape; a gated input doubles the last dim */
} shape;
static const shape plain_shapes[] = {{1, {7}}, {3, {3, 5, 10}}, {3, {2, 32, 64}}};
static const shape quant_shapes[] = {{3, {2, 32, 64}}, {2, {64, 96}}};

/* Normal values with the scale cycling over `sig` per element. */
static void fill(unsigned long long *seed, double *v, int64_t n, const float *sig, int nsig)
{
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(seed, sig[i % nsig]);
}

typedef struct run_data {
    int64_t nx, ny, w;        /* elements of x and y, x's last dim */
    int     ndim;
    int64_t xs[3], ys[3];
    double *xv, *dyv, *xr, *dyr, *yref, *dxref, *got;
} run_data;

static void run_data_init(run_data *d, const act_case *c, const shape *sh)
{
    d->ndim = sh->ndim;
    d->ny = d->nx = 1;
    for (int i = 0; i < sh->ndim; i++) {
        d->ys[i] = d->xs[i] = sh->s[i];
        if (i == sh->ndim - 1 && c->gated) d->xs[i] *= 2;
        d->nx *= d->xs[i];
        d->ny *= d->ys[i];
    }
    d->w = d->xs[sh->ndim - 1];
    double **bufs[] = {&d->xv, &d->xr, &d->dxref, &d->got, &d->dyv, &d->dyr, &d->yref};
    for (int i = 0; i < 7; i++) *bufs[i] = calloc((size_t)(i < 4 ? d->nx : d->ny), sizeof(double));
}

static void run_data_free(run_data *d)
{
    double *bufs[] = {d->xv, d->xr, d->dxref, d->got, d->dyv, d->dyr, d->yref};
    for (int i = 0; i < 7; i++) free(bufs[i]);
}

static opf_status create_op(opf_ctx *ctx, const act_case *c, const opf_clamped_swiglu_config *cfg,
                            opf_op **op)
{
    return opf_op_create(ctx, c->name, c->clamped ? (const void *)cfg : NULL, "act", op);
}

/* The quantized results equal quantizing the op's own plain results (the
 * values the store rule quantizes: fp32 for delayed, else rounded to dt). */
static void check_bit_exact(opf_ctx *ctx, const act_case *c, const opf_clamped_swiglu_config *cfg,
                            opf_dtype dt, recipe r, const run_data *d, const opf_quantizer *fq,
                            const opf_quantizer *gq, const opf_tensor *y, const opf_tensor *dx,
                            const char *what)
{
    opf_dtype tdt = r == R_DELAYED ? OPF_F32 : dt;
    opf_tensor xt = opf_test_make_tensor(ctx, d->ndim, d->xs, tdt, d->xr, NULL);
    opf_tensor dyt = opf_test_make_tensor(ctx, d->ndim, d->ys, tdt, d->dyr, NULL);
    opf_op *op;
    CHECK_OK(ctx, create_op(ctx, c, cfg, &op));
    opf_fwd_env env = {.ctx = ctx, .x = &xt, .requires_grad = true};
    opf_bwd_env benv = {.ctx = ctx, .dy = &dyt};
    opf_op_ctx octx = {0};
    opf_tensor yp[1], dxp, eq, ed;
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, yp));
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dxp, NULL));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, fq, &yp[0], &eq));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, gq, &dxp, &ed));
    CHECK(opf_test_same_qbytes(y, &eq), "%s: quantized output differs from quantizing the plain output", what);
    CHECK(opf_test_same_qbytes(dx, &ed), "%s: quantized dx differs from quantizing the plain dx", what);
    opf_tensor *ts[] = {&xt, &dyt, &yp[0], &dxp, &eq, &ed};
    for (int i = 0; i < 6; i++) opf_tensor_release(ts[i]);
    opf_op_destroy(op);
}

static void compare(opf_ctx *ctx, const opf_tensor *t, const double *ref, int64_t n, opf_dtype dt,
                    const opf_quantizer *q, double *got, const char *what, const char *which)
{
    opf_test_decode(ctx, t, got);
    tol T = q->scaling == OPF_SCALING_NONE ? dtype_tol(dt) : quant_tol(q->qdtype, amax_of(ref, n));
    int64_t first, bad = count_bad(got, ref, n, T, &first);
    CHECK(bad == 0, "%s: %s: %lld of %lld outside rtol %g atol %g (first [%lld] %.9g vs %.9g)", what,
          which, (long long)bad, (long long)n, T.rtol, T.atol, (long long)first,
          first >= 0 ? got[first] : 0.0, first >= 0 ? ref[first] : 0.0);
}

static void run_case(opf_ctx *ctx, const act_case *c, const opf_clamped_swiglu_config *cfg,
                     opf_dtype dt, recipe r, const shape *sh, unsigned long long *seed)
{
    char what[96];
    snprintf(what, sizeof what, "%s %s %s [%lld..%lld]", c->name, opf_dtype_name(dt),
             recipe_names[r], (long long)sh->s[0], (long long)sh->s[sh->ndim - 1]);
    ref_p p = {c->clamped ? cfg->alpha : c->alpha, c->clamped ? cfg->limit : 0.0};
    run_data d;
    run_data_init(&d, c, sh);
    fill(seed, d.xv, d.nx, (const float[]){0.3f, 1.5f, 6.0f}, 3);
    fill(seed, d.dyv, d.ny, (const float[]){0.5f, 2.0f}, 2);
    opf_tensor x = opf_test_make_tensor(ctx, d.ndim, d.xs, dt, d.xv, d.xr);
    opf_tensor dy = opf_test_make_tensor(ctx, d.ndim, d.ys, dt, d.dyv, d.dyr);
    ref_act(c, &p, d.xr, d.dyr, d.nx, d.w, d.yref, d.dxref);

    opf_delayed_state *fs = NULL, *bs = NULL;
    /* HYBRID: E4M3 for the output, E5M2 for dx. */
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0, 8, OPF_AMAX_MAX, false, 1, &fs));
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0, 8, OPF_AMAX_MAX, true, 1, &bs));
    opf_quantizer fq = make_q(r, fs, amax_of(d.yref, d.ny)), gq = make_q(r, bs, amax_of(d.dxref, d.nx));
    opf_op *op;
    CHECK_OK(ctx, create_op(ctx, c, cfg, &op));
    opf_fwd_env env = {.ctx = ctx, .x = &x, .prev_grad_q = r ? &gq : NULL,
                       .next_input_q = r ? &fq : NULL, .requires_grad = true};
    opf_op_ctx octx = {0};
    opf_tensor y[1], dx = {0};
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, y));
    check_fwd_fake(op, &y[0], what);
    CHECK(y[0].spec.scaling == fq.scaling && y[0].spec.dtype == dt, "%s: output is %s", what,
          opf_scaling_name(y[0].spec.scaling));
    compare(ctx, &y[0], d.yref, d.ny, dt, &fq, d.got, what, "y");
    /* The op keeps its own reference to x: the caller's may go. */
    opf_tensor_release(&x);
    opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, NULL));
    check_bwd_fake(op, &dx, what);
    CHECK(dx.spec.scaling == gq.scaling && dx.spec.dtype == dt && dx.spec.ndim == d.ndim &&
              dx.spec.shape[d.ndim - 1] == d.w, "%s: dx is %s", what, opf_scaling_name(dx.spec.scaling));
    compare(ctx, &dx, d.dxref, d.nx, dt, &gq, d.got, what, "dx");
    if (r != R_NONE) check_bit_exact(ctx, c, cfg, dt, r, &d, &fq, &gq, &y[0], &dx, what);
    opf_tensor_release(&y[0]);
    opf_tensor_release(&dx);
    opf_tensor_release(&dy);
    opf_op_destroy(op);
    opf_delayed_state_destroy(fs);
    opf_delayed_state_destroy(bs);
    run_data_free(&d);
}

static void test_matrix(opf_ctx *ctx)
{
    unsigned long long seed = 2024;
    const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    const opf_clamped_swiglu_config cfg = {.limit = 7.0, .alpha = 1.702};
    int k = 0;
    for (int ci = 0; ci < N_CASES; ci++)
        for (int di = 0; di < 3; di++)
            for (int r = 0; r < R_COUNT; r++, k++) {
                const shape *sh = r == R_NONE ? &plain_shapes[k % 3] : &quant_shapes[k % 2];
                run_case(ctx, &cases[ci], &cfg, dts[di], (recipe)r, sh, &seed);
            }
    /* ClampedSwiGLU with its own limit and alpha (config values reach the math). */
    const opf_clamped_swiglu_config cfg2 = {.limit = 2.5, .alpha = 1.0};
    for (int di = 0; di < 3; di++)
        run_case(ctx, &cases[N_CASES - 1], &cfg2, dts[di], R_NONE, &plain_shapes[2], &seed);
    run_case(ctx, &cases[N_CASES - 1], &cfg2, OPF_BF16, R_MXFP8, &quant_shapes[0], &seed);
}

/* A quantized input is decoded; the results follow its dequantized values. */
static void test_quantized_input(opf_ctx *ctx)
{
    unsigned long long seed = 77;
    for (int ci = 0; ci < N_CASES; ci += 5) {
        const act_case *c = &cases[ci];
        const opf_clamped_swiglu_config cfg = {.limit = 7.0, .alpha = 1.702};
        const shape sh = {2, {32, 64}};
        run_data d;
        run_data_init(&d, c, &sh);
        fill(&seed, d.xv, d.nx, (const float[]){0.5f, 3.0f}, 2);
        fill(&seed, d.dyv, d.ny, (const float[]){1.0f}, 1);
        opf_tensor x = opf_test_make_tensor(ctx, d.ndim, d.xs, OPF_BF16, d.xv, NULL), xq, y[1], dx;
        opf_tensor dy = opf_test_make_tensor(ctx, d.ndim, d.ys, OPF_BF16, d.dyv, d.dyr);
        opf_quantizer q = make_q(R_CURRENT, NULL, 0);
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));
        opf_test_decode(ctx, &xq, d.xr);
        ref_p p = {c->clamped ? cfg.alpha : c->alpha, cfg.limit};
        ref_act(c, &p, d.xr, d.dyr, d.nx, d.w, d.yref, d.dxref);
        opf_op *op;
        CHECK_OK(ctx, create_op(ctx, c, &cfg, &op));
        opf_fwd_env env = {.ctx = ctx, .x = &xq, .requires_grad = true};
        opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
        opf_op_ctx octx = {0};
        char what[64];
        snprintf(what, sizeof what, "%s fp8 input", c->name);
        CHECK_OK(ctx, opf_op_forward(op, &env, &octx, y));
        check_fwd_fake(op, &y[0], what);
        opf_quantizer none = opf_quantizer_default();
        compare(ctx, &y[0], d.yref, d.ny, OPF_BF16, &none, d.got, what, "y");
        CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, NULL));
        check_bwd_fake(op, &dx, what);
        CHECK(dx.spec.scaling == OPF_SCALING_NONE && dx.spec.dtype == OPF_BF16, "%s: dx plain bf16",
              what);
        compare(ctx, &dx, d.dxref, d.nx, OPF_BF16, &none, d.got, what, "dx");
        opf_tensor *ts[] = {&x, &xq, &y[0], &dx, &dy};
        for (int i = 0; i < 5; i++) opf_tensor_release(ts[i]);
        opf_op_destroy(op);
        run_data_free(&d);
    }
}

/* ---- bad inputs ------------------------------------------------------------------------ */

static opf_tensor plain(opf_ctx *ctx, int ndim, const int64_t *shape, opf_dtype dt)
{
    opf_spec s = opf_spec_make(ndim, shape, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    opf_layout L;
    opf_spec_layout(&s, &L);
    unsigned char *p = t.data[0];
    for (size_t i = 0; i < L.comp[0].nbytes; i++) p[i] = (unsigned char)(i * 37 % 61);
    return t;
}

/* Forward fails with want and the message parts, leaving outs and a valid
 * saved context of an earlier call as they were. */
#define CHECK_FWD_FAILS(ctx, op, env, octx, want, ...)                                     \
    do {                                                                                     \
        opf_tensor out_[2], keep_[2];                                                        \
        memset(out_, 0x5A, sizeof out_);                                                     \
        memcpy(keep_, out_, sizeof out_);                                                    \
        opf_op_ctx before_ = *(octx);                                                        \
        CHECK_FAILS(ctx, opf_op_forward(op, env, octx, out_), want, __VA_ARGS__);            \
        CHECK(!memcmp(out_, keep_, sizeof out_), "outputs touched by a failed forward");     \
        CHECK(!memcmp(&before_, (octx), sizeof before_), "context touched by a failed forward"); \
    } while (0)

static void test_bad_shapes_dtypes(opf_ctx *ctx)
{
    opf_op_ctx octx = {0};
    for (int ci = 0; ci < N_CASES; ci++) {
        const act_case *c = &cases[ci];
        const opf_clamped_swiglu_config cfg = {.limit = 7.0, .alpha = 1.702};
        opf_op *op;
        CHECK_OK(ctx, opf_op_create(ctx, c->name, c->clamped ? &cfg : NULL, "bad", &op));
        opf_tensor x = plain(ctx, 2, (int64_t[]){4, 63}, OPF_F32);
        opf_tensor x8 = plain(ctx, 2, (int64_t[]){4, 8}, OPF_E4M3);
        opf_tensor xi = plain(ctx, 2, (int64_t[]){4, 8}, OPF_I32);
        opf_tensor x0 = plain(ctx, 0, NULL, OPF_F32);
        opf_fwd_env env = {.ctx = ctx, .requires_grad = true};
        if (c->gated) {
            env.x = &x;
            CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_SHAPE, c->name, "\"bad\"", "63", "even");
        }
        env.x = &x8;
        CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_DTYPE, c->name, "\"bad\"", "e4m3");
        env.x = &xi;
        CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_DTYPE, c->name, "i32");
        env.x = &x0;
        CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_SHAPE, c->name, "ndim 0");
        /* An output the next op's quantizer cannot lay out. */
        opf_tensor xs = plain(ctx, 2, (int64_t[]){3, 20}, OPF_BF16);
        opf_quantizer mx = make_q(R_MXFP8, NULL, 0);
        env.x = &xs;
        env.next_input_q = &mx;
        CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_SHAPE, "bad", "mxfp8", "multiples of 32");
        opf_tensor *ts[] = {&x, &x8, &xi, &x0, &xs};
        for (int i = 0; i < 5; i++) opf_tensor_release(ts[i]);
        opf_op_destroy(op);
    }
}

static void test_bad_config(opf_ctx *ctx)
{
    const struct { double limit, alpha; const char *part; } bad[] = {
        {0.0, 1.702, "limit 0"}, {-1.0, 1.702, "limit -1"}, {NAN, 1.702, "limit nan"},
        {INFINITY, 1.702, "limit inf"}, {1e300, 1.702, "limit 1e+300"},
        {7.0, NAN, "alpha nan"}, {7.0, -INFINITY, "alpha -inf"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        opf_clamped_swiglu_config cfg = {.limit = bad[i].limit, .alpha = bad[i].alpha};
        opf_op *op = (opf_op *)&cfg;
        CHECK_FAILS(ctx, opf_op_create(ctx, "clamped_swiglu", &cfg, "cs", &op), OPF_ERR_INVALID_ARG,
                    "clamped_swiglu", "\"cs\"", bad[i].part);
        CHECK(op == NULL, "op not cleared on a failed create (%s)", bad[i].part);
    }
    opf_op *op;
    CHECK_FAILS(ctx, opf_op_create(ctx, "clamped_swiglu", NULL, "cs", &op), OPF_ERR_INVALID_ARG,
                "clamped_swiglu", "config");
}

/* Backward out of order, or with a gradient of the wrong shape or dtype. */
static void test_bad_backward(opf_ctx *ctx)
{
    for (int ci = 0; ci < N_CASES; ci++) {
        const act_case *c = &cases[ci];
        const opf_clamped_swiglu_config cfg = {.limit = 7.0, .alpha = 1.702};
        opf_op *op;
        CHECK_OK(ctx, opf_op_create(ctx, c->name, c->clamped ? &cfg : NULL, "bb", &op));
        int64_t w = c->gated ? 32 : 16;
        opf_tensor x = plain(ctx, 2, (int64_t[]){4, w}, OPF_F32);
        opf_tensor dy = plain(ctx, 2, (int64_t[]){4, 16}, OPF_F32);
        opf_tensor dyw = plain(ctx, 2, (int64_t[]){4, 15}, OPF_F32);
        opf_tensor dyi = plain(ctx, 2, (int64_t[]){4, 16}, OPF_I32);
        opf_tensor odd = plain(ctx, 2, (int64_t[]){4, 33}, OPF_F32);
        opf_fwd_env env = {.ctx = ctx, .x = &x, .requires_grad = true};
        opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
        opf_op_ctx octx = {0};
        opf_tensor y[1], dx = {0}, dx2 = {0};
        CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx, NULL), OPF_ERR_STATE, "bb", "forward");
        env.requires_grad = false;
        CHECK_OK(ctx, opf_op_forward(op, &env, &octx, y));
        opf_tensor_release(&y[0]);
        CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx, NULL), OPF_ERR_STATE, "bb");
        env.requires_grad = true;
        CHECK_OK(ctx, opf_op_forward(op, &env, &octx, y));
        if (c->gated) { /* a failed forward keeps the saved context of the good one */
            env.x = &odd;
            CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_SHAPE, "33");
        }
        benv.dy = &dyw;
        CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx, NULL), OPF_ERR_SHAPE, c->name, "\"bb\"",
                    "[4,15]", "[4,16]");
        benv.dy = &dyi;
        CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx, NULL), OPF_ERR_DTYPE, c->name, "i32");
        CHECK(octx.valid && dx.data[0] == NULL, "%s: a failed backward consumed the context", c->name);
        benv.dy = &dy;
        CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, NULL));
        CHECK(dx.spec.shape[1] == w, "%s: dx has %lld features", c->name, (long long)dx.spec.shape[1]);
        CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx2, NULL), OPF_ERR_STATE, "bb", "already");
        opf_tensor *ts[] = {&x, &dy, &dyw, &dyi, &odd, &y[0], &dx};
        for (int i = 0; i < 7; i++) opf_tensor_release(ts[i]);
        opf_op_destroy(op);
    }
}

/* Every activation is registered, with the shared schemas and no params. */
static void test_registry(opf_ctx *ctx)
{
    for (int ci = 0; ci < N_CASES; ci++) {
        const opf_op_class *c = opf_op_class_find(cases[ci].name);
        CHECK(c && !strcmp(c->name, cases[ci].name) && c->fusible && c->forward_fake &&
                  c->backward_fake && c->n_extra_in == 0 && c->n_extra_out == 0,
              "%s: class missing or incomplete", cases[ci].name);
    }
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx) != OPF_OK) return 1;
    test_registry(ctx);
    test_fd();
    test_fp32_bits(ctx);
    test_matrix(ctx);
    test_quantized_input(ctx);
    test_bad_shapes_dtypes(ctx);
    test_bad_config(ctx);
    test_bad_backward(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
