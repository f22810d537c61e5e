/* test_cuda_norm.c: the GPU norm kernels (backend/norm.h) against the CPU
 * reference, byte for byte: LayerNorm, RMSNorm (with and without the
 * residual gradient of the add + RMSNorm backward) and L2 normalization,
 * forward (z, mu, rsigma / rnorm) and backward (dx, dgamma, dbeta), every
 * x / gamma dtype pair with outputs and gradients in every dtype, zero-
 * centred gamma or not, on shapes that cut the warps and the 8-element
 * vectors, rows from one to thousands (the dgamma fold), and rows too long
 * for the kernels' shared memory. Data: random values with an offset, with
 * zeros, -0, subnormals and large values; in half of the cases also rows
 * holding NaN, inf or a value whose square overflows, a zero row and a
 * constant row. NaN compares equal to NaN (each device's NaN bits are its
 * own); every other value must have the CPU's bits. Every mismatch is
 * printed (the first few of each tensor). The bf16 backward of at most 512
 * rows runs both of its paths (one launch, two). */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#define _POSIX_C_SOURCE 200809L  /* setenv, strdup */
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test.h"

enum { K_LN, K_RMS, K_L2 };
static const char *const KIND_NAMES[] = {"layernorm", "rmsnorm", "l2norm"};
static const opf_dtype DT[] = {OPF_F32, OPF_BF16, OPF_F16};

/* One tensor on both devices. */
typedef struct pair {
    opf_tensor h, d;
} pair;

static opf_spec spec_of(int nd, const int64_t *shape, opf_dtype dt)
{
    return opf_spec_make(nd, shape, dt);
}

/* An input: values in dtype on the host, the same bytes on the device. */
static void input(opf_ctx *ctx, opf_spec sp, const float *v, pair *p)
{
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, &sp, v, &p->h));
    CHECK_OK(ctx, cuda_test_upload(ctx, &p->h, &p->d));
}

/* An output on both devices. */
static void output(opf_ctx *ctx, opf_spec sp, pair *p)
{
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sp, &p->h));
    CHECK_OK(ctx, cuda_test_alloc(ctx, &sp, &p->d));
}

static void release(pair *p)
{
    opf_tensor_release(&p->h);
    opf_tensor_release(&p->d);
}

/* Element i of plain t (f32, bf16 or f16) as fp32, and its bits. */
static float value_at(const opf_tensor *t, int64_t i, uint32_t *bits)
{
    if (t->spec.dtype == OPF_F32) {
        float v = ((const float *)t->data[0])[i];
        memcpy(bits, &v, sizeof v);
        return v;
    }
    uint16_t h = ((const uint16_t *)t->data[0])[i];
    *bits = h;
    return t->spec.dtype == OPF_BF16 ? opf_bf16_to_f32(h) : opf_f16_to_f32(h);
}

/* The CPU's host tensor ref against the device tensor got: same bits, or
 * both NaN. Prints the first mismatches with row and column. */
static void compare(opf_ctx *ctx, const char *what, const char *name, const opf_tensor *ref,
                    const opf_tensor *got_d, int64_t H)
{
    opf_tensor got;
    CHECK_OK(ctx, cuda_test_download(ctx, got_d, &got));
    int64_t n = opf_spec_numel(&ref->spec), bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t rb, gb;
        float r = value_at(ref, i, &rb), g = value_at(&got, i, &gb);
        if (rb == gb || (isnan(r) && isnan(g))) continue;
        if (bad++ < 6)
            fprintf(stderr,
                    "  %s: %s[%lld] (row %lld, col %lld): cpu %.9g (0x%08x) gpu %.9g (0x%08x)\n",
                    what, name, (long long)i, (long long)(i / H), (long long)(i % H), (double)r,
                    rb, (double)g, gb);
    }
    CHECK(bad == 0, "%s: %s: %lld of %lld elements differ", what, name, (long long)bad,
          (long long)n);
    opf_tensor_release(&got);
}

/* ---- data ---------------------------------------------------------------- */

/* Random values around `offset` with edge values mixed in; `special`: row 0
 * holds a NaN, row 1 an inf, row 2 a value whose square overflows, row 3 is
 * zeros and row 4 constant (those rows that exist). */
static float *data(int64_t rows, int64_t H, float offset, bool special)
{
    static const float edges[] = {0.0f, -0.0f, 1e-40f, -1.4e-45f, 1e-30f, 1e-8f, 65504.0f,
                                  -57344.0f, 0x1p-10f};
    int64_t n = rows * H;
    float *x = malloc((size_t)(n ? n : 1) * sizeof *x);
    cuda_test_fill(x, n, 1.0f, 0, false);
    for (int64_t i = 0; i < n; i++) {
        x[i] += offset;
        if (cuda_test_u32() % 61 == 0) x[i] = edges[cuda_test_u32() % 9];
    }
    if (!special) return x;
    if (rows > 0) x[H / 2] = NAN;
    if (rows > 1) x[H + H / 3] = -INFINITY;
    if (rows > 2) x[2 * H] = 3e38f;
    if (rows > 3)
        for (int64_t j = 0; j < H; j++) x[3 * H + j] = 0.0f;
    if (rows > 4)
        for (int64_t j = 0; j < H; j++) x[4 * H + j] = 2.5f;
    return x;
}

/* ---- one case -------------------------------------------------------------- */

typedef struct ncase {
    int       kind;
    int       nd;
    int64_t   shape[3];
    opf_dtype xt, gt, zt, dzt, dxt, addt;  /* addt: the dadd dtype (LayerNorm, RMSNorm) */
    bool      zc, dadd, special;
} ncase;

typedef struct nbufs {
    pair x, g, b, z, mu, rs, dz, dx, dg, db, add;
} nbufs;

static const opf_norm_kernels *cpu(void) { return opf_backend_get(OPF_DEVICE_CPU)->norm; }
static const opf_norm_kernels *gpu(void) { return opf_backend_get(OPF_DEVICE_CUDA)->norm; }

/* Forward on both devices, then compare z and the row statistics. */
static void forward(opf_ctx *ctx, const ncase *c, nbufs *t, float eps, int64_t H, const char *w)
{
    if (c->kind == K_LN) {
        CHECK_OK(ctx, cpu()->layernorm_fwd(ctx, &t->x.h, &t->g.h, &t->b.h, eps, c->zc, &t->z.h,
                                           &t->mu.h, &t->rs.h));
        CHECK_OK(ctx, gpu()->layernorm_fwd(ctx, &t->x.d, &t->g.d, &t->b.d, eps, c->zc, &t->z.d,
                                           &t->mu.d, &t->rs.d));
        compare(ctx, w, "mu", &t->mu.h, &t->mu.d, 1);
    } else if (c->kind == K_RMS) {
        CHECK_OK(ctx, cpu()->rmsnorm_fwd(ctx, &t->x.h, &t->g.h, eps, c->zc, &t->z.h, &t->rs.h));
        CHECK_OK(ctx, gpu()->rmsnorm_fwd(ctx, &t->x.d, &t->g.d, eps, c->zc, &t->z.d, &t->rs.d));
    } else {
        CHECK_OK(ctx, cpu()->l2norm_fwd(ctx, &t->x.h, eps, &t->z.h, &t->rs.h));
        CHECK_OK(ctx, gpu()->l2norm_fwd(ctx, &t->x.d, eps, &t->z.d, &t->rs.d));
    }
    compare(ctx, w, c->kind == K_L2 ? "y" : "z", &t->z.h, &t->z.d, H);
    compare(ctx, w, c->kind == K_L2 ? "rnorm" : "rsigma", &t->rs.h, &t->rs.d, 1);
}

/* Backward on both devices from the CPU's statistics (the same inputs even
 * where the forward differed), then compare the gradients. */
static void backward(opf_ctx *ctx, const ncase *c, nbufs *t, int64_t H, const char *w)
{
    size_t rows_bytes = (size_t)opf_spec_numel(&t->rs.h.spec) * sizeof(float);
    CHECK_OK(ctx, opf_cuda_copy(ctx, t->rs.d.data[0], t->rs.h.data[0], rows_bytes, OPF_CUDA_H2D));
    if (c->kind == K_LN) {
        CHECK_OK(ctx, opf_cuda_copy(ctx, t->mu.d.data[0], t->mu.h.data[0], rows_bytes,
                                    OPF_CUDA_H2D));
        CHECK_OK(ctx, cpu()->layernorm_bwd(ctx, &t->dz.h, &t->x.h, &t->mu.h, &t->rs.h, &t->g.h,
                                           c->zc, c->dadd ? &t->add.h : NULL, &t->dx.h, &t->dg.h,
                                           &t->db.h));
        CHECK_OK(ctx, gpu()->layernorm_bwd(ctx, &t->dz.d, &t->x.d, &t->mu.d, &t->rs.d, &t->g.d,
                                           c->zc, c->dadd ? &t->add.d : NULL, &t->dx.d, &t->dg.d,
                                           &t->db.d));
        compare(ctx, w, "dbeta", &t->db.h, &t->db.d, H);
    } else if (c->kind == K_RMS) {
        CHECK_OK(ctx, cpu()->rmsnorm_bwd(ctx, &t->dz.h, &t->x.h, &t->rs.h, &t->g.h, c->zc,
                                         c->dadd ? &t->add.h : NULL, &t->dx.h, &t->dg.h));
        CHECK_OK(ctx, gpu()->rmsnorm_bwd(ctx, &t->dz.d, &t->x.d, &t->rs.d, &t->g.d, c->zc,
                                         c->dadd ? &t->add.d : NULL, &t->dx.d, &t->dg.d));
    } else {
        CHECK_OK(ctx, cpu()->l2norm_bwd(ctx, &t->dz.h, &t->x.h, &t->rs.h, &t->dx.h));
        CHECK_OK(ctx, gpu()->l2norm_bwd(ctx, &t->dz.d, &t->x.d, &t->rs.d, &t->dx.d));
    }
    compare(ctx, w, "dx", &t->dx.h, &t->dx.d, H);
    if (c->kind != K_L2) compare(ctx, w, "dgamma", &t->dg.h, &t->dg.d, H);
}

static void run_case(opf_ctx *ctx, const ncase *c)
{
    opf_spec xs = spec_of(c->nd, c->shape, c->xt);
    int64_t H = c->shape[c->nd - 1], n = opf_spec_numel(&xs), rows = H ? n / H : 0;
    char w[224], ss[96];
    opf_spec_str(&xs, ss, sizeof ss);
    snprintf(w, sizeof w, "%s %s gamma %s z %s dz %s dx %s%s%s%s%s", KIND_NAMES[c->kind], ss,
             opf_dtype_name(c->gt), opf_dtype_name(c->zt), opf_dtype_name(c->dzt),
             opf_dtype_name(c->dxt), c->zc ? " zero-centred" : "",
             c->dadd ? " dadd " : "", c->dadd ? opf_dtype_name(c->addt) : "",
             c->special ? " (nan/inf rows)" : "");
    nbufs t;
    memset(&t, 0, sizeof t);
    float *xv = data(rows, H, c->kind == K_LN ? 3.0f : 0.0f, c->special);
    float *dzv = data(rows, H, 0.0f, false), *addv = data(rows, H, 0.0f, false);
    float *gv = data(1, H, c->zc ? 0.0f : 1.0f, false), *bv = data(1, H, 0.0f, false);
    int64_t hs[1] = {H}, rs[1] = {rows};
    input(ctx, xs, xv, &t.x);
    input(ctx, spec_of(c->nd, c->shape, c->dzt), dzv, &t.dz);
    input(ctx, spec_of(c->nd, c->shape, c->addt), addv, &t.add);
    input(ctx, spec_of(1, hs, c->gt), gv, &t.g);
    input(ctx, spec_of(1, hs, c->gt), bv, &t.b);
    output(ctx, spec_of(c->nd, c->shape, c->zt), &t.z);
    output(ctx, spec_of(c->nd, c->shape, c->dxt), &t.dx);
    output(ctx, spec_of(1, rs, OPF_F32), &t.mu);
    output(ctx, spec_of(1, rs, OPF_F32), &t.rs);
    output(ctx, spec_of(1, hs, c->gt), &t.dg);
    output(ctx, spec_of(1, hs, c->gt), &t.db);
    forward(ctx, c, &t, c->special ? 1e-6f : 1e-5f, H, w);
    backward(ctx, c, &t, H, w);
    pair *all[] = {&t.x, &t.g, &t.b, &t.z, &t.mu, &t.rs, &t.dz, &t.dx, &t.dg, &t.db, &t.add};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) release(all[i]);
    free(xv), free(dzv), free(addv), free(gv), free(bv);
}

/* Shapes: one element; H below, at and past a warp, not a multiple of 8;
 * rows past 32 and not a multiple of it (the dgamma fold); 3-D; H staged
 * in shared memory above 48 KiB a block (12288 backward, 24576 forward);
 * H not staged at all (40000 backward and forward, 40001 without vectors). */
static const struct { int nd; int64_t s[3]; } shapes[] = {
    {2, {1, 1}},     {2, {3, 5}},     {2, {2, 32}},    {2, {7, 33}},     {2, {37, 64}},
    {2, {64, 1000}}, {3, {5, 13, 96}}, {2, {1000, 24}}, {2, {4099, 40}}, {2, {5, 8192}},
    {2, {70, 4096}}, {2, {3, 12288}}, {2, {2, 24576}}, {2, {2, 40000}}, {2, {3, 40001}},
};
enum { N_SHAPES = sizeof shapes / sizeof shapes[0] };

/* The all-bf16 backward of at most 512 rows runs in one launch
 * (norm_bwd_one.cu) when its grid (a block per 16 rows, one per 32
 * columns) is one wave: rows and H that cut its blocks; rows staged in its
 * blocks' shared memory ([256, 1024], the step's; [512, 2048]; [37, 1001]
 * and [300, 33] element by element) or not ([3, 4000]; [2, 4001] without
 * vectors); [33, 12288] is past one wave, so the two launches run it. Each
 * case runs with the path on and, under OPF_CUDA_NORM_ONE_LAUNCH=0, off,
 * the same data and dtypes both times, each against the CPU; the path's
 * launch count says which ran. */
static const struct { int nd; int64_t s[3]; } one_launch_shapes[] = {
    {2, {1, 8}},      {2, {31, 1000}},  {2, {256, 1024}}, {3, {4, 75, 520}}, {2, {511, 96}},
    {2, {512, 2048}}, {2, {37, 1001}},  {2, {300, 33}},   {2, {3, 4000}},    {2, {2, 4001}},
    {2, {33, 12288}},
};
enum { N_ONE = sizeof one_launch_shapes / sizeof one_launch_shapes[0] };

static int sm_count(void)
{
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return 0;
    return n;
}

static int one_launch_cases(opf_ctx *ctx)
{
    const char *saved = getenv("OPF_CUDA_NORM_ONE_LAUNCH");
    char *keep = saved ? strdup(saved) : NULL;
    int sms = sm_count(), count = 0;
    CHECK(sms > 0, "the device's SM count (%d)", sms);
    for (int pass = 0; pass < 2; pass++) {
        setenv("OPF_CUDA_NORM_ONE_LAUNCH", pass ? "0" : "1", 1);
        int taken = 0;
        for (int si = 0; si < N_ONE; si++) {
            const int64_t *sh = one_launch_shapes[si].s;
            int nd = one_launch_shapes[si].nd;
            int64_t H = sh[nd - 1], rows = nd == 3 ? sh[0] * sh[1] : sh[0];
            bool one = !pass && (rows + 15) / 16 + (H + 31) / 32 <= sms;
            for (int kind = K_LN; kind <= K_RMS; kind++)
                for (int v = 0; v < 2; v++, count++) {
                    int k = (si * 2 + kind) * 2 + v;  /* the same in both passes */
                    ncase c = {kind, nd, {0}, OPF_BF16, OPF_BF16, DT[k % 3], OPF_BF16,
                               DT[(k + 1) % 3], DT[(k / 3) % 3], v == 1, (si + v) % 2 == 0,
                               k % 3 == 0};
                    memcpy(c.shape, sh, sizeof c.shape);
                    unsigned long long before = opf_cuda_norm_one_launches();
                    run_case(ctx, &c);
                    unsigned long long ran = opf_cuda_norm_one_launches() - before;
                    CHECK(ran == (one ? 1u : 0u),
                          "%s [%lld, %lld] %s: %llu one-launch backward calls, expected %d",
                          KIND_NAMES[kind], (long long)rows, (long long)H,
                          pass ? "path off" : "path on", ran, one ? 1 : 0);
                    taken += (int)ran;
                }
        }
        printf("  %s: %d cases, %d in one launch\n", pass ? "path off" : "path on", N_ONE * 4,
               taken);
    }
    if (keep) setenv("OPF_CUDA_NORM_ONE_LAUNCH", keep, 1);
    else unsetenv("OPF_CUDA_NORM_ONE_LAUNCH");
    free(keep);
    return count;
}

/* Every shape x every x / gamma dtype pair for LayerNorm and RMSNorm, and
 * every x / y pair for L2; the other dtypes rotate through the cases. */
int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    int count = 0;
    for (int si = 0; si < N_SHAPES; si++)
        for (int kind = K_LN; kind <= K_L2; kind++)
            for (int xi = 0; xi < 3; xi++)
                for (int gi = 0; gi < 3; gi++, count++) {
                    ncase c = {kind, shapes[si].nd, {0}, DT[xi], DT[gi], DT[(xi + gi + si) % 3],
                               DT[(xi + si + 1) % 3], DT[(gi + si + 2) % 3],
                               DT[(count / 2) % 3], count % 2 == 1, (count + si) % 3 == 2,
                               (count / 2) % 2 == 0};
                    memcpy(c.shape, shapes[si].s, sizeof c.shape);
                    if (kind == K_L2) c.zt = c.dxt = DT[gi];  /* L2 has no gamma: y / dx dtype */
                    run_case(ctx, &c);
                }
    count += one_launch_cases(ctx);
    printf("  %d cases\n", count);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
