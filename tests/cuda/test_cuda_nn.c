/* test_cuda_nn.c: the nn kernels on the GPU (src/backend/cuda/nn.cu)
 * against the CPU reference (opf_cpu_nn) on the same inputs, byte for byte
 * (two NaNs count as equal: nn.cu's NaN exception): embedding forward and
 * backward with repeated tokens and a bad token, causal attention forward
 * and backward on each path of OPF_CUDA_ATTENTION (exact byte for byte,
 * gemm, flash, flash2, flash1p and cudnn within bounds, the tiled ones the
 * same bytes when run twice; cudnn skipped, saying why, where cuDNN does not
 * load; T = 1, T not a multiple of 32, 64
 * or 128, heads 1..12, D = 1, 64, 128 and past one pass of 256; f32 qkv,
 * and bf16 and f16 for the 16-bit kernels, stored as f32 and as themselves
 * (the same bits); an unknown path is an error),
 * cross-entropy with ignored targets, vocabularies of 50257 and 50304 (rows
 * of any alignment; whole 16-byte vectors) and shorter rows, sumsq per
 * dtype, clipping's sumsq_acc and clip_scale; and the device expf/logf
 * against the host's libm. OPF_TEST_QUICK=1 (under compute-sanitizer)
 * leaves out the attention cases of T >= 1000: the chunked backward of
 * T = 8192 among them, every other path on the shorter cases. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#define _POSIX_C_SOURCE 200809L  /* setenv */
#include <stdlib.h>

#include "cuda_test.h"

/* ---- device buffers ---------------------------------------------------------- */

/* Device memory of bytes, holding h's when h is not NULL. */
static void *dev_from(opf_ctx *ctx, const void *h, size_t bytes)
{
    void *d = NULL;
    CHECK_OK(ctx, opf_cuda_alloc(ctx, bytes ? bytes : 4, &d));
    if (h && bytes) CHECK_OK(ctx, opf_cuda_copy(ctx, d, h, bytes, OPF_CUDA_H2D));
    return d;
}

static void host_from(opf_ctx *ctx, void *h, const void *d, size_t bytes)
{
    if (bytes) CHECK_OK(ctx, opf_cuda_copy(ctx, h, d, bytes, OPF_CUDA_D2H));
}

static float *fvec(int64_t n) { return calloc((size_t)(n ? n : 1), sizeof(float)); }

/* Random values around scale; one in `every` an edge value (inf and NaN
 * too when special). */
static float *frand(int64_t n, float scale, int every, bool special)
{
    float *x = fvec(n);
    for (int64_t i = 0; i < n; i++) x[i] = scale * cuda_test_unit();
    if (every)
        for (int64_t i = 0; i < n; i++)
            if (cuda_test_u32() % (uint32_t)every == 0) x[i] = cuda_test_edge(special);
    return x;
}

static bool same_f32(float a, float b)
{
    uint32_t ua, ub;
    memcpy(&ua, &a, 4), memcpy(&ub, &b, 4);
    return ua == ub || (isnan(a) && isnan(b));
}

/* got (device) byte for byte with ref (host): every mismatch counted, the
 * first few printed with their index. */
/* got (host copies of the GPU's values) against ref, bit for bit. */
static void check_same(const char *what, const float *ref, const float *got, int64_t n)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!same_f32(got[i], ref[i]) && bad++ < 4)
            fprintf(stderr, "  %s [%lld]: gpu %a cpu %a\n", what, (long long)i, (double)got[i],
                    (double)ref[i]);
    CHECK(bad == 0, "%s: %lld of %lld values differ", what, (long long)bad, (long long)n);
}

static void expect_same(opf_ctx *ctx, const char *what, const float *ref, const float *dev,
                        int64_t n)
{
    float *got = fvec(n);
    host_from(ctx, got, dev, sizeof(float) * (size_t)n);
    check_same(what, ref, got, n);
    free(got);
}

/* ---- embedding --------------------------------------------------------------- */

/* The forward captured as a device graph with a bad token at row rows - 2:
 * the call reads nothing back, the replay's next wait (opf_ctx_sync)
 * reports the row and the id once, the bad row is NaN and the others are
 * the CPU's (ref, from the good tokens). */
static void embed_captured_bad(opf_ctx *ctx, const int32_t *gtok, const float *gwte,
                               const float *gwpe, float *gy, const float *ref, int64_t rows,
                               int64_t T, int64_t C, int64_t V, const char *want)
{
    opf_cuda_graph *cg = NULL;
    CHECK_OK(ctx, opf_cuda_capture_begin(ctx));
    opf_status cst = opf_cuda_nn.embed_fwd(ctx, gtok, gwte, gwpe, gy, rows, T, C, V);
    opf_status est = opf_cuda_capture_end(ctx, &cg);
    CHECK(cst == OPF_OK && est == OPF_OK && cg, "captured embed_fwd: %s / %s: %s",
          opf_status_str(cst), opf_status_str(est), opf_last_error(ctx));
    if (!cg) return;
    CHECK_OK(ctx, opf_cuda_graph_launch(ctx, cg));
    CHECK_FAILS(ctx, opf_ctx_sync(ctx), OPF_ERR_INVALID_ARG, want, "replayed graph");
    CHECK_OK(ctx, opf_ctx_sync(ctx));  /* reported once */
    float *got = fvec(rows * C);
    host_from(ctx, got, gy, sizeof(float) * (size_t)(rows * C));
    int64_t bad_nan = 0, good_diff = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < C; c++) {
            float g = got[r * C + c];
            if (r == rows - 2) bad_nan += isnan(g);
            else good_diff += !same_f32(g, ref[r * C + c]);
        }
    CHECK(bad_nan == C && good_diff == 0, "captured embed_fwd: bad row %lld of %lld NaN, %lld "
          "other values differ from the CPU", (long long)bad_nan, (long long)C,
          (long long)good_diff);
    free(got);
    opf_cuda_graph_free(ctx, cg);
}

static void embed_case(opf_ctx *ctx, int64_t B, int64_t T, int64_t C, int64_t V, int64_t P,
                       int64_t distinct)
{
    int64_t rows = B * T;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(rows ? rows : 1));
    for (int64_t r = 0; r < rows; r++)  /* few distinct ids: long runs of one token */
        tok[r] = (int32_t)((cuda_test_u32() % (uint32_t)distinct) * (uint32_t)(V / distinct));
    float *wte = frand(V * C, 1.0f, 23, true), *wpe = frand(P * C, 1.0f, 31, false);
    float *dy = frand(rows * C, 2.0f, 17, false);
    float *y = fvec(rows * C), *dwte = fvec(V * C), *dwpe = fvec(P * C);
    int32_t *gtok = dev_from(ctx, tok, sizeof(int32_t) * (size_t)rows);
    float *gwte = dev_from(ctx, wte, sizeof(float) * (size_t)(V * C));
    float *gwpe = dev_from(ctx, wpe, sizeof(float) * (size_t)(P * C));
    float *gdy = dev_from(ctx, dy, sizeof(float) * (size_t)(rows * C));
    float *gy = dev_from(ctx, NULL, sizeof(float) * (size_t)(rows * C));
    float *gdwte = dev_from(ctx, NULL, sizeof(float) * (size_t)(V * C));
    float *gdwpe = dev_from(ctx, NULL, sizeof(float) * (size_t)(P * C));
    printf("  embedding rows %lld T %lld C %lld V %lld P %lld (%lld ids)\n", (long long)rows,
           (long long)T, (long long)C, (long long)V, (long long)P, (long long)distinct);
    CHECK_OK(ctx, opf_cpu_nn.embed_fwd(ctx, tok, wte, wpe, y, rows, T, C, V));
    CHECK_OK(ctx, opf_cuda_nn.embed_fwd(ctx, gtok, gwte, gwpe, gy, rows, T, C, V));
    expect_same(ctx, "embed_fwd y", y, gy, rows * C);
    CHECK_OK(ctx, opf_cpu_nn.embed_bwd(ctx, tok, dy, dwte, dwpe, rows, T, C, V, P));
    CHECK_OK(ctx, opf_cuda_nn.embed_bwd(ctx, gtok, gdy, gdwte, gdwpe, rows, T, C, V, P));
    expect_same(ctx, "embed_bwd dwte", dwte, gdwte, V * C);
    expect_same(ctx, "embed_bwd dwpe", dwpe, gdwpe, P * C);
    if (rows > 2) {  /* a token past the vocabulary: the error names the row and the id */
        int32_t badtok = (int32_t)V;
        CHECK_OK(ctx, opf_cuda_copy(ctx, gtok + rows - 2, &badtok, 4, OPF_CUDA_H2D));
        char want[64];
        snprintf(want, sizeof want, "token %d at row %lld", (int)V, (long long)(rows - 2));
        CHECK_FAILS(ctx, opf_cuda_nn.embed_fwd(ctx, gtok, gwte, gwpe, gy, rows, T, C, V),
                    OPF_ERR_INVALID_ARG, want, "outside the vocabulary");
        embed_captured_bad(ctx, gtok, gwte, gwpe, gy, y, rows, T, C, V, want);
    }
    void *gs[] = {gtok, gwte, gwpe, gdy, gy, gdwte, gdwpe};
    for (int i = 0; i < 7; i++) opf_cuda_free(ctx, gs[i]);
    void *hs[] = {tok, wte, wpe, dy, y, dwte, dwpe};
    for (int i = 0; i < 7; i++) free(hs[i]);
}

static void test_embedding(opf_ctx *ctx)
{
    embed_case(ctx, 3, 37, 77, 50, 40, 9);
    embed_case(ctx, 1, 1, 5, 3, 1, 1);
    embed_case(ctx, 2, 64, 768, 50257, 64, 4);      /* GPT-2's vocabulary, 4 ids repeated */
    embed_case(ctx, 4, 100, 33, 50257, 128, 50257);
}

/* ---- attention ---------------------------------------------------------------- */

/* The attention paths (OPF_CUDA_ATTENTION; NULL: unset, the default: auto,
 * cuDNN where it loads, else flash2) and their bounds against the
 * CPU, as fractions of the largest |value| of the reference (0: bit for
 * bit), per logical dtype of qkv (f32, bf16, f16).
 *  - gemm: fp32 GEMMs; only the order of the sums differs.
 *  - flash, f32 inputs: q, k, v, do, p and ds enter the tensor cores
 *    rounded to TF32 (10 mantissa bits, unit roundoff u = 2^-11 ~ 4.9e-4);
 *    a product of two rounded values is off by up to 2u relative, and the
 *    sums over D and over keys average the signs, so o and dqkv land near u
 *    of their largest value (about 2.5e-4 .. 5e-4 at the shapes below). The
 *    error of a score grows with |q| |k|, hence query/key values at most 2
 *    here. Bounds with 4x room: 2e-3 for o and lse, 5e-3 for dqkv (whose
 *    ds = p (dp - D_i) subtracts and whose products chain twice).
 *  - flash, bf16 inputs (q, k, v and do drawn as bf16 values, so the CPU
 *    sees the same inputs and the scores are exact products summed in
 *    fp32): only p (for P V and P^T dO) and ds (for dS K and dS^T Q) are
 *    rounded, to bf16 (7 mantissa bits, u = 2^-8 ~ 3.9e-3). o is an average
 *    of v weighted by rounded p: off by at most u of its largest |v|, less
 *    as the signs average; lse takes the fp32 sum of p, so it is as close
 *    as the fp32 kernels'. dq, dk, dv sum products with one rounded factor
 *    each (dk, dq a ds whose fp32 difference rounds once), again below u of
 *    their largest value. A float64 model of exactly these roundings at
 *    the shapes below gives 0.9e-3 .. 1.2e-3 for o and 1.7e-3 .. 2.4e-3 for
 *    dqkv. Bounds with 4x room: 5e-3 for o and lse, 1e-2 for dqkv.
 *  - flash, f16 inputs: the same with f16 (10 mantissa bits, u = 2^-11);
 *    the model gives 1.0e-4 .. 1.4e-4 for o, 2.0e-4 .. 2.7e-4 for dqkv;
 *    bounds 1e-3 and 2e-3 (p and ds below f16's normal range, 6e-5, lose
 *    bits but never more than 2^-25 absolutely).
 *  - flash2: flash's bounds. Its 16-bit kernels round the same values (p
 *    and ds, from fp32 scores of exact inputs) and sum in another order; its
 *    f32 path is flash's.
 *  - flash1p: flash2's forward and bounds; its 16-bit backward adds dq's
 *    parts of each 128-key tile in fp32 across blocks (ordered by counters),
 *    the same rounded ds in another order.
 *  - cudnn: flash2's bounds. cuDNN's flash attention rounds the same p and
 *    ds; it also writes o and dqkv in the 16-bit dtype (each value rounded
 *    once more: up to u/2 of the largest, 2e-3 for bf16, so o lands within
 *    about 3.2e-3 and dqkv 4.5e-3 of bf16's model, under 5e-3 and 1e-2) and
 *    sums D_i from o rounded to it. Where it does not run (f32 qkv, T 1)
 *    flash2 does. cudnn-atomic: the same bounds (dQ summed in fp32 in
 *    another order).
 *  - the default: cudnn's bounds where cuDNN loads, flash2's (the same)
 *    where not.
 * D other than 64 and 128 falls back to gemm (cudnn: D a multiple of 8 up
 * to 128 runs on cuDNN), well within every bound.
 * twice: the backward's bytes repeat, checked by running it again and, for
 * 16-bit storage, against the f32-storage run (the tiled paths, whose sums
 * are in a fixed order; flash1p's across blocks too; cudnn's deterministic
 * backward). cudnn-atomic's backward adds dQ with atomics: checked against
 * the CPU's only. */
typedef struct attn_path_case {
    const char *env;
    double      tol_o[3], tol_dqkv[3];  /* by dtype: f32, bf16, f16 */
    bool        twice;
} attn_path_case;
static const attn_path_case attn_paths[] = {
    {"exact", {0, 0, 0}, {0, 0, 0}, false},
    {"gemm", {2e-5, 2e-5, 2e-5}, {1e-4, 1e-4, 1e-4}, false},
    {NULL, {2e-3, 5e-3, 1e-3}, {5e-3, 1e-2, 2e-3}, true},
    {"flash", {2e-3, 5e-3, 1e-3}, {5e-3, 1e-2, 2e-3}, true},
    {"flash2", {2e-3, 5e-3, 1e-3}, {5e-3, 1e-2, 2e-3}, true},
    {"flash1p", {2e-3, 5e-3, 1e-3}, {5e-3, 1e-2, 2e-3}, true},
    {"cudnn", {2e-3, 5e-3, 1e-3}, {5e-3, 1e-2, 2e-3}, true},
    {"cudnn-atomic", {2e-3, 5e-3, 1e-3}, {5e-3, 1e-2, 2e-3}, false},
};

/* Whether cuDNN can run here (OPF_CUDA_ATTENTION=cudnn's cases); the first
 * call says why not ("SKIP cudnn: ..."), and which cuDNN otherwise. */
static bool cudnn_usable(void)
{
    static int state = -1;  /* -1 unknown, 0 no, 1 yes */
    if (state < 0) {
        size_t v = 0;
        state = opf_cuda_cudnn_version(NULL, &v) == OPF_OK;
        if (state) printf("  cudnn: cuDNN %zu.%zu.%zu\n", v / 10000, v / 100 % 100, v % 100);
        else printf("SKIP cudnn: %s\n", opf_last_error(NULL));
    }
    return state == 1;
}

static bool attn_path_runs(const attn_path_case *pc)
{
    return !pc->env || strncmp(pc->env, "cudnn", 5) || cudnn_usable();
}

static int dtype_slot(opf_dtype dt) { return dt == OPF_BF16 ? 1 : dt == OPF_F16 ? 2 : 0; }

/* n values around scale, exact in dt (bf16 and f16: rounded to it). */
static float *frand_dt(int64_t n, float scale, opf_dtype dt)
{
    float *x = frand(n, scale, 0, false);
    for (int64_t i = 0; i < n; i++)
        if (dt == OPF_BF16) x[i] = opf_bf16_to_f32(opf_f32_to_bf16(x[i]));
        else if (dt == OPF_F16) x[i] = opf_f16_to_f32(opf_f32_to_f16(x[i]));
    return x;
}

/* Where element at of an attention array lies: (b, t, column) of [B, T,
 * cols] (qkv's columns as q / k / v, head, d), or (b, h, t) of lse. */
static void attn_where(char *buf, size_t n, int64_t at, int64_t T, int64_t H, int64_t D,
                       int64_t cols)
{
    if (!cols) {
        snprintf(buf, n, "b %lld h %lld t %lld", (long long)(at / T / H), (long long)(at / T % H),
                 (long long)(at % T));
        return;
    }
    int64_t c = at % cols, C = H * D, part = cols == C ? 0 : c / C;
    snprintf(buf, n, "b %lld t %lld %s head %lld d %lld", (long long)(at / cols / T),
             (long long)(at / cols % T), cols == C ? "o" : part == 0 ? "q" : part == 1 ? "k" : "v",
             (long long)(c % C / D), (long long)(c % D));
}

/* got against ref (both host) within tol of ref's largest magnitude (tol
 * 0: byte for byte); a failure names the shape, the path and the worst
 * element with its place. */
static void check_attn(const char *name, const float *ref, const float *got, int64_t n, double tol,
                       int64_t T, int64_t H, int64_t D, int64_t cols)
{
    if (tol == 0) {
        check_same(name, ref, got, n);
        return;
    }
    double big = 0, err = 0;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) big = fmax(big, fabs((double)ref[i]));
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - (double)ref[i]);
        if (!(e <= err)) err = e, at = i;  /* NaN counts as the worst */
    }
    char where[96];
    attn_where(where, sizeof where, at, T, H, D, cols);
    CHECK(err <= tol * (big > 0 ? big : 1), "%s: error %g at [%lld] (%s; gpu %g cpu %g), over %g "
          "of the largest |value| %g", name, err, (long long)at, where, n ? (double)got[at] : 0.0,
          n ? (double)ref[at] : 0.0, tol, big);
}

/* The same for got on the device: n values of dtype dt, widened. */
static void expect_attn_dt(opf_ctx *ctx, const char *what, const char *shape, const float *ref,
                           const void *dev, opf_dtype dt, int64_t n, double tol, int64_t T,
                           int64_t H, int64_t D, int64_t cols)
{
    char name[160];
    snprintf(name, sizeof name, "%s [%s]", what, shape);
    size_t nb = opf_dtype_nbytes(dt, (size_t)n);
    void *raw = malloc(nb ? nb : 1);
    float *got = fvec(n);
    host_from(ctx, raw, dev, nb);
    CHECK_OK(ctx, opf_convert(raw, dt, got, OPF_F32, (size_t)n));
    check_attn(name, ref, got, n, tol, T, H, D, cols);
    free(raw), free(got);
}

static void expect_attn(opf_ctx *ctx, const char *what, const char *shape, const float *ref,
                        const float *dev, int64_t n, double tol, int64_t T, int64_t H, int64_t D,
                        int64_t cols)
{
    expect_attn_dt(ctx, what, shape, ref, dev, OPF_F32, n, tol, T, H, D, cols);
}

/* n values of dev (f32) as the host's, rounded to dt and widened back. */
static float *host_rounded(opf_ctx *ctx, const float *dev, int64_t n, opf_dtype dt)
{
    float *h = fvec(n);
    uint16_t *r = calloc((size_t)(n ? n : 1), sizeof *r);
    host_from(ctx, h, dev, sizeof(float) * (size_t)n);
    if (dt != OPF_F32) {
        CHECK_OK(ctx, opf_convert(h, OPF_F32, r, dt, (size_t)n));
        CHECK_OK(ctx, opf_convert(r, dt, h, OPF_F32, (size_t)n));
    }
    free(r);
    return h;
}

/* n values exact in dt, stored as dt on the device. */
static void *dev_as(opf_ctx *ctx, const float *h, int64_t n, opf_dtype dt)
{
    size_t nb = opf_dtype_nbytes(dt, (size_t)n);
    void *x = malloc(nb ? nb : 1);
    CHECK_OK(ctx, opf_convert(h, OPF_F32, x, dt, (size_t)n));
    void *d = dev_from(ctx, x, nb);
    free(x);
    return d;
}

/* The arrays of one attention call on the device, and their sizes. */
typedef struct attn_bufs {
    int64_t B, T, H, D, nq, no, nl;
    void   *qkv, *dout, *dqkv;  /* of the storage dtype */
    float  *o, *lse;
} attn_bufs;

/* On the path now set, with qkv, do and dqkv stored as dt (the 16-bit
 * kernels read and write it directly; g the fp32-storage run's arrays, the
 * forward's outputs in fo / flse, before the CPU's o and lse replaced them,
 * then dqkv from those): the forward's bits are that run's, dqkv is that
 * run's rounded once to dt, and with dqkv f32 it is that run's exactly.
 * The bounds against the CPU (cpu_dq) hold with dt's rounding. */
static void attn_typed_case(opf_ctx *ctx, const char *shape, opf_dtype dt, const attn_bufs *g,
                            const float *fo, const float *flse, const float *cpu_dq,
                            const float *qkv, const float *dout, double tol, bool twice)
{
    const opf_nn_kernels *K = &opf_cuda_nn;
    int64_t B = g->B, T = g->T, H = g->H, D = g->D, nq = g->nq, no = g->no, nl = g->nl;
    void *tq = dev_as(ctx, qkv, nq, dt), *td = dev_as(ctx, dout, no, dt);
    void *tdq = dev_from(ctx, NULL, opf_dtype_nbytes(dt, (size_t)nq));
    float *to = dev_from(ctx, NULL, sizeof(float) * (size_t)no);
    float *tl = dev_from(ctx, NULL, sizeof(float) * (size_t)nl);
    float *tdq32 = dev_from(ctx, NULL, sizeof(float) * (size_t)nq);
    char at[160];
    snprintf(at, sizeof at, "%s, %s storage", shape, opf_dtype_name(dt));
    CHECK_OK(ctx, K->attn_fwd(ctx, tq, dt, to, OPF_F32, tl, B, T, H, D, dt));
    expect_attn(ctx, "attn_fwd o", at, fo, to, no, 0, T, H, D, H * D);
    expect_attn(ctx, "attn_fwd lse", at, flse, tl, nl, 0, T, H, D, 0);
    float *want = host_rounded(ctx, g->dqkv, nq, dt), *f32 = host_rounded(ctx, g->dqkv, nq, OPF_F32);
    CHECK_OK(ctx, K->attn_bwd(ctx, tq, dt, g->o, OPF_F32, g->lse, td, dt, tdq, dt, B, T, H, D,
                              dt));
    if (twice) expect_attn_dt(ctx, "attn_bwd dqkv", at, want, tdq, dt, nq, 0, T, H, D, 3 * H * D);
    expect_attn_dt(ctx, "attn_bwd dqkv vs cpu", at, cpu_dq, tdq, dt, nq, tol, T, H, D, 3 * H * D);
    CHECK_OK(ctx, K->attn_bwd(ctx, tq, dt, g->o, OPF_F32, g->lse, td, dt, tdq32, OPF_F32, B, T, H,
                              D, dt));
    expect_attn(ctx, twice ? "attn_bwd dqkv f32" : "attn_bwd dqkv f32 vs cpu", at,
                twice ? f32 : cpu_dq, tdq32, nq, twice ? 0 : tol, T, H, D, 3 * H * D);
    void *gs[] = {tq, td, tdq, to, tl, tdq32};
    for (int i = 0; i < 6; i++) opf_cuda_free(ctx, gs[i]);
    free(want), free(f32);
}

/* The backward of g (its o and lse, f32 storage) once more: the same bytes
 * as its dqkv. */
static void attn_bwd_again(opf_ctx *ctx, const char *shape, const attn_bufs *g, opf_dtype dt)
{
    const opf_dtype F = OPF_F32;
    float *first = fvec(g->nq);
    char name[160];
    snprintf(name, sizeof name, "attn_bwd dqkv run twice [%s]", shape);
    host_from(ctx, first, g->dqkv, sizeof(float) * (size_t)g->nq);
    CHECK_OK(ctx, opf_cuda_nn.attn_bwd(ctx, g->qkv, F, g->o, F, g->lse, g->dout, F, g->dqkv, F,
                                       g->B, g->T, g->H, g->D, dt));
    expect_same(ctx, name, first, g->dqkv, g->nq);
    free(first);
}

/* The CPU's run with o stored as ot (16-bit: the fp32 o rounded once, the
 * backward reading that rounded o), the references of attn_o_case. */
typedef struct attn_o_ref {
    opf_dtype ot;
    void     *o;          /* host, ot's bits */
    float    *ow, *dqkv;  /* o widened; dqkv (f32) from o and the CPU's lse */
} attn_o_ref;

static attn_o_ref attn_o_ref_of(opf_ctx *ctx, const attn_bufs *g, const float *qkv,
                                const float *dout, opf_dtype ot, opf_dtype dt)
{
    const opf_dtype F = OPF_F32;
    attn_o_ref r = {ot, malloc(opf_dtype_nbytes(ot, (size_t)g->no) + 1), fvec(g->no), fvec(g->nq)};
    float *lse = fvec(g->nl);
    CHECK_OK(ctx, opf_cpu_nn.attn_fwd(ctx, qkv, F, r.o, ot, lse, g->B, g->T, g->H, g->D, dt));
    CHECK_OK(ctx, opf_cpu_nn.attn_bwd(ctx, qkv, F, r.o, ot, lse, dout, F, r.dqkv, F, g->B, g->T,
                                      g->H, g->D, dt));
    CHECK_OK(ctx, opf_convert(r.o, ot, r.ow, F, (size_t)g->no));
    free(lse);
    return r;
}

/* On the path now set (pc, its bounds for dt), o stored as r->ot and the
 * other arrays f32 (g's): the forward's o against the CPU's within tol_o
 * plus one unit of ot's rounding (a value the two round from either side of
 * a midpoint; tol 0 stays 0: exact's bits), lse as in f32; then the
 * backward from the CPU's rounded o and lse against the CPU's dqkv from
 * them, within tol_dqkv. */
static void attn_o_case(opf_ctx *ctx, const char *shape, const attn_path_case *pc, opf_dtype dt,
                        const attn_bufs *g, const attn_o_ref *r, const float *lse)
{
    const opf_dtype F = OPF_F32;
    int64_t B = g->B, T = g->T, H = g->H, D = g->D, C = H * D;
    int slot = dtype_slot(dt);
    size_t nb = opf_dtype_nbytes(r->ot, (size_t)g->no);
    void *go = dev_from(ctx, NULL, nb);
    char at[160];
    snprintf(at, sizeof at, "%s, o stored as %s", shape, opf_dtype_name(r->ot));
    double unit = r->ot == OPF_BF16 ? 0x1p-7 : 0x1p-10, tol = pc->tol_o[slot];
    CHECK_OK(ctx, opf_cuda_nn.attn_fwd(ctx, g->qkv, F, go, r->ot, g->lse, B, T, H, D, dt));
    expect_attn_dt(ctx, "attn_fwd o", at, r->ow, go, r->ot, g->no, tol > 0 ? tol + unit : 0, T, H,
                   D, C);
    expect_attn(ctx, "attn_fwd lse", at, lse, g->lse, g->nl, tol, T, H, D, 0);
    CHECK_OK(ctx, opf_cuda_copy(ctx, go, r->o, nb, OPF_CUDA_H2D));
    CHECK_OK(ctx, opf_cuda_copy(ctx, g->lse, lse, sizeof(float) * (size_t)g->nl, OPF_CUDA_H2D));
    CHECK_OK(ctx, opf_cuda_nn.attn_bwd(ctx, g->qkv, F, go, r->ot, g->lse, g->dout, F, g->dqkv, F, B,
                                       T, H, D, dt));
    expect_attn(ctx, "attn_bwd dqkv", at, r->dqkv, g->dqkv, g->nq, pc->tol_dqkv[slot], T, H, D,
                3 * C);
    opf_cuda_free(ctx, go);
}

/* One shape on every path (exact only when `exact`: slow at long T; f32
 * qkv only gemm and exact, which read no dtype), with q, k, v and do drawn
 * exact in dt and dt passed as qkv's logical dtype: the forward against
 * the CPU's o and lse, then the backward from the CPU's o and lse against
 * its dqkv, all on f32 storage; for bf16 and f16 then the same calls on dt
 * storage against these (attn_typed_case); then with o stored in 16 bits,
 * as dt (bf16 for f32: cuDNN's path writes and reads it in place where o is
 * dt) against the CPU's run with that o (attn_o_case). */
static void attn_case_dt(opf_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t D, float scale,
                         bool exact, opf_dtype dt)
{
    if (cuda_test_quick() && T >= 1000) {
        printf("  attention %s B %lld T %lld H %lld D %lld: left out (OPF_TEST_QUICK=1)\n",
               opf_dtype_name(dt), (long long)B, (long long)T, (long long)H, (long long)D);
        return;
    }
    int64_t C = H * D, nq = B * T * 3 * C, no = B * T * C, nl = B * H * T;
    float *qkv = frand_dt(nq, scale, dt), *dout = frand_dt(no, 1.0f, dt);
    float *o = fvec(no), *lse = fvec(nl), *dqkv = fvec(nq), *fo = fvec(no), *flse = fvec(nl);
    attn_bufs g = {.B = B, .T = T, .H = H, .D = D, .nq = nq, .no = no, .nl = nl};
    g.qkv = dev_from(ctx, qkv, sizeof(float) * (size_t)nq);
    g.dout = dev_from(ctx, dout, sizeof(float) * (size_t)no);
    g.o = dev_from(ctx, NULL, sizeof(float) * (size_t)no);
    g.lse = dev_from(ctx, NULL, sizeof(float) * (size_t)nl);
    g.dqkv = dev_from(ctx, NULL, sizeof(float) * (size_t)nq);
    printf("  attention %s B %lld T %lld H %lld D %lld (scale %g)\n", opf_dtype_name(dt),
           (long long)B, (long long)T, (long long)H, (long long)D, (double)scale);
    const opf_dtype F = OPF_F32;
    CHECK_OK(ctx, opf_cpu_nn.attn_fwd(ctx, qkv, F, o, F, lse, B, T, H, D, dt));
    CHECK_OK(ctx, opf_cpu_nn.attn_bwd(ctx, qkv, F, o, F, lse, dout, F, dqkv, F, B, T, H, D, dt));
    attn_o_ref r16 = attn_o_ref_of(ctx, &g, qkv, dout, dt == F ? OPF_BF16 : dt, dt);
    int first = dt != OPF_F32 ? 2 : exact ? 0 : 1, slot = dtype_slot(dt);
    for (int p = first; p < (int)(sizeof attn_paths / sizeof attn_paths[0]); p++) {
        const attn_path_case *pc = &attn_paths[p];
        if (!attn_path_runs(pc)) continue;
        if (pc->env) setenv("OPF_CUDA_ATTENTION", pc->env, 1);
        else unsetenv("OPF_CUDA_ATTENTION");
        char shape[112];
        snprintf(shape, sizeof shape, "%s B %lld T %lld H %lld D %lld scale %g, %s",
                 opf_dtype_name(dt), (long long)B, (long long)T, (long long)H, (long long)D,
                 (double)scale, pc->env ? pc->env : "default");
        CHECK_OK(ctx, opf_cuda_nn.attn_fwd(ctx, g.qkv, F, g.o, F, g.lse, B, T, H, D, dt));
        expect_attn(ctx, "attn_fwd o", shape, o, g.o, no, pc->tol_o[slot], T, H, D, C);
        expect_attn(ctx, "attn_fwd lse", shape, lse, g.lse, nl, pc->tol_o[slot], T, H, D, 0);
        host_from(ctx, fo, g.o, sizeof(float) * (size_t)no);
        host_from(ctx, flse, g.lse, sizeof(float) * (size_t)nl);
        /* the backward from the CPU's o and lse on both sides */
        CHECK_OK(ctx, opf_cuda_copy(ctx, g.o, o, sizeof(float) * (size_t)no, OPF_CUDA_H2D));
        CHECK_OK(ctx, opf_cuda_copy(ctx, g.lse, lse, sizeof(float) * (size_t)nl, OPF_CUDA_H2D));
        CHECK_OK(ctx, opf_cuda_nn.attn_bwd(ctx, g.qkv, F, g.o, F, g.lse, g.dout, F, g.dqkv, F, B,
                                           T, H, D, dt));
        expect_attn(ctx, "attn_bwd dqkv", shape, dqkv, g.dqkv, nq, pc->tol_dqkv[slot], T, H, D,
                    3 * C);
        if (pc->twice) attn_bwd_again(ctx, shape, &g, dt);
        if (dt != OPF_F32)
            attn_typed_case(ctx, shape, dt, &g, fo, flse, dqkv, qkv, dout, pc->tol_dqkv[slot],
                            pc->twice);
        attn_o_case(ctx, shape, pc, dt, &g, &r16, lse);
    }
    unsetenv("OPF_CUDA_ATTENTION");
    void *gs[] = {g.qkv, g.dout, g.o, g.lse, g.dqkv};
    for (int i = 0; i < 5; i++) opf_cuda_free(ctx, gs[i]);
    void *hs[] = {qkv, dout, o, lse, dqkv, fo, flse, r16.o, r16.ow, r16.dqkv};
    for (int i = 0; i < 10; i++) free(hs[i]);
}

static void attn_case(opf_ctx *ctx, int64_t B, int64_t T, int64_t H, int64_t D, float scale,
                      bool exact)
{
    attn_case_dt(ctx, B, T, H, D, scale, exact, OPF_F32);
}

/* An OPF_CUDA_ATTENTION that names no path fails both entries with a
 * message naming the variable, the value and the paths; "gemm" is
 * accepted; "cudnn" where cuDNN does not load is OPF_ERR_UNSUPPORTED, and
 * the default runs flash2 there. */
static void attn_path_error(opf_ctx *ctx)
{
    const opf_dtype F = OPF_F32;
    int64_t B = 1, T = 5, H = 2, D = 64, nq = B * T * 3 * H * D, no = B * T * H * D;
    float *qkv = frand(nq, 1.0f, 0, false), *dout = frand(no, 1.0f, 0, false);
    float *gqkv = dev_from(ctx, qkv, sizeof(float) * (size_t)nq);
    float *gdout = dev_from(ctx, dout, sizeof(float) * (size_t)no);
    float *go = dev_from(ctx, NULL, sizeof(float) * (size_t)no);
    float *glse = dev_from(ctx, NULL, sizeof(float) * (size_t)(B * H * T));
    float *gdqkv = dev_from(ctx, NULL, sizeof(float) * (size_t)nq);
    printf("  attention: OPF_CUDA_ATTENTION=flash3 is an error\n");
    setenv("OPF_CUDA_ATTENTION", "flash3", 1);
    CHECK_FAILS(ctx, opf_cuda_nn.attn_fwd(ctx, gqkv, F, go, F, glse, B, T, H, D, F),
                OPF_ERR_INVALID_ARG, "attention forward", "OPF_CUDA_ATTENTION", "flash3",
                "flash1p, cudnn, cudnn-atomic or exact");
    CHECK_FAILS(ctx, opf_cuda_nn.attn_bwd(ctx, gqkv, F, go, F, glse, gdout, F, gdqkv, F, B, T, H,
                                          D, OPF_BF16),
                OPF_ERR_INVALID_ARG, "attention backward", "OPF_CUDA_ATTENTION", "flash3");
    setenv("OPF_CUDA_ATTENTION", "gemm", 1);
    CHECK_OK(ctx, opf_cuda_nn.attn_fwd(ctx, gqkv, F, go, F, glse, B, T, H, D, OPF_BF16));
    if (!cudnn_usable()) {  /* cudnn where cuDNN is missing: refused, naming why */
        printf("  attention: OPF_CUDA_ATTENTION=cudnn without cuDNN is OPF_ERR_UNSUPPORTED\n");
        setenv("OPF_CUDA_ATTENTION", "cudnn", 1);
        CHECK_FAILS(ctx, opf_cuda_nn.attn_fwd(ctx, gqkv, F, go, F, glse, B, T, H, D, OPF_BF16),
                    OPF_ERR_UNSUPPORTED, "attention forward (cuda cudnn)", "cuDNN");
        CHECK_OK(ctx, opf_cuda_nn.attn_fwd(ctx, gqkv, F, go, F, glse, B, T, H, D, F));
        printf("  attention: unset without cuDNN runs flash2\n");
        unsetenv("OPF_CUDA_ATTENTION");
        CHECK_OK(ctx, opf_cuda_nn.attn_fwd(ctx, gqkv, F, go, F, glse, B, T, H, D, OPF_BF16));
        CHECK_OK(ctx, opf_cuda_nn.attn_bwd(ctx, gqkv, F, go, F, glse, gdout, F, gdqkv, F, B, T, H,
                                           D, OPF_BF16));
    }
    unsetenv("OPF_CUDA_ATTENTION");
    void *gs[] = {gqkv, gdout, go, glse, gdqkv};
    for (int i = 0; i < 5; i++) opf_cuda_free(ctx, gs[i]);
    free(qkv), free(dout);
}

static void test_attention(opf_ctx *ctx)
{
    attn_case(ctx, 2, 1, 3, 16, 1.0f, true);      /* T = 1 */
    attn_case(ctx, 1, 1, 1, 1, 1.0f, true);
    attn_case(ctx, 2, 33, 1, 64, 1.0f, true);
    attn_case(ctx, 1, 70, 12, 8, 4.0f, true);     /* large scores: the max moves often */
    attn_case(ctx, 3, 45, 5, 24, 1.0f, true);     /* flash: D = 24 falls back to gemm */
    attn_case(ctx, 1, 97, 2, 1, 8.0f, true);      /* D = 1 */
    attn_case(ctx, 1, 40, 2, 300, 0.5f, true);    /* D past one 256-wide pass */
    attn_case(ctx, 2, 128, 12, 64, 1.0f, true);   /* GPT-2's heads */
    attn_case(ctx, 1, 1024, 12, 64, 1.0f, false); /* GPT-2's context */
    attn_case(ctx, 1, 8192, 3, 8, 1.0f, false);   /* the backward in chunks of pairs */
    /* flash's tiles: 64 rows; partial last tiles, D 64 and 128 */
    attn_case(ctx, 2, 1, 3, 64, 1.0f, true);
    attn_case(ctx, 1, 33, 2, 128, 1.0f, true);
    attn_case(ctx, 2, 65, 3, 64, 1.0f, true);
    attn_case(ctx, 1, 127, 4, 128, 1.0f, true);
    attn_case(ctx, 3, 64, 2, 64, 2.0f, true);     /* one whole tile, larger scores */
    attn_case(ctx, 2, 1000, 2, 64, 1.0f, false);
    attn_case(ctx, 1, 1000, 3, 128, 1.0f, false);
    /* the 16-bit kernels (flash's and flash2's): own tiles of 128 rows, loop
     * tiles of 64; partial tiles of both, D 64 and 128, D 24 falling back
     * to gemm */
    static const opf_dtype dts[] = {OPF_BF16, OPF_F16};
    for (int d = 0; d < 2; d++) {
        opf_dtype dt = dts[d];
        attn_case_dt(ctx, 2, 1, 3, 64, 1.0f, false, dt);
        attn_case_dt(ctx, 1, 33, 2, 128, 1.0f, false, dt);
        attn_case_dt(ctx, 2, 65, 3, 64, 1.0f, false, dt);
        attn_case_dt(ctx, 1, 127, 4, 128, 1.0f, false, dt);
        attn_case_dt(ctx, 3, 128, 2, 64, 2.0f, false, dt);  /* one whole own tile */
        attn_case_dt(ctx, 2, 129, 3, 64, 1.0f, false, dt);
        attn_case_dt(ctx, 1, 200, 2, 128, 1.0f, false, dt);
        attn_case_dt(ctx, 2, 45, 5, 24, 1.0f, false, dt);
        attn_case_dt(ctx, 2, 1000, 2, 64, 1.0f, false, dt);
        attn_case_dt(ctx, 1, 1000, 3, 128, 1.0f, false, dt);
    }
    attn_case_dt(ctx, 2, 1024, 12, 64, 1.0f, false, OPF_BF16); /* GPT-2's shape */
    attn_path_error(ctx);
}

/* ---- cross-entropy -------------------------------------------------------------- */

/* expect_same for n values of dtype dt (both widened to fp32, exact). */
static void expect_same_dt(opf_ctx *ctx, const char *what, const void *ref, const void *dev,
                           opf_dtype dt, int64_t n)
{
    size_t nb = opf_dtype_nbytes(dt, (size_t)n);
    void *got = malloc(nb ? nb : 1);
    float *g32 = fvec(n), *r32 = fvec(n);
    host_from(ctx, got, dev, nb);
    CHECK_OK(ctx, opf_convert(got, dt, g32, OPF_F32, (size_t)n));
    CHECK_OK(ctx, opf_convert(ref, dt, r32, OPF_F32, (size_t)n));
    check_same(what, r32, g32, n);
    free(got), free(g32), free(r32);
}

/* Logits of dtype xt, dx of dtype dxt: the GPU's bits are the CPU's. */
static void xent_case(opf_ctx *ctx, int64_t rows, int64_t V, int ignore_every, float scale,
                      bool special, opf_dtype xt, opf_dtype dxt)
{
    float *x32 = frand(rows * V, scale, special ? 997 : 0, special);
    size_t xb = opf_dtype_nbytes(xt, (size_t)(rows * V)), db = opf_dtype_nbytes(dxt, (size_t)(rows * V));
    void *x = malloc(xb ? xb : 1), *dx = malloc(db ? db : 1);
    CHECK_OK(ctx, opf_convert(x32, OPF_F32, x, xt, (size_t)(rows * V)));
    int32_t *tgt = malloc(sizeof(int32_t) * (size_t)(rows ? rows : 1));
    for (int64_t r = 0; r < rows; r++)
        tgt[r] = ignore_every && cuda_test_u32() % (uint32_t)ignore_every == 0
                     ? -1 - (int32_t)(cuda_test_u32() % 100)
                     : (int32_t)(cuda_test_u32() % (uint32_t)V);
    float *lse = fvec(rows), loss = 0.0f, dloss = 1.7f;
    void *gx = dev_from(ctx, x, xb), *gdx = dev_from(ctx, NULL, db);
    int32_t *gtgt = dev_from(ctx, tgt, sizeof(int32_t) * (size_t)rows);
    float *glse = dev_from(ctx, NULL, sizeof(float) * (size_t)rows);
    float *gloss = dev_from(ctx, NULL, sizeof(float));
    float *gdloss = dev_from(ctx, &dloss, sizeof(float));
    printf("  cross-entropy rows %lld V %lld %s -> %s (ignored 1 in %d, scale %g%s)\n",
           (long long)rows, (long long)V, opf_dtype_name(xt), opf_dtype_name(dxt), ignore_every,
           (double)scale, special ? ", inf/NaN" : "");
    CHECK_OK(ctx, opf_cpu_nn.xent_fwd(ctx, x, xt, tgt, lse, &loss, rows, V));
    CHECK_OK(ctx, opf_cuda_nn.xent_fwd(ctx, gx, xt, gtgt, glse, gloss, rows, V));
    expect_same(ctx, "xent_fwd lse", lse, glse, rows);
    expect_same(ctx, "xent_fwd loss", &loss, gloss, 1);
    CHECK_OK(ctx, opf_cuda_copy(ctx, glse, lse, sizeof(float) * (size_t)rows, OPF_CUDA_H2D));
    CHECK_OK(ctx, opf_cpu_nn.xent_bwd(ctx, x, xt, tgt, lse, &dloss, dx, dxt, rows, V));
    CHECK_OK(ctx, opf_cuda_nn.xent_bwd(ctx, gx, xt, gtgt, glse, gdloss, gdx, dxt, rows, V));
    expect_same_dt(ctx, "xent_bwd dx", dx, gdx, dxt, rows * V);
    void *gs[] = {gx, gtgt, glse, gdx, gloss, gdloss};
    for (int i = 0; i < 6; i++) opf_cuda_free(ctx, gs[i]);
    void *hs[] = {x32, x, dx, tgt, lse};
    for (int i = 0; i < 5; i++) free(hs[i]);
}

static void test_xent(opf_ctx *ctx)
{
    const opf_dtype F = OPF_F32, B = OPF_BF16, H = OPF_F16;
    xent_case(ctx, 37, 50257, 4, 8.0f, false, F, F);  /* GPT-2's vocabulary */
    xent_case(ctx, 300, 1000, 3, 30.0f, false, F, F);
    xent_case(ctx, 64, 777, 5, 4.0f, true, F, F);     /* inf and NaN logits */
    xent_case(ctx, 5, 1, 0, 1.0f, false, F, F);       /* V = 1 */
    xent_case(ctx, 9, 100, 1, 1.0f, false, F, F);     /* every target ignored: loss 0 */
    xent_case(ctx, 37, 50257, 4, 8.0f, false, B, B);  /* a bf16 model's logits and dx */
    xent_case(ctx, 64, 777, 5, 4.0f, true, B, F);
    xent_case(ctx, 300, 1000, 3, 3.0f, false, H, H);
    /* rows of whole 16-byte vectors (the vector backward; the forward's
     * chunks without a head), with special values, dx wider and narrower,
     * and rows shorter than a vector */
    xent_case(ctx, 64, 50304, 4, 8.0f, false, B, B);  /* GPT-2's padded vocabulary */
    xent_case(ctx, 48, 776, 5, 4.0f, true, B, F);
    xent_case(ctx, 70, 100, 3, 5.0f, true, F, B);
    xent_case(ctx, 40, 3, 2, 2.0f, false, B, B);
}

/* ---- sumsq ---------------------------------------------------------------------- */

static void sumsq_case(opf_ctx *ctx, opf_dtype dt, int64_t n)
{
    float *x = frand(n, 3.0f, 61, false);
    size_t bytes = opf_dtype_nbytes(dt, (size_t)n);
    void *h = malloc(bytes ? bytes : 1);
    opf_convert(x, OPF_F32, h, dt, (size_t)n);
    void *g = dev_from(ctx, h, bytes);
    double ref = -1.0, got = -2.0;
    CHECK_OK(ctx, opf_cpu_nn.sumsq(ctx, h, dt, n, &ref));
    CHECK_OK(ctx, opf_cuda_nn.sumsq(ctx, g, dt, n, &got));
    CHECK(memcmp(&ref, &got, sizeof ref) == 0, "sumsq %s n %lld: gpu %a cpu %a",
          opf_dtype_name(dt), (long long)n, got, ref);
    opf_cuda_free(ctx, g);
    free(h);
    free(x);
}

static void test_sumsq(opf_ctx *ctx)
{
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    static const int64_t ns[] = {0, 1, 4095, 4097, 3 * 4096, 1000003, 40 * 4096 * 33 + 7};
    for (int d = 0; d < 3; d++)
        for (int i = 0; i < (int)(sizeof ns / sizeof ns[0]); i++) sumsq_case(ctx, dts[d], ns[i]);
    printf("  sumsq: f32, bf16, f16 at %d sizes\n", (int)(sizeof ns / sizeof ns[0]));
}

/* Clipping without a host read: the arrays' sums of squares accumulated
 * into one device double by one sumsq_acc call, then one clip_scale call at
 * a max_norm below the norm (scales), above it (leaves the arrays alone) and
 * with an infinite value (leaves them alone): the sum and every element byte
 * for byte with the CPU's. Array k has n[k] values of dtype dt[k]. */
static void clip_arrays(opf_ctx *ctx, int count, const int64_t *n, const opf_dtype *dt,
                        double frac, bool inf, const char *what)
{
    opf_nn_span *hs = calloc((size_t)count + 1, sizeof *hs), *gs = calloc((size_t)count + 1, sizeof *gs);
    void **back = calloc((size_t)count + 1, sizeof *back);
    for (int k = 0; k < count; k++) {
        float *x = frand(n[k], k % 2 ? 0.5f : 3.0f, 0, false);
        if (inf && k == count / 2 && n[k]) x[n[k] / 2] = INFINITY;
        size_t bytes = opf_dtype_nbytes(dt[k], (size_t)n[k]);
        void *h = malloc(bytes + 8);
        opf_convert(x, OPF_F32, h, dt[k], (size_t)n[k]);
        hs[k] = (opf_nn_span){h, dt[k], n[k]};
        gs[k] = (opf_nn_span){dev_from(ctx, h, bytes), dt[k], n[k]};
        back[k] = malloc(bytes + 8);
        free(x);
    }
    double ref = -1.0, got = -2.0, *gacc = dev_from(ctx, NULL, sizeof(double));
    CHECK_OK(ctx, opf_cpu_nn.sumsq_acc(ctx, hs, count, &ref, false));
    CHECK_OK(ctx, opf_cuda_nn.sumsq_acc(ctx, gs, count, gacc, false));
    host_from(ctx, &got, gacc, sizeof got);
    CHECK(memcmp(&ref, &got, sizeof ref) == 0, "sumsq_acc %s: gpu %a cpu %a", what, got, ref);
    /* add: the same sum again onto it */
    CHECK_OK(ctx, opf_cpu_nn.sumsq_acc(ctx, hs, count, &ref, true));
    CHECK_OK(ctx, opf_cuda_nn.sumsq_acc(ctx, gs, count, gacc, true));
    host_from(ctx, &got, gacc, sizeof got);
    CHECK(memcmp(&ref, &got, sizeof ref) == 0, "sumsq_acc %s, added: gpu %a cpu %a", what, got, ref);
    double max_norm = frac * sqrt(ref);
    CHECK_OK(ctx, opf_cpu_nn.clip_scale(ctx, hs, count, &ref, max_norm));
    CHECK_OK(ctx, opf_cuda_nn.clip_scale(ctx, gs, count, gacc, max_norm));
    int64_t bad = 0, all = 0;
    for (int k = 0; k < count; k++) {
        size_t es = opf_dtype_nbytes(dt[k], 1);
        host_from(ctx, back[k], gs[k].x, es * (size_t)n[k]);
        for (int64_t i = 0; i < n[k]; i++, all++)
            if (memcmp((char *)hs[k].x + i * es, (char *)back[k] + i * es, es) && bad++ < 4) {
                float a, b;
                opf_convert((char *)back[k] + i * es, dt[k], &a, OPF_F32, 1);
                opf_convert((char *)hs[k].x + i * es, dt[k], &b, OPF_F32, 1);
                fprintf(stderr, "  clip_scale %s frac %g array %d [%lld]: gpu %a cpu %a\n", what,
                        frac, k, (long long)i, (double)a, (double)b);
            }
        opf_cuda_free(ctx, gs[k].x);
        free(hs[k].x), free(back[k]);
    }
    CHECK(bad == 0, "clip_scale %s frac %g%s: %lld of %lld differ", what, frac, inf ? " (inf)" : "",
          (long long)bad, (long long)all);
    opf_cuda_free(ctx, gacc);
    free(hs), free(gs), free(back);
}

static void test_clip(opf_ctx *ctx)
{
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
    static const int64_t ns[] = {0, 1, 4097, 1000003};
    for (int d = 0; d < 3; d++)
        for (int i = 0; i < (int)(sizeof ns / sizeof ns[0]); i++) {
            int64_t n2[2] = {ns[i], ns[i]};
            opf_dtype d2[2] = {dts[d], dts[d]};
            char what[64];
            snprintf(what, sizeof what, "%s n %lld x 2", opf_dtype_name(dts[d]), (long long)ns[i]);
            clip_arrays(ctx, 2, n2, d2, 0.3, false, what);
            clip_arrays(ctx, 2, n2, d2, 2.0, false, what);
            clip_arrays(ctx, 2, n2, d2, 0.3, true, what);
        }
    /* a model's worth: 300 arrays (three launches' batches) of every dtype
     * and sizes from 0 to over a chunk, in one call each */
    enum { MANY = 300 };
    int64_t n[MANY];
    opf_dtype dt[MANY];
    for (int k = 0; k < MANY; k++) n[k] = (k * 7919) % 9001, dt[k] = dts[k % 3];
    n[5] = 0, n[131] = 1, n[257] = 4096 * 5;
    clip_arrays(ctx, MANY, n, dt, 0.3, false, "300 arrays");
    clip_arrays(ctx, MANY, n, dt, 2.0, false, "300 arrays");
    clip_arrays(ctx, MANY, n, dt, 0.3, true, "300 arrays");
    printf("  sumsq_acc, clip_scale: f32, bf16, f16 at %d sizes in pairs; 300 arrays of mixed "
           "dtypes and sizes in one call\n", (int)(sizeof ns / sizeof ns[0]));
    /* gradients on the CPU clipped by a CUDA context: refused, naming both,
     * and nothing scaled */
    opf_ctx *cpu;
    opf_seq *seq;
    CHECK_OK(NULL, opf_ctx_create(NULL, &cpu));
    CHECK_OK(cpu, opf_seq_create(cpu, &seq));
    CHECK_OK(cpu, opf_seq_append_linear(seq, 4, 3, true, OPF_F32, "fc"));
    opf_param *p = opf_op_param(opf_seq_at(seq, 0), 0);
    float *g = p->grad.data[0];
    for (int64_t k = 0; k < opf_spec_numel(&p->grad.spec); k++) g[k] = 100.0f + (float)k;
    p->has_grad = true;
    double norm = -1.0;
    CHECK_FAILS(ctx, opf_clip_grad_norm(ctx, &seq, 1, 1.0, &norm), OPF_ERR_INVALID_ARG,
                "clip_grad_norm", "is on device 0, the context's on 1");
    CHECK(g[0] == 100.0f && norm == 0.0, "a refused clip changed the gradient (%g) or norm (%g)",
          (double)g[0], norm);
    opf_seq_destroy(seq);
    opf_ctx_destroy(cpu);
}

/* ---- expf / logf ------------------------------------------------------------------ */

/* Every STRIDE-th bit pattern (all of them near 0 and 1) against the host's
 * libm, as the kernels compute them. */
static void test_math(opf_ctx *ctx)
{
    enum { STRIDE = 61, BATCH = 1 << 22 };
    float *g = NULL, *y = fvec(BATCH);
    CHECK_OK(ctx, opf_cuda_alloc(ctx, sizeof(float) * BATCH, (void **)&g));
    /* dense runs at 0 (subnormals), just below 1.0f and over expf's underflow edge */
    static const uint32_t dense[] = {0x00000000u, 0x3f7c0000u, 0xc2b00000u, 0xc2cf0000u};
    int n_strided = (int)((0x100000000ull / STRIDE + BATCH - 1) / BATCH);
    for (int log = 0; log < 2; log++) {
        int64_t bad = 0, n = 0;
        for (int b = 0; b < 4 + n_strided; b++) {
            uint32_t stride = b < 4 ? 1 : STRIDE;
            uint64_t first = b < 4 ? dense[b] : (uint64_t)(b - 4) * BATCH * STRIDE;
            int64_t cnt = BATCH;
            if (first + (uint64_t)cnt * stride > 0x100000000ull)
                cnt = (int64_t)((0x100000000ull - first + stride - 1) / stride);
            CHECK_OK(ctx, opf_cuda_nn_math(ctx, log, (uint32_t)first, stride, cnt, g));
            host_from(ctx, y, g, sizeof(float) * (size_t)cnt);
            for (int64_t i = 0; i < cnt; i++) {
                uint32_t u = (uint32_t)(first + (uint64_t)i * stride);
                float x, ref;
                memcpy(&x, &u, 4);
                ref = log ? logf(x) : expf(x);
                if (!same_f32(y[i], ref) && bad++ < 4)
                    fprintf(stderr, "  %s(%a) [0x%08x]: gpu %a libm %a\n", log ? "logf" : "expf",
                            (double)x, u, (double)y[i], (double)ref);
            }
            n += cnt;
        }
        printf("  %s: %lld inputs\n", log ? "logf" : "expf", (long long)n);
        CHECK(bad == 0, "%s: %lld of %lld differ from libm", log ? "logf" : "expf", (long long)bad,
              (long long)n);
    }
    opf_cuda_free(ctx, g);
    free(y);
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_math(ctx);
    test_embedding(ctx);
    test_attention(ctx);
    test_xent(ctx);
    test_sumsq(ctx);
    test_clip(ctx);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
