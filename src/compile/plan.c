/* plan.c: the memory plan of a traced graph (liveness over the node order,
 * in-place reuse, first-fit placement into one arena), baking the tags into
 * addresses, and the affine patches of a dynamic leading dimension.
 * Parameter gradients take no arena block: the backward node writes a
 * parameter's first gradient into its grad, and a later one (to be added)
 * into the graph's gradient buffer (exec.c), so their tags stay past
 * baking.
 *
 * The arena is one block of the memory x lives in: the host's counting
 * allocator, or the device allocator of x's device (one allocation per
 * graph). A graph that replays captured device graphs also places its
 * inputs in the arena (alive throughout): a captured graph reads fixed
 * addresses, so each call copies its inputs there (replay.c) instead of
 * patching pointers. */
#include <stdlib.h>
#include <string.h>

#include "compile/compile-impl.h"
#include "core/device-impl.h"

#define ALIGN 64

static size_t align_up(size_t n) { return (n + ALIGN - 1) & ~(size_t)(ALIGN - 1); }

/* The block of a value: its components one after another, each aligned. */
static opf_status block_layout(opf_graph *g, opf_gval *v)
{
    opf_layout L;
    opf_status st = opf_spec_layout(&v->spec, &L);
    if (st) return opf_error(g->ctx, st, "compile: value %s: %s", v->name, opf_last_error(NULL));
    size_t off = 0;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        v->comp_off[c] = off;
        if (L.comp[c].present) off += align_up(L.comp[c].nbytes ? L.comp[c].nbytes : 1);
    }
    v->bytes = off ? off : ALIGN;
    return OPF_OK;
}

/* Same components with the same sizes: one can be written over the other. */
static bool same_bytes(const opf_spec *a, const opf_spec *b)
{
    opf_layout la, lb;
    if (opf_spec_layout(a, &la) || opf_spec_layout(b, &lb)) return false;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (la.comp[c].present != lb.comp[c].present || la.comp[c].nbytes != lb.comp[c].nbytes)
            return false;
    return true;
}

static int tensor_val(const opf_tensor *t)
{
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (t->data[c]) return opf_is_tag(t->data[c]) ? opf_tag_value(t->data[c]) : -1;
    return -1;
}

static void liveness(opf_graph *g)
{
    int end = g->n_nodes;
    for (int i = 0; i < g->n_nodes; i++) {
        const opf_gnode *n = &g->nodes[i];
        bool hold = n->kind == OPF_NODE_EAGER_FORWARD && n->requires_grad;
        for (int r = 0; r < n->n_refs; r++) {
            int v = n->refs[r].val;
            if (v < 0) continue;
            opf_gval *gv = &g->vals[v];
            /* an eager forward keeps real pointers in its context for backward */
            int use = hold ? end : i;
            if (!n->refs[r].output || hold) gv->last = gv->last > use ? gv->last : use;
        }
    }
    for (int v = 0; v < g->n_vals; v++) {
        opf_gval *gv = &g->vals[v];
        if (gv->keep) gv->last = end;
        if (gv->last < gv->def) gv->last = gv->def;
    }
}

opf_status opf_graph_plan(opf_graph *g)
{
    liveness(g);
    g->stores = calloc((size_t)g->n_vals + 1, sizeof *g->stores);
    if (!g->stores) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    g->n_stores = 0;
    g->unplanned_bytes = g->saved_bytes = 0;
    g->n_inplace = 0;
    for (int v = 0; v < g->n_vals; v++) {
        opf_gval *gv = &g->vals[v];
        if (gv->kind != OPF_VAL_ARENA && !g->capture) continue;
        opf_status st = block_layout(g, gv);
        if (st) return st;
        if (gv->pgrad) continue;  /* no block: exec.c places it per call */
        g->unplanned_bytes += gv->bytes;
        if (gv->kind == OPF_VAL_INPUT) {  /* staged: the whole graph long */
            gv->store = g->n_stores;
            g->stores[g->n_stores++] = (opf_gstore){gv->bytes, 0, 0, g->n_nodes};
            continue;
        }
        if (gv->def < g->n_fwd && gv->last >= g->n_fwd && !gv->keep) g->saved_bytes += gv->bytes;
        /* in place: the node's main input dies here and has the same bytes */
        const opf_gnode *n = gv->def >= 0 ? &g->nodes[gv->def] : NULL;
        int x = n ? n->x_val : -1;
        if (n && n->kind == OPF_NODE_FORWARD && n->op->cls->inplace && x >= 0 &&
            tensor_val(&n->t[0]) == v && g->vals[x].kind == OPF_VAL_ARENA && !g->vals[x].keep &&
            g->vals[x].last == gv->def && g->vals[x].store >= 0 && same_bytes(&g->vals[x].spec, &gv->spec)) {
            gv->store = g->vals[x].store;
            opf_gstore *s = &g->stores[gv->store];
            if (gv->last > s->end) s->end = gv->last;
            g->n_inplace++;
            continue;
        }
        gv->store = g->n_stores;
        g->stores[g->n_stores++] = (opf_gstore){gv->bytes, 0, gv->def, gv->last};
    }
    /* the gradient buffer: the most one backward node adds */
    g->pgrad_bytes = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const opf_gnode *n = &g->nodes[i];
        size_t need = 0;
        for (int k = 1; n->kind == OPF_NODE_BACKWARD && k <= n->n_params; k++) {
            int v = tensor_val(&n->t[k]);
            if (v >= 0 && g->vals[v].pgrad) need += g->vals[v].bytes;
        }
        if (need > g->pgrad_bytes) g->pgrad_bytes = need;
    }
    /* first fit, largest blocks first */
    int *order = malloc(sizeof(int) * (size_t)(g->n_stores + 1));
    if (!order) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    for (int i = 0; i < g->n_stores; i++) order[i] = i;
    for (int i = 1; i < g->n_stores; i++)  /* insertion sort: stable, few stores */
        for (int j = i; j > 0 && g->stores[order[j]].bytes > g->stores[order[j - 1]].bytes; j--) {
            int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    size_t top = 0;
    for (int i = 0; i < g->n_stores; i++) {
        opf_gstore *s = &g->stores[order[i]];
        size_t off = 0;
        for (bool moved = true; moved;) {
            moved = false;
            for (int j = 0; j < i; j++) {
                const opf_gstore *o = &g->stores[order[j]];
                bool time = s->start <= o->end && o->start <= s->end;
                bool space = off < o->offset + o->bytes && o->offset < off + s->bytes;
                if (time && space) {
                    off = o->offset + o->bytes;
                    moved = true;
                }
            }
        }
        s->offset = off;
        if (off + s->bytes > top) top = off + s->bytes;
    }
    free(order);
    g->arena_bytes = top;
    opf_status st = opf_graph_mem_alloc(g, top, (void **)&g->arena);
    if (st) return st;
    /* the zero block for missing dextra_out */
    size_t zb = 0;
    for (int p = 0; !g->forward_only && p < g->n_pub_out; p++) {
        opf_layout L;
        if (!opf_spec_layout(&g->vals[g->dextra_out_val[p]].spec, &L) && L.total_bytes > zb) zb = L.total_bytes;
    }
    if ((st = opf_graph_mem_alloc(g, zb, &g->zeros))) return st;
    g->zeros_bytes = zb;
    return opf_device_memset(g->ctx, opf_graph_device(g), g->zeros, 0, zb);
}

opf_device opf_graph_device(const opf_graph *g) { return g->on_device ? g->x_spec.device : OPF_DEVICE_CPU; }

opf_status opf_graph_mem_alloc(opf_graph *g, size_t bytes, void **out)
{
    *out = NULL;
    if (!bytes) return OPF_OK;
    if (g->on_device) {
        opf_status st = opf_device_alloc(g->ctx, bytes, out);
        return st ? opf_error(g->ctx, st, "compile: no arena of %zu bytes on %s: %s", bytes,
                              opf_device_name(opf_graph_device(g)), opf_last_error(g->ctx))
                  : OPF_OK;
    }
    *out = opf_ctx_alloc(g->ctx, bytes);
    return *out ? OPF_OK : opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: no arena of %zu bytes", bytes);
}

void opf_graph_mem_free(opf_graph *g, void *p, size_t bytes)
{
    if (!p) return;
    if (g->on_device) opf_device_free(g->ctx, p, bytes);
    else opf_ctx_free(g->ctx, p, bytes);
}

static void *arena_addr(const opf_graph *g, int v, int c, size_t off)
{
    const opf_gval *gv = &g->vals[v];
    return g->arena + g->stores[gv->store].offset + gv->comp_off[c] + off;
}

void *opf_graph_addr(const opf_graph *g, int v, int c) { return arena_addr(g, v, c, 0); }

/* The scale components of a quantized arena value, zeroed before its node.
 * Not an in-place output: its block is the node's input, whose scales (and
 * their zero padding) the producer already wrote and the node still reads. */
static opf_status add_zero(opf_graph *g, opf_gnode *n, int v)
{
    const opf_gval *gv = &g->vals[v];
    opf_layout L;
    if (gv->kind != OPF_VAL_ARENA || gv->spec.scaling == OPF_SCALING_NONE || opf_spec_layout(&gv->spec, &L))
        return OPF_OK;
    if (n->x_val >= 0 && n->x_val != v && g->vals[n->x_val].kind == OPF_VAL_ARENA &&
        g->vals[n->x_val].store == gv->store)
        return OPF_OK;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (!L.comp[c].present || c == OPF_COMP_DATA || c == OPF_COMP_COL_DATA) continue;
        struct opf_gzero *z = realloc(n->zero, sizeof *z * (size_t)(n->n_zero + 1));
        if (!z) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
        n->zero = z;
        n->zero[n->n_zero++] = (struct opf_gzero){arena_addr(g, v, c, 0), L.comp[c].nbytes};
    }
    return OPF_OK;
}

opf_status opf_graph_bake(opf_graph *g)
{
    int cap = 0;
    g->n_binds = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        opf_gnode *n = &g->nodes[i];
        for (int r = 0; r < n->n_refs; r++)
            if (n->refs[r].output && n->refs[r].val >= 0) {
                opf_status st = add_zero(g, n, n->refs[r].val);
                if (st) return st;
            }
        for (int r = 0; r < n->n_refs; r++) {
            opf_tensor *t = n->refs[r].t;
            for (int c = 0; c < OPF_COMP_COUNT; c++) {
                void *p = t->data[c];
                if (!p || !opf_is_tag(p)) continue;
                int v = opf_tag_value(p), pc = opf_tag_comp(p);
                size_t off = opf_tag_offset(p);
                if (g->vals[v].pgrad) continue;  /* the tag stays: exec.c places it per call */
                if (g->vals[v].store >= 0) {  /* arena values; staged inputs */
                    t->data[c] = arena_addr(g, v, pc, off);
                    continue;
                }
                if (g->n_binds == cap) {
                    cap = cap ? 2 * cap : 16;
                    opf_gbind *b = realloc(g->binds, sizeof *b * (size_t)cap);
                    if (!b) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
                    g->binds = b;
                }
                g->binds[g->n_binds++] = (opf_gbind){&t->data[c], v, pc, off};
                t->data[c] = NULL;
            }
        }
    }
    return OPF_OK;
}

void opf_graph_value_tensor(const opf_graph *g, int v, opf_tensor *out)
{
    memset(out, 0, sizeof *out);
    if (v < 0) return;
    const opf_gval *gv = &g->vals[v];
    if (gv->kind == OPF_VAL_INPUT) {
        if (gv->bound) *out = *gv->bound, out->buf = NULL;
        return;
    }
    out->spec = gv->spec;
    opf_layout L;
    if (gv->store < 0 || opf_spec_layout(&gv->spec, &L)) return;  /* pgrad: no block */
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present) out->data[c] = arena_addr(g, v, c, 0);
}

/* ---- dynamic leading dimension ------------------------------------------------- */

static opf_status add_patch(opf_graph *g, int64_t *loc, int64_t v2, int64_t lead2, const char *what)
{
    int64_t d = *loc - v2, dl = g->lead0 - lead2;
    if (d % dl)
        return opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "compile: %s is %lld at leading size %lld and "
                         "%lld at %lld: not a multiple of the leading size; compile with "
                         "max_leading = 0", what, (long long)*loc, (long long)g->lead0, (long long)v2,
                         (long long)lead2);
    opf_gpatch *p = realloc(g->patches, sizeof *p * (size_t)(g->n_patches + 1));
    if (!p) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "compile: out of memory");
    g->patches = p;
    g->patches[g->n_patches++] = (opf_gpatch){loc, *loc, d / dl};
    return OPF_OK;
}

static opf_status diff_spec(opf_graph *g, opf_spec *a, const opf_spec *b, int64_t lead2, const char *who)
{
    if (a->ndim != b->ndim || a->dtype != b->dtype || a->scaling != b->scaling || a->usage != b->usage)
        return opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "compile: %s changes more than its sizes with "
                         "the leading dimension", who);
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) {
            opf_status st = add_patch(g, &a->shape[d], b->shape[d], lead2, who);
            if (st) return st;
        }
    return OPF_OK;
}

static opf_status diff_args(opf_graph *g, const opf_schema *s, char *a, const char *b, int64_t lead2,
                            const char *who)
{
    for (int i = 0; i < s->n_fields; i++) {
        const opf_field *f = &s->fields[i];
        char *pa = a + f->offset;
        const char *pb = b + f->offset;
        char what[160];
        snprintf(what, sizeof what, "%s: field \"%s\"", who, f->name);
        opf_status st = OPF_OK;
        switch (f->kind) {
        case OPF_FIELD_TENSOR:
        case OPF_FIELD_TENSOR_Q: break;  /* refs: compared through the node's refs */
        case OPF_FIELD_INT:
            if (memcmp(pa, pb, sizeof(int64_t))) st = add_patch(g, (int64_t *)(void *)pa, *(const int64_t *)(const void *)pb, lead2, what);
            break;
        case OPF_FIELD_BUNDLE:
            if (f->bundle) st = diff_args(g, f->bundle, pa, pb, lead2, who);
            break;
        case OPF_FIELD_FLOAT: st = memcmp(pa, pb, sizeof(double)) ? OPF_ERR_UNSUPPORTED : OPF_OK; break;
        case OPF_FIELD_BOOL: st = memcmp(pa, pb, sizeof(bool)) ? OPF_ERR_UNSUPPORTED : OPF_OK; break;
        case OPF_FIELD_ENUM: st = memcmp(pa, pb, sizeof(int)) ? OPF_ERR_UNSUPPORTED : OPF_OK; break;
        case OPF_FIELD_QUANTIZER:
            st = opf_quantizer_equal((const opf_quantizer *)(const void *)pa,
                                     (const opf_quantizer *)(const void *)pb) ? OPF_OK : OPF_ERR_UNSUPPORTED;
            break;
        default: break;
        }
        if (st == OPF_ERR_UNSUPPORTED)
            return opf_error(g->ctx, st, "compile: %s depends on the leading dimension; compile "
                             "with max_leading = 0", what);
        if (st) return st;
    }
    return OPF_OK;
}

opf_status opf_graph_diff(opf_graph *g, opf_graph *g2, int64_t lead2)
{
    if (g->n_nodes != g2->n_nodes || g->n_vals != g2->n_vals)
        return opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "compile: the graph's structure changes with "
                         "the leading dimension (%d/%d nodes at %lld, %d/%d at %lld)", g->n_nodes,
                         g->n_vals, (long long)g->lead0, g2->n_nodes, g2->n_vals, (long long)lead2);
    opf_status st = OPF_OK;
    for (int v = 0; v < g->n_vals && !st; v++)
        st = diff_spec(g, &g->vals[v].spec, &g2->vals[v].spec, lead2, g->vals[v].name);
    for (int i = 0; i < g->n_nodes && !st; i++) {
        opf_gnode *a = &g->nodes[i];
        const opf_gnode *b = &g2->nodes[i];
        const char *who = a->op ? a->op->name : opf_node_kind_name(a->kind);
        if (a->kind != b->kind || a->n_refs != b->n_refs || a->n_t != b->n_t)
            return opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "compile: %s: its node changes with the "
                             "leading dimension", who);
        for (int r = 0; r < a->n_refs && !st; r++) {
            opf_tensor *ta = a->refs[r].t;
            const opf_tensor *tb = b->refs[r].t;
            for (int c = 0; c < OPF_COMP_COUNT && !st; c++)
                if ((ta->data[c] == NULL) != (tb->data[c] == NULL) ||
                    (opf_is_tag(ta->data[c]) && opf_tag_offset(ta->data[c]) != opf_tag_offset(tb->data[c])))
                    st = opf_error(g->ctx, OPF_ERR_UNSUPPORTED, "compile: %s: a view's offset "
                                   "depends on the leading dimension", who);
            if (!st) st = diff_spec(g, &ta->spec, &tb->spec, lead2, who);
        }
        if (!st && a->args) st = diff_args(g, a->schema, a->args, b->args, lead2, who);
    }
    return st;
}

static void apply_patches(opf_graph *g, int64_t lead)
{
    for (int i = 0; i < g->n_patches; i++) {
        const opf_gpatch *p = &g->patches[i];
        *p->loc = p->base + p->slope * (lead - g->lead0);
    }
}

/* The fakes of every traced node on the patched args must give the patched
 * specs: the checks a new size needs (format divisibility...), once. */
static opf_status check_fakes(opf_graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) {
        const opf_gnode *n = &g->nodes[i];
        opf_spec s[OPF_OP_MAX_GRADS];
        int cnt = 0;
        for (int k = 0; k < OPF_OP_MAX_GRADS; k++) s[k].ndim = OPF_SPEC_NONE_NDIM;
        opf_status st = OPF_OK;
        if (n->kind == OPF_NODE_FORWARD) {
            st = n->op->cls->forward_fake(n->args, s, s + 1 + OPF_OP_MAX_EXTRA);
            cnt = 1 + OPF_OP_MAX_EXTRA + OPF_OP_MAX_AUX;
        } else if (n->kind == OPF_NODE_BACKWARD) {
            st = n->op->cls->backward_fake(n->args, s);
            if (s[0].ndim == OPF_GRAD_PASSTHROUGH) s[0].ndim = OPF_SPEC_NONE_NDIM;
            cnt = n->n_t;
        } else {
            continue;
        }
        if (st)
            return opf_error(g->ctx, st, "graph: leading size %lld: %s: %s", (long long)g->lead,
                             n->op->name, opf_last_error(NULL));
        for (int k = 0; k < cnt; k++) {
            bool present = n->t[k].data[0] || n->t[k].data[OPF_COMP_COL_DATA];
            if (!(s[k].flags & OPF_SPEC_HOST)) s[k].device = n->t[k].spec.device;  /* the trace's */
            if ((s[k].ndim >= 0) != present || (present && !opf_spec_equal(&s[k], &n->t[k].spec)))
                return opf_error(g->ctx, OPF_ERR_INVALID_ARG, "graph: leading size %lld: %s: the "
                                 "fake's output %d differs from the patched graph", (long long)g->lead,
                                 n->op->name, k);
        }
    }
    return OPF_OK;
}

opf_status opf_graph_set_lead(opf_graph *g, int64_t lead)
{
    if (lead == g->lead) return OPF_OK;
    int64_t old = g->lead;
    g->lead = lead;
    apply_patches(g, lead);
    opf_status st = check_fakes(g);
    if (st) {
        g->lead = old;
        apply_patches(g, old);
    }
    return st;
}
