/* test_quant_fp8.c: the FP8 CPU quantizers (per-tensor delayed and current,
 * block 1D/2D, MXFP8 1D/2D compact and swizzled): quantize -> dequantize
 * round trips within the E4M3 / E5M2 tolerances of numerics.md 8.3, the
 * failure paths of these kernels, and identical bytes for 1 and 2 threads.
 * Bit-exactness against the numerics is the oracle test's job. */
#include "test.h"

typedef struct tol { float rtol, atol; } tol;
static const tol tol_e4m3 = {0.125f, 0.0675f}, tol_e5m2 = {0.25f, 0.125f};

/* A quantizer case of the tables below. */
typedef struct qcase {
    const char *name;
    opf_scaling scaling;
    opf_dtype   qdtype;
    bool        pow2, swizzled, mxfp8_2d, delayed;
} qcase;

static const qcase cases[] = {
    {"current e4m3", OPF_SCALING_TENSOR, OPF_E4M3, false, false, false, false},
    {"current e5m2 pow2", OPF_SCALING_TENSOR, OPF_E5M2, true, false, false, false},
    {"delayed e4m3", OPF_SCALING_TENSOR, OPF_E4M3, false, false, false, true},
    {"block1d e4m3 pow2", OPF_SCALING_BLOCK_1D, OPF_E4M3, true, false, false, false},
    {"block1d e5m2", OPF_SCALING_BLOCK_1D, OPF_E5M2, false, false, false, false},
    {"block2d e4m3 pow2", OPF_SCALING_BLOCK_2D, OPF_E4M3, true, false, false, false},
    {"block2d e5m2", OPF_SCALING_BLOCK_2D, OPF_E5M2, false, false, false, false},
    {"mxfp8 e4m3", OPF_SCALING_MXFP8, OPF_E4M3, false, false, false, false},
    {"mxfp8 e5m2 swizzled", OPF_SCALING_MXFP8, OPF_E5M2, false, true, false, false},
    {"mxfp8 e4m3 2d swizzled", OPF_SCALING_MXFP8, OPF_E4M3, false, true, true, false},
    {"mxfp8 e5m2 2d", OPF_SCALING_MXFP8, OPF_E5M2, false, false, true, false},
};
enum { NCASES = sizeof cases / sizeof cases[0] };

static opf_quantizer make_q(const qcase *c, opf_delayed_state *ds)
{
    opf_quantizer q = opf_quantizer_default();
    q.scaling = c->scaling;
    q.qdtype = c->qdtype;
    q.pow2_scales = c->pow2;
    q.swizzled = c->swizzled;
    q.mxfp8_2d = c->mxfp8_2d;
    if (c->delayed) q.delayed = ds, q.slot = 0;
    return q;
}

static opf_ctx *new_ctx(int threads)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.num_threads = threads;
    opf_ctx *ctx = NULL;
    opf_status st = opf_ctx_create(&o, &ctx);
    CHECK(st == OPF_OK, "ctx");
    return ctx;
}

/* x (fp32 values exactly representable in dt) and its storage in dt. */
static void fill_input(unsigned long long seed, float *x, void *store, opf_dtype dt, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float v = opf_test_normal(&seed, 2.0f);
        if (dt == OPF_BF16) {
            uint16_t h = opf_f32_to_bf16(v);
            ((uint16_t *)store)[i] = h;
            x[i] = opf_bf16_to_f32(h);
        } else {
            ((float *)store)[i] = v;
            x[i] = v;
        }
    }
}

static int within(const float *got, const float *want, int64_t n, tol t, const char *what)
{
    for (int64_t i = 0; i < n; i++) {
        float d = fabsf(got[i] - want[i]);
        if (!(d <= t.atol + t.rtol * fabsf(want[i]))) {
            fprintf(stderr, "  %s: element %lld: %g vs %g\n", what, (long long)i,
                    (double)got[i], (double)want[i]);
            return 0;
        }
    }
    return 1;
}

static void round_trip(opf_ctx *ctx, const qcase *c, const int64_t *shape, opf_dtype dt)
{
    int64_t n = shape[0] * shape[1];
    float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
    void *store = malloc((size_t)n * sizeof(float));
    fill_input(0x5EED + (unsigned)n, x, store, dt, n);
    opf_spec s = opf_spec_make(2, shape, dt), ys = opf_spec_make(2, shape, OPF_F32);
    opf_tensor in, out, yt;
    CHECK_OK(ctx, opf_tensor_wrap(&s, store, &in));
    CHECK_OK(ctx, opf_tensor_wrap(&ys, y, &yt));
    opf_delayed_state *ds = NULL;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, 4, OPF_AMAX_MAX, false,
                                           1, &ds));
    opf_quantizer q = make_q(c, ds);
    if (c->delayed) {  /* one step to learn the amax, then quantize with it */
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &in, &out));
        opf_tensor_release(&out);
        CHECK_OK(ctx, opf_delayed_state_update(ctx, ds, NULL, NULL));
    }
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &in, &out));
    tol t = c->qdtype == OPF_E4M3 ? tol_e4m3 : tol_e5m2;
    for (unsigned which = OPF_USAGE_ROWWISE; which <= OPF_USAGE_COLUMNWISE; which <<= 1) {
        CHECK_OK(ctx, opf_dequantize(ctx, &out, which, &yt));
        CHECK(within(y, x, n, t, c->name), "%s %s %lldx%lld %s round trip", c->name,
              opf_dtype_name(dt), (long long)shape[0], (long long)shape[1],
              which == OPF_USAGE_ROWWISE ? "rowwise" : "columnwise");
    }
    opf_tensor_release(&out);
    opf_delayed_state_destroy(ds);
    free(x), free(y), free(store);
}

static void test_round_trips(void)
{
    opf_ctx *ctx = new_ctx(0);
    static const int64_t shapes[][2] = {{128, 256}, {96, 160}, {256, 128}};
    for (int c = 0; c < NCASES; c++)
        for (int s = 0; s < 3; s++) {
            if (cases[c].scaling == OPF_SCALING_BLOCK_1D && s == 1) {
                /* edge blocks: 144 x 272 */
                round_trip(ctx, &cases[c], (int64_t[]){144, 272}, OPF_BF16);
                continue;
            }
            round_trip(ctx, &cases[c], shapes[s], s == 2 ? OPF_F32 : OPF_BF16);
        }
    opf_ctx_destroy(ctx);
}

/* Every component's bytes of one quantization (NULL-safe sizes from the layout). */
static int same_components(const opf_tensor *a, const opf_tensor *b)
{
    opf_layout L;
    if (opf_spec_layout(&a->spec, &L) != OPF_OK) return 0;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && memcmp(a->data[c], b->data[c], L.comp[c].nbytes)) {
            fprintf(stderr, "  component %d differs\n", c);
            return 0;
        }
    return 1;
}

static void test_threads(void)
{
    opf_ctx *c1 = new_ctx(1), *c2 = new_ctx(2);
    const int64_t shape[2] = {256, 384};  /* large enough to run in parallel */
    int64_t n = shape[0] * shape[1];
    float *x = malloc((size_t)n * sizeof *x);
    float *y1 = malloc((size_t)n * 4), *y2 = malloc((size_t)n * 4);
    uint16_t *store = malloc((size_t)n * 2);
    fill_input(99, x, store, OPF_BF16, n);
    store[7] = 0x7FC0;  /* a NaN and an inf among the values */
    store[n - 3] = 0xFF80;
    opf_spec s = opf_spec_make(2, shape, OPF_BF16), ys = opf_spec_make(2, shape, OPF_F32);
    opf_tensor in, yt1, yt2;
    CHECK_OK(c1, opf_tensor_wrap(&s, store, &in));
    CHECK_OK(c1, opf_tensor_wrap(&ys, y1, &yt1));
    CHECK_OK(c1, opf_tensor_wrap(&ys, y2, &yt2));
    for (int c = 0; c < NCASES; c++) {
        opf_delayed_state *d1, *d2;
        CHECK_OK(c1, opf_delayed_state_create(c1, OPF_FORMAT_HYBRID, 0, 2, OPF_AMAX_MAX, false, 1,
                                              &d1));
        CHECK_OK(c2, opf_delayed_state_create(c2, OPF_FORMAT_HYBRID, 0, 2, OPF_AMAX_MAX, false, 1,
                                              &d2));
        opf_quantizer q1 = make_q(&cases[c], d1), q2 = make_q(&cases[c], d2);
        opf_tensor o1, o2;
        CHECK_OK(c1, opf_quantize_alloc(c1, &q1, &in, &o1));
        CHECK_OK(c2, opf_quantize_alloc(c2, &q2, &in, &o2));
        CHECK(same_components(&o1, &o2), "%s: 1 vs 2 threads", cases[c].name);
        CHECK(opf_delayed_state_history(d1)[0] == opf_delayed_state_history(d2)[0],
              "%s: accumulated amax", cases[c].name);
        for (unsigned w = OPF_USAGE_ROWWISE; w <= OPF_USAGE_COLUMNWISE; w <<= 1) {
            CHECK_OK(c1, opf_dequantize(c1, &o1, w, &yt1));
            CHECK_OK(c2, opf_dequantize(c2, &o2, w, &yt2));
            CHECK(memcmp(y1, y2, (size_t)n * 4) == 0, "%s: dequantize %u, 1 vs 2 threads",
                  cases[c].name, w);
        }
        opf_tensor_release(&o1), opf_tensor_release(&o2);
        opf_delayed_state_destroy(d1), opf_delayed_state_destroy(d2);
    }
    free(x), free(y1), free(y2), free(store);
    opf_ctx_destroy(c1), opf_ctx_destroy(c2);
}

static opf_status reduce_fails(void *user, float *amax, int n)
{
    (void)user, (void)n;
    amax[0] = 1e30f;
    return OPF_ERR_DEVICE;
}
static opf_status reduce_to_896(void *user, float *amax, int n)
{
    (void)user, (void)n;
    amax[0] = 896.0f;  /* another rank saw a larger amax */
    return OPF_OK;
}

/* The failure paths of the FP8 kernels and their state: a failed amax
 * reduction leaves the output untouched; a delayed quantizer must match its
 * state (slot range, element dtype). */
static void test_bad_inputs(void)
{
    opf_ctx *ctx = new_ctx(0);
    float x[4][8];
    unsigned long long seed = 5;
    for (int i = 0; i < 32; i++) x[i / 8][i % 8] = opf_test_uniform(&seed, -4, 4);
    opf_spec s = opf_spec_make(2, (int64_t[]){4, 8}, OPF_F32);
    opf_tensor in, out;
    CHECK_OK(ctx, opf_tensor_wrap(&s, x, &in));
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.amax_reduce = reduce_fails;
    opf_spec qs;
    CHECK_OK(ctx, opf_quantizer_spec(&q, &s, &qs));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &qs, &out));
    memset(out.data[OPF_COMP_DATA], 0xAB, 32);
    *(float *)out.data[OPF_COMP_SCALE_INV] = -1.0f;
    CHECK_FAILS(ctx, opf_quantize(ctx, &q, &in, &out), OPF_ERR_DEVICE, "current scaling",
                "amax reduction failed", "OPF_ERR_DEVICE");
    CHECK(((uint8_t *)out.data[OPF_COMP_DATA])[5] == 0xAB &&
          *(float *)out.data[OPF_COMP_SCALE_INV] == -1.0f, "output untouched");
    q.amax_reduce = reduce_to_896;
    CHECK_OK(ctx, opf_quantize(ctx, &q, &in, &out));
    CHECK(*(float *)out.data[OPF_COMP_SCALE_INV] == 2.0f &&
          *(float *)out.data[OPF_COMP_AMAX] == 896.0f, "reduced amax drives the scale");
    opf_tensor_release(&out);

    opf_delayed_state *ds;
    CHECK_OK(ctx,
             opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0, 3, OPF_AMAX_MAX, true, 2, &ds));
    q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.qdtype = OPF_E5M2;
    q.delayed = ds;
    q.slot = 2;
    CHECK_FAILS(ctx, opf_quantize_alloc(ctx, &q, &in, &out), OPF_ERR_INVALID_ARG, "slot 2",
                "2 slots");
    q.slot = 1;
    q.qdtype = OPF_E4M3;
    CHECK_FAILS(ctx, opf_quantize_alloc(ctx, &q, &in, &out), OPF_ERR_DTYPE, "e4m3", "e5m2");
    CHECK(opf_delayed_state_history(ds)[1] == 0.0f, "no amax recorded by failed calls");
    q.qdtype = OPF_E5M2;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &in, &out));
    opf_tensor_release(&out);
    opf_delayed_state_destroy(ds);
    opf_ctx_destroy(ctx);
}

int main(void)
{
    test_round_trips();
    test_threads();
    test_bad_inputs();
    TEST_DONE();
}
