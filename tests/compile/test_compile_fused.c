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
 * node). The helpers are compile_util.h's, shared with test_compile_ops.c. */
#include "compile/compile-impl.h"
#include "compile_util.h"

enum { M = 128, H = 128, STEPS = 2, MAXOPS = 8 };
static const uint64_t SEED = 0xF00Dull;

static opf_ctx *ca, *cb;

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
                              (in place / not), Q quantize (backward only), N rmsnorm, E layernorm,
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
    /* make_extra_output first: its input is the graph's x, so a node copies it */
    {"make+linear", "ML", 0, 0, {{"backward_linear_add", BWD, ALLR}}, "make_extra_output,basic_linear"},
    {"make+linear, no extra gradient", "ML", 0, NO_DEXTRA, {{"backward_linear_add", BWD, ALLR}},
     "make_extra_output,basic_linear"},
    {"residual inside the group", "MLA", 0, CHAN,
     {{"backward_linear_add", BWD, ALLR}, {"forward_linear_add", FWD, ALLR}},
     "make_extra_output,forward_linear_add"},
    {"quantize+bias+gelu", "QBG", 0, 0, {{"backward_activation_bias", BWD, QUANT}}, "quantize,bias,gelu"},
    {"quantize+bias+relu", "QBR", 0, 0, {{"backward_activation_bias", BWD, QUANT}}, "quantize,bias,relu"},
    {"make+rmsnorm", "mN", 0, 0, {{"backward_add_rmsnorm", BWD, ALLR}}, "make_extra_output,rmsnorm"},
    {"make+layernorm", "mE", 0, 0, {{"backward_add_layernorm", BWD, ALLR}}, "make_extra_output,layernorm"},
    {"grouped mlp", "XWY", 0, 0, {{"grouped_mlp", JOINT, ALLR}}, NULL},
};
enum { NSCEN = sizeof scens / sizeof scens[0] };

static int n_compared, n_skipped, cu_n_zero_dextra;

/* ---- helpers ----------------------------------------------------------------------- */

static opf_op *mk(opf_ctx *ctx, char c, const scen *sc, opf_dtype dt, int i)
{
    opf_basic_linear_config lin = {H, H, dt, false};
    opf_bias_config bias = {H, dt};
    opf_constant_scale_config scale = {sc->scale};
    opf_inplace_config in_place = {true}, not_in_place = {false};
    opf_quantize_config qbwd = {.forward = false, .backward = true};
    opf_norm_config norm = {H, 1e-5, false, dt};
    opf_grouped_linear_config fc1 = {2, H, 2 * H, true, dt, false}, fc2 = {2, H, H, true, dt, false};
    static const char *const cls[128] = {
        ['L'] = "basic_linear", ['B'] = "bias", ['G'] = "gelu", ['R'] = "relu", ['S'] = "constant_scale",
        ['A'] = "add_extra_input", ['a'] = "add_extra_input", ['M'] = "make_extra_output",
        ['m'] = "make_extra_output", ['Q'] = "quantize", ['N'] = "rmsnorm", ['E'] = "layernorm",
        ['X'] = "grouped_linear", ['W'] = "scaled_swiglu", ['Y'] = "grouped_linear"};
    const void *cfg[128] = {['L'] = &lin, ['B'] = &bias, ['S'] = &scale, ['A'] = &in_place,
                            ['a'] = &not_in_place, ['M'] = &in_place, ['m'] = &not_in_place,
                            ['Q'] = &qbwd, ['N'] = &norm, ['E'] = &norm, ['X'] = &fc1, ['Y'] = &fc2};
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
        cu_graph_plan_str(g, false, fwd, sizeof fwd);
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
            ex[n++] = cu_rand(ca, 2, (int64_t[]){M, H}, rr->dt, 1.0f);
        if (c == 'W') ex[n++] = cu_rand(ca, 1, (int64_t[]){M}, OPF_F32, 1.0f);
        if (c == 'X' || c == 'Y') {
            opf_spec s = opf_spec_make(1, (int64_t[]){2}, OPF_I64);
            CHECK_OK(ca, opf_tensor_alloc(ca, &s, &ex[n]));
            ((int64_t *)ex[n].data[0])[0] = 32, ((int64_t *)ex[n].data[0])[1] = M - 32;
            n++;
        }
    }
    return n;
}

/* The extra outputs or the extra inputs' gradients, one by one. */
static void compare_extras(const char *tag, const opf_tensor *ea, const opf_tensor *eb, int n,
                           const char *what)
{
    for (int i = 0; i < n; i++) {
        char w[48];
        snprintf(w, sizeof w, "%s %d", what, i);
        cu_same_tensor(tag, w, &ea[i], &eb[i]);
    }
}

typedef struct step_io {
    opf_tensor x, dy, extra[4], dext[2];
    opf_tensor eo[2], dei[4];   /* eager results beyond cu_outs */
} step_io;

static const opf_tensor *dext_arg(const row_run *rr, const step_io *io)
{
    return rr->sc->flags & NO_DEXTRA ? NULL : io->dext;
}

static bool eager_step(row_run *rr, int step, step_io *io, cu_outs *o)
{
    opf_status st = opf_seq_forward(rr->a, &io->x, &rr->call, &o->y, io->eo);
    if (!st) {
        io->dy = cu_rand(ca, o->y.spec.ndim, o->y.spec.shape, o->y.spec.dtype, 1.0f);
        for (int i = 0; i < opf_seq_num_extra_out(rr->a) && !(rr->sc->flags & NO_DEXTRA); i++)
            io->dext[i] = cu_rand(ca, io->eo[i].spec.ndim, io->eo[i].spec.shape, io->eo[i].spec.dtype, 1.0f);
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

static void compiled_step(row_run *rr, int step, const step_io *io, const cu_outs *ea)
{
    cu_outs eb;
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
    cu_same_tensor(tag, "y", &ea->y, &eb.y);
    cu_same_tensor(tag, "dx", &ea->dx, &eb.dx);
    compare_extras(tag, io->eo, eo, opf_seq_num_extra_out(rr->a), "extra output");
    compare_extras(tag, io->dei, dei, rr->n_extra, "extra-input grad");
    cu_compare_grads(tag, rr->a, rr->b);
    eb.eo = eo[0], eb.dei = dei[0];
    if (step == STEPS - 1) cu_check_conformance(cb, tag, rr->a, rr->g, ea, &eb, rr->sc->flags & NO_DEXTRA);
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
    if (ok) cu_randomize_params(ca, rr.a, rr.b);
    rr.call = opf_seq_call_default();
    rr.call.recipe = rk == OPF_RECIPE_NONE ? NULL : &rr.rec;
    for (int step = 0; ok && step < STEPS; step++) {
        step_io io;
        cu_outs ea;
        memset(&io, 0, sizeof io), memset(&ea, 0, sizeof ea);
        io.x = cu_rand(ca, 2, (int64_t[]){M, H}, dt, 1.0f);
        rr.n_extra = make_extras(&rr, io.extra);
        rr.call.n_extra_in = rr.n_extra;
        rr.call.extra_in = io.extra;
        ok = eager_step(&rr, step, &io, &ea);
        if (ok && step == 0) ok = cu_compile(cb, rr.tag, rr.b, &io.x.spec, &rr.call, NULL, &rr.g);
        if (ok && step == 0) check_fused_nodes(rr.tag, sc, rr.g, rk), n_compared++;
        if (ok) compiled_step(&rr, step, &io, &ea);
        cu_outs_release(&ea);
        release_io(&io, rr.n_extra);
    }
    opf_graph_destroy(rr.g);
    opf_seq_destroy(rr.a), opf_seq_destroy(rr.b);
}

int main(void)
{
    cu_rng = 0xFEEDull;
    cu_pair p;  /* one thread: bit-identical at any count; idle OpenMP workers spin on a busy 2-core box */
    if (!cu_pair_open(&p, SEED, 1, NULL, NULL)) TEST_DONE();
    ca = p.ca, cb = p.cb;
    for (int s = 0; s < NSCEN; s++)
        for (int k = 0; k < CU_NREC; k++)
            for (int d = 0; d < CU_NDT; d++) run_row(&scens[s], cu_dtypes[d], cu_recipes[k]);
    printf("compiled vs eager: %d fusion model x recipe x dtype rows compared, %d skipped (eager rejects)\n",
           n_compared, n_skipped);
    CHECK(n_compared >= NSCEN * CU_NREC, "only %d rows compared", n_compared);
    CHECK(cu_n_zero_dextra > 0, "no graph bound zeros for a missing extra-output gradient");
    cu_report_classes(true);
    cu_pair_close(&p);
    TEST_DONE();
}
