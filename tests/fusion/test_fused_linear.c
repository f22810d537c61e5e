/* test_fused_linear.c: the fused ops built around basic_linear
 * (forward_linear_bias_activation, forward_linear_bias,
 * forward_linear_bias_add, forward_linear_add, forward_linear_scale_add,
 * backward_linear_add, backward_linear_scale).
 *
 * One table row per model (a string of basic ops) with the forward and
 * backward plans it must get: the fused op appears exactly where its
 * conditions hold (in-place flags, the op that follows), forward and
 * backward plans differ where they should. Each row runs under every recipe
 * in f32 and bf16 with fusions on and off (same weights, same RNG state, a
 * fresh recipe state each time) and compares y, dx, every parameter
 * gradient (or main_grad), the extra inputs' gradients: bitwise where the
 * fused kernel does the same roundings (the masks in the table, f32 only),
 * else within the dtype's or the recipe's tolerance (numerics.md 8.3) scaled
 * by the tensor's amax. Also: fake-vs-real conformance of every fused op
 * that ran, quantized outputs of the forward fusions equal to quantizing
 * their plain output, and bad inputs that name the op and the values.
 *
 * Fusions of other files that could claim the same ops in backward
 * (backward_activation_bias over bias + gelu) are unregistered first, so
 * every difference measured here is one of these ops. */
#include <stdint.h>

#include "test.h"

#include "op/op-impl.h"
#include "ops/ops-impl.h"

enum { M = 64, H = 128, MAXOPS = 8 };

static opf_ctx *ctx;
static unsigned long long rng = 0xF05Eull;

static const opf_recipe_kind recipes[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                          OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
enum { NREC = sizeof recipes / sizeof recipes[0] };
#define RB(k) (1u << (k))
#define ALLR 0x3Fu

/* ---- the table ------------------------------------------------------------------ */

enum {
    CHAN      = 1 << 0,  /* make_extra_output's output feeds the add through channel "res" */
    NO_DEXTRA = 1 << 1,  /* no gradient for the public extra output */
    MAIN_GRAD = 1 << 2,  /* linears accumulate into main_grad */
    FIRST_MB  = 1 << 3,  /* is_first_microbatch = 1 (the weight cache) */
    INFER     = 1 << 4,  /* no backward (requires_grad false) */
    KINK      = 1 << 5,  /* y = relu(...): see kink_masks */
};

typedef struct scen {
    const char *name;
    const char *ops;     /* L basic_linear, B bias, G gelu, R relu, U silu, S constant_scale,
                            A / a add_extra_input (in place / not), M / m make_extra_output */
    double      scale;
    unsigned    flags;
    const char *fwd_plan, *bwd_plan;
    unsigned    exact_fwd, exact_bwd;  /* recipes where f32 results equal the unfused bitwise */
} scen;

/* Why the masks: the fused epilogues round where the unfused ops do when the
 * activations are f32 (GEMM + bias, + C, FP8/NVFP4 outputs from the same
 * fp32 values); a power-of-two scale commutes with every rounding, except
 * that delayed scaling keeps its scale, so s * dy may fall under the FP8
 * range where dy does not; a scale of 0.37 folded into alpha
 * (BackwardLinearScale) does not commute. */
static const scen scens[] = {
    {"linear+bias+gelu", "LBG", 0, 0, "forward_linear_bias_activation", "basic_linear,bias,gelu",
     ALLR, ALLR},
    {"linear+bias+gelu, quantized output", "LBGL", 0, 0,
     "forward_linear_bias_activation,basic_linear", "basic_linear,bias,gelu,basic_linear", ALLR,
     ALLR},
    {"linear+bias+relu", "LBR", 0, KINK, "forward_linear_bias_activation",
     "basic_linear,bias,relu", ALLR, ALLR},
    {"linear+bias+relu, quantized output", "LBRL", 0, INFER,
     "forward_linear_bias_activation,basic_linear", NULL, ALLR, 0},
    {"linear+bias+gelu, inference", "LBGL", 0, INFER,
     "forward_linear_bias_activation,basic_linear", NULL, ALLR, 0},
    {"linear+bias, quantized output", "LBL", 0, 0, "forward_linear_bias,basic_linear",
     "basic_linear,bias,basic_linear", ALLR, ALLR},
    {"linear+bias, weight cache", "LBL", 0, FIRST_MB, "forward_linear_bias,basic_linear",
     "basic_linear,bias,basic_linear", ALLR, ALLR},
    {"linear+bias", "LB", 0, 0, "forward_linear_bias", "basic_linear,bias", ALLR, ALLR},
    {"silu stays out of the fusion", "LBUL", 0, 0, "forward_linear_bias,silu,basic_linear",
     "basic_linear,bias,silu,basic_linear", ALLR, ALLR},
    {"linear+bias+add", "LBA", 0, 0, "forward_linear_bias_add", "basic_linear,bias,add_extra_input",
     ALLR, ALLR},
    {"linear+add", "LA", 0, 0, "forward_linear_add", "basic_linear,add_extra_input", ALLR, ALLR},
    {"add not in place", "LBa", 0, 0, "forward_linear_bias,add_extra_input",
     "basic_linear,bias,add_extra_input", ALLR, ALLR},
    {"add not in place, no bias", "La", 0, 0, "basic_linear,add_extra_input",
     "basic_linear,add_extra_input", ALLR, ALLR},
    {"linear+scale+add", "LSA", 0.5, 0, "forward_linear_scale_add",
     "backward_linear_scale,add_extra_input", ALLR, ALLR & ~RB(OPF_RECIPE_DELAYED)},
    {"linear+scale+add, scale 0.37", "LSA", 0.37, 0, "forward_linear_scale_add",
     "backward_linear_scale,add_extra_input",
     RB(OPF_RECIPE_NONE) | RB(OPF_RECIPE_BLOCK) | RB(OPF_RECIPE_MXFP8), 0},
    {"scale+add not in place", "LSa", 0.37, 0, "basic_linear,constant_scale,add_extra_input",
     "backward_linear_scale,add_extra_input", ALLR, 0},
    {"linear+scale, main_grad", "LS", 0.37, MAIN_GRAD, "basic_linear,constant_scale",
     "backward_linear_scale", ALLR, 0},
    {"make+linear", "ML", 0, 0, "make_extra_output,basic_linear", "backward_linear_add", ALLR, ALLR},
    {"make+linear, no extra gradient", "ML", 0, NO_DEXTRA, "make_extra_output,basic_linear",
     "backward_linear_add", ALLR, ALLR},
    {"make not in place", "mL", 0, 0, "make_extra_output,basic_linear",
     "make_extra_output,basic_linear", ALLR, ALLR},
    {"residual inside the group", "MLA", 0, CHAN, "make_extra_output,forward_linear_add",
     "backward_linear_add,add_extra_input", ALLR, ALLR},
};
enum { NSCEN = sizeof scens / sizeof scens[0] };

/* ---- helpers ------------------------------------------------------------------------- */

static void *xcalloc(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

static opf_op *mk(const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

/* A plain tensor of N(0, sigma) values rounded to dt, drawn from *state. */
static opf_tensor rand_tensor_from(unsigned long long *state, int ndim, const int64_t *shape,
                                   opf_dtype dt, float sigma)
{
    opf_spec s = opf_spec_make(ndim, shape, dt);
    int64_t n = opf_spec_numel(&s);
    float *v = xcalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(state, sigma);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    CHECK_OK(ctx, opf_convert(v, OPF_F32, t.data[OPF_COMP_DATA], dt, (size_t)n));
    free(v);
    return t;
}

static opf_tensor rand_tensor(int ndim, const int64_t *shape, opf_dtype dt, float sigma)
{
    return rand_tensor_from(&rng, ndim, shape, dt, sigma);
}

/* The values of t (dequantized rowwise when quantized) as new floats. */
static float *values(const opf_tensor *t)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *v = xcalloc((size_t)n * sizeof(float));
    if (t->spec.scaling == OPF_SCALING_NONE) {
        CHECK_OK(ctx, opf_convert(t->data[OPF_COMP_DATA], t->spec.dtype, v, OPF_F32, (size_t)n));
    } else {
        opf_tensor w;
        opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
        opf_tensor_wrap(&s, v, &w);
        CHECK_OK(ctx, opf_dequantize(ctx, t, OPF_USAGE_ROWWISE, &w));
    }
    return v;
}

/* Tolerances of numerics.md 8.3: the dtype's (f32 GEMMs take fp16's), or the
 * recipe's quantization tolerance (gradients of a HYBRID FP8 recipe are
 * E5M2); atol is relative to the tensor's amax. */
static void tols(opf_dtype dt, const opf_recipe *r, bool backward, double *rtol, double *atol)
{
    if (!r) {
        *rtol = dt == OPF_BF16 ? 1.6e-2 : 1e-3;
        *atol = dt == OPF_BF16 ? 1e-2 : 1e-5;
    } else if (r->kind == OPF_RECIPE_NVFP4 || (backward && r->format == OPF_FORMAT_HYBRID)) {
        *rtol = 0.25, *atol = 0.125;  /* E2M1, E5M2 */
    } else {
        *rtol = 0.125, *atol = 0.0675;  /* E4M3 */
    }
}

/* got vs want: bitwise, or |got - want| <= atol * amax(want) + rtol * |want|. */
static void compare_skip(const char *tag, const char *what, const float *got, const float *want,
                         int64_t n, bool exact, double rtol, double atol, const bool *skip)
{
    if (exact) {
        int64_t bad = 0, first = -1;
        for (int64_t i = 0; i < n; i++)
            if (memcmp(&got[i], &want[i], sizeof(float)) && bad++ == 0) first = i;
        CHECK(bad == 0, "%s %s: %lld of %lld differ from the unfused bits (first [%lld] %.9g vs "
              "%.9g)", tag, what, (long long)bad, (long long)n, (long long)first,
              first >= 0 ? got[first] : 0.0, first >= 0 ? want[first] : 0.0);
        return;
    }
    double amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fmax(amax, fabs(want[i]));
    int64_t bad = 0, worst = 0;
    double wr = 0;
    for (int64_t i = 0; i < n; i++) {
        if (skip && skip[i]) continue;
        double e = fabs((double)got[i] - want[i]), tol = atol * amax + rtol * fabs(want[i]);
        if (!(e <= tol)) bad++;
        if (e > wr) wr = e, worst = i;
    }
    CHECK(bad == 0 && amax > 0, "%s %s: %lld of %lld outside rtol %g atol %g*amax %g (worst [%lld] "
          "%.9g vs %.9g)", tag, what, (long long)bad, (long long)n, rtol, atol, amax,
          (long long)worst, got[worst], want[worst]);
}

static void compare(const char *tag, const char *what, const float *got, const float *want,
                    int64_t n, bool exact, double rtol, double atol)
{
    compare_skip(tag, what, got, want, n, exact, rtol, atol, NULL);
}

/* "forward_linear_bias,basic_linear": the classes of group 0's plan. */
static void plan_str(opf_seq *seq, bool backward, char *buf, size_t size)
{
    opf_plan_entry e[MAXOPS];
    int n = opf_seq_plan(seq, 0, backward, e, MAXOPS);
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && at < size; i++)
        at += (size_t)snprintf(buf + at, size - at, "%s%s", i ? "," : "", opf_op_class_of(e[i].op)->name);
}

/* ---- models ------------------------------------------------------------------------- */

static int count(const char *s, const char *chars)
{
    int n = 0;
    for (; *s; s++) n += strchr(chars, *s) != NULL;
    return n;
}

/* The model of a row; the same weights on every call (they come from the
 * context's Philox stream at seed 5, the biases from fixed seeds). */
static opf_seq *build(const scen *sc, opf_dtype dt)
{
    opf_ctx_set_rng(ctx, 5, 0);
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_op *mo = NULL, *ad = NULL;
    for (int i = 0; sc->ops[i]; i++) {
        char name[16];
        snprintf(name, sizeof name, "%c%d", sc->ops[i], i);
        opf_op *op = NULL;
        switch (sc->ops[i]) {
        case 'L': {
            opf_basic_linear_config c = {H, H, dt, (sc->flags & MAIN_GRAD) != 0};
            op = mk("basic_linear", &c, name);
            break;
        }
        case 'B': {
            opf_bias_config c = {H, dt};
            op = mk("bias", &c, name);
            unsigned long long seed = 0xB1A5ull + (unsigned)i;  /* the same in every build */
            opf_tensor b = rand_tensor_from(&seed, 1, (int64_t[]){H}, dt, 0.5f);  /* not 0 */
            memcpy(opf_op_param(op, 0)->value.data[0], b.data[0], (size_t)H * (dt == OPF_F32 ? 4 : 2));
            opf_tensor_release(&b);
            break;
        }
        case 'G': op = mk("gelu", NULL, name); break;
        case 'R': op = mk("relu", NULL, name); break;
        case 'U': op = mk("silu", NULL, name); break;
        case 'S': {
            opf_constant_scale_config c = {sc->scale};
            op = mk("constant_scale", &c, name);
            break;
        }
        case 'A':
        case 'a': {
            opf_inplace_config c = {sc->ops[i] == 'A'};
            op = ad = mk("add_extra_input", &c, name);
            break;
        }
        case 'M':
        case 'm': {
            opf_inplace_config c = {sc->ops[i] == 'M'};
            op = mo = mk("make_extra_output", &c, name);
            break;
        }
        }
        CHECK_OK(ctx, opf_seq_append(seq, op));
    }
    if (sc->flags & CHAN) {
        CHECK_OK(NULL, opf_op_set_extra_output(mo, 0, "res", false));
        CHECK_OK(NULL, opf_op_set_extra_input(ad, 0, "res"));
    }
    return seq;
}

/* What one run produced, as floats. */
typedef struct result {
    float  *y, *dx, *dextra;
    float  *grad[MAXOPS];
    int64_t ngrad[MAXOPS];
    int     n_grad;
    char    fwd_plan[256], bwd_plan[256];
} result;

static void result_free(result *r)
{
    free(r->y), free(r->dx), free(r->dextra);
    for (int i = 0; i < r->n_grad; i++) free(r->grad[i]);
    memset(r, 0, sizeof *r);
}

static void collect_grad(void *user, opf_op *op, opf_param *p)
{
    result *r = user;
    const opf_tensor *g = p->main_grad.data[0] ? &p->main_grad : &p->grad;
    r->ngrad[r->n_grad] = opf_spec_numel(&g->spec);
    r->grad[r->n_grad++] = values(g);
}

/* Inputs of one row: x, dy, the public extra input and extra-output gradient. */
typedef struct inputs {
    opf_tensor x, dy, extra, dextra;
} inputs;

/* The fused ops that ran: their fakes on data-less copies of their args
 * agree with what they produced (what a compiled graph must keep). */
static void *dataless(const opf_schema *schema, const void *args)
{
    static _Alignas(16) unsigned char copy[OPF_OP_ARGS_MAX];
    memcpy(copy, args, schema->size);
    opf_slot slots[16];
    int ns = opf_schema_slots(schema, copy, slots, 16);
    for (int i = 0; i < ns && i < 16; i++)
        for (int c = 0; c < OPF_COMP_COUNT; c++)
            if (slots[i].tensor->data[c]) slots[i].tensor->data[c] = (void *)(uintptr_t)1;
    return copy;
}

static void check_fakes(const char *tag, opf_seq *seq, const opf_tensor *y, const opf_tensor *dx)
{
    opf_plan_entry e[MAXOPS];
    int n = opf_seq_plan(seq, 0, false, e, MAXOPS);
    for (int i = 0; i < n; i++) {
        const opf_op *op = e[i].op;
        if (!opf_op_is_fused(op)) continue;
        opf_spec o[1 + OPF_OP_MAX_EXTRA], a[OPF_OP_MAX_AUX], o2[1 + OPF_OP_MAX_EXTRA], a2[OPF_OP_MAX_AUX];
        for (int k = 0; k < OPF_OP_MAX_AUX; k++) a[k].ndim = a2[k].ndim = OPF_SPEC_NONE_NDIM;
        CHECK(op->cls->forward_fake(op->fwd_args, o, a) == OPF_OK, "%s fake", tag);
        CHECK(op->cls->forward_fake(dataless(op->cls->fwd_schema, op->fwd_args), o2, a2) == OPF_OK,
              "%s data-less fake: %s", tag, opf_last_error(NULL));
        bool same = opf_spec_equal(&o[0], &o2[0]);
        for (int k = 0; k < OPF_OP_MAX_AUX; k++)
            same &= a[k].ndim == a2[k].ndim && (a[k].ndim < 0 || opf_spec_equal(&a[k], &a2[k]));
        CHECK(same, "%s: %s's fake reads data", tag, opf_op_name(op));
        if (i == n - 1) CHECK(opf_spec_equal(&o2[0], &y->spec), "%s: %s's fake differs from its output",
                              tag, opf_op_name(op));
    }
    if (!dx) return;
    n = opf_seq_plan(seq, 0, true, e, MAXOPS);
    const opf_op *op = e[0].op;
    if (!opf_op_is_fused(op)) return;
    opf_spec g[OPF_OP_MAX_GRADS];
    for (int k = 0; k < OPF_OP_MAX_GRADS; k++) g[k].ndim = OPF_SPEC_NONE_NDIM;
    CHECK(op->cls->backward_fake(dataless(op->cls->bwd_schema, op->bwd_args), g) == OPF_OK,
          "%s backward fake: %s", tag, opf_last_error(NULL));
    CHECK(opf_spec_equal(&g[0], &dx->spec), "%s: %s's backward fake differs from its dx", tag,
          opf_op_name(op));
    const opf_param *w = opf_op_param_const(op, 0);
    bool main_grad = w->main_grad.data[0] != NULL;
    CHECK(main_grad ? g[1].ndim < 0 : opf_spec_equal(&g[1], &w->grad.spec),
          "%s: %s's weight gradient spec", tag, opf_op_name(op));
}

/* One forward (+ backward) with fusions on or off into *r. */
static bool run(opf_seq *seq, const scen *sc, const opf_recipe *rec, const inputs *in, bool fused,
                const char *tag, result *r)
{
    memset(r, 0, sizeof *r);
    opf_seq_set_fusions(seq, fused);
    opf_seq_zero_grad(seq);
    opf_ctx_set_rng(ctx, 77, 4096);  /* stochastic rounding replays the same draws */
    bool chan = (sc->flags & CHAN) != 0;
    int n_in = count(sc->ops, "Aa") - chan, n_out = count(sc->ops, "Mm") - chan;
    opf_basic_linear_kwargs kw = {1};
    const void *kwargs[MAXOPS] = {0};
    for (int i = 0; sc->ops[i]; i++)
        if (sc->ops[i] == 'L') kwargs[i] = &kw;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = rec;
    call.requires_grad = !(sc->flags & INFER);
    call.n_extra_in = n_in;
    call.extra_in = &in->extra;
    call.kwargs = sc->flags & FIRST_MB ? kwargs : NULL;
    opf_tensor y, dx, eo, de;
    opf_status st = opf_seq_forward(seq, &in->x, &call, &y, n_out ? &eo : NULL);
    CHECK(st == OPF_OK, "%s forward (fused %d): %s", tag, fused, opf_last_error(ctx));
    if (st) return false;
    plan_str(seq, false, r->fwd_plan, sizeof r->fwd_plan);
    plan_str(seq, true, r->bwd_plan, sizeof r->bwd_plan);
    r->y = values(&y);
    if (n_out) opf_tensor_release(&eo);
    if (sc->flags & INFER) {
        if (fused) check_fakes(tag, seq, &y, NULL);
        opf_tensor_release(&y);
        return true;
    }
    const opf_tensor *dext = n_out && !(sc->flags & NO_DEXTRA) ? &in->dextra : NULL;
    st = opf_seq_backward(seq, &in->dy, dext, &dx, n_in ? &de : NULL);
    CHECK(st == OPF_OK, "%s backward (fused %d): %s", tag, fused, opf_last_error(ctx));
    if (st) {
        opf_tensor_release(&y);
        return false;
    }
    if (fused) check_fakes(tag, seq, &y, &dx);
    r->dx = values(&dx);
    if (n_in) r->dextra = values(&de), opf_tensor_release(&de);
    opf_seq_for_each_param(seq, collect_grad, r);
    opf_tensor_release(&y), opf_tensor_release(&dx);
    return true;
}

/* The unfused plan: every basic op by itself. */
static void basic_plan(const scen *sc, char *buf, size_t size)
{
    static const char *const names[128] = {
        ['L'] = "basic_linear", ['B'] = "bias", ['G'] = "gelu", ['R'] = "relu", ['U'] = "silu",
        ['S'] = "constant_scale", ['A'] = "add_extra_input", ['a'] = "add_extra_input",
        ['M'] = "make_extra_output", ['m'] = "make_extra_output"};
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; sc->ops[i] && at < size; i++)
        at += (size_t)snprintf(buf + at, size - at, "%s%s", i ? "," : "", names[(int)sc->ops[i]]);
}

/* ReLU's derivative jumps at 0: where the unfused op's extra rounding moves
 * a pre-activation across 0 (it shows as y > 0 in one run only), its
 * gradient legitimately differs. Those entries of the gradients are
 * skipped: the dx rows, the weight-gradient rows and bias entries of the
 * affected outputs. Such flips must stay rare. */
static void kink_masks(const char *tag, const result *on, const result *off, bool *skip_dx,
                       bool *skip_dw, bool *skip_db)
{
    int flips = 0;
    memset(skip_dx, 0, sizeof(bool) * M * H);
    memset(skip_dw, 0, sizeof(bool) * H * H);
    memset(skip_db, 0, sizeof(bool) * H);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < H; n++) {
            if ((on->y[m * H + n] > 0) == (off->y[m * H + n] > 0)) continue;
            flips++;
            for (int k = 0; k < H; k++) skip_dx[m * H + k] = skip_dw[n * H + k] = true;
            skip_db[n] = true;
        }
    CHECK(flips * 200 <= M * H, "%s: %d of %d ReLU derivatives flipped", tag, flips, M * H);
}

static void run_row(const scen *sc, opf_dtype dt, int k)
{
    char tag[160];
    snprintf(tag, sizeof tag, "[%s / %s / %s]", sc->name, opf_dtype_name(dt), opf_recipe_name(recipes[k]));
    inputs in;
    int64_t shape[2] = {M, H};
    in.x = rand_tensor(2, shape, dt, 1.0f);
    in.dy = rand_tensor(2, shape, dt, 1.0f);
    in.extra = rand_tensor(2, shape, dt, 1.0f);
    in.dextra = rand_tensor(2, shape, dt, 1.0f);
    opf_recipe r = opf_recipe_default(recipes[k]);
    r.amax_history_len = 4;
    const opf_recipe *rec = recipes[k] == OPF_RECIPE_NONE ? NULL : &r;
    /* a fresh model per run: the same weights, a fresh recipe state */
    result off, on;
    opf_seq *seq = build(sc, dt);
    bool ok = run(seq, sc, rec, &in, false, tag, &off);
    opf_seq_destroy(seq);
    seq = build(sc, dt);
    ok = ok && run(seq, sc, rec, &in, true, tag, &on);
    opf_seq_destroy(seq);
    if (ok) {
        char want[256];
        basic_plan(sc, want, sizeof want);
        CHECK(!strcmp(off.fwd_plan, want) && !strcmp(off.bwd_plan, want), "%s unfused plans %s / %s",
              tag, off.fwd_plan, off.bwd_plan);
        CHECK(!strcmp(on.fwd_plan, sc->fwd_plan), "%s forward plan %s, want %s", tag, on.fwd_plan,
              sc->fwd_plan);
        if (sc->bwd_plan)
            CHECK(!strcmp(on.bwd_plan, sc->bwd_plan), "%s backward plan %s, want %s", tag,
                  on.bwd_plan, sc->bwd_plan);
        double rtol, atol;
        tols(dt, rec, false, &rtol, &atol);
        bool xf = dt == OPF_F32 && (sc->exact_fwd & RB(recipes[k]));
        bool xb = dt == OPF_F32 && (sc->exact_bwd & RB(recipes[k]));
        compare(tag, "y", on.y, off.y, M * H, xf, rtol, atol);
        if (on.dx) {
            static bool skip_dx[M * H], skip_dw[H * H], skip_db[H];
            bool kink = (sc->flags & KINK) && !xb;
            if (kink) kink_masks(tag, &on, &off, skip_dx, skip_dw, skip_db);
            tols(dt, rec, true, &rtol, &atol);
            compare_skip(tag, "dx", on.dx, off.dx, M * H, xb, rtol, atol, kink ? skip_dx : NULL);
            if (on.dextra) compare(tag, "d(extra)", on.dextra, off.dextra, M * H, xb, rtol, atol);
            CHECK(on.n_grad == off.n_grad, "%s parameter count", tag);
            for (int i = 0; i < on.n_grad && i < off.n_grad; i++) {
                char what[32];
                snprintf(what, sizeof what, "grad of param %d", i);
                const bool *skip = !kink ? NULL : on.ngrad[i] == H ? skip_db : skip_dw;
                compare_skip(tag, what, on.grad[i], off.grad[i], on.ngrad[i], xb, rtol, atol, skip);
            }
        }
    }
    result_free(&off), result_free(&on);
    opf_tensor_release(&in.x), opf_tensor_release(&in.dy);
    opf_tensor_release(&in.extra), opf_tensor_release(&in.dextra);
}

static void test_table(void)
{
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16};
    for (int s = 0; s < NSCEN; s++)
        for (int d = 0; d < 2; d++)
            for (int k = 0; k < NREC; k++) run_row(&scens[s], dts[d], k);
}

/* ---- precision ------------------------------------------------------------------------ */

/* Relative Frobenius error of got against ref. */
static double rel_err(const float *got, const double *ref, int64_t n)
{
    double e = 0, r = 0;
    for (int64_t i = 0; i < n; i++) e += (got[i] - ref[i]) * (got[i] - ref[i]), r += ref[i] * ref[i];
    return sqrt(e / (r > 0 ? r : 1));
}

/* The fused linear+bias+gelu skips the unfused ops' two intermediate
 * roundings: against an FP64 reference on the same bf16 inputs and weights
 * it is within bf16's tolerance and no less precise than the unfused ops. */
static void test_precision(void)
{
    const scen sc = {"precision", "LBG", 0, INFER, "", NULL, 0, 0};
    opf_seq *seq = build(&sc, OPF_BF16);
    inputs in;
    memset(&in, 0, sizeof in);
    in.x = rand_tensor(2, (int64_t[]){M, H}, OPF_BF16, 1.0f);
    float *x = values(&in.x), *w = values(&opf_op_param(opf_seq_at(seq, 0), 0)->value);
    float *b = values(&opf_op_param(opf_seq_at(seq, 1), 0)->value);
    double *ref = xcalloc(sizeof(double) * M * H);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < H; n++) {
            double t = b[n];
            for (int k = 0; k < H; k++) t += (double)x[m * H + k] * w[n * H + k];
            ref[m * H + n] = t * (0.5 + 0.5 * tanh(t * (0.79788456 + 0.03567741 * t * t)));
        }
    result off, on;
    if (run(seq, &sc, NULL, &in, false, "[precision]", &off) &&
        run(seq, &sc, NULL, &in, true, "[precision]", &on)) {
        double e_on = rel_err(on.y, ref, M * H), e_off = rel_err(off.y, ref, M * H);
        CHECK(e_on <= 1.6e-2 && e_on <= e_off * 1.05, "fused error %.3g, unfused %.3g", e_on, e_off);
    }
    result_free(&off), result_free(&on);
    free(x), free(w), free(b), free(ref);
    opf_tensor_release(&in.x);
    opf_seq_destroy(seq);
}

/* ---- quantized outputs and conformance, op by op ------------------------------------ */

/* Runs fused op f forward on x for the next op's quantizer q (NULL: plain);
 * checks its fake on data-less args against the real output. */
static opf_status fused_forward(opf_op *f, const opf_tensor *x, const opf_quantizer *q,
                                const opf_recipe *r, opf_tensor *outs)
{
    const void *kw[3] = {0};
    opf_fwd_env env = {.ctx = ctx, .x = x, .next_input_q = q, .recipe = r, .kwargs = kw};
    opf_status st = opf_op_forward(f, &env, NULL, outs);
    if (st) return st;
    opf_spec o[1 + OPF_OP_MAX_EXTRA], a[OPF_OP_MAX_AUX];
    CHECK(f->cls->forward_fake(dataless(f->cls->fwd_schema, f->fwd_args), o, a) == OPF_OK &&
              opf_spec_equal(&o[0], &outs[0].spec),
          "%s: fake and real outputs differ", opf_op_name(f));
    return OPF_OK;
}

/* The forward fusions' quantized outputs equal quantizing their plain output
 * with the next op's quantizer: bitwise where the same values reach the
 * quantizer (f32 activations; bf16 through opf_op_store_f32, which rounds
 * to bf16 first), within the recipe's tolerance where the fusion quantizes
 * the fp32 value (delayed scaling of the activation's output; the
 * per-tensor FP8 output of the GEMM itself). */
static void test_quantized_outputs(void)
{
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16};
    for (int k = 1; k < NREC; k++)
        for (int d = 0; d < 2; d++) {
            opf_dtype dt = dts[d];
            opf_recipe r = opf_recipe_default(recipes[k]);
            r.amax_history_len = 4;
            opf_ctx_set_rng(ctx, 9, 0);
            opf_basic_linear_config lc = {H, H, dt, false};
            opf_bias_config bc = {H, dt};
            opf_op *parts[3] = {mk("basic_linear", &lc, "fc"), mk("bias", &bc, "b"), mk("gelu", NULL, "g")};
            opf_op *next = mk("basic_linear", &lc, "next");
            CHECK_OK(ctx, opf_op_reset_recipe(ctx, parts[0], &r));
            CHECK_OK(ctx, opf_op_reset_recipe(ctx, next, &r));
            opf_quantizer q = *opf_op_quantizer(next, OPF_ROLE_INPUT, 0);
            opf_tensor x = rand_tensor(2, (int64_t[]){M, H}, dt, 1.0f);
            for (int n = 2; n <= 3; n++) {
                const char *cls = n == 3 ? "forward_linear_bias_activation" : "forward_linear_bias";
                char tag[128];
                snprintf(tag, sizeof tag, "[%s / %s / %s]", cls, opf_dtype_name(dt), opf_recipe_name(recipes[k]));
                opf_op *f = NULL;
                CHECK_OK(ctx, opf_fused_op_create(ctx, cls, parts, n, &f));
                opf_tensor yq, yp, want;
                if (fused_forward(f, &x, &q, &r, &yq) || fused_forward(f, &x, NULL, &r, &yp)) {
                    CHECK(0, "%s forward: %s", tag, opf_last_error(ctx));
                    opf_op_destroy(f);
                    continue;
                }
                CHECK(yp.spec.scaling == OPF_SCALING_NONE && yp.spec.dtype == dt, "%s plain output", tag);
                CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &yp, &want));
                bool fp32_cast = n == 3 ? q.delayed != NULL : q.scaling == OPF_SCALING_TENSOR;
                if (dt == OPF_F32 || !fp32_cast) {
                    CHECK(opf_test_same_bytes(&yq, &want), "%s: the quantized output is not the quantized "
                          "plain output", tag);
                } else {
                    double rtol, atol;
                    tols(dt, &r, false, &rtol, &atol);
                    float *a = values(&yq), *b = values(&want);
                    compare(tag, "quantized y", a, b, M * H, false, rtol, atol);
                    free(a), free(b);
                }
                opf_tensor_release(&yq), opf_tensor_release(&yp), opf_tensor_release(&want);
                opf_op_destroy(f);
            }
            opf_tensor_release(&x);
            for (int i = 0; i < 3; i++) opf_op_destroy(parts[i]);
            opf_op_destroy(next);
        }
}

/* ---- bad inputs ---------------------------------------------------------------------- */

static void test_errors(void)
{
    opf_basic_linear_config lc = {H, H, OPF_F32, false};
    opf_bias_config half = {H / 2, OPF_F32};
    opf_tensor x = rand_tensor(2, (int64_t[]){M, H}, OPF_F32, 1.0f);
    opf_tensor narrow = rand_tensor(2, (int64_t[]){M, H / 2}, OPF_F32, 1.0f);
    opf_tensor y, dx;
    memset(&y, 0, sizeof y);
    opf_seq_call call = opf_seq_call_default();

    /* a bias that does not fit the linear: named by the fused op */
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_seq_append(seq, mk("basic_linear", &lc, "fc"));
    opf_seq_append(seq, mk("bias", &half, "b"));
    CHECK_FAILS(ctx, opf_seq_forward(seq, &x, &call, &y, NULL), OPF_ERR_SHAPE,
                "forward_linear_bias(fc,b)", "128 outputs", "64 values");
    CHECK(!y.data[0], "no output after an error");
    opf_seq_destroy(seq);

    /* an input of the wrong width: the linear's own message */
    opf_bias_config bc = {H, OPF_F32};
    opf_seq_create(ctx, &seq);
    opf_seq_append(seq, mk("basic_linear", &lc, "fc"));
    opf_seq_append(seq, mk("bias", &bc, "b"));
    opf_seq_append(seq, mk("gelu", NULL, "g"));
    CHECK_FAILS(ctx, opf_seq_forward(seq, &narrow, &call, &y, NULL), OPF_ERR_SHAPE,
                "basic_linear \"fc\"", "64 features", "expects 128");
    opf_seq_destroy(seq);

    /* an extra input of another shape; the weight is left as it was */
    opf_inplace_config inpl = {true};
    opf_seq_create(ctx, &seq);
    opf_op *fc = mk("basic_linear", &lc, "fc");
    opf_seq_append(seq, fc);
    opf_seq_append(seq, mk("bias", &bc, "b"));
    opf_seq_append(seq, mk("add_extra_input", &inpl, "add"));
    float w0[16];
    memcpy(w0, opf_op_param(fc, 0)->value.data[0], sizeof w0);
    call.n_extra_in = 1;
    call.extra_in = &narrow;
    CHECK_FAILS(ctx, opf_seq_forward(seq, &x, &call, &y, NULL), OPF_ERR_SHAPE,
                "forward_linear_bias_add(fc,b,add)", "extra input", "[64,64]", "shapes must match");
    CHECK(!y.data[0] && !memcmp(w0, opf_op_param(fc, 0)->value.data[0], sizeof w0),
          "state unchanged after an error");
    opf_seq_destroy(seq);

    /* an extra-output gradient of another shape for backward_linear_add */
    opf_seq_create(ctx, &seq);
    opf_seq_append(seq, mk("make_extra_output", &inpl, "mo"));
    opf_seq_append(seq, mk("basic_linear", &lc, "fc"));
    call.n_extra_in = 0;
    opf_tensor eo;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, &eo));
    CHECK_FAILS(ctx, opf_seq_backward(seq, &x, &narrow, &dx, NULL), OPF_ERR_SHAPE,
                "backward_linear_add(mo,fc)", "extra output gradient", "[64,64]");
    opf_tensor_release(&y), opf_tensor_release(&eo);
    memset(&y, 0, sizeof y);
    opf_seq_destroy(seq);

    /* driven directly: a missing extra input, a backward-only op's forward,
     * a backward without a forward, the wrong number of ops */
    opf_op *parts[3] = {mk("basic_linear", &lc, "fc"), mk("add_extra_input", &inpl, "add"), NULL};
    opf_op *f = NULL;
    CHECK_OK(ctx, opf_fused_op_create(ctx, "forward_linear_add", parts, 2, &f));
    const void *kw[2] = {0};
    opf_fwd_env env = {.ctx = ctx, .x = &x, .kwargs = kw};
    CHECK_FAILS(ctx, opf_op_forward(f, &env, NULL, &y), OPF_ERR_INVALID_ARG,
                "forward_linear_add(fc,add)", "extra input of add_extra_input \"add\"");
    opf_op_destroy(f);
    CHECK_FAILS(ctx, opf_fused_op_create(ctx, "forward_linear_bias", parts, 1, &f),
                OPF_ERR_INVALID_ARG, "covers 2", "got 1");
    opf_constant_scale_config sc = {2.0};
    opf_op_destroy(parts[1]);
    parts[1] = mk("constant_scale", &sc, "s");
    CHECK_OK(ctx, opf_fused_op_create(ctx, "backward_linear_scale", parts, 2, &f));
    CHECK_FAILS(ctx, opf_op_forward(f, &env, NULL, &y), OPF_ERR_UNSUPPORTED, "no forward");
    opf_op_ctx octx[2];
    memset(octx, 0, sizeof octx);
    opf_bwd_env benv = {.ctx = ctx, .dy = &x};
    CHECK_FAILS(ctx, opf_op_backward(f, octx, &benv, &dx, NULL), OPF_ERR_STATE,
                "backward_linear_scale(fc,s)", "without a forward");
    opf_op_destroy(f);
    opf_op_destroy(parts[0]), opf_op_destroy(parts[1]);
    opf_tensor_release(&x), opf_tensor_release(&narrow);
}

int main(void)
{
    if (opf_ctx_create(NULL, &ctx)) return 1;
    opf_unregister_fusion("backward_activation_bias");  /* see the file comment */
    test_table();
    test_precision();
    test_quantized_outputs();
    test_errors();
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
