/* bench_cuda.c: `opfuse bench cuda`: the GPU kernels timed with CUDA events
 * (median of REPS after the warm-up of bench_cuda.h), random data:
 *   - a device-to-device copy of the quantizer's input bytes (the ceiling);
 *   - quantize of a bf16 [M, K] tensor (FP8 per-tensor, MXFP8, FP8 block,
 *     NVFP4 1x16 with and without the Hadamard transform, 16x16), in bytes
 *     read + written (data, not scales) per second and as a fraction of the
 *     copy's rate;
 *   - GEMMs at S^3: bf16, FP8 per-tensor (fast and split accumulation),
 *     FP8 block 1x128 x 128x128 and 1x128 x 1x128 (cuBLASLt), MXFP8 and
 *     NVFP4 (dequantize + bf16 GEMM), in TFLOP/s;
 *   - LayerNorm forward and backward and RMSNorm forward on bf16
 *     [8192, 4096], GELU and SwiGLU forward and backward on fp32, in GB/s;
 *   - cast + transpose of a bf16 [M, K] tensor (the elem family's entry) and
 *     an AdamW step over 100 tensors of 1M fp32 parameters (fp32 gradients,
 *     master weights, moments and parameter copies), in GB/s;
 *   - causal attention on fp32 qkv at GPT-2 small's shape (B 16, T 1024,
 *     H 12, D 64), forward and forward + backward, on the gemm and flash
 *     paths of OPF_CUDA_ATTENTION, and flash, flash2, flash1p, cudnn and cudnn-atomic with
 *     bf16 qkv (cudnn skipped, saying why, where cuDNN does not load), in ms.
 * `--out FILE` also writes "name value" lines (the PyTorch peer script reads
 * them and prints the comparison table).
 *
 *   - softmax cross-entropy over GPT-2 small's logits (16 x 1024 rows, V
 *     50304, bf16), forward and forward + backward, in ms.
 * `--only LIST` runs only the sections named in LIST (any of quantize,
 * gemm, norm, elem, attn, xent; the copy always runs).
 *
 *     opfuse bench cuda [--out FILE] [--only LIST] [M K [S]]   default 8192 8192 8192 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "opfuse.h"

#ifndef OPF_HAVE_CUDA
int opf_bench_cuda(int argc, char **argv)
{
    (void)argc, (void)argv;
    printf("bench cuda: skipped, built without CUDA\n");
    return 0;
}
#else
#include "backend/backend-impl.h"
#include "bench_cuda.h"
#include "quant/quant-impl.h"

enum { WARMUP = 3, REPS = 15 };

typedef opf_status (*bench_fn)(opf_ctx *ctx, void *arg);

typedef struct bound { opf_ctx *ctx; bench_fn fn; void *arg; } bound;
static opf_status run_bound(void *b)
{
    const bound *x = (const bound *)b;
    return x->fn(x->ctx, x->arg);
}

/* Median milliseconds of fn over REPS runs, each between two events, after
 * the warm-up (opf_bench_cuda_settle). */
static int time_ms(opf_ctx *ctx, bench_fn fn, void *arg, double *ms)
{
    opf_cuda_timer *t = NULL;
    if (opf_cuda_timer_create(ctx, 2 * REPS, &t)) return 1;
    int rc = opf_bench_cuda_settle(ctx, run_bound, &(bound){ctx, fn, arg}, WARMUP) != OPF_OK;
    for (int i = 0; i < REPS && !rc; i++)
        rc = opf_cuda_timer_mark(ctx, t, 2 * i) || fn(ctx, arg) || opf_cuda_timer_mark(ctx, t, 2 * i + 1);
    double v[REPS];
    for (int i = 0; i < REPS && !rc; i++) {
        float f = 0;
        rc = opf_cuda_timer_ms(t, 2 * i, 2 * i + 1, &f) != OPF_OK;
        v[i] = f;
    }
    opf_cuda_timer_destroy(t);
    if (rc) {
        fprintf(stderr, "bench cuda: %s\n", opf_last_error(ctx));
        return 1;
    }
    *ms = opf_bench_median(v, REPS);
    return 0;
}

/* A device tensor of spec (its device aside). */
static opf_status device_tensor(opf_ctx *ctx, const opf_spec *spec, opf_tensor *out)
{
    opf_spec s = *spec;
    s.device = OPF_DEVICE_CUDA;
    return opf_tensor_alloc(ctx, &s, out);
}

typedef struct copy_arg { void *dst; const void *src; size_t bytes; } copy_arg;
static opf_status run_copy(opf_ctx *ctx, void *p)
{
    copy_arg *a = p;
    return opf_cuda_copy(ctx, a->dst, a->src, a->bytes, OPF_CUDA_D2D);
}

static opf_status cuda_quantize(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                opf_tensor *out)
{
    opf_quantize_state qs = {0};
    opf_quantize_state_delayed(q, &qs);
    return opf_backend_get(OPF_DEVICE_CUDA)->quantize[q->scaling](ctx, q, in, out, &qs);
}

typedef struct quant_arg { const opf_quantizer *q; const opf_tensor *in; opf_tensor *out; } quant_arg;
static opf_status run_quant(opf_ctx *ctx, void *p)
{
    quant_arg *a = p;
    return cuda_quantize(ctx, a->q, a->in, a->out);
}

typedef struct gemm_arg { opf_gemm_args g; } gemm_arg;
static opf_status run_gemm(opf_ctx *ctx, void *p) { return opf_cuda_gemm(ctx, &((gemm_arg *)p)->g); }

static FILE *results;

static void record(const char *name, const char *unit, double v, const char *note)
{
    int digits = strcmp(unit, "ms") ? 1 : 3;
    printf("  %-32s %10.*f %-7s %s\n", name, digits, v, unit, note ? note : "");
    if (results) fprintf(results, "%s %.6g\n", name, v);
}

typedef struct qbench {
    const char *name;
    opf_scaling scaling;
    unsigned    usage;
    bool        delayed, mx2d;
    bool        rht;  /* NVFP4: the Hadamard transform on the columnwise copy */
} qbench;

#define ROW OPF_USAGE_ROWWISE
#define ROWCOL (OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE)
static const qbench qcases[] = {
    {"fp8_current_row", OPF_SCALING_TENSOR, ROW, false, false, false},
    {"fp8_current_rowcol", OPF_SCALING_TENSOR, ROWCOL, false, false, false},
    {"fp8_delayed_row", OPF_SCALING_TENSOR, ROW, true, false, false},
    {"fp8_delayed_rowcol", OPF_SCALING_TENSOR, ROWCOL, true, false, false},
    {"mxfp8_row", OPF_SCALING_MXFP8, ROW, false, false, false},
    {"mxfp8_rowcol", OPF_SCALING_MXFP8, ROWCOL, false, false, false},
    {"mxfp8_2d_rowcol", OPF_SCALING_MXFP8, ROWCOL, false, true, false},
    {"block1d_row", OPF_SCALING_BLOCK_1D, ROW, false, false, false},
    {"block1d_rowcol", OPF_SCALING_BLOCK_1D, ROWCOL, false, false, false},
    {"block2d_rowcol", OPF_SCALING_BLOCK_2D, ROWCOL, false, false, false},
    {"nvfp4_row", OPF_SCALING_NVFP4_1D, ROW, false, false, false},
    {"nvfp4_rowcol", OPF_SCALING_NVFP4_1D, ROWCOL, false, false, false},
    {"nvfp4_rht_rowcol", OPF_SCALING_NVFP4_1D, ROWCOL, false, false, true},
    {"nvfp4_2d_rowcol", OPF_SCALING_NVFP4_2D, ROWCOL, false, false, false},
};
#undef ROW
#undef ROWCOL

/* The sections `--only` names (NULL: all). */
static const char *only;
static bool wanted(const char *section) { return !only || strstr(only, section); }

static int bench_quantize(opf_ctx *ctx, int64_t M, int64_t K)
{
    opf_tensor x;
    if (opf_bench_cuda_random(ctx, M, K, OPF_BF16, 1.0f, &x)) return 1;
    size_t in_bytes = (size_t)(M * K) * 2;
    void *dst = NULL;
    if (opf_cuda_alloc(ctx, in_bytes, &dst)) return 1;
    copy_arg ca = {dst, x.data[OPF_COMP_DATA], in_bytes};
    double copy_ms;
    if (time_ms(ctx, run_copy, &ca, &copy_ms)) return 1;
    double copy_gbs = 2.0 * (double)in_bytes / copy_ms * 1e-6;
    printf("bf16 [%lld, %lld] -> FP8 / FP4 (GB/s = bytes read + written per s)\n",
           (long long)M, (long long)K);
    record("copy_gbs", "GB/s", copy_gbs, "device copy of the input bytes");
    opf_delayed_state *ds = NULL;
    if (opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, 16, OPF_AMAX_MAX, false, 1, &ds)) return 1;
    const qbench *cases = qcases;
    int rc = 0;
    for (size_t i = 0; i < sizeof qcases / sizeof qcases[0] && !rc && wanted("quantize"); i++) {
        opf_quantizer q = opf_quantizer_default();
        bool fp4 = cases[i].scaling == OPF_SCALING_NVFP4_1D || cases[i].scaling == OPF_SCALING_NVFP4_2D;
        q.scaling = cases[i].scaling, q.qdtype = fp4 ? OPF_E2M1 : OPF_E4M3, q.usage = cases[i].usage;
        q.rht = cases[i].rht;
        q.delayed = cases[i].delayed ? ds : NULL;
        q.mxfp8_2d = cases[i].mx2d;
        q.pow2_scales = cases[i].scaling == OPF_SCALING_BLOCK_1D ||
                        cases[i].scaling == OPF_SCALING_BLOCK_2D;  /* the recipe's default */
        opf_spec qs;
        opf_tensor out;
        if (opf_quantizer_spec(&q, &x.spec, &qs) || device_tensor(ctx, &qs, &out)) return 1;
        quant_arg qa = {&q, &x, &out};
        double ms;
        rc = time_ms(ctx, run_quant, &qa, &ms);
        int copies = q.usage == OPF_USAGE_ROWWISE ? 1 : 2;
        double gbs = ((double)in_bytes + copies * (double)(M * K) * (fp4 ? 0.5 : 1.0)) / ms * 1e-6;
        char note[64];
        snprintf(note, sizeof note, "%.3f ms, %.0f%% of copy", ms, 100.0 * gbs / copy_gbs);
        char name[64];
        snprintf(name, sizeof name, "%s_gbs", cases[i].name);
        if (!rc) record(name, "GB/s", gbs, note);
        opf_tensor_release(&out);
    }
    opf_cuda_sync(ctx);
    opf_delayed_state_destroy(ds);
    opf_cuda_free(ctx, dst);
    opf_tensor_release(&x);
    return rc;
}

typedef struct gbench {
    const char     *name;
    int             a, b;
    bool            split;
    opf_gemm_layout layout;
} gbench;

static int bench_gemm(opf_ctx *ctx, int64_t S)
{
    opf_tensor a, b, d;
    if (opf_bench_cuda_random(ctx, S, S, OPF_BF16, 1.0f, &a) || opf_bench_cuda_random(ctx, S, S, OPF_BF16, 1.0f, &b)) return 1;
    opf_spec ds = opf_spec_make(2, (int64_t[]){S, S}, OPF_BF16);
    if (device_tensor(ctx, &ds, &d)) return 1;
    /* A and B in each format, rowwise copies: per-tensor, block 2D, block
     * 1D, MXFP8, NVFP4 (index 0 is the bf16 tensor itself). */
    static const opf_scaling fmts[] = {OPF_SCALING_NONE,     OPF_SCALING_TENSOR,
                                       OPF_SCALING_BLOCK_2D, OPF_SCALING_BLOCK_1D,
                                       OPF_SCALING_MXFP8,    OPF_SCALING_NVFP4_1D};
    enum { NF = sizeof fmts / sizeof fmts[0] };
    opf_tensor qa[NF], qb[NF];
    qa[0] = a, qb[0] = b;
    for (int f = 1; f < NF; f++) {
        opf_quantizer q = opf_quantizer_default();
        q.scaling = fmts[f], q.usage = OPF_USAGE_ROWWISE;
        q.qdtype = fmts[f] == OPF_SCALING_NVFP4_1D ? OPF_E2M1 : OPF_E4M3;
        q.pow2_scales = f == 2 || f == 3;
        opf_spec qs;
        if (opf_quantizer_spec(&q, &a.spec, &qs) || device_tensor(ctx, &qs, &qa[f]) ||
            device_tensor(ctx, &qs, &qb[f]) || cuda_quantize(ctx, &q, &a, &qa[f]) ||
            cuda_quantize(ctx, &q, &b, &qb[f]))
            return 1;
    }
    printf("GEMM %lld^3 (TN unless named), bf16 output (TFLOP/s)\n", (long long)S);
    static const gbench cases[] = {
        {"gemm_bf16_tflops", 0, 0, false, OPF_GEMM_TN},
        /* a Linear's bf16 dgrad and wgrad layouts (and MXFP8's decoded GEMMs) */
        {"gemm_bf16_nn_tflops", 0, 0, false, OPF_GEMM_NN},
        {"gemm_bf16_nt_tflops", 0, 0, false, OPF_GEMM_NT},
        {"gemm_fp8_fast_tflops", 1, 1, false, OPF_GEMM_TN},
        {"gemm_fp8_split_tflops", 1, 1, true, OPF_GEMM_TN},
        {"gemm_block_1x2_tflops", 2, 3, true, OPF_GEMM_TN},   /* A (weight) 128x128, B 1x128 */
        {"gemm_block_1x1_tflops", 3, 3, true, OPF_GEMM_TN},
        {"gemm_mxfp8_tflops", 4, 4, true, OPF_GEMM_TN},       /* dequantize + bf16 GEMM */
        {"gemm_nvfp4_tflops", 5, 5, true, OPF_GEMM_TN},       /* dequantize + bf16 GEMM */
    };
    int rc = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0] && !rc; i++) {
        opf_gemm_options o = opf_gemm_options_default();
        o.split_accumulator = cases[i].split;
        gemm_arg ga = {{&qa[cases[i].a], &qb[cases[i].b], cases[i].layout, &o, &d, S, S, S, {0}}};
        double ms;
        rc = time_ms(ctx, run_gemm, &ga, &ms);
        char note[32];
        snprintf(note, sizeof note, "%.3f ms", ms);
        if (!rc) record(cases[i].name, "TFLOP/s", 2.0 * (double)S * S * S / ms * 1e-9, note);
    }
    for (int f = 0; f < NF; f++) {
        opf_tensor_release(&qa[f]);
        opf_tensor_release(&qb[f]);
    }
    opf_tensor_release(&d);
    return rc;
}

/* ---- norms and activations: bf16 [8192, 4096] norms, f32 activations
 * (the act entries take fp32), GB/s = bytes read + written per s ------- */
enum { NA_ROWS = 8192, NA_H = 4096 };

typedef struct norm_arg {
    int         bwd;  /* 0 LayerNorm fwd, 1 LayerNorm bwd, 2 RMSNorm fwd */
    opf_tensor *x, *g, *b, *z, *mu, *rs, *dz, *dx, *dg, *db;
} norm_arg;
static opf_status run_norm(opf_ctx *ctx, void *p)
{
    norm_arg *a = p;
    const opf_norm_kernels *K = opf_backend_get(OPF_DEVICE_CUDA)->norm;
    if (a->bwd == 1)
        return K->layernorm_bwd(ctx, a->dz, a->x, a->mu, a->rs, a->g, false, NULL, a->dx, a->dg,
                                a->db);
    if (a->bwd == 2) return K->rmsnorm_fwd(ctx, a->x, a->g, 1e-5f, false, a->z, a->rs);
    return K->layernorm_fwd(ctx, a->x, a->g, a->b, 1e-5f, false, a->z, a->mu, a->rs);
}

typedef struct act_arg {
    opf_act_kind k;
    bool         bwd;
    const float *x, *dy;
    float       *y;
    int64_t      cols;
} act_arg;
static opf_status run_act(opf_ctx *ctx, void *p)
{
    act_arg *a = p;
    const opf_act_kernels *K = opf_backend_get(OPF_DEVICE_CUDA)->act;
    opf_act_params prm = {1.0f, 0.0f};
    return a->bwd ? K->bwd(ctx, a->k, prm, a->x, a->dy, a->y, NA_ROWS, a->cols)
                  : K->fwd(ctx, a->k, prm, a->x, a->y, NA_ROWS, a->cols);
}

/* Times fn and records name in GB/s for `bytes` moved. */
static int record_gbs(opf_ctx *ctx, const char *name, bench_fn fn, void *arg, double bytes)
{
    double ms;
    if (time_ms(ctx, fn, arg, &ms)) return 1;
    char note[32];
    snprintf(note, sizeof note, "%.3f ms", ms);
    record(name, "GB/s", bytes / ms * 1e-6, note);
    return 0;
}

static int bench_norm_act(opf_ctx *ctx)
{
    const int64_t M = NA_ROWS, H = NA_H, n = M * H;
    opf_tensor t[12];
    memset(t, 0, sizeof t);
    opf_spec row = opf_spec_make(1, (int64_t[]){M}, OPF_F32);
    opf_spec vec = opf_spec_make(1, (int64_t[]){H}, OPF_BF16);
    opf_spec mat = opf_spec_make(2, (int64_t[]){M, H}, OPF_BF16);
    if (opf_bench_cuda_random(ctx, M, H, OPF_BF16, 1.0f, &t[0]) || opf_bench_cuda_random(ctx, 1, H, OPF_BF16, 1.0f, &t[1]) ||
        opf_bench_cuda_random(ctx, M, H, OPF_BF16, 1.0f, &t[2]) || device_tensor(ctx, &mat, &t[3]) ||
        device_tensor(ctx, &mat, &t[4]) || device_tensor(ctx, &row, &t[5]) ||
        device_tensor(ctx, &row, &t[6]) || device_tensor(ctx, &vec, &t[7]) ||
        device_tensor(ctx, &vec, &t[8]) || opf_bench_cuda_random(ctx, M, 2 * H, OPF_F32, 1.0f, &t[9]) ||
        opf_bench_cuda_random(ctx, M, 2 * H, OPF_F32, 1.0f, &t[10]) || device_tensor(ctx, &t[9].spec, &t[11]))
        return 1;
    t[1].spec.ndim = 1, t[1].spec.shape[0] = H;  /* gamma and beta: [H] */
    printf("norms bf16 [%lld, %lld], activations fp32 (GB/s = bytes read + written per s)\n",
           (long long)M, (long long)H);
    norm_arg na = {0, &t[0], &t[1], &t[1], &t[3], &t[5], &t[6], &t[2], &t[4], &t[7], &t[8]};
    double b2 = 2.0 * (double)n, b4 = 4.0 * (double)n;
    int rc = record_gbs(ctx, "layernorm_fwd_gbs", run_norm, &na, 2 * b2);
    na.bwd = 1;
    rc = rc || record_gbs(ctx, "layernorm_bwd_gbs", run_norm, &na, 3 * b2);
    na.bwd = 2;
    rc = rc || record_gbs(ctx, "rmsnorm_fwd_gbs", run_norm, &na, 2 * b2);
    float *x = t[9].data[0], *dy = t[10].data[0], *y = t[11].data[0];
    act_arg aa[] = {{OPF_ACT_GELU, false, x, dy, y, H},
                    {OPF_ACT_GELU, true, x, dy, y, H},
                    {OPF_ACT_SWIGLU, false, x, dy, y, 2 * H},
                    {OPF_ACT_SWIGLU, true, x, dy, y, 2 * H}};
    const char *names[] = {"gelu_fwd_gbs", "gelu_bwd_gbs", "swiglu_fwd_gbs", "swiglu_bwd_gbs"};
    const double bytes[] = {2 * b4, 3 * b4, 3 * b4, 5 * b4};  /* SwiGLU: x [M, 2H], y [M, H] */
    for (int i = 0; i < 4 && !rc; i++) rc = record_gbs(ctx, names[i], run_act, &aa[i], bytes[i]);
    opf_cuda_sync(ctx);
    for (int i = 0; i < 12; i++) opf_tensor_release(&t[i]);
    return rc;
}

/* ---- fused outputs (qout.h): bf16 [8192, 4096] into current-scaling FP8
 * (both copies), fused and composed (OPF_CUDA_UNFUSED=1) in one run. GB/s
 * counts the bf16 read and the two FP8 copies written (dbias aside). */
typedef struct fused_arg {
    int               which;  /* 0 LayerNorm fwd_q, 1 GELU fwd_q, 2 GELU dact_dbias_q */
    const opf_tensor *x, *g, *dy;
    opf_tensor       *mu, *rs;
    const opf_qout   *o;
    float            *dbias;
} fused_arg;
static opf_status run_fused(opf_ctx *ctx, void *p)
{
    fused_arg *a = p;
    const opf_backend_i *be = opf_backend_get(OPF_DEVICE_CUDA);
    opf_act_params prm = {1.0f, 0.0f};
    if (a->which == 0)
        return be->norm->layernorm_fwd_q(ctx, a->x, a->g, a->g, 1e-5f, false, a->o, a->mu, a->rs);
    if (a->which == 1) return be->act->fwd_q(ctx, OPF_ACT_GELU, prm, a->x, a->o);
    return be->act->dact_dbias_q(ctx, OPF_ACT_GELU, prm, a->x, a->dy, a->o, a->dbias);
}

static int bench_fused(opf_ctx *ctx)
{
    const int64_t M = NA_ROWS, H = NA_H;
    opf_tensor t[6];
    memset(t, 0, sizeof t);
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    opf_spec qs, row = opf_spec_make(1, (int64_t[]){M}, OPF_F32);
    opf_spec db = opf_spec_make(1, (int64_t[]){H}, OPF_F32);
    if (opf_bench_cuda_random(ctx, M, H, OPF_BF16, 1.0f, &t[0]) || opf_bench_cuda_random(ctx, M, H, OPF_BF16, 1.0f, &t[1]) ||
        opf_bench_cuda_random(ctx, 1, H, OPF_BF16, 1.0f, &t[2]) || opf_quantizer_spec(&q, &t[0].spec, &qs) ||
        device_tensor(ctx, &qs, &t[3]) || device_tensor(ctx, &row, &t[4]) ||
        device_tensor(ctx, &row, &t[5]))
        return 1;
    t[2].spec.ndim = 1, t[2].spec.shape[0] = H;
    opf_tensor dbt = {0};
    if (device_tensor(ctx, &db, &dbt)) return 1;
    opf_qout o = {&t[3], &q, NULL, OPF_BF16};
    printf("fused outputs: bf16 [%lld, %lld] -> fp8 current scaling (both copies)\n",
           (long long)M, (long long)H);
    static const char *const names[2][3] = {
        {"layernorm_fwd_q_fp8cs_gbs", "gelu_fwd_q_fp8cs_gbs", "gelu_dact_dbias_q_fp8cs_gbs"},
        {"layernorm_fwd_q_fp8cs_unfused_gbs", "gelu_fwd_q_fp8cs_unfused_gbs",
         "gelu_dact_dbias_q_fp8cs_unfused_gbs"}};
    const double n = (double)(M * H), bytes[] = {4 * n, 4 * n, 6 * n};
    int rc = 0;
    for (int u = 0; u < 2 && !rc; u++) {
        if (u) setenv("OPF_CUDA_UNFUSED", "1", 1);
        for (int w = 0; w < 3 && !rc; w++) {
            fused_arg fa = {w, &t[0], &t[2], &t[1], &t[4], &t[5], &o, dbt.data[0]};
            rc = record_gbs(ctx, names[u][w], run_fused, &fa, bytes[w]);
        }
    }
    unsetenv("OPF_CUDA_UNFUSED");
    opf_cuda_sync(ctx);
    for (int i = 0; i < 6; i++) opf_tensor_release(&t[i]);
    opf_tensor_release(&dbt);
    return rc;
}

typedef struct ct_arg { const opf_tensor *x; opf_tensor *yt; } ct_arg;
static opf_status run_cast_transpose(opf_ctx *ctx, void *p)
{
    ct_arg *a = p;
    return opf_backend_get(OPF_DEVICE_CUDA)->elem->cast_transpose(ctx, a->x, NULL, a->yt);
}

enum { ADAMW_TENSORS = 100, ADAMW_N = 1000000 };
typedef struct adamw_arg { opf_optim_tensor t[ADAMW_TENSORS]; int64_t step; } adamw_arg;
static opf_status run_adamw(opf_ctx *ctx, void *p)
{
    adamw_arg *a = p;
    return opf_backend_get(OPF_DEVICE_CUDA)->optim->adamw(ctx, a->t, ADAMW_TENSORS, 1e-3f, 0.9f,
                                                           0.999f, 1e-8f, 0.01f, ++a->step, NULL);
}

/* AdamW's GB/s counts the 28 bytes a parameter must move (gradient, weight
 * and moments read; weight and moments written), as for the PyTorch peer;
 * opfuse also writes the parameter copy (32 bytes). */
static int bench_adamw(opf_ctx *ctx)
{
    static adamw_arg a;
    void *mem[ADAMW_TENSORS][5] = {{0}};
    size_t bytes = (size_t)ADAMW_N * sizeof(float);
    int rc = 0;
    for (int k = 0; k < ADAMW_TENSORS && !rc; k++) {
        for (int b = 0; b < 5 && !rc; b++)
            rc = opf_cuda_alloc(ctx, bytes, &mem[k][b]) || opf_cuda_memset(ctx, mem[k][b], b < 2 ? 0x3C : 0, bytes);
        a.t[k] = (opf_optim_tensor){.grad = mem[k][0], .grad_dtype = OPF_F32, .master = mem[k][1],
                                    .m = mem[k][2], .v = mem[k][3], .param = mem[k][4],
                                    .param_dtype = OPF_F32, .n = ADAMW_N};
    }
    double ms = 0;
    if (!rc) rc = time_ms(ctx, run_adamw, &a, &ms);
    char note[64];
    snprintf(note, sizeof note, "%.3f ms, %d x %d fp32", ms, ADAMW_TENSORS, ADAMW_N);
    if (!rc) record("adamw_100m_gbs", "GB/s", 28.0 * ADAMW_TENSORS * ADAMW_N / ms * 1e-6, note);
    opf_cuda_sync(ctx);
    for (int k = 0; k < ADAMW_TENSORS; k++)
        for (int b = 0; b < 5; b++) opf_cuda_free(ctx, mem[k][b]);
    return rc;
}

static int bench_elem(opf_ctx *ctx, int64_t M, int64_t K)
{
    opf_tensor x, yt;
    opf_spec ts = opf_spec_make(2, (int64_t[]){K, M}, OPF_BF16);
    if (opf_bench_cuda_random(ctx, M, K, OPF_BF16, 1.0f, &x) || device_tensor(ctx, &ts, &yt)) return 1;
    printf("element-wise and optimizer (GB/s = bytes read + written per s)\n");
    ct_arg ca = {&x, &yt};
    double ms;
    int rc = time_ms(ctx, run_cast_transpose, &ca, &ms);
    char note[32];
    snprintf(note, sizeof note, "%.3f ms", ms);
    if (!rc) record("cast_transpose_bf16_gbs", "GB/s", 4.0 * (double)(M * K) / ms * 1e-6, note);
    opf_tensor_release(&x);
    opf_tensor_release(&yt);
    return rc || bench_adamw(ctx);
}

/* ---- causal attention: qkv [B, T, 3C] at GPT-2 small's shape, fp32 per
 * path of OPF_CUDA_ATTENTION, and flash, flash2, flash1p, cudnn and cudnn-atomic with
 * qkv, o, do and dqkv stored in bf16, its logical dtype (their 16-bit kernels,
 * as a bf16 model calls them); the FLOP counts are the causal half's (the
 * backward's five products 2.5 times the forward's two). ------------------ */
enum { AT_B = 16, AT_T = 1024, AT_H = 12, AT_D = 64 };

typedef struct attn_arg {
    bool        bwd;
    opf_dtype   dt;  /* the logical and storage dtype of qkv, do and dqkv */
    const void *qkv, *dout;
    void       *o;  /* stored as dt, as the attention op saves it */
    float      *lse;
    void       *dqkv;
} attn_arg;
static opf_status run_attn(opf_ctx *ctx, void *p)
{
    attn_arg *a = p;
    const opf_nn_kernels *K = opf_backend_get(OPF_DEVICE_CUDA)->nn;
    opf_status st = K->attn_fwd(ctx, a->qkv, a->dt, a->o, a->dt, a->lse, AT_B, AT_T, AT_H, AT_D,
                                a->dt);
    if (st || !a->bwd) return st;
    return K->attn_bwd(ctx, a->qkv, a->dt, a->o, a->dt, a->lse, a->dout, a->dt, a->dqkv, a->dt,
                       AT_B, AT_T, AT_H, AT_D, a->dt);
}

/* qkv, do and dqkv of dtype dt into t[0], t[1], t[2]. */
static int attn_tensors(opf_ctx *ctx, opf_dtype dt, opf_tensor t[3])
{
    const int64_t rows = AT_B * AT_T, C = AT_H * AT_D;
    opf_spec sq = opf_spec_make(2, (int64_t[]){rows, 3 * C}, dt);
    return opf_bench_cuda_random(ctx, rows, 3 * C, dt, 1.0f, &t[0]) || opf_bench_cuda_random(ctx, rows, C, dt, 1.0f, &t[1]) ||
           device_tensor(ctx, &sq, &t[2]);
}

/* Whether cuDNN loads (the cudnn rows), printing its version or why not. */
static bool cudnn_here(void)
{
    size_t v = 0;
    if (opf_cuda_cudnn_version(NULL, &v)) {
        printf("skipped cudnn_bf16: %s\n", opf_last_error(NULL));
        return false;
    }
    printf("cuDNN %zu.%zu.%zu (libcudnn.so.9)\n", v / 10000, v / 100 % 100, v % 100);
    return true;
}

static int bench_attn(opf_ctx *ctx)
{
    const int64_t rows = AT_B * AT_T, C = AT_H * AT_D;
    opf_tensor t[8];  /* f32 qkv, do, dqkv; bf16 qkv, do, dqkv; o (f32: room for either), lse */
    memset(t, 0, sizeof t);
    opf_spec so = opf_spec_make(2, (int64_t[]){rows, C}, OPF_F32);
    opf_spec sl = opf_spec_make(1, (int64_t[]){AT_B * AT_H * AT_T}, OPF_F32);
    if (attn_tensors(ctx, OPF_F32, t) || attn_tensors(ctx, OPF_BF16, t + 3) ||
        device_tensor(ctx, &so, &t[6]) || device_tensor(ctx, &sl, &t[7]))
        return 1;
    printf("causal attention, B %d T %d H %d D %d (ms a call)\n", AT_B, AT_T, AT_H, AT_D);
    /* the path, the dtype of qkv, do and dqkv, the row's suffix */
    static const char *const paths[] = {"gemm",    "flash", "flash",       "flash2",
                                        "flash1p", "cudnn", "cudnn-atomic"};
    static const opf_dtype dts[] = {OPF_F32,  OPF_F32,  OPF_BF16, OPF_BF16,
                                    OPF_BF16, OPF_BF16, OPF_BF16};
    static const char *const tags[] = {"gemm",         "flash",      "flash_bf16",
                                       "flash2_bf16",  "flash1p_bf16", "cudnn_bf16",
                                       "cudnn_atomic_bf16"};
    const double fwd_flop = 2.0 * AT_B * AT_H * (double)AT_T * AT_T * AT_D;
    int rc = 0;
    for (int p = 0; p < (int)(sizeof paths / sizeof paths[0]) && !rc; p++) {
        if (!strncmp(paths[p], "cudnn", 5) && !cudnn_here()) continue;
        setenv("OPF_CUDA_ATTENTION", paths[p], 1);
        const opf_tensor *io = dts[p] == OPF_F32 ? t : t + 3;
        for (int b = 0; b < 2 && !rc; b++) {
            attn_arg a = {b, dts[p], io[0].data[0], io[1].data[0], t[6].data[0], t[7].data[0],
                          io[2].data[0]};
            double ms;
            rc = time_ms(ctx, run_attn, &a, &ms);
            char name[48], note[48];
            snprintf(name, sizeof name, "attn_%s_%s_ms", b ? "fwdbwd" : "fwd", tags[p]);
            snprintf(note, sizeof note, "%.1f TFLOP/s", (b ? 3.5 : 1.0) * fwd_flop / ms * 1e-9);
            if (!rc) record(name, "ms", ms, note);
        }
    }
    unsetenv("OPF_CUDA_ATTENTION");
    opf_cuda_sync(ctx);
    for (int i = 0; i < 8; i++) opf_tensor_release(&t[i]);
    return rc;
}

/* ---- softmax cross-entropy at GPT-2 small's logits: 16 x 1024 rows of
 * its padded vocabulary (50304), bf16 logits and dx, the forward (lse and
 * the loss) and the forward + backward, in ms. ------------------------------ */
enum { XE_ROWS = 16 * 1024, XE_V = 50304 };

typedef struct xent_arg {
    bool           bwd;
    const void    *x;
    const int32_t *tgt;
    float         *lse, *loss;
    const float   *dloss;
    void          *dx;
} xent_arg;
static opf_status run_xent(opf_ctx *ctx, void *p)
{
    xent_arg *a = p;
    const opf_nn_kernels *K = opf_backend_get(OPF_DEVICE_CUDA)->nn;
    opf_status st = K->xent_fwd(ctx, a->x, OPF_BF16, a->tgt, a->lse, a->loss, XE_ROWS, XE_V);
    if (st || !a->bwd) return st;
    return K->xent_bwd(ctx, a->x, OPF_BF16, a->tgt, a->lse, a->dloss, a->dx, OPF_BF16, XE_ROWS,
                       XE_V);
}

static int bench_xent(opf_ctx *ctx)
{
    opf_tensor x, dx;
    opf_spec sd = opf_spec_make(2, (int64_t[]){XE_ROWS, XE_V}, OPF_BF16);
    if (opf_bench_cuda_random(ctx, XE_ROWS, XE_V, OPF_BF16, 1.0f, &x) || device_tensor(ctx, &sd, &dx)) return 1;
    int32_t *tgt = malloc(sizeof(int32_t) * XE_ROWS);
    uint32_t r = 12345u;
    for (int i = 0; i < XE_ROWS; i++) r = r * 1664525u + 1013904223u, tgt[i] = (int32_t)(r % XE_V);
    const float one = 1.0f;
    void *gt = NULL, *gf = NULL;  /* targets; lse, loss and dloss */
    int rc = opf_cuda_alloc(ctx, sizeof(int32_t) * XE_ROWS, &gt) ||
             opf_cuda_alloc(ctx, sizeof(float) * (XE_ROWS + 2), &gf) ||
             opf_cuda_copy(ctx, gt, tgt, sizeof(int32_t) * XE_ROWS, OPF_CUDA_H2D) ||
             opf_cuda_copy(ctx, (float *)gf + XE_ROWS + 1, &one, sizeof one, OPF_CUDA_H2D);
    free(tgt);
    printf("softmax cross-entropy, %d rows x V %d, bf16 logits and dx (ms a call)\n", XE_ROWS,
           XE_V);
    const double gb = (double)XE_ROWS * XE_V * 2 * 1e-9;  /* the logits' GB */
    for (int b = 0; b < 2 && !rc; b++) {
        xent_arg a = {b, x.data[0], gt, gf, (float *)gf + XE_ROWS, (float *)gf + XE_ROWS + 1,
                      dx.data[0]};
        double ms;
        rc = time_ms(ctx, run_xent, &a, &ms);
        char note[64];
        snprintf(note, sizeof note, "%.0f GB/s of logits read and dx written", (b ? 3 : 1) * gb / ms * 1e3);
        if (!rc) record(b ? "xent_fwdbwd_bf16_ms" : "xent_fwd_bf16_ms", "ms", ms, note);
    }
    opf_cuda_sync(ctx);
    opf_cuda_free(ctx, gt);
    opf_cuda_free(ctx, gf);
    opf_tensor_release(&x);
    opf_tensor_release(&dx);
    return rc;
}

int opf_bench_cuda(int argc, char **argv)
{
    const char *out_path;
    opf_ctx *ctx;
    int64_t d[3] = {8192, 8192, 8192};  /* M K of the element-wise passes, S of the GEMMs */
    int rc = opf_bench_cuda_open("cuda", argc, argv, &out_path, &only, d, 3, &ctx);
    if (!ctx) return rc;
    int64_t M = d[0], K = d[1], S = d[2];
    results = out_path ? fopen(out_path, "w") : NULL;
    rc = bench_quantize(ctx, M, K) || (wanted("gemm") && bench_gemm(ctx, S)) ||
         (wanted("norm") && (bench_norm_act(ctx) || bench_fused(ctx))) ||
         (wanted("elem") && bench_elem(ctx, M, K)) || (wanted("attn") && bench_attn(ctx)) ||
         (wanted("xent") && bench_xent(ctx));
    if (rc) fprintf(stderr, "bench cuda: %s\n", opf_last_error(ctx));
    if (results) fclose(results);
    results = NULL;
    opf_ctx_destroy(ctx);
    return rc;
}
#endif
