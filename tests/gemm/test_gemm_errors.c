/* test_gemm_errors.c: every bad input to opf_gemm and opf_gemm_out_spec gets
 * its status and a message naming the values, and leaves D byte for byte as
 * it was (and the out spec untouched). */
#include "test.h"

static opf_ctx *ctx;
static unsigned long long seed = 1;

/* A plain [r, c] tensor of dt with random values. */
static opf_tensor plain(int64_t r, int64_t c, opf_dtype dt)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){r, c}, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    float *v = malloc((size_t)(r * c + 1) * sizeof(float));
    for (int64_t i = 0; i < r * c; i++) v[i] = opf_test_uniform(&seed, -1, 1);
    if (dt == OPF_F32 || dt == OPF_BF16 || dt == OPF_F16)
        CHECK_OK(ctx, opf_convert(v, OPF_F32, t.data[OPF_COMP_DATA], dt, (size_t)(r * c)));
    free(v);
    return t;
}

/* [r, c] bf16 values quantized with (scaling, qdtype, usage, rht). */
static opf_tensor quant(int64_t r, int64_t c, opf_scaling sc, opf_dtype qd, unsigned usage,
                        bool rht)
{
    opf_tensor x = plain(r, c, OPF_BF16), out;
    opf_quantizer q = opf_quantizer_default();
    q.scaling = sc;
    q.qdtype = qd;
    q.usage = usage;
    q.rht = rht;
    q.pow2_scales = true;
    memset(&out, 0, sizeof out);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &out));
    opf_tensor_release(&x);
    return out;
}

/* A copy of every component of D, to prove a failed call left it alone. */
typedef struct snapshot {
    void  *bytes[OPF_COMP_COUNT];
    size_t n[OPF_COMP_COUNT];
} snapshot;

static snapshot take(const opf_tensor *d)
{
    snapshot s;
    memset(&s, 0, sizeof s);
    opf_layout L;
    if (opf_spec_layout(&d->spec, &L)) return s;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && d->data[c]) {
            s.n[c] = L.comp[c].nbytes;
            s.bytes[c] = malloc(s.n[c] + 1);
            memcpy(s.bytes[c], d->data[c], s.n[c]);
        }
    return s;
}

static bool same(snapshot *s, const opf_tensor *d)
{
    bool ok = true;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (s->bytes[c]) ok &= !memcmp(s->bytes[c], d->data[c], s->n[c]);
        free(s->bytes[c]);
    }
    return ok;
}

/* opf_gemm must fail with `want`, a message holding every substring, and D
 * unchanged. */
#define GEMM_FAILS(a, b, L, o, d, want, ...)                                          \
    do {                                                                              \
        snapshot snap_ = take(d);                                                     \
        CHECK_FAILS(ctx, opf_gemm(ctx, a, b, L, o, d), want, __VA_ARGS__);           \
        CHECK(same(&snap_, d), "D changed by a failed call at line %d", __LINE__);    \
    } while (0)

static void test_nulls_and_layout(void)
{
    opf_tensor a = plain(80, 64, OPF_F32), b = plain(48, 64, OPF_F32), d = plain(48, 80, OPF_F32);
    opf_gemm_options o = opf_gemm_options_default();
    CHECK_FAILS(NULL, opf_gemm(NULL, &a, &b, OPF_GEMM_TN, &o, &d), OPF_ERR_INVALID_ARG, "gemm",
                "ctx is NULL");
    GEMM_FAILS(NULL, &b, OPF_GEMM_TN, &o, &d, OPF_ERR_INVALID_ARG, "gemm", "a is NULL");
    GEMM_FAILS(&a, NULL, OPF_GEMM_TN, &o, &d, OPF_ERR_INVALID_ARG, "gemm", "b is NULL");
    CHECK_FAILS(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, &o, NULL), OPF_ERR_INVALID_ARG,
                "d is NULL");
    GEMM_FAILS(&a, &b, (opf_gemm_layout)7, &o, &d, OPF_ERR_INVALID_ARG, "layout 7");
    GEMM_FAILS(&a, &b, (opf_gemm_layout)-1, &o, &d, OPF_ERR_INVALID_ARG, "layout -1");
    /* NULL options mean the defaults */
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, NULL, &d));
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d);
}

static void test_shapes(void)
{
    opf_gemm_options o = opf_gemm_options_default();
    /* K mismatch in each layout: TN A [N,K] B [M,K]; NN A [K,N] B [M,K]; NT A [K,N] B [K,M] */
    opf_tensor a = plain(80, 64, OPF_F32), b = plain(48, 128, OPF_F32), d = plain(48, 80, OPF_F32);
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &d, OPF_ERR_SHAPE, "gemm TN", "A has K=64, B has K=128");
    opf_tensor a2 = plain(64, 80, OPF_F32);
    GEMM_FAILS(&a2, &b, OPF_GEMM_NN, &o, &d, OPF_ERR_SHAPE, "gemm NN", "A has K=64, B has K=128");
    opf_tensor b2 = plain(128, 48, OPF_F32);
    GEMM_FAILS(&a2, &b2, OPF_GEMM_NT, &o, &d, OPF_ERR_SHAPE, "gemm NT", "A has K=64, B has K=128");
    /* D of the wrong shape */
    opf_tensor b3 = plain(48, 64, OPF_F32), dbad = plain(48, 81, OPF_F32);
    GEMM_FAILS(&a, &b3, OPF_GEMM_TN, &o, &dbad, OPF_ERR_SHAPE, "D is [48,81]",
               "expected [M=48, N=80]");
    /* operands with no dims, or a format's size rule broken */
    opf_tensor s0 = a;
    s0.spec.ndim = 0;
    GEMM_FAILS(&s0, &b3, OPF_GEMM_TN, &o, &d, OPF_ERR_SHAPE, "gemm TN", "A has ndim 0");
    opf_tensor mx = quant(64, 64, OPF_SCALING_MXFP8, OPF_E4M3, OPF_USAGE_ROWWISE, false);
    opf_tensor mxb = mx;
    mxb.spec.shape[0] = 48;  /* not a multiple of 32 */
    GEMM_FAILS(&mx, &mxb, OPF_GEMM_TN, &o, &d, OPF_ERR_SHAPE, "gemm TN", "B:", "multiples of 32");
    /* bias of the wrong length, dtype or format */
    opf_tensor bias = plain(1, 81, OPF_F32);
    bias.spec = opf_spec_make(1, (int64_t[]){81}, OPF_F32);
    o.bias = &bias;
    GEMM_FAILS(&a, &b3, OPF_GEMM_TN, &o, &d, OPF_ERR_SHAPE, "bias has shape [81]", "N=80");
    bias.spec = opf_spec_make(2, (int64_t[]){1, 80}, OPF_F32);
    GEMM_FAILS(&a, &b3, OPF_GEMM_TN, &o, &d, OPF_ERR_SHAPE, "bias", "ndim 2", "N=80");
    bias.spec = opf_spec_make(1, (int64_t[]){80}, OPF_I32);
    GEMM_FAILS(&a, &b3, OPF_GEMM_TN, &o, &d, OPF_ERR_DTYPE, "bias is", "i32");
    o.bias = &mx;
    GEMM_FAILS(&a, &b3, OPF_GEMM_TN, &o, &d, OPF_ERR_DTYPE, "bias is mxfp8");
    bias.spec = opf_spec_make(1, (int64_t[]){80}, OPF_F32);
    void *bp = bias.data[OPF_COMP_DATA];
    bias.data[OPF_COMP_DATA] = NULL;
    o.bias = &bias;
    GEMM_FAILS(&a, &b3, OPF_GEMM_TN, &o, &d, OPF_ERR_INVALID_ARG, "bias's data pointer is NULL");
    bias.data[OPF_COMP_DATA] = bp;
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d);
    opf_tensor_release(&a2), opf_tensor_release(&b2), opf_tensor_release(&b3);
    opf_tensor_release(&dbad), opf_tensor_release(&mx), opf_tensor_release(&bias);
}

static void test_dtypes_and_pairs(void)
{
    opf_gemm_options o = opf_gemm_options_default();
    opf_tensor a = plain(64, 64, OPF_BF16), b = plain(64, 64, OPF_BF16), d = plain(64, 64, OPF_F32);
    opf_tensor ai = plain(64, 64, OPF_I32), di = plain(64, 64, OPF_I32);
    GEMM_FAILS(&ai, &b, OPF_GEMM_TN, &o, &d, OPF_ERR_DTYPE, "A is plain i32", "f32, bf16 or f16");
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &di, OPF_ERR_DTYPE, "D has logical dtype i32");
    unsigned both = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    opf_tensor mx = quant(64, 64, OPF_SCALING_MXFP8, OPF_E4M3, both, false);
    opf_tensor nv = quant(64, 64, OPF_SCALING_NVFP4_1D, OPF_E2M1, both, false);
    opf_tensor nv2 = quant(64, 64, OPF_SCALING_NVFP4_2D, OPF_E2M1, both, false);
    opf_tensor f8 = quant(64, 64, OPF_SCALING_TENSOR, OPF_E4M3, both, false);
    opf_tensor e5 = quant(64, 64, OPF_SCALING_TENSOR, OPF_E5M2, both, false);
    opf_tensor b1 = quant(64, 64, OPF_SCALING_BLOCK_1D, OPF_E4M3, both, false);
    opf_tensor b2 = quant(64, 64, OPF_SCALING_BLOCK_2D, OPF_E4M3, both, false);
    GEMM_FAILS(&mx, &b, OPF_GEMM_TN, &o, &d, OPF_ERR_UNSUPPORTED, "A is mxfp8(e4m3)",
               "B is plain bf16", "both operands must be quantized or both plain");
    GEMM_FAILS(&a, &b1, OPF_GEMM_TN, &o, &d, OPF_ERR_UNSUPPORTED, "A is plain bf16",
               "B is fp8-block1d(e4m3)");
    GEMM_FAILS(&mx, &nv, OPF_GEMM_TN, &o, &d, OPF_ERR_UNSUPPORTED, "cannot multiply A mxfp8(e4m3)",
               "B nvfp4(e2m1)");
    GEMM_FAILS(&f8, &b1, OPF_GEMM_NN, &o, &d, OPF_ERR_UNSUPPORTED, "gemm NN", "A fp8(e4m3)",
               "B fp8-block1d(e4m3)");
    GEMM_FAILS(&b2, &b2, OPF_GEMM_TN, &o, &d, OPF_ERR_UNSUPPORTED, "both fp8-block2d",
               "2D x 2D");
    GEMM_FAILS(&e5, &e5, OPF_GEMM_NT, &o, &d, OPF_ERR_UNSUPPORTED, "gemm NT", "both e5m2");
    opf_tensor d16 = plain(64, 64, OPF_F16);
    GEMM_FAILS(&nv2, &nv, OPF_GEMM_TN, &o, &d16, OPF_ERR_UNSUPPORTED, "nvfp4", "f16 output");
    /* the allowed mixes run */
    CHECK_OK(ctx, opf_gemm(ctx, &b2, &b1, OPF_GEMM_TN, &o, &d));
    CHECK_OK(ctx, opf_gemm(ctx, &b1, &b2, OPF_GEMM_NN, &o, &d));
    CHECK_OK(ctx, opf_gemm(ctx, &f8, &e5, OPF_GEMM_NT, &o, &d));
    CHECK_OK(ctx, opf_gemm(ctx, &nv2, &nv, OPF_GEMM_TN, &o, &d));
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d);
    opf_tensor_release(&ai), opf_tensor_release(&di), opf_tensor_release(&d16);
    opf_tensor_release(&mx), opf_tensor_release(&nv), opf_tensor_release(&nv2);
    opf_tensor_release(&f8), opf_tensor_release(&e5);
    opf_tensor_release(&b1), opf_tensor_release(&b2);
}

static void test_copies(void)
{
    opf_gemm_options o = opf_gemm_options_default();
    opf_tensor d = plain(64, 64, OPF_F32);
    unsigned both = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    opf_tensor row = quant(64, 64, OPF_SCALING_MXFP8, OPF_E4M3, OPF_USAGE_ROWWISE, false);
    opf_tensor col = quant(64, 64, OPF_SCALING_MXFP8, OPF_E4M3, OPF_USAGE_COLUMNWISE, false);
    opf_tensor full = quant(64, 64, OPF_SCALING_MXFP8, OPF_E4M3, both, false);
    GEMM_FAILS(&row, &full, OPF_GEMM_NN, &o, &d, OPF_ERR_UNSUPPORTED, "gemm NN",
               "A has no columnwise copy", "rowwise only");
    GEMM_FAILS(&col, &full, OPF_GEMM_TN, &o, &d, OPF_ERR_UNSUPPORTED, "gemm TN",
               "A has no rowwise copy", "columnwise only");
    GEMM_FAILS(&full, &col, OPF_GEMM_NN, &o, &d, OPF_ERR_UNSUPPORTED, "B has no rowwise copy");
    GEMM_FAILS(&full, &row, OPF_GEMM_NT, &o, &d, OPF_ERR_UNSUPPORTED, "B has no columnwise copy");
    /* a copy the spec promises but whose memory is missing */
    opf_tensor hole = full;
    hole.data[OPF_COMP_COL_DATA] = NULL;
    GEMM_FAILS(&hole, &full, OPF_GEMM_NN, &o, &d, OPF_ERR_INVALID_ARG,
               "A's columnwise data pointer is NULL");
    hole = full;
    hole.data[OPF_COMP_SCALE_INV] = NULL;
    GEMM_FAILS(&full, &hole, OPF_GEMM_TN, &o, &d, OPF_ERR_INVALID_ARG,
               "B's scale_inv pointer is NULL");
    opf_tensor nv = quant(64, 64, OPF_SCALING_NVFP4_1D, OPF_E2M1, both, false);
    hole = nv;
    hole.data[OPF_COMP_COL_AMAX] = NULL;
    GEMM_FAILS(&nv, &hole, OPF_GEMM_NT, &o, &d, OPF_ERR_INVALID_ARG,
               "B's columnwise amax pointer is NULL");
    /* Hadamard-rotated columnwise copy against an unrotated rowwise one */
    opf_tensor rot = quant(64, 64, OPF_SCALING_NVFP4_1D, OPF_E2M1, both, true);
    GEMM_FAILS(&rot, &nv, OPF_GEMM_NN, &o, &d, OPF_ERR_UNSUPPORTED,
               "A's columnwise copy is Hadamard-rotated", "B's rowwise copy is not");
    GEMM_FAILS(&nv, &rot, OPF_GEMM_NT, &o, &d, OPF_ERR_UNSUPPORTED,
               "A's columnwise copy is not Hadamard-rotated", "B's columnwise copy is rotated");
    CHECK_OK(ctx, opf_gemm(ctx, &rot, &rot, OPF_GEMM_NT, &o, &d));
    CHECK_OK(ctx, opf_gemm(ctx, &rot, &nv, OPF_GEMM_TN, &o, &d));
    opf_tensor_release(&d), opf_tensor_release(&row), opf_tensor_release(&col);
    opf_tensor_release(&full), opf_tensor_release(&nv), opf_tensor_release(&rot);
}

static void test_output(void)
{
    opf_tensor a = plain(80, 64, OPF_BF16), b = plain(48, 64, OPF_BF16);
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.qdtype = OPF_E4M3;
    opf_spec ps = opf_spec_make(2, (int64_t[]){48, 80}, OPF_BF16), qs;
    CHECK_OK(ctx, opf_quantizer_spec(&q, &ps, &qs));
    opf_tensor d8;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &qs, &d8));
    memset(d8.data[OPF_COMP_DATA], 0x3C, 48 * 80);
    opf_gemm_options o = opf_gemm_options_default();
    /* quantized D without an output quantizer */
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &d8, OPF_ERR_INVALID_ARG, "D is quantized (fp8)",
               "out_quantizer is NULL");
    /* an output quantizer that is not per-tensor */
    opf_quantizer mq = q;
    mq.scaling = OPF_SCALING_MXFP8;
    o.out_quantizer = &mq;
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &d8, OPF_ERR_UNSUPPORTED, "per-tensor", "got mxfp8");
    /* accumulate into an FP8 D */
    o.out_quantizer = &q;
    o.accumulate = true;
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &d8, OPF_ERR_UNSUPPORTED, "accumulate", "FP8 output");
    o.accumulate = false;
    /* D laid out for another quantizer (rowwise only vs both copies) */
    opf_quantizer rq = q;
    rq.usage = OPF_USAGE_ROWWISE;
    o.out_quantizer = &rq;
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &d8, OPF_ERR_INVALID_ARG,
               "D is bf16[48,80] fp8(e4m3,row+col)",
               "the output quantizer makes bf16[48,80] fp8(e4m3,row)");
    /* an invalid output quantizer */
    opf_quantizer bad = q;
    bad.amax_epsilon = -1.0f;
    o.out_quantizer = &bad;
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &d8, OPF_ERR_INVALID_ARG, "output quantizer",
               "amax_epsilon");
    /* a plain D with the output quantizer set */
    opf_tensor dp = plain(48, 80, OPF_F32);
    o.out_quantizer = &q;
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &dp, OPF_ERR_INVALID_ARG, "D is f32[48,80]",
               "fp8(e4m3,row+col)");
    o.out_quantizer = NULL;
    /* D's memory: NULL, or shared with an input */
    opf_tensor dn = dp;
    dn.data[OPF_COMP_DATA] = NULL;
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &dn, OPF_ERR_INVALID_ARG, "D's data pointer is NULL");
    opf_tensor alias = plain(48, 80, OPF_BF16);
    opf_tensor a_alias = alias;
    a_alias.spec = opf_spec_make(2, (int64_t[]){60, 64}, OPF_BF16);  /* [N=60, K=64] */
    opf_tensor da = plain(48, 60, OPF_BF16);
    da.data[OPF_COMP_DATA] = alias.data[OPF_COMP_DATA];
    GEMM_FAILS(&a_alias, &b, OPF_GEMM_TN, &o, &da, OPF_ERR_INVALID_ARG, "D shares memory with A");
    /* D or an operand on another device */
    opf_tensor dc = dp;
    dc.spec.device = OPF_DEVICE_CUDA;
    GEMM_FAILS(&a, &b, OPF_GEMM_TN, &o, &dc, OPF_ERR_INVALID_ARG, "A is on cpu, D on cuda");
    opf_tensor ac = a, bc = b;
    ac.spec.device = bc.spec.device = OPF_DEVICE_CUDA;
    GEMM_FAILS(&ac, &b, OPF_GEMM_TN, &o, &dp, OPF_ERR_INVALID_ARG, "A is on cuda, B on cpu");
    GEMM_FAILS(&ac, &bc, OPF_GEMM_TN, &o, &dp, OPF_ERR_INVALID_ARG,
               "A is on cuda, the context on cpu");
    /* and a good FP8 output works */
    o.out_quantizer = &q;
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, &o, &d8));
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d8);
    opf_tensor_release(&dp), opf_tensor_release(&alias), opf_tensor_release(&da);
}

/* opf_gemm_out_spec: pure, the same operand checks, *out untouched on error. */
static void test_out_spec(void)
{
    opf_spec a = opf_spec_make(2, (int64_t[]){80, 64}, OPF_BF16);
    opf_spec b = opf_spec_make(2, (int64_t[]){48, 128}, OPF_BF16);
    opf_spec out = opf_spec_make(1, (int64_t[]){7}, OPF_I64), keep = out;
    CHECK_FAILS(NULL, opf_gemm_out_spec(&a, &b, OPF_GEMM_TN, OPF_F32, &out), OPF_ERR_SHAPE,
                "gemm TN", "A has K=64, B has K=128");
    CHECK(opf_spec_equal(&out, &keep), "out spec changed by a failed call");
    b.shape[1] = 64;
    CHECK_FAILS(NULL, opf_gemm_out_spec(&a, &b, OPF_GEMM_TN, OPF_E4M3, &out), OPF_ERR_DTYPE,
                "output dtype e4m3");
    CHECK_FAILS(NULL, opf_gemm_out_spec(&a, &b, OPF_GEMM_LAYOUT_COUNT, OPF_F32, &out),
                OPF_ERR_INVALID_ARG, "layout 3");
    CHECK_FAILS(NULL, opf_gemm_out_spec(NULL, &b, OPF_GEMM_TN, OPF_F32, &out), OPF_ERR_INVALID_ARG,
                "a is NULL");
    CHECK_FAILS(NULL, opf_gemm_out_spec(&a, &b, OPF_GEMM_TN, OPF_F32, NULL), OPF_ERR_INVALID_ARG,
                "out is NULL");
    opf_spec q = a;
    q.scaling = OPF_SCALING_NVFP4_1D;
    q.qdtype = OPF_E2M1;
    q.usage = OPF_USAGE_ROWWISE;
    opf_spec qb = b;
    qb.scaling = OPF_SCALING_NVFP4_1D;
    qb.qdtype = OPF_E2M1;
    qb.usage = OPF_USAGE_ROWWISE;
    CHECK_FAILS(NULL, opf_gemm_out_spec(&q, &qb, OPF_GEMM_TN, OPF_F16, &out), OPF_ERR_UNSUPPORTED,
                "f16 output");
    CHECK_FAILS(NULL, opf_gemm_out_spec(&q, &qb, OPF_GEMM_NT, OPF_F32, &out), OPF_ERR_UNSUPPORTED,
                "A has no columnwise copy");
    CHECK_FAILS(NULL, opf_gemm_out_spec(&q, &b, OPF_GEMM_TN, OPF_F32, &out), OPF_ERR_UNSUPPORTED,
                "A is nvfp4(e2m1) but B is plain bf16");
    CHECK(opf_spec_equal(&out, &keep), "out spec changed by failed calls");
    CHECK_OK(NULL, opf_gemm_out_spec(&q, &qb, OPF_GEMM_TN, OPF_BF16, &out));
    CHECK(out.ndim == 2 && out.shape[0] == 48 && out.shape[1] == 80, "out spec [48,80]");
}

int main(void)
{
    opf_ctx_options co = opf_ctx_options_default();
    if (opf_ctx_create(&co, &ctx) != OPF_OK) return 1;
    test_nulls_and_layout();
    test_shapes();
    test_dtypes_and_pairs();
    test_copies();
    test_output();
    test_out_spec();
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
