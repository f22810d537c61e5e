/* callback.c: the "callback" op class: a user step that is not fusible and
 * forms a fuser group by itself. */
#include <pthread.h>
#include <string.h>

#include "fuser/fuser-impl.h"
#include "ops/ops-impl.h"

/* One args struct both ways: the tensor the user step reads (x forward, dy
 * backward) and the user's interface. */
typedef struct cb_args {
    opf_tensor     t;
    opf_callback_i cb;
} cb_args;
typedef cb_args cb_fwd, cb_bwd;  /* the schemas' names */
static const opf_field cb_fwd_fields[] = {{"x", offsetof(cb_args, t), OPF_FIELD_TENSOR_Q, 0, NULL}};
OPF_SCHEMA(cb_fwd_schema, cb_fwd, cb_fwd_fields);
static const opf_field cb_bwd_fields[] = {{"dy", offsetof(cb_args, t), OPF_FIELD_TENSOR_Q, 0, NULL}};
OPF_SCHEMA(cb_bwd_schema, cb_bwd, cb_bwd_fields);

/* Runs the user's step f on a->t into out; `what` names it in the error. */
static opf_status call_user(opf_ctx *ctx, const cb_args *a,
                            opf_status (*f)(void *, opf_ctx *, const opf_tensor *, opf_tensor *),
                            opf_tensor *out, const char *what)
{
    opf_status st = f(a->cb.user, ctx, &a->t, out);
    if (st) return opf_error(ctx, st, "callback: the user %s failed: %s", what, opf_last_error(ctx));
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    cb_args *a = args;
    a->t = *env->x;
    a->cb = *(const opf_callback_i *)opf_op_config(op);
    return OPF_OK;
}

/* The callback allocates its own output, so there is no fake: the runner
 * gets an output spec of "none" and the result arrives through outs[0]. */
static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const cb_args *a = args;
    return call_user(ctx, a, a->cb.forward, &outs[0], "forward");
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *b)
{
    cb_args *a = b;
    a->t = *env->dy;
    a->cb = *(const opf_callback_i *)opf_op_config(op);
    if (!a->cb.backward)
        return opf_error(env->ctx, OPF_ERR_UNSUPPORTED, "callback \"%s\" has no backward",
                         opf_op_name(op));
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const cb_args *a = bargs;
    return call_user(ctx, a, a->cb.backward, &grads[0], "backward");
}

static const char *unsupported(const opf_op *op) { return "a user callback has no fake"; }

static const opf_op_class callback_class = {
    .abi_version = OPF_OP_ABI_VERSION,
    .name = "callback",
    .config_size = sizeof(opf_callback_i),
    .fwd_schema = &cb_fwd_schema,
    .bwd_schema = &cb_bwd_schema,
    .fusible = false,
    .resolve_fwd = resolve_fwd,
    .setup_context = setup_context,
    .resolve_bwd = resolve_bwd,
    .forward_impl = forward_impl,
    .backward_impl = backward_impl,
    .unsupported_reason = unsupported,
};

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void register_callback(void) { OPF_ASSERT(opf_op_class_register(&callback_class) == OPF_OK); }

opf_status opf_seq_append_callback(opf_seq *seq, const opf_callback_i *cb, const char *name)
{
    const char *fn = "opf_seq_append_callback";
    OPF_CHECK_NULL(NULL, fn, seq);
    OPF_CHECK_NULL(seq->ctx, fn, cb);
    if (!cb->forward) return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: forward is NULL", fn);
    pthread_once(&once, register_callback);
    opf_op *op;
    opf_status st = opf_op_create(seq->ctx, "callback", cb, name ? name : "callback", &op);
    return st ? st : opf_seq_append(seq, op);
}
