/* test_device.c: where tensors live, on any machine. A CUDA context without
 * a GPU (or without CUDA in the build) is a clear OPF_ERR_UNSUPPORTED and the
 * CPU keeps working; every dispatcher refuses tensors of two devices with a
 * message naming both, and a refused call changes nothing. Device tensors
 * here are host memory labelled CUDA: the checks refuse them before any
 * kernel could touch them. The GPU side: tests/cuda/test_cuda_ctx.c. */
#include "test.h"

enum { R = 32, C = 64 };

static opf_ctx *ctx;

/* A tensor of spec s on device dev over caller memory (never dereferenced
 * when dev is CUDA). */
static opf_tensor wrap_on(opf_spec s, opf_device dev, void *mem)
{
    opf_tensor t;
    s.device = dev;
    opf_tensor_wrap(&s, mem, &t);
    return t;
}

static void test_no_gpu(void)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.device = OPF_DEVICE_CUDA;
    opf_ctx *g = NULL;
    opf_status st = opf_ctx_create(&o, &g);
    if (st == OPF_OK) {  /* a GPU machine: the GPU test covers it */
        printf("a GPU is present: %s context made\n", opf_device_name(opf_ctx_device(g)));
        CHECK(opf_ctx_device(g) == OPF_DEVICE_CUDA, "device %d", (int)opf_ctx_device(g));
        opf_ctx_destroy(g);
        return;
    }
    printf("no CUDA context: %s\n", opf_last_error(NULL));
    CHECK_FAILS(NULL, st, OPF_ERR_UNSUPPORTED, "opf_ctx_create", "cuda");
    CHECK(g == NULL, "ctx written on failure");
    o.device_index = 99;
    CHECK_FAILS(NULL, opf_ctx_create(&o, &g), OPF_ERR_UNSUPPORTED, "opf_ctx_create", "cuda");
    /* the CPU path keeps working after the refusal */
    opf_ctx *c = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &c));
    opf_spec s = opf_spec_make(2, (int64_t[]){R, C}, OPF_F32);
    opf_tensor x, q;
    CHECK_OK(c, opf_tensor_alloc(c, &s, &x));
    for (int i = 0; i < R * C; i++) ((float *)x.data[0])[i] = (float)(i % 17) - 8.0f;
    opf_quantizer qz = opf_quantizer_default();
    qz.scaling = OPF_SCALING_TENSOR, qz.qdtype = OPF_E4M3, qz.usage = OPF_USAGE_ROWWISE;
    CHECK_OK(c, opf_quantize_alloc(c, &qz, &x, &q));
    CHECK_OK(c, opf_ctx_sync(c));
    opf_tensor_release(&x);
    opf_tensor_release(&q);
    opf_ctx_destroy(c);
}

static void test_names(void)
{
    CHECK(!strcmp(opf_device_name(OPF_DEVICE_CPU), "cpu"), "cpu");
    CHECK(!strcmp(opf_device_name(OPF_DEVICE_CUDA), "cuda"), "cuda");
    CHECK(!strcmp(opf_device_name((opf_device)7), "device 7"), "%s", opf_device_name((opf_device)7));
}

/* Counters and RNG that a refused call must leave as they were. */
typedef struct snapshot {
    opf_alloc_stats a;
    uint64_t        seed, offset;
} snapshot;

static snapshot take(void)
{
    snapshot s;
    opf_ctx_alloc_stats(ctx, &s.a);
    opf_ctx_get_rng(ctx, &s.seed, &s.offset);
    return s;
}

static void check_same(const snapshot *s, int line)
{
    snapshot n = take();
    CHECK(!memcmp(&s->a, &n.a, sizeof n.a), "allocation counters changed (line %d)", line);
    CHECK(s->seed == n.seed && s->offset == n.offset, "RNG moved (line %d)", line);
}

/* A refused call: status, message, and nothing changed (counters, RNG, the
 * output bytes `out` of n bytes). */
#define REFUSED(expr, out, n, ...)                                                 \
    do {                                                                           \
        unsigned char before_[4 * R * C];                                          \
        memcpy(before_, (out), (n));                                               \
        snapshot s_ = take();                                                      \
        CHECK_FAILS(ctx, (expr), OPF_ERR_INVALID_ARG, __VA_ARGS__);                \
        check_same(&s_, __LINE__);                                                 \
        CHECK(!memcmp(before_, (out), (n)), "output changed (line %d)", __LINE__); \
    } while (0)

static void test_tensors(void)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){R, C}, OPF_F32);
    static float host[R * C], fake[R * C];
    opf_tensor h = wrap_on(s, OPF_DEVICE_CPU, host), d = wrap_on(s, OPF_DEVICE_CUDA, fake);
    for (int i = 0; i < R * C; i++) host[i] = (float)i;
    /* a CUDA spec needs a CUDA context */
    opf_spec sd = s;
    sd.device = OPF_DEVICE_CUDA;
    opf_tensor t;
    snapshot s0 = take();
    CHECK_FAILS(ctx, opf_tensor_alloc(ctx, &sd, &t), OPF_ERR_INVALID_ARG, "opf_tensor_alloc",
                "the spec is on cuda, the context on cpu");
    CHECK(t.buf == NULL && t.data[0] == NULL, "tensor not zeroed on failure");
    CHECK_FAILS(ctx, opf_tensor_to(ctx, &h, OPF_DEVICE_CUDA, &t), OPF_ERR_INVALID_ARG,
                "the spec is on cuda, the context on cpu");
    check_same(&s0, __LINE__);
    REFUSED(opf_tensor_copy(ctx, &d, &h), host, sizeof host, "opf_tensor_copy",
            "the source is on cuda, the context on cpu");
    /* on the host, to and copy are plain copies of every component */
    CHECK_OK(ctx, opf_tensor_to(ctx, &h, OPF_DEVICE_CPU, &t));
    CHECK(opf_test_same_bytes(&h, &t), "opf_tensor_to on the host");
    opf_tensor small = wrap_on(opf_spec_make(2, (int64_t[]){R, R}, OPF_F32), OPF_DEVICE_CPU, fake);
    CHECK_FAILS(ctx, opf_tensor_copy(ctx, &t, &small), OPF_ERR_SHAPE, "source is f32[32,64]",
                "destination f32[32,32]");
    memset(host, 0, sizeof host);
    CHECK_OK(ctx, opf_tensor_copy(ctx, &t, &h));
    CHECK(host[R * C - 1] == (float)(R * C - 1), "copy back");
    opf_tensor_release(&t);
    opf_alloc_stats a, b;
    opf_ctx_alloc_stats(ctx, &a);
    opf_ctx_host_alloc_stats(ctx, &b);
    CHECK(!memcmp(&a, &b, sizeof a), "a CPU context's counters are its host counters");
}

static void test_dispatch(void)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){R, C}, OPF_F32);
    static float x[R * C], fake[R * C];
    static unsigned char outbuf[4 * R * C];
    for (int i = 0; i < R * C; i++) x[i] = (float)(i % 29) - 14.0f;
    opf_tensor h = wrap_on(s, OPF_DEVICE_CPU, x), d = wrap_on(s, OPF_DEVICE_CUDA, fake);

    /* quantize: input on one device, output on the other; both on CUDA */
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR, q.qdtype = OPF_E4M3, q.usage = OPF_USAGE_ROWWISE;
    q.stochastic = false;
    opf_spec qs;
    CHECK_OK(NULL, opf_quantizer_spec(&q, &s, &qs));
    opf_layout L;
    CHECK_OK(NULL, opf_spec_layout(&qs, &L));
    CHECK(L.total_bytes <= sizeof outbuf, "buffer too small: %zu", L.total_bytes);
    memset(outbuf, 0xA5, sizeof outbuf);
    opf_tensor qh, qd;
    CHECK_OK(NULL, opf_tensor_wrap(&qs, outbuf, &qh));
    qs.device = OPF_DEVICE_CUDA;
    CHECK_OK(NULL, opf_tensor_wrap(&qs, outbuf, &qd));
    REFUSED(opf_quantize(ctx, &q, &d, &qh), outbuf, L.total_bytes, "quantize",
            "the input is on cuda, the output on cpu");
    REFUSED(opf_quantize(ctx, &q, &h, &qd), outbuf, L.total_bytes, "quantize",
            "the input is on cpu, the output on cuda");
    REFUSED(opf_quantize(ctx, &q, &d, &qd), outbuf, L.total_bytes, "quantize",
            "the input is on cuda, the context on cpu");
    /* dequantize: a host FP8 tensor into a CUDA output */
    CHECK_OK(ctx, opf_quantize(ctx, &q, &h, &qh));
    REFUSED(opf_dequantize(ctx, &qh, OPF_USAGE_ROWWISE, &d), fake, sizeof fake, "dequantize",
            "the input is on cpu, the output on cuda");

    /* gemm: TN, A [N=R, K=C], B [M=R, K=C], D [M, N]; then a CUDA bias */
    opf_spec ds = opf_spec_make(2, (int64_t[]){R, R}, OPF_F32);
    static float dmem[R * R], bmem[R];
    opf_tensor dh = wrap_on(ds, OPF_DEVICE_CPU, dmem);
    REFUSED(opf_gemm(ctx, &h, &d, OPF_GEMM_TN, NULL, &dh), dmem, sizeof dmem, "gemm",
            "A is on cpu, B on cuda");
    opf_tensor bias = wrap_on(opf_spec_make(1, (int64_t[]){R}, OPF_F32), OPF_DEVICE_CUDA, bmem);
    opf_gemm_options o = opf_gemm_options_default();
    o.bias = &bias;
    REFUSED(opf_gemm(ctx, &h, &h, OPF_GEMM_TN, &o, &dh), dmem, sizeof dmem, "gemm",
            "A is on cpu, bias on cuda");
    o.bias = NULL;
    CHECK_OK(ctx, opf_gemm(ctx, &h, &h, OPF_GEMM_TN, &o, &dh));  /* one device: runs */
    opf_spec out;
    CHECK_FAILS(NULL, opf_gemm_out_spec(&h.spec, &d.spec, OPF_GEMM_TN, OPF_F32, &out),
                OPF_ERR_INVALID_ARG, "A is on cpu, B on cuda");

    /* an op's arguments (every op call validates them against its schema) */
    typedef struct two_args { opf_tensor x, w; } two_args;
    static const opf_field f[] = {OPF_F_TENSOR(two_args, x), OPF_F_TENSOR(two_args, w)};
    OPF_SCHEMA(two_schema, two_args, f);
    two_args args = {d, h};
    CHECK_FAILS(NULL, opf_schema_validate(&two_schema, &args), OPF_ERR_INVALID_ARG, "two_args",
                "x is on cuda, w on cpu");
    args.x = h;
    CHECK_OK(NULL, opf_schema_validate(&two_schema, &args));

    /* swizzling works on host scales only */
    opf_tensor mx = qd;
    mx.spec.scaling = OPF_SCALING_MXFP8;
    CHECK_FAILS(ctx, opf_tensor_swizzle(ctx, &mx, true), OPF_ERR_UNSUPPORTED, "on cuda");
}

int main(void)
{
    test_names();
    test_no_gpu();
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    test_tensors();
    test_dispatch();
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
