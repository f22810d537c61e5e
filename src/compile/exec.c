/* exec.c: opf_compile (trace, gate, plan, bake) and the execution of the
 * forward and backward graphs: a walk over the nodes calling the same
 * *_impl the eager fuser calls, on baked args, with inputs bound by a few
 * pointer writes per call. Nothing is allocated here (eager nodes aside:
 * they run the eager runner, which allocates, and copy into the arena;
 * and the gradient buffer, once, by the first call that adds a parameter
 * gradient: place_grads). */
/* clock_gettime and CLOCK_MONOTONIC are POSIX, not C17. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "compile/compile-impl.h"
#include "core/device-impl.h"

opf_compile_options opf_compile_options_default(void)
{
    opf_compile_options o;
    memset(&o, 0, sizeof o);
    o.max_variants = 8;
    return o;
}

const char *opf_node_kind_name(opf_node_kind k)
{
    static const char *const names[] = {"forward", "backward", "eager_forward", "eager_backward",
                                        "grad_add", "amax_update", "recompute"};
    _Static_assert(sizeof names / sizeof names[0] == OPF_NODE_KIND_COUNT, "node kind names");
    return (unsigned)k < OPF_NODE_KIND_COUNT ? names[k] : "?";
}

static void release_fused(opf_graph *g)
{
    for (int i = 0; i < g->n_fused; i++) opf_op_destroy(g->fused[i]);
    free(g->fused);
    g->fused = NULL;
    g->n_fused = 0;
}

static void release_held(opf_graph *g)
{
    for (int v = 0; g->held && v < g->n_vals; v++) {
        opf_tensor_release(&g->held[v]);
        g->vals[v].bound = NULL;
    }
}

void opf_graph_destroy(opf_graph *g)
{
    if (!g) return;
    release_held(g);
    free(g->held);
    free(g->dzero);
    opf_graph_free_ir(g);
    release_fused(g);
    opf_graph_free_segments(g);
    opf_graph_mem_free(g, g->arena, g->arena_bytes);
    opf_graph_mem_free(g, g->zeros, g->zeros_bytes);
    opf_graph_mem_free(g, g->pgrad_buf, g->pgrad_bytes);
    free(g->stores);
    free(g->binds);
    free(g->patches);
    free(g->rt);
    free(g);
}

/* Checks of opf_compile's arguments that need no tracing. */
static opf_status check_compile(opf_seq *seq, const opf_spec *x, const opf_seq_call *call,
                                const opf_compile_options *o)
{
    const char *fn = "opf_compile";
    opf_ctx *ctx = seq->ctx;
    if (seq->n == 0) return opf_error(ctx, OPF_ERR_STATE, "%s: the seq is empty", fn);
    if (seq->pending)
        return opf_error(ctx, OPF_ERR_STATE, "%s: a backward is pending on the seq; run "
                         "opf_seq_backward or opf_seq_discard first", fn);
    opf_layout L;
    if (opf_spec_layout(x, &L))
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: input spec: %s", fn, opf_last_error(NULL));
    if (o->max_leading < 0 || (o->max_leading > 0 && x->ndim < 1))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: max_leading %lld needs an input of rank >= 1 "
                         "(rank %d)", fn, (long long)o->max_leading, x->ndim);
    if (call->n_extra_in != seq->n_pub_in)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %d extra inputs given, the seq takes %d", fn,
                         call->n_extra_in, seq->n_pub_in);
    if (call->n_extra_in && !call->extra_in)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: extra_in is NULL", fn);
    for (int i = 0; i < seq->n; i++) {
        const opf_op_class *c = seq->ops[i]->cls;
        if (opf_op_class_find(c->name) != c)
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: op \"%s\" has class \"%s\", which is not "
                             "registered (opf_op_class_register)", fn, seq->ops[i]->name, c->name);
    }
    return OPF_OK;
}

/* One trace at leading size lead (0: x as given); takes the plans' fused ops. */
static opf_status trace_at(opf_graph *g, const opf_spec *x, const opf_seq_call *call, int64_t lead)
{
    opf_spec xs = *x;
    opf_seq_call c = *call;
    opf_tensor ext[64];
    if (lead > 0) {
        if (call->n_extra_in > 64)
            return opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "opf_compile: %d extra inputs > 64 with "
                             "max_leading", call->n_extra_in);
        /* extra inputs that share x's leading size follow it (residuals) */
        for (int i = 0; i < call->n_extra_in; i++) {
            ext[i] = call->extra_in[i];
            if (ext[i].spec.ndim >= 1 && ext[i].spec.shape[0] == x->shape[0]) ext[i].spec.shape[0] = lead;
        }
        c.extra_in = ext;
        xs.shape[0] = lead;
    }
    opf_status st = opf_seq_prepare_plans(g->seq, &c, g->first_req);
    if (st) return st;
    for (int i = 0; i < g->seq->n_groups; i++)
        for (int k = 0; k < g->seq->groups[i].n_fwd; k++) {
            const opf_op_class *cls = g->seq->groups[i].fwd[k].op->cls;
            if (opf_op_class_find(cls->name) != cls)
                return opf_error(g->ctx, OPF_ERR_INVALID_ARG, "opf_compile: op \"%s\" has class "
                                 "\"%s\", which is not registered", g->seq->groups[i].fwd[k].op->name,
                                 cls->name);
        }
    g->x_spec = xs;
    st = opf_graph_trace(g, &xs, &c);
    int n = opf_seq_take_fused(g->seq, &g->fused);
    if (n < 0) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "opf_compile: out of memory");
    g->n_fused = n;
    return st;
}

static opf_graph *graph_new(opf_seq *seq, const opf_seq_call *call, const opf_compile_options *o,
                            int first_req)
{
    opf_graph *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->seq = seq;
    g->ctx = seq->ctx;
    g->opts = *o;
    g->first_req = first_req;
    g->forward_only = first_req >= seq->n;
    g->call = *call;
    g->call.extra_in = NULL;
    g->call.kwargs = NULL;
    g->has_recipe = call->recipe != NULL;
    if (call->recipe) g->recipe = *call->recipe;
    g->call.recipe = g->has_recipe ? &g->recipe : NULL;
    g->y_val = g->dx_val = g->x_val = g->dy_val = -1;
    return g;
}

/* Traces a copy of g at leading size l and diffs g against it: the patches
 * of the leading dimension go to g->patches. */
static opf_status diff_at(opf_graph *g, const opf_spec *x, const opf_seq_call *call, int64_t l)
{
    opf_graph *g2 = graph_new(g->seq, call, &g->opts, g->first_req);
    if (!g2) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "opf_compile: out of memory");
    opf_status st = trace_at(g2, x, call, l);
    if (!st) st = opf_graph_diff(g, g2, l);
    opf_graph_destroy(g2);
    return st;
}

/* The leading dimension's patches: a trace at a second size (the largest
 * step of 128, 64, ... 1 below the maximum that the ops accept) gives
 * them; a trace at a third size, when the ops accept one, must predict the
 * same patches, or the graph is not affine in the leading size. */
static opf_status dynamic_patches(opf_graph *g, const opf_spec *x, const opf_seq_call *call)
{
    int64_t max = g->lead0, step = 0;
    opf_status st = OPF_ERR_UNSUPPORTED;
    char why[400] = "";
    for (int64_t a = 128; a >= 1 && st; a /= 2) {
        if (max % a || max - a < 1) continue;
        free(g->patches);
        g->patches = NULL, g->n_patches = 0;
        st = diff_at(g, x, call, max - a);
        if (st) snprintf(why, sizeof why, "%s", opf_last_error(g->ctx));
        else step = a;
    }
    if (st)
        return opf_error(g->ctx, st, "opf_compile: max_leading %lld: no smaller leading size traces "
                         "to the same graph (%s); compile with max_leading = 0", (long long)max, why);
    if (max - 2 * step < 1) return OPF_OK;
    opf_gpatch *p2 = g->patches;
    int n2 = g->n_patches;
    g->patches = NULL, g->n_patches = 0;
    st = diff_at(g, x, call, max - 2 * step);
    bool same = !st && g->n_patches == n2;
    for (int i = 0; same && i < n2; i++)
        same = g->patches[i].loc == p2[i].loc && g->patches[i].slope == p2[i].slope;
    free(g->patches);
    g->patches = p2, g->n_patches = n2;
    if (st) {  /* the ops refuse the third size: the fakes check every new size anyway */
        opf_clear_error(g->ctx);
        return OPF_OK;
    }
    if (!same)
        return opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "opf_compile: the graph is not affine in the "
                         "leading size (sizes %lld, %lld and %lld disagree); compile with "
                         "max_leading = 0", (long long)max, (long long)(max - step),
                         (long long)(max - 2 * step));
    return OPF_OK;
}

opf_status opf_compile(opf_seq *seq, const opf_spec *x, const opf_seq_call *call,
                       const opf_compile_options *opts, opf_graph **out)
{
    const char *fn = "opf_compile";
    OPF_CHECK_NULL(NULL, fn, seq);
    OPF_CHECK_NULL(seq->ctx, fn, out);
    *out = NULL;
    OPF_CHECK_NULL(seq->ctx, fn, x);
    OPF_CHECK_NULL(seq->ctx, fn, call);
    opf_compile_options o = opts ? *opts : opf_compile_options_default();
    opf_status st = opf_seq_build(seq);
    if (st || (st = check_compile(seq, x, call, &o))) return st;
    if (call->recipe && (st = opf_recipe_validate(call->recipe)))
        return opf_error(seq->ctx, st, "%s: %s", fn, opf_last_error(NULL));
    int first_req = opf_seq_first_req(seq, call);
    opf_graph *g = graph_new(seq, call, &o, first_req);
    if (!g) return opf_error(seq->ctx, OPF_ERR_NO_MEMORY, "%s: out of memory", fn);
    st = trace_at(g, x, call, o.max_leading);
    g->lead = g->lead0 = o.max_leading;
    if (!st && o.max_leading > 1) st = dynamic_patches(g, x, call);
    g->epoch = seq->epoch;
    g->on_device = x->device != OPF_DEVICE_CPU && x->device == opf_ctx_device(seq->ctx);
    g->capture = g->on_device && !o.no_device_graphs && opf_device_can_capture(seq->ctx);
    if (!st) st = opf_graph_plan(g);
    if (!st) st = opf_graph_bake(g);
    if (!st) st = opf_graph_segments(g);
    if (!st) {
        g->held = calloc((size_t)g->n_vals, sizeof *g->held);
        g->dzero = calloc((size_t)g->n_pub_out + 1, sizeof *g->dzero);
        if (!g->held || !g->dzero) st = opf_error(seq->ctx, OPF_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    if (!st) g->key = opf_graph_key(seq, x, call, &o);
    if (st) {
        opf_graph_destroy(g);
        return st;
    }
    *out = g;
    return OPF_OK;
}

/* ---- execution --------------------------------------------------------------- */

static opf_status bind(opf_graph *g, int v, const opf_tensor *t, const char *what)
{
    opf_gval *gv = &g->vals[v];
    if (!opf_spec_equal(&gv->spec, &t->spec)) {
        char want[160], got[160];
        opf_spec_str(&gv->spec, want, sizeof want);
        opf_spec_str(&t->spec, got, sizeof got);
        return opf_error(g->ctx, OPF_ERR_INVALID_ARG, "graph: %s is %s, the graph was compiled for %s",
                         what, got, want);
    }
    opf_tensor_retain(t, &g->held[v]);
    gv->bound = &g->held[v];
    return OPF_OK;
}

static void apply_binds(opf_graph *g, bool backward)
{
    for (int i = 0; i < g->n_binds; i++) {
        const opf_gbind *b = &g->binds[i];
        const opf_gval *gv = &g->vals[b->val];
        bool bwd_in = gv->in_kind == OPF_IN_DY || gv->in_kind == OPF_IN_DEXTRA_OUT;
        if (bwd_in != backward || !gv->bound) continue;
        char *p = gv->bound->data[b->comp];
        *b->loc = p ? p + b->off : NULL;
    }
}

static opf_status copy_into(opf_ctx *ctx, const opf_op *op, const opf_tensor *src, opf_tensor *dst)
{
    if (!opf_spec_equal(&src->spec, &dst->spec)) {
        char a[160], b[160];
        opf_spec_str(&src->spec, a, sizeof a);
        opf_spec_str(&dst->spec, b, sizeof b);
        return opf_error(ctx, OPF_ERR_STATE, "graph: eager node %s produced %s, the graph planned %s",
                         op->name, a, b);
    }
    return opf_op_copy_tensor(ctx, op->name, src, dst);
}

static opf_status run_eager_forward(opf_graph *g, opf_gnode *n, const opf_seq_call *call)
{
    opf_op *op = n->op;
    const void *kw[OPF_FUSED_MAX];
    opf_plan_entry e = {op, n->first, n->count};
    /* the env as traced (quantizers and grad flags baked), the call's kwargs */
    opf_fwd_env env = {.ctx = g->ctx, .prev_grad_q = n->has_q[0] ? &n->qv[0] : NULL,
                       .next_input_q = n->has_q[1] ? &n->qv[1] : NULL,
                       .recipe = g->has_recipe ? &g->recipe : NULL,
                       .requires_grad = n->requires_grad,
                       .first_requires_grad = n->first_requires_grad,
                       .kwargs = opf_entry_kwargs(&e, call->kwargs, kw)};
    env.x = &n->t[n->n_out];
    for (int i = 0; i < n->n_extra; i++)
        env.extra_in[i] = n->in_mask & (1u << (1 + i)) ? &n->t[n->n_out + 1 + i] : NULL;
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA];
    memset(outs, 0, sizeof outs);
    opf_status st = opf_op_forward(op, &env, n->requires_grad ? &g->octx[n->first] : NULL, outs);
    for (int i = 0; i < n->n_out && !st; i++) st = copy_into(g->ctx, op, &outs[i], &n->t[i]);
    for (int i = 0; i < n->n_out; i++) opf_tensor_release(&outs[i]);
    return st;
}

static opf_status run_eager_backward(opf_graph *g, opf_gnode *n)
{
    opf_op *op = n->op;
    if (n->restore_octx)
        for (int k = 0; k < n->count; k++) {
            opf_op_ctx *c = &g->octx[n->first + k];
            opf_op_ctx_clear(c);
            *c = g->octx_traced[n->first + k];  /* baked: views, the references stay there */
            for (int i = 0; i < c->n_saved; i++) c->saved[i].buf = NULL;
        }
    opf_bwd_env env = {.ctx = g->ctx, .dy = &n->t[n->n_out],
                       .prev_grad_q = n->has_q[0] ? &n->qv[0] : NULL};
    for (int i = 0; i < n->n_extra; i++)
        env.dextra_out[i] = n->in_mask & (1u << (1 + i)) ? &n->t[n->n_out + 1 + i] : NULL;
    opf_tensor dx, dxi[OPF_OP_MAX_EXTRA];
    memset(&dx, 0, sizeof dx);
    memset(dxi, 0, sizeof dxi);
    opf_status st = opf_op_backward(op, &g->octx[n->first], &env, &dx, dxi);
    if (!st && !n->passthrough && (n->t[0].data[0] || n->t[0].data[OPF_COMP_COL_DATA]))
        st = copy_into(g->ctx, op, &dx, &n->t[0]);
    for (int i = 0; i < op->n_extra_in && !st; i++)
        if (n->t[1 + i].data[0] && dxi[i].data[0]) st = copy_into(g->ctx, op, &dxi[i], &n->t[1 + i]);
    opf_tensor_release(&dx);
    for (int i = 0; i < OPF_OP_MAX_EXTRA; i++) opf_tensor_release(&dxi[i]);
    return st;
}

static double now_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static opf_status exec_node(opf_graph *g, opf_gnode *n, const opf_seq_call *call);

/* Profiled, a node on a device is timed between synchronizations: its
 * seconds are its kernels' time, not their launches'. */
static opf_status run_node(opf_graph *g, opf_gnode *n, const opf_seq_call *call)
{
    if (!g->profile) return exec_node(g, n, call);
    opf_status st = g->on_device ? opf_ctx_sync(g->ctx) : OPF_OK;
    double t0 = now_seconds();
    if (!st) st = exec_node(g, n, call);
    if (!st && g->on_device) st = opf_ctx_sync(g->ctx);
    n->seconds += now_seconds() - t0;
    return st;
}

static void place_grads_back(opf_gnode *n, void *const *tag)
{
    for (int i = 0; i < n->n_params; i++) n->t[1 + i].data[0] = tag[i];
}

/* Where a backward node writes its parameters' gradients (values with no
 * arena block, plan.c), placed per call: a parameter's first gradient after
 * zero_grad (has_grad clear, grad zeros) into the parameter's grad itself
 * where the value has grad's spec (direct[i]); the node then only sets
 * has_grad, with no copy (on the GPU a captured step that starts fresh
 * has no copy node a parameter: 16 MB in the 256 x 1024 LayerNorm-MLP
 * step). Any other (a gradient to be added, or one not kept) into the
 * graph's gradient buffer, allocated by the first call that needs it (a
 * new variant's warm-up walk: a capture replays its address; a graph that
 * only starts fresh never allocates it). The same bits as an arena value
 * copied or added in. replay.c keys its captures on has_grad, so each
 * capture keeps its choice. tag[i]: the value's tag, which
 * place_grads_back puts back. */
static opf_status place_grads(opf_graph *g, opf_gnode *n, void **tag, bool *direct)
{
    size_t off = 0;
    opf_status st = OPF_OK;
    for (int i = 0; i < n->n_params; i++) tag[i] = n->t[1 + i].data[0];
    for (int i = 0; i < n->n_params && !st; i++) {
        opf_param *p = opf_op_param(n->op, i);
        opf_tensor *t = &n->t[1 + i];
        direct[i] = false;
        if (!tag[i] || !opf_is_tag(tag[i])) continue;
        direct[i] = opf_param_grad_in_place(p, &t->spec);
        if (direct[i]) {
            t->data[0] = p->grad.data[0];
            continue;
        }
        if (!g->pgrad_buf && (st = opf_graph_mem_alloc(g, g->pgrad_bytes, &g->pgrad_buf)))
            st = opf_error(g->ctx, st, "compile: %s: no gradient buffer to add \"%s\"'s gradient "
                           "in: %s", n->op->name, p->name, opf_last_error(g->ctx));
        if (!st) {
            t->data[0] = (char *)g->pgrad_buf + off;
            off += g->vals[opf_tag_value(tag[i])].bytes;
        }
    }
    if (st) place_grads_back(n, tag);
    return st;
}

static opf_status exec_node(opf_graph *g, opf_gnode *n, const opf_seq_call *call)
{
    opf_ctx *ctx = g->ctx;
    opf_status st = OPF_OK;
    for (int z = 0; z < n->n_zero && !st; z++)
        st = opf_device_memset(ctx, opf_graph_device(g), n->zero[z].p, 0, n->zero[z].n);
    if (st) return st;
    size_t mark = opf_ctx_scratch_mark(ctx);
    switch (n->kind) {
    case OPF_NODE_FORWARD:
        st = n->op->cls->forward_impl(ctx, n->args, n->t, n->t + 1 + OPF_OP_MAX_EXTRA);
        break;
    case OPF_NODE_BACKWARD: {
        void *tag[OPF_OP_MAX_GRADS];
        bool direct[OPF_OP_MAX_GRADS];
        if ((st = place_grads(g, n, tag, direct))) break;
        opf_status bst = n->op->cls->backward_impl(ctx, n->args, n->t);
        opf_ctx_scratch_pop(ctx, mark);
        st = bst;
        for (int i = 0; i < n->n_params; i++) {
            opf_param *p = opf_op_param(n->op, i);
            if (direct[i]) {
                /* refused: grad back to zero_grad's zeros (it may be part written) */
                if (bst) opf_param_unwrite_grad(ctx, p, &n->t[1 + i]);
                else p->has_grad = true;
            } else if (!st && n->t[1 + i].data[0] && p->requires_grad) {
                st = opf_param_accumulate(ctx, p, &n->t[1 + i]);
            }
        }
        place_grads_back(n, tag);
        break;
    }
    case OPF_NODE_EAGER_FORWARD: st = run_eager_forward(g, n, call); break;
    case OPF_NODE_EAGER_BACKWARD: st = run_eager_backward(g, n); break;
    case OPF_NODE_GRAD_ADD: st = opf_grad_sum(ctx, &n->t[1], &n->t[2], &n->t[0]); break;
    case OPF_NODE_AMAX_UPDATE: opf_seq_update_delayed(g->seq, n->backward); break;
    case OPF_NODE_RECOMPUTE: st = opf_seq_recompute_state(g->seq, n->first, (opf_rc_phase)n->rc_phase); break;
    default: break;
    }
    opf_ctx_scratch_pop(ctx, mark);
    if (st && n->op) {
        char why[400];
        snprintf(why, sizeof why, "%s", opf_last_error(ctx));
        return opf_error(ctx, st, "graph: node %s (%s): %s", n->op->name,
                         opf_node_kind_name(n->kind), why);
    }
    return st;
}

opf_status opf_graph_walk(opf_graph *g, int first, int end, const opf_seq_call *call)
{
    opf_status st = OPF_OK;
    for (int i = first; i < end && !st; i++) st = run_node(g, &g->nodes[i], call);
    return st;
}

static opf_status check_live(opf_graph *g, const char *fn)
{
    if (g->epoch != g->seq->epoch)
        return opf_error(g->ctx, OPF_ERR_STATE, "%s: the graph is stale: its seq changed or rebuilt "
                         "its recipe state since compile; compile again", fn);
    return OPF_OK;
}

/* The guard of an explicit graph: what the call must share with the compile. */
static opf_status check_call(opf_graph *g, const opf_tensor *x, const opf_seq_call *call)
{
    const char *fn = "opf_graph_forward";
    opf_ctx *ctx = g->ctx;
    if (!opf_recipe_same(g->has_recipe ? &g->recipe : NULL, call->recipe))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the call's recipe differs from the compiled "
                         "one (%s)", fn, opf_recipe_name(g->has_recipe ? g->recipe.kind : OPF_RECIPE_NONE));
    if (call->requires_grad != g->call.requires_grad ||
        (call->requires_grad && call->input_requires_grad != g->call.input_requires_grad))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: requires_grad %d/%d, compiled with %d/%d", fn,
                         call->requires_grad, call->input_requires_grad, g->call.requires_grad,
                         g->call.input_requires_grad);
    if (call->n_extra_in != g->n_pub_in || (call->n_extra_in && !call->extra_in))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %d extra inputs given, the graph takes %d", fn,
                         call->n_extra_in, g->n_pub_in);
    if (!opf_graph_kwargs_match(g, call))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the kwargs' values differ from the compiled "
                         "ones", fn);
    if (g->lead0 > 0) {
        int64_t b = x->spec.ndim >= 1 ? x->spec.shape[0] : -1;
        if (b < 1 || b > g->lead0)
            return opf_error(ctx, OPF_ERR_SHAPE, "%s: x has leading size %lld, the graph runs 1..%lld",
                             fn, (long long)b, (long long)g->lead0);
        opf_status st = opf_graph_set_lead(g, b);
        if (st) return st;
    }
    return OPF_OK;
}

opf_status opf_graph_forward(opf_graph *g, const opf_tensor *x, const opf_seq_call *call,
                             opf_tensor *y, opf_tensor *extra_out)
{
    const char *fn = "opf_graph_forward";
    OPF_CHECK_NULL(NULL, fn, g);
    OPF_CHECK_NULL(g->ctx, fn, x);
    OPF_CHECK_NULL(g->ctx, fn, call);
    OPF_CHECK_NULL(g->ctx, fn, y);
    opf_status st = check_live(g, fn);
    if (st) return st;
    if (g->pending)
        return opf_error(g->ctx, OPF_ERR_STATE, "%s: the previous forward's backward has not run; "
                         "call opf_graph_backward first", fn);
    if ((st = check_call(g, x, call))) return st;
    release_held(g);
    st = bind(g, g->x_val, x, "x");
    for (int p = 0; p < g->n_pub_in && !st; p++) st = bind(g, g->extra_in_val[p], &call->extra_in[p], "an extra input");
    for (int v = 0; v < g->n_vals && !st; v++) {
        opf_gval *gv = &g->vals[v];
        if (gv->kind != OPF_VAL_INPUT || gv->in_kind != OPF_IN_KWARG) continue;
        const void *kw = call->kwargs ? call->kwargs[gv->in_index] : NULL;
        if (!kw) {
            st = opf_error(g->ctx, OPF_ERR_INVALID_ARG, "%s: op %d's tensor kwarg is missing", fn, gv->in_index);
            break;
        }
        st = bind(g, v, (const opf_tensor *)(const void *)((const char *)kw + gv->in_field), "a tensor kwarg");
    }
    if (st) {
        release_held(g);
        return st;
    }
    apply_binds(g, false);
    for (int i = 0; i < g->n_rt; i++) {  /* runtime kwargs: present, as the guard keyed */
        const opf_grt *r = &g->rt[i];
        const char *src = (const char *)call->kwargs[r->op] + r->off;
        int64_t v = r->src_kind == OPF_FIELD_INT ? *(const int64_t *)(const void *)src
                  : r->src_kind == OPF_FIELD_ENUM ? *(const int *)(const void *)src : *(const bool *)src;
        if (r->kind == OPF_FIELD_INT) *(int64_t *)r->loc = v;
        else if (r->kind == OPF_FIELD_ENUM) *(int *)r->loc = (int)v;
        else *(bool *)r->loc = v != 0;
    }
    st = opf_graph_run(g, false, call);
    if (st) {
        release_held(g);
        for (int i = 0; i < g->seq->n; i++) opf_op_ctx_clear(&g->octx[i]);
        return st;
    }
    g->pending = call->requires_grad && !g->forward_only;
    if (!g->pending) release_held(g);
    opf_graph_value_tensor(g, g->y_val, y);
    for (int p = 0; extra_out && p < g->n_pub_out; p++)
        opf_graph_value_tensor(g, g->extra_out_val[p], &extra_out[p]);
    return OPF_OK;
}

opf_status opf_graph_backward(opf_graph *g, const opf_tensor *dy, const opf_tensor *dextra_out,
                              opf_tensor *dx, opf_tensor *dextra_in)
{
    const char *fn = "opf_graph_backward";
    OPF_CHECK_NULL(NULL, fn, g);
    OPF_CHECK_NULL(g->ctx, fn, dy);
    opf_status st = check_live(g, fn);
    if (st) return st;
    if (!g->pending)
        return opf_error(g->ctx, OPF_ERR_STATE, "%s: no forward awaits a backward (run "
                         "opf_graph_forward with requires_grad first; each forward allows one backward)", fn);
    if ((st = bind(g, g->dy_val, dy, "dy"))) return st;
    for (int p = 0; p < g->n_pub_out && !st; p++) {
        int v = g->dextra_out_val[p];
        const opf_tensor *t = dextra_out ? &dextra_out[p] : NULL;
        if (!t || (!t->data[0] && !t->data[OPF_COMP_COL_DATA])) {
            opf_tensor_wrap(&g->vals[v].spec, g->zeros, &g->dzero[p]);
            t = &g->dzero[p];
        }
        st = bind(g, v, t, "an extra output's gradient");
    }
    if (st) return st;
    apply_binds(g, true);
    st = opf_graph_run(g, true, NULL);
    g->pending = false;
    for (int i = 0; i < g->seq->n; i++) opf_op_ctx_clear(&g->octx[i]);
    if (st) {
        release_held(g);
        return st;
    }
    if (dx) opf_graph_value_tensor(g, g->dx_val, dx);
    for (int p = 0; dextra_in && p < g->n_pub_in; p++) opf_graph_value_tensor(g, g->dextra_in_val[p], &dextra_in[p]);
    /* dx may be the caller's dy itself (pass-through): hand out a plain view */
    if (dx) dx->buf = NULL;
    release_held(g);
    return OPF_OK;
}

/* ---- introspection ----------------------------------------------------------- */

void opf_graph_set_profile(opf_graph *g, bool on)
{
    if (g) g->profile = on;
}

void opf_graph_reset_profile(opf_graph *g)
{
    for (int i = 0; g && i < g->n_nodes; i++) g->nodes[i].seconds = 0;
}

double opf_graph_node_seconds(const opf_graph *g, int i)
{
    return g && i >= 0 && i < g->n_nodes ? g->nodes[i].seconds : 0.0;
}

int opf_graph_num_nodes(const opf_graph *g) { return g ? g->n_nodes : 0; }

opf_status opf_graph_node(const opf_graph *g, int i, opf_graph_node_info *out)
{
    OPF_CHECK_NULL(NULL, "opf_graph_node", g);
    OPF_CHECK_NULL(g->ctx, "opf_graph_node", out);
    if (i < 0 || i >= g->n_nodes)
        return opf_error(g->ctx, OPF_ERR_INVALID_ARG, "opf_graph_node: index %d outside 0..%d", i,
                         g->n_nodes - 1);
    const opf_gnode *n = &g->nodes[i];
    memset(out, 0, sizeof *out);
    out->kind = n->kind;
    out->backward = i >= g->n_fwd;
    out->op_name = n->op ? n->op->name : opf_node_kind_name(n->kind);
    out->class_name = n->op ? n->op->cls->name : NULL;
    out->fused = n->op && opf_op_is_fused(n->op);
    out->first = n->first;
    out->count = n->count;
    out->reason = n->reason;
    for (int r = 0; r < n->n_refs; r++) out->n_outputs += n->refs[r].output && n->refs[r].val >= 0;
    return OPF_OK;
}

int opf_graph_reasons(const opf_graph *g, opf_graph_reason *out, int max)
{
    int k = 0;
    for (int i = 0; g && i < g->n_nodes; i++) {
        const opf_gnode *n = &g->nodes[i];
        if (!n->reason) continue;
        if (out && k < max) out[k] = (opf_graph_reason){n->op->name, n->reason, i >= g->n_fwd};
        k++;
    }
    return k;
}

void opf_graph_get_stats(const opf_graph *g, opf_graph_stats *s)
{
    memset(s, 0, sizeof *s);
    if (!g) return;
    for (int i = 0; i < g->n_nodes; i++) {
        const opf_gnode *n = &g->nodes[i];
        if (i < g->n_fwd) s->n_forward++;
        else s->n_backward++;
        s->n_eager += n->kind == OPF_NODE_EAGER_FORWARD || n->kind == OPF_NODE_EAGER_BACKWARD;
        s->n_fused += n->op && opf_op_is_fused(n->op);
    }
    for (int v = 0; v < g->n_vals; v++) s->n_values += g->vals[v].kind == OPF_VAL_ARENA;
    s->n_inplace = g->n_inplace;
    s->arena_bytes = g->arena_bytes;
    s->unplanned_bytes = g->unplanned_bytes;
    s->saved_bytes = g->saved_bytes;
    s->max_leading = g->lead0;
    s->forward_only = g->forward_only;
}
