/* test_misc_ops.c: the small basic ops: identity, bias, reshape,
 * constant_scale, add_extra_input, make_extra_output, quantize and dropout.
 * Forward and backward against FP64 references written here (exact where the
 * anchor's tests are exact, numerics.md 8.3), quantized outputs bit-exact
 * against opf_quantize, finite differences of the references, fake-vs-real
 * conformance, the dropout mask (Philox mapping, zero-fraction z-test,
 * reproducibility) and bad inputs. */
#include <stdint.h>

#include "test.h"

#include "op/op-impl.h"

static opf_ctx *ctx;
static unsigned long long rng = 20240611;

static const opf_dtype dtypes[] = {OPF_F32, OPF_BF16, OPF_F16};
#define N_DTYPES 3

typedef struct tol {
    double rtol, atol;
} tol;

/* numerics.md 8.3, the dtype tolerances */
static tol dtype_tol(opf_dtype d)
{
    return d == OPF_BF16 ? (tol){1.6e-2, 1e-5} : d == OPF_F16 ? (tol){1e-3, 1e-5} : (tol){1.3e-6, 1e-5};
}

/* ---- tensors ------------------------------------------------------------------ */

/* Normal values of a scale that changes call to call, rounded to dt. */
static opf_tensor rand_tensor(int ndim, const int64_t *shape, opf_dtype dt)
{
    static const float sigmas[] = {1.0f, 0.02f, 25.0f, 3.0f};
    static int call;
    float sigma = sigmas[call++ % 4];
    opf_spec s = opf_spec_make(ndim, shape, dt);
    opf_tensor t;
    OPF_ASSERT(opf_tensor_alloc(ctx, &s, &t) == OPF_OK);
    int64_t n = opf_spec_numel(&s);
    float *f = malloc(sizeof(float) * (size_t)(n + 1));
    for (int64_t i = 0; i < n; i++) f[i] = opf_test_normal(&rng, sigma);
    OPF_ASSERT(opf_convert(f, OPF_F32, t.data[0], dt, (size_t)n) == OPF_OK);
    free(f);
    return t;
}

/* The values of a float tensor (rowwise copy of a quantized one) as doubles. */
static double *values(const opf_tensor *t)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *f = malloc(sizeof(float) * (size_t)(n + 1));
    double *d = malloc(sizeof(double) * (size_t)(n + 1));
    if (t->spec.scaling == OPF_SCALING_NONE) {
        OPF_ASSERT(opf_convert(t->data[0], t->spec.dtype, f, OPF_F32, (size_t)n) == OPF_OK);
    } else {
        opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
        opf_tensor w;
        OPF_ASSERT(opf_tensor_wrap(&s, f, &w) == OPF_OK);
        unsigned which = t->spec.usage & OPF_USAGE_ROWWISE ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE;
        OPF_ASSERT(opf_dequantize(ctx, t, which, &w) == OPF_OK);
    }
    for (int64_t i = 0; i < n; i++) d[i] = f[i];
    free(f);
    return d;
}

/* Same layout and the same bytes in every component (specs may differ in
 * shape as long as the layouts match, e.g. a reshape). */
static bool same_bytes(const opf_tensor *a, const opf_tensor *b)
{
    opf_layout la, lb;
    if (opf_spec_layout(&a->spec, &la) || opf_spec_layout(&b->spec, &lb)) return false;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (la.comp[c].present != lb.comp[c].present || la.comp[c].nbytes != lb.comp[c].nbytes)
            return false;
        if (la.comp[c].present && la.comp[c].nbytes &&
            memcmp(a->data[c], b->data[c], la.comp[c].nbytes))
            return false;
    }
    return true;
}

/* Elements with |got - ref| > atol + rtol |ref|; *worst gets the largest error. */
static int64_t n_bad(const double *got, const double *ref, int64_t n, tol t)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += !(fabs(got[i] - ref[i]) <= t.atol + t.rtol * fabs(ref[i]));
    return bad;
}

static double amax_of(const double *v, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(v[i]));
    return m;
}

/* Compares a tensor with a reference; `what` names the case on failure. */
static void check_close(const char *what, const opf_tensor *t, const double *ref, tol tl)
{
    int64_t n = opf_spec_numel(&t->spec);
    double *got = values(t);
    int64_t bad = n_bad(got, ref, n, tl);
    CHECK(bad == 0, "%s: %lld of %lld elements outside rtol %g atol %g", what, (long long)bad,
          (long long)n, tl.rtol, tl.atol);
    free(got);
}

/* ---- running one op -------------------------------------------------------------- */

static opf_status fwd(opf_op *op, const opf_tensor *x, const opf_tensor *extra,
                      const opf_quantizer *next_q, const void *kwargs, opf_op_ctx *octx,
                      opf_tensor *outs)
{
    opf_fwd_env env = {.ctx = ctx, .x = x, .next_input_q = next_q, .kwargs = kwargs,
                       .requires_grad = octx != NULL};
    env.extra_in[0] = extra;
    memset(outs, 0, sizeof(opf_tensor) * (1 + OPF_OP_MAX_EXTRA));
    return opf_op_forward(op, &env, octx, outs);
}

static opf_status bwd(opf_op *op, opf_op_ctx *octx, const opf_tensor *dy, const opf_tensor *dextra,
                      opf_tensor *dx, opf_tensor *dextra_in)
{
    opf_bwd_env env = {.ctx = ctx, .dy = dy};
    env.dextra_out[0] = dextra;
    memset(dx, 0, sizeof *dx);
    memset(dextra_in, 0, sizeof(opf_tensor) * OPF_OP_MAX_EXTRA);
    return opf_op_backward(op, octx, &env, dx, dextra_in);
}

/* For runners whose outputs must be distinct memory (a torch op's): the
 * impl of a class that hands its input on (forward_is_input /
 * backward_is_dy) still writes every present output of its fake as a copy
 * of the input, byte for byte, into its own memory. Run on the args of the
 * op's last call in that direction. */
static void impl_copies_input(opf_op *op, bool backward, const opf_tensor *in, const char *what)
{
    const opf_op_class *c = opf_op_class_of(op);
    CHECK(backward ? c->backward_is_dy : c->forward_is_input, "%s: class hands its input on", what);
    opf_spec s[OPF_OP_MAX_GRADS];
    for (int i = 0; i < OPF_OP_MAX_GRADS; i++) s[i].ndim = OPF_SPEC_NONE_NDIM;
    int n = backward ? 1 + opf_op_num_params(op) + c->n_extra_in : 1 + c->n_extra_out;
    CHECK_OK(ctx, backward ? c->backward_fake(op->bwd_args, s)
                           : c->forward_fake(op->fwd_args, s, s + 1 + OPF_OP_MAX_EXTRA));
    opf_tensor t[OPF_OP_MAX_GRADS];
    memset(t, 0, sizeof t);
    int present = 0;
    for (int i = 0; i < n; i++) {
        if (s[i].ndim < 0) continue;
        s[i].device = in->spec.device;
        CHECK_OK(ctx, opf_tensor_alloc(ctx, &s[i], &t[i]));
        present++;
    }
    opf_tensor aux[OPF_OP_MAX_AUX];
    memset(aux, 0, sizeof aux);
    CHECK_OK(ctx, backward ? c->backward_impl(ctx, op->bwd_args, t)
                           : c->forward_impl(ctx, op->fwd_args, t, aux));
    for (int i = 0; i < n; i++) {
        if (s[i].ndim < 0) continue;
        CHECK(same_bytes(&t[i], in) && t[i].data[0] != in->data[0],
              "%s: the impl's output %d is not a copy of the input", what, i);
        opf_tensor_release(&t[i]);
    }
    CHECK(present > 0, "%s: the fake describes an output", what);
}

static void release_n(opf_tensor *t, int n)
{
    for (int i = 0; i < n; i++) opf_tensor_release(&t[i]);
}

static opf_op *make_op(const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    OPF_ASSERT(op);
    return op;
}

/* ---- fake vs real conformance ------------------------------------------------------ */

/* A copy of resolved args with every tensor's data dropped. */
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

/* After a real forward: the fake on data-free args gives the real specs. */
static void conform_fwd(opf_op *op, const opf_tensor *outs, const opf_tensor *aux, int n_aux)
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char buf[OPF_OP_ARGS_MAX];
    strip_data(c->fwd_schema, op->fwd_args, buf);
    opf_spec os[1 + OPF_OP_MAX_EXTRA], as[OPF_OP_MAX_AUX];
    none_specs(os, 1 + OPF_OP_MAX_EXTRA);
    none_specs(as, OPF_OP_MAX_AUX);
    CHECK_OK(NULL, c->forward_fake(buf, os, as));
    for (int i = 0; i < 1 + c->n_extra_out; i++)
        CHECK(opf_spec_equal(&os[i], &outs[i].spec), "%s: fake output %d differs", c->name, i);
    int n_fake_aux = 0;
    for (int i = 0; i < OPF_OP_MAX_AUX; i++) n_fake_aux += as[i].ndim >= 0;
    CHECK(n_fake_aux == n_aux, "%s: fake has %d aux, real %d", c->name, n_fake_aux, n_aux);
    for (int i = 0; i < n_aux && i < OPF_OP_MAX_AUX; i++)
        CHECK(opf_spec_equal(&as[i], &aux[i].spec), "%s: fake aux %d differs", c->name, i);
}

/* After a real backward: the fake's dx / parameter / extra gradients. */
static void conform_bwd(opf_op *op, const opf_tensor *dy, const opf_tensor *dx,
                        const opf_tensor *dextra_in)
{
    const opf_op_class *c = opf_op_class_of(op);
    _Alignas(16) unsigned char buf[OPF_OP_ARGS_MAX];
    strip_data(c->bwd_schema, op->bwd_args, buf);
    int np = opf_op_num_params(op), n = 1 + np + c->n_extra_in;
    opf_spec gs[1 + OPF_OP_MAX_PARAMS + OPF_OP_MAX_EXTRA];
    none_specs(gs, n);
    CHECK_OK(NULL, c->backward_fake(buf, gs));
    if (gs[0].ndim == OPF_GRAD_PASSTHROUGH)
        CHECK(dx->data[0] == dy->data[0], "%s: fake passes dy through, real dx is new", c->name);
    else
        CHECK(opf_spec_equal(&gs[0], &dx->spec) && dx->data[0] != dy->data[0],
              "%s: fake dx differs", c->name);
    for (int i = 0; i < np; i++)
        CHECK(gs[1 + i].ndim < 0 || opf_spec_equal(&gs[1 + i], &opf_op_param(op, i)->grad.spec),
              "%s: fake grad of param %d differs", c->name, i);
    for (int i = 0; i < c->n_extra_in; i++) {
        const opf_spec *g = &gs[1 + np + i];
        CHECK(g->ndim < 0 ? !dextra_in[i].data[0] : opf_spec_equal(g, &dextra_in[i].spec),
              "%s: fake grad of extra input %d differs", c->name, i);
    }
}

/* ---- FP64 references and their finite differences ------------------------------------ */
/* Each reference maps n_in stacked inputs of n elements to n_out stacked
 * outputs; its backward maps the outputs' gradients to the inputs'. */

typedef struct dropout_ref {
    const uint8_t *mask;
    double         keep_scale;  /* 1 / (1 - p) */
} dropout_ref;

static void scale_f(const double *in, int64_t n, const void *p, double *out)
{
    for (int64_t i = 0; i < n; i++) out[i] = *(const double *)p * in[i];
}
static void scale_b(const double *in, const double *dout, int64_t n, const void *p, double *din)
{
    for (int64_t i = 0; i < n; i++) din[i] = *(const double *)p * dout[i];
}
static void add_f(const double *in, int64_t n, const void *p, double *out)
{
    for (int64_t i = 0; i < n; i++) out[i] = in[i] + in[n + i];
}
static void add_b(const double *in, const double *dout, int64_t n, const void *p, double *din)
{
    for (int64_t i = 0; i < n; i++) din[i] = din[n + i] = dout[i];
}
static void make_f(const double *in, int64_t n, const void *p, double *out)
{
    for (int64_t i = 0; i < n; i++) out[i] = out[n + i] = in[i];
}
static void make_b(const double *in, const double *dout, int64_t n, const void *p, double *din)
{
    for (int64_t i = 0; i < n; i++) din[i] = dout[i] + dout[n + i];
}
static void drop_f(const double *in, int64_t n, const void *p, double *out)
{
    const dropout_ref *d = p;
    for (int64_t i = 0; i < n; i++) out[i] = in[i] * d->mask[i] * d->keep_scale;
}
static void drop_b(const double *in, const double *dout, int64_t n, const void *p, double *din)
{
    const dropout_ref *d = p;
    for (int64_t i = 0; i < n; i++) din[i] = dout[i] * d->mask[i] * d->keep_scale;
}

typedef void (*ref_fwd_fn)(const double *in, int64_t n, const void *p, double *out);
typedef void (*ref_bwd_fn)(const double *in, const double *dout, int64_t n, const void *p, double *din);

/* Central differences of L = sum(w * f(in)) against the reference backward. */
static void fd_check(const char *name, ref_fwd_fn f, ref_bwd_fn b, int n_in, int n_out, const void *p)
{
    enum { N = 64 };
    double in[2 * N], w[2 * N], out[2 * N], din[2 * N];
    for (int i = 0; i < n_in * N; i++) in[i] = opf_test_normal(&rng, 2.0f);
    for (int i = 0; i < n_out * N; i++) w[i] = opf_test_normal(&rng, 1.0f);
    b(in, w, N, p, din);
    const double h = 1e-4;
    int bad = 0;
    for (int i = 0; i < n_in * N; i++) {
        double keep = in[i], lp = 0, lm = 0;
        in[i] = keep + h;
        f(in, N, p, out);
        for (int k = 0; k < n_out * N; k++) lp += w[k] * out[k];
        in[i] = keep - h;
        f(in, N, p, out);
        for (int k = 0; k < n_out * N; k++) lm += w[k] * out[k];
        in[i] = keep;
        double fd = (lp - lm) / (2 * h);
        bad += !(fabs(fd - din[i]) <= 1e-6 * (1 + fabs(din[i])));
    }
    CHECK(bad == 0, "%s: %d finite-difference mismatches", name, bad);
}

static void test_finite_differences(void)
{
    double s = -1.75;
    fd_check("constant_scale", scale_f, scale_b, 1, 1, &s);
    fd_check("add_extra_input", add_f, add_b, 2, 1, NULL);
    fd_check("make_extra_output", make_f, make_b, 1, 2, NULL);
    uint8_t mask[64];
    for (int i = 0; i < 64; i++) mask[i] = (opf_test_rand_u64(&rng) & 3) != 0;
    dropout_ref d = {mask, 1.0 / (1.0 - 0.25)};
    fd_check("dropout (fixed mask)", drop_f, drop_b, 1, 1, &d);
}

/* ---- quantizers of the output (recipe of the next op) --------------------------------- */

typedef enum recipe { R_NONE, R_DELAYED, R_CURRENT, R_BLOCK, R_MXFP8, R_NVFP4, R_COUNT } recipe;
static const char *const recipe_names[R_COUNT] = {"none", "delayed", "current", "block", "mxfp8",
                                                  "nvfp4"};
_Static_assert(sizeof recipe_names / sizeof recipe_names[0] == R_COUNT, "recipe names");

/* A quantizer of recipe r; a delayed one reads a power-of-two scale that
 * fits amax from slot 0 of st (what an earlier step would have left). */
static opf_quantizer make_q(recipe r, opf_delayed_state *st, double amax)
{
    opf_quantizer q = opf_quantizer_default();
    switch (r) {
    case R_DELAYED:
        q.scaling = OPF_SCALING_TENSOR;
        q.delayed = st;
        q.slot = 0;
        opf_delayed_state_scale(st)[0] = (float)exp2(floor(log2(448.0 / (amax > 0 ? amax : 1))));
        break;
    case R_CURRENT: q.scaling = OPF_SCALING_TENSOR; break;
    case R_BLOCK: q.scaling = OPF_SCALING_BLOCK_1D; q.pow2_scales = true; break;
    case R_MXFP8: q.scaling = OPF_SCALING_MXFP8; break;
    case R_NVFP4: q.scaling = OPF_SCALING_NVFP4_1D; q.qdtype = OPF_E2M1; break;
    default: break;
    }
    return q;
}

/* numerics.md 8.3, the quantization tolerances, atol scaled by the tensor's amax. */
static tol quant_tol(opf_scaling s, double amax)
{
    bool fp4 = s == OPF_SCALING_NVFP4_1D || s == OPF_SCALING_NVFP4_2D;
    return fp4 ? (tol){0.25, 0.125 * amax} : (tol){0.125, 0.0675 * amax};
}

/* A quantized output: close to the reference, and bit-exact with
 * quantizing the fp32 values y32 as the store rule says (delayed: from fp32;
 * others: rounded to the activation dtype first, numerics.md 6.1/6.3). */
static void check_quantized_out(const char *what, const opf_tensor *out, const double *ref,
                                const float *y32, opf_dtype act, const opf_quantizer *q)
{
    int64_t n = opf_spec_numel(&out->spec);
    check_close(what, out, ref, quant_tol(q->scaling, amax_of(ref, n)));
    float *v = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++)
        v[i] = q->delayed || act == OPF_F32 ? y32[i]
             : act == OPF_BF16 ? opf_bf16_to_f32(opf_f32_to_bf16(y32[i]))
                               : opf_f16_to_f32(opf_f32_to_f16(y32[i]));
    opf_spec s = opf_spec_make(out->spec.ndim, out->spec.shape, OPF_F32);
    opf_tensor in, want;
    OPF_ASSERT(opf_tensor_wrap(&s, v, &in) == OPF_OK);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, q, &in, &want));
    CHECK(same_bytes(out, &want), "%s: quantized output differs from opf_quantize of its values", what);
    opf_tensor_release(&want);
    free(v);
}

/* ---- identity ------------------------------------------------------------------------ */

static void test_identity(void)
{
    opf_op *op = make_op("identity", NULL, "id");
    int64_t shape[3] = {2, 32, 64};
    for (int d = 0; d < N_DTYPES; d++) {
        opf_tensor x = rand_tensor(3, shape, dtypes[d]), dy = rand_tensor(3, shape, dtypes[d]);
        opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
        opf_op_ctx octx = {0};
        CHECK_OK(ctx, fwd(op, &x, NULL, NULL, NULL, &octx, outs));
        CHECK(same_bytes(&outs[0], &x) && opf_spec_equal(&outs[0].spec, &x.spec) &&
              outs[0].data[0] != x.data[0], "identity %s: y is not a copy of x",
              opf_dtype_name(dtypes[d]));
        conform_fwd(op, outs, NULL, 0);
        CHECK_OK(ctx, bwd(op, &octx, &dy, NULL, &dx, dex));
        CHECK(same_bytes(&dx, &dy), "identity: dx != dy");
        conform_bwd(op, &dy, &dx, dex);
        /* a quantized input stays quantized, byte for byte */
        opf_quantizer q = make_q(R_MXFP8, NULL, 0);
        opf_tensor xq;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));
        opf_tensor_release(&outs[0]);
        CHECK_OK(ctx, fwd(op, &xq, NULL, NULL, NULL, NULL, outs));
        CHECK(same_bytes(&outs[0], &xq) && opf_spec_equal(&outs[0].spec, &xq.spec),
              "identity: quantized input not copied exactly");
        release_n(outs, 1);
        opf_tensor_release(&xq);
        opf_tensor_release(&dx);
        opf_tensor_release(&x);
        opf_tensor_release(&dy);
    }
    opf_op_destroy(op);
}

/* ---- bias ------------------------------------------------------------------------------ */

static void test_bias_fd(void)
{
    enum { R = 5, H = 7 };
    double x[R * H], b[H], w[R * H], db[H] = {0};
    for (int i = 0; i < R * H; i++) x[i] = opf_test_normal(&rng, 1), w[i] = opf_test_normal(&rng, 1);
    for (int j = 0; j < H; j++) b[j] = opf_test_normal(&rng, 1);
    for (int i = 0; i < R * H; i++) db[i % H] += w[i];  /* reference: db = sum over rows of dy */
    int bad = 0;
    const double h = 1e-4;
    for (int j = 0; j < H; j++) {
        double l[2] = {0, 0};
        for (int sgn = 0; sgn < 2; sgn++)
            for (int i = 0; i < R * H; i++)
                l[sgn] += w[i] * (x[i] + b[i % H] + (i % H == j ? (sgn ? -h : h) : 0));
        bad += fabs((l[0] - l[1]) / (2 * h) - db[j]) > 1e-6 * (1 + fabs(db[j]));
    }
    CHECK(bad == 0, "bias: %d finite-difference mismatches of db", bad);
}

/* A column sum of `terms` fp32 values in any order is within (terms - 1) u
 * sum|t| of the exact sum (u = 2^-24); then it is rounded to t's dtype. */
static void check_colsum(const char *what, const opf_tensor *t, const double *ref,
                         const double *abssum, int64_t terms)
{
    int64_t n = opf_spec_numel(&t->spec), bad = 0;
    double *got = values(t), rtol = dtype_tol(t->spec.dtype).rtol;
    for (int64_t j = 0; j < n; j++) {
        double err = (double)(terms - 1) * 0x1p-24 * abssum[j];
        bad += !(fabs(got[j] - ref[j]) <= err + rtol * (fabs(ref[j]) + err));
    }
    CHECK(bad == 0, "%s: %lld of %lld column sums outside the summation bound", what,
          (long long)bad, (long long)n);
    free(got);
}

static void test_bias(void)
{
    int64_t shape[3] = {2, 16, 64}, n = 2 * 16 * 64, H = 64;
    for (int d = 0; d < N_DTYPES; d++)
        for (int r = 0; r < R_COUNT; r++) {
            opf_dtype dt = dtypes[d];
            opf_bias_config cfg = {.size = H, .dtype = dt};
            opf_op *op = make_op("bias", &cfg, "b1");
            opf_tensor bv = rand_tensor(1, &H, dt);
            opf_param *pb = opf_op_param(op, 0);
            opf_layout L;
            opf_spec_layout(&bv.spec, &L);
            memcpy(pb->value.data[0], bv.data[0], L.comp[0].nbytes);
            opf_tensor x = rand_tensor(3, shape, dt), dy = rand_tensor(3, shape, dt);
            double *xv = values(&x), *bvals = values(&bv), *dyv = values(&dy);
            double *ref = malloc(sizeof(double) * (size_t)n), dbref[64] = {0}, dbabs[64] = {0};
            float *y32 = malloc(sizeof(float) * (size_t)n);
            for (int64_t i = 0; i < n; i++) {
                ref[i] = xv[i] + bvals[i % H];
                y32[i] = (float)xv[i] + (float)bvals[i % H];
                dbref[i % H] += dyv[i];
                dbabs[i % H] += fabs(dyv[i]);
            }
            opf_delayed_state *ds = NULL;
            opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, 8, OPF_AMAX_MAX, false, 1, &ds);
            opf_quantizer q = make_q((recipe)r, ds, amax_of(ref, n));
            char what[96];
            snprintf(what, sizeof what, "bias %s next=%s", opf_dtype_name(dt), recipe_names[r]);
            opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
            opf_op_ctx octx = {0};
            CHECK_OK(ctx, fwd(op, &x, NULL, r ? &q : NULL, NULL, &octx, outs));
            if (r == R_NONE) check_close(what, &outs[0], ref, dtype_tol(dt));
            else check_quantized_out(what, &outs[0], ref, y32, dt, &q);
            conform_fwd(op, outs, NULL, 0);
            CHECK_OK(ctx, bwd(op, &octx, &dy, NULL, &dx, dex));
            CHECK(dx.data[0] == dy.data[0], "%s: dx is not dy passed through", what);
            CHECK(pb->has_grad, "%s: no bias gradient", what);
            check_colsum(what, &pb->grad, dbref, dbabs, n / H);
            conform_bwd(op, &dy, &dx, dex);
            release_n(outs, 1);
            opf_tensor_release(&dx);
            opf_tensor_release(&x);
            opf_tensor_release(&dy);
            opf_tensor_release(&bv);
            free(xv), free(bvals), free(dyv), free(ref), free(y32);
            opf_delayed_state_destroy(ds);
            opf_op_destroy(op);
        }
    test_bias_fd();
}

/* ---- reshape ---------------------------------------------------------------------------- */

typedef struct reshape_case {
    int     in_ndim;
    int64_t in[OPF_MAX_DIMS];
    int     ndim;
    int64_t shape[OPF_MAX_DIMS];
    int64_t want[OPF_MAX_DIMS];  /* the resolved shape */
} reshape_case;

static const reshape_case reshape_cases[] = {
    {3, {2, 3, 4}, 2, {6, -1}, {6, 4}},
    {2, {4, 6}, 1, {-1}, {24}},
    {2, {4, 6}, 3, {2, 2, 6}, {2, 2, 6}},
    {1, {24}, 3, {1, 24, 1}, {1, 24, 1}},
    {8, {1, 2, 1, 3, 1, 2, 1, 5}, 2, {-1, 5}, {12, 5}},
    {2, {12, 5}, 8, {1, 2, 1, 3, 1, 2, 1, 5}, {1, 2, 1, 3, 1, 2, 1, 5}},
    {1, {1}, 0, {0}, {0}},
};
#define N_RESHAPE ((int)(sizeof reshape_cases / sizeof reshape_cases[0]))

static void run_reshape_case(const reshape_case *rc, opf_dtype dt)
{
    opf_reshape_config cfg = {.ndim = rc->ndim};
    memcpy(cfg.shape, rc->shape, sizeof cfg.shape);
    opf_op *op = make_op("reshape", &cfg, "rs");
    opf_tensor x = rand_tensor(rc->in_ndim, rc->in, dt);
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
    opf_op_ctx octx = {0};
    CHECK_OK(ctx, fwd(op, &x, NULL, NULL, NULL, &octx, outs));
    opf_spec want = opf_spec_make(rc->ndim, rc->want, dt);
    CHECK(opf_spec_equal(&outs[0].spec, &want) && same_bytes(&outs[0], &x),
          "reshape %d-d -> %d-d %s: wrong view", rc->in_ndim, rc->ndim, opf_dtype_name(dt));
    conform_fwd(op, outs, NULL, 0);
    opf_tensor dy = rand_tensor(rc->ndim, rc->want, dt);
    CHECK_OK(ctx, bwd(op, &octx, &dy, NULL, &dx, dex));
    CHECK(opf_spec_equal(&dx.spec, &x.spec) && same_bytes(&dx, &dy),
          "reshape %d-d backward: dx is not dy viewed with the input shape", rc->in_ndim);
    conform_bwd(op, &dy, &dx, dex);
    release_n(outs, 1);
    opf_tensor_release(&dx);
    opf_tensor_release(&dy);
    opf_tensor_release(&x);
    opf_op_destroy(op);
}

/* Quantized tensors reshape only when the last dim stays. */
static void test_reshape_quantized(void)
{
    int64_t shape[3] = {2, 32, 64};
    opf_tensor x = rand_tensor(3, shape, OPF_BF16), xq;
    for (int r = R_DELAYED; r < R_COUNT; r++) {
        opf_delayed_state *ds = NULL;
        opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, 8, OPF_AMAX_MAX, false, 1, &ds);
        opf_quantizer q = make_q((recipe)r, ds, 30.0);
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xq));
        opf_reshape_config keep = {.ndim = 2, .shape = {-1, 64}}, change = {.ndim = 2, .shape = {32, 128}};
        opf_op *ok = make_op("reshape", &keep, "rs_keep"), *bad = make_op("reshape", &change, "rs_bad");
        opf_tensor outs[1 + OPF_OP_MAX_EXTRA], nouts[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
        opf_op_ctx octx = {0};
        CHECK_OK(ctx, fwd(ok, &xq, NULL, NULL, NULL, &octx, outs));
        CHECK(same_bytes(&outs[0], &xq) && outs[0].spec.ndim == 2 && outs[0].spec.shape[0] == 64 &&
              outs[0].spec.scaling == xq.spec.scaling, "reshape of %s input: bytes or spec differ",
              recipe_names[r]);
        conform_fwd(ok, outs, NULL, 0);
        CHECK_OK(ctx, bwd(ok, &octx, &outs[0], NULL, &dx, dex));  /* a quantized dy */
        CHECK(same_bytes(&dx, &xq) && opf_spec_equal(&dx.spec, &xq.spec),
              "reshape of %s gradient: bytes or spec differ", recipe_names[r]);
        CHECK_FAILS(ctx, fwd(bad, &xq, NULL, NULL, NULL, NULL, nouts), OPF_ERR_SHAPE,
                    "reshape \"rs_bad\"", "quantized", "[2,32,64]", "[32,128]");
        release_n(outs, 1);
        opf_tensor_release(&dx);
        opf_tensor_release(&xq);
        opf_op_destroy(ok);
        opf_op_destroy(bad);
        opf_delayed_state_destroy(ds);
    }
    opf_tensor_release(&x);
}

static void test_reshape(void)
{
    for (int c = 0; c < N_RESHAPE; c++)
        for (int d = 0; d < N_DTYPES; d++) run_reshape_case(&reshape_cases[c], dtypes[d]);
    test_reshape_quantized();
}

/* ---- constant_scale ---------------------------------------------------------------------- */

static void run_scale_case(double s, opf_dtype dt, recipe r, bool quantized_in)
{
    opf_constant_scale_config cfg = {.scale = s};
    opf_op *op = make_op("constant_scale", &cfg, "cs");
    int64_t shape[3] = {2, 32, 64}, n = 2 * 32 * 64;
    opf_tensor x = rand_tensor(3, shape, dt), dy = rand_tensor(3, shape, dt), xin = x;
    if (quantized_in) {
        opf_quantizer q = make_q(R_CURRENT, NULL, 0);
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xin));
    }
    double *xv = values(&xin), *dyv = values(&dy);
    double *ref = malloc(sizeof(double) * (size_t)n), *dref = malloc(sizeof(double) * (size_t)n);
    float *y32 = malloc(sizeof(float) * (size_t)n);
    scale_f(xv, n, &s, ref);
    scale_b(xv, dyv, n, &s, dref);
    for (int64_t i = 0; i < n; i++) y32[i] = (float)s * (float)xv[i];
    opf_delayed_state *ds = NULL;
    opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, 8, OPF_AMAX_MAX, false, 1, &ds);
    opf_quantizer q = make_q(r, ds, amax_of(ref, n));
    char what[96];
    snprintf(what, sizeof what, "constant_scale %g %s%s next=%s", s, opf_dtype_name(dt),
             quantized_in ? " (fp8 input)" : "", recipe_names[r]);
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
    opf_op_ctx octx = {0};
    CHECK_OK(ctx, fwd(op, &xin, NULL, r ? &q : NULL, NULL, &octx, outs));
    if (r == R_NONE) check_close(what, &outs[0], ref, dtype_tol(dt));
    else check_quantized_out(what, &outs[0], ref, y32, dt, &q);
    conform_fwd(op, outs, NULL, 0);
    CHECK_OK(ctx, bwd(op, &octx, &dy, NULL, &dx, dex));
    check_close(what, &dx, dref, dtype_tol(dt));
    conform_bwd(op, &dy, &dx, dex);
    release_n(outs, 1);
    opf_tensor_release(&dx);
    if (quantized_in) opf_tensor_release(&xin);
    opf_tensor_release(&x);
    opf_tensor_release(&dy);
    free(xv), free(dyv), free(ref), free(dref), free(y32);
    opf_delayed_state_destroy(ds);
    opf_op_destroy(op);
}

static void test_constant_scale(void)
{
    const double scales[] = {0.5, -3.7, 1e-3};
    for (int d = 0; d < N_DTYPES; d++)
        for (int r = 0; r < R_COUNT; r++)
            for (int k = 0; k < 3; k++) run_scale_case(scales[k], dtypes[d], (recipe)r, false);
    run_scale_case(2.5, OPF_BF16, R_NONE, true);
}

/* ---- add_extra_input ------------------------------------------------------------------------ */

static void run_add_case(opf_dtype dx_t, opf_dtype de_t, const opf_inplace_config *cfg)
{
    opf_op *op = make_op("add_extra_input", cfg, "add");
    int64_t shape[2] = {48, 40}, n = 48 * 40;
    opf_tensor x = rand_tensor(2, shape, dx_t), e = rand_tensor(2, shape, de_t);
    opf_tensor dy = rand_tensor(2, shape, dx_t);
    double *xe = malloc(sizeof(double) * (size_t)(2 * n)), *ref = malloc(sizeof(double) * (size_t)n);
    double *xv = values(&x), *ev = values(&e);
    memcpy(xe, xv, sizeof(double) * (size_t)n);
    memcpy(xe + n, ev, sizeof(double) * (size_t)n);
    add_f(xe, n, NULL, ref);
    bool in_place = cfg && cfg->in_place;
    opf_dtype out_t = in_place ? de_t : dx_t;
    char what[96];
    snprintf(what, sizeof what, "add_extra_input %s + %s%s", opf_dtype_name(dx_t),
             opf_dtype_name(de_t), cfg ? (in_place ? " in place" : "") : " (NULL config)");
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
    opf_op_ctx octx = {0};
    CHECK_OK(ctx, fwd(op, &x, &e, NULL, NULL, &octx, outs));
    CHECK(outs[0].spec.dtype == out_t, "%s: output dtype %s", what, opf_dtype_name(outs[0].spec.dtype));
    /* one fp32 add then one rounding: the output dtype's tolerance */
    check_close(what, &outs[0], ref, dtype_tol(out_t));
    conform_fwd(op, outs, NULL, 0);
    CHECK_OK(ctx, bwd(op, &octx, &dy, NULL, &dx, dex));
    CHECK(dx.data[0] == dy.data[0], "%s: dx is not dy passed through", what);
    /* backward_is_dy: the runner hands dy itself on (no copy, no kernel) */
    CHECK(dex[0].data[0] == dy.data[0] && opf_spec_equal(&dex[0].spec, &dy.spec),
          "%s: d(extra) is not dy handed on", what);
    impl_copies_input(op, true, &dy, what);
    conform_bwd(op, &dy, &dx, dex);
    release_n(outs, 1);
    opf_tensor_release(&dx);
    release_n(dex, 1);
    opf_tensor_release(&x);
    opf_tensor_release(&e);
    opf_tensor_release(&dy);
    free(xe), free(ref), free(xv), free(ev);
    opf_op_destroy(op);
}

static void test_add_extra_input(void)
{
    opf_inplace_config off = {false}, on = {true};
    for (int a = 0; a < N_DTYPES; a++)
        for (int b = 0; b < N_DTYPES; b++) {
            run_add_case(dtypes[a], dtypes[b], &off);
            run_add_case(dtypes[a], dtypes[b], &on);
        }
    run_add_case(OPF_BF16, OPF_BF16, NULL);
    opf_op *op = make_op("add_extra_input", NULL, "add0");
    CHECK(((const opf_inplace_config *)opf_op_config(op))->in_place == false,
          "a NULL config must mean not in place");
    opf_op_destroy(op);
}

/* ---- make_extra_output ------------------------------------------------------------------------ */

static void run_make_case(opf_dtype dt, bool with_dextra, bool quantized_in)
{
    opf_inplace_config cfg = {with_dextra};
    opf_op *op = make_op("make_extra_output", with_dextra ? &cfg : NULL, "mk");
    int64_t shape[3] = {4, 16, 32}, n = 4 * 16 * 32;
    opf_tensor x = rand_tensor(3, shape, dt), xin = x;
    if (quantized_in) {
        opf_quantizer q = make_q(R_MXFP8, NULL, 0);
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &xin));
    }
    opf_tensor dy = rand_tensor(3, shape, dt), de = rand_tensor(3, shape, dt);
    double *dd = malloc(sizeof(double) * (size_t)(2 * n)), *ref = malloc(sizeof(double) * (size_t)n);
    double *dyv = values(&dy), *dev = values(&de);
    memcpy(dd, dyv, sizeof(double) * (size_t)n);
    memcpy(dd + n, dev, sizeof(double) * (size_t)n);
    make_b(NULL, dd, n, NULL, ref);
    char what[96];
    snprintf(what, sizeof what, "make_extra_output %s%s%s", opf_dtype_name(dt),
             with_dextra ? " with d(extra)" : "", quantized_in ? " (mxfp8 input)" : "");
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
    opf_op_ctx octx = {0};
    CHECK_OK(ctx, fwd(op, &xin, NULL, NULL, NULL, &octx, outs));
    /* forward_is_input: the runner hands x itself on for both (no copy, no kernel) */
    for (int k = 0; k < 2; k++)
        CHECK(opf_spec_equal(&outs[k].spec, &xin.spec) && outs[k].data[0] == xin.data[0] &&
              outs[k].data[OPF_COMP_COL_DATA] == xin.data[OPF_COMP_COL_DATA],
              "%s: output %d is not x handed on", what, k);
    impl_copies_input(op, false, &xin, what);
    if (!quantized_in) {  /* caller memory (no counted buffer): copies that own their memory */
        opf_tensor w, wo[1 + OPF_OP_MAX_EXTRA];
        CHECK_OK(ctx, opf_tensor_wrap(&x.spec, x.data[0], &w));
        CHECK_OK(ctx, fwd(op, &w, NULL, NULL, NULL, NULL, wo));
        for (int k = 0; k < 2; k++)
            CHECK(wo[k].buf && wo[k].data[0] != x.data[0] && same_bytes(&wo[k], &x),
                  "%s: output %d over wrapped memory is not a copy", what, k);
        release_n(wo, 2);
    }
    conform_fwd(op, outs, NULL, 0);
    CHECK_OK(ctx, bwd(op, &octx, &dy, with_dextra ? &de : NULL, &dx, dex));
    if (with_dextra) check_close(what, &dx, ref, dtype_tol(dt));
    else CHECK(dx.data[0] == dy.data[0], "%s: without d(extra), dy must pass through", what);
    conform_bwd(op, &dy, &dx, dex);
    release_n(outs, 2);
    opf_tensor_release(&dx);
    if (quantized_in) opf_tensor_release(&xin);
    opf_tensor_release(&x);
    opf_tensor_release(&dy);
    opf_tensor_release(&de);
    free(dd), free(ref), free(dyv), free(dev);
    opf_op_destroy(op);
}

static void test_make_extra_output(void)
{
    for (int d = 0; d < N_DTYPES; d++) {
        run_make_case(dtypes[d], false, false);
        run_make_case(dtypes[d], true, false);
    }
    run_make_case(OPF_BF16, true, true);
}

/* ---- quantize ----------------------------------------------------------------------------------- */

typedef struct qrecipe {
    const char     *name;
    opf_recipe_kind kind;
    bool            nvfp4_extras;  /* RHT and stochastic rounding on */
} qrecipe;

static const qrecipe qrecipes[] = {
    {"none", OPF_RECIPE_NONE, false},       {"delayed", OPF_RECIPE_DELAYED, false},
    {"current", OPF_RECIPE_CURRENT, false}, {"block", OPF_RECIPE_BLOCK, false},
    {"mxfp8", OPF_RECIPE_MXFP8, false},     {"nvfp4", OPF_RECIPE_NVFP4, false},
    {"nvfp4+rht+sr", OPF_RECIPE_NVFP4, true},
};
#define N_QRECIPES ((int)(sizeof qrecipes / sizeof qrecipes[0]))

static opf_recipe recipe_of(const qrecipe *qr)
{
    opf_recipe r = opf_recipe_default(qr->kind);
    if (qr->kind == OPF_RECIPE_DELAYED) r.amax_history_len = 8;
    if (qr->kind == OPF_RECIPE_NVFP4) r.nvfp4_rht = r.nvfp4_stochastic = qr->nvfp4_extras;
    return r;
}

/* The op's output equals opf_quantize with the op's own quantizer (the RNG
 * rewound for stochastic rounding), or a copy of the input when off. */
static void check_quantize_dir(const char *what, const opf_tensor *got, const opf_tensor *in,
                               const opf_quantizer *q, uint64_t seed, uint64_t offset)
{
    if (!q) {
        CHECK(same_bytes(got, in) && opf_spec_equal(&got->spec, &in->spec), "%s: not the identity", what);
        return;
    }
    uint64_t s_after, o_after;
    opf_ctx_get_rng(ctx, &s_after, &o_after);
    opf_ctx_set_rng(ctx, seed, offset);
    opf_tensor want;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, q, in, &want));
    uint64_t o_ref;
    opf_ctx_get_rng(ctx, NULL, &o_ref);
    CHECK(o_ref == o_after, "%s: RNG offset %llu after the op, %llu after opf_quantize", what,
          (unsigned long long)o_after, (unsigned long long)o_ref);
    CHECK(same_bytes(got, &want) && opf_spec_equal(&got->spec, &want.spec),
          "%s: differs from opf_quantize", what);
    double *ref = values(in);
    int64_t n = opf_spec_numel(&in->spec);
    check_close(what, got, ref, quant_tol(q->scaling, amax_of(ref, n)));
    free(ref);
    opf_tensor_release(&want);
}

static void run_quantize_case(const qrecipe *qr, opf_dtype dt, const opf_quantize_config *cfg)
{
    opf_op *op = make_op("quantize", cfg, "qz");
    opf_recipe rec = recipe_of(qr);
    CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, qr->kind ? &rec : NULL));
    bool f_on = cfg ? cfg->forward : true, b_on = cfg ? cfg->backward : false;
    const opf_quantizer *q0 = opf_op_quantizer(op, OPF_ROLE_INPUT, 0);
    opf_quantizer qin = q0 ? *q0 : opf_quantizer_default();
    const opf_quantizer *g0 = opf_op_quantizer(op, OPF_ROLE_GRAD_OUTPUT, 0);
    opf_quantizer qgrad = g0 ? *g0 : opf_quantizer_default();
    bool fq = f_on && q0, bq = b_on && g0;
    const opf_op_class *c = opf_op_class_of(op);
    const opf_quantizer *hi = c->input_quantizer(op), *hg = c->grad_output_quantizer(op);
    char what[96];
    snprintf(what, sizeof what, "quantize %s %s fwd=%d bwd=%d", qr->name, opf_dtype_name(dt), f_on, b_on);
    CHECK(fq ? hi && opf_quantizer_equal(hi, &qin) : !hi, "%s: input_quantizer hook", what);
    CHECK(bq ? hg && opf_quantizer_equal(hg, &qgrad) : !hg, "%s: grad_output_quantizer hook", what);

    int64_t shape[3] = {2, 32, 64};
    opf_tensor x = rand_tensor(3, shape, dt), dy = rand_tensor(3, shape, dt);
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
    opf_op_ctx octx = {0};
    uint64_t seed, off;
    opf_ctx_get_rng(ctx, &seed, &off);
    CHECK_OK(ctx, fwd(op, &x, NULL, NULL, NULL, &octx, outs));
    check_quantize_dir(what, &outs[0], &x, fq ? &qin : NULL, seed, off);
    conform_fwd(op, outs, NULL, 0);
    opf_ctx_get_rng(ctx, &seed, &off);
    CHECK_OK(ctx, bwd(op, &octx, &dy, NULL, &dx, dex));
    if (bq) check_quantize_dir(what, &dx, &dy, &qgrad, seed, off);
    else CHECK(dx.data[0] == dy.data[0], "%s: dy must pass through", what);
    conform_bwd(op, &dy, &dx, dex);
    if (fq) {  /* an already quantized input is copied, not quantized again */
        opf_tensor again[1 + OPF_OP_MAX_EXTRA];
        CHECK_OK(ctx, fwd(op, &outs[0], NULL, NULL, NULL, NULL, again));
        CHECK(same_bytes(&again[0], &outs[0]) && opf_spec_equal(&again[0].spec, &outs[0].spec),
              "%s: a quantized input is not passed on unchanged", what);
        release_n(again, 1);
    }
    release_n(outs, 1);
    opf_tensor_release(&dx);
    opf_tensor_release(&x);
    opf_tensor_release(&dy);
    opf_op_destroy(op);
}

static void test_quantize(void)
{
    const opf_quantize_config cfgs[] = {{true, false}, {true, true}, {false, true}, {false, false}};
    for (int r = 0; r < N_QRECIPES; r++)
        for (int d = 0; d < N_DTYPES; d++) {
            for (int k = 0; k < 4; k++) run_quantize_case(&qrecipes[r], dtypes[d], &cfgs[k]);
            run_quantize_case(&qrecipes[r], dtypes[d], NULL);
        }
}

/* ---- dropout ---------------------------------------------------------------------------------- */

/* The documented mapping, written out independently of the op. */
static void ref_mask(uint64_t seed, uint64_t offset, double p, int64_t n, uint8_t *m)
{
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    const uint32_t thr = (uint32_t)(p * 4294967296.0);
    for (int64_t e = 0; e < n; e++) {
        uint64_t c = offset + (uint64_t)(e / 4);
        const uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), 0, 0};
        uint32_t w[4];
        opf_philox4x32_10(ctr, key, w);
        m[e] = w[e % 4] >= thr;
    }
}

static void run_dropout_case(double p, opf_dtype dt, uint64_t seed, uint64_t offset)
{
    opf_dropout_config cfg = {p};
    opf_op *op = make_op("dropout", &cfg, "drop");
    int64_t shape[3] = {8, 64, 65}, n = 8 * 64 * 65;  /* n % 4 != 0: a partial last group */
    opf_tensor x = rand_tensor(3, shape, dt), dy = rand_tensor(3, shape, dt);
    double *xv = values(&x), *dyv = values(&dy);
    double *ref = malloc(sizeof(double) * (size_t)n), *dref = malloc(sizeof(double) * (size_t)n);
    uint8_t *m = malloc((size_t)n);
    ref_mask(seed, offset, p, n, m);
    dropout_ref dr = {m, 1.0 / (1.0 - p)};
    drop_f(xv, n, &dr, ref);
    drop_b(xv, dyv, n, &dr, dref);
    char what[96];
    snprintf(what, sizeof what, "dropout p=%g %s", p, opf_dtype_name(dt));
    opf_ctx_set_rng(ctx, seed, offset);
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
    opf_op_ctx octx = {0};
    CHECK_OK(ctx, fwd(op, &x, NULL, NULL, NULL, &octx, outs));  /* NULL kwargs: training */
    uint64_t s_now, o_now;
    opf_ctx_get_rng(ctx, &s_now, &o_now);
    CHECK(s_now == seed && o_now == offset + (uint64_t)(n + 3) / 4,
          "%s: RNG offset advanced to %llu, want %llu", what, (unsigned long long)o_now,
          (unsigned long long)(offset + (uint64_t)(n + 3) / 4));
    CHECK(octx.n_saved == 1 && octx.saved[0].spec.dtype == OPF_U8 &&
          !memcmp(octx.saved[0].data[0], m, (size_t)n), "%s: saved mask differs from the Philox mapping", what);
    check_close(what, &outs[0], ref, dtype_tol(dt));
    conform_fwd(op, outs, octx.saved, 1);
    int64_t zeros = 0, bad_zero = 0;
    double *yv = values(&outs[0]);
    for (int64_t i = 0; i < n; i++) {
        zeros += !m[i];
        bad_zero += !m[i] && yv[i] != 0.0;
    }
    CHECK(bad_zero == 0, "%s: %lld dropped elements are not zero", what, (long long)bad_zero);
    if (dt == OPF_F32) {  /* the documented rounding: fl32(x * fl32(1 / (1 - p))) */
        const float s = (float)(1.0 / (1.0 - p));
        int64_t off_bits = 0;
        for (int64_t i = 0; i < n; i++) off_bits += (float)yv[i] != (float)xv[i] * (m[i] ? s : 0.0f);
        CHECK(off_bits == 0, "%s: %lld values differ from fl32(x * s)", what, (long long)off_bits);
    }
    if (p > 0) {
        double z = (zeros - n * p) / sqrt(n * p * (1 - p));
        CHECK(fabs(z) < 2.5758, "%s: zero fraction %g, z = %g", what, (double)zeros / n, z);
    } else {
        CHECK(zeros == 0, "%s: p = 0 dropped %lld elements", what, (long long)zeros);
    }
    CHECK_OK(ctx, bwd(op, &octx, &dy, NULL, &dx, dex));
    check_close(what, &dx, dref, dtype_tol(dt));
    conform_bwd(op, &dy, &dx, dex);
    release_n(outs, 1);
    opf_tensor_release(&dx);
    opf_tensor_release(&x);
    opf_tensor_release(&dy);
    free(xv), free(dyv), free(ref), free(dref), free(m), free(yv);
    opf_op_destroy(op);
}

/* Same seed and offset: same mask; the next call draws new counters. */
static void test_dropout_reproducible(void)
{
    opf_dropout_config cfg = {0.3};
    opf_op *op = make_op("dropout", &cfg, "drop");
    int64_t shape[2] = {32, 33};
    opf_tensor x = rand_tensor(2, shape, OPF_F32);
    opf_tensor o1[1 + OPF_OP_MAX_EXTRA], o2[1 + OPF_OP_MAX_EXTRA], o3[1 + OPF_OP_MAX_EXTRA];
    opf_ctx_set_rng(ctx, 77, 5);
    CHECK_OK(ctx, fwd(op, &x, NULL, NULL, NULL, NULL, o1));
    CHECK_OK(ctx, fwd(op, &x, NULL, NULL, NULL, NULL, o3));  /* continues the stream */
    opf_ctx_set_rng(ctx, 77, 5);
    CHECK_OK(ctx, fwd(op, &x, NULL, NULL, NULL, NULL, o2));
    CHECK(same_bytes(&o1[0], &o2[0]), "dropout: same seed and offset gave different outputs");
    CHECK(!same_bytes(&o1[0], &o3[0]), "dropout: consecutive calls reused the mask");
    release_n(o1, 1), release_n(o2, 1), release_n(o3, 1);
    /* eval: identity, no RNG used, dy passes through */
    opf_dropout_kwargs eval = {.training = false};
    uint64_t o_before, o_after;
    opf_ctx_get_rng(ctx, NULL, &o_before);
    opf_op_ctx octx = {0};
    opf_tensor dx, dex[OPF_OP_MAX_EXTRA];
    CHECK_OK(ctx, fwd(op, &x, NULL, NULL, &eval, &octx, o1));
    opf_ctx_get_rng(ctx, NULL, &o_after);
    CHECK(same_bytes(&o1[0], &x) && o1[0].data[0] != x.data[0] && o_after == o_before,
          "dropout eval: not an exact copy, or the RNG moved");
    conform_fwd(op, o1, NULL, 0);
    CHECK_OK(ctx, bwd(op, &octx, &x, NULL, &dx, dex));
    CHECK(dx.data[0] == x.data[0], "dropout eval: dy must pass through");
    conform_bwd(op, &x, &dx, dex);
    opf_tensor_release(&dx);
    release_n(o1, 1);
    opf_tensor_release(&x);
    opf_op_destroy(op);
}

static void test_dropout(void)
{
    const double ps[] = {0.0, 0.1, 0.5, 0.9};
    for (int k = 0; k < 4; k++)
        for (int d = 0; d < N_DTYPES; d++)
            run_dropout_case(ps[k], dtypes[d], 0x123456789ABCull + (uint64_t)k, 0xFFFFFF00ull * (uint64_t)d);
    test_dropout_reproducible();
}

/* ---- bad inputs ---------------------------------------------------------------------------------- */

static void test_bad_configs(void)
{
    opf_op *op = NULL;
    opf_reshape_config two = {.ndim = 3, .shape = {-1, 4, -1}}, neg = {.ndim = 2, .shape = {3, -2}};
    opf_reshape_config deep = {.ndim = 9};
    CHECK_FAILS(ctx, opf_op_create(ctx, "reshape", &two, "r2", &op), OPF_ERR_INVALID_ARG,
                "reshape \"r2\"", "[-1,4,-1]", "2 dims of -1");
    CHECK_FAILS(ctx, opf_op_create(ctx, "reshape", &neg, "r3", &op), OPF_ERR_INVALID_ARG,
                "reshape \"r3\"", "dim 1 is -2");
    CHECK_FAILS(ctx, opf_op_create(ctx, "reshape", &deep, "r4", &op), OPF_ERR_INVALID_ARG,
                "reshape \"r4\"", "ndim 9");
    CHECK_FAILS(ctx, opf_op_create(ctx, "reshape", NULL, "r5", &op), OPF_ERR_INVALID_ARG,
                "needs a config");
    opf_constant_scale_config nan_s = {NAN}, inf_s = {INFINITY}, big = {1e39};
    CHECK_FAILS(ctx, opf_op_create(ctx, "constant_scale", &nan_s, "s1", &op), OPF_ERR_INVALID_ARG,
                "constant_scale \"s1\"", "nan");
    CHECK_FAILS(ctx, opf_op_create(ctx, "constant_scale", &inf_s, "s2", &op), OPF_ERR_INVALID_ARG,
                "constant_scale \"s2\"", "inf");
    CHECK_FAILS(ctx, opf_op_create(ctx, "constant_scale", &big, "s3", &op), OPF_ERR_INVALID_ARG,
                "constant_scale \"s3\"", "1e+39");
    const double bad_p[] = {1.0, -0.1, NAN, 1.5};
    const char *const bad_p_str[] = {"p 1 ", "p -0.1 ", "p nan ", "p 1.5 "};
    for (int i = 0; i < 4; i++) {
        opf_dropout_config c = {bad_p[i]};
        CHECK_FAILS(ctx, opf_op_create(ctx, "dropout", &c, "dr", &op), OPF_ERR_INVALID_ARG,
                    "dropout \"dr\"", bad_p_str[i], "[0, 1)");
    }
    CHECK(op == NULL, "a failed create must leave *out NULL");
}

/* Backward with no forward, with a forward that did not save, and twice. */
static void test_backward_order(void)
{
    opf_bias_config bc = {.size = 8, .dtype = OPF_F32};
    opf_reshape_config rc = {.ndim = 1, .shape = {-1}};
    opf_constant_scale_config sc = {2.0};
    opf_dropout_config dc = {0.5};
    opf_quantize_config qc = {true, true};
    struct { const char *cls; const void *cfg; } ops[] = {
        {"identity", NULL}, {"bias", &bc}, {"reshape", &rc}, {"constant_scale", &sc},
        {"add_extra_input", NULL}, {"make_extra_output", NULL}, {"quantize", &qc}, {"dropout", &dc}};
    int64_t shape[2] = {4, 8};
    opf_tensor x = rand_tensor(2, shape, OPF_F32), e = rand_tensor(2, shape, OPF_F32);
    for (int i = 0; i < 8; i++) {
        opf_op *op = make_op(ops[i].cls, ops[i].cfg, "ord");
        opf_op_ctx octx = {0};
        opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
        CHECK_FAILS(ctx, bwd(op, &octx, &x, NULL, &dx, dex), OPF_ERR_STATE, "ord", "backward without a forward");
        CHECK_OK(ctx, fwd(op, &x, &e, NULL, NULL, NULL, outs));  /* no requires_grad */
        CHECK_FAILS(ctx, bwd(op, &octx, &x, NULL, &dx, dex), OPF_ERR_STATE, "ord", "backward without");
        release_n(outs, 1 + opf_op_class_of(op)->n_extra_out);
        CHECK_OK(ctx, fwd(op, &x, &e, NULL, NULL, &octx, outs));
        CHECK_OK(ctx, bwd(op, &octx, &x, NULL, &dx, dex));
        opf_tensor_release(&dx);
        release_n(dex, opf_op_class_of(op)->n_extra_in);
        CHECK_FAILS(ctx, bwd(op, &octx, &x, NULL, &dx, dex), OPF_ERR_STATE, "ord", "already done");
        release_n(outs, 1 + opf_op_class_of(op)->n_extra_out);
        opf_op_destroy(op);
    }
    opf_tensor_release(&x);
    opf_tensor_release(&e);
}

/* A failing forward leaves the outputs, the earlier context and the RNG as they were. */
static void check_fwd_fails(opf_op *op, const opf_tensor *x, const opf_tensor *extra,
                            opf_status want, const char *s1, const char *s2, const char *s3)
{
    opf_op_ctx octx = {0};
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], good[1 + OPF_OP_MAX_EXTRA];
    int64_t shape[2] = {4, 8};
    opf_tensor gx = rand_tensor(2, shape, OPF_F32), ge = rand_tensor(2, shape, OPF_F32);
    bool ok = fwd(op, &gx, &ge, NULL, NULL, &octx, good) == OPF_OK;  /* where the op takes [4,8] */
    uint64_t o_before, o_after;
    opf_ctx_get_rng(ctx, NULL, &o_before);
    CHECK_FAILS(ctx, fwd(op, x, extra, NULL, NULL, &octx, outs), want, s1, s2, s3);
    opf_ctx_get_rng(ctx, NULL, &o_after);
    CHECK(!outs[0].data[0] && o_before == o_after && octx.valid == ok,
          "%s: a failed forward changed the outputs, the RNG or the saved context", opf_op_name(op));
    if (ok) release_n(good, 1 + opf_op_class_of(op)->n_extra_out);
    opf_op_ctx_clear(&octx);
    opf_tensor_release(&gx);
    opf_tensor_release(&ge);
}

/* A failing backward names the op and the values and keeps the context. */
static void check_bwd_fails(opf_op *op, const opf_tensor *x, const opf_tensor *dy,
                            const opf_tensor *dextra, opf_status want, const char *s1,
                            const char *s2, const char *s3)
{
    opf_op_ctx octx = {0};
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dx, dex[OPF_OP_MAX_EXTRA];
    CHECK_OK(ctx, fwd(op, x, NULL, NULL, NULL, &octx, outs));
    CHECK_FAILS(ctx, bwd(op, &octx, dy, dextra, &dx, dex), want, s1, s2, s3);
    CHECK(octx.valid && !dx.data[0], "%s: a failed backward consumed the context or wrote dx",
          opf_op_name(op));
    release_n(outs, 1 + opf_op_class_of(op)->n_extra_out);
    opf_op_ctx_clear(&octx);
}

/* Inputs the bad-input tests share. */
static opf_tensor bx, bx7, bx35, bx340, bxi;

static void test_bad_reshape(void)
{
    opf_reshape_config rc = {.ndim = 2, .shape = {4, -1}}, rc0 = {.ndim = 2, .shape = {0, -1}};
    opf_reshape_config rc8 = {.ndim = 2, .shape = {8, 4}};
    opf_op *rs = make_op("reshape", &rc, "rs"), *rs0 = make_op("reshape", &rc0, "rs0");
    opf_op *rs8 = make_op("reshape", &rc8, "rs8");
    check_fwd_fails(rs, &bx35, NULL, OPF_ERR_SHAPE, "reshape \"rs\"", "[3,5] (15 elements)", "[4,-1]");
    check_fwd_fails(rs0, &bx, NULL, OPF_ERR_SHAPE, "reshape \"rs0\"", "[4,8]", "[0,-1]");
    check_fwd_fails(rs8, &bx35, NULL, OPF_ERR_SHAPE, "reshape \"rs8\"", "[3,5]", "[8,4]");
    check_bwd_fails(rs8, &bx, &bx35, NULL, OPF_ERR_SHAPE, "reshape \"rs8\"", "[3,5]", "[4,8]");
    opf_op_destroy(rs);
    opf_op_destroy(rs0);
    opf_op_destroy(rs8);
}

static void test_bad_inputs(void)
{
    int64_t s48[2] = {4, 8}, s47[2] = {4, 7}, s35[2] = {3, 5}, s340[2] = {3, 40};
    bx = rand_tensor(2, s48, OPF_F32), bx7 = rand_tensor(2, s47, OPF_F32);
    bx35 = rand_tensor(2, s35, OPF_BF16), bx340 = rand_tensor(2, s340, OPF_BF16);
    opf_spec is = opf_spec_make(2, s48, OPF_I32);
    OPF_ASSERT(opf_tensor_alloc(ctx, &is, &bxi) == OPF_OK);
    memset(bxi.data[0], 0, 32 * 4);
    test_bad_reshape();

    opf_constant_scale_config sc = {2.0};
    opf_op *cs = make_op("constant_scale", &sc, "cs");
    check_fwd_fails(cs, &bxi, NULL, OPF_ERR_DTYPE, "constant_scale \"cs\"", "i32", "f32/bf16/f16");
    check_bwd_fails(cs, &bx, &bxi, NULL, OPF_ERR_DTYPE, "constant_scale \"cs\"", "gradient", "i32");

    opf_op *add = make_op("add_extra_input", NULL, "res");
    check_fwd_fails(add, &bx, &bx7, OPF_ERR_SHAPE, "add_extra_input \"res\"", "f32[4,8]", "f32[4,7]");
    check_fwd_fails(add, &bx, NULL, OPF_ERR_INVALID_ARG, "add_extra_input \"res\"", "extra input 0",
                    "missing");
    check_fwd_fails(add, &bx, &bxi, OPF_ERR_DTYPE, "add_extra_input \"res\"", "i32", "f32");

    opf_op *mk = make_op("make_extra_output", NULL, "mk");
    check_bwd_fails(mk, &bx, &bx, &bx7, OPF_ERR_SHAPE, "make_extra_output \"mk\"", "f32[4,8]",
                    "f32[4,7]");
    check_bwd_fails(mk, &bx, &bx, &bxi, OPF_ERR_DTYPE, "make_extra_output \"mk\"", "extra gradient",
                    "i32");

    opf_op *qz = make_op("quantize", NULL, "qz");
    opf_recipe mx = opf_recipe_default(OPF_RECIPE_MXFP8);
    CHECK_OK(ctx, opf_op_reset_recipe(ctx, qz, &mx));
    check_fwd_fails(qz, &bx340, NULL, OPF_ERR_SHAPE, "quantize \"qz\"", "input", "multiples of 32");

    opf_dropout_config dc = {0.5};
    opf_op *dr = make_op("dropout", &dc, "dr");
    check_fwd_fails(dr, &bxi, NULL, OPF_ERR_DTYPE, "dropout \"dr\"", "i32", "f32/bf16/f16");
    check_bwd_fails(dr, &bx, &bx35, NULL, OPF_ERR_SHAPE, "dropout \"dr\"", "bf16[3,5]", "u8[4,8]");

    opf_bias_config bc = {.size = 16, .dtype = OPF_F32};
    opf_op *bs = make_op("bias", &bc, "fc1.bias");
    check_fwd_fails(bs, &bx, NULL, OPF_ERR_SHAPE, "bias \"fc1.bias\"", "8 features", "16");

    opf_op *all[] = {cs, add, mk, qz, dr, bs};
    for (int i = 0; i < 6; i++) opf_op_destroy(all[i]);
    opf_tensor *ts[] = {&bx, &bx7, &bx35, &bx340, &bxi};
    for (int i = 0; i < 5; i++) opf_tensor_release(ts[i]);
}

/* A backward override turns the Quantize op's backward quantization off. */
static void test_quantize_override(void)
{
    opf_quantize_config c = {true, true};
    opf_op *op;
    CHECK_OK(ctx, opf_op_create(ctx, "quantize", &c, "q", &op));
    opf_recipe r = opf_recipe_default(OPF_RECIPE_MXFP8);
    CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, &r));
    const opf_op_class *cls = opf_op_class_of(op);
    CHECK(cls->grad_output_quantizer(op) != NULL, "backward quantizer without override");
    r.backward_override = OPF_BACKWARD_HIGH_PRECISION;
    CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, &r));
    CHECK(cls->grad_output_quantizer(op) == NULL, "no backward quantizer under an override");
    CHECK(cls->input_quantizer(op) != NULL, "the forward still quantizes");
    opf_op_destroy(op);
}

int main(void)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 99;
    if (opf_ctx_create(&o, &ctx) != OPF_OK) return 1;
    test_finite_differences();
    test_identity();
    test_bias();
    test_reshape();
    test_constant_scale();
    test_add_extra_input();
    test_make_extra_output();
    test_quantize();
    test_quantize_override();
    test_dropout();
    test_bad_configs();
    test_backward_order();
    test_bad_inputs();
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
