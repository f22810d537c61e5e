/* test_cuda_elem.c: the GPU element-wise kernels (backend/elem.h) against
 * the CPU reference, byte for byte: bias_add, dbias, dbias_q (FP8 current
 * and delayed), scale, add (every dtype
 * mix, out aliasing a), dropout forward and backward, cast (NaN payloads),
 * cast+transpose, fill, fill_uniform and copy, on odd shapes, with edge
 * values, and on views that are not 16-byte aligned (the element path). */
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

#include "cuda_cmp.h"

static const opf_dtype D[] = {OPF_F32, OPF_BF16, OPF_F16};
enum { ND = 3 };
/* Rows and columns that fill the 8-element chunks and tiles, cut them, and
 * leave the vector path; one 3D. */
static const struct { int nd; int64_t s[3]; } shapes[] = {
    {2, {1, 1}},     {2, {3, 5}},     {2, {7, 33}},     {2, {64, 128}}, {2, {77, 300}},
    {2, {1, 8192}},  {2, {129, 1000}}, {2, {256, 8}},   {2, {1000, 1}}, {3, {2, 3, 40}},
    {2, {8, 2048}},  {2, {2048, 8}},  {2, {65, 64}},
};
enum { N_SHAPES = sizeof shapes / sizeof shapes[0] };

static const opf_elem_kernels *cpu(void) { return opf_backend_get(OPF_DEVICE_CPU)->elem; }
static const opf_elem_kernels *gpu(void) { return opf_backend_get(OPF_DEVICE_CUDA)->elem; }
static const char *dn(opf_dtype d) { return opf_dtype_name(d); }

static int64_t shape_numel(int si)
{
    int64_t n = 1;
    for (int i = 0; i < shapes[si].nd; i++) n *= shapes[si].s[i];
    return n;
}

/* Random values with edges for n elements (the caller frees). */
static float *values(int64_t n, float scale, cmp_edges e)
{
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    cmp_fill(x, n, scale, e);
    return x;
}

static cmp_pair pair(opf_ctx *ctx, int si, opf_dtype dt, const float *vals)
{
    return cmp_pair_of(ctx, shapes[si].nd, shapes[si].s, dt, vals);
}

/* The same pair seen one element further on, as [n - 1] (both sides
 * misaligned for 16-byte accesses). */
static cmp_pair shifted(const cmp_pair *p)
{
    cmp_pair v = *p;
    int64_t n = opf_spec_numel(&p->h.spec) - 1;
    size_t es = opf_dtype_nbytes(p->h.spec.dtype, 1);
    v.h.spec = v.d.spec = opf_spec_make(1, &n, p->h.spec.dtype);
    v.d.spec.device = OPF_DEVICE_CUDA;
    v.h.data[OPF_COMP_DATA] = (char *)p->h.data[OPF_COMP_DATA] + es;
    v.d.data[OPF_COMP_DATA] = (char *)p->d.data[OPF_COMP_DATA] + es;
    return v;
}

/* ---- bias, dbias ----------------------------------------------------------- */

static void test_bias_add(opf_ctx *ctx)
{
    for (int si = 0; si < N_SHAPES; si++) {
        int64_t n = shapes[si].s[shapes[si].nd - 1], total = shape_numel(si);
        float *xv = values(total, 10.0f, EDGES_INF), *bv = values(n, 1.0f, EDGES_INF);
        for (int a = 0; a < ND; a++)
            for (int b = 0; b < ND; b++)
                for (int c = 0; c < ND; c++) {
                    cmp_pair x = pair(ctx, si, D[a], xv), y = pair(ctx, si, D[c], NULL);
                    cmp_pair bias = cmp_pair_of(ctx, 1, &n, D[b], bv);
                    CHECK_OK(ctx, cpu()->bias_add(ctx, &x.h, &bias.h, &y.h));
                    CHECK_OK(ctx, gpu()->bias_add(ctx, &x.d, &bias.d, &y.d));
                    char what[96];
                    snprintf(what, sizeof what, "bias_add shape %d x %s + %s -> %s", si, dn(D[a]),
                             dn(D[b]), dn(D[c]));
                    cmp_tensor(ctx, &y.h, &y.d, what);
                    cmp_pair_release(&x), cmp_pair_release(&y), cmp_pair_release(&bias);
                }
        free(xv), free(bv);
    }
}

/* dbias on its own shapes: long columns (many rows a lane), one column, a
 * single row, rows of whole 16-byte chunks over several stages of
 * colsum.cuh's staged kernel (3001 x 136), and very wide rows of few
 * (staged and not). Finite values and the quiet NaN. Columns of at most
 * 512 rows run colsum.cuh's one-kernel path, and its two-kernel path
 * under OPF_CUDA_COLSUM_WHOLE=0 (the second pass). */
static void test_dbias_pass(opf_ctx *ctx);
static void test_dbias(opf_ctx *ctx)
{
    test_dbias_pass(ctx);
    setenv("OPF_CUDA_COLSUM_WHOLE", "0", 1);
    test_dbias_pass(ctx);
    unsetenv("OPF_CUDA_COLSUM_WHOLE");
}

static void test_dbias_pass(opf_ctx *ctx)
{
    static const int64_t dims[][2] = {{1, 1},   {300, 1},  {513, 33}, {1000, 1024},
                                      {4096, 72}, {7, 4097}, {1, 100}, {0, 5},
                                      {3001, 136}, {3, 600000}, {2, 300001}};
    for (size_t k = 0; k < sizeof dims / sizeof dims[0]; k++)
        for (int e = EDGES_FINITE; e <= EDGES_NAN; e++) {
            float *v = values(dims[k][0] * dims[k][1], 3.0f, (cmp_edges)e);
            for (int a = 0; a < ND; a++)
                for (int b = 0; b < ND; b++) {
                    cmp_pair dy = cmp_pair_of(ctx, 2, dims[k], D[a], v);
                    cmp_pair db = cmp_pair_of(ctx, 1, &dims[k][1], D[b], NULL);
                    CHECK_OK(ctx, cpu()->dbias(ctx, &dy.h, &db.h));
                    CHECK_OK(ctx, gpu()->dbias(ctx, &dy.d, &db.d));
                    char what[96];
                    snprintf(what, sizeof what, "dbias %lld x %lld %s -> %s (edges %d%s)",
                             (long long)dims[k][0], (long long)dims[k][1], dn(D[a]), dn(D[b]), e,
                             getenv("OPF_CUDA_COLSUM_WHOLE") ? ", two kernels" : "");
                    cmp_tensor(ctx, &db.h, &db.d, what);
                    cmp_pair_release(&dy), cmp_pair_release(&db);
                }
            free(v);
        }
}

/* dbias_q of dy [rows, cols] into FP8 per-tensor e4m3 (rowwise and
 * columnwise, as a BasicLinear's grad-output quantizer makes it), current
 * scaling (hp = dy's dtype: the fused column sum + amax, then the cast) or
 * delayed (hp f32: the composition, the state on each device updating its
 * own history), against the CPU's entry byte for byte: every component of
 * dx, db, and the delayed history after the update. Finite values (a NaN's
 * amax is each device's own). */
static void dbias_q_case(opf_ctx *ctx, opf_ctx *cpu_ctx, const int64_t dims[2], opf_dtype dt,
                         bool delayed, bool unfused)
{
    char what[160];
    snprintf(what, sizeof what, "dbias_q %s %lld x %lld %s%s", delayed ? "delayed" : "current",
             (long long)dims[0], (long long)dims[1], dn(dt), unfused ? " (OPF_CUDA_UNFUSED=1)" : "");
    opf_delayed_state *sc = NULL, *sg = NULL;
    opf_quantizer qc = opf_quantizer_default();
    qc.scaling = OPF_SCALING_TENSOR, qc.qdtype = OPF_E4M3;
    qc.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    opf_quantizer qg = qc;
    if (delayed) {
        CHECK_OK(cpu_ctx, opf_delayed_state_create(cpu_ctx, OPF_FORMAT_HYBRID, 0.0f, 4, OPF_AMAX_MAX,
                                                   true, 1, &sc));
        CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, 4, OPF_AMAX_MAX, true,
                                               1, &sg));
        qc.delayed = sc, qg.delayed = sg;
        qc.qdtype = qg.qdtype = opf_delayed_state_dtype(sc);  /* hybrid: gradients in e5m2 */
    }
    int64_t n = dims[0] * dims[1];
    float *v = values(n, 3.0f, EDGES_FINITE);
    opf_spec ys = opf_spec_make(2, dims, dt), qs_spec;
    CHECK_OK(ctx, opf_quantizer_spec(&qc, &ys, &qs_spec));
    cmp_pair dy = cmp_pair_of(ctx, 2, dims, dt, v), db = cmp_pair_of(ctx, 1, &dims[1], OPF_F32, NULL);
    opf_tensor hq, dq, got;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &qs_spec, &hq));
    CHECK_OK(ctx, cuda_test_alloc(ctx, &qs_spec, &dq));
    opf_quantize_state sth = {0}, std_ = {0};
    opf_quantize_state_delayed(&qc, &sth);
    opf_quantize_state_delayed(&qg, &std_);
    opf_dtype hp = delayed ? OPF_F32 : dt;
    opf_qout oh = {&hq, &qc, &sth, hp}, od = {&dq, &qg, &std_, hp};
    if (unfused) setenv("OPF_CUDA_UNFUSED", "1", 1);
    CHECK_OK(ctx, cpu()->dbias_q(ctx, &dy.h, &db.h, &oh));
    CHECK_OK(ctx, gpu()->dbias_q(ctx, &dy.d, &db.d, &od));
    if (unfused) unsetenv("OPF_CUDA_UNFUSED");
    CHECK_OK(ctx, cuda_test_download(ctx, &dq, &got));
    CHECK(cuda_test_same_bytes(&hq, &got, what), "%s: dx differs from the CPU's", what);
    cmp_tensor(ctx, &db.h, &db.d, what);
    if (delayed) {
        float scale, hist[4];
        CHECK_OK(cpu_ctx, opf_delayed_state_update(cpu_ctx, sc, NULL, NULL));
        CHECK_OK(ctx, opf_delayed_state_update(ctx, sg, NULL, NULL));
        CHECK_OK(ctx, opf_delayed_state_read(ctx, sg, &scale, hist));
        CHECK(!memcmp(opf_delayed_state_history(sc), hist, sizeof hist) &&
                  !memcmp(opf_delayed_state_scale(sc), &scale, sizeof scale),
              "%s: the delayed state differs from the CPU's", what);
    }
    cmp_pair_release(&dy), cmp_pair_release(&db);
    opf_tensor_release(&hq), opf_tensor_release(&dq), opf_tensor_release(&got);
    opf_delayed_state_destroy(sc), opf_delayed_state_destroy(sg);
    free(v);
}

/* Rows not a multiple of 32, one column, the staged kernel's rows of whole
 * 16-byte chunks (3001 x 136, 1000 x 1024), wide rows of few (staged and
 * not), no rows; f32 and bf16 dy (and f16 once). */
static void test_dbias_q(opf_ctx *ctx)
{
    static const int64_t dims[][2] = {{1, 1},     {300, 1},  {513, 33},    {1000, 1024}, {7, 4097},
                                      {3001, 136}, {0, 5},    {3, 600000}, {2, 300001},  {77, 768}};
    opf_ctx *cpu_ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &cpu_ctx));
    for (size_t k = 0; k < sizeof dims / sizeof dims[0]; k++)
        for (int a = 0; a < 2; a++)
            for (int d = 0; d < 2; d++) dbias_q_case(ctx, cpu_ctx, dims[k], D[a], d == 1, false);
    dbias_q_case(ctx, cpu_ctx, dims[2], OPF_F16, false, false);
    dbias_q_case(ctx, cpu_ctx, dims[3], OPF_BF16, false, true);
    opf_ctx_destroy(cpu_ctx);
}

/* ---- scale, add ------------------------------------------------------------------ */

static void test_scale(opf_ctx *ctx)
{
    static const float s[] = {0.5f, -3.0f, 0.0f, 1e30f, INFINITY};
    for (int si = 0; si < N_SHAPES; si++) {
        float *xv = values(shape_numel(si), 10.0f, EDGES_INF);
        for (int a = 0; a < ND; a++)
            for (int c = 0; c < ND; c++)
                for (size_t k = 0; k < sizeof s / sizeof s[0]; k++) {
                    cmp_pair x = pair(ctx, si, D[a], xv), y = pair(ctx, si, D[c], NULL);
                    CHECK_OK(ctx, cpu()->scale(ctx, &x.h, s[k], &y.h));
                    CHECK_OK(ctx, gpu()->scale(ctx, &x.d, s[k], &y.d));
                    char what[96];
                    snprintf(what, sizeof what, "scale shape %d %g * %s -> %s", si, (double)s[k],
                             dn(D[a]), dn(D[c]));
                    cmp_tensor(ctx, &y.h, &y.d, what);
                    cmp_pair_release(&x), cmp_pair_release(&y);
                }
        free(xv);
    }
}

/* out = a + b on both devices; shift: every operand one element on. */
static void add_case(opf_ctx *ctx, int si, opf_dtype da, opf_dtype db, opf_dtype dout,
                     const float *av, const float *bv, bool alias, bool shift)
{
    cmp_pair a = pair(ctx, si, da, av), b = pair(ctx, si, db, bv), o = pair(ctx, si, dout, NULL);
    cmp_pair va = shift ? shifted(&a) : a, vb = shift ? shifted(&b) : b, vo = shift ? shifted(&o) : o;
    cmp_pair *out = alias ? &va : &vo;
    CHECK_OK(ctx, cpu()->add(ctx, &va.h, &vb.h, &out->h));
    CHECK_OK(ctx, gpu()->add(ctx, &va.d, &vb.d, &out->d));
    char what[112];
    snprintf(what, sizeof what, "add shape %d %s + %s -> %s%s%s", si, dn(da), dn(db), dn(dout),
             alias ? " (into a)" : "", shift ? " (misaligned)" : "");
    cmp_tensor(ctx, &out->h, &out->d, what);
    cmp_pair_release(&a), cmp_pair_release(&b), cmp_pair_release(&o);
}

static void test_add(opf_ctx *ctx)
{
    for (int si = 0; si < N_SHAPES; si++) {
        int64_t n = shape_numel(si);
        float *av = values(n, 10.0f, EDGES_INF), *bv = values(n, 10.0f, EDGES_INF);
        for (int a = 0; a < ND; a++)
            for (int b = 0; b < ND; b++) {
                for (int c = 0; c < ND; c++) add_case(ctx, si, D[a], D[b], D[c], av, bv, false, false);
                add_case(ctx, si, D[a], D[b], D[a], av, bv, true, false);
                if (n > 1) add_case(ctx, si, D[a], D[b], D[b], av, bv, false, true);
            }
        free(av), free(bv);
    }
}

/* ---- dropout ------------------------------------------------------------------- */

static void dropout_case(opf_ctx *ctx, int si, opf_dtype dx, opf_dtype dy, double p, uint64_t offset,
                         bool shift)
{
    int64_t n = shape_numel(si);
    float *xv = values(n, 10.0f, EDGES_INF), *gv = values(n, 10.0f, EDGES_INF);
    cmp_pair x = pair(ctx, si, dx, xv), y = pair(ctx, si, dy, NULL), m = pair(ctx, si, OPF_U8, NULL);
    cmp_pair g = pair(ctx, si, dy, gv), gx = pair(ctx, si, dx, NULL);
    cmp_pair vx = x, vy = y, vm = m, vg = g, vgx = gx;
    if (shift) vx = shifted(&x), vy = shifted(&y), vm = shifted(&m), vg = shifted(&g), vgx = shifted(&gx);
    const uint64_t seed = 0x0123456789ABCDEFull;
    CHECK_OK(ctx, cpu()->dropout_fwd(ctx, &vx.h, p, seed, offset, &vy.h, &vm.h));
    CHECK_OK(ctx, gpu()->dropout_fwd(ctx, &vx.d, p, seed, offset, &vy.d, &vm.d));
    char what[128];
    int k = snprintf(what, sizeof what, "dropout shape %d %s -> %s p %g offset %llu%s", si, dn(dx),
                     dn(dy), p, (unsigned long long)offset, shift ? " (misaligned)" : "");
    snprintf(what + k, sizeof what - (size_t)k, " y");
    cmp_tensor(ctx, &vy.h, &vy.d, what);
    snprintf(what + k, sizeof what - (size_t)k, " mask");
    if (cmp_tensor(ctx, &vm.h, &vm.d, what)) {  /* the backward from the same mask */
        CHECK_OK(ctx, cpu()->dropout_bwd(ctx, &vg.h, &vm.h, p, &vgx.h));
        CHECK_OK(ctx, gpu()->dropout_bwd(ctx, &vg.d, &vm.d, p, &vgx.d));
        snprintf(what + k, sizeof what - (size_t)k, " dx");
        cmp_tensor(ctx, &vgx.h, &vgx.d, what);
    }
    cmp_pair_release(&x), cmp_pair_release(&y), cmp_pair_release(&m);
    cmp_pair_release(&g), cmp_pair_release(&gx);
    free(xv), free(gv);
}

static void test_dropout(opf_ctx *ctx)
{
    static const double ps[] = {0.0, 0.1, 0.5, 0.999};
    static const uint64_t offsets[] = {0, 3, 0x1FFFFFFF0ull};
    for (int si = 0; si < N_SHAPES; si++)
        for (int a = 0; a < ND; a++)
            for (int c = 0; c < ND; c++)
                for (int k = 0; k < 4; k++) {
                    dropout_case(ctx, si, D[a], D[c], ps[k], offsets[k % 3], false);
                    if (shape_numel(si) > 1 && k == 1) dropout_case(ctx, si, D[a], D[c], ps[k], 5, true);
                }
}

/* ---- cast, cast+transpose -------------------------------------------------------- */

/* Stored codes the codecs treat specially: NaN payloads (signalling,
 * negative), infinities, subnormals, overflow and rounding ties. */
static void poke_codes(opf_tensor *t)
{
    static const uint32_t f32[] = {0x7F800001u, 0xFFC00001u, 0x7FBFFFFFu, 0xFF800000u, 0x00000001u,
                                   0x80000001u, 0x7F7FFFFFu, 0x477FF000u, 0x477FEFFFu, 0x3F808000u,
                                   0x3F818000u, 0x33000001u, 0x387FE000u};
    static const uint16_t bf16[] = {0x7F81u, 0xFFC1u, 0xFF80u, 0x0001u, 0x8001u, 0x7F7Fu, 0x477Fu};
    static const uint16_t f16[] = {0x7C01u, 0xFE00u, 0x7DFFu, 0xFC00u, 0x0001u, 0x83FFu, 0x7BFFu};
    int64_t n = opf_spec_numel(&t->spec);
    void *p = t->data[OPF_COMP_DATA];
    for (int64_t i = 0, k = 0; i < n; i += 3, k++) {
        if (t->spec.dtype == OPF_F32) ((uint32_t *)p)[i] = f32[k % (sizeof f32 / 4)];
        else if (t->spec.dtype == OPF_BF16) ((uint16_t *)p)[i] = bf16[k % (sizeof bf16 / 2)];
        else ((uint16_t *)p)[i] = f16[k % (sizeof f16 / 2)];
    }
}

static void test_cast(opf_ctx *ctx)
{
    for (int si = 0; si < N_SHAPES; si++) {
        float *xv = values(shape_numel(si), 100.0f, EDGES_INF);
        for (int a = 0; a < ND; a++)
            for (int c = 0; c < ND; c++) {
                cmp_pair x = pair(ctx, si, D[a], xv), y = pair(ctx, si, D[c], NULL);
                poke_codes(&x.h);
                CHECK_OK(ctx, opf_tensor_copy(ctx, &x.h, &x.d));
                CHECK_OK(ctx, cpu()->cast(ctx, &x.h, &y.h));
                CHECK_OK(ctx, gpu()->cast(ctx, &x.d, &y.d));
                char what[96];
                snprintf(what, sizeof what, "cast shape %d %s -> %s", si, dn(D[a]), dn(D[c]));
                cmp_tensor(ctx, &y.h, &y.d, what);
                cmp_pair_release(&x), cmp_pair_release(&y);
            }
        free(xv);
    }
}

/* y_mode: 0 no y, 1 y in y_t's dtype (written by the transpose), 2 y in
 * another dtype (a cast of its own); shift: x one element on. */
static void cast_transpose_case(opf_ctx *ctx, int si, opf_dtype dx, opf_dtype dt, int y_mode,
                                bool shift, const float *xv)
{
    int64_t C = shapes[si].s[shapes[si].nd - 1], R = shape_numel(si) / C;
    int64_t xs[2] = {R * C + 1, 1}, ts[2] = {C, R}, ys[2] = {R, C};
    cmp_pair xb = cmp_pair_of(ctx, 2, xs, dx, xv), x = xb;
    poke_codes(&xb.h);
    CHECK_OK(ctx, opf_tensor_copy(ctx, &xb.h, &xb.d));
    if (shift) x = shifted(&xb);
    x.h.spec = opf_spec_make(2, ys, dx);  /* [R, C] from element 0 or 1 */
    x.d.spec = x.h.spec;
    x.d.spec.device = OPF_DEVICE_CUDA;
    opf_dtype dy = y_mode == 2 ? (dt == OPF_F32 ? OPF_BF16 : OPF_F32) : dt;
    cmp_pair t = cmp_pair_of(ctx, 2, ts, dt, NULL), y = cmp_pair_of(ctx, 2, ys, dy, NULL);
    CHECK_OK(ctx, cpu()->cast_transpose(ctx, &x.h, y_mode ? &y.h : NULL, &t.h));
    CHECK_OK(ctx, gpu()->cast_transpose(ctx, &x.d, y_mode ? &y.d : NULL, &t.d));
    char what[128];
    int k = snprintf(what, sizeof what, "cast_transpose %lld x %lld %s -> %s y %d%s", (long long)R,
                     (long long)C, dn(dx), dn(dt), y_mode, shift ? " (misaligned)" : "");
    snprintf(what + k, sizeof what - (size_t)k, " y_t");
    cmp_tensor(ctx, &t.h, &t.d, what);
    snprintf(what + k, sizeof what - (size_t)k, " y");
    if (y_mode) cmp_tensor(ctx, &y.h, &y.d, what);
    cmp_pair_release(&xb), cmp_pair_release(&t), cmp_pair_release(&y);
}

static void test_cast_transpose(opf_ctx *ctx)
{
    for (int si = 0; si < N_SHAPES; si++) {
        float *xv = values(shape_numel(si) + 1, 100.0f, EDGES_INF);
        for (int a = 0; a < ND; a++)
            for (int c = 0; c < ND; c++)
                for (int ym = 0; ym < 3; ym++) cast_transpose_case(ctx, si, D[a], D[c], ym, false, xv);
        for (int a = 0; a < ND; a++) cast_transpose_case(ctx, si, D[a], OPF_BF16, 1, true, xv);
        free(xv);
    }
}

/* ---- fill, fill_uniform, copy ------------------------------------------------------ */

static void test_fill(opf_ctx *ctx)
{
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16, OPF_F16, OPF_U8, OPF_I32, OPF_I64};
    static const double vals[] = {0.0, -0.0, 1.5, -3.75, 1e-40, 70000.0, 200.0, -7.9, 1.00390625};
    for (int si = 0; si < N_SHAPES; si++)
        for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++)
            for (size_t k = 0; k < sizeof vals / sizeof vals[0]; k++) {
                if (dts[d] == OPF_U8 && vals[k] < 0) continue;  /* out of u8's range: undefined */
                cmp_pair t = pair(ctx, si, dts[d], NULL);
                CHECK_OK(ctx, opf_cuda_memset(ctx, t.d.data[OPF_COMP_DATA], 0xA5,
                                              opf_dtype_nbytes(dts[d], (size_t)shape_numel(si))));
                CHECK_OK(ctx, cpu()->fill(ctx, vals[k], &t.h));
                CHECK_OK(ctx, gpu()->fill(ctx, vals[k], &t.d));
                char what[96];
                snprintf(what, sizeof what, "fill shape %d %s %g", si, dn(dts[d]), vals[k]);
                cmp_tensor(ctx, &t.h, &t.d, what);
                cmp_pair_release(&t);
            }
}

static void test_fill_uniform(opf_ctx *ctx)
{
    static const double bounds[] = {0.02, 1.0, 3e38};
    static const uint64_t offsets[] = {0, 5, 0x100000003ull};
    for (int si = 0; si < N_SHAPES; si++)
        for (int a = 0; a < ND; a++)
            for (int k = 0; k < 3; k++) {
                cmp_pair t = pair(ctx, si, D[a], NULL);
                uint32_t stream = (uint32_t)k * 7u;
                CHECK_OK(ctx, cpu()->fill_uniform(ctx, 42 + (uint64_t)si, offsets[k], stream, bounds[k], &t.h));
                CHECK_OK(ctx, gpu()->fill_uniform(ctx, 42 + (uint64_t)si, offsets[k], stream, bounds[k], &t.d));
                char what[96];
                snprintf(what, sizeof what, "fill_uniform shape %d %s bound %g", si, dn(D[a]), bounds[k]);
                cmp_tensor(ctx, &t.h, &t.d, what);
                cmp_pair_release(&t);
            }
}

static void test_copy(opf_ctx *ctx)
{
    static const size_t sizes[] = {0, 1, 17, 4096, 1000003};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        uint8_t *h = malloc(n + 8);
        for (size_t i = 0; i < n + 8; i++) h[i] = (uint8_t)cuda_test_u32();
        uint8_t *src = cmp_upload(ctx, h, n + 8), *dst = cmp_upload(ctx, h + 4, n + 8);
        CHECK_OK(ctx, gpu()->copy(ctx, src + 3, dst + 1, n));
        CHECK_OK(ctx, gpu()->copy(ctx, dst, dst, n));  /* equal: nothing to do */
        char what[64];
        snprintf(what, sizeof what, "copy %zu bytes", n);
        cmp_device(ctx, h + 3, dst + 1, (int64_t)n, 1, what);
        opf_cuda_free(ctx, src);
        opf_cuda_free(ctx, dst);
        free(h);
    }
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_bias_add(ctx);
    test_dbias(ctx);
    test_dbias_q(ctx);
    test_scale(ctx);
    test_add(ctx);
    test_dropout(ctx);
    test_cast(ctx);
    test_cast_transpose(ctx);
    test_fill(ctx);
    test_fill_uniform(ctx);
    test_copy(ctx);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
