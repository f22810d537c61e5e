/* norm_common.c: the pieces layernorm.c, rmsnorm.c and l2normalization.c
 * share (declared in norm-impl.h): the checks of configs, inputs and saved
 * contexts. Messages start with the op's class name, so each reads as if its
 * op had written it. */
#include <math.h>

#include "ops/basic/norm-impl.h"

static const char *class_name(const opf_op *op) { return opf_op_class_of(op)->name; }

/* ---- the class hooks' checks ------------------------------------------------------- */

opf_status opf_norm_init(opf_ctx *ctx, opf_op *op, bool with_bias)
{
    const opf_norm_config *c = opf_op_config(op);
    const char *cls = class_name(op), *n = opf_op_name(op);
    if (c->hidden < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": hidden size %lld < 1", cls, n,
                         (long long)c->hidden);
    opf_status st = opf_norm_check_eps(ctx, op, c->eps);
    if (st) return st;
    if (!opf_is_act_dtype(c->dtype))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": dtype %s, expected f32, bf16 or f16",
                         cls, n, opf_dtype_name(c->dtype));
    opf_spec s = opf_spec_make(1, &c->hidden, c->dtype);
    int iw = opf_op_add_param(ctx, op, "weight", &s);
    if (iw < 0) return (opf_status)-iw;
    int ib = with_bias ? opf_op_add_param(ctx, op, "bias", &s) : 0;
    if (ib < 0) return (opf_status)-ib;
    if (c->zero_centered_gamma) return OPF_OK;  /* params start at 0 */
    opf_tensor *w = &opf_op_param(op, iw)->value;
    const opf_elem_kernels *k = opf_op_elem(ctx, cls, w);
    return k ? k->fill(ctx, 1.0, w) : OPF_ERR_UNSUPPORTED;
}

opf_status opf_norm_check_eps(opf_ctx *ctx, const opf_op *op, double eps)
{
    if (!(eps >= 0.0) || !isfinite(eps))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s \"%s\": eps %g must be finite and >= 0",
                         class_name(op), opf_op_name(op), eps);
    return OPF_OK;
}

opf_status opf_norm_check_dtype(opf_ctx *ctx, const opf_op *op, const char *what,
                                const opf_tensor *t)
{
    if (!opf_is_act_dtype(t->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s \"%s\": %s dtype %s, expected f32, bf16 or f16",
                         class_name(op), opf_op_name(op), what, opf_dtype_name(t->spec.dtype));
    return OPF_OK;
}

opf_status opf_norm_check_input(opf_ctx *ctx, const opf_op *op, const char *what,
                                const opf_tensor *t, int64_t H)
{
    const opf_spec *s = &t->spec;
    if (s->ndim < 1 || s->shape[s->ndim - 1] != H)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s \"%s\": %s has %lld features, hidden size is %lld",
                         class_name(op), opf_op_name(op), what,
                         (long long)(s->ndim ? s->shape[s->ndim - 1] : 0), (long long)H);
    return opf_norm_check_dtype(ctx, op, what, t);
}

opf_status opf_norm_check_saved(opf_ctx *ctx, const opf_op *op, const opf_op_ctx *octx, int want)
{
    if (octx->n_saved != want)
        return opf_error(ctx, OPF_ERR_STATE, "%s \"%s\": context holds %d tensors, want %d",
                         class_name(op), opf_op_name(op), octx->n_saved, want);
    return OPF_OK;
}

opf_status opf_norm_check_bwd(opf_ctx *ctx, const opf_op *op, const opf_op_ctx *octx,
                              const opf_tensor *dy, int64_t H, int n_saved)
{
    opf_status st = opf_norm_check_saved(ctx, op, octx, n_saved);
    if (!st) st = opf_norm_check_input(ctx, op, "gradient", dy, H);
    if (st) return st;
    int64_t nd = opf_spec_numel(&dy->spec), nx = opf_spec_numel(&octx->saved[0].spec);
    if (nd != nx)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s \"%s\": gradient has %lld elements, the input had %lld",
                         class_name(op), opf_op_name(op), (long long)nd, (long long)nx);
    return OPF_OK;
}

void opf_norm_save(opf_op_ctx *octx, const opf_tensor *x, const opf_tensor *aux, int n_aux)
{
    opf_tensor_retain(x, &octx->saved[0]);
    for (int i = 0; i < n_aux; i++) opf_tensor_retain(&aux[i], &octx->saved[1 + i]);
    octx->n_saved = 1 + n_aux;
}
