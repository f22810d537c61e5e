/* test_quantized_weights.c: a Linear whose weight lives only quantized
 * (opf_op_set_param_quantized), under FP8 current scaling and MXFP8, trains
 * with SGD:
 *  - each output is the reference GEMM of the parameter and the input
 *    quantized, the parameter being the fp32 master quantized (from step 1;
 *    step 0 runs on the initial quantized value);
 *  - after each step the master is the previous one minus lr * grad and the
 *    parameter is that master quantized;
 *  - compiled (opf_compiled, the weight a graph input read as is) equals
 *    eager bit for bit: outputs, masters and parameters, one graph;
 *  - a checkpoint taken after step 0 and loaded into a fresh run resumes
 *    bit for bit. */
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
/* y = gemm(w, x quantized with the recipe's input quantizer), fp32 out. */
static void reference(run *R, const opf_tensor *w, const opf_tensor *x, const float *y, const char *tag)
{
    opf_quantizer qx;
    CHECK_OK(NULL, opf_recipe_quantizer(&R->r, &(opf_quantizer_role){"linear", OPF_ROLE_INPUT, "fc"}, &qx));
    opf_tensor xq, yr;
    CHECK_OK(R->ctx, opf_quantize_alloc(R->ctx, &qx, x, &xq));
    CHECK_OK(R->ctx, opf_tensor_alloc(R->ctx, &(opf_spec){.ndim = 2, .shape = {T, OUT}, .dtype = OPF_F32}, &yr));
    opf_gemm_options o = opf_gemm_options_default();
    CHECK_OK(R->ctx, opf_gemm(R->ctx, w, &xq, OPF_GEMM_TN, &o, &yr));
    CHECK(!memcmp(yr.data[0], y, sizeof(float) * T * OUT), "%s: y is the reference GEMM's", tag);
    opf_tensor_release(&xq);
    opf_tensor_release(&yr);
}

static void step(run *R, opf_compiled *c, int s, const char *tag, float *y_out)
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
    if (c) {
        CHECK_OK(R->ctx, opf_compiled_forward(c, &x, &call, &y, NULL));
        CHECK_OK(R->ctx, opf_compiled_backward(c, &dy, NULL, &dx, NULL));
    } else {
        CHECK_OK(R->ctx, opf_seq_forward(R->seq, &x, &call, &y, NULL));
        CHECK_OK(R->ctx, opf_seq_backward(R->seq, &dy, NULL, &dx, NULL));
    }
    if (!y.data[0]) return;
    memcpy(y_out, y.data[0], sizeof(float) * T * OUT);
    reference(R, &p->qvalue, &x, y_out, tag);
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
    run A, B, C;
    open_run(&A, kind);
    open_run(&C, kind);
    opf_compiled *c = NULL;
    CHECK_OK(C.ctx, opf_compiled_create(C.seq, NULL, &c));
    for (int s = 0; s < STEPS; s++) {
        snprintf(tag, sizeof tag, "%s step %d", opf_recipe_name(kind), s);
        step(&A, NULL, s, tag, ya[s]);
        if (s == 0) CHECK_OK(A.ctx, opf_checkpoint_save(A.ctx, A.seq, A.opt, path));
        snprintf(tag, sizeof tag, "%s compiled step %d", opf_recipe_name(kind), s);
        step(&C, c, s, tag, yb[s]);
        CHECK(!memcmp(ya[s], yb[s], sizeof ya[s]), "%s: compiled output = eager output", tag);
        float *ma, *mc;
        CHECK_OK(NULL, opf_optim_slot(A.opt, 0, NULL, &ma, NULL, NULL, NULL));
        CHECK_OK(NULL, opf_optim_slot(C.opt, 0, NULL, &mc, NULL, NULL, NULL));
        CHECK(!memcmp(ma, mc, sizeof(float) * IN * OUT), "%s: compiled master = eager master", tag);
        CHECK(opf_test_same_bytes(&opf_op_param(opf_seq_at(A.seq, 0), 0)->qvalue,
                                  &opf_op_param(opf_seq_at(C.seq, 0), 0)->qvalue),
              "%s: compiled weight = eager weight", tag);
    }
    opf_graph *g = opf_compiled_last_graph(c);
    CHECK(opf_compiled_num_graphs(c) == 1 && !opf_compiled_recompiles(c), "%s: one graph, no "
          "recompile", opf_recipe_name(kind));
    for (int i = 0; g && i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info info;
        CHECK_OK(NULL, opf_graph_node(g, i, &info));
        CHECK(info.kind != OPF_NODE_EAGER_FORWARD && info.kind != OPF_NODE_EAGER_BACKWARD,
              "%s: node %d (%s) is compiled, not eager (%s)", opf_recipe_name(kind), i,
              info.op_name, info.reason ? info.reason : "");
    }
    opf_compiled_destroy(c);
    close_run(&C);
    open_run(&B, kind);
    CHECK_OK(B.ctx, opf_checkpoint_prepare(B.ctx, B.seq, &B.r));
    CHECK_OK(B.ctx, opf_checkpoint_load(B.ctx, B.seq, B.opt, path));
    for (int s = 1; s < STEPS; s++) {
        snprintf(tag, sizeof tag, "%s resumed step %d", opf_recipe_name(kind), s);
        step(&B, NULL, s, tag, yb[s]);
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

/* What is refused, with a message naming it, and changes nothing. */
static void test_refusals(void)
{
    run R;
    open_run(&R, OPF_RECIPE_CURRENT);
    opf_op *fc = opf_seq_at(R.seq, 0);
    opf_quantizer q = opf_op_param(fc, 0)->primary_q;
    CHECK(opf_op_set_param_quantized(R.ctx, fc, 0, &q) == OPF_ERR_STATE &&
          strstr(opf_last_error(R.ctx), "already quantized"), "twice: %s", opf_last_error(R.ctx));
    CHECK(opf_op_set_param_quantized(R.ctx, fc, 1, &q) == OPF_ERR_INVALID_ARG, "no parameter 1");
    opf_tensor x, y;
    static float x0[T * IN];
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {T, IN}, .dtype = OPF_F32}, x0, &x);
    opf_seq_call call = opf_seq_call_default();
    CHECK(opf_seq_forward(R.seq, &x, &call, &y, NULL) == OPF_ERR_UNSUPPORTED &&
          strstr(opf_last_error(R.ctx), "needs a recipe"), "no recipe: %s", opf_last_error(R.ctx));
    opf_recipe mx = opf_recipe_default(OPF_RECIPE_MXFP8);
    call.recipe = &mx;
    CHECK(opf_seq_forward(R.seq, &x, &call, &y, NULL) == OPF_ERR_STATE &&
          strstr(opf_last_error(R.ctx), "lives quantized as"), "another format: %s",
          opf_last_error(R.ctx));
    close_run(&R);

    opf_ctx *ctx;
    opf_seq *seq;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, IN, OUT, false, OPF_F32, "fc"));
    opf_quantizer none = opf_quantizer_default();
    CHECK(opf_op_set_param_quantized(ctx, opf_seq_at(seq, 0), 0, &none) == OPF_ERR_INVALID_ARG &&
          opf_op_param(opf_seq_at(seq, 0), 0)->value.data[0], "a quantizer that does not quantize");
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
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
    test_refusals();
    TEST_DONE();
}
