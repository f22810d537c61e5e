/* norm.cu: LayerNorm, RMSNorm and L2 normalization on the GPU, forward and
 * backward, and the add + RMSNorm backward (backend/norm.h), bit for bit
 * with src/backend/cpu/norm.c.
 *
 * norm.h fixes every sum as a warp's tree: lane l adds the terms j = l,
 * l + 32, ... left to right, then the lanes fold in halves. So each row is
 * one warp. The warp stages its row (and dz's) in shared memory in the
 * input's own dtype (half the bytes of fp32 for bf16: more warps per SM),
 * with 16-byte asynchronous copies when the row allows them, and while it
 * computes one row the copy of its next row is in flight (two buffers when
 * they fit). The sums read the staged row lane-strided (no bank conflicts),
 * widening each value as it is read (and rounding it where the compute
 * dtype is not its own: seen_from); the outputs are written 8 elements a
 * lane, 16 bytes a store. Rows too long for shared memory are
 * read from global memory on every pass instead (the same values, the same
 * order). The all-bf16 call (x, dz, gamma) has kernels of its own with the
 * dtypes as constants, so no dtype branch stands between the loads of a
 * batch of terms.
 *
 * The column sums of dgamma and dbeta are two more kernels: lane class l
 * of a column holds the rows r = l mod 32 in order, as the CPU's; one
 * thread per (column or column pair, class) walks its rows, a batch of
 * rows' loads in flight before their adds, recomputing y from x, mu and
 * rsigma (cheaper than storing it); the 32 partials of a column go
 * through scratch to a thread that folds them in the header's order. No
 * atomics: every bit is fixed. Loads whose values are widened only after
 * the whole batch is loaded keep the mixed-dtype calls as fast.
 *
 * Built with -fmad=false (CMakeLists.txt) and IEEE division and square root,
 * so each operation rounds once as on the CPU. A NaN in a row makes that
 * row's outputs NaN on both devices; which NaN bits is each hardware's
 * own (the tests compare NaN with NaN). */
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

static bool one_dtype(const norm_args &a, opf_dtype t, bool bwd)
{
    return a.xt == t && a.act == t && a.gt == t && (!bwd || (a.dzt == t && a.dact == t));
}

/* One warp per row (grid-stride over rows). With slots > 0 each warp
 * stages its rows in its slice of the dynamic shared memory, x then dz, in
 * `slots` buffers: with two, the next row's copy is in flight while this
 * row is computed. */
template <int M, int FT> __global__ void row_kernel(norm_args a, int slots)
{
    fix_dtypes<FT>(a);
    extern __shared__ __align__(16) char smem[];
    const int warps = blockDim.x / LANES;
    int w = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    int64_t xb = row_bytes(a.H, a.xt), slot = xb + (is_bwd(M) ? row_bytes(a.H, a.dzt) : 0);
    char *mine = smem + (int64_t)w * slots * slot;
    int64_t r = (int64_t)blockIdx.x * warps + w, stride = (int64_t)gridDim.x * warps;
    auto issue = [&](int k, int64_t row) {
        stage(mine + k * slot, a.x, a.xt, row, a.H, a.vec, lane);
        if (is_bwd(M)) stage(mine + k * slot + xb, a.dz, a.dzt, row, a.H, a.vec, lane);
        opf_dev_copies_commit();
    };
    if (slots && r < a.rows) issue(0, r);
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

/* ---- dgamma / dbeta ------------------------------------------------------
 * Thread (columns c .. c + CP - 1, class l) sums the terms of its columns
 * over the rows r = l, l + 32, ... in order: the class's partials. A warp
 * is 32 * CP consecutive columns of one class, a block COL_WARPS classes,
 * so the H x 32 chains spread over every SM (a block of all 32 classes
 * held the grid to H / 32 blocks). Each thread loads the bits of a batch
 * of rows (x and dz) before it widens any, so the batch's loads are in
 * flight together for any dtypes; the batch's mu and rsigma come one row
 * a lane and go round by shuffles. The partials go through scratch
 * ([sums][32][H]) to fold_kernel. */
template <bool LN, int CP>
__global__ void __launch_bounds__(COL_WARPS *LANES) col_kernel(norm_args a, float *part)
{
    constexpr int B = LANES / CP;  /* rows a batch: 32 elements of x and of dz in flight */
    int lane = threadIdx.x % LANES, l = (int)blockIdx.y * COL_WARPS + (int)threadIdx.x / LANES;
    int64_t H = a.H, c = ((int64_t)blockIdx.x * LANES + lane) * CP;
    bool in = c < H;  /* with CP = 2 H is even: c + 1 < H too */
    float ag[CP] = {}, ab[CP] = {};
    for (int64_t r0 = l; r0 < a.rows; r0 += B * LANES) {
        int n = (int)min((int64_t)B, (a.rows - r0 + LANES - 1) / LANES);  /* rows of the batch */
        uint32_t xb[B][CP], db[B][CP];
#pragma unroll
        for (int u = 0; u < B; u++)
            if (u < n && in) {
                int64_t i = (r0 + (int64_t)u * LANES) * H + c;
                ld_bits_n<CP>(a.x, a.xt, i, xb[u]);
                ld_bits_n<CP>(a.dz, a.dzt, i, db[u]);
            }
        int64_t rl = r0 + (int64_t)lane * LANES;
        float rs_l = lane < n ? a.rs[rl] : 0.0f, mu_l = LN && lane < n ? a.mu[rl] : 0.0f;
#pragma unroll
        for (int u = 0; u < B; u++) {
            if (u >= n) break;  /* n is the warp's */
            float rs = __shfl_sync(0xFFFFFFFFu, rs_l, u), mu = __shfl_sync(0xFFFFFFFFu, mu_l, u);
#pragma unroll
            for (int k = 0; k < CP && in; k++) {
                float x = seen_from(widen_bits(xb[u][k], a.xt), a.xt, a.act);
                float d = seen_from(widen_bits(db[u][k], a.dzt), a.dzt, a.act);
                float y = LN ? rs * (x - mu) : rs * x;
                ag[k] = ag[k] + d * y;
                if (LN) ab[k] = ab[k] + d;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < CP && in; k++) {
        part[l * H + c + k] = ag[k];
        if (LN) part[(LANES + l) * H + c + k] = ab[k];
    }
}

/* The same sums as colsum.cuh terms (x and dz both of dtype D): the term
 * of row r and column c is (d y, d) for LayerNorm, d y for RMSNorm. Where
 * the rows are whole 16-byte chunks colsum.cuh stages them through shared
 * memory, which keeps more of them in flight than col_kernel can; the rows'
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

/* The 32 class partials p[0], p[H], ... of a column folded in halves
 * (class i += class i + off, norm.h). */
__device__ __forceinline__ float fold_classes(const float *p, int64_t H)
{
    float v[LANES];
#pragma unroll
    for (int i = 0; i < LANES; i++) v[i] = p[i * H];
#pragma unroll
    for (int off = LANES / 2; off > 0; off /= 2)
#pragma unroll
        for (int i = 0; i < LANES / 2; i++)
            if (i < off) v[i] = v[i] + v[i + off];
    return v[0];
}

/* One thread a column: dgamma, and dbeta when db, from their partials. */
__global__ void fold_kernel(const float *part, int64_t H, void *dg, opf_dtype dgt, void *db,
                            opf_dtype dbt)
{
    int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= H) return;
    st1(dg, dgt, c, fold_classes(part + c, H));
    if (db) st1(db, dbt, c, fold_classes(part + LANES * H + c, H));
}

/* ---- host side ----------------------------------------------------------- */

static bool plain_dtype(opf_dtype t) { return t == OPF_F32 || t == OPF_BF16 || t == OPF_F16; }

/* OPF_ERR_DTYPE naming the entry and the tensor when t is not f32/bf16/f16. */
static opf_status check_dtype(opf_ctx *ctx, const char *fn, const char *what, const opf_tensor *t)
{
    if (!t || plain_dtype(t->spec.dtype)) return OPF_OK;
    return opf_error(ctx, OPF_ERR_DTYPE, "%s: %s is %s, expected f32/bf16/f16", fn, what,
                     opf_dtype_name(t->spec.dtype));
}

static const void *data_of(const opf_tensor *t) { return t ? t->data[0] : NULL; }
static opf_dtype dtype_of(const opf_tensor *t) { return t ? t->spec.dtype : OPF_F32; }

/* The arguments common to every mode: x's rows of H, the compute dtype act,
 * the output, and whether every given tensor allows 16-byte accesses. */
static norm_args args_of(const opf_tensor *x, int64_t H, opf_dtype act, opf_tensor *out)
{
    norm_args a = {};
    a.x = x->data[0];
    a.xt = x->spec.dtype;
    a.act = a.dact = act;
    a.out = out->data[0];
    a.outt = out->spec.dtype;
    a.H = H;
    a.rows = H ? opf_spec_numel(&x->spec) / H : 0;
    a.rn = H ? 1.0f / (float)H : 0.0f;
    return a;
}

/* args_of for LayerNorm / RMSNorm: H and the compute dtype are gamma's. */
static norm_args gamma_args(const opf_tensor *x, const opf_tensor *gamma, bool zero_centered,
                            opf_tensor *out)
{
    norm_args a = args_of(x, gamma->spec.shape[0], gamma->spec.dtype, out);
    a.gamma = gamma->data[0], a.gt = gamma->spec.dtype, a.zc = zero_centered;
    return a;
}

static bool vec_ok(const norm_args &a)
{
    const void *ps[] = {a.x, a.dz, a.gamma, a.beta, a.dadd, a.out};
    bool ok = a.H % VEC == 0;
    for (const void *p : ps) ok = ok && (!p || opf_cuda_aligned16(p));
    return ok;
}

/* The warps a block (1..MAX_WARPS) that fit the most warps on an SM when
 * each stages per_warp bytes, and how many such blocks fit. */
static int block_warps(size_t per_warp, int *blocks_per_sm)
{
    int best = 0, warps = 1;
    for (int w = 1; w <= MAX_WARPS && w * per_warp <= BLOCK_SMEM_MAX; w++) {
        int blocks = (int)(SM_SMEM / (w * per_warp + BLOCK_RESERVED));
        if (blocks > 64 / w) blocks = 64 / w;  /* 2048 threads an SM */
        if (blocks * w >= best) best = blocks * w, warps = w, *blocks_per_sm = blocks;
    }
    return warps;
}

/* Launches the row kernel of mode M over a's rows: rows staged twice (the
 * next in flight) when that fits DOUBLE_MAX and leaves MIN_WARPS warps an
 * SM, once up to CACHE_MAX, else read from global memory; as many warps an
 * SM as the staging allows, and a grid of as many blocks as fit at once
 * (each warp walks several rows). */
template <int M> static opf_status launch_rows(opf_ctx *ctx, opf_cuda_state *s, norm_args a,
                                               const char *fn)
{
    if (a.rows == 0) return OPF_OK;
    a.vec = vec_ok(a);
    size_t slot = (size_t)row_bytes(a.H, a.xt) + (is_bwd(M) ? (size_t)row_bytes(a.H, a.dzt) : 0);
    int slots = 2 * slot <= DOUBLE_MAX ? 2 : slot <= CACHE_MAX ? 1 : 0;
    int warps = 4, per_sm = 16;
    if (slots) warps = block_warps(slots * slot, &per_sm);
    /* A second buffer hides a warp's own wait for its next row; more warps
     * an SM hide that as well, and the latency of the sums' add chains
     * besides: at [.., 4096] bf16, 7 warps an SM double-buffered, 13 not. */
    if (slots == 2 && warps * per_sm < MIN_WARPS) slots = 1, warps = block_warps(slot, &per_sm);
    size_t smem = slots * slot * (size_t)warps;
    /* Once per kernel and device (the attributes are the current device's):
     * allow up to the most shared memory a block may have, and ask for the
     * largest shared-memory carveout (a hint). */
    bool bf16 = one_dtype(a, OPF_BF16, is_bwd(M));
    void (*kernel)(norm_args, int) = bf16 ? row_kernel<M, OPF_BF16> : row_kernel<M, ANY>;
    static unsigned long long attrs_set[2];  /* a bit per device */
    if (opf_cuda_once_needed(&attrs_set[bf16], s->device)) {
        OPF_CUDA_TRY(ctx, fn, cudaFuncSetAttribute(kernel,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   (int)BLOCK_SMEM_MAX));
        OPF_CUDA_TRY(ctx, fn, cudaFuncSetAttribute(kernel,
                                                   cudaFuncAttributePreferredSharedMemoryCarveout,
                                                   (int)cudaSharedmemCarveoutMaxShared));
        opf_cuda_once_done(&attrs_set[bf16], s->device);
    }
    int64_t want = (a.rows + warps - 1) / warps, cap = (int64_t)s->sm_count * per_sm;
    unsigned grid = (unsigned)(want < cap ? want : cap);
    kernel<<<grid, warps * LANES, smem, s->stream>>>(a, slots);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* dgamma (and dbeta unless NULL) from the rows of a (x, dz seen as a.act).
 * Two columns a thread (one 4- or 8-byte load a tensor and row, half the
 * loads) once single columns would give every SM COL_PAIRS_WARPS warps;
 * below that, one a thread and twice the rows in flight. */
template <bool LN>
static opf_status launch_cols(opf_ctx *ctx, opf_cuda_state *s, const norm_args &a,
                              opf_tensor *dgamma, opf_tensor *dbeta, const char *fn)
{
    if (a.H == 0) return OPF_OK;
    if (a.xt == a.dzt && (!dbeta || dbeta->spec.dtype == dgamma->spec.dtype))
        return opf_dev_with_dtype(a.xt, [&](auto d) {
            constexpr opf_dtype D = decltype(d)::value;
            auto run = [&](auto t) {
                return opf_dev_with_dtype(dgamma->spec.dtype, [&](auto o) {
                    return opf_cuda_colsum<decltype(t), decltype(o)::value>(
                        ctx, s, fn, t, a.rows, a.H, dgamma->data[0], NULL,
                        dbeta ? dbeta->data[0] : NULL);
                });
            };
            if (holds_all(a.act, D) && holds_all(a.dact, D))
                return run(gamma_term<LN, D, false>{a.x, a.dz, a.mu, a.rs, a.H, a.act, a.dact});
            return run(gamma_term<LN, D, true>{a.x, a.dz, a.mu, a.rs, a.H, a.act, a.dact});
        });
    size_t mark = opf_ctx_scratch_mark(ctx);
    size_t sums = LN ? 2 : 1;
    float *part = (float *)opf_ctx_scratch_push_on(ctx, dgamma->spec.device,
                                                   sums * LANES * (size_t)a.H * sizeof(float));
    if (!part)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %zu x 32 x %lld partials", fn,
                         sums, (long long)a.H);
    bool pairs = a.H % 2 == 0 && opf_cuda_aligned16(a.x) && opf_cuda_aligned16(a.dz) &&
                 a.H >= (int64_t)s->sm_count * COL_PAIRS_WARPS;  /* H single-column warps */
    int cp = pairs ? 2 : 1;
    dim3 grid((unsigned)((a.H + LANES * cp - 1) / (LANES * cp)), LANES / COL_WARPS);
    void (*kernel)(norm_args, float *) = pairs ? col_kernel<LN, 2> : col_kernel<LN, 1>;
    kernel<<<grid, COL_WARPS * LANES, 0, s->stream>>>(a, part);
    fold_kernel<<<(unsigned)((a.H + 255) / 256), 256, 0, s->stream>>>(
        part, a.H, dgamma->data[0], dgamma->spec.dtype, dbeta ? dbeta->data[0] : NULL,
        dtype_of(dbeta));
    opf_ctx_scratch_pop(ctx, mark);  /* stream-ordered: later work reuses it after these */
    OPF_CUDA_LAUNCHED(ctx, fn);     /* either launch's error */
    return OPF_OK;
}

/* The state and the dtype checks of an entry; NULL tensors are skipped. */
static opf_cuda_state *begin(opf_ctx *ctx, const char *fn, opf_status *st,
                             const opf_tensor *t0, const opf_tensor *t1, const opf_tensor *t2,
                             const opf_tensor *t3, const opf_tensor *t4)
{
    const opf_tensor *ts[] = {t0, t1, t2, t3, t4};
    static const char *names[] = {"input", "gradient", "gamma", "second input", "output"};
    for (int i = 0; i < 5; i++)
        if ((*st = check_dtype(ctx, fn, names[i], ts[i]))) return NULL;
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    *st = s ? OPF_OK : OPF_ERR_STATE;
    return s;
}

/* LayerNorm (beta given) or RMSNorm forward into z; amax as norm_args'. */
static opf_status norm_fwd(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                           const opf_tensor *beta, float eps, bool zero_centered, opf_tensor *z,
                           opf_tensor *mu, opf_tensor *rsigma, unsigned *amax)
{
    const char *fn = beta ? "layernorm_fwd (cuda)" : "rmsnorm_fwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, NULL, gamma, beta, z);
    if (!s) return st;
    norm_args a = gamma_args(x, gamma, zero_centered, z);
    a.rs = (float *)rsigma->data[0], a.eps = eps, a.amax = amax;
    if (!beta) return launch_rows<RMS_FWD>(ctx, s, a, fn);
    a.beta = beta->data[0], a.bt = beta->spec.dtype, a.mu = (float *)mu->data[0];
    return launch_rows<LN_FWD>(ctx, s, a, fn);
}

static opf_status cuda_layernorm_fwd(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                     const opf_tensor *beta, float eps, bool zero_centered,
                                     opf_tensor *z, opf_tensor *mu, opf_tensor *rsigma)
{
    return norm_fwd(ctx, x, gamma, beta, eps, zero_centered, z, mu, rsigma, NULL);
}

static opf_status cuda_rmsnorm_fwd(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                   float eps, bool zero_centered, opf_tensor *z,
                                   opf_tensor *rsigma)
{
    return norm_fwd(ctx, x, gamma, NULL, eps, zero_centered, z, NULL, rsigma, NULL);
}

extern "C" bool opf_cuda_fused(void)
{
    const char *v = getenv("OPF_CUDA_UNFUSED");
    return !(v && v[0] == '1');
}

/* The *_q entries: a plain z is the plain entry's; current-scaling FP8 is
 * fused (z in hp into scratch with its amax in the same kernel, then the
 * cast pass); other formats, or OPF_CUDA_UNFUSED=1, the composition. */
static opf_status norm_fwd_q(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                             const opf_tensor *beta, float eps, bool zero_centered,
                             const opf_qout *z, opf_tensor *mu, opf_tensor *rsigma)
{
    if (!opf_qout_quantized(z))
        return norm_fwd(ctx, x, gamma, beta, eps, zero_centered, z->out, mu, rsigma, NULL);
    if (!opf_cuda_fused() || !opf_qout_current_fp8(z))
        return opf_norm_fwd_q_composed(ctx, opf_backend_get(OPF_DEVICE_CUDA), x, gamma, beta, eps,
                                       zero_centered, z, mu, rsigma);
    const char *fn = "norm_fwd_q (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_tensor t;
    opf_status st = opf_qout_begin(ctx, z, &t);
    if (!st)
        st = opf_cuda_qout_run(ctx, s, fn, z, &t, [&](unsigned *amax) {
            return norm_fwd(ctx, x, gamma, beta, eps, zero_centered, &t, mu, rsigma, amax);
        });
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static opf_status cuda_layernorm_fwd_q(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                       const opf_tensor *beta, float eps, bool zero_centered,
                                       const opf_qout *z, opf_tensor *mu, opf_tensor *rsigma)
{
    return norm_fwd_q(ctx, x, gamma, beta, eps, zero_centered, z, mu, rsigma);
}

static opf_status cuda_rmsnorm_fwd_q(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                     float eps, bool zero_centered, const opf_qout *z,
                                     opf_tensor *rsigma)
{
    return norm_fwd_q(ctx, x, gamma, NULL, eps, zero_centered, z, NULL, rsigma);
}

static norm_args bwd_args(const opf_tensor *dz, const opf_tensor *x, const opf_tensor *mu,
                          const opf_tensor *rsigma, const opf_tensor *gamma, bool zero_centered,
                          opf_tensor *dx)
{
    norm_args a = gamma_args(x, gamma, zero_centered, dx);
    a.dz = dz->data[0], a.dzt = dz->spec.dtype;
    a.mu = mu ? (float *)mu->data[0] : NULL, a.rs = (float *)rsigma->data[0];
    return a;
}

static opf_status cuda_layernorm_bwd(opf_ctx *ctx, const opf_tensor *dz, const opf_tensor *x,
                                     const opf_tensor *mu, const opf_tensor *rsigma,
                                     const opf_tensor *gamma, bool zero_centered,
                                     const opf_tensor *dadd, opf_tensor *dx, opf_tensor *dgamma,
                                     opf_tensor *dbeta)
{
    const char *fn = "layernorm_bwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, dz, gamma, dadd, dx);
    if (!s) return st;
    norm_args a = bwd_args(dz, x, mu, rsigma, gamma, zero_centered, dx);
    a.dadd = data_of(dadd), a.addt = dtype_of(dadd);
    if ((st = launch_rows<LN_BWD>(ctx, s, a, fn))) return st;
    return launch_cols<true>(ctx, s, a, dgamma, dbeta, fn);
}

static opf_status cuda_rmsnorm_bwd(opf_ctx *ctx, const opf_tensor *dz, const opf_tensor *x,
                                   const opf_tensor *rsigma, const opf_tensor *gamma,
                                   bool zero_centered, const opf_tensor *dadd, opf_tensor *dx,
                                   opf_tensor *dgamma)
{
    const char *fn = "rmsnorm_bwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, dz, gamma, dadd, dx);
    if (!s) return st;
    norm_args a = bwd_args(dz, x, NULL, rsigma, gamma, zero_centered, dx);
    a.dadd = data_of(dadd), a.addt = dtype_of(dadd);
    if ((st = launch_rows<RMS_BWD>(ctx, s, a, fn))) return st;
    return launch_cols<false>(ctx, s, a, dgamma, NULL, fn);
}

static int64_t last_dim(const opf_tensor *t) { return t->spec.shape[t->spec.ndim - 1]; }

/* L2: x is seen as the output's dtype (y forward, dx backward). */
static opf_status cuda_l2norm_fwd(opf_ctx *ctx, const opf_tensor *x, float eps, opf_tensor *y,
                                  opf_tensor *rnorm)
{
    const char *fn = "l2norm_fwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, NULL, NULL, NULL, y);
    if (!s) return st;
    norm_args a = args_of(x, last_dim(x), y->spec.dtype, y);
    a.rs = (float *)rnorm->data[0], a.eps = eps;
    return launch_rows<L2_FWD>(ctx, s, a, fn);
}

/* dy is read unrounded (seen as f32). */
static opf_status cuda_l2norm_bwd(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *x,
                                  const opf_tensor *rnorm, opf_tensor *dx)
{
    const char *fn = "l2norm_bwd (cuda)";
    opf_status st;
    opf_cuda_state *s = begin(ctx, fn, &st, x, dy, NULL, NULL, dx);
    if (!s) return st;
    norm_args a = args_of(x, last_dim(x), dx->spec.dtype, dx);
    a.dz = dy->data[0], a.dzt = dy->spec.dtype, a.dact = OPF_F32;
    a.rs = (float *)rnorm->data[0];
    return launch_rows<L2_BWD>(ctx, s, a, fn);
}

extern "C" const opf_norm_kernels opf_cuda_norm = {
    cuda_layernorm_fwd, cuda_layernorm_bwd, cuda_rmsnorm_fwd,
    cuda_rmsnorm_bwd,   cuda_l2norm_fwd,    cuda_l2norm_bwd,
    cuda_layernorm_fwd_q, cuda_rmsnorm_fwd_q,
};
