/* test_seq.c: opf_seq container semantics, grouping, plans, forward and
 * backward through the fuser, early stop and call-order errors. */
#include "test.h"

static opf_op *mk(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

static opf_status cb_fwd(void *user, opf_ctx *ctx, const opf_tensor *x, opf_tensor *y)
{
    (*(int *)user)++;
    opf_status st = opf_tensor_alloc(ctx, &x->spec, y);
    if (!st) memcpy(y->data[0], x->data[0], (size_t)opf_spec_numel(&x->spec) * 4);
    return st;
}

static opf_status cb_bwd(void *user, opf_ctx *ctx, const opf_tensor *dy, opf_tensor *dx)
{
    (*(int *)user) += 100;
    opf_status st = opf_tensor_alloc(ctx, &dy->spec, dx);
    if (!st) memcpy(dx->data[0], dy->data[0], (size_t)opf_spec_numel(&dy->spec) * 4);
    return st;
}

static void test_container(opf_ctx *ctx)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    int calls = 0;
    opf_callback_i cb = {cb_fwd, cb_bwd, &calls};
    /* as the anchor's Sequential groups them: fusible, fusible, callback,
     * callback, fusible, callback, fusible x3 -> 6 groups */
    opf_seq_append(seq, mk(ctx, "identity", NULL, "a"));
    opf_seq_append(seq, mk(ctx, "identity", NULL, "b"));
    opf_seq_append_callback(seq, &cb, "c1");
    opf_seq_append_callback(seq, &cb, "c2");
    opf_seq_append(seq, mk(ctx, "identity", NULL, "d"));
    opf_seq_append_callback(seq, &cb, "c3");
    for (int i = 0; i < 3; i++) opf_seq_append(seq, mk(ctx, "identity", NULL, "e"));
    CHECK(opf_seq_len(seq) == 9, "len %d", opf_seq_len(seq));
    CHECK(opf_seq_num_groups(seq) == 6, "groups %d", opf_seq_num_groups(seq));
    opf_plan_entry pe[4];
    CHECK(opf_seq_plan(seq, 5, false, pe, 4) == 3 && pe[0].first == 6 && pe[2].count == 1, "plan");
    /* insert and remove invalidate the groups */
    CHECK_OK(ctx, opf_seq_insert(seq, 0, mk(ctx, "identity", NULL, "z")));
    CHECK(opf_seq_num_groups(seq) == 6 && strcmp(opf_op_name(opf_seq_at(seq, 0)), "z") == 0, "insert");
    opf_op *out;
    CHECK_OK(ctx, opf_seq_remove(seq, 3, &out));  /* c1 */
    CHECK(strcmp(opf_op_name(out), "c1") == 0 && opf_seq_num_groups(seq) == 5, "remove -> %d groups",
          opf_seq_num_groups(seq));
    opf_op_destroy(out);
    CHECK_FAILS(ctx, opf_seq_remove(seq, 42, NULL), OPF_ERR_INVALID_ARG, "index 42");
    CHECK_FAILS(ctx, opf_seq_insert(seq, -1, mk(ctx, "identity", NULL, "y")), OPF_ERR_INVALID_ARG,
                "index -1");
    CHECK_FAILS(ctx, opf_seq_append(seq, opf_seq_at(seq, 0)), OPF_ERR_INVALID_ARG, "already");
    /* run through the callbacks */
    float xs[6] = {1, 2, 3, 4, 5, 6};
    opf_tensor x, y, dx;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {2, 3}, .dtype = OPF_F32}, xs, &x);
    opf_seq_call call = opf_seq_call_default();
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    CHECK(calls == 2 && memcmp(y.data[0], xs, sizeof xs) == 0, "callbacks ran forward (%d)", calls);
    CHECK_OK(ctx, opf_seq_backward(seq, &y, NULL, &dx, NULL));
    CHECK(calls == 202 && memcmp(dx.data[0], xs, sizeof xs) == 0, "and backward (%d)", calls);
    opf_tensor_release(&y);
    opf_tensor_release(&dx);
    opf_seq_destroy(seq);
}

/* x [M, N] + b, twice (two bias ops): y = x + b1 + b2, db_i = sum_rows dy. */
static void test_bias_chain(opf_ctx *ctx, opf_dtype dt)
{
    enum { M = 5, N = 7 };
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_bias_config bc = {N, dt};
    opf_seq_append(seq, mk(ctx, "bias", &bc, "b1"));
    opf_seq_append(seq, mk(ctx, "bias", &bc, "b2"));
    unsigned long long rs = 9;
    float xv[M * N], dyv[M * N], b[2][N];
    float xh[M * N], dyh[M * N];  /* raw storage in dt (large enough for f32) */
    for (int p = 0; p < 2; p++) {
        opf_param *pr = opf_op_param(opf_seq_at(seq, p), 0);
        for (int j = 0; j < N; j++) b[p][j] = opf_test_normal(&rs, 1.0f);
        opf_convert(b[p], OPF_F32, pr->value.data[0], dt, N);
        opf_convert(pr->value.data[0], dt, b[p], OPF_F32, N);
    }
    for (int i = 0; i < M * N; i++) xv[i] = opf_test_normal(&rs, 1.0f), dyv[i] = opf_test_normal(&rs, 1.0f);
    opf_convert(xv, OPF_F32, xh, dt, M * N);
    opf_convert(dyv, OPF_F32, dyh, dt, M * N);
    opf_convert(xh, dt, xv, OPF_F32, M * N);
    opf_convert(dyh, dt, dyv, OPF_F32, M * N);
    opf_tensor x, dy, y, dx;
    opf_spec s = {.ndim = 2, .shape = {M, N}, .dtype = dt};
    opf_tensor_wrap(&s, dt == OPF_F32 ? (void *)xv : xh, &x);
    opf_tensor_wrap(&s, dt == OPF_F32 ? (void *)dyv : dyh, &dy);
    opf_seq_call call = opf_seq_call_default();
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    float yv[M * N], tol = dt == OPF_F32 ? 1e-6f : dt == OPF_BF16 ? 2e-2f : 2e-3f;
    opf_convert(y.data[0], dt, yv, OPF_F32, M * N);
    int bad = 0;
    for (int i = 0; i < M * N; i++) {
        double r = (double)xv[i] + b[0][i % N] + b[1][i % N];
        bad += fabs(yv[i] - r) > tol * (1 + fabs(r));
    }
    CHECK(bad == 0, "%s forward: %d off", opf_dtype_name(dt), bad);
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));
    CHECK(memcmp(dx.data[0], dy.data[0], (size_t)M * N * (dt == OPF_F32 ? 4 : 2)) == 0, "dx = dy");
    for (int p = 0; p < 2; p++) {
        opf_param *pr = opf_op_param(opf_seq_at(seq, p), 0);
        float g[N];
        opf_convert(pr->grad.data[0], dt, g, OPF_F32, N);
        bad = 0;
        for (int j = 0; j < N; j++) {
            double r = 0;
            for (int i = 0; i < M; i++) r += dyv[i * N + j];
            bad += fabs(g[j] - r) > tol * (1 + fabs(r)) * 4;
        }
        CHECK(pr->has_grad && bad == 0, "%s db%d", opf_dtype_name(dt), p);
    }
    opf_tensor_release(&y);
    opf_tensor_release(&dx);

    /* call-order errors leave the state as it was */
    CHECK_FAILS(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward");
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    opf_tensor y2;
    CHECK_FAILS(ctx, opf_seq_forward(seq, &x, &call, &y2, NULL), OPF_ERR_STATE, "backward has not run");
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));  /* the first forward's backward */
    opf_tensor_release(&y);
    opf_tensor_release(&dx);
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    opf_seq_discard(seq);
    CHECK_FAILS(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward");
    opf_tensor_release(&y);

    /* inference: nothing saved, no backward */
    call.requires_grad = false;
    opf_alloc_stats a0, a1;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    opf_tensor_release(&y);
    opf_ctx_alloc_stats(ctx, &a0);
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    opf_tensor_release(&y);
    opf_ctx_alloc_stats(ctx, &a1);
    CHECK(a1.bytes_live == a0.bytes_live, "inference frees what it allocates");
    CHECK_FAILS(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward");

    /* frozen: no input grad, b1 frozen -> backward starts at b2 and stops there */
    call = opf_seq_call_default();
    call.input_requires_grad = false;
    opf_op_param(opf_seq_at(seq, 0), 0)->requires_grad = false;
    opf_seq_zero_grad(seq);
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    CHECK(opf_seq_first_requiring_backward(seq) == 1, "first requiring backward %d",
          opf_seq_first_requiring_backward(seq));
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));
    CHECK(dx.data[0] == NULL, "early stop: no dx");
    CHECK(!opf_op_param(opf_seq_at(seq, 0), 0)->has_grad && opf_op_param(opf_seq_at(seq, 1), 0)->has_grad,
          "only b2 got a gradient");
    opf_tensor_release(&y);
    /* everything frozen: forward keeps nothing */
    opf_op_param(opf_seq_at(seq, 1), 0)->requires_grad = false;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    CHECK(opf_seq_first_requiring_backward(seq) == 2, "nothing needs backward");
    CHECK_FAILS(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL), OPF_ERR_STATE, "no forward");
    opf_tensor_release(&y);

    /* bad input: wrong width */
    opf_tensor xb;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {7, 5}, .dtype = dt}, xh, &xb);
    CHECK_FAILS(ctx, opf_seq_forward(seq, &xb, &call, &y, NULL), OPF_ERR_SHAPE, "b1", "5 features",
                "7");
    opf_seq_destroy(seq);
}

static void test_errors(opf_ctx *ctx)
{
    opf_op *op;
    CHECK_FAILS(ctx, opf_op_create(ctx, "no_such_op", NULL, "x", &op), OPF_ERR_INVALID_ARG,
                "no_such_op");
    CHECK_FAILS(ctx, opf_op_create(ctx, "bias", NULL, "x", &op), OPF_ERR_INVALID_ARG, "config");
    opf_bias_config bc = {0, OPF_F32};
    CHECK_FAILS(ctx, opf_op_create(ctx, "bias", &bc, "bb", &op), OPF_ERR_INVALID_ARG, "bb", "size 0");
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_tensor x, y;
    float v[4];
    opf_tensor_wrap(&(opf_spec){.ndim = 1, .shape = {4}, .dtype = OPF_F32}, v, &x);
    opf_seq_call call = opf_seq_call_default();
    CHECK_FAILS(ctx, opf_seq_forward(seq, &x, &call, &y, NULL), OPF_ERR_STATE, "empty");
    opf_seq_destroy(seq);
    /* duplicate class registration */
    CHECK_FAILS(NULL, opf_op_class_register(opf_op_class_find("bias")), OPF_ERR_INVALID_ARG,
                "already registered");
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    test_container(ctx);
    for (opf_dtype dt = OPF_F32; dt <= OPF_BF16; dt++) test_bias_chain(ctx, dt);
    test_errors(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
