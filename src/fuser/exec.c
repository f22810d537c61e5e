/* exec.c: eager forward and backward of a seq: plan cache, neighbour
 * quantizers, channel routing, early stop, delayed-scaling updates. */
#include <string.h>

#include "fuser/fuser-impl.h"

opf_seq_call opf_seq_call_default(void)
{
    opf_seq_call c;
    memset(&c, 0, sizeof c);
    c.requires_grad = true;
    c.input_requires_grad = true;
    return c;
}

/* First basic op whose backward must run (te-ops.md 3.2). */
int opf_seq_first_req(const opf_seq *seq, const opf_seq_call *call)
{
    if (!call->requires_grad) return seq->n;
    if (call->input_requires_grad) return 0;
    for (int i = 0; i < seq->n; i++) {
        const opf_op *op = seq->ops[i];
        for (int p = 0; p < op->n_params; p++)
            if (op->params[p].requires_grad) return i;
        for (int j = 0; j < op->cls->n_extra_in; j++)
            if (seq->in_src[i * OPF_OP_MAX_EXTRA + j].op < 0) return i;  /* public input: may need grad */
    }
    return seq->n;
}

/* Recipes are equal when every value field is (the factory by identity). */
bool opf_recipe_same(const opf_recipe *a, const opf_recipe *b)
{
    if (!a || !b) return a == b;
    return a->kind == b->kind && a->format == b->format && a->margin == b->margin &&
           a->amax_history_len == b->amax_history_len && a->amax_algo == b->amax_algo &&
           a->reduce_amax == b->reduce_amax && a->power_2_scales == b->power_2_scales &&
           a->amax_epsilon == b->amax_epsilon && a->x_block_dim == b->x_block_dim &&
           a->w_block_dim == b->w_block_dim && a->grad_block_dim == b->grad_block_dim &&
           a->mxfp8_2d_weights == b->mxfp8_2d_weights && a->nvfp4_rht == b->nvfp4_rht &&
           a->nvfp4_stochastic == b->nvfp4_stochastic && a->nvfp4_2d_weights == b->nvfp4_2d_weights &&
           a->factory == b->factory && a->factory_user == b->factory_user &&
           a->backward_override == b->backward_override;
}

/* Plan cache (te-ops.md 3.3). The key is the recipe (kind, format, history
 * length, backward override and every other field: a different one needs
 * other quantizers or other fusions) and
 * the first op needing backward. A new recipe resets every op's recipe state
 * and rebuilds the plans; a new first op rebuilds the plans only. */
opf_status opf_seq_prepare_plans(opf_seq *seq, const opf_seq_call *call, int first_req)
{
    if (call->recipe) {
        opf_status st = opf_recipe_validate(call->recipe);
        if (st) return opf_error(seq->ctx, st, "seq: %s", opf_last_error(NULL));
    }
    bool reset = !seq->key_valid || !opf_recipe_same(seq->has_recipe ? &seq->recipe : NULL, call->recipe);
    if (reset) {
        seq->key_valid = false;
        for (int i = 0; i < seq->n; i++) {
            opf_status st = opf_op_reset_recipe(seq->ctx, seq->ops[i], call->recipe);
            if (st) return st;
        }
        /* the fusion functions see this call's recipe */
        seq->has_recipe = call->recipe != NULL;
        if (call->recipe) seq->recipe = *call->recipe;
        seq->key_valid = true;
        seq->epoch++;
    }
    if (reset || !seq->planned || first_req != seq->key_first_req) {
        opf_status st = opf_seq_plan_build(seq);
        if (st) return st;
    }
    seq->key_first_req = first_req;
    return OPF_OK;
}

opf_status opf_seq_prepare(opf_seq *seq, const opf_recipe *recipe)
{
    OPF_CHECK_NULL(NULL, "opf_seq_prepare", seq);
    if (seq->pending)
        return opf_error(seq->ctx, OPF_ERR_STATE, "opf_seq_prepare: a backward is pending; run "
                         "opf_seq_backward or opf_seq_discard first");
    opf_status st = opf_seq_build(seq);
    if (st) return st;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = recipe;
    if ((st = opf_seq_prepare_plans(seq, &call, seq->n))) return st;
    seq->key_first_req = -1;  /* the next forward sets it and rebuilds the plans only */
    return OPF_OK;
}

/* The neighbours' quantizers of the basic ops [first, last]: q[0] the
 * previous op's grad-output quantizer, q[1] the next op's input quantizer
 * (te-ops.md 3.7: basic-op neighbours, even inside another fused op). */
void opf_seq_neighbour_quantizers(const opf_seq *seq, int first, int last, opf_quantizer q[2],
                                  const opf_quantizer *p[2])
{
    p[0] = p[1] = NULL;
    if (first > 0 && seq->ops[first - 1]->cls->grad_output_quantizer) {
        const opf_quantizer *g = seq->ops[first - 1]->cls->grad_output_quantizer(seq->ops[first - 1]);
        if (g) q[0] = *g, p[0] = &q[0];
    }
    if (last + 1 < seq->n && seq->ops[last + 1]->cls->input_quantizer) {
        const opf_quantizer *n = seq->ops[last + 1]->cls->input_quantizer(seq->ops[last + 1]);
        if (n) q[1] = *n, p[1] = &q[1];
    }
}

void opf_seq_entry_env(const opf_seq *seq, const opf_plan_entry *e, int first_req,
                       const void *const *kwargs, opf_quantizer qv[2], const void *kw[OPF_FUSED_MAX],
                       opf_fwd_env *env)
{
    int first = e->first, last = e->first + e->count - 1;
    const opf_quantizer *qp[2];
    opf_seq_neighbour_quantizers(seq, first, last, qv, qp);
    for (int k = 0; k < OPF_FUSED_MAX; k++) kw[k] = kwargs && k < e->count ? kwargs[first + k] : NULL;
    memset(env, 0, sizeof *env);
    env->ctx = seq->ctx;
    env->prev_grad_q = qp[0];
    env->next_input_q = qp[1];
    env->recipe = seq->has_recipe ? &seq->recipe : NULL;
    env->requires_grad = last >= first_req;
    env->first_requires_grad = env->requires_grad && first_req > first ? first_req - first : 0;
    env->kwargs = opf_op_is_fused(e->op) ? (const void *)kw : kw[0];
}

static void release_pending(opf_seq *seq)
{
    for (int i = 0; i < seq->n; i++) opf_op_ctx_clear(&seq->octx[i]);
    for (int i = 0; i < seq->n * OPF_OP_MAX_EXTRA; i++) {
        opf_tensor_release(&seq->chan[i]);
        opf_tensor_release(&seq->chan_grad[i]);
    }
    seq->pending = false;
}

void opf_seq_discard(opf_seq *seq)
{
    if (seq && seq->built) release_pending(seq);
}

static opf_status check_call(opf_seq *seq, const opf_tensor *x, const opf_seq_call *call)
{
    const char *fn = "opf_seq_forward";
    OPF_CHECK_NULL(seq->ctx, fn, x);
    OPF_CHECK_NULL(seq->ctx, fn, call);
    if (seq->n == 0) return opf_error(seq->ctx, OPF_ERR_STATE, "%s: the seq is empty", fn);
    if (call->requires_grad && seq->pending)
        return opf_error(seq->ctx, OPF_ERR_STATE,
                         "%s: the previous forward's backward has not run; call opf_seq_backward "
                         "or opf_seq_discard first", fn);
    if (call->n_extra_in != seq->n_pub_in)
        return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: %d extra inputs given, the seq takes %d",
                         fn, call->n_extra_in, seq->n_pub_in);
    if (call->n_extra_in && !call->extra_in)
        return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: extra_in is NULL", fn);
    return OPF_OK;
}

/* Runs one plan entry forward; *cur is replaced by its output. Extra inputs
 * produced inside the entry are left NULL: a fused op wires them itself. */
static opf_status forward_entry(opf_seq *seq, const opf_plan_entry *e, const opf_seq_call *call,
                                opf_tensor *cur, bool *cur_owned)
{
    opf_op *op = e->op;
    int first = e->first, last = e->first + e->count - 1;
    opf_quantizer qv[2];
    const void *kw[OPF_FUSED_MAX];
    opf_fwd_env env;
    opf_seq_entry_env(seq, e, seq->first_req, call->kwargs, qv, kw, &env);
    env.x = cur;
    int slot = 0;
    for (int i = first; i <= last; i++)
        for (int j = 0; j < seq->ops[i]->cls->n_extra_in; j++, slot++) {
            const opf_src *s = &seq->in_src[i * OPF_OP_MAX_EXTRA + j];
            env.extra_in[slot] = s->op < 0 ? &call->extra_in[s->pub]
                               : s->op >= first ? NULL
                               : &seq->chan[s->op * OPF_OP_MAX_EXTRA + s->slot];
        }
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA];
    opf_status st = opf_op_forward(op, &env, &seq->octx[first], outs);
    if (st) return st;
    if (*cur_owned) opf_tensor_release(cur);
    *cur = outs[0];
    *cur_owned = true;
    slot = 0;
    for (int i = first; i <= last; i++)
        for (int j = 0; j < seq->ops[i]->cls->n_extra_out; j++, slot++) {
            opf_tensor *c = &seq->chan[i * OPF_OP_MAX_EXTRA + j];
            opf_tensor_release(c);
            *c = outs[1 + slot];
        }
    return OPF_OK;
}

void opf_seq_update_delayed(opf_seq *seq, bool backward)
{
    for (int i = 0; i < seq->n; i++)
        if (seq->ops[i]->rs) opf_recipe_state_update(seq->ctx, seq->ops[i]->rs, backward, NULL, NULL);
}

opf_status opf_seq_forward(opf_seq *seq, const opf_tensor *x, const opf_seq_call *call,
                           opf_tensor *y, opf_tensor *extra_out)
{
    OPF_CHECK_NULL(NULL, "opf_seq_forward", seq);
    OPF_CHECK_NULL(seq->ctx, "opf_seq_forward", y);
    opf_status st = opf_seq_build(seq);
    if (st || (st = check_call(seq, x, call))) return st;
    if (!call->requires_grad && seq->pending)  /* inference between a forward and its backward */
        return opf_error(seq->ctx, OPF_ERR_STATE, "opf_seq_forward: a backward is pending");
    int first_req = opf_seq_first_req(seq, call);
    if ((st = opf_seq_prepare_plans(seq, call, first_req))) return st;
    seq->first_req = first_req;
    opf_tensor cur = *x;
    bool owned = false;
    for (int g = 0; g < seq->n_groups && !st; g++) {
        const opf_group *gr = &seq->groups[g];
        for (int k = 0; k < gr->n_fwd && !st; k++) st = forward_entry(seq, &gr->fwd[k], call, &cur, &owned);
    }
    if (st) {
        if (owned) opf_tensor_release(&cur);
        release_pending(seq);
        return st;
    }
    if (!owned) opf_tensor_retain(x, &cur);  /* cannot happen with n >= 1; keep the contract */
    *y = cur;
    if (extra_out)
        for (int i = 0; i < seq->n; i++)
            for (int j = 0; j < seq->ops[i]->cls->n_extra_out; j++) {
                int pub = seq->out_pub[i * OPF_OP_MAX_EXTRA + j];
                if (pub >= 0) opf_tensor_retain(&seq->chan[i * OPF_OP_MAX_EXTRA + j], &extra_out[pub]);
            }
    if (call->requires_grad) {
        seq->pending = first_req < seq->n;
        opf_seq_update_delayed(seq, false);
    }
    if (!seq->pending) release_pending(seq);
    return OPF_OK;
}

opf_spec opf_grad_sum_spec(const opf_spec *acc)
{
    opf_spec s = opf_spec_make(acc->ndim, acc->shape,
                               acc->scaling == OPF_SCALING_NONE ? acc->dtype : OPF_F32);
    s.device = acc->device;
    return s;
}

opf_status opf_grad_sum(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b, opf_tensor *out)
{
    int64_t n = opf_spec_numel(&a->spec);
    if (opf_spec_numel(&b->spec) != n || opf_spec_numel(&out->spec) != n)
        return opf_error(ctx, OPF_ERR_SHAPE, "seq: channel gradients of %lld and %lld elements",
                         (long long)n, (long long)opf_spec_numel(&b->spec));
    size_t mark = opf_ctx_scratch_mark(ctx);
    float *x = opf_op_scratch(ctx, n), *y = opf_op_scratch(ctx, n);
    const float *pa, *pb;
    opf_status st = x && y ? OPF_OK : opf_error(ctx, OPF_ERR_NO_MEMORY, "seq: no scratch");
    if (!st) st = opf_op_load_f32(ctx, a, x, &pa);
    if (!st) st = opf_op_load_f32(ctx, b, y, &pb);
    if (!st) {
        for (int64_t i = 0; i < n; i++) x[i] = pa[i] + pb[i];
        st = opf_convert(x, OPF_F32, out->data[0], out->spec.dtype, (size_t)n);
    }
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

/* acc += g: acc takes a reference to g when empty, else a new fp32 sum in
 * acc's dtype. */
static opf_status add_grad(opf_ctx *ctx, opf_tensor *acc, const opf_tensor *g)
{
    if (!g || (!g->data[0] && !g->data[OPF_COMP_COL_DATA])) return OPF_OK;
    if (!acc->data[0] && !acc->data[OPF_COMP_COL_DATA]) {
        opf_tensor_retain(g, acc);
        return OPF_OK;
    }
    opf_spec s = opf_grad_sum_spec(&acc->spec);
    opf_tensor sum;
    opf_status st = opf_tensor_alloc(ctx, &s, &sum);
    if (st) return st;
    if ((st = opf_grad_sum(ctx, acc, g, &sum))) {
        opf_tensor_release(&sum);
        return st;
    }
    opf_tensor_release(acc);
    *acc = sum;
    return OPF_OK;
}

/* Backward of one plan entry: dy in *cur (replaced by dx). Gradients of
 * extra outputs consumed inside the entry are the fused op's business. */
static opf_status backward_entry(opf_seq *seq, const opf_plan_entry *e, const opf_tensor *dextra_out,
                                 opf_tensor *cur, opf_tensor *dextra_in)
{
    opf_op *op = e->op;
    opf_ctx *ctx = seq->ctx;
    int first = e->first, last = e->first + e->count - 1;
    opf_quantizer qv[2];
    const opf_quantizer *qp[2];
    opf_seq_neighbour_quantizers(seq, first, last, qv, qp);
    opf_bwd_env env = {.ctx = ctx, .dy = cur, .prev_grad_q = qp[0]};
    opf_status st = OPF_OK;
    int slot = 0;
    for (int i = first; i <= last && !st; i++)
        for (int j = 0; j < seq->ops[i]->cls->n_extra_out && !st; j++, slot++) {
            opf_tensor *cg = &seq->chan_grad[i * OPF_OP_MAX_EXTRA + j];
            int pub = seq->out_pub[i * OPF_OP_MAX_EXTRA + j];
            if (pub >= 0 && dextra_out) st = add_grad(ctx, cg, &dextra_out[pub]);
            env.dextra_out[slot] = cg->data[0] || cg->data[OPF_COMP_COL_DATA] ? cg : NULL;
        }
    opf_tensor dx, dxi[OPF_OP_MAX_EXTRA];
    memset(dxi, 0, sizeof dxi);
    if (!st) st = opf_op_backward(op, &seq->octx[first], &env, &dx, dxi);
    if (st) return st;
    slot = 0;
    for (int i = first; i <= last; i++)
        for (int j = 0; j < seq->ops[i]->cls->n_extra_in; j++, slot++) {
            const opf_src *s = &seq->in_src[i * OPF_OP_MAX_EXTRA + j];
            if (s->op < 0) {
                if (dextra_in && !st) opf_tensor_retain(&dxi[slot], &dextra_in[s->pub]);
            } else if (s->op < first && !st) {
                st = add_grad(ctx, &seq->chan_grad[s->op * OPF_OP_MAX_EXTRA + s->slot], &dxi[slot]);
            }
            opf_tensor_release(&dxi[slot]);
        }
    opf_tensor_release(cur);
    *cur = dx;
    return st;
}

opf_status opf_seq_backward(opf_seq *seq, const opf_tensor *dy, const opf_tensor *dextra_out,
                            opf_tensor *dx, opf_tensor *dextra_in)
{
    const char *fn = "opf_seq_backward";
    OPF_CHECK_NULL(NULL, fn, seq);
    OPF_CHECK_NULL(seq->ctx, fn, dy);
    if (!seq->pending)
        return opf_error(seq->ctx, OPF_ERR_STATE,
                         "%s: no forward awaits a backward (run opf_seq_forward with requires_grad "
                         "first; each forward allows one backward)", fn);
    opf_tensor cur;
    opf_tensor_retain(dy, &cur);
    opf_status st = OPF_OK;
    if (dextra_in)
        for (int p = 0; p < seq->n_pub_in; p++) memset(&dextra_in[p], 0, sizeof *dextra_in);
    for (int g = seq->n_groups - 1; g >= 0 && !st; g--) {
        const opf_group *gr = &seq->groups[g];
        for (int k = gr->n_bwd - 1; k >= 0 && !st; k--) {
            const opf_plan_entry *e = &gr->bwd[k];
            if (e->first + e->count - 1 < seq->first_req) {  /* early stop: nothing before needs gradients */
                opf_tensor_release(&cur);
                g = -1;
                break;
            }
            st = backward_entry(seq, e, dextra_out, &cur, dextra_in);
        }
    }
    if (st) {
        opf_tensor_release(&cur);
        release_pending(seq);
        return st;
    }
    if (dx) *dx = cur;
    else opf_tensor_release(&cur);
    opf_seq_update_delayed(seq, true);
    release_pending(seq);
    return OPF_OK;
}

void opf_seq_zero_grad(opf_seq *seq)
{
    for (int i = 0; i < seq->n; i++) {
        opf_op_zero_grad(seq->ops[i]);
        for (int p = 0; p < seq->ops[i]->n_params; p++) {
            opf_param *pr = &seq->ops[i]->params[p];
            opf_layout L;
            if (pr->main_grad.data[0] && !opf_spec_layout(&pr->main_grad.spec, &L))
                memset(pr->main_grad.data[0], 0, L.comp[0].nbytes);
        }
    }
}

void opf_seq_for_each_param(opf_seq *seq, void (*fn)(void *user, opf_op *op, opf_param *p),
                            void *user)
{
    for (int i = 0; i < seq->n; i++)
        for (int p = 0; p < seq->ops[i]->n_params; p++) fn(user, seq->ops[i], &seq->ops[i]->params[p]);
}
