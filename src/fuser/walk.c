/* walk.c: the seq walker (walk-impl.h): entry envs, channel routing and the
 * backward's early stop, once for eager execution and tracing. */
#include <string.h>

#include "fuser/walk-impl.h"

/* The neighbours' quantizers (as the anchor's fuser: basic-op neighbours, even
 * inside another fused op). */
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

const void *opf_entry_kwargs(const opf_plan_entry *e, const void *const *kwargs,
                             const void *kw[OPF_FUSED_MAX])
{
    for (int k = 0; k < OPF_FUSED_MAX; k++) kw[k] = kwargs && k < e->count ? kwargs[e->first + k] : NULL;
    return opf_op_is_fused(e->op) ? (const void *)kw : kw[0];
}

void opf_seq_entry_env(const opf_seq *seq, const opf_plan_entry *e, int first_req, int save_from,
                       const void *const *kwargs, opf_quantizer qv[2], const void *kw[OPF_FUSED_MAX],
                       opf_fwd_env *env)
{
    int first = e->first, last = e->first + e->count - 1;
    const opf_quantizer *qp[2];
    opf_seq_neighbour_quantizers(seq, first, last, qv, qp);
    memset(env, 0, sizeof *env);
    env->ctx = seq->ctx;
    env->prev_grad_q = qp[0];
    env->next_input_q = qp[1];
    env->recipe = seq->has_recipe ? &seq->recipe : NULL;
    env->requires_grad = last >= save_from;
    int inside = first_req - first;  /* past the entry when it only saves for a later one */
    if (inside > e->count) inside = e->count;
    env->first_requires_grad = env->requires_grad && inside > 0 ? inside : 0;
    env->kwargs = opf_entry_kwargs(e, kwargs, kw);
}

static bool present(const opf_tensor *t) { return t->data[0] || t->data[OPF_COMP_COL_DATA]; }

/* Where extra input j of basic op i reads from: the caller's list, a
 * channel produced before the entry starting at `first`, or (produced
 * inside the entry) NULL: a fused op wires it itself. */
static const opf_tensor *extra_source(const opf_walker *w, int i, int j, int first)
{
    const opf_src *s = &w->seq->in_src[i * OPF_OP_MAX_EXTRA + j];
    if (s->op < 0) return &w->extra_in[s->pub];
    if (s->op >= first) return NULL;
    const opf_tensor *c = &w->chan[s->op * OPF_OP_MAX_EXTRA + s->slot];
    return present(c) ? c : NULL;
}

/* The first basic op whose forward must save for the backward: first_req,
 * or the first op of the backward plan entry that holds it, since a fused
 * backward resolves every op it covers (MakeExtraOutput + a norm, when the
 * seq's input needs no gradient and the norm is the first op with
 * parameters). The walk's early stop still begins at that entry; a fused
 * op that takes first_requires_grad (grouped_mlp) still gets first_req's
 * place in it. */
static int save_first(const opf_seq *seq, int first_req)
{
    for (int g = 0; g < seq->n_groups; g++) {
        const opf_group *gr = &seq->groups[g];
        for (int k = 0; k < gr->n_bwd; k++) {
            const opf_plan_entry *e = &gr->bwd[k];
            if (e->first <= first_req && first_req < e->first + e->count) return e->first;
        }
    }
    return first_req;
}

static opf_status forward_entry(opf_walker *w, const opf_plan_entry *e, opf_tensor *cur)
{
    const opf_seq *seq = w->seq;
    int first = e->first, last = e->first + e->count - 1;
    opf_quantizer qv[2];
    const void *kw[OPF_FUSED_MAX];
    opf_fwd_env env;
    opf_seq_entry_env(seq, e, w->first_req, w->save_from, w->kwargs, qv, kw, &env);
    env.x = cur;
    int slot = 0;
    for (int i = first; i <= last; i++)
        for (int j = 0; j < seq->ops[i]->n_extra_in; j++) env.extra_in[slot++] = extra_source(w, i, j, first);
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA];
    memset(outs, 0, sizeof outs);
    opf_status st = w->vt->forward(w, e, &env, outs);
    if (st) return st;
    opf_tensor_release(cur);
    *cur = outs[0];
    slot = 0;
    for (int i = first; i <= last; i++)
        for (int j = 0; j < seq->ops[i]->n_extra_out; j++) {
            opf_tensor *c = &w->chan[i * OPF_OP_MAX_EXTRA + j];
            opf_tensor_release(c);
            *c = outs[1 + slot++];
        }
    return OPF_OK;
}

/* A recompute group whose backward runs: its forward keeps only its input. */
static bool recomputed(const opf_walker *w, const opf_group *gr)
{
    return gr->rc >= 0 && gr->first + gr->count - 1 >= w->first_req;
}

/* Group g's forward plan from *cur; a recompute group keeps its input and
 * drops what its ops saved. */
static opf_status forward_group(opf_walker *w, int g, opf_tensor *cur)
{
    opf_group *gr = &w->seq->groups[g];
    bool rc = recomputed(w, gr);
    opf_status st = rc ? w->vt->recompute(w, g, OPF_RC_MARK) : OPF_OK;
    if (rc && !st) {
        opf_tensor_release(&gr->rc_x);
        opf_tensor_retain(cur, &gr->rc_x);
    }
    for (int k = 0; k < gr->n_fwd && !st; k++) st = forward_entry(w, &gr->fwd[k], cur);
    if (rc && !st) st = w->vt->recompute(w, g, OPF_RC_DROP);
    return st;
}

/* Group g's forward again from its kept input, its output dropped, with the
 * forward's Philox offset and scales (recompute.c). The input stays kept
 * until the backward has succeeded (a refused one may be retried). */
static opf_status rerun_group(opf_walker *w, int g)
{
    opf_group *gr = &w->seq->groups[g];
    opf_tensor cur;
    opf_tensor_retain(&gr->rc_x, &cur);
    opf_status st = w->vt->recompute(w, g, OPF_RC_ENTER);
    for (int k = 0; k < gr->n_fwd && !st; k++) st = forward_entry(w, &gr->fwd[k], &cur);
    opf_status st2 = w->vt->recompute(w, g, OPF_RC_LEAVE);
    opf_tensor_release(&cur);
    return st ? st : st2;
}

opf_status opf_walk_forward(opf_walker *w, const opf_tensor *x, opf_tensor *y)
{
    w->save_from = save_first(w->seq, w->first_req);
    opf_tensor cur;
    opf_tensor_retain(x, &cur);
    opf_status st = OPF_OK;
    for (int g = 0; g < w->seq->n_groups && !st; g++) st = forward_group(w, g, &cur);
    if (st) {
        opf_tensor_release(&cur);
        return st;
    }
    *y = cur;
    return OPF_OK;
}

void opf_walk_extra_out(const opf_walker *w, opf_tensor *extra_out)
{
    const opf_seq *seq = w->seq;
    for (int i = 0; i < seq->n; i++)
        for (int j = 0; j < seq->ops[i]->n_extra_out; j++) {
            int pub = seq->out_pub[i * OPF_OP_MAX_EXTRA + j];
            if (pub >= 0) opf_tensor_retain(&w->chan[i * OPF_OP_MAX_EXTRA + j], &extra_out[pub]);
        }
}

/* Gradients of the extra inputs of entry [first, last]: to the caller's
 * list, or summed into the producer's channel gradient (consumed inside the
 * entry: the fused op's business). Releases dxi. */
static opf_status route_dextra_in(opf_walker *w, int first, int last, opf_tensor *dxi,
                                  opf_tensor *dextra_in)
{
    const opf_seq *seq = w->seq;
    opf_status st = OPF_OK;
    int slot = 0;
    for (int i = first; i <= last; i++)
        for (int j = 0; j < seq->ops[i]->n_extra_in; j++, slot++) {
            const opf_src *s = &seq->in_src[i * OPF_OP_MAX_EXTRA + j];
            if (s->op < 0) {
                if (dextra_in && !st) opf_tensor_retain(&dxi[slot], &dextra_in[s->pub]);
            } else if (s->op < first && !st) {
                st = w->vt->add_grad(w, &w->chan_grad[s->op * OPF_OP_MAX_EXTRA + s->slot], &dxi[slot]);
            }
            opf_tensor_release(&dxi[slot]);
        }
    return st;
}

/* Backward of one entry: dy in *cur (replaced by dx). */
static opf_status backward_entry(opf_walker *w, const opf_plan_entry *e, const opf_tensor *dextra_out,
                                 opf_tensor *cur, opf_tensor *dextra_in)
{
    const opf_seq *seq = w->seq;
    int first = e->first, last = e->first + e->count - 1;
    opf_quantizer qv[2];
    const opf_quantizer *qp[2];
    opf_seq_neighbour_quantizers(seq, first, last, qv, qp);
    opf_bwd_env env = {.ctx = seq->ctx, .dy = cur, .prev_grad_q = qp[0]};
    opf_status st = OPF_OK;
    int slot = 0;
    for (int i = first; i <= last && !st; i++)
        for (int j = 0; j < seq->ops[i]->n_extra_out && !st; j++, slot++) {
            opf_tensor *cg = &w->chan_grad[i * OPF_OP_MAX_EXTRA + j];
            int pub = seq->out_pub[i * OPF_OP_MAX_EXTRA + j];
            if (pub >= 0 && dextra_out) st = w->vt->add_grad(w, cg, &dextra_out[pub]);
            env.dextra_out[slot] = present(cg) ? cg : NULL;
        }
    opf_tensor dx, dxi[OPF_OP_MAX_EXTRA];
    memset(&dx, 0, sizeof dx);
    memset(dxi, 0, sizeof dxi);
    if (!st) st = w->vt->backward(w, e, &env, &dx, dxi);
    if (st) {
        for (int i = 0; i < OPF_OP_MAX_EXTRA; i++) opf_tensor_release(&dxi[i]);
        return st;
    }
    st = route_dextra_in(w, first, last, dxi, dextra_in);
    opf_tensor_release(cur);
    *cur = dx;
    return st;
}

opf_status opf_walk_backward(opf_walker *w, const opf_tensor *dy, const opf_tensor *dextra_out,
                             opf_tensor *dx, opf_tensor *dextra_in)
{
    w->save_from = save_first(w->seq, w->first_req);  /* for the recompute groups' reruns */
    const opf_seq *seq = w->seq;
    opf_tensor cur;
    opf_tensor_retain(dy, &cur);
    if (dextra_in) memset(dextra_in, 0, sizeof *dextra_in * (size_t)seq->n_pub_in);
    opf_status st = OPF_OK;
    for (int g = seq->n_groups - 1; g >= 0 && !st; g--) {
        const opf_group *gr = &seq->groups[g];
        if (recomputed(w, gr)) st = rerun_group(w, g);
        for (int k = gr->n_bwd - 1; k >= 0 && !st; k--) {
            const opf_plan_entry *e = &gr->bwd[k];
            if (e->first + e->count - 1 < w->first_req) {  /* early stop: nothing before needs gradients */
                opf_tensor_release(&cur);
                g = -1;
                break;
            }
            st = backward_entry(w, e, dextra_out, &cur, dextra_in);
        }
    }
    if (st) {
        opf_tensor_release(&cur);
        return st;
    }
    *dx = cur;
    return OPF_OK;
}
