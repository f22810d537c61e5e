/* optim.cu: SGD and AdamW over many tensors on the GPU (backend/optim.h),
 * bit for bit with src/backend/cpu/optim.c.
 *
 * Multi-tensor launches: up to BATCH tensors' descriptors travel in the
 * kernel's parameters (copied at launch: nothing for the caller to keep
 * alive, no device table to allocate), with the prefix sums of their chunk
 * counts; each block takes chunks in a grid-stride loop and finds its
 * tensor by binary search, so one launch spreads every tensor of the batch
 * over all SMs whatever their sizes.
 *
 * The per-element operations are the CPU's, in its order, one IEEE fp32
 * operation at a time (no FMA contraction), with x86's NaN bits where a NaN
 * comes out (opf_dev_add and friends, cuda-impl.h; a rare branch). The
 * AdamW bias corrections are computed on the host with the same powf as the
 * CPU and passed in, for the OPF_OPTIM_BC_WINDOW steps the device may be at
 * (backend/optim.h: skipped steps the host has not seen yet).
 *
 * Non-finite gradients: check_kernel writes the verdict to the guard's
 * device word, the step kernels read it and return at once when it is set,
 * and tally_kernel counts the skip after the last batch: no host wait. */
#include <math.h>

#include "backend/cuda/cuda-impl.h"
#include "backend/optim.h"

enum {
    THREADS = 256,
    VEC = 8,                    /* elements per thread and chunk */
    CHUNK = THREADS * VEC,      /* elements per block and chunk */
    BATCH = 256,                /* tensors per launch (fewer launches, fewer tails): the
                                 * parameters, 16 KiB, within the 32 KiB that Hopper and
                                 * CUDA 12.1 on allow */
};

/* One tensor of a launch: its arrays and dtypes. vec: every array 16-byte
 * aligned (16-byte accesses for whole 8-element runs). */
typedef struct desc {
    const void *grad;
    float      *master, *m, *v;
    void       *param;
    int64_t     n;
    uint8_t     grad_dtype, param_dtype, vec;
} desc;

typedef struct batch {
    desc    t[BATCH];
    int64_t first[BATCH + 1];  /* first[k]: the first chunk of tensor k; first[count]: all */
    int     count;
} batch;

typedef struct step_params {
    bool  adamw;
    float lr, momentum, weight_decay;
    float beta1, beta2, eps, bc1, bc2;
    /* the guard (NULL found: none); bc[j]: the corrections of step - j */
    const int32_t *found;
    const int64_t *skipped;
    int64_t        known, step;
    float          bc[2][OPF_OPTIM_BC_WINDOW];
} step_params;

/* The arithmetic of the step, two ways: plain IEEE operations (fast), and
 * the same with x86's NaN bits (x86). With no NaN among the results no
 * operation met or made one (each propagates NaN into w, m or v), so the
 * two agree; a NaN result is computed again the x86 way. */
template <bool X86> struct ops {
    static __device__ __forceinline__ float add(float a, float b)
    {
        return X86 ? opf_dev_add(a, b) : __fadd_rn(a, b);
    }
    static __device__ __forceinline__ float sub(float a, float b)
    {
        return X86 ? opf_dev_sub(a, b) : __fsub_rn(a, b);
    }
    static __device__ __forceinline__ float mul(float a, float b)
    {
        return X86 ? opf_dev_mul(a, b) : __fmul_rn(a, b);
    }
    static __device__ __forceinline__ float div(float a, float b)
    {
        return X86 ? opf_dev_div(a, b) : __fdiv_rn(a, b);
    }
    static __device__ __forceinline__ float sqrt(float a) { return X86 ? opf_dev_sqrt(a) : __fsqrt_rn(a); }
};
typedef ops<false> fast_ops;
typedef ops<true> x86_ops;

/* The CPU's sgd_run for one element (has_m: with momentum). */
template <class O>
__device__ __forceinline__ void sgd_math(const step_params &p, float g, float &w, bool has_m, float &m)
{
    float d = O::add(g, O::mul(p.weight_decay, w));
    if (has_m) d = m = O::add(O::mul(p.momentum, m), d);
    w = O::sub(w, O::mul(p.lr, d));
}

/* The CPU's adamw_run for one element. */
template <class O>
__device__ __forceinline__ void adamw_math(const step_params &p, float g, float &w, float &m, float &v)
{
    float omb1 = __fsub_rn(1.0f, p.beta1), omb2 = __fsub_rn(1.0f, p.beta2);
    m = O::add(O::mul(p.beta1, m), O::mul(omb1, g));
    v = O::add(O::mul(p.beta2, v), O::mul(O::mul(omb2, g), g));
    float mh = O::div(m, p.bc1), vh = O::div(v, p.bc2);
    float upd = O::add(O::div(mh, O::add(O::sqrt(vh), p.eps)), O::mul(p.weight_decay, w));
    w = O::sub(w, O::mul(p.lr, upd));
}

/* The step of 8 elements in place with the operation set O. */
template <class O>
__device__ __forceinline__ void math8(const step_params &p, const float g[VEC], float w[VEC],
                                      bool has_m, float m[VEC], float v[VEC])
{
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        if (p.adamw) adamw_math<O>(p, g[k], w[k], m[k], v[k]);
        else sgd_math<O>(p, g[k], w[k], has_m, m[k]);
    }
}

/* Elements [i0, i0 + w) of one tensor's inputs as fp32 (zeros for absent
 * moments and past w). */
template <opf_dtype DG>
__device__ __forceinline__ void load8(const desc &t, int64_t i0, int w, bool vec, float g[VEC],
                                      float wv[VEC], float mv[VEC], float vv[VEC])
{
    typedef typename opf_dev_plain<DG>::store SG;
    opf_dev_load8_as<DG>((const SG *)t.grad + i0, vec, w, g);
    opf_dev_load8_as<OPF_F32>(t.master + i0, vec, w, wv);
#pragma unroll
    for (int k = 0; k < VEC; k++) mv[k] = vv[k] = 0.0f;
    if (t.m) opf_dev_load8_as<OPF_F32>(t.m + i0, vec, w, mv);
    if (t.v) opf_dev_load8_as<OPF_F32>(t.v + i0, vec, w, vv);
}

/* 8 values (vec: 16-byte stores) or the first w. */
template <opf_dtype D> __device__ __forceinline__ void store8(void *p, bool vec, int w, const float v[VEC])
{
    if (vec) opf_dev_store8_vec<D>(p, v);
    else opf_dev_store8_as<D>(p, false, w, v);
}

/* Elements [i0, i0 + w) of one tensor, w <= 8; vec: w == 8 and aligned.
 * Plain IEEE operations first; only when a NaN comes out are the inputs
 * (not yet overwritten) loaded again and the 8 done the x86 way, so the
 * common path keeps no copy of them in registers. */
template <opf_dtype DG, opf_dtype DP>
__device__ __forceinline__ void step8(const step_params &p, const desc &t, int64_t i0, int w,
                                      bool vec)
{
    typedef typename opf_dev_plain<DP>::store SP;
    float g[VEC], wv[VEC], mv[VEC], vv[VEC];
    load8<DG>(t, i0, w, vec, g, wv, mv, vv);
    math8<fast_ops>(p, g, wv, t.m != NULL, mv, vv);
    bool nan = false;
#pragma unroll
    for (int k = 0; k < VEC; k++) nan |= isnan(wv[k]) | isnan(mv[k]) | isnan(vv[k]);
    if (__builtin_expect(nan, 0)) {
        load8<DG>(t, i0, w, vec, g, wv, mv, vv);
        math8<x86_ops>(p, g, wv, t.m != NULL, mv, vv);
    }
    store8<OPF_F32>(t.master + i0, vec, w, wv);
    if (t.m) store8<OPF_F32>(t.m + i0, vec, w, mv);
    if (t.v) store8<OPF_F32>(t.v + i0, vec, w, vv);
    store8<DP>((SP *)t.param + i0, vec, w, wv);
}

template <opf_dtype DG>
__device__ __forceinline__ void step8_param(const step_params &p, const desc &t, int64_t i0, int w,
                                            bool vec)
{
    switch (t.param_dtype) {
    case OPF_F32: step8<DG, OPF_F32>(p, t, i0, w, vec); break;
    case OPF_BF16: step8<DG, OPF_BF16>(p, t, i0, w, vec); break;
    default: step8<DG, OPF_F16>(p, t, i0, w, vec); break;
    }
}

/* 1 - beta^step the host's way when the host computed it, else here (pow
 * in double, rounded: powf's value but for a rare last bit). */
__device__ __forceinline__ float bias_correction(const step_params &p, int which, int64_t lag)
{
    if (lag < OPF_OPTIM_BC_WINDOW) return p.bc[which][lag];
    double beta = which ? p.beta2 : p.beta1;
    return __fsub_rn(1.0f, (float)pow(beta, (double)(p.step - lag)));
}

__global__ void __launch_bounds__(THREADS) step_kernel(const __grid_constant__ batch b, step_params p)
{
    if (p.found) {
        if (*p.found) return;  /* a non-finite gradient: the step is skipped */
        int64_t lag = *p.skipped - p.known;
        if (p.adamw) p.bc1 = bias_correction(p, 0, lag), p.bc2 = bias_correction(p, 1, lag);
    }
    for (int64_t c = blockIdx.x; c < b.first[b.count]; c += gridDim.x) {
        int k = opf_dev_chunk_owner(b.first, b.count, c);
        const desc &t = b.t[k];
        int64_t i0 = (c - b.first[k]) * CHUNK + threadIdx.x * VEC;
        if (i0 >= t.n) continue;
        int w = t.n - i0 < VEC ? (int)(t.n - i0) : VEC;
        bool vec = t.vec && w == VEC;
        switch (t.grad_dtype) {
        case OPF_F32: step8_param<OPF_F32>(p, t, i0, w, vec); break;
        case OPF_BF16: step8_param<OPF_BF16>(p, t, i0, w, vec); break;
        default: step8_param<OPF_F16>(p, t, i0, w, vec); break;
        }
    }
}

/* Non-finite among 8 elements of a gradient: an all-ones exponent. */
template <opf_dtype DG> __device__ __forceinline__ bool nonfinite8(const desc &t, int64_t i0, int w)
{
    typedef typename opf_dev_plain<DG>::store SG;
    float g[VEC];
    opf_dev_load8_as<DG>((const SG *)t.grad + i0, false, w, g);  /* exact widening */
    bool hit = false;
#pragma unroll
    for (int k = 0; k < VEC; k++) hit |= !isfinite(g[k]);
    return hit;
}

/* *found = 1 when some gradient of the batch is not finite (zeroed before). */
__global__ void __launch_bounds__(THREADS) check_kernel(const __grid_constant__ batch b, int32_t *found)
{
    for (int64_t c = blockIdx.x; c < b.first[b.count]; c += gridDim.x) {
        int k = opf_dev_chunk_owner(b.first, b.count, c);
        const desc &t = b.t[k];
        int64_t i0 = (c - b.first[k]) * CHUNK + threadIdx.x * VEC;
        bool hit = false;
        if (i0 < t.n) {
            int w = t.n - i0 < VEC ? (int)(t.n - i0) : VEC;
            switch (t.grad_dtype) {
            case OPF_F32: hit = nonfinite8<OPF_F32>(t, i0, w); break;
            case OPF_BF16: hit = nonfinite8<OPF_BF16>(t, i0, w); break;
            default: hit = nonfinite8<OPF_F16>(t, i0, w); break;
            }
        }
        if (__syncthreads_or(hit) && threadIdx.x == 0) *found = 1;  /* every writer writes 1 */
    }
}

/* After a step's last batch: one more skipped step when it was skipped. */
__global__ void tally_kernel(const int32_t *found, int64_t *skipped)
{
    if (*found) ++*skipped;
}

/* ---- host side ----------------------------------------------------------- */

static bool all_aligned(const opf_optim_tensor &t)
{
    return opf_cuda_aligned16(t.grad) && opf_cuda_aligned16(t.master) &&
           (!t.m || opf_cuda_aligned16(t.m)) && (!t.v || opf_cuda_aligned16(t.v)) &&
           opf_cuda_aligned16(t.param);
}

/* The launch descriptors of up to BATCH tensors from t (empty ones skipped). */
static void fill_batch(batch &b, const opf_optim_tensor *t, int count)
{
    b.count = 0;
    b.first[0] = 0;
    for (int k = 0; k < count; k++) {
        if (t[k].n <= 0) continue;
        desc &d = b.t[b.count];
        d.grad = t[k].grad, d.master = t[k].master, d.m = t[k].m, d.v = t[k].v;
        d.param = t[k].param, d.n = t[k].n;
        d.grad_dtype = (uint8_t)t[k].grad_dtype, d.param_dtype = (uint8_t)t[k].param_dtype;
        d.vec = all_aligned(t[k]);
        b.first[b.count + 1] = b.first[b.count] + opf_ceil_div(t[k].n, CHUNK);
        b.count++;
    }
}

static unsigned grid_of(const opf_cuda_state *s, const batch &b)
{
    int64_t chunks = b.first[b.count], cap = (int64_t)s->sm_count * (2048 / THREADS);
    return (unsigned)(chunks < cap ? chunks : cap);
}

/* The step over every tensor, BATCH per launch; found: check, not step. */
static opf_status launch_all(opf_ctx *ctx, const char *fn, const step_params *p,
                             const opf_optim_tensor *t, int count, int32_t *found)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    batch b;
    for (int k = 0; k < count; k += BATCH) {
        fill_batch(b, t + k, count - k < BATCH ? count - k : BATCH);
        if (b.count == 0) continue;
        if (found) check_kernel<<<grid_of(s, b), THREADS, 0, s->stream>>>(b, found);
        else step_kernel<<<grid_of(s, b), THREADS, 0, s->stream>>>(b, *p);
        OPF_CUDA_LAUNCHED(ctx, fn);
    }
    return OPF_OK;
}

static opf_status cuda_check(opf_ctx *ctx, const opf_optim_tensor *t, int count, int32_t *found)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "optim check");
    if (!s) return OPF_ERR_STATE;
    OPF_CUDA_TRY(ctx, "optim check", cudaMemsetAsync(found, 0, sizeof *found, s->stream));
    return launch_all(ctx, "optim check", NULL, t, count, found);
}

/* The step, and with a guard the skip's count after it. */
static opf_status step_all(opf_ctx *ctx, const char *fn, step_params &p, const opf_optim_tensor *t,
                           int count, const opf_optim_guard *g)
{
    if (g) p.found = g->found, p.skipped = g->skipped, p.known = g->known;
    opf_status st = launch_all(ctx, fn, &p, t, count, NULL);
    if (st || !g) return st;
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    tally_kernel<<<1, 1, 0, s->stream>>>(g->found, g->skipped);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

static opf_status cuda_sgd(opf_ctx *ctx, const opf_optim_tensor *t, int count, float lr,
                           float momentum, float weight_decay, const opf_optim_guard *g)
{
    step_params p = {};
    p.lr = lr, p.momentum = momentum, p.weight_decay = weight_decay;
    return step_all(ctx, "sgd", p, t, count, g);
}

/* The bias corrections as the CPU computes them (optim.c), on the host: of
 * step, and with a guard of the steps before it too (skips not yet seen). */
static opf_status cuda_adamw(opf_ctx *ctx, const opf_optim_tensor *t, int count, float lr,
                             float beta1, float beta2, float eps, float weight_decay, int64_t step,
                             const opf_optim_guard *g)
{
    step_params p = {};
    p.adamw = true, p.lr = lr, p.weight_decay = weight_decay;
    p.beta1 = beta1, p.beta2 = beta2, p.eps = eps, p.step = step;
    p.bc1 = 1.0f - powf(beta1, (float)step);
    p.bc2 = 1.0f - powf(beta2, (float)step);
    for (int j = 0; g && j < OPF_OPTIM_BC_WINDOW && step - j >= 1; j++) {
        p.bc[0][j] = 1.0f - powf(beta1, (float)(step - j));
        p.bc[1][j] = 1.0f - powf(beta2, (float)(step - j));
    }
    return step_all(ctx, "adamw", p, t, count, g);
}

extern "C" const opf_optim_kernels opf_cuda_optim = {
    /* .check = */ cuda_check,
    /* .sgd = */ cuda_sgd,
    /* .adamw = */ cuda_adamw,
};
