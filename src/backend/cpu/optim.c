/* optim.c: the CPU reference kernels for SGD and AdamW steps over many tensors
 * at once. Each tensor goes in chunks: its gradient widened to fp32, the
 * update of the master weights and moments, then the write-back in the
 * parameter's dtype. Every element is independent, so the chunks may run on
 * any number of threads with the same bits. */
#include <math.h>
#include <omp.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend/cpu/cpu-impl.h"
#include "backend/optim.h"
#include "core/core-impl.h"

enum {
    CHUNK = 2048,        /* elements per unit of work; its fp32 gradient sits on the stack */
    PAR_MIN = 1 << 15,   /* below this many elements one thread is faster */
};

typedef struct step_params {
    bool  adamw;
    float lr, momentum, weight_decay;  /* SGD; lr and weight_decay also AdamW */
    float beta1, beta2, eps, bc1, bc2; /* AdamW, bc = 1 - beta^step */
} step_params;

static void sgd_run(const step_params *p, const opf_optim_tensor *t, int64_t i0, int64_t len,
                    const float *g)
{
    float *w = t->master + i0, *m = t->m ? t->m + i0 : NULL;
    for (int64_t i = 0; i < len; i++) {
        float d = g[i] + p->weight_decay * w[i];
        if (m) d = m[i] = p->momentum * m[i] + d;
        w[i] -= p->lr * d;
    }
}

static void adamw_run(const step_params *p, const opf_optim_tensor *t, int64_t i0, int64_t len,
                      const float *g)
{
    float *w = t->master + i0, *m = t->m + i0, *v = t->v + i0;
    for (int64_t i = 0; i < len; i++) {
        m[i] = p->beta1 * m[i] + (1.0f - p->beta1) * g[i];
        v[i] = p->beta2 * v[i] + (1.0f - p->beta2) * g[i] * g[i];
        float mh = m[i] / p->bc1, vh = v[i] / p->bc2;
        w[i] -= p->lr * (mh / (sqrtf(vh) + p->eps) + p->weight_decay * w[i]);
    }
}

/* Elements [i0, i0 + len) of one tensor. The conversions are opf_convert's
 * (exact widening; one rounding per element on the way back). */
static void step_chunk(const step_params *p, const opf_optim_tensor *t, int64_t i0, int64_t len)
{
    float gbuf[CHUNK];
    const float *g = (const float *)t->grad + i0;
    if (t->grad_dtype != OPF_F32) {
        opf_convert((const char *)t->grad + opf_dtype_nbytes(t->grad_dtype, (size_t)i0),
                    t->grad_dtype, gbuf, OPF_F32, (size_t)len);
        g = gbuf;
    }
    if (p->adamw) adamw_run(p, t, i0, len, g);
    else sgd_run(p, t, i0, len, g);
    opf_convert(t->master + i0, OPF_F32,
                (char *)t->param + opf_dtype_nbytes(t->param_dtype, (size_t)i0), t->param_dtype,
                (size_t)len);
}

static opf_status step_all(opf_ctx *ctx, const step_params *p, const opf_optim_tensor *t,
                           int count)
{
    for (int k = 0; k < count; k++) {
        int64_t n = t[k].n, nchunks = opf_ceil_div(n, CHUNK);
        int nt = opf_cpu_threads(ctx, n, PAR_MIN);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t c = 0; c < nchunks; c++)
            step_chunk(p, &t[k], c * CHUNK, n - c * CHUNK < CHUNK ? n - c * CHUNK : CHUNK);
    }
    return OPF_OK;
}

/* Non-finite elements among n of a gradient: an all-ones exponent, read
 * from the bits. u & e <= e with equality exactly there, so the largest
 * u & e tells (a vectorized max reduction). */
static bool nonfinite(const void *g, opf_dtype dt, int64_t n)
{
    if (dt == OPF_F32) {
        const uint32_t *u = g;
        uint32_t mx = 0;
#pragma omp simd reduction(max : mx)
        for (int64_t i = 0; i < n; i++) mx = (u[i] & 0x7f800000u) > mx ? u[i] & 0x7f800000u : mx;
        return mx == 0x7f800000u;
    }
    const uint16_t *u = g;
    uint16_t e = dt == OPF_BF16 ? 0x7f80 : 0x7c00, mx = 0;
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < n; i++) mx = (uint16_t)(u[i] & e) > mx ? (uint16_t)(u[i] & e) : mx;
    return mx == e;
}

static opf_status cpu_check(opf_ctx *ctx, const opf_optim_tensor *t, int count, int32_t *found)
{
    int32_t hit = 0;
    for (int k = 0; k < count && !hit; k++) {
        int64_t n = t[k].n, nchunks = opf_ceil_div(n, CHUNK);
        size_t es = opf_dtype_nbytes(t[k].grad_dtype, 1);
        int nt = opf_cpu_threads(ctx, n, PAR_MIN);
#pragma omp parallel for num_threads(nt) schedule(static) reduction(| : hit)
        for (int64_t c = 0; c < nchunks; c++)
            hit |= nonfinite((const char *)t[k].grad + (size_t)(c * CHUNK) * es, t[k].grad_dtype,
                             n - c * CHUNK < CHUNK ? n - c * CHUNK : CHUNK);
    }
    *found = hit;
    return OPF_OK;
}

/* A guard's verdict in host memory (the CPU's caller passes none). */
static bool guarded_skip(const opf_optim_guard *g)
{
    if (!g || !*g->found) return false;
    ++*g->skipped;
    return true;
}

static opf_status cpu_sgd(opf_ctx *ctx, const opf_optim_tensor *t, int count, float lr,
                          float momentum, float weight_decay, const opf_optim_guard *guard)
{
    if (guarded_skip(guard)) return OPF_OK;
    step_params p = {.lr = lr, .momentum = momentum, .weight_decay = weight_decay};
    return step_all(ctx, &p, t, count);
}

static opf_status cpu_adamw(opf_ctx *ctx, const opf_optim_tensor *t, int count, float lr,
                            float beta1, float beta2, float eps, float weight_decay, int64_t step,
                            const opf_optim_guard *guard)
{
    if (guarded_skip(guard)) return OPF_OK;
    step -= guard ? *guard->skipped - guard->known : 0;
    step_params p = {.adamw = true, .lr = lr, .weight_decay = weight_decay, .beta1 = beta1,
                     .beta2 = beta2, .eps = eps, .bc1 = 1.0f - powf(beta1, (float)step),
                     .bc2 = 1.0f - powf(beta2, (float)step)};
    return step_all(ctx, &p, t, count);
}

const opf_optim_kernels opf_cpu_optim = {
    .check = cpu_check,
    .sgd = cpu_sgd,
    .adamw = cpu_adamw,
};
