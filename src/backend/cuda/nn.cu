/* nn.cu: backend/nn.h on the GPU (embedding, causal attention, softmax
 * cross-entropy, sum of squares), bit for bit with src/backend/cpu/nn.c.
 *
 * Every fp32 operation is an explicit round-to-nearest intrinsic (__fadd_rn,
 * __fmul_rn...), so nvcc contracts nothing the CPU (built with
 * -ffp-contract=off) does not. Every sum nn.h orders is one thread's
 * sequential chain in that order; the work around it is parallel:
 *  - embed_bwd: the rows are sorted by token with CUB's stable radix sort,
 *    so each token's rows are one run in increasing r; a thread per (token,
 *    column) walks its run. dwpe: a thread per (t, column) walks b.
 *  - attention (with OPF_CUDA_ATTENTION=exact; by default attn.cu's batched
 *    GEMMs, or with flash flash.cu's tiles, not bit for bit): a warp per
 *    (batch, head, query row). Its lanes compute the scores of 32 keys at
 *    once (each dot a lane's sequential sum over d), the running max of the
 *    online softmax is a warp scan (exact: a max of
 *    the same values; NaN scores never become the max, as on the CPU), so
 *    c and p are parallel; only l and acc_d, lanes over d, step through the
 *    keys in order. The backward: dq by a warp per query row, dk and dv by a
 *    warp per key row (queries i = j..T-1 in order), both from the same
 *    recomputed p and ds.
 *  - cross-entropy: a warp per row, each lane summing its own exponentials,
 *    then the fold (lanesum.h); the row is read in 16-byte vectors whose
 *    exps the lanes compute in parallel and hand, through shared memory, to
 *    the lane that adds them. The loss: one block computes the rows' terms,
 *    one thread adds them in order in double. The backward: a block a row,
 *    16-byte vectors where every row is whole ones.
 *  - sumsq: a warp per 4096-value chunk of the CPU, each lane its own
 *    squares, then the fold (lanesum.h); one warp folds the chunk sums.
 *    Clipping's sumsq_acc and clip_scale take every gradient of a model in
 *    a few launches (up to SPANS arrays each), with the same sums.
 *
 * Cross-entropy's exp is act-math.h's opf_expf_impl, compiled for the
 * device (nn.h: fp32 operations only, the CPU's bits under -fmad=false).
 * Attention's expf and logf are ports of the glibc functions the CPU reference calls
 * (glibc 2.28 and later, the same algorithms as ARM's optimized-routines:
 * a 32-entry 2^(i/32) table and a cubic in double for expf; a 16-entry
 * table and a cubic for logf), with the fused multiply-adds of glibc's
 * x86-64 FMA build (chosen on every CPU with FMA): identical to that libm
 * on all 2^32 inputs (checked exhaustively), NaN payloads aside.
 * test_cuda_nn compares them with the host's libm on the GPU.
 *
 * NaN inputs give NaN outputs where the CPU's do, but not the same NaN bits
 * (the GPU's arithmetic returns its canonical NaN, x86 propagates payloads).
 * The embedding forward checks its tokens on the device and reads the first
 * bad row back: one host synchronization per call, which the contract's
 * error needs. Inside a capture (a compiled graph replayed as a CUDA graph)
 * there is no read: the check marks the context's deferred word, the rows
 * with a bad token are NaN, and the next host wait (a synchronization or a
 * copy to the host) reports the row and the id (runtime.cu). */
#include <cub/cub.cuh>

#include "backend/cuda/cuda-impl.h"
extern "C" {
#include "backend/cpu/act-math.h"
}

enum {
    SUMSQ_CHUNK = 4096,     /* the CPU's chunk (nn.c) */
    WARPS = 4,              /* warps per block of the warp-per-row kernels */
    DCHUNK = 256,           /* head dims per pass of a warp: 8 per lane */
    DPL = DCHUNK / 32,
};
#define FULL 0xFFFFFFFFu

/* ---- expf / logf, as glibc computes them ---------------------------------- */

__device__ const uint64_t nn_exp2_tab[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

/* {1/c, log(c)} of the 16 subintervals of [0x1.66p-1, 0x1.66p0). */
__device__ const double nn_log_tab[16][2] = {
    {0x1.661ec79f8f3bep+0, -0x1.57bf7808caadep-2}, {0x1.571ed4aaf883dp+0, -0x1.2bef0a7c06ddbp-2},
    {0x1.49539f0f010b0p+0, -0x1.01eae7f513a67p-2}, {0x1.3c995b0b80385p+0, -0x1.b31d8a68224e9p-3},
    {0x1.30d190c8864a5p+0, -0x1.6574f0ac07758p-3}, {0x1.25e227b0b8ea0p+0, -0x1.1aa2bc79c8100p-3},
    {0x1.1bb4a4a1a343fp+0, -0x1.a4e76ce8c0e5ep-4}, {0x1.12358f08ae5bap+0, -0x1.1973c5a611cccp-4},
    {0x1.0953f419900a7p+0, -0x1.252f438e10c1ep-5}, {0x1.0000000000000p+0, 0x0.0p+0},
    {0x1.e608cfd9a47acp-1, 0x1.aa5aa5df25984p-5}, {0x1.ca4b31f026aa0p-1, 0x1.c5e53aa362eb4p-4},
    {0x1.b2036576afce6p-1, 0x1.526e57720db08p-3}, {0x1.9c2d163a1aa2dp-1, 0x1.bc2860d224770p-3},
    {0x1.886e6037841edp-1, 0x1.1058bc8a07ee1p-2}, {0x1.767dcf5534862p-1, 0x1.4043057b6ee09p-2},
};

/* e^x = 2^(k/32) 2^(r/32), x*32/ln2 = k + r, |r| <= 1/2. */
__device__ __forceinline__ float nn_expf(float x)
{
    const double inv_ln2_n = 0x1.71547652b82fep+5, shift = 0x1.8p+52;
    unsigned top = __float_as_uint(x) >> 20 & 0x7ffu;
    if (top >= 0x42bu) {  /* |x| >= 88, inf or NaN */
        if (__float_as_uint(x) == 0xff800000u) return 0.0f;
        if (top >= 0x7f8u) return __fadd_rn(x, x);
        if (x > 0x1.62e42ep6f) return INFINITY;
        if (x < -0x1.9fe368p6f) return 0.0f;
    }
    double xd = (double)x;
    double kd = __fma_rn(inv_ln2_n, xd, shift);  /* rounds x*32/ln2 to an integer */
    uint64_t ki = (uint64_t)__double_as_longlong(kd);
    kd = __dsub_rn(kd, shift);
    double r = __fma_rn(inv_ln2_n, xd, -kd);
    double s = __longlong_as_double((long long)(nn_exp2_tab[ki % 32] + (ki << 47)));
    double z = __fma_rn(0x1.c6af84b912394p-20, r, 0x1.ebfce50fac4f3p-13);
    double r2 = __dmul_rn(r, r);
    double y = __fma_rn(0x1.62e42ff0c52d6p-6, r, 1.0);
    y = __fma_rn(z, r2, y);
    return __double2float_rn(__dmul_rn(y, s));
}

/* log x = log1p(z/c - 1) + log c + k ln2, x = 2^k z. */
__device__ __forceinline__ float nn_logf(float x)
{
    unsigned ix = __float_as_uint(x);
    if (ix == 0x3f800000u) return 0.0f;
    if (ix - 0x00800000u >= 0x7f800000u - 0x00800000u) {  /* subnormal, 0, negative, inf, NaN */
        if (ix * 2 == 0) return -INFINITY;
        if (ix == 0x7f800000u) return x;
        if ((ix & 0x80000000u) || ix * 2 >= 0xff000000u) return __int_as_float(0x7fffffff);
        ix = __float_as_uint(__fmul_rn(x, 0x1p23f)) - (23u << 23);
    }
    unsigned tmp = ix - 0x3f330000u;
    int i = (int)(tmp >> 19 & 15u), k = (int)tmp >> 23;
    double invc = nn_log_tab[i][0], logc = nn_log_tab[i][1];
    double z = (double)__uint_as_float(ix - (tmp & 0xff800000u));
    double r = __fma_rn(z, invc, -1.0);
    double y0 = __fma_rn((double)k, 0x1.62e42fefa39efp-1, logc);
    double r2 = __dmul_rn(r, r);
    double y = __fma_rn(0x1.5575b0be00b6ap-2, r, -0x1.ffffef20a4123p-2);
    y = __fma_rn(-0x1.00ea348b88334p-2, r2, y);
    y = __fma_rn(y, r2, __dadd_rn(y0, r));
    return __double2float_rn(y);
}

static __global__ void math_kernel(bool log, uint32_t first, uint32_t stride, int64_t n, float *y)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float x = __uint_as_float(first + (uint32_t)i * stride);
        y[i] = log ? nn_logf(x) : nn_expf(x);
    }
}

extern "C" opf_status opf_cuda_nn_math(opf_ctx *ctx, bool log, uint32_t first, uint32_t stride,
                                       int64_t n, float *y)
{
    const char *fn = "nn math (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (n <= 0) return OPF_OK;
    math_kernel<<<opf_cuda_grid(s, n, 256), 256, 0, s->stream>>>(log, first, stride, n, y);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* ---- shared pieces ------------------------------------------------------- */

/* nn.c's dot: s += a[d] * b[d] from 0, in d order. */
__device__ __forceinline__ float nn_dot(const float *a, const float *b, int64_t n)
{
    float s = 0.0f;
    for (int64_t d = 0; d < n; d++) s = __fadd_rn(s, __fmul_rn(__ldg(a + d), __ldg(b + d)));
    return s;
}

/* The warp of thread t of a warp-per-item kernel, and its lane. */
__device__ __forceinline__ int64_t nn_warp_id(void)
{
    return ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
}
__device__ __forceinline__ int nn_lane(void) { return (int)(threadIdx.x & 31); }

static unsigned warp_grid(int64_t warps) { return (unsigned)((warps + WARPS - 1) / WARPS); }

/* The CPU's running max `m = s > m ? s : m` after each lane's key, from
 * m_before (the max before lane 0's key). s > m is false for a NaN s, so a
 * NaN key counts as -inf; among equal values the earlier stays, so the scan
 * combines (earlier, later) the same way and gives the CPU's bits. */
__device__ __forceinline__ float nn_running_max(float s, float m_before, int lane)
{
    float x = isnan(s) ? -INFINITY : s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        float y = __shfl_up_sync(FULL, x, o);
        if (lane >= o) x = x > y ? x : y;
    }
    return x > m_before ? x : m_before;
}

/* ---- embedding ------------------------------------------------------------ */

/* The first row holding a token outside [0, V) and its id, packed (row <<
 * 32 | id) so one atomicMin keeps the lowest row with its id, into *bad
 * (~0 when none): eagerly a scratch word read back at once; inside a
 * capture the context's deferred word (runtime.cu reads it at the next
 * host wait). */
static __global__ void embed_mark_kernel(const int32_t *tok, int64_t rows, int64_t V,
                                         unsigned long long *bad)
{
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows;
         r += (int64_t)gridDim.x * blockDim.x)
        if (tok[r] < 0 || tok[r] >= V)
            atomicMin(bad, (unsigned long long)r << 32 | (uint32_t)tok[r]);
}

/* A row whose token is outside [0, V) (only a captured call gets that far)
 * is NaN: no read past the table. */
static __global__ void embed_fwd_kernel(const int32_t *tok, const float *wte, const float *wpe,
                                        float *y, int64_t rows, int64_t T, int64_t C, int64_t V)
{
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int32_t id = tok[r];
        bool ok = id >= 0 && id < V;
        const float *e = wte + (int64_t)(ok ? id : 0) * C, *p = wpe + (r % T) * C;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            y[r * C + c] = ok ? __fadd_rn(e[c], p[c]) : __int_as_float(0x7FC00000);
    }
}

static opf_status embed_launch(opf_ctx *ctx, opf_cuda_state *s, const int32_t *tok,
                               const float *wte, const float *wpe, float *y, int64_t rows,
                               int64_t T, int64_t C, int64_t V)
{
    unsigned grid = (unsigned)(rows < 65536 ? rows : 65536);
    embed_fwd_kernel<<<grid, 256, 0, s->stream>>>(tok, wte, wpe, y, rows, T, C, V);
    OPF_CUDA_LAUNCHED(ctx, "embedding forward (cuda)");
    return OPF_OK;
}

static opf_status embed_fwd(opf_ctx *ctx, const int32_t *tok, const float *wte, const float *wpe,
                            float *y, int64_t rows, int64_t T, int64_t C, int64_t V)
{
    const char *fn = "embedding forward (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (rows <= 0) return OPF_OK;
    if (rows > INT32_MAX)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: %lld rows (at most %d)", fn,
                         (long long)rows, INT32_MAX);
    cudaStreamCaptureStatus cs;
    OPF_CUDA_TRY(ctx, fn, cudaStreamIsCapturing(s->stream, &cs));
    if (cs != cudaStreamCaptureStatusNone) {  /* no host read in a capture: checked later */
        embed_mark_kernel<<<opf_cuda_grid(s, rows, 256), 256, 0, s->stream>>>(tok, rows, V,
                                                                             s->deferred_bad);
        OPF_CUDA_LAUNCHED(ctx, fn);
        s->deferred_armed = true;
        return C > 0 ? embed_launch(ctx, s, tok, wte, wpe, y, rows, T, C, V) : OPF_OK;
    }
    void *ws;
    opf_status st = opf_cuda_scratch(ctx, s, 16, &ws);
    if (st) return st;
    unsigned long long *bad = (unsigned long long *)ws, w;
    OPF_CUDA_TRY(ctx, fn, cudaMemsetAsync(bad, 0xFF, sizeof w, s->stream));
    embed_mark_kernel<<<opf_cuda_grid(s, rows, 256), 256, 0, s->stream>>>(tok, rows, V, bad);
    OPF_CUDA_LAUNCHED(ctx, fn);
    if ((st = opf_cuda_copy(ctx, &w, bad, sizeof w, OPF_CUDA_D2H))) return st;
    if (w != ~0ull)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "embedding: token %d at row %lld is outside "
                         "the vocabulary [0, %lld)", (int)(int32_t)(uint32_t)(w & 0xFFFFFFFFull),
                         (long long)(w >> 32), (long long)V);
    return C > 0 ? embed_launch(ctx, s, tok, wte, wpe, y, rows, T, C, V) : OPF_OK;
}

static __global__ void iota_kernel(uint32_t *v, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        v[i] = (uint32_t)i;
}

/* Block p: when sorted position p starts a run of one token, the run's
 * rows (increasing r, the sort being stable) summed per column. */
/* A token outside [0, V) (a captured forward let it through, and reports
 * it) is skipped: no write past dwte; that call's dwte is not to be used. */
static __global__ void embed_dwte_kernel(const uint32_t *tok_sorted, const uint32_t *row_sorted,
                                         const float *dy, float *dwte, int64_t rows, int64_t C,
                                         int64_t V)
{
    int64_t p = blockIdx.x;
    uint32_t v = tok_sorted[p];
    if (v >= (uint64_t)V || (p > 0 && tok_sorted[p - 1] == v)) return;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int64_t q = p; q < rows && tok_sorted[q] == v; q++)
            acc = __fadd_rn(acc, dy[(int64_t)row_sorted[q] * C + c]);
        dwte[(int64_t)v * C + c] = acc;
    }
}

static __global__ void embed_dwpe_kernel(const float *dy, float *dwpe, int64_t rows, int64_t T,
                                         int64_t C)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T * C;
         i += (int64_t)gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int64_t r = i / C; r < rows; r += T) acc = __fadd_rn(acc, dy[r * C + i % C]);
        dwpe[i] = acc;
    }
}


static int bits_for(int64_t V)
{
    int b = 1;
    while (b < 32 && ((int64_t)1 << b) < V) b++;
    return b;
}

static opf_status embed_bwd(opf_ctx *ctx, const int32_t *tok, const float *dy, float *dwte,
                            float *dwpe, int64_t rows, int64_t T, int64_t C, int64_t V, int64_t P)
{
    const char *fn = "embedding backward (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    OPF_CUDA_TRY(ctx, fn, cudaMemsetAsync(dwte, 0, sizeof(float) * (size_t)(V * C), s->stream));
    OPF_CUDA_TRY(ctx, fn, cudaMemsetAsync(dwpe, 0, sizeof(float) * (size_t)(P * C), s->stream));
    if (rows <= 0 || C <= 0) return OPF_OK;
    if (rows > INT32_MAX)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: %lld rows (at most %d)", fn,
                         (long long)rows, INT32_MAX);
    int n = (int)rows, bits = bits_for(V);
    size_t tmp_bytes = 0, arr = opf_cuda_pad256(sizeof(uint32_t) * (size_t)rows);
    const uint32_t *keys = (const uint32_t *)tok;  /* ids in [0, V): the same order unsigned */
    OPF_CUDA_TRY(ctx, fn, cub::DeviceRadixSort::SortPairs(NULL, tmp_bytes, keys, (uint32_t *)NULL,
                                                          (const uint32_t *)NULL, (uint32_t *)NULL,
                                                          n, 0, bits, s->stream));
    void *ws;
    opf_status st = opf_cuda_scratch(ctx, s, 3 * arr + tmp_bytes, &ws);
    if (st) return st;
    uint32_t *tok_sorted = (uint32_t *)ws, *rows_in = (uint32_t *)((char *)ws + arr);
    uint32_t *row_sorted = (uint32_t *)((char *)ws + 2 * arr);
    iota_kernel<<<opf_cuda_grid(s, rows, 256), 256, 0, s->stream>>>(rows_in, rows);
    OPF_CUDA_LAUNCHED(ctx, fn);
    OPF_CUDA_TRY(ctx, fn, cub::DeviceRadixSort::SortPairs((char *)ws + 3 * arr, tmp_bytes, keys,
                                                          tok_sorted, rows_in, row_sorted, n, 0,
                                                          bits, s->stream));
    embed_dwte_kernel<<<(unsigned)rows, 256, 0, s->stream>>>(tok_sorted, row_sorted, dy, dwte,
                                                             rows, C, V);
    OPF_CUDA_LAUNCHED(ctx, fn);
    embed_dwpe_kernel<<<opf_cuda_grid(s, T * C, 256), 256, 0, s->stream>>>(dy, dwpe, rows, T, C);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* ---- attention ------------------------------------------------------------
 * Row t of a (batch, head): q at base + t*3C, k at +C, v at +2C, base =
 * qkv + b*T*3C + h*D. Warps take the longest rows first. */

typedef struct attn_dims {
    int64_t B, T, H, D, C;
    float   scale;
} attn_dims;

/* The forward of query row i: o_i = softmax(s_i.) v, lse_i. */
static __global__ void attn_fwd_kernel(const float *qkv, float *o, float *lse, attn_dims a)
{
    int64_t w = nn_warp_id(), BH = a.B * a.H, C = a.C, D = a.D;
    if (w >= BH * a.T) return;
    int lane = nn_lane();
    int64_t bh = w % BH, i = a.T - 1 - w / BH, b = bh / a.H, h = bh % a.H;
    const float *base = qkv + b * a.T * 3 * C + h * D, *q = base + i * 3 * C;
    float *out = o + (b * a.T + i) * C + h * D;
    for (int64_t d0 = 0; d0 < D; d0 += DCHUNK) {
        float acc[DPL], m = -INFINITY, l = 0.0f;
#pragma unroll
        for (int u = 0; u < DPL; u++) acc[u] = 0.0f;
        for (int64_t j0 = 0; j0 <= i; j0 += 32) {
            int64_t j = j0 + lane;
            float sc = j <= i ? __fmul_rn(nn_dot(q, base + j * 3 * C + C, D), a.scale) : -INFINITY;
            float mj = nn_running_max(sc, m, lane), mp = __shfl_up_sync(FULL, mj, 1);
            if (lane == 0) mp = m;
            float c = nn_expf(__fsub_rn(mp, mj)), p = nn_expf(__fsub_rn(sc, mj));
            int n = (int)(i - j0 + 1 < 32 ? i - j0 + 1 : 32);
            for (int t = 0; t < n; t++) {
                float ct = __shfl_sync(FULL, c, t), pt = __shfl_sync(FULL, p, t);
                const float *v = base + (j0 + t) * 3 * C + 2 * C + d0;
                l = __fadd_rn(__fmul_rn(l, ct), pt);
#pragma unroll
                for (int u = 0; u < DPL; u++) {
                    int64_t d = lane + 32 * u;
                    if (d0 + d < D)
                        acc[u] = __fadd_rn(__fmul_rn(acc[u], ct), __fmul_rn(pt, __ldg(v + d)));
                }
            }
            m = __shfl_sync(FULL, mj, 31);
        }
#pragma unroll
        for (int u = 0; u < DPL; u++) {
            int64_t d = d0 + lane + 32 * u;
            if (d < D) out[d] = __fdiv_rn(acc[u], l);
        }
        if (d0 == 0 && lane == 0) lse[bh * a.T + i] = __fadd_rn(m, nn_logf(l));
    }
}

/* The attention kernels OPF_CUDA_ATTENTION picks: auto (unset or empty:
 * the default) cuDNN's fused flash attention where libcudnn.so.9 loads,
 * with its deterministic backward, else flash2; flash2 flash.cu's tiled
 * kernels, for bf16 / f16 qkv its mma.sync ones (S and P in registers; D 64
 * or 128 and aligned arrays, else gemm), TF32 WMMA for fp32; flash the same
 * with WMMA for 16-bit too (slower on an H200: 1.80 against 1.45 ms forward
 * + backward at GPT-2's shape); gemm attn.cu's batched GEMMs; exact the
 * kernels here, with the CPU's bits (a warp per row: slow at long
 * contexts); flash1p flash2 with one backward kernel for 16-bit qkv (dQ
 * summed in a fixed order, flash.cu); cudnn cuDNN's (cudnn_attn.cu, for
 * 16-bit qkv: flash2 for the rest), an error where it does not load;
 * cudnn-atomic the same with cuDNN's atomic dQ accumulation (faster, bits
 * vary from run to run). On an H200 at GPT-2 124M's shape cuDNN's forward
 * + backward takes 0.445 ms (atomic 0.416) against flash2's 1.316
 * (bench/RESULTS.md). */
typedef enum attn_path {
    ATTN_GEMM, ATTN_FLASH, ATTN_EXACT, ATTN_FLASH2, ATTN_FLASH1P, ATTN_CUDNN, ATTN_CUDNN_ATOMIC,
    ATTN_AUTO, ATTN_PATH_COUNT
} attn_path;

static opf_status attention_path(opf_ctx *ctx, const char *fn, attn_path *out)
{
    static const char *const names[] = {"gemm",    "flash", "exact",        "flash2",
                                        "flash1p", "cudnn", "cudnn-atomic", "auto"};
    static_assert(sizeof names / sizeof names[0] == ATTN_PATH_COUNT, "a name per path");
    const char *v = getenv("OPF_CUDA_ATTENTION");
    if (getenv("OPF_CUDA_EXACT_ATTENTION"))
        opf_ctx_warn_once(ctx, "cuda: OPF_CUDA_EXACT_ATTENTION", "OPF_CUDA_EXACT_ATTENTION is "
                          "no longer read: OPF_CUDA_ATTENTION=exact selects the exact kernels");
    *out = ATTN_AUTO;
    if (!v || !v[0]) return OPF_OK;
    for (int p = 0; p < (int)(sizeof names / sizeof names[0]); p++)
        if (!strcmp(v, names[p])) {
            *out = (attn_path)p;
            return OPF_OK;
        }
    return opf_error(ctx, OPF_ERR_INVALID_ARG,
                     "%s: OPF_CUDA_ATTENTION=%s is not auto, gemm, flash, flash2, flash1p, cudnn, "
                     "cudnn-atomic or exact", fn, v);
}

/* The cuDNN mode of a cuDNN path. */
static opf_cudnn_use cudnn_mode(attn_path p)
{
    return p == ATTN_AUTO ? OPF_CUDNN_AUTO : p == ATTN_CUDNN ? OPF_CUDNN_ON : OPF_CUDNN_ATOMIC;
}
static bool is_cudnn(attn_path p)
{
    return p == ATTN_AUTO || p == ATTN_CUDNN || p == ATTN_CUDNN_ATOMIC;
}

/* The exact forward on fp32 arrays. */
static opf_status fwd_exact(opf_ctx *ctx, const float *qkv, float *o, float *lse, int64_t B,
                            int64_t T, int64_t H, int64_t D)
{
    const char *fn = "attention forward (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    int64_t warps = B * H * T;
    if (warps <= 0 || D <= 0) return OPF_OK;
    attn_dims a = {B, T, H, D, H * D, 1.0f / sqrtf((float)D)};
    attn_fwd_kernel<<<warp_grid(warps), 32 * WARPS, 0, s->stream>>>(qkv, o, lse, a);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* The exact forward on typed qkv (an fp32-o entry, as the other paths'). */
static opf_status fwd_exact_entry(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, float *o,
                                  float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                  opf_dtype in_dt)
{
    (void)in_dt;  /* fp32 whatever the logical dtype: the CPU's bits */
    return opf_cuda_attn_fwd_f32(ctx, fwd_exact, qkv, qkv_t, o, lse, B, T, H, D,
                                 "attention forward (cuda)");
}

/* Each path's forward with an fp32 o, in attn_path's order; NULL for
 * cuDNN's, which store nn.h's o_t themselves. */
static const opf_cuda_attn_fwd_o32_fn fwd_o32[] = {
    opf_cuda_attn_fwd_gemm,   opf_cuda_attn_fwd_flash, fwd_exact_entry, opf_cuda_attn_fwd_flash2,
    opf_cuda_attn_fwd_flash2, NULL,                    NULL,            NULL};
static_assert(sizeof fwd_o32 / sizeof fwd_o32[0] == ATTN_PATH_COUNT, "a forward per path");

static opf_status attn_fwd(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, void *o, opf_dtype o_t,
                           float *lse, int64_t B, int64_t T, int64_t H, int64_t D, opf_dtype in_dt)
{
    const char *fn = "attention forward (cuda)";
    attn_path path;
    opf_status st = attention_path(ctx, fn, &path);
    if (st) return st;
    if (is_cudnn(path))
        return opf_cuda_attn_fwd_cudnn(ctx, qkv, qkv_t, o, o_t, lse, B, T, H, D, in_dt,
                                       cudnn_mode(path));
    return opf_cuda_attn_fwd_typed_o(ctx, fn, fwd_o32[path], qkv, qkv_t, o, o_t, lse, B, T, H, D,
                                     in_dt);
}

/* D_i = dot(do_i, o_i) of every (batch, head, row), into Dv [B*H*T]. */
static __global__ void attn_delta_kernel(const float *o, const float *dout, float *Dv, attn_dims a)
{
    int64_t BH = a.B * a.H;
    for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < BH * a.T;
         x += (int64_t)gridDim.x * blockDim.x) {
        int64_t bh = x / a.T, i = x % a.T, off = (bh / a.H * a.T + i) * a.C + bh % a.H * a.D;
        Dv[x] = nn_dot(dout + off, o + off, a.D);
    }
}

/* p and ds of query i against key j, as nn.c's backward computes them. */
__device__ __forceinline__ void attn_p_ds(const float *q, const float *k, const float *v,
                                          const float *dO, float lse_i, float D_i,
                                          const attn_dims &a, float *p, float *ds)
{
    *p = nn_expf(__fsub_rn(__fmul_rn(nn_dot(q, k, a.D), a.scale), lse_i));
    float dp = nn_dot(dO, v, a.D);
    *ds = __fmul_rn(__fmul_rn(*p, __fsub_rn(dp, D_i)), a.scale);
}

/* dq_i = the sum over j = 0..i in order of ds_ij k_j. */
static __global__ void attn_dq_kernel(const float *qkv, const float *lse, const float *dout,
                                      const float *Dv, float *dqkv, attn_dims a)
{
    int64_t w = nn_warp_id(), BH = a.B * a.H, C = a.C, D = a.D;
    if (w >= BH * a.T) return;
    int lane = nn_lane();
    int64_t bh = w % BH, i = a.T - 1 - w / BH, b = bh / a.H, h = bh % a.H;
    const float *base = qkv + b * a.T * 3 * C + h * D, *q = base + i * 3 * C;
    const float *dO = dout + (b * a.T + i) * C + h * D;
    float lse_i = lse[bh * a.T + i], D_i = Dv[bh * a.T + i];
    float *dq = dqkv + (b * a.T + i) * 3 * C + h * D;
    for (int64_t d0 = 0; d0 < D; d0 += DCHUNK) {
        float acc[DPL];
#pragma unroll
        for (int u = 0; u < DPL; u++) acc[u] = 0.0f;
        for (int64_t j0 = 0; j0 <= i; j0 += 32) {
            int64_t j = j0 + lane;
            float p = 0.0f, ds = 0.0f;
            const float *kj = base + j * 3 * C + C;
            if (j <= i) attn_p_ds(q, kj, kj + C, dO, lse_i, D_i, a, &p, &ds);
            int n = (int)(i - j0 + 1 < 32 ? i - j0 + 1 : 32);
            for (int t = 0; t < n; t++) {
                float dst = __shfl_sync(FULL, ds, t);
                const float *k = base + (j0 + t) * 3 * C + C + d0;
#pragma unroll
                for (int u = 0; u < DPL; u++) {
                    int64_t d = lane + 32 * u;
                    if (d0 + d < D) acc[u] = __fadd_rn(acc[u], __fmul_rn(dst, __ldg(k + d)));
                }
            }
        }
#pragma unroll
        for (int u = 0; u < DPL; u++) {
            int64_t d = d0 + lane + 32 * u;
            if (d < D) dq[d] = acc[u];
        }
    }
}

/* dk_j, dv_j = the sums over i = j..T-1 in order of ds_ij q_i and p_ij do_i. */
static __global__ void attn_dkv_kernel(const float *qkv, const float *lse, const float *dout,
                                       const float *Dv, float *dqkv, attn_dims a)
{
    int64_t w = nn_warp_id(), BH = a.B * a.H, C = a.C, D = a.D, T = a.T;
    if (w >= BH * T) return;
    int lane = nn_lane();
    int64_t bh = w % BH, j = w / BH, b = bh / a.H, h = bh % a.H;
    const float *base = qkv + b * T * 3 * C + h * D;
    const float *k = base + j * 3 * C + C, *v = k + C, *dob = dout + b * T * C + h * D;
    float *dk = dqkv + (b * T + j) * 3 * C + C + h * D, *dv = dk + C;
    for (int64_t d0 = 0; d0 < D; d0 += DCHUNK) {
        float ak[DPL], av[DPL];
#pragma unroll
        for (int u = 0; u < DPL; u++) ak[u] = av[u] = 0.0f;
        for (int64_t i0 = j; i0 < T; i0 += 32) {
            int64_t i = i0 + lane;
            float p = 0.0f, ds = 0.0f;
            if (i < T)
                attn_p_ds(base + i * 3 * C, k, v, dob + i * C, lse[bh * T + i], Dv[bh * T + i], a,
                          &p, &ds);
            int n = (int)(T - i0 < 32 ? T - i0 : 32);
            for (int t = 0; t < n; t++) {
                float pt = __shfl_sync(FULL, p, t), dst = __shfl_sync(FULL, ds, t);
                const float *q = base + (i0 + t) * 3 * C + d0, *dO = dob + (i0 + t) * C + d0;
#pragma unroll
                for (int u = 0; u < DPL; u++) {
                    int64_t d = lane + 32 * u;
                    if (d0 + d < D) {
                        av[u] = __fadd_rn(av[u], __fmul_rn(pt, __ldg(dO + d)));
                        ak[u] = __fadd_rn(ak[u], __fmul_rn(dst, __ldg(q + d)));
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < DPL; u++) {
            int64_t d = d0 + lane + 32 * u;
            if (d < D) dk[d] = ak[u], dv[d] = av[u];
        }
    }
}

/* The exact backward on fp32 arrays. */
static opf_status bwd_exact(opf_ctx *ctx, const float *qkv, const float *o, const float *lse,
                            const float *dout, float *dqkv, int64_t B, int64_t T, int64_t H,
                            int64_t D)
{
    const char *fn = "attention backward (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    int64_t warps = B * H * T;
    if (warps <= 0 || D <= 0) return OPF_OK;
    attn_dims a = {B, T, H, D, H * D, 1.0f / sqrtf((float)D)};
    void *ws;
    opf_status st = opf_cuda_scratch(ctx, s, sizeof(float) * (size_t)warps, &ws);
    if (st) return st;
    float *Dv = (float *)ws;
    attn_delta_kernel<<<opf_cuda_grid(s, warps, 256), 256, 0, s->stream>>>(o, dout, Dv, a);
    OPF_CUDA_LAUNCHED(ctx, fn);
    attn_dq_kernel<<<warp_grid(warps), 32 * WARPS, 0, s->stream>>>(qkv, lse, dout, Dv, dqkv, a);
    OPF_CUDA_LAUNCHED(ctx, fn);
    attn_dkv_kernel<<<warp_grid(warps), 32 * WARPS, 0, s->stream>>>(qkv, lse, dout, Dv, dqkv, a);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* The exact backward on typed qkv, do and dqkv (an fp32-o entry). */
static opf_status bwd_exact_entry(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const float *o,
                                  const float *lse, const void *dout, opf_dtype dout_t, void *dqkv,
                                  opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H, int64_t D,
                                  opf_dtype in_dt)
{
    (void)in_dt;
    return opf_cuda_attn_bwd_f32(ctx, bwd_exact, qkv, qkv_t, o, lse, dout, dout_t, dqkv, dqkv_t,
                                 B, T, H, D, "attention backward (cuda)");
}

/* Each path's backward with an fp32 o, in attn_path's order (as fwd_o32). */
static const opf_cuda_attn_bwd_o32_fn bwd_o32[] = {
    opf_cuda_attn_bwd_gemm,    opf_cuda_attn_bwd_flash, bwd_exact_entry, opf_cuda_attn_bwd_flash2,
    opf_cuda_attn_bwd_flash1p, NULL,                    NULL,            NULL};
static_assert(sizeof bwd_o32 / sizeof bwd_o32[0] == ATTN_PATH_COUNT, "a backward per path");

static opf_status attn_bwd(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const void *o,
                           opf_dtype o_t, const float *lse, const void *dout, opf_dtype dout_t,
                           void *dqkv, opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H,
                           int64_t D, opf_dtype in_dt)
{
    const char *fn = "attention backward (cuda)";
    attn_path path;
    opf_status st = attention_path(ctx, fn, &path);
    if (st) return st;
    if (is_cudnn(path))
        return opf_cuda_attn_bwd_cudnn(ctx, qkv, qkv_t, o, o_t, lse, dout, dout_t, dqkv, dqkv_t,
                                       B, T, H, D, in_dt, cudnn_mode(path));
    return opf_cuda_attn_bwd_typed_o(ctx, fn, bwd_o32[path], qkv, qkv_t, o, o_t, lse, dout,
                                     dout_t, dqkv, dqkv_t, B, T, H, D, in_dt);
}

/* ---- cross-entropy -------------------------------------------------------- */

/* Element i of x (dtype D) as fp32. */
template <opf_dtype D> __device__ __forceinline__ float nn_ld(const void *x, int64_t i)
{
    return opf_dev_to_f32<D>(__ldg((const typename opf_dev_plain<D>::store *)x + i));
}

/* A row of logits as the vector kernels walk it: h head elements up to the
 * first 16-byte boundary, nv whole 16-byte vectors of E elements, then the
 * tail. Rows of any length and alignment take it (the bases of a dtype's
 * array are aligned to its element). */
template <opf_dtype D> struct xent_row {
    typedef typename opf_dev_plain<D>::store T;
    enum { E = 16 / (int)sizeof(T) };
    const T *p;
    int64_t  h, nv, tail;  /* tail: the first element after the vectors */
    __device__ xent_row(const void *x, int64_t r, int64_t V)
    {
        p = (const T *)x + r * V;
        h = (int64_t)((16 - ((uintptr_t)p & 15)) & 15) / (int64_t)sizeof(T);
        if (h > V) h = V;
        nv = (V - h) / E;
        tail = h + nv * E;
    }
    __device__ __forceinline__ float at(int64_t j) const { return opf_dev_to_f32<D>(__ldg(p + j)); }
    __device__ __forceinline__ uint4 vec(int64_t i) const { return __ldg((const uint4 *)(p + h) + i); }
    __device__ __forceinline__ static void widen(uint4 u, float (&v)[E])
    {
        const T *e = (const T *)&u;
#pragma unroll
        for (int k = 0; k < E; k++) v[k] = opf_dev_to_f32<D>(e[k]);
    }
};

/* lse of row r: m = the CPU's max (x_0 when it is NaN, else the max of the
 * numbers, in any order), e = S(expf(x_j - m)) in lanesum.h's order: lane c
 * adds the terms j = c mod 32 in j order, then the fold. The row is read in
 * 16-byte vectors: a chunk of 32 of them (32 E elements) goes through the
 * warp's piece of shared memory, each lane computing the E exps of its
 * vector (the exps in flight), then lane c adding the chunk's terms
 * of its class in order; the next chunk's vector is loaded ahead. */
template <opf_dtype D>
static __global__ void __launch_bounds__(32 * WARPS)
xent_lse_kernel(const void *x, const int32_t *tgt, float *lse, int64_t rows, int64_t V)
{
    typedef xent_row<D> R;
    enum { E = R::E, CH = 32 * E };
    __shared__ __align__(16) float buf[WARPS][CH];
    int64_t r = nn_warp_id();
    if (r >= rows) return;
    int lane = nn_lane();
    float *b = buf[threadIdx.x >> 5];
    if (tgt[r] < 0) {
        if (lane == 0) lse[r] = 0.0f;
        return;
    }
    const R row(x, r, V);
    float m = -INFINITY, v[E];
    if (lane < row.h) m = row.at(lane);
#pragma unroll 4
    for (int64_t i = lane; i < row.nv; i += 32) {
        R::widen(row.vec(i), v);
#pragma unroll
        for (int k = 0; k < E; k++) m = fmaxf(m, v[k]);  /* fmaxf skips NaN */
    }
    if (row.tail + lane < V) m = fmaxf(m, row.at(row.tail + lane));
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    float x0 = row.at(0);
    if (isnan(x0)) m = x0;
    float e = 0.0f;
    if (lane < row.h) e = opf_expf_impl(__fsub_rn(row.at(lane), m));
    /* chunk q holds elements h + q CH ...; lane c's first of its class at
     * position (c - h) mod 32, as CH is a multiple of 32 */
    const int first = (int)((lane - row.h) & 31);
    uint4 next = lane < row.nv ? row.vec(lane) : make_uint4(0, 0, 0, 0);
    for (int64_t q0 = 0; q0 < row.nv; q0 += 32) {
        uint4 now = next;
        if (q0 + 32 + lane < row.nv) next = row.vec(q0 + 32 + lane);
        int64_t live = (row.nv - q0 < 32 ? row.nv - q0 : 32) * E;  /* the chunk's elements */
        R::widen(now, v);
#pragma unroll
        for (int k = 0; k < E; k++) v[k] = opf_expf_impl(__fsub_rn(v[k], m));
#pragma unroll
        for (int k = 0; k < E; k += 4)  /* 16-byte stores: no bank conflicts */
            *(float4 *)&b[lane * E + k] = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
        __syncwarp();
#pragma unroll
        for (int k = 0; k < E; k++)
            if (first + 32 * k < live) e = __fadd_rn(e, b[first + 32 * k]);
        __syncwarp();
    }
    int64_t j = row.tail + ((lane - row.tail) & 31);
    if (j < V) e = __fadd_rn(e, opf_expf_impl(__fsub_rn(row.at(j), m)));
    for (int o = 16; o; o >>= 1) e = __fadd_rn(e, __shfl_down_sync(FULL, e, o));
    if (lane == 0) lse[r] = __fadd_rn(m, nn_logf(e));
}

/* One block: the rows' lse_r - x_{r, tgt_r} in double, added in r order.
 * The block computes a chunk's terms at once (the x_{r, tgt_r} gathers all
 * in flight), then thread 0 adds them in order. An ignored row's term is
 * -0.0, which added to any sum gives that sum's bits (x + -0 = x under
 * round-to-nearest, +0 + -0 = +0): the same sum as skipping the row, with
 * no test in the chain of adds. */
enum { LOSS_THREADS = 1024, LOSS_CHUNK = 4096 };
template <opf_dtype D>
static __global__ void __launch_bounds__(LOSS_THREADS)
xent_loss_kernel(const void *x, const int32_t *tgt, const float *lse, float *loss, int64_t rows,
                 int64_t V)
{
    __shared__ double term[LOSS_CHUNK];
    __shared__ unsigned long long count;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    double sum = 0.0;
    unsigned long long mine = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += LOSS_CHUNK) {
        int len = (int)(rows - r0 < LOSS_CHUNK ? rows - r0 : LOSS_CHUNK);
        for (int i = (int)threadIdx.x; i < len; i += LOSS_THREADS) {
            int64_t r = r0 + i;
            bool c = tgt[r] >= 0;
            mine += c;
            term[i] = c ? (double)__fsub_rn(lse[r], nn_ld<D>(x, r * V + tgt[r])) : -0.0;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
#pragma unroll 8
            for (int k = 0; k < len; k++) sum = __dadd_rn(sum, term[k]);
        }
        __syncthreads();
    }
    atomicAdd(&count, mine);
    __syncthreads();
    if (threadIdx.x == 0) loss[0] = count ? __double2float_rn(__ddiv_rn(sum, (double)count)) : 0.0f;
}

static opf_status xent_dtype(opf_ctx *ctx, const char *fn, const char *what, opf_dtype dt)
{
    if (dt == OPF_F32 || dt == OPF_BF16 || dt == OPF_F16) return OPF_OK;
    return opf_error(ctx, OPF_ERR_DTYPE, "%s: %s is %s, expected f32, bf16 or f16", fn, what,
                     opf_dtype_name(dt));
}

static opf_status xent_fwd(opf_ctx *ctx, const void *x, opf_dtype xt, const int32_t *tgt,
                           float *lse, float *loss, int64_t rows, int64_t V)
{
    const char *fn = "cross-entropy forward (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    opf_status st = xent_dtype(ctx, fn, "the logits' dtype", xt);
    if (st) return st;
    return opf_dev_with_dtype(xt, [&](auto d) {
        constexpr opf_dtype D = decltype(d)::value;
        if (rows > 0) {
            xent_lse_kernel<D><<<warp_grid(rows), 32 * WARPS, 0, s->stream>>>(x, tgt, lse, rows, V);
            OPF_CUDA_LAUNCHED(ctx, fn);
        }
        xent_loss_kernel<D><<<1, LOSS_THREADS, 0, s->stream>>>(x, tgt, lse, loss, rows, V);
        OPF_CUDA_LAUNCHED(ctx, fn);
        return OPF_OK;
    });
}

/* *g = dloss / (the number of counted rows), 0 when none. */
static __global__ void xent_grad_scale_kernel(const int32_t *tgt, const float *dloss, int64_t rows,
                                              float *g)
{
    __shared__ unsigned long long count;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    unsigned long long mine = 0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) mine += tgt[r] >= 0;
    atomicAdd(&count, mine);
    __syncthreads();
    if (threadIdx.x == 0)
        *g = count ? __fdiv_rn(dloss[0], __ull2float_rn(count)) : 0.0f;
}

/* dx = (expf(x - lse) - [j = t]) g, a block a row (0 on ignored rows). */
template <opf_dtype D, opf_dtype DO>
static __global__ void xent_bwd_kernel(const void *x, const int32_t *tgt, const float *lse,
                                       const float *g, void *dx, int64_t rows, int64_t V)
{
    float gg = *g;
    typename opf_dev_plain<DO>::store *out = (typename opf_dev_plain<DO>::store *)dx;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t t = tgt[r];
        float l = lse[r];
#pragma unroll 4
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
            float e = opf_expf_impl(__fsub_rn(nn_ld<D>(x, r * V + j), l));
            float d = t < 0 ? 0.0f : __fmul_rn(__fsub_rn(e, j == t ? 1.0f : 0.0f), gg);
            out[r * V + j] = opf_dev_from_f32<DO>(d);
        }
    }
}

/* The same where every row of x and dx is whole 16-byte vectors: a thread
 * E elements a step, one 16-byte load and E exps in flight. */
template <opf_dtype D, opf_dtype DO>
static __global__ void xent_bwd_vec_kernel(const void *x, const int32_t *tgt, const float *lse,
                                           const float *g, void *dx, int64_t rows, int64_t V)
{
    typedef typename opf_dev_plain<D>::store T;
    typedef typename opf_dev_plain<DO>::store OT;
    enum { E = 16 / (int)sizeof(T) };
    struct __align__(sizeof(OT) * E < 16 ? sizeof(OT) * E : 16) ovec { OT v[E]; };
    const float gg = *g;
    const int64_t nv = V / E;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const int64_t t = tgt[r];
        const float l = lse[r];
        const uint4 *xv = (const uint4 *)((const T *)x + r * V);
        ovec *ov = (ovec *)((OT *)dx + r * V);
        if (t < 0) {
            ovec z;
#pragma unroll
            for (int k = 0; k < E; k++) z.v[k] = opf_dev_from_f32<DO>(0.0f);
            for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) ov[i] = z;
            continue;
        }
#pragma unroll 2
        for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
            uint4 u = __ldg(xv + i);
            const T *e = (const T *)&u;
            ovec o;
#pragma unroll
            for (int k = 0; k < E; k++) {
                float ex = opf_expf_impl(__fsub_rn(opf_dev_to_f32<D>(e[k]), l));
                o.v[k] = opf_dev_from_f32<DO>(__fmul_rn(__fsub_rn(ex, i * E + k == t ? 1.0f : 0.0f), gg));
            }
            ov[i] = o;
        }
    }
}

static opf_status xent_bwd(opf_ctx *ctx, const void *x, opf_dtype xt, const int32_t *tgt,
                           const float *lse, const float *dloss, void *dx, opf_dtype dxt,
                           int64_t rows, int64_t V)
{
    const char *fn = "cross-entropy backward (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    opf_status st = xent_dtype(ctx, fn, "the logits' dtype", xt);
    if (!st) st = xent_dtype(ctx, fn, "dx's dtype", dxt);
    if (st || rows <= 0 || V <= 0) return st;
    void *ws;
    if ((st = opf_cuda_scratch(ctx, s, sizeof(float), &ws))) return st;
    xent_grad_scale_kernel<<<1, 1024, 0, s->stream>>>(tgt, dloss, rows, (float *)ws);
    OPF_CUDA_LAUNCHED(ctx, fn);
    unsigned grid = (unsigned)(rows < 65536 ? rows : 65536);
    bool vec = V * (int64_t)opf_dtype_nbytes(xt, 1) % 16 == 0 &&
               V * (int64_t)opf_dtype_nbytes(dxt, 1) % 16 == 0 && opf_cuda_aligned16(x) &&
               opf_cuda_aligned16(dx);
    return opf_dev_with_dtype(xt, [&](auto d) {
        return opf_dev_with_dtype(dxt, [&](auto o) {
            constexpr opf_dtype D = decltype(d)::value, DO = decltype(o)::value;
            if (vec)
                xent_bwd_vec_kernel<D, DO>
                    <<<grid, 256, 0, s->stream>>>(x, tgt, lse, (const float *)ws, dx, rows, V);
            else
                xent_bwd_kernel<D, DO>
                    <<<grid, 256, 0, s->stream>>>(x, tgt, lse, (const float *)ws, dx, rows, V);
            OPF_CUDA_LAUNCHED(ctx, fn);
            return OPF_OK;
        });
    });
}

/* ---- sum of squares -------------------------------------------------------- */

/* lanesum.h's order in double: a warp per chunk, each lane its own
 * squares in order, then the fold. */
__device__ __forceinline__ double nn_fold_d(double v)
{
    for (int o = 16; o; o >>= 1) v = __dadd_rn(v, __shfl_down_sync(FULL, v, o));
    return v;
}

/* ---- clipping over many arrays (nn.h's opf_nn_span) ------------------------
 * Up to SPANS arrays a launch, their descriptors in the kernel's parameters
 * with the prefix sums of their chunk counts (optim.cu's scheme): the sum of
 * squares is one launch over every 4096-value chunk of the batch (a warp a
 * chunk, found by binary search: lane l adds the squares of values l, l + 32,
 * ... of the chunk in order, then the fold) and one block that folds each
 * array's chunk sums (chunk c in lane c mod 32) and adds the arrays' sums to
 * *acc one at a time in order (nn.h's sumsq; sumsq itself is this on one
 * array); the scaling is
 * one launch over CLIP_CHUNK-value chunks. So a model's clipping is a few
 * launches, not three an array, with the same bits. */
enum {
    SPANS = 128,        /* arrays a launch: 4 KiB of descriptors */
    CLIP_CHUNK = 2048,  /* values a block takes at a time when scaling */
    FOLD_WARPS = 32,    /* warps of the folding block */
};

typedef struct span_d {
    const void *x;
    int64_t     n;
    int         dt;  /* opf_dtype: f32, bf16 or f16 */
} span_d;

typedef struct span_batch {
    span_d  t[SPANS];
    int64_t first[SPANS + 1];  /* first[k]: array k's first chunk; first[count]: all chunks */
    int     count;
} span_batch;

template <typename T>
__device__ __forceinline__ double chunk_sumsq(const T *xc, int len, int lane)
{
    double s = 0.0;
    for (int i = lane; i < len; i += 32) {
        double v = (double)opf_dev_widen<T>(xc[i]);
        s = __dadd_rn(s, __dmul_rn(v, v));
    }
    return nn_fold_d(s);
}

static __global__ void sumsq_spans_kernel(const span_batch b, double *part)
{
    int lane = nn_lane();
    int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t c = nn_warp_id(); c < b.first[b.count]; c += warps) {
        int k = opf_dev_chunk_owner(b.first, b.count, c);
        int64_t c0 = (c - b.first[k]) * SUMSQ_CHUNK, n = b.t[k].n;
        int len = n - c0 < SUMSQ_CHUNK ? (int)(n - c0) : SUMSQ_CHUNK;
        double v;
        if (b.t[k].dt == OPF_F32) v = chunk_sumsq((const float *)b.t[k].x + c0, len, lane);
        else if (b.t[k].dt == OPF_BF16)
            v = chunk_sumsq((const __nv_bfloat16 *)b.t[k].x + c0, len, lane);
        else v = chunk_sumsq((const __half *)b.t[k].x + c0, len, lane);
        if (lane == 0) part[c] = v;
    }
}

/* One block: array k's chunk sums folded as one lane sum (chunk c of the
 * array in lane c mod 32), then *acc = (add ? *acc : 0) +
 * S_0, + S_1, ... in order by one thread. */
static __global__ void sumsq_spans_total_kernel(const span_batch b, const double *part,
                                                double *acc, bool add)
{
    __shared__ double sums[SPANS];
    int lane = nn_lane(), w = (int)(threadIdx.x / 32);
    for (int k = w; k < b.count; k += FOLD_WARPS) {
        double t = 0.0;
        for (int64_t c = b.first[k] + lane; c < b.first[k + 1]; c += 32) t = __dadd_rn(t, part[c]);
        t = nn_fold_d(t);
        if (lane == 0) sums[k] = t;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double a = add ? *acc : 0.0;
        for (int k = 0; k < b.count; k++) a = add || k ? __dadd_rn(a, sums[k]) : sums[k];
        *acc = a;
    }
}

/* Each thread reads the sum and decides, as the CPU does once. */
template <opf_dtype D>
__device__ __forceinline__ void clip_chunk(void *x, int64_t i0, int64_t i1, float f)
{
    typename opf_dev_plain<D>::store *p = (typename opf_dev_plain<D>::store *)x;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
        p[i] = opf_dev_from_f32<D>(opf_dev_mul(f, opf_dev_to_f32<D>(p[i])));
}

static __global__ void clip_spans_kernel(const span_batch b, const double *sumsq, double max_norm)
{
    double norm = __dsqrt_rn(*sumsq);
    if (!(norm > max_norm) || isinf(norm)) return;
    float f = __double2float_rn(__ddiv_rn(max_norm, __dadd_rn(norm, 1e-6)));
    for (int64_t c = blockIdx.x; c < b.first[b.count]; c += gridDim.x) {
        int k = opf_dev_chunk_owner(b.first, b.count, c);
        int64_t i0 = (c - b.first[k]) * CLIP_CHUNK, n = b.t[k].n;
        int64_t i1 = n - i0 < CLIP_CHUNK ? n : i0 + CLIP_CHUNK;
        void *x = (void *)b.t[k].x;
        if (b.t[k].dt == OPF_F32) clip_chunk<OPF_F32>(x, i0, i1, f);
        else if (b.t[k].dt == OPF_BF16) clip_chunk<OPF_BF16>(x, i0, i1, f);
        else clip_chunk<OPF_F16>(x, i0, i1, f);
    }
}

/* The next batch of x's count arrays from array k0 (SPANS at most) into b,
 * chunks of `chunk` values; OPF_ERR_DTYPE for an array of another dtype than
 * f32, bf16 or f16. */
static opf_status span_batch_of(opf_ctx *ctx, const char *fn, const opf_nn_span *x, int count,
                                int k0, int64_t chunk, span_batch *b)
{
    count = count - k0 < SPANS ? count - k0 : SPANS;
    b->count = count;
    b->first[0] = 0;
    for (int k = 0; k < count; k++) {
        const opf_nn_span *t = &x[k0 + k];
        if (t->dt != OPF_F32 && t->dt != OPF_BF16 && t->dt != OPF_F16)
            return opf_error(ctx, OPF_ERR_DTYPE, "%s: array %d has dtype %s, expected f32, bf16 "
                             "or f16", fn, k0 + k, opf_dtype_name(t->dt));
        int64_t n = t->n > 0 ? t->n : 0;
        b->t[k] = (span_d){t->x, n, (int)t->dt};
        b->first[k + 1] = b->first[k] + (n + chunk - 1) / chunk;
    }
    return OPF_OK;
}

static opf_status sumsq_acc(opf_ctx *ctx, const opf_nn_span *x, int count, double *acc, bool add)
{
    const char *fn = "sumsq_acc (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    for (int k0 = 0; k0 < count; k0 += SPANS) {
        span_batch b;
        opf_status st = span_batch_of(ctx, fn, x, count, k0, SUMSQ_CHUNK, &b);
        void *ws = NULL;
        int64_t nc = b.first[b.count];
        if (!st) st = opf_cuda_scratch(ctx, s, sizeof(double) * (size_t)(nc + 1), &ws);
        if (st) return st;
        if (nc) {
            int64_t want = (nc + WARPS - 1) / WARPS, cap = (int64_t)s->sm_count * 16;
            unsigned grid = (unsigned)(want < cap ? want : cap);  /* a warp a chunk, looping */
            sumsq_spans_kernel<<<grid, 32 * WARPS, 0, s->stream>>>(b, (double *)ws);
            OPF_CUDA_LAUNCHED(ctx, fn);
        }
        sumsq_spans_total_kernel<<<1, 32 * FOLD_WARPS, 0, s->stream>>>(b, (double *)ws, acc,
                                                                      add || k0 > 0);
        OPF_CUDA_LAUNCHED(ctx, fn);
    }
    return OPF_OK;
}

static opf_status clip_scale(opf_ctx *ctx, const opf_nn_span *x, int count, const double *sumsq,
                             double max_norm)
{
    const char *fn = "clip_scale (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    for (int k0 = 0; k0 < count; k0 += SPANS) {
        span_batch b;
        opf_status st = span_batch_of(ctx, fn, x, count, k0, CLIP_CHUNK, &b);
        if (st) return st;
        int64_t nc = b.first[b.count];
        if (!nc) continue;
        unsigned grid = (unsigned)(nc < (int64_t)s->sm_count * 8 ? nc : (int64_t)s->sm_count * 8);
        clip_spans_kernel<<<grid, 256, 0, s->stream>>>(b, sumsq, max_norm);
        OPF_CUDA_LAUNCHED(ctx, fn);
    }
    return OPF_OK;
}

/* One array's sum, read back: sumsq_acc's launches on it into a device
 * double of the caching allocator. */
static opf_status sumsq(opf_ctx *ctx, const void *x, opf_dtype dt, int64_t n, double *out)
{
    *out = 0.0;
    if (n <= 0) return OPF_OK;
    void *acc = NULL;
    opf_nn_span span = {(void *)x, dt, n};
    opf_status st = opf_cuda_alloc(ctx, sizeof(double), &acc);
    if (!st) st = sumsq_acc(ctx, &span, 1, (double *)acc, false);
    if (!st) st = opf_cuda_copy(ctx, out, acc, sizeof(double), OPF_CUDA_D2H);
    opf_cuda_free(ctx, acc);
    return st;
}

extern "C" const opf_nn_kernels opf_cuda_nn = {
    .embed_fwd = embed_fwd,
    .embed_bwd = embed_bwd,
    .attn_fwd = attn_fwd,
    .attn_bwd = attn_bwd,
    .xent_fwd = xent_fwd,
    .xent_bwd = xent_bwd,
    .sumsq = sumsq,
    .sumsq_acc = sumsq_acc,
    .clip_scale = clip_scale,
};
