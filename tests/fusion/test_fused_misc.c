/* test_fused_misc.c: the basic op scaled_swiglu and the fused ops
 * backward_activation_bias, backward_add_rmsnorm, backward_add_layernorm and
 * grouped_mlp.
 *
 * scaled_swiglu: forward, dx and d(scales) against an FP64 reference (with
 * finite differences of that reference), quantized outputs bit-exact to
 * quantizing the plain ones, fake-vs-real conformance, bad inputs.
 * Fusions: each plan holds the fused op exactly when its conditions hold;
 * results match the same seq with fusions off, bit for bit where the kernels
 * are the same and within numerics.md 8.3 otherwise; dbias of the activation
 * fusion and dx of the RMSNorm fusion are also checked bit for bit against
 * their one-rounding definitions; grouped_mlp is one object in both plans
 * and declines where the recipe or the shapes rule it out. */
#include "test.h"

#include "op/op-impl.h"
#include "backend/cpu/act-math.h"
#include "ops/fused/grouped_mlp.h"

/* ---- shared helpers ------------------------------------------------------------- */

typedef struct tol {
    double rtol, atol;
} tol;

static tol dtype_tol(opf_dtype d)
{
    return d == OPF_F32 ? (tol){1.3e-6, 1e-5} : d == OPF_BF16 ? (tol){1.6e-2, 1e-5} : (tol){1e-3, 1e-5};
}

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

static opf_op *mk(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

static void fill(unsigned long long *seed, double *v, int64_t n, float sigma)
{
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(seed, sigma * (i % 3 == 2 ? 3.0f : 1.0f));
}

/* Elements outside |t - r| <= atol + rtol |r| (the first one in *first). */
static int64_t count_bad(const double *t, const double *r, int64_t n, tol T, int64_t *first)
{
    int64_t bad = 0;
    *first = -1;
    for (int64_t i = 0; i < n; i++)
        if (!(fabs(t[i] - r[i]) <= T.atol + T.rtol * fabs(r[i])) && bad++ == 0) *first = i;
    return bad;
}

static void check_close(const double *got, const double *ref, int64_t n, tol T, const char *what,
                        const char *which)
{
    int64_t first, bad = count_bad(got, ref, n, T, &first);
    CHECK(bad == 0, "%s: %s: %lld of %lld outside rtol %g atol %g (first [%lld] %.9g vs %.9g)", what,
          which, (long long)bad, (long long)n, T.rtol, T.atol, (long long)first,
          first >= 0 ? got[first] : 0.0, first >= 0 ? ref[first] : 0.0);
}

/* Two tensors' decoded values within T of each other (b is the reference). */
static void check_tensors_close(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b, tol T,
                                const char *what, const char *which)
{
    int64_t n = opf_spec_numel(&a->spec);
    CHECK(n == opf_spec_numel(&b->spec), "%s: %s: %lld vs %lld elements", what, which, (long long)n,
          (long long)opf_spec_numel(&b->spec));
    if (n != opf_spec_numel(&b->spec)) return;
    double *va = malloc(sizeof(double) * (size_t)(n + 1)), *vb = malloc(sizeof(double) * (size_t)(n + 1));
    opf_test_decode(ctx, a, va);
    opf_test_decode(ctx, b, vb);
    check_close(va, vb, n, T, what, which);
    free(va);
    free(vb);
}

/* Recipes of the quantizers a test hands an op directly. */
typedef enum recipe { R_NONE, R_DELAYED, R_CURRENT, R_BLOCK, R_MXFP8, R_NVFP4, R_COUNT } recipe;
static const char *const recipe_names[R_COUNT] = {"none", "delayed", "current", "block", "mxfp8",
                                                  "nvfp4"};
static const opf_recipe_kind recipe_kinds[R_COUNT] = {
    OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT, OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8,
    OPF_RECIPE_NVFP4};

/* A quantizer of recipe r; a delayed one uses st with a power-of-two scale
 * that fits amax, as a previous step's update would leave it. */
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

/* A copy of args with every tensor's memory detached (specs only). */
static void detach(const opf_schema *s, const void *args, unsigned char *copy)
{
    memcpy(copy, args, s->size);
    opf_slot slots[32];
    int n = opf_schema_slots(s, copy, slots, 32);
    for (int i = 0; i < n && i < 32; i++) {
        memset(slots[i].tensor->data, 0, sizeof slots[i].tensor->data);
        slots[i].tensor->buf = NULL;
    }
}

static void none_specs(opf_spec *s, int n)
{
    for (int i = 0; i < n; i++) s[i].ndim = OPF_SPEC_NONE_NDIM;
}

static bool plan_has(opf_seq *seq, bool bwd, const char *cls, int first, int count, opf_op **op)
{
    opf_plan_entry e[16];
    int n = opf_seq_plan(seq, 0, bwd, e, 16);
    for (int i = 0; i < n && i < 16; i++)
        if (!strcmp(opf_op_class_of(e[i].op)->name, cls) && e[i].first == first && e[i].count == count) {
            if (op) *op = e[i].op;
            return true;
        }
    return false;
}

static int plan_len(opf_seq *seq, bool bwd)
{
    opf_plan_entry e[16];
    return opf_seq_plan(seq, 0, bwd, e, 16);
}

static bool class_in_plan(opf_seq *seq, bool bwd, const char *cls)
{
    opf_plan_entry e[16];
    int n = opf_seq_plan(seq, 0, bwd, e, 16);
    for (int i = 0; i < n && i < 16; i++)
        if (!strcmp(opf_op_class_of(e[i].op)->name, cls)) return true;
    return false;
}

/* ==== scaled_swiglu ==================================================================== */

/* FP64 reference (numerics.md 6.3: SwiGLU activates the first half). */
static double r_sig(double z) { return 1.0 / (1.0 + exp(-z)); }
static double r_silu(double a) { return a * r_sig(a); }
static double r_dsilu(double a) { return a * (r_sig(a) * (1.0 - r_sig(a))) + r_sig(a); }

static void ssg_ref(const double *x, const double *s, const double *dy, int64_t rows, int64_t h,
                    double *y, double *dx, double *ds, double *ds_abs)
{
    for (int64_t r = 0; r < rows; r++) {
        double acc = 0, mag = 0;
        for (int64_t j = 0; j < h; j++) {
            double a = x[r * 2 * h + j], b = x[r * 2 * h + h + j], g = dy ? dy[r * h + j] * s[r] : 0;
            y[r * h + j] = r_silu(a) * b * s[r];
            if (!dy) continue;
            dx[r * 2 * h + j] = r_dsilu(a) * g * b;
            dx[r * 2 * h + h + j] = r_silu(a) * g;
            acc += r_silu(a) * b * dy[r * h + j];
            mag += fabs(r_silu(a) * b * dy[r * h + j]);
        }
        if (dy) ds[r] = acc, ds_abs[r] = mag;
    }
}

/* Central differences of the reference's L = sum(y * w) against its gradients. */
static void test_ssg_fd(void)
{
    enum { R = 3, H = 4 };
    unsigned long long seed = 77;
    double x[R * 2 * H], s[R], w[R * H], y[R * H], dx[R * 2 * H], ds[R], mag[R], yp[R * H], ym[R * H];
    fill(&seed, x, R * 2 * H, 1.2f);
    fill(&seed, s, R, 1.0f);
    fill(&seed, w, R * H, 1.0f);
    ssg_ref(x, s, w, R, H, y, dx, ds, mag);
    const double eps = 1e-6;
    int bad = 0;
    for (int i = 0; i < R * 2 * H + R; i++) {
        double *v = i < R * 2 * H ? &x[i] : &s[i - R * 2 * H], keep = *v, lp = 0, lm = 0;
        *v = keep + eps;
        ssg_ref(x, s, NULL, R, H, yp, NULL, NULL, NULL);
        *v = keep - eps;
        ssg_ref(x, s, NULL, R, H, ym, NULL, NULL, NULL);
        *v = keep;
        for (int k = 0; k < R * H; k++) lp += yp[k] * w[k], lm += ym[k] * w[k];
        double fd = (lp - lm) / (2 * eps), an = i < R * 2 * H ? dx[i] : ds[i - R * 2 * H];
        bad += !(fabs(fd - an) <= 1e-6 + 1e-6 * fabs(an));
    }
    CHECK(bad == 0, "scaled_swiglu reference: %d gradients disagree with finite differences", bad);
}

typedef struct ssg_shape {
    int     ndim;
    int64_t s[3];      /* the input's shape */
    int     s_ndim;    /* scales: 1 = [rows], else x's leading shape */
} ssg_shape;

/* The op's own plain outputs, quantized with its quantizers, equal its
 * quantized outputs (delayed scaling casts the fp32 values: run in f32). */
static void ssg_bit_exact(opf_ctx *ctx, recipe r, opf_dtype dt, const ssg_shape *sh, const double *xr,
                          const double *dyr, const opf_tensor *sc, const opf_quantizer *fq,
                          const opf_quantizer *gq, const opf_tensor *y, const opf_tensor *dx,
                          const char *what)
{
    opf_dtype tdt = r == R_DELAYED ? OPF_F32 : dt;
    int64_t ys[3];
    memcpy(ys, sh->s, sizeof ys);
    ys[sh->ndim - 1] /= 2;
    opf_tensor xt = opf_test_make_tensor(ctx, sh->ndim, sh->s, tdt, xr, NULL);
    opf_tensor dyt = opf_test_make_tensor(ctx, sh->ndim, ys, tdt, dyr, NULL);
    opf_op *op = mk(ctx, "scaled_swiglu", NULL, "ssg_plain");
    opf_fwd_env env = {.ctx = ctx, .x = &xt, .extra_in = {sc}, .requires_grad = true};
    opf_bwd_env benv = {.ctx = ctx, .dy = &dyt};
    opf_op_ctx octx = {0};
    opf_tensor yp[1], dxp, ds[1], eq, ed;
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, yp));
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dxp, ds));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, fq, &yp[0], &eq));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, gq, &dxp, &ed));
    CHECK(opf_test_same_qbytes(y, &eq), "%s: quantized y differs from quantizing the plain y", what);
    CHECK(opf_test_same_qbytes(dx, &ed), "%s: quantized dx differs from quantizing the plain dx", what);
    opf_tensor *ts[] = {&xt, &dyt, &yp[0], &dxp, &ds[0], &eq, &ed};
    for (int i = 0; i < 7; i++) opf_tensor_release(ts[i]);
    opf_op_destroy(op);
}

static void ssg_check_fakes(opf_op *op, const opf_tensor *y, const opf_tensor *dx,
                            const opf_tensor *ds, const char *what)
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char copy[OPF_OP_ARGS_MAX];
    detach(c->bwd_schema, op->bwd_args, copy);
    opf_spec g[4];
    none_specs(g, 4);
    CHECK_OK(NULL, c->backward_fake(copy, g));
    CHECK(opf_spec_equal(&g[0], &dx->spec) && opf_spec_equal(&g[1], &ds->spec) && g[2].ndim < 0,
          "%s: backward fake differs from the real gradients", what);
    (void)y;
}

static void ssg_case(opf_ctx *ctx, opf_dtype dt, opf_dtype sdt, recipe r, const ssg_shape *sh,
                     unsigned long long *seed)
{
    char what[128];
    snprintf(what, sizeof what, "scaled_swiglu %s scales %s %s [%lld..%lld]", opf_dtype_name(dt),
             opf_dtype_name(sdt), recipe_names[r], (long long)sh->s[0], (long long)sh->s[sh->ndim - 1]);
    int64_t nx = 1;
    for (int i = 0; i < sh->ndim; i++) nx *= sh->s[i];
    int64_t h = sh->s[sh->ndim - 1] / 2, rows = nx / (2 * h), ny = rows * h;
    double *xv = malloc(sizeof(double) * (size_t)nx), *xr = malloc(sizeof(double) * (size_t)nx);
    double *dyv = malloc(sizeof(double) * (size_t)ny), *dyr = malloc(sizeof(double) * (size_t)ny);
    double *sv = malloc(sizeof(double) * (size_t)rows), *sr = malloc(sizeof(double) * (size_t)rows);
    double *yref = malloc(sizeof(double) * (size_t)ny), *dxref = malloc(sizeof(double) * (size_t)nx);
    double *dsref = malloc(sizeof(double) * (size_t)rows), *dsmag = malloc(sizeof(double) * (size_t)rows);
    double *got = malloc(sizeof(double) * (size_t)nx);
    fill(seed, xv, nx, 1.5f);
    fill(seed, dyv, ny, 0.7f);
    fill(seed, sv, rows, 1.0f);
    int64_t ys[3];
    memcpy(ys, sh->s, sizeof ys);
    ys[sh->ndim - 1] = h;
    opf_tensor x = opf_test_make_tensor(ctx, sh->ndim, sh->s, dt, xv, xr);
    opf_tensor dy = opf_test_make_tensor(ctx, sh->ndim, ys, dt, dyv, dyr);
    opf_tensor sc = sh->s_ndim == 1 ? opf_test_make_tensor(ctx, 1, &rows, sdt, sv, sr)
                                    : opf_test_make_tensor(ctx, sh->ndim - 1, sh->s, sdt, sv, sr);
    ssg_ref(xr, sr, dyr, rows, h, yref, dxref, dsref, dsmag);

    opf_delayed_state *fs = NULL, *bs = NULL;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0, 8, OPF_AMAX_MAX, false, 1, &fs));
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0, 8, OPF_AMAX_MAX, true, 1, &bs));
    opf_quantizer fq = make_q(r, fs, amax_of(yref, ny)), gq = make_q(r, bs, amax_of(dxref, nx));
    opf_op *op = mk(ctx, "scaled_swiglu", NULL, "ssg");
    opf_fwd_env env = {.ctx = ctx, .x = &x, .extra_in = {&sc}, .prev_grad_q = r ? &gq : NULL,
                       .next_input_q = r ? &fq : NULL, .requires_grad = true};
    opf_op_ctx octx = {0};
    opf_tensor y[1], dx = {0}, ds[1];
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, y));
    /* fake vs real */
    _Alignas(16) unsigned char copy[OPF_OP_ARGS_MAX];
    detach(opf_op_class_of(op)->fwd_schema, op->fwd_args, copy);
    opf_spec fo[1 + OPF_OP_MAX_EXTRA], fa[OPF_OP_MAX_AUX];
    none_specs(fo, 1 + OPF_OP_MAX_EXTRA);
    none_specs(fa, OPF_OP_MAX_AUX);
    CHECK_OK(NULL, opf_op_class_of(op)->forward_fake(copy, fo, fa));
    CHECK(opf_spec_equal(&fo[0], &y[0].spec) && fa[0].ndim < 0 && fo[1].ndim < 0,
          "%s: forward fake differs from the real output", what);
    CHECK(y[0].spec.scaling == fq.scaling && y[0].spec.dtype == dt, "%s: y is %s", what,
          opf_scaling_name(y[0].spec.scaling));
    opf_test_decode(ctx, &y[0], got);
    check_close(got, yref, ny, r ? quant_tol(fq.qdtype, amax_of(yref, ny)) : dtype_tol(dt), what, "y");
    opf_tensor_release(&x);  /* the op keeps its own reference */
    opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, ds));
    ssg_check_fakes(op, &y[0], &dx, &ds[0], what);
    CHECK(dx.spec.scaling == gq.scaling && dx.spec.dtype == dt, "%s: dx is %s", what,
          opf_scaling_name(dx.spec.scaling));
    opf_test_decode(ctx, &dx, got);
    check_close(got, dxref, nx, r ? quant_tol(gq.qdtype, amax_of(dxref, nx)) : dtype_tol(dt), what, "dx");
    CHECK(ds[0].spec.dtype == sdt && opf_spec_numel(&ds[0].spec) == rows, "%s: d(scales) is %s[%lld]",
          what, opf_dtype_name(ds[0].spec.dtype), (long long)opf_spec_numel(&ds[0].spec));
    opf_test_decode(ctx, &ds[0], got);
    for (int64_t i = 0; i < rows; i++) {  /* fp32 sums of h terms, then one rounding to sdt */
        tol T = dtype_tol(sdt);
        T.atol += 1e-6 * (double)h * dsmag[i];
        int64_t first;
        if (count_bad(&got[i], &dsref[i], 1, T, &first)) {
            CHECK(0, "%s: d(scales)[%lld] %.9g vs %.9g", what, (long long)i, got[i], dsref[i]);
            break;
        }
    }
    if (r != R_NONE) ssg_bit_exact(ctx, r, dt, sh, xr, dyr, &sc, &fq, &gq, &y[0], &dx, what);
    opf_tensor *ts[] = {&y[0], &dx, &ds[0], &dy, &sc};
    for (int i = 0; i < 5; i++) opf_tensor_release(ts[i]);
    opf_op_destroy(op);
    opf_delayed_state_destroy(fs);
    opf_delayed_state_destroy(bs);
    double *fr[] = {xv, xr, dyv, dyr, sv, sr, yref, dxref, dsref, dsmag, got};
    for (size_t i = 0; i < sizeof fr / sizeof fr[0]; i++) free(fr[i]);
}

static void test_ssg_matrix(opf_ctx *ctx)
{
    static const ssg_shape plain_shapes[] = {{2, {5, 48}, 1}, {3, {3, 4, 32}, 2}, {2, {1, 2}, 1}};
    static const ssg_shape quant_shapes[] = {{2, {64, 128}, 1}, {3, {2, 32, 192}, 2}};
    const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    unsigned long long seed = 4242;
    int k = 0;
    for (int di = 0; di < 3; di++)
        for (int r = 0; r < R_COUNT; r++, k++) {
            if (r == R_NVFP4 && dts[di] == OPF_F16) continue;
            opf_dtype sdt = k % 4 == 3 ? OPF_BF16 : OPF_F32;
            const ssg_shape *sh = r == R_NONE ? &plain_shapes[k % 3] : &quant_shapes[k % 2];
            ssg_case(ctx, dts[di], sdt, (recipe)r, sh, &seed);
        }
    for (int i = 0; i < 3; i++) ssg_case(ctx, OPF_BF16, OPF_F32, R_NONE, &plain_shapes[i], &seed);
}

static opf_tensor pattern(opf_ctx *ctx, int ndim, const int64_t *shape, opf_dtype dt)
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

/* A failed forward leaves the outputs and a saved context as they were. */
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

static void test_ssg_bad(opf_ctx *ctx)
{
    opf_op *op = mk(ctx, "scaled_swiglu", NULL, "bad");
    CHECK(opf_op_num_params(op) == 0 && opf_op_num_extra_in(op) == 1 && opf_op_num_extra_out(op) == 0,
          "scaled_swiglu: no params, one extra input");
    opf_tensor x = pattern(ctx, 2, (int64_t[]){4, 32}, OPF_F32);
    opf_tensor odd = pattern(ctx, 2, (int64_t[]){4, 33}, OPF_F32);
    opf_tensor xi = pattern(ctx, 2, (int64_t[]){4, 32}, OPF_I32);
    opf_tensor s4 = pattern(ctx, 1, (int64_t[]){4}, OPF_F32);
    opf_tensor s5 = pattern(ctx, 1, (int64_t[]){5}, OPF_F32);
    opf_tensor si = pattern(ctx, 1, (int64_t[]){4}, OPF_I64);
    memset(s4.data[0], 0, 16);
    opf_op_ctx octx = {0};
    opf_fwd_env env = {.ctx = ctx, .x = &odd, .extra_in = {&s4}, .requires_grad = true};
    CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_SHAPE, "scaled_swiglu", "\"bad\"", "33", "even");
    env.x = &xi;
    CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_DTYPE, "scaled_swiglu", "i32");
    env.x = &x;
    env.extra_in[0] = NULL;
    CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_INVALID_ARG, "\"bad\"", "scales", "missing");
    env.extra_in[0] = &s5;
    CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_SHAPE, "\"bad\"", "[5]", "expected 4");
    env.extra_in[0] = &si;
    CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_SHAPE, "\"bad\"", "i64");
    /* backward out of order and with wrong gradients */
    opf_tensor dy = pattern(ctx, 2, (int64_t[]){4, 16}, OPF_F32);
    opf_tensor dyw = pattern(ctx, 2, (int64_t[]){4, 15}, OPF_F32);
    opf_tensor dyi = pattern(ctx, 2, (int64_t[]){4, 16}, OPF_I32);
    memset(dy.data[0], 0, 64 * 4);
    opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
    opf_tensor y[1], dx, ds[1];
    memset(&dx, 0, sizeof dx);
    memset(ds, 0, sizeof ds);
    CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx, ds), OPF_ERR_STATE, "bad", "forward");
    env.extra_in[0] = &s4;
    memset(x.data[0], 0, 128 * 4);
    CHECK_OK(ctx, opf_op_forward(op, &env, &octx, y));
    env.x = &odd;  /* a failed forward keeps the saved context of the good one */
    CHECK_FWD_FAILS(ctx, op, &env, &octx, OPF_ERR_SHAPE, "33");
    benv.dy = &dyw;
    CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx, ds), OPF_ERR_SHAPE, "\"bad\"", "[4,15]",
                "[4,16]");
    benv.dy = &dyi;
    CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx, ds), OPF_ERR_DTYPE, "\"bad\"", "i32");
    CHECK(octx.valid && dx.data[0] == NULL, "a failed backward consumed the context");
    benv.dy = &dy;
    CHECK_OK(ctx, opf_op_backward(op, &octx, &benv, &dx, ds));
    CHECK(dx.spec.shape[1] == 32 && ds[0].spec.shape[0] == 4, "dx and d(scales) shapes");
    CHECK_FAILS(ctx, opf_op_backward(op, &octx, &benv, &dx, ds), OPF_ERR_STATE, "bad", "already");
    opf_tensor *ts[] = {&x, &odd, &xi, &s4, &s5, &si, &dy, &dyw, &dyi, &y[0], &dx, &ds[0]};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) opf_tensor_release(ts[i]);
    opf_op_destroy(op);
}

/* ==== backward_activation_bias ========================================================== */

/* act.c's f' in fp32, the same expressions (numerics.md 6.3.1: GELU's
 * sigmoid form) and exp. */
static float gelu_df32(float x)
{
    const float x2 = x * x;
    const float s = 1.0f / (1.0f + opf_expf_impl(-2.0f * (x * (0.79788456f + 0.03567741f * x2))));
    return s + ((2.0f * x) * (0.79788456f + 0.1070322243f * x2)) * (s * (1.0f - s));
}
static float relu_df32(float x) { return x > 0.0f ? 1.0f : 0.0f; }

static void set_param(opf_ctx *ctx, opf_op *op, int i, const double *vals)
{
    opf_param *p = opf_op_param(op, i);
    int64_t n = opf_spec_numel(&p->value.spec);
    float *f = malloc(sizeof(float) * (size_t)n);
    for (int64_t k = 0; k < n; k++) f[k] = (float)vals[k];
    CHECK_OK(ctx, opf_convert(f, OPF_F32, p->value.data[0], p->value.spec.dtype, (size_t)n));
    free(f);
}

typedef enum x_kind { X_QUANTIZE_BWD, X_QUANTIZE_FWD, X_NONE, X_IDENTITY } x_kind;

/* [X] + bias + act, n features. */
static opf_seq *bias_act_seq(opf_ctx *ctx, x_kind xk, const char *act, int64_t n, opf_dtype dt,
                             const double *bias)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_quantize_config qb = {.forward = false, .backward = true}, qf = {.forward = true, .backward = false};
    if (xk == X_QUANTIZE_BWD) opf_seq_append(seq, mk(ctx, "quantize", &qb, "xq"));
    if (xk == X_QUANTIZE_FWD) opf_seq_append(seq, mk(ctx, "quantize", &qf, "xq"));
    if (xk == X_IDENTITY) opf_seq_append(seq, mk(ctx, "identity", NULL, "xi"));
    opf_bias_config bc = {.size = n, .dtype = dt};
    opf_op *b = mk(ctx, "bias", &bc, "b");
    set_param(ctx, b, 0, bias);
    opf_seq_append(seq, b);
    opf_seq_append(seq, mk(ctx, act, NULL, "act"));
    return seq;
}

typedef struct run_out {
    opf_tensor y, dx;
} run_out;

static opf_status run_seq(opf_ctx *ctx, opf_seq *seq, const opf_tensor *x, const opf_tensor *dy,
                          const opf_recipe *r, int n_extra, const opf_tensor *extra,
                          const opf_tensor *dextra_out, opf_tensor *extra_out, opf_tensor *dextra_in,
                          run_out *o)
{
    opf_seq_call call = opf_seq_call_default();
    opf_ctx_set_rng(ctx, 404, 0);  /* NVFP4 stochastic rounding: both plans draw the same numbers */
    call.recipe = r;
    call.n_extra_in = n_extra;
    call.extra_in = extra;
    opf_status st = opf_seq_forward(seq, x, &call, &o->y, extra_out);
    if (st) return st;
    return opf_seq_backward(seq, dy, dextra_out, &o->dx, dextra_in);
}

static void release_out(run_out *o)
{
    opf_tensor_release(&o->y);
    opf_tensor_release(&o->dx);
}

/* dbias from the fp32 products f'(x_act) * dy, x_act = round(x + b). */
static void expected_dbias(opf_ctx *ctx, const char *act, const double *xr, const double *br,
                           const double *dyr, int64_t rows, int64_t n, opf_dtype dt, opf_tensor *out)
{
    float *xa = malloc(sizeof(float) * (size_t)(rows * n)), *db = calloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < rows * n; i++) xa[i] = (float)xr[i] + (float)br[i % n];
    uint16_t *tmp = malloc(sizeof(uint16_t) * (size_t)(rows * n));
    if (dt != OPF_F32) {  /* the bias output is stored in the activation dtype */
        CHECK_OK(ctx, opf_convert(xa, OPF_F32, tmp, dt, (size_t)(rows * n)));
        CHECK_OK(ctx, opf_convert(tmp, dt, xa, OPF_F32, (size_t)(rows * n)));
    }
    bool gelu = !strcmp(act, "gelu");
    for (int64_t i = 0; i < rows * n; i++)  /* the fp32 products, summed per column */
        xa[i] = (gelu ? gelu_df32(xa[i]) : relu_df32(xa[i])) * (float)dyr[i];
    for (int64_t j = 0; j < n; j++) db[j] = opf_test_lane_colsum(xa, rows, n, j);
    opf_spec s = opf_spec_make(1, &n, dt);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, out));
    CHECK_OK(ctx, opf_convert(db, OPF_F32, out->data[0], dt, (size_t)n));
    free(xa), free(db), free(tmp);
}

static void bab_case(opf_ctx *ctx, const char *act, opf_dtype dt, recipe rk, unsigned long long *seed)
{
    enum { ROWS = 64, N = 64 };
    char what[96];
    snprintf(what, sizeof what, "backward_activation_bias %s %s %s", act, opf_dtype_name(dt),
             recipe_names[rk]);
    static double xv[ROWS * N], xr[ROWS * N], dyv[ROWS * N], dyr[ROWS * N], bv[N], br[N];
    fill(seed, xv, ROWS * N, 1.0f);
    fill(seed, dyv, ROWS * N, 0.5f);
    fill(seed, bv, N, 0.5f);
    opf_tensor bt = opf_test_make_tensor(ctx, 1, (int64_t[]){N}, dt, bv, br);
    opf_tensor_release(&bt);
    opf_tensor x = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, N}, dt, xv, xr);
    opf_tensor dy = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, N}, dt, dyv, dyr);
    opf_recipe r = opf_recipe_default(recipe_kinds[rk]);
    opf_seq *fused = bias_act_seq(ctx, X_QUANTIZE_BWD, act, N, dt, br);
    opf_seq *plain = bias_act_seq(ctx, X_QUANTIZE_BWD, act, N, dt, br);
    opf_seq_set_fusions(plain, false);
    run_out a = {0}, b = {0};
    CHECK_OK(ctx, run_seq(ctx, fused, &x, &dy, &r, 0, NULL, NULL, NULL, NULL, &a));
    CHECK_OK(ctx, run_seq(ctx, plain, &x, &dy, &r, 0, NULL, NULL, NULL, NULL, &b));
    CHECK(plan_has(fused, true, "backward_activation_bias", 1, 2, NULL) && plan_len(fused, true) == 2,
          "%s: the backward plan lacks the fused op", what);
    CHECK(plan_len(fused, false) == 3 && !class_in_plan(fused, false, "backward_activation_bias"),
          "%s: the forward plan changed", what);
    CHECK(plan_len(plain, true) == 3, "%s: fusions off still fused", what);
    CHECK(a.y.data[0] && opf_test_same_bytes(&a.y, &b.y), "%s: y differs from the unfused plan", what);
    CHECK(a.dx.spec.scaling != OPF_SCALING_NONE, "%s: dx reaches X unquantized", what);
    if (rk != R_DELAYED || dt == OPF_F32) {  /* rounded, then the same quantizer */
        CHECK(opf_test_same_bytes(&a.dx, &b.dx), "%s: dx differs from the unfused plan", what);
    } else {  /* delayed scaling casts the fp32 products, unfused the rounded ones */
        double *ref = malloc(sizeof(double) * ROWS * N);
        opf_test_decode(ctx, &b.dx, ref);
        check_tensors_close(ctx, &a.dx, &b.dx, quant_tol(a.dx.spec.qdtype, amax_of(ref, ROWS * N)), what, "dx");
        free(ref);
    }
    const opf_param *pa = opf_op_param_const(opf_seq_at(fused, 1), 0);
    const opf_param *pb = opf_op_param_const(opf_seq_at(plain, 1), 0);
    opf_tensor want;
    expected_dbias(ctx, act, xr, br, dyr, ROWS, N, dt, &want);
    CHECK(pa->has_grad && opf_test_same_bytes(&pa->grad, &want), "%s: dbias is not the sum of fp32 products", what);
    if (dt == OPF_F32) CHECK(opf_test_same_bytes(&pa->grad, &pb->grad), "%s: f32 dbias differs from unfused", what);
    else {
        tol T = dtype_tol(dt);
        T.atol = 0.02 * sqrt((double)ROWS);  /* ROWS rounded terms of ~0.5 */
        check_tensors_close(ctx, &pa->grad, &pb->grad, T, what, "dbias vs unfused");
    }
    opf_tensor_release(&want);
    release_out(&a), release_out(&b);
    opf_tensor_release(&x), opf_tensor_release(&dy);
    opf_seq_destroy(fused), opf_seq_destroy(plain);
}

static void test_bab_matrix(opf_ctx *ctx)
{
    unsigned long long seed = 99;
    const char *acts[] = {"gelu", "relu"};
    const opf_dtype dts[] = {OPF_F32, OPF_BF16};
    for (int a = 0; a < 2; a++)
        for (int d = 0; d < 2; d++)
            for (int r = R_DELAYED; r < R_COUNT; r++) bab_case(ctx, acts[a], dts[d], (recipe)r, &seed);
}

/* With no grad-output quantizer before the bias (no recipe, an X without
 * one) the fusion takes its plain form: dbias sums dx as stored, so dx and
 * dbias are the unfused plan's bytes in every dtype. */
static void bab_plain_case(opf_ctx *ctx, x_kind xk, const char *act, opf_dtype dt, bool recipe,
                           unsigned long long *seed)
{
    enum { ROWS = 77, N = 48 };
    char what[128];
    snprintf(what, sizeof what, "backward_activation_bias (plain dx) %s %s X %d%s", act,
             opf_dtype_name(dt), (int)xk, recipe ? ", current scaling" : "");
    static double xv[ROWS * N], dyv[ROWS * N], bv[N], br[N];
    fill(seed, xv, ROWS * N, 2.0f);
    fill(seed, dyv, ROWS * N, 0.5f);
    fill(seed, bv, N, 0.5f);
    opf_tensor bt = opf_test_make_tensor(ctx, 1, (int64_t[]){N}, dt, bv, br);
    opf_tensor_release(&bt);
    opf_tensor x = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, N}, dt, xv, NULL);
    opf_tensor dy = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, N}, dt, dyv, NULL);
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_seq *fused = bias_act_seq(ctx, xk, act, N, dt, br);
    opf_seq *plain = bias_act_seq(ctx, xk, act, N, dt, br);
    opf_seq_set_fusions(plain, false);
    run_out a = {0}, b = {0};
    CHECK_OK(ctx, run_seq(ctx, fused, &x, &dy, recipe ? &cur : NULL, 0, NULL, NULL, NULL, NULL, &a));
    CHECK_OK(ctx, run_seq(ctx, plain, &x, &dy, recipe ? &cur : NULL, 0, NULL, NULL, NULL, NULL, &b));
    CHECK(plan_has(fused, true, "backward_activation_bias", 1, 2, NULL), "%s: not fused", what);
    CHECK(a.y.data[0] && opf_test_same_bytes(&a.y, &b.y), "%s: y differs from the unfused plan", what);
    CHECK(a.dx.spec.scaling == OPF_SCALING_NONE && opf_test_same_bytes(&a.dx, &b.dx),
          "%s: dx differs from the unfused plan", what);
    const opf_param *pa = opf_op_param_const(opf_seq_at(fused, 1), 0);
    const opf_param *pb = opf_op_param_const(opf_seq_at(plain, 1), 0);
    CHECK(pa->has_grad && pb->has_grad && opf_test_same_bytes(&pa->grad, &pb->grad),
          "%s: dbias differs from the unfused plan", what);
    release_out(&a), release_out(&b);
    opf_tensor_release(&x), opf_tensor_release(&dy);
    opf_seq_destroy(fused), opf_seq_destroy(plain);
}

static void test_bab_plain(opf_ctx *ctx)
{
    unsigned long long seed = 17;
    const char *acts[] = {"gelu", "relu"};
    const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    for (int a = 0; a < 2; a++)
        for (int d = 0; d < 3; d++) {
            bab_plain_case(ctx, X_QUANTIZE_BWD, acts[a], dts[d], false, &seed);
            bab_plain_case(ctx, X_IDENTITY, acts[a], dts[d], false, &seed);
            bab_plain_case(ctx, X_QUANTIZE_FWD, acts[a], dts[d], true, &seed);
        }
}

/* Where the conditions fail the backward plan keeps bias and activation
 * (no recipe, or an X without a quantizer, fuse in the plain form above). */
static void test_bab_declines(opf_ctx *ctx)
{
    enum { N = 32 };
    double bv[N], xv[4 * N];
    unsigned long long seed = 5;
    fill(&seed, bv, N, 0.5f);
    fill(&seed, xv, 4 * N, 1.0f);
    opf_tensor x = opf_test_make_tensor(ctx, 2, (int64_t[]){4, N}, OPF_F32, xv, NULL);
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);
    const struct {
        x_kind xk;
        const char *act;
        bool recipe;
        const char *why;
    } cases[] = {{X_NONE, "gelu", true, "no op before the bias"},
                 {X_NONE, "relu", false, "no op before the bias (no recipe)"},
                 {X_QUANTIZE_BWD, "silu", true, "SiLU is not fused"},
                 {X_QUANTIZE_BWD, "srelu", true, "SReLU is not fused"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        opf_seq *seq = bias_act_seq(ctx, cases[i].xk, cases[i].act, N, OPF_F32, bv);
        run_out o = {0};
        CHECK_OK(ctx, run_seq(ctx, seq, &x, &x, cases[i].recipe ? &cur : NULL, 0, NULL, NULL, NULL,
                              NULL, &o));
        CHECK(!class_in_plan(seq, true, "backward_activation_bias") &&
                  plan_len(seq, true) == opf_seq_len(seq),
              "fused although %s", cases[i].why);
        release_out(&o);
        opf_seq_destroy(seq);
    }
    /* an op under a recipe of its own: X quantizing by its own recipe with
     * no call recipe (the plain form would not be the unfused bits: X's
     * quantizer shows at run time), or the bias under an override of its
     * own inside a quantized call */
    opf_recipe ovr = cur;
    ovr.backward_override = OPF_BACKWARD_HIGH_PRECISION;
    for (int k = 0; k < 2; k++) {
        opf_seq *s = bias_act_seq(ctx, X_QUANTIZE_BWD, "gelu", N, OPF_F32, bv);
        CHECK_OK(ctx, opf_op_set_recipe(opf_seq_at(s, k), k ? &ovr : &cur));
        run_out o = {0};
        CHECK_OK(ctx, run_seq(ctx, s, &x, &x, k ? &cur : NULL, 0, NULL, NULL, NULL, NULL, &o));
        CHECK(!class_in_plan(s, true, "backward_activation_bias"), "fused although %s",
              k ? "the bias has a recipe of its own" : "X quantizes by a recipe of its own");
        release_out(&o);
        opf_seq_destroy(s);
    }
    /* a recipe change rebuilds the plans: the fusion comes and goes (a
     * backward override declines it) */
    opf_seq *seq = bias_act_seq(ctx, X_QUANTIZE_BWD, "gelu", N, OPF_F32, bv);
    const opf_recipe *seqr[] = {NULL, &ovr, &cur, &ovr};
    for (int k = 0; k < 4; k++) {
        run_out o = {0};
        CHECK_OK(ctx, run_seq(ctx, seq, &x, &x, seqr[k], 0, NULL, NULL, NULL, NULL, &o));
        CHECK(class_in_plan(seq, true, "backward_activation_bias") == (seqr[k] != &ovr),
              "step %d: fusion present %d", k, (int)class_in_plan(seq, true, "backward_activation_bias"));
        release_out(&o);
    }
    opf_seq_destroy(seq);
    opf_tensor_release(&x);
}

/* Linear -> bias -> GELU -> Linear, as an MLP trains: the backward plan
 * fuses bias + GELU after the first linear; results within the recipe's
 * tolerance of the unfused plan (other registered fusions may apply). */
static void test_bab_mlp(opf_ctx *ctx)
{
    enum { T = 64, K = 64, N = 96 };
    unsigned long long seed = 31;
    static double xv[T * K], dyv[T * K];
    fill(&seed, xv, T * K, 1.0f);
    fill(&seed, dyv, T * K, 0.1f);
    const recipe rs[] = {R_CURRENT, R_MXFP8};
    for (int k = 0; k < 2; k++) {
        opf_seq *s[2];
        for (int i = 0; i < 2; i++) {
            opf_ctx_set_rng(ctx, 17, 0);
            opf_seq_create(ctx, &s[i]);
            opf_seq_append_linear(s[i], K, N, true, OPF_BF16, "fc1");
            opf_seq_append(s[i], mk(ctx, "gelu", NULL, "gelu"));
            opf_seq_append_linear(s[i], N, K, false, OPF_BF16, "fc2");
        }
        opf_seq_set_fusions(s[1], false);
        opf_tensor x = opf_test_make_tensor(ctx, 2, (int64_t[]){T, K}, OPF_BF16, xv, NULL);
        opf_tensor dy = opf_test_make_tensor(ctx, 2, (int64_t[]){T, K}, OPF_BF16, dyv, NULL);
        opf_recipe r = opf_recipe_default(recipe_kinds[rs[k]]);
        run_out o[2];
        memset(o, 0, sizeof o);
        for (int i = 0; i < 2; i++)
            CHECK_OK(ctx, run_seq(ctx, s[i], &x, &dy, &r, 0, NULL, NULL, NULL, NULL, &o[i]));
        CHECK(plan_has(s[0], true, "backward_activation_bias", 1, 2, NULL),
              "%s MLP: bias + GELU not fused in backward", recipe_names[rs[k]]);
        tol Tq = {0.125, 0.0675};
        char what[64];
        snprintf(what, sizeof what, "MLP %s", recipe_names[rs[k]]);
        check_tensors_close(ctx, &o[0].y, &o[1].y, (tol){0.125, 0.25}, what, "y");
        check_tensors_close(ctx, &o[0].dx, &o[1].dx, (tol){0.125, 0.01}, what, "dx");
        for (int p = 0; p < opf_op_num_params(opf_seq_at(s[0], 0)); p++)
            check_tensors_close(ctx, &opf_op_param(opf_seq_at(s[0], 0), p)->grad,
                                &opf_op_param(opf_seq_at(s[1], 0), p)->grad, (tol){0.125, 0.05}, what, "dW1");
        check_tensors_close(ctx, &opf_op_param(opf_seq_at(s[0], 1), 0)->grad,
                            &opf_op_param(opf_seq_at(s[1], 1), 0)->grad, (tol){Tq.rtol, 0.05}, what, "db1");
        for (int i = 0; i < 2; i++) release_out(&o[i]), opf_seq_destroy(s[i]);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
}

/* ==== backward_add_rmsnorm, backward_add_layernorm ========================================= */

/* make_extra_output (public extra output) + norm (rmsnorm or layernorm, its
 * bias 0.1), optionally + an internal residual back into the main path. */
static opf_seq *add_norm_seq(opf_ctx *ctx, const char *norm, int64_t H, opf_dtype dt,
                             bool in_place, bool residual, const double *gamma)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_inplace_config ip = {.in_place = in_place};
    opf_op *m = mk(ctx, "make_extra_output", &ip, "save");
    opf_norm_config nc = {.hidden = H, .eps = 0.3, .dtype = dt};
    opf_op *n = mk(ctx, norm, &nc, "norm");
    set_param(ctx, n, 0, gamma);
    if (!strcmp(norm, "layernorm")) {
        double beta[H];
        for (int64_t j = 0; j < H; j++) beta[j] = 0.1;
        set_param(ctx, n, 1, beta);
    }
    if (residual) CHECK_OK(NULL, opf_op_set_extra_output(m, 0, "res", false));
    opf_seq_append(seq, m);
    opf_seq_append(seq, n);
    if (residual) {
        opf_op *a = mk(ctx, "add_extra_input", NULL, "add");
        CHECK_OK(NULL, opf_op_set_extra_input(a, 0, "res"));
        opf_seq_append(seq, a);
    }
    return seq;
}

/* The unrounded norm dx: the same op in f32 on the same values. */
static void norm_dx_f32(opf_ctx *ctx, const char *norm, const double *xr, const double *dyr,
                        const double *gr, int64_t rows, int64_t H, float *dx)
{
    opf_seq *seq = add_norm_seq(ctx, norm, H, OPF_F32, false, false, gr);
    opf_tensor x = opf_test_make_tensor(ctx, 2, (int64_t[]){rows, H}, OPF_F32, xr, NULL);
    opf_tensor dy = opf_test_make_tensor(ctx, 2, (int64_t[]){rows, H}, OPF_F32, dyr, NULL);
    opf_seq_set_fusions(seq, false);
    opf_seq_call call = opf_seq_call_default();
    opf_tensor y, e, d;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, &e));
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &d, NULL));
    memcpy(dx, d.data[0], sizeof(float) * (size_t)(rows * H));
    opf_tensor *ts[] = {&x, &dy, &y, &e, &d};
    for (int i = 0; i < 5; i++) opf_tensor_release(ts[i]);
    opf_seq_destroy(seq);
}

static void bar_case(opf_ctx *ctx, const char *norm, opf_dtype dt, bool with_dextra,
                     const opf_recipe *r, unsigned long long *seed)
{
    enum { ROWS = 24, H = 96 };
    char what[96], cls[32];
    snprintf(cls, sizeof cls, "backward_add_%s", norm);
    snprintf(what, sizeof what, "%s %s %s%s", cls, opf_dtype_name(dt),
             with_dextra ? "with extra grad" : "without extra grad", r ? " (recipe)" : "");
    static double xv[ROWS * H], xr[ROWS * H], dyv[ROWS * H], dyr[ROWS * H], ev[ROWS * H], er[ROWS * H];
    double gv[H], gr[H];
    fill(seed, xv, ROWS * H, 1.0f);
    fill(seed, dyv, ROWS * H, 1.0f);
    fill(seed, ev, ROWS * H, 1.0f);
    for (int j = 0; j < H; j++) gv[j] = 1.0 + 0.25 * opf_test_normal(seed, 1.0f);
    opf_tensor g = opf_test_make_tensor(ctx, 1, (int64_t[]){H}, dt, gv, gr);
    opf_tensor_release(&g);
    opf_tensor x = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, H}, dt, xv, xr);
    opf_tensor dy = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, H}, dt, dyv, dyr);
    opf_tensor de = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, H}, dt, ev, er);
    opf_seq *s[2] = {add_norm_seq(ctx, norm, H, dt, false, false, gr),
                     add_norm_seq(ctx, norm, H, dt, false, false, gr)};
    opf_seq_set_fusions(s[1], false);
    run_out o[2];
    memset(o, 0, sizeof o);
    opf_tensor eo[2];
    for (int i = 0; i < 2; i++)
        CHECK_OK(ctx, run_seq(ctx, s[i], &x, &dy, r, 0, NULL, with_dextra ? &de : NULL, &eo[i], NULL, &o[i]));
    CHECK(plan_has(s[0], true, cls, 0, 2, NULL) && plan_len(s[0], false) == 2 &&
              plan_len(s[1], true) == 2 && !class_in_plan(s[1], true, cls),
          "%s: plans", what);
    CHECK(opf_test_same_bytes(&o[0].y, &o[1].y) && opf_test_same_bytes(&eo[0], &eo[1]), "%s: forward differs", what);
    for (int p = 0; p < opf_op_num_params(opf_seq_at(s[0], 1)); p++) {
        const opf_param *ga = opf_op_param_const(opf_seq_at(s[0], 1), p);
        const opf_param *gb = opf_op_param_const(opf_seq_at(s[1], 1), p);
        CHECK(opf_test_same_bytes(&ga->grad, &gb->grad), "%s: %s's gradient differs from the unfused plan",
              what, p ? "beta" : "gamma");
    }
    CHECK(o[0].dx.spec.scaling == OPF_SCALING_NONE && o[0].dx.spec.dtype == dt, "%s: dx is %s %s", what,
          opf_scaling_name(o[0].dx.spec.scaling), opf_dtype_name(o[0].dx.spec.dtype));
    if (!with_dextra || dt == OPF_F32) {
        CHECK(opf_test_same_bytes(&o[0].dx, &o[1].dx), "%s: dx differs from the unfused plan", what);
    } else {
        tol T = dtype_tol(dt);
        T.atol = 2 * T.rtol;  /* |dx| ~ 1: the unfused plan rounds twice */
        check_tensors_close(ctx, &o[0].dx, &o[1].dx, T, what, "dx");
    }
    /* one rounding: dx = round(dx_norm (fp32) + d(extra)) */
    float *f = malloc(sizeof(float) * ROWS * H);
    norm_dx_f32(ctx, norm, xr, dyr, gr, ROWS, H, f);
    for (int i = 0; i < ROWS * H; i++) f[i] = f[i] + (with_dextra ? (float)er[i] : 0.0f);
    opf_tensor want;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &o[0].dx.spec, &want));
    CHECK_OK(ctx, opf_convert(f, OPF_F32, want.data[0], dt, ROWS * H));
    CHECK(opf_test_same_bytes(&o[0].dx, &want), "%s: dx is not round(fp32 dx_norm + extra grad)", what);
    opf_tensor_release(&want);
    free(f);
    for (int i = 0; i < 2; i++) release_out(&o[i]), opf_tensor_release(&eo[i]), opf_seq_destroy(s[i]);
    opf_tensor_release(&x), opf_tensor_release(&dy), opf_tensor_release(&de);
}

static void test_bar_norm(opf_ctx *ctx, const char *norm)
{
    unsigned long long seed = 1234;
    char cls[32];
    snprintf(cls, sizeof cls, "backward_add_%s", norm);
    const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);
    for (int d = 0; d < 3; d++)
        for (int w = 0; w < 2; w++) bar_case(ctx, norm, dts[d], w, d == 1 ? &cur : NULL, &seed);

    /* an internal residual: its channel gradient reaches the fused op */
    enum { ROWS = 8, H = 64 };
    double xv[ROWS * H], dyv[ROWS * H], gv[H];
    fill(&seed, xv, ROWS * H, 1.0f);
    fill(&seed, dyv, ROWS * H, 1.0f);
    for (int j = 0; j < H; j++) gv[j] = 1.0 + 0.1 * j / H;
    opf_tensor x = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, H}, OPF_F32, xv, NULL);
    opf_tensor dy = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS, H}, OPF_F32, dyv, NULL);
    opf_seq *s[2] = {add_norm_seq(ctx, norm, H, OPF_F32, false, true, gv),
                     add_norm_seq(ctx, norm, H, OPF_F32, false, true, gv)};
    opf_seq_set_fusions(s[1], false);
    run_out o[2];
    memset(o, 0, sizeof o);
    for (int i = 0; i < 2; i++) CHECK_OK(ctx, run_seq(ctx, s[i], &x, &dy, NULL, 0, NULL, NULL, NULL, NULL, &o[i]));
    CHECK(plan_has(s[0], true, cls, 0, 2, NULL) && plan_len(s[0], true) == 2,
          "%s residual: the backward plan lacks the fused op", norm);
    CHECK(opf_test_same_bytes(&o[0].y, &o[1].y) && opf_test_same_bytes(&o[0].dx, &o[1].dx),
          "residual: results differ from the unfused plan");
    for (int i = 0; i < 2; i++) release_out(&o[i]), opf_seq_destroy(s[i]);

    /* an input that needs no gradient: the norm is the first op whose
     * backward must run, and the fused op also covers MakeExtraOutput
     * before it, which must have saved (it failed "backward without a
     * forward that saved for it"); eager and compiled, as the unfused plan */
    for (int compiled = 0; compiled < 2; compiled++) {
        opf_seq *t[2] = {add_norm_seq(ctx, norm, H, OPF_F32, false, true, gv),
                         add_norm_seq(ctx, norm, H, OPF_F32, false, true, gv)};
        opf_seq_set_fusions(t[1], false);
        opf_seq_call call = opf_seq_call_default();
        call.input_requires_grad = false;
        opf_tensor y[2], dx[2];
        static float yb[2][ROWS * H];  /* a graph's y is an arena view the backward may reuse */
        for (int i = 0; i < 2; i++) {
            opf_graph *gph = NULL;
            if (compiled) {
                opf_compile_options co = opf_compile_options_default();
                CHECK_OK(ctx, opf_compile(t[i], &x.spec, &call, &co, &gph));
                CHECK_OK(ctx, opf_graph_forward(gph, &x, &call, &y[i], NULL));
                memcpy(yb[i], y[i].data[0], sizeof yb[i]);
                CHECK_OK(ctx, opf_graph_backward(gph, &dy, NULL, &dx[i], NULL));
            } else {
                CHECK_OK(ctx, opf_seq_forward(t[i], &x, &call, &y[i], NULL));
                memcpy(yb[i], y[i].data[0], sizeof yb[i]);
                CHECK_OK(ctx, opf_seq_backward(t[i], &dy, NULL, &dx[i], NULL));
            }
            opf_graph_destroy(gph);
        }
        CHECK(class_in_plan(t[0], true, cls), "%s, input without gradient: not fused", norm);
        for (int p = 0; p < opf_op_num_params(opf_seq_at(t[0], 1)); p++)
            CHECK(opf_test_same_bytes(&opf_op_param_const(opf_seq_at(t[0], 1), p)->grad,
                                      &opf_op_param_const(opf_seq_at(t[1], 1), p)->grad),
                  "%s, input without gradient (%s): parameter %d's gradient differs from the "
                  "unfused plan", norm, compiled ? "compiled" : "eager", p);
        CHECK(!memcmp(yb[0], yb[1], sizeof yb[0]), "%s, input without gradient: forward differs", norm);
        for (int i = 0; i < 2; i++) opf_tensor_release(&y[i]), opf_tensor_release(&dx[i]), opf_seq_destroy(t[i]);
    }

    /* an extra gradient of the wrong shape: MakeExtraOutput's check names it */
    opf_seq *bad = add_norm_seq(ctx, norm, H, OPF_F32, false, false, gv);
    opf_tensor dew = opf_test_make_tensor(ctx, 2, (int64_t[]){ROWS / 2, H}, OPF_F32, xv, NULL), eo, y, dxb;
    opf_seq_call call = opf_seq_call_default();
    CHECK_OK(ctx, opf_seq_forward(bad, &x, &call, &y, &eo));
    CHECK(class_in_plan(bad, true, cls), "%s: bad-gradient seq not fused", norm);
    CHECK_FAILS(ctx, opf_seq_backward(bad, &dy, &dew, &dxb, NULL), OPF_ERR_SHAPE, "make_extra_output",
                "\"save\"", "[4,64]", "[8,64]");
    opf_tensor_release(&y), opf_tensor_release(&eo), opf_tensor_release(&dew);
    opf_seq_destroy(bad);

    /* declines: in place, a norm with no add fusion, the other order */
    opf_seq *ip = add_norm_seq(ctx, norm, H, OPF_F32, true, false, gv);
    opf_seq *l2, *rev;
    opf_norm_config nc = {.hidden = H, .eps = 1e-5, .dtype = OPF_F32};
    opf_l2norm_config l2c = {.eps = 1e-6};
    opf_seq_create(ctx, &l2);
    opf_seq_append(l2, mk(ctx, "make_extra_output", NULL, "m"));
    opf_seq_append(l2, mk(ctx, "l2normalization", &l2c, "l2"));
    opf_seq_create(ctx, &rev);
    opf_seq_append(rev, mk(ctx, norm, &nc, "norm"));
    opf_seq_append(rev, mk(ctx, "make_extra_output", NULL, "m"));
    opf_seq *dec[] = {ip, l2, rev};
    const char *why[] = {"in place", "l2normalization", "the norm first"};
    for (int i = 0; i < 3; i++) {
        run_out oo = {0};
        opf_tensor e;
        CHECK_OK(ctx, run_seq(ctx, dec[i], &x, &dy, NULL, 0, NULL, NULL, &e, NULL, &oo));
        CHECK(!class_in_plan(dec[i], true, "backward_add_rmsnorm") &&
                  !class_in_plan(dec[i], true, "backward_add_layernorm") && plan_len(dec[i], true) == 2,
              "%s: fused although %s", norm, why[i]);
        release_out(&oo);
        opf_tensor_release(&e);
        opf_seq_destroy(dec[i]);
    }
    opf_tensor_release(&x), opf_tensor_release(&dy);
}

static void test_bar(opf_ctx *ctx)
{
    test_bar_norm(ctx, "rmsnorm");
    test_bar_norm(ctx, "layernorm");
}

/* ==== grouped_mlp ========================================================================== */

typedef struct gm_dims {
    int     groups;
    int64_t K, H, N;       /* FC1: K -> 2H, FC2: H -> N */
    int64_t split[4];
    bool    bias1, bias2;
} gm_dims;

static int64_t gm_rows(const gm_dims *d)
{
    int64_t m = 0;
    for (int g = 0; g < d->groups; g++) m += d->split[g];
    return m;
}

static opf_seq *gm_seq(opf_ctx *ctx, const gm_dims *d, int64_t fc2_in, opf_dtype dt)
{
    opf_ctx_set_rng(ctx, 2718, 0);  /* both seqs of a comparison get the same weights */
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_grouped_linear_config c1 = {.groups = d->groups, .in_features = d->K, .out_features = 2 * d->H,
                                    .bias = d->bias1, .dtype = dt};
    opf_grouped_linear_config c2 = {.groups = d->groups, .in_features = fc2_in, .out_features = d->N,
                                    .bias = d->bias2, .dtype = dt};
    opf_seq_append(seq, mk(ctx, "grouped_linear", &c1, "fc1"));
    opf_seq_append(seq, mk(ctx, "scaled_swiglu", NULL, "glu"));
    opf_seq_append(seq, mk(ctx, "grouped_linear", &c2, "fc2"));
    /* biases start at zero: give them values */
    unsigned long long seed = 8;
    for (int k = 0; k < 3; k += 2)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, k)); p++) {
            opf_param *pr = opf_op_param(opf_seq_at(seq, k), p);
            if (pr->value.spec.ndim != 1) continue;
            double v[512];
            fill(&seed, v, pr->value.spec.shape[0], 0.2f);
            set_param(ctx, opf_seq_at(seq, k), p, v);
        }
    return seq;
}

typedef struct gm_inputs {
    opf_tensor x, dy, split, scales, extra[3];
} gm_inputs;

static void gm_inputs_make(opf_ctx *ctx, const gm_dims *d, opf_dtype dt, unsigned long long *seed,
                           gm_inputs *in)
{
    int64_t M = gm_rows(d);
    double *xv = malloc(sizeof(double) * (size_t)(M * d->K + 1));
    double *dyv = malloc(sizeof(double) * (size_t)(M * d->N + 1)), sv[512];
    fill(seed, xv, M * d->K, 1.0f);
    fill(seed, dyv, M * d->N, 0.2f);
    fill(seed, sv, M, 1.0f);
    in->x = opf_test_make_tensor(ctx, 2, (int64_t[]){M, d->K}, dt, xv, NULL);
    in->dy = opf_test_make_tensor(ctx, 2, (int64_t[]){M, d->N}, dt, dyv, NULL);
    in->scales = opf_test_make_tensor(ctx, 1, &M, OPF_F32, sv, NULL);
    opf_spec ss = opf_spec_make(1, (int64_t[]){d->groups}, OPF_I64);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &ss, &in->split));
    memcpy(in->split.data[0], d->split, sizeof(int64_t) * (size_t)d->groups);
    in->extra[0] = in->split, in->extra[1] = in->scales, in->extra[2] = in->split;
    free(xv), free(dyv);
}

static void gm_inputs_free(gm_inputs *in)
{
    opf_tensor_release(&in->x), opf_tensor_release(&in->dy), opf_tensor_release(&in->split);
    opf_tensor_release(&in->scales);
}

/* Forward and backward of both seqs; everything must agree bit for bit. */
static void gm_compare_step(opf_ctx *ctx, opf_seq *a, opf_seq *b, const gm_inputs *in,
                            const opf_recipe *r, const char *what)
{
    run_out o[2];
    memset(o, 0, sizeof o);
    opf_tensor dex[2][3];
    memset(dex, 0, sizeof dex);
    opf_seq *s[2] = {a, b};
    for (int i = 0; i < 2; i++)
        CHECK_OK(ctx, run_seq(ctx, s[i], &in->x, &in->dy, r, 3, in->extra, NULL, NULL, dex[i], &o[i]));
    CHECK(o[0].y.data[0] && opf_test_same_bytes(&o[0].y, &o[1].y), "%s: y differs from the unfused plan", what);
    CHECK(o[0].dx.data[0] && opf_test_same_bytes(&o[0].dx, &o[1].dx), "%s: dx differs from the unfused plan", what);
    CHECK(dex[0][1].data[0] && opf_test_same_bytes(&dex[0][1], &dex[1][1]), "%s: d(scales) differs", what);
    CHECK(dex[0][0].data[0] == NULL || opf_spec_numel(&dex[0][0].spec) == 0 ||
              opf_test_same_bytes(&dex[0][0], &dex[1][0]), "%s: split-size gradient", what);
    int bad = 0, n = 0;
    for (int k = 0; k < 3; k += 2)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, k)); p++, n++) {
            const opf_param *pa = opf_op_param_const(opf_seq_at(a, k), p);
            const opf_param *pb = opf_op_param_const(opf_seq_at(b, k), p);
            bad += pa->has_grad != pb->has_grad || !opf_test_same_bytes(&pa->grad, &pb->grad);
        }
    CHECK(bad == 0, "%s: %d of %d parameter gradients differ", what, bad, n);
    for (int i = 0; i < 2; i++) {
        release_out(&o[i]);
        for (int j = 0; j < 3; j++) opf_tensor_release(&dex[i][j]);
    }
}

/* The fused op's fake, run on its args and its parts' args with every
 * tensor detached, describes what the real forward produced. */
static void gm_check_fake(opf_op *fused, const opf_tensor *y, const char *what)
{
    const opf_op_class *c = opf_op_class_of(fused);
    _Alignas(16) unsigned char copy[OPF_OP_ARGS_MAX], parts[3][OPF_OP_ARGS_MAX];
    detach(c->fwd_schema, fused->fwd_args, copy);
    for (int k = 0; k < 3; k++) {
        char name[16];
        snprintf(name, sizeof name, "part[%d]", k);
        const opf_field *f = opf_schema_field(c->fwd_schema, name);
        CHECK(f && f->kind == OPF_FIELD_REF, "%s: no reference field %s", what, name);
        if (!f) return;
        opf_op *p = opf_op_basic(fused, k);
        detach(opf_op_class_of(p)->fwd_schema, p->fwd_args, parts[k]);
        *(void **)(copy + f->offset) = parts[k];
    }
    opf_spec o[1 + OPF_OP_MAX_EXTRA], a[OPF_OP_MAX_AUX];
    none_specs(o, 1 + OPF_OP_MAX_EXTRA);
    none_specs(a, OPF_OP_MAX_AUX);
    CHECK_OK(NULL, c->forward_fake(copy, o, a));
    CHECK(opf_spec_equal(&o[0], &y->spec) && a[0].dtype == OPF_U8 && a[1].ndim < 0,
          "%s: the fused fake differs from the real output", what);
}

static void gm_case(opf_ctx *ctx, const gm_dims *d, opf_dtype dt, recipe rk, unsigned long long *seed)
{
    char what[96];
    snprintf(what, sizeof what, "grouped_mlp %s %s G%d", opf_dtype_name(dt), recipe_names[rk], d->groups);
    opf_recipe r = opf_recipe_default(recipe_kinds[rk]);
    const opf_recipe *rp = rk == R_NONE ? NULL : &r;
    opf_seq *a = gm_seq(ctx, d, d->H, dt), *b = gm_seq(ctx, d, d->H, dt);
    opf_seq_set_fusions(b, false);
    gm_inputs in;
    gm_inputs_make(ctx, d, dt, seed, &in);
    for (int step = 0; step < 2; step++) {  /* the second step sees updated delayed scales */
        char w2[128];
        snprintf(w2, sizeof w2, "%s step %d", what, step);
        gm_compare_step(ctx, a, b, &in, rp, w2);
    }
    opf_op *fw = NULL, *bw = NULL;
    CHECK(plan_has(a, false, "grouped_mlp", 0, 3, &fw) && plan_has(a, true, "grouped_mlp", 0, 3, &bw) &&
              plan_len(a, false) == 1 && plan_len(a, true) == 1,
          "%s: the plans lack the joint op", what);
    CHECK(fw && fw == bw, "%s: forward and backward plans hold different objects", what);
    CHECK(plan_len(b, false) == 3 && plan_len(b, true) == 3, "%s: fusions off still fused", what);
    if (fw) {
        CHECK(opf_op_class_of(fw)->unsupported_reason && opf_op_class_of(fw)->unsupported_reason(fw),
              "%s: no reason to run eagerly in a graph", what);
        CHECK(opf_op_num_params(fw) == opf_op_num_params(opf_seq_at(a, 0)) + opf_op_num_params(opf_seq_at(a, 2)) &&
                  opf_op_num_extra_in(fw) == 3, "%s: the fused op's params or extra inputs", what);
        opf_seq_call call = opf_seq_call_default();
        call.recipe = rp;
        call.n_extra_in = 3;
        call.extra_in = in.extra;
        call.requires_grad = false;
        opf_tensor y;
        CHECK_OK(ctx, opf_seq_forward(a, &in.x, &call, &y, NULL));  /* inference: no backward after */
        /* new grad needs, new plans: the fused op is a new object */
        CHECK(plan_has(a, false, "grouped_mlp", 0, 3, &fw), "%s: inference plan not fused", what);
        gm_check_fake(fw, &y, what);
        opf_tensor_release(&y);
    }
    gm_inputs_free(&in);
    opf_seq_destroy(a), opf_seq_destroy(b);
}

static void test_gm_matrix(opf_ctx *ctx)
{
    static const gm_dims dims[] = {
        {3, 64, 64, 32, {32, 0, 64}, true, false},
        {2, 32, 32, 64, {64, 32}, false, true},
    };
    unsigned long long seed = 6;
    const opf_dtype dts[] = {OPF_F32, OPF_BF16};
    int k = 0;
    for (int di = 0; di < 2; di++)
        for (int r = 0; r < R_COUNT; r++, k++) gm_case(ctx, &dims[k % 2], dts[di], (recipe)r, &seed);
}

/* Declines: the recipe (MXFP8 with a hybrid backward format), dimensions
 * that are not multiples of 32, and the structural conditions. */
static void test_gm_declines(opf_ctx *ctx)
{
    unsigned long long seed = 61;
    gm_dims d = {2, 64, 32, 32, {32, 64}, true, true};
    opf_recipe hy = opf_recipe_default(OPF_RECIPE_MXFP8);
    hy.format = OPF_FORMAT_HYBRID;
    opf_seq *a = gm_seq(ctx, &d, d.H, OPF_BF16), *b = gm_seq(ctx, &d, d.H, OPF_BF16);
    opf_seq_set_fusions(b, false);
    gm_inputs in;
    gm_inputs_make(ctx, &d, OPF_BF16, &seed, &in);
    gm_compare_step(ctx, a, b, &in, &hy, "grouped_mlp mxfp8 hybrid");
    CHECK(!class_in_plan(a, false, "grouped_mlp") && !class_in_plan(a, true, "grouped_mlp") &&
              plan_len(a, false) == 3, "mxfp8 hybrid: fused although declined");
    opf_op *ops[3] = {opf_seq_at(a, 0), opf_seq_at(a, 1), opf_seq_at(a, 2)};
    const char *why = opf_grouped_mlp_decline_reason(ops, 3, &hy);
    CHECK(why && strstr(why, "MXFP8") && strstr(why, "E4M3"), "mxfp8 hybrid reason: %s", why ? why : "(null)");
    opf_recipe e4 = opf_recipe_default(OPF_RECIPE_MXFP8), nv = opf_recipe_default(OPF_RECIPE_NVFP4);
    CHECK(!opf_grouped_mlp_decline_reason(ops, 3, &e4) && !opf_grouped_mlp_decline_reason(ops, 3, &nv) &&
              !opf_grouped_mlp_decline_reason(ops, 3, NULL), "declined a supported recipe");
    CHECK(!opf_grouped_mlp_decline_reason(ops, 4, NULL), "four ops available, the first three fit");
    CHECK(opf_grouped_mlp_decline_reason(ops, 2, NULL) && opf_grouped_mlp_decline_reason(NULL, 0, NULL),
          "fewer than three ops");
    opf_op *rev[3] = {ops[1], ops[0], ops[2]};
    CHECK(opf_grouped_mlp_decline_reason(rev, 3, NULL) != NULL, "wrong order accepted");
    opf_op *fused;
    CHECK_OK(ctx, opf_fused_op_create(ctx, "grouped_mlp", ops, 3, &fused));
    opf_op *with_fused[3] = {fused, ops[1], ops[2]};
    const char *wf = opf_grouped_mlp_decline_reason(with_fused, 3, NULL);
    CHECK(wf && strstr(wf, "fused"), "a fused op accepted: %s", wf ? wf : "(null)");
    opf_op_destroy(fused);
    gm_inputs_free(&in);
    opf_seq_destroy(a), opf_seq_destroy(b);

    /* shapes: group counts, FC1 out != 2 x FC2 in, not multiples of 32 (48) */
    opf_grouped_linear_config c1 = {.groups = 2, .in_features = 64, .out_features = 128, .dtype = OPF_F32};
    opf_grouped_linear_config g3 = {.groups = 3, .in_features = 64, .out_features = 64, .dtype = OPF_F32};
    opf_grouped_linear_config w96 = {.groups = 2, .in_features = 96, .out_features = 64, .dtype = OPF_F32};
    opf_op *f1 = mk(ctx, "grouped_linear", &c1, "f1"), *glu = mk(ctx, "scaled_swiglu", NULL, "g");
    opf_op *f3 = mk(ctx, "grouped_linear", &g3, "f3"), *fw = mk(ctx, "grouped_linear", &w96, "fw");
    opf_op *l1[3] = {f1, glu, f3}, *l2[3] = {f1, glu, fw};
    const char *r1 = opf_grouped_mlp_decline_reason(l1, 3, NULL), *r2 = opf_grouped_mlp_decline_reason(l2, 3, NULL);
    CHECK(r1 && strstr(r1, "group"), "group counts: %s", r1 ? r1 : "(null)");
    CHECK(r2 && strstr(r2, "twice"), "FC1 out vs FC2 in: %s", r2 ? r2 : "(null)");
    opf_op *objs[] = {f1, glu, f3, fw};
    for (int i = 0; i < 4; i++) opf_op_destroy(objs[i]);

    gm_dims odd = {2, 48, 48, 32, {32, 32}, false, false};
    a = gm_seq(ctx, &odd, odd.H, OPF_F32), b = gm_seq(ctx, &odd, odd.H, OPF_F32);
    opf_seq_set_fusions(b, false);
    gm_inputs_make(ctx, &odd, OPF_F32, &seed, &in);
    gm_compare_step(ctx, a, b, &in, NULL, "grouped_mlp 48 wide");
    CHECK(plan_len(a, false) == 3 && plan_len(a, true) == 3, "48-wide dims fused");
    opf_op *ops48[3] = {opf_seq_at(a, 0), opf_seq_at(a, 1), opf_seq_at(a, 2)};
    const char *r48 = opf_grouped_mlp_decline_reason(ops48, 3, NULL);
    CHECK(r48 && strstr(r48, "32"), "48 wide: %s", r48 ? r48 : "(null)");
    gm_inputs_free(&in);
    opf_seq_destroy(a), opf_seq_destroy(b);
}

/* Bad inputs reach the fused op's parts, which name themselves; nothing is
 * left pending and the next good call works. */
static void test_gm_errors(opf_ctx *ctx)
{
    unsigned long long seed = 71;
    gm_dims d = {2, 32, 32, 32, {32, 32}, false, false};
    opf_seq *a = gm_seq(ctx, &d, d.H, OPF_F32);
    gm_inputs in;
    gm_inputs_make(ctx, &d, OPF_F32, &seed, &in);
    opf_seq_call call = opf_seq_call_default();
    call.n_extra_in = 3;
    opf_tensor bad_scales = opf_test_make_tensor(ctx, 1, (int64_t[]){63}, OPF_F32, (double[64]){0}, NULL);
    opf_spec ss = opf_spec_make(1, (int64_t[]){2}, OPF_I64);
    opf_tensor split2;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &ss, &split2));
    ((int64_t *)split2.data[0])[0] = 16, ((int64_t *)split2.data[0])[1] = 64;
    opf_tensor e1[3] = {in.split, bad_scales, in.split}, e2[3] = {in.split, in.scales, split2};
    opf_tensor y;
    call.extra_in = e1;
    CHECK_FAILS(ctx, opf_seq_forward(a, &in.x, &call, &y, NULL), OPF_ERR_SHAPE, "scaled_swiglu",
                "\"glu\"", "expected 64");
    call.extra_in = e2;
    CHECK_FAILS(ctx, opf_seq_forward(a, &in.x, &call, &y, NULL), OPF_ERR_SHAPE, "grouped_linear",
                "\"fc2\"", "sum to 80");
    call.extra_in = in.extra;
    run_out o = {0};
    CHECK_OK(ctx, run_seq(ctx, a, &in.x, &in.dy, NULL, 3, in.extra, NULL, NULL, NULL, &o));
    CHECK(plan_len(a, true) == 1, "fused after errors");
    /* a gradient of the wrong width is refused by FC2, the first part backward runs */
    opf_tensor dyw = opf_test_make_tensor(ctx, 2, (int64_t[]){64, 16}, OPF_F32, (double[1024]){0}, NULL);
    CHECK_OK(ctx, opf_seq_forward(a, &in.x, &call, &y, NULL));
    CHECK_FAILS(ctx, opf_seq_backward(a, &dyw, NULL, &o.dx, NULL), OPF_ERR_SHAPE, "fc2", "16");
    opf_tensor_release(&y);
    release_out(&o);
    opf_tensor_release(&bad_scales), opf_tensor_release(&split2), opf_tensor_release(&dyw);
    gm_inputs_free(&in);
    opf_seq_destroy(a);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx) != OPF_OK) return 1;
    test_ssg_fd();
    test_ssg_matrix(ctx);
    test_ssg_bad(ctx);
    test_bab_matrix(ctx);
    test_bab_plain(ctx);
    test_bab_declines(ctx);
    test_bab_mlp(ctx);
    test_bar(ctx);
    test_gm_matrix(ctx);
    test_gm_declines(ctx);
    test_gm_errors(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
