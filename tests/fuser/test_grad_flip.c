/* test_grad_flip.c: the plan cache survives grad-mode flips. Running one
 * seq with and without gradients, as activation recompute does, reuses the
 * plans and fused ops of each mode: after one call in each mode, ten flips
 * run no fusion function, keep the same fused ops, and allocate through the
 * context exactly what a warm call of their mode did. A registry change
 * or a new recipe still rebuilds. */
#include "test.h"

static int fusion_calls;

/* A forward fusion that fuses nothing and counts its calls. */
static opf_status count_fusion(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r,
                               void *user, opf_op **out, int *n_out)
{
    fusion_calls++;
    memcpy(out, in, sizeof *out * (size_t)n);
    *n_out = n;
    return OPF_OK;
}

static opf_op *mk(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

/* fc1 + bias, gelu, fc2 + bias: the forward plan fuses each linear with
 * its bias (and the first with the gelu). */
static opf_seq *build(opf_ctx *ctx)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_basic_linear_config l1 = {32, 64, OPF_F32, false}, l2 = {64, 32, OPF_F32, false};
    opf_bias_config b1 = {64, OPF_F32}, b2 = {32, OPF_F32};
    opf_op *ops[] = {mk(ctx, "basic_linear", &l1, "fc1"), mk(ctx, "bias", &b1, "fc1.bias"),
                     mk(ctx, "gelu", NULL, "gelu"), mk(ctx, "basic_linear", &l2, "fc2"),
                     mk(ctx, "bias", &b2, "fc2.bias")};
    for (int i = 0; i < 5; i++) CHECK_OK(ctx, opf_seq_append(seq, ops[i]));
    return seq;
}

/* One call in a grad mode (with its backward when training); returns the
 * context allocations it made and writes the forward plan's first op. */
static uint64_t step(opf_ctx *ctx, opf_seq *seq, opf_seq_call *call, bool grad, const opf_tensor *x,
                     opf_op **first_op)
{
    opf_alloc_stats a, b;
    opf_ctx_alloc_stats(ctx, &a);
    call->requires_grad = grad;
    opf_tensor y, dx;
    CHECK_OK(ctx, opf_seq_forward(seq, x, call, &y, NULL));
    if (grad) {
        CHECK_OK(ctx, opf_seq_backward(seq, &y, NULL, &dx, NULL));
        opf_tensor_release(&dx);
    }
    opf_tensor_release(&y);
    opf_ctx_alloc_stats(ctx, &b);
    opf_plan_entry e[5];
    CHECK(opf_seq_plan(seq, 0, false, e, 5) >= 1, "plan");
    *first_op = e[0].op;
    return b.n_alloc - a.n_alloc;
}

static void test_flips(opf_ctx *ctx, const opf_recipe *r)
{
    opf_seq *seq = build(ctx);
    float xs[8 * 32];
    for (int i = 0; i < 8 * 32; i++) xs[i] = 0.01f * (float)(i % 13) - 0.06f;
    opf_tensor x;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {8, 32}, .dtype = OPF_F32}, xs, &x);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r;
    opf_op *op_grad, *op_inf, *op;
    uint64_t alloc_grad = 0, alloc_inf = 0;
    int calls = fusion_calls;
    for (int warm = 0; warm < 2; warm++) {  /* the first calls also grow the scratch */
        alloc_grad = step(ctx, seq, &call, true, &x, &op_grad);
        alloc_inf = step(ctx, seq, &call, false, &x, &op_inf);
    }
    CHECK(fusion_calls == calls + 2, "one plan per mode: %d fusion calls", fusion_calls - calls);
    CHECK(opf_op_is_fused(op_grad) && opf_op_is_fused(op_inf), "fc1 + bias (+ gelu) fused");
    calls = fusion_calls;
    for (int flip = 0; flip < 10; flip++) {
        bool grad = flip % 2 == 0;
        uint64_t n = step(ctx, seq, &call, grad, &x, &op);
        CHECK(n == (grad ? alloc_grad : alloc_inf), "flip %d (%s): %llu allocations, the first call of "
              "the mode made %llu", flip, grad ? "grad" : "no grad", (unsigned long long)n,
              (unsigned long long)(grad ? alloc_grad : alloc_inf));
        CHECK(op == (grad ? op_grad : op_inf), "flip %d: the fused op was made again", flip);
    }
    CHECK(fusion_calls == calls, "ten flips ran the fusion functions %d times", fusion_calls - calls);
    /* a registry change rebuilds the next plans it meets */
    CHECK_OK(NULL, opf_register_backward_fusion("grad_flip_noop", count_fusion, NULL, false));
    step(ctx, seq, &call, true, &x, &op);
    CHECK(fusion_calls > calls, "a new fusion took effect");
    CHECK_OK(NULL, opf_unregister_fusion("grad_flip_noop"));
    opf_seq_destroy(seq);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    CHECK_OK(NULL, opf_register_forward_fusion("count_calls", count_fusion, NULL, false));
    opf_recipe cur = opf_recipe_default(OPF_RECIPE_CURRENT);
    test_flips(ctx, NULL);
    test_flips(ctx, &cur);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
