/* test_cuda_compile.c: compiled graphs on the GPU, replayed as CUDA graphs,
 * against the eager fuser on the GPU, bit for bit: forward outputs, dx,
 * every parameter gradient and the delayed-scaling state, step after step
 * with SGD updates between them.
 *
 * Models: the LayerNorm-MLP (layernorm, fc1 + bias, gelu, fc2 + bias) and a
 * stack of three bias-free Linears, bf16, under no recipe, FP8 delayed, FP8
 * current and MXFP8. Two pairs of contexts of one seed run the same model:
 * one eager, one through a graph compiled with max_leading, so that two
 * leading sizes (two size buckets) alternate. Each bucket's first call walks
 * the nodes, its second captures, the rest replay: on those the graph makes
 * one launch per segment, walks no node, and the device allocator counts no
 * allocation over the forward and backward. The eager context queues every
 * GEMM on its stream (OPF_CUDA_SIDE=0); the compiled one runs the Linears'
 * wgrad on the side queue beside dgrad (OPF_CUDA_SIDE=auto: GEMMs this small), so
 * the comparison also holds the side queue, in a capture, to the same bits. The Linear stack also runs the
 * is_first_microbatch schedule (cache the quantized weights, then reuse them
 * while the gradients accumulate): other variants of the same graph.
 *
 * Every mismatch is printed (the first differing byte of each component)
 * and the run goes on, so one GPU run shows every failing case. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "compile/compile-impl.h"
#include "cuda_test.h"

enum { HID = 256, FFN = 512, ROWS_MAX = 128, ROWS_SMALL = 64, STEPS = 8, WARM = 4 };

typedef opf_seq *(*build_fn)(opf_ctx *ctx, opf_dtype dt);

static void append(opf_ctx *ctx, opf_seq *seq, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    if (op) CHECK_OK(ctx, opf_seq_append(seq, op));
}

static opf_seq *ln_mlp(opf_ctx *ctx, opf_dtype dt)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_layernorm_config ln = {.hidden = HID, .eps = 1e-5, .dtype = dt};
    append(ctx, seq, "layernorm", &ln, "ln");
    CHECK_OK(ctx, opf_seq_append_linear(seq, HID, FFN, true, dt, "fc1"));
    append(ctx, seq, "gelu", NULL, "gelu");
    CHECK_OK(ctx, opf_seq_append_linear(seq, FFN, HID, true, dt, "fc2"));
    return seq;
}

static opf_seq *linear_stack(opf_ctx *ctx, opf_dtype dt)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, HID, FFN, false, dt, "l1"));
    CHECK_OK(ctx, opf_seq_append_linear(seq, FFN, FFN, false, dt, "l2"));
    CHECK_OK(ctx, opf_seq_append_linear(seq, FFN, HID, false, dt, "l3"));
    return seq;
}

/* ---- tensors on the device ------------------------------------------------------ */

static uint64_t rng = 0x5EED5EEDull;

static float rand_unit(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)(int32_t)(rng >> 32) * 0x1p-31f;
}

/* The same random host values, uploaded to each context. */
static void rand_pair(opf_ctx *ca, opf_ctx *cb, int64_t rows, int64_t cols, float scale,
                      opf_tensor *a, opf_tensor *b)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){rows, cols}, OPF_BF16);
    float *v = malloc(sizeof *v * (size_t)(rows * cols));
    for (int64_t i = 0; i < rows * cols; i++) v[i] = scale * rand_unit();
    opf_tensor h;
    memset(a, 0, sizeof *a), memset(b, 0, sizeof *b);
    CHECK_OK(ca, cuda_test_host_tensor(ca, &s, v, &h));
    CHECK_OK(ca, cuda_test_upload(ca, &h, a));
    CHECK_OK(cb, cuda_test_upload(cb, &h, b));
    opf_tensor_release(&h);
    free(v);
}

static bool present(const opf_tensor *t) { return t->data[0] || t->data[OPF_COMP_COL_DATA]; }

/* Prints the first differing byte of each component of host tensors a, b. */
static void print_diff(const char *tag, const char *what, const opf_tensor *a, const opf_tensor *b)
{
    opf_layout L;
    if (opf_spec_layout(&a->spec, &L)) return;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (!L.comp[c].present || !a->data[c] || !b->data[c]) continue;
        const unsigned char *x = a->data[c], *y = b->data[c];
        size_t n = 0, first = 0;
        for (size_t i = 0; i < L.comp[c].nbytes; i++)
            if (x[i] != y[i] && !n++) first = i;
        if (n)
            fprintf(stderr, "  %s: %s component %d: %zu of %zu bytes differ, first at %zu: eager "
                    "0x%02x, compiled 0x%02x\n", tag, what, c, n, L.comp[c].nbytes, first, x[first],
                    y[first]);
    }
}

/* a (eager, on ca) and b (compiled, on cb): same presence, spec and bytes. */
static void same(const char *tag, const char *what, opf_ctx *ca, const opf_tensor *a, opf_ctx *cb,
                 const opf_tensor *b)
{
    if (!present(a) && !present(b)) return;
    if (present(a) != present(b) || !opf_spec_equal(&a->spec, &b->spec)) {
        char sa[160] = "-", sb[160] = "-";
        if (present(a)) opf_spec_str(&a->spec, sa, sizeof sa);
        if (present(b)) opf_spec_str(&b->spec, sb, sizeof sb);
        CHECK(0, "%s: %s is %s eagerly, %s compiled", tag, what, sa, sb);
        return;
    }
    opf_tensor ha, hb;
    memset(&ha, 0, sizeof ha), memset(&hb, 0, sizeof hb);
    opf_status sa = opf_tensor_to(ca, a, OPF_DEVICE_CPU, &ha), sb = opf_tensor_to(cb, b, OPF_DEVICE_CPU, &hb);
    CHECK(!sa && !sb, "%s: %s: download: %s / %s", tag, what, opf_last_error(ca), opf_last_error(cb));
    if (!sa && !sb) {
        bool eq = opf_test_same_bytes(&ha, &hb);
        CHECK(eq, "%s: %s differs from eager", tag, what);
        if (!eq) print_diff(tag, what, &ha, &hb);
    }
    opf_tensor_release(&ha), opf_tensor_release(&hb);
}

/* ---- parameters -------------------------------------------------------------------- */

/* Parameters live on the context's device from their creation; 1-D ones
 * (biases, norm weights) get the same random values on both sides, so they
 * are not trivial. */
static void params_to_device(opf_ctx *ctx, opf_seq *seq, uint64_t seed)
{
    uint64_t keep = rng;
    rng = seed;
    for (int i = 0; i < opf_seq_len(seq); i++)
        for (int k = 0; k < opf_op_num_params(opf_seq_at(seq, i)); k++) {
            opf_param *p = opf_op_param(opf_seq_at(seq, i), k);
            CHECK(p->value.spec.device == OPF_DEVICE_CUDA, "parameter %s on the device", p->name);
            if (p->value.spec.ndim == 1) {
                int64_t n = opf_spec_numel(&p->value.spec);
                float *v = malloc(sizeof *v * (size_t)n);
                opf_tensor h;
                for (int64_t j = 0; j < n; j++) v[j] = 0.5f * rand_unit();
                CHECK_OK(ctx, opf_tensor_to(ctx, &p->value, OPF_DEVICE_CPU, &h));
                CHECK_OK(ctx, opf_convert(v, OPF_F32, h.data[0], h.spec.dtype, (size_t)n));
                CHECK_OK(ctx, opf_tensor_copy(ctx, &h, &p->value));
                opf_tensor_release(&h);
                free(v);
            }
            p->has_grad = false;
        }
    rng = keep;
}

/* The n-th parameter of seq in op order and its op's name, or NULL past the last. */
static opf_param *nth_param(opf_seq *seq, int n, const char **op_name)
{
    for (int i = 0; i < opf_seq_len(seq); i++) {
        opf_op *op = opf_seq_at(seq, i);
        if (n < opf_op_num_params(op)) {
            *op_name = opf_op_name(op);
            return opf_op_param(op, n);
        }
        n -= opf_op_num_params(op);
    }
    return NULL;
}

/* What zero_grad means to a step: the next accumulation starts fresh. */
static void fresh_grads(opf_seq *seq)
{
    const char *op;
    for (int n = 0; nth_param(seq, n, &op); n++) nth_param(seq, n, &op)->has_grad = false;
}

static void compare_grads(const char *tag, opf_ctx *ca, opf_seq *a, opf_ctx *cb, opf_seq *b)
{
    const char *op;
    for (int n = 0; nth_param(a, n, &op); n++) {
        const opf_param *pa = nth_param(a, n, &op), *pb = nth_param(b, n, &op);
        char what[96];
        snprintf(what, sizeof what, "grad of %s.%s", op, pa->name);
        CHECK(pa->has_grad == pb->has_grad, "%s: %s: has_grad %d eager, %d compiled", tag, what,
              pa->has_grad, pb->has_grad);
        if (pa->has_grad) same(tag, what, ca, &pa->grad, cb, &pb->grad);
    }
}

/* Delayed-scaling scales and amax histories of every op, read to the host
 * (the arrays live on the device). */
static void compare_delayed(const char *tag, opf_seq *a, opf_seq *b)
{
    for (int i = 0; i < opf_seq_len(a); i++) {
        opf_recipe_state *ra = opf_op_recipe_state(opf_seq_at(a, i)), *rb = opf_op_recipe_state(opf_seq_at(b, i));
        if (!ra || !rb) continue;
        for (int bwd = 0; bwd < 2; bwd++) {
            opf_delayed_state *da = opf_recipe_state_delayed(ra, bwd), *db = opf_recipe_state_delayed(rb, bwd);
            if (!da || !db) continue;
            size_t n = (size_t)opf_delayed_state_slots(da) * (size_t)(1 + opf_delayed_state_history_len(da));
            float *va = calloc(n, sizeof *va), *vb = calloc(n, sizeof *vb);
            size_t ns = (size_t)opf_delayed_state_slots(da);
            CHECK_OK(NULL, opf_delayed_state_read(NULL, da, va, va + ns));
            CHECK_OK(NULL, opf_delayed_state_read(NULL, db, vb, vb + ns));
            CHECK(memcmp(va, vb, n * sizeof *va) == 0, "%s: %s's %s delayed-scaling state differs",
                  tag, opf_op_name(opf_seq_at(a, i)), bwd ? "backward" : "forward");
            free(va), free(vb);
        }
    }
}

/* ---- one case --------------------------------------------------------------------- */

typedef struct side {
    opf_ctx   *ctx;
    opf_seq   *seq;
    opf_optim *opt;
} side;

static bool side_open(side *s, build_fn build)
{
    memset(s, 0, sizeof *s);
    opf_ctx_options o = opf_ctx_options_default();
    o.device = OPF_DEVICE_CUDA;
    o.seed = 1234;
    CHECK_OK(NULL, opf_ctx_create(&o, &s->ctx));
    if (!s->ctx) return false;
    s->seq = build(s->ctx, OPF_BF16);
    if (!s->seq) return false;
    params_to_device(s->ctx, s->seq, 77);
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = 0.01f;
    CHECK_OK(s->ctx, opf_optim_create(s->ctx, s->seq, OPF_OPTIM_SGD, &oo, &s->opt));
    return s->opt != NULL;
}

static void side_close(side *s)
{
    opf_optim_destroy(s->opt);
    opf_seq_destroy(s->seq);
    opf_ctx_destroy(s->ctx);
}

/* Segments of one direction that replay as captured graphs. */
static int captured_segments(const opf_graph *g, bool backward)
{
    int n = 0;
    for (int i = backward ? g->n_fwd_segs : 0; i < (backward ? g->n_segs : g->n_fwd_segs); i++)
        n += !g->segs[i].eager && !g->segs[i].refused;
    return n;
}

/* Step s of a schedule: its rows, its is_first_microbatch (-1: no kwargs),
 * and whether grads start fresh / the optimizer steps after it. */
typedef struct step_plan { int64_t rows; int first_mb; bool fresh, update; } step_plan;

static step_plan plan_of(bool microbatch, int s)
{
    if (microbatch) return (step_plan){ROWS_MAX, s % 2 == 0, s % 2 == 0, s % 2 == 1};
    return (step_plan){s % 2 ? ROWS_SMALL : ROWS_MAX, -1, true, true};
}

/* One step on both sides; false when a call failed (the case stops). */
static bool step_both(const char *tag, side *a, side *b, opf_graph *g, const opf_seq_call *call,
                      const step_plan *sp, bool replayed)
{
    opf_tensor xa, xb, dya, dyb, ya = {0}, yb = {0}, dxa = {0}, dxb = {0};
    rand_pair(a->ctx, b->ctx, sp->rows, HID, 1.0f, &xa, &xb);
    rand_pair(a->ctx, b->ctx, sp->rows, HID, 0.5f, &dya, &dyb);
    if (sp->fresh) fresh_grads(a->seq), fresh_grads(b->seq);
    opf_status st = opf_seq_forward(a->seq, &xa, call, &ya, NULL);
    CHECK(!st, "%s: eager forward: %s", tag, opf_last_error(a->ctx));
    if (!st) st = opf_seq_backward(a->seq, &dya, NULL, &dxa, NULL);
    CHECK(!st, "%s: eager backward: %s", tag, opf_last_error(a->ctx));
    opf_alloc_stats s0, s1;
    opf_cuda_sync(b->ctx);
    opf_cuda_alloc_stats(b->ctx, &s0);
    opf_status sb = st ? st : opf_graph_forward(g, &xb, call, &yb, NULL);
    CHECK(!sb || st, "%s: graph forward: %s", tag, opf_last_error(b->ctx));
    if (!sb) sb = opf_graph_backward(g, &dyb, NULL, &dxb, NULL);
    CHECK(!sb || st, "%s: graph backward: %s", tag, opf_last_error(b->ctx));
    opf_cuda_alloc_stats(b->ctx, &s1);
    if (!sb && replayed) {
        CHECK(s1.n_alloc == s0.n_alloc, "%s: %llu device allocations during a replayed step", tag,
              (unsigned long long)(s1.n_alloc - s0.n_alloc));
        for (int bwd = 0; bwd < 2; bwd++)
            CHECK(g->launches[bwd] == captured_segments(g, bwd) && g->walked[bwd] == 0,
                  "%s: %s: %d launches for %d captured segments, %d nodes walked", tag,
                  bwd ? "backward" : "forward", g->launches[bwd], captured_segments(g, bwd), g->walked[bwd]);
    }
    if (!sb) {
        same(tag, "y", a->ctx, &ya, b->ctx, &yb);
        same(tag, "dx", a->ctx, &dxa, b->ctx, &dxb);
        compare_grads(tag, a->ctx, a->seq, b->ctx, b->seq);
        compare_delayed(tag, a->seq, b->seq);
        if (sp->update) {
            CHECK_OK(a->ctx, opf_optim_step(a->opt));
            CHECK_OK(b->ctx, opf_optim_step(b->opt));
        }
    }
    opf_tensor_release(&ya), opf_tensor_release(&dxa);
    opf_tensor_release(&xa), opf_tensor_release(&xb), opf_tensor_release(&dya), opf_tensor_release(&dyb);
    return !sb;
}

static void run_case(const char *model, build_fn build, opf_recipe_kind kind, bool microbatch)
{
    char what[96];
    snprintf(what, sizeof what, "%s %s%s", model, opf_recipe_name(kind), microbatch ? " microbatches" : "");
    side a, b;
    opf_graph *g = NULL;
    /* the eager context keeps wgrad on its own stream; the compiled one
     * (these small GEMMs) runs it on the side queue, captured as a branch */
    const char *user = getenv("OPF_CUDA_SIDE");
    char *saved = user ? strdup(user) : NULL;
    setenv("OPF_CUDA_SIDE", "0", 1);
    bool opened = side_open(&a, build);
    setenv("OPF_CUDA_SIDE", "auto", 1);
    opened = opened && side_open(&b, build);
    if (saved) setenv("OPF_CUDA_SIDE", saved, 1);
    free(saved);
    if (!opened) goto out;
    opf_recipe r = opf_recipe_default(kind);
    if (kind == OPF_RECIPE_DELAYED) r.amax_history_len = 4;  /* the scales move within the run */
    opf_seq_call call = opf_seq_call_default();
    call.recipe = kind == OPF_RECIPE_NONE ? NULL : &r;
    opf_basic_linear_kwargs kw = {-1};
    const void *kwv[16] = {0};
    if (microbatch) {
        for (int i = 0; i < opf_seq_len(a.seq) && i < 16; i++)
            if (!strcmp(opf_op_class_of(opf_seq_at(a.seq, i))->name, "basic_linear")) kwv[i] = &kw;
        call.kwargs = kwv;
    }
    opf_compile_options o = opf_compile_options_default();
    o.max_leading = ROWS_MAX;
    opf_spec xs = opf_spec_make(2, (int64_t[]){ROWS_MAX, HID}, OPF_BF16);
    xs.device = OPF_DEVICE_CUDA;
    kw.is_first_microbatch = microbatch ? 1 : -1;
    opf_status st = opf_compile(b.seq, &xs, &call, &o, &g);
    CHECK(!st, "%s: compile: %s", what, opf_last_error(b.ctx));
    if (st) goto out;
    CHECK(g->capture && g->on_device, "%s: the graph does not capture (on device %d)", what, g->on_device);
    opf_graph_stats gs;
    opf_graph_get_stats(g, &gs);
    printf("%s: %d + %d nodes, %d eager, %d segments, arena %zu bytes\n", what, gs.n_forward,
           gs.n_backward, gs.n_eager, g->n_segs, gs.arena_bytes);
    for (int s = 0; s < STEPS; s++) {
        step_plan sp = plan_of(microbatch, s);
        kw.is_first_microbatch = sp.first_mb;
        char tag[160];
        snprintf(tag, sizeof tag, "%s step %d (%lld rows%s)", what, s, (long long)sp.rows,
                 microbatch ? (sp.first_mb ? ", first microbatch" : ", cached weights") : "");
        if (!step_both(tag, &a, &b, g, &call, &sp, s >= WARM)) break;
    }
    for (int i = 0; i < g->n_segs; i++)
        CHECK(!g->segs[i].refused, "%s: segment %d (nodes %d..%d) refused its capture", what, i,
              g->segs[i].first, g->segs[i].end - 1);
out:
    opf_graph_destroy(g);
    side_close(&b);
    side_close(&a);
}

/* Capture, launch and free on the context's stream, without the compiler:
 * a capture records, the launch runs. */
static void test_raw_graph(opf_ctx *ctx)
{
    opf_spec s = opf_spec_make(1, (int64_t[]){1024}, OPF_F32);
    float host[1024];
    for (int i = 0; i < 1024; i++) host[i] = (float)i;
    opf_tensor h, d, back;
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &s, host, &h));
    CHECK_OK(ctx, cuda_test_upload(ctx, &h, &d));
    opf_cuda_graph *cg = NULL;
    CHECK_OK(ctx, opf_cuda_capture_begin(ctx));
    CHECK_OK(ctx, opf_cuda_memset(ctx, d.data[0], 0, 4096));
    CHECK_OK(ctx, opf_cuda_capture_end(ctx, &cg));
    CHECK(cg && opf_cuda_graph_num_nodes(cg) == 1, "one memset node");
    CHECK_OK(ctx, cuda_test_download(ctx, &d, &back));
    CHECK(((float *)back.data[0])[7] == 7.0f, "the capture ran nothing");
    opf_tensor_release(&back);
    CHECK_OK(ctx, opf_cuda_graph_launch(ctx, cg));
    CHECK_OK(ctx, cuda_test_download(ctx, &d, &back));
    CHECK(((float *)back.data[0])[7] == 0.0f, "the launch ran the memset");
    opf_tensor_release(&back);
    /* a synchronization inside a capture fails it, and the stream is usable after */
    opf_cuda_graph_free(ctx, cg);
    cg = NULL;
    CHECK_OK(ctx, opf_cuda_capture_begin(ctx));
    opf_status st = opf_cuda_sync(ctx);
    opf_status end = opf_cuda_capture_end(ctx, &cg);
    CHECK(st != OPF_OK || end != OPF_OK, "a sync inside a capture is refused");
    CHECK(cg == NULL, "no graph from a refused capture");
    CHECK_OK(ctx, opf_cuda_sync(ctx));
    CHECK_OK(ctx, opf_cuda_scratch_reserve(ctx, 1 << 20));
    opf_tensor_release(&h), opf_tensor_release(&d);
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_raw_graph(ctx);
    cuda_test_done(ctx);
    static const opf_recipe_kind kinds[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                            OPF_RECIPE_MXFP8};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        run_case("layernorm-mlp", ln_mlp, kinds[k], false);
        run_case("linear stack", linear_stack, kinds[k], false);
    }
    run_case("linear stack", linear_stack, OPF_RECIPE_CURRENT, true);
    run_case("linear stack", linear_stack, OPF_RECIPE_DELAYED, true);
    TEST_DONE();
}
#endif
