/* cache.c: the guard of a call and opf_compiled, a bounded cache of graphs
 * over one seq. The guard covers what a graph bakes in: the input specs
 * (without the leading size under max_leading), the recipe and with it
 * every quantizer, the grad flags, and the kwargs' value fields. Tensor
 * kwargs enter by spec only: their data is a graph input.
 *
 * Guards compare values: the 64-bit key only finds candidates, and a graph
 * replays only when opf_graph_matches finds every hashed value equal to the
 * one it was compiled for, so a key collision compiles a second graph
 * beside the first. Float kwargs compare by their bits (opf_schema_equal),
 * the policy compile.h states. */
#include <stdlib.h>
#include <string.h>

#include "compile/compile-impl.h"

static uint64_t (*key_hook)(uint64_t);

void opf_graph_key_test_hook(uint64_t (*fn)(uint64_t key)) { key_hook = fn; }

static uint64_t mix_recipe(uint64_t h, const opf_recipe *r)
{
    return opf_hash_mix(h, r ? opf_schema_hash(&opf_recipe_schema, r) : 0xFFFF);
}

uint64_t opf_graph_key(const opf_seq *seq, const opf_spec *x, const opf_seq_call *call,
                       const opf_compile_options *opts)
{
    bool dyn = opts->max_leading > 0 && x->ndim >= 1;
    uint64_t h = opf_spec_hash(OPF_HASH_SEED, x, dyn);
    h = opf_hash_mix(h, (uint64_t)opts->max_leading);
    h = mix_recipe(h, call->recipe);
    h = opf_hash_mix(h, (uint64_t)call->requires_grad | (uint64_t)call->input_requires_grad << 1);
    h = opf_hash_mix(h, (uint64_t)call->n_extra_in);
    for (int i = 0; call->extra_in && i < call->n_extra_in; i++) {
        const opf_spec *s = &call->extra_in[i].spec;
        h = opf_spec_hash(h, s, dyn && s->ndim >= 1 && s->shape[0] == x->shape[0]);
    }
    for (int i = 0; call->kwargs && i < seq->n; i++) {
        const opf_schema *ks = seq->ops[i]->cls->kwargs_schema;
        if (!call->kwargs[i]) continue;
        h = opf_hash_mix(h, (uint64_t)i);
        /* a class without a kwargs schema runs eagerly; its kwargs are its own business */
        if (ks) h = opf_hash_mix(h, opf_schema_hash(ks, call->kwargs[i]));
    }
    return key_hook ? key_hook(h) : h;
}

/* ---- guards by value ------------------------------------------------------------ */

/* a as the key sees it against b as the graph keeps it: equal, the leading
 * size aside when it follows x (lead: the graph's traced size). */
static bool spec_matches(const opf_spec *a, const opf_spec *b, bool follows_x, int64_t lead)
{
    if (!follows_x) return opf_spec_equal(a, b);
    opf_spec s = *a;
    s.shape[0] = lead;
    return b->ndim >= 1 && b->shape[0] == lead && opf_spec_equal(&s, b);
}

bool opf_graph_kwargs_match(const opf_graph *g, const opf_seq_call *call)
{
    if (g->n_ops != g->seq->n) return false;
    for (int i = 0; i < g->n_ops; i++) {
        const void *kw = call->kwargs ? call->kwargs[i] : NULL;
        const opf_schema *ks = g->seq->ops[i]->cls->kwargs_schema;
        if ((kw != NULL) != g->kw_given[i]) return false;
        if (kw && ks && !opf_schema_equal(ks, kw, g->kwargs[i])) return false;
    }
    return true;
}

bool opf_graph_matches(const opf_graph *g, const opf_spec *x, const opf_seq_call *call,
                       const opf_compile_options *opts)
{
    bool dyn = opts->max_leading > 0 && x->ndim >= 1;
    int64_t lead = g->x_spec.ndim >= 1 ? g->x_spec.shape[0] : -1;
    if (opts->max_leading != g->opts.max_leading || !spec_matches(x, &g->x_spec, dyn, lead) ||
        !opf_recipe_same(call->recipe, g->has_recipe ? &g->recipe : NULL) ||
        call->requires_grad != g->call.requires_grad ||
        call->input_requires_grad != g->call.input_requires_grad || call->n_extra_in != g->n_pub_in)
        return false;
    for (int i = 0; call->extra_in && i < call->n_extra_in; i++) {
        const opf_spec *s = &call->extra_in[i].spec;
        if (!spec_matches(s, &g->extra_in_spec[i], dyn && s->ndim >= 1 && s->shape[0] == x->shape[0], lead))
            return false;
    }
    return opf_graph_kwargs_match(g, call);
}

/* ---- opf_compiled ------------------------------------------------------------ */

struct opf_compiled {
    opf_seq            *seq;
    opf_compile_options opts;
    opf_graph         **graphs;
    uint64_t           *used;       /* last use tick per graph */
    int                 n;
    int                 compiles;
    uint64_t            tick;
    opf_graph          *last;
    bool                warned_limit;
};

opf_status opf_compiled_create(opf_seq *seq, const opf_compile_options *opts, opf_compiled **out)
{
    OPF_CHECK_NULL(NULL, "opf_compiled_create", seq);
    OPF_CHECK_NULL(seq->ctx, "opf_compiled_create", out);
    opf_compile_options o = opts ? *opts : opf_compile_options_default();
    if (o.max_variants < 1)
        return opf_error(seq->ctx, OPF_ERR_INVALID_ARG, "opf_compiled_create: max_variants %d < 1",
                         o.max_variants);
    opf_compiled *c = calloc(1, sizeof *c);
    if (c) {
        c->graphs = calloc((size_t)o.max_variants, sizeof *c->graphs);
        c->used = calloc((size_t)o.max_variants, sizeof *c->used);
    }
    if (!c || !c->graphs || !c->used) {
        if (c) free(c->graphs), free(c->used);
        free(c);
        return opf_error(seq->ctx, OPF_ERR_NO_MEMORY, "opf_compiled_create: out of memory");
    }
    c->seq = seq;
    c->opts = o;
    *out = c;
    return OPF_OK;
}

void opf_compiled_destroy(opf_compiled *c)
{
    if (!c) return;
    for (int i = 0; i < c->n; i++) opf_graph_destroy(c->graphs[i]);
    free(c->graphs);
    free(c->used);
    free(c);
}

static void drop(opf_compiled *c, int i)
{
    if (c->graphs[i] == c->last) c->last = NULL;
    opf_graph_destroy(c->graphs[i]);
    c->graphs[i] = c->graphs[c->n - 1];
    c->used[i] = c->used[c->n - 1];
    c->n--;
}

opf_status opf_compiled_forward(opf_compiled *c, const opf_tensor *x, const opf_seq_call *call,
                                opf_tensor *y, opf_tensor *extra_out)
{
    const char *fn = "opf_compiled_forward";
    OPF_CHECK_NULL(NULL, fn, c);
    OPF_CHECK_NULL(c->seq->ctx, fn, x);
    OPF_CHECK_NULL(c->seq->ctx, fn, call);
    opf_ctx *ctx = c->seq->ctx;
    /* a stale graph's pending forward can never get its backward: not a reason to refuse
     * (the graph is dropped and compiled again below) */
    if (c->last && c->last->pending && c->last->epoch == c->seq->epoch)
        return opf_error(ctx, OPF_ERR_STATE, "%s: the previous forward's backward has not run; call "
                         "opf_compiled_backward first", fn);
    uint64_t key = opf_graph_key(c->seq, &x->spec, call, &c->opts);
    opf_graph *g = NULL;
    for (int i = 0; i < c->n && !g; i++) {
        if (c->graphs[i]->key != key) continue;
        if (c->graphs[i]->epoch != c->seq->epoch) {
            drop(c, i--);  /* stale for good: compiled again below if it was this call's */
            continue;
        }
        if (!opf_graph_matches(c->graphs[i], &x->spec, call, &c->opts)) continue;  /* a collision */
        g = c->graphs[i];
        c->used[i] = ++c->tick;
    }
    if (!g) {
        if (c->n == c->opts.max_variants) {
            int lru = 0;
            for (int i = 1; i < c->n; i++)
                if (c->used[i] < c->used[lru]) lru = i;
            if (!c->warned_limit)
                opf_ctx_warn(ctx, "compile: the graph cache is full (%d variants); evicting the least "
                             "recently used graph: calls keep changing shapes, recipes or kwarg "
                             "values", c->opts.max_variants);
            c->warned_limit = true;
            drop(c, lru);
        }
        opf_status st = opf_compile(c->seq, &x->spec, call, &c->opts, &g);
        if (st) return st;
        c->graphs[c->n] = g;
        c->used[c->n++] = ++c->tick;
        c->compiles++;
    }
    c->last = g;
    return opf_graph_forward(g, x, call, y, extra_out);
}

opf_status opf_compiled_backward(opf_compiled *c, const opf_tensor *dy, const opf_tensor *dextra_out,
                                 opf_tensor *dx, opf_tensor *dextra_in)
{
    OPF_CHECK_NULL(NULL, "opf_compiled_backward", c);
    if (!c->last)
        return opf_error(c->seq->ctx, OPF_ERR_STATE, "opf_compiled_backward: no forward ran");
    return opf_graph_backward(c->last, dy, dextra_out, dx, dextra_in);
}

int opf_compiled_recompiles(const opf_compiled *c) { return c && c->compiles > 1 ? c->compiles - 1 : 0; }
int opf_compiled_num_graphs(const opf_compiled *c) { return c ? c->n : 0; }
opf_graph *opf_compiled_last_graph(opf_compiled *c) { return c ? c->last : NULL; }
