/* test_backward_checks.c: a backward checks its dy before it touches
 * anything (issue 13, item 1): no data, another shape, a non-float dtype are
 * refused with a message, nothing is consumed, and the backward then runs. */
#include "test.h"

enum { T = 4, H = 8 };

/* A seq of one op of class cls (config cfg); returns its forward's state. */
static void check_class(opf_ctx *ctx, const char *cls, const void *cfg)
{
    opf_seq *seq;
    opf_op *op;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, cls, &op));
    CHECK_OK(ctx, opf_seq_append(seq, op));
    float xv[T * H], gv[T * H], gw[2 * T * H];
    for (int i = 0; i < T * H; i++) xv[i] = (float)i / 7.0f, gv[i] = 1.0f;
    for (int i = 0; i < 2 * T * H; i++) gw[i] = 1.0f;
    opf_spec s = opf_spec_make(2, (int64_t[]){T, H}, OPF_F32);
    opf_tensor x, dy, y, dx;
    opf_tensor_wrap(&s, xv, &x);
    opf_seq_call call = opf_seq_call_default();
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    /* no data */
    opf_tensor_wrap(&s, gv, &dy);
    dy.data[0] = NULL;
    CHECK_FAILS(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL), OPF_ERR_INVALID_ARG, "dy",
                "no data");
    /* another shape */
    opf_spec wide = opf_spec_make(2, (int64_t[]){T, 2 * H}, OPF_F32);
    opf_tensor_wrap(&wide, gw, &dy);
    CHECK_FAILS(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL), OPF_ERR_SHAPE, "f32[4,16]",
                "f32[4,8]");
    /* an integer dtype */
    opf_spec si = opf_spec_make(2, (int64_t[]){T, H}, OPF_I32);
    opf_tensor_wrap(&si, gv, &dy);
    CHECK_FAILS(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL), OPF_ERR_DTYPE, "dy of", "gradient dtype i32");
    /* nothing consumed: the backward runs now */
    opf_tensor_wrap(&s, gv, &dy);
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));
    opf_tensor_release(&y), opf_tensor_release(&dx);
    opf_seq_destroy(seq);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    opf_bias_config b = {H, OPF_F32};
    opf_constant_scale_config c = {2.0};
    opf_basic_linear_config l = {H, H, OPF_F32, false};
    check_class(ctx, "bias", &b);
    check_class(ctx, "identity", NULL);
    check_class(ctx, "constant_scale", &c);
    check_class(ctx, "basic_linear", &l);
    check_class(ctx, "gelu", NULL);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
