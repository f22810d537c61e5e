/* test_cuda_nosync.c: a training step on the GPU never waits for the host.
 * A small model (LayerNorm -> Linear -> GELU -> Linear) trains 3 steps
 * eagerly through the fuser with AdamW, under FP8 delayed and current
 * scaling, on a CUDA context and on a CPU context from the same parameters
 * and inputs. Every step after the first must add no host synchronization
 * and no device-to-host copy (opf_ctx_sync_stats: amax, scales and the
 * delayed-scaling state stay on the device), and the losses must track the
 * CPU's within the GEMM tolerance. The loss is L = 0.5 sum(y^2), so dy = y,
 * read back after the step (outside the counted window). Exits 77 without a
 * GPU. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "cuda_test.h"
#include "op_cases.h"

enum { TOKENS = 32, HIDDEN = 64, FFN = 128, STEPS = 3 };

static opf_ctx *cpu, *gpu;

typedef struct model {
    opf_ctx   *ctx;
    opf_seq   *seq;
    opf_optim *opt;
} model;

static opf_status add(model *m, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    opf_status st = opf_op_create(m->ctx, cls, cfg, name, &op);
    return st ? st : opf_seq_append(m->seq, op);
}

static opf_status build(model *m, opf_ctx *ctx)
{
    memset(m, 0, sizeof *m);
    m->ctx = ctx;
    opf_norm_config ln = {HIDDEN, 1e-5, false, OPF_BF16};
    opf_basic_linear_config fc1 = {HIDDEN, FFN, OPF_BF16, false};
    opf_basic_linear_config fc2 = {FFN, HIDDEN, OPF_BF16, false};
    opf_status st = opf_seq_create(ctx, &m->seq);
    if (!st) st = add(m, "layernorm", &ln, "ln");
    if (!st) st = add(m, "basic_linear", &fc1, "fc1");
    if (!st) st = add(m, "gelu", NULL, "act");
    if (!st) st = add(m, "basic_linear", &fc2, "fc2");
    return st;
}

static void destroy(model *m)
{
    opf_optim_destroy(m->opt);
    opf_seq_destroy(m->seq);
}

/* The GPU model's parameters take the CPU model's (seeded) values. */
static opf_status copy_params(model *c, model *g, unsigned long long *s)
{
    opf_status st = OPF_OK;
    for (int i = 0; !st && i < opf_seq_len(c->seq); i++) {
        opf_op *oc = opf_seq_at(c->seq, i), *og = opf_seq_at(g->seq, i);
        randomize_params(oc, s);
        for (int p = 0; !st && p < opf_op_num_params(oc); p++)
            st = opf_tensor_copy(gpu, &opf_op_param(oc, p)->value, &opf_op_param(og, p)->value);
    }
    return st;
}

/* 0.5 sum(y^2) of a host bf16 tensor, in double. */
static double loss_of(const opf_tensor *y)
{
    int64_t n = opf_spec_numel(&y->spec);
    float *v = malloc(sizeof(float) * (size_t)n);
    opf_convert(y->data[0], y->spec.dtype, v, OPF_F32, (size_t)n);
    double l = 0;
    for (int64_t i = 0; i < n; i++) l += 0.5 * (double)v[i] * v[i];
    free(v);
    return l;
}

/* Forward, backward with dy = y, optimizer step: the counted window. */
static opf_status train_step(model *m, const opf_tensor *x, const opf_seq_call *call, opf_tensor *y)
{
    opf_tensor dx;
    opf_seq_zero_grad(m->seq);
    opf_status st = opf_seq_forward(m->seq, x, call, y, NULL);
    if (!st) st = opf_seq_backward(m->seq, y, NULL, &dx, NULL);
    if (!st) opf_tensor_release(&dx);
    if (!st) st = opf_optim_step(m->opt);
    return st;
}

/* Prints why the GPU refused, naming the missing kernel family. */
static void refused(const char *what, opf_status st)
{
    const char *msg = opf_last_error(gpu);
    const char *no = strstr(msg, "no "), *k = no ? strstr(no, " kernels") : NULL;
    if (st == OPF_ERR_UNSUPPORTED && k)
        printf("FAIL %s: %.*s kernels on cuda (%s)\n", what, (int)(k - no), no, msg);
    else
        printf("FAIL %s: %s on cuda: %s\n", what, opf_status_str(st), msg);
    CHECK(false, "%s refused on cuda", what);
}

static void run(opf_recipe_kind rk)
{
    char what[64];
    snprintf(what, sizeof what, "train %s", opf_recipe_name(rk));
    model c, g;
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = 1e-3f;
    unsigned long long s = 0x5EEDull + (unsigned long long)rk;
    CHECK_OK(cpu, build(&c, cpu));
    opf_status st = build(&g, gpu);
    if (!st) st = copy_params(&c, &g, &s);  /* randomizes the CPU's, then copies */
    /* After the values are final: an optimizer takes its master weights at creation. */
    CHECK_OK(cpu, opf_optim_create(cpu, c.seq, OPF_OPTIM_ADAMW, &oo, &c.opt));
    if (!st) st = opf_optim_create(gpu, g.seq, OPF_OPTIM_ADAMW, &oo, &g.opt);
    opf_recipe r = opf_recipe_default(rk);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &r;
    for (int step = 0; !st && step < STEPS; step++) {
        opf_tensor xc = rand2(cpu, &s, TOKENS, HIDDEN, OPF_BF16), xg, yc, yg, yh;
        memset(&yc, 0, sizeof yc), memset(&yg, 0, sizeof yg), memset(&xg, 0, sizeof xg);
        if ((st = cuda_test_upload(gpu, &xc, &xg))) break;
        CHECK_OK(cpu, train_step(&c, &xc, &call, &yc));
        opf_sync_stats before, after;
        opf_ctx_sync_stats(gpu, &before);
        st = train_step(&g, &xg, &call, &yg);
        opf_ctx_sync_stats(gpu, &after);
        if (!st && step > 0) {
            uint64_t ns = after.n_sync - before.n_sync, nd = after.n_d2h - before.n_d2h;
            printf("  %s step %d: %llu host syncs, %llu device-to-host copies\n", what, step,
                   (unsigned long long)ns, (unsigned long long)nd);
            CHECK(ns == 0 && nd == 0, "%s step %d: %llu syncs, %llu copies to the host (want 0)",
                  what, step, (unsigned long long)ns, (unsigned long long)nd);
        }
        if (!st && !(st = cuda_test_download(gpu, &yg, &yh))) {
            double lc = loss_of(&yc), lg = loss_of(&yh), rel = fabs(lg - lc) / (fabs(lc) + 1e-30);
            printf("  %s step %d: loss cpu %.6g cuda %.6g (rel %.2e)\n", what, step, lc, lg, rel);
            CHECK(rel <= 1e-2, "%s step %d: loss %g on cuda, %g on cpu", what, step, lg, lc);
            opf_tensor_release(&yh);
        }
        opf_tensor_release(&yc), opf_tensor_release(&yg);
        opf_tensor_release(&xc), opf_tensor_release(&xg);
    }
    if (st) refused(what, st);
    destroy(&c), destroy(&g);
}

int main(void)
{
    gpu = cuda_test_ctx();
    CHECK_OK(NULL, opf_ctx_create(NULL, &cpu));
    run(OPF_RECIPE_DELAYED);
    run(OPF_RECIPE_CURRENT);
    opf_ctx_destroy(cpu);
    cuda_test_done(gpu);
    TEST_DONE();
}
#endif
