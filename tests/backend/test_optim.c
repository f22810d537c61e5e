/* test_optim.c: the optim family of the CPU kernel table (backend/optim.h)
 * called directly over several tensors at once (f32, bf16 and f16 gradients
 * and parameters; sizes below a chunk, over several chunks, and large enough
 * for several threads), bit for bit against a one-element-at-a-time
 * reference of the SGD (with and without momentum) and AdamW updates, over
 * a few steps. */
#include "backend/backend-impl.h"
#include "test.h"

static const opf_optim_kernels *K;

static uint32_t rng = 777u;
static float next_f(void)
{
    rng = rng * 1664525u + 1013904223u;
    return ((float)((rng >> 8) % 20001) - 10000.0f) / 4093.0f;
}

enum { NT = 3 };
static const int64_t kN[NT] = {5, 5000, 70001};
static const opf_dtype kGrad[NT] = {OPF_F32, OPF_BF16, OPF_F16};
static const opf_dtype kParam[NT] = {OPF_F32, OPF_BF16, OPF_BF16};

/* One tensor's arrays, twice: the kernel's and the reference's. */
typedef struct arrays {
    void  *grad, *param;
    float *master, *m, *v;
} arrays;

static void make(arrays *a, int k)
{
    size_t n = (size_t)kN[k];
    a->grad = malloc(opf_dtype_nbytes(kGrad[k], n));
    a->param = malloc(opf_dtype_nbytes(kParam[k], n));
    a->master = malloc(n * sizeof(float));
    a->m = calloc(n, sizeof(float));
    a->v = calloc(n, sizeof(float));
    for (size_t i = 0; i < n; i++) a->master[i] = next_f();
}

static void fill_grad(arrays *a, arrays *b, int k)
{
    size_t n = (size_t)kN[k];
    float *g = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) g[i] = next_f() * 0.01f;
    opf_convert(g, OPF_F32, a->grad, kGrad[k], n);
    opf_convert(g, OPF_F32, b->grad, kGrad[k], n);
    free(g);
}

static void drop(arrays *a)
{
    free(a->grad), free(a->param), free(a->master), free(a->m), free(a->v);
}

/* The reference, one element at a time, in the order of the original
 * optimizer: widen g, update, write the parameter back. */
static void ref_step(arrays *a, int k, bool adamw, bool momentum, int64_t step)
{
    const float lr = 0.01f, mom = 0.9f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.01f;
    float bc1 = 1.0f - powf(b1, (float)step), bc2 = 1.0f - powf(b2, (float)step);
    for (int64_t i = 0; i < kN[k]; i++) {
        float g, *w = &a->master[i], *m = &a->m[i], *v = &a->v[i];
        opf_convert((const char *)a->grad + opf_dtype_nbytes(kGrad[k], (size_t)i), kGrad[k], &g,
                    OPF_F32, 1);
        if (adamw) {
            *m = b1 * *m + (1.0f - b1) * g;
            *v = b2 * *v + (1.0f - b2) * g * g;
            float mh = *m / bc1, vh = *v / bc2;
            *w -= lr * (mh / (sqrtf(vh) + eps) + wd * *w);
        } else {
            float d = g + wd * *w;
            if (momentum) d = *m = mom * *m + d;
            *w -= lr * d;
        }
        opf_convert(w, OPF_F32, (char *)a->param + opf_dtype_nbytes(kParam[k], (size_t)i),
                    kParam[k], 1);
    }
}

static bool same(const arrays *a, const arrays *b, int k)
{
    size_t n = (size_t)kN[k];
    return !memcmp(a->master, b->master, n * 4) && !memcmp(a->m, b->m, n * 4) &&
           !memcmp(a->v, b->v, n * 4) &&
           !memcmp(a->param, b->param, opf_dtype_nbytes(kParam[k], n));
}

static void run(opf_ctx *ctx, bool adamw, bool momentum)
{
    arrays got[NT], want[NT];
    opf_optim_tensor t[NT];
    for (int k = 0; k < NT; k++) {
        make(&got[k], k);
        make(&want[k], k);
        memcpy(want[k].master, got[k].master, (size_t)kN[k] * sizeof(float));
        t[k] = (opf_optim_tensor){.grad = got[k].grad, .grad_dtype = kGrad[k],
                                  .master = got[k].master,
                                  .m = adamw || momentum ? got[k].m : NULL,
                                  .v = adamw ? got[k].v : NULL, .param = got[k].param,
                                  .param_dtype = kParam[k], .n = kN[k]};
    }
    for (int64_t step = 1; step <= 3; step++) {
        for (int k = 0; k < NT; k++) fill_grad(&got[k], &want[k], k);
        if (adamw) CHECK_OK(ctx, K->adamw(ctx, t, NT, 0.01f, 0.9f, 0.999f, 1e-8f, 0.01f, step, NULL));
        else CHECK_OK(ctx, K->sgd(ctx, t, NT, 0.01f, momentum ? 0.9f : 0.0f, 0.01f, NULL));
        for (int k = 0; k < NT; k++) {
            ref_step(&want[k], k, adamw, momentum, step);
            CHECK(same(&got[k], &want[k], k), "%s%s step %lld tensor %d (n %lld, %s grad): "
                  "differs from the reference", adamw ? "adamw" : "sgd",
                  momentum ? " with momentum" : "", (long long)step, k, (long long)kN[k],
                  opf_dtype_name(kGrad[k]));
        }
    }
    for (int k = 0; k < NT; k++) drop(&got[k]), drop(&want[k]);
}

int main(void)
{
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    K = opf_backend_get(OPF_DEVICE_CPU)->optim;
    run(ctx, false, false);
    run(ctx, false, true);
    run(ctx, true, false);
    CHECK_OK(ctx, K->sgd(ctx, NULL, 0, 0.01f, 0.0f, 0.0f, NULL));  /* no tensors: nothing to do */
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
