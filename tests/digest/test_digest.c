/* test_digest.c: the bit-exactness guard. Every case runs the library on
 * fresh inputs from a fixed-seed generator and hashes (FNV-1a 64 over raw
 * bytes and specs) what it produced: forward outputs, extra outputs, dx,
 * extra-input gradients, every parameter gradient (and main_grad), and the
 * recipe state (delayed scaling: amax histories and scales after three
 * steps). The hashes are compared with the committed tests/digest/golden.txt,
 * so any change of any bit, or of what an op accepts, fails here.
 *
 * Cases: every registered basic op class x recipe x dtype through the eager
 * op runner; seqs that make every fused class fire; the optimizers; quantize
 * and dequantize per recipe and role; the GEMM per layout; a compiled
 * LayerNorm-MLP step per recipe; the language-model ops (embedding,
 * attention, cross-entropy) per recipe and dtype and gradient clipping.
 *
 * OPF_DIGEST_WRITE=1 rewrites the golden file (see its header for when that
 * is allowed). OPF_DIGEST_VERBOSE=1 prints every case and every skip reason.
 *
 * The fp32 GEMMs are OpenBLAS's, whose bits depend on the kernels it picks
 * for the CPU (its "core"), so the golden file names the core it was
 * written with. On a machine whose OpenBLAS picks another core the test
 * runs itself again in a child process with OPENBLAS_CORETYPE set to the
 * golden's (a VM that hides AVX-512 from CPUID gets "Zen" or "Haswell" from
 * OpenBLAS 0.3.21, yet runs the golden's SkylakeX kernels) and answers with
 * the child's verdict; where the child cannot run them (it dies, say of
 * SIGILL), differences in cases some golden-CORE.txt lists (the ones fp32
 * GEMM kernels change) are reported and the test is skipped (77); any
 * other difference fails it. */
#define _POSIX_C_SOURCE 200809L
#include <cblas.h>
#include <errno.h>
#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "op_cases.h"

#ifndef OPF_DIGEST_GOLDEN
#error "OPF_DIGEST_GOLDEN (the golden file's path) is defined by CMakeLists.txt"
#endif

enum { MAX_CASES = 2048 };

/* ---- the digest ------------------------------------------------------------------- */

typedef struct dg_case {
    char name[96];
    char line[160];  /* "0123456789abcdef" or "skipped: why" */
} dg_case;

static dg_case cases[MAX_CASES];
static int n_cases;
static bool verbose;

static void dg_bytes(uint64_t *h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) *h = (*h ^ b[i]) * 0x100000001B3ull;
}

static void dg_u64(uint64_t *h, uint64_t v)
{
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
    dg_bytes(h, b, 8);
}

static uint64_t dg_str_hash(const char *s)
{
    uint64_t h = 0xCBF29CE484222325ull;
    dg_bytes(&h, s, strlen(s));
    return h;
}

/* The spec's fields one by one (never the struct's padding), then the bytes
 * of every component its layout has. */
static void dg_tensor(uint64_t *h, const opf_tensor *t)
{
    bool present = t && (t->data[0] || t->data[OPF_COMP_COL_DATA]);
    dg_u64(h, present);
    if (!present) return;
    const opf_spec *s = &t->spec;
    dg_u64(h, (uint64_t)s->ndim);
    for (int i = 0; i < s->ndim; i++) dg_u64(h, (uint64_t)s->shape[i]);
    dg_u64(h, (uint64_t)s->dtype);
    dg_u64(h, (uint64_t)s->scaling);
    if (s->scaling != OPF_SCALING_NONE) dg_u64(h, (uint64_t)s->qdtype), dg_u64(h, s->usage);
    opf_layout L;
    if (opf_spec_layout(s, &L)) {
        dg_u64(h, 0xBAD);
        return;
    }
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && t->data[c]) dg_u64(h, (uint64_t)c), dg_bytes(h, t->data[c], L.comp[c].nbytes);
}

static void dg_delayed(uint64_t *h, opf_delayed_state *ds)
{
    dg_u64(h, ds != NULL);
    if (!ds) return;
    size_t slots = (size_t)opf_delayed_state_slots(ds), len = (size_t)opf_delayed_state_history_len(ds);
    dg_bytes(h, opf_delayed_state_scale(ds), slots * sizeof(float));
    dg_bytes(h, opf_delayed_state_history(ds), slots * len * sizeof(float));
}

/* Gradients and main_grad of every parameter, and the op's recipe state. */
static void dg_op_state(uint64_t *h, opf_op *op)
{
    for (int i = 0; i < opf_op_num_params(op); i++) {
        const opf_param *p = opf_op_param_const(op, i);
        dg_u64(h, p->has_grad);
        dg_tensor(h, &p->grad);
        dg_tensor(h, &p->main_grad);
    }
    opf_recipe_state *rs = opf_op_recipe_state(op);
    if (rs) dg_delayed(h, opf_recipe_state_delayed(rs, false)), dg_delayed(h, opf_recipe_state_delayed(rs, true));
}

static void dg_params(uint64_t *h, opf_op *op)
{
    for (int i = 0; i < opf_op_num_params(op); i++) dg_tensor(h, &opf_op_param_const(op, i)->value);
}

static dg_case *dg_add(const char *name)
{
    CHECK(n_cases < MAX_CASES, "more than %d digest cases", MAX_CASES);
    if (n_cases >= MAX_CASES) n_cases--;
    dg_case *c = &cases[n_cases++];
    snprintf(c->name, sizeof c->name, "%s", name);
    return c;
}

static void dg_done(const char *name, uint64_t h)
{
    snprintf(dg_add(name)->line, sizeof cases[0].line, "%016llx", (unsigned long long)h);
}

/* A refusal is recorded by its status only: messages may be reworded, what
 * is accepted may not change silently. */
static void dg_skip(opf_ctx *ctx, const char *name, const char *stage, opf_status st)
{
    snprintf(dg_add(name)->line, sizeof cases[0].line, "skipped: %s %s", stage, opf_status_str(st));
    if (verbose) printf("  %s: %s: %s\n", name, stage, opf_last_error(ctx));
}

/* ---- inputs ------------------------------------------------------------------------ */

/* The generator of one case: seeded by its name, so a case's inputs do not
 * depend on which cases ran before it. */
static unsigned long long case_rng(const char *name) { return dg_str_hash(name); }

/* ---- every basic op class x recipe x dtype ------------------------------------------ */

/* What a case runs: a class with its config for the case's dtype, and a
 * maker of the step's inputs (x and extra input 0). */
typedef struct op_case op_case;
struct op_case {
    const char *cls, *op_name;
    void (*inputs)(opf_ctx *ctx, const op_case *c, opf_dtype dt, opf_recipe_kind rk, unsigned long long *s,
                   opf_tensor *x, opf_tensor *ex);
    const op_row *row;  /* op rows: the row; NULL for the nn cases */
    bool f32_dy;        /* the output is a loss: its gradient is one f32 */
};

/* An op row's inputs: x [ROWS, COLS] in dt and the row's extra input. */
static void row_inputs(opf_ctx *ctx, const op_case *c, opf_dtype dt, opf_recipe_kind rk, unsigned long long *s,
                       opf_tensor *x, opf_tensor *ex)
{
    *x = rand2(ctx, s, ROWS, COLS, dt);
    *ex = make_extra(ctx, c->row->extra, dt, rk, s);
}

/* One forward and backward of op on fresh inputs, hashed into *h. */
static opf_status op_step(opf_ctx *ctx, opf_op *op, const op_case *oc, opf_dtype dt, const opf_recipe *r,
                          op_quant q, unsigned long long *s, uint64_t *h, const char **stage)
{
    const opf_op_class *cls = opf_op_class_of(op);
    opf_tensor x, ex;
    oc->inputs(ctx, oc, dt, r->kind, s, &x, &ex);
    opf_dropout_kwargs dk = {.training = true};
    opf_fwd_env env = {.ctx = ctx, .x = &x, .requires_grad = true,
                       .recipe = r->kind == OPF_RECIPE_NONE ? NULL : r,
                       .next_input_q = cls->n_gemms ? NULL : q.next_input,
                       .kwargs = strcmp(cls->name, "dropout") ? NULL : &dk};
    if (cls->n_extra_in) env.extra_in[0] = &ex;
    opf_op_ctx octx;
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA], dy, dex[OPF_OP_MAX_EXTRA], dx, dxe[OPF_OP_MAX_EXTRA];
    memset(&octx, 0, sizeof octx), memset(outs, 0, sizeof outs), memset(&dy, 0, sizeof dy);
    memset(dex, 0, sizeof dex), memset(&dx, 0, sizeof dx), memset(dxe, 0, sizeof dxe);
    opf_status st = opf_op_forward(op, &env, &octx, outs);
    *stage = "forward";
    if (!st) {
        for (int i = 0; i < 1 + cls->n_extra_out; i++) dg_tensor(h, &outs[i]);
        dy = rand_like(ctx, s, &outs[0], oc->f32_dy ? OPF_F32 : dt);
        opf_bwd_env benv = {.ctx = ctx, .dy = &dy, .prev_grad_q = q.grad};
        for (int i = 0; i < cls->n_extra_out; i++) {
            dex[i] = rand_like(ctx, s, &outs[1 + i], dt);
            benv.dextra_out[i] = &dex[i];
        }
        *stage = "backward";
        st = opf_op_backward(op, &octx, &benv, &dx, dxe);
    }
    if (!st) {
        dg_tensor(h, &dx);
        for (int i = 0; i < cls->n_extra_in; i++) dg_tensor(h, &dxe[i]);
    }
    opf_op_ctx_clear(&octx);
    for (int i = 0; i < OPF_OP_MAX_EXTRA; i++) opf_tensor_release(&dex[i]), opf_tensor_release(&dxe[i]);
    for (int i = 0; i < 1 + OPF_OP_MAX_EXTRA; i++) opf_tensor_release(&outs[i]);
    opf_tensor_release(&dx), opf_tensor_release(&dy), opf_tensor_release(&x), opf_tensor_release(&ex);
    return st;
}

/* The case `name`: oc's op (config cfg) under recipe rk in dtype dt, steps
 * as the recipe needs, with a neighbour's quantizers under a recipe. */
static void run_class_case(opf_ctx *ctx, const char *name, const op_case *oc, const void *cfg, opf_dtype dt,
                           opf_recipe_kind rk)
{
    unsigned long long s = case_rng(name);
    opf_ctx_set_rng(ctx, 0x5EED, 0);
    opf_op *op = NULL;
    opf_status st = opf_op_create(ctx, oc->cls, cfg, oc->op_name, &op);
    if (st) {
        dg_skip(ctx, name, "create", st);
        return;
    }
    randomize_params(op, &s);
    opf_recipe r = recipe_of(rk);
    opf_quantizer nq, gq;
    opf_delayed_state *ds[2] = {NULL, NULL};
    op_quant q = {NULL, NULL};
    const char *stage = "recipe";
    if (rk != OPF_RECIPE_NONE) {
        if (!st && opf_op_class_of(op)->n_gemms) st = opf_op_reset_recipe(ctx, op, &r);
        if (!st) st = role_quantizer(ctx, &r, OPF_ROLE_INPUT, &nq, &ds[0]);
        if (!st) st = role_quantizer(ctx, &r, OPF_ROLE_GRAD_OUTPUT, &gq, &ds[1]);
        q = (op_quant){&nq, &gq};
    }
    uint64_t h = 0xCBF29CE484222325ull;
    for (int step = 0; !st && step < steps_for(rk); step++) {
        st = op_step(ctx, op, oc, dt, &r, q, &s, &h, &stage);
        if (!st && rk == OPF_RECIPE_DELAYED) update_delayed(ctx, op, ds, 2);
    }
    if (st) {
        dg_skip(ctx, name, stage, st);
    } else {
        dg_op_state(&h, op);
        dg_delayed(&h, ds[0]), dg_delayed(&h, ds[1]);
        dg_done(name, h);
    }
    opf_delayed_state_destroy(ds[0]), opf_delayed_state_destroy(ds[1]);
    opf_op_destroy(op);
}

static void run_op_case(opf_ctx *ctx, const op_row *row, opf_dtype dt, opf_recipe_kind rk)
{
    char name[96];
    snprintf(name, sizeof name, "op/%s/%s/%s", row->name, opf_recipe_name(rk), opf_dtype_name(dt));
    unsigned char cfg[256];
    op_case oc = {row->cls, row->name, row_inputs, row, false};
    run_class_case(ctx, name, &oc, row_config(row, dt, cfg, sizeof cfg), dt, rk);
}

/* Classes added after the golden file was frozen: rows here would add
 * golden lines, so their bits are pinned by their own tests instead
 * (tests/fusion/test_moe_variants.c: the unfused plan, an fp64 reference
 * and finite differences). */
static bool digested_elsewhere(const char *cls)
{
    static const char *const later[] = {"scaled_srelu", "scaled_clamped_qgeglu"};
    for (size_t i = 0; i < sizeof later / sizeof later[0]; i++)
        if (!strcmp(cls, later[i])) return true;
    return false;
}

/* The language-model classes take token ids, a packed qkv or logits with
 * targets, not the rows' [ROWS, COLS] input: their cases are the nn
 * section's (run_nn_cases). */
static bool nn_class(const char *cls)
{
    return !strcmp(cls, "embedding") || !strcmp(cls, "attention") || !strcmp(cls, "cross_entropy");
}

/* Every registered basic class has a row: a new class cannot be forgotten.
 * "callback" runs only user code. */
static void check_op_rows_cover_registry(void)
{
    int n_basic = 0, n_row_classes = 0;
    for (int i = 0; i < opf_op_class_count(); i++) {
        const opf_op_class *c = opf_op_class_at(i);
        if (c->covers > 0 || !strcmp(c->name, "callback") || digested_elsewhere(c->name) || nn_class(c->name))
            continue;
        n_basic++;
        bool found = false;
        for (int r = 0; r < N_OP_ROWS; r++) found |= !strcmp(op_rows[r].cls, c->name);
        CHECK(found, "op class %s has no digest row", c->name);
    }
    for (int r = 0; r < N_OP_ROWS; r++) {
        bool first = true;
        for (int p = 0; p < r; p++) first &= strcmp(op_rows[p].cls, op_rows[r].cls) != 0;
        n_row_classes += first;
    }
    CHECK(n_row_classes == n_basic, "the digest rows name %d classes, the registry has %d basic ones",
          n_row_classes, n_basic);
}

static void run_op_cases(opf_ctx *ctx)
{
    for (int r = 0; r < N_OP_ROWS; r++)
        for (int k = 0; k < NREC; k++)
            for (int d = 0; d < NDT; d++) run_op_case(ctx, &op_rows[r], dtypes[d], recipes[k]);
    check_op_rows_cover_registry();
}

/* ---- seqs: every fused op, the optimizers, a compiled step --------------------------- */

/* Appends an op of cls to seq; the first failure sticks in *st. */
static void add_op(opf_ctx *ctx, opf_seq *seq, const char *cls, const void *cfg, const char *name, opf_status *st)
{
    opf_op *op = NULL;
    if (*st || (*st = opf_op_create(ctx, cls, cfg, name, &op))) return;
    *st = opf_seq_append(seq, op);
}

static void add_linear(opf_ctx *ctx, opf_seq *seq, int64_t in, int64_t out, opf_dtype dt, const char *name,
                       opf_status *st)
{
    opf_basic_linear_config c = {in, out, dt, false};
    add_op(ctx, seq, "basic_linear", &c, name, st);
}

static void add_bias(opf_ctx *ctx, opf_seq *seq, int64_t n, opf_dtype dt, opf_status *st)
{
    opf_bias_config c = {n, dt};
    add_op(ctx, seq, "bias", &c, "bias", st);
}

/* The seqs, by the shape of their ops (x is [ROWS, COLS]). */
typedef enum seq_shape {
    SQ_LINEAR_BIAS_GELU,   /* linear, bias, gelu, linear */
    SQ_LINEAR_BIAS_RELU,   /* linear, bias, relu, linear */
    SQ_LINEAR_BIAS,        /* linear, bias */
    SQ_LINEAR_BIAS_ADD,    /* linear, bias, add_extra_input(in place) */
    SQ_LINEAR_ADD,         /* linear, add_extra_input(in place) */
    SQ_LINEAR_SCALE_ADD,   /* linear, constant_scale, add_extra_input(in place) */
    SQ_LINEAR_SCALE,       /* linear, constant_scale */
    SQ_RESIDUAL_LINEAR,    /* make_extra_output(in place), linear */
    SQ_RESIDUAL_RMSNORM,   /* make_extra_output, rmsnorm, linear */
    SQ_RESIDUAL_LAYERNORM, /* make_extra_output, layernorm (no GEMM: the same bits on
                              every OpenBLAS core) */
    SQ_GROUPED_MLP,        /* grouped_linear, scaled_swiglu, grouped_linear */
    SQ_LN_MLP,             /* layernorm, linear, bias, gelu, linear, bias */
} seq_shape;

typedef struct seq_def {
    const char *name;
    seq_shape   shape;
    extra_kind  extra[3];  /* the public extra inputs */
} seq_def;

static const seq_def seq_defs[] = {
    {"linear_bias_gelu", SQ_LINEAR_BIAS_GELU, {EX_NONE}},
    {"linear_bias_relu", SQ_LINEAR_BIAS_RELU, {EX_NONE}},
    {"linear_bias", SQ_LINEAR_BIAS, {EX_NONE}},
    {"linear_bias_add", SQ_LINEAR_BIAS_ADD, {EX_LIKE_Y}},
    {"linear_add", SQ_LINEAR_ADD, {EX_LIKE_Y}},
    {"linear_scale_add", SQ_LINEAR_SCALE_ADD, {EX_LIKE_Y}},
    {"linear_scale", SQ_LINEAR_SCALE, {EX_NONE}},
    {"residual_linear", SQ_RESIDUAL_LINEAR, {EX_NONE}},
    {"residual_rmsnorm", SQ_RESIDUAL_RMSNORM, {EX_NONE}},
    {"residual_layernorm", SQ_RESIDUAL_LAYERNORM, {EX_NONE}},
    {"grouped_mlp", SQ_GROUPED_MLP, {EX_SPLITS, EX_SCALES, EX_SPLITS}},
    {"ln_mlp", SQ_LN_MLP, {EX_NONE}},
};
enum { N_SEQ_DEFS = sizeof seq_defs / sizeof seq_defs[0] };

static void build_body(opf_ctx *ctx, opf_seq *seq, seq_shape shape, opf_dtype dt, opf_status *st)
{
    opf_norm_config norm = {COLS, 1e-5, false, dt};
    opf_constant_scale_config scale = {0.75};
    opf_grouped_linear_config fc1 = {2, COLS, 2 * HID, true, dt, false}, fc2 = {2, HID, COLS, true, dt, false};
    bool resid = shape == SQ_RESIDUAL_LINEAR || shape == SQ_RESIDUAL_RMSNORM ||
                 shape == SQ_RESIDUAL_LAYERNORM;
    if (shape == SQ_LN_MLP) add_op(ctx, seq, "layernorm", &norm, "ln", st);
    if (resid)
        add_op(ctx, seq, "make_extra_output", shape == SQ_RESIDUAL_LINEAR ? &in_place_cfg : NULL, "resid", st);
    if (shape == SQ_RESIDUAL_RMSNORM) add_op(ctx, seq, "rmsnorm", &norm, "rms", st);
    if (shape == SQ_RESIDUAL_LAYERNORM) {
        add_op(ctx, seq, "layernorm", &norm, "ln", st);
        return;
    }
    if (shape == SQ_GROUPED_MLP) {
        add_op(ctx, seq, "grouped_linear", &fc1, "fc1", st);
        add_op(ctx, seq, "scaled_swiglu", NULL, "glu", st);
        add_op(ctx, seq, "grouped_linear", &fc2, "fc2", st);
        return;
    }
    add_linear(ctx, seq, COLS, HID, dt, "fc1", st);
    if (shape <= SQ_LINEAR_BIAS_ADD || shape == SQ_LN_MLP) add_bias(ctx, seq, HID, dt, st);
    if (shape == SQ_LINEAR_SCALE_ADD || shape == SQ_LINEAR_SCALE)
        add_op(ctx, seq, "constant_scale", &scale, "scale", st);
    if (shape == SQ_LINEAR_BIAS_ADD || shape == SQ_LINEAR_ADD || shape == SQ_LINEAR_SCALE_ADD)
        add_op(ctx, seq, "add_extra_input", &in_place_cfg, "add", st);
    if (shape == SQ_LINEAR_BIAS_GELU || shape == SQ_LN_MLP) add_op(ctx, seq, "gelu", NULL, "act", st);
    if (shape == SQ_LINEAR_BIAS_RELU) add_op(ctx, seq, "relu", NULL, "act", st);
    if (shape == SQ_LINEAR_BIAS_GELU || shape == SQ_LINEAR_BIAS_RELU || shape == SQ_LN_MLP)
        add_linear(ctx, seq, HID, COLS, dt, "fc2", st);
    if (shape == SQ_LN_MLP) add_bias(ctx, seq, COLS, dt, st);
}

static opf_status build_seq(opf_ctx *ctx, seq_shape shape, opf_dtype dt, opf_seq **out)
{
    opf_status st = opf_seq_create(ctx, out);
    if (!st) build_body(ctx, *out, shape, dt, &st);
    if (st) opf_seq_destroy(*out), *out = NULL;
    return st;
}

/* Fused classes seen in some plan: every registered one must fire somewhere. */
static const char *fired[64];
static int n_fired;

static void note_fired(const char *cls)
{
    for (int i = 0; i < n_fired; i++)
        if (!strcmp(fired[i], cls)) return;
    if (n_fired < 64) fired[n_fired++] = cls;
}

/* The class names of every plan entry (forward and backward), in order. */
static void dg_plans(uint64_t *h, opf_seq *seq)
{
    opf_plan_entry e[32];
    for (int g = 0; g < opf_seq_num_groups(seq); g++)
        for (int bwd = 0; bwd < 2; bwd++) {
            int n = opf_seq_plan(seq, g, bwd, e, 32);
            dg_u64(h, (uint64_t)n);
            for (int i = 0; i < n && i < 32; i++) {
                const opf_op_class *c = opf_op_class_of(e[i].op);
                dg_bytes(h, c->name, strlen(c->name) + 1);
                dg_u64(h, (uint64_t)e[i].first), dg_u64(h, (uint64_t)e[i].count);
                if (c->covers > 0) note_fired(c->name);
            }
        }
}

/* A step's public inputs and outputs. */
typedef struct seq_io {
    opf_tensor x, ex[3], y, eo[4], dy, deo[4], dx, dei[4];
} seq_io;

static void seq_io_release(seq_io *io)
{
    opf_tensor *t = (opf_tensor *)io;
    for (size_t i = 0; i < sizeof *io / sizeof *t; i++) opf_tensor_release(&t[i]);
}

/* The graph's outputs are arena views: not released. */
typedef struct seq_runner {
    opf_seq   *seq;
    opf_graph *graph;  /* NULL: eager */
} seq_runner;

/* One forward and backward through the runner on fresh inputs, hashed. */
static opf_status seq_step(opf_ctx *ctx, seq_runner run, const seq_def *d, opf_dtype dt, const opf_seq_call *call0,
                           unsigned long long *s, uint64_t *h, const char **stage)
{
    seq_io io;
    memset(&io, 0, sizeof io);
    io.x = rand2(ctx, s, ROWS, COLS, dt);
    opf_seq_call call = *call0;
    opf_recipe_kind rk = call0->recipe ? call0->recipe->kind : OPF_RECIPE_NONE;
    for (int i = 0; i < 3 && d->extra[i] != EX_NONE; i++, call.n_extra_in++)
        io.ex[i] = make_extra(ctx, d->extra[i], dt, rk, s);
    call.extra_in = io.ex;
    *stage = "forward";
    opf_status st = run.graph ? opf_graph_forward(run.graph, &io.x, &call, &io.y, io.eo)
                              : opf_seq_forward(run.seq, &io.x, &call, &io.y, io.eo);
    int neo = opf_seq_num_extra_out(run.seq), nei = opf_seq_num_extra_in(run.seq);
    if (!st) {
        dg_tensor(h, &io.y);
        for (int i = 0; i < neo; i++) dg_tensor(h, &io.eo[i]), io.deo[i] = rand_like(ctx, s, &io.eo[i], dt);
        io.dy = rand_like(ctx, s, &io.y, dt);
        *stage = "backward";
        st = run.graph ? opf_graph_backward(run.graph, &io.dy, io.deo, &io.dx, io.dei)
                       : opf_seq_backward(run.seq, &io.dy, io.deo, &io.dx, io.dei);
    }
    if (!st) {
        dg_tensor(h, &io.dx);
        for (int i = 0; i < nei; i++) dg_tensor(h, &io.dei[i]);
        if (!run.graph) dg_plans(h, run.seq);
    }
    if (run.graph) memset(&io.y, 0, sizeof io.y), memset(io.eo, 0, sizeof io.eo),
                   memset(&io.dx, 0, sizeof io.dx), memset(io.dei, 0, sizeof io.dei);
    seq_io_release(&io);
    return st;
}

static void dg_seq_state(uint64_t *h, opf_seq *seq)
{
    for (int i = 0; i < opf_seq_len(seq); i++) dg_op_state(h, opf_seq_at(seq, i));
}

/* prefix/seq/recipe/dtype: steps_for(rk) eager (or compiled) steps. */
static void run_seq_case(opf_ctx *ctx, const char *prefix, const seq_def *d, opf_recipe_kind rk, opf_dtype dt,
                         bool compiled)
{
    char name[96];
    snprintf(name, sizeof name, "%s/%s/%s/%s", prefix, d->name, opf_recipe_name(rk), opf_dtype_name(dt));
    unsigned long long s = case_rng(name);
    opf_ctx_set_rng(ctx, 0x5EED, 0);
    seq_runner run = {NULL, NULL};
    const char *stage = "build";
    opf_status st = build_seq(ctx, d->shape, dt, &run.seq);
    opf_recipe r = recipe_of(rk);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = rk == OPF_RECIPE_NONE ? NULL : &r;
    if (!st) randomize_seq(run.seq, &s);
    if (!st && compiled) {
        stage = "compile";
        opf_spec xs = opf_spec_make(2, (int64_t[]){ROWS, COLS}, dt);
        opf_compile_options co = opf_compile_options_default();
        st = opf_compile(run.seq, &xs, &call, &co, &run.graph);
    }
    uint64_t h = 0xCBF29CE484222325ull;
    for (int step = 0; !st && step < steps_for(rk); step++) st = seq_step(ctx, run, d, dt, &call, &s, &h, &stage);
    if (st) {
        dg_skip(ctx, name, stage, st);
    } else {
        dg_seq_state(&h, run.seq);
        dg_done(name, h);
    }
    opf_graph_destroy(run.graph);
    opf_seq_destroy(run.seq);
}

/* Three steps of the optimizer over the LayerNorm-MLP: the parameters and
 * the optimizer's master weights and moments. */
static void run_optim_case(opf_ctx *ctx, opf_optim_kind kind, opf_dtype dt)
{
    char name[96];
    snprintf(name, sizeof name, "optim/%s/%s", kind == OPF_OPTIM_SGD ? "sgd" : "adamw", opf_dtype_name(dt));
    unsigned long long s = case_rng(name);
    opf_ctx_set_rng(ctx, 0x5EED, 0);
    const seq_def *d = &seq_defs[N_SEQ_DEFS - 1];
    seq_runner run = {NULL, NULL};
    opf_optim *opt = NULL;
    const char *stage = "build";
    opf_status st = build_seq(ctx, d->shape, dt, &run.seq);
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = kind == OPF_OPTIM_SGD ? 0.05f : 0.01f;
    oo.momentum = 0.9f, oo.weight_decay = 0.01f;
    if (!st) randomize_seq(run.seq, &s), stage = "create", st = opf_optim_create(ctx, run.seq, kind, &oo, &opt);
    opf_seq_call call = opf_seq_call_default();
    uint64_t h = 0xCBF29CE484222325ull;
    for (int step = 0; !st && step < 3; step++) {
        opf_seq_zero_grad(run.seq);
        st = seq_step(ctx, run, d, dt, &call, &s, &h, &stage);
        if (!st) stage = "step", st = opf_optim_step(opt);
    }
    for (int i = 0; !st && i < opf_seq_len(run.seq); i++) dg_params(&h, opf_seq_at(run.seq, i));
    for (int i = 0; !st && i < opf_optim_num_slots(opt); i++) {
        opf_param *p;
        float *master, *m, *v;
        int64_t n;
        if ((st = opf_optim_slot(opt, i, &p, &master, &m, &v, &n))) break;
        float *parts[3] = {master, m, v};
        for (int k = 0; k < 3; k++) {
            dg_u64(&h, parts[k] != NULL);
            if (parts[k]) dg_bytes(&h, parts[k], sizeof(float) * (size_t)n);
        }
    }
    if (st) dg_skip(ctx, name, stage, st);
    else dg_done(name, h);
    opf_optim_destroy(opt);
    opf_seq_destroy(run.seq);
}

static void run_seq_cases(opf_ctx *ctx)
{
    for (int i = 0; i < N_SEQ_DEFS; i++)
        for (int k = 0; k < NREC; k++)
            for (int d = 0; d < NDT; d++) run_seq_case(ctx, "seq", &seq_defs[i], recipes[k], dtypes[d], false);
    for (int k = 0; k < NREC; k++)
        for (int d = 0; d < NDT; d++)
            run_seq_case(ctx, "compile", &seq_defs[N_SEQ_DEFS - 1], recipes[k], dtypes[d], true);
    for (int d = 0; d < NDT; d++)
        run_optim_case(ctx, OPF_OPTIM_SGD, dtypes[d]), run_optim_case(ctx, OPF_OPTIM_ADAMW, dtypes[d]);
    for (int i = 0; i < opf_op_class_count(); i++) {
        const opf_op_class *c = opf_op_class_at(i);
        bool seen = false;
        for (int f = 0; f < n_fired; f++) seen |= !strcmp(fired[f], c->name);
        CHECK(c->covers == 0 || seen, "fused class %s fired in no digest seq", c->name);
    }
}

/* ---- quantize / dequantize per recipe and role; the GEMM per layout ------------------ */

static const opf_tensor_role quant_roles[] = {OPF_ROLE_INPUT, OPF_ROLE_WEIGHT, OPF_ROLE_GRAD_OUTPUT};

/* Quantizes x with both copies, hashes the result and its dequantized copies. */
static opf_status quant_step(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *x, uint64_t *h)
{
    opf_tensor xq, w;
    memset(&w, 0, sizeof w);
    opf_status st = opf_quantize_alloc(ctx, q, x, &xq);
    if (st) return st;
    dg_tensor(h, &xq);
    opf_spec fs = opf_spec_make(x->spec.ndim, x->spec.shape, OPF_F32);
    unsigned which[2] = {OPF_USAGE_ROWWISE, OPF_USAGE_COLUMNWISE};
    for (int k = 0; !st && k < 2; k++) {
        if (!(xq.spec.usage & which[k])) continue;
        if (!(st = opf_tensor_alloc(ctx, &fs, &w))) st = opf_dequantize(ctx, &xq, which[k], &w);
        if (!st) dg_tensor(h, &w);
        opf_tensor_release(&w);
    }
    opf_tensor_release(&xq);
    return st;
}

static void run_quant_case(opf_ctx *ctx, opf_recipe_kind rk, opf_tensor_role role, opf_dtype dt)
{
    char name[96];
    snprintf(name, sizeof name, "quant/%s/%s/%s", opf_recipe_name(rk), opf_role_name(role), opf_dtype_name(dt));
    unsigned long long s = case_rng(name);
    opf_ctx_set_rng(ctx, 0x5EED, 0);
    opf_recipe r = recipe_of(rk);
    opf_quantizer q;
    opf_delayed_state *ds = NULL;
    const char *stage = "quantizer";
    opf_status st = role_quantizer(ctx, &r, role, &q, &ds);
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    uint64_t h = 0xCBF29CE484222325ull;
    for (int step = 0; !st && step < steps_for(rk); step++) {
        opf_tensor x = rand2(ctx, &s, 2 * ROWS, COLS, dt);
        stage = "quantize";
        st = quant_step(ctx, &q, &x, &h);
        if (!st && ds) st = opf_delayed_state_update(ctx, ds, NULL, NULL);
        opf_tensor_release(&x);
    }
    dg_delayed(&h, ds);
    if (st) dg_skip(ctx, name, stage, st);
    else dg_done(name, h);
    opf_delayed_state_destroy(ds);
}

static void run_quant_cases(opf_ctx *ctx)
{
    for (int k = 1; k < NREC; k++)
        for (size_t role = 0; role < sizeof quant_roles / sizeof quant_roles[0]; role++)
            for (int d = 0; d < NDT; d++) run_quant_case(ctx, recipes[k], quant_roles[role], dtypes[d]);
}

/* The operands of each layout (gemm.h) for D [M, N] = [ROWS, HID], K = COLS,
 * and the roles a linear gives them (fprop, dgrad, wgrad). */
static const struct {
    const char     *name;
    opf_gemm_layout layout;
    int64_t         a[2], b[2];
    opf_tensor_role ra, rb;
} gemm_rows[] = {
    {"tn", OPF_GEMM_TN, {HID, COLS}, {ROWS, COLS}, OPF_ROLE_WEIGHT, OPF_ROLE_INPUT},
    {"nn", OPF_GEMM_NN, {COLS, HID}, {ROWS, COLS}, OPF_ROLE_WEIGHT, OPF_ROLE_GRAD_OUTPUT},
    {"nt", OPF_GEMM_NT, {COLS, HID}, {COLS, ROWS}, OPF_ROLE_INPUT, OPF_ROLE_GRAD_OUTPUT},
};

/* An operand: plain, or quantized (both copies) for role under recipe r. */
static opf_status gemm_operand(opf_ctx *ctx, const opf_recipe *r, opf_tensor_role role, const int64_t *shape,
                               opf_dtype dt, unsigned long long *s, opf_tensor *out)
{
    opf_tensor x = rand2(ctx, s, shape[0], shape[1], dt);
    if (r->kind == OPF_RECIPE_NONE) {
        *out = x;
        return OPF_OK;
    }
    opf_quantizer q;
    opf_delayed_state *ds = NULL;
    opf_status st = role_quantizer(ctx, r, role, &q, &ds);
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    if (!st) st = opf_quantize_alloc(ctx, &q, &x, out);
    opf_delayed_state_destroy(ds);
    opf_tensor_release(&x);
    return st;
}

/* D = 0.75 acc + bias, then D = 0.75 acc + 0.5 D (accumulate). */
static opf_status gemm_step(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b, opf_gemm_layout layout,
                            opf_dtype dt, unsigned long long *s, uint64_t *h)
{
    opf_spec ds;
    opf_status st = opf_gemm_out_spec(&a->spec, &b->spec, layout, dt, &ds);
    if (st) return st;
    opf_tensor d, bias = rand_tensor(ctx, s, 1, &ds.shape[1], dt, -1.0f, 1.0f);
    if ((st = opf_tensor_alloc(ctx, &ds, &d))) return opf_tensor_release(&bias), st;
    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = 0.75f, o.bias = &bias;
    st = opf_gemm(ctx, a, b, layout, &o, &d);
    if (!st) dg_tensor(h, &d);
    o.bias = NULL, o.accumulate = true, o.beta = 0.5f;
    if (!st) st = opf_gemm(ctx, a, b, layout, &o, &d);
    if (!st) dg_tensor(h, &d);
    opf_tensor_release(&d), opf_tensor_release(&bias);
    return st;
}

static void run_gemm_case(opf_ctx *ctx, int row, opf_recipe_kind rk, opf_dtype dt)
{
    char name[96];
    snprintf(name, sizeof name, "gemm/%s/%s/%s", gemm_rows[row].name, opf_recipe_name(rk), opf_dtype_name(dt));
    unsigned long long s = case_rng(name);
    opf_ctx_set_rng(ctx, 0x5EED, 0);
    opf_recipe r = recipe_of(rk);
    opf_tensor a, b;
    memset(&a, 0, sizeof a), memset(&b, 0, sizeof b);
    const char *stage = "quantize";
    opf_status st = gemm_operand(ctx, &r, gemm_rows[row].ra, gemm_rows[row].a, dt, &s, &a);
    if (!st) st = gemm_operand(ctx, &r, gemm_rows[row].rb, gemm_rows[row].b, dt, &s, &b);
    uint64_t h = 0xCBF29CE484222325ull;
    if (!st) stage = "gemm", st = gemm_step(ctx, &a, &b, gemm_rows[row].layout, dt, &s, &h);
    if (st) dg_skip(ctx, name, stage, st);
    else dg_done(name, h);
    opf_tensor_release(&a), opf_tensor_release(&b);
}

static void run_gemm_cases(opf_ctx *ctx)
{
    for (int row = 0; row < (int)(sizeof gemm_rows / sizeof gemm_rows[0]); row++)
        for (int k = 0; k < NREC; k++)
            for (int d = 0; d < NDT; d++) run_gemm_case(ctx, row, recipes[k], dtypes[d]);
}

/* ---- the language-model ops and gradient clipping (nn.h) ------------------------------ */

enum { NN_B = 4, NN_T = 16, NN_C = 64, NN_HEADS = 2, NN_V = 96 };

/* int32 values in [0, n), every 7th -1 when with_ignored (ignored targets). */
static opf_tensor rand_ids(opf_ctx *ctx, unsigned long long *s, int64_t n, bool with_ignored)
{
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &(opf_spec){.ndim = 2, .shape = {NN_B, NN_T}, .dtype = OPF_I32}, &t));
    int32_t *v = t.data[0];
    for (int64_t i = 0; v && i < NN_B * NN_T; i++)
        v[i] = with_ignored && i % 7 == 3 ? -1 : (int32_t)(opf_test_uniform(s, 0.0f, 1.0f) * (float)n) % (int32_t)n;
    return t;
}

static void nn_inputs(opf_ctx *ctx, const op_case *c, opf_dtype dt, opf_recipe_kind rk, unsigned long long *s,
                      opf_tensor *x, opf_tensor *ex)
{
    (void)rk;
    memset(ex, 0, sizeof *ex);
    if (!strcmp(c->cls, "embedding")) {
        *x = rand_ids(ctx, s, NN_V, false);
    } else if (!strcmp(c->cls, "attention")) {
        *x = rand_tensor(ctx, s, 3, (int64_t[]){NN_B, NN_T, 3 * NN_C}, dt, -2.0f, 2.0f);
    } else {
        *x = rand_tensor(ctx, s, 3, (int64_t[]){NN_B, NN_T, NN_V}, dt, -3.0f, 3.0f);
        *ex = rand_ids(ctx, s, NN_V, true);
    }
}

/* Each class per recipe (the neighbours' quantizers: embedding quantizes its
 * output for the next op, attention and cross_entropy their dx for the
 * previous one) and dtype. */
static void run_nn_op_cases(opf_ctx *ctx)
{
    static const char *const classes[] = {"embedding", "attention", "cross_entropy"};
    for (size_t i = 0; i < sizeof classes / sizeof classes[0]; i++)
        for (int k = 0; k < NREC; k++)
            for (int d = 0; d < NDT; d++) {
                char name[96];
                snprintf(name, sizeof name, "nn/%s/%s/%s", classes[i], opf_recipe_name(recipes[k]),
                         opf_dtype_name(dtypes[d]));
                opf_embedding_config ec = {NN_V, NN_T, NN_C, dtypes[d]};
                opf_attention_config ac = {NN_HEADS};
                const void *cfg = i == 0 ? (const void *)&ec : i == 1 ? (const void *)&ac : NULL;
                op_case oc = {classes[i], classes[i], nn_inputs, NULL, i == 2};
                run_class_case(ctx, name, &oc, cfg, dtypes[d], recipes[k]);
            }
}

/* Clipping: a LayerNorm-MLP's gradients after one step, clipped to half
 * their norm; the norm and the clipped gradients are hashed. */
static void run_clip_case(opf_ctx *ctx, opf_dtype dt)
{
    char name[96];
    snprintf(name, sizeof name, "nn/clip_grad_norm/%s", opf_dtype_name(dt));
    unsigned long long s = case_rng(name);
    opf_seq *seq = NULL;
    opf_status st = build_seq(ctx, SQ_LN_MLP, dt, &seq);
    const char *stage = "seq";
    opf_tensor x, y, dy, dx;
    memset(&y, 0, sizeof y), memset(&dy, 0, sizeof dy), memset(&dx, 0, sizeof dx);
    x = rand2(ctx, &s, ROWS, COLS, dt);
    if (!st) {
        randomize_seq(seq, &s);
        opf_seq_call call = opf_seq_call_default();
        stage = "step";
        st = opf_seq_forward(seq, &x, &call, &y, NULL);
        if (!st) dy = rand_like(ctx, &s, &y, dt), st = opf_seq_backward(seq, &dy, NULL, &dx, NULL);
    }
    double norm = 0, clipped = 0;
    if (!st) stage = "clip", st = opf_clip_grad_norm(ctx, &seq, 1, 1e30, &norm);
    if (!st) st = opf_clip_grad_norm(ctx, &seq, 1, 0.5 * norm, NULL);
    if (!st) st = opf_clip_grad_norm(ctx, &seq, 1, 1e30, &clipped);
    uint64_t h = 0xCBF29CE484222325ull;
    dg_bytes(&h, &norm, sizeof norm), dg_bytes(&h, &clipped, sizeof clipped);
    for (int i = 0; !st && i < opf_seq_len(seq); i++) dg_op_state(&h, opf_seq_at(seq, i));
    if (st) dg_skip(ctx, name, stage, st);
    else dg_done(name, h);
    opf_tensor_release(&x), opf_tensor_release(&y), opf_tensor_release(&dy), opf_tensor_release(&dx);
    opf_seq_destroy(seq);
}

static void run_nn_cases(opf_ctx *ctx)
{
    run_nn_op_cases(ctx);
    for (int d = 0; d < NDT; d++) run_clip_case(ctx, dtypes[d]);
}

/* ---- the golden file ------------------------------------------------------------- */

static const char golden_header[] =
    "# golden.txt: the digest of tests/digest/test_digest.c, one line per case:\n"
    "# \"name hash\" (FNV-1a 64 over the case's outputs, gradients and recipe state)\n"
    "# or \"name skipped: stage status\" (the library refused the combination).\n"
    "#\n"
    "# Written by running the test with OPF_DIGEST_WRITE=1. Regenerate it only for\n"
    "# an intended change of numerics, and say so in the commit. While kernels move\n"
    "# between files (into src/backend/cpu/ and behind the backend table) nobody may\n"
    "# regenerate it: such a move must keep every bit, and this file proves it.\n";

static const char core_tag[] = "# openblas core: ";

static const dg_case *find_case(const char *name)
{
    for (int i = 0; i < n_cases; i++)
        if (!strcmp(cases[i].name, name)) return &cases[i];
    return NULL;
}

/* A golden file's lines: the base file, then (on another OpenBLAS core) that
 * core's file, tests/digest/golden-CORE.txt, which lists only the cases
 * whose bits that core's GEMM kernels change. */
static dg_case golden[MAX_CASES];
static int n_golden;
static char golden_core[64];  /* the base file's core ("" when it names none) */

/* The golden file's directory ("." when its path names none). */
static void golden_dir(char *out, size_t n)
{
    const char *slash = strrchr(OPF_DIGEST_GOLDEN, '/');
    if (slash) snprintf(out, n, "%.*s", (int)(slash - OPF_DIGEST_GOLDEN), OPF_DIGEST_GOLDEN);
    else snprintf(out, n, ".");
}

static void core_file(const char *core, char *out, size_t n)
{
    char dir[512];
    golden_dir(dir, sizeof dir);
    snprintf(out, n, "%s/golden-%s.txt", dir, core);
}

static dg_case *find_golden(const char *name)
{
    for (int k = 0; k < n_golden; k++)
        if (!strcmp(golden[k].name, name)) return &golden[k];
    return NULL;
}

/* Reads path's "name hash" lines into golden[], replacing the lines of the
 * names it has; the core tag of a base file into golden_core. false when it
 * cannot be opened. */
static bool read_golden(const char *path, bool base)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char buf[512];
    while (fgets(buf, sizeof buf, f)) {
        buf[strcspn(buf, "\r\n")] = 0;
        if (base && !strncmp(buf, core_tag, strlen(core_tag)))
            snprintf(golden_core, sizeof golden_core, "%.63s", buf + strlen(core_tag));
        if (!buf[0] || buf[0] == '#') continue;
        char *sp = strchr(buf, ' ');
        if (!sp) continue;
        *sp = 0;
        dg_case *g = find_golden(buf);
        if (!g) {
            if (n_golden == MAX_CASES) break;
            g = &golden[n_golden++];
            snprintf(g->name, sizeof g->name, "%.95s", buf);
        }
        snprintf(g->line, sizeof g->line, "%.159s", sp + 1);
    }
    fclose(f);
    return true;
}

/* Whether some golden-CORE.txt next to the golden file lists the case:
 * one whose bits an OpenBLAS core's fp32 GEMM kernels change. */
static bool core_dependent(const char *name)
{
    char dir[1024];
    golden_dir(dir, sizeof dir);
    DIR *d = opendir(dir);
    bool found = false;
    for (struct dirent *e; d && !found && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (strncmp(e->d_name, "golden-", 7) || n < 4 || strcmp(e->d_name + n - 4, ".txt"))
            continue;
        char path[1400], buf[512];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r");
        while (f && !found && fgets(buf, sizeof buf, f)) {
            char *sp = strchr(buf, ' ');
            if (buf[0] != '#' && sp && (size_t)(sp - buf) == strlen(name) &&
                !strncmp(buf, name, (size_t)(sp - buf)))
                found = true;
        }
        if (f) fclose(f);
    }
    if (d) closedir(d);
    return found;
}

/* OPF_DIGEST_WRITE=1: on the base file's core (or with no base file) the
 * base file, every case; on another core that core's file, the cases whose
 * line differs from the base file's. */
static int write_golden(const char *core, bool other_core)
{
    char path[1024];
    if (other_core) core_file(core, path, sizeof path);
    else snprintf(path, sizeof path, "%s", OPF_DIGEST_GOLDEN);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "cannot write %s\n", path);
        return 1;
    }
    int n = 0;
    if (other_core) {
        fprintf(f, "# golden-%s.txt: the digest cases whose bits OpenBLAS's %s kernels change\n"
                   "# from golden.txt's (its fp32 GEMMs); written as golden.txt is, on a\n"
                   "# machine whose OpenBLAS picks core %s.\n", core, core, core);
        for (int i = 0; i < n_cases; i++) {
            const dg_case *g = find_golden(cases[i].name);
            if (g && !strcmp(g->line, cases[i].line)) continue;
            fprintf(f, "%s %s\n", cases[i].name, cases[i].line), n++;
        }
    } else {
        fputs(golden_header, f);
        fprintf(f, "%s%s\n", core_tag, core);
        for (int i = 0; i < n_cases; i++) fprintf(f, "%s %s\n", cases[i].name, cases[i].line), n++;
    }
    fclose(f);
    printf("wrote %d cases to %s\n", n, path);
    return 0;
}

/* Every golden line against the computed cases, then the cases the golden
 * files do not have; the number that differ, and in *firm those no
 * golden-CORE.txt lists. */
static int compare_golden(int *firm)
{
    int bad = 0;
    *firm = 0;
    bool *matched = calloc((size_t)n_cases + 1, sizeof(bool));
    for (int k = 0; k < n_golden; k++) {
        const dg_case *c = find_case(golden[k].name);
        if (!c) {
            printf("MISSING  %s (in the golden file, not computed)\n", golden[k].name), bad++,
                (*firm)++;
            continue;
        }
        matched[c - cases] = true;
        if (strcmp(c->line, golden[k].line)) {
            printf("MISMATCH %s: golden %s, now %s\n", golden[k].name, golden[k].line, c->line);
            bad++;
            *firm += !core_dependent(golden[k].name);
        }
    }
    for (int i = 0; i < n_cases; i++)
        if (!matched[i])
            printf("EXTRA    %s %s (computed, not in the golden file)\n", cases[i].name,
                   cases[i].line), bad++, (*firm)++;
    free(matched);
    printf("digest: %d cases computed, %d golden lines, %d differ\n", n_cases, n_golden, bad);
    return bad;
}

int main(int argc, char **argv)
{
    (void)argc;
    verbose = getenv("OPF_DIGEST_VERBOSE") && atoi(getenv("OPF_DIGEST_VERBOSE"));
    const char *w = getenv("OPF_DIGEST_WRITE");
    bool writing = w && atoi(w);
    bool have_base = read_golden(OPF_DIGEST_GOLDEN, true);
    CHECK(have_base || writing, "cannot read %s", OPF_DIGEST_GOLDEN);
    const char *core = openblas_get_corename();
    bool other_core = have_base && golden_core[0] && strcmp(golden_core, core);
    char path[1024];
    core_file(core, path, sizeof path);
    bool have_core = other_core && !writing && read_golden(path, false);
    if (have_core) printf("OpenBLAS core %s: golden.txt with %s\n", core, path);
#ifdef __linux__
    if (other_core && !have_core && !writing && !getenv("OPF_DIGEST_CORE_SET")) {
        printf("OpenBLAS picked core %s here, the golden file's is %s (and there is no %s): a "
               "child runs the test with OPENBLAS_CORETYPE=%s\n", core, golden_core, path,
               golden_core);
        fflush(stdout);
        setenv("OPENBLAS_CORETYPE", golden_core, 1);  /* read by the child's OpenBLAS only */
        setenv("OPF_DIGEST_CORE_SET", "1", 1);
        pid_t pid = fork();
        if (pid == 0) {
            struct rlimit none = {0, 0};  /* a child killed by SIGILL leaves no core file */
            setrlimit(RLIMIT_CORE, &none);
            execv("/proc/self/exe", argv);
            _exit(127);
        }
        int ws = 0;
        if (pid > 0 && waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) != 127)
            return WEXITSTATUS(ws);
        if (pid > 0 && WIFSIGNALED(ws))
            printf("the child died of signal %d (this CPU cannot run core %s's kernels)\n",
                   WTERMSIG(ws), golden_core);
        else printf("the child did not run (%s)\n", pid < 0 ? strerror(errno) : "exec failed");
        printf("comparing with core %s here\n", core);
    }
#endif
    (void)argv;
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 0x5EED;
    opf_ctx *ctx;
    if (opf_ctx_create(&o, &ctx)) return 1;
    run_op_cases(ctx);
    run_seq_cases(ctx);
    run_quant_cases(ctx);
    run_gemm_cases(ctx);
    run_nn_cases(ctx);
    opf_ctx_destroy(ctx);
    if (verbose)
        for (int i = 0; i < n_cases; i++) printf("%s %s\n", cases[i].name, cases[i].line);
    if (writing) return write_golden(core, other_core);
    int firm = 0, bad = compare_golden(&firm);
    if (bad > 0 && firm == 0 && other_core && !have_core) {
        printf("SKIP: %d cases differ, all of them ones an OpenBLAS core's fp32 GEMMs change; "
               "this OpenBLAS computes with core %s, the golden file's with %s, which it could "
               "not run here, and there is no %s (OPF_DIGEST_WRITE=1 writes it)\n", bad, core,
               golden_core, path);
        return 77;
    }
    CHECK(bad == 0, "%d digest cases differ from %s%s%s", bad, OPF_DIGEST_GOLDEN,
          have_core ? " and " : "", have_core ? path : "");
    TEST_DONE();
}
