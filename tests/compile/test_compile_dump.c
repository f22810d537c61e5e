/* test_compile_dump.c: the text and DOT dumps of a compiled LayerNorm-MLP
 * under MXFP8 with fusions: header counts and arena sizes match the graph's
 * stats, every node appears, fused nodes are marked, the DOT is well formed
 * (braces balanced, quotes escaped, clusters, edges between declared
 * nodes); a callback step shows up as an eager node with its reason in both
 * dumps; a dump is unchanged by running the graph; bad arguments and
 * failing streams are reported. */
#define _POSIX_C_SOURCE 200809L
#include "compile_util.h"

enum { M = 64, H = 64, F = 128 };  /* the graphs dumped: x f32[64,64], hidden 128 */

/* y = 2x, dx = 2dy, f32: a user step with no fake. */
static opf_status cb_fwd(void *user, opf_ctx *ctx, const opf_tensor *x, opf_tensor *y)
{
    opf_spec s = opf_spec_make(x->spec.ndim, x->spec.shape, OPF_F32);
    opf_status st = opf_tensor_alloc(ctx, &s, y);
    int64_t n = opf_spec_numel(&s);
    if (!st) st = opf_convert(x->data[0], x->spec.dtype, y->data[0], OPF_F32, (size_t)n);
    for (int64_t i = 0; !st && i < n; i++) ((float *)y->data[0])[i] *= 2;
    return st;
}

static opf_status cb_bwd(void *user, opf_ctx *ctx, const opf_tensor *dy, opf_tensor *dx)
{
    return cb_fwd(user, ctx, dy, dx);
}

/* layernorm -> linear + bias -> gelu -> linear + bias [-> callback]. */
static opf_seq *build(opf_ctx *ctx, int64_t h, int64_t f, const char *cb_name)
{
    opf_seq *seq = cu_ln_mlp(ctx, OPF_F32, h, f, "gelu", "gelu");
    if (cb_name) {
        static opf_callback_i cb = {cb_fwd, cb_bwd, NULL};
        CHECK_OK(ctx, opf_seq_append_callback(seq, &cb, cb_name));
    }
    return seq;
}

/* The dump into a malloc'ed string (open_memstream). */
static char *dump_str(const opf_graph *g, bool dot)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return NULL;
    opf_status st = dot ? opf_graph_dump_dot(g, f) : opf_graph_dump(g, f);
    CHECK(st == OPF_OK, "%s -> %s: %s", dot ? "dump_dot" : "dump", opf_status_str(st), opf_last_error(NULL));
    fclose(f);
    return buf;
}

/* Well-formed DOT: "digraph" first, braces balanced outside strings (never
 * below zero, zero at the end), every string closed on its line, and each
 * edge between nodes the file declares. Returns the number of edges. */
static int check_dot(const char *dot)
{
    CHECK(!strncmp(dot, "digraph", 7), "dot starts with \"%.20s\"", dot);
    int depth = 0, min_depth = 0, edges = 0, bad_edges = 0;
    bool in_str = false, open_str_at_eol = false;
    for (const char *p = dot; *p; p++) {
        if (in_str) {
            if (*p == '\\' && p[1]) p++;
            else if (*p == '"') in_str = false;
            else if (*p == '\n') open_str_at_eol = true;
            continue;
        }
        if (*p == '"') in_str = true;
        else if (*p == '{') depth++;
        else if (*p == '}') depth--;
        if (depth < min_depth) min_depth = depth;
        if (p[0] == '-' && p[1] == '>') {
            /* "  FROM -> TO [": both must be declared as "    ID [label=" */
            const char *ls = p;
            while (ls > dot && ls[-1] != '\n') ls--;
            char from[32], to[32], decl[48];
            if (sscanf(ls, " %31s -> %31s", from, to) != 2) {
                bad_edges++;
                continue;
            }
            edges++;
            snprintf(decl, sizeof decl, "\n    %s [label=", from);
            bool ok = strstr(dot, decl) != NULL;
            snprintf(decl, sizeof decl, "\n    %s [label=", to);
            ok = ok && strstr(dot, decl) != NULL;
            bad_edges += !ok;
            CHECK(ok, "edge %s -> %s between undeclared nodes", from, to);
        }
    }
    CHECK(!in_str && !open_str_at_eol, "a DOT string is not closed on its line");
    CHECK(depth == 0 && min_depth == 0, "DOT braces unbalanced: depth %d at the end, minimum %d", depth,
          min_depth);
    CHECK(bad_edges == 0, "%d malformed edges", bad_edges);
    return edges;
}

static int count_of(const char *s, const char *sub)
{
    int n = 0;
    for (const char *p = strstr(s, sub); p; p = strstr(p + 1, sub)) n++;
    return n;
}

/* The text and DOT of g agree with its stats and node list. */
static void check_dumps(const opf_graph *g, const char *text, const char *dot)
{
    opf_graph_stats s;
    opf_graph_get_stats(g, &s);
    char want[256];
    snprintf(want, sizeof want, "nodes: %d forward, %d backward; %d fused, %d eager\n", s.n_forward,
             s.n_backward, s.n_fused, s.n_eager);
    CHECK(strstr(text, want), "text lacks \"%s\"", want);
    snprintf(want, sizeof want, "arena: %zu bytes planned, %zu unplanned", s.arena_bytes, s.unplanned_bytes);
    CHECK(strstr(text, want), "text lacks \"%s\"", want);
    snprintf(want, sizeof want, "%zu bytes saved for backward; %d values, %d in place", s.saved_bytes,
             s.n_values, s.n_inplace);
    CHECK(strstr(text, want), "text lacks \"%s\"", want);
    CHECK(strstr(text, "recipe mxfp8"), "text lacks the recipe");
    int n = opf_graph_num_nodes(g), fused = 0;
    for (int i = 0; i < n; i++) {
        opf_graph_node_info info;
        CHECK_OK(NULL, opf_graph_node(g, i, &info));
        snprintf(want, sizeof want, "\n%4d %-14s %s", i, opf_node_kind_name(info.kind),
                 info.class_name ? info.op_name : "");
        CHECK(strstr(text, want), "text lacks node line \"%s\"", want + 1);
        if (info.class_name) {
            snprintf(want, sizeof want, "[%s%s]", info.class_name, info.fused ? ", fused" : "");
            CHECK(strstr(text, want), "text lacks \"%s\" for node %d", want, i);
        }
        snprintf(want, sizeof want, "\n    n%d [label=\"%d ", i, i);
        const char *decl = strstr(dot, want);
        CHECK(decl, "dot lacks node %d", i);
        if (decl && info.fused) {
            const char *eol = strchr(decl + 1, '\n');
            const char *fill = strstr(decl, "fillcolor=lightblue");
            CHECK(fill && fill < eol, "fused node %d is not highlighted", i);
            fused++;
        }
        if (info.backward) CHECK(i >= s.n_forward, "node %d backward but before n_forward", i);
    }
    CHECK(n == s.n_forward + s.n_backward, "%d nodes != %d + %d", n, s.n_forward, s.n_backward);
    CHECK(fused == s.n_fused, "%d highlighted fused nodes, stats %d", fused, s.n_fused);
    CHECK(count_of(text, "\nbackward:\n") == (s.n_backward > 0), "backward section");
    CHECK(count_of(text, "\nvalues:\n") == 1, "values section");
    CHECK(strstr(dot, "subgraph cluster_forward {"), "dot lacks cluster_forward");
    CHECK((strstr(dot, "subgraph cluster_backward {") != NULL) == (s.n_backward > 0),
          "cluster_backward present iff there is a backward");
    CHECK(strstr(dot, "[label=\"x\\nf32[64,64]\", shape=ellipse"), "dot lacks the input x as an ellipse");
    int edges = check_dot(dot);
    CHECK(edges >= n, "only %d edges for %d nodes", edges, n);
}

static opf_spec x_spec(void) { return opf_spec_make(2, (int64_t[]){M, H}, OPF_F32); }

/* The model [-> a callback named cb_name] compiled for x_spec() under MXFP8,
 * and its text and DOT dumps. Not to be copied: call.recipe points at r. */
typedef struct mx_case {
    opf_seq     *seq;
    opf_recipe   r;
    opf_seq_call call;
    opf_spec     xs;
    opf_graph   *g;
    char        *text, *dot;
} mx_case;

/* False (nothing left to free) when the compile fails. */
static bool mx_open(opf_ctx *ctx, const char *cb_name, mx_case *mc)
{
    memset(mc, 0, sizeof *mc);
    mc->seq = build(ctx, H, F, cb_name);
    mc->r = opf_recipe_default(OPF_RECIPE_MXFP8);
    mc->call = opf_seq_call_default();
    mc->call.recipe = &mc->r;
    mc->xs = x_spec();
    CHECK_OK(ctx, opf_compile(mc->seq, &mc->xs, &mc->call, NULL, &mc->g));
    if (!mc->g) {
        opf_seq_destroy(mc->seq);
        return false;
    }
    mc->text = dump_str(mc->g, false), mc->dot = dump_str(mc->g, true);
    CHECK(mc->text && mc->dot, "dumps");
    return true;
}

static void mx_close(mx_case *mc)
{
    free(mc->text), free(mc->dot);
    opf_graph_destroy(mc->g);
    opf_seq_destroy(mc->seq);
}

static void test_fused(opf_ctx *ctx)
{
    mx_case mc;
    if (!mx_open(ctx, NULL, &mc)) return;
    const char *text = mc.text, *dot = mc.dot;
    if (text && dot) {
        check_dumps(mc.g, text, dot);
        CHECK(strstr(text, "forward_linear_bias_activation"), "text lacks the fused forward class");
        CHECK(strstr(text, "mxfp8("), "text lacks a quantized spec");
        CHECK(strstr(dot, "mxfp8("), "dot edges lack a quantized spec");
        CHECK(strstr(text, "(parameter)"), "text lacks parameters");
        CHECK(!strstr(text, "eager:") && !strstr(dot, ", color=red"), "no eager nodes expected");
        CHECK(strstr(dot, "style=dashed"), "dot lacks saved-for-backward edges");
        /* running the graph changes nothing a dump shows */
        opf_tensor x = cu_rand2(ctx, M, H, OPF_F32, 1.0f), dy = cu_rand2(ctx, M, H, OPF_F32, 1.0f), y, dx;
        CHECK_OK(ctx, opf_graph_forward(mc.g, &x, &mc.call, &y, NULL));
        CHECK_OK(ctx, opf_graph_backward(mc.g, &dy, NULL, &dx, NULL));
        char *text2 = dump_str(mc.g, false), *dot2 = dump_str(mc.g, true);
        CHECK(text2 && !strcmp(text, text2), "text dump changed after a step");
        CHECK(dot2 && !strcmp(dot, dot2), "dot dump changed after a step");
        free(text2), free(dot2);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
    /* forward only: no backward section or cluster */
    opf_graph *gi = NULL;
    mc.call.requires_grad = false;
    CHECK_OK(ctx, opf_compile(mc.seq, &mc.xs, &mc.call, NULL, &gi));
    if (gi) {
        char *ti = dump_str(gi, false), *di = dump_str(gi, true);
        if (ti && di) {
            check_dumps(gi, ti, di);
            CHECK(strstr(ti, "inference (forward only)") && strstr(ti, ", 0 backward;"), "inference header");
        }
        free(ti), free(di);
    }
    opf_graph_destroy(gi);
    mx_close(&mc);
}

static void test_eager(opf_ctx *ctx)
{
    /* a name with quotes and a backslash: the DOT must escape them */
    const char *name = "cb \"x2\" \\o/";
    mx_case mc;
    if (!mx_open(ctx, name, &mc)) return;
    const char *text = mc.text, *dot = mc.dot;
    opf_graph_reason rs[4];
    int nr = opf_graph_reasons(mc.g, rs, 4);
    CHECK(nr == 2, "%d eager nodes, want 2 (forward and backward of the callback)", nr);
    if (text && dot && nr >= 1) {
        check_dumps(mc.g, text, dot);
        CHECK(strstr(text, "forward_linear_bias_activation"), "text lacks the fused forward class");
        CHECK(count_of(text, "eager_forward") == 1 && count_of(text, "eager_backward") == 1,
              "eager node kinds in text");
        char want[256];
        snprintf(want, sizeof want, "eager: %s\n", rs[0].reason);
        CHECK(count_of(text, want) == nr, "text: \"%s\" %d times, want %d", rs[0].reason,
              count_of(text, want), nr);
        CHECK(strstr(text, name) && strstr(text, "[callback]"), "text lacks the callback node");
        snprintf(want, sizeof want, "\\neager: %s\"", rs[0].reason);
        CHECK(count_of(dot, want) == nr, "dot: reason %d times, want %d", count_of(dot, want), nr);
        CHECK(count_of(dot, ", color=red") == nr, "dot: %d red nodes, want %d", count_of(dot, ", color=red"), nr);
        CHECK(strstr(dot, "cb \\\"x2\\\" \\\\o/"), "dot lacks the escaped name");
        CHECK(!strstr(dot, "cb \"x2\""), "dot holds the name unescaped");
    }
    mx_close(&mc);
}

/* The profile table after two profiled steps: a row per op class and
 * direction whose node counts add up to the graph's; its bad input. */
static void test_profile(opf_ctx *ctx, opf_graph *g)
{
    if (!g) return;
    opf_tensor x, dy, y, dx;
    opf_spec xs = opf_spec_make(2, (int64_t[]){8, 32}, OPF_F32);
    float v[8 * 32];
    for (int i = 0; i < 8 * 32; i++) v[i] = (float)((i * 37) % 17) / 8.0f - 1.0f;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &xs, &x));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &xs, &dy));
    memcpy(x.data[0], v, sizeof v), memcpy(dy.data[0], v, sizeof v);
    opf_seq_call call = opf_seq_call_default();
    opf_graph_set_profile(g, true);
    opf_graph_reset_profile(g);
    for (int s = 0; s < 2; s++) {
        CHECK_OK(ctx, opf_graph_forward(g, &x, &call, &y, NULL));
        CHECK_OK(ctx, opf_graph_backward(g, &dy, NULL, &dx, NULL));
        opf_tensor_release(&y), opf_tensor_release(&dx);
    }
    opf_graph_set_profile(g, false);
    FILE *tmp = tmpfile();
    CHECK(tmp, "tmpfile");
    if (tmp) {
        CHECK_OK(ctx, opf_graph_dump_profile(g, 2, tmp));
        rewind(tmp);
        char line[256];
        int rows = 0, nodes = 0, n;
        CHECK(fgets(line, sizeof line, tmp) && strstr(line, "graph nodes by op class"),
              "profile header: %s", line);
        while (fgets(line, sizeof line, tmp)) {
            char *paren = strrchr(line, '(');
            CHECK(paren && sscanf(paren, "(%d node", &n) == 1, "profile row: %s", line);
            if (paren && sscanf(paren, "(%d node", &n) == 1) nodes += n, rows++;
        }
        CHECK(rows > 1 && nodes == opf_graph_num_nodes(g), "profile: %d rows, %d nodes of %d", rows,
              nodes, opf_graph_num_nodes(g));
        fclose(tmp);
    }
    CHECK_FAILS(NULL, opf_graph_dump_profile(NULL, 1, stdout), OPF_ERR_INVALID_ARG,
                "opf_graph_dump_profile", "g is NULL");
    CHECK_FAILS(ctx, opf_graph_dump_profile(g, 1, NULL), OPF_ERR_INVALID_ARG,
                "opf_graph_dump_profile", "f is NULL");
    CHECK_FAILS(ctx, opf_graph_dump_profile(g, 0, stdout), OPF_ERR_INVALID_ARG,
                "opf_graph_dump_profile", "0 steps");
    FILE *full = fopen("/dev/full", "w");
    if (full) {
        CHECK_FAILS(ctx, opf_graph_dump_profile(g, 1, full), OPF_ERR_IO, "opf_graph_dump_profile");
        fclose(full);
    }
    opf_tensor_release(&x), opf_tensor_release(&dy);
}

static void test_errors(opf_ctx *ctx)
{
    opf_seq *seq = build(ctx, 32, 64, NULL);
    opf_seq_call call = opf_seq_call_default();
    opf_spec xs = opf_spec_make(2, (int64_t[]){8, 32}, OPF_F32);
    opf_graph *g = NULL;
    CHECK_OK(ctx, opf_compile(seq, &xs, &call, NULL, &g));
    FILE *tmp = tmpfile();
    CHECK(tmp, "tmpfile");
    CHECK_FAILS(NULL, opf_graph_dump(NULL, tmp), OPF_ERR_INVALID_ARG, "opf_graph_dump", "g is NULL");
    CHECK_FAILS(NULL, opf_graph_dump_dot(NULL, tmp), OPF_ERR_INVALID_ARG, "opf_graph_dump_dot", "g is NULL");
    CHECK_FAILS(ctx, opf_graph_dump(g, NULL), OPF_ERR_INVALID_ARG, "opf_graph_dump", "f is NULL");
    CHECK_FAILS(ctx, opf_graph_dump_dot(g, NULL), OPF_ERR_INVALID_ARG, "opf_graph_dump_dot", "f is NULL");
    /* a dump into tmpfile() reads back as the memory dump */
    if (tmp && g) {
        CHECK_OK(ctx, opf_graph_dump(g, tmp));
        long len = ftell(tmp);
        char *a = calloc(1, (size_t)len + 1), *b = dump_str(g, false);
        rewind(tmp);
        CHECK(a && fread(a, 1, (size_t)len, tmp) == (size_t)len && b && !strcmp(a, b), "tmpfile dump");
        free(a), free(b);
    }
    if (tmp) fclose(tmp);
    /* failing streams: a read-only stream, a full device */
    FILE *ro = fopen("/dev/null", "r");
    if (ro && g) {
        CHECK_FAILS(ctx, opf_graph_dump(g, ro), OPF_ERR_IO, "opf_graph_dump", "writing");
        clearerr(ro);
        CHECK_FAILS(ctx, opf_graph_dump_dot(g, ro), OPF_ERR_IO, "opf_graph_dump_dot", "writing");
    }
    if (ro) fclose(ro);
    FILE *full = fopen("/dev/full", "w");
    if (full && g) {
        CHECK_FAILS(ctx, opf_graph_dump(g, full), OPF_ERR_IO, "opf_graph_dump");
        clearerr(full);
        CHECK_FAILS(ctx, opf_graph_dump_dot(g, full), OPF_ERR_IO, "opf_graph_dump_dot");
    }
    if (full) fclose(full);
    test_profile(ctx, g);
    opf_graph_destroy(g);
    opf_seq_destroy(seq);
}

int main(void)
{
    opf_ctx *ctx;
    opf_ctx_create(NULL, &ctx);
    test_fused(ctx);
    test_eager(ctx);
    test_errors(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
