/* test_checkpoint.c: a checkpoint resumes training bit for bit. Under every
 * recipe, 4 uninterrupted steps (run A) must equal 2 steps, a save, and 2
 * more steps after loading into a fresh seq, optimizer and context (runs B
 * and C): parameters, gradients, outputs, input gradients, optimizer and
 * recipe state, RNG. The fresh seq is readied with opf_checkpoint_prepare
 * or (two recipes) with an inference forward. Also cached quantized weights
 * (is_first_microbatch) survive a round trip and are reused identically. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <unistd.h>

#include "test.h"

enum { T = 32, H = 64, F = 128 };

typedef struct config {
    opf_recipe_kind kind;
    opf_dtype       dtype;
    opf_optim_kind  optim;
} config;

static const config configs[] = {
    {OPF_RECIPE_NONE, OPF_F32, OPF_OPTIM_ADAMW},  {OPF_RECIPE_NONE, OPF_BF16, OPF_OPTIM_SGD},
    {OPF_RECIPE_DELAYED, OPF_BF16, OPF_OPTIM_ADAMW}, {OPF_RECIPE_CURRENT, OPF_BF16, OPF_OPTIM_ADAMW},
    {OPF_RECIPE_BLOCK, OPF_BF16, OPF_OPTIM_ADAMW},  {OPF_RECIPE_MXFP8, OPF_BF16, OPF_OPTIM_ADAMW},
    {OPF_RECIPE_NVFP4, OPF_BF16, OPF_OPTIM_ADAMW},
};
enum { NCONF = sizeof configs / sizeof configs[0] };

static char dir[64];

/* One training run: context, model, optimizer, recipe. */
typedef struct run {
    opf_ctx   *ctx;
    opf_seq   *seq;
    opf_optim *opt;
    opf_recipe recipe;
    bool       quant;
} run;

static opf_op *add(run *R, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(R->ctx, opf_op_create(R->ctx, cls, cfg, name, &op));
    CHECK_OK(R->ctx, opf_seq_append(R->seq, op));
    return op;
}

/* The residual LayerNorm-MLP of apps/model.c. */
static void build(run *R, const config *c)
{
    CHECK_OK(R->ctx, opf_seq_create(R->ctx, &R->seq));
    opf_norm_config ln = {H, 1e-5, false, c->dtype};
    CHECK_OK(NULL, opf_op_set_extra_output(add(R, "make_extra_output", NULL, "res.out"), 0, "res", false));
    add(R, "layernorm", &ln, "ln");
    CHECK_OK(R->ctx, opf_seq_append_linear(R->seq, H, F, true, c->dtype, "fc1"));
    add(R, "gelu", NULL, "gelu");
    CHECK_OK(R->ctx, opf_seq_append_linear(R->seq, F, H, true, c->dtype, "fc2"));
    CHECK_OK(NULL, opf_op_set_extra_input(add(R, "add_extra_input", NULL, "res.in"), 0, "res"));
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = 2e-3f;
    oo.momentum = 0.9f;
    oo.weight_decay = 0.01f;
    CHECK_OK(R->ctx, opf_optim_create(R->ctx, R->seq, c->optim, &oo, &R->opt));
    R->recipe = opf_recipe_default(c->kind);
    R->recipe.amax_history_len = 4;
    R->quant = c->kind != OPF_RECIPE_NONE;
}

static void open_run(run *R, const config *c, uint64_t seed)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = seed;
    CHECK_OK(NULL, opf_ctx_create(&o, &R->ctx));
    build(R, c);
}

static void close_run(run *R)
{
    opf_optim_destroy(R->opt);
    opf_seq_destroy(R->seq);
    opf_ctx_destroy(R->ctx);
}

static size_t plain_bytes(const opf_tensor *t)
{
    return opf_dtype_nbytes(t->spec.dtype, (size_t)opf_spec_numel(&t->spec));
}

/* Appends n bytes to a growing blob. */
typedef struct blob {
    unsigned char *p;
    size_t n;
} blob;

static void put(blob *b, const void *src, size_t n)
{
    b->p = realloc(b->p, b->n + n);
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

/* Every bit of persistent training state. */
static blob snapshot(run *R, bool grads)
{
    blob b = {NULL, 0};
    for (int i = 0; i < opf_seq_len(R->seq); i++) {
        opf_op *op = opf_seq_at(R->seq, i);
        for (int j = 0; j < opf_op_num_params(op); j++) {
            opf_param *p = opf_op_param(op, j);
            put(&b, p->value.data[0], plain_bytes(&p->value));
            if (grads) put(&b, p->grad.data[0], plain_bytes(&p->grad));
        }
        opf_recipe_state *rs = opf_op_recipe_state(op);
        for (int d = 0; rs && d < 2; d++) {
            opf_delayed_state *ds = opf_recipe_state_delayed(rs, d);
            if (!ds) continue;
            int s = opf_delayed_state_slots(ds), L = opf_delayed_state_history_len(ds);
            put(&b, opf_delayed_state_scale(ds), sizeof(float) * (size_t)s);
            put(&b, opf_delayed_state_history(ds), sizeof(float) * (size_t)(s * L));
        }
    }
    for (int k = 0; k < opf_optim_num_slots(R->opt); k++) {
        float *m[3];
        int64_t n;
        opf_optim_slot(R->opt, k, NULL, &m[0], &m[1], &m[2], &n);
        for (int w = 0; w < 3; w++)
            if (m[w]) put(&b, m[w], sizeof(float) * (size_t)n);
    }
    int64_t steps = opf_optim_step_count(R->opt);
    uint64_t rng[2];
    opf_ctx_get_rng(R->ctx, &rng[0], &rng[1]);
    put(&b, &steps, sizeof steps);
    put(&b, rng, sizeof rng);
    return b;
}

static bool blob_eq(blob a, blob b) { return a.n == b.n && !memcmp(a.p, b.p, a.n); }

static float xs[T * H], ts[T * H];

/* One step: forward, MSE gradient, backward, optimizer. y and dx bytes are
 * appended to *out. */
static void train_step(run *R, const void *const *kwargs, bool opt_step, blob *out)
{
    static uint16_t xb[T * H];
    opf_tensor x, y, dy, dx;
    opf_dtype dt = opf_op_param(opf_seq_at(R->seq, 1), 0)->value.spec.dtype;
    if (dt != OPF_F32) opf_convert(xs, OPF_F32, xb, dt, T * H);
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {T, H}, .dtype = dt},
                    dt == OPF_F32 ? (void *)xs : (void *)xb, &x);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = R->quant ? &R->recipe : NULL;
    call.kwargs = kwargs;
    opf_seq_zero_grad(R->seq);
    opf_status st = opf_seq_forward(R->seq, &x, &call, &y, NULL);
    CHECK(st == OPF_OK, "forward: %s", opf_last_error(R->ctx));
    if (st) return;
    float yv[T * H], g[T * H];
    opf_convert(y.data[0], y.spec.dtype, yv, OPF_F32, T * H);
    for (int i = 0; i < T * H; i++) g[i] = 2.0f * (yv[i] - ts[i]) / (T * H);
    static uint16_t gb[T * H];
    if (dt != OPF_F32) opf_convert(g, OPF_F32, gb, dt, T * H);
    opf_tensor_wrap(&y.spec, dt == OPF_F32 ? (void *)g : (void *)gb, &dy);
    CHECK_OK(R->ctx, opf_seq_backward(R->seq, &dy, NULL, &dx, NULL));
    if (opt_step) CHECK_OK(R->ctx, opf_optim_step(R->opt));
    put(out, y.data[0], plain_bytes(&y));
    if (dx.data[0]) put(out, dx.data[0], plain_bytes(&dx));
    opf_tensor_release(&y), opf_tensor_release(&dx);
}

/* A fresh model, optimizer and context (another seed: everything must come
 * from the file), readied for the load by opf_checkpoint_prepare or by an
 * inference forward with the recipe (the documented alternative). */
static void fresh_and_load(run *C, const config *c, const char *path, bool by_forward)
{
    open_run(C, c, 777);
    if (by_forward) {
        opf_tensor x, y;
        opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {T, H}, .dtype = OPF_F32}, xs, &x);
        if (c->dtype != OPF_F32) {
            opf_spec s = opf_spec_make(2, (int64_t[]){T, H}, c->dtype);
            CHECK_OK(C->ctx, opf_tensor_alloc(C->ctx, &s, &x));
            opf_convert(xs, OPF_F32, x.data[0], c->dtype, T * H);
        }
        opf_seq_call call = opf_seq_call_default();
        call.recipe = C->quant ? &C->recipe : NULL;
        call.requires_grad = call.input_requires_grad = false;
        CHECK_OK(C->ctx, opf_seq_forward(C->seq, &x, &call, &y, NULL));
        opf_tensor_release(&y), opf_tensor_release(&x);
    } else {
        CHECK_OK(C->ctx, opf_checkpoint_prepare(C->ctx, C->seq, C->quant ? &C->recipe : NULL));
    }
    CHECK_OK(C->ctx, opf_checkpoint_load(C->ctx, C->seq, C->opt, path));
}

static void test_resume(const config *c, bool by_forward)
{
    const char *rn = opf_recipe_name(c->kind);
    char path[128];
    snprintf(path, sizeof path, "%s/resume-%s.safetensors", dir, rn);
    run A, B, C;
    blob outA = {0}, outB = {0}, outC = {0}, skip = {0};
    open_run(&A, c, 42);
    for (int s = 0; s < 4; s++) train_step(&A, NULL, true, s < 2 ? &skip : &outA);
    open_run(&B, c, 42);
    for (int s = 0; s < 2; s++) train_step(&B, NULL, true, &skip);
    opf_alloc_stats a0, a1;
    opf_ctx_alloc_stats(B.ctx, &a0);
    CHECK_OK(B.ctx, opf_checkpoint_save(B.ctx, B.seq, B.opt, path));
    opf_ctx_alloc_stats(B.ctx, &a1);
    CHECK(a1.n_alloc > a0.n_alloc && a1.bytes_live == a0.bytes_live,
          "%s: the save's scratch comes from the context and goes back (%zu -> %zu bytes live)",
          rn, a0.bytes_live, a1.bytes_live);
    blob sb = snapshot(&B, false);
    fresh_and_load(&C, c, path, by_forward);
    blob sc = snapshot(&C, false);
    CHECK(blob_eq(sb, sc), "%s: the loaded state differs from the saved one", rn);
    for (int s = 0; s < 2; s++) train_step(&C, NULL, true, &outC);
    for (int s = 0; s < 2; s++) train_step(&B, NULL, true, &outB);
    blob sa = snapshot(&A, true), sc4 = snapshot(&C, true), sb4 = snapshot(&B, true);
    const char *how = by_forward ? " (readied by a forward)" : "";
    CHECK(outA.n > 0 && blob_eq(outA, outC), "%s%s: outputs and input gradients of steps 3-4 "
          "differ after resuming", rn, how);
    CHECK(blob_eq(sa, sc4), "%s%s: parameters, gradients or optimizer/recipe state differ after "
          "resuming", rn, how);
    CHECK(blob_eq(sa, sb4) && blob_eq(outA, outB), "%s: the uninterrupted runs differ", rn);
    free(outA.p), free(outB.p), free(outC.p), free(skip.p);
    free(sa.p), free(sb.p), free(sc.p), free(sc4.p), free(sb4.p);
    close_run(&A), close_run(&B), close_run(&C);
    unlink(path);
}

/* The cached quantized weights (is_first_microbatch = 1) are saved with
 * their spec and, after loading, reused (is_first_microbatch = 0) to the
 * same bits. */
static void test_cached_weights(const config *c)
{
    const char *rn = opf_recipe_name(c->kind);
    char path[128];
    snprintf(path, sizeof path, "%s/cache-%s.safetensors", dir, rn);
    run B, C;
    blob skip = {0}, outB = {0}, outC = {0};
    open_run(&B, c, 43);
    train_step(&B, NULL, true, &skip);  /* a step of history first */
    int n = opf_seq_len(B.seq);
    opf_basic_linear_kwargs first = {1}, reuse = {0};
    const void *kw1[16] = {0}, *kw0[16] = {0};
    for (int i = 0; i < n; i++)
        if (!strcmp(opf_op_class_of(opf_seq_at(B.seq, i))->name, "basic_linear"))
            kw1[i] = &first, kw0[i] = &reuse;
    train_step(&B, kw1, false, &skip);
    CHECK_OK(B.ctx, opf_checkpoint_save(B.ctx, B.seq, B.opt, path));
    fresh_and_load(&C, c, path, false);
    int cached = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < opf_op_num_params(opf_seq_at(B.seq, i)); j++) {
            opf_param *pb = opf_op_param(opf_seq_at(B.seq, i), j);
            opf_param *pc = opf_op_param(opf_seq_at(C.seq, i), j);
            CHECK(pb->qvalue_valid == pc->qvalue_valid, "%s: op %d param %d cache flag", rn, i, j);
            if (!pb->qvalue_valid) continue;
            cached++;
            opf_layout L;
            CHECK_OK(NULL, opf_spec_layout(&pb->qvalue.spec, &L));
            CHECK(opf_spec_equal(&pb->qvalue.spec, &pc->qvalue.spec), "%s: cached spec", rn);
            for (int k = 0; k < OPF_COMP_COUNT; k++)
                if (L.comp[k].present)
                    CHECK(!memcmp(pb->qvalue.data[k], pc->qvalue.data[k], L.comp[k].nbytes),
                          "%s: op %d component %d of the cached weight differs", rn, i, k);
        }
    CHECK(cached == 2, "%s: %d cached weights, expected fc1 and fc2", rn, cached);
    train_step(&B, kw0, false, &outB);
    train_step(&C, kw0, false, &outC);
    blob sb = snapshot(&B, true), sc = snapshot(&C, true);
    CHECK(blob_eq(outB, outC) && blob_eq(sb, sc), "%s: the reused cached weights give other bits", rn);
    free(skip.p), free(outB.p), free(outC.p), free(sb.p), free(sc.p);
    close_run(&B), close_run(&C);
    unlink(path);
}

int main(void)
{
    unsigned long long s = 7;
    for (int i = 0; i < T * H; i++) xs[i] = opf_test_normal(&s, 1.0f), ts[i] = opf_test_normal(&s, 0.5f);
    snprintf(dir, sizeof dir, "/tmp/opf_ckpt_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    for (int k = 0; k < NCONF; k++) {
        test_resume(&configs[k], false);
        if (configs[k].kind == OPF_RECIPE_DELAYED || configs[k].kind == OPF_RECIPE_NVFP4)
            test_resume(&configs[k], true);
        if (configs[k].kind != OPF_RECIPE_NONE) test_cached_weights(&configs[k]);
    }
    rmdir(dir);
    TEST_DONE();
}
