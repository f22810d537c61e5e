/* test_elem.c: the element-wise kernel family (src/backend/elem.h) and the
 * grouped GEMM, called directly through the CPU kernel table. Each entry is
 * compared bit for bit with a scalar reference written here from its
 * header's definition (fp32 math, one rounding through opf_convert), for
 * every f32/bf16/f16 combination, on a small shape and on one large enough
 * for the kernels' OpenMP split. */
#include "backend/backend-impl.h"
#include "core/core-impl.h"
#include "test.h"

static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16};
enum { NDT = 3 };
static const int64_t shapes[][2] = {{3, 5}, {301, 257}};  /* the second has > 65536 elements */
enum { NSHAPE = 2 };

static opf_ctx *ctx;
static const opf_elem_kernels *K;
static unsigned long long rng = 42;

/* A [r, c] tensor of dtype dt with random values; vals (may be NULL) gets
 * them as stored, in fp32. */
static opf_tensor rand_tensor(int64_t r, int64_t c, opf_dtype dt, float lo, float hi, float *vals)
{
    int64_t n = r * c;
    double *v = malloc(sizeof(double) * (size_t)n), *got = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_uniform(&rng, lo, hi);
    opf_tensor t = opf_test_make_tensor(ctx, 2, (int64_t[]){r, c}, dt, v, got);
    for (int64_t i = 0; vals && i < n; i++) vals[i] = (float)got[i];
    free(v);
    free(got);
    return t;
}

static opf_tensor empty(int ndim, const int64_t *shape, opf_dtype dt)
{
    opf_spec s = opf_spec_make(ndim, shape, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    return t;
}

/* Does t hold exactly ref (fp32 values rounded once into t's dtype)? */
static bool holds(const opf_tensor *t, const float *ref)
{
    size_t n = (size_t)opf_spec_numel(&t->spec), nb = opf_dtype_nbytes(t->spec.dtype, n);
    void *want = malloc(nb ? nb : 1);
    bool ok = opf_convert(ref, OPF_F32, want, t->spec.dtype, n) == OPF_OK &&
              memcmp(want, t->data[0], nb) == 0;
    free(want);
    return ok;
}

static float *floats(int64_t n) { return malloc(sizeof(float) * (size_t)(n ? n : 1)); }

static void test_bias(int64_t r, int64_t c, opf_dtype xd, opf_dtype bd, opf_dtype yd)
{
    float *x = floats(r * c), *b = floats(c), *ref = floats(r * c), *db = floats(c);
    opf_tensor tx = rand_tensor(r, c, xd, -2, 2, x), tb = rand_tensor(1, c, bd, -1, 1, b);
    tb.spec = opf_spec_make(1, &c, bd);
    opf_tensor ty = empty(2, (int64_t[]){r, c}, yd), tdb = empty(1, &c, yd);
    for (int64_t i = 0; i < r * c; i++) ref[i] = x[i] + b[i % c];
    CHECK_OK(ctx, K->bias_add(ctx, &tx, &tb, &ty));
    CHECK(holds(&ty, ref), "bias_add %lldx%lld %s+%s->%s", (long long)r, (long long)c,
          opf_dtype_name(xd), opf_dtype_name(bd), opf_dtype_name(yd));
    for (int64_t j = 0; j < c; j++) db[j] = opf_test_lane_colsum(x, r, c, j);
    CHECK_OK(ctx, K->dbias(ctx, &tx, &tdb));
    CHECK(holds(&tdb, db), "dbias %lldx%lld %s->%s", (long long)r, (long long)c,
          opf_dtype_name(xd), opf_dtype_name(yd));
    opf_tensor_release(&tx), opf_tensor_release(&tb), opf_tensor_release(&ty), opf_tensor_release(&tdb);
    free(x), free(b), free(ref), free(db);
}

static void test_scale_add_cast(int64_t r, int64_t c, opf_dtype ad, opf_dtype bd, opf_dtype od)
{
    int64_t n = r * c;
    float *a = floats(n), *b = floats(n), *ref = floats(n);
    opf_tensor ta = rand_tensor(r, c, ad, -3, 3, a), tb = rand_tensor(r, c, bd, -3, 3, b);
    opf_tensor to = empty(2, (int64_t[]){r, c}, od);
    const float s = 0.3f;
    for (int64_t i = 0; i < n; i++) ref[i] = s * a[i];
    CHECK_OK(ctx, K->scale(ctx, &ta, s, &to));
    CHECK(holds(&to, ref), "scale %s->%s n=%lld", opf_dtype_name(ad), opf_dtype_name(od), (long long)n);
    for (int64_t i = 0; i < n; i++) ref[i] = a[i] + b[i];
    CHECK_OK(ctx, K->add(ctx, &ta, &tb, &to));
    CHECK(holds(&to, ref), "add %s+%s->%s n=%lld", opf_dtype_name(ad), opf_dtype_name(bd),
          opf_dtype_name(od), (long long)n);
    for (int64_t i = 0; i < n; i++) ref[i] = a[i];
    CHECK_OK(ctx, K->cast(ctx, &ta, &to));
    CHECK(holds(&to, ref), "cast %s->%s n=%lld", opf_dtype_name(ad), opf_dtype_name(od), (long long)n);
    if (ad == od) {  /* accumulate into a: out aliases a */
        for (int64_t i = 0; i < n; i++) ref[i] = a[i] + b[i];
        CHECK_OK(ctx, K->add(ctx, &ta, &tb, &ta));
        CHECK(holds(&ta, ref), "add into a %s+%s n=%lld", opf_dtype_name(ad), opf_dtype_name(bd),
              (long long)n);
    }
    opf_tensor_release(&ta), opf_tensor_release(&tb), opf_tensor_release(&to);
    free(a), free(b), free(ref);
}

static void test_cast_transpose(int64_t r, int64_t c, opf_dtype xd, opf_dtype yd)
{
    float *x = floats(r * c), *ref = floats(r * c);
    opf_tensor tx = rand_tensor(r, c, xd, -5, 5, x);
    opf_tensor ty = empty(2, (int64_t[]){r, c}, yd), tt = empty(2, (int64_t[]){c, r}, yd);
    CHECK_OK(ctx, K->cast_transpose(ctx, &tx, &ty, &tt));
    CHECK(holds(&ty, x), "cast_transpose (cast) %s->%s", opf_dtype_name(xd), opf_dtype_name(yd));
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < c; j++) ref[j * r + i] = x[i * c + j];
    CHECK(holds(&tt, ref), "cast_transpose %lldx%lld %s->%s", (long long)r, (long long)c,
          opf_dtype_name(xd), opf_dtype_name(yd));
    opf_tensor_release(&tx), opf_tensor_release(&ty), opf_tensor_release(&tt);
    free(x), free(ref);
}

/* Word i % 4 of the Philox draw for element i (elem.h). */
static uint32_t philox_word(uint64_t seed, uint64_t offset, uint32_t stream, int64_t i)
{
    uint64_t c = offset + (uint64_t)(i / 4);
    uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), stream, 0}, key[2] = {(uint32_t)seed,
                                                                               (uint32_t)(seed >> 32)};
    uint32_t w[4];
    opf_philox4x32_10(ctr, key, w);
    return w[i % 4];
}

static void test_dropout(int64_t r, int64_t c, opf_dtype xd, opf_dtype yd)
{
    int64_t n = r * c, kept = 0;
    const double p = 0.3;
    const uint64_t seed = 0x1234567890ull, offset = (1ull << 32) - 3;  /* the counter carries */
    float *x = floats(n), *ref = floats(n), s = (float)(1.0 / (1.0 - p));
    opf_tensor tx = rand_tensor(r, c, xd, -2, 2, x), ty = empty(2, (int64_t[]){r, c}, yd);
    opf_tensor tm = empty(2, (int64_t[]){r, c}, OPF_U8), tdx = empty(2, (int64_t[]){r, c}, yd);
    CHECK_OK(ctx, K->dropout_fwd(ctx, &tx, p, seed, offset, &ty, &tm));
    const uint8_t *m = tm.data[0];
    bool mask_ok = true;
    for (int64_t i = 0; i < n; i++) {
        bool keep = philox_word(seed, offset, 0, i) >= (uint32_t)(p * 4294967296.0);
        mask_ok &= m[i] == keep;
        kept += keep;
        ref[i] = x[i] * (keep ? s : 0.0f);
    }
    CHECK(mask_ok, "dropout mask %s n=%lld", opf_dtype_name(xd), (long long)n);
    CHECK(holds(&ty, ref), "dropout_fwd %s->%s", opf_dtype_name(xd), opf_dtype_name(yd));
    CHECK(n < 1000 || fabs((double)kept / (double)n - (1 - p)) < 0.01, "kept %lld of %lld",
          (long long)kept, (long long)n);
    CHECK_OK(ctx, K->dropout_bwd(ctx, &tx, &tm, p, &tdx));
    CHECK(holds(&tdx, ref), "dropout_bwd %s->%s", opf_dtype_name(xd), opf_dtype_name(yd));
    opf_tensor_release(&tx), opf_tensor_release(&ty), opf_tensor_release(&tm), opf_tensor_release(&tdx);
    free(x), free(ref);
}

static void test_fill(int64_t r, int64_t c, opf_dtype dt)
{
    int64_t n = r * c;
    float *ref = floats(n);
    opf_tensor t = empty(2, (int64_t[]){r, c}, dt);
    for (int64_t i = 0; i < n; i++) ref[i] = (float)0.1;
    CHECK_OK(ctx, K->fill(ctx, 0.1, &t));
    CHECK(holds(&t, ref), "fill %s", opf_dtype_name(dt));
    const uint64_t seed = 7, offset = 99;
    const double bound = 0.125;
    bool inside = true;
    for (int64_t i = 0; i < n; i++) {
        double u = (double)(philox_word(seed, offset, 0x4C494E57u, i) >> 8) * (1.0 / 16777216.0);
        ref[i] = (float)(bound * (2.0 * u - 1.0));
        inside &= fabsf(ref[i]) <= bound;
    }
    CHECK_OK(ctx, K->fill_uniform(ctx, seed, offset, 0x4C494E57u, bound, &t));
    CHECK(holds(&t, ref) && inside, "fill_uniform %s n=%lld", opf_dtype_name(dt), (long long)n);
    opf_tensor_release(&t);
    free(ref);
}

/* Integer fills and zero fills of other dtypes; copy. */
static void test_fill_int_copy(void)
{
    int64_t n = 70000;
    opf_tensor ti = empty(1, &n, OPF_I64), tq = empty(1, &n, OPF_E4M3), tc = empty(1, &n, OPF_I64);
    CHECK_OK(ctx, K->fill(ctx, -3.0, &ti));
    memset(tq.data[0], 0x55, (size_t)n);
    CHECK_OK(ctx, K->fill(ctx, 0.0, &tq));
    bool ok = true;
    for (int64_t i = 0; i < n; i++) ok &= ((int64_t *)ti.data[0])[i] == -3 && ((uint8_t *)tq.data[0])[i] == 0;
    CHECK(ok, "integer and zero fills");
    CHECK_OK(ctx, K->copy(ctx, ti.data[0], tc.data[0], (size_t)n * sizeof(int64_t)));
    CHECK(!memcmp(ti.data[0], tc.data[0], (size_t)n * sizeof(int64_t)), "copy");
    opf_tensor_release(&ti), opf_tensor_release(&tq), opf_tensor_release(&tc);
}

/* grouped_gemm over three groups, one per layout (one empty), against one
 * opf_gemm call per group. */
static void test_grouped_gemm(void)
{
    const opf_backend_i *be = opf_backend_get(OPF_DEVICE_CPU);
    opf_gemm_layout lay[3] = {OPF_GEMM_TN, OPF_GEMM_NN, OPF_GEMM_NT};
    int64_t as[3][2] = {{48, 40}, {40, 24}, {0, 16}}, bs[3][2] = {{33, 40}, {17, 40}, {0, 8}};
    opf_tensor a[3], b[3], d[3], e[3], bias = rand_tensor(1, 48, OPF_BF16, -1, 1, NULL);
    bias.spec = opf_spec_make(1, (int64_t[]){48}, OPF_BF16);
    opf_gemm_options o[3];
    opf_gemm_args args[3];
    for (int g = 0; g < 3; g++) {
        a[g] = rand_tensor(as[g][0], as[g][1], OPF_BF16, -1, 1, NULL);
        b[g] = rand_tensor(bs[g][0], bs[g][1], OPF_BF16, -1, 1, NULL);
        opf_spec ds;
        CHECK_OK(ctx, opf_gemm_out_spec(&a[g].spec, &b[g].spec, lay[g], OPF_F32, &ds));
        d[g] = empty(ds.ndim, ds.shape, OPF_F32), e[g] = empty(ds.ndim, ds.shape, OPF_F32);
        o[g] = opf_gemm_options_default();
        o[g].bias = g == 0 ? &bias : NULL;
        int64_t m, n, ar, ac;
        opf_shape_2d(&ds, &m, &n);
        opf_shape_2d(&a[g].spec, &ar, &ac);
        args[g] = (opf_gemm_args){&a[g], &b[g], lay[g], &o[g], &d[g], m, n, lay[g] == OPF_GEMM_TN ? ac : ar, {0}};
        CHECK_OK(ctx, opf_gemm(ctx, &a[g], &b[g], lay[g], &o[g], &e[g]));
    }
    CHECK_OK(ctx, be->grouped_gemm(ctx, 3, args));
    for (int g = 0; g < 3; g++) {
        CHECK(opf_test_same_bytes(&d[g], &e[g]), "grouped_gemm group %d", g);
        opf_tensor_release(&a[g]), opf_tensor_release(&b[g]);
        opf_tensor_release(&d[g]), opf_tensor_release(&e[g]);
    }
    opf_tensor_release(&bias);
}

int main(void)
{
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    K = opf_backend_get(OPF_DEVICE_CPU)->elem;
    for (int s = 0; s < NSHAPE; s++) {
        int64_t r = shapes[s][0], c = shapes[s][1];
        for (int i = 0; i < NDT; i++)
            for (int j = 0; j < NDT; j++) {
                test_cast_transpose(r, c, dts[i], dts[j]);
                test_dropout(r, c, dts[i], dts[j]);
                for (int k = 0; k < NDT; k++) {
                    test_bias(r, c, dts[i], dts[j], dts[k]);
                    test_scale_add_cast(r, c, dts[i], dts[j], dts[k]);
                }
            }
        for (int i = 0; i < NDT; i++) test_fill(r, c, dts[i]);
    }
    test_fill_int_copy();
    test_grouped_gemm();
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
