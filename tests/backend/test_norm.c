/* test_norm.c: the norm entries of the CPU kernel table (backend/norm.h),
 * called directly: LayerNorm and RMSNorm (with and without the residual
 * gradient of the add + norm backward) and L2 normalization, forward and
 * backward, every dtype (f32, bf16, f16), shapes from one element to a
 * multi-threaded size, zero-centred gamma or not.
 *
 * One reference written here from norm.h runs in two modes: with every
 * operation rounded to fp32 (double then float is exact for + - * / sqrt)
 * it is the bit-exact twin a device's kernels must match byte for byte, the
 * warp-tree sums included; with no rounding it is the FP64 reference the
 * kernels must approach within a tolerance of their dtype. Also: no bit
 * depends on the thread count, and inputs in another dtype are rounded to
 * the compute dtype first. */
#include "test.h"

#include "backend/backend-impl.h"

enum { K_LN, K_RMS, K_L2, K_COUNT };
static const char *const KIND_NAMES[K_COUNT] = {"layernorm", "rmsnorm", "l2norm"};

/* ---- the reference (norm.h), exact fp32 or FP64 ------------------------------------ */

static bool fp32;  /* round every operation to fp32 (the twin) or not (FP64) */

static double R(double v) { return fp32 ? (double)(float)v : v; }

/* S over n terms t[0], t[stride], ...: 32 lanes left to right, then folded. */
static double tree(const double *t, int64_t n, int64_t stride)
{
    double lane[OPF_NORM_LANES] = {0};
    for (int64_t j = 0; j < n; j++)
        lane[j % OPF_NORM_LANES] = R(lane[j % OPF_NORM_LANES] + t[j * stride]);
    for (int w = OPF_NORM_LANES / 2; w; w /= 2)
        for (int l = 0; l < w; l++) lane[l] = R(lane[l] + lane[l + w]);
    return lane[0];
}

static double rsqrt_of(double v) { return R(1.0 / R(sqrt(v))); }

/* The inputs of one case, as the values the kernels see (already in dtype). */
typedef struct norm_data {
    int64_t rows, H;
    double *x, *g, *b, *dz, *da;  /* g: gamma (+ 1 zero-centred applied by ref) */
} norm_data;

/* The outputs: forward z, stats s1 (mu; LayerNorm only) and s2 (rsigma or
 * rnorm), backward dx, dg, db. */
typedef struct norm_out {
    double *z, *s1, *s2, *dx, *dg, *db;
} norm_out;

/* Row statistics of LayerNorm and RMSNorm: mu and m2 (t: H scratch). */
static double row_m2(const double *x, int64_t H, double rn, double *t, double *mu)
{
    *mu = R(tree(x, H, 1) * rn);
    for (int64_t j = 0; j < H; j++) {
        double d = R(x[j] - *mu);
        t[j] = R(d * d);
    }
    return tree(t, H, 1);
}

/* One row of the forward (z, stats) and the backward (y, dx) of kind k. */
static void ref_row(int k, const norm_data *d, const double *g, double eps, int64_t r, double *t,
                    double *y, norm_out *o)
{
    int64_t H = d->H, off = r * H;
    const double *x = d->x + off, *dz = d->dz + off;
    double rn = R(1.0 / (double)H), mu = 0, rs;
    if (k == K_L2) {
        for (int64_t j = 0; j < H; j++) t[j] = R(x[j] * x[j]);
        rs = rsqrt_of(R(tree(t, H, 1) + eps));
    } else {
        double m2 = row_m2(x, H, rn, t, &mu);
        double ms = k == K_LN ? R(rn * m2) : R(R(rn * m2) + R(mu * mu));
        rs = rsqrt_of(R(ms + eps));
        o->s1[r] = mu;
    }
    o->s2[r] = rs;
    for (int64_t j = 0; j < H; j++) {
        y[off + j] = k == K_LN ? R(rs * R(x[j] - mu)) : k == K_RMS ? R(rs * x[j]) : R(x[j] * rs);
        o->z[off + j] = k == K_LN ? R(R(g[j] * y[off + j]) + d->b[j])
                      : k == K_RMS ? R(g[j] * y[off + j]) : y[off + j];
        t[j] = k == K_L2 ? dz[j] : R(g[j] * dz[j]);  /* e_j */
    }
    double a = k == K_LN ? R(tree(t, H, 1) * rn) : 0;
    double *ey = o->dx + off;  /* the products, then dx */
    for (int64_t j = 0; j < H; j++) ey[j] = R(t[j] * y[off + j]);
    double c = k == K_L2 ? tree(ey, H, 1) : R(tree(ey, H, 1) * rn);
    for (int64_t j = 0; j < H; j++) {
        double cy = k == K_LN ? R(R(c * y[off + j]) + a) : R(c * y[off + j]);
        ey[j] = R(rs * R(t[j] - cy));
        if (d->da) ey[j] = R(ey[j] + d->da[off + j]);
    }
}

static void reference(int k, const norm_data *d, bool zc, double eps, norm_out *o)
{
    int64_t H = d->H, n = d->rows * H;
    double *g = calloc((size_t)H + 1, sizeof(double)), *t = calloc((size_t)H + 1, sizeof(double));
    double *y = calloc((size_t)n + 1, sizeof(double)), *p = calloc((size_t)n + 1, sizeof(double));
    for (int64_t j = 0; j < H && k != K_L2; j++) g[j] = zc ? R(d->g[j] + 1.0) : d->g[j];
    for (int64_t r = 0; r < d->rows; r++) ref_row(k, d, g, eps, r, t, y, o);
    for (int64_t i = 0; i < n && k != K_L2; i++) p[i] = R(d->dz[i] * y[i]);
    for (int64_t j = 0; j < H && k != K_L2; j++) {
        o->dg[j] = tree(p + j, d->rows, H);
        o->db[j] = tree(d->dz + j, d->rows, H);
    }
    free(g), free(t), free(y), free(p);
}

/* ---- the kernels' side ------------------------------------------------------------- */

typedef struct norm_case {
    int     kind;
    opf_dtype dt;
    int     ndim;
    int64_t shape[3];
    bool    zc, dadd;
} norm_case;

typedef struct norm_tensors {
    opf_tensor x, g, b, dz, da, z, mu, rs, dx, dg, db;
} norm_tensors;

static double *values(unsigned long long *seed, int64_t n, double mean, double sigma)
{
    double *v = calloc((size_t)n + 1, sizeof(double));
    for (int64_t i = 0; i < n; i++) v[i] = mean + opf_test_normal(seed, (float)sigma);
    return v;
}

static opf_tensor out_tensor(opf_ctx *ctx, int ndim, const int64_t *shape, opf_dtype dt)
{
    opf_tensor t;
    opf_spec s = opf_spec_make(ndim, shape, dt);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    return t;
}

/* Inputs of case c in its dtype, d gets the stored values; outputs allocated. */
static void make_case(opf_ctx *ctx, const norm_case *c, norm_data *d, norm_tensors *T)
{
    unsigned long long seed = 0x5EEDull + (unsigned long long)c->kind * 977u + c->shape[0];
    int64_t H = c->shape[c->ndim - 1], n = 1;
    for (int i = 0; i < c->ndim; i++) n *= c->shape[i];
    d->rows = n / H, d->H = H;
    double *x = values(&seed, n, 3.0, 1.0), *g = values(&seed, H, c->zc ? 0.0 : 1.0, 0.2);
    double *b = values(&seed, H, 0.0, 0.5), *dz = values(&seed, n, 0.0, 1.0);
    d->x = calloc((size_t)n + 1, sizeof(double)), d->dz = calloc((size_t)n + 1, sizeof(double));
    d->g = calloc((size_t)H + 1, sizeof(double)), d->b = calloc((size_t)H + 1, sizeof(double));
    T->x = opf_test_make_tensor(ctx, c->ndim, c->shape, c->dt, x, d->x);
    T->dz = opf_test_make_tensor(ctx, c->ndim, c->shape, c->dt, dz, d->dz);
    T->g = opf_test_make_tensor(ctx, 1, &H, c->dt, g, d->g);
    T->b = opf_test_make_tensor(ctx, 1, &H, c->dt, b, d->b);
    d->da = NULL;
    if (c->dadd) {  /* f32, read unrounded whatever dx's dtype */
        double *da = values(&seed, n, 0.0, 0.3);
        d->da = calloc((size_t)n + 1, sizeof(double));
        T->da = opf_test_make_tensor(ctx, c->ndim, c->shape, OPF_F32, da, d->da);
        free(da);
    }
    T->z = out_tensor(ctx, c->ndim, c->shape, c->dt);
    T->dx = out_tensor(ctx, c->ndim, c->shape, c->dt);
    T->mu = out_tensor(ctx, 1, &d->rows, OPF_F32);
    T->rs = out_tensor(ctx, 1, &d->rows, OPF_F32);
    T->dg = out_tensor(ctx, 1, &H, c->dt);
    T->db = out_tensor(ctx, 1, &H, c->dt);
    free(x), free(g), free(b), free(dz);
}

static const float EPS = 1e-5f;

/* Forward and backward of case c through the table's entries. */
static void run(opf_ctx *ctx, const norm_case *c, norm_tensors *T)
{
    const opf_norm_kernels *k = opf_backend_get(OPF_DEVICE_CPU)->norm;
    switch (c->kind) {
    case K_LN:
        CHECK_OK(ctx, k->layernorm_fwd(ctx, &T->x, &T->g, &T->b, EPS, c->zc, &T->z, &T->mu, &T->rs));
        CHECK_OK(ctx, k->layernorm_bwd(ctx, &T->dz, &T->x, &T->mu, &T->rs, &T->g, c->zc,
                                       c->dadd ? &T->da : NULL, &T->dx, &T->dg, &T->db));
        break;
    case K_RMS:
        CHECK_OK(ctx, k->rmsnorm_fwd(ctx, &T->x, &T->g, EPS, c->zc, &T->z, &T->rs));
        CHECK_OK(ctx, k->rmsnorm_bwd(ctx, &T->dz, &T->x, &T->rs, &T->g, c->zc,
                                     c->dadd ? &T->da : NULL, &T->dx, &T->dg));
        break;
    default:
        CHECK_OK(ctx, k->l2norm_fwd(ctx, &T->x, EPS, &T->z, &T->rs));
        CHECK_OK(ctx, k->l2norm_bwd(ctx, &T->dz, &T->x, &T->rs, &T->dx));
    }
}

static void release(norm_tensors *T, const norm_case *c)
{
    opf_tensor *all[] = {&T->x, &T->g, &T->b, &T->dz, &T->z, &T->mu, &T->rs, &T->dx, &T->dg, &T->db};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) opf_tensor_release(all[i]);
    if (c->dadd) opf_tensor_release(&T->da);
}

/* ---- checks ------------------------------------------------------------------------ */

static void case_name(const norm_case *c, char *buf, size_t n)
{
    snprintf(buf, n, "%s %s [%lld..%lld]%s%s", KIND_NAMES[c->kind], opf_dtype_name(c->dt),
             (long long)c->shape[0], (long long)c->shape[c->ndim - 1], c->zc ? " zc" : "",
             c->dadd ? " +dadd" : "");
}

/* t holds exactly ref (fp32 values) rounded once to t's dtype. */
static void check_exact(opf_ctx *ctx, const char *name, const char *what, const opf_tensor *t,
                        const double *ref)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *f = calloc((size_t)n + 1, sizeof(float));
    opf_tensor w;
    for (int64_t i = 0; i < n; i++) f[i] = (float)ref[i];
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &t->spec, &w));
    CHECK_OK(ctx, opf_convert(f, OPF_F32, w.data[0], t->spec.dtype, (size_t)n));
    CHECK(opf_test_same_bytes(t, &w), "%s: %s differs from the fp32 twin of norm.h", name, what);
    opf_tensor_release(&w);
    free(f);
}

/* t within the dtype's tolerance of the FP64 reference ref: |t - ref| <=
 * tol * (|ref| + max|ref|), the max term for values near a cancellation. */
static void check_close(opf_ctx *ctx, const char *name, const char *what, const opf_tensor *t,
                        const double *ref)
{
    int64_t n = opf_spec_numel(&t->spec);
    double tol = t->spec.dtype == OPF_F32 ? 1e-4 : t->spec.dtype == OPF_F16 ? 4e-3 : 3e-2;
    double *v = calloc((size_t)n + 1, sizeof(double)), big = 0, worst = 0;
    opf_test_decode(ctx, t, v);
    for (int64_t i = 0; i < n; i++) big = fmax(big, fabs(ref[i]));
    for (int64_t i = 0; i < n; i++) worst = fmax(worst, fabs(v[i] - ref[i]) / (fabs(ref[i]) + big));
    CHECK(worst <= tol, "%s: %s off the FP64 reference by %g (tolerance %g)", name, what, worst, tol);
    free(v);
}

static norm_out alloc_out(const norm_data *d)
{
    int64_t n = d->rows * d->H;
    norm_out o = {calloc((size_t)n + 1, sizeof(double)), calloc((size_t)d->rows + 1, sizeof(double)),
                  calloc((size_t)d->rows + 1, sizeof(double)), calloc((size_t)n + 1, sizeof(double)),
                  calloc((size_t)d->H + 1, sizeof(double)), calloc((size_t)d->H + 1, sizeof(double))};
    return o;
}

static void free_out(norm_out *o) { free(o->z), free(o->s1), free(o->s2), free(o->dx), free(o->dg), free(o->db); }

/* The kernels against both references; the mixed-dtype check for LayerNorm/RMSNorm. */
static void check_case(opf_ctx *ctx, const norm_case *c)
{
    char name[96];
    case_name(c, name, sizeof name);
    norm_data d;
    norm_tensors T;
    make_case(ctx, c, &d, &T);
    run(ctx, c, &T);
    for (int mode = 0; mode < 2; mode++) {
        fp32 = mode == 0;
        norm_out o = alloc_out(&d);
        reference(c->kind, &d, c->zc, EPS, &o);
        void (*check)(opf_ctx *, const char *, const char *, const opf_tensor *, const double *) =
            fp32 ? check_exact : check_close;
        check(ctx, name, "z", &T.z, o.z);
        if (fp32 || d.H > 1)  /* H = 1: dx = rs * e * (1 - y^2) cancels, no FP64 check */
            check(ctx, name, "dx", &T.dx, o.dx);
        if (fp32) check(ctx, name, "rsigma", &T.rs, o.s2);
        if (fp32 && c->kind == K_LN) check(ctx, name, "mu", &T.mu, o.s1);
        if (c->kind != K_L2) check(ctx, name, "dgamma", &T.dg, o.dg);
        if (c->kind == K_LN) check(ctx, name, "dbeta", &T.db, o.db);
        free_out(&o);
    }
    release(&T, c);
    free(d.x), free(d.g), free(d.b), free(d.dz), free(d.da);
}

/* Same case on 1 and 3 threads: the same bytes everywhere. */
static void check_threads(const norm_case *c)
{
    opf_tensor outs[2][4];
    opf_ctx *ctxs[2];
    for (int i = 0; i < 2; i++) {
        opf_ctx_options o = opf_ctx_options_default();
        o.num_threads = i ? 3 : 1;
        CHECK_OK(NULL, opf_ctx_create(&o, &ctxs[i]));
        norm_data d;
        norm_tensors T;
        make_case(ctxs[i], c, &d, &T);
        run(ctxs[i], c, &T);
        opf_tensor *keep[4] = {&T.z, &T.dx, &T.dg, &T.rs};
        for (int j = 0; j < 4; j++) opf_tensor_retain(keep[j], &outs[i][j]);
        release(&T, c);
        free(d.x), free(d.g), free(d.b), free(d.dz), free(d.da);
    }
    for (int j = 0; j < 4; j++) {
        bool written = !(c->kind == K_L2 && j == 2);  /* L2 has no dgamma */
        CHECK(!written || opf_test_same_bytes(&outs[0][j], &outs[1][j]),
              "%s: output %d differs on 1 and 3 threads", KIND_NAMES[c->kind], j);
        opf_tensor_release(&outs[0][j]), opf_tensor_release(&outs[1][j]);
    }
    opf_ctx_destroy(ctxs[0]), opf_ctx_destroy(ctxs[1]);
}

/* x in f32 under a bf16 gamma gives the bytes of x rounded to bf16 first. */
static void check_mixed_dtype(opf_ctx *ctx, int kind)
{
    int64_t shape[2] = {5, 48}, H = 48, rows = 5;
    unsigned long long seed = 99;
    double *x = values(&seed, rows * H, 1.0, 1.0), *g = values(&seed, H, 1.0, 0.2);
    opf_tensor x32 = opf_test_make_tensor(ctx, 2, shape, OPF_F32, x, NULL);
    opf_tensor x16 = opf_test_make_tensor(ctx, 2, shape, OPF_BF16, x, NULL);
    opf_tensor gt = opf_test_make_tensor(ctx, 1, &H, OPF_BF16, g, NULL), z[2], mu, rs;
    mu = out_tensor(ctx, 1, &rows, OPF_F32), rs = out_tensor(ctx, 1, &rows, OPF_F32);
    const opf_norm_kernels *k = opf_backend_get(OPF_DEVICE_CPU)->norm;
    for (int i = 0; i < 2; i++) {
        z[i] = out_tensor(ctx, 2, shape, OPF_BF16);
        const opf_tensor *xi = i ? &x16 : &x32;
        if (kind == K_LN)
            CHECK_OK(ctx, k->layernorm_fwd(ctx, xi, &gt, &gt, EPS, false, &z[i], &mu, &rs));
        else
            CHECK_OK(ctx, k->rmsnorm_fwd(ctx, xi, &gt, EPS, false, &z[i], &rs));
    }
    CHECK(opf_test_same_bytes(&z[0], &z[1]), "%s: an f32 input is not rounded to gamma's bf16 first",
          KIND_NAMES[kind]);
    opf_tensor *all[] = {&x32, &x16, &gt, &z[0], &z[1], &mu, &rs};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) opf_tensor_release(all[i]);
    free(x), free(g);
}

int main(void)
{
    static const struct { int ndim; int64_t shape[3]; } shapes[] = {
        {2, {1, 1}}, {2, {3, 33}}, {2, {4, 64}}, {3, {2, 3, 40}}, {2, {130, 257}}};
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    opf_ctx *ctx;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    for (int k = 0; k < K_COUNT; k++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (size_t t = 0; t < sizeof dts / sizeof dts[0]; t++)
                for (int v = 0; v < (k == K_L2 ? 1 : 4); v++) {
                    norm_case c = {k, dts[t], shapes[s].ndim, {0}, v & 1, v >= 2};
                    memcpy(c.shape, shapes[s].shape, sizeof c.shape);
                    check_case(ctx, &c);
                }
    for (int k = 0; k < K_COUNT; k++) {
        norm_case big = {k, OPF_BF16, 2, {130, 257}, true, k != K_L2};
        check_threads(&big);
    }
    check_mixed_dtype(ctx, K_LN);
    check_mixed_dtype(ctx, K_RMS);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
