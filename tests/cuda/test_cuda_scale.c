/* test_cuda_scale.c: the GPU scale kernels (backend/scale.h) against the
 * CPU reference, byte for byte: amax of every dtype (NaN ignored, infinities
 * kept, empty and all-NaN tensors), the delayed-scaling update of several
 * states x 10 steps on device arrays (history lengths 1, 2 and 16, both amax
 * algorithms, reduced amaxes or not, zero, NaN and infinite amaxes rolled in
 * or kept out, the count of non-finite amaxes, more states than one launch
 * takes), the public delayed state on both devices (the update neither
 * waits nor copies; the count is one 8-byte read), and the scale swizzle
 * both ways, transposed or not. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "cuda_cmp.h"

static const opf_scale_kernels *cpu(void) { return opf_backend_get(OPF_DEVICE_CPU)->scale; }
static const opf_scale_kernels *gpu(void) { return opf_backend_get(OPF_DEVICE_CUDA)->scale; }

/* ---- amax ------------------------------------------------------------------- */

static void amax_case(opf_ctx *ctx, int64_t n, opf_dtype dt, const float *v, const char *label)
{
    cmp_pair x = cmp_pair_of(ctx, 1, &n, dt, v);
    float ref = -1.0f, *dev = cmp_upload(ctx, &ref, sizeof ref);
    CHECK_OK(ctx, cpu()->amax(ctx, &x.h, &ref));
    CHECK_OK(ctx, gpu()->amax(ctx, &x.d, dev));
    char what[96];
    snprintf(what, sizeof what, "amax %s n %lld %s", label, (long long)n, opf_dtype_name(dt));
    cmp_device(ctx, &ref, dev, 1, sizeof ref, what);
    opf_cuda_free(ctx, dev);
    cmp_pair_release(&x);
}

static void test_amax(opf_ctx *ctx)
{
    static const int64_t sizes[] = {0, 1, 7, 8, 1000, 65537, 1 << 22};
    static const opf_dtype D[] = {OPF_F32, OPF_BF16, OPF_F16};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        int64_t n = sizes[k];
        float *v = malloc(sizeof(float) * (size_t)(n + 1));
        for (int d = 0; d < 3; d++)
            for (int e = EDGES_FINITE; e <= EDGES_INF; e++) {
                cmp_fill(v, n, 10.0f, (cmp_edges)e);
                char label[16];
                snprintf(label, sizeof label, "edges %d", e);
                amax_case(ctx, n, D[d], v, label);
            }
        for (int64_t i = 0; i < n; i++) v[i] = NAN;
        if (n) amax_case(ctx, n, OPF_BF16, v, "all NaN");
        if (n) v[n / 2] = -0x1p-140f;  /* one subnormal among the NaNs */
        if (n) amax_case(ctx, n, OPF_F32, v, "NaN + subnormal");
        free(v);
    }
}

/* ---- delayed update -------------------------------------------------------------- */

enum { STEPS = 10, MAX_STATES = 80 };

/* One state on both devices: host arrays (the CPU's) and device arrays. */
typedef struct dstate {
    opf_delayed_arrays h, d;
    float *reduced_h;  /* NULL when the state has none */
} dstate;

/* The state's options beyond its shape: reduced amaxes, non-finite ones kept
 * out, a count of them. */
typedef struct dopts {
    bool reduced, reject, count, filled;  /* filled: history rows 1.. start with ordinary amaxes */
} dopts;

static dstate make_state(opf_ctx *ctx, int n, int len, opf_amax_algo algo, dopts o)
{
    dstate s;
    memset(&s, 0, sizeof s);
    size_t hb = sizeof(float) * (size_t)n * (size_t)len, sb = sizeof(float) * (size_t)n;
    s.h.history = calloc(1, hb);
    for (size_t i = (size_t)n; o.filled && i < (size_t)n * (size_t)len; i++)
        s.h.history[i] = fabsf(cuda_test_unit()) * 100.0f;
    s.h.scale = malloc(sb);
    for (int j = 0; j < n; j++) s.h.scale[j] = j % 5 == 4 ? 0.25f : 1.0f;
    s.h.n = s.d.n = n, s.h.len = s.d.len = len;
    s.h.scaled_max = s.d.scaled_max = 448.0f / 2.0f;  /* margin 1 */
    s.h.algo = s.d.algo = algo;
    s.d.history = cmp_upload(ctx, s.h.history, hb);
    s.d.scale = cmp_upload(ctx, s.h.scale, sb);
    s.h.reject_nonfinite = s.d.reject_nonfinite = o.reject;
    if (o.count) {
        s.h.nonfinite = calloc(1, sizeof(uint64_t));
        s.d.nonfinite = cmp_upload(ctx, s.h.nonfinite, sizeof(uint64_t));
    }
    if (o.reduced) {
        s.reduced_h = calloc(1, sb);
        s.h.reduced = s.reduced_h;
        s.d.reduced = cmp_upload(ctx, s.reduced_h, sb);
    }
    return s;
}

static void free_state(opf_ctx *ctx, dstate *s)
{
    free(s->h.history), free(s->h.scale), free(s->reduced_h), free(s->h.nonfinite);
    opf_cuda_free(ctx, s->d.nonfinite);
    opf_cuda_free(ctx, s->d.history);
    opf_cuda_free(ctx, s->d.scale);
    opf_cuda_free(ctx, (void *)s->d.reduced);
}

/* This step's amax of one slot: often 0 (the slot was not used), NaN, inf,
 * tiny, or ordinary. */
static float step_amax(void)
{
    static const float special[] = {0.0f, 0.0f, NAN, INFINITY, 1e-40f, 3e38f, 448.0f};
    uint32_t r = cuda_test_u32() % 16;
    return r < 7 ? special[r] : fabsf(cuda_test_unit()) * 100.0f;
}

/* New row-0 amaxes (and reduced amaxes, some zero) on both sides. */
static void new_amaxes(opf_ctx *ctx, dstate *s)
{
    int n = s->h.n;
    for (int j = 0; j < n; j++) s->h.history[j] = step_amax();
    CHECK_OK(ctx, opf_cuda_copy(ctx, s->d.history, s->h.history, sizeof(float) * (size_t)n,
                                OPF_CUDA_H2D));
    if (!s->reduced_h) return;
    for (int j = 0; j < n; j++) s->reduced_h[j] = cuda_test_u32() % 3 ? step_amax() : 0.0f;
    CHECK_OK(ctx, opf_cuda_copy(ctx, (void *)s->d.reduced, s->reduced_h, sizeof(float) * (size_t)n,
                                OPF_CUDA_H2D));
}

/* count states, those with odd k keeping non-finite amaxes out when reject
 * is set; every fourth state has no count. */
static void run_delayed(opf_ctx *ctx, int count, bool reject, const char *label)
{
    /* 300 and 1024 rows: the device splits a slot's rows over a block's
     * threads in chunks (256 rows), the last one partial at 300 */
    static const int lens[] = {1, 2, 16, 300, 1024};
    static const int ns[] = {1, 3, 17, 64, 200, 2};
    dstate s[MAX_STATES];
    opf_delayed_arrays th[MAX_STATES], td[MAX_STATES];
    for (int k = 0; k < count; k++) {
        dopts o = {.reduced = k / 6 % 2 == 1, .reject = reject && k % 2, .count = k % 4 != 3,
                   .filled = k / 2 % 2 == 0};
        s[k] = make_state(ctx, ns[k % 6], lens[k % 5], k / 3 % 2 ? OPF_AMAX_MOST_RECENT : OPF_AMAX_MAX,
                          o);
        th[k] = s[k].h, td[k] = s[k].d;
    }
    for (int step = 1; step <= STEPS; step++) {
        for (int k = 0; k < count; k++) new_amaxes(ctx, &s[k]);
        CHECK_OK(ctx, cpu()->delayed_update(ctx, th, count));
        CHECK_OK(ctx, gpu()->delayed_update(ctx, td, count));
        for (int k = 0; k < count; k++) {
            char what[128];
            int m = snprintf(what, sizeof what, "delayed %s state %d (n %d, len %d, %s%s%s) step %d",
                             label, k, s[k].h.n, s[k].h.len,
                             s[k].h.algo == OPF_AMAX_MAX ? "max" : "most_recent",
                             s[k].reduced_h ? ", reduced" : "",
                             s[k].h.reject_nonfinite ? ", reject" : "", step);
            snprintf(what + m, sizeof what - (size_t)m, " history");
            cmp_device(ctx, s[k].h.history, s[k].d.history, (int64_t)s[k].h.n * s[k].h.len, 4, what);
            snprintf(what + m, sizeof what - (size_t)m, " scale");
            cmp_device(ctx, s[k].h.scale, s[k].d.scale, s[k].h.n, 4, what);
            if (!s[k].h.nonfinite) continue;
            snprintf(what + m, sizeof what - (size_t)m, " non-finite count");
            cmp_device(ctx, s[k].h.nonfinite, s[k].d.nonfinite, 1, 8, what);
        }
    }
    for (int k = 0; k < count; k++) free_state(ctx, &s[k]);
}

/* The public state on a CUDA context against the same on a CPU context:
 * histories with infinities and NaNs written through the API, updates, the
 * arrays and the count compared byte for byte. The updates queue work only
 * (no wait, no copy); the count is one 8-byte device-to-host read, and the
 * warning comes with it. */
static int n_warned;
static void on_warn(void *user, const char *msg)
{
    (void)user;
    if (strstr(msg, "non-finite amax")) n_warned++;
}

static void test_public_state(bool reject)
{
    enum { N = 5, L = 3, STEPS_PUB = 6 };
    opf_ctx_options co = opf_ctx_options_default();
    co.warn = on_warn;
    opf_ctx *cpu_ctx, *gctx;
    CHECK_OK(NULL, opf_ctx_create(&co, &cpu_ctx));
    co.device = OPF_DEVICE_CUDA;
    CHECK_OK(NULL, opf_ctx_create(&co, &gctx));
    opf_delayed_state *hs, *ds;
    CHECK_OK(cpu_ctx, opf_delayed_state_create(cpu_ctx, OPF_FORMAT_HYBRID, 1.0f, L, OPF_AMAX_MAX,
                                               false, N, &hs));
    CHECK_OK(gctx, opf_delayed_state_create(gctx, OPF_FORMAT_HYBRID, 1.0f, L, OPF_AMAX_MAX, false,
                                            N, &ds));
    opf_delayed_state_set_reject_nonfinite(hs, reject);
    opf_delayed_state_set_reject_nonfinite(ds, reject);
    n_warned = 0;
    float hist[L * N], got_s[N], got_h[L * N];
    for (int step = 0; step < STEPS_PUB; step++) {
        static const float row0[STEPS_PUB][N] = {
            {1, 2, 0, 4, 5}, {INFINITY, 2, 3, NAN, 0}, {3, 0, 1, 2, INFINITY},
            {2, 2, 2, 2, 2}, {0, NAN, 8, 1, 1}, {1, 1, 1, 1, 1},
        };
        float *h = opf_delayed_state_history(hs);
        memcpy(hist, h, sizeof hist);
        memcpy(hist, row0[step], sizeof row0[step]);
        memcpy(h, hist, sizeof hist);
        CHECK_OK(gctx, opf_delayed_state_write(gctx, ds, NULL, hist));
        opf_sync_stats a, b;
        opf_ctx_sync_stats(gctx, &a);
        CHECK_OK(cpu_ctx, opf_delayed_state_update(cpu_ctx, hs, NULL, NULL));
        CHECK_OK(gctx, opf_delayed_state_update(gctx, ds, NULL, NULL));
        opf_ctx_sync_stats(gctx, &b);
        CHECK(b.n_sync == a.n_sync && b.n_d2h == a.n_d2h && b.n_h2d == a.n_h2d,
              "reject %d step %d: the device update waited or copied (sync %llu, d2h %llu, "
              "h2d %llu)", (int)reject, step, (unsigned long long)(b.n_sync - a.n_sync),
              (unsigned long long)(b.n_d2h - a.n_d2h), (unsigned long long)(b.n_h2d - a.n_h2d));
        CHECK_OK(gctx, opf_delayed_state_read(gctx, ds, got_s, got_h));
        char what[96];
        snprintf(what, sizeof what, "public state reject %d step %d scale", (int)reject, step);
        cmp_bytes(opf_delayed_state_scale(hs), got_s, N, 4, what);
        snprintf(what, sizeof what, "public state reject %d step %d history", (int)reject, step);
        cmp_bytes(opf_delayed_state_history(hs), got_h, L * N, 4, what);
    }
    int cpu_warned = n_warned;
    CHECK(cpu_warned == 1, "reject %d: the CPU update warned %d times, want 1", (int)reject,
          cpu_warned);
    opf_sync_stats a, b;
    opf_ctx_sync_stats(gctx, &a);
    int64_t want = opf_delayed_state_nonfinite_amaxes(hs), got = opf_delayed_state_nonfinite_amaxes(ds);
    opf_ctx_sync_stats(gctx, &b);
    CHECK(want == 4 && got == want, "reject %d: non-finite count cpu %lld gpu %lld, want 4",
          (int)reject, (long long)want, (long long)got);
    CHECK(b.n_d2h == a.n_d2h + 1 && b.bytes_d2h == a.bytes_d2h + 8,
          "reject %d: the count read made %llu copies of %llu bytes, want 1 of 8", (int)reject,
          (unsigned long long)(b.n_d2h - a.n_d2h), (unsigned long long)(b.bytes_d2h - a.bytes_d2h));
    CHECK(n_warned == cpu_warned + 1, "reject %d: the device's count warned %d times, want 1",
          (int)reject, n_warned - cpu_warned);
    opf_delayed_state_reset(ds);
    CHECK(opf_delayed_state_nonfinite_amaxes(ds) == 0, "reject %d: reset clears the device count",
          (int)reject);
    opf_delayed_state_destroy(hs);
    opf_delayed_state_destroy(ds);
    opf_ctx_destroy(cpu_ctx);
    opf_ctx_destroy(gctx);
}

/* ---- swizzle ---------------------------------------------------------------------- */

static void swizzle_case(opf_ctx *ctx, int64_t R, int64_t C, bool tr, bool to, int shift)
{
    size_t n = (size_t)(R * C);
    uint8_t *src = malloc(n + 4), *ref = calloc(1, n + 4);
    for (size_t i = 0; i < n + 4; i++) src[i] = (uint8_t)cuda_test_u32();
    uint8_t *dsrc = cmp_upload(ctx, src, n + 4), *ddst = cmp_upload(ctx, ref, n + 4);
    CHECK_OK(ctx, cpu()->swizzle(ctx, src + shift, ref + shift, R, C, tr, to));
    CHECK_OK(ctx, gpu()->swizzle(ctx, dsrc + shift, ddst + shift, R, C, tr, to));
    char what[96];
    snprintf(what, sizeof what, "swizzle %lld x %lld%s %s%s", (long long)R, (long long)C,
             tr ? " transposed" : "", to ? "to swizzled" : "to compact", shift ? " (misaligned)" : "");
    cmp_device(ctx, ref, ddst, (int64_t)n + 4, 1, what);
    opf_cuda_free(ctx, dsrc);
    opf_cuda_free(ctx, ddst);
    free(src), free(ref);
}

static void test_swizzle(opf_ctx *ctx)
{
    static const int64_t dims[][2] = {{128, 4}, {128, 36}, {256, 8}, {384, 4}, {1024, 256}, {128, 2048}};
    for (size_t k = 0; k < sizeof dims / sizeof dims[0]; k++)
        for (int tr = 0; tr < 2; tr++)
            for (int to = 0; to < 2; to++)
                for (int shift = 0; shift < 2; shift++)
                    swizzle_case(ctx, dims[k][0], dims[k][1], tr, to, shift);
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    test_amax(ctx);
    run_delayed(ctx, 12, false, "12 states");
    run_delayed(ctx, 12, true, "12 states");
    run_delayed(ctx, 75, true, "75 states");  /* two launches */
    test_public_state(false);
    test_public_state(true);
    test_swizzle(ctx);
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
