/* test_norms.c: layernorm, rmsnorm and l2normalization, driven through
 * opf_op_forward / opf_op_backward: every op x dtype (f32, bf16, f16) x
 * shape (2-D, 3-D, 1-D, odd widths) x eps (1e-5 and TE's test value 0.3) x
 * zero-centred gamma x output/grad quantizer recipe (none, fp8 delayed,
 * current, block, mxfp8, nvfp4) against an FP64 reference written here from
 * numerics.md 6.1/6.2; bit-exact checks of the plain and quantized outputs
 * against an fp32 twin of the op and opf_quantize; finite differences of the
 * reference; fake-vs-real conformance; parameter init; inputs in another
 * dtype or quantized; thread-count independence; bad configs and inputs. */
#include "test.h"

#include "op/op-impl.h"

enum { K_LN, K_RMS, K_L2, K_COUNT };

typedef struct norm_kind {
    const char *cls;
    int         n_params;   /* weight (+ bias) */
    int         n_aux;      /* aux tensors, kept in saved[1..] after x in saved[0] */
    bool        quantizes;  /* y and dx follow the neighbours' quantizers */
} norm_kind;

static const norm_kind KINDS[K_COUNT] = {
    {"layernorm", 2, 2, true},
    {"rmsnorm", 1, 1, true},
    {"l2normalization", 0, 1, false},
};

enum { R_NONE, R_DELAYED, R_CURRENT, R_BLOCK, R_MXFP8, R_NVFP4, R_COUNT };
static const char *const RECIPE_NAMES[R_COUNT] = {"none", "fp8-delayed", "fp8-current",
                                                  "fp8-block", "mxfp8", "nvfp4"};

/* Delayed-scaling scales the test uses: forward E4M3 (max 448), dx E5M2. */
static const float DELAYED_SCALE_FWD = 32.0f, DELAYED_SCALE_BWD = 1024.0f;

/* ---- small helpers ------------------------------------------------------------ */

static int64_t numel_of(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

static double *dalloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }
static float *falloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

/* A plain tensor of dtype dt holding v rounded to dt. */
static opf_tensor make_tensor(opf_ctx *ctx, int ndim, const int64_t *shape, opf_dtype dt,
                              const float *v)
{
    opf_tensor t;
    opf_spec s = opf_spec_make(ndim, shape, dt);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    CHECK_OK(ctx, opf_convert(v, OPF_F32, t.data[0], dt, (size_t)numel_of(ndim, shape)));
    return t;
}

/* The values of t (plain, or one copy of a quantized tensor) as doubles. */
static void to_double(opf_ctx *ctx, const opf_tensor *t, unsigned which, double *out)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *f = falloc(n);
    if (t->spec.scaling == OPF_SCALING_NONE) {
        CHECK_OK(ctx, opf_convert(t->data[0], t->spec.dtype, f, OPF_F32, (size_t)n));
    } else {
        opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
        opf_tensor w;
        opf_tensor_wrap(&s, f, &w);
        CHECK_OK(ctx, opf_dequantize(ctx, t, which, &w));
    }
    for (int64_t i = 0; i < n; i++) out[i] = f[i];
    free(f);
}

/* t converted (rounded) to dtype dt, as a new plain tensor. */
static opf_tensor converted(opf_ctx *ctx, const opf_tensor *t, opf_dtype dt)
{
    opf_tensor o;
    opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, dt);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &o));
    CHECK_OK(ctx, opf_convert(t->data[0], t->spec.dtype, o.data[0], dt,
                              (size_t)opf_spec_numel(&t->spec)));
    return o;
}

/* Every component of a and b has the same bytes (quantized layouts do not
 * depend on the logical dtype, so a bf16 and an f32 quantized copy compare). */
static bool same_bits(const opf_tensor *a, const opf_tensor *b)
{
    opf_layout La, Lb;
    if (opf_spec_layout(&a->spec, &La) || opf_spec_layout(&b->spec, &Lb)) return false;
    if (a->spec.scaling != b->spec.scaling || (a->spec.scaling == OPF_SCALING_NONE &&
                                               a->spec.dtype != b->spec.dtype))
        return false;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (La.comp[c].present != Lb.comp[c].present || La.comp[c].nbytes != Lb.comp[c].nbytes)
            return false;
        if (La.comp[c].present && La.comp[c].nbytes &&
            memcmp(a->data[c], b->data[c], La.comp[c].nbytes))
            return false;
    }
    return true;
}

/* Elements with |got - ref| > atol + rtol |ref| (torch.testing semantics);
 * prints the first one. */
static int64_t mismatches(const char *what, const double *got, const double *ref, int64_t n,
                          double rtol, double atol, bool quiet)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs(got[i] - ref[i]);
        if (err <= atol + rtol * fabs(ref[i])) continue;
        if (!bad && !quiet)
            fprintf(stderr, "  %s[%lld]: got %.9g, ref %.9g (err %.3g, rtol %g atol %g)\n", what,
                    (long long)i, got[i], ref[i], err, rtol, atol);
        bad++;
    }
    return bad;
}

/* numerics.md 8.3's tolerance tables. */
static void dtype_tols(opf_dtype dt, double *rtol, double *atol)
{
    *atol = 1e-5;
    *rtol = dt == OPF_F32 ? 1.3e-6 : dt == OPF_BF16 ? 1.6e-2 : 1e-3;
}
static void quant_tols(opf_dtype qdt, double *rtol, double *atol)
{
    *rtol = qdt == OPF_E4M3 ? 0.125 : 0.25;
    *atol = qdt == OPF_E4M3 ? 0.0675 : 0.125;
}

static double amax_of(const double *v, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(v[i]));
    return m;
}

/* ---- FP64 reference (numerics.md 6.1, 6.2) ----------------------------------------
 * g is the effective gamma (gamma + 1 when zero-centred), b beta; both are
 * ignored by l2normalization. */

/* Per row: the normalized y and the scale rs with y = rs * (x - shift). */
static double ref_stats(int kind, const double *x, int64_t H, double eps, double *shift)
{
    double mu = 0, m2 = 0;
    for (int64_t j = 0; j < H; j++) mu += x[j];
    mu /= (double)H;
    if (kind == K_LN) {
        for (int64_t j = 0; j < H; j++) m2 += (x[j] - mu) * (x[j] - mu);
        *shift = mu;
        return 1.0 / sqrt(m2 / (double)H + eps);
    }
    for (int64_t j = 0; j < H; j++) m2 += x[j] * x[j];
    *shift = 0;
    return 1.0 / sqrt((kind == K_RMS ? m2 / (double)H : m2) + eps);
}

static void ref_fwd(int kind, const double *x, int64_t rows, int64_t H, const double *g,
                    const double *b, double eps, double *z)
{
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * H;
        double shift, rs = ref_stats(kind, xr, H, eps, &shift);
        for (int64_t j = 0; j < H; j++) {
            double y = (xr[j] - shift) * rs;
            z[r * H + j] = kind == K_LN ? g[j] * y + b[j] : kind == K_RMS ? g[j] * y : y;
        }
    }
}

/* dx for incoming dz; dg, db accumulate over rows (callers zero them). */
static void ref_bwd(int kind, const double *x, const double *dz, int64_t rows, int64_t H,
                    const double *g, double eps, double *dx, double *dg, double *db)
{
    double *y = dalloc(H), *e = dalloc(H);
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * H, *dzr = dz + r * H;
        double shift, rs = ref_stats(kind, xr, H, eps, &shift), se = 0, sey = 0;
        for (int64_t j = 0; j < H; j++) {
            y[j] = (xr[j] - shift) * rs;
            e[j] = kind == K_L2 ? dzr[j] : g[j] * dzr[j];
            se += e[j];
            sey += e[j] * y[j];
        }
        /* LN: dx = rs (e - mean e - y mean(e y)); RMS: without the mean of e;
         * L2: the sums are not divided by H. */
        double a = kind == K_LN ? se / (double)H : 0.0;
        double c = kind == K_L2 ? sey : sey / (double)H;
        for (int64_t j = 0; j < H; j++) {
            dx[r * H + j] = rs * (e[j] - a - c * y[j]);
            if (dg) dg[j] += dzr[j] * y[j];
            if (db) db[j] += dzr[j];
        }
    }
    free(y);
    free(e);
}

/* ---- finite differences of the reference ------------------------------------------ */

static double ref_loss(int kind, const double *x, int64_t rows, int64_t H, const double *g,
                       const double *b, double eps, const double *w)
{
    double *z = dalloc(rows * H), L = 0;
    ref_fwd(kind, x, rows, H, g, b, eps, z);
    for (int64_t i = 0; i < rows * H; i++) L += z[i] * w[i];
    free(z);
    return L;
}

/* Central difference of the loss in v[i]. */
static double fd_at(int kind, double *v, int64_t i, double *x, int64_t rows, int64_t H, double *g,
                    double *b, double eps, const double *w)
{
    double h = 1e-6 * fmax(1.0, fabs(v[i])), keep = v[i];
    v[i] = keep + h;
    double lp = ref_loss(kind, x, rows, H, g, b, eps, w);
    v[i] = keep - h;
    double lm = ref_loss(kind, x, rows, H, g, b, eps, w);
    v[i] = keep;
    return (lp - lm) / (2 * h);
}

static void test_fd(void)
{
    unsigned long long seed = 5;
    const int64_t rows = 3, H = 8;
    for (int kind = 0; kind < K_COUNT; kind++)
        for (int ei = 0; ei < 2; ei++) {
            double eps = ei ? 0.3 : 1e-5, x[24], w[24], g[8], b[8], dx[24], dg[8] = {0}, db[8] = {0};
            for (int i = 0; i < 24; i++) x[i] = 0.7 + opf_test_normal(&seed, 1.0f);
            for (int i = 0; i < 24; i++) w[i] = opf_test_normal(&seed, 1.0f);
            for (int j = 0; j < 8; j++) g[j] = 1.0 + opf_test_normal(&seed, 0.3f);
            for (int j = 0; j < 8; j++) b[j] = opf_test_normal(&seed, 0.5f);
            ref_bwd(kind, x, w, rows, H, g, eps, dx, dg, db);
            int bad = 0;
            for (int64_t i = 0; i < rows * H; i++) {
                double f = fd_at(kind, x, i, x, rows, H, g, b, eps, w);
                bad += fabs(f - dx[i]) > 1e-7 + 1e-7 * fabs(f);
            }
            for (int64_t j = 0; kind != K_L2 && j < H; j++) {
                double fg = fd_at(kind, g, j, x, rows, H, g, b, eps, w);
                bad += fabs(fg - dg[j]) > 1e-7 + 1e-7 * fabs(fg);
                if (kind == K_LN) {
                    double fb = fd_at(kind, b, j, x, rows, H, g, b, eps, w);
                    bad += fabs(fb - db[j]) > 1e-7 + 1e-7 * fabs(fb);
                }
            }
            CHECK(bad == 0, "%s eps %g: %d finite-difference mismatches", KINDS[kind].cls, eps, bad);
        }
}

/* ---- ops, quantizers, one run ----------------------------------------------------- */

static opf_op *make_op(opf_ctx *ctx, int kind, int64_t H, double eps, bool zc, opf_dtype dt,
                       const char *name)
{
    opf_op *op = NULL;
    if (kind == K_L2) {
        opf_l2norm_config c = {.eps = eps};
        CHECK_OK(ctx, opf_op_create(ctx, KINDS[kind].cls, &c, name, &op));
    } else {
        opf_norm_config c = {.hidden = H, .eps = eps, .zero_centered_gamma = zc, .dtype = dt};
        CHECK_OK(ctx, opf_op_create(ctx, KINDS[kind].cls, &c, name, &op));
    }
    return op;
}

static void set_param(opf_op *op, int i, const float *v)
{
    opf_param *p = opf_op_param(op, i);
    CHECK(opf_convert(v, OPF_F32, p->value.data[0], p->value.spec.dtype,
                      (size_t)opf_spec_numel(&p->value.spec)) == OPF_OK, "set %s", p->name);
}

/* Forward delayed states are E4M3; the dx one is the backward half of HYBRID (E5M2). */
static opf_delayed_state *new_state(opf_ctx *ctx, bool backward)
{
    opf_delayed_state *s = NULL;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, backward ? OPF_FORMAT_HYBRID : OPF_FORMAT_E4M3,
                                           0.0f, 8, OPF_AMAX_MAX, backward, 1, &s));
    if (s) opf_delayed_state_scale(s)[0] = backward ? DELAYED_SCALE_BWD : DELAYED_SCALE_FWD;
    return s;
}

/* The quantizer of one recipe, both copies (numerics.md 3). */
static opf_quantizer make_q(int recipe, opf_delayed_state *s)
{
    opf_quantizer q = opf_quantizer_default();
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    switch (recipe) {
    case R_DELAYED:
        q.scaling = OPF_SCALING_TENSOR;
        q.delayed = s;
        q.slot = 0;
        q.qdtype = opf_delayed_state_dtype(s);
        break;
    case R_CURRENT: q.scaling = OPF_SCALING_TENSOR; break;
    case R_BLOCK:
        q.scaling = OPF_SCALING_BLOCK_1D;
        q.pow2_scales = true;
        break;
    case R_MXFP8: q.scaling = OPF_SCALING_MXFP8; break;
    case R_NVFP4:
        q.scaling = OPF_SCALING_NVFP4_1D;
        q.qdtype = OPF_E2M1;
        break;
    default: break;
    }
    return q;
}

/* Runs the real fake on a copy of the resolved forward args with every data
 * pointer cleared, and compares with what the real forward produced. */
static void check_fake_fwd(const char *label, opf_op *op, const opf_tensor *y, const opf_op_ctx *octx,
                           const norm_kind *k)
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char args[OPF_OP_ARGS_MAX];
    memcpy(args, op->fwd_args, c->fwd_schema->size);
    opf_slot slots[16];
    int n = opf_schema_slots(c->fwd_schema, args, slots, 16);
    for (int i = 0; i < n; i++) {
        memset(slots[i].tensor->data, 0, sizeof slots[i].tensor->data);
        slots[i].tensor->buf = NULL;
    }
    opf_spec o[1 + OPF_OP_MAX_EXTRA], a[OPF_OP_MAX_AUX];
    for (int i = 0; i < 1 + OPF_OP_MAX_EXTRA; i++) o[i].ndim = OPF_SPEC_NONE_NDIM;
    for (int i = 0; i < OPF_OP_MAX_AUX; i++) a[i].ndim = OPF_SPEC_NONE_NDIM;
    CHECK(c->forward_fake(args, o, a) == OPF_OK, "%s: forward_fake: %s", label, opf_last_error(NULL));
    CHECK(opf_spec_equal(&o[0], &y->spec), "%s: fake output spec differs", label);
    CHECK(octx->n_saved == 1 + k->n_aux, "%s: %d saved", label, octx->n_saved);
    for (int i = 0; i < OPF_OP_MAX_AUX; i++) {
        if (i < k->n_aux && i + 1 < octx->n_saved)
            CHECK(opf_spec_equal(&a[i], &octx->saved[1 + i].spec), "%s: fake aux %d differs", label, i);
        else
            CHECK(a[i].ndim < 0, "%s: fake has an extra aux %d", label, i);
    }
    for (int i = 1; i < 1 + OPF_OP_MAX_EXTRA; i++) CHECK(o[i].ndim < 0, "%s: extra out %d", label, i);
}

static void check_fake_bwd(const char *label, opf_op *op, const opf_tensor *dx)
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char args[OPF_OP_ARGS_MAX];
    memcpy(args, op->bwd_args, c->bwd_schema->size);
    opf_slot slots[16];
    int n = opf_schema_slots(c->bwd_schema, args, slots, 16);
    for (int i = 0; i < n; i++) {
        memset(slots[i].tensor->data, 0, sizeof slots[i].tensor->data);
        slots[i].tensor->buf = NULL;
    }
    opf_spec g[1 + OPF_OP_MAX_PARAMS];
    for (int i = 0; i < 1 + OPF_OP_MAX_PARAMS; i++) g[i].ndim = OPF_SPEC_NONE_NDIM;
    CHECK(c->backward_fake(args, g) == OPF_OK, "%s: backward_fake: %s", label, opf_last_error(NULL));
    CHECK(opf_spec_equal(&g[0], &dx->spec), "%s: fake dx spec differs", label);
    for (int p = 0; p < opf_op_num_params(op); p++)
        CHECK(opf_spec_equal(&g[1 + p], &opf_op_param(op, p)->grad.spec), "%s: fake grad %d", label, p);
    for (int p = 1 + opf_op_num_params(op); p < 1 + OPF_OP_MAX_PARAMS; p++)
        CHECK(g[p].ndim < 0, "%s: fake has an extra grad %d", label, p);
}

typedef struct run_result {
    opf_tensor y, dx;
} run_result;

static void release_run(run_result *r)
{
    opf_tensor_release(&r->y);
    opf_tensor_release(&r->dx);
}

/* One forward and backward with fresh parameter gradients; conformance
 * checks when label is set. */
static opf_status run(opf_ctx *ctx, opf_op *op, const opf_tensor *x, const opf_tensor *dy,
                      const opf_quantizer *qf, const opf_quantizer *qb, run_result *r,
                      const char *label, const norm_kind *k)
{
    memset(r, 0, sizeof *r);
    opf_fwd_env fe = {.ctx = ctx, .x = x, .prev_grad_q = qb, .next_input_q = qf, .requires_grad = true};
    opf_op_ctx octx;
    memset(&octx, 0, sizeof octx);
    opf_op_zero_grad(op);
    opf_status st = opf_op_forward(op, &fe, &octx, &r->y);
    if (st) return st;
    if (label) check_fake_fwd(label, op, &r->y, &octx, k);
    opf_bwd_env be = {.ctx = ctx, .dy = dy};
    if ((st = opf_op_backward(op, &octx, &be, &r->dx, NULL))) {
        opf_op_ctx_clear(&octx);
        opf_tensor_release(&r->y);
        return st;
    }
    if (label) check_fake_bwd(label, op, &r->dx);
    return OPF_OK;
}

/* ---- one case ---------------------------------------------------------------------- */

typedef struct norm_case {
    int       kind;
    opf_dtype dt;
    int       ndim;
    int64_t   shape[3];
    double    eps;
    bool      zc;
    int       recipe;
    float     scale, offset;  /* x ~ offset + N(0, scale) */
} norm_case;

/* What a case holds between its steps. */
typedef struct case_data {
    const norm_case *c;
    const norm_kind *k;
    int64_t          n, H, rows;
    char             label[200];
    opf_op          *op;
    opf_tensor       x, dy;
    double          *xd, *dyd, *g, *b;  /* g: effective gamma */
    opf_delayed_state *sf, *sb;
    opf_quantizer    qf, qb;
    run_result       R;
} case_data;

/* y or dx against the FP64 reference: plain in dt, or quantized with q (both copies). */
static void check_against_ref(opf_ctx *ctx, const case_data *d, const char *what,
                              const opf_tensor *t, const double *ref, const opf_quantizer *q)
{
    double rtol, atol, *got = dalloc(d->n);
    if (!q) {
        CHECK(t->spec.scaling == OPF_SCALING_NONE && t->spec.dtype == d->c->dt, "%s %s: spec",
              d->label, what);
        dtype_tols(d->c->dt, &rtol, &atol);
        to_double(ctx, t, OPF_USAGE_ROWWISE, got);
        CHECK(mismatches(what, got, ref, d->n, rtol, atol, false) == 0, "%s %s", d->label, what);
    } else {
        CHECK(t->spec.scaling == q->scaling && t->spec.qdtype == q->qdtype &&
              t->spec.usage == q->usage && t->spec.dtype == d->c->dt, "%s %s: quantized spec",
              d->label, what);
        quant_tols(q->qdtype, &rtol, &atol);
        atol *= fmax(1.0, amax_of(ref, d->n));
        for (unsigned u = OPF_USAGE_ROWWISE; u <= OPF_USAGE_COLUMNWISE; u <<= 1) {
            if (!(t->spec.usage & u)) continue;
            to_double(ctx, t, u, got);
            CHECK(mismatches(what, got, ref, d->n, rtol, atol, false) == 0, "%s %s (%s copy)",
                  d->label, what, u == OPF_USAGE_ROWWISE ? "rowwise" : "columnwise");
        }
    }
    free(got);
}

/* Random inputs, parameters and quantizers of a case; the op itself. */
static bool case_setup(opf_ctx *ctx, case_data *d, unsigned long long *seed)
{
    const norm_case *c = d->c;
    d->k = &KINDS[c->kind];
    d->n = numel_of(c->ndim, c->shape);
    d->H = c->shape[c->ndim - 1];
    d->rows = d->n / d->H;
    int len = snprintf(d->label, sizeof d->label, "%s %s [", d->k->cls, opf_dtype_name(c->dt));
    for (int i = 0; i < c->ndim; i++)
        len += snprintf(d->label + len, sizeof d->label - (size_t)len, "%s%lld", i ? "," : "",
                        (long long)c->shape[i]);
    snprintf(d->label + len, sizeof d->label - (size_t)len, "] eps %g%s %s", c->eps,
             c->zc ? " zero-centred" : "", RECIPE_NAMES[c->recipe]);
    d->op = make_op(ctx, c->kind, d->H, c->eps, c->zc, c->dt, "norm");
    if (!d->op) return false;
    float *v = falloc(d->n > d->H ? d->n : d->H);
    d->g = dalloc(d->H);
    d->b = dalloc(d->H);
    for (int p = 0; p < d->k->n_params; p++) {
        for (int64_t j = 0; j < d->H; j++)
            v[j] = p == 0 ? (c->zc ? 0.0f : 1.0f) + opf_test_normal(seed, 0.25f)
                          : opf_test_normal(seed, 0.5f);
        set_param(d->op, p, v);
        to_double(ctx, &opf_op_param(d->op, p)->value, OPF_USAGE_ROWWISE, p == 0 ? d->g : d->b);
    }
    for (int64_t j = 0; c->zc && j < d->H; j++) d->g[j] += 1.0;
    for (int64_t i = 0; i < d->n; i++) v[i] = c->offset + opf_test_normal(seed, c->scale);
    d->x = make_tensor(ctx, c->ndim, c->shape, c->dt, v);
    for (int64_t i = 0; i < d->n; i++) v[i] = opf_test_normal(seed, 1.0f);
    d->dy = make_tensor(ctx, c->ndim, c->shape, c->dt, v);
    free(v);
    d->xd = dalloc(d->n);
    d->dyd = dalloc(d->n);
    to_double(ctx, &d->x, OPF_USAGE_ROWWISE, d->xd);
    to_double(ctx, &d->dy, OPF_USAGE_ROWWISE, d->dyd);
    if (c->recipe == R_DELAYED) {
        d->sf = new_state(ctx, false);
        d->sb = new_state(ctx, true);
    }
    d->qf = make_q(c->recipe, d->sf);
    d->qb = make_q(c->recipe, d->sb);
    return true;
}

static void case_free(case_data *d)
{
    release_run(&d->R);
    opf_tensor_release(&d->x);
    opf_tensor_release(&d->dy);
    opf_op_destroy(d->op);
    opf_delayed_state_destroy(d->sf);
    opf_delayed_state_destroy(d->sb);
    free(d->xd);
    free(d->dyd);
    free(d->g);
    free(d->b);
}

/* Forward and backward against the FP64 reference. */
static void check_reference(opf_ctx *ctx, case_data *d)
{
    const norm_case *c = d->c;
    bool quant = c->recipe != R_NONE;
    opf_status st = run(ctx, d->op, &d->x, &d->dy, quant ? &d->qf : NULL, quant ? &d->qb : NULL,
                        &d->R, d->label, d->k);
    CHECK(st == OPF_OK, "%s: %s", d->label, opf_last_error(ctx));
    if (st) return;
    double *z = dalloc(d->n), *dx = dalloc(d->n), *dg = dalloc(d->H), *db = dalloc(d->H);
    ref_fwd(c->kind, d->xd, d->rows, d->H, d->g, d->b, c->eps, z);
    ref_bwd(c->kind, d->xd, d->dyd, d->rows, d->H, d->g, c->eps, dx, dg, db);
    bool emits = quant && d->k->quantizes;
    check_against_ref(ctx, d, "y", &d->R.y, z, emits ? &d->qf : NULL);
    check_against_ref(ctx, d, "dx", &d->R.dx, dx, emits ? &d->qb : NULL);
    double rtol, atol, *got = dalloc(d->H);
    dtype_tols(c->dt, &rtol, &atol);
    for (int p = 0; p < d->k->n_params; p++) {
        const opf_param *pp = opf_op_param(d->op, p);
        CHECK(pp->has_grad, "%s: %s has no gradient", d->label, pp->name);
        to_double(ctx, &pp->grad, OPF_USAGE_ROWWISE, got);
        CHECK(mismatches(pp->name, got, p ? db : dg, d->H, rtol, atol, false) == 0, "%s d%s",
              d->label, pp->name);
    }
    free(got);
    free(z);
    free(dx);
    free(dg);
    free(db);
}

/* Quantizes src with q, or with a fresh copy of q's delayed state (same scale). */
static opf_tensor quantize_like(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *src,
                                bool backward)
{
    opf_tensor out;
    memset(&out, 0, sizeof out);
    opf_quantizer q2 = *q;
    opf_delayed_state *s = q->delayed ? new_state(ctx, backward) : NULL;
    if (s) q2.delayed = s;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q2, src, &out));
    opf_delayed_state_destroy(s);
    return out;
}

static float amax_f32(const opf_tensor *t)
{
    const float *v = t->data[0];
    float m = 0.0f;
    for (int64_t i = 0; i < opf_spec_numel(&t->spec); i++) m = fmaxf(m, fabsf(v[i]));
    return m;
}

/* The quantized y and dx equal opf_quantize of the plain output (delayed: of
 * the fp32 twin's value, numerics.md 6.1), and a delayed state saw the fp32
 * amax. T: the fp32 twin's run, P: the op's plain run. */
static void check_quantized_exact(opf_ctx *ctx, case_data *d, const run_result *T,
                                  const run_result *P)
{
    bool del = d->c->recipe == R_DELAYED;
    opf_tensor ey = quantize_like(ctx, &d->qf, del ? &T->y : &P->y, false);
    opf_tensor edx = quantize_like(ctx, &d->qb, del ? &T->dx : &P->dx, true);
    CHECK(same_bits(&d->R.y, &ey), "%s: quantized y differs from opf_quantize", d->label);
    CHECK(same_bits(&d->R.dx, &edx), "%s: quantized dx differs from opf_quantize", d->label);
    if (del) {
        float af = opf_delayed_state_history(d->sf)[0], ab = opf_delayed_state_history(d->sb)[0];
        CHECK(af == amax_f32(&T->y), "%s: delayed amax %g, fp32 y amax %g", d->label, (double)af,
              (double)amax_f32(&T->y));
        CHECK(ab == amax_f32(&T->dx), "%s: delayed dx amax %g, fp32 dx amax %g", d->label,
              (double)ab, (double)amax_f32(&T->dx));
    }
    opf_tensor_release(&ey);
    opf_tensor_release(&edx);
}

/* Bit-exact checks: the op's plain outputs and gradients equal an fp32
 * twin's rounded to the dtype (all math is fp32 on the decoded values), then
 * the quantized ones. */
static void check_exact(opf_ctx *ctx, case_data *d)
{
    const norm_case *c = d->c;
    opf_op *twin = make_op(ctx, c->kind, d->H, c->eps, c->zc, OPF_F32, "twin");
    if (!twin || !d->R.y.buf) {
        opf_op_destroy(twin);
        return;
    }
    float *v = falloc(d->H);
    for (int p = 0; p < d->k->n_params; p++) {
        const opf_param *pp = opf_op_param(d->op, p);
        opf_convert(pp->value.data[0], pp->value.spec.dtype, v, OPF_F32, (size_t)d->H);
        set_param(twin, p, v);
    }
    free(v);
    opf_tensor x32 = converted(ctx, &d->x, OPF_F32), dy32 = converted(ctx, &d->dy, OPF_F32);
    run_result T, P;
    CHECK_OK(ctx, run(ctx, twin, &x32, &dy32, NULL, NULL, &T, NULL, d->k));
    CHECK_OK(ctx, run(ctx, d->op, &d->x, &d->dy, NULL, NULL, &P, NULL, d->k));
    if (T.y.buf && P.y.buf) {
        opf_tensor ty = converted(ctx, &T.y, c->dt), tdx = converted(ctx, &T.dx, c->dt);
        CHECK(same_bits(&P.y, &ty), "%s: y differs from the fp32 twin rounded", d->label);
        CHECK(same_bits(&P.dx, &tdx), "%s: dx differs from the fp32 twin rounded", d->label);
        for (int p = 0; p < d->k->n_params; p++) {
            opf_tensor tg = converted(ctx, &opf_op_param(twin, p)->grad, c->dt);
            CHECK(same_bits(&opf_op_param(d->op, p)->grad, &tg), "%s: grad %d differs from the twin",
                  d->label, p);
            opf_tensor_release(&tg);
        }
        if (c->recipe != R_NONE && d->k->quantizes) check_quantized_exact(ctx, d, &T, &P);
        opf_tensor_release(&ty);
        opf_tensor_release(&tdx);
    }
    release_run(&T);
    release_run(&P);
    opf_tensor_release(&x32);
    opf_tensor_release(&dy32);
    opf_op_destroy(twin);
}

static void run_case(opf_ctx *ctx, const norm_case *c, unsigned long long *seed)
{
    case_data d;
    memset(&d, 0, sizeof d);
    d.c = c;
    if (case_setup(ctx, &d, seed)) {
        check_reference(ctx, &d);
        check_exact(ctx, &d);
    }
    case_free(&d);
}

typedef struct shape_row {
    int     ndim;
    int64_t shape[3];
    bool    quantizable;  /* fits every recipe's block sizes (32 rows, 128 columns) */
} shape_row;

static const shape_row SHAPES[] = {
    {3, {2, 32, 128}, true},
    {2, {32, 256}, true},
    {3, {5, 3, 40}, false},
    {1, {24}, false},
};

static void test_matrix(opf_ctx *ctx)
{
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    static const float scales[] = {1.0f, 0.5f, 3.0f}, offsets[] = {0.0f, 1.5f, -2.0f};
    unsigned long long seed = 1234;
    int i = 0;
    for (int kind = 0; kind < K_COUNT; kind++)
        for (int di = 0; di < 3; di++)
            for (size_t si = 0; si < sizeof SHAPES / sizeof SHAPES[0]; si++)
                for (int ei = 0; ei < 2; ei++)
                    for (int zc = 0; zc <= (kind != K_L2); zc++)
                        for (int r = 0; r < R_COUNT; r++) {
                            if (r && !(SHAPES[si].quantizable && KINDS[kind].quantizes)) continue;
                            const shape_row *s = &SHAPES[si];
                            norm_case c = {kind, dts[di], s->ndim, {s->shape[0], s->shape[1], s->shape[2]},
                                           ei ? 0.3 : 1e-5, zc, r, scales[i % 3], offsets[(i / 3) % 3]};
                            i++;
                            run_case(ctx, &c, &seed);
                        }
    printf("matrix: %d cases\n", i);
}

/* l2normalization leaves neighbours' quantizers alone: plain y and dx, equal
 * to a run without them. */
static void test_l2_plain_with_quantizers(opf_ctx *ctx)
{
    norm_case c = {K_L2, OPF_BF16, 2, {32, 128}, 1e-6, false, R_MXFP8, 1.0f, 0.0f};
    case_data d;
    unsigned long long seed = 99;
    memset(&d, 0, sizeof d);
    d.c = &c;
    if (case_setup(ctx, &d, &seed)) {
        run_result P;
        CHECK_OK(ctx, run(ctx, d.op, &d.x, &d.dy, &d.qf, &d.qb, &d.R, NULL, d.k));
        CHECK_OK(ctx, run(ctx, d.op, &d.x, &d.dy, NULL, NULL, &P, NULL, d.k));
        CHECK(d.R.y.buf && d.R.y.spec.scaling == OPF_SCALING_NONE && same_bits(&d.R.y, &P.y),
              "l2normalization quantized its output");
        CHECK(d.R.dx.buf && d.R.dx.spec.scaling == OPF_SCALING_NONE && same_bits(&d.R.dx, &P.dx),
              "l2normalization quantized dx");
        release_run(&P);
    }
    case_free(&d);
}

/* ---- parameters, inputs of another dtype, threads ----------------------------------- */

static void test_param_init(opf_ctx *ctx)
{
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    for (int kind = K_LN; kind <= K_RMS; kind++)
        for (int di = 0; di < 3; di++)
            for (int zc = 0; zc <= 1; zc++) {
                opf_op *op = make_op(ctx, kind, 48, 1e-5, zc, dts[di], "init");
                if (!op) continue;
                CHECK(opf_op_num_params(op) == KINDS[kind].n_params, "%s params", KINDS[kind].cls);
                double v[48];
                for (int p = 0; p < opf_op_num_params(op); p++) {
                    const opf_param *pp = opf_op_param(op, p);
                    CHECK(!strcmp(pp->name, p ? "bias" : "weight"), "param %d is %s", p, pp->name);
                    CHECK(pp->value.spec.ndim == 1 && pp->value.spec.shape[0] == 48 &&
                          pp->value.spec.dtype == dts[di], "%s param spec", KINDS[kind].cls);
                    to_double(ctx, &pp->value, OPF_USAGE_ROWWISE, v);
                    double want = p == 0 && !zc ? 1.0 : 0.0;
                    int bad = 0;
                    for (int j = 0; j < 48; j++) bad += v[j] != want;
                    CHECK(bad == 0, "%s %s zc %d: %s not all %g", KINDS[kind].cls,
                          opf_dtype_name(dts[di]), zc, pp->name, want);
                }
                opf_op_destroy(op);
            }
}

/* x of another dtype is rounded to the op's dtype first; a quantized x is
 * decoded and rounded likewise (TE casts the input to the module dtype). */
static void test_input_dtypes(opf_ctx *ctx)
{
    unsigned long long seed = 77;
    int64_t shape[2] = {32, 64};
    float v[32 * 64], dv[32 * 64];
    for (int i = 0; i < 32 * 64; i++) v[i] = 0.3f + opf_test_normal(&seed, 1.3f);
    for (int i = 0; i < 32 * 64; i++) dv[i] = opf_test_normal(&seed, 1.0f);
    opf_quantizer mx = make_q(R_MXFP8, NULL);
    for (int kind = 0; kind < K_COUNT; kind++) {
        opf_dtype op_dt = kind == K_L2 ? OPF_F32 : OPF_BF16;
        opf_op *op = make_op(ctx, kind, 64, 1e-5, false, op_dt, "mixed");
        if (!op) continue;
        opf_tensor x32 = make_tensor(ctx, 2, shape, OPF_F32, v), dy32 = make_tensor(ctx, 2, shape, OPF_F32, dv);
        run_result A, B;
        if (kind != K_L2) {  /* f32 x and dy into a bf16 op == bf16-rounded x and dy */
            opf_tensor xb = converted(ctx, &x32, OPF_BF16), dyb = converted(ctx, &dy32, OPF_BF16);
            CHECK_OK(ctx, run(ctx, op, &x32, &dy32, NULL, NULL, &A, NULL, &KINDS[kind]));
            CHECK_OK(ctx, run(ctx, op, &xb, &dyb, NULL, NULL, &B, NULL, &KINDS[kind]));
            CHECK(A.y.buf && A.y.spec.dtype == OPF_BF16 && same_bits(&A.y, &B.y),
                  "%s: f32 input not rounded to bf16", KINDS[kind].cls);
            CHECK(A.dx.buf && same_bits(&A.dx, &B.dx), "%s: f32 dy not rounded", KINDS[kind].cls);
            release_run(&A);
            release_run(&B);
            opf_tensor_release(&xb);
            opf_tensor_release(&dyb);
        }
        /* an MXFP8 x (logical bf16) == the bf16 rounding of its decoded values */
        opf_tensor xb = converted(ctx, &x32, OPF_BF16), xq, xd;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &mx, &xb, &xq));
        opf_spec ds = opf_spec_make(2, shape, OPF_BF16);
        CHECK_OK(ctx, opf_tensor_alloc(ctx, &ds, &xd));
        CHECK_OK(ctx, opf_dequantize(ctx, &xq, OPF_USAGE_ROWWISE, &xd));
        CHECK_OK(ctx, run(ctx, op, &xq, &dy32, NULL, NULL, &A, NULL, &KINDS[kind]));
        CHECK_OK(ctx, run(ctx, op, &xd, &dy32, NULL, NULL, &B, NULL, &KINDS[kind]));
        CHECK(A.y.buf && B.y.buf && same_bits(&A.y, &B.y), "%s: quantized input", KINDS[kind].cls);
        CHECK(A.dx.buf && B.dx.buf && same_bits(&A.dx, &B.dx), "%s: quantized input dx", KINDS[kind].cls);
        release_run(&A);
        release_run(&B);
        opf_tensor_release(&xb);
        opf_tensor_release(&xq);
        opf_tensor_release(&xd);
        opf_tensor_release(&x32);
        opf_tensor_release(&dy32);
        opf_op_destroy(op);
    }
}

/* Outputs and gradients do not depend on the thread count. */
static void test_threads(void)
{
    opf_ctx *c1 = NULL, *c2 = NULL;
    opf_ctx_options o = opf_ctx_options_default();
    o.num_threads = 1;
    CHECK_OK(NULL, opf_ctx_create(&o, &c1));
    o.num_threads = 2;
    CHECK_OK(NULL, opf_ctx_create(&o, &c2));
    if (!c1 || !c2) goto done;
    unsigned long long seed = 3;
    int64_t shape[2] = {64, 1024}, n = 64 * 1024;
    float *v = falloc(n), *dv = falloc(n), g[1024];
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(&seed, 2.0f);
    for (int64_t i = 0; i < n; i++) dv[i] = opf_test_normal(&seed, 1.0f);
    for (int j = 0; j < 1024; j++) g[j] = 1.0f + opf_test_normal(&seed, 0.2f);
    for (int kind = 0; kind < K_COUNT; kind++) {
        opf_ctx *cs[2] = {c1, c2};
        run_result R[2];
        opf_op *ops[2];
        for (int t = 0; t < 2; t++) {
            ops[t] = make_op(cs[t], kind, 1024, 1e-5, false, OPF_BF16, "threads");
            for (int p = 0; ops[t] && p < KINDS[kind].n_params; p++) set_param(ops[t], p, g);
            opf_tensor x = make_tensor(cs[t], 2, shape, OPF_BF16, v), dy = make_tensor(cs[t], 2, shape, OPF_BF16, dv);
            if (ops[t]) CHECK_OK(cs[t], run(cs[t], ops[t], &x, &dy, NULL, NULL, &R[t], NULL, &KINDS[kind]));
            opf_tensor_release(&x);
            opf_tensor_release(&dy);
        }
        if (ops[0] && ops[1] && R[0].y.buf && R[1].y.buf) {
            CHECK(same_bits(&R[0].y, &R[1].y) && same_bits(&R[0].dx, &R[1].dx),
                  "%s: 1 and 2 threads differ", KINDS[kind].cls);
            for (int p = 0; p < KINDS[kind].n_params; p++)
                CHECK(same_bits(&opf_op_param(ops[0], p)->grad, &opf_op_param(ops[1], p)->grad),
                      "%s: grad %d differs across threads", KINDS[kind].cls, p);
            release_run(&R[0]);
            release_run(&R[1]);
        }
        opf_op_destroy(ops[0]);
        opf_op_destroy(ops[1]);
    }
    free(v);
    free(dv);
done:
    opf_ctx_destroy(c1);
    opf_ctx_destroy(c2);
}

/* ---- bad configs and inputs ------------------------------------------------------------ */

static void test_bad_config(opf_ctx *ctx)
{
    typedef struct bad_cfg {
        int64_t     hidden;
        double      eps;
        opf_dtype   dt;
        const char *want;  /* in the message */
    } bad_cfg;
    static const bad_cfg rows[] = {
        {0, 1e-5, OPF_BF16, "hidden size 0"},   {-4, 1e-5, OPF_BF16, "hidden size -4"},
        {64, -1e-3, OPF_BF16, "eps -0.001"},    {64, NAN, OPF_BF16, "eps nan"},
        {64, INFINITY, OPF_F32, "eps inf"},     {64, 1e-5, OPF_E4M3, "dtype e4m3"},
        {64, 1e-5, OPF_I32, "dtype i32"},
    };
    for (int kind = K_LN; kind <= K_RMS; kind++)
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
            opf_norm_config c = {.hidden = rows[i].hidden, .eps = rows[i].eps, .dtype = rows[i].dt};
            opf_op *op = (opf_op *)&c;
            CHECK_FAILS(ctx, opf_op_create(ctx, KINDS[kind].cls, &c, "badcfg", &op),
                        OPF_ERR_INVALID_ARG, KINDS[kind].cls, "badcfg", rows[i].want);
            CHECK(op == NULL, "a failed create leaves *out NULL");
        }
    static const double l2_bad[] = {-1.0, NAN, INFINITY};
    static const char *const l2_want[] = {"eps -1", "eps nan", "eps inf"};
    for (int i = 0; i < 3; i++) {
        opf_l2norm_config c = {.eps = l2_bad[i]};
        opf_op *op = NULL;
        CHECK_FAILS(ctx, opf_op_create(ctx, "l2normalization", &c, "badl2", &op), OPF_ERR_INVALID_ARG,
                    "l2normalization", "badl2", l2_want[i]);
        CHECK(op == NULL, "a failed create leaves *out NULL");
    }
    opf_l2norm_config zero = {.eps = 0.0};  /* eps is taken as given: 0 is valid */
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, "l2normalization", &zero, "l2zero", &op));
    opf_op_destroy(op);
}

static bool all_zero(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return false;
    return true;
}

/* A forward that fails keeps the caller's output and context untouched. */
static void fwd_fails(opf_ctx *ctx, opf_op *op, const opf_tensor *x, const opf_quantizer *qf,
                      opf_op_ctx *octx, opf_status want, const char *s1, const char *s2)
{
    opf_fwd_env fe = {.ctx = ctx, .x = x, .next_input_q = qf, .requires_grad = true};
    opf_tensor out;
    memset(&out, 0, sizeof out);
    int n_saved = octx->n_saved;
    bool valid = octx->valid;
    CHECK_FAILS(ctx, opf_op_forward(op, &fe, octx, &out), want, opf_op_name(op), s1, s2);
    CHECK(all_zero(&out, sizeof out), "%s: failed forward wrote its output", opf_op_name(op));
    CHECK(octx->n_saved == n_saved && octx->valid == valid, "%s: failed forward changed the context",
          opf_op_name(op));
}

static void bwd_fails(opf_ctx *ctx, opf_op *op, opf_op_ctx *octx, const opf_tensor *dy,
                      opf_status want, const char *s1, const char *s2)
{
    opf_bwd_env be = {.ctx = ctx, .dy = dy};
    opf_tensor dx;
    memset(&dx, 0, sizeof dx);
    bool valid = octx->valid;
    CHECK_FAILS(ctx, opf_op_backward(op, octx, &be, &dx, NULL), want, opf_op_name(op), s1, s2);
    CHECK(all_zero(&dx, sizeof dx), "%s: failed backward wrote dx", opf_op_name(op));
    CHECK(octx->valid == valid, "%s: failed backward changed the context", opf_op_name(op));
    for (int p = 0; p < opf_op_num_params(op); p++)
        CHECK(!opf_op_param(op, p)->has_grad, "%s: failed backward wrote a gradient", opf_op_name(op));
}

/* Inputs the bad-input tests feed one op of width 128. */
typedef struct bad_fixture {
    opf_op    *op;
    opf_tensor x, narrow, big, scalar, ints, odd;  /* [4,128] [4,100] [8,128] [] i32[4,128] [5,128] */
} bad_fixture;

static bool bad_setup(opf_ctx *ctx, int kind, bad_fixture *f)
{
    unsigned long long seed = 21;
    static float v[8 * 128];
    for (int i = 0; i < 8 * 128; i++) v[i] = opf_test_normal(&seed, 1.0f);
    char name[32];
    snprintf(name, sizeof name, "bad_%s", KINDS[kind].cls);
    memset(f, 0, sizeof *f);
    f->op = make_op(ctx, kind, 128, 1e-5, false, OPF_BF16, name);
    if (!f->op) return false;
    f->x = make_tensor(ctx, 2, (int64_t[]){4, 128}, OPF_BF16, v);
    f->narrow = make_tensor(ctx, 2, (int64_t[]){4, 100}, OPF_BF16, v);
    f->big = make_tensor(ctx, 2, (int64_t[]){8, 128}, OPF_BF16, v);
    f->scalar = make_tensor(ctx, 0, (int64_t[]){1}, OPF_BF16, v);
    f->odd = make_tensor(ctx, 2, (int64_t[]){5, 128}, OPF_BF16, v);
    opf_spec is = opf_spec_make(2, (int64_t[]){4, 128}, OPF_I32);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &is, &f->ints));
    if (f->ints.data[0]) memset(f->ints.data[0], 0, 4 * 128 * 4);
    return true;
}

static void bad_free(bad_fixture *f)
{
    opf_tensor *ts[] = {&f->x, &f->narrow, &f->big, &f->scalar, &f->ints, &f->odd};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) opf_tensor_release(ts[i]);
    opf_op_destroy(f->op);
}

/* Bad inputs to a forward, with octx in whatever state the caller left it. */
static void bad_forwards(opf_ctx *ctx, int kind, bad_fixture *f, opf_op_ctx *octx)
{
    bool l2 = kind == K_L2;
    if (!l2) fwd_fails(ctx, f->op, &f->narrow, NULL, octx, OPF_ERR_SHAPE, "100 features", "128");
    fwd_fails(ctx, f->op, &f->scalar, NULL, octx, OPF_ERR_SHAPE, l2 ? "scalar" : "0 features",
              l2 ? "" : "128");
    fwd_fails(ctx, f->op, &f->ints, NULL, octx, OPF_ERR_DTYPE, "input dtype i32", "");
    opf_quantizer mx = make_q(R_MXFP8, NULL);
    if (KINDS[kind].quantizes)  /* 5 rows cannot take 32x1 blocks: the fake says so */
        fwd_fails(ctx, f->op, &f->odd, &mx, octx, OPF_ERR_SHAPE, "32", "");
}

static void test_bad_inputs_kind(opf_ctx *ctx, int kind)
{
    bad_fixture f;
    if (!bad_setup(ctx, kind, &f)) return;
    opf_op *op = f.op;
    opf_op_ctx octx;
    memset(&octx, 0, sizeof octx);
    unsigned char before[128 * 2];
    if (opf_op_num_params(op)) memcpy(before, opf_op_param(op, 0)->value.data[0], sizeof before);
    bwd_fails(ctx, op, &octx, &f.x, OPF_ERR_STATE, "backward without a forward", "");
    bad_forwards(ctx, kind, &f, &octx);
    /* after a good forward: bad forwards keep its context, bad gradients too */
    opf_fwd_env fe = {.ctx = ctx, .x = &f.x, .requires_grad = true};
    opf_tensor y, dx;
    CHECK_OK(ctx, opf_op_forward(op, &fe, &octx, &y));
    opf_tensor_release(&y);
    bad_forwards(ctx, kind, &f, &octx);
    bwd_fails(ctx, op, &octx, &f.narrow, OPF_ERR_SHAPE, "100", "128");
    bwd_fails(ctx, op, &octx, &f.big, OPF_ERR_SHAPE, "1024", "512");
    bwd_fails(ctx, op, &octx, &f.ints, OPF_ERR_DTYPE, "gradient dtype i32", "");
    opf_bwd_env be = {.ctx = ctx, .dy = &f.x};
    CHECK_OK(ctx, opf_op_backward(op, &octx, &be, &dx, NULL));
    opf_tensor_release(&dx);
    opf_op_zero_grad(op);
    bwd_fails(ctx, op, &octx, &f.x, OPF_ERR_STATE, "backward already done", "");
    fe.requires_grad = false;  /* saves nothing */
    CHECK_OK(ctx, opf_op_forward(op, &fe, &octx, &y));
    opf_tensor_release(&y);
    bwd_fails(ctx, op, &octx, &f.x, OPF_ERR_STATE, "requires_grad", "");
    opf_op_ctx forged;  /* claims to be valid but holds nothing */
    memset(&forged, 0, sizeof forged);
    forged.valid = true;
    bwd_fails(ctx, op, &forged, &f.x, OPF_ERR_STATE, "context holds 0 tensors", "");
    if (opf_op_num_params(op))
        CHECK(!memcmp(before, opf_op_param(op, 0)->value.data[0], sizeof before),
              "%s: failures changed the weight", opf_op_name(op));
    opf_op_ctx_clear(&octx);
    bad_free(&f);
}

/* The tolerance check itself must catch a wrong answer (negative control). */
static void test_negative_control(void)
{
    double ref[4] = {1.0, -2.0, 0.5, 3.0}, got[4] = {-1.0, 2.0, -0.5, -3.0};
    CHECK(mismatches("neg", got, ref, 4, 0.125, 0.0675, true) == 4, "negated values pass");
    got[0] = 1.0 + 1e-5;
    CHECK(mismatches("neg", got, ref, 1, 1.3e-6, 1e-5, true) == 0, "in-tolerance value fails");
}

int main(void)
{
    opf_ctx *ctx = NULL;
    if (opf_ctx_create(NULL, &ctx) != OPF_OK) return 1;
    test_negative_control();
    test_fd();
    test_param_init(ctx);
    test_matrix(ctx);
    test_l2_plain_with_quantizers(ctx);
    test_input_dtypes(ctx);
    test_threads();
    test_bad_config(ctx);
    for (int kind = 0; kind < K_COUNT; kind++) test_bad_inputs_kind(ctx, kind);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
