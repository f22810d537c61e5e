/* test_gemm.c: opf_gemm on the CPU against references written here.
 *
 * - every layout (TN, NN, NT) x every operand format, against an FP64 GEMM of
 *   the dequantized operand copies the layout reads (so only the GEMM's own
 *   fp32 error remains), with a bound built from the sum of |products|;
 * - alpha, beta, accumulate, bias and f32 / bf16 / f16 / FP8 outputs;
 * - the exact structure of each format's math on operands whose products sum
 *   exactly in fp32 in any order: per-tensor FP8 alpha folding, NVFP4 alpha',
 *   MXFP8, and the per-128-chunk fmaf rule of FP8 block scaling, bitwise;
 * - the block rule on random operands against an fp32 fmaf reference whose
 *   chunk sums are done in double;
 * - the Linear triple (fprop, dgrad, wgrad) per recipe against FP64 on the
 *   unquantized values with the anchor's quantization tolerances;
 * - bitwise equality with 1 and 2 threads; opf_gemm_out_spec. */
#include <float.h>
#include <stdint.h>

#include "test.h"

#define U32 (1.0 / 16777216.0) /* unit roundoff of fp32 */

static const char *const lname[] = {"TN", "NN", "NT"};

static opf_ctx *new_ctx(int threads)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.num_threads = threads;
    opf_ctx *ctx = NULL;
    if (opf_ctx_create(&o, &ctx) != OPF_OK) {
        fprintf(stderr, "cannot create a context\n");
        exit(1);
    }
    return ctx;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

static void fill_uniform(float *v, int64_t n, unsigned long long *s, float lo, float hi)
{
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_uniform(s, lo, hi);
}

/* A plain [r, c] tensor of dtype dt holding v; v is replaced by the values the
 * tensor really holds (rounded to dt). */
static opf_tensor plain_tensor(opf_ctx *ctx, int64_t r, int64_t c, opf_dtype dt, float *v)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){r, c}, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    CHECK_OK(ctx, opf_convert(v, OPF_F32, t.data[OPF_COMP_DATA], dt, (size_t)(r * c)));
    CHECK_OK(ctx, opf_convert(t.data[OPF_COMP_DATA], dt, v, OPF_F32, (size_t)(r * c)));
    return t;
}

/* ---- operand formats ---------------------------------------------------- */

enum { Q_SWZ = 1, Q_RHT = 2, Q_POW2 = 4, Q_MX2D = 8 };

typedef struct qcfg {
    opf_scaling sc;
    opf_dtype   qd;
    unsigned    opt;  /* Q_* */
} qcfg;

static opf_quantizer quantizer_of(const qcfg *c)
{
    opf_quantizer q = opf_quantizer_default();
    q.scaling = c->sc;
    q.qdtype = c->qd;
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    q.swizzled = (c->opt & Q_SWZ) != 0;
    q.rht = (c->opt & Q_RHT) != 0;
    q.pow2_scales = (c->opt & Q_POW2) != 0;
    q.mxfp8_2d = (c->opt & Q_MX2D) != 0;
    return q;
}

/* An operand [r, c] from the values v: plain of dtype dt, or bf16 quantized
 * with cfg (both copies). */
static opf_tensor make_operand(opf_ctx *ctx, int64_t r, int64_t c, const qcfg *cfg, opf_dtype dt,
                               float *v)
{
    opf_tensor plain = plain_tensor(ctx, r, c, cfg->sc == OPF_SCALING_NONE ? dt : OPF_BF16, v);
    if (cfg->sc == OPF_SCALING_NONE) return plain;
    opf_quantizer q = quantizer_of(cfg);
    opf_tensor out;
    memset(&out, 0, sizeof out);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &plain, &out));
    opf_tensor_release(&plain);
    return out;
}

/* fp32 logical [R, C] values of the copy the GEMM reads (malloc'd). */
static float *operand_values(opf_ctx *ctx, const opf_tensor *t, bool rowwise)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *v = xmalloc((size_t)n * sizeof(float));
    if (t->spec.scaling == OPF_SCALING_NONE) {
        CHECK_OK(ctx, opf_convert(t->data[OPF_COMP_DATA], t->spec.dtype, v, OPF_F32, (size_t)n));
        return v;
    }
    opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
    opf_tensor out;
    CHECK_OK(ctx, opf_tensor_wrap(&s, v, &out));
    CHECK_OK(ctx, opf_dequantize(ctx, t, rowwise ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE, &out));
    return v;
}

/* ---- FP64 reference ------------------------------------------------------- */

/* val[m,n] = sum_k B(m,k) A(n,k), mag = sum |B(m,k) A(n,k)|, with A and B the
 * logical matrices of the layout (5.1). */
static void ref_gemm(opf_gemm_layout L, int64_t M, int64_t N, int64_t K, const float *A,
                     const float *B, double *val, double *mag)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double s = 0, a = 0;
            for (int64_t k = 0; k < K; k++) {
                double x = L == OPF_GEMM_NT ? B[k * M + m] : B[m * K + k];
                double w = L == OPF_GEMM_TN ? A[n * K + k] : A[k * N + n];
                s += x * w;
                a += fabs(x * w);
            }
            val[m * N + n] = s;
            mag[m * N + n] = a;
        }
}

/* Relative and absolute rounding of the final cast to dt. */
static double out_rel(opf_dtype dt)
{
    return dt == OPF_BF16 ? 1.0 / 256 : dt == OPF_F16 ? 1.0 / 1024 : U32;
}
static double out_abs(opf_dtype dt) { return dt == OPF_F16 ? 0x1p-24 : 1e-37; }

/* D (any plain dtype) vs ref, per element within err[i] (fp32 arithmetic
 * bound) plus the output rounding. Returns the failures. */
static int check_close(const char *what, const opf_tensor *d, const double *ref, const double *err)
{
    int64_t n = opf_spec_numel(&d->spec);
    float *v = xmalloc((size_t)n * sizeof(float));
    opf_convert(d->data[OPF_COMP_DATA], d->spec.dtype, v, OPF_F32, (size_t)n);
    int bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double tol = err[i] + out_rel(d->spec.dtype) * fabs(ref[i]) + out_abs(d->spec.dtype);
        double e = fabs((double)v[i] - ref[i]);
        if (!(e <= tol)) {
            if (!bad)
                fprintf(stderr, "  %s: element %lld is %.9g, reference %.9g (tol %.3g)\n", what,
                        (long long)i, (double)v[i], ref[i], tol);
            bad++;
        }
        if (tol > 0 && e / tol > worst) worst = e / tol;
    }
    CHECK(bad == 0, "%s: %d of %lld elements off (worst err/tol %.3g)", what, bad, (long long)n,
          worst);
    free(v);
    return bad;
}

/* fp32 accumulation bound of a sum of K products: (K + 8) u sum|p|. The +8
 * covers the scale folding and the exact-but-rounded dequantized copies. */
static void gemm_err(int64_t n, int64_t K, const double *mag, double scale, double *err)
{
    for (int64_t i = 0; i < n; i++) err[i] = (double)(K + 8) * U32 * mag[i] * scale;
}

/* ---- every layout x every format ------------------------------------------ */

typedef struct fmt_case {
    const char *name;
    qcfg        a, b;
    int64_t     shapes[2][3];  /* M, N, K */
    opf_dtype   out;
} fmt_case;

#define T(s, q) {OPF_SCALING_##s, OPF_##q, 0}
#define TO(s, q, o) {OPF_SCALING_##s, OPF_##q, o}
static const fmt_case fmt_cases[] = {
    {"plain f32", T(NONE, F32), T(NONE, F32), {{48, 80, 96}, {7, 5, 300}}, OPF_F32},
    {"plain bf16", T(NONE, BF16), T(NONE, BF16), {{48, 80, 96}, {33, 130, 17}}, OPF_BF16},
    {"plain f16", T(NONE, F16), T(NONE, F16), {{48, 80, 96}, {130, 3, 64}}, OPF_F16},
    {"plain f32 x bf16", T(NONE, F32), T(NONE, BF16), {{48, 80, 96}, {1, 1, 1}}, OPF_F32},
    {"fp8 e4m3", T(TENSOR, E4M3), T(TENSOR, E4M3), {{64, 96, 272}, {48, 80, 96}}, OPF_F32},
    {"fp8 hybrid (B e5m2)", T(TENSOR, E4M3), T(TENSOR, E5M2), {{64, 96, 272}, {48, 80, 96}},
     OPF_BF16},
    {"fp8 hybrid (A e5m2)", T(TENSOR, E5M2), T(TENSOR, E4M3), {{48, 80, 96}, {16, 16, 16}},
     OPF_F16},
    {"mxfp8", T(MXFP8, E4M3), T(MXFP8, E4M3), {{64, 96, 160}, {160, 64, 96}}, OPF_F32},
    {"mxfp8 swizzled, B e5m2", TO(MXFP8, E4M3, Q_SWZ), TO(MXFP8, E5M2, Q_SWZ),
     {{64, 96, 160}, {160, 64, 96}}, OPF_BF16},
    {"mxfp8 32x32 A", TO(MXFP8, E4M3, Q_MX2D), T(MXFP8, E4M3), {{64, 96, 160}, {32, 32, 32}},
     OPF_F32},
    {"block 1Dx1D", TO(BLOCK_1D, E4M3, Q_POW2), TO(BLOCK_1D, E4M3, Q_POW2),
     {{64, 96, 272}, {48, 144, 128}}, OPF_F32},
    {"block 1Dx2D", TO(BLOCK_2D, E4M3, Q_POW2), TO(BLOCK_1D, E4M3, Q_POW2),
     {{64, 160, 272}, {144, 48, 400}}, OPF_BF16},
    {"block 2Dx1D", TO(BLOCK_1D, E4M3, Q_POW2), TO(BLOCK_2D, E4M3, Q_POW2),
     {{160, 64, 272}, {48, 144, 16}}, OPF_F32},
    {"block 1Dx1D fp32 scales", T(BLOCK_1D, E4M3), T(BLOCK_1D, E5M2), {{64, 96, 272}, {16, 16, 16}},
     OPF_F32},
    {"nvfp4 1D", T(NVFP4_1D, E2M1), T(NVFP4_1D, E2M1), {{64, 96, 272}, {48, 80, 96}}, OPF_F32},
    {"nvfp4 2D A", T(NVFP4_2D, E2M1), T(NVFP4_1D, E2M1), {{64, 96, 272}, {48, 80, 96}}, OPF_BF16},
    {"nvfp4 swizzled", TO(NVFP4_1D, E2M1, Q_SWZ), TO(NVFP4_2D, E2M1, Q_SWZ),
     {{144, 96, 272}, {48, 80, 96}}, OPF_F32},
};

/* Logical shapes of A and B for a layout (5.1). */
static void operand_shapes(opf_gemm_layout L, int64_t M, int64_t N, int64_t K, int64_t a[2],
                           int64_t b[2])
{
    a[0] = L == OPF_GEMM_TN ? N : K;
    a[1] = L == OPF_GEMM_TN ? K : N;
    b[0] = L == OPF_GEMM_NT ? K : M;
    b[1] = L == OPF_GEMM_NT ? M : K;
}

/* One GEMM of a format case against the FP64 reference. */
static void run_fmt_case(opf_ctx *ctx, const fmt_case *c, opf_gemm_layout L, const int64_t *mnk,
                         unsigned long long *seed)
{
    int64_t M = mnk[0], N = mnk[1], K = mnk[2], as[2], bs[2];
    operand_shapes(L, M, N, K, as, bs);
    float *av = xmalloc((size_t)(N * K) * sizeof(float));
    float *bv = xmalloc((size_t)(M * K) * sizeof(float));
    fill_uniform(av, N * K, seed, -2.0f, 2.0f);
    fill_uniform(bv, M * K, seed, -0.5f, 0.5f);
    opf_tensor a = make_operand(ctx, as[0], as[1], &c->a, c->a.qd, av);
    opf_tensor b = make_operand(ctx, bs[0], bs[1], &c->b, c->b.qd, bv);
    float *ar = operand_values(ctx, &a, L == OPF_GEMM_TN);
    float *br = operand_values(ctx, &b, L != OPF_GEMM_NT);
    opf_spec ds;
    CHECK_OK(ctx, opf_gemm_out_spec(&a.spec, &b.spec, L, c->out, &ds));
    opf_tensor d;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &ds, &d));
    opf_gemm_options o = opf_gemm_options_default();
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, L, &o, &d));
    double *ref = xmalloc((size_t)(M * N) * sizeof(double));
    double *mag = xmalloc((size_t)(M * N) * sizeof(double));
    ref_gemm(L, M, N, K, ar, br, ref, mag);
    gemm_err(M * N, K, mag, 1.0, mag);
    char what[128];
    snprintf(what, sizeof what, "%s %s %lldx%lldx%lld", c->name, lname[L], (long long)M,
             (long long)N, (long long)K);
    check_close(what, &d, ref, mag);
    free(av), free(bv), free(ar), free(br), free(ref), free(mag);
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d);
}

static void test_formats(opf_ctx *ctx)
{
    unsigned long long seed = 11;
    for (size_t i = 0; i < sizeof fmt_cases / sizeof fmt_cases[0]; i++)
        for (int L = 0; L < OPF_GEMM_LAYOUT_COUNT; L++)
            for (int s = 0; s < 2; s++)
                run_fmt_case(ctx, &fmt_cases[i], L, fmt_cases[i].shapes[s], &seed);
}

/* NVFP4 with the Hadamard transform on both columnwise copies: the wgrad
 * (NT) product of the rotated copies is the product of the originals. */
static void test_nvfp4_rht(opf_ctx *ctx)
{
    fmt_case c = {"nvfp4 rht", TO(NVFP4_1D, E2M1, Q_RHT), TO(NVFP4_1D, E2M1, Q_RHT),
                  {{64, 96, 272}, {48, 32, 128}}, OPF_F32};
    unsigned long long seed = 12;
    for (int s = 0; s < 2; s++) {
        run_fmt_case(ctx, &c, OPF_GEMM_NT, c.shapes[s], &seed);
        run_fmt_case(ctx, &c, OPF_GEMM_TN, c.shapes[s], &seed);  /* rowwise copies: not rotated */
    }
}

/* ---- epilogue: alpha, beta, accumulate, bias, output dtypes --------------- */

typedef struct epi_case {
    qcfg      fmt;
    opf_dtype out, bias_dt;
    float     alpha, beta;
    bool      accumulate, bias;
} epi_case;

static const epi_case epi_cases[] = {
    {T(NONE, F32), OPF_F32, OPF_F32, 0.75f, 0.0f, false, true},
    {T(NONE, F32), OPF_F32, OPF_BF16, -1.5f, 0.5f, true, true},
    {T(NONE, BF16), OPF_BF16, OPF_BF16, 2.0f, 1.0f, true, false},
    {T(NONE, F16), OPF_F16, OPF_F16, 0.3f, -1.0f, true, true},
    {T(TENSOR, E4M3), OPF_BF16, OPF_BF16, 1.25f, 1.0f, true, true},
    {T(TENSOR, E4M3), OPF_F32, OPF_F32, 1.0f, 2.0f, true, false},
    {T(MXFP8, E4M3), OPF_F16, OPF_F32, 0.5f, 1.0f, true, true},
    {TO(BLOCK_1D, E4M3, Q_POW2), OPF_F32, OPF_BF16, 1.5f, 1.0f, true, true},
    {TO(BLOCK_1D, E4M3, Q_POW2), OPF_BF16, OPF_F32, 0.5f, 0.25f, true, true},
    {T(NVFP4_1D, E2M1), OPF_BF16, OPF_BF16, 3.0f, 1.0f, true, true},
    {T(NVFP4_1D, E2M1), OPF_F32, OPF_F32, 0.5f, 0.0f, false, true},
};

static void run_epi_case(opf_ctx *ctx, const epi_case *c, opf_gemm_layout L,
                         unsigned long long *seed)
{
    const int64_t M = 64, N = 96, K = 160;
    int64_t as[2], bs[2];
    operand_shapes(L, M, N, K, as, bs);
    float *av = xmalloc(N * K * sizeof(float)), *bv = xmalloc(M * K * sizeof(float));
    float *cv = xmalloc(M * N * sizeof(float)), *biasv = xmalloc(N * sizeof(float));
    fill_uniform(av, N * K, seed, -1, 1);
    fill_uniform(bv, M * K, seed, -1, 1);
    fill_uniform(cv, M * N, seed, -8, 8);
    fill_uniform(biasv, N, seed, -4, 4);
    opf_tensor a = make_operand(ctx, as[0], as[1], &c->fmt, c->fmt.qd, av);
    opf_tensor b = make_operand(ctx, bs[0], bs[1], &c->fmt, c->fmt.qd, bv);
    opf_tensor d = plain_tensor(ctx, M, N, c->out, cv);  /* cv: the old D as stored */
    opf_spec bsp = opf_spec_make(1, (int64_t[]){N}, c->bias_dt);
    opf_tensor bias;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &bsp, &bias));
    opf_convert(biasv, OPF_F32, bias.data[OPF_COMP_DATA], c->bias_dt, (size_t)N);
    opf_convert(bias.data[OPF_COMP_DATA], c->bias_dt, biasv, OPF_F32, (size_t)N);
    float *ar = operand_values(ctx, &a, L == OPF_GEMM_TN);
    float *br = operand_values(ctx, &b, L != OPF_GEMM_NT);

    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = c->alpha;
    o.beta = c->beta;
    o.accumulate = c->accumulate;
    o.bias = c->bias ? &bias : NULL;
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, L, &o, &d));

    double *ref = xmalloc(M * N * sizeof(double)), *mag = xmalloc(M * N * sizeof(double));
    ref_gemm(L, M, N, K, ar, br, ref, mag);
    bool block = c->fmt.sc == OPF_SCALING_BLOCK_1D;
    for (int64_t i = 0; i < M * N; i++) {
        double t = c->alpha * ref[i] + (c->bias ? biasv[i % N] : 0.0);
        double err = (K + 8) * U32 * mag[i] * fabs(c->alpha) + 4 * U32 * (fabs(t) + 1e-30);
        if (c->accumulate) {
            /* block scaling rounds to D's dtype before adding the old D */
            if (block) err += out_rel(c->out) * fabs(t) + out_abs(c->out);
            t += c->beta * (double)cv[i];
            err += 4 * U32 * fabs(c->beta * cv[i]);
        }
        ref[i] = t;
        mag[i] = err;
    }
    char what[128];
    snprintf(what, sizeof what, "epilogue %s %s %s out alpha %g beta %g acc %d bias %d",
             opf_scaling_name(c->fmt.sc), lname[L], opf_dtype_name(c->out), (double)c->alpha,
             (double)c->beta, c->accumulate, c->bias);
    check_close(what, &d, ref, mag);
    free(av), free(bv), free(cv), free(biasv), free(ar), free(br), free(ref), free(mag);
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d);
    opf_tensor_release(&bias);
}

static void test_epilogue(opf_ctx *ctx)
{
    unsigned long long seed = 21;
    for (size_t i = 0; i < sizeof epi_cases / sizeof epi_cases[0]; i++)
        for (int L = 0; L < OPF_GEMM_LAYOUT_COUNT; L++) run_epi_case(ctx, &epi_cases[i], L, &seed);
}

/* K = 0: the sum is empty, D = bias (or beta * D). */
static void test_empty_k(opf_ctx *ctx)
{
    float av[1], bv[1], biasv[5] = {1, -2, 3.5f, 0, 7}, dv[15];
    opf_tensor a = plain_tensor(ctx, 5, 0, OPF_F32, av), b = plain_tensor(ctx, 3, 0, OPF_F32, bv);
    opf_tensor bias = plain_tensor(ctx, 1, 5, OPF_F32, biasv);
    bias.spec = opf_spec_make(1, (int64_t[]){5}, OPF_F32);
    for (int i = 0; i < 15; i++) dv[i] = 100.0f;
    opf_tensor d = plain_tensor(ctx, 3, 5, OPF_F32, dv);
    opf_gemm_options o = opf_gemm_options_default();
    o.bias = &bias;
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, &o, &d));
    const float *y = d.data[OPF_COMP_DATA];
    int ok = 1;
    for (int i = 0; i < 15; i++) ok &= y[i] == biasv[i % 5];
    CHECK(ok, "K=0: D must equal the bias");
    /* M = 0: nothing to compute, and nothing fails */
    opf_tensor b0 = plain_tensor(ctx, 0, 0, OPF_F32, bv), d0 = plain_tensor(ctx, 0, 5, OPF_F32, dv);
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b0, OPF_GEMM_TN, &o, &d0));
    opf_tensor_release(&b0), opf_tensor_release(&d0);
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&bias);
    opf_tensor_release(&d);
}

/* ---- FP8 output ------------------------------------------------------------ */

/* An FP8 D equals quantizing the fp32 D of the same GEMM, bitwise (data,
 * scale_inv, amax), for current and delayed scaling, with and without bias. */
static void run_fp8_out(opf_ctx *ctx, const qcfg *fmt, const opf_quantizer *q, bool with_bias,
                        opf_delayed_state *st)
{
    const int64_t M = 48, N = 80, K = 96;
    unsigned long long seed = 31;
    float *av = xmalloc(N * K * sizeof(float)), *bv = xmalloc(M * K * sizeof(float)), biasv[80];
    fill_uniform(av, N * K, &seed, -1, 1);
    fill_uniform(bv, M * K, &seed, -3, 3);
    fill_uniform(biasv, N, &seed, -1, 1);
    opf_tensor a = make_operand(ctx, N, K, fmt, fmt->qd, av);
    opf_tensor b = make_operand(ctx, M, K, fmt, fmt->qd, bv);
    opf_tensor bias = plain_tensor(ctx, 1, N, OPF_BF16, biasv);
    bias.spec = opf_spec_make(1, (int64_t[]){N}, OPF_BF16);
    opf_spec plain = opf_spec_make(2, (int64_t[]){M, N}, OPF_BF16), qs;
    CHECK_OK(ctx, opf_quantizer_spec(q, &plain, &qs));
    opf_tensor d8, d8ref, d32;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &qs, &d8));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &qs, &d8ref));
    opf_spec s32 = opf_spec_make(2, (int64_t[]){M, N}, OPF_F32);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s32, &d32));

    opf_gemm_options o = opf_gemm_options_default();
    o.bias = with_bias ? &bias : NULL;
    o.alpha = 0.5f;
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, &o, &d32));
    float h_before = st ? opf_delayed_state_history(st)[q->slot] : 0;
    o.out_quantizer = q;
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, &o, &d8));
    float h_gemm = st ? opf_delayed_state_history(st)[q->slot] : 0;
    /* reference: quantize the fp32 D (viewed as the f32 logical dtype) */
    opf_tensor view = d8ref;
    view.spec.dtype = OPF_F32;
    CHECK_OK(ctx, opf_quantize(ctx, q, &d32, &view));
    opf_layout lay;
    opf_spec_layout(&qs, &lay);
    int same = 1;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (lay.comp[c].present)
            same &= !memcmp(d8.data[c], d8ref.data[c], lay.comp[c].nbytes);
    CHECK(same, "FP8 output (%s, %s, bias %d) differs from quantizing the fp32 result",
          opf_scaling_name(fmt->sc), st ? "delayed" : "current", with_bias);
    if (st) {
        float amax = *(float *)d8.data[OPF_COMP_AMAX];
        CHECK(h_gemm == fmaxf(h_before, amax) && amax > 0,
              "delayed FP8 output must max-accumulate amax %g into the history (%g -> %g)",
              (double)amax, (double)h_before, (double)h_gemm);
    }
    free(av), free(bv);
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&bias);
    opf_tensor_release(&d8), opf_tensor_release(&d8ref), opf_tensor_release(&d32);
}

static void test_fp8_output(opf_ctx *ctx)
{
    opf_quantizer cur = opf_quantizer_default();
    cur.scaling = OPF_SCALING_TENSOR;
    cur.qdtype = OPF_E4M3;
    qcfg plain = T(NONE, BF16), fp8 = T(TENSOR, E4M3), blk = TO(BLOCK_1D, E4M3, Q_POW2);
    run_fp8_out(ctx, &plain, &cur, false, NULL);
    run_fp8_out(ctx, &fp8, &cur, true, NULL);
    run_fp8_out(ctx, &blk, &cur, true, NULL);
    cur.usage = OPF_USAGE_ROWWISE;
    cur.qdtype = OPF_E5M2;
    run_fp8_out(ctx, &fp8, &cur, false, NULL);

    opf_delayed_state *st;
    CHECK_OK(ctx,
             opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, 4, OPF_AMAX_MAX, false, 3, &st));
    opf_delayed_state_scale(st)[2] = 8.0f;
    opf_quantizer del = opf_quantizer_default();
    del.scaling = OPF_SCALING_TENSOR;
    del.delayed = st;
    del.slot = 2;
    run_fp8_out(ctx, &fp8, &del, true, st);
    opf_delayed_state_destroy(st);
}

/* ---- exact structure on exactly summable operands ---------------------------- */

/* E4M3 code of a small integer |v| <= 15 (exact). */
static uint8_t e4m3_int(int v) { return opf_f32_to_e4m3((float)v); }

/* A quantized tensor with every copy's bytes and scales written by hand:
 * codes[i*K + k] is the raw value of row idx i at reduction index k for the
 * copy stored as [idx, K]. Returns it allocated. */
static opf_tensor alloc_spec(opf_ctx *ctx, int64_t r, int64_t c, opf_scaling sc, opf_dtype qd,
                             unsigned usage)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){r, c}, OPF_BF16);
    s.scaling = sc;
    s.qdtype = qd;
    s.usage = usage;
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    return t;
}

/* x rounded to dt (RNE) and back. */
static float round_dt(opf_dtype dt, float x)
{
    if (dt == OPF_BF16) return opf_bf16_to_f32(opf_f32_to_bf16(x));
    if (dt == OPF_F16) return opf_f16_to_f32(opf_f32_to_f16(x));
    return x;
}

/* The epilogue order on exact sums (plain f32 small integers), bitwise:
 * t = fl(alpha acc); t = fl(t + bias); t = fl(t + fl(beta D_old)); D = RNE(t). */
static void test_exact_epilogue(opf_ctx *ctx)
{
    const int64_t M = 32, N = 48, K = 64;
    static const opf_dtype outs[] = {OPF_F32, OPF_BF16, OPF_F16};
    unsigned long long seed = 45;
    float *av = xmalloc(N * K * sizeof(float)), *bv = xmalloc(M * K * sizeof(float));
    float *old = xmalloc(M * N * sizeof(float)), *got = xmalloc(M * N * sizeof(float)), biasv[48];
    for (int64_t i = 0; i < N * K; i++) av[i] = (float)((int)(opf_test_rand_u64(&seed) % 15) - 7);
    for (int64_t i = 0; i < M * K; i++) bv[i] = (float)((int)(opf_test_rand_u64(&seed) % 15) - 7);
    fill_uniform(biasv, N, &seed, -30, 30);
    opf_tensor a = plain_tensor(ctx, N, K, OPF_F32, av), b = plain_tensor(ctx, M, K, OPF_F32, bv);
    opf_tensor bias = plain_tensor(ctx, 1, N, OPF_F32, biasv);
    bias.spec = opf_spec_make(1, (int64_t[]){N}, OPF_F32);
    for (int i = 0; i < 3; i++) {
        fill_uniform(old, M * N, &seed, -100, 100);
        opf_tensor d = plain_tensor(ctx, M, N, outs[i], old);
        opf_gemm_options o = opf_gemm_options_default();
        o.alpha = 0.3f;
        o.beta = 0.7f;
        o.accumulate = true;
        o.bias = &bias;
        CHECK_OK(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, &o, &d));
        opf_convert(d.data[OPF_COMP_DATA], outs[i], got, OPF_F32, (size_t)(M * N));
        int bad = 0;
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) {
                int acc = 0;
                for (int64_t k = 0; k < K; k++) acc += (int)bv[m * K + k] * (int)av[n * K + k];
                float t = o.alpha * (float)acc;
                t = t + biasv[n];
                t = t + o.beta * old[m * N + n];
                bad += got[m * N + n] != round_dt(outs[i], t);
            }
        CHECK(bad == 0, "exact epilogue, %s out: %d elements differ", opf_dtype_name(outs[i]), bad);
        opf_tensor_release(&d);
    }
    free(av), free(bv), free(old), free(got);
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&bias);
}

/* Per-tensor FP8: D = fl(fl(alpha * fl(sA * sB)) * sum qa qb) when the sum is
 * exact; also NVFP4's alpha' = fl(fl(fl(alpha amax_A) amax_B) c). TN. */
static void test_exact_alpha(opf_ctx *ctx)
{
    const int64_t M = 32, N = 48, K = 64;
    unsigned long long seed = 41;
    int *qa = xmalloc(N * K * sizeof(int)), *qb = xmalloc(M * K * sizeof(int));
    for (int64_t i = 0; i < N * K; i++) qa[i] = (int)(opf_test_rand_u64(&seed) % 13) - 6;
    for (int64_t i = 0; i < M * K; i++) qb[i] = (int)(opf_test_rand_u64(&seed) % 13) - 6;
    float *dv = xmalloc(M * N * sizeof(float));
    opf_spec ds = opf_spec_make(2, (int64_t[]){M, N}, OPF_F32);
    opf_tensor d;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &ds, &d));
    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = 0.3f;

    /* per-tensor FP8 */
    opf_tensor a = alloc_spec(ctx, N, K, OPF_SCALING_TENSOR, OPF_E4M3, OPF_USAGE_ROWWISE);
    opf_tensor b = alloc_spec(ctx, M, K, OPF_SCALING_TENSOR, OPF_E4M3, OPF_USAGE_ROWWISE);
    for (int64_t i = 0; i < N * K; i++) ((uint8_t *)a.data[OPF_COMP_DATA])[i] = e4m3_int(qa[i]);
    for (int64_t i = 0; i < M * K; i++) ((uint8_t *)b.data[OPF_COMP_DATA])[i] = e4m3_int(qb[i]);
    float sa = 0.031871315f, sb = 0.042909317f;  /* association matters for these */
    *(float *)a.data[OPF_COMP_SCALE_INV] = sa;
    *(float *)b.data[OPF_COMP_SCALE_INV] = sb;
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, &o, &d));
    float alpha_t = o.alpha * (sa * sb);
    int bad = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            int s = 0;
            for (int64_t k = 0; k < K; k++) s += qb[m * K + k] * qa[n * K + k];
            float want = alpha_t * (float)s;
            bad += ((float *)d.data[OPF_COMP_DATA])[m * N + n] != want;
        }
    CHECK(bad == 0, "per-tensor FP8: %d elements differ from fl(fl(alpha fl(sA sB)) sum)", bad);
    opf_tensor_release(&a), opf_tensor_release(&b);

    /* NVFP4: codes in {-6..6} halves; scales small integers, unswizzled */
    a = alloc_spec(ctx, N, K, OPF_SCALING_NVFP4_1D, OPF_E2M1, OPF_USAGE_ROWWISE);
    b = alloc_spec(ctx, M, K, OPF_SCALING_NVFP4_1D, OPF_E2M1, OPF_USAGE_ROWWISE);
    opf_layout la, lb;
    opf_spec_layout(&a.spec, &la);
    opf_spec_layout(&b.spec, &lb);
    static const float fp4v[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6,
                                   -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
    uint8_t *ad = a.data[OPF_COMP_DATA], *bd = b.data[OPF_COMP_DATA];
    uint8_t *asf = a.data[OPF_COMP_SCALE_INV], *bsf = b.data[OPF_COMP_SCALE_INV];
    memset(ad, 0, la.comp[OPF_COMP_DATA].nbytes);
    memset(bd, 0, lb.comp[OPF_COMP_DATA].nbytes);
    for (int64_t i = 0; i < N * K; i++) ad[i / 2] |= (uint8_t)((qa[i] & 15) << (4 * (i & 1)));
    for (int64_t i = 0; i < M * K; i++) bd[i / 2] |= (uint8_t)((qb[i] & 15) << (4 * (i & 1)));
    for (size_t i = 0; i < la.comp[OPF_COMP_SCALE_INV].nbytes; i++)
        asf[i] = e4m3_int(1 + (int)(i % 3));
    for (size_t i = 0; i < lb.comp[OPF_COMP_SCALE_INV].nbytes; i++)
        bsf[i] = e4m3_int(1 + (int)(i % 4));
    float amax_a = 5.025569f, amax_b = 6.2357965f;  /* association matters */
    *(float *)a.data[OPF_COMP_AMAX] = amax_a;
    *(float *)b.data[OPF_COMP_AMAX] = amax_b;
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, OPF_GEMM_TN, &o, &d));
    float c = 1.0f / 7225344.0f;
    float alpha_n = ((o.alpha * amax_a) * amax_b) * c;
    int64_t sca = la.comp[OPF_COMP_SCALE_INV].cols, scb = lb.comp[OPF_COMP_SCALE_INV].cols;
    bad = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double s = 0;  /* exact: multiples of 1/4 below 2^20 */
            for (int64_t k = 0; k < K; k++)
                s += (double)fp4v[qb[m * K + k] & 15] * opf_e4m3_to_f32(bsf[m * scb + k / 16]) *
                     fp4v[qa[n * K + k] & 15] * opf_e4m3_to_f32(asf[n * sca + k / 16]);
            float want = alpha_n * (float)s;
            bad += ((float *)d.data[OPF_COMP_DATA])[m * N + n] != want;
        }
    CHECK(bad == 0, "nvfp4: %d elements differ from fl(alpha' sum), alpha' = "
          "fl(fl(fl(alpha amax_A) amax_B) fl32(1/7225344))", bad);
    uint32_t cbits;
    memcpy(&cbits, &c, sizeof cbits);
    CHECK(cbits == 0x34149B93u, "fl32(1/7225344) must be 0x34149B93");
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d);
    free(qa), free(qb), free(dv);
}

/* Block scaling on exactly summable codes: stored copies [idx, K] with
 * integer codes, arbitrary (non power of two) fp32 scales. Each chunk P is
 * exact, so D must match the 5.3 formula bitwise. Covers every layout
 * (filling the copy each layout reads) and 1Dx1D, 1Dx2D, 2Dx1D. */
typedef struct hand_block {
    opf_tensor t;
    int       *q;       /* [idx, K] integer codes */
    float     *s;       /* scale grid of the copy (points into t) */
    int64_t    ld;      /* scale grid row length */
    bool       two_d;
} hand_block;

static hand_block make_hand_block(opf_ctx *ctx, int64_t idx, int64_t K, bool rowwise, bool two_d,
                                  unsigned long long *seed)
{
    hand_block h;
    int64_t r = rowwise ? idx : K, c = rowwise ? K : idx;
    h.t = alloc_spec(ctx, r, c, two_d ? OPF_SCALING_BLOCK_2D : OPF_SCALING_BLOCK_1D, OPF_E4M3,
                     rowwise ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE);
    h.two_d = two_d;
    opf_layout L;
    opf_spec_layout(&h.t.spec, &L);
    opf_component dc = rowwise ? OPF_COMP_DATA : OPF_COMP_COL_DATA;
    opf_component sc = rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV;
    h.q = xmalloc((size_t)(idx * K) * sizeof(int));
    uint8_t *d = h.t.data[dc];
    for (int64_t i = 0; i < idx * K; i++) {
        h.q[i] = (int)(opf_test_rand_u64(seed) % 17) - 8;
        d[i] = e4m3_int(h.q[i]);  /* the stored copy is [idx, K] in both cases */
    }
    h.s = h.t.data[sc];
    h.ld = L.comp[sc].cols;
    for (int64_t i = 0; i < L.comp[sc].rows * L.comp[sc].cols; i++)
        h.s[i] = opf_test_uniform(seed, 0.001f, 0.1f);
    return h;
}

static float hand_scale(const hand_block *h, int64_t i, int64_t kb)
{
    return h->two_d ? h->s[(i / 128) * h->ld + kb] : h->s[kb * h->ld + i];
}

static void run_block_exact(opf_ctx *ctx, opf_gemm_layout L, bool a2d, bool b2d, int64_t M,
                            int64_t N, int64_t K, opf_dtype out)
{
    unsigned long long seed = 51 + (unsigned)L * 7 + a2d * 3 + b2d;
    /* "a" of 5.3 is B (rows of D), "b" is A */
    hand_block A = make_hand_block(ctx, N, K, L == OPF_GEMM_TN, b2d, &seed);
    hand_block B = make_hand_block(ctx, M, K, L != OPF_GEMM_NT, a2d, &seed);
    /* with a low-precision D: accumulate, which rounds to D's dtype first */
    float *old = xmalloc((size_t)(M * N) * sizeof(float));
    fill_uniform(old, M * N, &seed, -50, 50);
    opf_tensor d = plain_tensor(ctx, M, N, out, old);
    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = 0.7f;
    o.beta = 0.3f;
    o.accumulate = out != OPF_F32;
    CHECK_OK(ctx, opf_gemm(ctx, &A.t, &B.t, L, &o, &d));
    float *got = xmalloc((size_t)(M * N) * sizeof(float));
    opf_convert(d.data[OPF_COMP_DATA], out, got, OPF_F32, (size_t)(M * N));
    int bad = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float y = 0;
            for (int64_t kb = 0; kb * 128 < K; kb++) {
                int p = 0;
                for (int64_t k = kb * 128; k < K && k < kb * 128 + 128; k++)
                    p += B.q[m * K + k] * A.q[n * K + k];
                float sa = hand_scale(&B, m, kb), sb = hand_scale(&A, n, kb);
                y = a2d ? fmaf((float)p * sb, sa, y) : fmaf((float)p * sa, sb, y);
            }
            y = o.alpha * y;
            if (o.accumulate) {
                y = round_dt(out, y);
                y = y + o.beta * old[m * N + n];
            }
            bad += got[m * N + n] != round_dt(out, y);
        }
    CHECK(bad == 0, "block %s %s x %s %lldx%lldx%lld: %d elements differ from the chunk rule",
          lname[L], a2d ? "2D" : "1D", b2d ? "2D" : "1D", (long long)M, (long long)N,
          (long long)K, bad);
    free(A.q), free(B.q), free(old), free(got);
    opf_tensor_release(&A.t), opf_tensor_release(&B.t), opf_tensor_release(&d);
}

static void test_block_exact(opf_ctx *ctx)
{
    for (int L = 0; L < OPF_GEMM_LAYOUT_COUNT; L++) {
        run_block_exact(ctx, L, false, false, 48, 80, 272, OPF_F32);
        run_block_exact(ctx, L, false, true, 160, 144, 400, OPF_F32);
        run_block_exact(ctx, L, true, false, 144, 160, 272, OPF_F32);
        run_block_exact(ctx, L, false, false, 16, 16, 16, OPF_F32);
        run_block_exact(ctx, L, false, true, 48, 144, 272, OPF_BF16);
        run_block_exact(ctx, L, true, false, 144, 48, 160, OPF_F16);
        /* any shape: partial 128-chunks of K and partial 128x128 tiles */
        run_block_exact(ctx, L, false, false, 303, 305, 300, OPF_F32);
        run_block_exact(ctx, L, false, true, 305, 303, 256, OPF_BF16);
        run_block_exact(ctx, L, true, false, 303, 300, 305, OPF_F32);
    }
}

/* MXFP8 on exact codes: power-of-two scales keep every product exact, so D is
 * the exact sum when it fits fp32. Swizzled scales, every layout. */
static void test_mxfp8_exact(opf_ctx *ctx)
{
    const int64_t M = 64, N = 96, K = 128;
    unsigned long long seed = 61;
    for (int L = 0; L < OPF_GEMM_LAYOUT_COUNT; L++) {
        int64_t as[2], bs[2];
        operand_shapes(L, M, N, K, as, bs);
        /* values: small integers times 2^e, e per 32-block in [-3, 3] */
        float *av = xmalloc(N * K * sizeof(float)), *bv = xmalloc(M * K * sizeof(float));
        for (int64_t i = 0; i < N * K; i++)
            av[i] = (float)((int)(opf_test_rand_u64(&seed) % 15) - 7) *
                    ldexpf(1, (int)(i / 32 % 7) - 3);
        for (int64_t i = 0; i < M * K; i++)
            bv[i] = (float)((int)(opf_test_rand_u64(&seed) % 15) - 7) *
                    ldexpf(1, (int)(i / 64 % 5) - 2);
        qcfg f = TO(MXFP8, E4M3, Q_SWZ);
        opf_tensor a = make_operand(ctx, as[0], as[1], &f, OPF_E4M3, av);
        opf_tensor b = make_operand(ctx, bs[0], bs[1], &f, OPF_E4M3, bv);
        float *ar = operand_values(ctx, &a, L == OPF_GEMM_TN);
        float *br = operand_values(ctx, &b, L != OPF_GEMM_NT);
        opf_spec ds = opf_spec_make(2, (int64_t[]){M, N}, OPF_F32);
        opf_tensor d;
        CHECK_OK(ctx, opf_tensor_alloc(ctx, &ds, &d));
        opf_gemm_options o = opf_gemm_options_default();
        CHECK_OK(ctx, opf_gemm(ctx, &a, &b, L, &o, &d));
        double *ref = xmalloc(M * N * sizeof(double)), *mag = xmalloc(M * N * sizeof(double));
        ref_gemm(L, M, N, K, ar, br, ref, mag);
        int bad = 0;
        for (int64_t i = 0; i < M * N; i++)
            bad += ((float *)d.data[OPF_COMP_DATA])[i] != (float)ref[i];
        CHECK(bad == 0, "mxfp8 exact %s: %d elements differ", lname[L], bad);
        free(av), free(bv), free(ar), free(br), free(ref), free(mag);
        opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d);
    }
}

/* ---- block rule on random operands vs an fp32 fmaf reference --------------- */

/* The reference follows 5.3 with fp32 fmaf; each chunk P is summed in double
 * and rounded once, so it differs from OpenBLAS's fp32 chunk sum by at most
 * kt u sum|qa qb| per chunk, carried through the scales. */
static void run_block_random(opf_ctx *ctx, opf_gemm_layout L, opf_scaling sa_mode,
                             opf_scaling sb_mode, int64_t M, int64_t N, int64_t K)
{
    unsigned long long seed = 71 + (unsigned)L;
    int64_t as[2], bs[2];
    operand_shapes(L, M, N, K, as, bs);
    float *av = xmalloc(N * K * sizeof(float)), *bv = xmalloc(M * K * sizeof(float));
    for (int64_t i = 0; i < N * K; i++) av[i] = opf_test_normal(&seed, 1.0f) * (1 + i % 5);
    for (int64_t i = 0; i < M * K; i++) bv[i] = opf_test_normal(&seed, 0.01f);
    qcfg fa = {sb_mode, OPF_E4M3, 0}, fb = {sa_mode, OPF_E4M3, 0};  /* fp32 scales */
    opf_tensor a = make_operand(ctx, as[0], as[1], &fa, OPF_E4M3, av);
    opf_tensor b = make_operand(ctx, bs[0], bs[1], &fb, OPF_E4M3, bv);
    opf_spec ds = opf_spec_make(2, (int64_t[]){M, N}, OPF_F32);
    opf_tensor d;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &ds, &d));
    opf_gemm_options o = opf_gemm_options_default();
    CHECK_OK(ctx, opf_gemm(ctx, &a, &b, L, &o, &d));

    /* raw codes and scales of the copies read, stored [idx, K] */
    bool arow = L == OPF_GEMM_TN, brow = L != OPF_GEMM_NT;
    opf_layout la, lb;
    opf_spec_layout(&a.spec, &la);
    opf_spec_layout(&b.spec, &lb);
    const uint8_t *qa = a.data[arow ? OPF_COMP_DATA : OPF_COMP_COL_DATA];
    const uint8_t *qb = b.data[brow ? OPF_COMP_DATA : OPF_COMP_COL_DATA];
    hand_block A = {a, NULL, a.data[arow ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV],
                    la.comp[arow ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV].cols,
                    sb_mode == OPF_SCALING_BLOCK_2D};
    hand_block B = {b, NULL, b.data[brow ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV],
                    lb.comp[brow ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV].cols,
                    sa_mode == OPF_SCALING_BLOCK_2D};
    bool a2d = B.two_d;
    int bad = 0;
    double worst = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float y = 0;
            double err = 0;
            for (int64_t kb = 0; kb * 128 < K; kb++) {
                double p = 0, pm = 0;
                for (int64_t k = kb * 128; k < K && k < kb * 128 + 128; k++) {
                    double t = (double)opf_e4m3_to_f32(qb[m * K + k]) *
                               opf_e4m3_to_f32(qa[n * K + k]);
                    p += t;
                    pm += fabs(t);
                }
                float sa = hand_scale(&B, m, kb), sb = hand_scale(&A, n, kb);
                y = a2d ? fmaf((float)p * sb, sa, y) : fmaf((float)p * sa, sb, y);
                err += 130 * U32 * pm * sa * sb + 2 * U32 * fabs(y);
            }
            double e = fabs((double)((float *)d.data[OPF_COMP_DATA])[m * N + n] - y);
            if (!(e <= err + 1e-37)) bad++;
            if (err > 0 && e / err > worst) worst = e / err;
        }
    CHECK(bad == 0, "block random %s %s x %s: %d elements off the chunk rule (worst %.3g)",
          lname[L], opf_scaling_name(sa_mode), opf_scaling_name(sb_mode), bad, worst);
    free(av), free(bv);
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d);
}

static void test_block_random(opf_ctx *ctx)
{
    for (int L = 0; L < OPF_GEMM_LAYOUT_COUNT; L++) {
        run_block_random(ctx, L, OPF_SCALING_BLOCK_1D, OPF_SCALING_BLOCK_1D, 48, 80, 400);
        run_block_random(ctx, L, OPF_SCALING_BLOCK_1D, OPF_SCALING_BLOCK_2D, 144, 272, 272);
        run_block_random(ctx, L, OPF_SCALING_BLOCK_2D, OPF_SCALING_BLOCK_1D, 272, 48, 144);
        run_block_random(ctx, L, OPF_SCALING_BLOCK_1D, OPF_SCALING_BLOCK_2D, 303, 305, 300);
        run_block_random(ctx, L, OPF_SCALING_BLOCK_2D, OPF_SCALING_BLOCK_1D, 305, 303, 256);
    }
}

/* ---- the Linear triple per recipe --------------------------------------------- */

typedef struct tol { double rtol, atol; } tol;
static const tol tol_e4m3 = {0.125, 0.0675}, tol_e5m2 = {0.25, 0.125}, tol_e2m1 = {0.25, 0.125};
static const tol tol_bf16 = {1.6e-2, 1e-5};

/* |t - r| <= atol + rtol |r| per element (numerics.md 8.3). */
static void check_tol(const char *what, const opf_tensor *d, const double *ref, tol t)
{
    int64_t n = opf_spec_numel(&d->spec);
    float *v = xmalloc((size_t)n * sizeof(float));
    opf_convert(d->data[OPF_COMP_DATA], d->spec.dtype, v, OPF_F32, (size_t)n);
    int bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(v[i] - ref[i]), lim = t.atol + t.rtol * fabs(ref[i]);
        bad += !(e <= lim);
        if (e / lim > worst) worst = e / lim;
    }
    CHECK(bad == 0, "%s: %d of %lld elements outside rtol %g atol %g (worst %.3g of the limit)",
          what, bad, (long long)n, t.rtol, t.atol, worst);
    free(v);
}

static opf_tensor linear_operand(opf_ctx *ctx, opf_recipe_state *rs, const opf_recipe *r,
                                 opf_tensor_role role, int64_t rows, int64_t cols, float *v)
{
    opf_tensor plain = plain_tensor(ctx, rows, cols, OPF_BF16, v);
    if (r->kind == OPF_RECIPE_NONE) return plain;
    opf_quantizer q;
    CHECK_OK(ctx, opf_recipe_state_quantizer(rs, role, 0, &q));
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    opf_tensor out;
    memset(&out, 0, sizeof out);
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &plain, &out));
    opf_tensor_release(&plain);
    return out;
}

static void run_linear(opf_ctx *ctx, opf_recipe_kind kind, tol fwd, tol bwd)
{
    const int64_t M = 128, K = 160, N = 96;  /* tokens, in, out */
    unsigned long long seed = 81 + (unsigned)kind;
    opf_recipe r = opf_recipe_default(kind);
    opf_recipe_state *rs = NULL;
    if (kind != OPF_RECIPE_NONE)
        CHECK_OK(ctx, opf_recipe_state_create(ctx, &r, "linear", "fc", 1, &rs));
    float *x = xmalloc(M * K * sizeof(float)), *w = xmalloc(N * K * sizeof(float));
    float *dy = xmalloc(M * N * sizeof(float));
    fill_uniform(x, M * K, &seed, 0, 1);
    fill_uniform(w, N * K, &seed, 0, 1);
    fill_uniform(dy, M * N, &seed, 0, 1);
    opf_tensor xq = linear_operand(ctx, rs, &r, OPF_ROLE_INPUT, M, K, x);
    opf_tensor wq = linear_operand(ctx, rs, &r, OPF_ROLE_WEIGHT, N, K, w);
    opf_tensor dyq = linear_operand(ctx, rs, &r, OPF_ROLE_GRAD_OUTPUT, M, N, dy);
    opf_tensor y, dx, dw;
    opf_spec s;
    CHECK_OK(ctx, opf_gemm_out_spec(&wq.spec, &xq.spec, OPF_GEMM_TN, OPF_BF16, &s));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &y));
    CHECK_OK(ctx, opf_gemm_out_spec(&wq.spec, &dyq.spec, OPF_GEMM_NN, OPF_BF16, &s));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &dx));
    CHECK_OK(ctx, opf_gemm_out_spec(&xq.spec, &dyq.spec, OPF_GEMM_NT, OPF_F32, &s));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &dw));
    opf_gemm_options o = opf_gemm_options_default();
    CHECK_OK(ctx, opf_gemm(ctx, &wq, &xq, OPF_GEMM_TN, &o, &y));
    CHECK_OK(ctx, opf_gemm(ctx, &wq, &dyq, OPF_GEMM_NN, &o, &dx));
    CHECK_OK(ctx, opf_gemm(ctx, &xq, &dyq, OPF_GEMM_NT, &o, &dw));

    double *ry = xmalloc(M * N * sizeof(double)), *rdx = xmalloc(M * K * sizeof(double));
    double *rdw = xmalloc(N * K * sizeof(double));
    double *mag = xmalloc(M * K * sizeof(double) + N * K * sizeof(double));
    ref_gemm(OPF_GEMM_TN, M, N, K, w, x, ry, mag);   /* y = x W^T */
    ref_gemm(OPF_GEMM_NN, M, K, N, w, dy, rdx, mag); /* dx = dy W */
    ref_gemm(OPF_GEMM_NT, N, K, M, x, dy, rdw, mag); /* dW = dy^T x */
    char what[96];
    snprintf(what, sizeof what, "linear %s fprop", opf_recipe_name(kind));
    check_tol(what, &y, ry, fwd);
    snprintf(what, sizeof what, "linear %s dgrad", opf_recipe_name(kind));
    check_tol(what, &dx, rdx, bwd);
    snprintf(what, sizeof what, "linear %s wgrad", opf_recipe_name(kind));
    check_tol(what, &dw, rdw, bwd);
    free(x), free(w), free(dy), free(ry), free(rdx), free(rdw), free(mag);
    opf_tensor_release(&xq), opf_tensor_release(&wq), opf_tensor_release(&dyq);
    opf_tensor_release(&y), opf_tensor_release(&dx), opf_tensor_release(&dw);
    opf_recipe_state_destroy(rs);
}

static void test_linear(opf_ctx *ctx)
{
    run_linear(ctx, OPF_RECIPE_NONE, tol_bf16, tol_bf16);
    run_linear(ctx, OPF_RECIPE_DELAYED, tol_e4m3, tol_e5m2);  /* HYBRID: dy e5m2 */
    run_linear(ctx, OPF_RECIPE_CURRENT, tol_e4m3, tol_e5m2);
    run_linear(ctx, OPF_RECIPE_MXFP8, tol_e4m3, tol_e4m3);
    run_linear(ctx, OPF_RECIPE_BLOCK, tol_e4m3, tol_e4m3);
    run_linear(ctx, OPF_RECIPE_NVFP4, tol_e2m1, tol_e2m1);   /* 2D W, RHT, SR on dy */
}

/* ---- determinism ------------------------------------------------------------- */

static void run_threads(const qcfg *f, opf_gemm_layout L, int64_t M, int64_t N, int64_t K)
{
    opf_ctx *c1 = new_ctx(1), *c2 = new_ctx(2);
    unsigned long long seed = 91;
    int64_t as[2], bs[2];
    operand_shapes(L, M, N, K, as, bs);
    float *av = xmalloc(N * K * sizeof(float)), *bv = xmalloc(M * K * sizeof(float));
    fill_uniform(av, N * K, &seed, -1, 1);
    fill_uniform(bv, M * K, &seed, -1, 1);
    opf_tensor a = make_operand(c1, as[0], as[1], f, f->qd, av);
    opf_tensor b = make_operand(c1, bs[0], bs[1], f, f->qd, bv);
    opf_spec ds = opf_spec_make(2, (int64_t[]){M, N}, OPF_F32);
    opf_tensor d1, d2;
    CHECK_OK(c1, opf_tensor_alloc(c1, &ds, &d1));
    CHECK_OK(c2, opf_tensor_alloc(c2, &ds, &d2));
    opf_gemm_options o = opf_gemm_options_default();
    CHECK_OK(c1, opf_gemm(c1, &a, &b, L, &o, &d1));
    CHECK_OK(c2, opf_gemm(c2, &a, &b, L, &o, &d2));
    CHECK(!memcmp(d1.data[OPF_COMP_DATA], d2.data[OPF_COMP_DATA], (size_t)(M * N) * sizeof(float)),
          "%s %s %lldx%lldx%lld: 1 and 2 threads differ", opf_scaling_name(f->sc), lname[L],
          (long long)M, (long long)N, (long long)K);
    free(av), free(bv);
    opf_tensor_release(&a), opf_tensor_release(&b);
    opf_tensor_release(&d1), opf_tensor_release(&d2);
    opf_ctx_destroy(c1);
    opf_ctx_destroy(c2);
}

static void test_determinism(void)
{
    qcfg f32 = T(NONE, F32), blk = TO(BLOCK_1D, E4M3, Q_POW2);
    qcfg nv = T(NVFP4_1D, E2M1), mx = T(MXFP8, E4M3);
    run_threads(&f32, OPF_GEMM_TN, 600, 1100, 300);
    run_threads(&f32, OPF_GEMM_NT, 520, 530, 1000);
    run_threads(&blk, OPF_GEMM_NN, 288, 560, 400);
    run_threads(&nv, OPF_GEMM_TN, 512, 528, 256);
    run_threads(&mx, OPF_GEMM_NT, 288, 544, 256);
}

/* ---- out spec ------------------------------------------------------------------ */

static void test_out_spec(void)
{
    opf_spec w = opf_spec_make(2, (int64_t[]){96, 64}, OPF_BF16);
    opf_spec x = opf_spec_make(3, (int64_t[]){2, 8, 64}, OPF_BF16);
    opf_spec dy = opf_spec_make(3, (int64_t[]){2, 8, 96}, OPF_BF16);
    opf_spec s;
    CHECK_OK(NULL, opf_gemm_out_spec(&w, &x, OPF_GEMM_TN, OPF_F32, &s));
    CHECK(s.ndim == 3 && s.shape[0] == 2 && s.shape[1] == 8 && s.shape[2] == 96 &&
              s.dtype == OPF_F32,
          "fprop out spec must be [2,8,96] f32");
    CHECK_OK(NULL, opf_gemm_out_spec(&w, &dy, OPF_GEMM_NN, OPF_BF16, &s));
    CHECK(s.ndim == 3 && s.shape[2] == 64 && s.dtype == OPF_BF16 && s.scaling == OPF_SCALING_NONE,
          "dgrad out spec must be [2,8,64] bf16");
    CHECK_OK(NULL, opf_gemm_out_spec(&x, &dy, OPF_GEMM_NT, OPF_F16, &s));
    CHECK(s.ndim == 2 && s.shape[0] == 96 && s.shape[1] == 64 && s.dtype == OPF_F16,
          "wgrad out spec must be [96,64] f16");
    /* a quantized pair gives the same plain spec */
    opf_spec wq = w, xq = x;
    wq.scaling = xq.scaling = OPF_SCALING_MXFP8;
    wq.qdtype = xq.qdtype = OPF_E4M3;
    wq.usage = xq.usage = OPF_USAGE_ROWWISE;
    xq.shape[1] = 16;
    CHECK_OK(NULL, opf_gemm_out_spec(&wq, &xq, OPF_GEMM_TN, OPF_BF16, &s));
    CHECK(s.ndim == 3 && s.shape[1] == 16 && s.shape[2] == 96 && s.scaling == OPF_SCALING_NONE,
          "quantized fprop out spec must be plain [2,16,96]");

    /* a 3D D from the out spec works in opf_gemm */
    opf_ctx *ctx = new_ctx(0);
    float wv[96 * 64], xv[16 * 64];
    unsigned long long seed = 5;
    fill_uniform(wv, 96 * 64, &seed, -1, 1);
    fill_uniform(xv, 16 * 64, &seed, -1, 1);
    opf_tensor wt = plain_tensor(ctx, 96, 64, OPF_F32, wv);
    opf_tensor xt = plain_tensor(ctx, 16, 64, OPF_F32, xv);
    xt.spec = opf_spec_make(3, (int64_t[]){2, 8, 64}, OPF_F32);
    CHECK_OK(ctx, opf_gemm_out_spec(&wt.spec, &xt.spec, OPF_GEMM_TN, OPF_F32, &s));
    opf_tensor d;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &d));
    opf_gemm_options o = opf_gemm_options_default();
    CHECK_OK(ctx, opf_gemm(ctx, &wt, &xt, OPF_GEMM_TN, &o, &d));
    double ref = 0;
    for (int k = 0; k < 64; k++) ref += (double)xv[5 * 64 + k] * wv[7 * 64 + k];
    CHECK(fabs(((float *)d.data[OPF_COMP_DATA])[5 * 96 + 7] - ref) < 1e-4, "3D fprop value");
    opf_tensor_release(&wt), opf_tensor_release(&xt), opf_tensor_release(&d);
    opf_ctx_destroy(ctx);
}

int main(void)
{
    opf_ctx *ctx = new_ctx(0);
    test_formats(ctx);
    test_nvfp4_rht(ctx);
    test_epilogue(ctx);
    test_empty_k(ctx);
    test_fp8_output(ctx);
    test_exact_alpha(ctx);
    test_exact_epilogue(ctx);
    test_block_exact(ctx);
    test_mxfp8_exact(ctx);
    test_block_random(ctx);
    test_linear(ctx);
    opf_ctx_destroy(ctx);
    test_determinism();
    test_out_spec();
    TEST_DONE();
}
