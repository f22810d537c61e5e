/* test_compile_recipe_state.c: recipe state that lives across steps, eager
 * and compiled.
 *
 *  - The custom recipe with a delayed-scaling role: a factory that asks for
 *    delayed scaling for the linears' input and weight and gives current
 *    scaling (E5M2) for their grad_output trains a LayerNorm-MLP in a seq
 *    and, from the same start, in a compiled graph: y, dx, gradients,
 *    parameters and the delayed states equal bit for bit after every step,
 *    the amax updates are graph nodes, and the scales moved.
 *  - Compiling after eager warm-up under delayed scaling: both sides train
 *    eagerly, then one compiles (a graph, or the guarded cache) and goes on
 *    compiled; its state is carried over (equal right after the compile) and
 *    every later step equals staying eager. */
#include "compile/compile_util.h"

enum { M = 32, H = 64, F = 128, HIST = 4 };

/* ---- the custom recipe --------------------------------------------------------------- */

static int factory_calls;

static opf_status mixed_factory(void *user, const opf_quantizer_role *role, opf_quantizer_request *out)
{
    factory_calls++;
    bool linear = role->module_type && !strcmp(role->module_type, "linear");
    if (linear && (role->tensor == OPF_ROLE_INPUT || role->tensor == OPF_ROLE_WEIGHT)) {
        out->delayed = true;
        out->format = OPF_FORMAT_E4M3;
        out->amax_history_len = HIST;
        out->amax_algo = OPF_AMAX_MAX;
        return OPF_OK;
    }
    if (linear && role->tensor == OPF_ROLE_GRAD_OUTPUT) {
        opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);  /* HYBRID: E5M2 gradients */
        return opf_recipe_quantizer(&cur, role, &out->quantizer);
    }
    out->quantizer = opf_quantizer_default();  /* everything else unquantized */
    return OPF_OK;
}

/* One step of both sides on fresh inputs (growing, so histories roll); the
 * compiled side through g or c, or eagerly when both are NULL. Returns the
 * mismatches (y, dx, grads, params, delayed states). */
static int pair_step(cu_pair *p, opf_graph *g, opf_compiled *c, const opf_seq_call *call, int step,
                     int *n_states)
{
    float sigma = 0.5f + 0.25f * (float)step;
    opf_tensor x = cu_rand2(p->ca, M, H, OPF_BF16, sigma), dy = cu_rand2(p->ca, M, H, OPF_BF16, 0.1f * sigma);
    cu_step s;
    memset(&s, 0, sizeof s);
    opf_seq_zero_grad(p->a);
    opf_seq_zero_grad(p->b);
    cu_eager_step(p, call, &x, &dy, &s);
    if (g || c) {
        cu_compiled_step(p, g, c, call, &x, &dy, &s);
    } else {
        CHECK_OK(p->cb, opf_seq_forward(p->b, &x, call, &s.yb, NULL));
        CHECK_OK(p->cb, opf_seq_backward(p->b, &dy, NULL, &s.dxb, s.deb));
    }
    cu_pair_optim_step(p);
    *n_states = 0;
    int bad = cu_delayed_differ(p->a, p->b, n_states);
    bad += !opf_test_same_bytes(&s.ya, &s.yb) + !opf_test_same_bytes(&s.dxa, &s.dxb);
    bad += cu_grads_differ(p->a, p->b) + cu_params_differ(p->a, p->b);
    if (!g && !c) opf_tensor_release(&s.yb), opf_tensor_release(&s.dxb);
    cu_step_release(&s);
    opf_tensor_release(&x), opf_tensor_release(&dy);
    return bad;
}

static int count_nodes(opf_graph *g, opf_node_kind kind)
{
    int n = 0;
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info ni;
        opf_graph_node(g, i, &ni);
        n += ni.kind == kind;
    }
    return n;
}

/* Some scale of op i's forward delayed state is not 1. */
static bool scales_moved(opf_seq *seq, int i)
{
    opf_recipe_state *rs = opf_op_recipe_state(opf_seq_at(seq, i));
    opf_delayed_state *ds = rs ? opf_recipe_state_delayed(rs, false) : NULL;
    bool moved = false;
    for (int k = 0; ds && k < opf_delayed_state_slots(ds); k++) moved |= opf_delayed_state_scale(ds)[k] != 1.0f;
    return moved;
}

static void test_custom_delayed(void)
{
    cu_pair p;
    if (!cu_pair_build(&p, 21, cu_ln_gelu_mlp, OPF_BF16, H, F) || !cu_pair_sgd(&p, 0.05f, 0)) {
        cu_pair_close(&p);
        return;
    }
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CUSTOM);
    r.factory = mixed_factory;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &r;
    opf_spec xs = opf_spec_make(2, (int64_t[]){M, H}, OPF_BF16);
    opf_graph *g = NULL;
    if (cu_compile(p.cb, "custom delayed", p.b, &xs, &call, NULL, &g)) {
        CHECK(count_nodes(g, OPF_NODE_AMAX_UPDATE) >= 1, "custom delayed: no amax update node");
        int n_states = 0;
        for (int step = 0; step < 6; step++) {
            int bad = pair_step(&p, g, NULL, &call, step, &n_states);
            CHECK(bad == 0, "custom delayed step %d: %d mismatches (y, dx, grads, params, states)", step, bad);
        }
        /* two linears with a forward state each; their gradients use current scaling */
        CHECK(n_states == 2, "custom delayed: %d delayed states, want 2", n_states);
        CHECK(scales_moved(p.b, 1), "custom delayed: fc1's scales never moved");
        opf_quantizer q;
        const opf_quantizer *gq = opf_op_quantizer(opf_seq_at(p.b, 1), OPF_ROLE_GRAD_OUTPUT, 0);
        q = gq ? *gq : opf_quantizer_default();
        CHECK(q.scaling == OPF_SCALING_TENSOR && !q.delayed && q.qdtype == OPF_E5M2,
              "custom delayed: fc1's grad_output quantizer is not current-scaling E5M2");
    }
    CHECK(factory_calls > 0, "the factory was called");
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

/* Eager warm-up on both sides, then b compiled (graph or cache) from its
 * carried-over state. */
static void test_warmup(bool cached)
{
    const char *tag = cached ? "warm-up then opf_compiled" : "warm-up then opf_compile";
    cu_pair p;
    if (!cu_pair_build(&p, 23, cu_ln_gelu_mlp, OPF_BF16, H, F) || !cu_pair_sgd(&p, 0.05f, 0)) {
        cu_pair_close(&p);
        return;
    }
    opf_recipe r;
    opf_seq_call call = cu_call(OPF_RECIPE_DELAYED, &r);
    r.amax_history_len = HIST;
    int n_states = 0, step = 0;
    for (; step < 3; step++) {
        int bad = pair_step(&p, NULL, NULL, &call, step, &n_states);
        CHECK(bad == 0, "%s: eager step %d: %d mismatches", tag, step, bad);
    }
    CHECK(scales_moved(p.b, 1), "%s: the warm-up moved no scale", tag);
    opf_spec xs = opf_spec_make(2, (int64_t[]){M, H}, OPF_BF16);
    opf_graph *g = NULL;
    opf_compiled *c = NULL;
    bool ok = cached ? opf_compiled_create(p.b, NULL, &c) == OPF_OK : cu_compile(p.cb, tag, p.b, &xs, &call, NULL, &g);
    if (ok) {
        n_states = 0;  /* (the cache compiles at its first call: then this checks nothing yet) */
        int bad = cu_delayed_differ(p.a, p.b, &n_states);
        CHECK(bad == 0 && n_states == 4, "%s: the compile changed the state (%d, %d states)", tag, bad, n_states);
        for (; step < 7; step++) {
            bad = pair_step(&p, g, c, &call, step, &n_states);
            CHECK(bad == 0, "%s: compiled step %d: %d mismatches (y, dx, grads, params, states)", tag, step, bad);
        }
        if (c) CHECK(opf_compiled_recompiles(c) == 0, "%s: %d recompiles", tag, opf_compiled_recompiles(c));
    }
    opf_graph_destroy(g);
    opf_compiled_destroy(c);
    cu_pair_close(&p);
}

int main(void)
{
    test_custom_delayed();
    test_warmup(false);
    test_warmup(true);
    TEST_DONE();
}
