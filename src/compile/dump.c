/* dump.c: text and Graphviz DOT dumps of a compiled graph.
 *
 * Both walk the IR of compile-impl.h as it stands after planning: nodes in
 * execution order (forward nodes [0, n_fwd), then backward), the values each
 * node reads and writes (refs), and where the memory plan put each arena
 * value. Writes go through one checked printf so that a failing stream
 * turns into OPF_ERR_IO instead of a truncated dump. */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "compile/compile-impl.h"

#define SPEC_CHARS 96

/* A stream with a sticky error: every write after a failure is skipped. */
typedef struct dump_out {
    FILE *f;
    int   err;  /* errno of the first failed write; 0 while fine */
} dump_out;

static void OPF_PRINTF(2, 3) put(dump_out *o, const char *fmt, ...)
{
    if (o->err) return;
    va_list ap;
    va_start(ap, fmt);
    errno = 0;
    int n = vfprintf(o->f, fmt, ap);
    va_end(ap);
    if (n < 0) o->err = errno ? errno : EIO;
}

static opf_status finish(const opf_graph *g, dump_out *o, const char *fn)
{
    if (!o->err && fflush(o->f) == EOF) o->err = errno ? errno : EIO;
    if (!o->err && ferror(o->f)) o->err = EIO;
    if (o->err) return opf_error(g->ctx, OPF_ERR_IO, "%s: writing the dump failed: %s", fn, strerror(o->err));
    return OPF_OK;
}

/* ---- shared helpers ------------------------------------------------------------- */

static const char *recipe_name(const opf_graph *g)
{
    return g->has_recipe ? opf_recipe_name(g->recipe.kind) : "none";
}

static void spec_str(const opf_spec *s, char *buf)
{
    opf_spec_str(s, buf, SPEC_CHARS);
}

static bool is_eager(const opf_gnode *n)
{
    return n->kind == OPF_NODE_EAGER_FORWARD || n->kind == OPF_NODE_EAGER_BACKWARD;
}

/* The op's name, or what a node without an op does. */
static const char *node_name(const opf_gnode *n)
{
    if (n->op) return n->op->name;
    return n->kind == OPF_NODE_GRAD_ADD ? "(sum of two gradients of one channel)"
         : n->kind == OPF_NODE_AMAX_UPDATE ? "(delayed scaling: amax history roll, new scales)"
         : n->kind == OPF_NODE_RECOMPUTE ? "(recompute span: Philox offset and scales)"
         : "";
}

/* The distinct values the node reads (outputs = false) or writes (outputs =
 * true), in ref order, into out[max]. Returns how many. */
static int node_values(const opf_gnode *n, bool outputs, int *out, int max)
{
    int k = 0;
    for (int r = 0; r < n->n_refs; r++) {
        int v = n->refs[r].val;
        if (v < 0 || n->refs[r].output != outputs) continue;
        bool seen = false;
        for (int j = 0; j < k && !seen; j++) seen = out[j] == v;
        if (!seen && k < max) out[k++] = v;
    }
    return k;
}

/* Names the parameter a tensor of op-owned memory belongs to ("fc1.weight",
 * "fc1.weight(q)" for the quantized copy); false when it is none. */
static bool param_name(const opf_op *op, const opf_tensor *t, char *buf, size_t size)
{
    int nb = op->n_basic ? op->n_basic : 1;
    for (int b = 0; b < nb; b++) {
        const opf_op *o = op->n_basic ? op->basic[b] : op;
        for (int p = 0; p < opf_op_num_params(o); p++) {
            const opf_param *pr = opf_op_param_const(o, p);
            for (int c = 0; c < OPF_COMP_COUNT; c++) {
                const void *d = t->data[c];
                if (!d) continue;
                const char *suffix = d == pr->value.data[c] ? "" : d == pr->qvalue.data[c] ? "(q)" : NULL;
                if (!suffix) continue;
                snprintf(buf, size, "%s.%s%s", o->name, pr->name, suffix);
                return true;
            }
        }
    }
    return false;
}

/* Width of the name column: the longest value name. */
static int name_width(const opf_graph *g)
{
    int w = 12;
    for (int v = 0; v < g->n_vals; v++) {
        int n = (int)strlen(g->vals[v].name);
        w = n > w ? n : w;
    }
    return w;
}

static bool has_data(const opf_tensor *t)
{
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (t->data[c]) return true;
    return false;
}

/* ---- text ------------------------------------------------------------------------ */

static void text_header(const opf_graph *g, dump_out *o)
{
    opf_graph_stats s;
    opf_graph_get_stats(g, &s);
    char xs[SPEC_CHARS];
    spec_str(&g->x_spec, xs);
    put(o, "graph: recipe %s, %s, input x %s", recipe_name(g),
        g->forward_only ? "inference (forward only)" : "training", xs);
    if (g->lead0 > 0) put(o, ", max_leading %lld (dynamic)\n", (long long)g->lead0);
    else put(o, ", max_leading 0 (fixed shapes)\n");
    put(o, "nodes: %d forward, %d backward; %d fused, %d eager\n", s.n_forward, s.n_backward,
        s.n_fused, s.n_eager);
    double saving = s.unplanned_bytes ? 100.0 * (1.0 - (double)s.arena_bytes / (double)s.unplanned_bytes) : 0;
    put(o, "arena: %zu bytes planned, %zu unplanned (%.1f%% saved by reuse); %zu bytes saved for "
        "backward; %d values, %d in place\n", s.arena_bytes, s.unplanned_bytes, saving,
        s.saved_bytes, s.n_values, s.n_inplace);
    put(o, "outputs: y = %s", g->y_val >= 0 ? g->vals[g->y_val].name : "-");
    for (int p = 0; p < g->n_pub_out; p++)
        put(o, ", extra_out[%d] = %s", p, g->extra_out_val[p] >= 0 ? g->vals[g->extra_out_val[p]].name : "-");
    if (!g->forward_only) {
        put(o, ", dx = %s", g->dx_val >= 0 ? g->vals[g->dx_val].name : "- (not computed)");
        for (int p = 0; p < g->n_pub_in; p++)
            put(o, ", dextra_in[%d] = %s", p,
                g->dextra_in_val[p] >= 0 ? g->vals[g->dextra_in_val[p]].name : "-");
    }
    put(o, "\n");
}

static void text_node(const opf_graph *g, int i, int w, dump_out *o)
{
    const opf_gnode *n = &g->nodes[i];
    put(o, "%4d %-14s %s", i, opf_node_kind_name(n->kind), node_name(n));
    if (n->op) put(o, "  [%s%s]", n->op->cls->name, opf_op_is_fused(n->op) ? ", fused" : "");
    if (n->passthrough) put(o, "  (dx = dy, pass-through)");
    put(o, "\n");
    if (is_eager(n)) put(o, "         eager: %s\n", n->reason ? n->reason : "?");
    char sb[SPEC_CHARS];
    int vs[64];
    int nv = node_values(n, false, vs, 64);
    for (int k = 0; k < nv; k++) {
        const opf_gval *v = &g->vals[vs[k]];
        spec_str(&v->spec, sb);
        put(o, "         in  %-*s %s\n", w, v->name, sb);
    }
    /* memory the op owns (parameters, cached quantized weights) */
    for (int r = 0; n->op && r < n->n_refs; r++) {
        const opf_gref *ref = &n->refs[r];
        char pn[128];
        if (ref->val >= 0 || ref->output || !has_data(ref->t) || !param_name(n->op, ref->t, pn, sizeof pn))
            continue;
        spec_str(&ref->t->spec, sb);
        put(o, "         in  %-*s %s (parameter)\n", w, pn, sb);
    }
    nv = node_values(n, true, vs, 64);
    for (int k = 0; k < nv; k++) {
        const opf_gval *v = &g->vals[vs[k]];
        spec_str(&v->spec, sb);
        put(o, "         out %-*s %s", w, v->name, sb);
        if (v->kind == OPF_VAL_ARENA && v->store >= 0) {
            put(o, "  @%zu", g->stores[v->store].offset);
            int x = n->x_val;
            if (x >= 0 && x != vs[k] && g->vals[x].kind == OPF_VAL_ARENA && g->vals[x].store == v->store)
                put(o, " (in place of %s)", g->vals[x].name);
        }
        put(o, "\n");
    }
}

static const char *input_kind_name(opf_in_kind k)
{
    switch (k) {
    case OPF_IN_X: return "input x";
    case OPF_IN_EXTRA: return "input extra_in";
    case OPF_IN_DY: return "input dy";
    case OPF_IN_DEXTRA_OUT: return "input dextra_out";
    case OPF_IN_KWARG: return "input kwarg";
    }
    return "input";
}

static void text_values(const opf_graph *g, dump_out *o)
{
    int w = name_width(g);
    put(o, "values:\n");
    put(o, "%4s %-*s %-40s %10s %11s %s\n", "id", w, "name", "spec", "bytes", "[def,last]", "store");
    char sb[SPEC_CHARS];
    for (int v = 0; v < g->n_vals; v++) {
        const opf_gval *gv = &g->vals[v];
        spec_str(&gv->spec, sb);
        char live[32];
        snprintf(live, sizeof live, "[%d,%d]", gv->def, gv->last);
        put(o, "%4d %-*s %-40s ", v, w, gv->name, sb);
        if (gv->kind == OPF_VAL_INPUT) {
            put(o, "%10s %11s %s\n", "-", live, input_kind_name(gv->in_kind));
            continue;
        }
        put(o, "%10zu %11s ", gv->bytes, live);
        if (gv->store >= 0) put(o, "#%d @%zu", gv->store, g->stores[gv->store].offset);
        else put(o, "-");
        put(o, "%s%s\n", gv->keep ? " kept" : "",
            gv->def >= 0 && gv->def < g->n_fwd && gv->last >= g->n_fwd && !gv->keep ? " saved" : "");
    }
}

opf_status opf_graph_dump(const opf_graph *g, FILE *f)
{
    OPF_CHECK_NULL(NULL, "opf_graph_dump", g);
    OPF_CHECK_NULL(g->ctx, "opf_graph_dump", f);
    dump_out o = {f, 0};
    text_header(g, &o);
    int w = name_width(g);
    put(&o, "forward:\n");
    for (int i = 0; i < g->n_nodes; i++) {
        if (i == g->n_fwd) put(&o, "backward:\n");
        text_node(g, i, w, &o);
    }
    text_values(g, &o);
    return finish(g, &o, "opf_graph_dump");
}

/* ---- DOT -------------------------------------------------------------------------- */

/* Writes s as the inside of a DOT string: quotes and backslashes escaped,
 * newlines as \n (centred lines). */
static void dot_esc(dump_out *o, const char *s)
{
    for (; *s && !o->err; s++) {
        if (*s == '"' || *s == '\\') put(o, "\\%c", *s);
        else if (*s == '\n') put(o, "\\n");
        else put(o, "%c", *s);
    }
}

/* A label: `id [label="...", attrs];` */
static void dot_node(dump_out *o, const char *id, const char *label, const char *attrs)
{
    put(o, "    %s [label=\"", id);
    dot_esc(o, label);
    put(o, "\"%s%s];\n", attrs && *attrs ? ", " : "", attrs ? attrs : "");
}

static void dot_graph_node(const opf_graph *g, int i, dump_out *o)
{
    const opf_gnode *n = &g->nodes[i];
    char label[512], id[16];
    int len = n->op ? snprintf(label, sizeof label, "%d %s\n%s", i, n->op->name, opf_node_kind_name(n->kind))
                    : snprintf(label, sizeof label, "%d %s", i, opf_node_kind_name(n->kind));
    if (n->op && (size_t)len < sizeof label)
        len += snprintf(label + len, sizeof label - (size_t)len, "\n[%s]", n->op->cls->name);
    if (is_eager(n) && (size_t)len < sizeof label)
        snprintf(label + len, sizeof label - (size_t)len, "\neager: %s", n->reason ? n->reason : "?");
    snprintf(id, sizeof id, "n%d", i);
    const char *attrs;
    if (is_eager(n)) attrs = "color=red, fontcolor=red, penwidth=2";
    else if (n->op && opf_op_is_fused(n->op)) attrs = "style=\"bold,filled\", fillcolor=lightblue, penwidth=2";
    else if (!n->op) attrs = "style=dashed";
    else attrs = "";
    dot_node(o, id, label, attrs);
}

/* saved: a forward value the backward reads (drawn dashed). */
static void dot_edge(const opf_graph *g, dump_out *o, const char *from, const char *to, int v, bool saved)
{
    char sb[SPEC_CHARS], label[160];
    spec_str(&g->vals[v].spec, sb);
    snprintf(label, sizeof label, "%s\n%s", g->vals[v].name, sb);
    put(o, "  %s -> %s [label=\"", from, to);
    dot_esc(o, label);
    put(o, "\"%s];\n", saved ? ", style=dashed" : "");
}

/* Graph inputs as ellipses, the public outputs as double ellipses. */
static void dot_terminals(const opf_graph *g, dump_out *o)
{
    char sb[SPEC_CHARS], label[160], id[16];
    for (int v = 0; v < g->n_vals; v++) {
        const opf_gval *gv = &g->vals[v];
        if (gv->kind != OPF_VAL_INPUT) continue;
        spec_str(&gv->spec, sb);
        snprintf(label, sizeof label, "%s\n%s", gv->name, sb);
        snprintf(id, sizeof id, "v%d", v);
        dot_node(o, id, label, "shape=ellipse, style=filled, fillcolor=lightyellow");
    }
    struct { const char *name; int v; } outs[2] = {{"y", g->y_val}, {"dx", g->forward_only ? -1 : g->dx_val}};
    for (int k = 0; k < 2; k++)
        if (outs[k].v >= 0) {
            snprintf(id, sizeof id, "out_%s", outs[k].name);
            dot_node(o, id, outs[k].name, "shape=ellipse, peripheries=2");
        }
}

static void dot_cluster(const opf_graph *g, dump_out *o, const char *name, int from, int to)
{
    put(o, "  subgraph cluster_%s {\n    label=\"%s\";\n    style=rounded;\n", name, name);
    for (int i = from; i < to; i++) dot_graph_node(g, i, o);
    put(o, "  }\n");
}

static void dot_edges(const opf_graph *g, dump_out *o)
{
    char from[16], to[16];
    int vs[64];
    for (int i = 0; i < g->n_nodes; i++) {
        int nv = node_values(&g->nodes[i], false, vs, 64);
        snprintf(to, sizeof to, "n%d", i);
        for (int k = 0; k < nv; k++) {
            const opf_gval *gv = &g->vals[vs[k]];
            if (gv->kind == OPF_VAL_INPUT) snprintf(from, sizeof from, "v%d", vs[k]);
            else if (gv->def >= 0) snprintf(from, sizeof from, "n%d", gv->def);
            else continue;
            dot_edge(g, o, from, to, vs[k], gv->def >= 0 && gv->def < g->n_fwd && i >= g->n_fwd);
        }
    }
    struct { const char *id; int v; } outs[2] = {{"out_y", g->y_val}, {"out_dx", g->forward_only ? -1 : g->dx_val}};
    for (int k = 0; k < 2; k++) {
        int v = outs[k].v;
        if (v < 0) continue;
        const opf_gval *gv = &g->vals[v];
        if (gv->kind == OPF_VAL_INPUT) snprintf(from, sizeof from, "v%d", v);
        else if (gv->def >= 0) snprintf(from, sizeof from, "n%d", gv->def);
        else continue;
        dot_edge(g, o, from, outs[k].id, v, false);
    }
}

opf_status opf_graph_dump_dot(const opf_graph *g, FILE *f)
{
    OPF_CHECK_NULL(NULL, "opf_graph_dump_dot", g);
    OPF_CHECK_NULL(g->ctx, "opf_graph_dump_dot", f);
    dump_out o = {f, 0};
    opf_graph_stats s;
    opf_graph_get_stats(g, &s);
    char title[256];
    snprintf(title, sizeof title, "recipe %s, %d forward + %d backward nodes, arena %zu bytes "
             "(%zu unplanned)", recipe_name(g), s.n_forward, s.n_backward, s.arena_bytes,
             s.unplanned_bytes);
    put(&o, "digraph opfuse {\n  rankdir=TB;\n  labelloc=t;\n  label=\"");
    dot_esc(&o, title);
    put(&o, "\";\n  node [shape=box, fontname=\"Helvetica\", fontsize=10];\n"
        "  edge [fontname=\"Helvetica\", fontsize=8];\n");
    dot_terminals(g, &o);
    dot_cluster(g, &o, "forward", 0, g->n_fwd);
    if (g->n_nodes > g->n_fwd) dot_cluster(g, &o, "backward", g->n_fwd, g->n_nodes);
    dot_edges(g, &o);
    put(&o, "}\n");
    return finish(g, &o, "opf_graph_dump_dot");
}

/* ---- the profile ----------------------------------------------------------------- */

typedef struct node_group {
    const char *name;  /* the op class, or the node kind for a node with none */
    bool        backward;
    int         nodes;
    double      s;
} node_group;

static int by_time_desc(const void *a, const void *b)
{
    double x = ((const node_group *)a)->s, y = ((const node_group *)b)->s;
    return (x < y) - (x > y);
}

opf_status opf_graph_dump_profile(const opf_graph *g, int64_t steps, FILE *f)
{
    OPF_CHECK_NULL(NULL, "opf_graph_dump_profile", g);
    OPF_CHECK_NULL(g->ctx, "opf_graph_dump_profile", f);
    if (steps <= 0)
        return opf_error(g->ctx, OPF_ERR_INVALID_ARG, "opf_graph_dump_profile: %lld steps (want > 0)",
                         (long long)steps);
    int n = g->n_nodes, ng = 0, counted = 0;
    node_group *gr = calloc((size_t)(n > 0 ? n : 1), sizeof *gr);
    if (!gr) return opf_error(g->ctx, OPF_ERR_NO_MEMORY, "opf_graph_dump_profile: %d nodes", n);
    double sum = 0;
    for (int i = 0; i < n; i++) {
        opf_graph_node_info info;
        if (opf_graph_node(g, i, &info)) continue;
        const char *name = info.class_name ? info.class_name : opf_node_kind_name(info.kind);
        int k = 0;
        while (k < ng && !(gr[k].backward == info.backward && !strcmp(gr[k].name, name))) k++;
        if (k == ng) gr[ng++] = (node_group){name, info.backward, 0, 0.0};
        gr[k].nodes++, counted++;
        gr[k].s += g->nodes[i].seconds;
        sum += g->nodes[i].seconds;
    }
    qsort(gr, (size_t)ng, sizeof *gr, by_time_desc);
    dump_out o = {f, 0};
    put(&o, "graph nodes by op class (%d nodes, %.3f ms per step in all), ms per step:\n", counted,
        1e3 * sum / (double)steps);
    for (int k = 0; k < ng; k++)
        put(&o, "  %9.3f  %5.1f%%  %-8s %s (%d node%s)\n", 1e3 * gr[k].s / (double)steps,
            sum > 0 ? 100 * gr[k].s / sum : 0.0, gr[k].backward ? "backward" : "forward",
            gr[k].name, gr[k].nodes, gr[k].nodes == 1 ? "" : "s");
    free(gr);
    return finish(g, &o, "opf_graph_dump_profile");
}
