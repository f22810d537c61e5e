/* test_fake_calls.c: fakes run once per op per call, in the runner
 * (op/run.c): an eager forward calls each op's forward_fake once and its
 * after_fake hook once, a backward each backward_fake once; a compiled graph
 * calls them once while tracing and never on replay. The same holds for the
 * fused ops (whose resolve no longer runs its fake: the linear ones get the
 * weight cache from after_fake, which the later calls with
 * is_first_microbatch = 0 read). The ops are the built-in classes registered
 * again under counting names, with fakes that count their calls (the names
 * keep the built-in fusions off them); the test's own fusion functions
 * build the counted fused classes over them. */
#include "test.h"

enum { N_CLS = 10, N_BASIC = 6 };
enum { C_FORK, C_LN, C_LIN, C_BIAS, C_SCALE, C_JOIN, C_FLB, C_FLSA, C_BLA, C_BLS };
static const char *const wrapped_names[N_CLS] = {
    "make_extra_output", "layernorm", "basic_linear", "bias", "constant_scale", "add_extra_input",
    "forward_linear_bias", "forward_linear_scale_add", "backward_linear_add",
    "backward_linear_scale"};
static const opf_op_class *orig[N_CLS];
static opf_op_class counted[N_CLS];
static char counted_names[N_CLS][48];
static int n_ffake[N_CLS], n_bfake[N_CLS], n_after[N_CLS];

#define WRAP(i)                                                                          \
    static opf_status ff##i(const void *a, opf_spec *o, opf_spec *x)                     \
    {                                                                                    \
        n_ffake[i]++;                                                                    \
        return orig[i]->forward_fake(a, o, x);                                           \
    }                                                                                    \
    static opf_status bf##i(const void *a, opf_spec *g)                                  \
    {                                                                                    \
        n_bfake[i]++;                                                                    \
        return orig[i]->backward_fake(a, g);                                             \
    }                                                                                    \
    static opf_status af##i(opf_op *op, const opf_fwd_env *env, void *args,              \
                            const opf_spec *o, const opf_spec *x)                        \
    {                                                                                    \
        n_after[i]++;                                                                    \
        return orig[i]->after_fake ? orig[i]->after_fake(op, env, args, o, x) : OPF_OK;  \
    }
WRAP(0) WRAP(1) WRAP(2) WRAP(3) WRAP(4) WRAP(5) WRAP(6) WRAP(7) WRAP(8) WRAP(9)
#define HOOKS(i) {ff##i, bf##i, af##i}
static const struct {
    opf_status (*ff)(const void *, opf_spec *, opf_spec *);
    opf_status (*bf)(const void *, opf_spec *);
    opf_status (*af)(opf_op *, const opf_fwd_env *, void *, const opf_spec *, const opf_spec *);
} hooks[N_CLS] = {HOOKS(0), HOOKS(1), HOOKS(2), HOOKS(3), HOOKS(4),
                  HOOKS(5), HOOKS(6), HOOKS(7), HOOKS(8), HOOKS(9)};

/* ---- the test's fusions: the built-in ones, over the counted classes ---- */

static bool fuse_on;  /* the fusion functions are registered for the whole process */

static bool is(const opf_op *op, int cls)
{
    return !opf_op_is_fused(op) && opf_op_class_of(op) == &counted[cls];
}

static int match_fwd(opf_op *const *ops, int n, const opf_recipe *r, void *user)
{
    if (!fuse_on || n < 2 || !is(ops[0], C_LIN)) return 0;
    if (is(ops[1], C_BIAS)) return 2;
    return n >= 3 && is(ops[1], C_SCALE) && is(ops[2], C_JOIN) ? 3 : 0;
}

static int match_bwd(opf_op *const *ops, int n, const opf_recipe *r, void *user)
{
    if (!fuse_on || n < 2) return 0;
    return (is(ops[0], C_FORK) && is(ops[1], C_LIN)) || (is(ops[0], C_LIN) && is(ops[1], C_SCALE))
               ? 2
               : 0;
}

static opf_status build_counted(opf_ctx *ctx, opf_op *const *ops, int n, const opf_recipe *r,
                                void *user, opf_op **fused)
{
    int cls = is(ops[0], C_FORK) ? C_BLA
              : is(ops[1], C_BIAS) ? C_FLB
              : n == 3             ? C_FLSA
                                   : C_BLS;
    return opf_fused_op_create(ctx, counted_names[cls], ops, n, fused);
}

static opf_status fuse_fwd(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r, void *user,
                           opf_op **out, int *n_out)
{
    return opf_fusion_scan(ctx, in, n, r, match_fwd, build_counted, NULL, out, n_out);
}

static opf_status fuse_bwd(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r, void *user,
                           opf_op **out, int *n_out)
{
    return opf_fusion_scan(ctx, in, n, r, match_bwd, build_counted, NULL, out, n_out);
}

static void register_counted(void)
{
    for (int i = 0; i < N_CLS; i++) {
        orig[i] = opf_op_class_find(wrapped_names[i]);
        CHECK(orig[i] && (orig[i]->forward_fake || orig[i]->backward_fake), "class %s",
              wrapped_names[i]);
        counted[i] = *orig[i];
        snprintf(counted_names[i], sizeof counted_names[i], "counted_%s", wrapped_names[i]);
        counted[i].name = counted_names[i];
        if (orig[i]->forward_fake) {
            counted[i].forward_fake = hooks[i].ff;
            counted[i].after_fake = hooks[i].af;
        }
        if (orig[i]->backward_fake) counted[i].backward_fake = hooks[i].bf;
        CHECK_OK(NULL, opf_op_class_register(&counted[i]));
    }
    CHECK_OK(NULL, opf_register_forward_fusion("counted_forward", fuse_fwd, NULL, true));
    CHECK_OK(NULL, opf_register_backward_fusion("counted_backward", fuse_bwd, NULL, true));
}

static void reset_counts(void)
{
    memset(n_ffake, 0, sizeof n_ffake);
    memset(n_bfake, 0, sizeof n_bfake);
    memset(n_after, 0, sizeof n_after);
}

/* Forward and backward fake calls of each class in one call of the seq. */
typedef struct per_call {
    int fwd[N_CLS], bwd[N_CLS];
} per_call;
/* Unfused: the seq's ops of each class (two linears). Fused: the forward
 * plan is ln, fork, FLB(fc1, b1), FLSA(fc2, scale, join), the backward plan
 * ln, BLA(fork, fc1), b1, BLS(fc2, scale), join. */
static const per_call unfused_calls = {{1, 1, 2, 1, 1, 1}, {1, 1, 2, 1, 1, 1}};
static const per_call fused_calls = {{[C_FORK] = 1, [C_LN] = 1, [C_FLB] = 1, [C_FLSA] = 1},
                                     {[C_LN] = 1, [C_BIAS] = 1, [C_JOIN] = 1, [C_BLA] = 1,
                                      [C_BLS] = 1}};

/* Checks every class ran its fakes as `per` says, times fwd and bwd calls. */
static void check_counts(const char *what, const per_call *per, int fwd, int bwd)
{
    for (int i = 0; i < N_CLS; i++) {
        int want = fwd * per->fwd[i];
        CHECK(n_ffake[i] == want && n_after[i] == want,
              "%s: %s: %d forward fakes, %d after_fake, want %d", what, wrapped_names[i], n_ffake[i],
              n_after[i], want);
        CHECK(n_bfake[i] == bwd * per->bwd[i], "%s: %s: %d backward fakes, want %d", what,
              wrapped_names[i], n_bfake[i], bwd * per->bwd[i]);
    }
}

static opf_op *mk(opf_ctx *ctx, int cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, counted_names[cls], cfg, name, &op));
    return op;
}

/* A residual MLP: ln; res = (x); fc1 + bias; fc2; scale; + res. The fork
 * and the join are in place, as the linear fusions want them. */
static opf_seq *build(opf_ctx *ctx, int64_t h, int64_t f)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_norm_config nc = {h, 1e-5, false, OPF_F32};
    opf_basic_linear_config l1 = {h, f, OPF_F32, false}, l2 = {f, h, OPF_F32, false};
    opf_bias_config bc = {f, OPF_F32};
    opf_constant_scale_config sc = {0.5};
    opf_inplace_config ip = {.in_place = true};
    opf_op *fork = mk(ctx, C_FORK, &ip, "fork"), *join = mk(ctx, C_JOIN, &ip, "join");
    CHECK_OK(ctx, opf_op_set_extra_output(fork, 0, "res", false));
    CHECK_OK(ctx, opf_op_set_extra_input(join, 0, "res"));
    opf_op *ops[] = {mk(ctx, C_LN, &nc, "ln"), fork, mk(ctx, C_LIN, &l1, "fc1"),
                     mk(ctx, C_BIAS, &bc, "b1"), mk(ctx, C_LIN, &l2, "fc2"),
                     mk(ctx, C_SCALE, &sc, "scale"), join};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) CHECK_OK(ctx, opf_seq_append(seq, ops[i]));
    for (int i = 0; i < opf_seq_len(seq); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, i)); p++) {
            opf_param *pr = opf_op_param(opf_seq_at(seq, i), p);
            float *v = pr->value.data[0];
            for (int64_t k = 0; k < opf_spec_numel(&pr->value.spec); k++) v[k] = 0.01f * (float)(k % 7) + 0.5f;
        }
    return seq;
}

static opf_tensor ramp(opf_ctx *ctx, int64_t m, int64_t k)
{
    opf_tensor t;
    opf_spec s = opf_spec_make(2, (int64_t[]){m, k}, OPF_F32);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    for (int64_t i = 0; i < m * k; i++) ((float *)t.data[0])[i] = 0.001f * (float)(i % 97) - 0.05f;
    return t;
}

/* One test's seq, input, gradient and call; the linears quantize their
 * weight once and cache it (kwargs is_first_microbatch = 1). */
typedef struct setup {
    opf_seq                *seq;
    opf_tensor              x, dy;
    opf_basic_linear_kwargs lk;
    const void             *kw[7];
    opf_seq_call            call;
} setup;

static void set_up(opf_ctx *ctx, const opf_recipe *r, setup *t)
{
    t->seq = build(ctx, 64, 128);
    t->x = ramp(ctx, 16, 64);
    t->dy = ramp(ctx, 16, 64);
    t->lk.is_first_microbatch = 1;
    for (int i = 0; i < 7; i++) t->kw[i] = NULL;
    t->kw[2] = t->kw[4] = &t->lk;
    t->call = opf_seq_call_default();
    t->call.recipe = r;
    t->call.kwargs = t->kw;
    reset_counts();
}

static void tear_down(setup *t)
{
    opf_seq_destroy(t->seq);
    opf_tensor_release(&t->x);
    opf_tensor_release(&t->dy);
}

/* What a check reports: the path, the recipe, fused or not. */
static const char *label(char *buf, const char *path, const opf_recipe *r, bool fused)
{
    snprintf(buf, 64, "%s%s%s", path, r ? " fp8" : "", fused ? " fused" : "");
    return buf;
}

/* Three training steps, then an inference call. The first step quantizes
 * and caches the weights, the later ones read the cache (is_first_microbatch
 * 0), which exists only if after_fake ran for the fused linears too. */
static void test_eager(opf_ctx *ctx, const opf_recipe *r, bool fused)
{
    const per_call *per = fused ? &fused_calls : &unfused_calls;
    char what[64];
    setup t;
    set_up(ctx, r, &t);
    fuse_on = fused;
    for (int step = 0; step < 3; step++) {
        opf_tensor y, dx;
        t.lk.is_first_microbatch = step == 0;
        CHECK_OK(ctx, opf_seq_forward(t.seq, &t.x, &t.call, &y, NULL));
        CHECK_OK(ctx, opf_seq_backward(t.seq, &t.dy, NULL, &dx, NULL));
        opf_tensor_release(&y);
        opf_tensor_release(&dx);
    }
    check_counts(label(what, "eager", r, fused), per, 3, 3);
    /* inference: forward fakes only */
    reset_counts();
    t.call.requires_grad = false;
    opf_tensor y;
    CHECK_OK(ctx, opf_seq_forward(t.seq, &t.x, &t.call, &y, NULL));
    opf_tensor_release(&y);
    check_counts(label(what, "inference", r, fused), per, 1, 0);
    tear_down(&t);
}

static void test_compiled(opf_ctx *ctx, const opf_recipe *r, bool fused)
{
    const per_call *per = fused ? &fused_calls : &unfused_calls;
    char what[64];
    setup t;
    set_up(ctx, r, &t);
    fuse_on = fused;
    opf_graph *g = NULL;
    CHECK_OK(ctx, opf_compile(t.seq, &t.x.spec, &t.call, NULL, &g));
    opf_graph_stats gs;
    opf_graph_get_stats(g, &gs);
    CHECK(gs.n_eager == 0, "%d eager nodes", gs.n_eager);
    check_counts(label(what, "trace", r, fused), per, 1, 1);
    reset_counts();
    for (int step = 0; g && step < 3; step++) {
        opf_tensor y, dx;
        CHECK_OK(ctx, opf_graph_forward(g, &t.x, &t.call, &y, NULL));
        CHECK_OK(ctx, opf_graph_backward(g, &t.dy, NULL, &dx, NULL));
    }
    check_counts(label(what, "replay", r, fused), per, 0, 0);
    opf_graph_destroy(g);
    tear_down(&t);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    register_counted();
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);
    for (int fused = 0; fused < 2; fused++) {
        test_eager(ctx, NULL, fused);
        test_eager(ctx, &cur, fused);
        test_compiled(ctx, NULL, fused);
        test_compiled(ctx, &cur, fused);
    }
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
