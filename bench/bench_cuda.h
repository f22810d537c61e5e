/* bench_cuda.h: what the GPU benchmarks share (bench_cuda.c,
 * bench_cuda_train.c): their common start. */
#ifndef OPFUSE_BENCH_CUDA_H
#define OPFUSE_BENCH_CUDA_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda.h"
#include "bench.h"
#include "opfuse.h"

/* Random values in [-scale, scale] of dtype dt, [rows, cols], on the device:
 * a xorshift stream seeded by the shape and by the number of calls before
 * (so that two tensors of one shape differ). */
static inline opf_status opf_bench_cuda_random(opf_ctx *ctx, int64_t rows, int64_t cols,
                                               opf_dtype dt, float scale, opf_tensor *out)
{
    static uint64_t calls;
    opf_spec s = opf_spec_make(2, (int64_t[]){rows, cols}, dt);
    opf_tensor h;
    opf_status st = opf_tensor_alloc(ctx, &s, &h);
    if (st) return st;
    float *v = (float *)malloc(sizeof *v * (size_t)(rows * cols));
    uint64_t r = 0x2545F4914F6CDD1Dull ^ (uint64_t)(rows * 131 + cols) ^ ++calls * 0x9E3779B97F4A7C15ull;
    for (int64_t i = 0; v && i < rows * cols; i++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        v[i] = scale * (float)(int32_t)(r >> 32) * 0x1p-31f;
    }
    if (!v) st = opf_set_error(ctx, OPF_ERR_NO_MEMORY, "bench: no host memory for a random [%lld, %lld]",
                               (long long)rows, (long long)cols);
    if (!st) st = opf_convert(v, OPF_F32, h.data[0], dt, (size_t)(rows * cols));
    if (!st) st = opf_tensor_to(ctx, &h, OPF_DEVICE_CUDA, out);
    free(v);
    opf_tensor_release(&h);
    return st;
}

/* The warm-up before a timed loop: fn(arg) run at least min_runs times and
 * until OPF_BENCH_SETTLE_MS (default 300; 0: min_runs only) of wall time have
 * passed after the first run (whose one-time setup, an algorithm choice or a
 * compilation, is no warm-up). An H200 reaches its power cap (near 700 W)
 * some 40 ms into a loop of large GEMMs and lowers its SM clock from 1980 MHz
 * to 1200-1680 (an 8192^3 bf16 GEMM: 1.36 ms, then 1.57-1.71); 50 ms idle
 * restore it. Timed after a few runs, a median fell on either side of that
 * edge, and a case run after another started hot. Settled, a case is timed
 * in the power-capped steady state of a long run; the PyTorch peers
 * (bench/peer/peer_timing.py) warm up by the same rule. Runs in growing
 * batches, a sync after each; opf_bench_cuda_run_for is the same loop for
 * settle_s seconds. */
static inline opf_status opf_bench_cuda_run_for(opf_ctx *ctx, opf_status (*fn)(void *), void *arg,
                                                int min_runs, double settle_s)
{
    opf_status st = fn(arg);
    if (!st) st = opf_cuda_sync(ctx);
    double t0 = opf_bench_now();
    for (int64_t n = 1, done = 0, batch = 1; !st;) {  /* n runs in all, done since t0 */
        double t = opf_bench_now() - t0, left = settle_s - t;
        if (n >= min_runs && left <= 0) break;
        if (done > 0) {  /* twice the last batch at most, no more than the time left needs */
            double need = left > 0 ? left / (t > 0 ? t / (double)done : 1e-9) + 1 : (double)(min_runs - n);
            batch = need < 2.0 * (double)batch ? (int64_t)need : 2 * batch;
            if (batch > (1 << 20)) batch = 1 << 20;
            if (batch < 1) batch = 1;
        }
        for (int64_t i = 0; i < batch && !st; i++) st = fn(arg);
        n += batch, done += batch;
        if (!st) st = opf_cuda_sync(ctx);
    }
    return st;
}

static inline opf_status opf_bench_cuda_settle(opf_ctx *ctx, opf_status (*fn)(void *), void *arg,
                                               int min_runs)
{
    return opf_bench_cuda_run_for(ctx, fn, arg, min_runs,
                                  opf_bench_env_ms("OPF_BENCH_SETTLE_MS", 300.0) * 1e-3);
}

typedef struct opf_bench_heat { opf_ctx *ctx; opf_tensor a, b, d; } opf_bench_heat;
static inline opf_status opf_bench_heat_gemm(void *p)
{
    opf_bench_heat *h = (opf_bench_heat *)p;
    opf_gemm_options o = opf_gemm_options_default();
    return opf_gemm(h->ctx, &h->a, &h->b, OPF_GEMM_TN, &o, &h->d);
}

/* Loads the GPU before the first timed case: 4096^3 bf16 GEMMs on random
 * data for OPF_BENCH_PREHEAT_MS (default 3000; 0: none), so that no process
 * times its first case on an idle, cool GPU (the die goes from 41 to 63 C in
 * the first seconds of load). Added for an nn.Linear step that ran 4.31 ms
 * timed first in its process and 4.93 ms timed again after other GEMMs
 * (its kernels are opfuse's bf16 GEMMs, and in turns with its own three
 * torch.mm it takes their time: what moved was the GPU's state, which the
 * order of cases sets; bench/RESULTS.md, Dec 3). Every GPU benchmark process
 * and PyTorch kernel peer (peer_timing.py) starts so. */
static inline opf_status opf_bench_cuda_preheat(opf_ctx *ctx)
{
    double ms = opf_bench_env_ms("OPF_BENCH_PREHEAT_MS", 3000.0);
    if (ms <= 0) return OPF_OK;
    enum { N = 4096 };
    opf_bench_heat h = {.ctx = ctx};
    opf_spec ds = opf_spec_make(2, (int64_t[]){N, N}, OPF_BF16);
    ds.device = OPF_DEVICE_CUDA;
    opf_status st = opf_bench_cuda_random(ctx, N, N, OPF_BF16, 1.0f, &h.a);
    if (!st) st = opf_bench_cuda_random(ctx, N, N, OPF_BF16, 1.0f, &h.b);
    if (!st) st = opf_tensor_alloc(ctx, &ds, &h.d);
    if (!st) st = opf_bench_cuda_run_for(ctx, opf_bench_heat_gemm, &h, 1, ms * 1e-3);
    opf_tensor_release(&h.a), opf_tensor_release(&h.b), opf_tensor_release(&h.d);
    return st;
}

/* Takes the leading options off argv, in any order: `--out FILE`
 * (*out_path, else NULL) and, where only is not NULL, `--only LIST` (*only,
 * else NULL); then the n_dims sizes that may follow (dims[i] keeps its
 * default where none is given; a size that is not a positive integer is an
 * error). Makes a CUDA context, prints "bench WHO on <GPU>" and heats the GPU
 * (opf_bench_cuda_preheat). Returns 0
 * with *ctx made, or the benchmark's exit status with *ctx NULL: 0 when the
 * machine has no GPU (skipped), 2 on bad arguments, 1 on another failure. */
static inline int opf_bench_cuda_open(const char *who, int argc, char **argv,
                                      const char **out_path, const char **only, int64_t *dims,
                                      int n_dims, opf_ctx **ctx)
{
    *out_path = NULL;
    *ctx = NULL;
    if (only) *only = NULL;
    for (; argc >= 2 && argv[0][0] == '-'; argc -= 2, argv += 2) {
        if (!strcmp(argv[0], "--out")) *out_path = argv[1];
        else if (only && !strcmp(argv[0], "--only")) *only = argv[1];
        else break;
    }
    for (int i = 0; i < argc; i++) {
        char *end;
        long long v = strtoll(argv[i], &end, 10);
        if (i >= n_dims || *end || end == argv[i] || v < 1) {
            fprintf(stderr, "bench %s: argument \"%s\" is not %s\n", who, argv[i],
                    i >= n_dims ? "an option this benchmark takes" : "a positive size");
            return 2;
        }
        dims[i] = v;
    }
    opf_ctx_options o = opf_ctx_options_default();
    o.device = OPF_DEVICE_CUDA;
    opf_status st = opf_ctx_create(&o, ctx);
    if (st) {
        printf("bench %s: skipped: %s\n", who, opf_last_error(NULL));
        return st == OPF_ERR_UNSUPPORTED ? 0 : 1;
    }
    char name[128] = "";
    opf_cuda_device_name(*ctx, name, sizeof name);
    printf("bench %s on %s\n", who, name);
    if ((st = opf_bench_cuda_preheat(*ctx))) {
        fprintf(stderr, "bench %s: the warm-up GEMMs failed: %s\n", who, opf_last_error(*ctx));
        opf_ctx_destroy(*ctx);
        *ctx = NULL;
        return 1;
    }
    return 0;
}

#endif
