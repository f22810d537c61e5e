/* test_registry.c: the fusion registries: registration rules, order and
 * prepend, misbehaving fusion functions rejected by name, plans rebuilt and
 * fused ops freed, forward and backward plans built independently. */
#include "test.h"

static opf_op *mk(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

/* A fused class over identity + identity with both halves (a joint op). */
static opf_status ii_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    *(opf_tensor *)args = *env->x;
    return OPF_OK;
}
static opf_status ii_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const opf_tensor *)args)->spec;
    return OPF_OK;
}
static opf_status ii_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const opf_tensor *x = args;
    memcpy(outs[0].data[0], x->data[0], (size_t)opf_spec_numel(&x->spec) * 4);
    return OPF_OK;
}
static opf_status ii_rbwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *b)
{
    *(opf_tensor *)b = *env->dy;
    return OPF_OK;
}
static opf_status ii_bfake(const void *b, opf_spec *g)
{
    g[0].ndim = OPF_GRAD_PASSTHROUGH;
    return OPF_OK;
}
static opf_status ii_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g) { return OPF_OK; }

typedef struct ii_args {
    opf_tensor x;
} ii_args;
static const opf_field ii_fields[] = {OPF_F_TENSOR(ii_args, x)};
OPF_SCHEMA(ii_schema, ii_args, ii_fields);

static const opf_op_class ii_class = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "test_ii", .covers = 2, .fusible = true,
    .fwd_schema = &ii_schema, .bwd_schema = &ii_schema, .resolve_fwd = ii_resolve,
    .forward_fake = ii_fake, .forward_impl = ii_impl, .resolve_bwd = ii_rbwd,
    .backward_fake = ii_bfake, .backward_impl = ii_bimpl,
};
static const opf_op_class ii_fwd_only = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "test_ii_fwd", .covers = 2, .fusible = true,
    .fwd_schema = &ii_schema, .resolve_fwd = ii_resolve, .forward_fake = ii_fake,
    .forward_impl = ii_impl,
};

static int match_ii(opf_op *const *ops, int n, const opf_recipe *r, void *user)
{
    return n >= 2 && !strcmp(opf_op_class_of(ops[0])->name, "identity") &&
                   !strcmp(opf_op_class_of(ops[1])->name, "identity") ? 2 : 0;
}

static int calls[8];
static opf_status fuse_ii(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r, void *user,
                          opf_op **out, int *n_out)
{
    calls[(intptr_t)user]++;
    return opf_fusion_scan(ctx, in, n, r, match_ii, opf_fusion_build_class, (void *)"test_ii", out, n_out);
}

static opf_status fuse_ii_fwd_only(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r,
                                   void *user, opf_op **out, int *n_out)
{
    return opf_fusion_scan(ctx, in, n, r, match_ii, opf_fusion_build_class, (void *)"test_ii_fwd",
                           out, n_out);
}

/* Misbehaving functions: drop, duplicate, reorder, overflow. */
static opf_status drop_one(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r, void *u,
                           opf_op **out, int *n_out)
{
    for (int i = 1; i < n; i++) out[i - 1] = in[i];
    *n_out = n - 1;
    return OPF_OK;
}
static opf_status duplicate(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r, void *u,
                            opf_op **out, int *n_out)
{
    for (int i = 0; i < n; i++) out[i] = in[0];
    *n_out = n;
    return OPF_OK;
}
static opf_status reorder(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r, void *u,
                          opf_op **out, int *n_out)
{
    for (int i = 0; i < n; i++) out[i] = in[n - 1 - i];
    *n_out = n;
    return OPF_OK;
}
static opf_status fails(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r, void *u,
                        opf_op **out, int *n_out)
{
    return OPF_ERR_UNSUPPORTED;
}

static opf_seq *three_ids(opf_ctx *ctx)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    for (int i = 0; i < 3; i++) opf_seq_append(seq, mk(ctx, "identity", NULL, "id"));
    return seq;
}

static int plan_len(opf_seq *seq, bool bwd)
{
    opf_plan_entry e[8];
    return opf_seq_plan(seq, 0, bwd, e, 8);
}

static void run_once(opf_ctx *ctx, opf_seq *seq, opf_status want, const char *msg)
{
    float xs[4] = {1, 2, 3, 4};
    opf_tensor x, y, dx;
    opf_tensor_wrap(&(opf_spec){.ndim = 1, .shape = {4}, .dtype = OPF_F32}, xs, &x);
    opf_seq_call call = opf_seq_call_default();
    opf_status st = opf_seq_forward(seq, &x, &call, &y, NULL);
    if (want == OPF_OK) {
        CHECK(st == OPF_OK, "forward: %s", opf_last_error(ctx));
        if (st) return;
        CHECK(memcmp(y.data[0], xs, sizeof xs) == 0, "values");
        CHECK_OK(ctx, opf_seq_backward(seq, &y, NULL, &dx, NULL));
        CHECK(memcmp(dx.data[0], xs, sizeof xs) == 0, "grad values");
        opf_tensor_release(&dx);
        opf_tensor_release(&y);
    } else {
        CHECK(st == want && strstr(opf_last_error(ctx), msg), "want %s \"%s\", got %s \"%s\"",
              opf_status_str(want), msg, opf_status_str(st), opf_last_error(ctx));
    }
}

static void test_rules(void)
{
    CHECK_OK(NULL, opf_op_class_register(&ii_class));
    CHECK_OK(NULL, opf_op_class_register(&ii_fwd_only));
    CHECK_FAILS(NULL, opf_register_forward_fusion("", fuse_ii, NULL, false), OPF_ERR_INVALID_ARG, "name");
    CHECK_FAILS(NULL, opf_register_forward_fusion("x", NULL, NULL, false), OPF_ERR_INVALID_ARG, "function");
    CHECK_OK(NULL, opf_register_forward_fusion("ii_a", fuse_ii, (void *)0, false));
    CHECK_FAILS(NULL, opf_register_backward_fusion("ii_a", fuse_ii, NULL, false), OPF_ERR_INVALID_ARG,
                "ii_a", "already registered");
    CHECK_OK(NULL, opf_unregister_fusion("ii_a"));
    CHECK_FAILS(NULL, opf_unregister_fusion("ii_a"), OPF_ERR_INVALID_ARG, "ii_a");
    opf_op *a, *b = NULL;
    opf_ctx *ctx;
    opf_ctx_create(NULL, &ctx);
    a = mk(ctx, "identity", NULL, "a");
    opf_op *pair[2] = {a, a};
    CHECK_FAILS(ctx, opf_fused_op_create(ctx, "identity", pair, 2, &b), OPF_ERR_INVALID_ARG,
                "not a registered fused class");
    CHECK_FAILS(ctx, opf_fused_op_create(ctx, "test_ii", pair, 1, &b), OPF_ERR_INVALID_ARG, "covers 2",
                "got 1");
    CHECK_FAILS(ctx, opf_op_create(ctx, "test_ii", NULL, "x", &b), OPF_ERR_INVALID_ARG, "fused class");
    opf_op_destroy(a);
    opf_ctx_destroy(ctx);
}

static void test_plans(opf_ctx *ctx)
{
    /* forward-only fusion: forward plan fused, backward plan basic */
    CHECK_OK(NULL, opf_register_forward_fusion("ii_fwd", fuse_ii, (void *)1, false));
    opf_seq *seq = three_ids(ctx);
    run_once(ctx, seq, OPF_OK, NULL);
    CHECK(plan_len(seq, false) == 2 && plan_len(seq, true) == 3, "fwd %d bwd %d", plan_len(seq, false),
          plan_len(seq, true));
    opf_plan_entry e[3];
    opf_seq_plan(seq, 0, false, e, 3);
    CHECK(opf_op_is_fused(e[0].op) && e[0].first == 0 && e[0].count == 2 && e[1].first == 2, "entries");
    /* fusions off: basic everywhere */
    opf_seq_set_fusions(seq, false);
    run_once(ctx, seq, OPF_OK, NULL);
    CHECK(plan_len(seq, false) == 3, "fusions off");
    opf_seq_set_fusions(seq, true);
    /* the plan is cached: running again does not call the function */
    run_once(ctx, seq, OPF_OK, NULL);
    int c = calls[1];
    run_once(ctx, seq, OPF_OK, NULL);
    CHECK(calls[1] == c, "cached plan (%d calls, then %d)", c, calls[1]);
    /* a new recipe kind is a miss */
    float xs[4] = {1, 2, 3, 4};
    opf_tensor x, y;
    opf_tensor_wrap(&(opf_spec){.ndim = 1, .shape = {4}, .dtype = OPF_F32}, xs, &x);
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &r;
    call.requires_grad = false;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    opf_tensor_release(&y);
    CHECK(calls[1] == c + 1, "recipe change rebuilds the plan");
    opf_seq_destroy(seq);
    CHECK_OK(NULL, opf_unregister_fusion("ii_fwd"));

    /* prepend runs first: the later-registered function wins */
    CHECK_OK(NULL, opf_register_backward_fusion("ii_b1", fuse_ii, (void *)2, false));
    CHECK_OK(NULL, opf_register_backward_fusion("ii_b0", fuse_ii, (void *)3, true));
    seq = three_ids(ctx);
    run_once(ctx, seq, OPF_OK, NULL);
    CHECK(calls[3] == 1 && calls[2] == 1 && plan_len(seq, true) == 2 && plan_len(seq, false) == 3,
          "prepend order (%d %d)", calls[3], calls[2]);
    opf_seq_destroy(seq);
    opf_unregister_fusion("ii_b0");
    opf_unregister_fusion("ii_b1");

    /* joint: one object in both plans */
    CHECK_OK(NULL, opf_register_joint_fusion("ii_joint", fuse_ii, (void *)4, false));
    seq = three_ids(ctx);
    run_once(ctx, seq, OPF_OK, NULL);
    opf_plan_entry f[3], b[3];
    CHECK(opf_seq_plan(seq, 0, false, f, 3) == 2 && opf_seq_plan(seq, 0, true, b, 3) == 2 &&
          f[0].op == b[0].op, "joint op shared");
    opf_seq_destroy(seq);
    opf_unregister_fusion("ii_joint");

    /* a forward-only op put in the backward plan is refused */
    CHECK_OK(NULL, opf_register_backward_fusion("ii_wrong", fuse_ii_fwd_only, NULL, false));
    seq = three_ids(ctx);
    run_once(ctx, seq, OPF_ERR_INVALID_ARG, "no backward");
    opf_seq_destroy(seq);
    opf_unregister_fusion("ii_wrong");
}

static void test_misbehaving(opf_ctx *ctx)
{
    static const struct {
        const char *name;
        opf_fusion_fn fn;
        opf_status st;
        const char *msg;
    } bad[] = {
        {"drops_an_op", drop_one, OPF_ERR_INVALID_ARG, "drops_an_op"},
        {"duplicates_ops", duplicate, OPF_ERR_INVALID_ARG, "duplicates_ops"},
        {"reorders_ops", reorder, OPF_ERR_INVALID_ARG, "reorders_ops"},
        {"just_fails", fails, OPF_ERR_UNSUPPORTED, ""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_OK(NULL, opf_register_forward_fusion(bad[i].name, bad[i].fn, NULL, false));
        opf_seq *seq = three_ids(ctx);
        run_once(ctx, seq, bad[i].st, bad[i].msg);
        /* and the seq still works once the function is gone */
        opf_unregister_fusion(bad[i].name);
        opf_seq_set_fusions(seq, false);
        opf_seq_set_fusions(seq, true);
        run_once(ctx, seq, OPF_OK, NULL);
        opf_seq_destroy(seq);
    }
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    test_rules();
    test_plans(ctx);
    test_misbehaving(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
