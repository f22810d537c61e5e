/* demo_train.c: `opfuse demo`: trains a small residual LayerNorm-MLP on a
 * synthetic regression task on the CPU with every recipe, eagerly and
 * compiled (opf_compiled), and prints recipe, first and last loss, time per
 * step of each, and whether the two runs' losses agree bit for bit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "apps.h"
#include "model.h"

enum { TOKENS = 128, HIDDEN = 64, FFN = 256, STEPS = 30 };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Teacher: t = x + 0.5 tanh(x A) with a fixed random A, inputs normal. */
static void make_task(float *x, float *t)
{
    uint64_t s = 7;
    float *a = malloc(sizeof(float) * HIDDEN * HIDDEN);
    for (int i = 0; i < TOKENS * HIDDEN + HIDDEN * HIDDEN; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        float u = ((int)(s >> 40) - (1 << 23)) / (float)(1 << 23);
        if (i < TOKENS * HIDDEN) x[i] = 1.7f * u;
        else a[i - TOKENS * HIDDEN] = u / sqrtf((float)HIDDEN) * 1.7f;
    }
    for (int r = 0; r < TOKENS; r++)
        for (int c = 0; c < HIDDEN; c++) {
            double acc = 0;
            for (int k = 0; k < HIDDEN; k++) acc += x[r * HIDDEN + k] * a[k * HIDDEN + c];
            t[r * HIDDEN + c] = x[r * HIDDEN + c] + 0.5f * (float)tanh(acc);
        }
    free(a);
}

typedef struct run_result {
    double first, last, ms;
    double loss[STEPS];
} run_result;

static opf_status train(const opf_recipe *r, const float *xv, const float *t, bool compiled,
                        opf_device dev, run_result *res)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = 1234;
    o.device = dev;
    opf_ctx *ctx;
    opf_status st = opf_ctx_create(&o, &ctx);
    if (st) return fprintf(stderr, "opfuse demo: %s\n", opf_last_error(NULL)), st;
    opf_seq *seq = NULL;
    opf_optim *opt = NULL;
    opf_compiled *cc = NULL;
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = 3e-3f;
    opf_tensor x, xh;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {TOKENS, HIDDEN}, .dtype = OPF_F32}, (void *)xv,
                    &xh);
    x = xh;
    if ((dev != OPF_DEVICE_CPU && (st = opf_tensor_to(ctx, &xh, dev, &x))) ||
        (st = opf_model_ln_mlp(ctx, HIDDEN, FFN, OPF_F32, &seq)) ||
        (st = opf_optim_create(ctx, seq, OPF_OPTIM_ADAMW, &oo, &opt)) ||
        (compiled && (st = opf_compiled_create(seq, NULL, &cc))))
        goto done;
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r->kind == OPF_RECIPE_NONE ? NULL : r;
    call.input_requires_grad = false;
    double t0 = 0;
    for (int step = 0; step < STEPS && !st; step++) {
        if (step == 1) t0 = now_s();  /* step 0 builds plans and scratch */
        opf_tensor y, dy, dx;
        double loss;
        opf_seq_zero_grad(seq);
        st = cc ? opf_compiled_forward(cc, &x, &call, &y, NULL) : opf_seq_forward(seq, &x, &call, &y, NULL);
        if (st) break;
        st = opf_model_mse(ctx, &y, t, &loss, &dy);
        if (!st) st = cc ? opf_compiled_backward(cc, &dy, NULL, &dx, NULL)
                         : opf_seq_backward(seq, &dy, NULL, &dx, NULL);
        if (!st) st = opf_optim_step(opt);
        /* compiled outputs are views into the graph: releasing them is a no-op */
        opf_tensor_release(&y), opf_tensor_release(&dy), opf_tensor_release(&dx);
        if (step == 0) res->first = loss;
        res->last = res->loss[step] = loss;
    }
    res->ms = (now_s() - t0) * 1e3 / (STEPS - 1);
done:
    if (st) fprintf(stderr, "%s: %s\n", opf_recipe_name(r->kind), opf_last_error(ctx));
    if (x.data[0] != xh.data[0]) opf_tensor_release(&x);
    opf_compiled_destroy(cc);
    opf_optim_destroy(opt);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
    return st;
}

/* The largest relative difference of two runs' losses. */
static double max_rel_diff(const run_result *a, const run_result *b)
{
    double m = 0;
    for (int i = 0; i < STEPS; i++) {
        double d = fabs(a->loss[i] - b->loss[i]) / (fabs(b->loss[i]) + 1e-30);
        if (d > m) m = d;
    }
    return m;
}

int opf_demo_train(int argc, char **argv)
{
    opf_device dev = OPF_DEVICE_CPU;
    for (int i = 0; i < argc; i += 2) {
        bool cuda = i + 1 < argc && !strcmp(argv[i + 1], "cuda");
        if (strcmp(argv[i], "--device") || !(cuda || (i + 1 < argc && !strcmp(argv[i + 1], "cpu"))))
            return fprintf(stderr, "opfuse demo: usage: opfuse demo [--device cpu|cuda]\n"), 2;
        dev = cuda ? OPF_DEVICE_CUDA : OPF_DEVICE_CPU;
    }
    static float x[TOKENS * HIDDEN], t[TOKENS * HIDDEN];
    make_task(x, t);
    printf("opfuse demo: residual LayerNorm-MLP (hidden %d, ffn %d, %d tokens), AdamW, %d steps, "
           "fp32 master weights\n\n", HIDDEN, FFN, TOKENS, STEPS);
    printf("| %-12s | %11s | %11s | %9s | %12s | %14s |\n", "recipe", "first loss", "last loss",
           "ms/step", "compiled ms", "same losses");
    printf("|--------------|-------------|-------------|-----------|--------------|----------------|\n");
    static const opf_recipe_kind kinds[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                            OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
    int rc = 0;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        opf_recipe r = opf_recipe_default(kinds[i]);
        r.amax_history_len = 16;
        static run_result eager, comp, ref;
        if (train(&r, x, t, false, dev, &eager) || train(&r, x, t, true, dev, &comp) ||
            (dev != OPF_DEVICE_CPU && train(&r, x, t, false, OPF_DEVICE_CPU, &ref))) {
            rc = 1;
            continue;
        }
        bool same = memcmp(eager.loss, comp.loss, sizeof eager.loss) == 0;
        printf("| %-12s | %11.5f | %11.5f | %9.3f | %12.3f | %14s |\n", opf_recipe_name(kinds[i]),
               eager.first, eager.last, eager.ms, comp.ms, same ? "bit for bit" : "NO");
        if (!same) rc = 1;
        if (dev != OPF_DEVICE_CPU)
            printf("|   vs the cpu | %11.5f | %11.5f | losses within %.1e of the cpu run      |\n",
                   ref.first, ref.last, max_rel_diff(&eager, &ref));
    }
    printf("\n");
    return rc;
}
