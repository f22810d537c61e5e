/* test_backward_override.c: the recipe's backward override (numerics.md
 * 3.7, as the anchor's fuser applies it) through LayerNorm -> Linear(+bias) ->
 * GELU -> Linear(+bias) under FP8 current, FP8 block, MXFP8 and NVFP4
 * scaling, each model built fresh from the same seed:
 *   - the forward output is bitwise the same with and without an override;
 *   - high_precision: dW and db of both linears match an FP64 reference on
 *     the plain inputs the linears saved (the outputs of prefix seqs, which
 *     compute the same bits) and the original weights, and dx / the
 *     LayerNorm grads match a recipe-less LayerNorm backward of the FP64
 *     reference's gradient (fp32 GEMM tolerances of numerics.md 8.3);
 *   - dequantized: the same FP64 reference on the forward's quantized
 *     operands, decoded; its grads lie within the recipe's quantization
 *     tolerance of high_precision's and both differ from the quantized
 *     backward's;
 *   - the backward plan holds backward_activation_bias only without an
 *     override, and the plan cache follows the override of one seq;
 *   - the linear's quantizer callbacks, bias dropping prevQ, a linear's dx
 *     kept plain under an override, a pre-quantized input under
 *     high_precision, a bf16 dequantized backward;
 *   - an override with delayed scaling is refused, nothing run. */
#include "test.h"

enum { T = 128, H = 128, F = 256 };
enum { OP_LN, OP_FC1, OP_B1, OP_GELU, OP_FC2, OP_B2, N_OPS };

static const opf_recipe_kind kinds[] = {OPF_RECIPE_CURRENT, OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8,
                                        OPF_RECIPE_NVFP4};
enum { NKINDS = sizeof kinds / sizeof kinds[0] };
static const char *const ovr_names[] = {"none", "high_precision", "dequantized"};

/* fp32 GEMMs are checked with fp16 tolerances (numerics.md 8.3). */
static const double GEMM_RTOL = 1e-3, GEMM_ATOL = 1e-5;

static opf_op *mk(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

static void fill(float *v, int64_t n, unsigned long long seed, float sigma, float mean)
{
    for (int64_t i = 0; i < n; i++) v[i] = mean + opf_test_normal(&seed, sigma);
}

static float *param_value(opf_seq *seq, int op, int i)
{
    return opf_op_param(opf_seq_at(seq, op), i)->value.data[OPF_COMP_DATA];
}

static const float *param_grad(opf_seq *seq, int op, int i)
{
    opf_param *p = opf_op_param(opf_seq_at(seq, op), i);
    return p->has_grad ? p->grad.data[OPF_COMP_DATA] : NULL;
}

/* The model, the same bits on every call: weights from the context's
 * Philox stream at a fixed seed, LayerNorm and bias values from the test's.
 * n_ops < N_OPS keeps a prefix. */
static opf_seq *model(opf_ctx *ctx, int n_ops)
{
    opf_ctx_set_rng(ctx, 77, 0);
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_norm_config ln = {H, 1e-5, false, OPF_F32};
    CHECK_OK(ctx, opf_seq_append(seq, mk(ctx, "layernorm", &ln, "ln")));
    CHECK_OK(ctx, opf_seq_append_linear(seq, H, F, true, OPF_F32, "fc1"));
    CHECK_OK(ctx, opf_seq_append(seq, mk(ctx, "gelu", NULL, "act")));
    CHECK_OK(ctx, opf_seq_append_linear(seq, F, H, true, OPF_F32, "fc2"));
    fill(param_value(seq, OP_LN, 0), H, 101, 0.2f, 1.0f);
    fill(param_value(seq, OP_LN, 1), H, 102, 0.2f, 0.0f);
    fill(param_value(seq, OP_B1, 0), F, 103, 0.5f, 0.0f);
    fill(param_value(seq, OP_B2, 0), H, 104, 0.5f, 0.0f);
    while (opf_seq_len(seq) > n_ops) CHECK_OK(ctx, opf_seq_remove(seq, opf_seq_len(seq) - 1, NULL));
    return seq;
}

static opf_recipe recipe(opf_recipe_kind k, int ovr)
{
    opf_recipe r = opf_recipe_default(k);
    r.backward_override = (opf_backward_override)ovr;
    return r;
}

static opf_tensor wrap2(float *v, int64_t rows, int64_t cols)
{
    opf_tensor t;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {rows, cols}, .dtype = OPF_F32}, v, &t);
    return t;
}

/* What one training step leaves: output, input gradient, parameter grads. */
typedef struct step {
    float y[T * H], dx[T * H];
    float ln_w[H], ln_b[H], w1[F * H], b1[F], w2[H * F], b2[H];
} step;

static float xs[T * H], dys[T * H];

static void copy_grad(opf_seq *seq, int op, int i, float *dst, int64_t n)
{
    const float *g = param_grad(seq, op, i);
    CHECK(g != NULL, "op %d param %d has a gradient", op, i);
    if (g) memcpy(dst, g, sizeof(float) * (size_t)n);
}

/* A fresh model, one forward and backward under r; false on failure. */
static bool run_step(opf_ctx *ctx, const opf_recipe *r, step *s)
{
    opf_seq *seq = model(ctx, N_OPS);
    opf_tensor x = wrap2(xs, T, H), dy = wrap2(dys, T, H), y, dx;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r;
    opf_status st = opf_seq_forward(seq, &x, &call, &y, NULL);
    CHECK(st == OPF_OK, "%s/%s forward: %s", opf_recipe_name(r->kind),
          ovr_names[r->backward_override], opf_last_error(ctx));
    if (!st) {
        CHECK(y.spec.scaling == OPF_SCALING_NONE && y.spec.dtype == OPF_F32, "plain output");
        memcpy(s->y, y.data[0], sizeof s->y);
        opf_tensor_release(&y);
        st = opf_seq_backward(seq, &dy, NULL, &dx, NULL);
        CHECK(st == OPF_OK, "%s/%s backward: %s", opf_recipe_name(r->kind),
              ovr_names[r->backward_override], opf_last_error(ctx));
    }
    if (!st) {
        CHECK(dx.spec.scaling == OPF_SCALING_NONE && dx.spec.dtype == OPF_F32, "plain dx");
        memcpy(s->dx, dx.data[0], sizeof s->dx);
        opf_tensor_release(&dx);
        copy_grad(seq, OP_LN, 0, s->ln_w, H), copy_grad(seq, OP_LN, 1, s->ln_b, H);
        copy_grad(seq, OP_FC1, 0, s->w1, F * H), copy_grad(seq, OP_B1, 0, s->b1, F);
        copy_grad(seq, OP_FC2, 0, s->w2, H * F), copy_grad(seq, OP_B2, 0, s->b2, H);
    }
    opf_seq_destroy(seq);
    return st == OPF_OK;
}

/* The output of a model prefix of n_ops ops under r (inference): the input
 * the next linear of the full model saw, bit for bit, when that linear
 * takes its input plain. */
static void prefix_output(opf_ctx *ctx, const opf_recipe *r, int n_ops, float *out, int64_t cols)
{
    opf_seq *seq = model(ctx, n_ops);
    opf_tensor x = wrap2(xs, T, H), y;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r;
    call.requires_grad = false;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    CHECK(y.spec.scaling == OPF_SCALING_NONE && opf_spec_numel(&y.spec) == T * cols,
          "prefix %d: plain [%d, %lld]", n_ops, T, (long long)cols);
    memcpy(out, y.data[0], sizeof(float) * (size_t)(T * cols));
    opf_tensor_release(&y);
    opf_seq_destroy(seq);
}

/* v quantized with the recipe's quantizer for a linear's role, rowwise
 * copy decoded to fp32: the operand a forward GEMM read. */
static void decode_operand(opf_ctx *ctx, const opf_recipe *r, opf_tensor_role role, float *v,
                           int64_t rows, int64_t cols, float *out)
{
    opf_quantizer_role qr = {"linear", role, "fc"};
    opf_quantizer q;
    CHECK_OK(NULL, opf_recipe_quantizer(r, &qr, &q));
    q.usage = OPF_USAGE_ROWWISE;
    opf_tensor t = wrap2(v, rows, cols), o = wrap2(out, rows, cols), qt;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &t, &qt));
    CHECK_OK(ctx, opf_dequantize(ctx, &qt, OPF_USAGE_ROWWISE, &o));
    opf_tensor_release(&qt);
}

/* GELU' (tanh approximation) of numerics.md 6.3, in double. */
static double dgelu(double x)
{
    double t = tanh(0.79788456 * x * (1.0 + 0.044715 * x * x));
    return 0.5 * x * (1.0 - t * t) * (0.79788456 + 0.1070322243 * x * x) + 0.5 * (1.0 + t);
}

/* FP64 backward of the two linears and the GELU from the operands the
 * backward GEMMs read: x1 [T,H], w1 [F,H], y1 (GELU input) [T,F], x2 [T,F],
 * w2 [H,F]. Fills the reference grads and dx1 (the LayerNorm's dy). */
typedef struct ref {
    double w1[F * H], b1[F], w2[H * F], b2[H];
    float dx1[T * H];
} ref;

static void reference(const float *x1, const float *w1, const float *y1, const float *x2,
                      const float *w2, ref *o)
{
    static double dz[T * F];
    memset(o, 0, sizeof *o);
    for (int t = 0; t < T; t++)
        for (int f = 0; f < F; f++) {
            double dx2 = 0;
            for (int h = 0; h < H; h++) dx2 += (double)dys[t * H + h] * w2[h * F + f];
            dz[t * F + f] = dgelu(y1[t * F + f]) * dx2;
        }
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++) {
            o->b2[h] += dys[t * H + h];
            for (int f = 0; f < F; f++) o->w2[h * F + f] += (double)dys[t * H + h] * x2[t * F + f];
        }
    for (int f = 0; f < F; f++)
        for (int t = 0; t < T; t++) {
            o->b1[f] += dz[t * F + f];
            for (int k = 0; k < H; k++) o->w1[f * H + k] += dz[t * F + f] * x1[t * H + k];
        }
    for (int t = 0; t < T; t++)
        for (int k = 0; k < H; k++) {
            double s = 0;
            for (int f = 0; f < F; f++) s += dz[t * F + f] * w1[f * H + k];
            o->dx1[t * H + k] = (float)s;
        }
}

/* Elements outside |a - ref| <= atol + rtol |ref|. */
static int n_bad(const float *a, const double *r, int64_t n)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !(fabs(a[i] - r[i]) <= GEMM_ATOL + GEMM_RTOL * fabs(r[i]));
    return bad;
}

static int n_bad_f(const float *a, const float *r, int64_t n)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !(fabs(a[i] - r[i]) <= GEMM_ATOL + GEMM_RTOL * fabs(r[i]));
    return bad;
}

/* Elements of got [N,K] off sum_m a[m,n] b[m,k] (a [M,N], b [M,K]) in FP64:
 * a wgrad. */
static int n_off_atb(const float *got, const float *a, const float *b, int M, int N, int K,
                     double rtol)
{
    int bad = 0;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            double s = 0;
            for (int m = 0; m < M; m++) s += (double)a[m * N + n] * b[m * K + k];
            bad += !(fabs(got[n * K + k] - s) <= GEMM_ATOL + rtol * fabs(s));
        }
    return bad;
}

/* Elements of got [M,K] off sum_n a[m,n] b[n,k] (a [M,N], b [N,K]): a dgrad. */
static int n_off_ab(const float *got, const float *a, const float *b, int M, int N, int K,
                    double rtol)
{
    int bad = 0;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) {
            double s = 0;
            for (int n = 0; n < N; n++) s += (double)a[m * N + n] * b[n * K + k];
            bad += !(fabs(got[m * K + k] - s) <= GEMM_ATOL + rtol * fabs(s));
        }
    return bad;
}

/* The LayerNorm's dx and grads for dy = dx1 without a recipe. */
static void ln_backward(opf_ctx *ctx, float *dx1, float *dx, float *gw, float *gb)
{
    opf_seq *seq = model(ctx, 1);
    opf_tensor x = wrap2(xs, T, H), dy = wrap2(dx1, T, H), y, d;
    opf_seq_call call = opf_seq_call_default();
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &d, NULL));
    memcpy(dx, d.data[0], sizeof(float) * T * H);
    memcpy(gw, param_grad(seq, OP_LN, 0), sizeof(float) * H);
    memcpy(gb, param_grad(seq, OP_LN, 1), sizeof(float) * H);
    opf_tensor_release(&y), opf_tensor_release(&d);
    opf_seq_destroy(seq);
}

/* Every grad of s against the FP64 reference built from those operands. */
static void check_against(opf_ctx *ctx, const char *tag, const step *s, const float *x1,
                          const float *w1, const float *y1, const float *x2, const float *w2)
{
    static ref o;
    static float dx[T * H], gw[H], gb[H];
    reference(x1, w1, y1, x2, w2, &o);
    int b[4] = {n_bad(s->w2, o.w2, H * F), n_bad(s->b2, o.b2, H), n_bad(s->w1, o.w1, F * H),
                n_bad(s->b1, o.b1, F)};
    CHECK(!b[0] && !b[1] && !b[2] && !b[3], "%s: FP64 mismatches dW2 %d db2 %d dW1 %d db1 %d", tag,
          b[0], b[1], b[2], b[3]);
    ln_backward(ctx, o.dx1, dx, gw, gb);
    int c[3] = {n_bad_f(s->dx, dx, T * H), n_bad_f(s->ln_w, gw, H), n_bad_f(s->ln_b, gb, H)};
    CHECK(!c[0] && !c[1] && !c[2], "%s: LayerNorm mismatches dx %d dgamma %d dbeta %d", tag, c[0],
          c[1], c[2]);
}

static double rel_rms(const float *a, const float *r, int64_t n)
{
    double e = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = a[i] - (double)r[i];
        e += d * d, m += (double)r[i] * r[i];
    }
    return sqrt(e / (m + 1e-30));
}

static bool differs(const float *a, const float *b, int64_t n)
{
    return memcmp(a, b, sizeof(float) * (size_t)n) != 0;
}

/* (1)-(3) for one recipe kind. */
static void test_kind(opf_ctx *ctx, opf_recipe_kind k)
{
    static step s[3];
    static float x1[T * H], y1[T * F], x2[T * F], w1[F * H], w2[H * F], x1q[T * H], x2q[T * F],
        w1q[F * H], w2q[H * F];
    const char *name = opf_recipe_name(k);
    for (int o = 0; o < 3; o++) {
        opf_recipe r = recipe(k, o);
        if (!run_step(ctx, &r, &s[o])) return;
    }
    for (int o = 1; o < 3; o++)
        CHECK(!differs(s[o].y, s[0].y, T * H), "%s/%s: forward output differs from no override",
              name, ovr_names[o]);
    /* the operands: prefix outputs under high_precision are what the
     * linears saved; the originals of the weights are the parameters */
    opf_recipe hp = recipe(k, OPF_BACKWARD_HIGH_PRECISION);
    prefix_output(ctx, &hp, 1, x1, H);
    prefix_output(ctx, &hp, 3, y1, F);
    prefix_output(ctx, &hp, 4, x2, F);
    opf_seq *m = model(ctx, N_OPS);
    memcpy(w1, param_value(m, OP_FC1, 0), sizeof w1);
    memcpy(w2, param_value(m, OP_FC2, 0), sizeof w2);
    opf_seq_destroy(m);
    char tag[64];
    snprintf(tag, sizeof tag, "%s/high_precision", name);
    check_against(ctx, tag, &s[1], x1, w1, y1, x2, w2);
    /* dequantized: the same on the forward's quantized operands, decoded */
    decode_operand(ctx, &hp, OPF_ROLE_INPUT, x1, T, H, x1q);
    decode_operand(ctx, &hp, OPF_ROLE_INPUT, x2, T, F, x2q);
    decode_operand(ctx, &hp, OPF_ROLE_WEIGHT, w1, F, H, w1q);
    decode_operand(ctx, &hp, OPF_ROLE_WEIGHT, w2, H, F, w2q);
    snprintf(tag, sizeof tag, "%s/dequantized", name);
    check_against(ctx, tag, &s[2], x1q, w1q, y1, x2q, w2q);
    /* dequantized vs high precision: the operands' quantization error only
     * (numerics.md 8.3 rtol: E4M3 0.125, E2M1 0.25; measured about 0.03 for the
     * FP8 family and 0.16 for NVFP4) */
    double tol = k == OPF_RECIPE_NVFP4 ? 0.25 : 0.125;
    double e[3] = {rel_rms(s[2].w2, s[1].w2, H * F), rel_rms(s[2].w1, s[1].w1, F * H),
                   rel_rms(s[2].dx, s[1].dx, T * H)};
    CHECK(e[0] < tol && e[1] < tol && e[2] < tol && e[0] > 0 && e[2] > 0,
          "%s: dequantized vs high_precision rel RMS dW2 %.4f dW1 %.4f dx %.4f (tol %.3f)", name,
          e[0], e[1], e[2], tol);
    for (int o = 1; o < 3; o++)
        CHECK(differs(s[o].w2, s[0].w2, H * F) && differs(s[o].w1, s[0].w1, F * H) &&
              differs(s[o].dx, s[0].dx, T * H),
              "%s/%s: grads equal to the quantized backward's", name, ovr_names[o]);
}

/* Is a class named cls in the group's plan? */
static bool plan_has(opf_seq *seq, bool backward, const char *cls)
{
    opf_plan_entry e[N_OPS];
    int n = opf_seq_plan(seq, 0, backward, e, N_OPS);
    for (int i = 0; i < n; i++)
        if (!strcmp(opf_op_class_of(e[i].op)->name, cls)) return true;
    return false;
}

/* (4): one seq, the override changing between steps: the plan cache key
 * includes it, and so do the linears' quantizer callbacks. */
static void test_plans(opf_ctx *ctx)
{
    static const int order[] = {0, 1, 2, 0, 2};
    opf_seq *seq = model(ctx, N_OPS);
    opf_tensor x = wrap2(xs, T, H), dy = wrap2(dys, T, H), y, dx;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        int o = order[i];
        opf_recipe r = recipe(OPF_RECIPE_MXFP8, o);
        opf_seq_call call = opf_seq_call_default();
        call.recipe = &r;
        CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
        CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));
        opf_tensor_release(&y), opf_tensor_release(&dx);
        CHECK(plan_has(seq, true, "backward_activation_bias") == (o == 0),
              "step %zu (%s): backward_activation_bias %s", i, ovr_names[o],
              o ? "under an override" : "missing without an override");
        CHECK(plan_has(seq, false, "forward_linear_bias_activation"), "forward plan keeps its fusion");
        for (int j = OP_FC1; j <= OP_FC2; j += OP_FC2 - OP_FC1) {
            opf_op *lin = opf_seq_at(seq, j);
            const opf_op_class *c = opf_op_class_of(lin);
            CHECK((c->input_quantizer(lin) != NULL) == (o != OPF_BACKWARD_HIGH_PRECISION),
                  "%s: input quantizer offered iff not high_precision", ovr_names[o]);
            CHECK((c->grad_output_quantizer(lin) != NULL) == (o == 0),
                  "%s: grad-output quantizer offered iff no override", ovr_names[o]);
        }
    }
    opf_seq_destroy(seq);
    /* an X whose grad-output quantizer ignores the override (a quantize op
     * with its backward on): the fusion itself declines */
    opf_quantize_config qc = {false, true};
    opf_bias_config bc = {H, OPF_F32};
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append(seq, mk(ctx, "quantize", &qc, "q")));
    CHECK_OK(ctx, opf_seq_append(seq, mk(ctx, "bias", &bc, "b")));
    CHECK_OK(ctx, opf_seq_append(seq, mk(ctx, "gelu", NULL, "act")));
    for (int o = 0; o < 3; o++) {
        opf_recipe r = recipe(OPF_RECIPE_CURRENT, o);
        opf_seq_call call = opf_seq_call_default();
        call.recipe = &r;
        CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
        CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));
        opf_tensor_release(&y), opf_tensor_release(&dx);
        CHECK(plan_has(seq, true, "backward_activation_bias") == (o == 0),
              "quantize X, %s: backward_activation_bias %s", ovr_names[o],
              o ? "under an override" : "missing without an override");
    }
    opf_seq_destroy(seq);
}

/* (5): delayed scaling with an override is refused before anything runs. */
static void test_delayed_refused(opf_ctx *ctx)
{
    opf_seq *seq = model(ctx, N_OPS);
    opf_tensor x = wrap2(xs, T, H), y;
    memset(&y, 0, sizeof y);
    for (int o = 1; o < 3; o++) {
        opf_recipe r = recipe(OPF_RECIPE_DELAYED, o);
        opf_seq_call call = opf_seq_call_default();
        call.recipe = &r;
        CHECK_FAILS(ctx, opf_seq_forward(seq, &x, &call, &y, NULL), OPF_ERR_INVALID_ARG,
                    "backward_override must be none for fp8-delayed", ovr_names[o]);
        CHECK(!y.data[0], "no output on refusal");
        CHECK(!opf_op_recipe_state(opf_seq_at(seq, OP_FC1)), "no recipe state made");
    }
    opf_recipe r = recipe(OPF_RECIPE_DELAYED, 0);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &r;
    call.requires_grad = false;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    opf_tensor_release(&y);
    opf_seq_destroy(seq);
}

/* Bias records prevQ in its context unless the recipe overrides the backward. */
static void test_bias_prev_q(opf_ctx *ctx)
{
    opf_bias_config bc = {H, OPF_F32};
    opf_op *b = mk(ctx, "bias", &bc, "b");
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.qdtype = OPF_E5M2;
    opf_tensor x = wrap2(xs, T, H), y;
    for (int o = 0; o < 3; o++) {
        opf_recipe r = recipe(OPF_RECIPE_CURRENT, o);
        opf_fwd_env env = {.ctx = ctx, .x = &x, .prev_grad_q = &q, .recipe = &r, .requires_grad = true};
        opf_op_ctx octx;
        memset(&octx, 0, sizeof octx);
        CHECK_OK(ctx, opf_op_forward(b, &env, &octx, &y));
        CHECK(opf_quantizer_equal(&octx.prev_grad_q, &q) == (o == 0),
              "bias %s: prevQ %s", ovr_names[o], o ? "kept under an override" : "not recorded");
        opf_tensor_release(&y);
        opf_op_ctx_clear(&octx);
    }
    opf_op_destroy(b);
}

/* One basic_linear on its own. Under an override its dx stays plain though
 * the previous op offers an MXFP8 quantizer; high_precision with an input
 * that came quantized decodes that input for wgrad; the override follows
 * the recipe between calls on the same op. */
static void test_linear_alone(opf_ctx *ctx)
{
    enum { K = 64, N = 96, M = 64 };
    static float xv[M * K], dyv[M * N], xd[M * K];
    fill(xv, M * K, 201, 1.0f, 0.0f), fill(dyv, M * N, 202, 1.0f, 0.0f);
    opf_basic_linear_config lc = {K, N, OPF_F32, false};
    opf_op *lin = mk(ctx, "basic_linear", &lc, "fc");
    const float *w = opf_op_param(lin, 0)->value.data[0];
    opf_quantizer pq = opf_quantizer_default();
    pq.scaling = OPF_SCALING_MXFP8;
    pq.qdtype = OPF_E4M3;
    opf_recipe r0 = recipe(OPF_RECIPE_MXFP8, 0);
    opf_quantizer_role role = {"linear", OPF_ROLE_INPUT, "fc"};
    opf_quantizer xq;
    CHECK_OK(NULL, opf_recipe_quantizer(&r0, &role, &xq));
    opf_tensor xp = wrap2(xv, M, K), dy = wrap2(dyv, M, N), xqt, xdt = wrap2(xd, M, K);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &xq, &xp, &xqt));  /* both copies */
    CHECK_OK(ctx, opf_dequantize(ctx, &xqt, OPF_USAGE_ROWWISE, &xdt));
    static const int order[] = {1, 0, 2, 1};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        int o = order[i];
        opf_recipe r = recipe(OPF_RECIPE_MXFP8, o);
        opf_fwd_env env = {.ctx = ctx, .x = &xqt, .prev_grad_q = &pq, .recipe = &r, .requires_grad = true};
        opf_bwd_env benv = {.ctx = ctx, .dy = &dy, .prev_grad_q = &pq};
        opf_op_ctx octx;
        memset(&octx, 0, sizeof octx);
        opf_tensor y, dx;
        opf_op_zero_grad(lin);
        CHECK_OK(ctx, opf_op_forward(lin, &env, &octx, &y));
        CHECK_OK(ctx, opf_op_backward(lin, &octx, &benv, &dx, NULL));
        CHECK((dx.spec.scaling == OPF_SCALING_NONE) == (o != 0), "%s: dx %s", ovr_names[o],
              o ? "quantized under an override" : "not quantized with prevQ");
        const opf_op_class *c = opf_op_class_of(lin);
        CHECK((c->grad_output_quantizer(lin) == NULL) == (o != 0), "%s: callback", ovr_names[o]);
        /* wgrad operand: the decoded rowwise copy under either override */
        int bad = o ? n_off_atb(opf_op_param(lin, 0)->grad.data[0], dyv, xd, M, N, K, GEMM_RTOL) : 0;
        CHECK(!bad, "%s: %d dW elements off the FP64 reference on the decoded input", ovr_names[o],
              bad);
        /* dgrad: high_precision reads the original weight */
        bad = o == OPF_BACKWARD_HIGH_PRECISION ? n_off_ab(dx.data[0], dyv, w, M, N, K, GEMM_RTOL) : 0;
        CHECK(!bad, "%s: %d dx elements off dy W in FP64", ovr_names[o], bad);
        opf_tensor_release(&y), opf_tensor_release(&dx);
    }
    opf_tensor_release(&xqt);
    opf_op_destroy(lin);
}

/* dequantized with bf16 activations: the operands decode to bf16, the
 * compute dtype; dx is bf16 and dW matches FP64 on those decoded values. */
static void test_dequantized_bf16(opf_ctx *ctx)
{
    enum { K = 64, N = 32, M = 48 };
    static float xv[M * K], dyv[M * N], wd[N * K], xd[M * K];
    fill(xv, M * K, 301, 2.0f, 0.0f), fill(dyv, M * N, 302, 0.5f, 0.0f);
    opf_basic_linear_config lc = {K, N, OPF_F32, false};
    opf_op *lin = mk(ctx, "basic_linear", &lc, "fc");
    opf_recipe r = recipe(OPF_RECIPE_CURRENT, OPF_BACKWARD_DEQUANTIZED);
    opf_spec sx = {.ndim = 2, .shape = {M, K}, .dtype = OPF_BF16};
    opf_spec sd = {.ndim = 2, .shape = {M, N}, .dtype = OPF_BF16};
    opf_tensor x, dy, y, dx;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sx, &x));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sd, &dy));
    CHECK_OK(ctx, opf_convert(xv, OPF_F32, x.data[0], OPF_BF16, M * K));
    CHECK_OK(ctx, opf_convert(dyv, OPF_F32, dy.data[0], OPF_BF16, M * N));
    CHECK_OK(ctx, opf_convert(dy.data[0], OPF_BF16, dyv, OPF_F32, M * N));
    /* the reference operands: quantized as the forward does, decoded to bf16 */
    opf_quantizer_role rx = {"linear", OPF_ROLE_INPUT, "fc"}, rw = {"linear", OPF_ROLE_WEIGHT, "fc"};
    opf_quantizer qx, qw;
    CHECK_OK(NULL, opf_recipe_quantizer(&r, &rx, &qx));
    CHECK_OK(NULL, opf_recipe_quantizer(&r, &rw, &qw));
    qx.usage = qw.usage = OPF_USAGE_ROWWISE;
    opf_tensor xq, wq, xb, wb;
    opf_spec sxb = sx, swb = {.ndim = 2, .shape = {N, K}, .dtype = OPF_BF16};
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &qx, &x, &xq));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &qw, &opf_op_param(lin, 0)->value, &wq));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sxb, &xb));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &swb, &wb));
    CHECK_OK(ctx, opf_dequantize(ctx, &xq, OPF_USAGE_ROWWISE, &xb));
    CHECK_OK(ctx, opf_dequantize(ctx, &wq, OPF_USAGE_ROWWISE, &wb));
    CHECK_OK(ctx, opf_convert(xb.data[0], OPF_BF16, xd, OPF_F32, M * K));
    CHECK_OK(ctx, opf_convert(wb.data[0], OPF_BF16, wd, OPF_F32, N * K));
    opf_fwd_env env = {.ctx = ctx, .x = &x, .recipe = &r, .requires_grad = true};
    opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
    opf_op_ctx octx;
    memset(&octx, 0, sizeof octx);
    CHECK_OK(ctx, opf_op_forward(lin, &env, &octx, &y));
    CHECK_OK(ctx, opf_op_backward(lin, &octx, &benv, &dx, NULL));
    CHECK(dx.spec.dtype == OPF_BF16 && dx.spec.scaling == OPF_SCALING_NONE, "bf16 plain dx");
    static float dxf[M * K];
    CHECK_OK(ctx, opf_convert(dx.data[0], OPF_BF16, dxf, OPF_F32, M * K));
    int bad_w = n_off_atb(opf_op_param(lin, 0)->grad.data[0], dyv, xd, M, N, K, GEMM_RTOL);
    int bad_x = n_off_ab(dxf, dyv, wd, M, N, K, 1.6e-2);  /* dx rounded to bf16 */
    CHECK(!bad_w && !bad_x, "bf16 dequantized: %d dW, %d dx elements off FP64", bad_w, bad_x);
    opf_tensor_release(&y), opf_tensor_release(&dx);
    opf_tensor_release(&x), opf_tensor_release(&dy), opf_tensor_release(&xq);
    opf_tensor_release(&wq), opf_tensor_release(&xb), opf_tensor_release(&wb);
    opf_op_destroy(lin);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    fill(xs, T * H, 11, 1.0f, 0.5f);
    fill(dys, T * H, 12, 1.0f, 0.0f);
    for (int k = 0; k < NKINDS; k++) test_kind(ctx, kinds[k]);
    test_plans(ctx);
    test_delayed_refused(ctx);
    test_bias_prev_q(ctx);
    test_linear_alone(ctx);
    test_dequantized_bf16(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
