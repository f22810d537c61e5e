/* test_quantized_weights.c: a Linear whose weight lives only quantized
 * (opf_op_set_param_quantized), under FP8 current scaling and MXFP8, trains
 * with SGD: after each step the optimizer's fp32 master is the previous one
 * minus lr * grad and the parameter is that master quantized; a checkpoint
 * taken after step 1 and loaded into a fresh run resumes bit for bit. */
#include "test.h"

enum { T = 32, IN = 64, OUT = 32, STEPS = 3 };
static const float LR = 0.05f;

typedef struct run {
    opf_ctx   *ctx;
    opf_seq   *seq;
    opf_optim *opt;
    opf_recipe r;
} run;

static void open_run(run *R, opf_recipe_kind kind)
{
    CHECK_OK(NULL, opf_ctx_create(NULL, &R->ctx));
    opf_ctx_set_rng(R->ctx, 7, 0);
    CHECK_OK(R->ctx, opf_seq_create(R->ctx, &R->seq));
    CHECK_OK(R->ctx, opf_seq_append_linear(R->seq, IN, OUT, false, OPF_F32, "fc"));
    R->r = opf_recipe_default(kind);
    opf_quantizer q;
    CHECK_OK(NULL, opf_recipe_quantizer(&R->r, &(opf_quantizer_role){"linear", OPF_ROLE_WEIGHT, "fc"}, &q));
    CHECK_OK(R->ctx, opf_op_set_param_quantized(R->ctx, opf_seq_at(R->seq, 0), 0, &q));
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = LR;
    CHECK_OK(R->ctx, opf_optim_create(R->ctx, R->seq, OPF_OPTIM_SGD, &oo, &R->opt));
}

static void close_run(run *R)
{
    opf_optim_destroy(R->opt);
    opf_seq_destroy(R->seq);
    opf_ctx_destroy(R->ctx);
}

static float xs[STEPS][T * IN], dys[STEPS][T * OUT];

/* One step; checks the master and the parameter against their definitions
 * and returns the output's bytes in y. */
static void step(run *R, int s, const char *tag, float *y_out)
{
    opf_param *p = opf_op_param(opf_seq_at(R->seq, 0), 0);
    float *master;
    int64_t n;
    CHECK_OK(NULL, opf_optim_slot(R->opt, 0, NULL, &master, NULL, NULL, &n));
    CHECK(!p->value.data[0] && p->qvalue_valid, "%s: no plain value, a quantized one", tag);
    opf_tensor x, y, dy, dx;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {T, IN}, .dtype = OPF_F32}, xs[s], &x);
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {T, OUT}, .dtype = OPF_F32}, dys[s], &dy);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &R->r;
    opf_seq_zero_grad(R->seq);
    CHECK_OK(R->ctx, opf_seq_forward(R->seq, &x, &call, &y, NULL));
    CHECK_OK(R->ctx, opf_seq_backward(R->seq, &dy, NULL, &dx, NULL));
    memcpy(y_out, y.data[0], sizeof(float) * T * OUT);
    static float want[IN * OUT];
    for (int64_t i = 0; i < n; i++) want[i] = master[i] - LR * ((const float *)p->grad.data[0])[i];
    CHECK_OK(R->ctx, opf_optim_step(R->opt));
    CHECK(!memcmp(want, master, sizeof(float) * (size_t)n), "%s: master = master - lr * grad", tag);
    opf_tensor m, wq;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {OUT, IN}, .dtype = OPF_F32}, master, &m);
    CHECK_OK(R->ctx, opf_quantize_alloc(R->ctx, &p->primary_q, &m, &wq));
    CHECK(opf_test_same_bytes(&wq, &p->qvalue), "%s: the parameter is the master quantized", tag);
    opf_tensor_release(&wq);
    opf_tensor_release(&y);
    opf_tensor_release(&dx);
}

static void test_recipe(opf_recipe_kind kind)
{
    static float ya[STEPS][T * OUT], yb[STEPS][T * OUT];
    char tag[64], path[64];
    snprintf(path, sizeof path, "qweights_%s.ck", opf_recipe_name(kind));
    run A, B;
    open_run(&A, kind);
    for (int s = 0; s < STEPS; s++) {
        snprintf(tag, sizeof tag, "%s step %d", opf_recipe_name(kind), s);
        step(&A, s, tag, ya[s]);
        if (s == 0) CHECK_OK(A.ctx, opf_checkpoint_save(A.ctx, A.seq, A.opt, path));
    }
    open_run(&B, kind);
    CHECK_OK(B.ctx, opf_checkpoint_prepare(B.ctx, B.seq, &B.r));
    CHECK_OK(B.ctx, opf_checkpoint_load(B.ctx, B.seq, B.opt, path));
    for (int s = 1; s < STEPS; s++) {
        snprintf(tag, sizeof tag, "%s resumed step %d", opf_recipe_name(kind), s);
        step(&B, s, tag, yb[s]);
        CHECK(!memcmp(ya[s], yb[s], sizeof ya[s]), "%s: the output as without the round trip", tag);
    }
    const opf_param *pa = opf_op_param(opf_seq_at(A.seq, 0), 0);
    const opf_param *pb = opf_op_param(opf_seq_at(B.seq, 0), 0);
    CHECK(opf_test_same_bytes(&pa->qvalue, &pb->qvalue), "%s: the final weights agree",
          opf_recipe_name(kind));
    remove(path);
    close_run(&A);
    close_run(&B);
}

int main(void)
{
    uint32_t s = 12345;
    for (int k = 0; k < STEPS; k++) {
        for (int i = 0; i < T * IN; i++) xs[k][i] = (float)((s = s * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f;
        for (int i = 0; i < T * OUT; i++) dys[k][i] = (float)((s = s * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f;
    }
    test_recipe(OPF_RECIPE_CURRENT);
    test_recipe(OPF_RECIPE_MXFP8);
    TEST_DONE();
}
