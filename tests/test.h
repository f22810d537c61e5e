/* test.h: the tiny harness every C test uses.
 *
 * CHECK(cond, fmt, ...) counts a pass or prints the failure with file:line;
 * TEST_DONE() prints "N passed, N failed" and returns the exit status. */
#ifndef OPFUSE_TEST_H
#define OPFUSE_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opfuse.h"

static int opf_test_pass, opf_test_fail;

#define CHECK(cond, ...)                                                         \
    do {                                                                         \
        if (cond) {                                                              \
            opf_test_pass++;                                                     \
        } else {                                                                 \
            opf_test_fail++;                                                     \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                        \
            fputc('\n', stderr);                                                 \
        }                                                                        \
    } while (0)

/* Checks a status and, on failure, prints the context's message. */
#define CHECK_OK(ctx, expr)                                                      \
    do {                                                                         \
        opf_status st_ = (expr);                                                 \
        CHECK(st_ == OPF_OK, "%s -> %s: %s", #expr, opf_status_str(st_),         \
              opf_last_error(ctx));                                              \
    } while (0)

/* Checks that expr fails with status want and leaves a message that contains
 * each of the given substrings (a NULL-terminated list). */
static inline int opf_test_msg_has(const char *msg, const char *const *subs)
{
    for (; *subs; subs++)
        if (!strstr(msg, *subs)) return 0;
    return 1;
}
#define CHECK_FAILS(ctx, expr, want, ...)                                        \
    do {                                                                         \
        opf_status st_ = (expr);                                                 \
        const char *subs_[] = {__VA_ARGS__, NULL};                               \
        CHECK(st_ == (want) && opf_test_msg_has(opf_last_error(ctx), subs_),     \
              "%s -> %s (want %s): \"%s\"", #expr, opf_status_str(st_),          \
              opf_status_str(want), opf_last_error(ctx));                        \
    } while (0)

#define TEST_DONE()                                                              \
    do {                                                                         \
        printf("%d passed, %d failed\n", opf_test_pass, opf_test_fail);          \
        return opf_test_fail ? 1 : 0;                                            \
    } while (0)

/* Same spec and the same bytes in every component the layout has. */
static inline bool opf_test_same_bytes(const opf_tensor *a, const opf_tensor *b)
{
    if (!opf_spec_equal(&a->spec, &b->spec)) return false;
    opf_layout L;
    if (opf_spec_layout(&a->spec, &L)) return false;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && L.comp[c].nbytes && memcmp(a->data[c], b->data[c], L.comp[c].nbytes))
            return false;
    return true;
}

/* Same bytes ignoring the logical dtype (quantized copies of different
 * high-precision tensors). */
static inline bool opf_test_same_qbytes(const opf_tensor *a, const opf_tensor *b)
{
    opf_tensor x = *a, y = *b;
    x.spec.dtype = y.spec.dtype = OPF_F32;
    return opf_test_same_bytes(&x, &y);
}

/* A plain tensor of vals rounded to dt; *rounded (may be NULL) gets the
 * stored values. The caller releases it. */
static inline opf_tensor opf_test_make_tensor(opf_ctx *ctx, int ndim, const int64_t *shape,
                                              opf_dtype dt, const double *vals, double *rounded)
{
    opf_spec s = opf_spec_make(ndim, shape, dt);
    int64_t n = opf_spec_numel(&s);
    float *f = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) f[i] = (float)vals[i];
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    CHECK_OK(ctx, opf_convert(f, OPF_F32, t.data[0], dt, (size_t)n));
    CHECK_OK(ctx, opf_convert(t.data[0], dt, f, OPF_F32, (size_t)n));
    if (rounded)
        for (int64_t i = 0; i < n; i++) rounded[i] = f[i];
    free(f);
    return t;
}

/* The values of t (plain, or the rowwise copy of a quantized tensor). */
static inline void opf_test_decode(opf_ctx *ctx, const opf_tensor *t, double *out)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *f = malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (t->spec.scaling == OPF_SCALING_NONE) {
        CHECK_OK(ctx, opf_convert(t->data[0], t->spec.dtype, f, OPF_F32, (size_t)n));
    } else {
        opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
        opf_tensor w;
        CHECK_OK(ctx, opf_tensor_wrap(&s, f, &w));
        CHECK_OK(ctx, opf_dequantize(ctx, t, OPF_USAGE_ROWWISE, &w));
    }
    for (int64_t i = 0; i < n; i++) out[i] = f[i];
    free(f);
}

/* Warnings caught from a context: how many contained filter (every one when
 * it is NULL) and the text of the last of them. */
typedef struct opf_test_warnings {
    const char *filter;
    int         n;
    char        last[512];
} opf_test_warnings;

static inline void opf_test_on_warn(void *user, const char *msg)
{
    opf_test_warnings *w = user;
    if (w->filter && !strstr(msg, w->filter)) return;
    w->n++;
    snprintf(w->last, sizeof w->last, "%s", msg);
}

/* A CPU context whose warnings go to *w (cleared, filter kept). */
static inline opf_ctx *opf_test_ctx_catching(opf_test_warnings *w)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.warn = opf_test_on_warn, o.warn_user = w;
    w->n = 0, w->last[0] = '\0';
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(&o, &ctx));
    return ctx;
}

/* One forward and backward of seq on f32 [rows, cols] host arrays x and dy
 * under recipe (NULL: unquantized), from zeroed gradients; the outputs are
 * dropped (the caller reads parameters, gradients and recipe state). */
static inline void opf_test_fwd_bwd(opf_ctx *ctx, opf_seq *seq, const opf_recipe *recipe,
                                    int64_t rows, int64_t cols, float *x, float *dy)
{
    opf_spec sp = {.ndim = 2, .shape = {rows, cols}, .dtype = OPF_F32};
    opf_tensor xt, dyt, y, dx;
    opf_tensor_wrap(&sp, x, &xt);
    opf_tensor_wrap(&sp, dy, &dyt);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = recipe;
    opf_seq_zero_grad(seq);
    CHECK_OK(ctx, opf_seq_forward(seq, &xt, &call, &y, NULL));
    CHECK_OK(ctx, opf_seq_backward(seq, &dyt, NULL, &dx, NULL));
    opf_tensor_release(&y);
    opf_tensor_release(&dx);
}

/* The library's column sum (numerics.md 6.4), written out for the tests: for
 * column j of x [rows, cols], 32 partial sums, row r into partial r % 32 in
 * row order, then partial i += partial i + h for h = 16, 8, 4, 2, 1. */
static inline float opf_test_lane_colsum(const float *x, int64_t rows, int64_t cols, int64_t j)
{
    float part[32] = {0};
    for (int64_t r = 0; r < rows; r++) part[r % 32] += x[r * cols + j];
    for (int h = 16; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) part[i] += part[i + h];
    return part[0];
}

/* Deterministic test randomness (splitmix64). */
static inline unsigned long long opf_test_rand_u64(unsigned long long *s)
{
    unsigned long long z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* Uniform in [lo, hi). */
static inline float opf_test_uniform(unsigned long long *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)((opf_test_rand_u64(s) >> 40) * (1.0 / 16777216.0));
}
/* Normal(0, sigma) by Box-Muller. */
static inline float opf_test_normal(unsigned long long *s, float sigma)
{
    double u1 = ((opf_test_rand_u64(s) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    double u2 = (opf_test_rand_u64(s) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sigma * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

#endif
