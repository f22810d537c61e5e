/* test_recipe_override.c: opf_op_set_recipe, one op of a seq under its own
 * recipe (a model's output layer kept unquantized under FP8):
 *  - fc1 -> bias -> gelu -> head with the head unquantized, under FP8
 *    current scaling and MXFP8: outputs and every gradient equal, bit for
 *    bit, the same layers run as two seqs (fc1 -> bias -> gelu under the
 *    recipe, head alone without one); the head holds no recipe state;
 *  - compiled equals eager bit for bit;
 *  - a head under another recipe than the call's gets that recipe's state;
 *  - no built-in fusion covers an op with an override;
 *  - refusals: after the seq is built, an invalid recipe. */
#include "test.h"

enum { T = 32, IN = 64, H = 128, OUT = 64 };

typedef struct model {
    opf_ctx *ctx;
    opf_seq *seq[2];  /* one seq, or body and head */
} model;

static float xs[T * IN], dys[T * OUT];

static void fill(opf_param *p, uint32_t seed)
{
    float *v = p->value.data[0];
    int64_t n = opf_spec_numel(&p->value.spec);
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        v[i] = ((float)(seed >> 8) / 16777216.0f - 0.5f) * 0.2f;
    }
}

static opf_op *append(model *m, int s, const char *cls, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(m->ctx, opf_op_create(m->ctx, cls, NULL, name, &op));
    CHECK_OK(m->ctx, opf_seq_append(m->seq[s], op));
    return op;
}

/* fc1 -> bias -> gelu -> head, in one seq (split false) or two; the head's
 * override (when head_r is not the call's) set before the first forward. */
static opf_op *build(model *m, bool split, bool own, const opf_recipe *head_r)
{
    CHECK_OK(NULL, opf_ctx_create(NULL, &m->ctx));
    m->seq[1] = NULL;
    for (int s = 0; s < 1 + split; s++) CHECK_OK(m->ctx, opf_seq_create(m->ctx, &m->seq[s]));
    CHECK_OK(m->ctx, opf_seq_append_linear(m->seq[0], IN, H, true, OPF_F32, "fc1"));
    append(m, 0, "gelu", "act");
    CHECK_OK(m->ctx, opf_seq_append_linear(m->seq[split], H, OUT, false, OPF_F32, "head"));
    fill(opf_op_param(opf_seq_at(m->seq[0], 0), 0), 1);
    fill(opf_op_param(opf_seq_at(m->seq[0], 1), 0), 2);
    opf_op *head = opf_seq_at(m->seq[split], split ? 0 : 3);
    fill(opf_op_param(head, 0), 3);
    if (own) CHECK_OK(m->ctx, opf_op_set_recipe(head, head_r));
    return head;
}

static void destroy(model *m)
{
    opf_seq_destroy(m->seq[0]);
    opf_seq_destroy(m->seq[1]);
    opf_ctx_destroy(m->ctx);
}

static opf_tensor wrap(float *p, int64_t rows, int64_t cols)
{
    opf_tensor t;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {rows, cols}, .dtype = OPF_F32}, p, &t);
    return t;
}

/* One forward and backward; y and the gradients of fc1, bias and head
 * (concatenated in g) are kept for comparison. */
typedef struct result {
    float y[T * OUT], g[H * IN + H + OUT * H];
} result;

static void keep_grads(model *m, result *r)
{
    size_t at = 0;
    for (int s = 0; s < 2 && m->seq[s]; s++)
        for (int i = 0; i < opf_seq_len(m->seq[s]); i++) {
            opf_op *op = opf_seq_at(m->seq[s], i);
            for (int p = 0; p < opf_op_num_params(op); p++) {
                const opf_param *q = opf_op_param(op, p);
                size_t n = (size_t)opf_spec_numel(&q->grad.spec);
                memcpy(r->g + at, q->grad.data[0], n * sizeof(float));
                at += n;
            }
        }
}

static void step_eager(model *m, const opf_recipe *r, result *out)
{
    opf_tensor x = wrap(xs, T, IN), dy = wrap(dys, T, OUT), h, y, dh, dx;
    opf_seq_call call = opf_seq_call_default(), plain = opf_seq_call_default();
    call.recipe = r;
    call.input_requires_grad = plain.input_requires_grad = false;
    if (!m->seq[1]) {
        CHECK_OK(m->ctx, opf_seq_forward(m->seq[0], &x, &call, &y, NULL));
        CHECK_OK(m->ctx, opf_seq_backward(m->seq[0], &dy, NULL, &dx, NULL));
    } else {
        plain.input_requires_grad = true;
        CHECK_OK(m->ctx, opf_seq_forward(m->seq[0], &x, &call, &h, NULL));
        CHECK_OK(m->ctx, opf_seq_forward(m->seq[1], &h, &plain, &y, NULL));
        CHECK_OK(m->ctx, opf_seq_backward(m->seq[1], &dy, NULL, &dh, NULL));
        CHECK_OK(m->ctx, opf_seq_backward(m->seq[0], &dh, NULL, &dx, NULL));
        opf_tensor_release(&h), opf_tensor_release(&dh);
    }
    memcpy(out->y, y.data[0], sizeof out->y);
    keep_grads(m, out);
    opf_tensor_release(&y), opf_tensor_release(&dx);
}

static void step_compiled(model *m, const opf_recipe *r, result *out)
{
    opf_tensor x = wrap(xs, T, IN), dy = wrap(dys, T, OUT), y, dx;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r;
    call.input_requires_grad = false;
    opf_compiled *cc = NULL;
    CHECK_OK(m->ctx, opf_compiled_create(m->seq[0], NULL, &cc));
    CHECK_OK(m->ctx, opf_compiled_forward(cc, &x, &call, &y, NULL));
    CHECK_OK(m->ctx, opf_compiled_backward(cc, &dy, NULL, &dx, NULL));
    memcpy(out->y, y.data[0], sizeof out->y);
    keep_grads(m, out);
    opf_tensor_release(&y), opf_tensor_release(&dx);
    opf_compiled_destroy(cc);
}

static void same(const result *a, const result *b, const char *what)
{
    CHECK(!memcmp(a->y, b->y, sizeof a->y), "%s: outputs differ", what);
    CHECK(!memcmp(a->g, b->g, sizeof a->g), "%s: gradients differ", what);
}

static result want, got;

/* The head unquantized: one seq (eager, compiled) against two. */
static void head_unquantized(opf_recipe_kind kind)
{
    opf_recipe r = opf_recipe_default(kind);
    const char *name = opf_recipe_name(kind);
    model a, b, c;
    opf_op *head = build(&a, false, true, NULL);
    build(&b, true, false, NULL);
    build(&c, false, true, NULL);
    step_eager(&a, &r, &got);
    step_eager(&b, &r, &want);
    printf("%s: head unquantized, one seq vs two\n", name);
    same(&got, &want, name);
    CHECK(opf_op_recipe_state(head) == NULL, "%s: the head holds recipe state", name);
    CHECK(opf_op_recipe_state(opf_seq_at(a.seq[0], 0)) != NULL, "%s: fc1 has no recipe state", name);
    const opf_recipe *own = &r;
    CHECK(opf_op_has_recipe(head, &own) && own == NULL, "%s: has_recipe", name);
    step_compiled(&c, &r, &got);
    printf("%s: compiled vs eager\n", name);
    same(&got, &want, name);
    destroy(&a), destroy(&b), destroy(&c);
}

/* Under FP8 current scaling a head under MXFP8 gets MXFP8 state, fc1
 * current-scaling state; once the seq is built the override stays. */
static void head_other_recipe(void)
{
    opf_recipe call = opf_recipe_default(OPF_RECIPE_CURRENT), mx = opf_recipe_default(OPF_RECIPE_MXFP8);
    model a;
    opf_op *head = build(&a, false, true, &mx);
    step_eager(&a, &call, &got);
    opf_recipe_state *rs = opf_op_recipe_state(head);
    CHECK(rs && opf_recipe_state_recipe(rs)->kind == OPF_RECIPE_MXFP8, "head: want MXFP8 state");
    rs = opf_op_recipe_state(opf_seq_at(a.seq[0], 0));
    CHECK(rs && opf_recipe_state_recipe(rs)->kind == OPF_RECIPE_CURRENT, "fc1: want current state");
    CHECK_FAILS(a.ctx, opf_op_set_recipe(head, NULL), OPF_ERR_STATE, "head", "built");
    CHECK_FAILS(a.ctx, opf_op_clear_recipe(head), OPF_ERR_STATE, "head", "built");
    destroy(&a);
}

/* fc1's linear under its own recipe: the linear + bias + gelu fusion
 * leaves it out, in both plans. */
static void no_fusion(void)
{
    model a;
    build(&a, false, false, NULL);
    opf_op *fc1 = opf_seq_at(a.seq[0], 0);
    CHECK_OK(a.ctx, opf_op_set_recipe(fc1, NULL));
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CURRENT);
    step_eager(&a, &r, &got);
    for (int bwd = 0; bwd < 2; bwd++) {
        opf_plan_entry e[8];
        int n = opf_seq_plan(a.seq[0], 0, bwd, e, 8);
        for (int i = 0; i < n; i++)
            CHECK(e[i].first > 0 || e[i].count == 1, "%s plan: entry %d covers fc1 and %d more ops",
                  bwd ? "backward" : "forward", i, e[i].count - 1);
    }
    destroy(&a);
}

static void refusals(void)
{
    model a;
    opf_op *head = build(&a, false, false, NULL);
    opf_recipe bad = opf_recipe_default(OPF_RECIPE_DELAYED);
    bad.amax_history_len = 0;
    CHECK_FAILS(NULL, opf_op_set_recipe(head, &bad), OPF_ERR_INVALID_ARG, "head");
    CHECK(!opf_op_has_recipe(head, NULL), "a refused recipe was kept");
    CHECK_OK(NULL, opf_op_set_recipe(head, NULL));
    CHECK_OK(NULL, opf_op_clear_recipe(head));
    CHECK(!opf_op_has_recipe(head, NULL), "cleared, still an override");
    CHECK_FAILS(NULL, opf_op_set_recipe(NULL, NULL), OPF_ERR_INVALID_ARG, "opf_op_set_recipe");
    destroy(&a);
}

int main(void)
{
    for (int i = 0; i < T * IN; i++) xs[i] = sinf(0.37f * (float)i);
    for (int i = 0; i < T * OUT; i++) dys[i] = 0.01f * cosf(0.11f * (float)i);
    head_unquantized(OPF_RECIPE_CURRENT);
    head_unquantized(OPF_RECIPE_MXFP8);
    head_unquantized(OPF_RECIPE_DELAYED);
    head_other_recipe();
    no_fusion();
    refusals();
    TEST_DONE();
}
