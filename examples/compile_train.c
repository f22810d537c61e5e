/* compile_train.c: train a LayerNorm-MLP compiled, with the guarded cache.
 * Copy from here.
 *
 * The model is layernorm -> linear(+bias) -> gelu -> linear(+bias) in bf16
 * under MXFP8; the loss is the mean squared error against a fixed random
 * linear map of the input. opf_compiled compiles on the first call and
 * replays after; the batch size changes every step (max_leading), which
 * needs no recompilation. The program prints the loss, the graph's memory
 * plan and the recompile count, and fails if the loss does not fall. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <opfuse.h>

enum { HIDDEN = 64, FFN = 128, MAX_BATCH = 128, STEPS = 40 };

#define TRY(ctx, expr)                                                   \
    do {                                                                 \
        opf_status st_ = (expr);                                         \
        if (st_) {                                                       \
            fprintf(stderr, "%s: %s\n", #expr, opf_last_error(ctx));     \
            exit(1);                                                     \
        }                                                                \
    } while (0)

static float frand(unsigned long long *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((int)(*s >> 40) - (1 << 23)) / (float)(1 << 23);
}

int main(void)
{
    opf_ctx *ctx;
    TRY(NULL, opf_ctx_create(NULL, &ctx));
    opf_seq *seq;
    TRY(ctx, opf_seq_create(ctx, &seq));
    opf_norm_config ln = {.hidden = HIDDEN, .eps = 1e-5, .dtype = OPF_BF16};
    opf_op *op;
    TRY(ctx, opf_op_create(ctx, "layernorm", &ln, "ln", &op));
    TRY(ctx, opf_seq_append(seq, op));
    TRY(ctx, opf_seq_append_linear(seq, HIDDEN, FFN, true, OPF_BF16, "fc1"));
    TRY(ctx, opf_op_create(ctx, "gelu", NULL, "act", &op));
    TRY(ctx, opf_seq_append(seq, op));
    TRY(ctx, opf_seq_append_linear(seq, FFN, HIDDEN, true, OPF_BF16, "fc2"));

    opf_optim_options oo = opf_optim_options_default();
    oo.lr = 3e-3f;
    opf_optim *opt;
    TRY(ctx, opf_optim_create(ctx, seq, OPF_OPTIM_ADAMW, &oo, &opt));
    opf_compile_options co = opf_compile_options_default();
    co.max_leading = MAX_BATCH;
    opf_compiled *cc;
    TRY(ctx, opf_compiled_create(seq, &co, &cc));

    opf_recipe r = opf_recipe_default(OPF_RECIPE_MXFP8);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &r;
    call.input_requires_grad = false;

    static float map[HIDDEN * HIDDEN], xs[MAX_BATCH * HIDDEN], ys[MAX_BATCH * HIDDEN];
    unsigned long long seed = 42;
    for (int i = 0; i < HIDDEN * HIDDEN; i++) map[i] = frand(&seed) / 8;
    float first = 0, last = 0;
    for (int step = 0; step < STEPS; step++) {
        int64_t batch = MAX_BATCH - 32 * (step % 3);  /* 128, 96, 64: one graph */
        for (int64_t i = 0; i < batch * HIDDEN; i++) xs[i] = frand(&seed);
        opf_spec bs = opf_spec_make(2, (int64_t[]){batch, HIDDEN}, OPF_BF16);
        opf_tensor x, y, dy;
        TRY(ctx, opf_tensor_alloc(ctx, &bs, &x));
        TRY(ctx, opf_tensor_alloc(ctx, &bs, &dy));
        TRY(ctx, opf_convert(xs, OPF_F32, x.data[0], OPF_BF16, (size_t)(batch * HIDDEN)));
        opf_seq_zero_grad(seq);
        TRY(ctx, opf_compiled_forward(cc, &x, &call, &y, NULL));
        /* loss = mean (y - x M)^2; dy = 2 (y - x M) / n */
        float *yv = ys, loss = 0;
        TRY(ctx, opf_convert(y.data[0], OPF_BF16, yv, OPF_F32, (size_t)(batch * HIDDEN)));
        for (int64_t b = 0; b < batch; b++)
            for (int j = 0; j < HIDDEN; j++) {
                float t = 0;
                for (int k = 0; k < HIDDEN; k++) t += xs[b * HIDDEN + k] * map[k * HIDDEN + j];
                float d = yv[b * HIDDEN + j] - t;
                loss += d * d;
                yv[b * HIDDEN + j] = 2 * d / (float)(batch * HIDDEN);
            }
        loss /= (float)(batch * HIDDEN);
        TRY(ctx, opf_convert(yv, OPF_F32, dy.data[0], OPF_BF16, (size_t)(batch * HIDDEN)));
        TRY(ctx, opf_compiled_backward(cc, &dy, NULL, NULL, NULL));
        TRY(ctx, opf_optim_step(opt));
        if (step == 0) first = loss;
        last = loss;
        if (step % 10 == 0 || step == STEPS - 1)
            printf("step %2d  batch %3lld  loss %.5f\n", step, (long long)batch, loss);
        opf_tensor_release(&x);
        opf_tensor_release(&dy);
    }
    opf_graph_stats gs;
    opf_graph_get_stats(opf_compiled_last_graph(cc), &gs);
    printf("graph: %d forward + %d backward nodes (%d fused), arena %zu bytes (%zu without reuse), "
           "%d recompiles\n", gs.n_forward, gs.n_backward, gs.n_fused, gs.arena_bytes,
           gs.unplanned_bytes, opf_compiled_recompiles(cc));
    int ok = last < 0.5f * first && opf_compiled_recompiles(cc) == 0;
    opf_compiled_destroy(cc);
    opf_optim_destroy(opt);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
    printf("%s\n", ok ? "ok" : "FAILED: the loss did not halve or the graph recompiled");
    return ok ? 0 : 1;
}
