/* test_compile_user.c: user classes and user fusions under compile.
 *
 * The gate's reasons, each checked by its text and with compiled == eager
 * bit for bit over two SGD steps:
 *  - kwargs handed to a class without a kwargs schema (gelu);
 *  - a kwargs schema with a field not flagged OPF_FIELD_KWARG (and, as the
 *    control, the same op with the flag compiles to plain nodes);
 *  - args that hide a tensor outside their schema, forward and backward.
 * User-registered fused ops: a joint fusion, then a forward-only and a
 * backward-only fusion over a user basic op, each a node of the graph (no
 * eager node) and compiled == eager. */
#include "compile/compile_util.h"

enum { M = 32, H = 64 };

/* ---- a user basic op: y = s x, s a learnable scalar (f32) ------------------------------- */

typedef struct tu_fwd {
    opf_tensor x, s;
} tu_fwd;
static const opf_field tu_fwd_fields[] = {OPF_F_TENSOR(tu_fwd, x), OPF_F_TENSOR(tu_fwd, s)};
OPF_SCHEMA(tu_fwd_schema, tu_fwd, tu_fwd_fields);

typedef struct tu_bwd {
    opf_tensor dy, x, s;
    double     c;  /* the fused backward's constant_scale factor; 1 for tu_scale */
} tu_bwd;
static const opf_field tu_bwd_fields[] = {OPF_F_TENSOR(tu_bwd, dy), OPF_F_TENSOR(tu_bwd, x),
                                          OPF_F_TENSOR(tu_bwd, s), OPF_F_FLOAT(tu_bwd, c)};
OPF_SCHEMA(tu_bwd_schema, tu_bwd, tu_bwd_fields);

static opf_status tu_init(opf_ctx *ctx, opf_op *op)
{
    opf_spec s = opf_spec_make(1, (int64_t[]){1}, OPF_F32);
    int i = opf_op_add_param(ctx, op, "s", &s);
    if (i < 0) return (opf_status)-i;
    *(float *)opf_op_param(op, i)->value.data[0] = 1.25f;
    return OPF_OK;
}

static bool plain_f32(const opf_tensor *t) { return t->spec.dtype == OPF_F32 && t->spec.scaling == OPF_SCALING_NONE; }

static opf_status tu_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    tu_fwd *a = args;
    if (!plain_f32(env->x)) return OPF_ERR_DTYPE;
    a->x = *env->x;
    a->s = opf_op_param(op, 0)->value;
    return OPF_OK;
}

static opf_status tu_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const tu_fwd *)args)->x.spec;
    return OPF_OK;
}

/* y = fl(fl(s x) c): c = 1 for tu_scale, constant_scale's factor when fused */
static void tu_forward(const tu_fwd *a, float c, opf_tensor *y)
{
    const float *x = a->x.data[0], s = *(const float *)a->s.data[0];
    float *out = y->data[0];
    for (int64_t i = 0; i < opf_spec_numel(&a->x.spec); i++) out[i] = c * (s * x[i]);
}

static opf_status tu_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    tu_forward(args, 1.0f, &outs[0]);
    return OPF_OK;
}

static opf_status tu_setup(opf_op *op, opf_op_ctx *c, const void *args, const opf_tensor *outs, const opf_tensor *aux)
{
    opf_tensor_retain(&((const tu_fwd *)args)->x, &c->saved[c->n_saved++]);
    return OPF_OK;
}

static opf_status tu_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *b)
{
    tu_bwd *a = b;
    if (!plain_f32(env->dy)) return OPF_ERR_DTYPE;
    a->dy = *env->dy;
    a->x = c->saved[0];
    a->s = opf_op_param(op, 0)->value;
    a->c = 1.0;
    return OPF_OK;
}

static opf_status tu_bfake(const void *b, opf_spec *g)
{
    const tu_bwd *a = b;
    g[0] = a->dy.spec;
    g[1] = a->s.spec;
    return OPF_OK;
}

/* dz = fl(c dy) as constant_scale's backward rounds it, then dx = s dz and
 * ds = sum dz x, left to right */
static opf_status tu_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g)
{
    const tu_bwd *a = b;
    const float *dy = a->dy.data[0], *x = a->x.data[0], s = *(const float *)a->s.data[0], c = (float)a->c;
    float *dx = g[0].data[0], ds = 0;
    for (int64_t i = 0; i < opf_spec_numel(&a->dy.spec); i++) {
        float dz = c * dy[i];
        dx[i] = s * dz;
        ds += dz * x[i];
    }
    *(float *)g[1].data[0] = ds;
    return OPF_OK;
}

static const opf_op_class tu_scale = {
    .abi_version = OPF_OP_ABI_VERSION, .name = "tu_scale", .fwd_schema = &tu_fwd_schema,
    .bwd_schema = &tu_bwd_schema, .fusible = true, .init = tu_init, .resolve_fwd = tu_resolve,
    .forward_fake = tu_fake, .forward_impl = tu_impl, .setup_context = tu_setup,
    .resolve_bwd = tu_resolve_bwd, .backward_fake = tu_bfake, .backward_impl = tu_bimpl,
};

/* ---- fused classes over tu_scale + constant_scale ----------------------------------------- */

typedef struct tu_ss_fwd {
    tu_fwd ts;
    double c;
} tu_ss_fwd;
static const opf_field tu_ss_fwd_fields[] = {OPF_F_TENSOR(tu_ss_fwd, ts.x), OPF_F_TENSOR(tu_ss_fwd, ts.s),
                                             OPF_F_FLOAT(tu_ss_fwd, c)};
OPF_SCHEMA(tu_ss_fwd_schema, tu_ss_fwd, tu_ss_fwd_fields);

static double tu_factor(opf_op *fused)
{
    return ((const opf_constant_scale_config *)opf_op_config(opf_op_basic(fused, 1)))->scale;
}

static opf_status ss_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    tu_ss_fwd *a = args;
    a->c = tu_factor(op);
    return tu_resolve(opf_op_basic(op, 0), env, &a->ts);
}

static opf_status ss_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    return tu_fake(&((const tu_ss_fwd *)args)->ts, outs, aux);
}

static opf_status ss_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const tu_ss_fwd *a = args;
    tu_forward(&a->ts, (float)a->c, &outs[0]);
    return OPF_OK;
}

/* tu_scale's context gets its x; constant_scale's keeps nothing */
static opf_status ss_setup(opf_op *op, opf_op_ctx *octx, const void *args, const opf_tensor *outs,
                           const opf_tensor *aux)
{
    return tu_setup(op, &octx[0], &((const tu_ss_fwd *)args)->ts, outs, aux);
}

static opf_status ss_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *b)
{
    opf_status st = tu_resolve_bwd(opf_op_basic(op, 0), &octx[0], env, b);
    ((tu_bwd *)b)->c = tu_factor(op);
    return st;
}

#define TU_FUSED_HEAD(cls_name, fwd, bwd) \
    .abi_version = OPF_OP_ABI_VERSION, .name = (cls_name), .covers = 2, .fusible = true, \
    .fwd_schema = (fwd), .bwd_schema = (bwd)
#define TU_FUSED_FWD .resolve_fwd = ss_resolve, .forward_fake = ss_fake, .forward_impl = ss_impl, \
    .setup_context = ss_setup
#define TU_FUSED_BWD .resolve_bwd = ss_resolve_bwd, .backward_fake = tu_bfake, .backward_impl = tu_bimpl

static const opf_op_class tu_joint = {TU_FUSED_HEAD("tu_ss_joint", &tu_ss_fwd_schema, &tu_bwd_schema),
                                      TU_FUSED_FWD, TU_FUSED_BWD};
static const opf_op_class tu_fwd_only = {TU_FUSED_HEAD("tu_ss_fwd", &tu_ss_fwd_schema, NULL), TU_FUSED_FWD};
static const opf_op_class tu_bwd_only = {TU_FUSED_HEAD("tu_ss_bwd", NULL, &tu_bwd_schema), TU_FUSED_BWD};

static int match_ss(opf_op *const *ops, int n, const opf_recipe *r, void *user)
{
    return n >= 2 && !strcmp(opf_op_class_of(ops[0])->name, "tu_scale") &&
                   !strcmp(opf_op_class_of(ops[1])->name, "constant_scale") ? 2 : 0;
}

static opf_status fuse_ss(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *r, void *user,
                          opf_op **out, int *n_out)
{
    return opf_fusion_scan(ctx, in, n, r, match_ss, opf_fusion_build_class, user, out, n_out);
}

/* linear(+bias) -> tu_scale -> constant_scale(0.75), f32 */
static opf_seq *tu_model(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq = NULL;
    opf_constant_scale_config c = {0.75};
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, h, h, true, dt, "fc"));
    cu_append(ctx, seq, "tu_scale", NULL, "scale");
    cu_append(ctx, seq, "constant_scale", &c, "const");
    return seq;
}

/* The fused class of each direction in g's nodes, and no eager node. */
static void check_fused_nodes(const char *tag, opf_graph *g, const char *fwd_cls, const char *bwd_cls)
{
    bool fwd = false, bwd = false;
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info n;
        CHECK_OK(NULL, opf_graph_node(g, i, &n));
        CHECK(n.kind != OPF_NODE_EAGER_FORWARD && n.kind != OPF_NODE_EAGER_BACKWARD,
              "%s: %s runs as an eager node (%s)", tag, n.op_name, n.reason ? n.reason : "");
        if (!n.class_name) continue;
        fwd |= n.kind == OPF_NODE_FORWARD && !strcmp(n.class_name, fwd_cls);
        bwd |= n.kind == OPF_NODE_BACKWARD && !strcmp(n.class_name, bwd_cls);
    }
    CHECK(fwd && bwd, "%s: forward node %s %d, backward node %s %d", tag, fwd_cls, fwd, bwd_cls, bwd);
}

/* Two SGD steps on a pair built by build, compiled == eager; g checked by check. */
static void run_pair(const char *tag, cu_build_fn build, const opf_seq_call *call, const char *fwd_cls,
                     const char *bwd_cls, const char *reason)
{
    cu_pair p;
    if (!cu_pair_build(&p, 7, build, OPF_F32, H, 2 * H) || !p.a || !p.b || !cu_pair_sgd(&p, 0.05f, 0)) {
        cu_pair_close(&p);
        return;
    }
    cu_randomize_params(p.ca, p.a, p.b);
    opf_spec xs = opf_spec_make(2, (int64_t[]){M, H}, OPF_F32);
    opf_graph *g = NULL;
    if (cu_compile(p.cb, tag, p.b, &xs, call, NULL, &g)) {
        for (int step = 0; step < 2; step++) {
            cu_compare_step(&p, g, NULL, call, M, H, OPF_F32, 0.5f, tag);
            cu_pair_optim_step(&p);
        }
        int bad = cu_params_differ(p.a, p.b);
        CHECK(bad == 0, "%s: %d parameters differ after two steps", tag, bad);
        if (fwd_cls) check_fused_nodes(tag, g, fwd_cls, bwd_cls);
        opf_graph_reason r[8];
        int n = opf_graph_reasons(g, r, 8);
        if (!reason) CHECK(n == 0, "%s: %d eager nodes (%s)", tag, n, n ? r[0].reason : "");
        bool found = false;
        for (int i = 0; reason && i < n && i < 8; i++) found |= !r[i].backward && !strcmp(r[i].reason, reason);
        CHECK(!reason || found, "%s: no forward eager node with reason \"%s\" (%d reasons)", tag, reason, n);
    }
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

static void test_user_fusions(void)
{
    opf_seq_call call = opf_seq_call_default();
    CHECK_OK(NULL, opf_register_joint_fusion("tu_ss_joint", fuse_ss, (void *)"tu_ss_joint", true));
    run_pair("joint user fusion", tu_model, &call, "tu_ss_joint", "tu_ss_joint", NULL);
    CHECK_OK(NULL, opf_unregister_fusion("tu_ss_joint"));
    CHECK_OK(NULL, opf_register_forward_fusion("tu_ss_fwd", fuse_ss, (void *)"tu_ss_fwd", true));
    CHECK_OK(NULL, opf_register_backward_fusion("tu_ss_bwd", fuse_ss, (void *)"tu_ss_bwd", true));
    run_pair("forward and backward user fusions", tu_model, &call, "tu_ss_fwd", "tu_ss_bwd", NULL);
    CHECK_OK(NULL, opf_unregister_fusion("tu_ss_fwd"));
    CHECK_OK(NULL, opf_unregister_fusion("tu_ss_bwd"));
}

/* ---- kwargs the gate refuses -------------------------------------------------------------------- */

/* y = f x with f a per-call kwarg (1 when none is given); dx = f dy */
typedef struct tu_kw {
    double factor;
} tu_kw;
static const opf_field tu_kw_bad_fields[] = {OPF_F(tu_kw, factor, OPF_FIELD_FLOAT, 0)};
OPF_SCHEMA(tu_kw_bad_schema, tu_kw, tu_kw_bad_fields);
static const opf_field tu_kw_good_fields[] = {OPF_F(tu_kw, factor, OPF_FIELD_FLOAT, OPF_FIELD_KWARG)};
OPF_SCHEMA(tu_kw_good_schema, tu_kw, tu_kw_good_fields);

typedef struct tu_kw_args {
    opf_tensor x;
    double     factor;
} tu_kw_args;
static const opf_field tu_kw_args_fields[] = {OPF_F_TENSOR(tu_kw_args, x), OPF_F_FLOAT(tu_kw_args, factor)};
OPF_SCHEMA(tu_kw_args_schema, tu_kw_args, tu_kw_args_fields);

static double kw_factor(const void *kw) { return kw ? ((const tu_kw *)kw)->factor : 1.0; }

static opf_status kw_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    tu_kw_args *a = args;
    if (!plain_f32(env->x)) return OPF_ERR_DTYPE;
    *a = (tu_kw_args){*env->x, kw_factor(env->kwargs)};
    return OPF_OK;
}

/* The backward reads the factor the forward saw (attrs[0] holds its bits). */
static opf_status kw_setup(opf_op *op, opf_op_ctx *c, const void *args, const opf_tensor *outs, const opf_tensor *aux)
{
    memcpy(&c->attrs[0], &((const tu_kw_args *)args)->factor, sizeof(double));
    return OPF_OK;
}

static opf_status kw_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *args)
{
    tu_kw_args *a = args;
    if (!plain_f32(env->dy)) return OPF_ERR_DTYPE;
    a->x = *env->dy;
    memcpy(&a->factor, &c->attrs[0], sizeof(double));
    return OPF_OK;
}

static opf_status kw_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const tu_kw_args *)args)->x.spec;
    return OPF_OK;
}

static opf_status kw_bfake(const void *args, opf_spec *g) { return kw_fake(args, g, NULL); }

static opf_status kw_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const tu_kw_args *a = args;
    const float *x = a->x.data[0];
    float *y = outs[0].data[0], f = (float)a->factor;
    for (int64_t i = 0; i < opf_spec_numel(&a->x.spec); i++) y[i] = f * x[i];
    return OPF_OK;
}

static opf_status kw_bimpl(opf_ctx *ctx, const void *args, opf_tensor *g) { return kw_impl(ctx, args, g, NULL); }

#define TU_KW_CLASS(cls_name, kw_schema) {                                                      \
    .abi_version = OPF_OP_ABI_VERSION, .name = (cls_name), .fusible = true,                     \
    .fwd_schema = &tu_kw_args_schema, .bwd_schema = &tu_kw_args_schema, .kwargs_schema = (kw_schema), \
    .resolve_fwd = kw_resolve, .forward_fake = kw_fake, .forward_impl = kw_impl,                 \
    .setup_context = kw_setup, .resolve_bwd = kw_resolve_bwd, .backward_fake = kw_bfake,         \
    .backward_impl = kw_bimpl}
static const opf_op_class tu_kw_bad = TU_KW_CLASS("tu_kw_bad", &tu_kw_bad_schema);
static const opf_op_class tu_kw_good = TU_KW_CLASS("tu_kw_good", &tu_kw_good_schema);

/* linear(+bias) -> the op of the class the name of which the build reads */
static const char *tu_tail;
static opf_seq *tail_model(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, h, h, true, dt, "fc"));
    cu_append(ctx, seq, tu_tail, NULL, "tail");
    return seq;
}

static void test_kwargs_gate(void)
{
    tu_kw kw = {0.625};
    const void *kwargs[3] = {NULL, NULL, &kw};
    opf_seq_call call = opf_seq_call_default();
    call.kwargs = kwargs;
    tu_tail = "tu_kw_bad";
    run_pair("kwargs field without OPF_FIELD_KWARG", tail_model, &call, NULL, NULL,
             "a kwargs field is not declared OPF_FIELD_KWARG");
    tu_tail = "tu_kw_good";
    run_pair("declared kwargs (control)", tail_model, &call, NULL, NULL, NULL);
    tu_tail = "gelu";
    run_pair("kwargs to a class without a kwargs schema", tail_model, &call, NULL, NULL,
             "it is given kwargs its class does not declare");
}

/* ---- args that hide a tensor ------------------------------------------------------------------- */

/* y = 0.5 x, but the impl reads x through a copy the schema does not list. */
typedef struct tu_hid_args {
    opf_tensor x;       /* in the schema */
    opf_tensor hidden;  /* the same tensor, outside it */
} tu_hid_args;
static const opf_field tu_hid_fields[] = {OPF_F_TENSOR(tu_hid_args, x)};
OPF_SCHEMA(tu_hid_schema, tu_hid_args, tu_hid_fields);

static opf_status hid_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    tu_hid_args *a = args;
    if (!plain_f32(env->x)) return OPF_ERR_DTYPE;
    a->x = a->hidden = *env->x;
    return OPF_OK;
}

static opf_status hid_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *args)
{
    tu_hid_args *a = args;
    if (!plain_f32(env->dy)) return OPF_ERR_DTYPE;
    a->x = a->hidden = *env->dy;
    return OPF_OK;
}

/* The same struct without the hidden copy in use: x alone. */
static opf_status plain_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    opf_status st = hid_resolve(op, env, args);
    memset(&((tu_hid_args *)args)->hidden, 0, sizeof(opf_tensor));
    return st;
}

static opf_status hid_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    outs[0] = ((const tu_hid_args *)args)->x.spec;
    return OPF_OK;
}

static opf_status hid_bfake(const void *args, opf_spec *g) { return hid_fake(args, g, NULL); }

static opf_status hid_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const tu_hid_args *a = args;
    const opf_tensor *src = a->hidden.data[0] ? &a->hidden : &a->x;
    const float *x = src->data[0];
    float *y = outs[0].data[0];
    for (int64_t i = 0; i < opf_spec_numel(&src->spec); i++) y[i] = 0.5f * x[i];
    return OPF_OK;
}

static opf_status hid_bimpl(opf_ctx *ctx, const void *args, opf_tensor *g) { return hid_impl(ctx, args, g, NULL); }

#define TU_HID_CLASS(cls_name, fwd_resolve, bwd_resolve) {                                       \
    .abi_version = OPF_OP_ABI_VERSION, .name = (cls_name), .fusible = true,                     \
    .fwd_schema = &tu_hid_schema, .bwd_schema = &tu_hid_schema, .resolve_fwd = (fwd_resolve),   \
    .forward_fake = hid_fake, .forward_impl = hid_impl, .resolve_bwd = (bwd_resolve),            \
    .backward_fake = hid_bfake, .backward_impl = hid_bimpl}
static const opf_op_class tu_hid_fwd = TU_HID_CLASS("tu_hidden_fwd", hid_resolve, hid_resolve_bwd);
static const opf_op_class tu_hid_bwd = TU_HID_CLASS("tu_hidden_bwd", plain_resolve, hid_resolve_bwd);

/* The backward reason of a graph's eager nodes, or NULL. */
static const char *backward_reason(opf_graph *g)
{
    opf_graph_reason r[8];
    int n = opf_graph_reasons(g, r, 8);
    for (int i = 0; i < n && i < 8; i++)
        if (r[i].backward) return r[i].reason;
    return NULL;
}

static void test_hidden_tensor(void)
{
    opf_seq_call call = opf_seq_call_default();
    const char *why = "its args hold a tensor outside its schema";
    tu_tail = "tu_hidden_fwd";
    run_pair("hidden tensor in forward args", tail_model, &call, NULL, NULL, why);
    /* a clean forward and a hiding backward: the backward node alone is eager */
    cu_pair p;
    tu_tail = "tu_hidden_bwd";
    if (!cu_pair_build(&p, 9, tail_model, OPF_F32, H, H) || !p.a || !p.b) {
        cu_pair_close(&p);
        return;
    }
    opf_spec xs = opf_spec_make(2, (int64_t[]){M, H}, OPF_F32);
    opf_graph *g = NULL;
    if (cu_compile(p.cb, "hidden tensor in backward args", p.b, &xs, &call, NULL, &g)) {
        cu_compare_step(&p, g, NULL, &call, M, H, OPF_F32, 0.5f, "hidden tensor in backward args");
        const char *r = backward_reason(g);
        CHECK(r && !strcmp(r, why), "hidden backward tensor: backward reason %s", r ? r : "(none)");
        CHECK(opf_graph_reasons(g, NULL, 0) == 1, "hidden backward tensor: %d eager nodes, want 1",
              opf_graph_reasons(g, NULL, 0));
    }
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

int main(void)
{
    const opf_op_class *classes[] = {&tu_scale, &tu_joint, &tu_fwd_only, &tu_bwd_only,
                                     &tu_kw_bad, &tu_kw_good, &tu_hid_fwd, &tu_hid_bwd};
    for (size_t i = 0; i < sizeof classes / sizeof classes[0]; i++)
        CHECK_OK(NULL, opf_op_class_register(classes[i]));
    test_user_fusions();
    test_kwargs_gate();
    test_hidden_tensor();
    TEST_DONE();
}
