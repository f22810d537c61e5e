/* dump.c: text and Graphviz DOT dumps of a compiled graph. */
#include <string.h>

#include "compile/compile-impl.h"

opf_status opf_graph_dump(const opf_graph *g, FILE *f)
{
    OPF_CHECK_NULL(NULL, "opf_graph_dump", g);
    OPF_CHECK_NULL(g->ctx, "opf_graph_dump", f);
    for (int i = 0; i < g->n_nodes; i++) {
        const opf_gnode *n = &g->nodes[i];
        fprintf(f, "%3d %-14s %s\n", i, opf_node_kind_name(n->kind), n->op ? n->op->name : "");
    }
    return OPF_OK;
}

opf_status opf_graph_dump_dot(const opf_graph *g, FILE *f)
{
    OPF_CHECK_NULL(NULL, "opf_graph_dump_dot", g);
    OPF_CHECK_NULL(g->ctx, "opf_graph_dump_dot", f);
    fprintf(f, "digraph opfuse {\n}\n");
    return OPF_OK;
}
