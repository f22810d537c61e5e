/* test_contract.c: the op contract itself: registry rules, schema utilities
 * (slots, hash, print, validate), channel bindings, a user op class. */
#include "test.h"

#include "ops/ops-impl.h"

/* A user basic op: y = s * x with a learnable scalar s (a custom op, as
 * the anchor's tests have one). */
typedef struct uscale_fwd {
    opf_tensor x, s;
    double     hint;
    int64_t    n;
    bool       flag;
    opf_quantizer q;
} uscale_fwd;
static const opf_field uscale_fwd_fields[] = {
    OPF_F_TENSOR(uscale_fwd, x), OPF_F_TENSOR(uscale_fwd, s), OPF_F_FLOAT(uscale_fwd, hint),
    OPF_F_INT(uscale_fwd, n), OPF_F_BOOL(uscale_fwd, flag), OPF_F_QUANT(uscale_fwd, q)};
OPF_SCHEMA(uscale_fwd_schema, uscale_fwd, uscale_fwd_fields);

typedef struct uscale_bwd {
    opf_tensor dy, x, s;
} uscale_bwd;
static const opf_field uscale_bwd_fields[] = {
    OPF_F_TENSOR(uscale_bwd, dy), OPF_F_TENSOR(uscale_bwd, x), OPF_F_TENSOR(uscale_bwd, s)};
OPF_SCHEMA(uscale_bwd_schema, uscale_bwd, uscale_bwd_fields);

static opf_status us_init(opf_ctx *ctx, opf_op *op)
{
    opf_spec s = opf_spec_make(1, (int64_t[]){1}, OPF_F32);
    int i = opf_op_add_param(ctx, op, "scale", &s);
    if (i < 0) return (opf_status)-i;
    *(float *)opf_op_param(op, i)->value.data[0] = 1.5f;
    return OPF_OK;
}

static opf_status us_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    uscale_fwd *a = args;
    a->x = *env->x;
    a->s = opf_op_param(op, 0)->value;
    a->hint = 0.5;
    a->n = 3;
    a->q = opf_quantizer_default();
    return OPF_OK;
}

static opf_status us_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const uscale_fwd *)args)->x.spec;
    return OPF_OK;
}

static opf_status us_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const uscale_fwd *a = args;
    const float *x = a->x.data[0];
    float s = *(const float *)a->s.data[0], *y = outs[0].data[0];
    for (int64_t i = 0; i < opf_spec_numel(&a->x.spec); i++) y[i] = s * x[i];
    return OPF_OK;
}

static opf_status us_setup(opf_op *op, opf_op_ctx *c, const void *args, const opf_tensor *outs,
                           const opf_tensor *aux)
{
    opf_tensor_retain(&((const uscale_fwd *)args)->x, &c->saved[c->n_saved++]);
    return OPF_OK;
}

static opf_status us_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *b)
{
    uscale_bwd *a = b;
    a->dy = *env->dy;
    a->x = c->saved[0];
    a->s = opf_op_param(op, 0)->value;
    return OPF_OK;
}

static opf_status us_bfake(const void *b, opf_spec *g)
{
    const uscale_bwd *a = b;
    g[0] = a->dy.spec;
    g[1] = a->s.spec;
    return OPF_OK;
}

static opf_status us_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g)
{
    const uscale_bwd *a = b;
    const float *dy = a->dy.data[0], *x = a->x.data[0];
    float s = *(const float *)a->s.data[0], *dx = g[0].data[0], ds = 0;
    for (int64_t i = 0; i < opf_spec_numel(&a->dy.spec); i++) dx[i] = s * dy[i], ds += dy[i] * x[i];
    *(float *)g[1].data[0] = ds;
    return OPF_OK;
}

static const opf_op_class uscale_class = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "user_scale",
    .fwd_schema = &uscale_fwd_schema, .bwd_schema = &uscale_bwd_schema, .fusible = true,
    .init = us_init, .resolve_fwd = us_resolve_fwd, .setup_context = us_setup,
    .resolve_bwd = us_resolve_bwd, .forward_fake = us_fake, .forward_impl = us_impl,
    .backward_fake = us_bfake, .backward_impl = us_bimpl,
};

static void test_registry(void)
{
    int n0 = opf_op_class_count();
    CHECK(n0 >= 2 && opf_op_class_find("identity") && opf_op_class_find("bias"), "builtins (%d)", n0);
    CHECK_OK(NULL, opf_op_class_register(&uscale_class));
    CHECK(opf_op_class_find("user_scale") == &uscale_class && opf_op_class_count() == n0 + 1, "found");
    CHECK_FAILS(NULL, opf_op_class_register(&uscale_class), OPF_ERR_INVALID_ARG, "user_scale",
                "already registered");
    opf_op_class bad = uscale_class;
    bad.name = "UserScale";
    CHECK_FAILS(NULL, opf_op_class_register(&bad), OPF_ERR_INVALID_ARG, "UserScale", "lower-case");
    bad.name = "user_scale2";
    bad.abi_version = 99;
    CHECK_FAILS(NULL, opf_op_class_register(&bad), OPF_ERR_INVALID_ARG, "abi_version 99");
    bad.abi_version = OPF_OP_ABI_VERSION;
    bad.forward_impl = NULL;
    CHECK_FAILS(NULL, opf_op_class_register(&bad), OPF_ERR_INVALID_ARG, "forward_impl");
    CHECK(opf_op_class_find("user_scale2") == NULL, "nothing registered on failure");
    CHECK_FAILS(NULL, opf_op_class_register(NULL), OPF_ERR_INVALID_ARG, "cls");
}

static void test_schema(void)
{
    float xs[6] = {1, 2, 3, 4, 5, 6}, s = 2;
    uscale_fwd a;
    memset(&a, 0, sizeof a);
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {2, 3}, .dtype = OPF_F32}, xs, &a.x);
    opf_tensor_wrap(&(opf_spec){.ndim = 1, .shape = {1}, .dtype = OPF_F32}, &s, &a.s);
    a.hint = 0.25;
    a.n = 7;
    a.q = opf_quantizer_default();
    opf_slot slots[4];
    CHECK(opf_schema_slots(&uscale_fwd_schema, &a, slots, 4) == 2 && slots[0].tensor == &a.x &&
          slots[1].tensor == &a.s && !strcmp(slots[1].field->name, "s"), "slots");
    uint64_t h = opf_schema_hash(&uscale_fwd_schema, &a);
    float other[6];
    uscale_fwd b = a;
    b.x.data[0] = other;  /* data does not enter the hash, specs and values do */
    CHECK(opf_schema_hash(&uscale_fwd_schema, &b) == h, "hash ignores data");
    b.n = 8;
    CHECK(opf_schema_hash(&uscale_fwd_schema, &b) != h, "hash sees ints");
    b = a;
    b.q.scaling = OPF_SCALING_MXFP8;
    CHECK(opf_schema_hash(&uscale_fwd_schema, &b) != h, "hash sees quantizers by value");
    b = a;
    b.x.spec.shape[0] = 3;
    CHECK(opf_schema_hash(&uscale_fwd_schema, &b) != h, "hash sees shapes");
    char buf[256];
    opf_schema_print(&uscale_fwd_schema, &a, buf, sizeof buf);
    CHECK(strstr(buf, "x: f32[2,3]") && strstr(buf, "hint: 0.25") && strstr(buf, "n: 7") &&
          strstr(buf, "flag: false") && strstr(buf, "q: none/e4m3"), "print \"%s\"", buf);
    CHECK_OK(NULL, opf_schema_validate(&uscale_fwd_schema, &a));
    b = a;
    memset(&b.s, 0, sizeof b.s);
    CHECK_FAILS(NULL, opf_schema_validate(&uscale_fwd_schema, &b), OPF_ERR_INVALID_ARG,
                "tensor \"s\" is missing");
    CHECK(opf_schema_field(&uscale_fwd_schema, "hint") == &uscale_fwd_fields[2] &&
          opf_schema_field(&uscale_fwd_schema, "nope") == NULL, "field lookup");
}

static void test_user_op(opf_ctx *ctx)
{
    opf_op *op;
    CHECK_OK(ctx, opf_op_create(ctx, "user_scale", NULL, "us", &op));
    float xs[4] = {1, -2, 3, 0.5f}, dys[4] = {1, 1, 2, -1};
    opf_tensor x, dy, outs[1], dx;
    opf_spec sp = {.ndim = 1, .shape = {4}, .dtype = OPF_F32};
    opf_tensor_wrap(&sp, xs, &x);
    opf_tensor_wrap(&sp, dys, &dy);
    opf_op_ctx c;
    memset(&c, 0, sizeof c);
    opf_bwd_env be = {.ctx = ctx, .dy = &dy};
    CHECK_FAILS(ctx, opf_op_backward(op, &c, &be, &dx, NULL), OPF_ERR_STATE, "us", "without a forward");
    opf_fwd_env fe = {.ctx = ctx, .x = &x, .requires_grad = true};
    CHECK_OK(ctx, opf_op_forward(op, &fe, &c, outs));
    CHECK(((float *)outs[0].data[0])[1] == -3.0f && c.valid && c.n_saved == 1, "forward");
    CHECK_OK(ctx, opf_op_backward(op, &c, &be, &dx, NULL));
    const opf_param *p = opf_op_param(op, 0);
    CHECK(((float *)dx.data[0])[2] == 3.0f && *(float *)p->grad.data[0] == 1 - 2 + 6 - 0.5f &&
          p->has_grad && !c.valid, "backward");
    opf_tensor_release(&dx);
    CHECK_FAILS(ctx, opf_op_backward(op, &c, &be, &dx, NULL), OPF_ERR_STATE, "already done");
    opf_tensor_release(&outs[0]);
    opf_op_zero_grad(op);
    CHECK(!opf_op_param(op, 0)->has_grad && *(float *)p->grad.data[0] == 0, "zero_grad");
    opf_op_destroy(op);
}

static void test_channels(opf_ctx *ctx)
{
    opf_op *op;
    CHECK_OK(ctx, opf_op_create(ctx, "identity", NULL, "id", &op));
    CHECK_FAILS(NULL, opf_op_set_extra_input(op, 0, "r"), OPF_ERR_INVALID_ARG, "id", "index 0",
                "0..-1");
    CHECK_FAILS(NULL, opf_op_set_extra_output(op, 1, "r", true), OPF_ERR_INVALID_ARG, "index 1");
    opf_op_destroy(op);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    test_registry();
    test_schema();
    test_user_op(ctx);
    test_channels(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
