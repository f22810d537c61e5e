/* reshape.c: y = x viewed with another shape (one dim may be -1, inferred);
 * dx = dy viewed back with the input's shape. Our tensors are immutable
 * views of buffers, so the "view" is a copy of every component. A quantized
 * tensor keeps its bytes only while its 2D view [M, K] is unchanged, so a
 * quantized input (or gradient) may be reshaped only when the last dim stays. */
#include "ops/ops-impl.h"

/* The fields of a target shape: ndim, then shape[0..7] one by one. */
#define TARGET_SHAPE_FIELDS(st)                                                            \
    OPF_F_INT(st, ndim), OPF_F_INT(st, shape[0]), OPF_F_INT(st, shape[1]),                 \
        OPF_F_INT(st, shape[2]), OPF_F_INT(st, shape[3]), OPF_F_INT(st, shape[4]),         \
        OPF_F_INT(st, shape[5]), OPF_F_INT(st, shape[6]), OPF_F_INT(st, shape[7])
_Static_assert(OPF_MAX_DIMS == 8, "TARGET_SHAPE_FIELDS lists OPF_MAX_DIMS dims");

typedef struct reshape_fwd {
    opf_tensor x;
    int64_t    ndim;                 /* the resolved target shape (no -1) */
    int64_t    shape[OPF_MAX_DIMS];
} reshape_fwd;
static const opf_field reshape_fwd_fields[] = {OPF_F_TENSOR_Q(reshape_fwd, x),
                                               TARGET_SHAPE_FIELDS(reshape_fwd)};
OPF_SCHEMA(reshape_fwd_schema, reshape_fwd, reshape_fwd_fields);

/* The backward is the same view with the input's shape as the target. */
typedef struct reshape_bwd {
    opf_tensor dy;
    int64_t    ndim;
    int64_t    shape[OPF_MAX_DIMS];
} reshape_bwd;
static const opf_field reshape_bwd_fields[] = {OPF_F_TENSOR_Q(reshape_bwd, dy),
                                               TARGET_SHAPE_FIELDS(reshape_bwd)};
OPF_SCHEMA(reshape_bwd_schema, reshape_bwd, reshape_bwd_fields);

/* "[4,-1,8]" into buf. */
static const char *shape_str(int ndim, const int64_t *shape, char *buf, size_t size)
{
    int n = snprintf(buf, size, "[");
    for (int i = 0; i < ndim && n > 0 && (size_t)n < size; i++)
        n += snprintf(buf + n, size - n, "%s%lld", i ? "," : "", (long long)shape[i]);
    if (n > 0 && (size_t)n < size) snprintf(buf + n, size - n, "]");
    return buf;
}

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_reshape_config *c = opf_op_config(op);
    const char *name = opf_op_name(op);
    if (c->ndim < 0 || c->ndim > OPF_MAX_DIMS)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "reshape \"%s\": ndim %d outside 0..%d", name,
                         c->ndim, OPF_MAX_DIMS);
    int n_infer = 0;
    for (int i = 0; i < c->ndim; i++) {
        if (c->shape[i] < -1)
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "reshape \"%s\": dim %d is %lld", name, i,
                             (long long)c->shape[i]);
        n_infer += c->shape[i] == -1;
    }
    if (n_infer > 1) {
        char b[160];
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "reshape \"%s\": shape %s has %d dims of -1, "
                         "at most one may be inferred", name, shape_str(c->ndim, c->shape, b, sizeof b),
                         n_infer);
    }
    return OPF_OK;
}

/* Resolves the -1 of `want` for `have` elements into out; OPF_ERR_SHAPE
 * naming both shapes when the element counts cannot match. */
static opf_status resolve_shape(opf_ctx *ctx, const char *name, const opf_spec *in, int ndim,
                                const int64_t *want, int64_t *out)
{
    int64_t have = opf_spec_numel(in), known = 1;
    int infer = -1;
    bool overflow = false;
    for (int i = 0; i < ndim; i++) {
        if (want[i] == -1) infer = i;
        else overflow |= __builtin_mul_overflow(known, want[i], &known);
        out[i] = want[i];
    }
    if (overflow) known = -1;  /* matches no element count */
    if (infer >= 0 && known > 0 && have % known == 0) out[infer] = have / known;
    bool ok = infer >= 0 ? known > 0 && have % known == 0 : known == have;
    if (ok) return OPF_OK;
    char a[160], b[160];
    return opf_error(ctx, OPF_ERR_SHAPE, "reshape \"%s\": cannot view %s (%lld elements) as %s", name,
                     shape_str(in->ndim, in->shape, a, sizeof a), (long long)have,
                     shape_str(ndim, want, b, sizeof b));
}

/* A quantized tensor keeps its bytes only under the same 2D view. */
static opf_status check_quantized(opf_ctx *ctx, const char *name, const char *what,
                                  const opf_spec *in, int ndim, const int64_t *shape)
{
    if (in->scaling == OPF_SCALING_NONE) return OPF_OK;
    if (in->ndim >= 1 && ndim >= 1 && in->shape[in->ndim - 1] == shape[ndim - 1]) return OPF_OK;
    char a[160], b[160];
    return opf_error(ctx, OPF_ERR_SHAPE,
                     "reshape \"%s\": %s is quantized (%s) and can only be reshaped keeping its "
                     "last dim: %s -> %s", name, what, opf_scaling_name(in->scaling),
                     shape_str(in->ndim, in->shape, a, sizeof a), shape_str(ndim, shape, b, sizeof b));
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    reshape_fwd *a = args;
    const opf_reshape_config *c = opf_op_config(op);
    int64_t shape[OPF_MAX_DIMS];
    opf_status st = resolve_shape(env->ctx, opf_op_name(op), &env->x->spec, c->ndim, c->shape, shape);
    if (!st) st = check_quantized(env->ctx, opf_op_name(op), "the input", &env->x->spec, c->ndim, shape);
    if (st) return st;
    a->x = *env->x;
    a->ndim = c->ndim;
    memcpy(a->shape, shape, sizeof shape);
    return OPF_OK;
}

/* The input spec with the target shape (format, usage, flags kept). */
static opf_spec view_spec(const opf_spec *in, int64_t ndim, const int64_t *shape)
{
    opf_spec s = *in;
    s.ndim = (int)ndim;
    for (int i = 0; i < OPF_MAX_DIMS; i++) s.shape[i] = i < ndim ? shape[i] : 0;
    return s;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const reshape_fwd *a = args;
    outs[0] = view_spec(&a->x.spec, a->ndim, a->shape);
    return OPF_OK;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    return opf_op_copy_tensor(ctx, "reshape", &((const reshape_fwd *)args)->x, &outs[0]);
}

/* The input shape in attrs: attrs[0] = ndim | shape[7] << 4 (the eighth dim
 * rides in the high bits, since attrs has room for only 7 more), attrs[1..7]
 * = shape[0..6]. */
static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const opf_spec *in = &((const reshape_fwd *)args)->x.spec;
    octx->attrs[0] = in->ndim | (in->ndim == OPF_MAX_DIMS ? in->shape[OPF_MAX_DIMS - 1] << 4 : 0);
    for (int i = 0; i < OPF_MAX_DIMS - 1; i++) octx->attrs[1 + i] = i < in->ndim ? in->shape[i] : 0;
    return OPF_OK;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *args)
{
    reshape_bwd *a = args;
    int ndim = (int)(octx->attrs[0] & 15);
    int64_t shape[OPF_MAX_DIMS] = {0};
    for (int i = 0; i < ndim && i < OPF_MAX_DIMS - 1; i++) shape[i] = octx->attrs[1 + i];
    if (ndim == OPF_MAX_DIMS) shape[OPF_MAX_DIMS - 1] = octx->attrs[0] >> 4;
    opf_status st = resolve_shape(env->ctx, opf_op_name(op), &env->dy->spec, ndim, shape, shape);
    if (!st) st = check_quantized(env->ctx, opf_op_name(op), "the gradient", &env->dy->spec, ndim, shape);
    if (st) return st;
    a->dy = *env->dy;
    a->ndim = ndim;
    memcpy(a->shape, shape, sizeof shape);
    return OPF_OK;
}

static opf_status backward_fake(const void *args, opf_spec *grads)
{
    const reshape_bwd *a = args;
    grads[0] = view_spec(&a->dy.spec, a->ndim, a->shape);
    return OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *args, opf_tensor *grads)
{
    return opf_op_copy_tensor(ctx, "reshape", &((const reshape_bwd *)args)->dy, &grads[0]);
}

const opf_op_class opf_op_class_reshape = {
    OPF_OP_CLASS_HEAD("reshape", sizeof(opf_reshape_config), &reshape_fwd_schema,
                      &reshape_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(init, setup_context),
    .inplace = true,  /* the copy skips equal memory */
};
