/* test_cuda_act.c: the GPU activation kernels (backend/act.h) against the
 * CPU reference, byte for byte: forward and backward of every kind (the
 * plain ones, the GLUs and ClampedSwiGLU), in place, dact + dbias, and the
 * scaled GLU forward and backward (ds included). Shapes cut the 4-float
 * vectors and the 32-sum tiles of the ordered sums; a shifted base leaves
 * the vector path; rows run from none to thousands. Data spread over six
 * decades with zeros, -0, subnormals, huge values and, in half of the
 * cases, inf and NaN. NaN compares equal to NaN (each device's NaN bits
 * are its own); every other value must have the CPU's bits. Every mismatch
 * is printed (the first few of each array). dact + dbias runs again at each
 * spread of colsum.cuh's staged kernel (OPF_CUDA_COLSUM_SPREAD=1, 2, 4),
 * through the fp32 entry and dact_dbias_q (f32 / bf16 in, FP8 current
 * scaling out: the amax taken in the kernel), on shapes that end in a
 * partial stage, have fewer rows than 32, or dead columns in the last
 * strip; and dact_dbias_stored (dbias of the stored dx, the bias fusion's
 * plain form) in every dtype combination. */
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

static const char *const KIND_NAMES[OPF_ACT_COUNT] = {
    "gelu", "qgelu", "relu", "srelu", "silu", "glu", "geglu", "qgeglu", "reglu", "sreglu",
    "swiglu", "clamped_swiglu"};

static const opf_act_kernels *cpu(void) { return opf_backend_get(OPF_DEVICE_CPU)->act; }
static const opf_act_kernels *gpu(void) { return opf_backend_get(OPF_DEVICE_CUDA)->act; }

static opf_act_params params_of(opf_act_kind k)
{
    opf_act_params p = {1.0f, 0.0f};
    if (k == OPF_ACT_QGELU || k == OPF_ACT_QGEGLU || k == OPF_ACT_CLAMPED_SWIGLU) p.alpha = 1.702f;
    if (k == OPF_ACT_CLAMPED_SWIGLU) p.limit = 7.0f;
    return p;
}

/* n floats on the device at `shift` floats past an allocation (shift 1
 * leaves the 16-byte path); *base is what to free. */
static float *dev_floats(opf_ctx *ctx, const float *h, int64_t n, int shift, void **base)
{
    *base = NULL;
    CHECK_OK(ctx, opf_cuda_alloc(ctx, (size_t)(n + shift + 1) * sizeof(float), base));
    float *d = (float *)*base + shift;
    if (h && n) CHECK_OK(ctx, opf_cuda_copy(ctx, d, h, (size_t)n * sizeof(float), OPF_CUDA_H2D));
    return d;
}

/* ref (CPU) against the device's n floats d: same bits or both NaN. */
static void compare(opf_ctx *ctx, const char *what, const char *name, const float *ref,
                    const float *d, int64_t n, int64_t cols)
{
    float *got = malloc((size_t)(n ? n : 1) * sizeof *got);
    if (n) CHECK_OK(ctx, opf_cuda_copy(ctx, got, d, (size_t)n * sizeof(float), OPF_CUDA_D2H));
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t rb, gb;
        memcpy(&rb, &ref[i], 4);
        memcpy(&gb, &got[i], 4);
        if (rb == gb || (isnan(ref[i]) && isnan(got[i]))) continue;
        if (bad++ < 6)
            fprintf(stderr,
                    "  %s: %s[%lld] (row %lld, col %lld): cpu %.9g (0x%08x) gpu %.9g (0x%08x)\n",
                    what, name, (long long)i, (long long)(i / cols), (long long)(i % cols),
                    (double)ref[i], rb, (double)got[i], gb);
    }
    CHECK(bad == 0, "%s: %s: %lld of %lld values differ", what, name, (long long)bad, (long long)n);
    free(got);
}

typedef struct acase {
    opf_act_kind kind;
    int64_t      rows, cols;
    int          shift;    /* floats past the allocation of every device array */
    bool         special;  /* inf and NaN in the data */
    float        scale;
} acase;

/* Host and device copies of the arrays of one case. */
typedef struct abufs {
    float *x, *dy, *s, *y, *dx, *db, *ds, *work;        /* host (CPU results in y..ds) */
    float *dX, *dDY, *dS, *dY, *dDX, *dDB, *dDS;        /* device */
    void  *base[7];
} abufs;

static float *host_random(int64_t n, float scale, int every, bool special)
{
    float *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    cuda_test_fill(v, n, scale, every, special);
    return v;
}

static void alloc_case(opf_ctx *ctx, const acase *c, abufs *b)
{
    bool glu = opf_act_is_glu(c->kind);
    int64_t n = c->rows * c->cols, ny = glu ? n / 2 : n;
    b->x = host_random(n, c->scale, 9, c->special);
    b->dy = host_random(ny, 1.0f, 13, c->special);
    b->s = host_random(c->rows, 1.0f, 0, false);
    b->y = malloc((size_t)(n + 1) * sizeof(float));
    b->dx = malloc((size_t)(n + 1) * sizeof(float));
    b->db = malloc((size_t)(c->cols + 1) * sizeof(float));
    b->ds = malloc((size_t)(c->rows + 1) * sizeof(float));
    b->work = malloc((size_t)(n + 1) * sizeof(float));
    b->dX = dev_floats(ctx, b->x, n, c->shift, &b->base[0]);
    b->dDY = dev_floats(ctx, b->dy, ny, c->shift, &b->base[1]);
    b->dS = dev_floats(ctx, b->s, c->rows, c->shift, &b->base[2]);
    b->dY = dev_floats(ctx, NULL, n, c->shift, &b->base[3]);
    b->dDX = dev_floats(ctx, NULL, n, c->shift, &b->base[4]);
    b->dDB = dev_floats(ctx, NULL, c->cols, c->shift, &b->base[5]);
    b->dDS = dev_floats(ctx, NULL, c->rows, c->shift, &b->base[6]);
}

static void free_case(opf_ctx *ctx, abufs *b)
{
    for (int i = 0; i < 7; i++) opf_cuda_free(ctx, b->base[i]);
    free(b->x), free(b->dy), free(b->s), free(b->y), free(b->dx), free(b->db), free(b->ds);
    free(b->work);
}

static void run_dbias(opf_ctx *ctx, const acase *c, abufs *b, const char *w)
{
    opf_act_params p = params_of(c->kind);
    int64_t R = c->rows, C = c->cols;
    CHECK_OK(ctx, cpu()->dact_dbias(ctx, c->kind, p, b->x, b->dy, b->dx, b->db, R, C));
    CHECK_OK(ctx, gpu()->dact_dbias(ctx, c->kind, p, b->dX, b->dDY, b->dDX, b->dDB, R, C));
    compare(ctx, w, "dact_dbias dx", b->dx, b->dDX, R * C, C);
    compare(ctx, w, "dbias", b->db, b->dDB, C, C);
}

/* Plain kinds: forward (out of place, then in place over a copy of x),
 * backward (in place over dy) and dact + dbias. */
static void run_plain(opf_ctx *ctx, const acase *c, abufs *b, const char *w)
{
    opf_act_kind k = c->kind;
    opf_act_params p = params_of(k);
    int64_t R = c->rows, C = c->cols, n = R * C;
    size_t bytes = (size_t)n * sizeof(float);
    CHECK_OK(ctx, cpu()->fwd(ctx, k, p, b->x, b->y, R, C));
    CHECK_OK(ctx, gpu()->fwd(ctx, k, p, b->dX, b->dY, R, C));
    compare(ctx, w, "y", b->y, b->dY, n, C);
    if (n) CHECK_OK(ctx, opf_cuda_copy(ctx, b->dY, b->dX, bytes, OPF_CUDA_D2D));
    CHECK_OK(ctx, gpu()->fwd(ctx, k, p, b->dY, b->dY, R, C));
    compare(ctx, w, "y (in place)", b->y, b->dY, n, C);
    CHECK_OK(ctx, cpu()->bwd(ctx, k, p, b->x, b->dy, b->dx, R, C));
    if (n) CHECK_OK(ctx, opf_cuda_copy(ctx, b->dDX, b->dDY, bytes, OPF_CUDA_D2D));
    CHECK_OK(ctx, gpu()->bwd(ctx, k, p, b->dX, b->dDX, b->dDX, R, C));
    compare(ctx, w, "dx (in place over dy)", b->dx, b->dDX, n, C);
    run_dbias(ctx, c, b, w);
}

/* GLU kinds: forward, backward and, but for ClampedSwiGLU, the scaled pair. */
static void run_glu(opf_ctx *ctx, const acase *c, abufs *b, const char *w)
{
    opf_act_kind k = c->kind;
    opf_act_params p = params_of(k);
    int64_t R = c->rows, C = c->cols, n = R * C, h = C / 2;
    CHECK_OK(ctx, cpu()->fwd(ctx, k, p, b->x, b->y, R, C));
    CHECK_OK(ctx, gpu()->fwd(ctx, k, p, b->dX, b->dY, R, C));
    compare(ctx, w, "y", b->y, b->dY, R * h, h);
    CHECK_OK(ctx, cpu()->bwd(ctx, k, p, b->x, b->dy, b->dx, R, C));
    CHECK_OK(ctx, gpu()->bwd(ctx, k, p, b->dX, b->dDY, b->dDX, R, C));
    compare(ctx, w, "dx", b->dx, b->dDX, n, C);
    if (k == OPF_ACT_CLAMPED_SWIGLU) return;
    CHECK_OK(ctx, cpu()->scaled_glu_fwd(ctx, k, p, b->x, b->s, b->y, R, C));
    CHECK_OK(ctx, gpu()->scaled_glu_fwd(ctx, k, p, b->dX, b->dS, b->dY, R, C));
    compare(ctx, w, "scaled y", b->y, b->dY, R * h, h);
    CHECK_OK(ctx, cpu()->scaled_glu_bwd(ctx, k, p, b->x, b->s, b->dy, b->dx, b->ds, b->work, R, C));
    CHECK_OK(ctx, gpu()->scaled_glu_bwd(ctx, k, p, b->dX, b->dS, b->dDY, b->dDX, b->dDS, NULL, R,
                                        C));
    compare(ctx, w, "scaled dx", b->dx, b->dDX, n, C);
    compare(ctx, w, "ds", b->ds, b->dDS, R, 1);
}

/* Every pass of a case, or (dbias_only) dact + dbias alone. */
static void run_case(opf_ctx *ctx, const acase *c, bool dbias_only)
{
    char w[200];
    const char *spread = getenv("OPF_CUDA_COLSUM_SPREAD");
    snprintf(w, sizeof w, "%s [%lld, %lld] shift %d scale %g%s%s%s", KIND_NAMES[c->kind],
             (long long)c->rows, (long long)c->cols, c->shift, (double)c->scale,
             c->special ? " (inf/nan)" : "", spread ? " spread " : "", spread ? spread : "");
    abufs b;
    memset(&b, 0, sizeof b);
    alloc_case(ctx, c, &b);
    if (dbias_only) run_dbias(ctx, c, &b, w);
    else if (opf_act_is_glu(c->kind)) run_glu(ctx, c, &b, w);
    else run_plain(ctx, c, &b, w);
    free_case(ctx, &b);
}

/* The tensors of a dact + dbias entry compared across the devices: x and
 * dy [rows, cols] (finite random data) on both, dx of spec os and dbias of
 * spec bs allocated on both. */
typedef struct dbias_io {
    float     *v;
    opf_tensor hx, hdy, dx, ddy, hout, dout, hdb, ddb;
} dbias_io;

static void dbias_io_open(opf_ctx *ctx, const opf_spec *xs, const opf_spec *os,
                          const opf_spec *bs, dbias_io *io)
{
    int64_t n = opf_spec_numel(xs);
    io->v = host_random(2 * n, 3.0f, 0, false);
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, xs, io->v, &io->hx));
    CHECK_OK(ctx, cuda_test_host_tensor(ctx, xs, io->v + n, &io->hdy));
    CHECK_OK(ctx, cuda_test_upload(ctx, &io->hx, &io->dx));
    CHECK_OK(ctx, cuda_test_upload(ctx, &io->hdy, &io->ddy));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, os, &io->hout));
    CHECK_OK(ctx, cuda_test_alloc(ctx, os, &io->dout));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, bs, &io->hdb));
    CHECK_OK(ctx, cuda_test_alloc(ctx, bs, &io->ddb));
}

/* dx and dbias of the GPU against the CPU's bytes; everything released. */
static void dbias_io_check(opf_ctx *ctx, dbias_io *io, const char *w)
{
    opf_tensor got, gdb;
    CHECK_OK(ctx, cuda_test_download(ctx, &io->dout, &got));
    CHECK_OK(ctx, cuda_test_download(ctx, &io->ddb, &gdb));
    CHECK(cuda_test_same_bytes(&io->hout, &got, "dx"), "%s: dx differs from the CPU", w);
    CHECK(cuda_test_same_bytes(&io->hdb, &gdb, "dbias"), "%s: dbias differs from the CPU", w);
    opf_tensor *ts[] = {&io->hx, &io->hdy, &io->dx,  &io->ddy, &io->hout,
                        &io->dout, &io->hdb, &io->ddb, &got,     &gdb};
    for (int i = 0; i < 10; i++) opf_tensor_release(ts[i]);
    free(io->v);
}

/* dact_dbias_q of x, dy of dtype dt [rows, cols] into FP8 e4m3 current
 * scaling (hp dt): data, scale_inv and amax, and dbias, against the CPU's
 * bytes. Finite data (the amax of a NaN is each device's own). */
static void run_dbias_q(opf_ctx *ctx, opf_act_kind k, opf_dtype dt, int64_t rows, int64_t cols)
{
    char w[200];
    snprintf(w, sizeof w, "dact_dbias_q %s %s [%lld, %lld] spread %s", KIND_NAMES[k],
             opf_dtype_name(dt), (long long)rows, (long long)cols,
             getenv("OPF_CUDA_COLSUM_SPREAD"));
    opf_spec xs = opf_spec_make(2, (int64_t[]){rows, cols}, dt), os;
    opf_spec bs = opf_spec_make(1, &cols, OPF_F32);
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.qdtype = OPF_E4M3;
    q.usage = OPF_USAGE_ROWWISE;
    CHECK_OK(ctx, opf_quantizer_spec(&q, &xs, &os));
    dbias_io io;
    dbias_io_open(ctx, &xs, &os, &bs, &io);
    opf_qout oh = {&io.hout, &q, NULL, dt}, od = {&io.dout, &q, NULL, dt};
    opf_act_params p = params_of(k);
    CHECK_OK(ctx, cpu()->dact_dbias_q(ctx, k, p, &io.hx, &io.hdy, &oh, io.hdb.data[0]));
    CHECK_OK(ctx, gpu()->dact_dbias_q(ctx, k, p, &io.dx, &io.ddy, &od, io.ddb.data[0]));
    dbias_io_check(ctx, &io, w);
}

/* [rows, cols], cols even for the GLUs: h = cols / 2 below, at and past the
 * vector width, not a multiple of 4; rows none, one, past 32 and the 64-term
 * tiles of the ordered sums, not a multiple of them; rows of whole 16-byte
 * chunks over several stages of colsum.cuh's staged kernel (3001 x 136) and
 * rows that are not (4099 x 34: its direct kernel). */
static const int64_t shapes[][2] = {
    {0, 8}, {1, 2}, {2, 2}, {5, 6}, {3, 10}, {7, 66}, {33, 128}, {130, 1000}, {1000, 72},
    {4099, 34}, {64, 4096}, {3, 8194}, {3001, 136},
};
enum { N_SHAPES = sizeof shapes / sizeof shapes[0] };

/* dact_dbias_stored (the bias fusion's plain form): x and dy of di, dx of
 * dx_t, db of db_t; dx and db with the CPU's bytes (its entry is the
 * activation's backward, then the bias's dbias of the stored dx). */
static void run_dbias_stored(opf_ctx *ctx, opf_act_kind k, opf_dtype di, opf_dtype dx_t,
                             opf_dtype db_t, int64_t rows, int64_t cols)
{
    char w[200];
    snprintf(w, sizeof w, "dact_dbias_stored %s %s -> %s, db %s [%lld, %lld]%s", KIND_NAMES[k],
             opf_dtype_name(di), opf_dtype_name(dx_t), opf_dtype_name(db_t), (long long)rows,
             (long long)cols, getenv("OPF_CUDA_COLSUM_WHOLE") ? " (two kernels)" : "");
    opf_spec xs = opf_spec_make(2, (int64_t[]){rows, cols}, di);
    opf_spec os = opf_spec_make(2, (int64_t[]){rows, cols}, dx_t);
    opf_spec bs = opf_spec_make(1, &cols, db_t);
    dbias_io io;
    dbias_io_open(ctx, &xs, &os, &bs, &io);
    opf_act_params p = params_of(k);
    CHECK_OK(ctx, cpu()->dact_dbias_stored(ctx, k, p, &io.hx, &io.hdy, &io.hout, &io.hdb));
    CHECK_OK(ctx, gpu()->dact_dbias_stored(ctx, k, p, &io.dx, &io.ddy, &io.dout, &io.ddb));
    dbias_io_check(ctx, &io, w);
}

/* Every dtype combination the fused kernel takes (and f16, the
 * composition) on short columns (one kernel) and long ones, GELU and ReLU;
 * the short ones again through the two-kernel path. */
static int run_stored(opf_ctx *ctx)
{
    static const int64_t dims[][2] = {{256, 1024}, {77, 200}, {1, 8}, {3001, 136}, {4099, 34}};
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16};
    static const opf_act_kind kinds[] = {OPF_ACT_GELU, OPF_ACT_RELU};
    int count = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass) setenv("OPF_CUDA_COLSUM_WHOLE", "0", 1);
        for (size_t si = 0; si < sizeof dims / sizeof dims[0]; si++)
            for (int ki = 0; ki < 2; ki++)
                for (int a = 0; a < 2; a++)
                    for (int b = 0; b < 2; b++)
                        for (int c = 0; c < 2; c++, count++)
                            run_dbias_stored(ctx, kinds[ki], dts[a], dts[b], dts[c], dims[si][0],
                                             dims[si][1]);
        run_dbias_stored(ctx, OPF_ACT_GELU, OPF_F16, OPF_F16, OPF_F16, 77, 200), count++;
    }
    unsetenv("OPF_CUDA_COLSUM_WHOLE");
    return count;
}

/* dact + dbias at each spread. colsum.cuh's strips are 32 f32 / 64 bf16
 * columns, its stages 32 K rows (K 16 / 32 at spread 1, half that above):
 * partial last stages (3001; 517 and 287, some classes a row more than
 * others), rows below 32 (17, 1), dead columns in the last strip of the
 * staged kernel (136, 72, 1032, 200, 8; 100 in f32) and rows it cannot
 * stage (34; 100 in bf16: opf_colsum_kernel at every spread), all columns
 * live over whole stages (1024 x 3072). */
static const int64_t spread_shapes[][2] = {
    {3001, 136}, {517, 72}, {287, 1032}, {17, 200}, {1, 8}, {4099, 34}, {33, 100}, {1024, 3072},
};
static const opf_act_kind spread_kinds[] = {OPF_ACT_GELU, OPF_ACT_SILU, OPF_ACT_RELU};

static int run_spreads(opf_ctx *ctx)
{
    static const char *const spreads[] = {"1", "2", "4"};
    int count = 0;
    /* the short shapes' staged kernel too: not the one-kernel path of
     * columns of at most 512 rows (the default cases run that one) */
    setenv("OPF_CUDA_COLSUM_WHOLE", "0", 1);
    for (int sp = 0; sp < 3; sp++) {
        setenv("OPF_CUDA_COLSUM_SPREAD", spreads[sp], 1);
        for (int ki = 0; ki < 3; ki++)
            for (size_t si = 0; si < sizeof spread_shapes / sizeof spread_shapes[0]; si++) {
                int64_t r = spread_shapes[si][0], c = spread_shapes[si][1];
                acase a = {spread_kinds[ki], r, c, 0, si % 2 == 0, 1.0f};
                run_case(ctx, &a, true);
                run_dbias_q(ctx, spread_kinds[ki], OPF_F32, r, c);
                run_dbias_q(ctx, spread_kinds[ki], OPF_BF16, r, c);
                count += 3;
            }
    }
    unsetenv("OPF_CUDA_COLSUM_SPREAD");
    unsetenv("OPF_CUDA_COLSUM_WHOLE");
    return count;
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    int count = 0;
    for (int k = 0; k < OPF_ACT_COUNT; k++)
        for (int si = 0; si < N_SHAPES; si++)
            for (int shift = 0; shift < 2; shift++, count++) {
                bool special = (count / 2 + si) % 2 == 0;
                acase c = {(opf_act_kind)k, shapes[si][0], shapes[si][1], shift, special,
                           si % 3 == 1 ? 10.0f : 1.0f};
                run_case(ctx, &c, false);
            }
    int spread = run_spreads(ctx);
    int stored = run_stored(ctx);
    printf("  %d cases, %d of dact + dbias at spreads 1, 2, 4, %d of dact_dbias_stored\n", count,
           spread, stored);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
