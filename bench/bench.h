/* bench.h: the benchmarks behind `opfuse bench <what>`. Each takes the
 * arguments after its name, prints a table (milliseconds or GB/s and the ratio
 * to a peer measured in the same run) and returns 0, or 1 on failure. */
#ifndef OPFUSE_BENCH_H
#define OPFUSE_BENCH_H

#include <ctype.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "opfuse.h"

/* The monotonic clock in seconds. */
static inline double opf_bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A non-negative number of milliseconds from environment variable name, def
 * where it is unset or empty; a value that is not one (white space around it
 * allowed) is said on stderr and def used. */
static inline double opf_bench_env_ms(const char *name, double def)
{
    const char *e = getenv(name);
    if (!e || !*e) return def;
    char *end;
    double v = strtod(e, &end);  /* leading white space skipped; trailing, below */
    bool none = end == e;        /* no number at all */
    while (isspace((unsigned char)*end)) end++;
    if (none || *end || !isfinite(v) || v < 0) {
        fprintf(stderr, "%s=\"%s\" is not a number of milliseconds >= 0: %g used\n", name, e, def);
        return def;
    }
    return v;
}

/* qsort order of doubles. */
static inline int opf_bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of t[0..n) (element n / 2 after sorting t in place). */
static inline double opf_bench_median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof *t, opf_bench_cmp_double);
    return t[n / 2];
}

/* Quantize throughput per format against memcpy (bench_quantize.c). */
int opf_bench_quantize(int argc, char **argv);

/* opf_gemm against a plain OpenBLAS sgemm of the same shape (bench_gemm.c):
 * fp32 operands at a few shapes, then every quantized recipe at 1024^3.
 *     opfuse bench gemm [M N K]   one fp32 shape instead of the default list */
int opf_bench_gemm(int argc, char **argv);

/* Median microseconds of host time per op of forward (+ backward) through a
 * seq of n ops of class cls on x, on x's device (bench_ops.c); -1 on failure. */
double opf_bench_host_us_per_op(opf_ctx *ctx, const char *cls, const void *cfg, int n,
                                bool backward, const opf_tensor *x);

/* Host time per op in the eager fuser and the LayerNorm-MLP step against
 * PyTorch CPU (bench_ops.c).
 *     opfuse bench ops [tokens hidden ffn] */
int opf_bench_ops(int argc, char **argv);

/* The LayerNorm-MLP step with fusions on and off, per recipe (bench_ops.c).
 *     opfuse bench fusion [tokens hidden ffn] */
int opf_bench_fusion(int argc, char **argv);

/* Forward and backward time of the activation ops on one f32 tensor
 * (bench_act.c).
 *     opfuse bench act [rows cols]   default 128 1024 */
int opf_bench_act(int argc, char **argv);

/* Host time of a LayerNorm-MLP training step at tiny shapes, eager against
 * the compiled graph in the same run (bench_compile.c).
 *     opfuse bench compile [steps]   default 2000 */
int opf_bench_compile(int argc, char **argv);

/* The GPU kernels with CUDA events: FP8 quantize against a device copy,
 * cuBLASLt GEMMs (bench_cuda.c); skipped without a GPU.
 *     opfuse bench cuda [--out FILE] [M K [S]]   default 8192 8192 8192 */
int opf_bench_cuda(int argc, char **argv);

/* Training steps on the GPU (bench_cuda_train.c): Linear forward + backward
 * per recipe and its three GEMMs alone, the LayerNorm-MLP step per recipe,
 * the small step eager vs CUDA graphs, host time per call; skipped without
 * a GPU.
 *     opfuse bench cuda-train [--out FILE] [S [T H]]   default 8192 8192 4096 */
int opf_bench_cuda_train(int argc, char **argv);

/* GPT training tokens per second of `opfuse train`'s model per recipe,
 * eager and compiled, against the same model in PyTorch, eager and
 * torch.compile, in the same run (bench_train.c). The CPU default is a
 * small model; --device cuda GPT-2 small's shapes (bf16 peer, flash
 * attention, fused AdamW).
 *     opfuse bench train [--device cpu|cuda] [--recipes LIST] [--steps N] [--layers N]
 *                        [--width N] [--heads N] [--batch N] [--context T] [--vocab V] [--no-peer] */
int opf_bench_train(int argc, char **argv);

#endif
