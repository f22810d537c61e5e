/* elem.cu: the element-wise family on the GPU (backend/elem.h), bit for bit
 * with src/backend/cpu/elem.c: bias and dbias, constant scale, add,
 * dropout, cast and cast+transpose, fill and copy.
 *
 * Every element-wise entry is one grid-stride pass over 8-element chunks:
 * 16-byte accesses where every pointer allows them, element accesses
 * otherwise and at the tail. The arithmetic is the CPU's, one fp32 operation
 * at a time with its NaN bits (opf_dev_add and friends, cuda-impl.h); the
 * conversions are its codecs' (opf_dev_to_f32 / opf_dev_from_f32).
 *
 * dbias keeps the CPU's order (lanesum.h's column sums) through colsum.cuh;
 * dbias_q, for current-scaling FP8, takes dy's amax in the same column-sum
 * pass and then runs the cast pass from it (qout.cuh), so dy is read twice,
 * not three times. */
#include "backend/cuda/colsum.cuh"
#include "backend/cuda/cuda-impl.h"
#include "backend/cuda/qout.cuh"

enum {
    THREADS = 256,
    VEC = 8,           /* elements per chunk */
    TR = 64,           /* cast+transpose tile edge */
    CT_THREADS = 128,  /* cast+transpose: threads per block, */
    CT_LOADS = TR * TR / VEC / CT_THREADS, /* each with this many 16-byte loads in flight */
};

static int64_t numel(const opf_tensor *t) { return opf_spec_numel(&t->spec); }
static const void *cdata(const opf_tensor *t) { return t->data[OPF_COMP_DATA]; }
static void *data(opf_tensor *t) { return t->data[OPF_COMP_DATA]; }
static bool al16(const void *p) { return opf_cuda_aligned16(p); }

/* body(i0, w, vec) for every chunk of 8 elements from i0 (w of them exist;
 * vec: all 8 exist and the pointers allow 16-byte accesses). */
template <class F> __device__ __forceinline__ void each_chunk(int64_t n, bool vec, F body)
{
    int64_t nc = (n + VEC - 1) / VEC, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nc; c += stride) {
        int64_t i0 = c * VEC;
        int w = n - i0 < VEC ? (int)(n - i0) : VEC;
        body(i0, w, vec && w == VEC);
    }
}

template <opf_dtype D> __device__ __forceinline__ const void *at(const void *p, int64_t i)
{
    return (const typename opf_dev_plain<D>::store *)p + i;
}
template <opf_dtype D> __device__ __forceinline__ void *at(void *p, int64_t i)
{
    return (typename opf_dev_plain<D>::store *)p + i;
}

/* ---- bias, scale, add ----------------------------------------------------- */

/* vec also says n % 8 == 0: a chunk then lies in one row, its bias whole. */
template <opf_dtype DX, opf_dtype DB, opf_dtype DY>
__global__ void bias_add_kernel(const void *x, const void *bias, int64_t total, int64_t n,
                                bool vec, void *y)
{
    each_chunk(total, vec, [&](int64_t i0, int w, bool v8) {
        float u[VEC], b[VEC];
        opf_dev_load8_as<DX>(at<DX>(x, i0), v8, w, u);
        if (v8) {
            opf_dev_load8_as<DB>(at<DB>(bias, i0 % n), true, VEC, b);
        } else {
            const typename opf_dev_plain<DB>::store *bs = (const typename opf_dev_plain<DB>::store *)bias;
#pragma unroll
            for (int k = 0; k < VEC; k++) b[k] = k < w ? opf_dev_to_f32<DB>(bs[(i0 + k) % n]) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < VEC; k++) u[k] = opf_dev_add(u[k], b[k]);
        opf_dev_store8_as<DY>(at<DY>(y, i0), v8, w, u);
    });
}

template <opf_dtype DX, opf_dtype DY>
__global__ void scale_kernel(const void *x, float s, int64_t n, bool vec, void *y)
{
    each_chunk(n, vec, [&](int64_t i0, int w, bool v8) {
        float u[VEC];
        opf_dev_load8_as<DX>(at<DX>(x, i0), v8, w, u);
#pragma unroll
        for (int k = 0; k < VEC; k++) u[k] = opf_dev_mul(s, u[k]);
        opf_dev_store8_as<DY>(at<DY>(y, i0), v8, w, u);
    });
}

/* out may be a (each element is read before it is written, by one thread). */
template <opf_dtype DA, opf_dtype DB, opf_dtype DO>
__global__ void add_kernel(const void *a, const void *b, int64_t n, bool vec, void *out)
{
    each_chunk(n, vec, [&](int64_t i0, int w, bool v8) {
        float u[VEC], v[VEC];
        opf_dev_load8_as<DA>(at<DA>(a, i0), v8, w, u);
        opf_dev_load8_as<DB>(at<DB>(b, i0), v8, w, v);
#pragma unroll
        for (int k = 0; k < VEC; k++) u[k] = opf_dev_add(u[k], v[k]);
        opf_dev_store8_as<DO>(at<DO>(out, i0), v8, w, u);
    });
}

template <opf_dtype DX, opf_dtype DY>
__global__ void cast_kernel(const void *x, int64_t n, bool vec, void *y)
{
    each_chunk(n, vec, [&](int64_t i0, int w, bool v8) {
        float u[VEC];
        opf_dev_load8_as<DX>(at<DX>(x, i0), v8, w, u);
        opf_dev_store8_as<DY>(at<DY>(y, i0), v8, w, u);
    });
}

/* ---- dbias -----------------------------------------------------------------
 * colsum.cuh's column sums of dy [rows, n]. */
template <opf_dtype D, bool AMAX = false> struct db_term {
    enum { BATCH = 16, STREAMS = 1 };
    typedef typename opf_dev_plain<D>::store store;
    struct in { float v; };
    const void *dy;
    int64_t     n;
    __host__ __device__ const void *stream(int) const { return dy; }
    __device__ __forceinline__ void unpack(const store (&e)[1], in &v) const
    {
        v.v = opf_dev_to_f32<D>(e[0]);
    }
    __device__ __forceinline__ void load(int64_t r, int64_t c, in &v) const
    {
        v.v = opf_dev_to_f32<D>(((const typename opf_dev_plain<D>::store *)dy)[r * n + c]);
    }
    /* AMAX: dbias_q's term, keeping the amax key of dy's value (dy is the
     * tensor its cast pass reads: nothing stored) */
    __device__ __forceinline__ float finish(int64_t, int64_t, const in &v, unsigned &key) const
    {
        if (AMAX) key = opf_dev_amax_max(key, v.v);
        return v.v;
    }
};

/* ---- scaled bias (GroupedLinear's scale_bias) ---------------------------
 * Rare and small next to the GEMMs around it: element loads of any dtype
 * through one switch, no vector path. */
__device__ __forceinline__ float ld_any(const void *p, opf_dtype d, int64_t i)
{
    switch (d) {
    case OPF_F32: return opf_dev_to_f32<OPF_F32>(((const float *)p)[i]);
    case OPF_BF16: return opf_dev_to_f32<OPF_BF16>(((const uint16_t *)p)[i]);
    default: return opf_dev_to_f32<OPF_F16>(((const uint16_t *)p)[i]);
    }
}
__device__ __forceinline__ void st_any(void *p, opf_dtype d, int64_t i, float v)
{
    switch (d) {
    case OPF_F32: ((float *)p)[i] = opf_dev_from_f32<OPF_F32>(v); break;
    case OPF_BF16: ((uint16_t *)p)[i] = opf_dev_from_f32<OPF_BF16>(v); break;
    default: ((uint16_t *)p)[i] = opf_dev_from_f32<OPF_F16>(v); break;
    }
}

typedef struct sbias_args {
    const void *acc, *s, *bias;
    void       *y;
    opf_dtype   acc_t, s_t, bias_t, y_t;
    int64_t     rows, n;
} sbias_args;

/* y[r, j] = acc[r, j] + fl(s[r] * bias[j]) (the CPU's order). */
__global__ void scaled_bias_add_kernel(sbias_args a)
{
    int64_t total = a.rows * a.n, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int64_t r = i / a.n, j = i % a.n;
        float v = opf_dev_add(ld_any(a.acc, a.acc_t, i),
                              opf_dev_mul(ld_any(a.s, a.s_t, r), ld_any(a.bias, a.bias_t, j)));
        st_any(a.y, a.y_t, i, v);
    }
}

/* scaled_dbias's db: the column sums of fl(dy[r, j] * s[r]). */
struct sdb_term {
    enum { BATCH = 16, STREAMS = 0 };
    struct in { float v, s; };
    sbias_args a;
    __device__ __forceinline__ void load(int64_t r, int64_t c, in &v) const
    {
        v.v = ld_any(a.acc, a.acc_t, r * a.n + c);
        v.s = ld_any(a.s, a.s_t, r);
    }
    __device__ __forceinline__ float finish(int64_t, int64_t, const in &v, unsigned &) const
    {
        return opf_dev_mul(v.v, v.s);
    }
};

/* ds[r] = sum over j left to right of fl(dy[r, j] * bias[j]): one thread per
 * row (a.y is ds here, a.acc is dy). */
__global__ void scaled_ds_kernel(sbias_args a)
{
    int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= a.rows) return;
    float sum = 0.0f;
    for (int64_t j = 0; j < a.n; j++)
        sum = opf_dev_add(sum, opf_dev_mul(ld_any(a.acc, a.acc_t, r * a.n + j), ld_any(a.bias, a.bias_t, j)));
    st_any(a.y, a.y_t, r, sum);
}

/* ---- Philox draws: dropout, uniform fill -------------------------------------
 * A chunk of 8 from i0 (a multiple of 8) takes the 8 words of counters
 * offset + i0/4 and offset + i0/4 + 1 (elem.h). */
__device__ __forceinline__ void philox8(uint64_t seed, uint64_t offset, uint32_t stream,
                                        int64_t i0, uint32_t r[8])
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint4 q = opf_dev_philox_at(seed, offset + (uint64_t)(i0 / 4 + h), stream);
        r[4 * h] = q.x, r[4 * h + 1] = q.y, r[4 * h + 2] = q.z, r[4 * h + 3] = q.w;
    }
}

/* 8 mask bytes at m (8-byte aligned when vec). */
__device__ __forceinline__ void store_mask8(uint8_t *m, bool vec, int w, const uint8_t b[8])
{
    if (vec) {
        *(uint2 *)m = *(const uint2 *)b;
        return;
    }
#pragma unroll
    for (int k = 0; k < VEC; k++)
        if (k < w) m[k] = b[k];
}

template <opf_dtype DX, opf_dtype DY>
__global__ void dropout_fwd_kernel(const void *x, int64_t n, bool vec, uint32_t thr, float s,
                                   uint64_t seed, uint64_t offset, void *y, uint8_t *mask)
{
    each_chunk(n, vec, [&](int64_t i0, int w, bool v8) {
        uint32_t r[VEC];
        __align__(8) uint8_t keep[VEC];
        float u[VEC];
        philox8(seed, offset, 0u, i0, r);
        opf_dev_load8_as<DX>(at<DX>(x, i0), v8, w, u);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            keep[k] = r[k] >= thr;
            u[k] = opf_dev_mul(u[k], keep[k] ? s : 0.0f);
        }
        store_mask8(mask + i0, v8, w, keep);
        opf_dev_store8_as<DY>(at<DY>(y, i0), v8, w, u);
    });
}

template <opf_dtype DX, opf_dtype DY>
__global__ void dropout_bwd_kernel(const void *dy, const uint8_t *mask, int64_t n, bool vec,
                                   float s, void *dx)
{
    each_chunk(n, vec, [&](int64_t i0, int w, bool v8) {
        __align__(8) uint8_t keep[VEC] = {0};
        float u[VEC];
        if (v8) *(uint2 *)keep = *(const uint2 *)(mask + i0);
        else
#pragma unroll
            for (int k = 0; k < VEC; k++) keep[k] = k < w ? mask[i0 + k] : 0;
        opf_dev_load8_as<DX>(at<DX>(dy, i0), v8, w, u);
#pragma unroll
        for (int k = 0; k < VEC; k++) u[k] = opf_dev_mul(u[k], keep[k] ? s : 0.0f);
        opf_dev_store8_as<DY>(at<DY>(dx, i0), v8, w, u);
    });
}

/* u = (word >> 8) * 2^-24, v = fl32(bound * (2u - 1)) in double (elem.h). */
template <opf_dtype D>
__global__ void fill_uniform_kernel(int64_t n, bool vec, uint64_t seed, uint64_t offset,
                                    uint32_t stream, double bound, void *t)
{
    each_chunk(n, vec, [&](int64_t i0, int w, bool v8) {
        uint32_t r[VEC];
        float v[VEC];
        philox8(seed, offset, stream, i0, r);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            double u = __dmul_rn((double)(r[k] >> 8), 1.0 / 16777216.0);
            v[k] = __double2float_rn(__dmul_rn(bound, __dsub_rn(__dmul_rn(2.0, u), 1.0)));
        }
        opf_dev_store8_as<D>(at<D>(t, i0), v8, w, v);
    });
}

/* nbytes of the 16-byte pattern (a whole number of elements) from dst. */
__global__ void fill_kernel(uint8_t *dst, int64_t nbytes, bool vec, uint4 pat)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t nv = vec ? nbytes / 16 : 0;
    for (int64_t c = i; c < nv; c += stride) ((uint4 *)dst)[c] = pat;
    const uint8_t *p = (const uint8_t *)&pat;
    for (int64_t b = nv * 16 + i; b < nbytes; b += stride) dst[b] = p[b % 16];
}

/* ---- cast + transpose ---------------------------------------------------------
 * One TR x TR tile of x [R, C] per block, from one read of x: rows read 8
 * elements a thread (16-byte loads, all of a thread's issued before the
 * first is used: enough bytes in flight), held as fp32 in shared memory, then
 * written to y_t [C, R] with 8 lanes on each row of y_t (a warp stores four
 * whole 128-byte runs, 16 bytes a lane). y, when given, gets the rowwise
 * copy from the same loads: x's bits when the dtypes are equal (NaN payloads
 * too, as the CPU's byte copy), else the conversion. VEC_IO: R and C
 * multiples of 8, aligned bases. */

/* The raw bits of 8 elements of a plain D array (zero bits past w), as the
 * words of memory: 8 for f32, 4 (pairs, low half first) for bf16 and f16. */
template <opf_dtype D>
__device__ __forceinline__ void load8_bits(const void *p, bool vec, int w, uint32_t q[VEC])
{
    if (vec) {
        uint4 a = ((const uint4 *)p)[0];
        q[0] = a.x, q[1] = a.y, q[2] = a.z, q[3] = a.w;
        if constexpr (D == OPF_F32) {
            uint4 b = ((const uint4 *)p)[1];
            q[4] = b.x, q[5] = b.y, q[6] = b.z, q[7] = b.w;
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < VEC; i++) q[i] = 0u;
#pragma unroll
    for (int i = 0; i < VEC; i++) {
        if (i >= w) break;
        if constexpr (D == OPF_F32) q[i] = ((const uint32_t *)p)[i];
        else q[i / 2] |= (uint32_t)((const uint16_t *)p)[i] << 16 * (i % 2);
    }
}

/* Element i's bits from those words. */
template <opf_dtype D> __device__ __forceinline__ uint32_t bits_of(const uint32_t q[VEC], int i)
{
    if constexpr (D == OPF_F32) return q[i];
    else return q[i / 2] >> 16 * (i % 2) & 0xFFFFu;
}

/* The inverse of load8_bits: 8 (vec) or the first w elements into p. */
template <opf_dtype D>
__device__ __forceinline__ void store8_bits(void *p, bool vec, int w, const uint32_t q[VEC])
{
    if (vec) {
        opf_dev_st16(p, q[0], q[1], q[2], q[3]);
        if constexpr (D == OPF_F32) opf_dev_st16((uint32_t *)p + 4, q[4], q[5], q[6], q[7]);
        return;
    }
#pragma unroll
    for (int i = 0; i < VEC; i++) {
        if (i >= w) break;
        if constexpr (D == OPF_F32) ((uint32_t *)p)[i] = q[i];
        else ((uint16_t *)p)[i] = (uint16_t)bits_of<D>(q, i);
    }
}

template <opf_dtype D> __device__ __forceinline__ float bits_to_f32(uint32_t b)
{
    if constexpr (D == OPF_F32) return __uint_as_float(b);
    else return opf_dev_to_f32<D>((uint16_t)b);
}

template <opf_dtype D>
__device__ __forceinline__ void store8_f32_as(void *p, bool vec, int w, const float v[VEC])
{
    if (vec) opf_dev_store8_vec<D>(p, v);
    else opf_dev_store8_as<D>(p, false, w, v);
}

/* Row r, column c of x's tile for the j-th load of thread i. */
__device__ __forceinline__ void ct_at(int i, int j, int &r, int &c)
{
    int k = i + j * CT_THREADS;
    r = k / (TR / VEC), c = k % (TR / VEC) * VEC;
}

template <opf_dtype DX, opf_dtype DO, bool VEC_IO>
__global__ void __launch_bounds__(CT_THREADS)
cast_transpose_kernel(const void *x, int64_t R, int64_t C, void *y, void *yt)
{
    __shared__ float tile[TR][TR + 1];
    int64_t tc = (C + TR - 1) / TR;  /* one grid dimension: rows or columns may be many */
    int64_t r0 = (int64_t)blockIdx.x / tc * TR, c0 = (int64_t)blockIdx.x % tc * TR;
    uint32_t b[CT_LOADS][VEC];
    int w[CT_LOADS];
#pragma unroll
    for (int j = 0; j < CT_LOADS; j++) {  /* every load issued before any use */
        int r, c;
        ct_at(threadIdx.x, j, r, c);
        int64_t gr = r0 + r, gc = c0 + c;
        w[j] = gr >= R || gc >= C ? 0 : C - gc < VEC ? (int)(C - gc) : VEC;
        load8_bits<DX>(at<DX>(x, gr * C + gc), VEC_IO && w[j] == VEC, w[j], b[j]);
    }
#pragma unroll
    for (int j = 0; j < CT_LOADS; j++) {
        int r, c;
        ct_at(threadIdx.x, j, r, c);
        int64_t i0 = (r0 + r) * C + c0 + c;
        bool vec = VEC_IO && w[j] == VEC;
        float v[VEC];
#pragma unroll
        for (int i = 0; i < VEC; i++) v[i] = bits_to_f32<DX>(bits_of<DX>(b[j], i));
        if (y && w[j]) {
            if constexpr (DX == DO) store8_bits<DO>(at<DO>(y, i0), vec, w[j], b[j]);
            else store8_f32_as<DO>(at<DO>(y, i0), vec, w[j], v);
        }
#pragma unroll
        for (int i = 0; i < VEC; i++) tile[r][c + i] = v[i];
    }
    __syncthreads();
    for (int k = threadIdx.x; k < TR * TR / VEC; k += CT_THREADS) {
        int c = k / (TR / VEC), g = k % (TR / VEC) * VEC;
        int64_t gc = c0 + c, gr = r0 + g;
        int n = gc >= C || gr >= R ? 0 : R - gr < VEC ? (int)(R - gr) : VEC;
        float v[VEC];
#pragma unroll
        for (int i = 0; i < VEC; i++) v[i] = tile[g + i][c];
        if (n) store8_f32_as<DO>(at<DO>(yt, gc * R + gr), VEC_IO && n == VEC, n, v);
    }
}

/* ---- host side ------------------------------------------------------------------ */

#define STATE_OR_FAIL(s, ctx, fn)                   \
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn); \
    if (!s) return OPF_ERR_STATE

static unsigned grid_of(const opf_cuda_state *s, int64_t n)
{
    return opf_cuda_grid(s, (n + VEC - 1) / VEC, THREADS);
}

static opf_status launched(opf_ctx *ctx, const char *fn)
{
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

static opf_status cuda_copy_bytes(opf_ctx *ctx, const void *src, void *dst, size_t nbytes)
{
    const char *fn = "copy";
    STATE_OR_FAIL(s, ctx, fn);
    if (src != dst && nbytes)
        OPF_CUDA_TRY(ctx, fn, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, s->stream));
    return OPF_OK;
}

static opf_status cuda_bias_add(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *bias,
                                opf_tensor *y)
{
    const char *fn = "bias_add";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(bias), total = numel(x);
    if (n == 0 || total == 0) return OPF_OK;
    bool vec = n % VEC == 0 && al16(cdata(x)) && al16(cdata(bias)) && al16(data(y));
    const void *xs = cdata(x), *bs = cdata(bias);
    void *ys = data(y);
    return opf_dev_with_dtype(x->spec.dtype, [&](auto dx) {
        return opf_dev_with_dtype(bias->spec.dtype, [&](auto db) {
            return opf_dev_with_dtype(y->spec.dtype, [&](auto dyt) {
                bias_add_kernel<decltype(dx)::value, decltype(db)::value, decltype(dyt)::value>
                    <<<grid_of(s, total), THREADS, 0, s->stream>>>(xs, bs, total, n, vec, ys);
                return launched(ctx, fn);
            });
        });
    });
}

/* db = the column sums of dy; with amax (not NULL) the amax keys of dy's
 * values merged into it in the same pass. */
static opf_status dbias_sums(opf_ctx *ctx, opf_cuda_state *s, const char *fn, const opf_tensor *dy,
                             opf_tensor *db, unsigned *amax)
{
    int64_t n = numel(db), rows = n ? numel(dy) / n : 0;
    return opf_dev_with_dtype(dy->spec.dtype, [&](auto d) {
        return opf_dev_with_dtype(db->spec.dtype, [&](auto dout) {
            constexpr opf_dtype DI = decltype(d)::value, DO = decltype(dout)::value;
            if (amax) {
                db_term<DI, true> t = {cdata(dy), n};
                return opf_cuda_colsum<decltype(t), DO>(ctx, s, fn, t, rows, n, data(db), amax);
            }
            db_term<DI> t = {cdata(dy), n};
            return opf_cuda_colsum<decltype(t), DO>(ctx, s, fn, t, rows, n, data(db));
        });
    });
}

static opf_status cuda_dbias(opf_ctx *ctx, const opf_tensor *dy, opf_tensor *db)
{
    const char *fn = "dbias";
    STATE_OR_FAIL(s, ctx, fn);
    return dbias_sums(ctx, s, fn, dy, db, NULL);
}

/* Current-scaling FP8 that takes dy as it is: one column-sum pass for db
 * and dy's amax, then the cast pass reading dy (qout.cuh); anything else,
 * or OPF_CUDA_UNFUSED=1, the composition. */
static opf_status cuda_dbias_q(opf_ctx *ctx, const opf_tensor *dy, opf_tensor *db,
                               const opf_qout *dx)
{
    const char *fn = "dbias_q (cuda)";
    if (!opf_cuda_fused() || !opf_qout_current_fp8(dx) || !opf_qout_reads_as_is(dx, dy->spec.dtype))
        return opf_dbias_q_composed(ctx, opf_backend_get(OPF_DEVICE_CUDA), dy, db, dx);
    STATE_OR_FAIL(s, ctx, fn);
    return opf_cuda_qout_run(ctx, s, fn, dx, dy,
                             [&](unsigned *amax) { return dbias_sums(ctx, s, fn, dy, db, amax); });
}

static opf_status cuda_scaled_bias_add(opf_ctx *ctx, const opf_tensor *acc, const opf_tensor *sc,
                                       const opf_tensor *bias, opf_tensor *y)
{
    const char *fn = "scaled_bias_add";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(bias), rows = n ? numel(acc) / n : 0;
    if (!n || !rows) return OPF_OK;
    sbias_args a = {cdata(acc), cdata(sc), cdata(bias), data(y), acc->spec.dtype, sc->spec.dtype,
                    bias->spec.dtype, y->spec.dtype, rows, n};
    scaled_bias_add_kernel<<<opf_cuda_grid(s, rows * n, THREADS), THREADS, 0, s->stream>>>(a);
    return launched(ctx, fn);
}

static opf_status cuda_scaled_dbias(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *sc,
                                    const opf_tensor *bias, opf_tensor *db, opf_tensor *ds)
{
    const char *fn = "scaled_dbias";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(db), rows = n ? numel(dy) / n : 0;
    if (!n) return OPF_OK;
    sbias_args a = {cdata(dy), cdata(sc), cdata(bias), data(db), dy->spec.dtype, sc->spec.dtype,
                    bias->spec.dtype, db->spec.dtype, rows, n};
    sdb_term t = {a};
    opf_status st = opf_dev_with_dtype(db->spec.dtype, [&](auto dout) {
        return opf_cuda_colsum<sdb_term, decltype(dout)::value>(ctx, s, fn, t, rows, n, data(db));
    });
    if (st || !rows) return st;
    a.y = data(ds), a.y_t = ds->spec.dtype;
    scaled_ds_kernel<<<(unsigned)((rows + THREADS - 1) / THREADS), THREADS, 0, s->stream>>>(a);
    return launched(ctx, fn);
}

static opf_status cuda_scale(opf_ctx *ctx, const opf_tensor *x, float sc, opf_tensor *y)
{
    const char *fn = "scale";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(x);
    if (n == 0) return OPF_OK;
    bool vec = al16(cdata(x)) && al16(data(y));
    const void *xs = cdata(x);
    void *ys = data(y);
    return opf_dev_with_dtype(x->spec.dtype, [&](auto dx) {
        return opf_dev_with_dtype(y->spec.dtype, [&](auto dyt) {
            scale_kernel<decltype(dx)::value, decltype(dyt)::value>
                <<<grid_of(s, n), THREADS, 0, s->stream>>>(xs, sc, n, vec, ys);
            return launched(ctx, fn);
        });
    });
}

static opf_status cuda_add(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b, opf_tensor *out)
{
    const char *fn = "add";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(out);
    if (n == 0) return OPF_OK;
    const void *as = cdata(a), *bs = cdata(b);
    void *os = data(out);
    bool vec = al16(as) && al16(bs) && al16(os);
    return opf_dev_with_dtype(a->spec.dtype, [&](auto da) {
        return opf_dev_with_dtype(b->spec.dtype, [&](auto db) {
            return opf_dev_with_dtype(out->spec.dtype, [&](auto dout) {
                add_kernel<decltype(da)::value, decltype(db)::value, decltype(dout)::value>
                    <<<grid_of(s, n), THREADS, 0, s->stream>>>(as, bs, n, vec, os);
                return launched(ctx, fn);
            });
        });
    });
}

/* The CPU's keep threshold and scale (elem.h), computed on the host as it does. */
static float dropout_scale(double p) { return (float)(1.0 / (1.0 - p)); }

static opf_status cuda_dropout_fwd(opf_ctx *ctx, const opf_tensor *x, double p, uint64_t seed,
                                   uint64_t offset, opf_tensor *y, opf_tensor *mask)
{
    const char *fn = "dropout_fwd";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(x);
    if (n == 0) return OPF_OK;
    const uint32_t thr = (uint32_t)(p * 4294967296.0);
    const float sc = dropout_scale(p);
    const void *xs = cdata(x);
    void *ys = data(y);
    uint8_t *m = (uint8_t *)data(mask);
    bool vec = al16(xs) && al16(ys) && ((uintptr_t)m & 7u) == 0;
    return opf_dev_with_dtype(x->spec.dtype, [&](auto dx) {
        return opf_dev_with_dtype(y->spec.dtype, [&](auto dyt) {
            dropout_fwd_kernel<decltype(dx)::value, decltype(dyt)::value>
                <<<grid_of(s, n), THREADS, 0, s->stream>>>(xs, n, vec, thr, sc, seed, offset, ys, m);
            return launched(ctx, fn);
        });
    });
}

static opf_status cuda_dropout_bwd(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *mask,
                                   double p, opf_tensor *dx)
{
    const char *fn = "dropout_bwd";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(dy);
    if (n == 0) return OPF_OK;
    const float sc = dropout_scale(p);
    const void *src = cdata(dy);
    const uint8_t *m = (const uint8_t *)cdata(mask);
    void *out = data(dx);
    bool vec = al16(src) && al16(out) && ((uintptr_t)m & 7u) == 0;
    return opf_dev_with_dtype(dy->spec.dtype, [&](auto din) {
        return opf_dev_with_dtype(dx->spec.dtype, [&](auto dout) {
            dropout_bwd_kernel<decltype(din)::value, decltype(dout)::value>
                <<<grid_of(s, n), THREADS, 0, s->stream>>>(src, m, n, vec, sc, out);
            return launched(ctx, fn);
        });
    });
}

static opf_status cuda_cast(opf_ctx *ctx, const opf_tensor *x, opf_tensor *y)
{
    const char *fn = "cast";
    int64_t n = numel(x);
    if (x->spec.dtype == y->spec.dtype)  /* the bits as they are (NaN payloads too) */
        return cuda_copy_bytes(ctx, cdata(x), data(y), opf_dtype_nbytes(x->spec.dtype, (size_t)n));
    STATE_OR_FAIL(s, ctx, fn);
    if (n == 0) return OPF_OK;
    const void *xs = cdata(x);
    void *ys = data(y);
    bool vec = al16(xs) && al16(ys);
    return opf_dev_with_dtype(x->spec.dtype, [&](auto dx) {
        return opf_dev_with_dtype(y->spec.dtype, [&](auto dyt) {
            cast_kernel<decltype(dx)::value, decltype(dyt)::value>
                <<<grid_of(s, n), THREADS, 0, s->stream>>>(xs, n, vec, ys);
            return launched(ctx, fn);
        });
    });
}

/* y rides along with the transpose when it has y_t's dtype; otherwise it is
 * a cast of its own. */
static opf_status cuda_cast_transpose(opf_ctx *ctx, const opf_tensor *x, opf_tensor *y,
                                      opf_tensor *y_t)
{
    const char *fn = "cast_transpose";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t R, C;
    opf_shape_2d(&x->spec, &R, &C);
    bool fuse_y = y && y->spec.dtype == y_t->spec.dtype;
    opf_status st = y && !fuse_y ? cuda_cast(ctx, x, y) : OPF_OK;
    if (st || R == 0 || C == 0) return st;
    const void *xs = cdata(x);
    void *ys = fuse_y ? data(y) : NULL, *ts = data(y_t);
    bool vec = R % VEC == 0 && C % VEC == 0 && al16(xs) && al16(ts) && (!ys || al16(ys));
    unsigned grid = (unsigned)(((C + TR - 1) / TR) * ((R + TR - 1) / TR));
    return opf_dev_with_dtype(x->spec.dtype, [&](auto dx) {
        return opf_dev_with_dtype(y_t->spec.dtype, [&](auto dout) {
            constexpr opf_dtype DX = decltype(dx)::value, DO = decltype(dout)::value;
            if (vec)
                cast_transpose_kernel<DX, DO, true><<<grid, CT_THREADS, 0, s->stream>>>(xs, R, C, ys, ts);
            else
                cast_transpose_kernel<DX, DO, false><<<grid, CT_THREADS, 0, s->stream>>>(xs, R, C, ys, ts);
            return launched(ctx, fn);
        });
    });
}

/* The element's bytes, as the CPU's fill makes them; false for a dtype that
 * takes zero bytes only. */
static bool fill_element(opf_dtype dt, double value, uint8_t one[8])
{
    float f = (float)value;
    union { float f; uint16_t h; uint8_t u8; int32_t i32; int64_t i64; } u;
    switch (dt) {
    case OPF_F32: u.f = f; break;
    case OPF_BF16: u.h = opf_dev_from_f32<OPF_BF16>(f); break;
    case OPF_F16: u.h = opf_dev_from_f32<OPF_F16>(f); break;
    case OPF_U8: u.u8 = (uint8_t)value; break;
    case OPF_I32: u.i32 = (int32_t)value; break;
    case OPF_I64: u.i64 = (int64_t)value; break;
    default: return false;
    }
    memcpy(one, &u, 8);
    return true;
}

static opf_status cuda_fill(opf_ctx *ctx, double value, opf_tensor *t)
{
    const char *fn = "fill";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(t);
    size_t es = opf_dtype_nbytes(t->spec.dtype, 1), nbytes = opf_dtype_nbytes(t->spec.dtype, (size_t)n);
    if (n == 0) return OPF_OK;
    uint8_t one[8], pat[16];
    bool nonzero = false;
    if (fill_element(t->spec.dtype, value, one))
        for (size_t i = 0; i < 16; i++) nonzero |= (pat[i] = one[i % es]) != 0;
    if (!nonzero) {
        OPF_CUDA_TRY(ctx, fn, cudaMemsetAsync(data(t), 0, nbytes, s->stream));
        return OPF_OK;
    }
    uint4 p4;
    memcpy(&p4, pat, 16);
    fill_kernel<<<opf_cuda_grid(s, (int64_t)nbytes / 16 + 1, THREADS), THREADS, 0, s->stream>>>(
        (uint8_t *)data(t), (int64_t)nbytes, al16(data(t)), p4);
    return launched(ctx, fn);
}

static opf_status cuda_fill_uniform(opf_ctx *ctx, uint64_t seed, uint64_t offset, uint32_t stream,
                                    double bound, opf_tensor *t)
{
    const char *fn = "fill_uniform";
    STATE_OR_FAIL(s, ctx, fn);
    int64_t n = numel(t);
    if (n == 0) return OPF_OK;
    void *ts = data(t);
    return opf_dev_with_dtype(t->spec.dtype, [&](auto d) {
        fill_uniform_kernel<decltype(d)::value><<<grid_of(s, n), THREADS, 0, s->stream>>>(
            n, al16(ts), seed, offset, stream, bound, ts);
        return launched(ctx, fn);
    });
}

extern "C" const opf_elem_kernels opf_cuda_elem = {
    .bias_add = cuda_bias_add,
    .dbias = cuda_dbias,
    .dbias_q = cuda_dbias_q,
    .scaled_bias_add = cuda_scaled_bias_add,
    .scaled_dbias = cuda_scaled_dbias,
    .scale = cuda_scale,
    .add = cuda_add,
    .dropout_fwd = cuda_dropout_fwd,
    .dropout_bwd = cuda_dropout_bwd,
    .cast = cuda_cast,
    .cast_transpose = cuda_cast_transpose,
    .fill = cuda_fill,
    .fill_uniform = cuda_fill_uniform,
    .copy = cuda_copy_bytes,
};
