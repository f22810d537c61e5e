/* test_fake_calls.c: fakes run once per op per call, in the runner
 * (op/run.c): an eager forward calls each op's forward_fake once and its
 * after_fake hook once, a backward each backward_fake once; a compiled graph
 * calls them once while tracing and never on replay. The ops are the
 * built-in classes registered again under counting names, with fakes that
 * count their calls (the names keep the fusions off them). */
#include "test.h"

enum { N_CLS = 6 };
static const char *const wrapped_names[N_CLS] = {"make_extra_output", "layernorm", "basic_linear",
                                                  "bias", "constant_scale", "add_extra_input"};
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
WRAP(0) WRAP(1) WRAP(2) WRAP(3) WRAP(4) WRAP(5)
#define HOOKS(i) {ff##i, bf##i, af##i}
static const struct {
    opf_status (*ff)(const void *, opf_spec *, opf_spec *);
    opf_status (*bf)(const void *, opf_spec *);
    opf_status (*af)(opf_op *, const opf_fwd_env *, void *, const opf_spec *, const opf_spec *);
} hooks[N_CLS] = {HOOKS(0), HOOKS(1), HOOKS(2), HOOKS(3), HOOKS(4), HOOKS(5)};

static void register_counted(void)
{
    for (int i = 0; i < N_CLS; i++) {
        orig[i] = opf_op_class_find(wrapped_names[i]);
        CHECK(orig[i] && orig[i]->forward_fake && orig[i]->backward_fake, "class %s", wrapped_names[i]);
        counted[i] = *orig[i];
        snprintf(counted_names[i], sizeof counted_names[i], "counted_%s", wrapped_names[i]);
        counted[i].name = counted_names[i];
        counted[i].forward_fake = hooks[i].ff;
        counted[i].backward_fake = hooks[i].bf;
        counted[i].after_fake = hooks[i].af;
        CHECK_OK(NULL, opf_op_class_register(&counted[i]));
    }
}

static void reset_counts(void)
{
    memset(n_ffake, 0, sizeof n_ffake);
    memset(n_bfake, 0, sizeof n_bfake);
    memset(n_after, 0, sizeof n_after);
}

/* Checks every class ran its fakes `fwd` and `bwd` times per op. */
static void check_counts(const char *what, int fwd, int bwd)
{
    static const int ops_of[N_CLS] = {1, 1, 2, 1, 1, 1};  /* ops of each class in the seq */
    for (int i = 0; i < N_CLS; i++) {
        CHECK(n_ffake[i] == fwd * ops_of[i] && n_after[i] == fwd * ops_of[i],
              "%s: %s: %d forward fakes, %d after_fake, want %d", what, wrapped_names[i], n_ffake[i],
              n_after[i], fwd * ops_of[i]);
        CHECK(n_bfake[i] == bwd * ops_of[i], "%s: %s: %d backward fakes, want %d", what,
              wrapped_names[i], n_bfake[i], bwd * ops_of[i]);
    }
}

static opf_op *mk(opf_ctx *ctx, int cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, counted_names[cls], cfg, name, &op));
    return op;
}

/* A residual LayerNorm-MLP: res = x; ln; fc1 + bias; scale; fc2; + res. */
static opf_seq *build(opf_ctx *ctx, int64_t h, int64_t f)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_norm_config nc = {h, 1e-5, false, OPF_F32};
    opf_basic_linear_config l1 = {h, f, OPF_F32, false}, l2 = {f, h, OPF_F32, false};
    opf_bias_config bc = {f, OPF_F32};
    opf_constant_scale_config sc = {0.5};
    opf_op *fork = mk(ctx, 0, NULL, "fork"), *join = mk(ctx, 5, NULL, "join");
    CHECK_OK(ctx, opf_op_set_extra_output(fork, 0, "res", false));
    CHECK_OK(ctx, opf_op_set_extra_input(join, 0, "res"));
    opf_op *ops[] = {fork, mk(ctx, 1, &nc, "ln"), mk(ctx, 2, &l1, "fc1"), mk(ctx, 3, &bc, "b1"),
                     mk(ctx, 4, &sc, "scale"), mk(ctx, 2, &l2, "fc2"), join};
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
    t->kw[2] = t->kw[5] = &t->lk;
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

static void test_eager(opf_ctx *ctx, const opf_recipe *r)
{
    setup t;
    set_up(ctx, r, &t);
    for (int step = 0; step < 3; step++) {
        opf_tensor y, dx;
        CHECK_OK(ctx, opf_seq_forward(t.seq, &t.x, &t.call, &y, NULL));
        CHECK_OK(ctx, opf_seq_backward(t.seq, &t.dy, NULL, &dx, NULL));
        opf_tensor_release(&y);
        opf_tensor_release(&dx);
    }
    check_counts(r ? "eager fp8" : "eager", 3, 3);
    /* inference: forward fakes only */
    reset_counts();
    t.call.requires_grad = false;
    opf_tensor y;
    CHECK_OK(ctx, opf_seq_forward(t.seq, &t.x, &t.call, &y, NULL));
    opf_tensor_release(&y);
    check_counts("inference", 1, 0);
    tear_down(&t);
}

static void test_compiled(opf_ctx *ctx, const opf_recipe *r)
{
    setup t;
    set_up(ctx, r, &t);
    opf_graph *g = NULL;
    CHECK_OK(ctx, opf_compile(t.seq, &t.x.spec, &t.call, NULL, &g));
    opf_graph_stats gs;
    opf_graph_get_stats(g, &gs);
    CHECK(gs.n_eager == 0, "%d eager nodes", gs.n_eager);
    check_counts(r ? "trace fp8" : "trace", 1, 1);
    reset_counts();
    for (int step = 0; g && step < 3; step++) {
        opf_tensor y, dx;
        CHECK_OK(ctx, opf_graph_forward(g, &t.x, &t.call, &y, NULL));
        CHECK_OK(ctx, opf_graph_backward(g, &t.dy, NULL, &dx, NULL));
    }
    check_counts("replay", 0, 0);
    opf_graph_destroy(g);
    tear_down(&t);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    register_counted();
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);
    test_eager(ctx, NULL);
    test_eager(ctx, &cur);
    test_compiled(ctx, NULL);
    test_compiled(ctx, &cur);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
