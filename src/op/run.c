/* run.c: eager execution of one op through its class, shared by the fuser
 * and by anyone running a single op. Allocation happens here, from the
 * fakes' specs, never inside *_impl. */
#include <stdio.h>
#include <string.h>

#include "backend/elem.h"
#include "core/core-impl.h"
#include "op/op-impl.h"

static void release_all(opf_tensor *t, int n)
{
    for (int i = 0; i < n; i++) opf_tensor_release(&t[i]);
}

/* Allocates tensors for every spec that is present (ndim >= 0). */
static opf_status alloc_specs(opf_ctx *ctx, const opf_spec *specs, opf_tensor *t, int n)
{
    for (int i = 0; i < n; i++) {
        memset(&t[i], 0, sizeof t[i]);
        if (specs[i].ndim < 0) continue;
        opf_status st = opf_tensor_alloc(ctx, &specs[i], &t[i]);
        if (st) {
            release_all(t, i);
            return st;
        }
    }
    return OPF_OK;
}

static void none_specs(opf_spec *s, int n)
{
    memset(s, 0, sizeof *s * (size_t)n);
    for (int i = 0; i < n; i++) s[i].ndim = OPF_SPEC_NONE_NDIM;
}

static bool any_spec(const opf_spec *s, int n)
{
    for (int i = 0; i < n; i++)
        if (s[i].ndim >= 0) return true;
    return false;
}

/* Fakes describe shapes and formats; the device is the call's: every
 * present spec lives where the op's input (x forward, dy backward) lives,
 * but for the host-resident ones a fake marks OPF_SPEC_HOST. */
static void on_device(opf_spec *s, int n, opf_device dev)
{
    for (int i = 0; i < n; i++)
        if (s[i].ndim >= 0 && !(s[i].flags & OPF_SPEC_HOST)) s[i].device = dev;
}

opf_status opf_op_trace_forward(opf_op *op, const opf_fwd_env *env, void *args, opf_spec *out_s,
                                opf_spec *aux_s)
{
    const opf_op_class *c = op->cls;
    opf_ctx *ctx = env->ctx;
    if (!c->forward_impl)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: the op has no forward (backward-only fusion)",
                         op->name);
    opf_fwd_env own;  /* opf_op_set_recipe: the op's recipe replaces the call's */
    if (opf_op_has_recipe(op, NULL)) own = *env, own.recipe = opf_op_recipe_for(op, env->recipe), env = &own;
    memset(args, 0, c->fwd_schema->size);
    opf_status st = c->resolve_fwd(op, env, args);
    if (st) return st;
    if ((st = opf_schema_validate(c->fwd_schema, args)))
        return opf_error(ctx, st, "%s: %s", op->name, opf_last_error(NULL));
    none_specs(out_s, 1 + OPF_OP_MAX_EXTRA);
    none_specs(aux_s, OPF_OP_MAX_AUX);
    if (c->forward_fake && (st = c->forward_fake(args, out_s, aux_s)))
        return opf_error(ctx, st, "%s: %s", op->name, opf_last_error(NULL));
    opf_device dev = env->x ? env->x->spec.device : opf_ctx_device(ctx);
    on_device(out_s, 1 + OPF_OP_MAX_EXTRA, dev);
    on_device(aux_s, OPF_OP_MAX_AUX, dev);
    return c->after_fake ? c->after_fake(op, env, args, out_s, aux_s) : OPF_OK;
}

opf_status opf_op_save_context(opf_op *op, const opf_fwd_env *env, opf_op_ctx *octx,
                               const void *args, const opf_tensor *outs, const opf_tensor *aux)
{
    int n_ctx = opf_op_num_basic(op);
    for (int k = 0; k < n_ctx; k++) {
        opf_op_ctx_clear(&octx[k]);
        octx[k].requires_grad = true;
    }
    /* the dx quantizer of a fused op belongs to its first basic op */
    octx->prev_grad_q = env->prev_grad_q ? *env->prev_grad_q : opf_quantizer_default();
    opf_status st = OPF_OK;
    if (op->cls->setup_context) {
        st = op->cls->setup_context(op, octx, args, outs, aux);
    } else {  /* default: keep the aux outputs */
        for (int i = 0; i < OPF_OP_MAX_AUX; i++)
            if (aux[i].data[0] || aux[i].data[OPF_COMP_COL_DATA])
                opf_tensor_retain(&aux[i], &octx->saved[octx->n_saved++]);
    }
    for (int k = 0; k < n_ctx; k++) octx[k].valid = !st;
    return st;
}

bool opf_op_outputs_are(const opf_op *op, bool backward, const opf_tensor *in, const opf_spec *s,
                        int n, const opf_spec *aux)
{
    if (!(backward ? op->cls->backward_is_dy : op->cls->forward_is_input) || !in) return false;
    if (backward && opf_op_num_params(op) > 0) return false;  /* a parameter's gradient is no dy */
    if (aux && any_spec(aux, OPF_OP_MAX_AUX)) return false;   /* nothing kept beside x */
    for (int i = 0; i < n; i++)
        if (s[i].ndim >= 0 && !opf_spec_equal(&s[i], &in->spec)) return false;
    return true;
}

/* forward_is_input: each present output a reference to x, no call. */
static opf_status forward_alias(opf_op *op, const opf_fwd_env *env, opf_op_ctx *octx,
                                const opf_spec *out_s, opf_tensor *outs)
{
    int n_out = 1 + op->n_extra_out;
    opf_tensor aux[OPF_OP_MAX_AUX];
    memset(aux, 0, sizeof aux);
    for (int i = 0; i < n_out; i++) {
        memset(&outs[i], 0, sizeof outs[i]);
        if (out_s[i].ndim >= 0) opf_tensor_retain(env->x, &outs[i]);
    }
    opf_status st = env->requires_grad && octx
                        ? opf_op_save_context(op, env, octx, op->fwd_args, outs, aux) : OPF_OK;
    if (st) release_all(outs, n_out);
    return st;
}

opf_status opf_op_forward(opf_op *op, const opf_fwd_env *env, opf_op_ctx *octx, opf_tensor *outs)
{
    opf_ctx *ctx = env->ctx;
    int n_out = 1 + op->n_extra_out;
    opf_spec out_s[1 + OPF_OP_MAX_EXTRA], aux_s[OPF_OP_MAX_AUX];
    opf_status st = opf_op_trace_forward(op, env, op->fwd_args, out_s, aux_s);
    if (st) return st;
    /* x's buffer counted: the outputs are references that keep it alive
     * (wrapped caller memory gets the impl's copies) */
    if (env->x && env->x->buf && opf_op_outputs_are(op, false, env->x, out_s, n_out, aux_s))
        return forward_alias(op, env, octx, out_s, outs);
    opf_tensor aux[OPF_OP_MAX_AUX];
    if ((st = alloc_specs(ctx, out_s, outs, n_out))) return st;
    if ((st = alloc_specs(ctx, aux_s, aux, OPF_OP_MAX_AUX))) {
        release_all(outs, n_out);
        return st;
    }
    size_t mark = opf_ctx_scratch_mark(ctx);
    st = op->cls->forward_impl(ctx, op->fwd_args, outs, aux);
    opf_ctx_scratch_pop(ctx, mark);
    if (!st && env->requires_grad && octx) st = opf_op_save_context(op, env, octx, op->fwd_args, outs, aux);
    release_all(aux, OPF_OP_MAX_AUX);
    if (st) release_all(outs, n_out);
    return st;
}

opf_status opf_param_accumulate(opf_ctx *ctx, opf_param *p, const opf_tensor *g)
{
    int64_t n = opf_spec_numel(&p->grad.spec);
    if (opf_spec_numel(&g->spec) != n)
        return opf_error(ctx, OPF_ERR_SHAPE, "param \"%s\": gradient has %lld elements, want %lld",
                         p->name, (long long)opf_spec_numel(&g->spec), (long long)n);
    if (g->data[0] == p->grad.data[0]) {  /* written in place (direct_grads) */
        p->has_grad = true;
        return OPF_OK;
    }
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_status st;
    if (p->has_grad) {  /* summed in fp32, rounded once into the gradient's dtype */
        st = opf_op_add(ctx, p->name, &p->grad, g, &p->grad);
    } else {
        const struct opf_elem_kernels *k = opf_op_elem(ctx, p->name, &p->grad);
        st = k ? k->cast(ctx, g, &p->grad) : OPF_ERR_UNSUPPORTED;
    }
    opf_ctx_scratch_pop(ctx, mark);
    p->has_grad |= !st;
    return st;
}

opf_status opf_grad_check(opf_ctx *ctx, const char *fn, const char *what, const opf_tensor *g,
                          const opf_spec *want)
{
    if (!g) return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s is NULL", fn, what);
    if (!g->data[0] && !g->data[OPF_COMP_COL_DATA])
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s has no data", fn, what);
    opf_dtype dt = g->spec.dtype;
    if (dt != OPF_F32 && dt != OPF_BF16 && dt != OPF_F16)
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: %s: gradient dtype %s, expected f32/bf16/f16",
                         fn, what, opf_dtype_name(dt));
    bool same = !want || (g->spec.ndim == want->ndim && g->spec.device == want->device);
    for (int i = 0; want && same && i < want->ndim; i++) same = g->spec.shape[i] == want->shape[i];
    if (same) return OPF_OK;
    char got[160], out[160];
    opf_spec_str(&g->spec, got, sizeof got);
    opf_spec_str(want, out, sizeof out);
    return opf_error(ctx, OPF_ERR_SHAPE, "%s: %s is %s on %s, the output was %s on %s", fn, what,
                     got, opf_device_name(g->spec.device), out, opf_device_name(want->device));
}

opf_status opf_op_trace_backward(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                                 void *bargs, opf_spec *gs, int *n_grads)
{
    const opf_op_class *c = op->cls;
    opf_ctx *ctx = env->ctx;
    int n_ctx = opf_op_num_basic(op), n_params = opf_op_num_params(op);
    bool valid = octx != NULL;
    for (int k = 0; valid && k < n_ctx; k++) valid = octx[k].valid;
    if (!valid)
        return opf_error(ctx, OPF_ERR_STATE, "%s: backward without a forward that saved for it "
                         "(forward not run, run without requires_grad, or backward already done)",
                         op->name);
    if (!c->backward_impl)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: the op has no backward", op->name);
    int n = 1 + n_params + op->n_extra_in;
    if (n > OPF_OP_MAX_GRADS)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: %d gradients exceed %d", op->name, n,
                         OPF_OP_MAX_GRADS);
    memset(bargs, 0, c->bwd_schema->size);
    opf_status st = c->resolve_bwd(op, octx, env, bargs);
    if (st) return st;
    none_specs(gs, n);
    if (c->backward_fake && (st = c->backward_fake(bargs, gs)))
        return opf_error(ctx, st, "%s: %s", op->name, opf_last_error(NULL));
    on_device(gs, n, env->dy ? env->dy->spec.device : opf_ctx_device(ctx));
    *n_grads = n;
    return OPF_OK;
}

/* Written in place, the commit only sets has_grad where it used to copy
 * the gradient in (a full pass over each weight a step; on the GPU a copy
 * and its host call). */
bool opf_param_grad_in_place(const opf_param *p, const opf_spec *s)
{
    return p->requires_grad && !p->has_grad && p->grad.data[0] && s->ndim >= 0 &&
           opf_spec_equal(s, &p->grad.spec);
}

void opf_param_unwrite_grad(opf_ctx *ctx, opf_param *p, const opf_tensor *g)
{
    if (g->data[0] && g->data[0] == p->grad.data[0] && !p->has_grad)
        opf_op_zero(ctx, p->name, &p->grad);
}

/* Marks the parameters whose gradients go into grad itself and sets their
 * specs none (not allocated; the caller hands grad to the backward). */
static void direct_grads(opf_op *op, opf_spec *gs, bool *direct)
{
    for (int i = 0; i < opf_op_num_params(op); i++) {
        direct[i] = opf_param_grad_in_place(opf_op_param(op, i), &gs[1 + i]);
        if (direct[i]) gs[1 + i].ndim = OPF_SPEC_NONE_NDIM;
    }
}

void opf_op_unstage_grads(opf_ctx *ctx, opf_op *op, opf_tensor *pgrad)
{
    for (int i = 0; i < opf_op_num_params(op); i++) {
        opf_param_unwrite_grad(ctx, opf_op_param(op, i), &pgrad[i]);
        opf_tensor_release(&pgrad[i]);
    }
}

opf_status opf_op_backward_staged(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                                  opf_tensor *dx, opf_tensor *dextra_in, opf_tensor *pgrad)
{
    opf_ctx *ctx = env->ctx;
    int n_params = opf_op_num_params(op), n;
    opf_spec gs[OPF_OP_MAX_GRADS];
    char fn[112];
    snprintf(fn, sizeof fn, "%s \"%s\"", op->cls->name, op->name);
    opf_status st = opf_grad_check(ctx, fn, "dy", env->dy, NULL);
    if (st || (st = opf_op_trace_backward(op, octx, env, op->bwd_args, gs, &n))) return st;
    bool pass = gs[0].ndim == OPF_GRAD_PASSTHROUGH;
    if (pass) gs[0].ndim = OPF_SPEC_NONE_NDIM;
    opf_tensor g[OPF_OP_MAX_GRADS];
    /* backward_is_dy over a counted dy: references, no call */
    if (env->dy && env->dy->buf && opf_op_outputs_are(op, true, env->dy, gs, n, NULL)) {
        for (int i = 0; i < n; i++) {
            memset(&g[i], 0, sizeof g[i]);
            if (gs[i].ndim >= 0) opf_tensor_retain(env->dy, &g[i]);
        }
    } else {
        bool direct[OPF_OP_MAX_GRADS];
        direct_grads(op, gs, direct);
        if ((st = alloc_specs(ctx, gs, g, n))) return st;
        for (int i = 0; i < n_params; i++)
            if (direct[i]) opf_tensor_retain(&opf_op_param(op, i)->grad, &g[1 + i]);
        size_t mark = opf_ctx_scratch_mark(ctx);
        st = op->cls->backward_impl(ctx, op->bwd_args, g);
        opf_ctx_scratch_pop(ctx, mark);
        if (st) {
            for (int i = 0; i < n_params; i++)
                if (direct[i]) opf_param_unwrite_grad(ctx, opf_op_param(op, i), &g[1 + i]);
            release_all(g, n);
            return st;
        }
    }
    if (pass) opf_tensor_retain(env->dy, dx);
    else *dx = g[0];
    for (int i = 0; i < n_params; i++) {
        bool keep = g[1 + i].data[0] && opf_op_param(op, i)->requires_grad;
        if (keep) pgrad[i] = g[1 + i];
        else opf_tensor_release(&g[1 + i]), memset(&pgrad[i], 0, sizeof pgrad[i]);
    }
    for (int i = 0; i < op->n_extra_in; i++) dextra_in[i] = g[1 + n_params + i];
    return OPF_OK;
}

opf_status opf_op_commit_grads(opf_ctx *ctx, opf_op *op, opf_tensor *pgrad)
{
    opf_status st = OPF_OK;
    for (int i = 0; i < opf_op_num_params(op); i++) {
        if (!st && pgrad[i].data[0]) st = opf_param_accumulate(ctx, opf_op_param(op, i), &pgrad[i]);
        else if (st) opf_param_unwrite_grad(ctx, opf_op_param(op, i), &pgrad[i]);
        opf_tensor_release(&pgrad[i]);
    }
    return st;
}

opf_status opf_op_backward(opf_op *op, opf_op_ctx *octx, const opf_bwd_env *env, opf_tensor *dx,
                           opf_tensor *dextra_in)
{
    opf_tensor pg[OPF_OP_MAX_GRADS], d, dxi[OPF_OP_MAX_EXTRA];
    memset(&d, 0, sizeof d);
    opf_status st = opf_op_backward_staged(op, octx, env, &d, dxi, pg);
    if (st) return st;
    if ((st = opf_op_commit_grads(env->ctx, op, pg))) {  /* pg released */
        opf_tensor_release(&d);
        for (int i = 0; i < op->n_extra_in; i++) opf_tensor_release(&dxi[i]);
        return st;
    }
    *dx = d;
    for (int i = 0; i < op->n_extra_in; i++) dextra_in[i] = dxi[i];
    for (int k = 0; k < opf_op_num_basic(op); k++) opf_op_ctx_clear(&octx[k]);
    return OPF_OK;
}

void opf_op_zero_grad(opf_op *op)
{
    for (int i = 0; i < opf_op_num_params(op); i++) {
        opf_param *p = opf_op_param(op, i);
        opf_op_zero(op->ctx, op->name, &p->grad);
        p->has_grad = false;
    }
}
