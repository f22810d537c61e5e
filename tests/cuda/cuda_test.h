/* cuda_test.h: what the GPU tests share: a CUDA context (exit 77, skipped,
 * without a GPU), random data with the edge values of
 * docs/numerics.md, and host <-> device tensor round trips. */
#ifndef OPFUSE_CUDA_TEST_H
#define OPFUSE_CUDA_TEST_H

#include <stdint.h>

#include "backend/backend-impl.h"
#include "backend/cuda/cuda.h"
#include "quant/quant-impl.h"
#include "test.h"

/* The context every GPU test runs on; exits 77 when the machine has no GPU. */
static inline opf_ctx *cuda_test_ctx(void)
{
    /* line-buffered: what a test printed survives its crash (under
     * compute-sanitizer, say, with stdout going to a log file) */
    setvbuf(stdout, NULL, _IOLBF, 0);
    opf_ctx *ctx = NULL;
    opf_ctx_options o = opf_ctx_options_default();
    o.device = OPF_DEVICE_CUDA;
    opf_status st = opf_ctx_create(&o, &ctx);
    if (st == OPF_ERR_UNSUPPORTED) {
        printf("SKIP: %s\n", opf_last_error(NULL));
        exit(77);
    }
    if (st != OPF_OK) {
        fprintf(stderr, "opf_ctx_create (cuda): %s\n", opf_last_error(NULL));
        exit(1);
    }
    char name[128];
    if (opf_cuda_device_name(ctx, name, sizeof name) == OPF_OK) printf("GPU: %s\n", name);
    return ctx;
}

static inline void cuda_test_done(opf_ctx *ctx) { opf_ctx_destroy(ctx); }

/* OPF_TEST_QUICK=1: the tests that read it leave out their largest cases,
 * every kernel path still running on the smaller ones, so that a run under
 * compute-sanitizer (kernels a hundred times slower) ends within its time
 * limit; scripts/gpu.sh sets it there. */
static inline bool cuda_test_quick(void)
{
    const char *v = getenv("OPF_TEST_QUICK");
    return v && v[0] == '1';
}

/* A device tensor of spec (its device aside); release with opf_tensor_release. */
static inline opf_status cuda_test_alloc(opf_ctx *ctx, const opf_spec *spec, opf_tensor *out)
{
    opf_spec s = *spec;
    s.device = OPF_DEVICE_CUDA;
    return opf_tensor_alloc(ctx, &s, out);
}

static uint64_t cuda_test_rng = 0x9E3779B97F4A7C15ull;

static inline uint32_t cuda_test_u32(void)
{
    cuda_test_rng ^= cuda_test_rng << 13;
    cuda_test_rng ^= cuda_test_rng >> 7;
    cuda_test_rng ^= cuda_test_rng << 17;
    return (uint32_t)(cuda_test_rng >> 16);
}

/* Uniform in [-1, 1). */
static inline float cuda_test_unit(void) { return (float)cuda_test_u32() / 2147483648.0f - 1.0f; }

/* The kernel table of a device (both are built here). */
static inline const opf_backend_i *cuda_test_table(opf_device dev) { return opf_backend_get(dev); }

/* The edge values of numerics.md: zeros, -0, subnormals, huge and tiny
 * values, values at and past the FP8 limits; inf and NaN when `special`. */
static inline float cuda_test_edge(bool special)
{
    static const float finite[] = {0.0f, -0.0f, 1e-40f, -1.4e-45f, 3e38f, -3.3e38f, 1e-30f,
                                   448.0f, 464.0f, -57344.0f, 0x1p-10f, 65504.0f, 1e-8f};
    int nf = (int)(sizeof finite / sizeof finite[0]);
    uint32_t r = cuda_test_u32() % (uint32_t)(nf + (special ? 3 : 0));
    if ((int)r < nf) return finite[r];
    return r == (uint32_t)nf ? INFINITY : r == (uint32_t)nf + 1 ? -INFINITY : NAN;
}

/* n values spread over magnitudes 1e-3..1e3, one in `every` an edge value. */
static inline void cuda_test_fill(float *x, int64_t n, float scale, int every, bool special)
{
    for (int64_t i = 0; i < n; i++) {
        float mag = powf(10.0f, 3.0f * cuda_test_unit());
        x[i] = scale * mag * cuda_test_unit();
        if (every && cuda_test_u32() % (uint32_t)every == 0) x[i] = cuda_test_edge(special);
    }
}

/* A host tensor of spec filled from f32 values (converted to its dtype). */
static inline opf_status cuda_test_host_tensor(opf_ctx *ctx, const opf_spec *spec, const float *x,
                                        opf_tensor *out)
{
    opf_status st = opf_tensor_alloc(ctx, spec, out);
    if (st) return st;
    return opf_convert(x, OPF_F32, out->data[OPF_COMP_DATA], spec->dtype,
                       (size_t)opf_spec_numel(spec));
}

/* The device copy of a host tensor. */
static inline opf_status cuda_test_upload(opf_ctx *ctx, const opf_tensor *h, opf_tensor *d)
{
    return opf_tensor_to(ctx, h, OPF_DEVICE_CUDA, d);
}

/* A host tensor of d's spec holding d's bytes. */
static inline opf_status cuda_test_download(opf_ctx *ctx, const opf_tensor *d, opf_tensor *h)
{
    return opf_tensor_to(ctx, d, OPF_DEVICE_CPU, h);
}

/* ||a - b|| / ||b|| over n floats; NaN when any is NaN. */
static inline double cuda_test_rel_err(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Whether two host tensors of one spec hold the same bytes; prints the
 * first differing byte of every component that differs. */
static inline bool cuda_test_same_bytes(const opf_tensor *want, const opf_tensor *got,
                                        const char *what)
{
    static const char *const names[OPF_COMP_COUNT] = {
        "data", "scale_inv", "columnwise data", "columnwise scale_inv", "amax", "columnwise amax"};
    opf_layout L;
    if (!opf_spec_equal(&want->spec, &got->spec) || opf_spec_layout(&want->spec, &L)) return false;
    bool same = true;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        const uint8_t *a = want->data[c], *b = got->data[c];
        size_t n = L.comp[c].present ? L.comp[c].nbytes : 0, i = 0, bad = 0;
        for (size_t k = 0; k < n; k++) bad += a[k] != b[k];
        if (!bad) continue;
        while (a[i] == b[i]) i++;
        printf("    %s: %s: %zu of %zu bytes differ, first at byte %zu of [%lld, %lld]: cpu 0x%02x "
               "gpu 0x%02x\n", what, names[c], bad, n, i, (long long)L.comp[c].rows,
               (long long)L.comp[c].cols, a[i], b[i]);
        same = false;
    }
    return same;
}

/* Dequantizes copy `which` on both devices and compares the fp32 bytes. */
static inline void cuda_test_check_dequantize(opf_ctx *ctx, const opf_tensor *hq,
                                              const opf_tensor *dq, unsigned which,
                                              const char *what)
{
    int64_t n = opf_spec_numel(&hq->spec);
    float *ref = malloc((size_t)(n ? n : 1) * sizeof *ref), *got = malloc((size_t)(n ? n : 1) * sizeof *got);
    void *dev = NULL;
    opf_scaling sc = hq->spec.scaling;
    CHECK_OK(ctx, cuda_test_table(OPF_DEVICE_CPU)->dequantize[sc](ctx, hq, which, ref));
    CHECK_OK(ctx, opf_cuda_alloc(ctx, (size_t)n * sizeof(float), &dev));
    CHECK_OK(ctx, cuda_test_table(OPF_DEVICE_CUDA)->dequantize[sc](ctx, dq, which, dev));
    CHECK_OK(ctx, opf_cuda_copy(ctx, got, dev, (size_t)n * sizeof(float), OPF_CUDA_D2H));
    int64_t i = 0;
    while (i < n && !memcmp(ref + i, got + i, sizeof(float))) i++;
    CHECK(i == n, "dequantize %s (%s copy) differs at %lld: cpu %a gpu %a", what,
          which == OPF_USAGE_ROWWISE ? "rowwise" : "columnwise", (long long)i,
          i < n ? (double)ref[i] : 0.0, i < n ? (double)got[i] : 0.0);
    opf_cuda_free(ctx, dev);
    free(ref);
    free(got);
}

/* Quantizes x (host, the f32 values of the input) with q on the CPU
 * (opf_quantize_alloc, at the context's RNG position) and with q_gpu
 * through the CUDA table at the same position, compares every byte and
 * both dequantized copies; returns whether the bytes agree. */
static inline bool cuda_test_check_quantize(opf_ctx *ctx, const opf_quantizer *q,
                                            const opf_quantizer *q_gpu, const opf_spec *in_spec,
                                            const float *x, const char *what)
{
    opf_tensor hin, hq, din, dq, got;
    opf_quantize_state qs = {0};
    opf_ctx_get_rng(ctx, &qs.rng_seed, &qs.rng_offset);
    opf_quantize_state_delayed(q_gpu, &qs);
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, in_spec, x, &hin));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, q, &hin, &hq));
    CHECK_OK(ctx, cuda_test_upload(ctx, &hin, &din));
    CHECK_OK(ctx, cuda_test_alloc(ctx, &hq.spec, &dq));
    CHECK_OK(ctx, cuda_test_table(OPF_DEVICE_CUDA)->quantize[q->scaling](ctx, q_gpu, &din, &dq, &qs));
    CHECK_OK(ctx, cuda_test_download(ctx, &dq, &got));
    bool same = cuda_test_same_bytes(&hq, &got, what);
    CHECK(same, "quantize %s differs from the CPU", what);
    if (q->usage & OPF_USAGE_ROWWISE)
        cuda_test_check_dequantize(ctx, &hq, &dq, OPF_USAGE_ROWWISE, what);
    if (q->usage & OPF_USAGE_COLUMNWISE)
        cuda_test_check_dequantize(ctx, &hq, &dq, OPF_USAGE_COLUMNWISE, what);
    opf_tensor *ts[] = {&hin, &hq, &got, &din, &dq};
    for (int i = 0; i < 5; i++) opf_tensor_release(ts[i]);
    return same;
}

#endif
