/* act.cuh: the device side act.cu shares with act_dbias_<fn>.cu: the
 * element functions of each act-math.h pair, typed loads and stores, and
 * dact + dbias's colsum.cuh terms with their launches. Those column sums
 * (108 instantiations: five element functions x the dtypes x the three
 * spreads; 123 when the fp32 entry had a term of its own) made act.cu the
 * longest nvcc step of a CUDA build (49-61 s on
 * the GPU machine's 16 cores, the rest of the build waiting), so each
 * element function's build in a translation unit of its own
 * (act_dbias_<fn>.cu, ACT_DBIAS_INSTANTIATE) in parallel; the extern
 * template declarations at the end keep every other includer (act.cu)
 * from instantiating them. act.cu's file comment says how they work. */
#ifndef OPFUSE_CUDA_ACT_CUH
#define OPFUSE_CUDA_ACT_CUH

#include <stdlib.h>

#include "backend/cuda/colsum.cuh"
#include "backend/cuda/cuda-impl.h"
#include "backend/cuda/qout.cuh"
extern "C" {
#include "backend/cpu/act-math.h"
}

enum { ACT_BATCH = 16 }; /* dact + dbias rows in flight a thread (colsum.cuh) */

/* A kind of each element-function pair (act-math.h's opf_act_fn): on a
 * constant kind opf_act_scalar_impl inlines to that pair's f or f'. */
__host__ __device__ constexpr opf_act_kind kind_of(opf_act_fn fn)
{
    return fn == OPF_ACT_FN_GELU      ? OPF_ACT_GELU
           : fn == OPF_ACT_FN_RELU    ? OPF_ACT_RELU
           : fn == OPF_ACT_FN_SRELU   ? OPF_ACT_SRELU
           : fn == OPF_ACT_FN_SIGMOID ? OPF_ACT_GLU
                                      : OPF_ACT_SILU;
}
template <opf_act_fn FN> __device__ __forceinline__ float act_f(float x, float alpha)
{
    return opf_act_f_impl(kind_of(FN), x, alpha);
}
template <opf_act_fn FN> __device__ __forceinline__ float act_df(float x, float alpha)
{
    return opf_act_df_impl(kind_of(FN), x, alpha);
}

/* Element i of a plain array of dtype D, widened exactly. */
template <opf_dtype D> __device__ __forceinline__ float ld_t(const void *p, int64_t i)
{
    return opf_dev_to_f32<D>(((const typename opf_dev_plain<D>::store *)p)[i]);
}

/* Stores v rounded once into D (the cast kernel's rounding) at element i;
 * returns the stored value widened (what an amax pass would read). */
template <opf_dtype D> __device__ __forceinline__ float st_t(void *p, int64_t i, float v)
{
    typename opf_dev_plain<D>::store b = opf_dev_from_f32<D>(v);
    ((typename opf_dev_plain<D>::store *)p)[i] = b;
    return opf_dev_to_f32<D>(b);
}

/* f(d_in, d_out) for the typed kernels' dtype pair (each f32 or bf16), as
 * opf_dev_dtype constants. */
template <class F> static inline opf_status act_with_io(opf_dtype di, opf_dtype dout, F f)
{
    bool ob = dout == OPF_BF16;
    if (di == OPF_BF16)
        return ob ? f(opf_dev_dtype<OPF_BF16>(), opf_dev_dtype<OPF_BF16>())
                  : f(opf_dev_dtype<OPF_BF16>(), opf_dev_dtype<OPF_F32>());
    return ob ? f(opf_dev_dtype<OPF_F32>(), opf_dev_dtype<OPF_BF16>())
              : f(opf_dev_dtype<OPF_F32>(), opf_dev_dtype<OPF_F32>());
}

/* dact + dbias: k = row, c = column; dx = f'(x)·dy. x, dy of DI; dx stored
 * in DO, its amax key kept. The sum takes the fp32 term (dact_dbias,
 * dact_dbias_q), or with STORED the value stored in DO (dact_dbias_stored:
 * the activation's backward, then the bias's). */
template <opf_act_fn FN, opf_dtype DI, opf_dtype DO, bool STORED = false> struct dbias_t_term {
    enum { BATCH = ACT_BATCH, STREAMS = 2, SPREAD = 2 };
    typedef typename opf_dev_plain<DI>::store store;
    struct in { float x, dy; };
    const void *x, *dy;
    void       *dx;
    int64_t     cols;
    float       alpha;
    __host__ __device__ const void *stream(int i) const { return i ? dy : x; }
    __device__ __forceinline__ void unpack(const store (&e)[2], in &v) const
    {
        v.x = opf_dev_to_f32<DI>(e[0]);
        v.dy = opf_dev_to_f32<DI>(e[1]);
    }
    __device__ __forceinline__ void load(int64_t r, int64_t c, in &v) const
    {
        v.x = ld_t<DI>(x, r * cols + c);
        v.dy = ld_t<DI>(dy, r * cols + c);
    }
    __device__ __forceinline__ float finish(int64_t r, int64_t c, const in &v, unsigned &key) const
    {
        float d = act_df<FN>(v.x, alpha) * v.dy, w = st_t<DO>(dx, r * cols + c, d);
        key = opf_dev_amax_max(key, w);
        return STORED ? w : d;
    }
};

/* The arguments of a typed pass (act.cu's *_q entries). */
typedef struct typed_args {
    const void *x, *dy;
    void       *y;      /* the output, or the hp tensor before the quantize */
    float      *dbias;
    int64_t     rows, cols;
    float       alpha;
    unsigned   *amax;
} typed_args;

/* The staged kernel's spread for dact + dbias: OPF_CUDA_COLSUM_SPREAD
 * where it is 1, 2 or 4, else def (a getenv a launch, so a test can
 * change it between calls). */
static inline int dbias_spread(int def)
{
    const char *v = getenv("OPF_CUDA_COLSUM_SPREAD");
    int n = v ? atoi(v) : 0;
    return n == 1 || n == 2 || n == 4 ? n : def;
}

/* dbias (and dx through t) at that spread, dbias stored in OD. */
template <typename Term, opf_dtype OD = OPF_F32>
static opf_status dbias_sums(opf_ctx *ctx, opf_cuda_state *s, const char *fn, const Term &t,
                             int64_t rows, int64_t cols, void *dbias, unsigned *amax)
{
    switch (dbias_spread(Term::SPREAD)) {
    case 1: return opf_cuda_colsum<Term, OD, 1>(ctx, s, fn, t, rows, cols, dbias, amax);
    case 2: return opf_cuda_colsum<Term, OD, 2>(ctx, s, fn, t, rows, cols, dbias, amax);
    default: return opf_cuda_colsum<Term, OD, 4>(ctx, s, fn, t, rows, cols, dbias, amax);
    }
}

/* ---- the dact + dbias entries of one element function ----------------------
 * act_dbias_plain: fp32 x, dy and dx (dact_dbias). act_dbias_typed: x and
 * dy of di, dx into a.y of dout (each f32 or bf16), its amax key into
 * a.amax (dact_dbias_q). act_dbias_stored (GELU and ReLU, the bias
 * fusion's): x and dy of one dtype, dx of its own, db f32 or bf16, which
 * sums dx as stored (dact_dbias_stored). */
template <opf_act_fn FN>
opf_status act_dbias_plain(opf_ctx *ctx, opf_cuda_state *s, const char *fn, float alpha,
                           const float *x, const float *dy, float *dx, float *dbias, int64_t rows,
                           int64_t cols)
{
    dbias_t_term<FN, OPF_F32, OPF_F32> t = {x, dy, dx, cols, alpha};
    return dbias_sums(ctx, s, fn, t, rows, cols, dbias, NULL);
}

template <opf_act_fn FN>
opf_status act_dbias_typed(opf_ctx *ctx, opf_cuda_state *s, const char *fn, opf_dtype di,
                           opf_dtype dout, const typed_args &a)
{
    return act_with_io(di, dout, [&](auto i, auto o) {
        dbias_t_term<FN, decltype(i)::value, decltype(o)::value> t = {a.x, a.dy, a.y, a.cols,
                                                                      a.alpha};
        return dbias_sums(ctx, s, fn, t, a.rows, a.cols, a.dbias, a.amax);
    });
}

template <opf_act_fn FN>
opf_status act_dbias_stored(opf_ctx *ctx, opf_cuda_state *s, const char *fn, float alpha,
                            const opf_tensor *x, const opf_tensor *dy, opf_tensor *dx,
                            opf_tensor *db)
{
    int64_t cols = opf_spec_numel(&db->spec), rows = cols ? opf_spec_numel(&x->spec) / cols : 0;
    return act_with_io(x->spec.dtype, dx->spec.dtype, [&](auto i, auto o) {
        dbias_t_term<FN, decltype(i)::value, decltype(o)::value, true> t = {
            x->data[0], dy->data[0], dx->data[0], cols, alpha};
        if (db->spec.dtype == OPF_BF16)
            return dbias_sums<decltype(t), OPF_BF16>(ctx, s, fn, t, rows, cols, db->data[0], NULL);
        return dbias_sums<decltype(t), OPF_F32>(ctx, s, fn, t, rows, cols, db->data[0], NULL);
    });
}

#define ACT_DBIAS_INSTANCES(spec, FN)                                                        \
    spec template opf_status act_dbias_plain<FN>(opf_ctx *, opf_cuda_state *, const char *, \
                                                 float, const float *, const float *,       \
                                                 float *, float *, int64_t, int64_t);       \
    spec template opf_status act_dbias_typed<FN>(opf_ctx *, opf_cuda_state *, const char *, \
                                                 opf_dtype, opf_dtype, const typed_args &);
#define ACT_DBIAS_STORED_INSTANCE(spec, FN)                                                  \
    spec template opf_status act_dbias_stored<FN>(opf_ctx *, opf_cuda_state *, const char *, \
                                                  float, const opf_tensor *, const opf_tensor *, \
                                                  opf_tensor *, opf_tensor *);
/* In act_dbias_<fn>.cu: the definitions of FN's; for GELU and ReLU also
 * ACT_DBIAS_STORED_INSTANTIATE. */
#define ACT_DBIAS_INSTANTIATE(FN) ACT_DBIAS_INSTANCES(, FN)
#define ACT_DBIAS_STORED_INSTANTIATE(FN) ACT_DBIAS_STORED_INSTANCE(, FN)
ACT_DBIAS_INSTANCES(extern, OPF_ACT_FN_GELU)
ACT_DBIAS_INSTANCES(extern, OPF_ACT_FN_RELU)
ACT_DBIAS_INSTANCES(extern, OPF_ACT_FN_SRELU)
ACT_DBIAS_INSTANCES(extern, OPF_ACT_FN_SIGMOID)
ACT_DBIAS_INSTANCES(extern, OPF_ACT_FN_SWISH)
ACT_DBIAS_STORED_INSTANCE(extern, OPF_ACT_FN_GELU)
ACT_DBIAS_STORED_INSTANCE(extern, OPF_ACT_FN_RELU)

#endif
