/* test_grouped_mlp.c: the fused grouped MLP (ops/fused/grouped_mlp.c)
 * against the same seq with fusions off, built in a second context from the
 * same seed, over two training steps without resetting either context's RNG
 * (NVFP4's stochastic rounding must draw the same numbers in both):
 *   - every recipe (none, delayed, current, block, MXFP8, NVFP4) and, where
 *     allowed (not with delayed scaling), every backward override (none,
 *     high_precision, dequantized; numerics.md 3.7): y, dx, d(scales) and
 *     every parameter gradient (with has_grad) bit for bit, the contexts'
 *     RNG offsets and every delayed-scaling state equal after each step.
 *     Both plans run the same kernels in the same order, so no tolerance;
 *   - where the seq's first op requiring backward (the anchor's rule) is FC1,
 *     the GLU or FC2: FC1 frozen with no input gradient (FC1 still first:
 *     its split sizes are a public input), and the split sizes (and the
 *     scales) fed by a channel from a preceding op, which moves the first
 *     op to the GLU (FC2). FC1's gradients stay zero with has_grad false,
 *     and the fused op's backward fake lists no dx and no gradient of a
 *     part that the unfused plan would not run;
 *   - without the channel source, a compiled graph of the fused seq (where
 *     grouped_mlp is an eager node pair) agrees with the unfused plan bit
 *     for bit too. (A graph's probe reads split sizes only from public
 *     inputs, so channel-fed ones do not compile.)
 * The split and scale source is a test op class, "gm_tap" (y = x, extra
 * outputs: the split sizes and the scales of its config). */
#include "test.h"

#include "op/op-impl.h"

/* ---- the channel source ------------------------------------------------------------ */

enum { GM_MAX_ROWS = 160 };

typedef struct tap_config {
    int64_t groups, rows;
    int64_t split[4];
    float   scales[GM_MAX_ROWS];
} tap_config;

typedef struct tap_fwd {
    opf_tensor        x;
    const tap_config *cfg;
} tap_fwd;
static const opf_field tap_fwd_fields[] = {OPF_F_TENSOR(tap_fwd, x), OPF_F(tap_fwd, cfg, OPF_FIELD_REF, 0)};
OPF_SCHEMA(tap_fwd_schema, tap_fwd, tap_fwd_fields);

typedef struct tap_bwd {
    opf_tensor dy;
} tap_bwd;
static const opf_field tap_bwd_fields[] = {OPF_F_TENSOR(tap_bwd, dy)};
OPF_SCHEMA(tap_bwd_schema, tap_bwd, tap_bwd_fields);

static opf_status tap_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    tap_fwd *a = args;
    a->x = *env->x;
    a->cfg = opf_op_config(op);
    return OPF_OK;
}

static opf_status tap_forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const tap_fwd *a = args;
    outs[0] = a->x.spec;
    outs[1] = opf_spec_make(1, &a->cfg->groups, OPF_I64);
    outs[2] = opf_spec_make(1, &a->cfg->rows, OPF_F32);
    (void)aux;
    return OPF_OK;
}

static opf_status tap_forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const tap_fwd *a = args;
    opf_layout L;
    opf_status st = opf_spec_layout(&a->x.spec, &L);
    if (st) return st;
    memcpy(outs[0].data[0], a->x.data[0], L.comp[0].nbytes);
    memcpy(outs[1].data[0], a->cfg->split, sizeof(int64_t) * (size_t)a->cfg->groups);
    memcpy(outs[2].data[0], a->cfg->scales, sizeof(float) * (size_t)a->cfg->rows);
    (void)ctx, (void)aux;
    return OPF_OK;
}

static opf_status tap_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *bargs)
{
    ((tap_bwd *)bargs)->dy = *env->dy;
    (void)op, (void)octx;
    return OPF_OK;
}

static opf_status tap_backward_fake(const void *bargs, opf_spec *grads)
{
    grads[0].ndim = OPF_GRAD_PASSTHROUGH;
    (void)bargs;
    return OPF_OK;
}

static opf_status tap_backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    (void)ctx, (void)bargs, (void)grads;
    return OPF_OK;
}

static const opf_op_class tap_class = {
    .abi_version = OPF_OP_ABI_VERSION,
    .name = "gm_tap",
    .module_type = "tap",
    .config_size = sizeof(tap_config),
    .fwd_schema = &tap_fwd_schema,
    .bwd_schema = &tap_bwd_schema,
    .n_extra_out = 2,
    .fusible = true,
    .resolve_fwd = tap_resolve_fwd,
    .resolve_bwd = tap_resolve_bwd,
    .forward_fake = tap_forward_fake,
    .forward_impl = tap_forward_impl,
    .backward_fake = tap_backward_fake,
    .backward_impl = tap_backward_impl,
};

/* ---- cases ---------------------------------------------------------------------------- */

typedef struct gm_dims {
    int     groups;
    int64_t K, H, N;  /* FC1: K -> 2H, FC2: H -> N */
    int64_t split[4];
    bool    bias1, bias2;
    opf_dtype dtype;
} gm_dims;

static const gm_dims dims_table[] = {
    {3, 64, 64, 32, {32, 0, 64}, true, false, OPF_BF16},
    {2, 32, 32, 64, {64, 32}, true, true, OPF_F32},
};
enum { N_DIMS = sizeof dims_table / sizeof dims_table[0] };

/* How gradients are asked for and where the split sizes and scales come
 * from; first_req is the seq's first op requiring backward. */
typedef enum gm_wiring { W_FULL, W_FROZEN, W_TAP_SPLIT, W_TAP_BOTH, W_COUNT } gm_wiring;
typedef struct wiring_row {
    const char *name;
    bool        tap, split_chan, scales_chan, frozen_fc1, input_grad;
    int         first_req;  /* index in the seq */
    bool        fc1_bwd, glu_bwd;
} wiring_row;
static const wiring_row wirings[W_COUNT] = {
    [W_FULL]      = {"full", false, false, false, false, true, 0, true, true},
    [W_FROZEN]    = {"frozen fc1", false, false, false, true, false, 0, true, true},
    [W_TAP_SPLIT] = {"tap split", true, true, false, true, false, 2, false, true},
    [W_TAP_BOTH]  = {"tap split+scales", true, true, true, true, false, 3, false, false},
};

typedef struct recipe_row {
    const char     *name;
    bool            quant;
    opf_recipe_kind kind;
} recipe_row;
static const recipe_row recipes[] = {
    {"none", false, OPF_RECIPE_NONE},      {"delayed", true, OPF_RECIPE_DELAYED},
    {"current", true, OPF_RECIPE_CURRENT}, {"block", true, OPF_RECIPE_BLOCK},
    {"mxfp8", true, OPF_RECIPE_MXFP8},     {"nvfp4", true, OPF_RECIPE_NVFP4},
};
enum { N_RECIPES = sizeof recipes / sizeof recipes[0] };
static const char *const ovr_names[OPF_BACKWARD_OVERRIDE_COUNT] = {"none", "high_precision",
                                                                   "dequantized"};

/* ---- model and inputs -------------------------------------------------------------------- */

static opf_op *mk(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

static int64_t gm_rows(const gm_dims *d)
{
    int64_t m = 0;
    for (int g = 0; g < d->groups; g++) m += d->split[g];
    return m;
}

static void fill(unsigned long long *seed, float *v, int64_t n, float sigma)
{
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(seed, sigma * (i % 3 == 2 ? 3.0f : 1.0f));
}

static void set_values(opf_ctx *ctx, opf_tensor *t, const float *v)
{
    CHECK_OK(ctx, opf_convert(v, OPF_F32, t->data[0], t->spec.dtype, (size_t)opf_spec_numel(&t->spec)));
}

/* [gm_tap] + FC1 + scaled_swiglu + FC2, the same bits in every context. */
static opf_seq *gm_model(opf_ctx *ctx, const gm_dims *d, const wiring_row *w)
{
    opf_ctx_set_rng(ctx, 2718, 0);
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_grouped_linear_config c1 = {.groups = d->groups, .in_features = d->K, .out_features = 2 * d->H,
                                    .bias = d->bias1, .dtype = d->dtype};
    opf_grouped_linear_config c2 = {.groups = d->groups, .in_features = d->H, .out_features = d->N,
                                    .bias = d->bias2, .dtype = d->dtype};
    unsigned long long seed = 8;
    if (w->tap) {
        tap_config tc = {.groups = d->groups, .rows = gm_rows(d)};
        memcpy(tc.split, d->split, sizeof tc.split);
        fill(&seed, tc.scales, tc.rows, 1.0f);
        opf_op *tap = mk(ctx, "gm_tap", &tc, "tap");
        CHECK_OK(ctx, opf_op_set_extra_output(tap, 0, w->split_chan ? "split" : NULL, false));
        CHECK_OK(ctx, opf_op_set_extra_output(tap, 1, w->scales_chan ? "scales" : NULL, false));
        CHECK_OK(ctx, opf_seq_append(seq, tap));
    }
    opf_op *fc1 = mk(ctx, "grouped_linear", &c1, "fc1"), *glu = mk(ctx, "scaled_swiglu", NULL, "glu");
    opf_op *fc2 = mk(ctx, "grouped_linear", &c2, "fc2");
    if (w->split_chan) {
        CHECK_OK(ctx, opf_op_set_extra_input(fc1, 0, "split"));
        CHECK_OK(ctx, opf_op_set_extra_input(fc2, 0, "split"));
    }
    if (w->scales_chan) CHECK_OK(ctx, opf_op_set_extra_input(glu, 0, "scales"));
    opf_op *lin[2] = {fc1, fc2};
    for (int k = 0; k < 2; k++)  /* biases start at zero: give them values */
        for (int p = 0; p < opf_op_num_params(lin[k]); p++) {
            opf_param *pr = opf_op_param(lin[k], p);
            if (pr->value.spec.ndim != 1) continue;
            float v[256];
            fill(&seed, v, pr->value.spec.shape[0], 0.2f);
            set_values(ctx, &pr->value, v);
        }
    for (int p = 0; w->frozen_fc1 && p < opf_op_num_params(fc1); p++)
        opf_op_param(fc1, p)->requires_grad = false;
    CHECK_OK(ctx, opf_seq_append(seq, fc1));
    CHECK_OK(ctx, opf_seq_append(seq, glu));
    CHECK_OK(ctx, opf_seq_append(seq, fc2));
    return seq;
}

typedef struct gm_inputs {
    opf_tensor x, dy, split, scales;
    opf_tensor pub[3];  /* the seq's public extra inputs, in order */
    int        n_pub;
} gm_inputs;

static opf_tensor alloc_tensor(opf_ctx *ctx, int64_t rows, int64_t cols, opf_dtype dt)
{
    opf_spec s = cols ? opf_spec_make(2, (int64_t[]){rows, cols}, dt) : opf_spec_make(1, &rows, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    return t;
}

static void gm_inputs_make(opf_ctx *ctx, const gm_dims *d, const wiring_row *w, gm_inputs *in)
{
    unsigned long long seed = 6;
    int64_t M = gm_rows(d);
    float *v = malloc(sizeof(float) * (size_t)(M * (d->K > d->N ? d->K : d->N)));
    in->x = alloc_tensor(ctx, M, d->K, d->dtype);
    fill(&seed, v, M * d->K, 1.0f);
    set_values(ctx, &in->x, v);
    in->dy = alloc_tensor(ctx, M, d->N, d->dtype);
    fill(&seed, v, M * d->N, 0.2f);
    set_values(ctx, &in->dy, v);
    in->scales = alloc_tensor(ctx, M, 0, OPF_F32);
    fill(&seed, v, M, 1.0f);
    set_values(ctx, &in->scales, v);
    in->split = alloc_tensor(ctx, d->groups, 0, OPF_I64);
    memcpy(in->split.data[0], d->split, sizeof(int64_t) * (size_t)d->groups);
    in->n_pub = 0;
    if (!w->split_chan) in->pub[in->n_pub++] = in->split;
    if (!w->scales_chan) in->pub[in->n_pub++] = in->scales;
    if (!w->split_chan) in->pub[in->n_pub++] = in->split;
    free(v);
}

static void gm_inputs_free(gm_inputs *in)
{
    opf_tensor *ts[] = {&in->x, &in->dy, &in->split, &in->scales};
    for (int i = 0; i < 4; i++) opf_tensor_release(ts[i]);
}

/* ---- one step and the comparison --------------------------------------------------------- */

typedef struct gm_out {
    opf_tensor y, dx, dpub[3];
} gm_out;

static void gm_out_free(gm_out *o)
{
    opf_tensor_release(&o->y), opf_tensor_release(&o->dx);
    for (int i = 0; i < 3; i++) opf_tensor_release(&o->dpub[i]);
}

static opf_seq_call gm_call(const gm_inputs *in, const wiring_row *w, const opf_recipe *r)
{
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r;
    call.input_requires_grad = w->input_grad;
    call.n_extra_in = in->n_pub;
    call.extra_in = in->pub;
    return call;
}

static void gm_step(opf_ctx *ctx, opf_seq *seq, const gm_inputs *in, const wiring_row *w,
                    const opf_recipe *r, gm_out *o)
{
    memset(o, 0, sizeof *o);
    opf_seq_call call = gm_call(in, w, r);
    CHECK_OK(ctx, opf_seq_forward(seq, &in->x, &call, &o->y, NULL));
    CHECK_OK(ctx, opf_seq_backward(seq, &in->dy, NULL, &o->dx, o->dpub));
}

static void count_warning(void *user, const char *msg)
{
    (void)msg;
    ++*(int *)user;
}

/* The same step through a compiled graph of the seq (compiled on step 0),
 * where grouped_mlp runs as an eager node pair. */
static void gm_graph_step(opf_ctx *ctx, opf_seq *seq, opf_graph **g, const gm_inputs *in,
                          const wiring_row *w, const opf_recipe *r, gm_out *o)
{
    memset(o, 0, sizeof *o);
    opf_seq_call call = gm_call(in, w, r);
    if (!*g) CHECK_OK(ctx, opf_compile(seq, &in->x.spec, &call, NULL, g));
    if (!*g) return;
    CHECK_OK(ctx, opf_graph_forward(*g, &in->x, &call, &o->y, NULL));
    CHECK_OK(ctx, opf_graph_backward(*g, &in->dy, NULL, &o->dx, o->dpub));
}

static bool present(const opf_tensor *t) { return t->data[0] || t->data[OPF_COMP_COL_DATA]; }

/* Both absent, or the same spec and the same bytes in every component. */
static bool same_bytes(const opf_tensor *a, const opf_tensor *b)
{
    if (!present(a) || !present(b)) return present(a) == present(b);
    if (!opf_spec_equal(&a->spec, &b->spec)) return false;
    opf_layout L;
    if (opf_spec_layout(&a->spec, &L)) return false;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && memcmp(a->data[c], b->data[c], L.comp[c].nbytes)) return false;
    return true;
}

static bool all_zero(const opf_tensor *t)
{
    opf_layout L;
    if (opf_spec_layout(&t->spec, &L)) return false;
    const unsigned char *p = t->data[0];
    for (size_t i = 0; i < L.comp[0].nbytes; i++)
        if (p[i]) return false;
    return true;
}

/* Every delayed-scaling state of the two seqs' ops holds the same values. */
static bool same_delayed(opf_seq *a, opf_seq *b)
{
    for (int i = 0; i < opf_seq_len(a); i++) {
        opf_recipe_state *ra = opf_op_recipe_state(opf_seq_at(a, i));
        opf_recipe_state *rb = opf_op_recipe_state(opf_seq_at(b, i));
        if (!ra || !rb) {
            if (ra != rb) return false;
            continue;
        }
        for (int bwd = 0; bwd < 2; bwd++) {
            opf_delayed_state *da = opf_recipe_state_delayed(ra, bwd), *db = opf_recipe_state_delayed(rb, bwd);
            if (!da || !db) {
                if (da != db) return false;
                continue;
            }
            int n = opf_delayed_state_slots(da), L = opf_delayed_state_history_len(da);
            if (n != opf_delayed_state_slots(db) || L != opf_delayed_state_history_len(db) ||
                memcmp(opf_delayed_state_scale(da), opf_delayed_state_scale(db), sizeof(float) * (size_t)n) ||
                memcmp(opf_delayed_state_history(da), opf_delayed_state_history(db),
                       sizeof(float) * (size_t)n * (size_t)L))
                return false;
        }
    }
    return true;
}

static void gm_compare(opf_ctx *ca, opf_ctx *cb, opf_seq *a, opf_seq *b, const gm_out *oa,
                       const gm_out *ob, const wiring_row *w, int n_pub, const char *what)
{
    CHECK(present(&oa->y) && same_bytes(&oa->y, &ob->y), "%s: y differs from the unfused plan", what);
    CHECK(same_bytes(&oa->dx, &ob->dx), "%s: dx differs from the unfused plan", what);
    CHECK(present(&oa->dx) == (w->first_req == 0), "%s: dx %s", what,
          present(&oa->dx) ? "returned though no op before FC2 needs it" : "missing");
    for (int i = 0; i < n_pub; i++)
        CHECK(same_bytes(&oa->dpub[i], &ob->dpub[i]), "%s: gradient of public input %d differs", what, i);
    int bad = 0, n = 0, fc1 = w->tap ? 1 : 0;
    for (int k = fc1; k < fc1 + 3; k += 2)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, k)); p++, n++) {
            const opf_param *pa = opf_op_param_const(opf_seq_at(a, k), p);
            const opf_param *pb = opf_op_param_const(opf_seq_at(b, k), p);
            bad += pa->has_grad != pb->has_grad || !same_bytes(&pa->grad, &pb->grad);
            if (k == fc1 && w->frozen_fc1)
                CHECK(!pa->has_grad && all_zero(&pa->grad), "%s: frozen FC1's %s got a gradient", what,
                      pa->name);
        }
    CHECK(bad == 0, "%s: %d of %d parameter gradients differ", what, bad, n);
    uint64_t sa, oa_, sb, ob_;
    opf_ctx_get_rng(ca, &sa, &oa_);
    opf_ctx_get_rng(cb, &sb, &ob_);
    CHECK(sa == sb && oa_ == ob_, "%s: RNG offsets %llu (fused) vs %llu", what, (unsigned long long)oa_,
          (unsigned long long)ob_);
    CHECK(same_delayed(a, b), "%s: delayed-scaling states differ", what);
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

/* The fused op's backward fake on its last backward's args lists a dx and
 * FC1's gradients only where the unfused plan runs FC1's backward, and the
 * GLU's d(scales) only where it runs the GLU's. */
static void gm_check_bwd_fake(opf_op *fused, const wiring_row *w, const char *what)
{
    const opf_op_class *c = opf_op_class_of(fused);
    opf_spec g[OPF_OP_MAX_GRADS];
    for (int i = 0; i < OPF_OP_MAX_GRADS; i++) g[i].ndim = OPF_SPEC_NONE_NDIM;
    CHECK_OK(NULL, c->backward_fake(fused->bwd_args, g));
    int n1 = opf_op_num_params(opf_op_basic(fused, 0)), np = opf_op_num_params(fused);
    int fc1_grads = 0;
    for (int i = 1; i <= n1; i++) fc1_grads += g[i].ndim >= 0;
    CHECK((g[0].ndim >= 0) == w->fc1_bwd, "%s: the fused backward %s dx", what,
          g[0].ndim >= 0 ? "computes a" : "lacks its");
    CHECK(w->fc1_bwd || fc1_grads == 0, "%s: %d FC1 gradients computed with FC1's backward skipped",
          what, fc1_grads);
    CHECK((g[1 + np + 1].ndim >= 0) == w->glu_bwd, "%s: d(scales) %s", what,
          w->glu_bwd ? "missing" : "computed with the GLU's backward skipped");
}

static void gm_case(const gm_dims *d, const wiring_row *w, const recipe_row *rr, int ovr)
{
    char what[160];
    snprintf(what, sizeof what, "grouped_mlp %s %s G%d %s override %s", w->name,
             opf_dtype_name(d->dtype), d->groups, rr->name, ovr_names[ovr]);
    opf_ctx *ca, *cb, *cc;
    opf_ctx_options co = opf_ctx_options_default();
    int warnings = 0;
    co.warn = count_warning, co.warn_user = &warnings;
    if (opf_ctx_create(NULL, &ca) || opf_ctx_create(NULL, &cb) || opf_ctx_create(&co, &cc)) {
        CHECK(false, "%s: no context", what);
        return;
    }
    opf_recipe r = opf_recipe_default(rr->kind);
    r.backward_override = (opf_backward_override)ovr;
    const opf_recipe *rp = rr->quant ? &r : NULL;
    opf_seq *a = gm_model(ca, d, w), *b = gm_model(cb, d, w), *c = gm_model(cc, d, w);
    opf_seq_set_fusions(b, false);
    opf_graph *g = NULL;
    gm_inputs ia, ib, ic;
    gm_inputs_make(ca, d, w, &ia);
    gm_inputs_make(cb, d, w, &ib);
    gm_inputs_make(cc, d, w, &ic);
    int fc1 = w->tap ? 1 : 0;
    for (int step = 0; step < 2; step++) {  /* the second step sees updated delayed scales */
        char w2[200];
        snprintf(w2, sizeof w2, "%s step %d", what, step);
        gm_out oa, ob, oc;
        gm_step(ca, a, &ia, w, rp, &oa);
        gm_step(cb, b, &ib, w, rp, &ob);
        if (!w->tap) gm_graph_step(cc, c, &g, &ic, w, rp, &oc);
        else memset(&oc, 0, sizeof oc);
        CHECK(opf_seq_first_requiring_backward(a) == w->first_req &&
                  opf_seq_first_requiring_backward(b) == w->first_req,
              "%s: first op requiring backward %d / %d, expected %d", w2,
              opf_seq_first_requiring_backward(a), opf_seq_first_requiring_backward(b), w->first_req);
        gm_compare(ca, cb, a, b, &oa, &ob, w, ia.n_pub, w2);
        char w3[220];
        snprintf(w3, sizeof w3, "%s compiled", w2);
        if (g) gm_compare(cc, cb, c, b, &oc, &ob, w, ic.n_pub, w3);
        opf_op *fw = NULL, *bw = NULL;
        CHECK(plan_has(a, false, "grouped_mlp", fc1, 3, &fw) && plan_has(a, true, "grouped_mlp", fc1, 3, &bw) &&
                  fw == bw, "%s: the fused plans lack the joint op", w2);
        CHECK(!plan_has(b, false, "grouped_mlp", fc1, 3, NULL), "%s: fusions off still fused", w2);
        if (bw) gm_check_bwd_fake(bw, w, w2);
        gm_out_free(&oa), gm_out_free(&ob), gm_out_free(&oc);
    }
    CHECK(w->tap || (g && warnings > 0), "%s: no graph, or no warning of its eager node", what);
    opf_graph_destroy(g);
    gm_inputs_free(&ia), gm_inputs_free(&ib), gm_inputs_free(&ic);
    opf_seq_destroy(a), opf_seq_destroy(b), opf_seq_destroy(c);
    opf_ctx_destroy(ca), opf_ctx_destroy(cb), opf_ctx_destroy(cc);
}

/* Every wiring under every recipe and every override it allows. */
static void test_gm_overrides(void)
{
    int k = 0;
    for (int wi = 0; wi < W_COUNT; wi++)
        for (int ri = 0; ri < N_RECIPES; ri++)
            for (int o = 0; o < OPF_BACKWARD_OVERRIDE_COUNT; o++) {
                if (o && (!recipes[ri].quant || recipes[ri].kind == OPF_RECIPE_DELAYED)) continue;
                gm_case(&dims_table[k++ % N_DIMS], &wirings[wi], &recipes[ri], o);
            }
}

int main(void)
{
    CHECK_OK(NULL, opf_op_class_register(&tap_class));
    test_gm_overrides();
    TEST_DONE();
}
