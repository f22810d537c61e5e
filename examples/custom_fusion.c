/* custom_fusion.c: how a user adds ops and fusions to opfuse. Copy from here.
 *
 *  1. a user basic op, "learnable_scale": y = s * x with a learnable scalar s;
 *  2. a forward-only fused op, "user_scale_add": learnable_scale followed by
 *     add_extra_input computed in one pass (the backward stays unfused, so
 *     the forward fills both basic ops' contexts as their own forwards would);
 *  3. a backward-only fused op, "user_scale_scale_bwd": learnable_scale
 *     followed by constant_scale, backward in one pass;
 *  4. a joint fused op, "user_scale_silu": learnable_scale + silu with its
 *     own forward and backward: the same object appears in both plans.
 *
 * main() registers everything, runs the same little models with fusions on
 * and off, checks plans and results, and prints "N passed, N failed". */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <opfuse.h>

/* ---- 1. the basic op ----------------------------------------------------------------- */

typedef struct ls_fwd {
    opf_tensor x, s;  /* x f32 [..], s f32 [1] */
} ls_fwd;
static const opf_field ls_fwd_fields[] = {OPF_F_TENSOR(ls_fwd, x), OPF_F_TENSOR(ls_fwd, s)};
OPF_SCHEMA(ls_fwd_schema, ls_fwd, ls_fwd_fields);

typedef struct ls_bwd {
    opf_tensor dy, x, s;
} ls_bwd;
static const opf_field ls_bwd_fields[] = {OPF_F_TENSOR(ls_bwd, dy), OPF_F_TENSOR(ls_bwd, x),
                                          OPF_F_TENSOR(ls_bwd, s)};
OPF_SCHEMA(ls_bwd_schema, ls_bwd, ls_bwd_fields);

static opf_status ls_init(opf_ctx *ctx, opf_op *op)
{
    opf_spec s = opf_spec_make(1, (int64_t[]){1}, OPF_F32);
    int i = opf_op_add_param(ctx, op, "scale", &s);
    if (i < 0) return (opf_status)-i;
    *(float *)opf_op_param(op, i)->value.data[0] = 1.25f;
    return OPF_OK;
}

static opf_status ls_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    ls_fwd *a = args;
    if (env->x->spec.dtype != OPF_F32 || env->x->spec.scaling != OPF_SCALING_NONE)
        return OPF_ERR_DTYPE;  /* this example handles plain f32 only */
    a->x = *env->x;
    a->s = opf_op_param(op, 0)->value;
    return OPF_OK;
}

static opf_status ls_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const ls_fwd *)args)->x.spec;
    return OPF_OK;
}

static opf_status ls_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const ls_fwd *a = args;
    const float *x = a->x.data[0], s = *(const float *)a->s.data[0];
    float *y = outs[0].data[0];
    for (int64_t i = 0; i < opf_spec_numel(&a->x.spec); i++) y[i] = s * x[i];
    return OPF_OK;
}

/* What learnable_scale keeps for backward: its input. Fused forwards that
 * cover it must keep exactly this. */
static void ls_save(opf_op_ctx *c, const opf_tensor *x) { opf_tensor_retain(x, &c->saved[c->n_saved++]); }

static opf_status ls_setup(opf_op *op, opf_op_ctx *c, const void *args, const opf_tensor *outs,
                           const opf_tensor *aux)
{
    ls_save(c, &((const ls_fwd *)args)->x);
    return OPF_OK;
}

static opf_status ls_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *b)
{
    ls_bwd *a = b;
    a->dy = *env->dy;
    a->x = c->saved[0];
    a->s = opf_op_param(op, 0)->value;
    return OPF_OK;
}

static opf_status ls_bfake(const void *b, opf_spec *g)
{
    const ls_bwd *a = b;
    g[0] = a->dy.spec;  /* dx */
    g[1] = a->s.spec;   /* ds */
    return OPF_OK;
}

/* dx = s dy, ds = sum(dy x) (times an extra factor c for the fused variant) */
static void ls_backward(const ls_bwd *a, float c, opf_tensor *g)
{
    const float *dy = a->dy.data[0], *x = a->x.data[0], s = *(const float *)a->s.data[0];
    float *dx = g[0].data[0], ds = 0;
    for (int64_t i = 0; i < opf_spec_numel(&a->dy.spec); i++) {
        dx[i] = (s * c) * dy[i];
        ds += (c * dy[i]) * x[i];
    }
    *(float *)g[1].data[0] = ds;
}

static opf_status ls_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g)
{
    ls_backward(b, 1.0f, g);
    return OPF_OK;
}

static const opf_op_class learnable_scale = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "learnable_scale",
    .fwd_schema = &ls_fwd_schema, .bwd_schema = &ls_bwd_schema, .fusible = true,
    .init = ls_init, .resolve_fwd = ls_resolve_fwd, .setup_context = ls_setup,
    .resolve_bwd = ls_resolve_bwd, .forward_fake = ls_fake, .forward_impl = ls_impl,
    .backward_fake = ls_bfake, .backward_impl = ls_bimpl,
};

static bool is(opf_op *op, const char *name) { return !strcmp(opf_op_class_of(op)->name, name); }

/* ---- 2. forward-only fused op: y = s * x + extra ----------------------------------- */

typedef struct sa_fwd {
    opf_tensor x, s, extra;
} sa_fwd;
static const opf_field sa_fwd_fields[] = {OPF_F_TENSOR(sa_fwd, x), OPF_F_TENSOR(sa_fwd, s),
                                          OPF_F_TENSOR(sa_fwd, extra)};
OPF_SCHEMA(sa_fwd_schema, sa_fwd, sa_fwd_fields);

static opf_status sa_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    sa_fwd *a = args;
    if (!env->extra_in[0]) return OPF_ERR_INVALID_ARG;  /* the residual comes from outside */
    a->x = *env->x;
    a->s = opf_op_param(opf_op_basic(op, 0), 0)->value;
    a->extra = *env->extra_in[0];
    return OPF_OK;
}

static opf_status sa_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const sa_fwd *)args)->x.spec;
    return OPF_OK;
}

static opf_status sa_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const sa_fwd *a = args;
    const float *x = a->x.data[0], *e = a->extra.data[0], s = *(const float *)a->s.data[0];
    float *y = outs[0].data[0];
    for (int64_t i = 0; i < opf_spec_numel(&a->x.spec); i++) y[i] = s * x[i] + e[i];
    return OPF_OK;
}

/* octx[0] is learnable_scale's context, octx[1] add_extra_input's (which keeps nothing). */
static opf_status sa_setup(opf_op *op, opf_op_ctx *octx, const void *args, const opf_tensor *outs,
                           const opf_tensor *aux)
{
    ls_save(&octx[0], &((const sa_fwd *)args)->x);
    return OPF_OK;
}

static const opf_op_class user_scale_add = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "user_scale_add", .covers = 2,
    .fwd_schema = &sa_fwd_schema, .fusible = true, .resolve_fwd = sa_resolve,
    .setup_context = sa_setup, .forward_fake = sa_fake, .forward_impl = sa_impl,
};

static int match_scale_add(opf_op *const *ops, int n, const opf_recipe *r, void *user)
{
    return n >= 2 && is(ops[0], "learnable_scale") && is(ops[1], "add_extra_input") ? 2 : 0;
}

static opf_status fuse_scale_add(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r,
                                 void *user, opf_op **out, int *n_out)
{
    return opf_fusion_scan(ctx, in, n, r, match_scale_add, opf_fusion_build_class,
                           (void *)"user_scale_add", out, n_out);
}

/* ---- 3. backward-only fused op: d(c * s * x) in one pass ---------------------------- */

typedef struct ss_bwd {
    ls_bwd ls;
    double c;
} ss_bwd;
static const opf_field ss_bwd_fields[] = {
    OPF_F_TENSOR(ss_bwd, ls.dy), OPF_F_TENSOR(ss_bwd, ls.x), OPF_F_TENSOR(ss_bwd, ls.s),
    OPF_F_FLOAT(ss_bwd, c)};
OPF_SCHEMA(ss_bwd_schema, ss_bwd, ss_bwd_fields);

/* Reads what the unfused forwards saved: learnable_scale its x; constant_scale nothing. */
static opf_status ss_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *b)
{
    ss_bwd *a = b;
    opf_status st = ls_resolve_bwd(opf_op_basic(op, 0), &octx[0], env, &a->ls);
    a->c = ((const opf_constant_scale_config *)opf_op_config(opf_op_basic(op, 1)))->scale;
    return st;
}

static opf_status ss_bfake(const void *b, opf_spec *g) { return ls_bfake(&((const ss_bwd *)b)->ls, g); }

static opf_status ss_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g)
{
    const ss_bwd *a = b;
    ls_backward(&a->ls, (float)a->c, g);  /* grads: dx, ds (constant_scale has no params) */
    return OPF_OK;
}

static const opf_op_class user_scale_scale_bwd = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "user_scale_scale_bwd", .covers = 2,
    .fwd_schema = &ls_fwd_schema, .bwd_schema = &ss_bwd_schema, .fusible = true,
    .resolve_fwd = ls_resolve_fwd, .resolve_bwd = ss_resolve_bwd, .backward_fake = ss_bfake,
    .backward_impl = ss_bimpl,
};

static int match_scale_scale(opf_op *const *ops, int n, const opf_recipe *r, void *user)
{
    return n >= 2 && is(ops[0], "learnable_scale") && is(ops[1], "constant_scale") ? 2 : 0;
}

static opf_status fuse_scale_scale(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r,
                                   void *user, opf_op **out, int *n_out)
{
    return opf_fusion_scan(ctx, in, n, r, match_scale_scale, opf_fusion_build_class,
                           (void *)"user_scale_scale_bwd", out, n_out);
}

/* ---- 4. joint fused op: y = silu(s * x), own forward and backward ------------------ */

static float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

static opf_status sl_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const ls_fwd *a = args;
    const float *x = a->x.data[0], s = *(const float *)a->s.data[0];
    float *y = outs[0].data[0];
    for (int64_t i = 0; i < opf_spec_numel(&a->x.spec); i++) {
        float z = s * x[i];
        y[i] = z * sigmoid(z);
    }
    return OPF_OK;
}

/* The joint op owns both halves: it may save what it likes (here x in octx[0]). */
static opf_status sl_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *b)
{
    return ls_resolve_bwd(opf_op_basic(op, 0), &octx[0], env, b);
}

static opf_status sl_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g)
{
    const ls_bwd *a = b;
    const float *dy = a->dy.data[0], *x = a->x.data[0], s = *(const float *)a->s.data[0];
    float *dx = g[0].data[0], ds = 0;
    for (int64_t i = 0; i < opf_spec_numel(&a->dy.spec); i++) {
        float z = s * x[i], sg = sigmoid(z), dz = dy[i] * (sg + z * sg * (1.0f - sg));
        dx[i] = s * dz;
        ds += dz * x[i];
    }
    *(float *)g[1].data[0] = ds;
    return OPF_OK;
}

static opf_status sl_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    return ls_resolve_fwd(opf_op_basic(op, 0), env, args);
}

static const opf_op_class user_scale_silu = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "user_scale_silu", .covers = 2,
    .fwd_schema = &ls_fwd_schema, .bwd_schema = &ls_bwd_schema, .fusible = true,
    .resolve_fwd = sl_resolve_fwd, .setup_context = ls_setup, .forward_fake = ls_fake,
    .forward_impl = sl_impl, .resolve_bwd = sl_resolve_bwd, .backward_fake = ls_bfake,
    .backward_impl = sl_bimpl,
};

static int match_scale_silu(opf_op *const *ops, int n, const opf_recipe *r, void *user)
{
    return n >= 2 && is(ops[0], "learnable_scale") && is(ops[1], "silu") ? 2 : 0;
}

static opf_status fuse_scale_silu(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r,
                                  void *user, opf_op **out, int *n_out)
{
    return opf_fusion_scan(ctx, in, n, r, match_scale_silu, opf_fusion_build_class,
                           (void *)"user_scale_silu", out, n_out);
}

/* ---- running it ------------------------------------------------------------------------- */

static int passed, failed;
#define EXPECT(cond, ...)                                                \
    do {                                                                 \
        if (cond) passed++;                                              \
        else {                                                           \
            failed++;                                                    \
            fprintf(stderr, "custom_fusion: " __VA_ARGS__);              \
            fputc('\n', stderr);                                         \
        }                                                                \
    } while (0)

enum { N = 24 };

/* Runs forward + backward of seq (fusions on or off) and returns y, dx, ds. */
static void run(opf_ctx *ctx, opf_seq *seq, bool fused, const float *x, const float *e, float *y,
                float *dx, float *ds)
{
    opf_tensor xt, et, dyt, yt, dxt;
    opf_spec sp = opf_spec_make(2, (int64_t[]){4, 6}, OPF_F32);
    float dy[N];
    for (int i = 0; i < N; i++) dy[i] = 0.1f * (float)(i % 7) - 0.3f;
    opf_tensor_wrap(&sp, (void *)x, &xt);
    opf_tensor_wrap(&sp, (void *)e, &et);
    opf_tensor_wrap(&sp, dy, &dyt);
    opf_seq_set_fusions(seq, fused);
    opf_seq_zero_grad(seq);
    opf_seq_call call = opf_seq_call_default();
    call.n_extra_in = opf_seq_num_extra_in(seq);
    call.extra_in = &et;
    opf_status st = opf_seq_forward(seq, &xt, &call, &yt, NULL);
    if (!st) st = opf_seq_backward(seq, &dyt, NULL, &dxt, NULL);
    EXPECT(st == OPF_OK, "run (fused %d): %s", fused, opf_last_error(ctx));
    if (st) return;
    memcpy(y, yt.data[0], sizeof(float) * N);
    memcpy(dx, dxt.data[0], sizeof(float) * N);
    *ds = *(const float *)opf_op_param(opf_seq_at(seq, 0), 0)->grad.data[0];
    opf_tensor_release(&yt);
    opf_tensor_release(&dxt);
}

static void compare(opf_ctx *ctx, opf_seq *seq, const char *what, float tol)
{
    float x[N], e[N], y0[N], y1[N], dx0[N], dx1[N], ds0 = 0, ds1 = 0;
    for (int i = 0; i < N; i++) x[i] = sinf((float)i), e[i] = cosf((float)i);
    run(ctx, seq, false, x, e, y0, dx0, &ds0);
    run(ctx, seq, true, x, e, y1, dx1, &ds1);
    float err = fabsf(ds0 - ds1);
    for (int i = 0; i < N; i++) {
        err = fmaxf(err, fabsf(y0[i] - y1[i]));
        err = fmaxf(err, fabsf(dx0[i] - dx1[i]));
    }
    EXPECT(err <= tol, "%s: fused and unfused differ by %g", what, err);
}

static opf_seq *model(opf_ctx *ctx, const char *second, const void *cfg)
{
    opf_seq *seq;
    opf_op *a, *b;
    opf_seq_create(ctx, &seq);
    opf_op_create(ctx, "learnable_scale", NULL, "scale", &a);
    opf_op_create(ctx, second, cfg, second, &b);
    opf_seq_append(seq, a);
    opf_seq_append(seq, b);
    return seq;
}

static const char *plan_class(opf_seq *seq, bool backward)
{
    opf_plan_entry e[4];
    int n = opf_seq_plan(seq, 0, backward, e, 4);
    return n >= 1 ? opf_op_class_of(e[0].op)->name : "?";
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    EXPECT(opf_op_class_register(&learnable_scale) == OPF_OK, "register learnable_scale");
    EXPECT(opf_op_class_register(&user_scale_add) == OPF_OK, "register user_scale_add");
    EXPECT(opf_op_class_register(&user_scale_scale_bwd) == OPF_OK, "register user_scale_scale_bwd");
    EXPECT(opf_op_class_register(&user_scale_silu) == OPF_OK, "register user_scale_silu");
    EXPECT(opf_register_forward_fusion("user_scale_add", fuse_scale_add, NULL, false) == OPF_OK, "fwd");
    EXPECT(opf_register_backward_fusion("user_scale_scale_bwd", fuse_scale_scale, NULL, false) == OPF_OK,
           "bwd");
    EXPECT(opf_register_joint_fusion("user_scale_silu", fuse_scale_silu, NULL, true) == OPF_OK, "joint");

    opf_seq *seq = model(ctx, "add_extra_input", NULL);
    compare(ctx, seq, "forward-only scale+add", 1e-6f);
    EXPECT(!strcmp(plan_class(seq, false), "user_scale_add"), "forward plan: %s", plan_class(seq, false));
    EXPECT(!strcmp(plan_class(seq, true), "learnable_scale"), "backward plan stays unfused: %s",
           plan_class(seq, true));
    opf_seq_destroy(seq);

    opf_constant_scale_config c = {-0.5};
    seq = model(ctx, "constant_scale", &c);
    compare(ctx, seq, "backward-only scale+scale", 1e-6f);
    EXPECT(!strcmp(plan_class(seq, false), "learnable_scale"), "forward stays unfused");
    EXPECT(!strcmp(plan_class(seq, true), "user_scale_scale_bwd"), "backward plan: %s",
           plan_class(seq, true));
    opf_seq_destroy(seq);

    seq = model(ctx, "silu", NULL);
    compare(ctx, seq, "joint scale+silu", 1e-5f);
    opf_plan_entry f[2], b[2];
    EXPECT(opf_seq_plan(seq, 0, false, f, 2) == 1 && opf_seq_plan(seq, 0, true, b, 2) == 1 &&
           f[0].op == b[0].op && !strcmp(opf_op_class_of(f[0].op)->name, "user_scale_silu"),
           "the joint op is one object in both plans");
    opf_seq_destroy(seq);

    opf_ctx_destroy(ctx);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
