/* test_cuda_quant.c: the GPU quantization kernels against the CPU reference,
 * byte for byte: every component (data, transposed copy, scale_inv, amax),
 * the dequantized values, and the delayed-scaling state after ten steps;
 * per-tensor FP8, MXFP8 (1x32 / 32x1 / 32x32, compact and swizzled scales)
 * and FP8 block scaling (1x128, 128x128). Current scaling runs both of its
 * paths: one pass (one cooperative launch) and two (amax, then cast). */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#define _POSIX_C_SOURCE 200809L  /* setenv, strdup */
#include <cuda_runtime_api.h>
#include <stdlib.h>

#include "cuda_test.h"

static const opf_dtype in_dtypes[] = {OPF_F32, OPF_BF16, OPF_F16};
static const opf_dtype q_dtypes[] = {OPF_E4M3, OPF_E5M2};
static const unsigned usages[] = {OPF_USAGE_ROWWISE, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE};
/* Shapes that fill the tiles, cut them, and leave the vector path; the
 * last is large enough (8.8M elements) that the flat passes' threads, as
 * many as an H200 holds at once, each take several turns of their loop. */
static const struct { int nd; int64_t s[3]; } shapes[] = {
    {2, {1, 1}},     {2, {3, 5}},      {2, {64, 128}},  {2, {77, 300}},
    {2, {128, 256}}, {2, {256, 48}},   {2, {33, 16}},   {3, {2, 64, 96}},
    {2, {1000, 1024}}, {2, {48, 1000}}, {2, {2112, 4160}}, {2, {0, 128}},
};
enum { N_SHAPES = sizeof shapes / sizeof shapes[0] };

static opf_quantizer fp8_quantizer(opf_dtype qd, unsigned usage)
{
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.qdtype = qd;
    q.usage = usage;
    return q;
}

/* One shape of test_current: every dtype x element dtype x usage. */
static void test_current_shape(opf_ctx *ctx, int si, const char *path)
{
    for (int di = 0; di < 3; di++)
        for (int qi = 0; qi < 2; qi++)
            for (int ui = 0; ui < 2; ui++) {
                opf_spec sp = opf_spec_make(shapes[si].nd, shapes[si].s, in_dtypes[di]);
                int64_t n = opf_spec_numel(&sp);
                float *x = malloc((size_t)n * sizeof *x);
                bool special = (si + di + qi) % 2 == 0;
                cuda_test_fill(x, n, 1.0f, 7, special);
                opf_quantizer q = fp8_quantizer(q_dtypes[qi], usages[ui]);
                q.pow2_scales = ui == 1 && qi == 0;
                q.amax_epsilon = si == 1 ? 1e-2f : 0.0f;
                char what[160], ss[96];
                opf_spec_str(&sp, ss, sizeof ss);
                snprintf(what, sizeof what, "current %s -> %s usage %u%s%s", ss,
                         opf_dtype_name(q.qdtype), q.usage, special ? " (inf/nan)" : "", path);
                cuda_test_check_quantize(ctx, &q, &q, &sp, x, what);
                free(x);
            }
}

/* Current scaling: every dtype x element dtype x usage x shape, on data
 * with edge values (inf and NaN in half of the cases), pow2 and epsilon;
 * each case in one pass (the amax and the cast in one launch) where the
 * tensor fits one wave, and with OPF_CUDA_FP8_ONE_PASS=0 in two. Both must
 * give the CPU's bytes; the one-pass count says which path ran: every
 * non-empty shape of at most one 128 x 64 tile an SM (one wave on any GPU
 * that runs cooperative launches) in one pass, none with it off. */
static void test_current(opf_ctx *ctx)
{
    const char *env = getenv("OPF_CUDA_FP8_ONE_PASS");
    char *keep = env ? strdup(env) : NULL;
    int dev = 0, sms = 0, coop = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
    for (int off = 0; off < 2; off++) {
        setenv("OPF_CUDA_FP8_ONE_PASS", off ? "0" : "1", 1);
        for (int si = 0; si < N_SHAPES; si++) {
            opf_spec sp = opf_spec_make(shapes[si].nd, shapes[si].s, OPF_F32);
            int64_t n = opf_spec_numel(&sp), M = 1, K = shapes[si].s[shapes[si].nd - 1];
            for (int d = 0; d < shapes[si].nd - 1; d++) M *= shapes[si].s[d];
            int64_t tiles = n ? (K + 63) / 64 * ((M + 127) / 128) : 0;
            unsigned long long before = opf_cuda_fp8_one_pass_calls();
            test_current_shape(ctx, si, off ? " (two passes)" : "");
            unsigned long long ran = opf_cuda_fp8_one_pass_calls() - before;
            if (off || n == 0) CHECK(ran == 0, "%s: %llu one-pass quantizes where none may run",
                                     off ? "OPF_CUDA_FP8_ONE_PASS=0" : "empty tensor", ran);
            else if (coop && tiles <= sms)
                CHECK(ran == 12, "shape %d (%lld tiles, %d SMs): %llu of 12 quantizes in one pass",
                      si, (long long)tiles, sms, ran);
        }
    }
    if (keep) setenv("OPF_CUDA_FP8_ONE_PASS", keep, 1);
    else unsetenv("OPF_CUDA_FP8_ONE_PASS");
    free(keep);
}

static opf_status reduce_to_at_least_100(void *user, float *amax, int n)
{
    (void)user;
    for (int i = 0; i < n; i++)
        if (amax[i] < 100.0f) amax[i] = 100.0f;
    return OPF_OK;
}

/* Current scaling through an amax reduction hook (sequence parallel). */
static void test_current_reduce(opf_ctx *ctx)
{
    opf_spec sp = opf_spec_make(2, (int64_t[]){96, 160}, OPF_BF16);
    float x[96 * 160];
    cuda_test_fill(x, 96 * 160, 0.01f, 0, false);
    opf_quantizer q = fp8_quantizer(OPF_E4M3, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE);
    q.amax_reduce = reduce_to_at_least_100;
    cuda_test_check_quantize(ctx, &q, &q, &sp, x, "current scaling with amax reduction");
}

/* Delayed scaling: ten steps with the CPU and the GPU on states of their
 * own (the GPU's in device memory, updated there); after each step the
 * update runs on both, and bytes, scales and history must agree. */
static void test_delayed(opf_ctx *ctx)
{
    opf_ctx *cpu = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &cpu));
    for (int di = 0; di < 3; di++) {
        opf_delayed_state *sc = NULL, *sg = NULL;
        CHECK_OK(cpu, opf_delayed_state_create(cpu, OPF_FORMAT_HYBRID, 0.0f, 4, OPF_AMAX_MAX,
                                               di == 2, 2, &sc));
        CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, 4, OPF_AMAX_MAX,
                                               di == 2, 2, &sg));
        opf_dtype qd = opf_delayed_state_dtype(sc);
        for (int step = 0; step < 10; step++) {
            opf_spec sp = opf_spec_make(2, (int64_t[]){128 + 16 * step, 96}, in_dtypes[di]);
            int64_t n = opf_spec_numel(&sp);
            float *x = malloc((size_t)n * sizeof *x);
            cuda_test_fill(x, n, powf(4.0f, (float)(step % 5) - 2.0f), step == 7 ? 11 : 0, false);
            if (step == 3) memset(x, 0, (size_t)n * sizeof *x);  /* zero amax: no roll */
            opf_quantizer qc = fp8_quantizer(qd, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE);
            opf_quantizer qg = qc;
            qc.delayed = sc, qg.delayed = sg;
            qc.slot = qg.slot = step % 2;
            char what[96];
            snprintf(what, sizeof what, "delayed %s step %d", opf_dtype_name(in_dtypes[di]), step);
            cuda_test_check_quantize(ctx, &qc, &qg, &sp, x, what);
            free(x);
            CHECK_OK(cpu, opf_delayed_state_update(cpu, sc, NULL, NULL));
            CHECK_OK(ctx, opf_delayed_state_update(ctx, sg, NULL, NULL));
            float scale[2], hist[4 * 2];
            CHECK_OK(ctx, opf_delayed_state_read(ctx, sg, scale, hist));
            CHECK(!memcmp(opf_delayed_state_scale(sc), scale, sizeof scale),
                  "delayed scales differ after step %d", step);
            CHECK(!memcmp(opf_delayed_state_history(sc), hist, sizeof hist),
                  "delayed history differs after step %d", step);
        }
        opf_delayed_state_destroy(sc);
        opf_delayed_state_destroy(sg);
    }
    opf_ctx_destroy(cpu);
}

/* One quantizer of a block format over shapes x input dtypes x element
 * dtypes x usages, on data with edge values (inf and NaN every other case). */
typedef struct shape_case { int nd; int64_t s[3]; } shape_case;

static void sweep(opf_ctx *ctx, const opf_quantizer *base, const shape_case *sh, int n_sh,
                  const char *mode)
{
    static const unsigned all_usages[] = {OPF_USAGE_ROWWISE, OPF_USAGE_COLUMNWISE,
                                          OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE};
    int count = 0;
    for (int si = 0; si < n_sh; si++)
        for (int di = 0; di < 3; di++)
            for (int qi = 0; qi < 2; qi++)
                for (int ui = 0; ui < 3; ui++, count++) {
                    opf_spec sp = opf_spec_make(sh[si].nd, sh[si].s, in_dtypes[di]);
                    int64_t n = opf_spec_numel(&sp);
                    float *x = malloc((size_t)(n ? n : 1) * sizeof *x);
                    bool special = count % 2 == 0;
                    cuda_test_fill(x, n, 1.0f, 7, special);
                    opf_quantizer q = *base;
                    q.qdtype = q_dtypes[qi];
                    q.usage = all_usages[ui];
                    char what[192], ss[96];
                    opf_spec_str(&sp, ss, sizeof ss);
                    snprintf(what, sizeof what, "%s %s -> %s usage %u%s", mode, ss,
                             opf_dtype_name(q.qdtype), q.usage, special ? " (inf/nan)" : "");
                    cuda_test_check_quantize(ctx, &q, &q, &sp, x, what);
                    free(x);
                }
    printf("  %s: %d cases\n", mode, count);
}

/* MXFP8: 1x32 / 32x1 blocks and 32x32 tiles, compact and swizzled scales;
 * shapes that fill the 64x128 tiles of the kernel and cut them. */
static void test_mxfp8(opf_ctx *ctx)
{
    static const shape_case sh[] = {
        {2, {32, 32}}, {2, {64, 128}}, {2, {96, 160}}, {3, {2, 64, 96}}, {2, {160, 4160}},
        {2, {512, 1024}},
    };
    static const char *modes[] = {"mxfp8 1d compact", "mxfp8 1d swizzled", "mxfp8 2d compact",
                                  "mxfp8 2d swizzled"};
    for (int mi = 0; mi < 4; mi++) {
        opf_quantizer q = opf_quantizer_default();
        q.scaling = OPF_SCALING_MXFP8;
        q.swizzled = mi % 2 == 1;
        q.mxfp8_2d = mi >= 2;
        sweep(ctx, &q, sh, (int)(sizeof sh / sizeof sh[0]), modes[mi]);
    }
}

/* FP8 block scaling 1x128 and 128x128: shapes that are not multiples of
 * the tiles (the layout takes multiples of 16), with and without
 * power-of-two scales and an epsilon. */
static void test_block(opf_ctx *ctx)
{
    static const shape_case sh[] = {
        {2, {16, 16}},  {2, {48, 80}},   {2, {144, 304}},  {2, {128, 256}}, {2, {256, 48}},
        {2, {16, 2000}}, {3, {2, 64, 96}}, {2, {208, 1008}}, {2, {384, 1024}},
    };
    static const char *modes[] = {"block 1d pow2", "block 1d fp32 eps", "block 2d pow2",
                                  "block 2d fp32 eps"};
    for (int mi = 0; mi < 4; mi++) {
        opf_quantizer q = opf_quantizer_default();
        q.scaling = mi >= 2 ? OPF_SCALING_BLOCK_2D : OPF_SCALING_BLOCK_1D;
        q.pow2_scales = mi % 2 == 0;
        q.amax_epsilon = mi % 2 ? 1e-3f : 0.0f;
        sweep(ctx, &q, sh, (int)(sizeof sh / sizeof sh[0]), modes[mi]);
    }
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_current(ctx);
    test_current_reduce(ctx);
    test_delayed(ctx);
    test_mxfp8(ctx);
    test_block(ctx);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
