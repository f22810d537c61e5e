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
#include "compile/compile-impl.h"
#include "compile_util.h"

enum { M = 128, H = 128, STEPS = 2, MAXSEQ = 3 };
static const uint64_t SEED = 0x5EEDull;

static opf_ctx *ca, *cb;

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
static opf_grouped_linear_config grouped_cfg = {2, H, H, true, OPF_F32, false};

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
    {"scaled_srelu", "scaled_srelu", NULL, H, H, EX_SCALES, KW_NONE},
    {"scaled_clamped_qgeglu", "scaled_clamped_qgeglu", NULL, 2 * H, H, EX_SCALES, KW_NONE},
};
enum { NROWS = sizeof rows / sizeof rows[0] };


typedef enum { PLACE_ALONE, PLACE_BETWEEN_LINEARS, PLACE_COUNT } placement;
static const char *const place_names[PLACE_COUNT] = {"alone", "between linears"};

static int n_compared, n_skipped;

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
    case EX_LIKE_X: return cu_rand(ca, 2, (int64_t[]){M, r->in_cols}, dt, 1.0f);
    case EX_SCALES: return cu_rand(ca, 1, (int64_t[]){M}, OPF_F32, 1.0f);
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

/* Runs one eager step; false when the eager seq rejects the combination
 * (counted as skipped on the first step, a failure on a later one). */
static bool eager_step(row_run *rr, int step, const opf_tensor *x, opf_tensor *dy, opf_tensor *dext,
                       cu_outs *o)
{
    opf_status st = opf_seq_forward(rr->a, x, &rr->call, &o->y, &o->eo);
    if (!st) {
        *dy = cu_rand(ca, o->y.spec.ndim, o->y.spec.shape, o->y.spec.dtype, 1.0f);
        if (opf_seq_num_extra_out(rr->a))
            *dext = cu_rand(ca, o->eo.spec.ndim, o->eo.spec.shape, o->eo.spec.dtype, 1.0f);
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
                          const opf_tensor *dext, const cu_outs *ea)
{
    cu_outs eb;
    memset(&eb, 0, sizeof eb);
    char tag[200];
    snprintf(tag, sizeof tag, "%s step %d", rr->tag, step);
    opf_status st = opf_graph_forward(rr->g, x, &rr->call, &eb.y, &eb.eo);
    CHECK(st == OPF_OK, "%s: graph forward: %s", tag, opf_last_error(cb));
    if (st) return;
    st = opf_graph_backward(rr->g, dy, dext, &eb.dx, &eb.dei);
    CHECK(st == OPF_OK, "%s: graph backward: %s", tag, opf_last_error(cb));
    if (st) return;
    cu_same_tensor(tag, "y", &ea->y, &eb.y);
    cu_same_tensor(tag, "dx", &ea->dx, &eb.dx);
    if (opf_seq_num_extra_out(rr->a)) cu_same_tensor(tag, "extra output", &ea->eo, &eb.eo);
    if (opf_seq_num_extra_in(rr->a)) cu_same_tensor(tag, "extra-input grad", &ea->dei, &eb.dei);
    cu_compare_grads(tag, rr->a, rr->b);
    if (step == STEPS - 1) cu_check_conformance(cb, tag, rr->a, rr->g, ea, &eb, false);
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

/* The ops that only hand their input on, make_extra_output's forward
 * (forward_is_input) and add_extra_input's backward (backward_is_dy): no
 * node between two linears; alone, where their input is the graph's x or
 * dy, a node that copies it (the graph's outputs are its own memory). */
static void check_handed_on(const row_run *rr)
{
    bool mk = !strcmp(rr->r->cls, "make_extra_output"), add = !strcmp(rr->r->cls, "add_extra_input");
    if (!mk && !add) return;
    int n = 0, want = rr->pl == PLACE_ALONE;
    for (int i = 0; i < opf_graph_num_nodes(rr->g); i++) {
        opf_graph_node_info in;
        CHECK_OK(cb, opf_graph_node(rr->g, i, &in));
        n += in.class_name && !strcmp(in.class_name, rr->r->cls) && in.backward == add;
    }
    CHECK(n == want, "%s: %d %s %s nodes, want %d (%s)", rr->tag, n, add ? "backward" : "forward",
          rr->r->cls, want, want ? "a copy of the graph's input" : "the op hands its input on");
}

static bool row_setup(row_run *rr)
{
    rr->a = build(ca, rr->r, rr->dt, rr->pl);
    rr->b = build(cb, rr->r, rr->dt, rr->pl);
    if (!rr->a || !rr->b) return false;
    cu_randomize_params(ca, rr->a, rr->b);
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
        opf_tensor x = cu_rand(ca, 2, (int64_t[]){M, cols}, dt, 1.0f), extra = make_extra(r, dt);
        opf_tensor dy = {0}, dext = {0};
        cu_outs ea;
        memset(&ea, 0, sizeof ea);
        rr.call.extra_in = &extra;
        ok = eager_step(&rr, step, &x, &dy, &dext, &ea);
        if (ok && step == 0) ok = cu_compile(cb, rr.tag, rr.b, &x.spec, &rr.call, NULL, &rr.g);
        if (ok && step == 0) check_reasons(&rr), check_handed_on(&rr), n_compared++;
        if (ok) compiled_step(&rr, step, &x, &dy, &dext, &ea);
        cu_outs_release(&ea);
        opf_tensor_release(&x), opf_tensor_release(&extra);
        opf_tensor_release(&dy), opf_tensor_release(&dext);
    }
    opf_graph_destroy(rr.g);
    opf_seq_destroy(rr.a), opf_seq_destroy(rr.b);
}

int main(void)
{
    cu_rng = 0xC0FFEEull;
    cu_pair p;  /* one thread: bit-identical at any count; idle OpenMP workers spin on a busy 2-core box */
    if (!cu_pair_open(&p, SEED, 1, NULL, NULL)) TEST_DONE();
    ca = p.ca, cb = p.cb;
    for (int r = 0; r < NROWS; r++)
        for (int pl = 0; pl < PLACE_COUNT; pl++)
            for (int k = 0; k < CU_NREC; k++)
                for (int d = 0; d < CU_NDT; d++) run_row(&rows[r], cu_dtypes[d], cu_recipes[k], (placement)pl);
    printf("compiled vs eager: %d op x placement x recipe x dtype rows compared, %d skipped "
           "(eager rejects)\n",
           n_compared, n_skipped);
    CHECK(n_compared >= 300, "only %d rows compared", n_compared);
    cu_report_classes(false);
    cu_pair_close(&p);
    TEST_DONE();
}
