/* test_compile_memory.c: the memory a compiled graph uses and touches.
 *
 *  - no allocation while a graph runs (forward, backward, and the SGD step),
 *    and a planned peak (the arena) no larger than the eager step's peak;
 *  - a forward-only (inference) compile saves nothing for backward, has no
 *    backward nodes, plans less memory, and matches eager inference;
 *  - a graph never writes memory it does not own: the caller's input, extra
 *    inputs, dy and the parameter values are byte-identical after a step,
 *    also with in-place ops right after the input and eager nodes inside
 *    (a user op without fakes, grouped_linear).
 * Eager and compiled run on two contexts of the same seed (identical
 * parameters), with fresh random inputs. */
#include "../test.h"

static unsigned long long rng = 0x3E3035EEDull;

static opf_tensor rand_t(opf_ctx *ctx, int64_t m, int64_t k, opf_dtype dt, float sigma)
{
    int64_t shape[2] = {m, k};
    opf_spec s = opf_spec_make(2, shape, dt);
    opf_tensor t;
    opf_tensor_alloc(ctx, &s, &t);
    float *v = malloc(sizeof(float) * (size_t)(m * k));
    for (int64_t i = 0; i < m * k; i++) v[i] = opf_test_normal(&rng, sigma);
    opf_convert(v, OPF_F32, t.data[0], dt, (size_t)(m * k));
    free(v);
    return t;
}

static void append_named(opf_ctx *ctx, opf_seq *seq, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    opf_status st = opf_op_create(ctx, cls, cfg, name, &op);
    CHECK(st == OPF_OK, "create %s: %s", cls, opf_last_error(ctx));
    if (!st) opf_seq_append(seq, op);
}

/* layernorm -> fc1 (+bias) -> gelu -> fc2 (+bias) */
static opf_seq *lnmlp(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_layernorm_config ln = {.hidden = h, .eps = 1e-5, .dtype = dt};
    append_named(ctx, seq, "layernorm", &ln, "ln");
    opf_seq_append_linear(seq, h, f, true, dt, "fc1");
    append_named(ctx, seq, "gelu", NULL, "gelu");
    opf_seq_append_linear(seq, f, h, true, dt, "fc2");
    return seq;
}

static int grads_differ(opf_seq *a, opf_seq *b)
{
    int bad = 0;
    for (int i = 0; i < opf_seq_len(a); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++) {
            const opf_param *pa = opf_op_param_const(opf_seq_at(a, i), p);
            const opf_param *pb = opf_op_param_const(opf_seq_at(b, i), p);
            bad += pa->has_grad != pb->has_grad || !opf_test_same_bytes(&pa->grad, &pb->grad);
        }
    return bad;
}

static int params_differ(opf_seq *a, opf_seq *b)
{
    int bad = 0;
    for (int i = 0; i < opf_seq_len(a); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++)
            bad += !opf_test_same_bytes(&opf_op_param_const(opf_seq_at(a, i), p)->value,
                                        &opf_op_param_const(opf_seq_at(b, i), p)->value);
    return bad;
}

typedef struct pair {
    opf_ctx *ca, *cb;  /* eager, compiled */
    opf_seq *a, *b;
} pair;

static void pair_make(pair *p, opf_dtype dt, int64_t h, int64_t f)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 23;
    opf_ctx_create(&o, &p->ca);
    opf_ctx_create(&o, &p->cb);
    p->a = lnmlp(p->ca, dt, h, f);
    p->b = lnmlp(p->cb, dt, h, f);
}

static void pair_free(pair *p)
{
    opf_seq_destroy(p->a), opf_seq_destroy(p->b);
    opf_ctx_destroy(p->ca), opf_ctx_destroy(p->cb);
}

/* ---- 9. no allocation; arena <= eager peak ---------------------------------------- */

/* One training step of both: eager on a (optionally measuring its peak),
 * compiled on b through c; outputs compared. */
static void train_step(pair *p, opf_compiled *c, opf_optim *oa, opf_optim *ob, const opf_seq_call *call,
                       int64_t m, int64_t h, opf_dtype dt, size_t *eager_peak, const char *what)
{
    opf_tensor x = rand_t(p->ca, m, h, dt, 1.0f), dy = rand_t(p->ca, m, h, dt, 1.0f);
    opf_tensor ya = {0}, dxa = {0}, yb = {0}, dxb = {0};
    opf_seq_zero_grad(p->a);
    opf_seq_zero_grad(p->b);
    opf_alloc_stats s0, s1;
    opf_ctx_alloc_reset_peak(p->ca);
    opf_ctx_alloc_stats(p->ca, &s0);
    CHECK_OK(p->ca, opf_seq_forward(p->a, &x, call, &ya, NULL));
    CHECK_OK(p->ca, opf_seq_backward(p->a, &dy, NULL, &dxa, NULL));
    opf_ctx_alloc_stats(p->ca, &s1);
    if (eager_peak) *eager_peak = s1.bytes_peak - s0.bytes_live;
    CHECK_OK(p->cb, opf_compiled_forward(c, &x, call, &yb, NULL));
    CHECK_OK(p->cb, opf_compiled_backward(c, &dy, NULL, &dxb, NULL));
    CHECK(ya.data[0] && opf_test_same_bytes(&ya, &yb), "%s: y differs", what);
    CHECK(dxa.data[0] && opf_test_same_bytes(&dxa, &dxb), "%s: dx differs", what);
    CHECK(grads_differ(p->a, p->b) == 0, "%s: parameter gradients differ", what);
    opf_tensor_release(&ya), opf_tensor_release(&dxa);
    CHECK_OK(p->ca, opf_optim_step(oa));
    CHECK_OK(p->cb, opf_optim_step(ob));
    CHECK(params_differ(p->a, p->b) == 0, "%s: parameters differ after the optimizer step", what);
    opf_tensor_release(&x), opf_tensor_release(&dy);
}

static void test_no_alloc(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64, f = 128;
    char what[64];
    snprintf(what, sizeof what, "no-alloc %s %s", opf_recipe_name(kind), opf_dtype_name(dt));
    pair p;
    pair_make(&p, dt, h, f);
    opf_recipe r = opf_recipe_default(kind);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = kind == OPF_RECIPE_NONE ? NULL : &r;
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = 0.01f;
    oo.momentum = 0.9f;
    opf_optim *oa = NULL, *ob = NULL;
    opf_compiled *c = NULL;
    CHECK_OK(p.ca, opf_optim_create(p.ca, p.a, OPF_OPTIM_SGD, &oo, &oa));
    CHECK_OK(p.cb, opf_optim_create(p.cb, p.b, OPF_OPTIM_SGD, &oo, &ob));
    CHECK_OK(p.cb, opf_compiled_create(p.b, NULL, &c));
    if (!oa || !ob || !c) goto out;
    train_step(&p, c, oa, ob, &call, m, h, dt, NULL, what);  /* warm-up: compiles */
    size_t eager_peak = 0;
    opf_alloc_stats before, after;
    opf_ctx_alloc_stats(p.cb, &before);
    for (int step = 0; step < 5; step++) train_step(&p, c, oa, ob, &call, m, h, dt, &eager_peak, what);
    opf_ctx_alloc_stats(p.cb, &after);
    CHECK(after.n_alloc == before.n_alloc && after.n_free == before.n_free,
          "%s: 5 compiled steps allocated %llu and freed %llu times", what,
          (unsigned long long)(after.n_alloc - before.n_alloc),
          (unsigned long long)(after.n_free - before.n_free));
    CHECK(after.bytes_live == before.bytes_live, "%s: live bytes %zu -> %zu", what, before.bytes_live,
          after.bytes_live);
    CHECK(opf_compiled_recompiles(c) == 0, "%s: %d recompiles", what, opf_compiled_recompiles(c));
    opf_graph_stats s;
    opf_graph_get_stats(opf_compiled_last_graph(c), &s);
    printf("%-28s arena %7zu bytes (unplanned %7zu, saved %7zu), eager peak %7zu bytes\n", what,
           s.arena_bytes, s.unplanned_bytes, s.saved_bytes, eager_peak);
    CHECK(s.arena_bytes > 0 && s.arena_bytes <= eager_peak, "%s: arena %zu > eager peak %zu", what,
          s.arena_bytes, eager_peak);
    CHECK(s.arena_bytes <= s.unplanned_bytes, "%s: arena %zu > unplanned %zu", what, s.arena_bytes,
          s.unplanned_bytes);
out:
    opf_compiled_destroy(c);
    opf_optim_destroy(oa), opf_optim_destroy(ob);
    pair_free(&p);
}

/* ---- 11. forward-only compile ---------------------------------------------------------- */

static void test_inference(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64, f = 128;
    char what[64];
    snprintf(what, sizeof what, "inference %s %s", opf_recipe_name(kind), opf_dtype_name(dt));
    pair p;
    pair_make(&p, dt, h, f);
    opf_recipe r = opf_recipe_default(kind);
    opf_seq_call train = opf_seq_call_default(), infer = train;
    train.recipe = infer.recipe = kind == OPF_RECIPE_NONE ? NULL : &r;
    infer.requires_grad = false;
    infer.input_requires_grad = false;
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, dt);
    opf_graph *gt = NULL, *gi = NULL;
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &train, NULL, &gt));
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &infer, NULL, &gi));
    if (!gt || !gi) goto out;
    opf_graph_stats st, si;
    opf_graph_get_stats(gt, &st);
    opf_graph_get_stats(gi, &si);
    CHECK(!st.forward_only && st.n_backward > 0 && st.saved_bytes > 0, "%s: the training graph", what);
    CHECK(si.forward_only, "%s: stats.forward_only", what);
    CHECK(si.n_backward == 0, "%s: %d backward nodes", what, si.n_backward);
    CHECK(si.saved_bytes == 0, "%s: saved %zu bytes", what, si.saved_bytes);
    CHECK(si.arena_bytes < st.arena_bytes, "%s: inference arena %zu >= training arena %zu", what,
          si.arena_bytes, st.arena_bytes);
    printf("%-28s arena %7zu bytes, training %7zu bytes\n", what, si.arena_bytes, st.arena_bytes);
    opf_alloc_stats before = {0}, after;
    for (int step = 0; step < 4; step++) {
        if (step == 1) opf_ctx_alloc_stats(p.cb, &before);
        opf_tensor x = rand_t(p.ca, m, h, dt, 1.0f), ya = {0}, yb = {0}, dx;
        CHECK_OK(p.ca, opf_seq_forward(p.a, &x, &infer, &ya, NULL));
        CHECK_OK(p.cb, opf_graph_forward(gi, &x, &infer, &yb, NULL));
        CHECK(ya.data[0] && opf_test_same_bytes(&ya, &yb), "%s step %d: y differs", what, step);
        opf_tensor dy = rand_t(p.ca, m, h, dt, 1.0f);
        CHECK_FAILS(p.cb, opf_graph_backward(gi, &dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward");
        opf_tensor_release(&ya), opf_tensor_release(&x), opf_tensor_release(&dy);
    }
    opf_ctx_alloc_stats(p.cb, &after);
    CHECK(after.n_alloc == before.n_alloc, "%s: inference steps allocated %llu times", what,
          (unsigned long long)(after.n_alloc - before.n_alloc));
out:
    opf_graph_destroy(gt), opf_graph_destroy(gi);
    pair_free(&p);
}

/* ---- 12. memory the graph does not own ------------------------------------------------ */

/* A user op without fakes (y = s x, f32): its forward_impl and backward_impl
 * allocate what they return, so the graph runs it as an eager node. */
typedef struct nf_fwd {
    opf_tensor x, s;
} nf_fwd;
static const opf_field nf_fwd_fields[] = {OPF_F_TENSOR(nf_fwd, x), OPF_F_TENSOR(nf_fwd, s)};
OPF_SCHEMA(nf_fwd_schema, nf_fwd, nf_fwd_fields);
typedef struct nf_bwd {
    opf_tensor dy, x, s;
} nf_bwd;
static const opf_field nf_bwd_fields[] = {OPF_F_TENSOR(nf_bwd, dy), OPF_F_TENSOR(nf_bwd, x),
                                          OPF_F_TENSOR(nf_bwd, s)};
OPF_SCHEMA(nf_bwd_schema, nf_bwd, nf_bwd_fields);

static opf_status nf_init(opf_ctx *ctx, opf_op *op)
{
    opf_spec s = opf_spec_make(1, (int64_t[]){1}, OPF_F32);
    int i = opf_op_add_param(ctx, op, "scale", &s);
    if (i < 0) return (opf_status)-i;
    *(float *)opf_op_param(op, i)->value.data[0] = 0.75f;
    return OPF_OK;
}
static opf_status nf_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    nf_fwd *a = args;
    if (env->x->spec.dtype != OPF_F32 || env->x->spec.scaling != OPF_SCALING_NONE) return OPF_ERR_DTYPE;
    a->x = *env->x;
    a->s = opf_op_param(op, 0)->value;
    return OPF_OK;
}
static opf_status nf_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const nf_fwd *a = args;
    opf_status st = opf_tensor_alloc(ctx, &a->x.spec, &outs[0]);
    const float *x = a->x.data[0], s = *(const float *)a->s.data[0];
    for (int64_t i = 0; !st && i < opf_spec_numel(&a->x.spec); i++) ((float *)outs[0].data[0])[i] = s * x[i];
    return st;
}
static opf_status nf_setup(opf_op *op, opf_op_ctx *c, const void *args, const opf_tensor *outs,
                           const opf_tensor *aux)
{
    opf_tensor_retain(&((const nf_fwd *)args)->x, &c->saved[c->n_saved++]);
    return OPF_OK;
}
static opf_status nf_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *b)
{
    nf_bwd *a = b;
    if (env->dy->spec.dtype != OPF_F32 || env->dy->spec.scaling != OPF_SCALING_NONE) return OPF_ERR_DTYPE;
    a->dy = *env->dy;
    a->x = c->saved[0];
    a->s = opf_op_param(op, 0)->value;
    return OPF_OK;
}
static opf_status nf_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g)
{
    const nf_bwd *a = b;
    opf_status st = opf_tensor_alloc(ctx, &a->dy.spec, &g[0]);
    if (!st) st = opf_tensor_alloc(ctx, &a->s.spec, &g[1]);
    if (st) return st;
    const float *dy = a->dy.data[0], *x = a->x.data[0], s = *(const float *)a->s.data[0];
    float *dx = g[0].data[0], ds = 0;
    for (int64_t i = 0; i < opf_spec_numel(&a->dy.spec); i++) dx[i] = s * dy[i], ds += dy[i] * x[i];
    *(float *)g[1].data[0] = ds;
    return OPF_OK;
}
static const opf_op_class nofake_class = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "t2_mem_nofake",
    .fwd_schema = &nf_fwd_schema, .bwd_schema = &nf_bwd_schema, .fusible = true,
    .init = nf_init, .resolve_fwd = nf_resolve, .setup_context = nf_setup,
    .resolve_bwd = nf_resolve_bwd, .forward_impl = nf_impl, .backward_impl = nf_bimpl,
};

/* FNV-1a over every component of t's layout. */
static uint64_t checksum(const opf_tensor *t)
{
    uint64_t h = 0xCBF29CE484222325ull;
    opf_layout L;
    if (opf_spec_layout(&t->spec, &L)) return 0;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (!L.comp[c].present || !t->data[c]) continue;
        const unsigned char *b = t->data[c];
        for (size_t i = 0; i < L.comp[c].nbytes; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    }
    return h;
}

static uint64_t params_checksum(opf_seq *seq)
{
    uint64_t h = 0;
    for (int i = 0; i < opf_seq_len(seq); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, i)); p++)
            h = h * 31 + checksum(&opf_op_param_const(opf_seq_at(seq, i), p)->value);
    return h;
}

typedef opf_seq *(*build_fn)(opf_ctx *ctx, int64_t h, int64_t f);

/* identity -> gelu -> bias -> add_extra_input (in place) -> layernorm -> fc1 (+bias)
 * -> [no-fake user op] -> fc2 (+bias) */
static opf_seq *build_inplace(opf_ctx *ctx, int64_t h, int64_t f)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    append_named(ctx, seq, "identity", NULL, "id");
    append_named(ctx, seq, "gelu", NULL, "gelu0");
    opf_bias_config bc = {h, OPF_F32};
    append_named(ctx, seq, "bias", &bc, "b0");
    opf_inplace_config ip = {.in_place = true};
    append_named(ctx, seq, "add_extra_input", &ip, "res");
    opf_layernorm_config ln = {.hidden = h, .eps = 1e-5, .dtype = OPF_F32};
    append_named(ctx, seq, "layernorm", &ln, "ln");
    opf_seq_append_linear(seq, h, f, true, OPF_F32, "fc1");
    append_named(ctx, seq, "t2_mem_nofake", NULL, "user");
    opf_seq_append_linear(seq, f, h, true, OPF_F32, "fc2");
    /* the bias starts at zero: give it values */
    opf_param *pb = opf_op_param(opf_seq_at(seq, 2), 0);
    for (int64_t i = 0; i < h; i++) ((float *)pb->value.data[0])[i] = 0.01f * (float)(i % 17) - 0.08f;
    return seq;
}

/* identity -> grouped_linear -> gelu -> grouped_linear (split sizes: extra inputs) */
static opf_seq *build_grouped(opf_ctx *ctx, int64_t h, int64_t f)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    append_named(ctx, seq, "identity", NULL, "id");
    opf_grouped_linear_config c1 = {.groups = 2, .in_features = h, .out_features = f, .dtype = OPF_F32};
    opf_grouped_linear_config c2 = {.groups = 2, .in_features = f, .out_features = h, .dtype = OPF_F32};
    append_named(ctx, seq, "grouped_linear", &c1, "g1");
    append_named(ctx, seq, "gelu", NULL, "gelu");
    append_named(ctx, seq, "grouped_linear", &c2, "g2");
    return seq;
}

static void test_untouched(build_fn build, const char *name, opf_recipe_kind kind, int want_eager)
{
    const int64_t m = 64, h = 64, f = 128;
    char what[80];
    snprintf(what, sizeof what, "untouched %s %s", name, opf_recipe_name(kind));
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 5;
    pair p;
    opf_ctx_create(&o, &p.ca);
    opf_ctx_create(&o, &p.cb);
    p.a = build(p.ca, h, f);
    p.b = build(p.cb, h, f);
    opf_recipe r = opf_recipe_default(kind);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = kind == OPF_RECIPE_NONE ? NULL : &r;
    /* extra inputs: a residual, or split sizes per grouped linear */
    opf_tensor ext[2];
    memset(ext, 0, sizeof ext);
    opf_spec ss = opf_spec_make(1, (int64_t[]){2}, OPF_I64);
    bool grouped = build == build_grouped;
    if (grouped) {
        for (int i = 0; i < 2; i++) {
            opf_tensor_alloc(p.ca, &ss, &ext[i]);
            ((int64_t *)ext[i].data[0])[0] = i ? 32 : 16;
            ((int64_t *)ext[i].data[0])[1] = m - (i ? 32 : 16);
        }
        call.n_extra_in = 2;
    } else {
        ext[0] = rand_t(p.ca, m, h, OPF_F32, 1.0f);
        call.n_extra_in = 1;
    }
    call.extra_in = ext;
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, OPF_F32);
    opf_graph *g = NULL;
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &call, NULL, &g));
    if (!g) goto out;
    opf_graph_stats s;
    opf_graph_get_stats(g, &s);
    CHECK(s.n_eager == want_eager, "%s: %d eager nodes, want %d", what, s.n_eager, want_eager);
    if (!grouped) CHECK(s.n_inplace >= 1, "%s: an op runs in place (%d)", what, s.n_inplace);
    for (int step = 0; step < 3; step++) {
        opf_tensor x = rand_t(p.ca, m, h, OPF_F32, 1.0f), dy = rand_t(p.ca, m, h, OPF_F32, 1.0f);
        for (int i = 0; grouped && i < 2; i++) {  /* new split sizes: the eager nodes read them */
            ((int64_t *)ext[i].data[0])[0] = 8 * (step + 1 + i);
            ((int64_t *)ext[i].data[0])[1] = m - 8 * (step + 1 + i);
        }
        uint64_t cx = checksum(&x), cdy = checksum(&dy), ce0 = checksum(&ext[0]), ce1 = checksum(&ext[1]);
        uint64_t cpa = params_checksum(p.a), cpb = params_checksum(p.b);
        CHECK(cpa == cpb, "%s: identical parameters", what);
        opf_tensor ya = {0}, dxa = {0}, yb = {0}, dxb = {0}, dea[2], deb[2];
        memset(dea, 0, sizeof dea), memset(deb, 0, sizeof deb);
        opf_seq_zero_grad(p.a);
        opf_seq_zero_grad(p.b);
        CHECK_OK(p.ca, opf_seq_forward(p.a, &x, &call, &ya, NULL));
        CHECK_OK(p.ca, opf_seq_backward(p.a, &dy, NULL, &dxa, dea));
        CHECK_OK(p.cb, opf_graph_forward(g, &x, &call, &yb, NULL));
        CHECK(checksum(&x) == cx && checksum(&ext[0]) == ce0 && checksum(&ext[1]) == ce1,
              "%s step %d: the forward wrote the caller's input", what, step);
        CHECK_OK(p.cb, opf_graph_backward(g, &dy, NULL, &dxb, deb));
        CHECK(checksum(&x) == cx, "%s step %d: x changed", what, step);
        CHECK(checksum(&dy) == cdy, "%s step %d: dy changed", what, step);
        CHECK(checksum(&ext[0]) == ce0 && checksum(&ext[1]) == ce1, "%s step %d: an extra input changed",
              what, step);
        CHECK(params_checksum(p.b) == cpb, "%s step %d: parameter values changed", what, step);
        CHECK(params_checksum(p.a) == cpa, "%s step %d: eager changed parameter values", what, step);
        CHECK(ya.data[0] && opf_test_same_bytes(&ya, &yb), "%s step %d: y differs", what, step);
        CHECK(dxa.data[0] && opf_test_same_bytes(&dxa, &dxb), "%s step %d: dx differs", what, step);
        if (!grouped)
            CHECK(dea[0].data[0] && opf_test_same_bytes(&dea[0], &deb[0]), "%s step %d: d(residual) differs",
                  what, step);
        CHECK(grads_differ(p.a, p.b) == 0, "%s step %d: parameter gradients differ", what, step);
        opf_tensor_release(&ya), opf_tensor_release(&dxa);
        opf_tensor_release(&dea[0]), opf_tensor_release(&dea[1]);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
out:
    opf_graph_destroy(g);
    opf_tensor_release(&ext[0]), opf_tensor_release(&ext[1]);
    pair_free(&p);
}

int main(void)
{
    CHECK(opf_op_class_register(&nofake_class) == OPF_OK, "register: %s", opf_last_error(NULL));
    const struct { opf_recipe_kind k; opf_dtype dt; } cases[] = {
        {OPF_RECIPE_NONE, OPF_F32}, {OPF_RECIPE_NONE, OPF_BF16}, {OPF_RECIPE_CURRENT, OPF_F32},
        {OPF_RECIPE_CURRENT, OPF_BF16}, {OPF_RECIPE_MXFP8, OPF_BF16}};
    for (int i = 0; i < 5; i++) test_no_alloc(cases[i].k, cases[i].dt);
    for (int i = 0; i < 5; i++) test_inference(cases[i].k, cases[i].dt);
    /* eager nodes: the user op's forward and backward; both grouped linears' */
    test_untouched(build_inplace, "in-place + no-fake op", OPF_RECIPE_NONE, 2);
    test_untouched(build_inplace, "in-place + no-fake op", OPF_RECIPE_CURRENT, 2);
    test_untouched(build_grouped, "grouped_linear", OPF_RECIPE_NONE, 4);
    test_untouched(build_grouped, "grouped_linear", OPF_RECIPE_CURRENT, 4);
    TEST_DONE();
}
