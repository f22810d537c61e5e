/* test_cuda_optim.c: the GPU SGD and AdamW steps (backend/optim.h) against
 * the CPU reference, byte for byte after every step: master weights,
 * moments and the parameters, over ten steps on tensors of odd sizes with
 * mixed gradient and parameter dtypes, more tensors than one launch takes,
 * misaligned arrays, and gradients holding NaN (exact) or infinities (NaNs
 * of two kinds meet there: see cuda_cmp.h; compared as NaN on both sides).
 * Then the non-finite guard (backend/optim.h): the check's verdict on the
 * device, skipped steps that change nothing, the skip count, and AdamW's
 * bias corrections after skips the host has not seen, against the CPU
 * kernels given the same guard in host memory. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include "cuda_cmp.h"

static const opf_dtype D[] = {OPF_F32, OPF_BF16, OPF_F16};
enum { STEPS = 10, MAX_T = 64 };

typedef enum kind { ADAMW, SGD_MOMENTUM, SGD_PLAIN } kind;

/* One parameter on both devices: h points at host arrays, d at device ones;
 * shift: every device and host array starts one element into its buffer. */
typedef struct slot {
    opf_optim_tensor h, d;
    void *hbuf[5], *dbuf[5];  /* grad, master, m, v, param */
} slot;

static const opf_optim_kernels *cpu(void) { return opf_backend_get(OPF_DEVICE_CPU)->optim; }
static const opf_optim_kernels *gpu(void) { return opf_backend_get(OPF_DEVICE_CUDA)->optim; }

static size_t nb(opf_dtype dt, int64_t n) { return opf_dtype_nbytes(dt, (size_t)n); }

/* Buffer b of a slot: n elements of dt (+1 for the shift), host values from
 * f32 vals (NULL: zeros), the same bytes on the device. */
static void *buffer(opf_ctx *ctx, slot *s, int b, opf_dtype dt, int64_t n, const float *vals,
                    int shift, void **dev)
{
    size_t es = nb(dt, 1), bytes = nb(dt, n + 1);
    char *h = calloc(1, bytes);
    if (vals) CHECK_OK(ctx, opf_convert(vals, OPF_F32, h + shift * es, dt, (size_t)n));
    s->hbuf[b] = h;
    s->dbuf[b] = cmp_upload(ctx, h, bytes);
    *dev = (char *)s->dbuf[b] + shift * es;
    return h + shift * es;
}

static slot make_slot(opf_ctx *ctx, int64_t n, opf_dtype gd, opf_dtype pd, kind k, int shift)
{
    slot s;
    memset(&s, 0, sizeof s);
    float *w = malloc(sizeof(float) * (size_t)(n + 1)), *v = malloc(sizeof(float) * (size_t)(n + 1));
    cmp_fill(w, n, 1.0f, EDGES_FINITE);
    for (int64_t i = 0; i < n; i++) v[i] = fabsf(w[(i * 7) % n]) * 1e-3f;  /* v >= 0 */
    s.h.n = s.d.n = n;
    s.h.grad_dtype = s.d.grad_dtype = gd;
    s.h.param_dtype = s.d.param_dtype = pd;
    void *dv;
    s.h.grad = buffer(ctx, &s, 0, gd, n, NULL, shift, &dv), s.d.grad = dv;
    s.h.master = buffer(ctx, &s, 1, OPF_F32, n, w, shift, &dv), s.d.master = dv;
    if (k != SGD_PLAIN) s.h.m = buffer(ctx, &s, 2, OPF_F32, n, NULL, shift, &dv), s.d.m = dv;
    if (k == ADAMW) s.h.v = buffer(ctx, &s, 3, OPF_F32, n, v, shift, &dv), s.d.v = dv;
    s.h.param = buffer(ctx, &s, 4, pd, n, NULL, shift, &dv), s.d.param = dv;
    free(w), free(v);
    return s;
}

static void free_slot(opf_ctx *ctx, slot *s)
{
    for (int b = 0; b < 5; b++) {
        free(s->hbuf[b]);
        opf_cuda_free(ctx, s->dbuf[b]);
    }
}

/* New gradients for one step, the same bytes on both sides. */
static void new_grads(opf_ctx *ctx, slot *s, cmp_edges e)
{
    int64_t n = s->h.n;
    float *g = malloc(sizeof(float) * (size_t)n);
    cmp_fill(g, n, 0.1f, e);
    CHECK_OK(ctx, opf_convert(g, OPF_F32, (void *)s->h.grad, s->h.grad_dtype, (size_t)n));
    CHECK_OK(ctx, opf_cuda_copy(ctx, (void *)s->d.grad, s->h.grad, nb(s->h.grad_dtype, n),
                                OPF_CUDA_H2D));
    free(g);
}

/* NaN-tolerant: values equal bit for bit, or NaN on both sides. */
static void cmp_nan_ok(const float *ref, const float *got, int64_t n, const char *what)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bool same = !memcmp(&ref[i], &got[i], 4) || (isnan(ref[i]) && isnan(got[i]));
        if (!same && bad++ < CMP_SHOW)
            fprintf(stderr, "  %s: element %lld: cpu %a gpu %a\n", what, (long long)i,
                    (double)ref[i], (double)got[i]);
    }
    CHECK(bad == 0, "%s: %lld of %lld elements differ", what, (long long)bad, (long long)n);
}

/* An array of a slot after a step: exact, or when loose widened to f32 (exact
 * for numbers) and NaN-tolerant. */
static void cmp_array(opf_ctx *ctx, const void *ref, const void *dev, int64_t n, opf_dtype dt,
                      bool loose, const char *what)
{
    if (!loose) {
        cmp_device(ctx, ref, dev, n, nb(dt, 1), what);
        return;
    }
    void *raw = malloc(nb(dt, n));
    float *got = malloc(sizeof(float) * (size_t)n), *want = malloc(sizeof(float) * (size_t)n);
    CHECK_OK(ctx, opf_cuda_copy(ctx, raw, dev, nb(dt, n), OPF_CUDA_D2H));
    CHECK_OK(ctx, opf_convert(raw, dt, got, OPF_F32, (size_t)n));
    CHECK_OK(ctx, opf_convert(ref, dt, want, OPF_F32, (size_t)n));
    cmp_nan_ok(want, got, n, what);
    free(raw), free(got), free(want);
}

static void cmp_slot(opf_ctx *ctx, const slot *s, int t, int step, bool loose, const char *name)
{
    char what[128];
    int k = snprintf(what, sizeof what, "%s tensor %d (n %lld, grad %s, param %s) step %d", name, t,
                     (long long)s->h.n, opf_dtype_name(s->h.grad_dtype),
                     opf_dtype_name(s->h.param_dtype), step);
    int64_t n = s->h.n;
    snprintf(what + k, sizeof what - (size_t)k, " master");
    cmp_array(ctx, s->h.master, s->d.master, n, OPF_F32, loose, what);
    snprintf(what + k, sizeof what - (size_t)k, " m");
    if (s->h.m) cmp_array(ctx, s->h.m, s->d.m, n, OPF_F32, loose, what);
    snprintf(what + k, sizeof what - (size_t)k, " v");
    if (s->h.v) cmp_array(ctx, s->h.v, s->d.v, n, OPF_F32, loose, what);
    snprintf(what + k, sizeof what - (size_t)k, " param");
    cmp_array(ctx, s->h.param, s->d.param, n, s->h.param_dtype, loose, what);
}

/* count tensors of the given sizes, dtypes cycling through D, STEPS steps. */
static void run_case(opf_ctx *ctx, kind k, const int64_t *sizes, int count, cmp_edges e, int shift,
                     float wd, const char *name)
{
    slot s[MAX_T];
    opf_optim_tensor th[MAX_T], td[MAX_T];
    for (int t = 0; t < count; t++) {
        s[t] = make_slot(ctx, sizes[t], D[t % 3], D[(t / 3 + t) % 3], k, shift && t % 2);
        th[t] = s[t].h, td[t] = s[t].d;
    }
    for (int step = 1; step <= STEPS; step++) {
        for (int t = 0; t < count; t++) new_grads(ctx, &s[t], e);
        if (k == ADAMW) {
            CHECK_OK(ctx, cpu()->adamw(ctx, th, count, 1e-3f, 0.9f, 0.999f, 1e-8f, wd, step, NULL));
            CHECK_OK(ctx, gpu()->adamw(ctx, td, count, 1e-3f, 0.9f, 0.999f, 1e-8f, wd, step, NULL));
        } else {
            float mom = k == SGD_MOMENTUM ? 0.9f : 0.0f;
            CHECK_OK(ctx, cpu()->sgd(ctx, th, count, 0.01f, mom, wd, NULL));
            CHECK_OK(ctx, gpu()->sgd(ctx, td, count, 0.01f, mom, wd, NULL));
        }
        for (int t = 0; t < count; t++) cmp_slot(ctx, &s[t], t, step, e == EDGES_INF, name);
    }
    for (int t = 0; t < count; t++) free_slot(ctx, &s[t]);
}

/* One gradient element of tensor t made non-finite on both sides (the
 * last one, or the first of an even step), value v. */
static void poison(opf_ctx *ctx, slot *s, int step, float v)
{
    int64_t i = step % 2 ? s->h.n - 1 : 0;
    size_t es = nb(s->h.grad_dtype, 1);
    char *h = (char *)s->h.grad + (size_t)i * es;
    CHECK_OK(ctx, opf_convert(&v, OPF_F32, h, s->h.grad_dtype, 1));
    CHECK_OK(ctx, opf_cuda_copy(ctx, (char *)s->d.grad + (size_t)i * es, h, es, OPF_CUDA_H2D));
}

/* STEPS guarded steps on gradients with no edge values (3e38 is inf in an
 * f16 gradient), made non-finite at steps 3, 4 (NaN, Inf in different
 * tensors) and 7 (-Inf): the verdicts, the states after every
 * step (a skip changes nothing) and the skip counts equal the CPU's; the
 * host never reads the count (known 0), so AdamW's steps after a skip take
 * the device's bias corrections from the window. */
static void run_guarded(opf_ctx *ctx, kind k, const int64_t *sizes, int count, const char *name)
{
    slot s[MAX_T];
    opf_optim_tensor th[MAX_T], td[MAX_T];
    for (int t = 0; t < count; t++) {
        s[t] = make_slot(ctx, sizes[t], D[t % 3], D[(t / 3 + t) % 3], k, 0);
        th[t] = s[t].h, td[t] = s[t].d;
    }
    int64_t hwords[2] = {0, 0};  /* int32 verdict (and pad), int64 count */
    int64_t *dwords = cmp_upload(ctx, hwords, sizeof hwords);
    opf_optim_guard hg = {(int32_t *)&hwords[0], &hwords[1], 0};
    opf_optim_guard dg = {(int32_t *)&dwords[0], &dwords[1], 0};
    for (int step = 1; step <= STEPS; step++) {
        for (int t = 0; t < count; t++) new_grads(ctx, &s[t], EDGES_NONE);
        if (step == 3) poison(ctx, &s[count - 1], step, NAN);
        if (step == 4) poison(ctx, &s[step % count], step, INFINITY);
        if (step == 7) poison(ctx, &s[1], step, -INFINITY);
        CHECK_OK(ctx, cpu()->check(ctx, th, count, hg.found));
        CHECK_OK(ctx, gpu()->check(ctx, td, count, dg.found));
        int64_t got[2];
        CHECK_OK(ctx, opf_cuda_copy(ctx, got, dwords, sizeof got, OPF_CUDA_D2H));
        bool want = step == 3 || step == 4 || step == 7;
        CHECK((int32_t)hwords[0] == want && (int32_t)got[0] == want,
              "%s guarded step %d: verdict cpu %d gpu %d, want %d", name, step, (int)hwords[0],
              (int)(int32_t)got[0], (int)want);
        if (k == ADAMW) {
            CHECK_OK(ctx, cpu()->adamw(ctx, th, count, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, &hg));
            CHECK_OK(ctx, gpu()->adamw(ctx, td, count, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, &dg));
        } else {
            float mom = k == SGD_MOMENTUM ? 0.9f : 0.0f;
            CHECK_OK(ctx, cpu()->sgd(ctx, th, count, 0.01f, mom, 0.01f, &hg));
            CHECK_OK(ctx, gpu()->sgd(ctx, td, count, 0.01f, mom, 0.01f, &dg));
        }
        CHECK_OK(ctx, opf_cuda_copy(ctx, got, dwords, sizeof got, OPF_CUDA_D2H));
        CHECK(hwords[1] == got[1], "%s guarded step %d: skipped cpu %lld gpu %lld", name, step,
              (long long)hwords[1], (long long)got[1]);
        for (int t = 0; t < count; t++) cmp_slot(ctx, &s[t], t, step, false, name);
    }
    CHECK(hwords[1] == 3, "%s guarded: %lld steps skipped, want 3", name, (long long)hwords[1]);
    opf_cuda_free(ctx, dwords);
    for (int t = 0; t < count; t++) free_slot(ctx, &s[t]);
}

int main(void)
{
    opf_ctx *ctx = cuda_test_ctx();
    static const int64_t odd[] = {1, 7, 2048, 2049, 5000, 100003, 33, 8, 9, 4095};
    enum { N_ODD = sizeof odd / sizeof odd[0] };
    int64_t many[60];  /* more than one launch's batch */
    for (int t = 0; t < 60; t++) many[t] = 1 + (t * 37) % 300;
    static const struct { kind k; const char *name; } kinds[] = {
        {ADAMW, "adamw"}, {SGD_MOMENTUM, "sgd momentum"}, {SGD_PLAIN, "sgd"}};
    for (int i = 0; i < 3; i++) {
        for (int wd = 0; wd < 2; wd++)
            run_case(ctx, kinds[i].k, odd, N_ODD, EDGES_FINITE, 0, wd ? 0.01f : 0.0f, kinds[i].name);
        run_case(ctx, kinds[i].k, odd, N_ODD, EDGES_FINITE, 1, 0.01f, kinds[i].name);
        run_case(ctx, kinds[i].k, many, 60, EDGES_FINITE, 0, 0.01f, kinds[i].name);
        run_case(ctx, kinds[i].k, odd, N_ODD, EDGES_NAN, 0, 0.01f, kinds[i].name);
        run_case(ctx, kinds[i].k, odd, N_ODD, EDGES_INF, 0, 0.01f, kinds[i].name);
        run_guarded(ctx, kinds[i].k, odd, N_ODD, kinds[i].name);
        run_guarded(ctx, kinds[i].k, many, 60, kinds[i].name);
    }
    cuda_test_done(ctx);
    TEST_DONE();
}
#endif
