/* test_cuda_fused.c: the fused entries with a plain or quantized output
 * (backend/qout.h: norm.h's layernorm_fwd_q / rmsnorm_fwd_q, act.h's
 * fwd_q / bwd_q / dact_dbias_q) on the GPU against the CPU's entries, byte
 * for byte: every component of the output (data, scales, amax, the
 * columnwise copy), mu / rsigma and dbias. Each case runs twice on the GPU:
 * fused, and with OPF_CUDA_UNFUSED=1 (the composition), so a failing
 * fused kernel shows beside a passing fallback. Formats: plain f32 / bf16,
 * FP8 current scaling (e4m3, both copies; e5m2 rowwise), MXFP8, FP8 block
 * 1x128 and NVFP4; op dtypes f32 and bf16 (the hp the value is rounded to);
 * odd shapes (H = 1, 8, 33, 100, 4096; rows 1, 7, 128, 333) where the
 * format allows them. No inf / NaN in the data (their bits are each
 * device's own). Every failing case is printed with its parameters. */
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

#include "cuda_test.h"

typedef struct fmt_case {
    const char *name;
    opf_scaling scaling;
    opf_dtype   qdtype;
    unsigned    usage;
} fmt_case;

static const fmt_case fmts[] = {
    {"plain", OPF_SCALING_NONE, OPF_E4M3, 0},
    {"fp8-current-e4m3", OPF_SCALING_TENSOR, OPF_E4M3, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE},
    {"fp8-current-e5m2-row", OPF_SCALING_TENSOR, OPF_E5M2, OPF_USAGE_ROWWISE},
    {"mxfp8", OPF_SCALING_MXFP8, OPF_E4M3, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE},
    {"block-1x128", OPF_SCALING_BLOCK_1D, OPF_E4M3, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE},
    {"nvfp4", OPF_SCALING_NVFP4_1D, OPF_E2M1, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE},
};
static const opf_dtype dtypes[] = {OPF_F32, OPF_BF16};
static const int64_t shapes[][2] = {{1, 1}, {7, 8}, {128, 33}, {333, 100}, {128, 4096}, {32, 256}};

enum { N_FMT = sizeof fmts / sizeof fmts[0] };

static int failures;

/* A host tensor and its device twin of one spec. */
typedef struct pair {
    opf_tensor h, d;
} pair;

static void pair_alloc(opf_ctx *ctx, const opf_spec *s, pair *p)
{
    CHECK_OK(ctx, opf_tensor_alloc(ctx, s, &p->h));
    CHECK_OK(ctx, cuda_test_alloc(ctx, s, &p->d));
}

static void pair_from(opf_ctx *ctx, const opf_spec *s, const float *v, pair *p)
{
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, s, v, &p->h));
    CHECK_OK(ctx, cuda_test_upload(ctx, &p->h, &p->d));
}

static void pair_free(pair *p)
{
    opf_tensor_release(&p->h);
    opf_tensor_release(&p->d);
}

/* Downloads p.d and compares it with p.h; prints the case on a mismatch. */
static void compare(opf_ctx *ctx, const pair *p, const char *what, const char *label)
{
    opf_tensor got;
    CHECK_OK(ctx, cuda_test_download(ctx, &p->d, &got));
    bool same = cuda_test_same_bytes(&p->h, &got, what);
    CHECK(same, "%s: %s differs from the CPU", label, what);
    failures += !same;
    opf_tensor_release(&got);
}

/* The quantizer of fmt (NONE for plain), its output spec for plain spec
 * `plain`; false when the format cannot take the shape. */
static bool out_spec(const fmt_case *f, const opf_spec *plain, opf_quantizer *q, opf_spec *s)
{
    *q = opf_quantizer_default();
    q->scaling = f->scaling;
    q->qdtype = f->qdtype;
    if (f->scaling == OPF_SCALING_NONE) {
        *s = *plain;
        return true;
    }
    q->usage = f->usage;
    return opf_quantizer_spec(q, plain, s) == OPF_OK;
}

/* Values over six decades with zeros, -0 and subnormals; no huge values
 * (3e38 overflows x * x in a norm and the activations' gradients, and the
 * NaN that follows has each device's own bits). */
static void fill(float *v, int64_t n, float scale)
{
    static const float edge[] = {0.0f, -0.0f, 1e-40f, -1.4e-45f, 1e-30f};
    cuda_test_fill(v, n, scale, 0, false);
    for (int64_t i = 0; i < n; i++)
        if (cuda_test_u32() % 17 == 0) v[i] = edge[cuda_test_u32() % 5];
}

/* ---- norms --------------------------------------------------------------- */

static void norm_case(opf_ctx *ctx, bool ln, const fmt_case *f, opf_dtype dt, int64_t rows,
                      int64_t H, bool fused)
{
    char label[160];
    snprintf(label, sizeof label, "%s_fwd_q %s dtype %s rows %lld H %lld (%s)",
             ln ? "layernorm" : "rmsnorm", f->name, opf_dtype_name(dt), (long long)rows,
             (long long)H, fused ? "fused" : "OPF_CUDA_UNFUSED=1");
    opf_spec xs = opf_spec_make(2, (int64_t[]){rows, H}, dt), gs = opf_spec_make(1, &H, dt);
    opf_spec rs = opf_spec_make(1, &rows, OPF_F32), zs;
    opf_quantizer q;
    if (!out_spec(f, &xs, &q, &zs)) return;
    float *v = malloc((size_t)(rows * H + 2 * H) * sizeof *v);
    fill(v, rows * H, 4.0f);
    for (int64_t j = 0; j < 2 * H; j++) v[rows * H + j] = 1.0f + 0.5f * cuda_test_unit();
    pair x, g, b, z, mu, rsig;
    pair_from(ctx, &xs, v, &x);
    pair_from(ctx, &gs, v + rows * H, &g);
    pair_from(ctx, &gs, v + rows * H + H, &b);
    pair_alloc(ctx, &zs, &z);
    pair_alloc(ctx, &rs, &mu);
    pair_alloc(ctx, &rs, &rsig);
    bool plain = f->scaling == OPF_SCALING_NONE;
    opf_qout oh = {&z.h, plain ? NULL : &q, NULL, dt}, od = {&z.d, plain ? NULL : &q, NULL, dt};
    const opf_norm_kernels *C = cuda_test_table(OPF_DEVICE_CPU)->norm;
    const opf_norm_kernels *G = cuda_test_table(OPF_DEVICE_CUDA)->norm;
    if (ln) {
        CHECK_OK(ctx, C->layernorm_fwd_q(ctx, &x.h, &g.h, &b.h, 1e-5f, false, &oh, &mu.h, &rsig.h));
        CHECK_OK(ctx, G->layernorm_fwd_q(ctx, &x.d, &g.d, &b.d, 1e-5f, false, &od, &mu.d, &rsig.d));
        compare(ctx, &mu, "mu", label);
    } else {
        CHECK_OK(ctx, C->rmsnorm_fwd_q(ctx, &x.h, &g.h, 1e-5f, true, &oh, &rsig.h));
        CHECK_OK(ctx, G->rmsnorm_fwd_q(ctx, &x.d, &g.d, 1e-5f, true, &od, &rsig.d));
    }
    compare(ctx, &z, "z", label);
    compare(ctx, &rsig, "rsigma", label);
    pair *ps[] = {&x, &g, &b, &z, &mu, &rsig};
    for (int i = 0; i < 6; i++) pair_free(ps[i]);
    free(v);
}

/* ---- activations --------------------------------------------------------- */

static const opf_act_kind kinds[] = {OPF_ACT_GELU, OPF_ACT_RELU, OPF_ACT_QGELU, OPF_ACT_SRELU,
                                     OPF_ACT_SILU, OPF_ACT_SWIGLU};
static const char *const kind_names[] = {"gelu", "relu", "qgelu", "srelu", "silu", "swiglu"};

/* pass 0 fwd_q, 1 bwd_q, 2 dact_dbias_q (plain kinds). */
static void act_case(opf_ctx *ctx, int ki, int pass, const fmt_case *f, opf_dtype dt,
                     int64_t rows, int64_t cols, bool fused)
{
    static const char *const pass_names[] = {"fwd_q", "bwd_q", "dact_dbias_q"};
    opf_act_kind k = kinds[ki];
    bool glu = opf_act_is_glu(k);
    if ((pass == 2 && glu) || (glu && cols % 2)) return;
    char label[160];
    snprintf(label, sizeof label, "act %s %s %s dtype %s rows %lld cols %lld (%s)",
             kind_names[ki], pass_names[pass], f->name, opf_dtype_name(dt), (long long)rows,
             (long long)cols, fused ? "fused" : "OPF_CUDA_UNFUSED=1");
    int64_t oc = pass == 0 && glu ? cols / 2 : cols;
    opf_spec xs = opf_spec_make(2, (int64_t[]){rows, cols}, dt);
    opf_spec ys = opf_spec_make(2, (int64_t[]){rows, oc}, dt), dys = ys, os;
    opf_spec bs = opf_spec_make(1, &cols, OPF_F32);
    if (pass) dys = opf_spec_make(2, (int64_t[]){rows, glu ? cols / 2 : cols}, dt);
    opf_quantizer q;
    if (!out_spec(f, pass ? &xs : &ys, &q, &os)) return;
    int64_t n = rows * cols;
    float *v = malloc((size_t)(2 * n + 1) * sizeof *v);
    fill(v, 2 * n, 3.0f);
    pair x, dy, out, db;
    pair_from(ctx, &xs, v, &x);
    pair_from(ctx, &dys, v + n, &dy);
    pair_alloc(ctx, &os, &out);
    pair_alloc(ctx, &bs, &db);
    bool plain = f->scaling == OPF_SCALING_NONE;
    opf_qout oh = {&out.h, plain ? NULL : &q, NULL, dt}, od = {&out.d, plain ? NULL : &q, NULL, dt};
    const opf_act_kernels *C = cuda_test_table(OPF_DEVICE_CPU)->act;
    const opf_act_kernels *G = cuda_test_table(OPF_DEVICE_CUDA)->act;
    opf_act_params p = {k == OPF_ACT_QGELU ? 1.702f : 1.0f, 0.0f};
    if (pass == 0) {
        CHECK_OK(ctx, C->fwd_q(ctx, k, p, &x.h, &oh));
        CHECK_OK(ctx, G->fwd_q(ctx, k, p, &x.d, &od));
    } else if (pass == 1) {
        CHECK_OK(ctx, C->bwd_q(ctx, k, p, &x.h, &dy.h, &oh));
        CHECK_OK(ctx, G->bwd_q(ctx, k, p, &x.d, &dy.d, &od));
    } else {
        CHECK_OK(ctx, C->dact_dbias_q(ctx, k, p, &x.h, &dy.h, &oh, db.h.data[0]));
        CHECK_OK(ctx, G->dact_dbias_q(ctx, k, p, &x.d, &dy.d, &od, db.d.data[0]));
        compare(ctx, &db, "dbias", label);
    }
    compare(ctx, &out, pass ? "dx" : "y", label);
    pair *ps[] = {&x, &dy, &out, &db};
    for (int i = 0; i < 4; i++) pair_free(ps[i]);
    free(v);
}

static void run_all(opf_ctx *ctx, bool fused)
{
    if (fused) unsetenv("OPF_CUDA_UNFUSED");
    else setenv("OPF_CUDA_UNFUSED", "1", 1);
    for (int fi = 0; fi < N_FMT; fi++)
        for (int di = 0; di < 2; di++)
            for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
                int64_t r = shapes[si][0], c = shapes[si][1];
                norm_case(ctx, true, &fmts[fi], dtypes[di], r, c, fused);
                norm_case(ctx, false, &fmts[fi], dtypes[di], r, c, fused);
                for (int ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
                    for (int pass = 0; pass < 3; pass++)
                        act_case(ctx, ki, pass, &fmts[fi], dtypes[di], r, c, fused);
            }
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    run_all(ctx, true);
    int fused_failures = failures;
    run_all(ctx, false);
    printf("failing cases: %d fused, %d composed (OPF_CUDA_UNFUSED=1)\n", fused_failures,
           failures - fused_failures);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
