/* recompute.c: activation recompute (the anchor's checkpointing) of spans
 * of a seq: the spans themselves, and the state a re-run needs to give the
 * forward's bits again.
 *
 * The walker (walk.c) keeps a span's input through the forward, drops what
 * the span's ops saved, and in the backward re-runs the span's forward plan
 * from that input before its backward plan. What else the forward read must
 * be the same at the re-run:
 *   - the Philox offset (dropout masks, stochastic rounding): the offset at
 *     the span's start is kept and put back for the re-run, and the offset
 *     the backward had reached is restored after it, so the backward's own
 *     draws do not move;
 *   - the delayed-scaling scales: the forward's update (after the whole
 *     forward) has changed them by the time the backward runs, so each op's
 *     forward state (scales and amax history) is copied at the span's start,
 *     put back for the re-run and the current one restored after it (the
 *     amaxes the re-run records are dropped: the forward recorded them).
 * Current-scaling and block recipes have no state; cached quantized
 * weights are still valid (the parameters have not changed since). */
#include <string.h>

#include "fuser/fuser-impl.h"

static int index_of(const opf_seq *seq, const opf_op *op)
{
    for (int i = 0; i < seq->n; i++)
        if (seq->ops[i] == op) return i;
    return -1;
}

opf_status opf_seq_set_recompute(opf_seq *seq, int first, int count)
{
    const char *fn = "opf_seq_set_recompute";
    OPF_CHECK_NULL(NULL, fn, seq);
    if (seq->pending)
        return opf_error(seq->ctx, OPF_ERR_STATE, "%s: a backward is pending; run opf_seq_backward "
                         "or opf_seq_discard first", fn);
    if (count < 1 || first < 0 || first > seq->n - count)
        return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: span [%d, %d + %d) outside the seq's "
                         "%d ops", fn, first, first, count, seq->n);
    if (seq->n_rc == OPF_RC_MAX)
        return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: more than %d spans", fn, OPF_RC_MAX);
    int last = first + count - 1;
    for (int s = 0; s < seq->n_rc; s++) {
        int a = index_of(seq, seq->rc[s].first), b = index_of(seq, seq->rc[s].last);
        if (first <= b && a <= last)
            return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: span [%d, %d] overlaps span [%d, %d]",
                             fn, first, last, a, b);
    }
    opf_seq_unbuild(seq);
    seq->rc[seq->n_rc++] = (opf_rc_span){seq->ops[first], seq->ops[last]};
    return OPF_OK;
}

opf_status opf_seq_clear_recompute(opf_seq *seq)
{
    OPF_CHECK_NULL(NULL, "opf_seq_clear_recompute", seq);
    if (seq->pending)
        return opf_error(seq->ctx, OPF_ERR_STATE, "opf_seq_clear_recompute: a backward is pending");
    opf_seq_unbuild(seq);
    seq->n_rc = 0;
    return OPF_OK;
}

int opf_seq_num_recompute(const opf_seq *seq) { return seq ? seq->n_rc : 0; }

opf_status opf_seq_recompute_span(const opf_seq *seq, int i, int *first, int *count)
{
    const char *fn = "opf_seq_recompute_span";
    OPF_CHECK_NULL(NULL, fn, seq);
    OPF_CHECK_NULL(seq->ctx, fn, first);
    OPF_CHECK_NULL(seq->ctx, fn, count);
    if (i < 0 || i >= seq->n_rc)
        return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "%s: span %d of %d", fn, i, seq->n_rc);
    *first = index_of(seq, seq->rc[i].first);
    *count = index_of(seq, seq->rc[i].last) - *first + 1;
    return OPF_OK;
}

void opf_seq_rc_forget(opf_seq *seq, const opf_op *op)
{
    int k = 0;
    for (int s = 0; s < seq->n_rc; s++)
        if (seq->rc[s].first != op && seq->rc[s].last != op) seq->rc[k++] = seq->rc[s];
    seq->n_rc = k;
}

opf_status opf_seq_resolve_recompute(opf_seq *seq)
{
    for (int i = 0; i < seq->n; i++) seq->rc_of[i] = -1;
    for (int s = 0; s < seq->n_rc; s++) {
        int a = index_of(seq, seq->rc[s].first), b = index_of(seq, seq->rc[s].last);
        for (int i = a; i <= b; i++) {
            if (!seq->ops[i]->cls->fusible)
                return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "seq: recompute span %d holds \"%s\", "
                                 "a step that is not fusible (a callback cannot be re-run)", s,
                                 seq->ops[i]->name);
            seq->rc_of[i] = s;
        }
    }
    return OPF_OK;
}

bool opf_seq_rc_edge(const opf_seq *seq, int a, int b) { return seq->rc_of[a] != seq->rc_of[b]; }

opf_status opf_seq_check_recompute(opf_seq *seq)
{
    for (int g = 0; g < seq->n_groups; g++) {
        opf_group *gr = &seq->groups[g];
        gr->rc = seq->rc_of[gr->first];
        for (int i = gr->first; gr->rc >= 0 && i < gr->first + gr->count; i++)
            for (int j = 0; j < seq->ops[i]->n_extra_in; j++)
                if (seq->in_src[i * OPF_OP_MAX_EXTRA + j].op < 0)
                    return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "seq: op \"%s\" in recompute span "
                                     "%d reads public extra input %d; a span's re-run can read only "
                                     "its input and channels inside it", seq->ops[i]->name, gr->rc, j);
    }
    return OPF_OK;
}

void opf_seq_rc_release(opf_seq *seq)
{
    for (int g = 0; seq->groups && g < seq->n_groups; g++) {
        opf_group *gr = &seq->groups[g];
        opf_tensor_release(&gr->rc_x);
        opf_ctx_free(seq->ctx, gr->rc_state, 2 * gr->rc_floats * sizeof(float));
        gr->rc_state = NULL;
        gr->rc_floats = 0;
    }
}

/* ---- the state of a re-run ------------------------------------------------------ */

/* The forward delayed-scaling state of op i, or NULL. */
static opf_delayed_state *fwd_state(const opf_seq *seq, int i)
{
    return seq->ops[i]->rs ? opf_recipe_state_delayed(seq->ops[i]->rs, false) : NULL;
}

static size_t state_floats(const opf_delayed_state *d)
{
    return (size_t)opf_delayed_state_slots(d) * (1 + (size_t)opf_delayed_state_history_len(d));
}

/* Copies the group's delayed states into buf (to_buf) or back out of it. */
static void copy_states(opf_seq *seq, const opf_group *gr, float *buf, bool to_buf)
{
    for (int i = gr->first; i < gr->first + gr->count; i++) {
        opf_delayed_state *d = fwd_state(seq, i);
        if (!d) continue;
        size_t ns = (size_t)opf_delayed_state_slots(d), nh = state_floats(d) - ns;
        float *sc = opf_delayed_state_scale(d), *h = opf_delayed_state_history(d);
        if (to_buf) memcpy(buf, sc, ns * sizeof(float)), memcpy(buf + ns, h, nh * sizeof(float));
        else memcpy(sc, buf, ns * sizeof(float)), memcpy(h, buf + ns, nh * sizeof(float));
        buf += ns + nh;
    }
}

/* Sizes the group's state buffer for its ops' current recipe states. */
static opf_status size_state(opf_seq *seq, opf_group *gr)
{
    size_t n = 0;
    for (int i = gr->first; i < gr->first + gr->count; i++)
        if (fwd_state(seq, i)) n += state_floats(fwd_state(seq, i));
    if (n == gr->rc_floats) return OPF_OK;
    opf_ctx_free(seq->ctx, gr->rc_state, 2 * gr->rc_floats * sizeof(float));
    gr->rc_floats = 0;
    gr->rc_state = n ? opf_ctx_alloc(seq->ctx, 2 * n * sizeof(float)) : NULL;
    if (n && !gr->rc_state)
        return opf_error(seq->ctx, OPF_ERR_NO_MEMORY, "seq: recompute: out of memory");
    gr->rc_floats = n;
    return OPF_OK;
}

opf_status opf_seq_recompute_state(opf_seq *seq, int g, opf_rc_phase phase)
{
    opf_group *gr = &seq->groups[g];
    uint64_t seed;
    switch (phase) {
    case OPF_RC_MARK: {
        opf_status st = size_state(seq, gr);
        if (st) return st;
        opf_ctx_get_rng(seq->ctx, &seed, &gr->rc_rng[0]);
        copy_states(seq, gr, gr->rc_state, true);
        break;
    }
    case OPF_RC_ENTER:
        opf_ctx_get_rng(seq->ctx, &seed, &gr->rc_rng[1]);
        opf_ctx_set_rng(seq->ctx, seed, gr->rc_rng[0]);
        copy_states(seq, gr, gr->rc_state + gr->rc_floats, true);
        copy_states(seq, gr, gr->rc_state, false);
        break;
    case OPF_RC_LEAVE:
        opf_ctx_get_rng(seq->ctx, &seed, NULL);
        opf_ctx_set_rng(seq->ctx, seed, gr->rc_rng[1]);
        copy_states(seq, gr, gr->rc_state + gr->rc_floats, false);
        break;
    case OPF_RC_DROP: break;
    }
    return OPF_OK;
}
