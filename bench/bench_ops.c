/* bench_ops.c: `opfuse bench ops`: host time per op in the eager fuser on
 * tiny shapes, and the residual LayerNorm-MLP training step against PyTorch
 * CPU (bench/peer/torch_ln_mlp.py) measured in the same run.
 *
 *     opfuse bench ops [tokens hidden ffn]   default 128 256 1024 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "model.h"

/* Median microseconds per op of forward (+ backward) through a seq of n ops
 * of class cls on x (any device: the context is synchronized, untimed,
 * before each call, so only the host's time counts); -1 on failure. */
double opf_bench_host_us_per_op(opf_ctx *ctx, const char *cls, const void *cfg, int n,
                                bool backward, const opf_tensor *x)
{
    opf_seq *seq;
    if (opf_seq_create(ctx, &seq)) return -1;
    for (int i = 0; i < n; i++) {
        opf_op *op;
        if (opf_op_create(ctx, cls, cfg, cls, &op) || opf_seq_append(seq, op)) {
            opf_seq_destroy(seq);
            return -1;
        }
    }
    opf_seq_call call = opf_seq_call_default();
    call.requires_grad = backward;
    enum { REPS = 41 };
    double t[REPS];
    opf_status st = OPF_OK;
    for (int r = -3; r < REPS && !st; r++) {  /* three warm-up calls build plans and scratch */
        if ((st = opf_ctx_sync(ctx))) break;
        double t0 = opf_bench_now();
        opf_tensor y, dx;
        if ((st = opf_seq_forward(seq, x, &call, &y, NULL))) break;
        if (backward && (st = opf_seq_backward(seq, &y, NULL, &dx, NULL))) {
            opf_tensor_release(&y);
            break;
        }
        if (backward) opf_tensor_release(&dx);
        opf_tensor_release(&y);
        if (r >= 0) t[r] = (opf_bench_now() - t0) * 1e6 / n;
    }
    if (!st) st = opf_ctx_sync(ctx);
    opf_seq_destroy(seq);
    return st ? -1 : opf_bench_median(t, REPS);
}

/* Median ms of a training step of the LayerNorm-MLP, fusions on or off,
 * under recipe r (NULL: none). */
static double ln_mlp_ms(opf_ctx *ctx, int64_t tokens, int64_t hidden, int64_t ffn, int steps,
                        bool fusions, const opf_recipe *r)
{
    opf_seq *seq;
    opf_optim *opt;
    if (opf_model_ln_mlp(ctx, hidden, ffn, OPF_F32, &seq) ||
        opf_optim_create(ctx, seq, OPF_OPTIM_ADAMW, NULL, &opt))
        return -1;
    opf_seq_set_fusions(seq, fusions);
    float *xv = malloc(sizeof(float) * (size_t)(tokens * hidden));
    float *tv = malloc(sizeof(float) * (size_t)(tokens * hidden));
    for (int64_t i = 0; i < tokens * hidden; i++) xv[i] = (float)((i * 7919) % 1000) / 500.0f - 1, tv[i] = 0.1f;
    opf_tensor x;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {tokens, hidden}, .dtype = OPF_F32}, xv, &x);
    opf_seq_call call = opf_seq_call_default();
    call.input_requires_grad = false;
    call.recipe = r;
    double *t = malloc(sizeof(double) * (size_t)steps);
    for (int s = -1; s < steps; s++) {
        double t0 = opf_bench_now(), loss;
        opf_tensor y, dy, dx;
        opf_seq_zero_grad(seq);
        if (opf_seq_forward(seq, &x, &call, &y, NULL) || opf_model_mse(ctx, &y, tv, &loss, &dy) ||
            opf_seq_backward(seq, &dy, NULL, &dx, NULL) || opf_optim_step(opt)) {
            fprintf(stderr, "bench: LayerNorm-MLP step failed: %s\n", opf_last_error(ctx));
            return -1;
        }
        opf_tensor_release(&y), opf_tensor_release(&dy), opf_tensor_release(&dx);
        if (s >= 0) t[s] = (opf_bench_now() - t0) * 1e3;
    }
    qsort(t, (size_t)steps, sizeof t[0], opf_bench_cmp_double);
    double ms = t[steps / 2];
    free(t), free(xv), free(tv);
    opf_optim_destroy(opt);
    opf_seq_destroy(seq);
    return ms;
}

/* Runs the PyTorch peer; returns its ms/step or -1 when torch is missing. */
static double torch_ms(int64_t tokens, int64_t hidden, int64_t ffn, int steps, int threads)
{
    const char *py = getenv("OPF_PYTHON");
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s bench/peer/torch_ln_mlp.py %lld %lld %lld %d %d 2>/dev/null",
             py ? py : ".venv/bin/python", (long long)tokens, (long long)hidden, (long long)ffn,
             steps, threads);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    double ms = -1;
    char line[256];
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "torch_ms_per_step %lf", &ms) == 1) break;
    pclose(f);
    return ms;
}

int opf_bench_ops(int argc, char **argv)
{
    int64_t tokens = argc >= 3 ? atoll(argv[0]) : 128, hidden = argc >= 3 ? atoll(argv[1]) : 256,
            ffn = argc >= 3 ? atoll(argv[2]) : 1024;
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    float xs[16] = {0};
    opf_tensor x;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {1, 16}, .dtype = OPF_F32}, xs, &x);
    opf_bias_config bc = {16, OPF_F32};
    printf("host time per op, eager fuser, tiny [1, 16] f32 tensors, seq of 32 ops (target < 2 us)\n\n");
    printf("| %-10s | %14s | %20s |\n", "op", "fwd us/op", "fwd+bwd us/op");
    printf("|------------|----------------|----------------------|\n");
    static const char *const ops[] = {"identity", "bias", "gelu", "layernorm"};
    opf_norm_config ln = {16, 1e-5, false, OPF_F32};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        const void *cfg = !strcmp(ops[i], "bias") ? (const void *)&bc
                        : !strcmp(ops[i], "layernorm") ? (const void *)&ln : NULL;
        printf("| %-10s | %14.2f | %20.2f |\n", ops[i], opf_bench_host_us_per_op(ctx, ops[i], cfg, 32, false, &x),
               opf_bench_host_us_per_op(ctx, ops[i], cfg, 32, true, &x));
    }
    int steps = 20, threads = omp_get_max_threads();
    double ours = ln_mlp_ms(ctx, tokens, hidden, ffn, steps, true, NULL);
    double peer = torch_ms(tokens, hidden, ffn, steps, threads);
    printf("\nLayerNorm-MLP training step (fp32, AdamW), tokens %lld, hidden %lld, ffn %lld, %d threads\n\n",
           (long long)tokens, (long long)hidden, (long long)ffn, threads);
    printf("| %-22s | %10s |\n", "implementation", "ms/step");
    printf("|------------------------|------------|\n");
    printf("| %-22s | %10.3f |\n", "opfuse eager", ours);
    if (peer > 0) printf("| %-22s | %10.3f |\n| %-22s | %9.2fx |\n", "PyTorch CPU eager", peer,
                         "speed-up over PyTorch", peer / ours);
    else printf("| %-22s | %10s |\n", "PyTorch CPU eager", "not installed (pip install torch into .venv)");
    opf_ctx_destroy(ctx);
    return ours < 0;
}

int opf_bench_fusion(int argc, char **argv)
{
    int64_t tokens = argc >= 3 ? atoll(argv[0]) : 128, hidden = argc >= 3 ? atoll(argv[1]) : 256,
            ffn = argc >= 3 ? atoll(argv[2]) : 1024;
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    printf("LayerNorm-MLP training step, fusions on vs off (tokens %lld, hidden %lld, ffn %lld)\n\n",
           (long long)tokens, (long long)hidden, (long long)ffn);
    printf("| %-12s | %12s | %12s | %8s |\n", "recipe", "fused ms", "unfused ms", "speed-up");
    printf("|--------------|--------------|--------------|----------|\n");
    static const opf_recipe_kind kinds[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                            OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
    int rc = 0;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        opf_recipe r = opf_recipe_default(kinds[i]);
        const opf_recipe *rp = kinds[i] == OPF_RECIPE_NONE ? NULL : &r;
        double on = ln_mlp_ms(ctx, tokens, hidden, ffn, 10, true, rp);
        double off = ln_mlp_ms(ctx, tokens, hidden, ffn, 10, false, rp);
        rc |= on < 0 || off < 0;
        printf("| %-12s | %12.3f | %12.3f | %7.2fx |\n", opf_recipe_name(kinds[i]), on, off, off / on);
    }
    opf_ctx_destroy(ctx);
    return rc;
}
