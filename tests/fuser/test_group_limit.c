/* test_group_limit.c: a fusible group holds at most OPF_MAX_GROUP_OPS ops;
 * one more is refused naming the limit, and a callback step between them
 * splits the run into groups that fit. */
#include "test.h"

static opf_status cb_fwd(void *user, opf_ctx *ctx, const opf_tensor *x, opf_tensor *y)
{
    (void)user;
    opf_status st = opf_tensor_alloc(ctx, &x->spec, y);
    if (!st) memcpy(y->data[0], x->data[0], (size_t)opf_spec_numel(&x->spec) * 4);
    return st;
}

static opf_status run(opf_ctx *ctx, int n_ops, bool split)
{
    opf_seq *seq;
    opf_status st = opf_seq_create(ctx, &seq);
    opf_callback_i cb = {cb_fwd, NULL, NULL};
    for (int i = 0; !st && i < n_ops; i++) {
        opf_op *op = NULL;
        if (split && i == n_ops / 2) st = opf_seq_append_callback(seq, &cb, "split");
        if (!st) st = opf_op_create(ctx, "identity", NULL, "id", &op);
        if (!st) st = opf_seq_append(seq, op);
    }
    float xs[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    opf_spec s = opf_spec_make(2, (int64_t[]){2, 4}, OPF_F32);
    opf_tensor x, y;
    opf_tensor_wrap(&s, xs, &x);
    opf_seq_call call = opf_seq_call_default();
    call.requires_grad = false;
    if (!st) st = opf_seq_forward(seq, &x, &call, &y, NULL);
    if (!st) opf_tensor_release(&y);
    opf_seq_destroy(seq);
    return st;
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    CHECK(OPF_MAX_GROUP_OPS == 1024, "the limit is %d", OPF_MAX_GROUP_OPS);
    CHECK_OK(ctx, run(ctx, OPF_MAX_GROUP_OPS, false));
    CHECK_FAILS(ctx, run(ctx, OPF_MAX_GROUP_OPS + 1, false), OPF_ERR_UNSUPPORTED,
                "1025 ops", "OPF_MAX_GROUP_OPS", "1024");
    CHECK_OK(ctx, run(ctx, OPF_MAX_GROUP_OPS + 1, true));
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
