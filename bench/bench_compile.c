/* bench_compile.c: `opfuse bench compile`: host time of a training step
 * (zero_grad, forward, backward; no optimizer) of the LayerNorm-MLP at tiny
 * shapes: eager (opf_seq_forward / opf_seq_backward, the peer) against the
 * compiled graph (opf_graph_forward / opf_graph_backward) of the same
 * configuration, measured in the same run, step by step interleaved.
 *
 * On the CPU the kernels run on the host too, so a step's time is kernel time
 * plus host overhead (resolving args, fakes, allocation, contexts, plans,
 * dispatch). Both paths run the same kernels on the same layouts; the
 * kernel time is measured by the graph's node profile (opf_graph_set_profile)
 * in extra pairs of steps, an eager one next to a profiled compiled one, and
 * host time = step - those kernels, per pair, median over the pairs. The
 * headline is eager host time / compiled host time (target >= 3x); the
 * whole-step ratio is printed too.
 *
 *     opfuse bench compile [steps]   default 2000 (after 200 warm-up steps) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "model.h"

typedef struct bench_case {
    opf_recipe_kind kind;
    opf_dtype       dtype;
    int64_t         rows, hidden, ffn;
} bench_case;

/* Medians in microseconds of each phase and of the whole step. */
typedef struct step_times {
    double step, fwd, bwd;
    double kernels;  /* compiled only: median kernel time per step (node profile) */
    double host;     /* median over profiled pairs of (step - the compiled step's kernels) */
} step_times;

typedef struct runner {
    opf_seq   *seq;
    opf_graph *g;      /* NULL: eager */
    double    *fwd, *bwd, *step;
} runner;

/* One step; records its phases at index i (i < 0: warm-up, not recorded). */
static opf_status run_step(runner *r, const opf_tensor *x, const opf_tensor *dy,
                           const opf_seq_call *call, int i)
{
    opf_tensor y, dx;
    double t0 = opf_bench_now() * 1e6;
    opf_seq_zero_grad(r->seq);
    opf_status st = r->g ? opf_graph_forward(r->g, x, call, &y, NULL) : opf_seq_forward(r->seq, x, call, &y, NULL);
    if (st) return st;
    double t1 = opf_bench_now() * 1e6;
    st = r->g ? opf_graph_backward(r->g, dy, NULL, &dx, NULL) : opf_seq_backward(r->seq, dy, NULL, &dx, NULL);
    opf_tensor_release(&y);
    if (!st) opf_tensor_release(&dx);
    double t2 = opf_bench_now() * 1e6;
    if (i >= 0) r->fwd[i] = t1 - t0, r->bwd[i] = t2 - t1, r->step[i] = t2 - t0;
    return st;
}

static opf_status rand_tensor(opf_ctx *ctx, int64_t m, int64_t k, opf_dtype dt, uint64_t seed, opf_tensor *t)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){m, k}, dt);
    opf_status st = opf_tensor_alloc(ctx, &s, t);
    float *v = malloc(sizeof(float) * (size_t)(m * k));
    if (st || !v) {
        free(v);
        return st ? st : OPF_ERR_NO_MEMORY;
    }
    for (int64_t i = 0; i < m * k; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = (float)((int)(seed >> 40) - (1 << 23)) / (float)(1 << 23);
    }
    st = opf_convert(v, OPF_F32, t->data[0], dt, (size_t)(m * k));
    free(v);
    return st;
}

/* Eager and compiled, step by step interleaved, `steps` measured steps. */
static opf_status bench_one(const bench_case *c, int steps, step_times *eager, step_times *comp,
                            int *n_nodes)
{
    opf_ctx *ctx;
    opf_status st = opf_ctx_create(NULL, &ctx);
    if (st) return st;
    runner r[2] = {{0}, {0}};
    opf_tensor x = {0}, dy = {0};
    opf_recipe rc = opf_recipe_default(c->kind);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = c->kind == OPF_RECIPE_NONE ? NULL : &rc;
    call.input_requires_grad = false;
    double *mem = malloc(sizeof(double) * (size_t)steps * 6);
    if (!mem) st = OPF_ERR_NO_MEMORY;
    for (int k = 0; k < 2 && !st; k++) {
        r[k].fwd = mem + (size_t)steps * (3 * k), r[k].bwd = r[k].fwd + steps, r[k].step = r[k].bwd + steps;
        st = opf_model_ln_mlp(ctx, c->hidden, c->ffn, c->dtype, &r[k].seq);
    }
    if (!st) st = rand_tensor(ctx, c->rows, c->hidden, c->dtype, 1, &x);
    if (!st) st = rand_tensor(ctx, c->rows, c->hidden, c->dtype, 2, &dy);
    if (!st) st = opf_compile(r[1].seq, &x.spec, &call, NULL, &r[1].g);
    if (!st) *n_nodes = opf_graph_num_nodes(r[1].g);
    for (int i = -200; i < steps && !st; i++)
        for (int k = 0; k < 2 && !st; k++) st = run_step(&r[k], &x, &dy, &call, i);
    /* the kernels' share: more compiled steps with the node profile on,
     * interleaved with eager ones, each step's kernel sum read on its own */
    double *kern = st ? NULL : malloc(sizeof(double) * (size_t)steps * 3), *hostc = kern ? kern + steps : NULL;
    double *hoste = kern ? hostc + steps : NULL;
    if (!st && !kern) st = OPF_ERR_NO_MEMORY;
    if (!st) opf_graph_set_profile(r[1].g, true);
    for (int i = 0; i < steps && !st; i++) {
        double t0 = opf_bench_now() * 1e6;
        st = run_step(&r[0], &x, &dy, &call, -1);
        double te = opf_bench_now() * 1e6 - t0;
        opf_graph_reset_profile(r[1].g);
        t0 = opf_bench_now() * 1e6;
        if (!st) st = run_step(&r[1], &x, &dy, &call, -1);
        double t = opf_bench_now() * 1e6 - t0, k = 0;
        for (int n = 0; n < opf_graph_num_nodes(r[1].g); n++) k += opf_graph_node_seconds(r[1].g, n);
        kern[i] = k * 1e6;
        hostc[i] = t - kern[i];
        hoste[i] = te - kern[i];  /* the eager step next to it runs the same kernels */
    }
    if (!st) {
        comp->kernels = opf_bench_median(kern, steps);
        comp->host = opf_bench_median(hostc, steps);
        eager->host = opf_bench_median(hoste, steps);
    }
    free(kern);
    if (st) {
        fprintf(stderr, "bench compile: %s %s: %s\n", opf_recipe_name(c->kind),
                opf_dtype_name(c->dtype), opf_last_error(ctx));
    } else {
        step_times *out[2] = {eager, comp};
        for (int k = 0; k < 2; k++)
            *out[k] = (step_times){opf_bench_median(r[k].step, steps),
                                   opf_bench_median(r[k].fwd, steps),
                                   opf_bench_median(r[k].bwd, steps), out[k]->kernels, out[k]->host};
    }
    opf_tensor_release(&x), opf_tensor_release(&dy);
    for (int k = 0; k < 2; k++) {
        opf_graph_destroy(r[k].g);
        opf_seq_destroy(r[k].seq);
    }
    free(mem);
    opf_ctx_destroy(ctx);
    return st;
}

int opf_bench_compile(int argc, char **argv)
{
    int steps = argc >= 1 ? atoi(argv[0]) : 2000;
    if (steps < 1) steps = 2000;
    static const bench_case cases[] = {
        {OPF_RECIPE_NONE, OPF_F32, 8, 32, 64},     {OPF_RECIPE_NONE, OPF_BF16, 8, 32, 64},
        {OPF_RECIPE_CURRENT, OPF_F32, 8, 32, 64},  {OPF_RECIPE_CURRENT, OPF_BF16, 8, 32, 64},
        {OPF_RECIPE_MXFP8, OPF_F32, 32, 32, 64},   {OPF_RECIPE_MXFP8, OPF_BF16, 32, 32, 64},
    };
    enum { N_CASES = sizeof cases / sizeof cases[0] };
    printf("LayerNorm-MLP training step (zero_grad + forward + backward, no optimizer), host time, "
           "eager vs compiled, median of %d steps after 200 warm-up, interleaved\n\n", steps);
    printf("| %-11s | %-5s | %-14s | %5s | %9s | %11s | %10s | %10s | %12s | %10s | %10s |\n",
           "recipe", "dtype", "rows x h x ffn", "nodes", "eager us", "compiled us", "kernels us",
           "eager host", "compiled host", "host ratio", "step ratio");
    printf("|-------------|-------|----------------|------:|----------:|------------:|-----------:|"
           "-----------:|-------------:|-----------:|-----------:|\n");
    double ratios[N_CASES], steps_r[N_CASES];
    int n_ok = 0, rc = 0;
    for (int i = 0; i < N_CASES; i++) {
        const bench_case *c = &cases[i];
        step_times e = {0}, g = {0};
        int nodes = 0;
        if (bench_one(c, steps, &e, &g, &nodes)) {
            rc = 1;
            continue;
        }
        char shape[32];
        snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)c->rows, (long long)c->hidden,
                 (long long)c->ffn);
        double he = e.host, hc = g.host;
        if (hc < 0.05) hc = 0.05;  /* below the clock's resolution */
        ratios[n_ok] = he / hc;
        steps_r[n_ok++] = e.step / g.step;
        printf("| %-11s | %-5s | %-14s | %5d | %9.2f | %11.2f | %10.2f | %10.2f | %13.2f | %9.1fx | %9.2fx |\n",
               opf_recipe_name(c->kind), opf_dtype_name(c->dtype), shape, nodes, e.step, g.step,
               g.kernels, he, hc, he / hc, e.step / g.step);
    }
    if (n_ok) {
        double lo = ratios[0];
        for (int i = 1; i < n_ok; i++) lo = ratios[i] < lo ? ratios[i] : lo;
        printf("\nheadline: the compiled step spends %.1fx less host time than eager (median of %d "
               "cases; lowest %.1fx; target >= 3x); whole steps %.2fx faster (the kernels are the same)\n",
               opf_bench_median(ratios, n_ok), n_ok, lo, opf_bench_median(steps_r, n_ok));
    }
    return rc;
}
