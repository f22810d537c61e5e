/* fuzz_api.c: libFuzzer target for the public API. Each input is decoded
 * into a short program over a fresh context: random specs, quantizers,
 * recipes and tensor values driving quantize / dequantize / requantize /
 * update_usage, GEMM, and the forward and backward of small seqs of
 * basic_linear, layernorm, gelu and bias. Any call may refuse with a
 * status, but it must leave a message, and where the header promises it,
 * leave its output untouched; nothing may crash, leak or trip the
 * sanitizers. Results of successful calls are checked against invariants
 * that hold under every recipe: finite, bounded inputs give finite outputs,
 * quantization keeps signs (except Hadamard-rotated copies), and a backward
 * refused for a malformed dy can be retried. Dims stay <= 64 so an input
 * runs in about a millisecond.
 * Build and run: fuzz/run.sh; without libFuzzer: fuzz/standalone.c. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opfuse.h"

/* ---- decoding ----------------------------------------------------------- */

/* The input: structure bytes are read in order (0 past the end); element
 * values cycle over the whole input from their own cursor, so a short input
 * still gives varied tensors. */
typedef struct fa_in {
    const uint8_t *p;
    size_t         n, i, v;
} fa_in;

static unsigned fa_u8(fa_in *in) { return in->i < in->n ? in->p[in->i++] : 0; }
static unsigned fa_pick(fa_in *in, unsigned n) { return fa_u8(in) % n; }
static bool fa_bool(fa_in *in) { return fa_u8(in) & 1; }
/* Mostly true: a malformed argument one time in sixteen. */
static bool fa_rare(fa_in *in) { return fa_pick(in, 16) == 0; }

/* 1..64, half the time a multiple of 16 (what the block formats take),
 * or 0 now and then. */
static int64_t fa_dim(fa_in *in)
{
    unsigned b = fa_u8(in);
    return b == 0xff ? 0 : b & 0x80 ? 16 * (1 + b % 4) : 1 + b % 64;
}

/* f32, bf16, f16; now and then any value of the enum or one past it. */
static opf_dtype fa_float_dtype(fa_in *in)
{
    unsigned b = fa_u8(in);
    if (b >= 0xf8) return (opf_dtype)(b % (OPF_DTYPE_COUNT + 1));
    static const opf_dtype f[] = {OPF_F32, OPF_BF16, OPF_F16};
    return f[b % 3];
}

static float fa_param(fa_in *in)
{
    static const float v[] = {0.0f, 1e-6f, 0.5f, 1.0f, 2.0f, -1.0f, 64.0f, 300.0f, NAN, INFINITY};
    return v[fa_pick(in, sizeof v / sizeof v[0])];
}

/* Values of one tensor: a tame tensor holds multiples of 1/16 of at most
 * 60 in magnitude, a wild one any scale plus edge values (huge, subnormal,
 * infinite, NaN). */
typedef struct fa_vals {
    bool  tame;
    float scale;
} fa_vals;

static fa_vals fa_vals_pick(fa_in *in, bool allow_wild)
{
    fa_vals v = {true, 1.0f};
    unsigned b = fa_u8(in);
    if (allow_wild && (b & 3) == 0) {
        v.tame = false;
        v.scale = ldexpf(1.0f, (int)(b >> 2) - 32);
    } else {
        v.scale = ldexpf(1.0f, (int)(b >> 2) % 8 - 4);
    }
    return v;
}

static float fa_value(fa_in *in, fa_vals v)
{
    unsigned b = in->n ? in->p[in->v++ % in->n] : 0;
    static const float edge[] = {0.0f,     -0.0f, 448.0f,   -57344.0f, 65504.0f, 1e-40f,
                                 FLT_MAX, -FLT_MAX, FLT_MIN, INFINITY, -INFINITY, NAN};
    if (!v.tame && b >= 0xf0) return edge[(b - 0xf0) % (sizeof edge / sizeof edge[0])];
    return ((float)(b % 0xf0) - 120.0f) / 16.0f * (v.tame ? fminf(v.scale, 8.0f) : v.scale);
}

/* ---- checks ------------------------------------------------------------- */

/* What the current step built, for the report of a failure. */
static char fa_trace[512];

static void fa_note(const char *fmt, const char *a, long b)
{
    size_t n = strlen(fa_trace);
    snprintf(fa_trace + n, sizeof fa_trace - n, fmt, a, b);
}

static void fa_fail(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_api: %s: %s (after: %s)\n", what, detail, fa_trace);
    abort();
}

/* A refused call says why, with a status of the enum. Pure calls (no
 * context) leave the message in the thread's: pass ctx NULL. */
static void fa_refused(opf_ctx *ctx, opf_status st, const char *call)
{
    if (st <= OPF_OK || st > OPF_ERR_STATE) fa_fail(call, "status outside the enum");
    const char *m = opf_last_error(ctx);
    if (!m || !*m) fa_fail(call, "refused without a message");
}

static bool fa_is_float(opf_dtype dt) { return dt == OPF_F32 || dt == OPF_BF16 || dt == OPF_F16; }

/* t's values as f32 (plain float tensors only); the caller frees them. */
static float *fa_read(const opf_tensor *t)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *f = malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (!f) abort();
    if (n && opf_convert(t->data[0], t->spec.dtype, f, OPF_F32, (size_t)n)) abort();
    return f;
}

static void fa_check_finite(const opf_tensor *t, const char *what)
{
    if (t->spec.scaling != OPF_SCALING_NONE || !t->data[0] || t->spec.dtype == OPF_F16 ||
        !fa_is_float(t->spec.dtype))
        return;
    float *f = fa_read(t);
    for (int64_t i = 0, n = opf_spec_numel(&t->spec); i < n; i++)
        if (!isfinite(f[i])) fa_fail(what, "non-finite value from finite inputs");
    free(f);
}

/* A copy of every byte of t's components (to see that a refusal left them). */
static unsigned char *fa_snapshot(const opf_tensor *t, size_t *nbytes)
{
    opf_layout L;
    *nbytes = 0;
    if (opf_spec_layout(&t->spec, &L)) return NULL;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && t->data[c]) *nbytes += L.comp[c].nbytes;
    unsigned char *s = malloc(*nbytes + 1), *p = s;
    if (!s) abort();
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && t->data[c])
            memcpy(p, t->data[c], L.comp[c].nbytes), p += L.comp[c].nbytes;
    return s;
}

static void fa_check_untouched(const opf_tensor *t, unsigned char *snap, size_t n, const char *call)
{
    size_t m;
    unsigned char *now = fa_snapshot(t, &m);
    if (m != n || (n && memcmp(now, snap, n))) fa_fail(call, "refused but changed its output");
    free(now), free(snap);
}

/* ---- tensors ------------------------------------------------------------ */

/* A plain tensor of spec s filled from the input; false (and a checked
 * refusal) when the allocation is refused. */
static bool fa_tensor(opf_ctx *ctx, fa_in *in, const opf_spec *s, fa_vals v, opf_tensor *t)
{
    opf_status st = opf_tensor_alloc(ctx, s, t);
    if (st) {
        fa_refused(ctx, st, "opf_tensor_alloc");
        return false;
    }
    int64_t n = opf_spec_numel(s);
    if (!n || !t->data[0]) return true;
    if (!fa_is_float(s->dtype)) {
        memset(t->data[0], (int)fa_u8(in), opf_dtype_nbytes(s->dtype, (size_t)n));
        return true;
    }
    float *f = malloc(sizeof(float) * (size_t)n);
    if (!f) abort();
    for (int64_t i = 0; i < n; i++) f[i] = fa_value(in, v);
    if (opf_convert(f, OPF_F32, t->data[0], s->dtype, (size_t)n)) abort();
    free(f);
    return true;
}

/* A 1..3-D spec of at most 64 x 64 elements. */
static opf_spec fa_spec(fa_in *in)
{
    int ndim = 1 + (int)fa_pick(in, 3);
    int64_t shape[3] = {fa_dim(in), fa_dim(in), fa_dim(in)};
    if (ndim == 3) shape[0] = 1 + shape[0] % 4;
    return opf_spec_make(ndim, ndim == 3 ? shape : shape + 1, fa_float_dtype(in));
}

/* ---- quantizers and recipes --------------------------------------------- */

static opf_recipe fa_recipe(fa_in *in)
{
    opf_recipe r = opf_recipe_default((opf_recipe_kind)fa_pick(in, OPF_RECIPE_COUNT + 1));
    if (fa_bool(in)) return r;
    r.format = (opf_format)fa_pick(in, OPF_FORMAT_COUNT + 1);
    r.margin = fa_param(in);
    r.amax_history_len = (int)fa_pick(in, 5);
    r.amax_algo = (opf_amax_algo)fa_pick(in, OPF_AMAX_ALGO_COUNT + 1);
    r.power_2_scales = fa_bool(in);
    r.amax_epsilon = fa_param(in);
    r.x_block_dim = (int)fa_pick(in, 4);
    r.w_block_dim = (int)fa_pick(in, 4);
    r.grad_block_dim = (int)fa_pick(in, 4);
    r.mxfp8_2d_weights = fa_bool(in);
    r.nvfp4_rht = fa_bool(in);
    r.nvfp4_stochastic = fa_bool(in);
    r.nvfp4_2d_weights = fa_bool(in);
    r.backward_override = (opf_backward_override)fa_pick(in, OPF_BACKWARD_OVERRIDE_COUNT + 1);
    return r;
}

/* What a quantizer references and the fuzz input must free. */
typedef struct fa_qstate {
    opf_recipe_state  *rs;
    opf_delayed_state *ds;
} fa_qstate;

static void fa_qstate_free(fa_qstate *s)
{
    opf_recipe_state_destroy(s->rs);
    opf_delayed_state_destroy(s->ds);
    s->rs = NULL, s->ds = NULL;
}

/* A quantizer from raw fields, from a delayed state, or from a recipe
 * state's role; false when one of the calls building it refused. */
static bool fa_quantizer(opf_ctx *ctx, fa_in *in, opf_quantizer *q, fa_qstate *qs)
{
    *q = opf_quantizer_default();
    opf_status st;
    switch (fa_pick(in, 3)) {
    case 0: {
        opf_recipe r = fa_recipe(in);
        static const char *const modules[] = {"linear", "grouped_linear", "layernorm_linear"};
        int gemms = 1 + (int)fa_pick(in, 2);
        st = opf_recipe_state_create(ctx, &r, modules[fa_pick(in, 3)], "fz", gemms, &qs->rs);
        if (st) return fa_refused(ctx, st, "opf_recipe_state_create"), false;
        st = opf_recipe_state_quantizer(qs->rs, (opf_tensor_role)fa_pick(in, OPF_ROLE_COUNT + 1),
                                        (int)fa_pick(in, 3), q);
        if (st) return fa_refused(NULL, st, "opf_recipe_state_quantizer"), false;
        q->usage = 1 + fa_pick(in, 3);
        return true;
    }
    case 1:
        st = opf_delayed_state_create(ctx, (opf_format)fa_pick(in, OPF_FORMAT_COUNT + 1), fa_param(in),
                                      (int)fa_pick(in, 5), (opf_amax_algo)fa_pick(in, 3), fa_bool(in),
                                      (int)fa_pick(in, 5), &qs->ds);
        if (st) return fa_refused(ctx, st, "opf_delayed_state_create"), false;
        q->scaling = OPF_SCALING_TENSOR;
        q->qdtype = opf_delayed_state_dtype(qs->ds);
        q->delayed = qs->ds;
        q->slot = (int)fa_pick(in, 5) - 1;
        q->usage = 1 + fa_pick(in, 3);
        return true;
    default: {
        static const opf_dtype qd[] = {OPF_E4M3, OPF_E5M2, OPF_E2M1, OPF_BF16};
        q->scaling = (opf_scaling)fa_pick(in, OPF_SCALING_COUNT + 1);
        q->qdtype = qd[fa_pick(in, 4)];
        q->usage = fa_pick(in, 4);
        q->swizzled = fa_bool(in);
        q->pow2_scales = fa_bool(in);
        q->amax_epsilon = fa_param(in);
        q->mxfp8_2d = fa_bool(in);
        q->rht = fa_bool(in);
        q->rht_sign_mask = (uint16_t)(fa_u8(in) << 8 | fa_u8(in));
        q->stochastic = fa_bool(in);
        return true;
    }
    }
}

/* ---- quantize / dequantize ---------------------------------------------- */

/* Decodes each copy of xq (quantized from x) and checks it: a present copy
 * decodes, finite tame inputs give finite values, signs are kept except in a
 * Hadamard-rotated copy. */
static void fa_check_decode(opf_ctx *ctx, fa_in *in, const opf_tensor *x, fa_vals v,
                            const opf_tensor *xq)
{
    if (!fa_is_float(x->spec.dtype) || xq->spec.scaling == OPF_SCALING_NONE) return;
    float *xf = fa_read(x);
    int64_t n = opf_spec_numel(&x->spec);
    bool finite = v.tame;
    for (int64_t i = 0; i < n; i++) finite = finite && isfinite(xf[i]);
    for (unsigned which = OPF_USAGE_ROWWISE; which <= OPF_USAGE_COLUMNWISE; which <<= 1) {
        if (!(xq->spec.usage & which)) continue;
        opf_spec s = x->spec;
        s.dtype = fa_rare(in) ? fa_float_dtype(in) : OPF_F32;
        opf_tensor d;
        if (opf_tensor_alloc(ctx, &s, &d)) continue;
        opf_status st = opf_dequantize(ctx, xq, which, &d);
        if (st) {
            if (s.dtype == OPF_F32) fa_fail("opf_dequantize", opf_last_error(ctx));
            fa_refused(ctx, st, "opf_dequantize");
        } else if (s.dtype == OPF_F32) {
            bool rotated = which == OPF_USAGE_COLUMNWISE && (xq->spec.flags & OPF_SPEC_NVFP4_RHT);
            const float *df = d.data[0];
            for (int64_t i = 0; i < n; i++) {
                if (finite && !isfinite(df[i])) fa_fail("dequantize(quantize(x))", "non-finite from finite x");
                if (!rotated && !isnan(xf[i]) && xf[i] * df[i] < 0) fa_fail("dequantize(quantize(x))", "sign flipped");
            }
        }
        opf_tensor_release(&d);
    }
    free(xf);
}

static void fa_quantize_step(opf_ctx *ctx, fa_in *in)
{
    opf_spec s = fa_spec(in);
    fa_vals v = fa_vals_pick(in, true);
    opf_tensor x, xq;
    if (!fa_tensor(ctx, in, &s, v, &x)) return;
    opf_quantizer q;
    fa_qstate qs = {0};
    if (fa_quantizer(ctx, in, &q, &qs)) {
        memset(&xq, 0xa5, sizeof xq);
        opf_status st = opf_quantize_alloc(ctx, &q, &x, &xq);
        if (st) {
            fa_refused(ctx, st, "opf_quantize_alloc");
            static const opf_tensor zero;
            if (memcmp(&xq, &zero, sizeof xq)) fa_fail("opf_quantize_alloc", "refused but *out not zeroed");
        } else {
            fa_check_decode(ctx, in, &x, v, &xq);
            /* Another quantizer from the decoded copy. */
            opf_quantizer q2;
            fa_qstate qs2 = {0};
            opf_spec s2;
            opf_tensor y;
            if (fa_quantizer(ctx, in, &q2, &qs2) && !opf_quantizer_spec(&q2, &x.spec, &s2) &&
                !opf_tensor_alloc(ctx, &s2, &y)) {
                st = opf_requantize(ctx, &q2, &xq, &y);
                if (st) fa_refused(ctx, st, "opf_requantize");
                else if (!(xq.spec.flags & OPF_SPEC_NVFP4_RHT)) fa_check_decode(ctx, in, &x, v, &y);
                opf_tensor_release(&y);
            }
            fa_qstate_free(&qs2);
            /* Derive or drop copies; a refusal leaves the tensor as it was. */
            opf_tensor before = xq;
            st = opf_tensor_update_usage(ctx, &xq, fa_pick(in, 4));
            if (st) {
                fa_refused(ctx, st, "opf_tensor_update_usage");
                if (memcmp(&before, &xq, sizeof xq)) fa_fail("opf_tensor_update_usage", "refused but changed *t");
            } else if (!(xq.spec.flags & OPF_SPEC_NVFP4_RHT)) {
                fa_check_decode(ctx, in, &x, v, &xq);
            }
            opf_tensor_release(&xq);
        }
    }
    fa_qstate_free(&qs);
    opf_tensor_release(&x);
}

/* ---- GEMM --------------------------------------------------------------- */

/* Operand of logical shape [r, c]: plain, or quantized by a fuzzed
 * quantizer when that succeeds. */
static bool fa_operand(opf_ctx *ctx, fa_in *in, int64_t r, int64_t c, fa_vals v, opf_tensor *t,
                       fa_qstate *qs)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){r, c}, fa_float_dtype(in));
    if (!fa_tensor(ctx, in, &s, v, t)) return false;
    opf_quantizer q;
    if (!fa_bool(in) || !fa_quantizer(ctx, in, &q, qs)) return true;
    opf_tensor tq;
    opf_status st = opf_quantize_alloc(ctx, &q, t, &tq);
    if (st) return fa_refused(ctx, st, "opf_quantize_alloc"), true;
    opf_tensor_release(t);
    *t = tq;
    return true;
}

static void fa_gemm_step(opf_ctx *ctx, fa_in *in)
{
    opf_gemm_layout layout = (opf_gemm_layout)fa_pick(in, OPF_GEMM_LAYOUT_COUNT + 1);
    int64_t M = fa_dim(in), N = fa_dim(in), K = fa_dim(in);
    int64_t K2 = fa_rare(in) ? fa_dim(in) : K;
    /* A and B in the layout's logical shapes (gemm.h). */
    int64_t ar = N, ac = K, br = M, bc = K2;
    if (layout == OPF_GEMM_NN) ar = K, ac = N;
    if (layout == OPF_GEMM_NT) ar = K, ac = N, br = K2, bc = M;
    fa_vals v = fa_vals_pick(in, true);
    fa_qstate qa = {0}, qb = {0}, qd = {0};
    opf_tensor a = {0}, b = {0}, d = {0}, bias = {0};
    if (!fa_operand(ctx, in, ar, ac, v, &a, &qa) || !fa_operand(ctx, in, br, bc, v, &b, &qb)) goto out;
    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = fa_bool(in) ? 1.0f : fa_param(in);
    o.accumulate = fa_bool(in);
    o.beta = fa_bool(in) ? 1.0f : fa_param(in);
    opf_spec ds;
    opf_dtype dt = fa_float_dtype(in);
    opf_status st = opf_gemm_out_spec(&a.spec, &b.spec, layout, dt, &ds);
    if (st) {
        fa_refused(NULL, st, "opf_gemm_out_spec");
        ds = opf_spec_make(2, (int64_t[]){M, N}, dt);
    }
    opf_quantizer oq;
    if (fa_rare(in) && fa_quantizer(ctx, in, &oq, &qd)) {
        o.out_quantizer = &oq;
        opf_spec plain = ds;
        if (opf_quantizer_spec(&oq, &plain, &ds)) goto out;
    }
    if (o.out_quantizer ? opf_tensor_alloc(ctx, &ds, &d) != OPF_OK : !fa_tensor(ctx, in, &ds, v, &d)) goto out;
    if (fa_bool(in)) {
        opf_spec bs = opf_spec_make(1, (int64_t[]){fa_rare(in) ? fa_dim(in) : N}, fa_float_dtype(in));
        if (!fa_tensor(ctx, in, &bs, v, &bias)) goto out;
        o.bias = &bias;
    }
    size_t n;
    unsigned char *snap = fa_snapshot(&d, &n);
    st = opf_gemm(ctx, &a, &b, layout, fa_rare(in) ? NULL : &o, &d);
    if (st) {
        fa_refused(ctx, st, "opf_gemm");
        fa_check_untouched(&d, snap, n, "opf_gemm");
    } else {
        free(snap);
        if (v.tame && isfinite(o.alpha) && isfinite(o.beta) && fabsf(o.alpha) <= 300 && fabsf(o.beta) <= 300)
            fa_check_finite(&d, "opf_gemm");
    }
out:
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d), opf_tensor_release(&bias);
    fa_qstate_free(&qa), fa_qstate_free(&qb), fa_qstate_free(&qd);
}

/* ---- op forward / backward ---------------------------------------------- */

/* What the ops appended so far allow the checks to expect. */
typedef struct fa_bounds {
    bool eps_ok;   /* every norm's eps is positive and finite */
    bool has_f16;  /* an op computes in f16 */
    bool has_norm; /* a norm scales its gradient by up to 1/sqrt(eps) */
} fa_bounds;

/* Appends an op of a fuzzed class taking width *h (its output width back in
 * *h); false when the op was refused. */
static bool fa_append_op(opf_ctx *ctx, fa_in *in, opf_seq *seq, int64_t *h, fa_bounds *b)
{
    int64_t w = fa_rare(in) ? fa_dim(in) : *h;
    opf_dtype dt = fa_float_dtype(in);
    opf_basic_linear_config lin = {w, fa_dim(in), dt, fa_bool(in)};
    opf_norm_config ln = {w, fa_bool(in) ? 1e-5 : (double)fa_param(in), fa_bool(in), dt};
    opf_bias_config bias = {w, dt};
    static const char *const cls[] = {"basic_linear", "layernorm", "gelu", "bias"};
    const void *cfg[] = {&lin, &ln, NULL, &bias};
    unsigned c = fa_pick(in, 4);
    opf_op *op;
    opf_status st = opf_op_create(ctx, cls[c], cfg[c], cls[c], &op);
    if (st) return fa_refused(ctx, st, "opf_op_create"), false;
    if ((st = opf_seq_append(seq, op))) {
        fa_refused(ctx, st, "opf_seq_append");
        opf_op_destroy(op);
        return false;
    }
    fa_note("%s(%ld) ", cls[c], (long)w);
    fa_note("%s%ld ", opf_dtype_name(dt), c == 0 ? (long)lin.out_features : 0);
    if (c == 0) *h = lin.out_features;
    if (c == 1 && !(ln.eps > 0 && ln.eps < 1e30)) b->eps_ok = false;
    b->has_f16 |= dt == OPF_F16;
    b->has_norm |= c == 1;
    /* Parameters from the input, tame. */
    for (int i = 0; i < opf_op_num_params(op); i++) {
        opf_param *p = opf_op_param(op, i);
        int64_t n = opf_spec_numel(&p->value.spec);
        if (!fa_bool(in) || !n || !fa_is_float(p->value.spec.dtype)) continue;
        float *f = malloc(sizeof(float) * (size_t)n);
        if (!f) abort();
        fa_vals v = {true, 0.0625f};
        for (int64_t k = 0; k < n; k++) f[k] = fa_value(in, v);
        opf_convert(f, OPF_F32, p->value.data[0], p->value.spec.dtype, (size_t)n);
        free(f);
    }
    return true;
}

static void fa_check_grads(opf_seq *seq)
{
    for (int i = 0; i < opf_seq_len(seq); i++) {
        opf_op *op = opf_seq_at(seq, i);
        for (int k = 0; k < opf_op_num_params(op); k++) {
            opf_param *p = opf_op_param(op, k);
            if (p->has_grad) fa_check_finite(&p->grad, "parameter gradient");
        }
    }
}

/* A malformed dy must be refused and change nothing, so that the backward
 * with the right dy can still run. */
static void fa_backward(opf_ctx *ctx, fa_in *in, opf_seq *seq, const opf_tensor *y, fa_vals v,
                        bool check)
{
    opf_tensor dy, dx = {0};
    bool malformed = fa_rare(in);
    opf_spec s = y->spec;
    if (malformed) {
        switch (fa_pick(in, 3)) {
        case 0: s.shape[s.ndim - 1] += 1; break;
        case 1: s.dtype = OPF_I32; break;
        default: s.ndim = 1, s.shape[0] = opf_spec_numel(&y->spec); break;
        }
        if (!fa_tensor(ctx, in, &s, v, &dy)) return;
        opf_status st = opf_seq_backward(seq, &dy, NULL, &dx, NULL);
        opf_tensor_release(&dy);
        if (!st) {
            opf_tensor_release(&dx);
            if (s.dtype == OPF_I32 || s.ndim != y->spec.ndim) fa_fail("opf_seq_backward", "accepted a malformed dy");
            return;
        }
        fa_refused(ctx, st, "opf_seq_backward");
        if (st == OPF_ERR_STATE) return; /* no backward awaited (nothing requires grad) */
        s = y->spec;
    }
    if (!fa_tensor(ctx, in, &s, v, &dy)) return;
    opf_status st = opf_seq_backward(seq, &dy, NULL, &dx, NULL);
    if (st) {
        fa_refused(ctx, st, "opf_seq_backward");
        if (malformed && st == OPF_ERR_STATE) fa_fail("opf_seq_backward", "a refused dy consumed the forward");
    } else if (check) {
        fa_check_finite(&dx, "opf_seq_backward dx");
        fa_check_grads(seq);
    }
    opf_tensor_release(&dy), opf_tensor_release(&dx);
}

static void fa_seq_step(opf_ctx *ctx, fa_in *in)
{
    opf_seq *seq;
    opf_status st = opf_seq_create(ctx, &seq);
    if (st) return fa_refused(ctx, st, "opf_seq_create");
    int64_t h0 = fa_dim(in), h = h0;
    fa_bounds b = {true, false, false};
    for (int i = 0, n = 1 + (int)fa_pick(in, 3); i < n; i++) fa_append_op(ctx, in, seq, &h, &b);
    opf_recipe r = fa_recipe(in);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = fa_bool(in) ? NULL : &r;
    fa_note("recipe %s %ld ", call.recipe ? opf_recipe_name(r.kind) : "none", r.format);
    call.requires_grad = !fa_rare(in);
    call.input_requires_grad = fa_bool(in);
    opf_spec xs = opf_spec_make(2, (int64_t[]){fa_dim(in), h0}, fa_float_dtype(in));
    for (int step = 0, steps = 1 + (int)fa_pick(in, 2); step < steps; step++) {
        fa_vals v = fa_vals_pick(in, true);
        opf_tensor x, y;
        if (!fa_tensor(ctx, in, &xs, v, &x)) break;
        st = opf_seq_forward(seq, &x, &call, &y, NULL);
        opf_tensor_release(&x);
        if (st) {
            fa_refused(ctx, st, "opf_seq_forward");
            break;
        }
        /* Gradients accumulate over steps: one wild step spoils the rest. A
         * norm over a constant row multiplies the gradient by 1/sqrt(eps)
         * (316 at 1e-5), so two of them overflow an f16 gradient legitimately. */
        b.eps_ok = b.eps_ok && v.tame;
        if (b.eps_ok) fa_check_finite(&y, "opf_seq_forward");
        if (call.requires_grad && fa_bool(in))
            fa_backward(ctx, in, seq, &y, v, b.eps_ok && !(b.has_f16 && b.has_norm));
        opf_tensor_release(&y);
    }
    opf_seq_destroy(seq);
}

/* ---- entry -------------------------------------------------------------- */

static void quiet(void *user, const char *msg) { (void)user, (void)msg; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fa_in in = {data, size, 0, 0};
    opf_ctx_options o = opf_ctx_options_default();
    o.num_threads = 1;
    o.warn = quiet;
    o.seed = fa_u8(&in);
    opf_ctx *ctx;
    if (opf_ctx_create(&o, &ctx)) abort();
    /* A few steps of any kind, until the input runs out. */
    fa_trace[0] = 0;
    for (int step = 0; step < 4 && (step == 0 || in.i < in.n); step++) {
        switch (fa_pick(&in, 3)) {
        case 0: fa_note("%squantize %ld; ", "", step); fa_quantize_step(ctx, &in); break;
        case 1: fa_note("%sgemm %ld; ", "", step); fa_gemm_step(ctx, &in); break;
        default: fa_note("%sseq %ld: ", "", step); fa_seq_step(ctx, &in); break;
        }
    }
    opf_ctx_destroy(ctx);
    return 0;
}
