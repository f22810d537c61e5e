/* seq.c: the sequential container: ownership and mutation, grouping of
 * adjacent fusible ops, channel resolution, and the (basic-op) plans. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuser/fuser-impl.h"

opf_status opf_seq_create(opf_ctx *ctx, opf_seq **out)
{
    OPF_CHECK_NULL(ctx, "opf_seq_create", ctx);
    OPF_CHECK_NULL(ctx, "opf_seq_create", out);
    opf_seq *s = opf_ctx_calloc(ctx, 1, sizeof *s);
    if (!s) return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_seq_create: out of memory");
    s->ctx = ctx;
    s->fusions = true;
    *out = s;
    return OPF_OK;
}

void opf_seq_unbuild(opf_seq *seq)
{
    if (seq->chan)
        for (int i = 0; i < seq->n * OPF_OP_MAX_EXTRA; i++) {
            opf_tensor_release(&seq->chan[i]);
            opf_tensor_release(&seq->chan_grad[i]);
        }
    if (seq->octx)
        for (int i = 0; i < seq->n; i++) opf_op_ctx_clear(&seq->octx[i]);
    opf_seq_rc_release(seq);
    opf_seq_drop_plans(seq, true);
    /* the arrays of opf_seq_build, sized by the n it saw (unbuild runs
     * before every change of n) */
    opf_ctx *ctx = seq->ctx;
    size_t n = (size_t)(seq->n ? seq->n : 1), ne = n * OPF_OP_MAX_EXTRA;
    opf_ctx_free(ctx, seq->groups, n * sizeof *seq->groups);
    opf_ctx_free(ctx, seq->octx, n * sizeof *seq->octx);
    opf_ctx_free(ctx, seq->in_src, ne * sizeof *seq->in_src);
    opf_ctx_free(ctx, seq->out_pub, ne * sizeof *seq->out_pub);
    opf_ctx_free(ctx, seq->chan, ne * sizeof *seq->chan);
    opf_ctx_free(ctx, seq->chan_grad, ne * sizeof *seq->chan_grad);
    opf_ctx_free(ctx, seq->rc_of, n * sizeof *seq->rc_of);
    opf_ctx_free(ctx, (void *)seq->rc_kw, n * sizeof *seq->rc_kw);
    if (seq->param_off) {
        size_t np = (size_t)seq->param_off[seq->n];
        opf_seq_release_staged(seq);
        opf_ctx_free(ctx, seq->pgrad, (np ? np : 1) * sizeof *seq->pgrad);
    }
    opf_ctx_free(ctx, seq->param_off, (n + 1) * sizeof *seq->param_off);
    seq->rc_of = NULL, seq->rc_kw = NULL, seq->pgrad = NULL, seq->param_off = NULL;
    seq->groups = NULL, seq->octx = NULL, seq->in_src = NULL, seq->out_pub = NULL;
    seq->chan = seq->chan_grad = NULL;
    seq->n_groups = 0;
    seq->built = seq->planned = seq->pending = false;
    seq->epoch++;
}

void opf_seq_destroy(opf_seq *seq)
{
    if (!seq) return;
    opf_optim_detach_seq(seq);
    opf_seq_unbuild(seq);
    for (int i = 0; i < seq->n; i++) opf_op_destroy(seq->ops[i]);
    opf_ctx_free(seq->ctx, seq->ops, sizeof *seq->ops * (size_t)seq->cap);
    opf_ctx_free(seq->ctx, seq, sizeof *seq);
}

/* op: the op inserted or removed, for the message. */
static opf_status mutable_or_fail(opf_seq *seq, const char *fn, const opf_op *op)
{
    if (seq->pending)
        return opf_error(seq->ctx, OPF_ERR_STATE,
                         "%s: a backward is pending; run opf_seq_backward or opf_seq_discard first", fn);
    if (seq->optims)
        return opf_error(seq->ctx, OPF_ERR_STATE,
                         "%s: op \"%s\": an optimizer was created over this seq, which freezes its "
                         "ops; destroy the optimizer before changing the seq, then create it anew",
                         fn, opf_op_name(op));
    return OPF_OK;
}

opf_status opf_seq_insert(opf_seq *seq, int index, opf_op *op)
{
    const char *fn = "opf_seq_insert";
    OPF_CHECK_NULL(NULL, fn, seq);
    if (!op) return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: op is NULL", fn);
    /* another seq's op stays that seq's: refused, not destroyed */
    if (op->owner && op->owner != seq)
        return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: op \"%s\" belongs to another seq; "
                         "take it out there first (opf_seq_remove with out)", fn, opf_op_name(op));
    opf_status st = mutable_or_fail(seq, fn, op);
    if (!st && (index < 0 || index > seq->n))
        st = opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: index %d outside 0..%d", fn, index, seq->n);
    if (!st && op->owner == seq)
        st = opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: op \"%s\" is already in the seq", fn,
                       opf_op_name(op));
    if (!st && seq->n == seq->cap) {
        int cap = seq->cap ? 2 * seq->cap : 8;
        opf_op **ops = opf_ctx_calloc(seq->ctx, (size_t)cap, sizeof *ops);
        if (!ops) {
            st = opf_error(seq->ctx, OPF_ERR_NO_MEMORY, "%s: out of memory", fn);
        } else {
            if (seq->n) memcpy(ops, seq->ops, sizeof *ops * (size_t)seq->n);
            opf_ctx_free(seq->ctx, seq->ops, sizeof *ops * (size_t)seq->cap);
            seq->ops = ops, seq->cap = cap;
        }
    }
    if (st) {
        if (op->owner != seq) opf_op_destroy(op);
        return st;
    }
    opf_seq_unbuild(seq);
    memmove(seq->ops + index + 1, seq->ops + index, sizeof *seq->ops * (size_t)(seq->n - index));
    seq->ops[index] = op;
    op->owner = seq;
    seq->n++;
    return OPF_OK;
}

opf_status opf_seq_append(opf_seq *seq, opf_op *op)
{
    OPF_CHECK_NULL(NULL, "opf_seq_append", seq);
    return opf_seq_insert(seq, seq->n, op);
}

opf_status opf_seq_remove(opf_seq *seq, int index, opf_op **out)
{
    const char *fn = "opf_seq_remove";
    OPF_CHECK_NULL(NULL, fn, seq);
    if (index < 0 || index >= seq->n)
        return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: index %d outside 0..%d", fn, index,
                         seq->n - 1);
    opf_status st = mutable_or_fail(seq, fn, seq->ops[index]);
    if (st) return st;
    opf_seq_unbuild(seq);
    opf_op *op = seq->ops[index];
    opf_seq_rc_forget(seq, op);
    memmove(seq->ops + index, seq->ops + index + 1, sizeof *seq->ops * (size_t)(seq->n - index - 1));
    seq->n--;
    op->locked = false;
    op->owner = NULL;
    if (out) *out = op;
    else opf_op_destroy(op);
    return OPF_OK;
}

int opf_seq_len(const opf_seq *seq) { return seq->n; }
opf_op *opf_seq_at(const opf_seq *seq, int index)
{
    return index >= 0 && index < seq->n ? seq->ops[index] : NULL;
}

opf_status opf_seq_append_linear(opf_seq *seq, int64_t in_features, int64_t out_features,
                                 bool bias, opf_dtype dtype, const char *name)
{
    OPF_CHECK_NULL(NULL, "opf_seq_append_linear", seq);
    char nm[64];
    opf_basic_linear_config lc = {in_features, out_features, dtype, false};
    opf_op *op;
    snprintf(nm, sizeof nm, "%s", name ? name : "linear");
    opf_status st = opf_op_create(seq->ctx, "basic_linear", &lc, nm, &op);
    if (st || (st = opf_seq_append(seq, op)) || !bias) return st;
    opf_bias_config bc = {out_features, dtype};
    snprintf(nm, sizeof nm, "%s.bias", name ? name : "linear");
    if ((st = opf_op_create(seq->ctx, "bias", &bc, nm, &op))) return st;
    return opf_seq_append(seq, op);
}

/* ---- building: groups and channels ------------------------------------------ */

static int find_producer(const opf_seq *seq, int first, int end, const char *name, int *slot)
{
    for (int i = first; i < end; i++)
        for (int j = 0; j < seq->ops[i]->n_extra_out; j++)
            if (!strcmp(seq->ops[i]->extra_out[j].name, name)) {
                *slot = j;
                return i;
            }
    return -1;
}

/* Resolves the channels of group [first, end): producers unique, every bound
 * input produced strictly earlier in the group. */
static opf_status resolve_channels(opf_seq *seq, int first, int end)
{
    for (int i = first; i < end; i++)
        for (int j = 0; j < seq->ops[i]->n_extra_out; j++) {
            const char *nm = seq->ops[i]->extra_out[j].name;
            int slot;
            if (nm[0] && find_producer(seq, first, i + 1, nm, &slot) != i)
                return opf_error(seq->ctx, OPF_ERR_INVALID_ARG,
                                 "seq: channel \"%s\" has two producers (\"%s\" and an earlier op)",
                                 nm, seq->ops[i]->name);
            bool pub = !nm[0] || seq->ops[i]->extra_out[j].to_caller;
            seq->out_pub[i * OPF_OP_MAX_EXTRA + j] = pub ? seq->n_pub_out++ : -1;
        }
    for (int i = first; i < end; i++)
        for (int j = 0; j < seq->ops[i]->n_extra_in; j++) {
            const char *nm = seq->ops[i]->extra_in[j].name;
            opf_src *s = &seq->in_src[i * OPF_OP_MAX_EXTRA + j];
            if (!nm[0]) {
                *s = (opf_src){-1, 0, seq->n_pub_in++};
                continue;
            }
            int slot, p = find_producer(seq, first, end, nm, &slot);
            if (p < 0)
                return opf_error(seq->ctx, OPF_ERR_INVALID_ARG,
                                 "seq: op \"%s\" reads channel \"%s\", which nothing in its group "
                                 "produces", seq->ops[i]->name, nm);
            if (p >= i)
                return opf_error(seq->ctx, OPF_ERR_INVALID_ARG,
                                 "seq: op \"%s\" (index %d) reads channel \"%s\" before its producer "
                                 "\"%s\" (index %d)", seq->ops[i]->name, i, nm, seq->ops[p]->name, p);
            *s = (opf_src){p, slot, -1};
        }
    return OPF_OK;
}

static opf_status add_group(opf_seq *seq, int first, int end)
{
    opf_group *g = &seq->groups[seq->n_groups++];
    g->first = first;
    g->count = end - first;
    g->rc = -1;
    return resolve_channels(seq, first, end);
}

opf_status opf_seq_build(opf_seq *seq)
{
    if (seq->built) return OPF_OK;
    size_t ne = (size_t)(seq->n ? seq->n : 1) * OPF_OP_MAX_EXTRA;
    opf_ctx *ctx = seq->ctx;
    seq->groups = opf_ctx_calloc(ctx, (size_t)(seq->n ? seq->n : 1), sizeof *seq->groups);
    seq->octx = opf_ctx_calloc(ctx, (size_t)(seq->n ? seq->n : 1), sizeof *seq->octx);
    seq->in_src = opf_ctx_calloc(ctx, ne, sizeof *seq->in_src);
    seq->out_pub = opf_ctx_calloc(ctx, ne, sizeof *seq->out_pub);
    seq->chan = opf_ctx_calloc(ctx, ne, sizeof *seq->chan);
    seq->chan_grad = opf_ctx_calloc(ctx, ne, sizeof *seq->chan_grad);
    seq->rc_of = opf_ctx_calloc(ctx, (size_t)(seq->n ? seq->n : 1), sizeof *seq->rc_of);
    seq->rc_kw = opf_ctx_calloc(ctx, (size_t)(seq->n ? seq->n : 1), sizeof *seq->rc_kw);
    seq->param_off = opf_ctx_calloc(ctx, (size_t)seq->n + 1, sizeof *seq->param_off);
    for (int i = 0; seq->param_off && i < seq->n; i++)
        seq->param_off[i + 1] = seq->param_off[i] + seq->ops[i]->n_params;
    size_t np = seq->param_off ? (size_t)seq->param_off[seq->n] : 0;
    seq->pgrad = seq->param_off ? opf_ctx_calloc(ctx, np ? np : 1, sizeof *seq->pgrad) : NULL;
    seq->n_pub_in = seq->n_pub_out = 0;
    opf_status st = OPF_OK;
    if (!seq->groups || !seq->octx || !seq->in_src || !seq->out_pub || !seq->chan || !seq->chan_grad ||
        !seq->rc_of || !seq->rc_kw || !seq->param_off || !seq->pgrad)
        st = opf_error(seq->ctx, OPF_ERR_NO_MEMORY, "seq: out of memory");
    if (!st) st = opf_seq_resolve_recompute(seq);
    for (int i = 0; !st && i < seq->n;) {
        int end = i + 1;  /* a recompute span's edges are group edges */
        if (seq->ops[i]->cls->fusible)
            while (end < seq->n && seq->ops[end]->cls->fusible && !opf_seq_rc_edge(seq, end - 1, end)) end++;
        st = add_group(seq, i, end);
        i = end;
    }
    if (!st) st = opf_seq_check_recompute(seq);
    if (st) {
        opf_seq_unbuild(seq);
        return st;
    }
    for (int i = 0; i < seq->n; i++) seq->ops[i]->locked = true;
    seq->built = true;
    return OPF_OK;
}

int opf_seq_num_groups(opf_seq *seq) { return opf_seq_build(seq) ? -1 : seq->n_groups; }
int opf_seq_num_extra_in(opf_seq *seq) { return opf_seq_build(seq) ? -1 : seq->n_pub_in; }
int opf_seq_num_extra_out(opf_seq *seq) { return opf_seq_build(seq) ? -1 : seq->n_pub_out; }
int opf_seq_first_requiring_backward(const opf_seq *seq) { return seq->first_req; }

int opf_seq_plan(opf_seq *seq, int group, bool backward, opf_plan_entry *entries, int max)
{
    if (opf_seq_build(seq) || group < 0 || group >= seq->n_groups) return -1;
    if (!seq->planned && opf_seq_use_plans(seq, seq->key_first_req)) return -1;
    const opf_group *g = &seq->groups[group];
    int n = backward ? g->n_bwd : g->n_fwd;
    for (int i = 0; i < n && i < max; i++) entries[i] = backward ? g->bwd[i] : g->fwd[i];
    return n;
}
