/* bench_train.c: `opfuse bench train`: training tokens per second of the
 * GPT of `opfuse train` (apps/gpt.h, uniform random tokens) per recipe,
 * eager and compiled, against the same model in PyTorch
 * (bench/peer/torch_gpt.py: eager and torch.compile) in the same run. On
 * the CPU a small model; with --device cuda GPT-2 small's shapes and the
 * peer in bf16 autocast with flash attention and fused AdamW. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "train.h"

#include <omp.h>

typedef struct bench_cfg {
    const char *device, *recipes;
    int64_t     layers, width, heads, batch, context, vocab, steps;
    bool        no_peer;
} bench_cfg;

static const bench_cfg cpu_default = {"cpu", "bf16,fp8-delayed,fp8-current,fp8-block,mxfp8,nvfp4",
                                      2, 64, 4, 32, 16, 64, 10, false};
static const bench_cfg cuda_default = {"cuda", "bf16,fp8-delayed,fp8-current,fp8-block,mxfp8,nvfp4",
                                       12, 768, 12, 16, 1024, 50304, 10, false};

static int threads(void) { return omp_get_max_threads(); }

/* opfuse's tokens per second under recipe (eager or compiled): steps timed
 * after two warm-up steps, and on the GPU after as many more as fill
 * OPF_BENCH_SETTLE_MS (default 300) after the first (whose one-time setup,
 * a compilation or a capture, is no warm-up), as the peer's median_ms
 * warms up (bench_cuda.h says why); -1 when the run cannot start (the
 * message is on stderr). */
static double opfuse_tokens_per_s(const bench_cfg *c, const char *recipe, bool compile)
{
    enum { WARMUP = 2, MAX_SETTLE = 1000 };
    bool gpu = !strcmp(c->device, "cuda");
    double settle_s = gpu ? opf_bench_env_ms("OPF_BENCH_SETTLE_MS", 300.0) * 1e-3 : 0;
    trainer t;
    memset(&t, 0, sizeof t);
    t.o = train_default_opts();
    t.o.recipe = recipe, t.o.device = c->device, t.o.compile = compile, t.o.quiet = true;
    t.o.layers = c->layers, t.o.width = c->width, t.o.heads = c->heads, t.o.batch = c->batch;
    t.o.context = c->context, t.o.random_vocab = c->vocab;
    t.o.steps = WARMUP + (gpu ? MAX_SETTLE : 0) + c->steps;
    t.o.warmup = 1;
    double tps = -1, t0 = 0, t1 = 0;
    int64_t s = 0;
    opf_status st = train_open(&t) ? OPF_ERR_INVALID_ARG : OPF_OK;
    for (; !st && s < WARMUP + (gpu ? MAX_SETTLE : 0); s++) {  /* warm-up, a sync after each */
        if (s >= WARMUP && opf_bench_now() - t1 >= settle_s) break;
        if (!(st = train_step(&t, s, NULL)) && !(st = opf_ctx_sync(t.ctx)) && s == 0)
            t1 = opf_bench_now();
    }
    if (!st) t0 = opf_bench_now();
    for (int64_t k = 0; !st && k < c->steps; k++)  /* the loss is never read: no host sync */
        st = train_step(&t, s + k, NULL);
    if (!st) st = opf_ctx_sync(t.ctx);
    if (!st) tps = (double)(c->steps * c->batch * c->context) / (opf_bench_now() - t0);
    else if (t.ctx) fprintf(stderr, "bench train: %s: %s\n", recipe, opf_last_error(t.ctx));
    train_close(&t);
    return tps;
}

typedef struct peer_result {
    char   mode[32];
    double tps;  /* -1: failed */
    char   why[160];
} peer_result;

/* Runs the PyTorch peer over its modes; returns how many lines it gave. */
static int run_peer(const bench_cfg *c, const char *modes, peer_result *r, int max)
{
    const char *py = getenv("OPF_PYTHON");
    char cmd[768], line[512];
    snprintf(cmd, sizeof cmd, "%s bench/peer/torch_gpt.py %s %lld %lld %lld %lld %lld %lld %lld %d %s 2>/dev/null",
             py ? py : ".venv/bin/python", c->device, (long long)c->layers, (long long)c->width,
             (long long)c->heads, (long long)c->batch, (long long)c->context, (long long)c->vocab,
             (long long)c->steps, threads(), modes);
    FILE *f = popen(cmd, "r");
    int n = 0;
    while (f && n < max && fgets(line, sizeof line, f)) {
        peer_result *p = &r[n];
        p->why[0] = 0;
        if (sscanf(line, "torch_tokens_per_s %31s %lf", p->mode, &p->tps) == 2) n++;
        else if (sscanf(line, "torch_failed %31s %159[^\n]", p->mode, p->why) >= 1) p->tps = -1, n++;
    }
    if (f) pclose(f);
    return n;
}

static bool parse(int argc, char **argv, bench_cfg *c)
{
    for (int i = 0; i < argc; i++)  /* the device first: it picks the defaults */
        if (!strcmp(argv[i], "--device") && i + 1 < argc) {
            if (!strcmp(argv[i + 1], "cuda")) *c = cuda_default;
            else if (strcmp(argv[i + 1], "cpu"))
                return fprintf(stderr, "bench train: unknown device \"%s\" (cpu or cuda)\n", argv[i + 1]), false;
        }
    static const struct { const char *name; size_t off; } ints[] = {
        {"--layers", offsetof(bench_cfg, layers)}, {"--width", offsetof(bench_cfg, width)},
        {"--heads", offsetof(bench_cfg, heads)},   {"--batch", offsetof(bench_cfg, batch)},
        {"--context", offsetof(bench_cfg, context)}, {"--vocab", offsetof(bench_cfg, vocab)},
        {"--steps", offsetof(bench_cfg, steps)},
    };
    for (int i = 0; i < argc; i++) {
        bool known = !strcmp(argv[i], "--device") && i + 1 < argc;
        if (!strcmp(argv[i], "--no-peer")) {
            c->no_peer = true;
            continue;
        }
        if (!strcmp(argv[i], "--recipes") && i + 1 < argc) c->recipes = argv[i + 1], known = true;
        for (size_t k = 0; k < sizeof ints / sizeof ints[0] && i + 1 < argc; k++)
            if (!strcmp(argv[i], ints[k].name)) *(int64_t *)((char *)c + ints[k].off) = atoll(argv[i + 1]), known = true;
        if (!known) {
            fprintf(stderr, "usage: opfuse bench train [--device cpu|cuda] [--recipes LIST] [--steps N]\n"
                            "       [--layers N] [--width N] [--heads N] [--batch N] [--context T] [--vocab V]\n"
                            "       [--no-peer]\n");
            return false;
        }
        i++;
    }
    return c->steps > 0 && c->batch > 0 && c->context > 1 && c->vocab > 1;
}

static void row(const char *impl, const char *mode, double tps, const peer_result *base, int n_base)
{
    printf("| %-24s | %-14s | %10.0f |", impl, mode, tps);
    for (int i = 0; i < n_base; i++)
        if (base[i].tps > 0) printf(" %11.2fx |", tps / base[i].tps);
        else printf(" %12s |", "-");
    printf("\n");
}

int opf_bench_train(int argc, char **argv)
{
    bench_cfg c = cpu_default;
    if (!parse(argc, argv, &c)) return 2;
    bool cuda = !strcmp(c.device, "cuda");
    peer_result peer[8];
    int n_peer = c.no_peer ? 0 : run_peer(&c, cuda ? "eager,compile" : "eager,eager-bf16,compile", peer, 8);
    printf("GPT training step (AdamW, clipping, cross-entropy), %s, %lld layers x %lld wide, %lld heads, "
           "vocab %lld, batch %lld x %lld tokens, %lld timed steps, %d threads\n\n", c.device,
           (long long)c.layers, (long long)c.width, (long long)c.heads, (long long)c.vocab,
           (long long)c.batch, (long long)c.context, (long long)c.steps, threads());
    printf("| %-24s | %-14s | %10s |", "implementation", "recipe / mode", "tokens/s");
    for (int i = 0; i < n_peer; i++) printf(" x %-10s |", peer[i].mode);
    printf("\n|--------------------------|----------------|------------|");
    for (int i = 0; i < n_peer; i++) printf("--------------|");
    printf("\n");
    for (int i = 0; i < n_peer; i++) {
        char impl[64];
        snprintf(impl, sizeof impl, "PyTorch %s", cuda ? "CUDA bf16" : "CPU");
        if (peer[i].tps > 0) row(impl, peer[i].mode, peer[i].tps, peer, n_peer);
        else printf("| %-24s | %-14s | failed: %s\n", impl, peer[i].mode, peer[i].why);
    }
    if (!c.no_peer && n_peer == 0)
        printf("| PyTorch                  | -              | not run (no torch in .venv or OPF_PYTHON) |\n");
    char list[256];
    snprintf(list, sizeof list, "%s", c.recipes);
    int rc = 0;
    for (char *save, *r = strtok_r(list, ",", &save); r; r = strtok_r(NULL, ",", &save))
        for (int compile = 0; compile < 2; compile++) {
            double tps = opfuse_tokens_per_s(&c, r, compile);
            if (tps < 0) {
                printf("| %-24s | %-14s | failed (see stderr)\n", compile ? "opfuse compiled" : "opfuse eager", r);
                rc = 1;
                continue;
            }
            row(compile ? "opfuse compiled" : "opfuse eager", r, tps, peer, n_peer);
            fflush(stdout);
        }
    return rc;
}
