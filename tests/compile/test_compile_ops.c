/* test_compile_ops.c: every built-in basic op compiled against eager, bit
 * for bit, and the fake/real conformance of the compiled graphs.
 *
 * Scenario 1: for each op row (every basic class; dropout in training and
 * in eval; add_extra_input in and out of place) x recipe x dtype, a seq A
 * run eagerly in context A and the same seq B compiled in context B (same
 * seed: same parameters, same Philox draws for dropout and stochastic
 * rounding) run two steps on fresh inputs; y, dx, the extra outputs, the
 * extra inputs' gradients and every parameter gradient (accumulated over
 * both steps) must have the same bytes. Each row runs the op alone and,
 * with fusions off, between two linears (its output quantized by the next
 * linear's input quantizer, its dx by the previous one's grad quantizer,
 * its input an arena value that in-place ops may reuse). Combinations the
 * eager seq rejects are skipped and counted.
 *
 * Scenario 8: per graph, every traced node's args agree with the eager
 * op's args of the same plan entry slot by slot (count, presence, spec,
 * layout), the plans agree, the public outputs' specs agree, the stats are
 * sane; per class the nodes checked are reported, and every registered
 * basic class must have been checked (grouped_linear as an eager node,
 * listed by opf_graph_reasons). Fused classes: test_compile_fused.c. */
#include "test.h"

#include "compile/compile-impl.h"

enum { M = 128, H = 128, STEPS = 2, MAXSEQ = 3, MAXSLOTS = 64 };
static const uint64_t SEED = 0x5EEDull;

static opf_ctx *ca, *cb;
static unsigned long long rng = 0xC0FFEEull;

/* ---- the table ------------------------------------------------------------------ */

typedef enum { EX_NONE, EX_LIKE_X, EX_SPLITS, EX_SCALES } extra_kind;
typedef enum { KW_NONE, KW_TRAIN, KW_EVAL } kw_kind;

typedef struct op_row {
    const char *label;
    const char *cls;
    const void *cfg;        /* dtype fields are substituted (config_for) */
    int64_t     in_cols, out_cols;
    extra_kind  extra;
    kw_kind     kw;
} op_row;

static opf_bias_config bias_cfg = {H, OPF_F32};
static opf_norm_config norm_cfg = {H, 1e-5, false, OPF_F32};
static opf_l2norm_config l2_cfg = {1e-6};
static opf_basic_linear_config lin_cfg = {H, H, OPF_F32, false};
static opf_constant_scale_config scale_cfg = {0.75};
static opf_reshape_config reshape_cfg = {3, {2, -1, H}};  /* the 2D view stays [M, H] */
static opf_clamped_swiglu_config clamp_cfg = {7.0, 1.702};
static opf_inplace_config inplace_cfg = {true};
static opf_quantize_config quant_cfg = {true, true};
static opf_dropout_config drop_cfg = {0.25};
static opf_grouped_linear_config grouped_cfg = {2, H, H, true, OPF_F32};

static const op_row rows[] = {
    {"identity", "identity", NULL, H, H, EX_NONE, KW_NONE},
    {"reshape", "reshape", &reshape_cfg, H, H, EX_NONE, KW_NONE},
    {"constant_scale", "constant_scale", &scale_cfg, H, H, EX_NONE, KW_NONE},
    {"bias", "bias", &bias_cfg, H, H, EX_NONE, KW_NONE},
    {"basic_linear", "basic_linear", &lin_cfg, H, H, EX_NONE, KW_NONE},
    {"layernorm", "layernorm", &norm_cfg, H, H, EX_NONE, KW_NONE},
    {"rmsnorm", "rmsnorm", &norm_cfg, H, H, EX_NONE, KW_NONE},
    {"l2normalization", "l2normalization", &l2_cfg, H, H, EX_NONE, KW_NONE},
    {"gelu", "gelu", NULL, H, H, EX_NONE, KW_NONE},
    {"qgelu", "qgelu", NULL, H, H, EX_NONE, KW_NONE},
    {"relu", "relu", NULL, H, H, EX_NONE, KW_NONE},
    {"srelu", "srelu", NULL, H, H, EX_NONE, KW_NONE},
    {"silu", "silu", NULL, H, H, EX_NONE, KW_NONE},
    {"glu", "glu", NULL, 2 * H, H, EX_NONE, KW_NONE},
    {"geglu", "geglu", NULL, 2 * H, H, EX_NONE, KW_NONE},
    {"qgeglu", "qgeglu", NULL, 2 * H, H, EX_NONE, KW_NONE},
    {"reglu", "reglu", NULL, 2 * H, H, EX_NONE, KW_NONE},
    {"sreglu", "sreglu", NULL, 2 * H, H, EX_NONE, KW_NONE},
    {"swiglu", "swiglu", NULL, 2 * H, H, EX_NONE, KW_NONE},
    {"clamped_swiglu", "clamped_swiglu", &clamp_cfg, 2 * H, H, EX_NONE, KW_NONE},
    {"add_extra_input", "add_extra_input", NULL, H, H, EX_LIKE_X, KW_NONE},
    {"add_extra_input(in place)", "add_extra_input", &inplace_cfg, H, H, EX_LIKE_X, KW_NONE},
    {"make_extra_output", "make_extra_output", NULL, H, H, EX_NONE, KW_NONE},
    {"make_extra_output(in place)", "make_extra_output", &inplace_cfg, H, H, EX_NONE, KW_NONE},
    {"quantize", "quantize", &quant_cfg, H, H, EX_NONE, KW_NONE},
    {"dropout(no kwargs)", "dropout", &drop_cfg, H, H, EX_NONE, KW_NONE},
    {"dropout(training)", "dropout", &drop_cfg, H, H, EX_NONE, KW_TRAIN},
    {"dropout(eval)", "dropout", &drop_cfg, H, H, EX_NONE, KW_EVAL},
    {"grouped_linear", "grouped_linear", &grouped_cfg, H, H, EX_SPLITS, KW_NONE},
    {"scaled_swiglu", "scaled_swiglu", NULL, 2 * H, H, EX_SCALES, KW_NONE},
};
enum { NROWS = sizeof rows / sizeof rows[0] };

static const opf_recipe_kind recipes[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                          OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
enum { NREC = sizeof recipes / sizeof recipes[0] };
static const opf_dtype dtypes[] = {OPF_F32, OPF_BF16};

typedef enum { PLACE_ALONE, PLACE_BETWEEN_LINEARS, PLACE_COUNT } placement;
static const char *const place_names[PLACE_COUNT] = {"alone", "between linears"};

static int n_compared, n_skipped;

/* ---- per-class conformance report (scenario 8) ----------------------------------- */

typedef struct class_report {
    int nodes;      /* traced nodes whose args were compared with eager */
    int eager;      /* eager nodes (output specs only) */
    int slots;      /* tensor slots compared */
    int bad;        /* slots or specs that disagreed */
} class_report;
static class_report report[256];

static int class_index(const opf_op_class *c)
{
    for (int i = 0; i < opf_op_class_count() && i < 256; i++)
        if (opf_op_class_at(i) == c) return i;
    return 0;
}

/* ---- helpers ----------------------------------------------------------------------- */

static const void *config_for(const op_row *r, opf_dtype dt, void *buf)
{
    if (!r->cfg) return NULL;
    memcpy(buf, r->cfg, opf_op_class_find(r->cls)->config_size);
    if (r->cfg == &bias_cfg) ((opf_bias_config *)buf)->dtype = dt;
    if (r->cfg == &norm_cfg) ((opf_norm_config *)buf)->dtype = dt;
    if (r->cfg == &lin_cfg) ((opf_basic_linear_config *)buf)->dtype = dt;
    if (r->cfg == &grouped_cfg) ((opf_grouped_linear_config *)buf)->dtype = dt;
    return buf;
}

/* A plain tensor of N(0, sigma) values rounded to dt. */
static opf_tensor rand_tensor(int ndim, const int64_t *shape, opf_dtype dt, float sigma)
{
    opf_spec s = opf_spec_make(ndim, shape, dt);
    int64_t n = opf_spec_numel(&s);
    float *v = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(&rng, sigma);
    opf_tensor t;
    CHECK_OK(ca, opf_tensor_alloc(ca, &s, &t));
    CHECK_OK(ca, opf_convert(v, OPF_F32, t.data[0], dt, (size_t)n));
    free(v);
    return t;
}

/* The same random values in every 1-D parameter (biases start at zero,
 * norm weights at one) of both seqs; weights keep their seeded init. */
static void randomize_params(opf_seq *a, opf_seq *b)
{
    for (int i = 0; i < opf_seq_len(a); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++) {
            opf_param *pa = opf_op_param(opf_seq_at(a, i), p), *pb = opf_op_param(opf_seq_at(b, i), p);
            if (pa->value.spec.ndim != 1) continue;
            opf_tensor t = rand_tensor(1, pa->value.spec.shape, pa->value.spec.dtype, 0.5f);
            size_t n = opf_dtype_nbytes(t.spec.dtype, (size_t)opf_spec_numel(&t.spec));
            memcpy(pa->value.data[0], t.data[0], n);
            memcpy(pb->value.data[0], t.data[0], n);
            opf_tensor_release(&t);
        }
}

static opf_seq *build(opf_ctx *ctx, const op_row *r, opf_dtype dt, placement pl)
{
    unsigned char cfg[256];
    opf_seq *seq;
    opf_op *op = NULL;
    opf_ctx_set_rng(ctx, SEED, 0);
    opf_seq_create(ctx, &seq);
    if (opf_op_create(ctx, r->cls, config_for(r, dt, cfg), r->label, &op)) {
        opf_seq_destroy(seq);
        return NULL;
    }
    if (pl == PLACE_BETWEEN_LINEARS) {
        opf_seq_append_linear(seq, H, r->in_cols, false, dt, "in");
        opf_seq_append(seq, op);
        opf_seq_append_linear(seq, r->out_cols, H, false, dt, "out");
        opf_seq_set_fusions(seq, false);
    } else {
        opf_seq_append(seq, op);
    }
    return seq;
}

/* Same presence, spec and bytes; prints what differs. */
static bool same_tensor(const char *tag, const char *what, const opf_tensor *a, const opf_tensor *b)
{
    bool ha = a->data[0] || a->data[OPF_COMP_COL_DATA], hb = b->data[0] || b->data[OPF_COMP_COL_DATA];
    if (!ha && !hb) return true;
    if (ha != hb) {
        CHECK(0, "%s: %s present eagerly %d, compiled %d", tag, what, ha, hb);
        return false;
    }
    if (!opf_spec_equal(&a->spec, &b->spec)) {
        char sa[160], sb[160];
        opf_spec_str(&a->spec, sa, sizeof sa), opf_spec_str(&b->spec, sb, sizeof sb);
        CHECK(0, "%s: %s spec eager %s, compiled %s", tag, what, sa, sb);
        return false;
    }
    bool same = opf_test_same_bytes(a, b);
    CHECK(same, "%s: %s differs from eager", tag, what);
    return same;
}

/* ---- scenario 8: conformance of one graph against the eager seq ------------------ */

/* The eager seq's plan entry over [first, first + count) in one direction. */
static opf_op *eager_entry(opf_seq *a, bool bwd, int first, int count)
{
    for (int gi = 0; gi < opf_seq_num_groups(a); gi++) {
        opf_plan_entry e[16];
        int n = opf_seq_plan(a, gi, bwd, e, 16);
        for (int i = 0; i < n && i < 16; i++)
            if (e[i].first == first && e[i].count == count) return e[i].op;
    }
    return NULL;
}

static bool present(const opf_tensor *t) { return t->data[0] || t->data[OPF_COMP_COL_DATA]; }

static bool same_layout(const opf_spec *a, const opf_spec *b)
{
    opf_layout la, lb;
    if (opf_spec_layout(a, &la) || opf_spec_layout(b, &lb)) return false;
    bool same = la.m == lb.m && la.k == lb.k && la.total_bytes == lb.total_bytes;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        same &= la.comp[c].present == lb.comp[c].present && la.comp[c].nbytes == lb.comp[c].nbytes;
    return same;
}

/* The node's baked args against the eager op's args of the same entry:
 * slot count, and per slot presence, spec and layout. */
static void check_node_args(const char *tag, const opf_gnode *n, opf_op *eop, class_report *rep)
{
    const char *dir = n->backward ? "backward" : "forward";
    void *eargs = n->backward ? eop->bwd_args : eop->fwd_args;
    opf_slot sg[MAXSLOTS], se[MAXSLOTS];
    int ng = opf_schema_slots(n->schema, n->args, sg, MAXSLOTS);
    int ne = opf_schema_slots(n->schema, eargs, se, MAXSLOTS);
    CHECK(ng == ne && ng <= MAXSLOTS, "%s: %s %s: %d slots compiled, %d eager", tag, n->op->name, dir,
          ng, ne);
    rep->bad += ng != ne;
    for (int i = 0; i < ng && i < ne && i < MAXSLOTS; i++) {
        const opf_tensor *tg = sg[i].tensor, *te = se[i].tensor;
        bool ok = present(tg) == present(te);
        if (ok && present(tg)) ok = opf_spec_equal(&tg->spec, &te->spec) && same_layout(&tg->spec, &te->spec);
        char a[160] = "-", b[160] = "-";
        if (!ok) opf_spec_str(&tg->spec, a, sizeof a), opf_spec_str(&te->spec, b, sizeof b);
        CHECK(ok, "%s: %s %s slot %s: compiled %s (present %d), eager %s (present %d)", tag,
              n->op->name, dir, sg[i].field->name, a, present(tg), b, present(te));
        rep->slots++;
        rep->bad += !ok;
    }
    rep->nodes++;
}

/* Class names of the compiled nodes of one direction that run ops, and of
 * the eager plan in execution order, as "a,b,c". */
static void graph_plan_str(const opf_graph *g, bool bwd, char *buf, size_t size)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info in;
        if (opf_graph_node(g, i, &in) || in.backward != bwd || !in.class_name) continue;
        at += (size_t)snprintf(buf + at, size - at, "%s%s", at ? "," : "", in.class_name);
        if (at >= size) break;
    }
}

static void eager_plan_str(opf_seq *a, bool bwd, char *buf, size_t size)
{
    size_t at = 0;
    buf[0] = '\0';
    int ng = opf_seq_num_groups(a);
    for (int k = 0; k < ng; k++) {
        int gi = bwd ? ng - 1 - k : k;
        opf_plan_entry e[16];
        int n = opf_seq_plan(a, gi, bwd, e, 16);
        for (int j = 0; j < n && j < 16 && at < size; j++) {
            const opf_plan_entry *en = &e[bwd ? n - 1 - j : j];
            at += (size_t)snprintf(buf + at, size - at, "%s%s", at ? "," : "", opf_op_class_of(en->op)->name);
        }
    }
}

static void check_stats(const char *tag, const opf_graph *g)
{
    opf_graph_stats s;
    opf_graph_get_stats(g, &s);
    int eager = 0, fused = 0;
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info in;
        CHECK_OK(cb, opf_graph_node(g, i, &in));
        eager += in.kind == OPF_NODE_EAGER_FORWARD || in.kind == OPF_NODE_EAGER_BACKWARD;
        fused += in.fused;
    }
    CHECK(s.arena_bytes > 0 && s.n_values > 0 && s.arena_bytes <= s.unplanned_bytes, "%s: stats arena %zu "
          "(unplanned %zu), %d values", tag, s.arena_bytes, s.unplanned_bytes, s.n_values);
    CHECK(s.n_forward > 0 && s.n_backward > 0 && s.n_forward + s.n_backward == opf_graph_num_nodes(g),
          "%s: stats %d + %d nodes of %d", tag, s.n_forward, s.n_backward, opf_graph_num_nodes(g));
    CHECK(s.n_eager == eager && s.n_fused == fused && opf_graph_reasons(g, NULL, 0) == eager,
          "%s: stats eager %d fused %d, nodes say %d / %d", tag, s.n_eager, s.n_fused, eager, fused);
    CHECK(!s.forward_only && s.max_leading == 0, "%s: stats forward_only %d max_leading %lld", tag,
          s.forward_only, (long long)s.max_leading);
}

typedef struct step_out {
    opf_tensor y, eo, dx, dei;
} step_out;

/* Scenario 8 for one graph: plans, node args, public output specs, stats. */
static void check_conformance(const char *tag, opf_seq *a, const opf_graph *g, const step_out *ea,
                              const step_out *eb)
{
    for (int bwd = 0; bwd < 2; bwd++) {
        char pg[512], pe[512];
        graph_plan_str(g, bwd, pg, sizeof pg);
        eager_plan_str(a, bwd, pe, sizeof pe);
        CHECK(!strcmp(pg, pe), "%s: compiled %s nodes %s, eager plan %s", tag, bwd ? "backward" : "forward",
              pg, pe);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const opf_gnode *n = &g->nodes[i];
        if (!n->op) continue;
        class_report *rep = &report[class_index(n->op->cls)];
        if (n->kind == OPF_NODE_EAGER_FORWARD || n->kind == OPF_NODE_EAGER_BACKWARD) {
            rep->eager++;
            continue;
        }
        opf_op *eop = eager_entry(a, n->backward, n->first, n->count);
        CHECK(eop && eop->cls == n->op->cls, "%s: node %s has no eager entry of its class", tag, n->op->name);
        if (eop && eop->cls == n->op->cls) check_node_args(tag, n, eop, rep);
    }
    const opf_tensor *pa[] = {&ea->y, &ea->eo, &ea->dx, &ea->dei};
    const opf_tensor *pb[] = {&eb->y, &eb->eo, &eb->dx, &eb->dei};
    static const char *const names[] = {"y", "extra output", "dx", "extra-input grad"};
    const opf_op *last = opf_seq_at(a, opf_seq_len(a) - 1);
    for (int k = 0; k < 4; k++) {
        bool ok = present(pa[k]) == present(pb[k]) &&
                  (!present(pa[k]) || opf_spec_equal(&pa[k]->spec, &pb[k]->spec));
        CHECK(ok, "%s: %s spec differs (scenario 8)", tag, names[k]);
        report[class_index(last->cls)].bad += !ok;
    }
    check_stats(tag, g);
}

/* ---- scenario 1: one row ------------------------------------------------------------- */

typedef struct row_run {
    const op_row     *r;
    opf_dtype         dt;
    placement         pl;
    char              tag[160];
    opf_recipe        rec;
    opf_seq          *a, *b;
    opf_graph        *g;
    opf_seq_call      call;
    const void       *kw[MAXSEQ];
    opf_dropout_kwargs dkw;
} row_run;

static opf_tensor make_extra(const op_row *r, opf_dtype dt)
{
    switch (r->extra) {
    case EX_LIKE_X: return rand_tensor(2, (int64_t[]){M, r->in_cols}, dt, 1.0f);
    case EX_SCALES: return rand_tensor(1, (int64_t[]){M}, OPF_F32, 1.0f);
    case EX_SPLITS: {
        opf_tensor t;
        opf_spec s = opf_spec_make(1, (int64_t[]){2}, OPF_I64);
        CHECK_OK(ca, opf_tensor_alloc(ca, &s, &t));
        ((int64_t *)t.data[0])[0] = 32, ((int64_t *)t.data[0])[1] = M - 32;
        return t;
    }
    default: {
        opf_tensor t;
        memset(&t, 0, sizeof t);
        return t;
    }
    }
}

static void release_out(step_out *o)
{
    opf_tensor_release(&o->y), opf_tensor_release(&o->eo);
    opf_tensor_release(&o->dx), opf_tensor_release(&o->dei);
}

static void compare_grads(const char *tag, opf_seq *a, opf_seq *b)
{
    for (int i = 0; i < opf_seq_len(a); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++) {
            const opf_param *pa = opf_op_param_const(opf_seq_at(a, i), p);
            const opf_param *pb = opf_op_param_const(opf_seq_at(b, i), p);
            char what[96];
            snprintf(what, sizeof what, "grad of %s.%s", opf_op_name(opf_seq_at(a, i)), pa->name);
            CHECK(pa->has_grad == pb->has_grad, "%s: %s: has_grad %d eager, %d compiled", tag, what,
                  pa->has_grad, pb->has_grad);
            same_tensor(tag, what, &pa->grad, &pb->grad);
        }
}

/* Runs one eager step; false when the eager seq rejects the combination
 * (counted as skipped on the first step, a failure on a later one). */
static bool eager_step(row_run *rr, int step, const opf_tensor *x, opf_tensor *dy, opf_tensor *dext,
                       step_out *o)
{
    opf_status st = opf_seq_forward(rr->a, x, &rr->call, &o->y, &o->eo);
    if (!st) {
        *dy = rand_tensor(o->y.spec.ndim, o->y.spec.shape, o->y.spec.dtype, 1.0f);
        if (opf_seq_num_extra_out(rr->a))
            *dext = rand_tensor(o->eo.spec.ndim, o->eo.spec.shape, o->eo.spec.dtype, 1.0f);
        st = opf_seq_backward(rr->a, dy, dext, &o->dx, &o->dei);
    }
    if (st && step == 0) {
        printf("skip %s: %s\n", rr->tag, opf_last_error(ca));
        n_skipped++;
    }
    CHECK(!st || step == 0, "%s step %d: eager failed after a good step: %s", rr->tag, step,
          opf_last_error(ca));
    return !st;
}

static void compiled_step(row_run *rr, int step, const opf_tensor *x, const opf_tensor *dy,
                          const opf_tensor *dext, const step_out *ea)
{
    step_out eb;
    memset(&eb, 0, sizeof eb);
    char tag[200];
    snprintf(tag, sizeof tag, "%s step %d", rr->tag, step);
    opf_status st = opf_graph_forward(rr->g, x, &rr->call, &eb.y, &eb.eo);
    CHECK(st == OPF_OK, "%s: graph forward: %s", tag, opf_last_error(cb));
    if (st) return;
    st = opf_graph_backward(rr->g, dy, dext, &eb.dx, &eb.dei);
    CHECK(st == OPF_OK, "%s: graph backward: %s", tag, opf_last_error(cb));
    if (st) return;
    same_tensor(tag, "y", &ea->y, &eb.y);
    same_tensor(tag, "dx", &ea->dx, &eb.dx);
    if (opf_seq_num_extra_out(rr->a)) same_tensor(tag, "extra output", &ea->eo, &eb.eo);
    if (opf_seq_num_extra_in(rr->a)) same_tensor(tag, "extra-input grad", &ea->dei, &eb.dei);
    compare_grads(tag, rr->a, rr->b);
    if (step == STEPS - 1) check_conformance(tag, rr->a, rr->g, ea, &eb);
}

/* grouped_linear runs as an eager node, and says why; nothing else does. */
static void check_reasons(const row_run *rr)
{
    opf_graph_reason rs[8];
    int n = opf_graph_reasons(rr->g, rs, 8);
    if (strcmp(rr->r->cls, "grouped_linear")) {
        CHECK(n == 0, "%s: %d eager nodes (first: %s: %s)", rr->tag, n, n ? rs[0].op_name : "",
              n ? rs[0].reason : "");
        return;
    }
    bool fwd = false, bwd = false;
    for (int i = 0; i < n && i < 8; i++) {
        bool mine = !strcmp(rs[i].op_name, rr->r->label);
        fwd |= mine && !rs[i].backward && strstr(rs[i].reason, "split sizes");
        bwd |= mine && rs[i].backward;
    }
    CHECK(n == 2 && fwd && bwd, "%s: grouped_linear not listed as an eager node forward and backward "
          "(%d reasons)", rr->tag, n);
}

static bool row_setup(row_run *rr)
{
    rr->a = build(ca, rr->r, rr->dt, rr->pl);
    rr->b = build(cb, rr->r, rr->dt, rr->pl);
    if (!rr->a || !rr->b) return false;
    randomize_params(rr->a, rr->b);
    rr->call = opf_seq_call_default();
    rr->call.recipe = rr->rec.kind == OPF_RECIPE_NONE ? NULL : &rr->rec;
    rr->call.n_extra_in = rr->r->extra != EX_NONE;
    if (rr->r->kw != KW_NONE) {
        rr->dkw.training = rr->r->kw == KW_TRAIN;
        rr->kw[rr->pl == PLACE_ALONE ? 0 : 1] = &rr->dkw;
        rr->call.kwargs = rr->kw;
    }
    return true;
}

static void run_row(const op_row *r, opf_dtype dt, opf_recipe_kind rk, placement pl)
{
    row_run rr;
    memset(&rr, 0, sizeof rr);
    rr.r = r, rr.dt = dt, rr.pl = pl;
    snprintf(rr.tag, sizeof rr.tag, "[%s / %s / %s / %s]", r->label, place_names[pl], opf_recipe_name(rk),
             opf_dtype_name(dt));
    rr.rec = opf_recipe_default(rk);
    rr.rec.amax_history_len = 4;  /* the delayed scales move within two steps */
    bool ok = row_setup(&rr);
    CHECK(ok, "%s: building the seqs failed: %s", rr.tag, opf_last_error(ca));
    for (int step = 0; ok && step < STEPS; step++) {
        int64_t cols = pl == PLACE_ALONE ? r->in_cols : H;
        opf_tensor x = rand_tensor(2, (int64_t[]){M, cols}, dt, 1.0f), extra = make_extra(r, dt);
        opf_tensor dy = {0}, dext = {0};
        step_out ea;
        memset(&ea, 0, sizeof ea);
        rr.call.extra_in = &extra;
        ok = eager_step(&rr, step, &x, &dy, &dext, &ea);
        if (ok && step == 0) {
            opf_status st = opf_compile(rr.b, &x.spec, &rr.call, NULL, &rr.g);
            CHECK(st == OPF_OK, "%s: compile: %s", rr.tag, opf_last_error(cb));
            ok = st == OPF_OK;
            if (ok) check_reasons(&rr), n_compared++;
        }
        if (ok) compiled_step(&rr, step, &x, &dy, &dext, &ea);
        release_out(&ea);
        opf_tensor_release(&x), opf_tensor_release(&extra);
        opf_tensor_release(&dy), opf_tensor_release(&dext);
    }
    opf_graph_destroy(rr.g);
    opf_seq_destroy(rr.a), opf_seq_destroy(rr.b);
}

/* Every registered basic class was checked; prints the per-class report. */
static void report_classes(void)
{
    printf("conformance per class (compiled vs eager args):\n");
    for (int i = 0; i < opf_op_class_count(); i++) {
        const opf_op_class *c = opf_op_class_at(i);
        const class_report *r = &report[i];
        if (c->covers > 0) {
            printf("  %-32s fused: test_compile_fused\n", c->name);
            continue;
        }
        printf("  %-32s %4d nodes, %5d slots, %3d eager nodes, %d mismatches\n", c->name, r->nodes,
               r->slots, r->eager, r->bad);
        if (!strcmp(c->name, "callback")) continue;  /* a user step, not a fusible op */
        bool eager_only = c->unsupported_reason != NULL;
        CHECK(eager_only ? r->eager > 0 : r->nodes > 0 && r->slots > 0, "class %s: never checked", c->name);
        CHECK(r->bad == 0, "class %s: %d mismatches", c->name, r->bad);
    }
}

int main(void)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = SEED;
    o.num_threads = 1;  /* bit-identical at any count; idle OpenMP workers spin on a busy 2-core box */
    if (opf_ctx_create(&o, &ca) || opf_ctx_create(&o, &cb)) return 1;
    for (int r = 0; r < NROWS; r++)
        for (int pl = 0; pl < PLACE_COUNT; pl++)
            for (int k = 0; k < NREC; k++)
                for (int d = 0; d < 2; d++) run_row(&rows[r], dtypes[d], recipes[k], (placement)pl);
    printf("compiled vs eager: %d op x placement x recipe x dtype rows compared, %d skipped "
           "(eager rejects)\n",
           n_compared, n_skipped);
    CHECK(n_compared >= 300, "only %d rows compared", n_compared);
    report_classes();
    opf_ctx_destroy(ca);
    opf_ctx_destroy(cb);
    TEST_DONE();
}
