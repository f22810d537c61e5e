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
#include "compile_util.h"
#include "core/context-impl.h"

/* ---- 9. no allocation; arena <= eager peak ---------------------------------------- */

/* One training step of both: eager on a (optionally measuring its peak),
 * compiled on b through c; outputs compared. */
static void train_step(cu_pair *p, opf_compiled *c, const opf_seq_call *call, int64_t m, int64_t h,
                       opf_dtype dt, size_t *eager_peak, const char *what)
{
    opf_tensor x = cu_rand2(p->ca, m, h, dt, 1.0f), dy = cu_rand2(p->ca, m, h, dt, 1.0f);
    cu_step s;
    memset(&s, 0, sizeof s);
    opf_seq_zero_grad(p->a);
    opf_seq_zero_grad(p->b);
    opf_alloc_stats s0, s1;
    opf_ctx_alloc_reset_peak(p->ca);
    opf_ctx_alloc_stats(p->ca, &s0);
    cu_eager_step(p, call, &x, &dy, &s);
    opf_ctx_alloc_stats(p->ca, &s1);
    if (eager_peak) *eager_peak = s1.bytes_peak - s0.bytes_live;
    cu_compiled_step(p, NULL, c, call, &x, &dy, &s);
    cu_check_step(what, p, &s);
    cu_step_release(&s);
    cu_pair_optim_step(p);
    CHECK(cu_params_differ(p->a, p->b) == 0, "%s: parameters differ after the optimizer step", what);
    opf_tensor_release(&x), opf_tensor_release(&dy);
}

static void test_no_alloc(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64, f = 128;
    char what[64];
    snprintf(what, sizeof what, "no-alloc %s %s", opf_recipe_name(kind), opf_dtype_name(dt));
    cu_pair p;
    if (!cu_pair_build(&p, 23, cu_ln_gelu_mlp, dt, h, f)) return;
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
    opf_compiled *c = NULL;
    bool sgd = cu_pair_sgd(&p, 0.01f, 0.9f);
    CHECK_OK(p.cb, opf_compiled_create(p.b, NULL, &c));
    if (!sgd || !c) goto out;
    train_step(&p, c, &call, m, h, dt, NULL, what);  /* warm-up: compiles */
    size_t eager_peak = 0;
    opf_alloc_stats before, after;
    opf_ctx_alloc_stats(p.cb, &before);
    for (int step = 0; step < 5; step++) train_step(&p, c, &call, m, h, dt, &eager_peak, what);
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
    cu_pair_close(&p);
}

/* ---- the gradient buffer ----------------------------------------------------------------
 * A step that starts fresh writes the parameter gradients in place; the
 * first that adds into them allocates the graph's gradient buffer. Refused
 * there (no memory), the backward says so and changes no gradient; a
 * retry adds as eagerly. */
static void test_grad_buffer(void)
{
    const int64_t m = 32, h = 64, f = 128;
    const char *what = "gradient buffer";
    cu_pair p;
    if (!cu_pair_build(&p, 29, cu_ln_gelu_mlp, OPF_F32, h, f)) return;
    opf_seq_call call = opf_seq_call_default();
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, OPF_F32);
    opf_graph *g = NULL;
    if (!cu_compile(p.cb, what, p.b, &xs, &call, NULL, &g)) goto out;
    opf_seq_zero_grad(p.a), opf_seq_zero_grad(p.b);
    for (int step = 0; step < 2; step++) {
        opf_tensor x = cu_rand2(p.ca, m, h, OPF_F32, 1.0f), dy = cu_rand2(p.ca, m, h, OPF_F32, 1.0f);
        cu_step s;
        memset(&s, 0, sizeof s);
        if (step == 1) {  /* adds: the buffer's allocation refused, then retried */
            opf_tensor y, dx;
            CHECK_OK(p.cb, opf_graph_forward(g, &x, &call, &y, NULL));
            opf_ctx_fail_alloc(p.cb, 1);
            opf_status st = opf_graph_backward(g, &dy, NULL, &dx, NULL);
            opf_ctx_fail_alloc(p.cb, 0);
            CHECK(st == OPF_ERR_NO_MEMORY && strstr(opf_last_error(p.cb), "gradient buffer"),
                  "%s: refused backward: %s \"%s\"", what, opf_status_str(st), opf_last_error(p.cb));
            CHECK(cu_grads_differ(p.a, p.b) == 0, "%s: the refused backward changed gradients", what);
            opf_clear_error(p.cb);
        }
        cu_eager_step(&p, &call, &x, &dy, &s);
        cu_compiled_step(&p, g, NULL, &call, &x, &dy, &s);
        cu_check_step(what, &p, &s);
        cu_step_release(&s);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
out:
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

/* ---- 11. forward-only compile ---------------------------------------------------------- */

static void test_inference(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64, f = 128;
    char what[64];
    snprintf(what, sizeof what, "inference %s %s", opf_recipe_name(kind), opf_dtype_name(dt));
    cu_pair p;
    if (!cu_pair_build(&p, 23, cu_ln_gelu_mlp, dt, h, f)) return;
    opf_recipe r;
    opf_seq_call train = cu_call(kind, &r), infer = train;
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
        opf_tensor x = cu_rand2(p.ca, m, h, dt, 1.0f), ya = {0}, yb = {0}, dx;
        CHECK_OK(p.ca, opf_seq_forward(p.a, &x, &infer, &ya, NULL));
        CHECK_OK(p.cb, opf_graph_forward(gi, &x, &infer, &yb, NULL));
        CHECK(ya.data[0] && opf_test_same_bytes(&ya, &yb), "%s step %d: y differs", what, step);
        opf_tensor dy = cu_rand2(p.ca, m, h, dt, 1.0f);
        CHECK_FAILS(p.cb, opf_graph_backward(gi, &dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward");
        opf_tensor_release(&ya), opf_tensor_release(&x), opf_tensor_release(&dy);
    }
    opf_ctx_alloc_stats(p.cb, &after);
    CHECK(after.n_alloc == before.n_alloc, "%s: inference steps allocated %llu times", what,
          (unsigned long long)(after.n_alloc - before.n_alloc));
out:
    opf_graph_destroy(gt), opf_graph_destroy(gi);
    cu_pair_close(&p);
}

/* make_extra_output hands its input on (forward_is_input): first in the seq,
 * its input is the graph's x, which a node copies, so y and the extra output
 * are the graph's own memory with the right bytes, in a training and in a
 * forward-only graph; after a linear it leaves no node and both outputs are
 * the linear's value. Against the eager seq, whose outputs are counted
 * references (to x itself where x's buffer is counted). */
static opf_seq *build_handed_on(opf_ctx *ctx, bool first, int64_t h)
{
    opf_seq *seq = NULL;
    opf_op *mk = NULL;
    opf_ctx_set_rng(ctx, 41, 0);
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    if (!first) CHECK_OK(ctx, opf_seq_append_linear(seq, h, h, false, OPF_F32, "in"));
    CHECK_OK(ctx, opf_op_create(ctx, "make_extra_output", NULL, "mk", &mk));
    CHECK_OK(ctx, opf_seq_append(seq, mk));
    CHECK_OK(ctx, opf_seq_append_linear(seq, h, h, false, OPF_F32, "out"));
    return seq;
}

static void test_handed_on(bool first, bool training)
{
    const int64_t m = 16, h = 32;
    char what[64];
    snprintf(what, sizeof what, "handed on (%s, %s)", first ? "first op" : "after a linear",
             training ? "training" : "forward only");
    opf_ctx *ca = NULL, *cb = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ca));
    CHECK_OK(NULL, opf_ctx_create(NULL, &cb));
    opf_seq *a = build_handed_on(ca, first, h), *b = build_handed_on(cb, first, h);
    opf_seq_call call = opf_seq_call_default();
    call.requires_grad = call.input_requires_grad = training;
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, OPF_F32);
    opf_graph *g = NULL;
    CHECK_OK(cb, opf_compile(b, &xs, &call, NULL, &g));
    int mk_nodes = 0;
    for (int i = 0; g && i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info in;
        CHECK_OK(cb, opf_graph_node(g, i, &in));
        mk_nodes += in.class_name && !strcmp(in.class_name, "make_extra_output") && !in.backward;
    }
    CHECK(mk_nodes == (first ? 1 : 0), "%s: %d forward make_extra_output nodes", what, mk_nodes);
    for (int step = 0; g && step < 2; step++) {
        opf_tensor x = cu_rand2(ca, m, h, OPF_F32, 1.0f), ya = {0}, ea = {0}, yb = {0}, eb = {0};
        CHECK_OK(ca, opf_seq_forward(a, &x, &call, &ya, &ea));
        CHECK_OK(cb, opf_graph_forward(g, &x, &call, &yb, &eb));
        CHECK(yb.data[0] && eb.data[0] && opf_test_same_bytes(&ya, &yb) &&
              opf_test_same_bytes(&ea, &eb), "%s step %d: y or the extra output differs", what, step);
        CHECK(eb.data[0] != x.data[0], "%s step %d: the graph's extra output is the caller's x", what,
              step);
        if (first) CHECK(ea.data[0] == x.data[0], "%s step %d: eager did not hand x on", what, step);
        if (training) {
            opf_tensor dy = cu_rand2(ca, m, h, OPF_F32, 1.0f), de = cu_rand2(ca, m, h, OPF_F32, 1.0f);
            opf_tensor dxa = {0}, dxb = {0};
            CHECK_OK(ca, opf_seq_backward(a, &dy, &de, &dxa, NULL));
            CHECK_OK(cb, opf_graph_backward(g, &dy, &de, &dxb, NULL));
            CHECK(dxb.data[0] && opf_test_same_bytes(&dxa, &dxb), "%s step %d: dx differs", what, step);
            opf_tensor_release(&dxa), opf_tensor_release(&dy), opf_tensor_release(&de);
        }
        opf_tensor_release(&ya), opf_tensor_release(&ea), opf_tensor_release(&x);
    }
    opf_graph_destroy(g);
    opf_seq_destroy(a), opf_seq_destroy(b);
    opf_ctx_destroy(ca), opf_ctx_destroy(cb);
}

/* ---- 12. memory the graph does not own ------------------------------------------------ */

static uint64_t params_checksum(opf_seq *seq)
{
    uint64_t h = 0;
    for (int i = 0; i < opf_seq_len(seq); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, i)); p++)
            h = h * 31 + cu_checksum(&opf_op_param_const(opf_seq_at(seq, i), p)->value);
    return h;
}

/* identity -> gelu -> bias -> add_extra_input (in place) -> layernorm -> fc1 (+bias)
 * -> [no-fake user op] -> fc2 (+bias) */
static opf_seq *build_inplace(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    cu_append(ctx, seq, "identity", NULL, "id");
    cu_append(ctx, seq, "gelu", NULL, "gelu0");
    opf_bias_config bc = {h, dt};
    cu_append(ctx, seq, "bias", &bc, "b0");
    opf_inplace_config ip = {.in_place = true};
    cu_append(ctx, seq, "add_extra_input", &ip, "res");
    opf_layernorm_config ln = {.hidden = h, .eps = 1e-5, .dtype = dt};
    cu_append(ctx, seq, "layernorm", &ln, "ln");
    CHECK_OK(ctx, opf_seq_append_linear(seq, h, f, true, dt, "fc1"));
    cu_append(ctx, seq, CU_NOFAKE, NULL, "user");  /* eager node: no fakes */
    CHECK_OK(ctx, opf_seq_append_linear(seq, f, h, true, dt, "fc2"));
    /* the bias starts at zero: give it values */
    opf_param *pb = opf_op_param(opf_seq_at(seq, 2), 0);
    for (int64_t i = 0; i < h; i++) ((float *)pb->value.data[0])[i] = 0.01f * (float)(i % 17) - 0.08f;
    return seq;
}

/* identity -> grouped_linear -> gelu -> grouped_linear (split sizes: extra inputs) */
static opf_seq *build_grouped(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    cu_append(ctx, seq, "identity", NULL, "id");
    opf_grouped_linear_config c1 = {.groups = 2, .in_features = h, .out_features = f, .dtype = dt};
    opf_grouped_linear_config c2 = {.groups = 2, .in_features = f, .out_features = h, .dtype = dt};
    cu_append(ctx, seq, "grouped_linear", &c1, "g1");
    cu_append(ctx, seq, "gelu", NULL, "gelu");
    cu_append(ctx, seq, "grouped_linear", &c2, "g2");
    return seq;
}

static void test_untouched(cu_build_fn build, const char *name, opf_recipe_kind kind, int want_eager)
{
    const int64_t m = 64, h = 64, f = 128;
    char what[80];
    snprintf(what, sizeof what, "untouched %s %s", name, opf_recipe_name(kind));
    cu_pair p;
    if (!cu_pair_build(&p, 5, build, OPF_F32, h, f)) return;  /* f32: build_inplace writes floats */
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
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
        ext[0] = cu_rand2(p.ca, m, h, OPF_F32, 1.0f);
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
        char tag[128];
        snprintf(tag, sizeof tag, "%s step %d", what, step);
        opf_tensor x = cu_rand2(p.ca, m, h, OPF_F32, 1.0f), dy = cu_rand2(p.ca, m, h, OPF_F32, 1.0f);
        for (int i = 0; grouped && i < 2; i++) {  /* new split sizes: the eager nodes read them */
            ((int64_t *)ext[i].data[0])[0] = 8 * (step + 1 + i);
            ((int64_t *)ext[i].data[0])[1] = m - 8 * (step + 1 + i);
        }
        uint64_t cx = cu_checksum(&x), cdy = cu_checksum(&dy);
        uint64_t ce0 = cu_checksum(&ext[0]), ce1 = cu_checksum(&ext[1]);
        uint64_t cpa = params_checksum(p.a), cpb = params_checksum(p.b);
        CHECK(cpa == cpb, "%s: identical parameters", tag);
        cu_step s;
        memset(&s, 0, sizeof s);
        opf_seq_zero_grad(p.a);
        opf_seq_zero_grad(p.b);
        cu_eager_step(&p, &call, &x, &dy, &s);
        CHECK_OK(p.cb, opf_graph_forward(g, &x, &call, &s.yb, NULL));
        CHECK(cu_checksum(&x) == cx && cu_checksum(&ext[0]) == ce0 && cu_checksum(&ext[1]) == ce1,
              "%s: the forward wrote the caller's input", tag);
        CHECK_OK(p.cb, opf_graph_backward(g, &dy, NULL, &s.dxb, s.deb));
        CHECK(cu_checksum(&x) == cx, "%s: x changed", tag);
        CHECK(cu_checksum(&dy) == cdy, "%s: dy changed", tag);
        CHECK(cu_checksum(&ext[0]) == ce0 && cu_checksum(&ext[1]) == ce1, "%s: an extra input changed", tag);
        CHECK(params_checksum(p.b) == cpb, "%s: parameter values changed", tag);
        CHECK(params_checksum(p.a) == cpa, "%s: eager changed parameter values", tag);
        cu_check_step(tag, &p, &s);  /* y, dx, parameter gradients */
        if (!grouped)
            CHECK(s.dea[0].data[0] && opf_test_same_bytes(&s.dea[0], &s.deb[0]), "%s: d(residual) differs", tag);
        cu_step_release(&s);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
out:
    opf_graph_destroy(g);
    opf_tensor_release(&ext[0]), opf_tensor_release(&ext[1]);
    cu_pair_close(&p);
}

int main(void)
{
    cu_rng = 0x3E3035EEDull;
    CHECK(opf_op_class_register(&cu_nofake_class) == OPF_OK, "register: %s", opf_last_error(NULL));
    const struct { opf_recipe_kind k; opf_dtype dt; } cases[] = {
        {OPF_RECIPE_NONE, OPF_F32}, {OPF_RECIPE_NONE, OPF_BF16}, {OPF_RECIPE_CURRENT, OPF_F32},
        {OPF_RECIPE_CURRENT, OPF_BF16}, {OPF_RECIPE_MXFP8, OPF_BF16}};
    for (int i = 0; i < 5; i++) test_no_alloc(cases[i].k, cases[i].dt);
    for (int i = 0; i < 5; i++) test_inference(cases[i].k, cases[i].dt);
    for (int k = 0; k < 4; k++) test_handed_on(k & 1, k & 2);
    test_grad_buffer();
    /* eager nodes: the user op's forward and backward; both grouped linears' */
    test_untouched(build_inplace, "in-place + no-fake op", OPF_RECIPE_NONE, 2);
    test_untouched(build_inplace, "in-place + no-fake op", OPF_RECIPE_CURRENT, 2);
    test_untouched(build_grouped, "grouped_linear", OPF_RECIPE_NONE, 4);
    test_untouched(build_grouped, "grouped_linear", OPF_RECIPE_CURRENT, 4);
    TEST_DONE();
}
