/* exec.c: eager forward and backward of a seq: plan cache, neighbour
 * quantizers, channel routing, early stop, delayed-scaling updates. */
#include <stdio.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "fuser/walk-impl.h"
#include "quant/quant-impl.h"

opf_seq_call opf_seq_call_default(void)
{
    opf_seq_call c;
    memset(&c, 0, sizeof c);
    c.requires_grad = true;
    c.input_requires_grad = true;
    return c;
}

/* First basic op whose backward must run (the anchor's rule). */
int opf_seq_first_req(const opf_seq *seq, const opf_seq_call *call)
{
    if (!call->requires_grad) return seq->n;
    if (call->input_requires_grad) return 0;
    for (int i = 0; i < seq->n; i++) {
        const opf_op *op = seq->ops[i];
        for (int p = 0; p < op->n_params; p++)
            if (op->params[p].requires_grad) return i;
        for (int j = 0; j < op->n_extra_in; j++)
            if (seq->in_src[i * OPF_OP_MAX_EXTRA + j].op < 0) return i;  /* public input: may need grad */
    }
    return seq->n;
}

/* Recipes are equal when every field of the recipe's table is (the
 * factory by identity). */
bool opf_recipe_same(const opf_recipe *a, const opf_recipe *b)
{
    return opf_schema_equal(&opf_recipe_schema, a, b);
}

/* Plan cache (as the anchor's fuser keeps one). The key is the recipe (kind, format, history
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
    if (reset) opf_seq_drop_plans(seq, false);  /* the fusion functions see the recipe */
    if (reset || !seq->planned || first_req != seq->key_first_req) {
        opf_status st = opf_seq_use_plans(seq, first_req);
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

void opf_seq_release_staged(opf_seq *seq)
{
    for (int i = 0; seq->param_off && i < seq->param_off[seq->n]; i++) opf_tensor_release(&seq->pgrad[i]);
}

static void release_pending(opf_seq *seq)
{
    opf_seq_release_staged(seq);
    for (int i = 0; i < seq->n; i++) opf_op_ctx_clear(&seq->octx[i]), seq->rc_kw[i] = NULL;
    for (int g = 0; g < seq->n_groups; g++) opf_tensor_release(&seq->groups[g].rc_x);
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

void opf_seq_update_delayed(opf_seq *seq, bool backward)
{
    enum { CHUNK = 256 };  /* one batched update of every op's state (in chunks) */
    opf_delayed_state *st[CHUNK];
    int n = 0;
    for (int i = 0; i < seq->n; i++) {
        if (n == CHUNK) opf_delayed_states_update(seq->ctx, st, n), n = 0;
        opf_delayed_state *ds = opf_recipe_state_delayed(seq->ops[i]->rs, backward);
        if (ds) st[n++] = ds;
    }
    if (n) opf_delayed_states_update(seq->ctx, st, n);
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
    size_t mark = opf_ctx_scratch_mark(ctx);  /* quantized gradients are decoded there */
    opf_status st = opf_op_add(ctx, "seq: channel gradient sum", a, b, out);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

/* acc += g: acc takes a reference to g when empty, else a new fp32 sum in
 * acc's dtype. */
static opf_status add_grad(opf_walker *w, opf_tensor *acc, const opf_tensor *g)
{
    opf_ctx *ctx = w->seq->ctx;
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

/* ---- the eager visitor of the seq walker: the ops' own runners ---- */

void opf_seq_check_finite(opf_seq *seq, bool enabled)
{
    if (seq) seq->check_finite = enabled;
}

/* True when a plain tensor holds a NaN or an infinity: the optimizer's
 * check pass (backend/optim.h) over it, its verdict read back from a
 * device; quantized tensors are not looked at. */
static bool nonfinite(opf_ctx *ctx, const opf_tensor *t)
{
    opf_dtype dt = t->spec.dtype;
    opf_device dev = t->spec.device;
    if (!t->data[0] || t->spec.scaling != OPF_SCALING_NONE ||
        (dt != OPF_F32 && dt != OPF_BF16 && dt != OPF_F16))
        return false;
    const opf_optim_kernels *k = opf_backend_kernels(ctx, "opf_seq_check_finite", dev, OPF_KERNELS_OPTIM);
    opf_optim_tensor ot = {.grad = t->data[0], .grad_dtype = dt, .n = opf_spec_numel(&t->spec)};
    int32_t found = 0;
    size_t mark = opf_ctx_scratch_mark(ctx);
    int32_t *flag = dev == OPF_DEVICE_CPU ? &found : (int32_t *)opf_op_scratch_on(ctx, dev, 1);
    if (k && flag && !k->check(ctx, &ot, 1, flag) && flag != &found) {
        opf_spec sp = opf_spec_make(1, (int64_t[]){1}, OPF_F32);
        opf_tensor d, h;
        sp.device = dev;
        opf_tensor_wrap(&sp, flag, &d);
        sp.device = OPF_DEVICE_CPU;
        opf_tensor_wrap(&sp, &found, &h);
        opf_tensor_copy(ctx, &d, &h);
    }
    opf_ctx_scratch_pop(ctx, mark);
    return found != 0;
}

/* OPF_ERR_STATE naming the entry's op and the tensor when t is not finite. */
static opf_status check_finite(opf_walker *w, const opf_plan_entry *e, const char *what, int k,
                               const opf_tensor *t)
{
    if (!w->seq->check_finite || !nonfinite(w->seq->ctx, t)) return OPF_OK;
    return opf_error(w->seq->ctx, OPF_ERR_STATE, "seq: op %d (%s \"%s\"): %s %d holds a NaN or "
                     "an infinity (opf_seq_check_finite)", e->first, e->op->cls->name,
                     opf_op_name(e->op), what, k);
}

static opf_status run_forward(opf_walker *w, const opf_plan_entry *e, const opf_fwd_env *env,
                              opf_tensor *outs)
{
    opf_status st = opf_op_forward(e->op, env, &w->seq->octx[e->first], outs);
    for (int k = 0; !st && w->seq->check_finite && k <= e->op->n_extra_out; k++)
        if ((st = check_finite(w, e, "forward output", k, &outs[k])))
            for (int j = 0; j <= e->op->n_extra_out; j++) opf_tensor_release(&outs[j]);
    return st;
}

/* The op's parameter gradients are staged (committed by opf_seq_backward
 * once the whole walk has run) and its saved context kept, so that a
 * refused backward can be taken back; only a recompute span's contexts go
 * at once (a retry re-runs the span from its kept input). */
static opf_status run_backward(opf_walker *w, const opf_plan_entry *e, const opf_bwd_env *env,
                               opf_tensor *dx, opf_tensor *dextra_in)
{
    opf_seq *seq = w->seq;
    opf_op_ctx *octx = &seq->octx[e->first];
    opf_status st = opf_op_backward_staged(e->op, octx, env, dx, dextra_in,
                                           &seq->pgrad[seq->param_off[e->first]]);
    if (!st && seq->check_finite && (st = check_finite(w, e, "backward input gradient", 0, dx))) {
        opf_tensor_release(dx);
        for (int k = 0; k < e->op->n_extra_in; k++) opf_tensor_release(&dextra_in[k]);
        return st;
    }
    if (!st && seq->rc_of[e->first] >= 0)
        for (int k = 0; k < opf_op_num_basic(e->op); k++) opf_op_ctx_clear(&octx[k]);
    return st;
}

/* Recompute (recompute.c): MARK keeps the forward's kwargs for the re-run,
 * DROP frees what the span's ops saved. */
static opf_status run_recompute(opf_walker *w, int g, opf_rc_phase phase)
{
    opf_seq *seq = w->seq;
    const opf_group *gr = &seq->groups[g];
    for (int i = gr->first; i < gr->first + gr->count; i++) {
        if (phase == OPF_RC_MARK) seq->rc_kw[i] = w->kwargs ? w->kwargs[i] : NULL;
        if (phase == OPF_RC_DROP) opf_op_ctx_clear(&seq->octx[i]);
    }
    return opf_seq_recompute_state(seq, g, phase);
}

static const opf_walk_i eager_walk = {run_forward, run_backward, add_grad, run_recompute};

/* What a call may change before it is known to succeed, kept at its start
 * (no allocation, a few floats per op): the Philox offset, and row 0 of the
 * amax histories of the direction that records amaxes. A refused call puts
 * both back; gradients are staged and saved contexts kept (run_backward),
 * so nothing else needs taking back. */
typedef struct call_mark {
    uint64_t seed, offset;
    bool     backward;
} call_mark;

static void each_delayed(opf_seq *seq, bool backward, void (*fn)(opf_delayed_state *))
{
    for (int i = 0; i < seq->n; i++)
        if (seq->ops[i]->rs) fn(opf_recipe_state_delayed(seq->ops[i]->rs, backward));
}

static call_mark mark_call(opf_seq *seq, bool backward)
{
    call_mark m = {.backward = backward};
    opf_ctx_get_rng(seq->ctx, &m.seed, &m.offset);
    each_delayed(seq, backward, opf_delayed_state_keep_row0);
    return m;
}

static void rollback_call(opf_seq *seq, const call_mark *m)
{
    opf_ctx_set_rng(seq->ctx, m->seed, m->offset);
    each_delayed(seq, m->backward, opf_delayed_state_rollback_row0);
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
    opf_walker w = {.seq = seq, .vt = &eager_walk, .first_req = first_req, .kwargs = call->kwargs,
                    .extra_in = call->extra_in, .chan = seq->chan, .chan_grad = seq->chan_grad};
    call_mark m = mark_call(seq, false);
    if ((st = opf_walk_forward(&w, x, y))) {
        release_pending(seq);
        rollback_call(seq, &m);
        return st;
    }
    if (extra_out) opf_walk_extra_out(&w, extra_out);
    if (call->requires_grad) {
        seq->pending = first_req < seq->n;
        seq->y_spec = y->spec;
        opf_seq_update_delayed(seq, false);
    }
    if (!seq->pending) release_pending(seq);
    return OPF_OK;
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
    char what[96];  /* the output dy belongs to: the last op's */
    snprintf(what, sizeof what, "dy of \"%s\"", seq->n ? opf_op_name(seq->ops[seq->n - 1]) : "");
    opf_status st = opf_grad_check(seq->ctx, fn, what, dy, &seq->y_spec);
    if (st) return st;
    opf_walker w = {.seq = seq, .vt = &eager_walk, .first_req = seq->first_req,
                    .kwargs = seq->rc_kw, .chan = seq->chan, .chan_grad = seq->chan_grad};
    opf_tensor d;
    memset(&d, 0, sizeof d);
    call_mark m = mark_call(seq, true);
    st = opf_walk_backward(&w, dy, dextra_out, &d, dextra_in);
    for (int i = 0; !st && i < seq->n; i++)  /* plain gradients: no allocation, cannot fail */
        st = opf_op_commit_grads(seq->ctx, seq->ops[i], &seq->pgrad[seq->param_off[i]]);
    if (st) {  /* the forward stays: the backward may be retried */
        opf_tensor_release(&d);
        for (int i = 0; i < seq->n; i++)  /* what is not committed, grads written in place too */
            opf_op_unstage_grads(seq->ctx, seq->ops[i], &seq->pgrad[seq->param_off[i]]);
        for (int i = 0; i < seq->n * OPF_OP_MAX_EXTRA; i++) opf_tensor_release(&seq->chan_grad[i]);
        for (int i = 0; dextra_in && i < seq->n_pub_in; i++) opf_tensor_release(&dextra_in[i]);
        rollback_call(seq, &m);
        return st;
    }
    if (dx) *dx = d;
    else opf_tensor_release(&d);
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
            opf_op_zero(seq->ctx, "opf_seq_zero_grad", &pr->main_grad);
        }
    }
}

void opf_seq_for_each_param(opf_seq *seq, void (*fn)(void *user, opf_op *op, opf_param *p),
                            void *user)
{
    for (int i = 0; i < seq->n; i++)
        for (int p = 0; p < seq->ops[i]->n_params; p++) fn(user, seq->ops[i], &seq->ops[i]->params[p]);
}
