/* act.cu: the activations on the GPU (backend/act.h), bit for bit with
 * src/backend/cpu/act.c.
 *
 * The element functions are act-math.h's own, compiled for the device (the
 * header's functions are OPF_HD): the same exp, tanh and sigmoid written
 * with fp32 +, -, *, / and bit operations, the same constants and grouping.
 * With -fmad=false (CMakeLists.txt) and IEEE division every operation
 * rounds once as on the CPU. NaN results are NaN on both devices, with
 * each hardware's own bits.
 *
 * Element-wise passes (forward, backward, the GLUs and their scaled form)
 * are grid-stride loops over 4 floats a thread (16-byte accesses when the
 * shapes and bases allow). The two entries with ordered sums are one kernel
 * each: dact + dbias is colsum.cuh's column sum (lanesum.h's order) of terms
 * that write dx as they go, its staged kernel at spread 2 (two threads
 * compute the terms of each ordered sum: the derivative is ~110
 * instructions a term); the scaled GLU backward's row sums (left to
 * right) take 32 sums a block, eight warps computing a tile of the terms
 * into shared memory while warp 0 adds up the previous tile, one thread per
 * sum in order.
 *
 * The *_q entries (qout.h) of the plain kinds read x and dy in their own
 * dtype (f32 or bf16) and write the output rounded into its dtype or into
 * hp for the quantizer, one pass, taking the amax of the stored values on
 * the way for current-scaling FP8, whose cast pass follows; dact + dbias
 * does so inside its ordered-sum kernel. The GLU kinds, f16 tensors and
 * OPF_CUDA_UNFUSED=1 take the composition of the fp32 entries.
 *
 * For measurement, OPF_CUDA_COLSUM_SPREAD=1, 2 or 4 sets dact + dbias's
 * spread (both entries; 1: the one-thread-a-sum kernel of the cheap
 * terms), read at each launch; the bits are the same at every spread.
 * dact + dbias's terms and launches are act.cuh's, built in a translation
 * unit per element function (act_dbias_<fn>.cu). */
#include "backend/cuda/act.cuh"

enum {
    W = 4,                    /* floats per thread access */
    THREADS = 256,
    SUM_LANES = 32,           /* sums of a block */
    SUM_TILE = 64,            /* terms of each sum per tile */
    SUM_LOADERS = 256,        /* threads computing a tile */
    SUM_THREADS = SUM_LOADERS + 32,
    PER_LOADER = SUM_TILE * SUM_LANES / SUM_LOADERS,
};
static_assert(SUM_TILE * SUM_LANES % SUM_LOADERS == 0, "whole tiles per loader");

template <int N> __device__ __forceinline__ void load(const float *p, float v[N])
{
    if (N == 4) {
        float4 t = *(const float4 *)p;
        v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else {
#pragma unroll
        for (int i = 0; i < N; i++) v[i] = p[i];
    }
}

template <int N> __device__ __forceinline__ void store(float *p, const float v[N])
{
    if (N == 4) {
        *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int i = 0; i < N; i++) p[i] = v[i];
    }
}

/* ---- plain kinds ----------------------------------------------------------
 * y = f(x) or dx = f'(x)·dy over n floats, in place allowed: chunks of N,
 * then the tail of n % N one float a thread. */
template <opf_act_fn FN, bool BWD, int N>
__device__ __forceinline__ void plain_chunk(float alpha, const float *x, const float *dy,
                                            float *y, int64_t i)
{
    float v[N], g[N];
    load<N>(x + i, v);
    if (BWD) load<N>(dy + i, g);
#pragma unroll
    for (int k = 0; k < N; k++)
        v[k] = BWD ? act_df<FN>(v[k], alpha) * g[k] : act_f<FN>(v[k], alpha);
    store<N>(y + i, v);
}

template <opf_act_fn FN, bool BWD>
__global__ void plain_kernel(float alpha, const float *x, const float *dy, float *y, int64_t n,
                             bool vec)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nv = vec ? n / W : 0;
    for (int64_t c = t; c < nv; c += stride) plain_chunk<FN, BWD, W>(alpha, x, dy, y, c * W);
    for (int64_t i = nv * W + t; i < n; i += stride) plain_chunk<FN, BWD, 1>(alpha, x, dy, y, i);
}

/* The typed form: x, dy of dtype DI, y of DO (may alias x), with the amax
 * of y as stored when amax is not NULL; 8 elements a thread with 16-byte
 * accesses when vec (all three arrays 16-byte aligned). */
template <opf_act_fn FN, bool BWD, opf_dtype DI, opf_dtype DO>
__global__ void plain_t_kernel(float alpha, const void *x, const void *dy, void *y, int64_t n,
                               bool vec, unsigned *amax)
{
    typedef typename opf_dev_plain<DI>::store SI;
    typedef typename opf_dev_plain<DO>::store SO;
    int64_t stride = (int64_t)gridDim.x * blockDim.x, t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t nv = vec ? n / 8 : 0;
    unsigned key = 0;
    for (int64_t c = t; c < nv; c += stride) {
        float v[8], g[8];
        opf_dev_load8_as<DI>((const SI *)x + c * 8, true, 8, v);
        if (BWD) opf_dev_load8_as<DI>((const SI *)dy + c * 8, true, 8, g);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float r = BWD ? act_df<FN>(v[k], alpha) * g[k] : act_f<FN>(v[k], alpha);
            v[k] = opf_dev_to_f32<DO>(opf_dev_from_f32<DO>(r));  /* as stored (rounds again to itself) */
            if (amax) key = opf_dev_amax_max(key, v[k]);
        }
        opf_dev_store8_as<DO>((SO *)y + c * 8, true, 8, v);
    }
    for (int64_t i = nv * 8 + t; i < n; i += stride) {
        float v = ld_t<DI>(x, i);
        float r = BWD ? act_df<FN>(v, alpha) * ld_t<DI>(dy, i) : act_f<FN>(v, alpha);
        float w = st_t<DO>(y, i, r);
        if (amax) key = opf_dev_amax_max(key, w);
    }
    if (amax) opf_dev_warp_amax(key, amax);
}

/* ---- GLU kinds -------------------------------------------------------------
 * x [rows, 2h] = [a | b]. Forward y = f(a)·b (times s[r] when scaled);
 * backward with g = dy (·s[r]): da = f'(a)·g·b, db = f(a)·g. ClampedSwiGLU
 * clamps as act.c does; its selects keep the CPU's NaN cases. */
typedef struct glu_args {
    const float *x, *dy, *s;  /* s: the row scales, or NULL */
    float       *y;           /* y forward, dx backward */
    int64_t      rows, h;
    float        alpha, limit;
} glu_args;

/* fminf(v, hi) / fmaxf(v, lo) for a finite bound, NaN giving the bound (act.c). */
__device__ __forceinline__ float min_limit(float v, float hi) { return v < hi ? v : hi; }
__device__ __forceinline__ float max_limit(float v, float lo) { return v > lo ? v : lo; }

template <opf_act_fn FN, bool CLAMP>
__device__ __forceinline__ float glu_f(float a, float b, float alpha, float L)
{
    if (!CLAMP) return act_f<FN>(a, alpha) * b;
    float ac = min_limit(a, L), bc = min_limit(max_limit(b, -L), L) + 1.0f;
    return act_f<FN>(ac, alpha) * bc;
}

/* da and db of one element (g already scaled). */
template <opf_act_fn FN, bool CLAMP>
__device__ __forceinline__ float2 glu_df(float a, float b, float g, float alpha, float L)
{
    if (!CLAMP) return make_float2(act_df<FN>(a, alpha) * g * b, act_f<FN>(a, alpha) * g);
    bool b_live = (b >= -L) & (b <= L);
    float bc = min_limit(max_limit(b, -L), L) + 1.0f;
    float fa = act_f<FN>(min_limit(a, L), alpha), dfa = act_df<FN>(a, alpha);
    return make_float2((a <= L ? dfa : 0.0f) * g * bc, b_live ? fa * g : 0.0f);
}

/* Elements j .. j+N-1 of row r. */
template <opf_act_fn FN, bool BWD, bool CLAMP, int N>
__device__ __forceinline__ void glu_chunk(const glu_args &p, int64_t r, int64_t j)
{
    const float *xa = p.x + r * 2 * p.h + j, *xb = xa + p.h;
    float a[N], b[N], o[N];
    load<N>(xa, a);
    load<N>(xb, b);
    if (!BWD) {
#pragma unroll
        for (int k = 0; k < N; k++) {
            o[k] = glu_f<FN, CLAMP>(a[k], b[k], p.alpha, p.limit);
            if (p.s) o[k] = o[k] * p.s[r];
        }
        store<N>(p.y + r * p.h + j, o);
        return;
    }
    float g[N], ob[N];
    load<N>(p.dy + r * p.h + j, g);
#pragma unroll
    for (int k = 0; k < N; k++) {
        float2 d = glu_df<FN, CLAMP>(a[k], b[k], p.s ? g[k] * p.s[r] : g[k], p.alpha, p.limit);
        o[k] = d.x, ob[k] = d.y;
    }
    store<N>(p.y + r * 2 * p.h + j, o);
    store<N>(p.y + r * 2 * p.h + p.h + j, ob);
}

/* vec: h % 4 == 0 and aligned bases, chunks of 4 inside a row; else one
 * element a thread. */
template <opf_act_fn FN, bool BWD, bool CLAMP>
__global__ void glu_kernel(glu_args p, bool vec)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        int64_t hv = p.h / W;
        for (int64_t c = t; c < p.rows * hv; c += stride)
            glu_chunk<FN, BWD, CLAMP, W>(p, c / hv, c % hv * W);
        return;
    }
    for (int64_t i = t; i < p.rows * p.h; i += stride)
        glu_chunk<FN, BWD, CLAMP, 1>(p, i / p.h, i % p.h);
}

/* ---- ordered sums -----------------------------------------------------------
 * out[c] = the sum over k = 0 .. K-1, in k order from 0.0f, of term(k, c),
 * for the 32 sums c of a block (the scaled GLU backward's row sums: k is
 * contiguous in memory, so consecutive threads take consecutive k).
 * term.load(k, c, in) issues the loads of one term, term.finish(k, c, in)
 * computes it (and writes what the pass outputs besides). */
template <typename Term>
__global__ void __launch_bounds__(SUM_THREADS, 2) sum_kernel(Term term, int64_t K, int64_t C,
                                                          float *out)
{
    __shared__ float tile[2][SUM_TILE][SUM_LANES + 1];
    int64_t c0 = (int64_t)blockIdx.x * SUM_LANES;
    int lane = threadIdx.x % SUM_LANES, t = (int)threadIdx.x - SUM_LANES;
    float acc = 0.0f;
    for (int64_t k0 = 0, it = 0; k0 < K; k0 += SUM_TILE, it++) {
        float(*b)[SUM_LANES + 1] = tile[it & 1];
        if (t >= 0) {
            typename Term::in in[PER_LOADER];
            int kk[PER_LOADER], cc[PER_LOADER];
#pragma unroll
            for (int m = 0; m < PER_LOADER; m++) {
                int e = t + m * SUM_LOADERS;
                kk[m] = e % SUM_TILE;
                cc[m] = e / SUM_TILE;
                if (k0 + kk[m] < K && c0 + cc[m] < C) term.load(k0 + kk[m], c0 + cc[m], in[m]);
            }
#pragma unroll
            for (int m = 0; m < PER_LOADER; m++)
                if (k0 + kk[m] < K && c0 + cc[m] < C)
                    b[kk[m]][cc[m]] = term.finish(k0 + kk[m], c0 + cc[m], in[m]);
        }
        /* Warp 0 summed tile it - 1 (the buffer written above) before this. */
        __syncthreads();
        if (t < 0) {
            int64_t nk = K - k0 < SUM_TILE ? K - k0 : SUM_TILE;
            for (int k = 0; k < nk; k++) acc = acc + b[k][lane];
        }
    }
    if (t < 0 && c0 + lane < C) out[c0 + lane] = acc;
}

/* Scaled GLU backward: k = j, c = row; dx as the GLU backward with
 * g = fl(dy s[r]), and the term fl(fl(f(a) b) dy) of ds[r]. */
template <opf_act_fn FN> struct ds_term {
    struct in { float a, b, dy; };
    const float *x, *dy, *s;
    float       *dx;
    int64_t      h;
    float        alpha;
    __device__ __forceinline__ void load(int64_t j, int64_t r, in &v) const
    {
        v.a = x[r * 2 * h + j];
        v.b = x[r * 2 * h + h + j];
        v.dy = dy[r * h + j];
    }
    __device__ __forceinline__ float finish(int64_t j, int64_t r, const in &v) const
    {
        float g = v.dy * s[r], fa = act_f<FN>(v.a, alpha);
        float da = act_df<FN>(v.a, alpha) * g;
        dx[r * 2 * h + j] = da * v.b;
        dx[r * 2 * h + h + j] = fa * g;
        float fb = fa * v.b;
        return fb * v.dy;
    }
};

/* ---- host side ----------------------------------------------------------- */

/* Calls L::template run<FN>(args...) for k's element-function pair. */
template <typename L, typename... A> static opf_status dispatch(opf_act_kind k, A... args)
{
    switch (opf_act_fn_of(k)) {
    case OPF_ACT_FN_GELU: return L::template run<OPF_ACT_FN_GELU>(args...);
    case OPF_ACT_FN_RELU: return L::template run<OPF_ACT_FN_RELU>(args...);
    case OPF_ACT_FN_SRELU: return L::template run<OPF_ACT_FN_SRELU>(args...);
    case OPF_ACT_FN_SIGMOID: return L::template run<OPF_ACT_FN_SIGMOID>(args...);
    default: return L::template run<OPF_ACT_FN_SWISH>(args...);
    }
}

static bool aligned(const void *a, const void *b, const void *c)
{
    return opf_cuda_aligned16(a) && (!b || opf_cuda_aligned16(b)) && opf_cuda_aligned16(c);
}

template <bool BWD> struct plain_launch {
    template <opf_act_fn FN>
    static opf_status run(opf_ctx *ctx, opf_cuda_state *s, const char *fn, float alpha,
                          const float *x, const float *dy, float *y, int64_t n)
    {
        if (n == 0) return OPF_OK;
        bool vec = aligned(x, dy, y);
        unsigned grid = opf_cuda_grid(s, (n + W - 1) / W, THREADS);
        plain_kernel<FN, BWD><<<grid, THREADS, 0, s->stream>>>(alpha, x, dy, y, n, vec);
        OPF_CUDA_LAUNCHED(ctx, fn);
        return OPF_OK;
    }
};

template <bool BWD> struct glu_launch {
    template <opf_act_fn FN>
    static opf_status run(opf_ctx *ctx, opf_cuda_state *s, const char *fn, glu_args p, bool clamp)
    {
        if (p.rows * p.h == 0) return OPF_OK;
        bool vec = p.h % W == 0 && aligned(p.x, p.dy, p.y);
        unsigned grid = opf_cuda_grid(s, p.rows * p.h / (vec ? W : 1), THREADS);
        if constexpr (FN == OPF_ACT_FN_SWISH)  /* ClampedSwiGLU's pair */
            if (clamp) {
                glu_kernel<FN, BWD, true><<<grid, THREADS, 0, s->stream>>>(p, vec);
                OPF_CUDA_LAUNCHED(ctx, fn);
                return OPF_OK;
            }
        glu_kernel<FN, BWD, false><<<grid, THREADS, 0, s->stream>>>(p, vec);
        OPF_CUDA_LAUNCHED(ctx, fn);
        return OPF_OK;
    }
};

/* The ordered sums over K terms of C sums (none: nothing to launch). */
template <typename Term>
static opf_status launch_sums(opf_ctx *ctx, opf_cuda_state *s, const char *fn, const Term &t,
                              int64_t K, int64_t C, float *out)
{
    if (C == 0) return OPF_OK;
    unsigned grid = (unsigned)((C + SUM_LANES - 1) / SUM_LANES);
    sum_kernel<Term><<<grid, SUM_THREADS, 0, s->stream>>>(t, K, C, out);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

struct dbias_launch {
    template <opf_act_fn FN>
    static opf_status run(opf_ctx *ctx, opf_cuda_state *s, const char *fn, float alpha,
                          const float *x, const float *dy, float *dx, float *dbias, int64_t rows,
                          int64_t cols)
    {
        return act_dbias_plain<FN>(ctx, s, fn, alpha, x, dy, dx, dbias, rows, cols);
    }
};

struct ds_launch {
    template <opf_act_fn FN>
    static opf_status run(opf_ctx *ctx, opf_cuda_state *s, const char *fn, float alpha,
                          const float *x, const float *sc, const float *dy, float *dx, float *ds,
                          int64_t rows, int64_t h)
    {
        ds_term<FN> t = {x, dy, sc, dx, h, alpha};
        return launch_sums(ctx, s, fn, t, h, rows, ds);
    }
};

/* ---- the *_q entries ------------------------------------------------------ */

/* Whether the typed kernels take these dtypes (x and dy alike; the tensor
 * written). */
static bool typed_ok(const opf_tensor *x, const opf_tensor *dy, opf_dtype out)
{
    opf_dtype d = x->spec.dtype;
    return (d == OPF_F32 || d == OPF_BF16) && (!dy || dy->spec.dtype == d) &&
           (out == OPF_F32 || out == OPF_BF16);
}

template <opf_act_fn FN, opf_dtype DI, opf_dtype DO>
static opf_status typed_go(opf_ctx *ctx, opf_cuda_state *s, const char *fn, opf_act_pass pass,
                           const typed_args &a)
{
    int64_t n = a.rows * a.cols;
    if (n == 0) return OPF_OK;
    bool vec = opf_cuda_aligned16(a.x) && opf_cuda_aligned16(a.y) &&
               (pass != OPF_ACT_PASS_BWD || opf_cuda_aligned16(a.dy));
    unsigned grid = opf_cuda_grid(s, vec ? (n + 7) / 8 : n, THREADS);
    if (pass == OPF_ACT_PASS_BWD)
        plain_t_kernel<FN, true, DI, DO><<<grid, THREADS, 0, s->stream>>>(a.alpha, a.x, a.dy, a.y,
                                                                          n, vec, a.amax);
    else
        plain_t_kernel<FN, false, DI, DO><<<grid, THREADS, 0, s->stream>>>(a.alpha, a.x, a.dy,
                                                                           a.y, n, vec, a.amax);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

struct typed_launch {
    template <opf_act_fn FN>
    static opf_status run(opf_ctx *ctx, opf_cuda_state *s, const char *fn, opf_act_pass pass,
                          opf_dtype di, opf_dtype dout, typed_args a)
    {
        if (pass == OPF_ACT_PASS_DACT_DBIAS) return act_dbias_typed<FN>(ctx, s, fn, di, dout, a);
        return act_with_io(di, dout, [&](auto i, auto o) {
            return typed_go<FN, decltype(i)::value, decltype(o)::value>(ctx, s, fn, pass, a);
        });
    }
};

/* One pass into the output or its hp tensor (with the amax for
 * current-scaling FP8, then its cast pass; other formats then their
 * quantize kernel), or the composition (qout.h) where the typed kernels do
 * not apply or OPF_CUDA_UNFUSED=1. */
static opf_status act_q(opf_ctx *ctx, opf_act_pass pass, opf_act_kind k, opf_act_params p,
                        const opf_tensor *x, const opf_tensor *dy, const opf_qout *o,
                        float *dbias)
{
    static const char *const fns[] = {"activation fwd_q (cuda)", "activation bwd_q (cuda)",
                                      "dact_dbias_q (cuda)"};
    const char *fn = fns[pass];
    const opf_backend_i *be = opf_backend_get(OPF_DEVICE_CUDA);
    opf_dtype target = opf_qout_quantized(o) ? o->hp : o->out->spec.dtype;
    if (!opf_cuda_fused() || opf_act_is_glu(k) || !typed_ok(x, dy, target))
        return opf_act_q_composed(ctx, be, pass, k, p, x, dy, o, dbias);
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_tensor t;
    opf_status st = opf_qout_begin(ctx, o, &t);
    int64_t cols = x->spec.ndim ? x->spec.shape[x->spec.ndim - 1] : 1;
    if (!st)
        st = opf_cuda_qout_run(ctx, s, fn, o, &t, [&](unsigned *amax) {
            typed_args a = {x->data[0], dy ? dy->data[0] : NULL, t.data[0], dbias,
                            cols ? opf_spec_numel(&x->spec) / cols : 0, cols, p.alpha, amax};
            return dispatch<typed_launch>(k, ctx, s, fn, pass, x->spec.dtype, target, a);
        });
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static opf_status cuda_act_fwd_q(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                                 const opf_tensor *x, const opf_qout *y)
{
    return act_q(ctx, OPF_ACT_PASS_FWD, k, p, x, NULL, y, NULL);
}

static opf_status cuda_act_bwd_q(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                                 const opf_tensor *x, const opf_tensor *dy, const opf_qout *dx)
{
    return act_q(ctx, OPF_ACT_PASS_BWD, k, p, x, dy, dx, NULL);
}

static opf_status cuda_act_dact_dbias_q(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                                        const opf_tensor *x, const opf_tensor *dy,
                                        const opf_qout *dx, float *dbias)
{
    return act_q(ctx, OPF_ACT_PASS_DACT_DBIAS, k, p, x, dy, dx, dbias);
}

/* One colsum.cuh pass whose terms store dx and sum what they stored (GELU
 * and ReLU in f32 / bf16 with db f32 or bf16); other kinds and dtypes, or
 * OPF_CUDA_UNFUSED=1, the composition: the activation's backward, then
 * the bias's dbias. */
static opf_status cuda_act_dact_dbias_stored(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                                             const opf_tensor *x, const opf_tensor *dy,
                                             opf_tensor *dx, opf_tensor *db)
{
    const char *fn = "dact_dbias_stored (cuda)";
    opf_dtype dbt = db->spec.dtype;
    if (!opf_cuda_fused() || (k != OPF_ACT_GELU && k != OPF_ACT_RELU) ||
        !typed_ok(x, dy, dx->spec.dtype) || (dbt != OPF_F32 && dbt != OPF_BF16))
        return opf_act_dact_dbias_stored_composed(ctx, opf_backend_get(OPF_DEVICE_CUDA), k, p, x,
                                                  dy, dx, db);
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (k == OPF_ACT_GELU)
        return act_dbias_stored<OPF_ACT_FN_GELU>(ctx, s, fn, p.alpha, x, dy, dx, db);
    return act_dbias_stored<OPF_ACT_FN_RELU>(ctx, s, fn, p.alpha, x, dy, dx, db);
}

static opf_status cuda_act_fwd(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const float *x,
                               float *y, int64_t rows, int64_t cols)
{
    const char *fn = "activation fwd (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (!opf_act_is_glu(k))
        return dispatch<plain_launch<false>>(k, ctx, s, fn, p.alpha, x, (const float *)NULL, y,
                                             rows * cols);
    glu_args g = {x, NULL, NULL, y, rows, cols / 2, p.alpha, p.limit};
    return dispatch<glu_launch<false>>(k, ctx, s, fn, g, k == OPF_ACT_CLAMPED_SWIGLU);
}

static opf_status cuda_act_bwd(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const float *x,
                               const float *dy, float *dx, int64_t rows, int64_t cols)
{
    const char *fn = "activation bwd (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (!opf_act_is_glu(k))
        return dispatch<plain_launch<true>>(k, ctx, s, fn, p.alpha, x, dy, dx, rows * cols);
    glu_args g = {x, dy, NULL, dx, rows, cols / 2, p.alpha, p.limit};
    return dispatch<glu_launch<true>>(k, ctx, s, fn, g, k == OPF_ACT_CLAMPED_SWIGLU);
}

static opf_status cuda_act_dact_dbias(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                                      const float *x, const float *dy, float *dx, float *dbias,
                                      int64_t rows, int64_t cols)
{
    const char *fn = "dact_dbias (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    return dispatch<dbias_launch>(k, ctx, s, fn, p.alpha, x, dy, dx, dbias, rows, cols);
}

static opf_status cuda_scaled_glu_fwd(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                                      const float *x, const float *sc, float *y, int64_t rows,
                                      int64_t cols)
{
    const char *fn = "scaled_glu_fwd (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    glu_args g = {x, NULL, sc, y, rows, cols / 2, p.alpha, p.limit};
    return dispatch<glu_launch<false>>(k, ctx, s, fn, g, false);
}

/* work is not needed: dx and ds come out of one pass. */
static opf_status cuda_scaled_glu_bwd(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                                      const float *x, const float *sc, const float *dy, float *dx,
                                      float *ds, float *work, int64_t rows, int64_t cols)
{
    const char *fn = "scaled_glu_bwd (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    return dispatch<ds_launch>(k, ctx, s, fn, p.alpha, x, sc, dy, dx, ds, rows, cols / 2);
}

extern "C" const opf_act_kernels opf_cuda_act = {
    cuda_act_fwd,   cuda_act_bwd,   cuda_act_dact_dbias, cuda_scaled_glu_fwd, cuda_scaled_glu_bwd,
    cuda_act_fwd_q, cuda_act_bwd_q, cuda_act_dact_dbias_q, cuda_act_dact_dbias_stored,
};
