/* test_cuda_quant.c: the GPU quantization kernels against the CPU reference,
 * byte for byte: every component (data, transposed copy, scale_inv, amax),
 * the dequantized values, and the delayed-scaling state after ten steps. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "cuda_test.h"

static const opf_dtype in_dtypes[] = {OPF_F32, OPF_BF16, OPF_F16};
static const opf_dtype q_dtypes[] = {OPF_E4M3, OPF_E5M2};
static const unsigned usages[] = {OPF_USAGE_ROWWISE, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE};
/* Shapes that fill the tiles, cut them, and leave the vector path. */
static const struct { int nd; int64_t s[3]; } shapes[] = {
    {2, {1, 1}},     {2, {3, 5}},      {2, {64, 128}},  {2, {77, 300}},
    {2, {128, 256}}, {2, {256, 48}},   {2, {33, 16}},   {3, {2, 64, 96}},
    {2, {1000, 1024}}, {2, {48, 1000}},
};
enum { N_SHAPES = sizeof shapes / sizeof shapes[0] };

/* Dequantizes copy `which` on both devices and compares the fp32 bytes. */
static void check_dequantize(opf_ctx *ctx, const opf_tensor *hq, const opf_tensor *dq,
                             unsigned which, const char *what)
{
    int64_t n = opf_spec_numel(&hq->spec);
    float *ref = malloc((size_t)n * sizeof *ref), *got = malloc((size_t)n * sizeof *got);
    void *dev = NULL;
    CHECK_OK(ctx, opf_cpu_dequantize_tensor_fp8(ctx, hq, which, ref));
    CHECK_OK(ctx, opf_cuda_alloc(ctx, (size_t)n * sizeof(float), &dev));
    CHECK_OK(ctx, opf_cuda_dequantize_tensor_fp8(ctx, dq, which, dev));
    CHECK_OK(ctx, opf_cuda_copy(ctx, got, dev, (size_t)n * sizeof(float), OPF_CUDA_D2H));
    CHECK(!memcmp(ref, got, (size_t)n * sizeof(float)), "dequantize %s (%s copy) differs", what,
          which == OPF_USAGE_ROWWISE ? "rowwise" : "columnwise");
    opf_cuda_free(ctx, dev);
    free(ref);
    free(got);
}

/* Quantizes x (host, f32 values of the input) with q on both devices and
 * compares every byte; returns the GPU result on the host in *got. */
static void check_case(opf_ctx *ctx, const opf_quantizer *q, const opf_quantizer *q_gpu,
                       const opf_spec *in_spec, const float *x, const char *what)
{
    opf_tensor hin, hq, din, dq, got;
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, in_spec, x, &hin));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, q, &hin, &hq));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hin, &din));
    CHECK_OK(ctx, opf_cuda_tensor_alloc(ctx, &hq.spec, &dq));
    CHECK_OK(ctx, opf_cuda_quantize_tensor_fp8(ctx, q_gpu, &din, &dq, 0, 0));
    CHECK_OK(ctx, cuda_test_download(ctx, &dq, &got));
    CHECK(opf_test_same_bytes(&hq, &got), "quantize %s differs from the CPU", what);
    check_dequantize(ctx, &hq, &dq, OPF_USAGE_ROWWISE, what);
    if (q->usage & OPF_USAGE_COLUMNWISE) check_dequantize(ctx, &hq, &dq, OPF_USAGE_COLUMNWISE, what);
    opf_tensor_release(&hin);
    opf_tensor_release(&hq);
    opf_tensor_release(&got);
    opf_cuda_tensor_free(ctx, &din);
    opf_cuda_tensor_free(ctx, &dq);
}

static opf_quantizer fp8_quantizer(opf_dtype qd, unsigned usage)
{
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.qdtype = qd;
    q.usage = usage;
    return q;
}

/* Current scaling: every dtype x element dtype x usage x shape, on data
 * with edge values (inf and NaN in half of the cases), pow2 and epsilon. */
static void test_current(opf_ctx *ctx)
{
    for (int si = 0; si < N_SHAPES; si++)
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
                    snprintf(what, sizeof what, "current %s -> %s usage %u%s", ss,
                             opf_dtype_name(q.qdtype), q.usage, special ? " (inf/nan)" : "");
                    check_case(ctx, &q, &q, &sp, x, what);
                    free(x);
                }
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
    check_case(ctx, &q, &q, &sp, x, "current scaling with amax reduction");
}

/* Delayed scaling: ten steps with the CPU and the GPU on states of their
 * own; after each step the update runs on both, and bytes, scales and
 * history must agree. */
static void test_delayed(opf_ctx *ctx)
{
    for (int di = 0; di < 3; di++) {
        opf_delayed_state *sc = NULL, *sg = NULL;
        CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, 4, OPF_AMAX_MAX,
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
            check_case(ctx, &qc, &qg, &sp, x, what);
            free(x);
            CHECK_OK(ctx, opf_cuda_delayed_flush(ctx));  /* the device amaxes into row 0 */
            CHECK_OK(ctx, opf_delayed_state_update(ctx, sc, NULL, NULL));
            CHECK_OK(ctx, opf_delayed_state_update(ctx, sg, NULL, NULL));
            CHECK(!memcmp(opf_delayed_state_scale(sc), opf_delayed_state_scale(sg), 2 * sizeof(float)),
                  "delayed scales differ after step %d", step);
            CHECK(!memcmp(opf_delayed_state_history(sc), opf_delayed_state_history(sg),
                          4 * 2 * sizeof(float)),
                  "delayed history differs after step %d", step);
        }
        opf_delayed_state_destroy(sc);
        opf_delayed_state_destroy(sg);
    }
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_current(ctx);
    test_current_reduce(ctx);
    test_delayed(ctx);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
