/* test_compile_errors.c: bad inputs to opf_compile, opf_graph_* and
 * opf_compiled_*: each fails with the documented status and a message that
 * names what is wrong, and afterwards the seq still runs eagerly and a
 * fresh compile works (bit-exact with eager on the same parameters). */
#include "compile_util.h"
#include "op/op-impl.h"  /* to give an op a class that is not registered */

enum { M = 32, H = 64, F = 128 };

/* layernorm "ln" -> fc1 (+bias) -> gelu "act" -> fc2 (+bias), f32 */
static opf_seq *lnmlp(opf_ctx *ctx) { return cu_ln_mlp(ctx, OPF_F32, H, F, "gelu", "act"); }

static opf_spec x_spec(void) { return opf_spec_make(2, (int64_t[]){M, H}, OPF_F32); }

/* What a test starts from: its seq (owned), the default call, the input
 * spec, and a fresh x and dy. */
typedef struct fixture {
    opf_seq     *seq;
    opf_seq_call call;
    opf_spec     xs;
    opf_tensor   x, dy;
} fixture;

static fixture fx_open(opf_ctx *ctx, opf_seq *seq)
{
    fixture f = {.seq = seq, .call = opf_seq_call_default(), .xs = x_spec()};
    f.x = cu_rand2(ctx, M, H, OPF_F32, 1.0f);
    f.dy = cu_rand2(ctx, M, H, OPF_F32, 1.0f);
    return f;
}

/* The fixture's seq compiled for its call (CHECKed); NULL on failure. */
static opf_graph *fx_compile(opf_ctx *ctx, fixture *f)
{
    opf_graph *g = NULL;
    CHECK_OK(ctx, opf_compile(f->seq, &f->xs, &f->call, NULL, &g));
    return g;
}

static void fx_close(fixture *f)
{
    opf_tensor_release(&f->x), opf_tensor_release(&f->dy);
    opf_seq_destroy(f->seq);
}

/* The seq runs eagerly, and a fresh graph gives the same y, dx and grads.
 * `old`, when given, is an earlier graph that must still run (an eager run
 * does not make it stale). */
static void still_works(opf_ctx *ctx, opf_seq *seq, const opf_seq_call *call, opf_graph *old,
                        const char *after)
{
    opf_spec xs = x_spec();
    opf_tensor x = cu_rand2(ctx, M, H, OPF_F32, 1.0f), dy = cu_rand2(ctx, M, H, OPF_F32, 1.0f);
    opf_tensor ya = {0}, dxa = {0}, yb = {0}, dxb = {0};
    int np = 0;
    for (int i = 0; i < opf_seq_len(seq); i++) np += opf_op_num_params(opf_seq_at(seq, i));
    opf_tensor *ga = calloc((size_t)np + 1, sizeof *ga);
    opf_seq_zero_grad(seq);
    CHECK_OK(ctx, opf_seq_forward(seq, &x, call, &ya, NULL));
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dxa, NULL));
    for (int i = 0, k = 0; i < opf_seq_len(seq); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, i)); p++, k++) {
            const opf_tensor *g = &opf_op_param_const(opf_seq_at(seq, i), p)->grad;
            opf_tensor_alloc(ctx, &g->spec, &ga[k]);
            memcpy(ga[k].data[0], g->data[0], opf_dtype_nbytes(g->spec.dtype, (size_t)opf_spec_numel(&g->spec)));
        }
    opf_graph *g = NULL;
    CHECK_OK(ctx, opf_compile(seq, &xs, call, NULL, &g));
    for (int r = 0; r < (old ? 2 : 1); r++) {
        opf_graph *gr = r ? old : g;
        if (!gr) continue;
        opf_seq_zero_grad(seq);
        CHECK_OK(ctx, opf_graph_forward(gr, &x, call, &yb, NULL));
        CHECK_OK(ctx, opf_graph_backward(gr, &dy, NULL, &dxb, NULL));
        CHECK(yb.data[0] && opf_test_same_bytes(&ya, &yb), "after %s (%s graph): y differs from eager", after,
              r ? "earlier" : "fresh");
        CHECK(dxb.data[0] && opf_test_same_bytes(&dxa, &dxb), "after %s (%s graph): dx differs", after,
              r ? "earlier" : "fresh");
        int bad = 0;
        for (int i = 0, k = 0; i < opf_seq_len(seq); i++)
            for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, i)); p++, k++)
                bad += !opf_test_same_bytes(&ga[k], &opf_op_param_const(opf_seq_at(seq, i), p)->grad);
        CHECK(bad == 0, "after %s (%s graph): %d parameter gradients differ", after, r ? "earlier" : "fresh", bad);
    }
    opf_graph_destroy(g);
    for (int k = 0; k < np; k++) opf_tensor_release(&ga[k]);
    free(ga);
    opf_tensor_release(&ya), opf_tensor_release(&dxa);
    opf_tensor_release(&x), opf_tensor_release(&dy);
}

/* ---- an op whose class is not registered ------------------------------------------ */

static void test_unregistered(opf_ctx *ctx)
{
    fixture f = fx_open(ctx, lnmlp(ctx));
    opf_op *act = opf_seq_at(f.seq, 3);
    CHECK(!strcmp(opf_op_name(act), "act"), "op 3 is the activation");
    /* a copy of the gelu class, same name and functions, never registered */
    static opf_op_class copy;
    const opf_op_class *orig = act->cls;
    copy = *orig;
    act->cls = &copy;
    opf_graph *g = NULL;
    CHECK_FAILS(ctx, opf_compile(f.seq, &f.xs, &f.call, NULL, &g), OPF_ERR_INVALID_ARG, "\"act\"", "\"gelu\"",
                "not registered");
    CHECK(g == NULL, "no graph on failure");
    opf_compiled *c = NULL;
    CHECK_OK(ctx, opf_compiled_create(f.seq, NULL, &c));
    opf_tensor y;
    CHECK_FAILS(ctx, opf_compiled_forward(c, &f.x, &f.call, &y, NULL), OPF_ERR_INVALID_ARG, "\"act\"",
                "not registered");
    CHECK(opf_compiled_num_graphs(c) == 0 && opf_compiled_last_graph(c) == NULL, "no graph cached");
    opf_tensor dx;
    CHECK_FAILS(ctx, opf_compiled_backward(c, &f.dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward");
    act->cls = orig;
    still_works(ctx, f.seq, &f.call, NULL, "an unregistered class");
    /* the cache works once the class is the registered one */
    opf_tensor yc;
    CHECK_OK(ctx, opf_compiled_forward(c, &f.x, &f.call, &yc, NULL));
    CHECK_OK(ctx, opf_compiled_backward(c, &f.dy, NULL, &dx, NULL));
    CHECK(opf_compiled_recompiles(c) == 0, "the failed compile is not counted");
    opf_compiled_destroy(c);
    fx_close(&f);
}

/* ---- specs the ops reject -------------------------------------------------------------- */

static void test_bad_specs(opf_ctx *ctx)
{
    fixture f = fx_open(ctx, lnmlp(ctx));
    opf_graph *g = NULL;
    opf_spec narrow = opf_spec_make(2, (int64_t[]){M, 32}, OPF_F32);
    CHECK_FAILS(ctx, opf_compile(f.seq, &narrow, &f.call, NULL, &g), OPF_ERR_SHAPE, "layernorm", "\"ln\"", "32",
                "64");
    opf_spec rank3 = opf_spec_make(3, (int64_t[]){4, 8, 48}, OPF_F32);
    CHECK_FAILS(ctx, opf_compile(f.seq, &rank3, &f.call, NULL, &g), OPF_ERR_SHAPE, "\"ln\"", "48");
    opf_spec rank1 = opf_spec_make(1, (int64_t[]){40}, OPF_F32);
    CHECK_FAILS(ctx, opf_compile(f.seq, &rank1, &f.call, NULL, &g), OPF_ERR_SHAPE, "\"ln\"", "40");
    opf_spec ints = opf_spec_make(2, (int64_t[]){M, H}, OPF_I32);
    opf_status st = opf_compile(f.seq, &ints, &f.call, NULL, &g);
    CHECK(st != OPF_OK && strstr(opf_last_error(ctx), "ln"), "i32 input: %s: %s", opf_status_str(st),
          opf_last_error(ctx));
    /* an input spec no layout exists for */
    opf_spec mx = x_spec();
    mx.shape[0] = 20, mx.scaling = OPF_SCALING_MXFP8, mx.qdtype = OPF_E4M3, mx.usage = OPF_USAGE_ROWWISE;
    CHECK_FAILS(ctx, opf_compile(f.seq, &mx, &f.call, NULL, &g), OPF_ERR_SHAPE, "opf_compile", "input spec");
    /* max_leading needs a rank >= 1, and must not be negative */
    opf_compile_options o = opf_compile_options_default();
    o.max_leading = -4;
    CHECK_FAILS(ctx, opf_compile(f.seq, &f.xs, &f.call, &o, &g), OPF_ERR_INVALID_ARG, "max_leading", "-4");
    /* extra inputs the seq does not take */
    opf_tensor extra = cu_rand2(ctx, M, H, OPF_F32, 1.0f);
    opf_seq_call c2 = f.call;
    c2.n_extra_in = 1, c2.extra_in = &extra;
    CHECK_FAILS(ctx, opf_compile(f.seq, &f.xs, &c2, NULL, &g), OPF_ERR_INVALID_ARG, "1 extra inputs", "takes 0");
    /* an invalid recipe */
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    r.amax_history_len = 0;
    c2 = f.call;
    c2.recipe = &r;
    st = opf_compile(f.seq, &f.xs, &c2, NULL, &g);
    CHECK(st == OPF_ERR_INVALID_ARG && strstr(opf_last_error(ctx), "opf_compile"), "bad recipe: %s: %s",
          opf_status_str(st), opf_last_error(ctx));
    CHECK(g == NULL, "no graph on failure");
    opf_tensor_release(&extra);
    still_works(ctx, f.seq, &f.call, NULL, "rejected specs");
    fx_close(&f);
}

/* ---- calls that do not match the graph ------------------------------------------------ */

static void test_mismatched_calls(opf_ctx *ctx)
{
    fixture f = fx_open(ctx, lnmlp(ctx));
    opf_graph *g = fx_compile(ctx, &f);
    if (!g) goto out;
    opf_tensor y, dx;
    opf_tensor small = cu_rand2(ctx, M / 2, H, OPF_F32, 1.0f), half = cu_rand2(ctx, M, H, OPF_BF16, 1.0f);
    CHECK_FAILS(ctx, opf_graph_forward(g, &small, &f.call, &y, NULL), OPF_ERR_INVALID_ARG, "x is",
                "f32[16,64]", "f32[32,64]");
    CHECK_FAILS(ctx, opf_graph_forward(g, &half, &f.call, &y, NULL), OPF_ERR_INVALID_ARG, "x is", "bf16");
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_seq_call c2 = f.call;
    c2.recipe = &r;
    CHECK_FAILS(ctx, opf_graph_forward(g, &f.x, &c2, &y, NULL), OPF_ERR_INVALID_ARG, "recipe");
    c2 = f.call;
    c2.requires_grad = false;
    CHECK_FAILS(ctx, opf_graph_forward(g, &f.x, &c2, &y, NULL), OPF_ERR_INVALID_ARG, "requires_grad");
    opf_tensor extra = cu_rand2(ctx, M, H, OPF_F32, 1.0f);
    c2 = f.call;
    c2.n_extra_in = 1, c2.extra_in = &extra;
    CHECK_FAILS(ctx, opf_graph_forward(g, &f.x, &c2, &y, NULL), OPF_ERR_INVALID_ARG, "extra inputs");
    /* none of those left a forward pending */
    CHECK_FAILS(ctx, opf_graph_backward(g, &f.dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward");
    /* a dy of the wrong spec */
    CHECK_OK(ctx, opf_graph_forward(g, &f.x, &f.call, &y, NULL));
    CHECK_FAILS(ctx, opf_graph_backward(g, &half, NULL, &dx, NULL), OPF_ERR_INVALID_ARG, "dy is", "bf16");
    CHECK_OK(ctx, opf_graph_backward(g, &f.dy, NULL, &dx, NULL));
    still_works(ctx, f.seq, &f.call, g, "mismatched calls");
    opf_tensor_release(&small), opf_tensor_release(&half), opf_tensor_release(&extra);
out:
    opf_graph_destroy(g);
    fx_close(&f);
}

/* A value kwarg the graph baked (dropout's training flag) differs. */
static void test_kwarg_mismatch(opf_ctx *ctx)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_dropout_config dc = {.p = 0.25};
    opf_seq_append_linear(seq, H, H, false, OPF_F32, "fc");
    opf_seq_append(seq, cu_op(ctx, "dropout", &dc, "drop"));
    opf_dropout_kwargs train = {.training = true}, eval = {.training = false};
    const void *kw[2] = {NULL, &train};
    opf_seq_call call = opf_seq_call_default();
    call.kwargs = kw;
    opf_spec xs = x_spec();
    opf_graph *g = NULL;
    CHECK_OK(ctx, opf_compile(seq, &xs, &call, NULL, &g));
    opf_tensor x = cu_rand2(ctx, M, H, OPF_F32, 1.0f), dy = cu_rand2(ctx, M, H, OPF_F32, 1.0f), y, dx;
    kw[1] = &eval;
    if (g) CHECK_FAILS(ctx, opf_graph_forward(g, &x, &call, &y, NULL), OPF_ERR_INVALID_ARG, "kwargs");
    /* the cache compiles the other value instead */
    opf_compiled *c = NULL;
    CHECK_OK(ctx, opf_compiled_create(seq, NULL, &c));
    for (int i = 0; c && i < 3; i++) {
        kw[1] = i == 1 ? (const void *)&eval : &train;
        CHECK_OK(ctx, opf_compiled_forward(c, &x, &call, &y, NULL));
        CHECK_OK(ctx, opf_compiled_backward(c, &dy, NULL, &dx, NULL));
    }
    CHECK(opf_compiled_recompiles(c) == 1, "training true/false: %d recompiles", opf_compiled_recompiles(c));
    kw[1] = &train;
    if (g) {
        CHECK_OK(ctx, opf_graph_forward(g, &x, &call, &y, NULL));
        CHECK_OK(ctx, opf_graph_backward(g, &dy, NULL, &dx, NULL));
    }
    opf_compiled_destroy(c);
    opf_graph_destroy(g);
    opf_tensor_release(&x), opf_tensor_release(&dy);
    opf_seq_destroy(seq);
}

/* ---- order of calls ------------------------------------------------------------------- */

static void test_order(opf_ctx *ctx)
{
    fixture f = fx_open(ctx, lnmlp(ctx));
    opf_graph *g = fx_compile(ctx, &f);
    if (!g) goto out;
    opf_tensor y, dx;
    CHECK_FAILS(ctx, opf_graph_backward(g, &f.dy, NULL, &dx, NULL), OPF_ERR_STATE, "opf_graph_backward",
                "no forward");
    CHECK_OK(ctx, opf_graph_forward(g, &f.x, &f.call, &y, NULL));
    CHECK_FAILS(ctx, opf_graph_forward(g, &f.x, &f.call, &y, NULL), OPF_ERR_STATE, "opf_graph_forward",
                "backward has not run");
    CHECK_OK(ctx, opf_graph_backward(g, &f.dy, NULL, &dx, NULL));
    CHECK_FAILS(ctx, opf_graph_backward(g, &f.dy, NULL, &dx, NULL), OPF_ERR_STATE, "one backward");
    /* the same through the cache */
    opf_compiled *c = NULL;
    CHECK_OK(ctx, opf_compiled_create(f.seq, NULL, &c));
    CHECK_FAILS(ctx, opf_compiled_backward(c, &f.dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward ran");
    CHECK_OK(ctx, opf_compiled_forward(c, &f.x, &f.call, &y, NULL));
    CHECK_FAILS(ctx, opf_compiled_forward(c, &f.x, &f.call, &y, NULL), OPF_ERR_STATE, "opf_compiled_backward first");
    CHECK_OK(ctx, opf_compiled_backward(c, &f.dy, NULL, &dx, NULL));
    /* an eager backward pending on the seq: no compile until it runs */
    opf_tensor ye, dxe;
    CHECK_OK(ctx, opf_seq_forward(f.seq, &f.x, &f.call, &ye, NULL));
    opf_graph *g2 = NULL;
    CHECK_FAILS(ctx, opf_compile(f.seq, &f.xs, &f.call, NULL, &g2), OPF_ERR_STATE, "pending");
    CHECK(g2 == NULL, "no graph on failure");
    CHECK_OK(ctx, opf_seq_backward(f.seq, &f.dy, NULL, &dxe, NULL));
    opf_tensor_release(&ye), opf_tensor_release(&dxe);
    still_works(ctx, f.seq, &f.call, g, "out-of-order calls");
    opf_compiled_destroy(c);
out:
    opf_graph_destroy(g);
    fx_close(&f);
}

/* ---- a stale graph ---------------------------------------------------------------------- */

static void test_stale(opf_ctx *ctx)
{
    fixture f = fx_open(ctx, lnmlp(ctx));
    opf_graph *g = NULL;
    opf_compiled *c = NULL;
    CHECK_OK(ctx, opf_compile(f.seq, &f.xs, &f.call, NULL, &g));
    CHECK_OK(ctx, opf_compiled_create(f.seq, NULL, &c));
    opf_tensor y, dx;
    CHECK_OK(ctx, opf_compiled_forward(c, &f.x, &f.call, &y, NULL));
    CHECK_OK(ctx, opf_compiled_backward(c, &f.dy, NULL, &dx, NULL));
    CHECK_OK(ctx, opf_seq_append(f.seq, cu_op(ctx, "identity", NULL, "tail")));
    if (g) {
        CHECK_FAILS(ctx, opf_graph_forward(g, &f.x, &f.call, &y, NULL), OPF_ERR_STATE, "stale");
        CHECK_FAILS(ctx, opf_graph_backward(g, &f.dy, NULL, &dx, NULL), OPF_ERR_STATE, "stale");
    }
    /* the cache compiles it again, counted as a recompile */
    CHECK_OK(ctx, opf_compiled_forward(c, &f.x, &f.call, &y, NULL));
    CHECK_OK(ctx, opf_compiled_backward(c, &f.dy, NULL, &dx, NULL));
    CHECK(opf_compiled_recompiles(c) == 1 && opf_compiled_num_graphs(c) == 1,
          "stale graph recompiled: %d recompiles, %d graphs", opf_compiled_recompiles(c),
          opf_compiled_num_graphs(c));
    /* a pending compiled forward when the seq changes: the backward refuses */
    CHECK_OK(ctx, opf_compiled_forward(c, &f.x, &f.call, &y, NULL));
    opf_op *removed = NULL;
    CHECK_OK(ctx, opf_seq_remove(f.seq, opf_seq_len(f.seq) - 1, &removed));
    opf_op_destroy(removed);
    CHECK_FAILS(ctx, opf_compiled_backward(c, &f.dy, NULL, &dx, NULL), OPF_ERR_STATE, "stale");
    /* the cache is not stuck on the stale forward: it compiles again */
    CHECK_OK(ctx, opf_compiled_forward(c, &f.x, &f.call, &y, NULL));
    CHECK_OK(ctx, opf_compiled_backward(c, &f.dy, NULL, &dx, NULL));
    CHECK(opf_compiled_recompiles(c) == 2, "recompiled after the stale forward: %d recompiles",
          opf_compiled_recompiles(c));
    still_works(ctx, f.seq, &f.call, NULL, "a stale graph");
    /* a forward with another recipe rebuilds the recipe state: stale too */
    opf_graph *g3 = NULL;
    CHECK_OK(ctx, opf_compile(f.seq, &f.xs, &f.call, NULL, &g3));
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_seq_call cr = f.call;
    cr.recipe = &r;
    opf_tensor ye, dxe;
    CHECK_OK(ctx, opf_seq_forward(f.seq, &f.x, &cr, &ye, NULL));
    CHECK_OK(ctx, opf_seq_backward(f.seq, &f.dy, NULL, &dxe, NULL));
    opf_tensor_release(&ye), opf_tensor_release(&dxe);
    if (g3) CHECK_FAILS(ctx, opf_graph_forward(g3, &f.x, &f.call, &y, NULL), OPF_ERR_STATE, "stale");
    still_works(ctx, f.seq, &f.call, NULL, "a recipe change");
    /* switching fusions changes the plans a graph baked: stale too */
    opf_graph *g4 = NULL;
    CHECK_OK(ctx, opf_compile(f.seq, &f.xs, &f.call, NULL, &g4));
    opf_seq_set_fusions(f.seq, false);
    if (g4) CHECK_FAILS(ctx, opf_graph_forward(g4, &f.x, &f.call, &y, NULL), OPF_ERR_STATE, "stale");
    opf_seq_set_fusions(f.seq, true);
    still_works(ctx, f.seq, &f.call, NULL, "switching fusions");
    opf_graph_destroy(g4);
    opf_graph_destroy(g3);
    opf_compiled_destroy(c);
    opf_graph_destroy(g);
    fx_close(&f);
}

/* ---- NULL arguments --------------------------------------------------------------------- */

static void test_null(opf_ctx *ctx)
{
    fixture f = fx_open(ctx, lnmlp(ctx));
    opf_graph *g = NULL;
    CHECK_FAILS(NULL, opf_compile(NULL, &f.xs, &f.call, NULL, &g), OPF_ERR_INVALID_ARG, "opf_compile", "seq");
    CHECK_FAILS(ctx, opf_compile(f.seq, NULL, &f.call, NULL, &g), OPF_ERR_INVALID_ARG, "opf_compile", "x");
    CHECK_FAILS(ctx, opf_compile(f.seq, &f.xs, NULL, NULL, &g), OPF_ERR_INVALID_ARG, "opf_compile", "call");
    CHECK_FAILS(ctx, opf_compile(f.seq, &f.xs, &f.call, NULL, NULL), OPF_ERR_INVALID_ARG, "opf_compile", "out");
    CHECK_OK(ctx, opf_compile(f.seq, &f.xs, &f.call, NULL, &g));
    if (!g) goto out;
    opf_tensor y, dx;
    CHECK_FAILS(NULL, opf_graph_forward(NULL, &f.x, &f.call, &y, NULL), OPF_ERR_INVALID_ARG, "opf_graph_forward", "g");
    CHECK_FAILS(ctx, opf_graph_forward(g, NULL, &f.call, &y, NULL), OPF_ERR_INVALID_ARG, "opf_graph_forward", "x");
    CHECK_FAILS(ctx, opf_graph_forward(g, &f.x, NULL, &y, NULL), OPF_ERR_INVALID_ARG, "opf_graph_forward", "call");
    CHECK_FAILS(ctx, opf_graph_forward(g, &f.x, &f.call, NULL, NULL), OPF_ERR_INVALID_ARG, "opf_graph_forward", "y");
    CHECK_OK(ctx, opf_graph_forward(g, &f.x, &f.call, &y, NULL));
    CHECK_FAILS(NULL, opf_graph_backward(NULL, &f.dy, NULL, &dx, NULL), OPF_ERR_INVALID_ARG, "opf_graph_backward");
    CHECK_FAILS(ctx, opf_graph_backward(g, NULL, NULL, &dx, NULL), OPF_ERR_INVALID_ARG, "opf_graph_backward", "dy");
    CHECK_OK(ctx, opf_graph_backward(g, &f.dy, NULL, NULL, NULL));  /* dx may be NULL */
    opf_graph_node_info ni;
    CHECK_FAILS(ctx, opf_graph_node(g, opf_graph_num_nodes(g), &ni), OPF_ERR_INVALID_ARG, "index");
    CHECK_FAILS(ctx, opf_graph_node(g, -1, &ni), OPF_ERR_INVALID_ARG, "index");
    CHECK_FAILS(ctx, opf_graph_node(g, 0, NULL), OPF_ERR_INVALID_ARG, "out");
    CHECK_FAILS(NULL, opf_graph_dump(NULL, stderr), OPF_ERR_INVALID_ARG, "opf_graph_dump");
    CHECK_FAILS(ctx, opf_graph_dump(g, NULL), OPF_ERR_INVALID_ARG, "opf_graph_dump");
    CHECK_FAILS(ctx, opf_graph_dump_dot(g, NULL), OPF_ERR_INVALID_ARG, "opf_graph_dump_dot");
    CHECK(opf_graph_num_nodes(NULL) == 0 && opf_graph_reasons(NULL, NULL, 0) == 0, "NULL graph queries");
    opf_graph_stats s;
    opf_graph_get_stats(NULL, &s);
    CHECK(s.arena_bytes == 0 && s.n_forward == 0, "stats of NULL are zero");
    opf_graph_destroy(NULL);
    opf_compiled *c = NULL;
    CHECK_FAILS(NULL, opf_compiled_create(NULL, NULL, &c), OPF_ERR_INVALID_ARG, "opf_compiled_create");
    CHECK_FAILS(ctx, opf_compiled_create(f.seq, NULL, NULL), OPF_ERR_INVALID_ARG, "opf_compiled_create", "out");
    opf_compile_options o = opf_compile_options_default();
    o.max_variants = 0;
    CHECK_FAILS(ctx, opf_compiled_create(f.seq, &o, &c), OPF_ERR_INVALID_ARG, "max_variants", "0");
    CHECK_OK(ctx, opf_compiled_create(f.seq, NULL, &c));
    CHECK_FAILS(NULL, opf_compiled_forward(NULL, &f.x, &f.call, &y, NULL), OPF_ERR_INVALID_ARG, "opf_compiled_forward");
    if (c) {
        CHECK_FAILS(ctx, opf_compiled_forward(c, NULL, &f.call, &y, NULL), OPF_ERR_INVALID_ARG, "x");
        CHECK_FAILS(ctx, opf_compiled_forward(c, &f.x, NULL, &y, NULL), OPF_ERR_INVALID_ARG, "call");
    }
    CHECK_FAILS(NULL, opf_compiled_backward(NULL, &f.dy, NULL, &dx, NULL), OPF_ERR_INVALID_ARG, "opf_compiled_backward");
    CHECK(opf_compiled_recompiles(NULL) == 0 && opf_compiled_num_graphs(NULL) == 0 &&
          opf_compiled_last_graph(NULL) == NULL, "NULL cache queries");
    opf_compiled_destroy(NULL);
    opf_compiled_destroy(c);
    still_works(ctx, f.seq, &f.call, g, "NULL arguments");
out:
    opf_graph_destroy(g);
    /* an empty seq */
    opf_seq *empty;
    opf_seq_create(ctx, &empty);
    CHECK_FAILS(ctx, opf_compile(empty, &f.xs, &f.call, NULL, &g), OPF_ERR_STATE, "empty");
    opf_seq_destroy(empty);
    fx_close(&f);
}

int main(void)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 3;
    opf_ctx *ctx;
    if (opf_ctx_create(&o, &ctx)) return 1;
    test_unregistered(ctx);
    test_bad_specs(ctx);
    test_mismatched_calls(ctx);
    test_kwarg_mismatch(ctx);
    test_order(ctx);
    test_stale(ctx);
    test_null(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
