/* callback.c: the "callback" op class: a user step that is not fusible and
 * forms a fuser group by itself. */
#include <pthread.h>
#include <string.h>

#include "fuser/fuser-impl.h"
#include "ops/ops-impl.h"

typedef struct cb_fwd {
    opf_tensor     x;
    opf_callback_i cb;
} cb_fwd;
static const opf_field cb_fwd_fields[] = {OPF_F_TENSOR_Q(cb_fwd, x)};
OPF_SCHEMA(cb_fwd_schema, cb_fwd, cb_fwd_fields);

typedef struct cb_bwd {
    opf_tensor     dy;
    opf_callback_i cb;
} cb_bwd;
static const opf_field cb_bwd_fields[] = {OPF_F_TENSOR_Q(cb_bwd, dy)};
OPF_SCHEMA(cb_bwd_schema, cb_bwd, cb_bwd_fields);

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    cb_fwd *a = args;
    a->x = *env->x;
    a->cb = *(const opf_callback_i *)opf_op_config(op);
    return OPF_OK;
}

/* The callback allocates its own output, so there is no fake: the runner
 * gets an output spec of "none" and the result arrives through outs[0]. */
static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const cb_fwd *a = args;
    opf_status st = a->cb.forward(a->cb.user, ctx, &a->x, &outs[0]);
    if (st) return opf_error(ctx, st, "callback: the user forward failed: %s", opf_last_error(ctx));
    return OPF_OK;
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *b)
{
    cb_bwd *a = b;
    a->dy = *env->dy;
    a->cb = *(const opf_callback_i *)opf_op_config(op);
    if (!a->cb.backward)
        return opf_error(env->ctx, OPF_ERR_UNSUPPORTED, "callback \"%s\" has no backward",
                         opf_op_name(op));
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const cb_bwd *a = bargs;
    opf_status st = a->cb.backward(a->cb.user, ctx, &a->dy, &grads[0]);
    if (st) return opf_error(ctx, st, "callback: the user backward failed: %s", opf_last_error(ctx));
    return OPF_OK;
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
