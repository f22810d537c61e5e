/* test_compile_fused.c: multi-op groups and every built-in fusion compiled
 * against eager, bit for bit.
 *
 * Scenario 2: one row per model that triggers a fusion (the models of
 * tests/fusion/): the compiled graph holds a node of the fused class
 * (fused, in the direction the fusion works in) under every recipe where
 * the fusion applies, and over two steps with fresh inputs y, dx, the extra
 * outputs, the extra inputs' gradients and every parameter gradient equal
 * the eager seq's bytes (seq A in context A, seq B compiled in context B,
 * same seed: same parameters and Philox draws), under every recipe and
 * dtype the eager seq accepts.
 *
 * Scenario 3: a backward-only fusion stays backward-only in the graph: its
 * class appears only among backward nodes and the forward nodes are the
 * basic ops (their class names are asserted).
 *
 * Scenario 8 for the fused classes: every traced node's args agree with the
 * eager plan entry's args slot by slot (count, presence, spec, layout), the
 * graph's node lists are the eager plans, the public outputs' specs agree,
 * the stats are sane; per class the nodes checked are reported and every
 * registered fused class must have been checked (grouped_mlp as an eager
 * node). The helpers mirror test_compile_ops.c. */
#include "test.h"

#include "compile/compile-impl.h"

enum { M = 128, H = 128, STEPS = 2, MAXOPS = 8, MAXSLOTS = 64 };
static const uint64_t SEED = 0xF00Dull;

static opf_ctx *ca, *cb;
static unsigned long long rng = 0xFEEDull;

static const opf_recipe_kind recipes[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                          OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
enum { NREC = sizeof recipes / sizeof recipes[0] };
static const opf_dtype dtypes[] = {OPF_F32, OPF_BF16};
#define RB(k) (1u << (k))
#define ALLR 0x3Fu
#define QUANT (ALLR & ~RB(OPF_RECIPE_NONE))

/* ---- the table ------------------------------------------------------------------ */

enum { FWD = 1, BWD = 2, JOINT = FWD | BWD };
enum {
    CHAN      = 1 << 0,  /* make_extra_output feeds add_extra_input through channel "res" */
    NO_DEXTRA = 1 << 1,  /* no gradient for the public extra output (the graph passes zeros) */
};

typedef struct fusion_want {
    const char *cls;
    int         dir;       /* FWD, BWD or JOINT */
    unsigned    recipes;   /* RB() of the recipes where the graph must hold it */
} fusion_want;

typedef struct scen {
    const char *name;
    const char *ops;       /* L basic_linear, B bias, G gelu, R relu, S constant_scale,
                              A / a add_extra_input (in place / not), M / m make_extra_output
                              (in place / not), Q quantize (backward only), N rmsnorm,
                              X grouped_linear K -> 2H, W scaled_swiglu, Y grouped_linear H -> H */
    double      scale;
    unsigned    flags;
    fusion_want want[2];
    const char *fwd_nodes; /* scenario 3: the forward nodes of a backward-only fusion */
} scen;

static const scen scens[] = {
    {"linear+bias+gelu", "LBG", 0, 0, {{"forward_linear_bias_activation", FWD, ALLR}}, NULL},
    {"linear+bias+relu", "LBR", 0, 0, {{"forward_linear_bias_activation", FWD, ALLR}}, NULL},
    {"MLP: linear+bias+gelu+linear", "LBGL", 0, 0,
     {{"forward_linear_bias_activation", FWD, ALLR}, {"backward_activation_bias", BWD, QUANT}}, NULL},
    {"linear+bias", "LB", 0, 0, {{"forward_linear_bias", FWD, ALLR}}, NULL},
    {"linear+bias+add", "LBA", 0, 0, {{"forward_linear_bias_add", FWD, ALLR}}, NULL},
    {"linear+add", "LA", 0, 0, {{"forward_linear_add", FWD, ALLR}}, NULL},
    {"linear+scale+add", "LSA", 0.5, 0,
     {{"forward_linear_scale_add", FWD, ALLR}, {"backward_linear_scale", BWD, ALLR}}, NULL},
    {"linear+scale", "LS", 0.37, 0, {{"backward_linear_scale", BWD, ALLR}}, "basic_linear,constant_scale"},
    {"make+linear", "ML", 0, 0, {{"backward_linear_add", BWD, ALLR}}, "make_extra_output,basic_linear"},
    {"make+linear, no extra gradient", "ML", 0, NO_DEXTRA, {{"backward_linear_add", BWD, ALLR}},
     "make_extra_output,basic_linear"},
    {"residual inside the group", "MLA", 0, CHAN,
     {{"backward_linear_add", BWD, ALLR}, {"forward_linear_add", FWD, ALLR}},
     "make_extra_output,forward_linear_add"},
    {"quantize+bias+gelu", "QBG", 0, 0, {{"backward_activation_bias", BWD, QUANT}}, "quantize,bias,gelu"},
    {"quantize+bias+relu", "QBR", 0, 0, {{"backward_activation_bias", BWD, QUANT}}, "quantize,bias,relu"},
    {"make+rmsnorm", "mN", 0, 0, {{"backward_add_rmsnorm", BWD, ALLR}}, "make_extra_output,rmsnorm"},
    {"grouped mlp", "XWY", 0, 0, {{"grouped_mlp", JOINT, ALLR}}, NULL},
};
enum { NSCEN = sizeof scens / sizeof scens[0] };

static int n_compared, n_skipped, n_zero_dextra;

/* ---- per-class conformance report (scenario 8) ----------------------------------- */

typedef struct class_report {
    int nodes, eager, slots, bad;
} class_report;
static class_report report[256];

static int class_index(const opf_op_class *c)
{
    for (int i = 0; i < opf_op_class_count() && i < 256; i++)
        if (opf_op_class_at(i) == c) return i;
    return 0;
}

/* ---- helpers ----------------------------------------------------------------------- */

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

/* The same random values in every 1-D parameter (biases, norm weights) of
 * both seqs; weights keep their seeded init. */
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

static opf_op *mk(opf_ctx *ctx, char c, const scen *sc, opf_dtype dt, int i)
{
    opf_basic_linear_config lin = {H, H, dt, false};
    opf_bias_config bias = {H, dt};
    opf_constant_scale_config scale = {sc->scale};
    opf_inplace_config in_place = {true}, not_in_place = {false};
    opf_quantize_config qbwd = {.forward = false, .backward = true};
    opf_norm_config norm = {H, 1e-5, false, dt};
    opf_grouped_linear_config fc1 = {2, H, 2 * H, true, dt}, fc2 = {2, H, H, true, dt};
    static const char *const cls[128] = {
        ['L'] = "basic_linear", ['B'] = "bias", ['G'] = "gelu", ['R'] = "relu", ['S'] = "constant_scale",
        ['A'] = "add_extra_input", ['a'] = "add_extra_input", ['M'] = "make_extra_output",
        ['m'] = "make_extra_output", ['Q'] = "quantize", ['N'] = "rmsnorm", ['X'] = "grouped_linear",
        ['W'] = "scaled_swiglu", ['Y'] = "grouped_linear"};
    const void *cfg[128] = {['L'] = &lin, ['B'] = &bias, ['S'] = &scale, ['A'] = &in_place,
                            ['a'] = &not_in_place, ['M'] = &in_place, ['m'] = &not_in_place,
                            ['Q'] = &qbwd, ['N'] = &norm, ['X'] = &fc1, ['Y'] = &fc2};
    char name[16];
    snprintf(name, sizeof name, "%c%d", c, i);
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls[(int)c], cfg[(int)c], name, &op));
    return op;
}

static opf_seq *build(opf_ctx *ctx, const scen *sc, opf_dtype dt)
{
    opf_seq *seq;
    opf_ctx_set_rng(ctx, SEED, 0);
    opf_seq_create(ctx, &seq);
    for (int i = 0; sc->ops[i]; i++) {
        char c = sc->ops[i];
        opf_op *op = mk(ctx, c, sc, dt, i);
        if (!op) {
            opf_seq_destroy(seq);
            return NULL;
        }
        bool chan = (sc->flags & CHAN) != 0;
        if (chan && (c == 'M' || c == 'm')) CHECK_OK(ctx, opf_op_set_extra_output(op, 0, "res", false));
        if (chan && (c == 'A' || c == 'a')) CHECK_OK(ctx, opf_op_set_extra_input(op, 0, "res"));
        CHECK_OK(ctx, opf_seq_append(seq, op));
    }
    return seq;
}

static bool present(const opf_tensor *t) { return t->data[0] || t->data[OPF_COMP_COL_DATA]; }

/* Same presence, spec and bytes; prints what differs. */
static bool same_tensor(const char *tag, const char *what, const opf_tensor *a, const opf_tensor *b)
{
    if (!present(a) && !present(b)) return true;
    if (present(a) != present(b)) {
        CHECK(0, "%s: %s present eagerly %d, compiled %d", tag, what, present(a), present(b));
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
 * slot count, and per slot presence, spec and layout. With zero_dextra (no
 * extra-output gradient given) the graph binds its zeros block where eager
 * has no gradient: a "dextra" slot present only in the graph is expected. */
static void check_node_args(const char *tag, const opf_gnode *n, opf_op *eop, bool zero_dextra,
                            class_report *rep)
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
        bool zeros = zero_dextra && n->backward && !strcmp(sg[i].field->name, "dextra") && present(tg) &&
                     !present(te);
        n_zero_dextra += zeros;
        bool ok = zeros || present(tg) == present(te);
        if (ok && present(tg) && present(te)) ok = opf_spec_equal(&tg->spec, &te->spec) && same_layout(&tg->spec, &te->spec);
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
                              const step_out *eb, bool zero_dextra)
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
        if (eop && eop->cls == n->op->cls) check_node_args(tag, n, eop, zero_dextra, rep);
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

/* ---- scenarios 2 and 3: the fused nodes ------------------------------------------------ */

static bool is_eager_kind(opf_node_kind k)
{
    return k == OPF_NODE_EAGER_FORWARD || k == OPF_NODE_EAGER_BACKWARD;
}

/* Does the graph hold a fused node of class cls in the backward (or forward) graph? */
static bool graph_has(const opf_graph *g, const char *cls, bool backward)
{
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info in;
        if (opf_graph_node(g, i, &in) || !in.class_name || strcmp(in.class_name, cls)) continue;
        bool kind_ok = backward ? in.kind == OPF_NODE_BACKWARD || in.kind == OPF_NODE_EAGER_BACKWARD
                                : in.kind == OPF_NODE_FORWARD || in.kind == OPF_NODE_EAGER_FORWARD;
        if (in.backward == backward && in.fused && kind_ok && in.count > 1) return true;
    }
    return false;
}

static void check_fused_nodes(const char *tag, const scen *sc, const opf_graph *g, opf_recipe_kind rk)
{
    for (int w = 0; w < 2 && sc->want[w].cls; w++) {
        const fusion_want *fw = &sc->want[w];
        if (!(fw->recipes & RB(rk))) continue;
        if (fw->dir & FWD) CHECK(graph_has(g, fw->cls, false), "%s: no forward %s node", tag, fw->cls);
        if (fw->dir & BWD) CHECK(graph_has(g, fw->cls, true), "%s: no backward %s node", tag, fw->cls);
        if (fw->dir == FWD)
            CHECK(!graph_has(g, fw->cls, true), "%s: forward-only %s among the backward nodes", tag, fw->cls);
        if (fw->dir == BWD)
            CHECK(!graph_has(g, fw->cls, false), "%s: backward-only %s among the forward nodes", tag,
                  fw->cls);
    }
    if (sc->fwd_nodes) {  /* scenario 3: the forward graph runs the basic ops */
        char fwd[512];
        graph_plan_str(g, false, fwd, sizeof fwd);
        CHECK(!strcmp(fwd, sc->fwd_nodes), "%s: forward nodes %s, want %s", tag, fwd, sc->fwd_nodes);
    }
    /* grouped_mlp: the one eager node pair, with its reason */
    opf_graph_reason rs[8];
    int n = opf_graph_reasons(g, rs, 8);
    if (strcmp(sc->want[0].cls, "grouped_mlp")) {
        CHECK(n == 0, "%s: %d eager nodes (first %s: %s)", tag, n, n ? rs[0].op_name : "",
              n ? rs[0].reason : "");
        return;
    }
    int eager = 0;
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info in;
        if (!opf_graph_node(g, i, &in) && is_eager_kind(in.kind))
            eager += in.class_name && !strcmp(in.class_name, "grouped_mlp") && in.reason && in.reason[0];
    }
    CHECK(n == 2 && eager == 2, "%s: grouped_mlp eager nodes %d, reasons %d", tag, eager, n);
}

/* ---- one row ------------------------------------------------------------------------------- */

typedef struct row_run {
    const scen  *sc;
    opf_dtype    dt;
    char         tag[160];
    opf_recipe   rec;
    opf_seq     *a, *b;
    opf_graph   *g;
    opf_seq_call call;
    int          n_extra;
} row_run;

/* The public extra inputs of the seq, in op order, fresh each step. */
static int make_extras(const row_run *rr, opf_tensor *ex)
{
    int n = 0;
    for (int i = 0; rr->sc->ops[i]; i++) {
        char c = rr->sc->ops[i];
        if ((c == 'A' || c == 'a') && !(rr->sc->flags & CHAN))
            ex[n++] = rand_tensor(2, (int64_t[]){M, H}, rr->dt, 1.0f);
        if (c == 'W') ex[n++] = rand_tensor(1, (int64_t[]){M}, OPF_F32, 1.0f);
        if (c == 'X' || c == 'Y') {
            opf_spec s = opf_spec_make(1, (int64_t[]){2}, OPF_I64);
            CHECK_OK(ca, opf_tensor_alloc(ca, &s, &ex[n]));
            ((int64_t *)ex[n].data[0])[0] = 32, ((int64_t *)ex[n].data[0])[1] = M - 32;
            n++;
        }
    }
    return n;
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

/* The extra outputs or the extra inputs' gradients, one by one. */
static void compare_extras(const char *tag, const opf_tensor *ea, const opf_tensor *eb, int n,
                           const char *what)
{
    for (int i = 0; i < n; i++) {
        char w[48];
        snprintf(w, sizeof w, "%s %d", what, i);
        same_tensor(tag, w, &ea[i], &eb[i]);
    }
}

typedef struct step_io {
    opf_tensor x, dy, extra[4], dext[2];
    opf_tensor eo[2], dei[4];   /* eager results beyond step_out */
} step_io;

static const opf_tensor *dext_arg(const row_run *rr, const step_io *io)
{
    return rr->sc->flags & NO_DEXTRA ? NULL : io->dext;
}

static bool eager_step(row_run *rr, int step, step_io *io, step_out *o)
{
    opf_status st = opf_seq_forward(rr->a, &io->x, &rr->call, &o->y, io->eo);
    if (!st) {
        io->dy = rand_tensor(o->y.spec.ndim, o->y.spec.shape, o->y.spec.dtype, 1.0f);
        for (int i = 0; i < opf_seq_num_extra_out(rr->a) && !(rr->sc->flags & NO_DEXTRA); i++)
            io->dext[i] = rand_tensor(io->eo[i].spec.ndim, io->eo[i].spec.shape, io->eo[i].spec.dtype, 1.0f);
        st = opf_seq_backward(rr->a, &io->dy, dext_arg(rr, io), &o->dx, io->dei);
    }
    if (st && step == 0) {
        printf("skip %s: %s\n", rr->tag, opf_last_error(ca));
        n_skipped++;
    }
    CHECK(!st || step == 0, "%s step %d: eager failed after a good step: %s", rr->tag, step,
          opf_last_error(ca));
    if (!st) {  /* the conformance check reads the first extra output and input gradient */
        if (opf_seq_num_extra_out(rr->a)) opf_tensor_retain(&io->eo[0], &o->eo);
        if (rr->n_extra) opf_tensor_retain(&io->dei[0], &o->dei);
    }
    return !st;
}

static void compiled_step(row_run *rr, int step, const step_io *io, const step_out *ea)
{
    step_out eb;
    opf_tensor eo[2], dei[4];
    memset(&eb, 0, sizeof eb), memset(eo, 0, sizeof eo), memset(dei, 0, sizeof dei);
    char tag[200];
    snprintf(tag, sizeof tag, "%s step %d", rr->tag, step);
    opf_status st = opf_graph_forward(rr->g, &io->x, &rr->call, &eb.y, eo);
    CHECK(st == OPF_OK, "%s: graph forward: %s", tag, opf_last_error(cb));
    if (st) return;
    st = opf_graph_backward(rr->g, &io->dy, dext_arg(rr, io), &eb.dx, dei);
    CHECK(st == OPF_OK, "%s: graph backward: %s", tag, opf_last_error(cb));
    if (st) return;
    same_tensor(tag, "y", &ea->y, &eb.y);
    same_tensor(tag, "dx", &ea->dx, &eb.dx);
    compare_extras(tag, io->eo, eo, opf_seq_num_extra_out(rr->a), "extra output");
    compare_extras(tag, io->dei, dei, rr->n_extra, "extra-input grad");
    compare_grads(tag, rr->a, rr->b);
    eb.eo = eo[0], eb.dei = dei[0];
    if (step == STEPS - 1) check_conformance(tag, rr->a, rr->g, ea, &eb, rr->sc->flags & NO_DEXTRA);
}

static void release_io(step_io *io, int n_extra)
{
    opf_tensor_release(&io->x), opf_tensor_release(&io->dy);
    for (int i = 0; i < 2; i++) opf_tensor_release(&io->dext[i]), opf_tensor_release(&io->eo[i]);
    for (int i = 0; i < 4; i++) opf_tensor_release(&io->dei[i]);
    for (int i = 0; i < n_extra; i++) opf_tensor_release(&io->extra[i]);
}

static void run_row(const scen *sc, opf_dtype dt, opf_recipe_kind rk)
{
    row_run rr;
    memset(&rr, 0, sizeof rr);
    rr.sc = sc, rr.dt = dt;
    snprintf(rr.tag, sizeof rr.tag, "[%s / %s / %s]", sc->name, opf_recipe_name(rk), opf_dtype_name(dt));
    rr.rec = opf_recipe_default(rk);
    rr.rec.amax_history_len = 4;  /* the delayed scales move within two steps */
    rr.a = build(ca, sc, dt);
    rr.b = build(cb, sc, dt);
    bool ok = rr.a && rr.b;
    CHECK(ok, "%s: building the seqs failed", rr.tag);
    if (ok) randomize_params(rr.a, rr.b);
    rr.call = opf_seq_call_default();
    rr.call.recipe = rk == OPF_RECIPE_NONE ? NULL : &rr.rec;
    for (int step = 0; ok && step < STEPS; step++) {
        step_io io;
        step_out ea;
        memset(&io, 0, sizeof io), memset(&ea, 0, sizeof ea);
        io.x = rand_tensor(2, (int64_t[]){M, H}, dt, 1.0f);
        rr.n_extra = make_extras(&rr, io.extra);
        rr.call.n_extra_in = rr.n_extra;
        rr.call.extra_in = io.extra;
        ok = eager_step(&rr, step, &io, &ea);
        if (ok && step == 0) {
            opf_status st = opf_compile(rr.b, &io.x.spec, &rr.call, NULL, &rr.g);
            CHECK(st == OPF_OK, "%s: compile: %s", rr.tag, opf_last_error(cb));
            ok = st == OPF_OK;
            if (ok) check_fused_nodes(rr.tag, sc, rr.g, rk), n_compared++;
        }
        if (ok) compiled_step(&rr, step, &io, &ea);
        release_out(&ea);
        release_io(&io, rr.n_extra);
    }
    opf_graph_destroy(rr.g);
    opf_seq_destroy(rr.a), opf_seq_destroy(rr.b);
}

/* Every registered fused class was checked; prints the per-class report. */
static void report_classes(void)
{
    printf("conformance per fused class (compiled vs eager args):\n");
    for (int i = 0; i < opf_op_class_count(); i++) {
        const opf_op_class *c = opf_op_class_at(i);
        const class_report *r = &report[i];
        if (c->covers == 0) continue;
        printf("  %-32s %4d nodes, %5d slots, %3d eager nodes, %d mismatches\n", c->name, r->nodes,
               r->slots, r->eager, r->bad);
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
    for (int s = 0; s < NSCEN; s++)
        for (int k = 0; k < NREC; k++)
            for (int d = 0; d < 2; d++) run_row(&scens[s], dtypes[d], recipes[k]);
    printf("compiled vs eager: %d fusion model x recipe x dtype rows compared, %d skipped (eager rejects)\n",
           n_compared, n_skipped);
    CHECK(n_compared >= NSCEN * NREC, "only %d rows compared", n_compared);
    CHECK(n_zero_dextra > 0, "no graph bound zeros for a missing extra-output gradient");
    report_classes();
    opf_ctx_destroy(ca);
    opf_ctx_destroy(cb);
    TEST_DONE();
}
