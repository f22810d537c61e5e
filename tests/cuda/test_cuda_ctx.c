/* test_cuda_ctx.c: a CUDA context through the public API only: made by
 * opf_ctx_create, tensors allocated on the device by opf_tensor_alloc and
 * counted (with a peak) in opf_ctx_alloc_stats, moved by opf_tensor_to /
 * opf_tensor_copy, and quantize + dequantize + GEMM run on the device with
 * the bytes of a CPU context (quantization) or within numerics.md's
 * tolerance (GEMM). Exits 77 (skipped) without a GPU. */
#include "test.h"

enum { M = 128, N = 96, K = 256 };

static opf_ctx *gpu, *cpu;

static double rel_err(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* A host bf16 tensor of shape [r, c] with values spread over magnitudes. */
static opf_tensor host_bf16(int64_t r, int64_t c, uint32_t seed)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){r, c}, OPF_BF16);
    opf_tensor t;
    float *v = malloc((size_t)(r * c) * sizeof *v);
    for (int64_t i = 0; i < r * c; i++) {
        seed = seed * 1664525u + 1013904223u;
        v[i] = ((float)(seed >> 8) / 8388608.0f - 1.0f) * (i % 7 == 0 ? 20.0f : 1.0f);
    }
    CHECK_OK(cpu, opf_tensor_alloc(cpu, &s, &t));
    opf_convert(v, OPF_F32, t.data[OPF_COMP_DATA], OPF_BF16, (size_t)(r * c));
    free(v);
    return t;
}

/* The host copy of a device tensor (the spec but for the device). */
static opf_tensor to_host(const opf_tensor *g)
{
    opf_tensor h;
    memset(&h, 0, sizeof h);
    CHECK_OK(gpu, opf_tensor_to(gpu, g, OPF_DEVICE_CPU, &h));
    return h;
}

static void test_memory(void)
{
    opf_alloc_stats a0, a;
    opf_ctx_alloc_stats(gpu, &a0);
    CHECK(a0.n_alloc == 0 && a0.bytes_live == 0, "a fresh context holds device memory");
    opf_tensor h = host_bf16(M, K, 1), g, g2, back;
    CHECK_OK(gpu, opf_tensor_to(gpu, &h, OPF_DEVICE_CUDA, &g));
    CHECK(g.spec.device == OPF_DEVICE_CUDA, "device %d", (int)g.spec.device);
    size_t bytes = opf_tensor_buffer_bytes(&g);
    opf_ctx_alloc_stats(gpu, &a);
    CHECK(a.n_alloc == 1 && a.bytes_live == bytes && a.bytes_peak == bytes,
          "after one tensor: %llu allocs, %zu live, %zu peak (buffer %zu)",
          (unsigned long long)a.n_alloc, a.bytes_live, a.bytes_peak, bytes);
    /* device to device, then back to the host: the same bytes */
    CHECK_OK(gpu, opf_tensor_to(gpu, &g, OPF_DEVICE_CUDA, &g2));
    opf_ctx_alloc_stats(gpu, &a);
    CHECK(a.bytes_live == 2 * bytes && a.bytes_peak == 2 * bytes, "two tensors: %zu live, %zu peak",
          a.bytes_live, a.bytes_peak);
    back = to_host(&g2);
    CHECK(back.spec.device == OPF_DEVICE_CPU && opf_test_same_bytes(&h, &back),
          "host -> cuda -> cuda -> host changed the bytes");
    /* copy into an existing device tensor */
    opf_tensor z = host_bf16(M, K, 2);
    CHECK_OK(gpu, opf_tensor_copy(gpu, &z, &g2));
    opf_tensor_release(&back);
    back = to_host(&g2);
    CHECK(opf_test_same_bytes(&z, &back), "opf_tensor_copy host -> cuda");
    opf_tensor_release(&g2);
    opf_ctx_alloc_stats(gpu, &a);
    CHECK(a.bytes_live == bytes && a.bytes_peak == 2 * bytes && a.n_free == 1,
          "after a release: %zu live, %zu peak, %llu frees", a.bytes_live, a.bytes_peak,
          (unsigned long long)a.n_free);
    opf_ctx_alloc_reset_peak(gpu);
    opf_ctx_alloc_stats(gpu, &a);
    CHECK(a.bytes_peak == bytes, "peak after reset %zu", a.bytes_peak);
    /* host memory of the CUDA context is counted apart */
    opf_alloc_stats hs;
    opf_ctx_host_alloc_stats(gpu, &hs);
    CHECK(hs.bytes_live >= opf_tensor_buffer_bytes(&back), "host counters %zu", hs.bytes_live);
    /* a refused copy: two devices' shapes differ */
    opf_tensor small = host_bf16(M, M, 3);
    CHECK_FAILS(gpu, opf_tensor_copy(gpu, &small, &g), OPF_ERR_SHAPE, "opf_tensor_copy");
    opf_tensor *ts[] = {&h, &g, &back, &z, &small};
    for (int i = 0; i < 5; i++) opf_tensor_release(ts[i]);
    CHECK_OK(gpu, opf_ctx_sync(gpu));
    opf_ctx_alloc_stats(gpu, &a);
    CHECK(a.bytes_live == 0 && a.n_alloc == a.n_free, "leak: %zu live, %llu allocs, %llu frees",
          a.bytes_live, (unsigned long long)a.n_alloc, (unsigned long long)a.n_free);
}

/* Quantize x with q on both contexts: the device bytes are the CPU bytes. */
static void quantize_both(const opf_quantizer *q, const opf_tensor *x, opf_tensor *hq,
                          opf_tensor *gq)
{
    opf_tensor gx, back;
    CHECK_OK(cpu, opf_quantize_alloc(cpu, q, x, hq));
    CHECK_OK(gpu, opf_tensor_to(gpu, x, OPF_DEVICE_CUDA, &gx));
    CHECK_OK(gpu, opf_quantize_alloc(gpu, q, &gx, gq));
    CHECK(gq->spec.device == OPF_DEVICE_CUDA, "quantized on %s", opf_device_name(gq->spec.device));
    back = to_host(gq);
    CHECK(opf_test_same_bytes(hq, &back), "quantize on cuda differs from the CPU");
    /* dequantize on the device: the same fp32 bytes */
    opf_spec fs = opf_spec_make(x->spec.ndim, x->spec.shape, OPF_F32);
    opf_tensor hf, gf, gfh;
    CHECK_OK(cpu, opf_tensor_alloc(cpu, &fs, &hf));
    fs.device = OPF_DEVICE_CUDA;
    CHECK_OK(gpu, opf_tensor_alloc(gpu, &fs, &gf));
    CHECK_OK(cpu, opf_dequantize(cpu, hq, OPF_USAGE_ROWWISE, &hf));
    CHECK_OK(gpu, opf_dequantize(gpu, gq, OPF_USAGE_ROWWISE, &gf));
    gfh = to_host(&gf);
    CHECK(opf_test_same_bytes(&hf, &gfh), "dequantize on cuda differs from the CPU");
    opf_tensor *ts[] = {&gx, &back, &hf, &gf, &gfh};
    for (int i = 0; i < 5; i++) opf_tensor_release(ts[i]);
}

/* D = B A^T (TN) on both contexts; the relative error of the device's D. */
static double gemm_both(const opf_tensor *ha, const opf_tensor *hb, const opf_tensor *ga,
                        const opf_tensor *gb)
{
    opf_spec ds = opf_spec_make(2, (int64_t[]){M, N}, OPF_BF16);
    opf_tensor hd, gd, back;
    CHECK_OK(cpu, opf_tensor_alloc(cpu, &ds, &hd));
    ds.device = OPF_DEVICE_CUDA;
    CHECK_OK(gpu, opf_tensor_alloc(gpu, &ds, &gd));
    CHECK_OK(cpu, opf_gemm(cpu, ha, hb, OPF_GEMM_TN, NULL, &hd));
    CHECK_OK(gpu, opf_gemm(gpu, ga, gb, OPF_GEMM_TN, NULL, &gd));
    back = to_host(&gd);
    static float ref[M * N], got[M * N];
    opf_convert(hd.data[0], OPF_BF16, ref, OPF_F32, M * N);
    opf_convert(back.data[0], OPF_BF16, got, OPF_F32, M * N);
    opf_tensor_release(&hd);
    opf_tensor_release(&gd);
    opf_tensor_release(&back);
    return rel_err(got, ref, M * N);
}

static void test_quantize_gemm(void)
{
    opf_tensor x = host_bf16(M, K, 11), w = host_bf16(N, K, 12), gx, gw;
    /* plain BF16 GEMM (numerics.md 8: bf16 output, fp32 sums in another order) */
    CHECK_OK(gpu, opf_tensor_to(gpu, &x, OPF_DEVICE_CUDA, &gx));
    CHECK_OK(gpu, opf_tensor_to(gpu, &w, OPF_DEVICE_CUDA, &gw));
    double e = gemm_both(&w, &x, &gw, &gx);
    printf("bf16 gemm TN: rel err %.2e\n", e);
    CHECK(e <= 8e-3, "bf16 gemm rel err %.3e", e);
    /* per-tensor FP8, current scaling, both copies */
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR, q.qdtype = OPF_E4M3;
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    opf_tensor hqx, gqx, hqw, gqw;
    quantize_both(&q, &x, &hqx, &gqx);
    quantize_both(&q, &w, &hqw, &gqw);
    e = gemm_both(&hqw, &hqx, &gqw, &gqx);
    printf("fp8 gemm TN: rel err %.2e\n", e);
    CHECK(e <= 8e-3, "fp8 gemm rel err %.3e", e);
    /* two devices in one call: refused, naming both */
    opf_spec ds = opf_spec_make(2, (int64_t[]){M, N}, OPF_BF16);
    ds.device = OPF_DEVICE_CUDA;
    opf_tensor gd;
    CHECK_OK(gpu, opf_tensor_alloc(gpu, &ds, &gd));
    CHECK_FAILS(gpu, opf_gemm(gpu, &gqw, &hqx, OPF_GEMM_TN, NULL, &gd), OPF_ERR_INVALID_ARG,
                "gemm", "A is on cuda, B on cpu");
    CHECK_FAILS(gpu, opf_quantize(gpu, &q, &x, &gqx), OPF_ERR_INVALID_ARG, "quantize",
                "the input is on cpu, the output on cuda");
    /* host tensors on a CUDA context run the CPU kernels */
    opf_tensor hq2;
    CHECK_OK(gpu, opf_quantize_alloc(gpu, &q, &x, &hq2));
    CHECK(opf_test_same_bytes(&hqx, &hq2), "host quantize on the CUDA context");
    opf_tensor *ts[] = {&x, &w, &gx, &gw, &hqx, &gqx, &hqw, &gqw, &gd, &hq2};
    for (int i = 0; i < 10; i++) opf_tensor_release(ts[i]);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);  /* as cuda_test_ctx: output survives a crash */
    opf_ctx_options o = opf_ctx_options_default();
    o.device = OPF_DEVICE_CUDA;
    opf_status st = opf_ctx_create(&o, &gpu);
    if (st == OPF_ERR_UNSUPPORTED) {
        printf("SKIP: %s\n", opf_last_error(NULL));
        return 77;
    }
    CHECK_OK(NULL, st);
    if (st) TEST_DONE();
    CHECK(opf_ctx_device(gpu) == OPF_DEVICE_CUDA, "device %d", (int)opf_ctx_device(gpu));
    CHECK_OK(NULL, opf_ctx_create(NULL, &cpu));
    test_memory();
    test_quantize_gemm();
    /* a device buffer may outlive its context */
    opf_spec s = opf_spec_make(1, (int64_t[]){1000}, OPF_F32);
    s.device = OPF_DEVICE_CUDA;
    opf_tensor late;
    CHECK_OK(gpu, opf_tensor_alloc(gpu, &s, &late));
    opf_ctx_destroy(gpu);
    opf_tensor_release(&late);
    opf_ctx_destroy(cpu);
    TEST_DONE();
}
