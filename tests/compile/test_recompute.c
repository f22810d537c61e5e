/* test_recompute.c: activation recompute of a seq span (opf_seq_set_recompute).
 *
 *  - recompute equals no recompute bit for bit: y, dx, every gradient, the
 *    parameters after SGD steps and the Philox offset, under every recipe
 *    (delayed scaling's scales move between the forward and the re-run;
 *    dropout in the span draws from Philox), eagerly and compiled;
 *  - it saves memory: the compiled plan's saved bytes fall by exactly what
 *    the span's ops saved (its input and output stay: ln's and fc2's saved
 *    tensors), its peak falls, and eagerly the bytes held from the forward
 *    to the backward fall at least as much;
 *  - the span is a fuser group of its own; spans that overlap, hold a
 *    callback or read a public extra input are refused with a message.
 * Two contexts of one seed: identical parameters and draws. */
#include "compile/compile-impl.h"
#include "compile_util.h"

enum { SPAN_FIRST = 1, SPAN_COUNT = 4 };  /* fc1, fc1.bias, gelu, dropout */

/* ln -> fc1 (+bias) -> gelu -> dropout -> fc2 (+bias). */
static opf_seq *mlp_dropout(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_layernorm_config ln = {.hidden = h, .eps = 1e-5, .dtype = dt};
    cu_append(ctx, seq, "layernorm", &ln, "ln");
    CHECK_OK(ctx, opf_seq_append_linear(seq, h, f, true, dt, "fc1"));
    cu_append(ctx, seq, "gelu", NULL, "gelu");
    opf_dropout_config dc = {0.25};
    cu_append(ctx, seq, "dropout", &dc, "drop");
    CHECK_OK(ctx, opf_seq_append_linear(seq, f, h, true, dt, "fc2"));
    return seq;
}

static void set_span(opf_ctx *ctx, opf_seq *seq)
{
    CHECK_OK(ctx, opf_seq_set_recompute(seq, SPAN_FIRST, SPAN_COUNT));
}

static uint64_t rng_offset(const opf_ctx *ctx)
{
    uint64_t seed, off;
    opf_ctx_get_rng(ctx, &seed, &off);
    return off;
}

/* A pair (a without, b with the span; same parameters; SGD on both) and
 * the call of recipe kind. False when something failed (then close p). */
static bool rc_pair(cu_pair *p, uint64_t seed, opf_recipe_kind kind, opf_dtype dt, opf_recipe *r,
                    opf_seq_call *call)
{
    *call = cu_call(kind, r);
    if (!cu_pair_build(p, seed, mlp_dropout, dt, 64, 128)) return false;
    set_span(p->cb, p->b);
    cu_randomize_params(p->ca, p->a, p->b);
    return cu_pair_sgd(p, 0.05f, 0.9f);
}

/* Eager steps of a (no recompute) and b (recompute) on the same inputs. */
static void test_eager(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64;
    char tag[80];
    snprintf(tag, sizeof tag, "recompute eager %s %s", opf_recipe_name(kind), opf_dtype_name(dt));
    cu_pair p;
    opf_recipe r;
    opf_seq_call call;
    if (!rc_pair(&p, 31, kind, dt, &r, &call)) goto out;
    for (int step = 0; step < 3; step++) {
        opf_tensor x = cu_rand2(p.ca, m, h, dt, 1.0f), dy = cu_rand2(p.ca, m, h, dt, 1.0f);
        opf_tensor ya, yb, dxa, dxb;
        opf_seq_zero_grad(p.a), opf_seq_zero_grad(p.b);
        CHECK_OK(p.ca, opf_seq_forward(p.a, &x, &call, &ya, NULL));
        CHECK_OK(p.cb, opf_seq_forward(p.b, &x, &call, &yb, NULL));
        CHECK_OK(p.ca, opf_seq_backward(p.a, &dy, NULL, &dxa, NULL));
        CHECK_OK(p.cb, opf_seq_backward(p.b, &dy, NULL, &dxb, NULL));
        CHECK(opf_test_same_bytes(&ya, &yb), "%s step %d: y differs", tag, step);
        CHECK(opf_test_same_bytes(&dxa, &dxb), "%s step %d: dx differs", tag, step);
        int bad = cu_grads_differ(p.a, p.b);
        CHECK(bad == 0, "%s step %d: %d gradients differ", tag, step, bad);
        CHECK(rng_offset(p.ca) == rng_offset(p.cb), "%s step %d: Philox offsets %llu vs %llu", tag,
              step, (unsigned long long)rng_offset(p.ca), (unsigned long long)rng_offset(p.cb));
        cu_pair_optim_step(&p);
        CHECK(cu_params_differ(p.a, p.b) == 0, "%s step %d: parameters differ", tag, step);
        opf_tensor_release(&ya), opf_tensor_release(&yb), opf_tensor_release(&dxa), opf_tensor_release(&dxb);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
    /* the span is its own group: ln | span | fc2 + bias */
    CHECK(opf_seq_num_groups(p.b) == 3 && opf_seq_num_groups(p.a) == 1, "%s: groups %d and %d", tag,
          opf_seq_num_groups(p.a), opf_seq_num_groups(p.b));
out:
    cu_pair_close(&p);
}

/* Compiled with recompute (b) against eager without (a), through a cache. */
static void test_compiled(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64;
    char tag[80];
    snprintf(tag, sizeof tag, "recompute compiled %s %s", opf_recipe_name(kind), opf_dtype_name(dt));
    cu_pair p;
    opf_recipe r;
    opf_seq_call call;
    opf_compiled *c = NULL;
    if (!rc_pair(&p, 37, kind, dt, &r, &call)) goto out;
    CHECK_OK(p.cb, opf_compiled_create(p.b, NULL, &c));
    if (!c) goto out;
    for (int step = 0; step < 3; step++) {
        cu_compare_step(&p, NULL, c, &call, m, h, dt, 1.0f, tag);
        CHECK(rng_offset(p.ca) == rng_offset(p.cb), "%s step %d: Philox offsets differ", tag, step);
        cu_pair_optim_step(&p);
        CHECK(cu_params_differ(p.a, p.b) == 0, "%s step %d: parameters differ", tag, step);
    }
out:
    opf_compiled_destroy(c);
    cu_pair_close(&p);
}

static bool in_span(const opf_gnode *n) { return n->op && n->first >= SPAN_FIRST && n->first < SPAN_FIRST + SPAN_COUNT; }

/* Bytes of the forward graph's values, defined by the span's forward nodes,
 * that the span's backward nodes read: the activations the span saves. */
static size_t saved_by_span(const opf_graph *g)
{
    size_t n = 0;
    bool *seen = calloc((size_t)g->n_vals + 1, 1);
    for (int i = g->n_fwd; i < g->n_nodes; i++) {
        const opf_gnode *b = &g->nodes[i];
        if (!in_span(b) || (b->kind != OPF_NODE_BACKWARD && b->kind != OPF_NODE_EAGER_BACKWARD)) continue;
        for (int r = 0; r < b->n_refs; r++) {
            int v = b->refs[r].val;
            if (v < 0 || b->refs[r].output || seen[v]) continue;
            const opf_gval *gv = &g->vals[v];
            seen[v] = true;
            if (gv->kind == OPF_VAL_ARENA && gv->def >= 0 && gv->def < g->n_fwd && in_span(&g->nodes[gv->def]))
                n += gv->bytes;
        }
    }
    free(seen);
    return n;
}

/* The plan of the same model with and without the span. */
static void test_memory(opf_recipe_kind kind)
{
    const int64_t m = 128, h = 64, f = 256;
    char tag[80];
    snprintf(tag, sizeof tag, "recompute memory %s", opf_recipe_name(kind));
    cu_pair p;
    if (!cu_pair_build(&p, 41, mlp_dropout, OPF_BF16, h, f)) return;
    set_span(p.cb, p.b);
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
    opf_spec xs = opf_spec_make(2, (int64_t[]){m, h}, OPF_BF16);
    opf_graph *ga = NULL, *gb = NULL;
    if (!cu_compile(p.ca, tag, p.a, &xs, &call, NULL, &ga) || !cu_compile(p.cb, tag, p.b, &xs, &call, NULL, &gb))
        goto out;
    opf_graph_stats sa, sb;
    opf_graph_get_stats(ga, &sa);
    opf_graph_get_stats(gb, &sb);
    /* the span's input (ln's output) is saved either way: by fc1 without
     * recompute, for the re-run with it; the span's output by fc2 */
    size_t span_saved = saved_by_span(ga);
    CHECK(span_saved > 0 && saved_by_span(gb) == 0, "%s: the span saves %zu bytes, %zu with recompute",
          tag, span_saved, saved_by_span(gb));
    CHECK(sb.saved_bytes == sa.saved_bytes - span_saved, "%s: saved bytes %zu -> %zu, want a fall of %zu",
          tag, sa.saved_bytes, sb.saved_bytes, span_saved);
    /* the planned peak does not rise; it need not fall: this one-span
     * model's peak is the span's own backward (its values live again),
     * which no recompute lowers, since parameter gradients take no arena
     * block (before, a weight gradient's block made a later backward the peak) */
    CHECK(sb.arena_bytes <= sa.arena_bytes, "%s: peak %zu -> %zu rose", tag, sa.arena_bytes,
          sb.arena_bytes);
    /* eagerly, what stays live from the forward to the backward falls alike
     * (measured at the second step: the first allocates the span's copy of
     * the delayed-scaling state, kept from then on) */
    size_t held[2];
    for (int s = 0; s < 4; s++) {
        opf_ctx *ctx = s % 2 ? p.cb : p.ca;
        opf_seq *seq = s % 2 ? p.b : p.a;
        opf_tensor x = cu_rand2(ctx, m, h, OPF_BF16, 1.0f), dy = cu_rand2(ctx, m, h, OPF_BF16, 1.0f), y, dx;
        opf_alloc_stats s0, s1;
        opf_ctx_alloc_stats(ctx, &s0);
        CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
        opf_tensor_release(&y);
        opf_ctx_alloc_stats(ctx, &s1);
        held[s % 2] = s1.bytes_live - s0.bytes_live;
        CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));
        opf_tensor_release(&dx), opf_tensor_release(&x), opf_tensor_release(&dy);
    }
    CHECK(held[0] - held[1] >= span_saved, "%s: eager bytes held for the backward %zu -> %zu, want a "
          "fall of %zu at least", tag, held[0], held[1], span_saved);
out:
    opf_graph_destroy(ga), opf_graph_destroy(gb);
    cu_pair_close(&p);
}

static opf_status cb_fwd(void *u, opf_ctx *ctx, const opf_tensor *x, opf_tensor *y)
{
    (void)u;
    opf_tensor_retain(x, y);
    return OPF_OK;
}

static void test_errors(void)
{
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    opf_seq *seq = mlp_dropout(ctx, OPF_F32, 32, 64);
    CHECK_FAILS(ctx, opf_seq_set_recompute(seq, 5, 3), OPF_ERR_INVALID_ARG, "outside", "7 ops");
    CHECK_FAILS(ctx, opf_seq_set_recompute(seq, 0, 0), OPF_ERR_INVALID_ARG, "span");
    CHECK_OK(ctx, opf_seq_set_recompute(seq, 1, 2));
    CHECK_FAILS(ctx, opf_seq_set_recompute(seq, 2, 2), OPF_ERR_INVALID_ARG, "overlaps", "[1, 2]");
    int a = 0, n = 0;
    CHECK(opf_seq_num_recompute(seq) == 1, "one span");
    CHECK_OK(ctx, opf_seq_recompute_span(seq, 0, &a, &n));
    CHECK(a == 1 && n == 2, "span [%d, +%d)", a, n);
    /* removing an end op drops the span */
    CHECK_OK(ctx, opf_seq_remove(seq, 2, NULL));
    CHECK(opf_seq_num_recompute(seq) == 0, "span dropped with its op");
    /* a callback cannot be re-run */
    opf_callback_i cb = {cb_fwd, NULL, NULL};
    CHECK_OK(ctx, opf_seq_append_callback(seq, &cb, "cb"));
    opf_op *cbop = NULL;
    CHECK_OK(ctx, opf_seq_remove(seq, opf_seq_len(seq) - 1, &cbop));
    CHECK_OK(ctx, opf_seq_insert(seq, 2, cbop));
    CHECK_OK(ctx, opf_seq_set_recompute(seq, 1, 3));
    CHECK_FAILS(ctx, opf_seq_prepare(seq, NULL), OPF_ERR_INVALID_ARG, "not fusible");
    CHECK_OK(ctx, opf_seq_clear_recompute(seq));
    CHECK_OK(ctx, opf_seq_prepare(seq, NULL));
    opf_seq_destroy(seq);
    /* a span reading a public extra input */
    opf_seq *s2 = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &s2));
    cu_append(ctx, s2, "identity", NULL, "id");
    cu_append(ctx, s2, "add_extra_input", NULL, "add");
    CHECK_OK(ctx, opf_seq_set_recompute(s2, 1, 1));
    CHECK_FAILS(ctx, opf_seq_prepare(s2, NULL), OPF_ERR_INVALID_ARG, "public extra input");
    opf_seq_destroy(s2);
    opf_ctx_destroy(ctx);
}

int main(void)
{
    test_errors();
    for (int k = 0; k < CU_NREC; k++)
        for (int d = 0; d < CU_NDT; d++) {
            if (cu_recipes[k] == OPF_RECIPE_NVFP4 && cu_dtypes[d] == OPF_F32) continue;
            test_eager(cu_recipes[k], cu_dtypes[d]);
            test_compiled(cu_recipes[k], cu_dtypes[d]);
        }
    for (int k = 0; k < CU_NREC; k++) test_memory(cu_recipes[k]);
    TEST_DONE();
}
