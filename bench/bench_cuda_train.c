/* bench_cuda_train.c: `opfuse bench cuda-train`: training steps on the GPU
 * (CUDA-event medians of REPS after the warm-up of bench_cuda.h,
 * opf_bench_cuda_settle; random data, bf16):
 *   - Linear forward + backward (fprop, dgrad, wgrad) at S x S x S per
 *     recipe (timed alone, as its peer), and its ratio to the recipe's three
 *     GEMMs alone on operands quantized once (the floor the step
 *     approaches), the step and the GEMMs timed in turns for it; and, in
 *     turns too, against the plain bf16 GEMMs of the same step, which are
 *     the cuBLAS kernels PyTorch's nn.Linear step runs (Nsight Compute: the
 *     same kernel names and times), a ratio to nn.Linear's kernels that does
 *     not depend on the order of cases in two processes;
 *   - the LayerNorm-MLP step (layernorm, fc1 + bias, gelu, fc2 + bias;
 *     forward + backward with a given dy, no optimizer) at T tokens x
 *     hidden H (ffn 4H) per recipe, eager;
 *   - the same step at 256 x 1024, eager and compiled (replayed as CUDA
 *     graphs), bf16 and FP8 current scaling;
 *   - printed, not recorded: the compiled step's profile (device time per
 *     node group) at T x H in FP8 current scaling and at 256 x 1024 in bf16;
 *   - host time: the CPU wall time of the calls alone (the stream is idle
 *     before each timed call and the GPU work it queues runs after it), per
 *     eager op call (a step's calls over its plan entries) and per compiled
 *     step, with the graph launches a step makes; and per eager call of one
 *     op class (a seq of 32 on a tiny tensor, as `bench ops` on the CPU).
 * `--out FILE` also writes "name value" lines for
 * bench/peer/torch_cuda_train.py, which prints the comparison table.
 * `--only LIST` runs only the sections named in LIST (any of linear, lnmlp,
 * small, host); OPF_BENCH_RECIPES=LIST (of bf16, fp8_current, fp8_delayed,
 * fp8_block, mxfp8, nvfp4) only those recipes in linear and lnmlp.
 * OPF_CUDA_SIDE=auto (or 1) puts the Linears' wgrad on the side queue
 * (cuda.h; off by default), for the before / after of it.
 *
 *     opfuse bench cuda-train [--out FILE] [--only LIST] [S [T H]]   default 8192 8192 4096 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "opfuse.h"

#ifndef OPF_HAVE_CUDA
int opf_bench_cuda_train(int argc, char **argv)
{
    (void)argc, (void)argv;
    printf("bench cuda-train: skipped, built without CUDA\n");
    return 0;
}
#else
#include "bench_cuda.h"
#include "compile/compile-impl.h"

enum { WARMUP = 3, REPS = 15, HOST_REPS = 50 };

static FILE *results;

static void record(const char *name, const char *unit, double v, const char *note)
{
    printf("  %-34s %10.3f %-4s %s\n", name, v, unit, note ? note : "");
    if (results) fprintf(results, "%s %.6g\n", name, v);
}

/* What a timed step runs: fn(arg) queues one step's work on ctx's stream. */
typedef opf_status (*step_fn)(void *arg);
typedef struct timed { opf_ctx *ctx; step_fn fn; void *arg; } timed;

/* Event-timed runs of t, n of them, into v[0..n) (ms). */
static opf_status time_runs(const timed *t, int n, double *v)
{
    opf_cuda_timer *tm = NULL;
    opf_status st = opf_cuda_timer_create(t->ctx, 2 * n, &tm);
    for (int i = 0; i < n && !st; i++)
        if (!(st = opf_cuda_timer_mark(t->ctx, tm, 2 * i)) && !(st = t->fn(t->arg)))
            st = opf_cuda_timer_mark(t->ctx, tm, 2 * i + 1);
    for (int i = 0; i < n && !st; i++) {
        float f = 0;
        st = opf_cuda_timer_ms(tm, 2 * i, 2 * i + 1, &f);
        v[i] = f;
    }
    opf_cuda_timer_destroy(tm);
    return st;
}

/* Median milliseconds of a step between two events, after the warm-up
 * (opf_bench_cuda_settle). */
static opf_status time_ms(const timed *t, double *ms)
{
    double v[REPS];
    opf_status st = opf_bench_cuda_settle(t->ctx, t->fn, t->arg, WARMUP);
    if (!st) st = time_runs(t, REPS, v);
    if (!st) *ms = opf_bench_median(v, REPS);
    return st;
}

/* a then b (timed *[2]): the warm-up of time_pair_ms. */
static opf_status run_both(void *ab)
{
    const timed *const *p = (const timed *const *)ab;
    opf_status st = p[0]->fn(p[0]->arg);
    return st ? st : p[1]->fn(p[1]->arg);
}

/* Medians of a and b timed in turns, ROUNDS rounds of REPS / ROUNDS runs
 * each after the warm-up of both, so that both see the same clocks and heat (a
 * GPU at full FP8 load throttles over seconds; timed one after the other,
 * the ratio of two such loops moved by a sixth between runs). All runs are
 * queued before the first time is read: none starts on an idle GPU. */
static opf_status time_pair_ms(const timed *a, const timed *b, double *ms_a, double *ms_b)
{
    enum { ROUNDS = 5, PER = REPS / ROUNDS, RUNS = 2 * ROUNDS * PER };
    double va[ROUNDS * PER], vb[ROUNDS * PER];
    opf_cuda_timer *tm = NULL;
    opf_status st = opf_cuda_timer_create(a->ctx, 2 * RUNS, &tm);
    const timed *ab[2] = {a, b};
    if (!st) st = opf_bench_cuda_settle(a->ctx, run_both, ab, WARMUP);
    for (int i = 0; i < RUNS && !st; i++) {  /* run i: a or b by its half of the round */
        const timed *t = i / PER % 2 ? b : a;
        if (!(st = opf_cuda_timer_mark(t->ctx, tm, 2 * i)) && !(st = t->fn(t->arg)))
            st = opf_cuda_timer_mark(t->ctx, tm, 2 * i + 1);
    }
    for (int i = 0; i < RUNS && !st; i++) {
        float f = 0;
        st = opf_cuda_timer_ms(tm, 2 * i, 2 * i + 1, &f);
        int round = i / (2 * PER), k = i % PER;
        (i / PER % 2 ? vb : va)[round * PER + k] = f;
    }
    opf_cuda_timer_destroy(tm);
    if (!st) *ms_a = opf_bench_median(va, ROUNDS * PER), *ms_b = opf_bench_median(vb, ROUNDS * PER);
    return st;
}

/* Median microseconds of the host calls of a step, the device idle before
 * each (the GPU work queued runs after the clock stops). */
static opf_status host_us(const timed *t, double *us)
{
    double v[HOST_REPS];
    opf_status st = OPF_OK;
    for (int i = 0; i < HOST_REPS && !st; i++) {
        if ((st = opf_cuda_sync(t->ctx))) break;
        double t0 = opf_bench_now();
        st = t->fn(t->arg);
        v[i] = (opf_bench_now() - t0) * 1e6;
    }
    if (!st) st = opf_cuda_sync(t->ctx);
    if (!st) *us = opf_bench_median(v, HOST_REPS);
    return st;
}

static opf_status ln_mlp(opf_ctx *ctx, int64_t h, opf_seq **out)
{
    opf_seq *seq = NULL;
    opf_op *ln = NULL, *act = NULL;
    opf_layernorm_config lc = {.hidden = h, .eps = 1e-5, .dtype = OPF_BF16};
    opf_status st = opf_seq_create(ctx, &seq);
    if (!st) st = opf_op_create(ctx, "layernorm", &lc, "ln", &ln);
    if (!st) st = opf_seq_append(seq, ln);
    if (!st) st = opf_seq_append_linear(seq, h, 4 * h, true, OPF_BF16, "fc1");
    if (!st) st = opf_op_create(ctx, "gelu", NULL, "gelu", &act);
    if (!st) st = opf_seq_append(seq, act);
    if (!st) st = opf_seq_append_linear(seq, 4 * h, h, true, OPF_BF16, "fc2");
    *out = seq;
    return st;
}

/* ---- one training step, eager or compiled ------------------------------------------ */

typedef struct train {
    opf_seq     *seq;
    opf_graph   *g;             /* NULL: eager */
    opf_seq_call call;
    opf_recipe   recipe;
    opf_tensor   x, dy;
} train;

static opf_status train_step(void *arg)
{
    train *t = arg;
    opf_tensor y, dx;
    for (int i = 0; i < opf_seq_len(t->seq); i++)  /* zero_grad: each step's grads start fresh */
        for (int k = 0; k < opf_op_num_params(opf_seq_at(t->seq, i)); k++)
            opf_op_param(opf_seq_at(t->seq, i), k)->has_grad = false;
    opf_status st = t->g ? opf_graph_forward(t->g, &t->x, &t->call, &y, NULL)
                         : opf_seq_forward(t->seq, &t->x, &t->call, &y, NULL);
    if (st) return st;
    st = t->g ? opf_graph_backward(t->g, &t->dy, NULL, &dx, NULL)
              : opf_seq_backward(t->seq, &t->dy, NULL, &dx, NULL);
    opf_tensor_release(&y);
    if (!st) opf_tensor_release(&dx);
    return st;
}

static opf_status train_open(opf_ctx *ctx, opf_seq *seq, opf_recipe_kind kind, int64_t rows,
                             int64_t h, train *t)
{
    memset(t, 0, sizeof *t);
    t->seq = seq;
    t->recipe = opf_recipe_default(kind);
    t->call = opf_seq_call_default();
    t->call.recipe = kind == OPF_RECIPE_NONE ? NULL : &t->recipe;
    opf_status st = opf_bench_cuda_random(ctx, rows, h, OPF_BF16, 1.0f, &t->x);
    return st ? st : opf_bench_cuda_random(ctx, rows, h, OPF_BF16, 0.01f, &t->dy);
}

static void train_close(train *t)
{
    opf_graph_destroy(t->g);
    opf_tensor_release(&t->x), opf_tensor_release(&t->dy);
}

/* ---- Linear: the step and its three GEMMs --------------------------------------------- */

typedef struct gemms {
    opf_ctx   *ctx;
    opf_tensor w, x, dy;        /* operands, quantized by the recipe (rowwise + columnwise) */
    opf_tensor y, dx, dw;
} gemms;

static opf_status run_gemms(void *arg)
{
    gemms *a = arg;
    opf_gemm_options o = opf_gemm_options_default();
    opf_status st = opf_gemm(a->ctx, &a->w, &a->x, OPF_GEMM_TN, &o, &a->y);
    if (!st) st = opf_gemm(a->ctx, &a->w, &a->dy, OPF_GEMM_NN, &o, &a->dx);
    return st ? st : opf_gemm(a->ctx, &a->x, &a->dy, OPF_GEMM_NT, &o, &a->dw);
}

/* in quantized by role's quantizer of recipe state rs (both usages); plain when rs is NULL. */
static opf_status operand(opf_ctx *ctx, opf_recipe_state *rs, opf_tensor_role role,
                          const opf_tensor *in, opf_tensor *out)
{
    opf_quantizer q;
    if (!rs) return opf_tensor_to(ctx, in, OPF_DEVICE_CUDA, out);
    opf_status st = opf_recipe_state_quantizer(rs, role, 0, &q);
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    return st ? st : opf_quantize_alloc(ctx, &q, in, out);
}

/* The three GEMMs of the Linear op of seq on t's x and dy and the op's
 * weight: quantized by the op's recipe (both usages), or, plain, the bf16
 * GEMMs of PyTorch's nn.Linear step (the same cuBLAS kernels, by ncu). */
static opf_status gemms_open(opf_ctx *ctx, opf_seq *seq, const train *t, int64_t S, bool plain,
                             gemms *a)
{
    memset(a, 0, sizeof *a);
    a->ctx = ctx;
    opf_op *op = opf_seq_at(seq, 0);
    opf_recipe_state *rs = plain ? NULL : opf_op_recipe_state(op);
    opf_spec ps = opf_spec_make(2, (int64_t[]){S, S}, OPF_BF16);
    ps.device = OPF_DEVICE_CUDA;
    opf_status st = operand(ctx, rs, OPF_ROLE_WEIGHT, &opf_op_param(op, 0)->value, &a->w);
    if (!st) st = operand(ctx, rs, OPF_ROLE_INPUT, &t->x, &a->x);
    if (!st) st = operand(ctx, rs, OPF_ROLE_GRAD_OUTPUT, &t->dy, &a->dy);
    if (!st) st = opf_tensor_alloc(ctx, &ps, &a->y);
    if (!st) st = opf_tensor_alloc(ctx, &ps, &a->dx);
    if (!st) st = opf_tensor_alloc(ctx, &ps, &a->dw);
    return st;
}

static void gemms_close(gemms *a)
{
    opf_tensor *all[] = {&a->w, &a->x, &a->dy, &a->y, &a->dx, &a->dw};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) opf_tensor_release(all[i]);
}

/* The step t and three GEMMs, timed in turns: *ms the step, *gms the GEMMs,
 * the recipe's own (plain false) or the plain bf16 ones (true). */
static opf_status step_and_gemms_ms(opf_ctx *ctx, opf_seq *seq, train *t, int64_t S, bool plain,
                                    double *ms, double *gms)
{
    gemms a;
    opf_status st = gemms_open(ctx, seq, t, S, plain, &a);
    if (!st) st = time_pair_ms(&(timed){ctx, train_step, t}, &(timed){ctx, run_gemms, &a}, ms, gms);
    gemms_close(&a);
    return st;
}

typedef struct rcase { opf_recipe_kind kind; const char *name; } rcase;
static const rcase recipes[] = {
    {OPF_RECIPE_NONE, "bf16"},       {OPF_RECIPE_CURRENT, "fp8_current"},
    {OPF_RECIPE_DELAYED, "fp8_delayed"}, {OPF_RECIPE_BLOCK, "fp8_block"},
    {OPF_RECIPE_MXFP8, "mxfp8"},     {OPF_RECIPE_NVFP4, "nvfp4"},
};
enum { N_RECIPES = sizeof recipes / sizeof recipes[0] };

/* The recipes OPF_BENCH_RECIPES (a comma list of the names above) names,
 * a bit each by index in recipes[]; unset or empty, all. A name that is no
 * recipe's is said (a typo would otherwise run nothing in silence). */
static unsigned wanted;

static unsigned recipes_wanted(void)
{
    const char *list = getenv("OPF_BENCH_RECIPES");
    if (!list || !*list) return (1u << N_RECIPES) - 1;
    unsigned set = 0;
    for (const char *p = list; *p;) {
        size_t n = strcspn(p, ",");
        int r = 0;
        while (r < N_RECIPES && !(strlen(recipes[r].name) == n && !strncmp(p, recipes[r].name, n)))
            r++;
        if (r < N_RECIPES) set |= 1u << r;
        else printf("OPF_BENCH_RECIPES: '%.*s' is no recipe here (skipped)\n", (int)n, p);
        p += n + (p[n] == ',');
    }
    return set;
}

static void failed(opf_ctx *ctx, const char *what)
{
    printf("  %-34s failed: %s\n", what, opf_last_error(ctx));
    opf_clear_error(ctx);
}

static void bench_linear(opf_ctx *ctx, int64_t S)
{
    printf("Linear forward + backward, %lld^3, bf16 in and out (ms)\n", (long long)S);
    for (int r = 0; r < N_RECIPES; r++) {
        char name[64];
        opf_seq *seq = NULL;
        train t = {0};
        double ms = 0, tms = 0, gms = 0;
        if (!(wanted >> r & 1)) continue;
        opf_status st = opf_seq_create(ctx, &seq);
        if (!st) st = opf_seq_append_linear(seq, S, S, false, OPF_BF16, "fc");
        if (!st) st = train_open(ctx, seq, recipes[r].kind, S, S, &t);
        if (!st) st = time_ms(&(timed){ctx, train_step, &t}, &ms);  /* alone, as the peer's */
        snprintf(name, sizeof name, "linear_%s_ms", recipes[r].name);
        if (st) failed(ctx, name);
        else record(name, "ms", ms, NULL);
        if (!st) st = step_and_gemms_ms(ctx, seq, &t, S, false, &tms, &gms);
        snprintf(name, sizeof name, "linear_%s_turns_ms", recipes[r].name);
        if (!st) record(name, "ms", tms, "the step, timed in turns with its GEMMs");
        snprintf(name, sizeof name, "linear_%s_gemms_ms", recipes[r].name);
        char note[80];
        snprintf(note, sizeof note, "step / GEMMs %.2f (in turns)", gms > 0 ? tms / gms : 0.0);
        if (st) failed(ctx, name);
        else record(name, "ms", gms, note);
        /* against nn.Linear's kernels in this process: a ratio that does not
         * depend on what ran before the peer's loop in its own process */
        if (!st && recipes[r].kind != OPF_RECIPE_NONE) {
            st = step_and_gemms_ms(ctx, seq, &t, S, true, &tms, &gms);
            snprintf(name, sizeof name, "linear_%s_vs_bf16_ms", recipes[r].name);
            if (!st) record(name, "ms", tms, "the step, timed in turns with the bf16 GEMMs");
            snprintf(name, sizeof name, "linear_%s_bf16_gemms_ms", recipes[r].name);
            snprintf(note, sizeof note, "the 3 bf16 GEMMs (nn.Linear's kernels): step %.2fx faster",
                     tms > 0 ? gms / tms : 0.0);
            if (st) failed(ctx, name);
            else record(name, "ms", gms, note);
        }
        train_close(&t);
        opf_seq_destroy(seq);
    }
}

static void bench_lnmlp(opf_ctx *ctx, int64_t T, int64_t H)
{
    printf("LayerNorm-MLP step (forward + backward), %lld tokens x hidden %lld, eager (ms)\n",
           (long long)T, (long long)H);
    for (int r = 0; r < N_RECIPES; r++) {
        char name[64];
        if (!(wanted >> r & 1)) continue;
        snprintf(name, sizeof name, "lnmlp_%s_ms", recipes[r].name);
        opf_seq *seq = NULL;
        train t = {0};
        double ms = 0;
        opf_status st = ln_mlp(ctx, H, &seq);
        if (!st) st = train_open(ctx, seq, recipes[r].kind, T, H, &t);
        if (!st) st = time_ms(&(timed){ctx, train_step, &t}, &ms);
        if (st) failed(ctx, name);
        else record(name, "ms", ms, NULL);
        train_close(&t);
        opf_seq_destroy(seq);
    }
}

/* Where a step's time goes: the step compiled (walked with a
 * synchronization around each node) in recipe kind, the node groups'
 * device time. Printed, not recorded: a profile, not a number. */
static void profile_lnmlp(opf_ctx *ctx, opf_recipe_kind kind, const char *recipe, int64_t T,
                          int64_t H)
{
    enum { STEPS = 5 };
    opf_seq *seq = NULL;
    train t = {0};
    opf_status st = ln_mlp(ctx, H, &seq);
    if (!st) st = train_open(ctx, seq, kind, T, H, &t);
    if (!st) st = opf_compile(seq, &t.x.spec, &t.call, NULL, &t.g);
    for (int i = 0; i < 2 && !st; i++) st = train_step(&t);
    if (!st) opf_graph_set_profile(t.g, true);
    for (int i = 0; i < STEPS && !st; i++) st = train_step(&t);
    printf("LayerNorm-MLP step, %lld tokens x hidden %lld, %s, compiled: profile\n",
           (long long)T, (long long)H, recipe);
    if (!st) st = opf_graph_dump_profile(t.g, STEPS, stdout);
    if (st) failed(ctx, "lnmlp profile");
    train_close(&t);
    opf_seq_destroy(seq);
}

/* The small step eager and compiled: device time and host time of each. */
static opf_status small_case(opf_ctx *ctx, const rcase *rc, int64_t T, int64_t H)
{
    opf_seq *seq = NULL;
    train t = {0};
    char name[64], note[96];
    double eager_ms, graph_ms, eager_us, graph_us;
    opf_status st = ln_mlp(ctx, H, &seq);
    if (!st) st = train_open(ctx, seq, rc->kind, T, H, &t);
    if (!st) st = time_ms(&(timed){ctx, train_step, &t}, &eager_ms);
    if (!st) st = host_us(&(timed){ctx, train_step, &t}, &eager_us);
    if (!st) st = opf_compile(seq, &t.x.spec, &t.call, NULL, &t.g);
    if (!st) st = time_ms(&(timed){ctx, train_step, &t}, &graph_ms);
    if (!st) st = host_us(&(timed){ctx, train_step, &t}, &graph_us);
    if (!st) {
        opf_graph_stats gs;
        opf_graph_get_stats(t.g, &gs);
        int calls = gs.n_forward + gs.n_backward;
        snprintf(name, sizeof name, "small_%s_eager_ms", rc->name);
        record(name, "ms", eager_ms, NULL);
        snprintf(name, sizeof name, "small_%s_graph_ms", rc->name);
        snprintf(note, sizeof note, "%d + %d graph launches per step", t.g->launches[0], t.g->launches[1]);
        record(name, "ms", graph_ms, note);
        snprintf(name, sizeof name, "host_%s_eager_step_us", rc->name);
        record(name, "us", eager_us, NULL);
        snprintf(name, sizeof name, "host_%s_eager_op_us", rc->name);
        snprintf(note, sizeof note, "over %d op calls (plan entries) per step", calls);
        record(name, "us", eager_us / calls, note);
        snprintf(name, sizeof name, "host_%s_graph_step_us", rc->name);
        record(name, "us", graph_us, NULL);
    }
    train_close(&t);
    opf_seq_destroy(seq);
    return st;
}

/* Host time per eager op call on the GPU: bench ops' seq of 32 ops of one
 * class on a tiny [16, 64] f32 device tensor, forward and forward + backward
 * (the GPU synchronized, untimed, before each call): what an op call costs
 * the CPU (its checks, plan, allocation and kernel launches), apart from a
 * step's optimizer and loss. */
static void bench_op_host(opf_ctx *ctx)
{
    enum { ROWS = 16, COLS = 64 };
    printf("host time per eager op call, a seq of 32 ops on a [%d, %d] f32 device tensor\n", ROWS,
           COLS);
    float xs[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; i++) xs[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
    opf_tensor hx, x;
    opf_spec sp = opf_spec_make(2, (int64_t[]){ROWS, COLS}, OPF_F32);
    if (opf_tensor_wrap(&sp, xs, &hx) || opf_tensor_to(ctx, &hx, OPF_DEVICE_CUDA, &x)) {
        failed(ctx, "host per op: the input");
        return;
    }
    opf_bias_config bc = {COLS, OPF_F32};
    opf_norm_config ln = {COLS, 1e-5, false, OPF_F32};
    static const char *const ops[] = {"identity", "bias", "gelu", "layernorm"};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        const void *cfg = !strcmp(ops[i], "bias") ? (const void *)&bc
                        : !strcmp(ops[i], "layernorm") ? (const void *)&ln : NULL;
        for (int bwd = 0; bwd < 2; bwd++) {
            char name[64];
            double us = opf_bench_host_us_per_op(ctx, ops[i], cfg, 32, bwd, &x);
            snprintf(name, sizeof name, "host_op_%s_%s_us", ops[i], bwd ? "fwdbwd" : "fwd");
            if (us < 0) failed(ctx, name);
            else record(name, "us", us, NULL);
        }
    }
    opf_tensor_release(&x);
}

static void bench_small(opf_ctx *ctx)
{
    const int64_t T = 256, H = 1024;
    printf("LayerNorm-MLP step, %lld tokens x hidden %lld: eager vs compiled with CUDA graphs\n",
           (long long)T, (long long)H);
    static const rcase cases[] = {{OPF_RECIPE_NONE, "bf16"}, {OPF_RECIPE_CURRENT, "fp8_current"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (small_case(ctx, &cases[i], T, H)) failed(ctx, cases[i].name);
    profile_lnmlp(ctx, OPF_RECIPE_NONE, "bf16", T, H);
}

int opf_bench_cuda_train(int argc, char **argv)
{
    const char *out_path;
    opf_ctx *ctx;
    int64_t d[3] = {8192, 8192, 4096};  /* the Linear's S, the LayerNorm-MLP's tokens and hidden */
    const char *only;
    int rc = opf_bench_cuda_open("cuda-train", argc, argv, &out_path, &only, d, 3, &ctx);
    if (!ctx) return rc;
    int64_t S = d[0], T = d[1], H = d[2];
    results = out_path ? fopen(out_path, "w") : NULL;
    wanted = recipes_wanted();
    if (!only || strstr(only, "linear")) bench_linear(ctx, S);
    if (!only || strstr(only, "lnmlp")) {
        bench_lnmlp(ctx, T, H);
        profile_lnmlp(ctx, OPF_RECIPE_CURRENT, "FP8 current", T, H);
    }
    if (!only || strstr(only, "small")) bench_small(ctx);
    if (!only || strstr(only, "host")) bench_op_host(ctx);
    if (results) fclose(results);
    results = NULL;
    opf_ctx_destroy(ctx);
    return 0;
}
#endif
