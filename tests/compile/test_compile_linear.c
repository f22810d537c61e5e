/* test_compile_linear.c: Linear under compile the way its users run it,
 * against eager, bit for bit:
 *  - the is_first_microbatch schedule with quantized weights (FP8 current
 *    and delayed, FP8 block, MXFP8, NVFP4): the weight is quantized into
 *    the parameter's cache on microbatch 0 and reused on microbatches 1..3,
 *    an optimizer step after each batch; values 1 and 0 run in one graph
 *    (a runtime kwarg), so nothing recompiles across microbatches and
 *    steps; -1 is a graph of its own;
 *  - an FP8 output feeding the next linear (current and delayed scaling):
 *    the first linear's output in the graph is per-tensor FP8.
 * Eager and compiled run on two contexts of the same seed (identical
 * parameters), with fresh random inputs. */
#include "compile/compile-impl.h"  /* to look at a node's output spec */
#include "compile_util.h"

/* The weight caches (qvalue) of every basic_linear of a and b: same bytes. */
static int caches_differ(opf_seq *a, opf_seq *b, int *n_cached)
{
    int bad = 0;
    for (int i = 0; i < opf_seq_len(a); i++) {
        if (strcmp(opf_op_class_of(opf_seq_at(a, i))->name, "basic_linear")) continue;
        const opf_param *pa = opf_op_param_const(opf_seq_at(a, i), 0);
        const opf_param *pb = opf_op_param_const(opf_seq_at(b, i), 0);
        bool ha = pa->qvalue.data[0] != NULL, hb = pb->qvalue.data[0] != NULL;
        *n_cached += ha && hb;
        bad += ha != hb || (ha && !opf_test_same_bytes(&pa->qvalue, &pb->qvalue));
    }
    return bad;
}

/* fc1 (+bias) -> gelu -> fc2 (+bias): basic_linear at 0 and 3 */
static opf_seq *mlp(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, h, f, true, dt, "fc1"));
    cu_append(ctx, seq, "gelu", NULL, "gelu");
    CHECK_OK(ctx, opf_seq_append_linear(seq, f, h, true, dt, "fc2"));
    return seq;
}

/* fc1 -> fc2, no biases */
static opf_seq *two_linears(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, h, f, false, dt, "fc1"));
    CHECK_OK(ctx, opf_seq_append_linear(seq, f, h, false, dt, "fc2"));
    return seq;
}

/* ---- the is_first_microbatch schedule -------------------------------------------- */

static void test_microbatches(opf_recipe_kind kind, opf_dtype dt, int64_t m, int64_t h, int64_t f)
{
    char what[64];
    snprintf(what, sizeof what, "microbatches %s %s", opf_recipe_name(kind), opf_dtype_name(dt));
    cu_pair p;
    if (!cu_pair_build(&p, 31, mlp, dt, h, f)) return;
    CHECK(opf_seq_len(p.a) == 5, "fc1, fc1.bias, gelu, fc2, fc2.bias");
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
    if (kind == OPF_RECIPE_NVFP4) r.nvfp4_stochastic = false;
    if (kind == OPF_RECIPE_DELAYED) r.amax_history_len = 4;
    opf_basic_linear_kwargs kw = {0};
    const void *kwv[5] = {&kw, NULL, NULL, &kw, NULL};
    call.kwargs = kwv;
    opf_compiled *c = NULL;
    bool sgd = cu_pair_sgd(&p, 0.02f, 0.0f);
    CHECK_OK(p.cb, opf_compiled_create(p.b, NULL, &c));
    if (!sgd || !c) goto out;
    for (int step = 0; step < 3; step++) {
        opf_seq_zero_grad(p.a);
        opf_seq_zero_grad(p.b);
        for (int mb = 0; mb < 4; mb++) {
            kw.is_first_microbatch = mb == 0;
            char tag[96];
            snprintf(tag, sizeof tag, "%s step %d mb %d", what, step, mb);
            opf_tensor x = cu_rand2(p.ca, m, h, dt, 1.0f), dy = cu_rand2(p.ca, m, h, dt, 0.5f);
            cu_step s;
            memset(&s, 0, sizeof s);
            cu_eager_step(&p, &call, &x, &dy, &s);
            cu_compiled_step(&p, NULL, c, &call, &x, &dy, &s);
            cu_check_step(tag, &p, &s);  /* y, dx, the gradients accumulated so far */
            int n_cached = 0, bad = caches_differ(p.a, p.b, &n_cached);
            CHECK(bad == 0 && n_cached == 2, "%s: weight caches (%d cached, %d differ)", tag, n_cached, bad);
            cu_step_release(&s);
            opf_tensor_release(&x), opf_tensor_release(&dy);
        }
        int bad = cu_grads_differ(p.a, p.b);
        CHECK(bad == 0, "%s step %d: %d accumulated gradients differ", what, step, bad);
        cu_pair_optim_step(&p);
        CHECK(cu_params_differ(p.a, p.b) == 0, "%s step %d: parameters differ after the step", what, step);
        /* is_first_microbatch is a runtime kwarg (OPF_FIELD_RUNTIME): 1 and 0
         * run in one graph, nothing recompiles across microbatches and steps */
        CHECK(opf_compiled_recompiles(c) == 0, "%s after step %d: %d recompiles", what, step,
              opf_compiled_recompiles(c));
    }
    CHECK(opf_compiled_num_graphs(c) == 1, "%s: %d graphs", what, opf_compiled_num_graphs(c));
    /* -1 (no cache) traces differently: its own graph, matching eager */
    kw.is_first_microbatch = -1;
    for (int i = 0; i < 2; i++) {
        char tag[96];
        snprintf(tag, sizeof tag, "%s, -1 call %d", what, i);
        cu_compare_step(&p, NULL, c, &call, m, h, dt, 0.5f, tag);
    }
    CHECK(opf_compiled_recompiles(c) == 1 && opf_compiled_num_graphs(c) == 2,
          "%s: is_first_microbatch -1 compiled once (%d recompiles, %d graphs)", what,
          opf_compiled_recompiles(c), opf_compiled_num_graphs(c));
    /* last, since it leaves eager and compiled apart: 0 right after an
     * optimizer step. Eager refuses the stale cache; the graph does not
     * check it and reads the cache as the last 1 left it (docs/compile.md,
     * "is_first_microbatch") */
    kw.is_first_microbatch = 0;
    {
        opf_tensor x = cu_rand2(p.ca, m, h, dt, 1.0f), dy = cu_rand2(p.ca, m, h, dt, 0.5f);
        opf_tensor ya = {0}, yb = {0}, dxb = {0};
        CHECK_FAILS(p.ca, opf_seq_forward(p.a, &x, &call, &ya, NULL), OPF_ERR_STATE, "fc1",
                    "is_first_microbatch=0");
        CHECK_OK(p.cb, opf_compiled_forward(c, &x, &call, &yb, NULL));
        CHECK_OK(p.cb, opf_compiled_backward(c, &dy, NULL, &dxb, NULL));
        CHECK(opf_compiled_recompiles(c) == 1, "%s: the stale-cache call recompiled", what);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
out:
    opf_compiled_destroy(c);
    cu_pair_close(&p);
}

/* ---- FP8 output feeding the next op ------------------------------------------------- */

static void test_fp8_output(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64, f = 128;
    char what[64];
    snprintf(what, sizeof what, "fp8 output %s %s", opf_recipe_name(kind), opf_dtype_name(dt));
    cu_pair p;
    if (!cu_pair_build(&p, 37, two_linears, dt, h, f)) return;
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
    if (kind == OPF_RECIPE_DELAYED) r.amax_history_len = 8;
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, dt);
    opf_graph *g = NULL;
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &call, NULL, &g));
    if (!g) goto out;
    /* the forward node of fc1 writes a per-tensor FP8 value */
    int found = 0;
    for (int i = 0; i < g->n_fwd; i++) {
        const opf_gnode *n = &g->nodes[i];
        if (!n->op || strcmp(opf_op_name(n->op), "fc1")) continue;
        found++;
        CHECK(n->kind == OPF_NODE_FORWARD && n->t[0].spec.scaling == OPF_SCALING_TENSOR,
              "%s: fc1's output is %s (kind %s)", what, opf_scaling_name(n->t[0].spec.scaling),
              opf_node_kind_name(n->kind));
    }
    CHECK(found == 1, "%s: one forward node of fc1 (%d)", what, found);
    for (int step = 0; step < 3; step++) {
        char tag[96];
        snprintf(tag, sizeof tag, "%s step %d", what, step);
        cu_compare_step(&p, g, NULL, &call, m, h, dt, 0.5f, tag);
    }
out:
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

int main(void)
{
    cu_rng = 0x714EA25EEDull;
    test_microbatches(OPF_RECIPE_CURRENT, OPF_BF16, 64, 64, 128);
    test_microbatches(OPF_RECIPE_CURRENT, OPF_F32, 64, 64, 128);
    test_microbatches(OPF_RECIPE_DELAYED, OPF_BF16, 64, 64, 128);
    test_microbatches(OPF_RECIPE_BLOCK, OPF_BF16, 128, 128, 256);
    test_microbatches(OPF_RECIPE_MXFP8, OPF_BF16, 64, 64, 128);
    test_microbatches(OPF_RECIPE_NVFP4, OPF_BF16, 64, 64, 128);
    test_fp8_output(OPF_RECIPE_CURRENT, OPF_BF16);
    test_fp8_output(OPF_RECIPE_CURRENT, OPF_F32);
    test_fp8_output(OPF_RECIPE_DELAYED, OPF_BF16);
    TEST_DONE();
}
