/* test_compile_guard.c: what a compiled graph keys on and what it does not.
 *
 *  - a user op without fakes runs as an eager node inside the graph, its
 *    reason is listed and warned once per context, and results still match
 *    eager bit for bit (also a seq with a callback step);
 *  - a quantized tensor kwarg that changes every call causes no recompile,
 *    a value kwarg recompiles once per new value, the cache limit warns;
 *  - guards by value: with every key forced to collide (a test hook),
 *    calls differing in a kwarg value, the recipe or the shape never replay
 *    each other's graph; float kwargs are guarded by their bits;
 *  - one graph compiled for max_leading runs five batch sizes with no
 *    recompilation, and refuses a batch above the maximum;
 *  - delayed scaling: scales, amax histories and parameters after 10 SGD
 *    steps are identical to eager.
 * Eager and compiled run on two contexts of the same seed (identical
 * parameters), with fresh random inputs. */
#include "compile/compile-impl.h"
#include "compile_util.h"

/* ---- helpers -------------------------------------------------------------------- */

/* Warnings through opf_ctx_options.warn. */
typedef struct warn_log {
    int  n;
    int  n_fwd_fake, n_bwd_fake, n_cache;
    char last[512];
} warn_log;

static void on_warn(void *user, const char *msg)
{
    warn_log *w = user;
    w->n++;
    w->n_fwd_fake += strstr(msg, CU_NOFAKE) && strstr(msg, "forward fake") != NULL;
    w->n_bwd_fake += strstr(msg, CU_NOFAKE) && strstr(msg, "backward fake") != NULL;
    w->n_cache += strstr(msg, "cache") != NULL;
    snprintf(w->last, sizeof w->last, "%s", msg);
}

/* A pair of contexts of seed 11; wb, when given, logs the compiled context's warnings. */
static bool pair_ctx(cu_pair *p, warn_log *wb)
{
    return cu_pair_open(p, 11, 0, wb ? on_warn : NULL, wb);
}

/* ---- a user op with kwargs: y = x + alpha * t -----------------------------------------
 * t (plain or quantized) and alpha are per-call kwargs; t has x's shape. */

typedef struct kw_args {
    opf_tensor t;
    double     alpha;
} kw_args;
static const opf_field kw_args_fields[] = {OPF_F(kw_args, t, OPF_FIELD_TENSOR_Q, OPF_FIELD_KWARG),
                                           OPF_F(kw_args, alpha, OPF_FIELD_FLOAT, OPF_FIELD_KWARG)};
OPF_SCHEMA(kw_args_schema, kw_args, kw_args_fields);

typedef struct kw_fwd {
    opf_tensor x, t;
    double     alpha;
} kw_fwd;
static const opf_field kw_fwd_fields[] = {OPF_F_TENSOR(kw_fwd, x), OPF_F_TENSOR_Q(kw_fwd, t),
                                          OPF_F_FLOAT(kw_fwd, alpha)};
OPF_SCHEMA(kw_fwd_schema, kw_fwd, kw_fwd_fields);

typedef struct kw_bwd {
    opf_tensor dy;
} kw_bwd;
static const opf_field kw_bwd_fields[] = {OPF_F_TENSOR(kw_bwd, dy)};
OPF_SCHEMA(kw_bwd_schema, kw_bwd, kw_bwd_fields);

static opf_status kw_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const kw_fwd *a = args;
    if (opf_spec_numel(&a->t.spec) != opf_spec_numel(&a->x.spec)) return OPF_ERR_SHAPE;
    outs[0] = a->x.spec;
    return OPF_OK;
}

static opf_status kw_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    kw_fwd *a = args;
    const kw_args *kw = env->kwargs;
    if (!kw) return OPF_ERR_INVALID_ARG;  /* kwargs are required */
    if (env->x->spec.scaling != OPF_SCALING_NONE) return OPF_ERR_DTYPE;
    a->x = *env->x;
    a->t = kw->t;
    a->alpha = kw->alpha;
    return OPF_OK;
}

static opf_status kw_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const kw_fwd *a = args;
    int64_t n = opf_spec_numel(&a->x.spec);
    size_t mark = opf_ctx_scratch_mark(ctx);
    float *x = opf_ctx_scratch_push(ctx, sizeof(float) * (size_t)n);
    float *t = opf_ctx_scratch_push(ctx, sizeof(float) * (size_t)n);
    opf_status st = x && t ? OPF_OK : OPF_ERR_NO_MEMORY;
    if (!st) st = opf_convert(a->x.data[0], a->x.spec.dtype, x, OPF_F32, (size_t)n);
    if (!st && a->t.spec.scaling == OPF_SCALING_NONE) {
        st = opf_convert(a->t.data[0], a->t.spec.dtype, t, OPF_F32, (size_t)n);
    } else if (!st) {
        opf_spec ts = opf_spec_make(a->t.spec.ndim, a->t.spec.shape, OPF_F32);
        opf_tensor tw;
        st = opf_tensor_wrap(&ts, t, &tw);
        if (!st) st = opf_dequantize(ctx, &a->t, OPF_USAGE_ROWWISE, &tw);
    }
    for (int64_t i = 0; !st && i < n; i++) x[i] += (float)a->alpha * t[i];
    if (!st) st = opf_convert(x, OPF_F32, outs[0].data[0], outs[0].spec.dtype, (size_t)n);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static opf_status kw_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *b)
{
    ((kw_bwd *)b)->dy = *env->dy;
    return OPF_OK;
}

static opf_status kw_bfake(const void *b, opf_spec *g)
{
    g[0] = ((const kw_bwd *)b)->dy.spec;
    return OPF_OK;
}

static opf_status kw_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g)
{
    const opf_tensor *dy = &((const kw_bwd *)b)->dy;
    opf_layout L;
    opf_status st = opf_spec_layout(&dy->spec, &L);
    if (!st) memcpy(g[0].data[0], dy->data[0], L.comp[0].nbytes);
    return st;
}

static const opf_op_class kwarg_class = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "t2_add_kw",
    .fwd_schema = &kw_fwd_schema, .bwd_schema = &kw_bwd_schema, .kwargs_schema = &kw_args_schema,
    .fusible = true, .resolve_fwd = kw_resolve, .forward_fake = kw_fake, .forward_impl = kw_impl,
    .resolve_bwd = kw_resolve_bwd, .backward_fake = kw_bfake, .backward_impl = kw_bimpl,
};

/* ---- 4. eager nodes ------------------------------------------------------------------- */

/* n_steps of forward + backward on a (eager) and the graph g of b; compared. */
static void compare_steps(cu_pair *p, opf_graph *g, const opf_seq_call *call, int64_t m, int64_t h,
                          opf_dtype dt, int n_steps, const char *what)
{
    for (int step = 0; step < n_steps; step++) {
        char tag[128];
        snprintf(tag, sizeof tag, "%s step %d", what, step);
        cu_compare_step(p, g, NULL, call, m, h, dt, 1.0f, tag);
    }
}

static void test_nofake_op(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 32, h = 64, f = 128;
    warn_log w = {0};
    cu_pair p;
    if (!pair_ctx(&p, &w)) return;
    p.a = cu_ln_mlp(p.ca, dt, h, f, CU_NOFAKE, "user");
    p.b = cu_ln_mlp(p.cb, dt, h, f, CU_NOFAKE, "user");
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, dt);
    opf_graph *g = NULL, *g2 = NULL;
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &call, NULL, &g));
    if (!g) goto out;
    opf_graph_reason rs[16];
    int nr = opf_graph_reasons(g, rs, 16);
    int fwd = 0, bwd = 0;
    for (int i = 0; i < nr && i < 16; i++) {
        CHECK(!strcmp(rs[i].op_name, "user"), "only the user op is eager, not %s (%s)", rs[i].op_name,
              rs[i].reason);
        CHECK(strstr(rs[i].reason, "fake") != NULL, "reason names the missing fake: %s", rs[i].reason);
        fwd += !rs[i].backward, bwd += rs[i].backward;
    }
    CHECK(nr == 2 && fwd == 1 && bwd == 1, "one eager forward and one eager backward node (%d: %d/%d)", nr,
          fwd, bwd);
    opf_graph_stats s;
    opf_graph_get_stats(g, &s);
    CHECK(s.n_eager == 2, "stats: %d eager nodes", s.n_eager);
    CHECK(w.n_fwd_fake == 1 && w.n_bwd_fake == 1, "first compile warns once per reason (%d/%d): %s",
          w.n_fwd_fake, w.n_bwd_fake, w.last);
    compare_steps(&p, g, &call, m, h, dt, 3, "nofake user op");
    /* a second compile in the same context warns no more */
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &call, NULL, &g2));
    CHECK(w.n_fwd_fake == 1 && w.n_bwd_fake == 1, "second compile: warned again (%d/%d)", w.n_fwd_fake,
          w.n_bwd_fake);
    if (g2) compare_steps(&p, g2, &call, m, h, dt, 1, "nofake user op, second graph");
out:
    opf_graph_destroy(g);
    opf_graph_destroy(g2);
    cu_pair_close(&p);
}

/* A callback step: y = 0.5 x (f32), dx = 0.5 dy. */
static opf_status cb_half(opf_ctx *ctx, const opf_tensor *in, opf_tensor *out)
{
    opf_status st = opf_tensor_alloc(ctx, &in->spec, out);
    return st ? st : cu_nf_scale(ctx, in, 0.5f, out);
}
static opf_status cb_fwd(void *user, opf_ctx *ctx, const opf_tensor *x, opf_tensor *y)
{
    ++*(int *)user;
    return cb_half(ctx, x, y);
}
static opf_status cb_bwd(void *user, opf_ctx *ctx, const opf_tensor *dy, opf_tensor *dx)
{
    return cb_half(ctx, dy, dx);
}

static void test_callback(opf_dtype dt)
{
    const int64_t m = 32, h = 64, f = 128;
    cu_pair p;
    if (!pair_ctx(&p, NULL)) return;
    int calls[2] = {0, 0};
    opf_seq *s[2];
    opf_ctx *c[2] = {p.ca, p.cb};
    opf_layernorm_config ln = {.hidden = h, .eps = 1e-5, .dtype = dt};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(c[i], opf_seq_create(c[i], &s[i]));
        cu_append(c[i], s[i], "layernorm", &ln, "ln");
        CHECK_OK(c[i], opf_seq_append_linear(s[i], h, f, true, dt, "fc1"));
        opf_callback_i cb = {cb_fwd, cb_bwd, &calls[i]};
        CHECK_OK(c[i], opf_seq_append_callback(s[i], &cb, "half"));
        CHECK_OK(c[i], opf_seq_append_linear(s[i], f, h, true, dt, "fc2"));
    }
    p.a = s[0], p.b = s[1];
    opf_seq_call call = opf_seq_call_default();
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, dt);
    opf_graph *g = NULL;
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &call, NULL, &g));
    if (g) {
        opf_graph_reason rs[8];
        int nr = opf_graph_reasons(g, rs, 8);
        CHECK(nr == 2 && !strcmp(rs[0].op_name, "half") && strstr(rs[0].reason, "callback"),
              "the callback is the eager node (%d: %s)", nr, nr ? rs[0].reason : "-");
        int before = calls[1];
        compare_steps(&p, g, &call, m, h, dt, 3, "callback");
        CHECK(calls[1] - before == 3, "the callback ran once per compiled forward (%d)", calls[1] - before);
    }
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

/* ---- 5. kwargs ---------------------------------------------------------------------------- */

static opf_tensor fp8_kwarg(opf_ctx *ctx, int64_t m, int64_t k)
{
    opf_recipe rc = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_quantizer_role role = {"linear", OPF_ROLE_INPUT, "t"};
    opf_quantizer q;
    opf_recipe_quantizer(&rc, &role, &q);
    q.usage = OPF_USAGE_ROWWISE;
    opf_tensor plain = cu_rand2(ctx, m, k, OPF_F32, 0.5f), t = {0};
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &plain, &t));
    opf_tensor_release(&plain);
    return t;
}

/* One step through opf_compiled with kwargs (alpha, a fresh fp8 t); compared with eager. */
static void kw_step(cu_pair *p, opf_compiled *c, const opf_recipe *r, double alpha, int64_t m, int64_t h,
                    int64_t f, const char *what)
{
    const int user = 3;
    const void *kwv[16] = {0};
    kw_args kw = {.t = fp8_kwarg(p->ca, m, f), .alpha = alpha};
    CHECK(kw.t.spec.scaling == OPF_SCALING_TENSOR, "t is per-tensor fp8");
    kwv[user] = &kw;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r;
    call.kwargs = kwv;
    char tag[128];
    snprintf(tag, sizeof tag, "%s (alpha %g)", what, alpha);
    opf_tensor x = cu_rand2(p->ca, m, h, OPF_F32, 1.0f), dy = cu_rand2(p->ca, m, h, OPF_F32, 1.0f);
    cu_step s;
    memset(&s, 0, sizeof s);
    opf_seq_zero_grad(p->a);
    opf_seq_zero_grad(p->b);
    cu_eager_step(p, &call, &x, &dy, &s);
    uint64_t ct = cu_checksum(&kw.t), cx = cu_checksum(&x), cdy = cu_checksum(&dy);
    cu_compiled_step(p, NULL, c, &call, &x, &dy, &s);
    CHECK(cu_checksum(&kw.t) == ct && cu_checksum(&x) == cx && cu_checksum(&dy) == cdy,
          "%s: the graph wrote the tensor kwarg, x or dy", tag);
    cu_check_step(tag, p, &s);
    cu_step_release(&s);
    opf_tensor_release(&x), opf_tensor_release(&dy), opf_tensor_release(&kw.t);
}

static void test_kwargs(opf_recipe_kind kind)
{
    const int64_t m = 32, h = 64, f = 128;
    warn_log w = {0};
    cu_pair p;
    if (!pair_ctx(&p, &w)) return;
    p.a = cu_ln_mlp(p.ca, OPF_F32, h, f, "t2_add_kw", "user");
    p.b = cu_ln_mlp(p.cb, OPF_F32, h, f, "t2_add_kw", "user");
    CHECK(!strcmp(opf_op_class_of(opf_seq_at(p.a, 3))->name, "t2_add_kw"), "user op at index 3");
    opf_recipe r = opf_recipe_default(kind);
    const opf_recipe *rp = kind == OPF_RECIPE_NONE ? NULL : &r;
    opf_compile_options o = opf_compile_options_default();
    o.max_variants = 2;
    opf_compiled *c = NULL;
    CHECK_OK(p.cb, opf_compiled_create(p.b, &o, &c));
    if (!c) goto out;
    /* the tensor kwarg changes every call: no recompilation */
    for (int i = 0; i < 4; i++) kw_step(&p, c, rp, 3.0, m, h, f, "fresh fp8 kwarg");
    CHECK(opf_compiled_recompiles(c) == 0, "tensor kwargs recompiled %d times", opf_compiled_recompiles(c));
    CHECK(opf_compiled_num_graphs(c) == 1, "%d graphs", opf_compiled_num_graphs(c));
    opf_graph_reason rs[4];
    CHECK(opf_graph_reasons(opf_compiled_last_graph(c), rs, 4) == 0, "the kwargs op is traced, not eager");
    /* a value kwarg: once per new value */
    kw_step(&p, c, rp, 5.0, m, h, f, "alpha 5");
    CHECK(opf_compiled_recompiles(c) == 1, "alpha 3 -> 5: %d recompiles", opf_compiled_recompiles(c));
    kw_step(&p, c, rp, 3.0, m, h, f, "alpha 3 again");
    kw_step(&p, c, rp, 5.0, m, h, f, "alpha 5 again");
    CHECK(opf_compiled_recompiles(c) == 1, "cached values: %d recompiles", opf_compiled_recompiles(c));
    CHECK(w.n_cache == 0, "no cache warning yet: %s", w.last);
    /* a third value with max_variants 2: warns about the limit, recompiles */
    kw_step(&p, c, rp, 7.0, m, h, f, "alpha 7");
    CHECK(opf_compiled_recompiles(c) == 2, "alpha 7: %d recompiles", opf_compiled_recompiles(c));
    CHECK(opf_compiled_num_graphs(c) == 2, "the cache keeps %d graphs", opf_compiled_num_graphs(c));
    CHECK(w.n_cache == 1 && strstr(w.last, "2 variants"), "cache-limit warning: %d, \"%s\"", w.n_cache, w.last);
    /* 3.0 was evicted (least recently used): compiled again, no second warning */
    kw_step(&p, c, rp, 3.0, m, h, f, "alpha 3 after eviction");
    CHECK(opf_compiled_recompiles(c) == 3, "evicted value: %d recompiles", opf_compiled_recompiles(c));
    CHECK(w.n_cache == 1, "the limit warns once (%d)", w.n_cache);
out:
    opf_compiled_destroy(c);
    cu_pair_close(&p);
}

/* ---- 5b. guards by value ----------------------------------------------------------------- */

/* The kwargs seq on both contexts and a cache of up to 8 graphs over b's. */
static bool kw_pair(cu_pair *p, int64_t h, int64_t f, opf_compiled **c)
{
    if (!pair_ctx(p, NULL)) return false;
    p->a = cu_ln_mlp(p->ca, OPF_F32, h, f, "t2_add_kw", "user");
    p->b = cu_ln_mlp(p->cb, OPF_F32, h, f, "t2_add_kw", "user");
    opf_compile_options o = opf_compile_options_default();
    o.max_variants = 8;
    CHECK_OK(p->cb, opf_compiled_create(p->b, &o, c));
    return true;
}

static uint64_t one_key(uint64_t key)
{
    (void)key;
    return 42;  /* every call collides */
}

/* With every key forced equal, calls that differ in a value kwarg or the
 * input shape still get their own graphs (each compared with eager), a
 * repeat of each replays its own, and a new recipe is not given an old
 * graph. */
static void test_collision(void)
{
    const int64_t h = 64, f = 128;
    cu_pair p;
    opf_compiled *c = NULL;
    if (!kw_pair(&p, h, f, &c)) return;
    opf_graph_key_test_hook(one_key);
    const struct { double alpha; int64_t m; } calls[] = {{3.0, 32}, {5.0, 32}, {3.0, 64}, {5.0, 64}};
    enum { NC = sizeof calls / sizeof calls[0] };
    for (int round = 0; c && round < 2; round++)
        for (int i = 0; i < NC; i++) {
            char tag[96];
            snprintf(tag, sizeof tag, "collision round %d call %d", round, i);
            kw_step(&p, c, NULL, calls[i].alpha, calls[i].m, h, f, tag);
        }
    CHECK(c && opf_compiled_num_graphs(c) == NC && opf_compiled_recompiles(c) == NC - 1,
          "colliding keys: %d graphs, %d recompiles; want %d and %d", opf_compiled_num_graphs(c),
          opf_compiled_recompiles(c), NC, NC - 1);
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);  /* another recipe, the same key */
    if (c) kw_step(&p, c, &cur, 3.0, 32, h, f, "collision, current scaling");
    opf_graph_key_test_hook(NULL);
    opf_compiled_destroy(c);
    cu_pair_close(&p);
}

/* The float-kwarg policy of compile.h: by bits. -0.0 is not 0.0, values
 * 1e-9 apart are apart, and a repeated value (NaN bits included) replays;
 * an explicit graph refuses a call whose float differs only in its bits. */
static void test_float_policy(void)
{
    const int64_t m = 32, h = 64, f = 128;
    cu_pair p;
    opf_compiled *c = NULL;
    if (!kw_pair(&p, h, f, &c)) return;
    const double vals[] = {0.0, -0.0, 0.5, 0.5 + 1e-9, 0.0, -0.0, 0.5};
    const int want[] = {0, 1, 2, 3, 3, 3, 3};  /* recompiles after each call */
    for (int i = 0; c && i < (int)(sizeof vals / sizeof vals[0]); i++) {
        kw_step(&p, c, NULL, vals[i], m, h, f, "float policy");
        CHECK(opf_compiled_recompiles(c) == want[i], "float kwarg %g (call %d): %d recompiles, want %d",
              vals[i], i, opf_compiled_recompiles(c), want[i]);
    }
    kw_args kw = {.t = fp8_kwarg(p.cb, m, f), .alpha = -0.0};
    const void *kwv[16] = {0};
    kwv[3] = &kw;
    opf_seq_call call = opf_seq_call_default();
    call.kwargs = kwv;
    opf_graph *g = NULL;
    CHECK_OK(p.cb, opf_compile(p.b, &(opf_spec){.ndim = 2, .shape = {m, h}, .dtype = OPF_F32}, &call, NULL, &g));
    kw.alpha = 0.0;
    opf_tensor x = cu_rand2(p.cb, m, h, OPF_F32, 1.0f), y;
    if (g) CHECK_FAILS(p.cb, opf_graph_forward(g, &x, &call, &y, NULL), OPF_ERR_INVALID_ARG, "kwargs");
    opf_graph_destroy(g);
    opf_tensor_release(&x), opf_tensor_release(&kw.t);
    opf_compiled_destroy(c);
    cu_pair_close(&p);
}

/* ---- 6. dynamic leading dimension -------------------------------------------------- */

static void dyn_step(cu_pair *p, opf_compiled *c, opf_graph *g, const opf_seq_call *call, int64_t bs,
                     int64_t h, opf_dtype dt, const char *what)
{
    char tag[128];
    snprintf(tag, sizeof tag, "%s batch %lld", what, (long long)bs);
    cu_compare_step(p, g, c, call, bs, h, dt, 1.0f, tag);
}

static void test_dynamic(opf_recipe_kind kind, opf_dtype dt, bool cached)
{
    const int64_t h = 64, f = 128, maxb = 128;
    const int64_t sizes16[] = {128, 96, 64, 32, 16}, sizes32[] = {128, 96, 64, 32, 64};
    const int64_t *sizes = kind == OPF_RECIPE_MXFP8 ? sizes32 : sizes16;
    char what[96];
    snprintf(what, sizeof what, "dynamic %s %s %s", opf_recipe_name(kind), opf_dtype_name(dt),
             cached ? "opf_compiled" : "opf_graph");
    cu_pair p;
    if (!cu_pair_build(&p, 11, cu_ln_gelu_mlp, dt, h, f)) return;
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
    if (kind == OPF_RECIPE_NVFP4) r.nvfp4_stochastic = false;
    opf_compile_options o = opf_compile_options_default();
    o.max_leading = maxb;
    opf_compiled *c = NULL;
    opf_graph *g = NULL;
    opf_spec xs = opf_spec_make(2, (int64_t[]){32, h}, dt);  /* the leading size is replaced */
    if (cached) CHECK_OK(p.cb, opf_compiled_create(p.b, &o, &c));
    else CHECK_OK(p.cb, opf_compile(p.b, &xs, &call, &o, &g));
    if (!c && !g) goto out;
    if (g) {
        opf_graph_stats s;
        opf_graph_get_stats(g, &s);
        CHECK(s.max_leading == maxb, "%s: stats.max_leading %lld", what, (long long)s.max_leading);
    }
    for (int i = 0; i < 5; i++) dyn_step(&p, c, g, &call, sizes[i], h, dt, what);
    if (c) {
        CHECK(opf_compiled_recompiles(c) == 0, "%s: %d recompiles", what, opf_compiled_recompiles(c));
        CHECK(opf_compiled_num_graphs(c) == 1, "%s: %d graphs", what, opf_compiled_num_graphs(c));
    }
    /* above the declared maximum: refused, naming both sizes */
    opf_tensor big = cu_rand2(p.ca, maxb + 32, h, dt, 1.0f), y;
    if (c) CHECK_FAILS(p.cb, opf_compiled_forward(c, &big, &call, &y, NULL), OPF_ERR_SHAPE, "160", "128");
    else CHECK_FAILS(p.cb, opf_graph_forward(g, &big, &call, &y, NULL), OPF_ERR_SHAPE, "160", "128", "x");
    opf_tensor_release(&big);
    /* a size the format cannot take fails like eager, and the graph keeps working */
    if (kind == OPF_RECIPE_MXFP8) {
        opf_tensor x16 = cu_rand2(p.ca, 16, h, dt, 1.0f), ya;
        opf_status se = opf_seq_forward(p.a, &x16, &call, &ya, NULL);
        opf_status sc = c ? opf_compiled_forward(c, &x16, &call, &y, NULL) : opf_graph_forward(g, &x16, &call, &y, NULL);
        CHECK(se != OPF_OK && sc != OPF_OK, "%s: batch 16 under mxfp8: eager %s, compiled %s (%s)", what,
              opf_status_str(se), opf_status_str(sc), opf_last_error(p.cb));
        if (!se) opf_seq_discard(p.a), opf_tensor_release(&ya);
        opf_tensor_release(&x16);
    }
    dyn_step(&p, c, g, &call, 32, h, dt, "after the refusals");
    if (c) CHECK(opf_compiled_recompiles(c) == 0, "%s: refusals recompiled", what);
out:
    opf_compiled_destroy(c);
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

/* ---- 7. delayed scaling ------------------------------------------------------------- */

static void test_delayed(opf_dtype dt, int hist)
{
    const int64_t m = 32, h = 64, f = 128;
    cu_pair p;
    if (!cu_pair_build(&p, 11, cu_ln_gelu_mlp, dt, h, f)) return;
    opf_recipe r;
    opf_seq_call call = cu_call(OPF_RECIPE_DELAYED, &r);
    r.amax_history_len = hist;
    bool sgd = cu_pair_sgd(&p, 0.05f, 0.0f);
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, dt);
    opf_graph *g = NULL;
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &call, NULL, &g));
    if (!g || !sgd) goto out;
    int updates = 0;
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info ni;
        opf_graph_node(g, i, &ni);
        updates += ni.kind == OPF_NODE_AMAX_UPDATE;
    }
    CHECK(updates == 2, "amax updates are nodes of the graph (%d)", updates);
    int n_states = 0;
    for (int step = 0; step < 10; step++) {
        /* growing inputs so that the histories roll through new amaxes */
        float sigma = 0.5f + 0.25f * (float)step;
        opf_tensor x = cu_rand2(p.ca, m, h, dt, sigma), dy = cu_rand2(p.ca, m, h, dt, 0.1f * sigma);
        cu_step s;
        memset(&s, 0, sizeof s);
        opf_seq_zero_grad(p.a);
        opf_seq_zero_grad(p.b);
        cu_eager_step(&p, &call, &x, &dy, &s);
        cu_compiled_step(&p, g, NULL, &call, &x, &dy, &s);
        cu_pair_optim_step(&p);
        n_states = 0;
        int bad = cu_delayed_differ(p.a, p.b, &n_states);
        bad += !opf_test_same_bytes(&s.ya, &s.yb) + !opf_test_same_bytes(&s.dxa, &s.dxb);
        bad += cu_grads_differ(p.a, p.b) + cu_params_differ(p.a, p.b);
        CHECK(bad == 0, "delayed %s L=%d step %d: %d mismatches (states, y, dx, grads, params)",
              opf_dtype_name(dt), hist, step, bad);
        cu_step_release(&s);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
    CHECK(n_states == 4, "two linears with a forward and a backward state each (%d)", n_states);
    /* the states actually moved: some scale is not 1 */
    bool moved = false;
    opf_recipe_state *rs = opf_op_recipe_state(opf_seq_at(p.b, 1));
    opf_delayed_state *ds = rs ? opf_recipe_state_delayed(rs, false) : NULL;
    for (int i = 0; ds && i < opf_delayed_state_slots(ds); i++) moved |= opf_delayed_state_scale(ds)[i] != 1.0f;
    CHECK(moved, "delayed scales were updated");
out:
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

int main(void)
{
    cu_rng = 0x6A2D5EEDull;
    CHECK(opf_op_class_register(&cu_nofake_class) == OPF_OK, "register: %s", opf_last_error(NULL));
    CHECK(opf_op_class_register(&kwarg_class) == OPF_OK, "register: %s", opf_last_error(NULL));

    test_nofake_op(OPF_RECIPE_NONE, OPF_F32);
    test_nofake_op(OPF_RECIPE_CURRENT, OPF_BF16);
    test_callback(OPF_F32);

    test_kwargs(OPF_RECIPE_NONE);
    test_kwargs(OPF_RECIPE_CURRENT);
    test_collision();
    test_float_policy();

    const struct { opf_recipe_kind k; opf_dtype dt; } dyn[] = {
        {OPF_RECIPE_NONE, OPF_F32}, {OPF_RECIPE_CURRENT, OPF_F32},
        {OPF_RECIPE_MXFP8, OPF_BF16}, {OPF_RECIPE_NVFP4, OPF_BF16}};
    for (int i = 0; i < 4; i++)
        for (int cached = 0; cached < 2; cached++) test_dynamic(dyn[i].k, dyn[i].dt, cached);

    test_delayed(OPF_F32, 4);
    test_delayed(OPF_BF16, 8);
    TEST_DONE();
}
