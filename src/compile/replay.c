/* replay.c: a graph on a device replays captured device graphs (CUDA
 * graphs) instead of walking its nodes.
 *
 * Segments: each direction's nodes split at its eager nodes, which run (and
 * allocate) on every call; every other run of nodes is captured once and
 * replayed with one launch.
 *
 * Variants: what the host decides while the nodes run is baked into a
 * capture: the leading size (patched args), the runtime kwargs (the weight
 * cache's is_first_microbatch picks which kernels run) and whether each
 * parameter grad starts fresh (the first gradient is written into grad
 * itself, later ones are added). Their hash keys the captures of a direction: each key's first call
 * walks the nodes (a warm-up that grows the kernels' scratch, builds the
 * GEMM plans and the weight caches), its second captures and launches, later
 * ones replay. A replay repeats a capture's host effects that the nodes
 * would have had: the grads it accumulated count as present.
 *
 * A segment whose capture fails (a node synchronized, allocated or copied
 * to the host inside it) or draws random numbers (Philox offsets are baked
 * into a capture, so replays would repeat them) is walked from then on;
 * the graph warns once with the reason. The state the failed capture
 * touched (grad flags, the RNG offset) is restored before the walk.
 *
 * Inputs: a capture reads fixed addresses, so each call copies its inputs
 * into their blocks of the arena (plan.c) on the device's queue. */
#include <stdlib.h>
#include <string.h>

#include "compile/compile-impl.h"
#include "core/device-impl.h"

static bool eager_kind(opf_node_kind k)
{
    return k == OPF_NODE_EAGER_FORWARD || k == OPF_NODE_EAGER_BACKWARD;
}

/* The grads node n accumulates into (BACKWARD nodes with present grads). */
static opf_status add_params(opf_graph *g, opf_gseg *s, const opf_gnode *n)
{
    for (int i = 0; n->kind == OPF_NODE_BACKWARD && i < n->n_params; i++) {
        if (!n->t[1 + i].data[0]) continue;
        opf_param **p = realloc(s->params, sizeof *p * (size_t)(s->n_params + 1));
        bool *h = realloc(s->had, sizeof *h * (size_t)(s->n_params + 1));
        if (p) s->params = p;
        if (h) s->had = h;
        if (!p || !h) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
        s->params[s->n_params++] = opf_op_param(n->op, i);
    }
    return OPF_OK;
}

/* Splits nodes [first, end) at eager nodes. */
static opf_status split(opf_graph *g, int first, int end)
{
    for (int i = first; i < end;) {
        bool eager = eager_kind(g->nodes[i].kind);
        int j = i + 1;
        while (!eager && j < end && !eager_kind(g->nodes[j].kind)) j++;
        opf_gseg *s = &g->segs[g->n_segs++];
        memset(s, 0, sizeof *s);
        s->first = i, s->end = j, s->eager = eager;
        for (int k = i; k < j; k++) {
            opf_status st = add_params(g, s, &g->nodes[k]);
            if (st) return st;
        }
        i = j;
    }
    return OPF_OK;
}

opf_status opf_graph_segments(opf_graph *g)
{
    if (!g->capture) return OPF_OK;
    g->segs = calloc((size_t)g->n_nodes + 1, sizeof *g->segs);
    if (!g->segs) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    opf_status st = split(g, 0, g->n_fwd);
    g->n_fwd_segs = g->n_segs;
    return st ? st : split(g, g->n_fwd, g->n_nodes);
}

void opf_graph_free_segments(opf_graph *g)
{
    for (int b = 0; b < 2; b++)
        for (int v = 0; v < g->n_variants[b]; v++) {
            opf_gvariant *var = &g->variants[b][v];
            int n = b ? g->n_segs - g->n_fwd_segs : g->n_fwd_segs;
            for (int k = 0; var->exec && k < n; k++) opf_device_graph_free(g->ctx, var->exec[k]);
            free(var->exec);
        }
    for (int i = 0; i < g->n_segs; i++) {
        free(g->segs[i].params);
        free(g->segs[i].had);
    }
    free(g->segs);
    g->segs = NULL;
    g->n_segs = g->n_fwd_segs = 0;
    memset(g->n_variants, 0, sizeof g->n_variants);
}

/* ---- inputs ----------------------------------------------------------------- */

opf_status opf_graph_stage_inputs(opf_graph *g, bool backward)
{
    for (int v = 0; v < g->n_vals; v++) {
        const opf_gval *gv = &g->vals[v];
        bool bwd_in = gv->in_kind == OPF_IN_DY || gv->in_kind == OPF_IN_DEXTRA_OUT;
        if (gv->kind != OPF_VAL_INPUT || bwd_in != backward || !gv->bound) continue;
        opf_tensor dst;
        memset(&dst, 0, sizeof dst);
        dst.spec = gv->bound->spec;
        for (int c = 0; c < OPF_COMP_COUNT; c++)
            if (gv->bound->data[c]) dst.data[c] = opf_graph_addr(g, v, c);
        opf_status st = opf_tensor_copy(g->ctx, gv->bound, &dst);
        if (st) return opf_error(g->ctx, st, "graph: input %s: %s", gv->name, opf_last_error(g->ctx));
    }
    return OPF_OK;
}

/* ---- variants ----------------------------------------------------------------- */

static uint64_t variant_key(const opf_graph *g, bool backward)
{
    uint64_t h = opf_hash_mix(OPF_HASH_SEED, (uint64_t)g->lead);
    for (int i = 0; i < g->n_rt; i++) {
        const opf_grt *r = &g->rt[i];
        int64_t v = r->kind == OPF_FIELD_INT ? *(const int64_t *)r->loc
                  : r->kind == OPF_FIELD_ENUM ? *(const int *)r->loc : *(const bool *)r->loc;
        h = opf_hash_mix(h, (uint64_t)v);
    }
    for (int s = backward ? g->n_fwd_segs : g->n_segs; s < g->n_segs; s++)
        for (int k = 0; k < g->segs[s].n_params; k++) {
            const opf_param *p = g->segs[s].params[k];
            h = opf_hash_mix(h, (uint64_t)p->has_grad | (uint64_t)p->requires_grad << 1);
        }
    return h;
}

/* The variant of this call, or NULL when every slot is taken (walked). */
static opf_gvariant *find_variant(opf_graph *g, bool backward)
{
    uint64_t key = variant_key(g, backward);
    opf_gvariant *vs = g->variants[backward];
    int *n = &g->n_variants[backward];
    for (int i = 0; i < *n; i++)
        if (vs[i].key == key) return &vs[i];
    if (*n == OPF_GRAPH_MAX_CAPTURES) {
        opf_ctx_warn_once(g->ctx, "compile: capture variants", "compile: more than %d leading sizes "
                          "or runtime-kwarg combinations in one graph: the rest walk their nodes "
                          "instead of replaying device graphs", OPF_GRAPH_MAX_CAPTURES);
        return NULL;
    }
    int segs = backward ? g->n_segs - g->n_fwd_segs : g->n_fwd_segs;
    void **exec = calloc((size_t)segs + 1, sizeof *exec);
    if (!exec) return NULL;
    vs[*n] = (opf_gvariant){key, 0, exec};
    return &vs[(*n)++];
}

/* ---- capture and replay ---------------------------------------------------------- */

static bool seg_backward(const opf_graph *g, const opf_gseg *s) { return s >= g->segs + g->n_fwd_segs; }

static opf_status walk_segment(opf_graph *g, const opf_gseg *s, const opf_seq_call *call)
{
    g->walked[seg_backward(g, s)] += s->end - s->first;
    return opf_graph_walk(g, s->first, s->end, call);
}

/* Captures segment s and launches it; a refusal restores what the capture
 * touched on the host and walks it instead. */
static opf_status capture(opf_graph *g, opf_gseg *s, const opf_seq_call *call, void **exec)
{
    opf_ctx *ctx = g->ctx;
    uint64_t seed, off, off2;
    opf_ctx_get_rng(ctx, &seed, &off);
    for (int k = 0; k < s->n_params; k++) s->had[k] = s->params[k]->has_grad;
    opf_status st = opf_device_capture_begin(ctx);
    if (!st) {
        st = opf_graph_walk(g, s->first, s->end, call);
        opf_status end = opf_device_capture_end(ctx, exec);
        if (!st) st = end;
    }
    opf_ctx_get_rng(ctx, NULL, &off2);
    if (!st && off2 != off)
        st = opf_error(ctx, OPF_ERR_UNSUPPORTED, "it draws random numbers (dropout, stochastic "
                       "rounding), whose offsets a replay would repeat");
    if (!st) {
        g->launches[seg_backward(g, s)]++;
        return opf_device_graph_launch(ctx, *exec);
    }
    opf_device_graph_free(ctx, *exec);
    *exec = NULL;
    s->refused = opf_node_kind_name(g->nodes[s->first].kind);
    const char *who = g->nodes[s->first].op ? g->nodes[s->first].op->name : s->refused;
    opf_ctx_warn_once(ctx, "compile: capture refused", "compile: the nodes from %s on are walked "
                      "on every call instead of replayed as a device graph: %s", who,
                      opf_last_error(ctx));
    opf_clear_error(ctx);
    opf_ctx_set_rng(ctx, seed, off);
    for (int k = 0; k < s->n_params; k++) s->params[k]->has_grad = s->had[k];
    return walk_segment(g, s, call);
}

static opf_status replay(opf_graph *g, opf_gseg *s, void *exec)
{
    opf_status st = opf_device_graph_launch(g->ctx, exec);
    for (int k = 0; !st && k < s->n_params; k++)
        if (s->params[k]->requires_grad) s->params[k]->has_grad = true;
    g->launches[seg_backward(g, s)]++;
    return st;
}

opf_status opf_graph_run(opf_graph *g, bool backward, const opf_seq_call *call)
{
    int first = backward ? g->n_fwd : 0, end = backward ? g->n_nodes : g->n_fwd;
    g->launches[backward] = g->walked[backward] = 0;
    if (!g->capture) {
        g->walked[backward] = end - first;
        return opf_graph_walk(g, first, end, call);
    }
    opf_status st = opf_graph_stage_inputs(g, backward);
    if (st) return st;
    opf_gvariant *v = find_variant(g, backward);
    int s0 = backward ? g->n_fwd_segs : 0, s1 = backward ? g->n_segs : g->n_fwd_segs;
    bool warm = v && v->calls++ > 0;
    for (int i = s0; i < s1 && !st; i++) {
        opf_gseg *s = &g->segs[i];
        void **exec = v ? &v->exec[i - s0] : NULL;
        if (!warm || g->profile || s->eager || s->refused) st = walk_segment(g, s, call);
        else if (*exec) st = replay(g, s, *exec);
        else st = capture(g, s, call, exec);
    }
    return st;
}
