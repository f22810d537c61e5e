/* trace.c: the trace and gate passes. The seq's forward and backward plans
 * run on tagged tensors (compile-impl.h): each op's traced half and fake,
 * never its impl, so no tensor data is read. Ops the graph cannot replay
 * from baked args become eager nodes; their output specs come from a probe
 * that runs their traced half (and, without a fake, their impl) on zeroed
 * stand-ins allocated for the probe only. */
#include <stdlib.h>
#include <string.h>

#include "compile/compile-impl.h"
#include "core/device-impl.h"

/* ---- values and nodes ------------------------------------------------------ */

static int new_val(opf_graph *g, const opf_spec *s, opf_val_kind kind, const char *name, int k)
{
    if (g->n_vals == OPF_GRAPH_MAX_VALUES) return -1;
    if (g->n_vals == g->cap_vals) {
        int cap = g->cap_vals ? 2 * g->cap_vals : 64;
        opf_gval *v = realloc(g->vals, sizeof *v * (size_t)cap);
        if (!v) return -1;
        g->vals = v, g->cap_vals = cap;
    }
    opf_gval *v = &g->vals[g->n_vals];
    memset(v, 0, sizeof *v);
    v->spec = *s;
    v->kind = kind;
    v->def = v->last = -1;
    v->store = -1;
    if (k >= 0) snprintf(v->name, sizeof v->name, "%.36s.%d", name, k);
    else snprintf(v->name, sizeof v->name, "%s", name);
    return g->n_vals++;
}

/* t becomes a tagged tensor of value v. */
static void tag_tensor(const opf_graph *g, int v, opf_tensor *t)
{
    memset(t, 0, sizeof *t);
    t->spec = g->vals[v].spec;
    opf_layout L;
    if (opf_spec_layout(&t->spec, &L)) return;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present) t->data[c] = opf_tag(v, c);
}

/* The value a (possibly tagged) tensor refers to, or -1. */
static int tensor_val(const opf_tensor *t)
{
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (t->data[c]) return opf_is_tag(t->data[c]) ? opf_tag_value(t->data[c]) : -1;
    return -1;
}

static opf_gnode *new_node(opf_graph *g, opf_node_kind kind, opf_op *op, int first, int count)
{
    if (g->n_nodes == g->cap_nodes) {
        int cap = g->cap_nodes ? 2 * g->cap_nodes : 32;
        opf_gnode *n = realloc(g->nodes, sizeof *n * (size_t)cap);
        if (!n) return NULL;
        g->nodes = n, g->cap_nodes = cap;
    }
    opf_gnode *n = &g->nodes[g->n_nodes++];
    memset(n, 0, sizeof *n);
    n->kind = kind;
    n->op = op;
    n->first = first;
    n->count = count;
    n->x_val = -1;
    return n;
}

/* Whether an op may hand value v on as its outputs (forward_is_input,
 * backward_is_dy): an arena value only. A graph input stays behind a node
 * that copies it, so the graph's outputs are always its own memory. */
static bool hands_on(const opf_graph *g, int v)
{
    return v >= 0 && g->vals[v].kind == OPF_VAL_ARENA;
}

/* Takes back the last node (an op that turned out to run nothing). */
static void drop_node(opf_graph *g, opf_gnode *n)
{
    free(n->args), free(n->t), free(n->refs), free(n->zero);
    memset(n, 0, sizeof *n);
    g->n_nodes--;
}

static opf_status add_ref(opf_graph *g, opf_gnode *n, opf_tensor *t, bool output)
{
    opf_gref *r = realloc(n->refs, sizeof *r * (size_t)(n->n_refs + 1));
    if (!r) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    n->refs = r;
    opf_gref *ref = &n->refs[n->n_refs++];
    *ref = (opf_gref){.t = t, .val = tensor_val(t), .output = output};
    memcpy(ref->traced, t->data, sizeof t->data);
    return OPF_OK;
}

static opf_status alloc_tensors(opf_graph *g, opf_gnode *n, int count)
{
    n->t = calloc((size_t)(count ? count : 1), sizeof *n->t);
    n->n_t = count;
    return n->t ? OPF_OK : opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
}

/* What an output is to its op, for its value's name. */
typedef enum { ROLE_OUT, ROLE_AUX, ROLE_GRAD, ROLE_SUM } out_role;

/* "ln.y", "fc1+fc1.bias+gelu.aux1", "fc2.dweight", "res.in.dextra0". */
static void value_name(const opf_op *op, out_role role, int i, char *buf, size_t size)
{
    char base[36] = "grad_sum";
    if (op) {
        int len = 0;
        for (int k = 0; k < opf_op_num_basic(op) && len < (int)sizeof base - 1; k++)
            len += snprintf(base + len, sizeof base - (size_t)len, "%s%s", k ? "+" : "",
                            opf_op_basic(op, k)->name);
    }
    int np = op ? opf_op_num_params(op) : 0;
    if (role == ROLE_SUM) snprintf(buf, size, "%s", base);
    else if (role == ROLE_OUT && i == 0) snprintf(buf, size, "%.30s.y", base);
    else if (role == ROLE_OUT) snprintf(buf, size, "%.30s.out%d", base, i);
    else if (role == ROLE_AUX) snprintf(buf, size, "%.30s.aux%d", base, i);
    else if (i == 0) snprintf(buf, size, "%.30s.dx", base);
    else if (i <= np) snprintf(buf, size, "%.30s.d%.10s", base, opf_op_param_const(op, i - 1)->name);
    else snprintf(buf, size, "%.30s.dextra%d", base, i - 1 - np);
}

/* An output tensor: a new arena value of spec s, tagged into *t. */
static opf_status out_tensor(opf_graph *g, opf_gnode *n, const opf_spec *s, out_role role, int i,
                             opf_tensor *t)
{
    char name[48];
    value_name(n->op, role, i, name, sizeof name);
    int v = new_val(g, s, OPF_VAL_ARENA, name, -1);
    if (v < 0) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: more than %d values",
                                OPF_GRAPH_MAX_VALUES);
    g->vals[v].def = (int)(n - g->nodes);
    g->vals[v].backward = n->backward;
    tag_tensor(g, v, t);
    return add_ref(g, n, t, true);
}

/* ---- gate ------------------------------------------------------------------------ */

/* Why op (an entry of the forward or backward plan) must run eagerly, or NULL. */
static const char *eager_reason(const opf_graph *g, const opf_op *op, int first, int count,
                                bool backward, const opf_seq_call *call)
{
    const opf_op_class *c = op->cls;
    const char *r = c->unsupported_reason ? c->unsupported_reason(op) : NULL;
    if (r) return r;
    if (!backward && !c->forward_fake) return "its class has no forward fake";
    if (backward && !c->backward_fake) return "its class has no backward fake";
    for (int k = 0; k < count; k++) {
        const opf_op *b = g->seq->ops[first + k];
        if (backward && g->fwd_eager[first + k]) return "its forward ran as an eager node";
        if (!call->kwargs || !call->kwargs[first + k] || backward) continue;
        const opf_schema *ks = b->cls->kwargs_schema;
        if (!ks) return "it is given kwargs its class does not declare";
        for (int f = 0; f < ks->n_fields; f++)
            if (!(ks->fields[f].flags & OPF_FIELD_KWARG)) return "a kwargs field is not declared OPF_FIELD_KWARG";
    }
    return NULL;
}

/* True when the args hold a tag outside the schema's tensor slots: a tensor
 * the graph cannot see, so the op cannot be replayed from baked args. */
static bool hidden_tensor(const opf_schema *s, void *args)
{
    opf_slot slots[256];
    int n = opf_schema_slots(s, args, slots, 256);
    if (n > 256) return true;
    for (size_t off = 0; off + sizeof(void *) <= s->size; off += sizeof(void *)) {
        void *p;
        memcpy(&p, (char *)args + off, sizeof p);
        if (!opf_is_tag(p)) continue;
        bool in_slot = false;
        for (int i = 0; i < n && !in_slot; i++) {
            const char *t = (const char *)slots[i].tensor;
            in_slot = (const char *)args + off >= t && (const char *)args + off < t + sizeof(opf_tensor);
        }
        if (!in_slot) return true;
    }
    return false;
}

/* ---- runtime kwargs ----------------------------------------------------------- */

static opf_status find_runtime(opf_graph *g, const opf_gnode *n, const opf_schema *s, char *args)
{
    for (int i = 0; i < s->n_fields; i++) {
        const opf_field *f = &s->fields[i];
        if (f->kind == OPF_FIELD_BUNDLE && f->bundle) {
            opf_status st = find_runtime(g, n, f->bundle, args + f->offset);
            if (st) return st;
            continue;
        }
        if (!(f->flags & OPF_FIELD_RUNTIME)) continue;
        for (int k = 0; k < n->count; k++) {
            int op = n->first + k;
            const opf_field *kf = opf_schema_field(g->seq->ops[op]->cls->kwargs_schema, f->name);
            if (!kf || !(kf->flags & OPF_FIELD_RUNTIME) || !g->kwargs[op]) continue;
            opf_grt *r = realloc(g->rt, sizeof *r * (size_t)(g->n_rt + 1));
            if (!r) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
            g->rt = r;
            g->rt[g->n_rt++] = (opf_grt){args + f->offset, f->kind, kf->kind, op, kf->offset};
            break;
        }
    }
    return OPF_OK;
}

/* ---- probes of eager nodes -------------------------------------------------------- */

/* A zero-filled real tensor of spec s (probe stand-in for a value). */
static opf_status zero_tensor(opf_ctx *ctx, const opf_spec *s, opf_tensor *t)
{
    opf_status st = opf_tensor_alloc(ctx, s, t);
    if (st) return st;
    opf_layout L;
    opf_spec_layout(s, &L);
    for (int c = 0; c < OPF_COMP_COUNT && !st; c++)
        if (L.comp[c].present && t->data[c]) st = opf_device_memset(ctx, s->device, t->data[c], 0, L.comp[c].nbytes);
    return st;
}

/* The probe stand-in of a forward input: the caller's tensor for a public
 * extra input that came with data (ops such as grouped_linear read theirs,
 * split sizes, on the host in their traced half, so zeros would fail them),
 * zeros otherwise. An extra input resized to the traced leading size
 * (max_leading) does not match its data and gets zeros. */
static opf_status probe_input(const opf_graph *g, const opf_seq_call *call, const opf_tensor *src,
                              opf_tensor *out)
{
    int v = tensor_val(src);
    const opf_gval *gv = v >= 0 ? &g->vals[v] : NULL;
    if (gv && gv->kind == OPF_VAL_INPUT && gv->in_kind == OPF_IN_EXTRA && call->extra_in) {
        const opf_tensor *t = &call->extra_in[gv->in_index];
        bool resized = g->opts.max_leading > 0 && t->spec.ndim >= 1 &&
                       t->spec.shape[0] == g->x_spec.shape[0];
        if (t->data[0] && !resized && opf_spec_equal(&t->spec, &src->spec)) {
            opf_tensor_retain(t, out);
            return OPF_OK;
        }
    }
    return zero_tensor(g->ctx, &src->spec, out);
}

/* The inputs of an eager node: *x the main one (x or dy), extra[0..n_in - 1)
 * the extra ones (NULL: none). Each becomes a tagged ref in
 * n->t[n->n_out + i] for the plan and a real stand-in real[i] for the probe,
 * at which *x and extra[] then point (NULL where there is none). */
static opf_status eager_inputs(opf_graph *g, const opf_seq_call *call, opf_gnode *n, int n_in,
                               const opf_tensor **x, const opf_tensor **extra, opf_tensor *real)
{
    memset(real, 0, sizeof *real * (size_t)n_in);
    opf_status st = OPF_OK;
    for (int i = 0; i < n_in; i++) {
        const opf_tensor **slot = i ? &extra[i - 1] : x, *src = *slot;
        *slot = NULL;
        if (!src || st) continue;
        n->t[n->n_out + i] = *src;
        n->in_mask |= 1u << i;
        st = add_ref(g, n, &n->t[n->n_out + i], false);
        if (!st) st = call ? probe_input(g, call, src, &real[i]) : zero_tensor(g->ctx, &src->spec, &real[i]);
        if (!st) *slot = &real[i];
    }
    return st;
}

/* ---- the trace ------------------------------------------------------------------------- */

typedef struct trace_state {
    opf_graph   *g;
    const opf_seq_call *call;
    opf_op_ctx  *probe;               /* [n] real contexts of eager forwards */
    bool         backward;            /* tracing the backward (a recompute span's re-run) */
} trace_state;

/* Turns n into an eager node of op with its outputs then its inputs in n->t
 * (the main one, then the extra ones): a forward's outputs are y and the
 * extra outputs, a backward's dx and the extra inputs' gradients. */
static opf_status eager_node(opf_graph *g, opf_gnode *n, const opf_op *op, opf_node_kind kind,
                             const char *reason)
{
    bool fwd = kind == OPF_NODE_EAGER_FORWARD;
    int n_out = 1 + (fwd ? op->n_extra_out : op->n_extra_in);
    int n_in = 1 + (fwd ? op->n_extra_in : op->n_extra_out);
    opf_status st = alloc_tensors(g, n, n_out + n_in);
    if (st) return st;
    n->kind = kind;
    n->reason = reason;
    n->n_out = n_out;
    n->n_extra = n_in - 1;
    return OPF_OK;
}

static opf_status eager_forward(trace_state *ts, const opf_plan_entry *e, opf_fwd_env *env,
                                opf_gnode *n, const char *reason)
{
    opf_graph *g = ts->g;
    opf_op *op = e->op;
    opf_status st = eager_node(g, n, op, OPF_NODE_EAGER_FORWARD, reason);
    if (st) return st;
    int n_out = n->n_out, n_in = 1 + n->n_extra;
    n->requires_grad = env->requires_grad;
    n->first_requires_grad = env->first_requires_grad;
    for (int k = 0; k < 2; k++) {
        const opf_quantizer *q = k ? env->next_input_q : env->prev_grad_q;
        n->has_q[k] = q != NULL;
        if (q) n->qv[k] = *q;
    }
    /* inputs: tagged refs for the plan; stand-ins for the probe, which also
     * reads the caller's kwargs (eager nodes get the real ones) */
    opf_tensor real_in[1 + OPF_OP_MAX_EXTRA] = {0};
    opf_fwd_env probe = *env;
    const void *kw[OPF_FUSED_MAX];
    probe.kwargs = opf_entry_kwargs(e, ts->call->kwargs, kw);
    st = eager_inputs(g, ts->call, n, n_in, &probe.x, probe.extra_in, real_in);
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA];
    memset(outs, 0, sizeof outs);
    if (!st) st = opf_op_forward(op, &probe, env->requires_grad ? &ts->probe[e->first] : NULL, outs);
    for (int i = 0; i < n_out && !st; i++) {
        if (!outs[i].data[0] && !outs[i].data[OPF_COMP_COL_DATA])
            st = opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "compile: %s: the eager forward produced no "
                           "output %d", op->name, i);
        else
            st = out_tensor(g, n, &outs[i].spec, ROLE_OUT, i, &n->t[i]);
    }
    for (int i = 0; i < n_out; i++) opf_tensor_release(&outs[i]);
    for (int i = 0; i < n_in; i++) opf_tensor_release(&real_in[i]);
    return st;
}

/* The probe contexts of an eager backward whose forward was traced: the
 * traced contexts with zeroed stand-ins for every tagged saved tensor. */
static opf_status probe_from_traced(opf_graph *g, const opf_op_ctx *traced, opf_op_ctx *probe, int n)
{
    for (int k = 0; k < n; k++) {
        opf_op_ctx_clear(&probe[k]);
        probe[k] = traced[k];
        probe[k].n_saved = 0;
        for (int i = 0; i < traced[k].n_saved; i++) {
            opf_status st = zero_tensor(g->ctx, &traced[k].saved[i].spec, &probe[k].saved[i]);
            if (st) return st;
            probe[k].n_saved = i + 1;
        }
    }
    return OPF_OK;
}

static opf_status eager_backward(trace_state *ts, const opf_plan_entry *e, opf_bwd_env *env,
                                 opf_gnode *n, const char *reason)
{
    opf_graph *g = ts->g;
    opf_ctx *ctx = g->ctx;
    opf_op *op = e->op;
    opf_status st = eager_node(g, n, op, OPF_NODE_EAGER_BACKWARD, reason);
    if (st) return st;
    int n_in = 1 + n->n_extra;
    n->has_q[0] = env->prev_grad_q != NULL;
    if (env->prev_grad_q) n->qv[0] = *env->prev_grad_q;
    n->restore_octx = !g->fwd_eager[e->first];
    if (n->restore_octx) {
        if ((st = probe_from_traced(g, &g->octx_traced[e->first], &ts->probe[e->first], e->count)))
            return st;
        for (int k = 0; k < e->count && !st; k++) {
            opf_op_ctx *c = &g->octx_traced[e->first + k];
            for (int i = 0; i < c->n_saved && !st; i++) st = add_ref(g, n, &c->saved[i], false);
        }
    }
    opf_tensor real_in[1 + OPF_OP_MAX_EXTRA] = {0};
    opf_bwd_env probe = *env;
    if (!st) st = eager_inputs(g, NULL, n, n_in, &probe.dy, probe.dextra_out, real_in);
    /* the probe runs the traced half and the fake; without a fake, the impl
     * (which then allocates its gradients) but never the accumulation */
    unsigned char *bargs = st ? NULL : calloc(1, op->cls->bwd_schema->size);
    opf_spec gs[OPF_OP_MAX_GRADS];
    opf_tensor gr[OPF_OP_MAX_GRADS];
    int ng = 0;
    memset(gr, 0, sizeof gr);
    if (!st && !bargs) st = opf_error(ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    if (!st) st = opf_op_trace_backward(op, &ts->probe[e->first], &probe, bargs, gs, &ng);
    if (!st && !op->cls->backward_fake) {
        size_t mark = opf_ctx_scratch_mark(ctx);
        st = op->cls->backward_impl(ctx, bargs, gr);
        opf_ctx_scratch_pop(ctx, mark);
        for (int i = 0; i < ng; i++) {
            gs[i] = gr[i].spec;
            if (!gr[i].data[0] && !gr[i].data[OPF_COMP_COL_DATA]) gs[i].ndim = OPF_SPEC_NONE_NDIM;
            if (i == 0 && gr[0].data[0] && gr[0].data[0] == real_in[0].data[0]) gs[0].ndim = OPF_GRAD_PASSTHROUGH;
        }
    }
    int n_params = opf_op_num_params(op);
    if (!st) {
        n->passthrough = gs[0].ndim == OPF_GRAD_PASSTHROUGH;
        if (gs[0].ndim >= 0) st = out_tensor(g, n, &gs[0], ROLE_GRAD, 0, &n->t[0]);
        for (int i = 0; i < op->n_extra_in && !st; i++)
            if (gs[1 + n_params + i].ndim >= 0)
                st = out_tensor(g, n, &gs[1 + n_params + i], ROLE_GRAD, 1 + n_params + i, &n->t[1 + i]);
    }
    for (int i = 0; i < ng; i++) opf_tensor_release(&gr[i]);
    for (int i = 0; i < n_in; i++) opf_tensor_release(&real_in[i]);
    free(bargs);
    for (int k = 0; k < e->count; k++) opf_op_ctx_clear(&ts->probe[e->first + k]);
    return st;
}

/* ---- the tracing visitor of the seq walker (fuser/walk-impl.h) ------------------ */

static opf_status trace_forward(opf_walker *w, const opf_plan_entry *e, const opf_fwd_env *walk_env,
                                opf_tensor *outs)
{
    trace_state *ts = w->user;
    opf_graph *g = ts->g;
    opf_op *op = e->op;
    int first = e->first;
    opf_fwd_env env = *walk_env;
    opf_gnode *n = new_node(g, OPF_NODE_FORWARD, op, first, e->count);
    if (!n) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    n->x_val = tensor_val(env.x);
    n->backward = ts->backward;
    const char *reason = eager_reason(g, op, first, e->count, false, ts->call);
    opf_status st = OPF_OK;
    if (!reason) {  /* trace on tags */
        n->schema = op->cls->fwd_schema;
        n->args = calloc(1, n->schema->size);
        opf_spec out_s[1 + OPF_OP_MAX_EXTRA], aux_s[OPF_OP_MAX_AUX];
        if (!n->args) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
        if ((st = opf_op_trace_forward(op, &env, n->args, out_s, aux_s))) return st;
        if (hands_on(g, n->x_val) &&
            opf_op_outputs_are(op, false, env.x, out_s, 1 + op->n_extra_out, aux_s)) {
            /* forward_is_input: every output is x's value; the op leaves no node */
            opf_tensor aux[OPF_OP_MAX_AUX] = {0};
            for (int i = 0; i < 1 + op->n_extra_out; i++) {
                memset(&outs[i], 0, sizeof outs[i]);
                if (out_s[i].ndim >= 0) outs[i] = *env.x;
            }
            if (env.requires_grad)
                st = opf_op_save_context(op, &env, &g->octx_traced[first], n->args, outs, aux);
            drop_node(g, n);
            return st;
        }
        if (hidden_tensor(n->schema, n->args)) {
            reason = "its args hold a tensor outside its schema";
            free(n->args);
            n->args = NULL;
            n->schema = NULL;
        } else {
            n->n_out = 1 + OPF_OP_MAX_EXTRA + OPF_OP_MAX_AUX;
            if ((st = alloc_tensors(g, n, n->n_out))) return st;
            opf_slot slots[256];
            int ns = opf_schema_slots(n->schema, n->args, slots, 256);
            st = find_runtime(g, n, n->schema, n->args);
            for (int i = 0; i < ns && !st; i++) st = add_ref(g, n, slots[i].tensor, false);
            for (int i = 0; i < 1 + op->n_extra_out && !st; i++)
                if (out_s[i].ndim >= 0) st = out_tensor(g, n, &out_s[i], ROLE_OUT, i, &n->t[i]);
            for (int i = 0; i < OPF_OP_MAX_AUX && !st; i++)
                if (aux_s[i].ndim >= 0)
                    st = out_tensor(g, n, &aux_s[i], ROLE_AUX, i, &n->t[1 + OPF_OP_MAX_EXTRA + i]);
            if (!st && n->t[0].spec.ndim == 0 && !n->t[0].data[0])
                st = opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "compile: %s: the fake gives no output",
                               op->name);
            if (!st && env.requires_grad)
                st = opf_op_save_context(op, &env, &g->octx_traced[first], n->args, n->t,
                                         n->t + 1 + OPF_OP_MAX_EXTRA);
        }
    }
    if (reason) {
        for (int k = 0; k < e->count; k++) g->fwd_eager[first + k] = true;
        if ((st = eager_forward(ts, e, &env, n, reason))) return st;
    }
    if (st) return st;
    for (int i = 0; i < 1 + op->n_extra_out; i++) outs[i] = n->t[i];
    return OPF_OK;
}

/* acc += g: a GRAD_ADD node when both exist (channel gradients flow only in
 * the backward graph). */
static opf_status trace_add_grad(opf_walker *w, opf_tensor *acc, const opf_tensor *gt)
{
    trace_state *ts = w->user;
    opf_graph *g = ts->g;
    int v = tensor_val(gt);
    if (v < 0) return OPF_OK;
    if (tensor_val(acc) < 0) {
        *acc = *gt;
        return OPF_OK;
    }
    opf_gnode *n = new_node(g, OPF_NODE_GRAD_ADD, NULL, -1, 0);
    if (!n) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    n->backward = true;
    opf_status st = alloc_tensors(g, n, 3);
    if (st) return st;
    n->n_out = 1;
    opf_spec s = opf_grad_sum_spec(&acc->spec);
    if ((st = out_tensor(g, n, &s, ROLE_SUM, 0, &n->t[0]))) return st;
    tag_tensor(g, tensor_val(acc), &n->t[1]);
    tag_tensor(g, v, &n->t[2]);
    if ((st = add_ref(g, n, &n->t[1], false)) || (st = add_ref(g, n, &n->t[2], false))) return st;
    *acc = n->t[0];
    return OPF_OK;
}

static opf_status trace_backward(opf_walker *w, const opf_plan_entry *e, const opf_bwd_env *walk_env,
                                 opf_tensor *dx, opf_tensor *dextra_in)
{
    trace_state *ts = w->user;
    opf_graph *g = ts->g;
    opf_op *op = e->op;
    int first = e->first;
    opf_bwd_env env = *walk_env;
    int cur = tensor_val(env.dy);
    if (cur < 0)
        return opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "compile: %s: no gradient reaches its backward",
                         op->name);
    opf_status st = OPF_OK;
    opf_gnode *n = new_node(g, OPF_NODE_BACKWARD, op, first, e->count);
    if (!n) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    n->backward = true;
    int n_params = opf_op_num_params(op);
    const char *reason = eager_reason(g, op, first, e->count, true, ts->call);
    int dx_val = -1, dxi_at = 1;  /* extra-input gradients: n->t[dxi_at + i] */
    if (!reason) {
        n->schema = op->cls->bwd_schema;
        n->args = calloc(1, n->schema->size);
        if (!n->args) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
        opf_spec gs[OPF_OP_MAX_GRADS];
        int ng;
        if ((st = opf_op_trace_backward(op, &g->octx_traced[first], &env, n->args, gs, &ng))) return st;
        if (hidden_tensor(n->schema, n->args)) {
            reason = "its args hold a tensor outside its schema";
            free(n->args);
            n->args = NULL;
            n->schema = NULL;
        } else if (hands_on(g, cur) && opf_op_outputs_are(op, true, env.dy, gs, ng, NULL)) {
            /* backward_is_dy: dx and every extra-input gradient are dy's
             * value; the op leaves no node */
            for (int i = 0; i < op->n_extra_in; i++) {
                memset(&dextra_in[i], 0, sizeof dextra_in[i]);
                if (gs[1 + i].ndim >= 0) dextra_in[i] = *env.dy;
            }
            if (gs[0].ndim >= 0 || gs[0].ndim == OPF_GRAD_PASSTHROUGH) *dx = *env.dy;
            drop_node(g, n);
            return OPF_OK;
        } else {
            n->passthrough = gs[0].ndim == OPF_GRAD_PASSTHROUGH;
            if (n->passthrough) gs[0].ndim = OPF_SPEC_NONE_NDIM;
            n->n_params = n_params;
            n->n_out = ng;
            if ((st = alloc_tensors(g, n, ng))) return st;
            opf_slot slots[256];
            int ns = opf_schema_slots(n->schema, n->args, slots, 256);
            st = find_runtime(g, n, n->schema, n->args);
            for (int i = 0; i < ns && !st; i++) st = add_ref(g, n, slots[i].tensor, false);
            for (int i = 0; i < ng && !st; i++)
                if (gs[i].ndim >= 0) st = out_tensor(g, n, &gs[i], ROLE_GRAD, i, &n->t[i]);
            if (st) return st;
            for (int i = 1; i <= n_params; i++)  /* plain: exec.c places data[0] alone */
                if (n->t[i].data[0] && n->t[i].spec.scaling == OPF_SCALING_NONE)
                    g->vals[tensor_val(&n->t[i])].pgrad = true;
            dx_val = n->passthrough ? cur : tensor_val(&n->t[0]);
            dxi_at = 1 + n_params;
        }
    }
    if (reason) {
        if ((st = eager_backward(ts, e, &env, n, reason))) return st;
        dx_val = n->passthrough ? cur : tensor_val(&n->t[0]);
    }
    if (dx_val >= 0) tag_tensor(g, dx_val, dx);
    for (int i = 0; i < op->n_extra_in; i++) dextra_in[i] = n->t[dxi_at + i];
    return OPF_OK;
}

/* Recompute: the state phases become nodes (the Philox offset and scales
 * are read and set when the graph runs); DROP needs none: the backward
 * nodes read the re-run's values, so the forward's die with the forward. */
static opf_status trace_recompute(opf_walker *w, int grp, opf_rc_phase phase)
{
    trace_state *ts = w->user;
    if (phase == OPF_RC_DROP) return OPF_OK;
    opf_gnode *n = new_node(ts->g, OPF_NODE_RECOMPUTE, NULL, grp, 0);
    if (!n) return opf_error(ts->g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    n->backward = phase != OPF_RC_MARK;
    n->rc_phase = (int)phase;
    return OPF_OK;
}

static const opf_walk_i trace_walk = {trace_forward, trace_backward, trace_add_grad, trace_recompute};

static opf_status add_update(opf_graph *g, bool backward)
{
    bool any = false;
    for (int i = 0; i < g->seq->n && !any; i++)
        any = g->seq->ops[i]->rs && opf_recipe_state_delayed(g->seq->ops[i]->rs, backward);
    if (!any) return OPF_OK;
    opf_gnode *n = new_node(g, OPF_NODE_AMAX_UPDATE, NULL, -1, 0);
    if (!n) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    n->backward = backward;
    return OPF_OK;
}

/* An input value with a tagged tensor. */
static int input_val(opf_graph *g, const opf_spec *s, opf_in_kind kind, int index, const char *name)
{
    int v = new_val(g, s, OPF_VAL_INPUT, name, index);
    if (v >= 0) g->vals[v].in_kind = kind, g->vals[v].in_index = index;
    return v;
}

/* The kwargs copies the traced halves read: value fields as given, tensor
 * fields replaced by tagged graph inputs. */
static opf_status trace_kwargs(opf_graph *g, const opf_seq_call *call)
{
    opf_seq *seq = g->seq;
    g->kwargs = calloc((size_t)seq->n, sizeof *g->kwargs);
    g->kw_given = calloc((size_t)seq->n + 1, sizeof *g->kw_given);
    if (!g->kwargs || !g->kw_given) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    for (int i = 0; call->kwargs && i < seq->n; i++) {
        const opf_schema *ks = seq->ops[i]->cls->kwargs_schema;
        g->kw_given[i] = call->kwargs[i] != NULL;
        if (!call->kwargs[i] || !ks) continue;  /* eager nodes read the caller's */
        g->kwargs[i] = calloc(1, ks->size);
        if (!g->kwargs[i]) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
        memcpy(g->kwargs[i], call->kwargs[i], ks->size);
        for (int f = 0; f < ks->n_fields; f++) {
            const opf_field *fd = &ks->fields[f];
            if (fd->kind != OPF_FIELD_TENSOR && fd->kind != OPF_FIELD_TENSOR_Q) continue;
            opf_tensor *t = (opf_tensor *)((char *)g->kwargs[i] + fd->offset);
            if (!t->data[0] && !t->data[OPF_COMP_COL_DATA]) continue;
            char name[48];
            snprintf(name, sizeof name, "%.20s.%.20s", seq->ops[i]->name, fd->name);
            int v = input_val(g, &t->spec, OPF_IN_KWARG, i, name);
            if (v < 0) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
            g->vals[v].in_field = fd->offset;
            tag_tensor(g, v, t);
        }
    }
    return OPF_OK;
}

opf_status opf_graph_trace(opf_graph *g, const opf_spec *x, const opf_seq_call *call)
{
    opf_seq *seq = g->seq;
    opf_ctx *ctx = g->ctx;
    int n = seq->n;
    opf_status st;
    g->n_ops = n;
    g->octx = calloc((size_t)n, sizeof *g->octx);
    g->octx_traced = calloc((size_t)n, sizeof *g->octx_traced);
    g->fwd_eager = calloc((size_t)n, sizeof *g->fwd_eager);
    g->extra_in_spec = calloc((size_t)seq->n_pub_in + 1, sizeof *g->extra_in_spec);
    g->extra_in_val = calloc((size_t)seq->n_pub_in + 1, sizeof(int));
    g->dextra_in_val = calloc((size_t)seq->n_pub_in + 1, sizeof(int));
    g->extra_out_val = calloc((size_t)seq->n_pub_out + 1, sizeof(int));
    g->dextra_out_val = calloc((size_t)seq->n_pub_out + 1, sizeof(int));
    trace_state ts = {.g = g, .call = call};
    size_t ne = (size_t)n * OPF_OP_MAX_EXTRA;
    opf_tensor *chan = calloc(ne, sizeof *chan), *chan_grad = calloc(ne, sizeof *chan_grad);
    opf_tensor *ext = calloc((size_t)seq->n_pub_in + 1, sizeof *ext);
    opf_tensor *dext = calloc((size_t)seq->n_pub_in + (size_t)seq->n_pub_out + 1, sizeof *dext);
    ts.probe = calloc((size_t)n, sizeof *ts.probe);
    if (!g->octx || !g->octx_traced || !g->fwd_eager || !g->extra_in_spec || !g->extra_in_val ||
        !g->dextra_in_val || !g->extra_out_val || !g->dextra_out_val || !chan || !chan_grad ||
        !ext || !dext || !ts.probe) {
        st = opf_error(ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
        goto done;
    }
    g->n_pub_in = seq->n_pub_in;
    g->n_pub_out = seq->n_pub_out;
    g->x_val = input_val(g, x, OPF_IN_X, -1, "x");
    for (int p = 0; p < seq->n_pub_in; p++) {
        g->extra_in_spec[p] = call->extra_in[p].spec;
        g->extra_in_val[p] = input_val(g, &call->extra_in[p].spec, OPF_IN_EXTRA, p, "extra_in");
        tag_tensor(g, g->extra_in_val[p], &ext[p]);
        g->dextra_in_val[p] = -1;
    }
    if ((st = trace_kwargs(g, call))) goto done;
    opf_walker w = {.seq = seq, .vt = &trace_walk, .user = &ts, .first_req = g->first_req,
                    .kwargs = (const void *const *)g->kwargs, .extra_in = ext, .chan = chan,
                    .chan_grad = chan_grad};
    opf_tensor xt, yt;
    tag_tensor(g, g->x_val, &xt);
    if ((st = opf_walk_forward(&w, &xt, &yt))) goto done;
    g->y_val = tensor_val(&yt);
    g->vals[g->y_val].keep = true;
    opf_tensor *eout = dext + seq->n_pub_in;  /* scratch for the public extra outputs */
    opf_walk_extra_out(&w, eout);
    for (int p = 0; p < seq->n_pub_out; p++) {
        g->extra_out_val[p] = tensor_val(&eout[p]);
        if (g->extra_out_val[p] >= 0) g->vals[g->extra_out_val[p]].keep = true;
    }
    if (g->call.requires_grad && (st = add_update(g, false))) goto done;
    g->n_fwd = g->n_nodes;
    g->dx_val = -1;
    if (!g->forward_only) {
        /* backward: callers pass plain gradients */
        const opf_spec *ys = &g->vals[g->y_val].spec;
        opf_spec dys = opf_spec_make(ys->ndim, ys->shape, ys->dtype);
        dys.device = ys->device;
        g->dy_val = input_val(g, &dys, OPF_IN_DY, -1, "dy");
        for (int p = 0; p < seq->n_pub_out; p++) {
            const opf_spec *es = &g->vals[g->extra_out_val[p]].spec;
            opf_spec s = opf_spec_make(es->ndim, es->shape, es->dtype);
            s.device = es->device;
            g->dextra_out_val[p] = input_val(g, &s, OPF_IN_DEXTRA_OUT, p, "dextra_out");
            tag_tensor(g, g->dextra_out_val[p], &eout[p]);
        }
        opf_tensor dyt, dxt;
        tag_tensor(g, g->dy_val, &dyt);
        ts.backward = true;
        if ((st = opf_walk_backward(&w, &dyt, eout, &dxt, dext))) goto done;
        g->dx_val = g->first_req == 0 ? tensor_val(&dxt) : -1;
        if (g->dx_val >= 0) g->vals[g->dx_val].keep = true;
        for (int p = 0; p < seq->n_pub_in; p++) {
            g->dextra_in_val[p] = tensor_val(&dext[p]);
            if (g->dextra_in_val[p] >= 0) g->vals[g->dextra_in_val[p]].keep = true;
        }
        if ((st = add_update(g, true))) goto done;
    }
    /* warn once per reason */
    for (int i = 0; i < g->n_nodes; i++) {
        const opf_gnode *nd = &g->nodes[i];
        if (nd->kind != OPF_NODE_EAGER_FORWARD && nd->kind != OPF_NODE_EAGER_BACKWARD) continue;
        char key[256];
        snprintf(key, sizeof key, "compile:%s:%s", nd->op->cls->name, nd->reason);
        opf_ctx_warn_once(ctx, key, "compile: %s \"%s\" runs as an eager node inside the graph: %s",
                          nd->op->cls->name, nd->op->name, nd->reason);
    }
done:
    if (ts.probe)
        for (int i = 0; i < n; i++) opf_op_ctx_clear(&ts.probe[i]);
    free(chan), free(chan_grad), free(ext), free(dext), free(ts.probe);
    return st;
}

void opf_graph_free_ir(opf_graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) {
        free(g->nodes[i].args);
        free(g->nodes[i].t);
        free(g->nodes[i].refs);
        free(g->nodes[i].zero);
    }
    free(g->nodes);
    g->nodes = NULL;
    g->n_nodes = g->cap_nodes = 0;
    free(g->vals);
    g->vals = NULL;
    g->n_vals = g->cap_vals = 0;
    /* n_ops, not seq->n: a stale graph's seq may have grown or shrunk since */
    for (int i = 0; g->kwargs && i < g->n_ops; i++) free(g->kwargs[i]);
    free(g->kwargs);
    free(g->kw_given);
    g->kwargs = NULL;
    g->kw_given = NULL;
    for (int i = 0; g->octx && i < g->n_ops; i++) opf_op_ctx_clear(&g->octx[i]);
    for (int i = 0; g->octx_traced && i < g->n_ops; i++) opf_op_ctx_clear(&g->octx_traced[i]);
    free(g->octx), free(g->octx_traced), free(g->fwd_eager);
    g->octx = g->octx_traced = NULL;
    g->fwd_eager = NULL;
    free(g->extra_in_spec), free(g->extra_in_val), free(g->dextra_in_val);
    free(g->extra_out_val), free(g->dextra_out_val);
    g->extra_in_spec = NULL;
    g->extra_in_val = g->dextra_in_val = g->extra_out_val = g->dextra_out_val = NULL;
}
