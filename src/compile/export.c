/* export.c: the traced graph for another runtime (compile.h "export"):
 * values by origin, nodes by args and the values their tensors refer to. */
#include <string.h>

#include "compile/compile-impl.h"

static opf_status bad_index(const opf_graph *g, const char *what, int i, int n)
{
    return opf_error(g ? g->ctx : NULL, OPF_ERR_INVALID_ARG, "opf_graph_%s: index %d outside [0, %d)",
                     what, i, n);
}

int opf_graph_num_values(const opf_graph *g)
{
    return g ? g->n_vals : 0;
}

static opf_graph_value_kind input_kind(opf_in_kind k)
{
    switch (k) {
    case OPF_IN_X: return OPF_GRAPH_VALUE_X;
    case OPF_IN_EXTRA: return OPF_GRAPH_VALUE_EXTRA_IN;
    case OPF_IN_DY: return OPF_GRAPH_VALUE_DY;
    case OPF_IN_DEXTRA_OUT: return OPF_GRAPH_VALUE_DEXTRA_OUT;
    default: return OPF_GRAPH_VALUE_KWARG;
    }
}

/* The place of value v among its defining node's tensors. */
static int def_out(const opf_graph *g, int v)
{
    const opf_gnode *n = &g->nodes[g->vals[v].def];
    for (int r = 0; r < n->n_refs; r++)
        if (n->refs[r].output && n->refs[r].val == v) return (int)(n->refs[r].t - n->t);
    return -1;
}

opf_status opf_graph_value(const opf_graph *g, int v, opf_graph_value_info *out)
{
    memset(out, 0, sizeof *out);
    if (!g || v < 0 || v >= g->n_vals) return bad_index(g, "value", v, g ? g->n_vals : 0);
    const opf_gval *gv = &g->vals[v];
    out->spec = gv->spec;
    out->name = gv->name;
    out->def = out->def_out = -1;
    if (gv->kind == OPF_VAL_INPUT) {
        out->kind = input_kind(gv->in_kind);
        out->index = gv->in_index;
        out->field = gv->in_field;
    } else if (gv->def >= 0) {
        out->def = gv->def;
        out->def_out = def_out(g, v);
    }
    return OPF_OK;
}

void opf_graph_get_io(const opf_graph *g, opf_graph_io *out)
{
    memset(out, 0, sizeof *out);
    out->x = out->y = out->dy = out->dx = -1;
    if (!g) return;
    *out = (opf_graph_io){g->x_val, g->y_val, g->dy_val, g->dx_val, g->n_pub_in, g->n_pub_out,
                          g->extra_in_val, g->dextra_in_val, g->extra_out_val, g->dextra_out_val};
}

opf_status opf_graph_node_args(const opf_graph *g, int i, const opf_schema **schema,
                               const void **args)
{
    *schema = NULL;
    *args = NULL;
    if (!g || i < 0 || i >= g->n_nodes) return bad_index(g, "node_args", i, g ? g->n_nodes : 0);
    *schema = g->nodes[i].schema;
    *args = g->nodes[i].args;
    return OPF_OK;
}

int opf_graph_node_num_refs(const opf_graph *g, int i)
{
    return g && i >= 0 && i < g->n_nodes ? g->nodes[i].n_refs : 0;
}

opf_status opf_graph_node_ref(const opf_graph *g, int i, int r, opf_graph_ref *out)
{
    memset(out, 0, sizeof *out);
    if (!g || i < 0 || i >= g->n_nodes) return bad_index(g, "node_ref", i, g ? g->n_nodes : 0);
    const opf_gnode *n = &g->nodes[i];
    if (r < 0 || r >= n->n_refs) return bad_index(g, "node_ref", r, n->n_refs);
    const opf_gref *ref = &n->refs[r];
    out->t = ref->t;
    out->output = ref->output;
    out->out_index = ref->output ? (int)(ref->t - n->t) : -1;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        void *p = ref->traced[c];
        bool tag = p && opf_is_tag(p);
        out->value[c] = tag ? opf_tag_value(p) : -1;
        out->comp[c] = tag ? opf_tag_comp(p) : c;
        out->offset[c] = tag ? opf_tag_offset(p) : 0;
    }
    return OPF_OK;
}
