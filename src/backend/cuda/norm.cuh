/* norm.cuh: the device side of the norms (norm.cu): the arguments of a
 * call, element access, staging, the warp-tree sums, the row kernels of each
 * mode and the dgamma / dbeta terms of colsum.cuh. Its file comment says how
 * they work. Included by norm.cu (the entries, the launches and the column
 * sums of mixed dtypes), by norm_cols_<d>.cu (the column sums of one dtype
 * each, below) and by norm_bwd_one.cu (the backward in one launch). */
#ifndef OPFUSE_CUDA_NORM_CUH
#define OPFUSE_CUDA_NORM_CUH

#include "backend/cuda/colsum.cuh"
#include "backend/cuda/cuda-impl.h"
#include "backend/cuda/qout.cuh"

enum {
    LANES = OPF_NORM_LANES,
    VEC = 8,                          /* elements per vector access */
    CACHE_MAX = 96 * 1024,            /* the most shared memory a warp stages */
    DOUBLE_MAX = 32 * 1024,           /* the most a warp stages twice (next row in flight) */
    SM_SMEM = 228 * 1024,             /* Hopper: shared memory of an SM */
    BLOCK_RESERVED = 1024,            /* ... of which each block holds back */
    BLOCK_SMEM_MAX = 227 * 1024,      /* ... and the most one block may opt in to */
    MAX_WARPS = 8,                    /* warps of a row block */
    COL_WARPS = 4,                    /* warps (classes) of a column-sum block */
    COL_PAIRS_WARPS = 16,             /* column-sum warps an SM that call for column pairs */
    MIN_WARPS = 16,                   /* row-kernel warps an SM that double buffers must leave */
    SUM_BATCH = 8,                    /* terms in flight per lane of a row sum */
    ANY = -1,                         /* the dtypes of a call known only at run time */
};
static_assert(LANES == 32, "a sum's lanes are a warp's");

/* What a row kernel computes. */
typedef enum norm_mode { LN_FWD, RMS_FWD, L2_FWD, LN_BWD, RMS_BWD, L2_BWD } norm_mode;

__host__ __device__ constexpr bool is_bwd(int m) { return m >= LN_BWD; }
__host__ __device__ constexpr bool has_gamma(int m) { return m != L2_FWD && m != L2_BWD; }

/* The arguments of one call (one struct for every mode; unused ones NULL). */
typedef struct norm_args {
    const void  *x, *dz, *gamma, *beta, *dadd;
    opf_dtype    xt, dzt, gt, bt, addt;
    opf_dtype    act, dact;  /* the dtypes x and dz are seen in */
    void        *out;        /* z, y or dx */
    opf_dtype    outt;
    float       *mu, *rs;    /* [rows]: written forward, read backward */
    unsigned    *amax;       /* forward: max-accumulates the amax keys of the
                                outputs as stored (qout.h's fused path); or NULL */
    int64_t      rows, H;
    float        rn, eps;    /* fl(1/H) */
    bool         zc;         /* zero-centred gamma */
    bool         vec;        /* 16-byte accesses: H % 8 == 0 and aligned bases */
    bool         prefetch;   /* gamma and beta asked into L1 first (norm_rows) */
} norm_args;

/* ---- element access ------------------------------------------------------ */

/* The bits of element i of p (dtype t) as stored, apart from their widening
 * so that a batch of loads issues before any of its values is needed, for
 * any dtype. */
__device__ __forceinline__ uint32_t ld_bits(const void *p, opf_dtype t, int64_t i)
{
    return t == OPF_F32 ? ((const uint32_t *)p)[i] : ((const uint16_t *)p)[i];
}

/* The bits of elements i .. i + N - 1 (N = 1 or 2; for 2, i is even and p
 * aligned): one load. */
template <int N>
__device__ __forceinline__ void ld_bits_n(const void *p, opf_dtype t, int64_t i, uint32_t u[N])
{
    if (N == 1) {
        u[0] = ld_bits(p, t, i);
    } else if (t == OPF_F32) {
        uint2 v = ((const uint2 *)p)[i / 2];
        u[0] = v.x, u[N - 1] = v.y;
    } else {
        uint32_t v = ((const uint32_t *)p)[i / 2];
        u[0] = v & 0xFFFFu, u[N - 1] = v >> 16;  /* little-endian: element i low */
    }
}

/* fp32 of one element's bits (exact). */
__device__ __forceinline__ float widen_bits(uint32_t u, opf_dtype t)
{
    return t == OPF_F32    ? __uint_as_float(u)
           : t == OPF_BF16 ? __uint_as_float(u << 16)
                           : __half2float(__ushort_as_half((unsigned short)u));
}

__device__ __forceinline__ float ld1(const void *p, opf_dtype t, int64_t i)
{
    return widen_bits(ld_bits(p, t, i), t);
}

__device__ __forceinline__ void ld8(const void *p, opf_dtype t, int64_t i, float v[VEC])
{
    switch (t) {
    case OPF_BF16: opf_dev_load8((const __nv_bfloat16 *)p + i, v); break;
    case OPF_F16: opf_dev_load8((const __half *)p + i, v); break;
    default: opf_dev_load8((const float *)p + i, v); break;
    }
}

/* v rounded to dtype t and widened back (row_in of the CPU: exact for a value
 * of t already). */
__device__ __forceinline__ float seen_as(float v, opf_dtype t)
{
    switch (t) {
    case OPF_BF16: return __bfloat162float(__float2bfloat16_rn(v));
    case OPF_F16: return __half2float(__float2half_rn(v));
    default: return v;
    }
}

__device__ __forceinline__ void st1(void *p, opf_dtype t, int64_t i, float v)
{
    switch (t) {
    case OPF_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    case OPF_F16: ((__half *)p)[i] = __float2half_rn(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

/* Whether act holds every value of dtype t (the same dtype, or fp32). */
__host__ __device__ __forceinline__ bool holds_all(opf_dtype act, opf_dtype t)
{
    return t == act || act == OPF_F32;
}

/* A value of dtype t seen as act: seen_as, but skipped where act holds
 * every value of t, where it changes no bit. */
__device__ __forceinline__ float seen_from(float v, opf_dtype t, opf_dtype act)
{
    return holds_all(act, t) ? v : seen_as(v, act);
}

/* Stores 8 values, each rounded once to t; 16-byte aligned. */
__device__ __forceinline__ void st8(void *p, opf_dtype t, int64_t i, const float v[VEC])
{
    if (t == OPF_F32) {
        float *d = (float *)p + i;
        *(float4 *)d = make_float4(v[0], v[1], v[2], v[3]);
        *(float4 *)(d + 4) = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    uint4 u;
    uint16_t *h = (uint16_t *)&u;
#pragma unroll
    for (int k = 0; k < VEC; k++)
        h[k] = t == OPF_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v[k]))
                             : __half_as_ushort(__float2half_rn(v[k]));
    *(uint4 *)((uint16_t *)p + i) = u;
}

/* key max-accumulated with the amax key of v as st1 / st8 store it in
 * dtype t (rounding is monotonic, so this is the key the quantize kernel's
 * amax pass reads). */
__device__ __forceinline__ unsigned stored_key_max(unsigned key, float v, opf_dtype t)
{
    return opf_dev_amax_max(key, seen_as(v, t));
}

/* g_j = gamma_j (+ 1.0f zero-centred). */
__device__ __forceinline__ float gamma_at(const norm_args &a, int64_t j)
{
    float g = ld1(a.gamma, a.gt, j);
    return a.zc ? g + 1.0f : g;
}

__host__ __device__ constexpr int64_t elem_size(opf_dtype t) { return t == OPF_F32 ? 4 : 2; }

/* One row of a tensor as the kernel sees it: its values in dtype t, staged
 * in shared memory or in global memory (one generic pointer: no branch
 * between the two in the inner loops), each widened and rounded to act at
 * each use. */
typedef struct row_view {
    const void *p;
    opf_dtype   t, act;

    __device__ __forceinline__ float at(int64_t j) const { return seen_from(ld1(p, t, j), t, act); }
    __device__ __forceinline__ void at8(int64_t j, float v[VEC]) const
    {
        ld8(p, t, j, v);
#pragma unroll
        for (int k = 0; k < VEC; k++) v[k] = seen_from(v[k], t, act);
    }
} row_view;

/* ---- staging ----------------------------------------------------------- */

/* Starts copying row r of p (dtype t) into buf as it is: 16-byte
 * asynchronous copies when vec (the row is whole 16-byte chunks), else
 * element by element. The caller commits, waits and syncs the warp. */
__device__ __forceinline__ void stage(void *buf, const void *p, opf_dtype t, int64_t r, int64_t H,
                                      bool vec, int lane)
{
    int64_t es = elem_size(t), bytes = H * es;
    const char *src = (const char *)p + r * bytes;
    if (vec) {
        for (int64_t c = (int64_t)lane * 16; c < bytes; c += LANES * 16)
            opf_dev_copy16_async((char *)buf + c, src + c);
    } else if (es == 2) {
        for (int64_t j = lane; j < H; j += LANES) ((uint16_t *)buf)[j] = ((const uint16_t *)src)[j];
    } else {
        for (int64_t j = lane; j < H; j += LANES) ((float *)buf)[j] = ((const float *)src)[j];
    }
}

/* The bytes a staged row of H elements of t takes (whole 16-byte chunks). */
__host__ __device__ constexpr int64_t row_bytes(int64_t H, opf_dtype t)
{
    return (H * elem_size(t) + 15) / 16 * 16;
}

/* ---- the sums (norm.h) --------------------------------------------------- */

/* The lanes' partials folded in halves (lane i += lane i + off), then lane
 * 0's total on every lane. */
__device__ __forceinline__ float fold(float v)
{
    for (int off = LANES / 2; off; off >>= 1) v = v + __shfl_down_sync(0xFFFFFFFFu, v, off);
    return __shfl_sync(0xFFFFFFFFu, v, 0);
}

/* Two sums over the row in one pass, each this lane's terms left to right
 * then the fold. SUM_BATCH terms are computed (their loads in flight
 * together) before they are added in order. */
template <typename F>
__device__ __forceinline__ float2 row_sum2(int64_t H, int lane, F terms)
{
    float p = 0.0f, q = 0.0f;
    int64_t j = lane;
    for (; j + (SUM_BATCH - 1) * LANES < H; j += SUM_BATCH * LANES) {
        float2 t[SUM_BATCH];
#pragma unroll
        for (int u = 0; u < SUM_BATCH; u++) t[u] = terms(j + u * LANES);
#pragma unroll
        for (int u = 0; u < SUM_BATCH; u++) {
            p = p + t[u].x;
            q = q + t[u].y;
        }
    }
    for (; j < H; j += LANES) {
        float2 t = terms(j);
        p = p + t.x;
        q = q + t.y;
    }
    return make_float2(fold(p), fold(q));
}

/* S(term(j)) over the row. */
template <typename F> __device__ __forceinline__ float row_sum(int64_t H, int lane, F term)
{
    return row_sum2(H, lane, [&](int64_t j) { return make_float2(term(j), 0.0f); }).x;
}

/* ---- the outputs of a row -------------------------------------------------
 * f(x, d, g, b, add) of each element: x and d from the views, g, b and add
 * loaded only where the mode uses them. */
template <int M, typename F>
__device__ __forceinline__ unsigned row_out(const norm_args &a, const row_view &xv,
                                            const row_view &dv, int64_t r, int lane, F f)
{
    unsigned key = 0;
    const bool B = M == LN_FWD, ADD = (M == LN_BWD || M == RMS_BWD) && a.dadd;
    int64_t H = a.H, o = r * H;
    if (a.vec) {
        for (int64_t c = lane; c < H / VEC; c += LANES) {
            int64_t j = c * VEC;
            float x[VEC], d[VEC] = {0}, g[VEC] = {0}, b[VEC] = {0}, ad[VEC] = {0}, z[VEC];
            xv.at8(j, x);
            if (is_bwd(M)) dv.at8(j, d);
            if (has_gamma(M)) {
                ld8(a.gamma, a.gt, j, g);
#pragma unroll
                for (int k = 0; k < VEC; k++) g[k] = a.zc ? g[k] + 1.0f : g[k];
            }
            if (B) ld8(a.beta, a.bt, j, b);
            if (ADD) ld8(a.dadd, a.addt, o + j, ad);
#pragma unroll
            for (int k = 0; k < VEC; k++) z[k] = f(x[k], d[k], g[k], b[k], ad[k]);
            st8(a.out, a.outt, o + j, z);
            if (!is_bwd(M) && a.amax)
#pragma unroll
                for (int k = 0; k < VEC; k++) key = stored_key_max(key, z[k], a.outt);
        }
        return key;
    }
    for (int64_t j = lane; j < H; j += LANES) {
        float d = is_bwd(M) ? dv.at(j) : 0.0f, g = has_gamma(M) ? gamma_at(a, j) : 0.0f;
        float b = B ? ld1(a.beta, a.bt, j) : 0.0f, ad = ADD ? ld1(a.dadd, a.addt, o + j) : 0.0f;
        float z = f(xv.at(j), d, g, b, ad);
        st1(a.out, a.outt, o + j, z);
        if (!is_bwd(M) && a.amax) key = stored_key_max(key, z, a.outt);
    }
    return key;
}

/* ---- one row of each mode ------------------------------------------------ */

/* Forward LayerNorm / RMSNorm: mu and m2 as norm.h, then z; returns the
 * lane's amax key of z (0 unless a.amax). */
template <int M>
__device__ __forceinline__ unsigned fwd_row(const norm_args &a, const row_view &xv, int64_t r,
                                        int lane)
{
    int64_t H = a.H;
    float rn = a.rn;
    float mu = row_sum(H, lane, [&](int64_t j) { return xv.at(j); }) * rn;
    float m2 = row_sum(H, lane, [&](int64_t j) {
        float d = xv.at(j) - mu;
        return d * d;
    });
    float var = rn * m2;
    float rs = M == LN_FWD ? 1.0f / sqrtf(var + a.eps) : 1.0f / sqrtf(var + mu * mu + a.eps);
    if (lane == 0) {
        if (M == LN_FWD) a.mu[r] = mu;
        a.rs[r] = rs;
    }
    if (M == LN_FWD)
        return row_out<M>(a, xv, xv, r, lane, [&](float x, float, float g, float b, float) {
            float y = rs * (x - mu);
            float gy = g * y;
            return gy + b;
        });
    return row_out<M>(a, xv, xv, r, lane, [&](float x, float, float g, float, float) {
            float y = rs * x;
            return g * y;
        });
}

__device__ __forceinline__ void l2_fwd_row(const norm_args &a, const row_view &xv, int64_t r,
                                           int lane)
{
    float s = row_sum(a.H, lane, [&](int64_t j) {
        float x = xv.at(j);
        return x * x;
    });
    float rv = 1.0f / sqrtf(s + a.eps);
    if (lane == 0) a.rs[r] = rv;
    row_out<L2_FWD>(a, xv, xv, r, lane,
                    [&](float x, float, float, float, float) { return x * rv; });
}

__device__ __forceinline__ void ln_bwd_row(const norm_args &a, const row_view &xv,
                                           const row_view &dv, int64_t r, int lane)
{
    float mu = a.mu[r], rs = a.rs[r], rn = a.rn;
    float2 s = row_sum2(a.H, lane, [&](int64_t j) {
        float y = rs * (xv.at(j) - mu);
        float e = gamma_at(a, j) * dv.at(j);
        return make_float2(e, e * y);
    });
    float av = s.x * rn, c = s.y * rn;
    bool add = a.dadd != NULL;
    row_out<LN_BWD>(a, xv, dv, r, lane, [&](float x, float dz, float g, float, float ad) {
        float y = rs * (x - mu);
        float e = g * dz;
        float cy = c * y;
        float t = cy + av;
        float dx = rs * (e - t);
        return add ? dx + ad : dx;
    });
}

__device__ __forceinline__ void rms_bwd_row(const norm_args &a, const row_view &xv,
                                            const row_view &dv, int64_t r, int lane)
{
    float rs = a.rs[r];
    float c = row_sum(a.H, lane, [&](int64_t j) {
        float y = rs * xv.at(j);
        float e = gamma_at(a, j) * dv.at(j);
        return e * y;
    }) * a.rn;
    bool add = a.dadd != NULL;
    row_out<RMS_BWD>(a, xv, dv, r, lane, [&](float x, float dz, float g, float, float ad) {
        float y = rs * x;
        float e = g * dz;
        float cy = c * y;
        float dx = rs * (e - cy);
        return add ? dx + ad : dx;
    });
}

__device__ __forceinline__ void l2_bwd_row(const norm_args &a, const row_view &xv,
                                           const row_view &dv, int64_t r, int lane)
{
    float rv = a.rs[r];
    float c = row_sum(a.H, lane, [&](int64_t j) {
        float y = xv.at(j) * rv;
        return dv.at(j) * y;
    });
    row_out<L2_BWD>(a, xv, dv, r, lane, [&](float x, float dy, float, float, float) {
        float y = x * rv;
        float cy = c * y;
        return rv * (dy - cy);
    });
}

/* The common case compiled on its own: x, dz, gamma and the compute dtype
 * all FT (as constants, every dtype switch of the inner loops folds away and
 * their loads issue together instead of one behind each branch). */
template <int FT> __device__ __forceinline__ void fix_dtypes(norm_args &a)
{
    if (FT == ANY) return;
    a.xt = a.dzt = a.gt = a.act = a.dact = (opf_dtype)FT;
}

/* Whether every given tensor of a allows 16-byte accesses (norm_args.vec). */
static inline bool vec_ok(const norm_args &a)
{
    const void *ps[] = {a.x, a.dz, a.gamma, a.beta, a.dadd, a.out};
    bool ok = a.H % VEC == 0;
    for (const void *p : ps) ok = ok && (!p || opf_cuda_aligned16(p));
    return ok;
}

static inline bool one_dtype(const norm_args &a, opf_dtype t, bool bwd)
{
    return a.xt == t && a.act == t && a.gt == t && (!bwd || (a.dzt == t && a.dact == t));
}

/* Asks L1 for the bytes at p, a 128-byte line a lane (bits unchanged).
 * gamma and beta are read by every row, each element of them by its lane
 * only at the row's output (and in the backward's sum), one dependent
 * L2 round trip a loop iteration; asked for before the row is staged,
 * they are on their way while it is. PREFETCH_MAX bounds the bytes (L1
 * is what the shared-memory carveout leaves: 28 KB of an SM's 256). */
enum { PREFETCH_MAX = 16 * 1024 };
__device__ __forceinline__ void prefetch_l1(const void *p, int64_t bytes, int lane)
{
    size_t g = __cvta_generic_to_global(p), end = g + (size_t)bytes;
    for (size_t l = (g & ~(size_t)127) + (size_t)lane * 128; l < end; l += LANES * 128)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(l));
}

/* Whether a launch asks L1 for a's gamma and beta: they fit PREFETCH_MAX,
 * unless OPF_CUDA_NORM_PREFETCH=0 (read once a process, off the launch
 * path: a benchmark times each setting in a process of its own). */
static inline bool prefetch_ok(const norm_args &a)
{
    static int off = -1;  /* every thread that reads the variable stores the same value */
    int o = __atomic_load_n(&off, __ATOMIC_RELAXED);
    if (o < 0) {
        const char *v = getenv("OPF_CUDA_NORM_PREFETCH");
        o = v && v[0] == '0';
        __atomic_store_n(&off, o, __ATOMIC_RELAXED);
    }
    int64_t bytes = (a.gamma ? a.H * elem_size(a.gt) : 0) + (a.beta ? a.H * elem_size(a.bt) : 0);
    return !o && bytes > 0 && bytes <= PREFETCH_MAX;
}

/* One warp per row (grid-stride over rows): block `block` of `blocks`
 * (the grid's, or the rows' share of a grid they share: norm_bwd_one.cu).
 * With slots > 0 each warp stages its rows in its slice of smem (the
 * dynamic shared memory), x then dz, in `slots` buffers: with two, the next
 * row's copy is in flight while this row is computed. */
template <int M, int FT>
__device__ __forceinline__ void norm_rows(norm_args a, int slots, int64_t block, int64_t blocks,
                                          char *smem)
{
    fix_dtypes<FT>(a);
    const int warps = blockDim.x / LANES;
    int w = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    int64_t xb = row_bytes(a.H, a.xt), slot = xb + (is_bwd(M) ? row_bytes(a.H, a.dzt) : 0);
    char *mine = smem + (int64_t)w * slots * slot;
    int64_t r = block * warps + w, stride = blocks * warps;
    auto issue = [&](int k, int64_t row) {
        stage(mine + k * slot, a.x, a.xt, row, a.H, a.vec, lane);
        if (is_bwd(M)) stage(mine + k * slot + xb, a.dz, a.dzt, row, a.H, a.vec, lane);
        opf_dev_copies_commit();
    };
    if (slots && r < a.rows) issue(0, r);
    if (a.prefetch && r < a.rows) {
        if (has_gamma(M)) prefetch_l1(a.gamma, a.H * elem_size(a.gt), lane);
        if (M == LN_FWD) prefetch_l1(a.beta, a.H * elem_size(a.bt), lane);
    }
    unsigned key = 0;
    for (int k = 0; r < a.rows; r += stride, k ^= slots == 2) {
        bool ahead = slots == 2 && r + stride < a.rows;
        if (ahead) issue(k ^ 1, r + stride);
        if (slots) {
            if (ahead) opf_dev_copies_wait<1>();
            else opf_dev_copies_wait<0>();
            __syncwarp();  /* every lane's copies of this row have landed */
        }
        const char *b = mine + k * slot;
        row_view xv = {slots ? b : (const char *)a.x + r * a.H * elem_size(a.xt), a.xt, a.act};
        row_view dv = xv;
        if (is_bwd(M))
            dv = {slots ? b + xb : (const char *)a.dz + r * a.H * elem_size(a.dzt), a.dzt, a.dact};
        if constexpr (M == LN_FWD || M == RMS_FWD) key = max(key, fwd_row<M>(a, xv, r, lane));
        else if constexpr (M == L2_FWD) l2_fwd_row(a, xv, r, lane);
        else if constexpr (M == LN_BWD) ln_bwd_row(a, xv, dv, r, lane);
        else if constexpr (M == RMS_BWD) rms_bwd_row(a, xv, dv, r, lane);
        else l2_bwd_row(a, xv, dv, r, lane);
        __syncwarp();  /* the row is read before the next one overwrites it */
        if (slots == 1 && r + stride < a.rows) issue(0, r + stride);
    }
    if (a.amax) {  /* one atomic a warp; an integer max merges in any order */
        for (int o = LANES / 2; o; o >>= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, o));
        if (lane == 0 && key) atomicMax(a.amax, key);
    }
}

template <int M, int FT> __global__ void row_kernel(norm_args a, int slots)
{
    extern __shared__ __align__(16) char smem[];
    norm_rows<M, FT>(a, slots, blockIdx.x, gridDim.x, smem);
}

/* The same sums as colsum.cuh terms (x and dz both of dtype D): the term
 * of row r and column c is (d y, d) for LayerNorm, d y for RMSNorm. Where
 * the rows are whole 16-byte chunks colsum.cuh stages them through shared
 * memory, which keeps more of them in flight than col_kernel (norm.cu) can; the rows'
 * mu (LayerNorm) and rsigma are its per-row values. */
template <bool LN, opf_dtype D, bool SEEN = true> struct gamma_term {
    enum { BATCH = 8, STREAMS = 2, ROWS = LN ? 2 : 1 };
    typedef typename opf_dev_plain<D>::store store;
    typedef std::conditional_t<LN, float2, float> sum_t;
    struct in { float x, dz, mu, rs; };
    const void  *x, *dz;
    const float *mu, *rs;
    int64_t      H;
    opf_dtype    act, dact;
    __host__ __device__ const void *stream(int i) const { return i ? dz : x; }
    __device__ const float *row(int i) const { return i == ROWS - 1 ? rs : mu; }
    __device__ __forceinline__ void load(int64_t r, int64_t c, in &v) const
    {
        v.x = opf_dev_to_f32<D>(((const store *)x)[r * H + c]);
        v.dz = opf_dev_to_f32<D>(((const store *)dz)[r * H + c]);
        v.rs = rs[r];
        v.mu = LN ? mu[r] : 0.0f;
    }
    __device__ __forceinline__ void unpack(const store (&e)[2], const float (&rv)[ROWS],
                                           in &v) const
    {
        v.x = opf_dev_to_f32<D>(e[0]);
        v.dz = opf_dev_to_f32<D>(e[1]);
        v.rs = rv[ROWS - 1];
        v.mu = LN ? rv[0] : 0.0f;
    }
    __device__ __forceinline__ sum_t finish(int64_t, int64_t, const in &v, unsigned &) const
    {
        /* SEEN false: act and dact hold every value of D (the launch
         * checked), so no term takes seen_from's run-time dtype branches */
        float x = SEEN ? seen_from(v.x, D, act) : v.x, d = SEEN ? seen_from(v.dz, D, dact) : v.dz;
        if constexpr (LN) return make_float2(d * (v.rs * (x - v.mu)), d);
        else return d * (v.rs * x);
    }
};
static_assert(opf_colsum_sums<gamma_term<true, OPF_BF16>>() == 2 &&
                  opf_colsum_sums<gamma_term<false, OPF_BF16>>() == 1,
              "LayerNorm's terms are (dgamma, dbeta), RMSNorm's dgamma alone");

/* ---- dgamma / dbeta through colsum.cuh --------------------------------------
 * The column sums of a call whose x and dz are both of dtype D: gamma_term
 * instantiated for each dgamma dtype through opf_cuda_colsum. These 36
 * instantiations were most of the norms' nvcc time (norm.cu took 216 s for
 * sm_90a on a busy 2-core machine, 15 s without them), the longest single
 * step of a CUDA build, so each D has a translation unit of its own
 * (norm_cols_<d>.cu, NORM_COLS_INSTANTIATE) and nvcc builds the three in
 * parallel; norm.cu only declares them (extern template). */
template <bool LN, opf_dtype D>
opf_status norm_cols_plain(opf_ctx *ctx, opf_cuda_state *s, const norm_args &a,
                           opf_tensor *dgamma, opf_tensor *dbeta, const char *fn)
{
    auto run = [&](auto t) {
        return opf_dev_with_dtype(dgamma->spec.dtype, [&](auto o) {
            return opf_cuda_colsum<decltype(t), decltype(o)::value>(
                ctx, s, fn, t, a.rows, a.H, dgamma->data[0], NULL, dbeta ? dbeta->data[0] : NULL);
        });
    };
    if (holds_all(a.act, D) && holds_all(a.dact, D))
        return run(gamma_term<LN, D, false>{a.x, a.dz, a.mu, a.rs, a.H, a.act, a.dact});
    return run(gamma_term<LN, D, true>{a.x, a.dz, a.mu, a.rs, a.H, a.act, a.dact});
}

/* ---- the backward in one launch (norm_bwd_one.cu) ---------------------------
 * Whether a LayerNorm (ln) or RMSNorm backward of a takes it, and the launch.
 * dbeta is NULL for RMSNorm. */
bool norm_bwd_one_takes(const opf_cuda_state *s, const norm_args &a, bool ln,
                        const opf_tensor *dgamma, const opf_tensor *dbeta);
opf_status norm_bwd_one(opf_ctx *ctx, opf_cuda_state *s, norm_args a, bool ln, opf_tensor *dgamma,
                        opf_tensor *dbeta, const char *fn);

#define NORM_COLS_INSTANCES(spec, D)                                                      \
    spec template opf_status norm_cols_plain<true, D>(opf_ctx *, opf_cuda_state *,        \
                                                      const norm_args &, opf_tensor *,    \
                                                      opf_tensor *, const char *);        \
    spec template opf_status norm_cols_plain<false, D>(opf_ctx *, opf_cuda_state *,       \
                                                       const norm_args &, opf_tensor *,   \
                                                       opf_tensor *, const char *);
/* In norm_cols_<d>.cu: the definitions of D's two. */
#define NORM_COLS_INSTANTIATE(D) NORM_COLS_INSTANCES(, D)
NORM_COLS_INSTANCES(extern, OPF_F32)
NORM_COLS_INSTANCES(extern, OPF_BF16)
NORM_COLS_INSTANCES(extern, OPF_F16)

#endif
