/* colsum.cuh: column sums over the rows of a [rows, cols] matrix on the GPU
 * in lanesum.h's order, bit for bit with the CPU's opf_cpu_colsum: the sum of
 * column c is 32 lane sums, lane l over the rows r with r mod 32 = l in row
 * order, folded in halves.
 *
 * Thread (column c, class l) sums its column's rows r = l, l + 32, ... in
 * order, loading Term::BATCH rows before it adds any, so the memory
 * traffic runs in parallel although each sum is sequential. A warp is 32
 * consecutive columns of one class and a block COLSUM_WARPS classes, so the
 * 32 x cols chains spread over every SM (a block of all 32 classes held
 * the grid to cols / 32 blocks). The class sums go through device scratch
 * ([32][cols]) to a fold kernel, a thread a column; short columns (a few
 * hundred rows) take one kernel that folds in shared memory instead
 * (opf_colsum_whole_kernel). The adds are
 * opf_dev_add's (x86's NaN bits, as the CPU's sums give them).
 *
 * That kernel keeps Term::BATCH rows in flight a thread, and 32 x cols
 * threads are all there are: at GPT-2's 768 columns about 0.8 MB in flight
 * over the whole GPU, a fifth of what hides an H200's memory latency. So
 * where the inputs allow it (every row whole 16-byte chunks) the staged
 * kernel runs instead: a block's threads copy a strip of rows into shared
 * memory asynchronously (cp.async, several stages ahead, 16 bytes a copy,
 * decoupled from the chains), and each chain reads its terms from there in
 * the same order. Same bits either way.
 *
 * A Term gives the terms and what the pass writes besides (act.cuh's dact +
 * dbias writes dx):
 *   enum { BATCH };                               rows loaded ahead (registers:
 *                                                 BATCH x in, plus what finish
 *                                                 needs for all of them)
 *   struct in;                                    what one term loads
 *   void  load(int64_t r, int64_t c, in &v);      issues its loads
 *   float finish(int64_t r, int64_t c, const in &v, unsigned &key);
 *                                                 the term (key: the amax key
 *                                                 of anything it stored); of
 *                                                 Term::sum_t when it is
 *                                                 float2: two sums at once (a
 *                                                 norm's dgamma and dbeta)
 * and, for the staged kernel (STREAMS 0: never staged), its inputs as
 * STREAMS [rows, cols] arrays of one element type:
 *   enum { STREAMS };  typedef ... store;         the element type
 *   const void *stream(int i);                    input i's base (host and device)
 *   void unpack(const store (&e)[STREAMS], in &v); the loaded elements as in
 * A term that also reads a value per row (a norm's mu and rsigma) names
 * ROWS float arrays; the staged kernel loads them a stage ahead, lane k of
 * a warp row k of the stage, and hands each chain its row's by a shuffle
 * (read inside the chain of adds, each term waited on its own L2 round
 * trip: a stage's 32 terms on 32 of them in turn, ten times the time of
 * the stage's copies):
 *   enum { ROWS };  const float *row(int i);
 *   void unpack(const store (&e)[STREAMS], const float (&rv)[ROWS], in &v);
 * A term of many instructions names its spread (colsum_staging): SP
 * threads compute each chain's terms, its owner adding them in order (same
 * bits); without one, one thread a chain:
 *   enum { SPREAD };                              1, 2 or 4
 * A caller may pick another (opf_cuda_colsum's SP): act.cuh's dact + dbias
 * takes OPF_CUDA_COLSUM_SPREAD=1|2|4 from the environment, for measurement. */
#ifndef OPFUSE_CUDA_COLSUM_CUH
#define OPFUSE_CUDA_COLSUM_CUH

#include <stdlib.h>

#include <type_traits>

#include "backend/cuda/cuda-impl.h"
#include "backend/lanesum.h"

enum { COLSUM_WARPS = 4 };

/* One sum a column (a term of float) or two (float2): the accumulator adds
 * each component in order, and plane p of the partials ([sums][32][cols])
 * takes component p. */
__device__ __forceinline__ void opf_colsum_add(float &acc, float t) { acc = opf_dev_add(acc, t); }
__device__ __forceinline__ void opf_colsum_add(float2 &acc, float2 t)
{
    acc.x = opf_dev_add(acc.x, t.x);
    acc.y = opf_dev_add(acc.y, t.y);
}
__device__ __forceinline__ void opf_colsum_put(float *part, int64_t i, int64_t, float acc)
{
    part[i] = acc;
}
__device__ __forceinline__ void opf_colsum_put(float *part, int64_t i, int64_t plane, float2 acc)
{
    part[i] = acc.x;
    part[plane + i] = acc.y;
}
/* A term's sum type: Term::sum_t where it names one (float2: two sums),
 * else float. Named, not deduced from finish: nvcc's host pass deduced a
 * __device__ auto function's type differently from the device pass (the
 * host sized the scratch for one sum, the device wrote two). */
template <typename T, typename = void> struct opf_colsum_acc_of { typedef float type; };
template <typename T> struct opf_colsum_acc_of<T, std::void_t<typename T::sum_t>> {
    typedef typename T::sum_t type;
};
template <typename Term> using opf_colsum_acc = typename opf_colsum_acc_of<Term>::type;
/* A term's per-row arrays: Term::ROWS where it names them, else none. */
template <typename T, typename = void> struct opf_colsum_rows_of {
    static constexpr int value = 0;
};
template <typename T> struct opf_colsum_rows_of<T, std::void_t<decltype(T::ROWS)>> {
    static constexpr int value = (int)T::ROWS;
};
/* A term's spread (colsum_staging): Term::SPREAD where it names one, else 1. */
template <typename T, typename = void> struct opf_colsum_spread_of {
    static constexpr int value = 1;
};
template <typename T> struct opf_colsum_spread_of<T, std::void_t<decltype(T::SPREAD)>> {
    static constexpr int value = (int)T::SPREAD;
};
template <typename Term> __host__ __device__ constexpr int opf_colsum_sums()
{
    return std::is_same<opf_colsum_acc<Term>, float2>::value ? 2 : 1;
}
/* In the device pass: finish returns that type. */
#ifdef __CUDA_ARCH__
#define OPF_COLSUM_CHECK_TERM(Term, term)                                                     \
    static_assert(std::is_same<decltype(term.finish(0, 0, typename Term::in(),                 \
                                                    *(unsigned *)nullptr)),                   \
                               opf_colsum_acc<Term>>::value,                                  \
                  "a colsum term's finish returns its sum_t (float unless it names one)")
#else
#define OPF_COLSUM_CHECK_TERM(Term, term)
#endif

/* part[l * cols + c] = class l's sum of column c (and the second sum's at
 * 32 cols further); amax (or NULL) merges the keys of what the terms stored. */
template <typename Term>
__global__ void __launch_bounds__(COLSUM_WARPS * 32)
opf_colsum_kernel(Term term, int64_t rows, int64_t cols, float *part, unsigned *amax)
{
    OPF_COLSUM_CHECK_TERM(Term, term);
    int lane = threadIdx.x & 31, l = (int)blockIdx.y * COLSUM_WARPS + (int)(threadIdx.x >> 5);
    int64_t c = (int64_t)blockIdx.x * 32 + lane;
    bool live = c < cols;
    unsigned key = 0;
    opf_colsum_acc<Term> acc{};
    for (int64_t r0 = l; r0 < rows; r0 += OPF_SUM_LANES * Term::BATCH) {
        typename Term::in in[Term::BATCH];
#pragma unroll
        for (int k = 0; k < Term::BATCH; k++) {
            int64_t r = r0 + OPF_SUM_LANES * k;
            if (live && r < rows) term.load(r, c, in[k]);
        }
#pragma unroll
        for (int k = 0; k < Term::BATCH; k++) {
            int64_t r = r0 + OPF_SUM_LANES * k;
            if (live && r < rows) opf_colsum_add(acc, term.finish(r, c, in[k], key));
        }
    }
    if (live) opf_colsum_put(part, (int64_t)l * cols + c, OPF_SUM_LANES * cols, acc);
    if (amax) opf_dev_warp_amax(key, amax);
}

/* out[c] (dtype OD) = column c's 32 class sums folded in halves; the
 * second sum's into out2 (when not NULL) from the next plane. */
template <opf_dtype OD>
__global__ void opf_colsum_fold_kernel(const float *part, int64_t cols, void *out, void *out2)
{
    int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    if (blockIdx.y) {
        part += OPF_SUM_LANES * cols;
        out = out2;
    }
    float v[OPF_SUM_LANES];
#pragma unroll
    for (int i = 0; i < OPF_SUM_LANES; i++) v[i] = part[i * cols + c];
#pragma unroll
    for (int off = OPF_SUM_LANES / 2; off; off >>= 1)
#pragma unroll
        for (int i = 0; i < OPF_SUM_LANES / 2; i++)
            if (i < off) v[i] = opf_dev_add(v[i], v[i + off]);
    ((typename opf_dev_plain<OD>::store *)out)[c] = opf_dev_from_f32<OD>(v[0]);
}

/* Short columns (rows <= COLSUM_WHOLE_ROWS): one kernel, no scratch. A
 * block owns 32 columns whole: G warps, warp g the classes g, g + G, ...
 * (CPT of them, a sum each), its lanes the 32 columns. G is 32 (a chain a
 * thread) for a cheap term, 16 for one that names a spread (its ~100
 * instructions a term need more than the 64 registers a thread of a
 * 1024-thread block may have). A batch loads Term::BATCH terms (KB rows of
 * each of the CPT chains) before it adds any, each chain in row order; the
 * 32 class sums of a column then meet in shared memory and one thread a
 * column (a warp a sum) folds them in halves: opf_colsum_fold_kernel's
 * bits, one launch where the partials' kernel and the fold were two. At a
 * few hundred rows each kernel of the pair is a launch gap and a memory
 * round trip or two, so the pair cost twice this one (the LayerNorm-MLP step's three column
 * sums at 256 tokens). Longer columns keep the two kernels: their chains
 * are long, and a grid of cols / 32 blocks is too few to carry them. */
enum { COLSUM_WHOLE_ROWS = 512 };
template <typename Term> __host__ __device__ constexpr int opf_colsum_whole_groups()
{
    return opf_colsum_spread_of<Term>::value > 1 ? 16 : 32;
}

/* Component p of a sum (float: itself). */
__device__ __forceinline__ float opf_colsum_comp(float v, int) { return v; }
__device__ __forceinline__ float opf_colsum_comp(float2 v, int p) { return p ? v.y : v.x; }

/* Block `block` of the kernel below (columns 32 block ..), in a block of G
 * warps: the kernel's body, apart so that a kernel with other work for
 * some of its blocks can run it in the others (norm_bwd_one.cu). */
template <typename Term, opf_dtype OD, int G>
__device__ __forceinline__ void opf_colsum_whole_block(const Term &term, int64_t rows,
                                                       int64_t cols, void *out, void *out2,
                                                       unsigned *amax, int64_t block)
{
    OPF_COLSUM_CHECK_TERM(Term, term);
    typedef opf_colsum_acc<Term> A;
    enum {
        CPT = OPF_SUM_LANES / G,                                  /* chains a thread */
        KB = Term::BATCH / CPT > 0 ? (int)Term::BATCH / CPT : 1,  /* rows of each a batch */
    };
    static_assert(OPF_SUM_LANES % G == 0, "every thread the same number of classes");
    __shared__ A sums[OPF_SUM_LANES][32];
    const int lane = threadIdx.x & 31, g = threadIdx.x >> 5;
    const int64_t c = block * 32 + lane;
    const bool live = c < cols;
    unsigned key = 0;
    A acc[CPT];
#pragma unroll
    for (int j = 0; j < CPT; j++) acc[j] = A{};
    for (int64_t k0 = 0; k0 * OPF_SUM_LANES < rows; k0 += KB) {
        typename Term::in in[KB][CPT];
#pragma unroll
        for (int k = 0; k < KB; k++)
#pragma unroll
            for (int j = 0; j < CPT; j++) {
                int64_t r = (k0 + k) * OPF_SUM_LANES + g + j * G;
                if (live && r < rows) term.load(r, c, in[k][j]);
            }
#pragma unroll
        for (int k = 0; k < KB; k++)
#pragma unroll
            for (int j = 0; j < CPT; j++) {
                int64_t r = (k0 + k) * OPF_SUM_LANES + g + j * G;
                if (live && r < rows) opf_colsum_add(acc[j], term.finish(r, c, in[k][j], key));
            }
    }
#pragma unroll
    for (int j = 0; j < CPT; j++) sums[g + j * G][lane] = acc[j];
    __syncthreads();
    constexpr int NS = opf_colsum_sums<Term>();
    if (g < NS && live) {
        float v[OPF_SUM_LANES];
#pragma unroll
        for (int i = 0; i < OPF_SUM_LANES; i++) v[i] = opf_colsum_comp(sums[i][lane], g);
#pragma unroll
        for (int off = OPF_SUM_LANES / 2; off; off >>= 1)
#pragma unroll
            for (int i = 0; i < OPF_SUM_LANES / 2; i++)
                if (i < off) v[i] = opf_dev_add(v[i], v[i + off]);
        ((typename opf_dev_plain<OD>::store *)(g ? out2 : out))[c] = opf_dev_from_f32<OD>(v[0]);
    }
    if (amax) opf_dev_warp_amax(key, amax);
}

template <typename Term, opf_dtype OD, int G = opf_colsum_whole_groups<Term>()>
__global__ void __launch_bounds__(G * 32)
opf_colsum_whole_kernel(Term term, int64_t rows, int64_t cols, void *out, void *out2,
                        unsigned *amax)
{
    opf_colsum_whole_block<Term, OD, G>(term, rows, cols, out, out2, amax, blockIdx.x);
}

/* Whether the launch takes the one-kernel path: short columns, unless
 * OPF_CUDA_COLSUM_WHOLE=0 (read at each launch, so a test and a benchmark
 * can run both paths in one process; the bits are the same). */
static inline bool opf_colsum_whole(int64_t rows)
{
    if (rows > COLSUM_WHOLE_ROWS) return false;
    const char *v = getenv("OPF_CUDA_COLSUM_WHOLE");
    return !(v && v[0] == '0');
}

/* The staged kernel's shape for Term at spread SP: 128 chains a block, a
 * strip of SC columns (128 bytes of a row) x G classes; a stage is K row
 * groups of 32 (its G rows of each); NST stages in shared memory.
 *
 * SP 1: a block of 128 threads, each its chain's terms and sum; a stage is
 * 64 rows, 8 KB a stream (48 KB for two streams, the static limit).
 *
 * SP > 1 (a term of ~100 instructions: act.cuh's dact + dbias): 128 SP
 * threads; thread t computes the terms k = t / 128, t / 128 + SP, ... of
 * chain t % 128 into a tile d[K][G][SC] of sums, then thread t < 128 adds
 * its chain's K in k order (the SP 1 kernel's bits). At SP 1 the 32 x cols
 * chains are all the threads there are, 3072 warps at 3072 columns, and at
 * 91 registers 4 blocks (16 warps) an SM: half the SM's issue rate. The
 * stage halves (32 rows) so the stages and the tile fit 48 KB (bf16, two
 * streams: 3 x 2 x 4 KB + 8 KB = 32 KB; f32: 24 + 4 = 28 KB); 2 stages
 * ahead of 4 KB a stream is still 16 KB in flight a block, over 6 MB on an
 * H200. MIN_BLOCKS bounds the registers (ptxas -v, dbias_t_term<GELU, bf16,
 * bf16>; sm_90, 64K registers and 228 KB an SM; 768 blocks at 3072 columns):
 *   SP 1: 91 registers, 48 KB: 4 blocks of 4 warps (16 warps an SM), 528
 *         a wave, 768 in 528 + 240;
 *   SP 2: 3 blocks of 8 warps, <= 80 registers (80, no spill), 32 KB: 24
 *         warps an SM, 396 a wave, 768 in two of 396 + 372;
 *   SP 4: 2 blocks of 16 warps, <= 64 registers (64; one spilled, loaded
 *         once a stage), 32 KB: 32 warps, 264 a wave, 768 in three of
 *         264 + 264 + 240.
 * 4 blocks at SP 2 would hold 32 warps at <= 64 registers but 528 a wave,
 * 768 in 528 + 240, the second wave half empty; 6 (one wave) leave 40
 * registers for a term of ~110 instructions. */
template <typename Term, int SP = 1> struct colsum_staging {
    typedef typename Term::store T;
    enum {
        CHAINS = 128,
        THREADS = CHAINS * SP,
        SC = 128 / (int)sizeof(T),
        G = CHAINS / SC,
        K = 64 / G / (SP > 1 ? 2 : 1),
        NST = Term::STREAMS == 1 ? 4 : 3,
        CHUNKS = K * G * 128 / 16,  /* 16-byte copies a stage, a stream */
        PER_CHUNK = 16 / (int)sizeof(T),
        ROWS = opf_colsum_rows_of<Term>::value,
        MIN_BLOCKS = SP == 1 ? 0 : SP == 2 ? 3 : 2,  /* 0: no bound */
    };
    static_assert(SP == 1 || SP == 2 || SP == 4, "a spread of 1, 2 or 4");
    static_assert(OPF_SUM_LANES % G == 0, "a block's classes divide the 32");
    static_assert(SC % 32 == 0 && K <= 32, "a warp is one class; a stage's rows are lanes");
    static_assert(K % SP == 0, "each thread of a chain the same number of a stage's terms");
};

/* part[l * cols + c] as opf_colsum_kernel's, the inputs staged; SP as
 * colsum_staging's. */
template <typename Term, int SP>
__global__ void __launch_bounds__(colsum_staging<Term, SP>::THREADS,
                                  colsum_staging<Term, SP>::MIN_BLOCKS)
opf_colsum_staged_kernel(Term term, int64_t rows, int64_t cols, float *part, unsigned *amax)
{
    OPF_COLSUM_CHECK_TERM(Term, term);
    typedef colsum_staging<Term, SP> P;
    typedef typename Term::store T;
    typedef opf_colsum_acc<Term> A;
    enum { S = Term::STREAMS };
    __shared__ __align__(16) T buf[P::NST][S][P::K][P::G][P::SC];
    __shared__ A d[SP > 1 ? P::K : 1][P::G][P::SC];  /* SP > 1: a stage's terms */
    /* thread t: chain o, its terms ph, ph + SP, ... of a stage */
    const int t = (int)threadIdx.x, o = SP > 1 ? t % P::CHAINS : t, ph = SP > 1 ? t / P::CHAINS : 0;
    const int gl = o / P::SC, cl = o % P::SC;
    const int64_t c0 = (int64_t)blockIdx.x * P::SC, l0 = (int64_t)blockIdx.y * P::G;
    const int64_t stages = (rows + OPF_SUM_LANES * P::K - 1) / (OPF_SUM_LANES * P::K);
    /* stage s: rows 32 (s K + k) + l0 + g, k < K, g < G; consecutive threads
     * take consecutive chunks of a row */
    auto issue = [&](int64_t s) {
        if (s >= stages) return;
        for (int i = t; i < P::CHUNKS; i += P::THREADS) {
            int k = i / (P::G * 8), g = i / 8 % P::G, ch = i % 8;
            int64_t r = OPF_SUM_LANES * (s * P::K + k) + l0 + g, c = c0 + ch * P::PER_CHUNK;
            if (r >= rows || c >= cols) continue;
#pragma unroll
            for (int j = 0; j < S; j++)
                opf_dev_copy16_async(&buf[s % P::NST][j][k][g][ch * P::PER_CHUNK],
                                     (const T *)term.stream(j) + r * cols + c);
        }
    };
    for (int s = 0; s < P::NST - 1; s++) {
        issue(s);
        opf_dev_copies_commit();
    }
    const int64_t c = c0 + cl, l = l0 + gl;
    const bool live = c < cols;
    const bool warp_live = __all_sync(0xFFFFFFFFu, live);
    const int lane = t & 31;
    /* the per-row values of stage s (lane k: row k of the stage's class l;
     * a warp is one class, so each warp loads its own) */
    float rv_now[P::ROWS > 0 ? P::ROWS : 1], rv_next[P::ROWS > 0 ? P::ROWS : 1];
    auto rows_of = [&](int64_t s, float (&rv)[P::ROWS > 0 ? P::ROWS : 1]) {
        if constexpr (P::ROWS > 0) {
            int64_t r = OPF_SUM_LANES * (s * P::K + lane) + l;
#pragma unroll
            for (int i = 0; i < P::ROWS; i++)
                rv[i] = lane < P::K && r < rows ? __ldg(term.row(i) + r) : 0.0f;
        }
    };
    rows_of(0, rv_next);
    unsigned key = 0;
    A acc{};
    for (int64_t s = 0; s < stages; s++) {
#pragma unroll
        for (int i = 0; i < P::ROWS; i++) rv_now[i] = rv_next[i];
        if (P::ROWS && s + 1 < stages) rows_of(s + 1, rv_next);  /* in flight over this stage */
        opf_dev_copies_wait<P::NST - 2>();  /* this thread's copies of stage s */
        /* everyone's; everyone is done with stage s - 1's buffer, and the
         * chains' owners with its terms in d */
        __syncthreads();
        issue(s + P::NST - 1);  /* into stage s - 1's buffer */
        opf_dev_copies_commit();
        const int b = (int)(s % P::NST);
        /* a warp's lanes all run the terms (the shuffles); the dead ones'
         * terms are not computed. A warp of live lanes (all but the last
         * strip's) takes a copy without that test, so a whole stage is one
         * block of straight-line code the compiler schedules as a whole.
         * The ks of a warp are the same on all its lanes. */
        auto term_k = [&](int k, auto checked) {
            float rv[P::ROWS > 0 ? P::ROWS : 1];
#pragma unroll
            for (int i = 0; i < P::ROWS; i++) rv[i] = __shfl_sync(0xFFFFFFFFu, rv_now[i], k);
            if (decltype(checked)::value && !live) return;
            T e[S];
#pragma unroll
            for (int j = 0; j < S; j++) e[j] = buf[b][j][k][gl][cl];
            typename Term::in v;
            if constexpr (P::ROWS > 0) term.unpack(e, rv, v);
            else term.unpack(e, v);
            A x = term.finish(OPF_SUM_LANES * (s * P::K + k) + l, c, v, key);
            if constexpr (SP > 1) d[k][gl][cl] = x;
            else opf_colsum_add(acc, x);
        };
        int64_t r0 = OPF_SUM_LANES * s * P::K + l;
        bool whole = r0 + OPF_SUM_LANES * (P::K - 1) < rows;  /* every row of the stage */
        if (whole && warp_live) {
#pragma unroll
            for (int j = 0; j < P::K / SP; j++) term_k(ph + j * SP, std::false_type());
        } else if (whole) {
#pragma unroll
            for (int j = 0; j < P::K / SP; j++) term_k(ph + j * SP, std::true_type());
        } else {
            for (int k = ph; r0 + OPF_SUM_LANES * k < rows; k += SP) term_k(k, std::true_type());
        }
        if constexpr (SP > 1) {
            __syncthreads();  /* the stage's terms in d */
            if (ph == 0 && live) {
                if (whole) {
#pragma unroll
                    for (int k = 0; k < P::K; k++) opf_colsum_add(acc, d[k][gl][cl]);
                } else {
                    for (int k = 0; r0 + OPF_SUM_LANES * k < rows; k++)
                        opf_colsum_add(acc, d[k][gl][cl]);
                }
            }
        }
    }
    if (live && ph == 0) opf_colsum_put(part, l * cols + c, OPF_SUM_LANES * cols, acc);
    if (amax) opf_dev_warp_amax(key, amax);
}

/* Whether t's inputs can be staged: rows of whole 16-byte chunks from
 * 16-byte aligned bases. */
template <typename Term> static bool opf_colsum_stageable(const Term &t, int64_t cols)
{
    if (cols * (int64_t)sizeof(typename Term::store) % 16) return false;
    for (int j = 0; j < Term::STREAMS; j++)
        if (!opf_cuda_aligned16(t.stream(j))) return false;
    return true;
}

/* The launches on s's stream (no columns: nothing to launch); a term of
 * two sums folds its second into out2. SP: the staged kernel's spread
 * (colsum_staging), Term::SPREAD where the term names one, else 1. */
template <typename Term, opf_dtype OD = OPF_F32, int SP = opf_colsum_spread_of<Term>::value>
static opf_status opf_cuda_colsum(opf_ctx *ctx, opf_cuda_state *s, const char *fn, const Term &t,
                                  int64_t rows, int64_t cols, void *out, unsigned *amax = NULL,
                                  void *out2 = NULL)
{
    constexpr int sums = opf_colsum_sums<Term>();
    if (cols == 0) return OPF_OK;
    if (opf_colsum_whole(rows)) {
        opf_colsum_whole_kernel<Term, OD>
            <<<(unsigned)((cols + 31) / 32), opf_colsum_whole_groups<Term>() * 32, 0, s->stream>>>(
                t, rows, cols, out, out2, amax);
        OPF_CUDA_LAUNCHED(ctx, fn);
        return OPF_OK;
    }
    size_t mark = opf_ctx_scratch_mark(ctx);
    float *part = (float *)opf_ctx_scratch_push_on(
        ctx, OPF_DEVICE_CUDA, sizeof(float) * sums * OPF_SUM_LANES * (size_t)cols);
    if (!part)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %d x 32 x %lld partial sums",
                         fn, sums, (long long)cols);
    bool staged = false;
    if constexpr (Term::STREAMS > 0) {
        typedef colsum_staging<Term, SP> P;
        staged = opf_colsum_stageable(t, cols);
        dim3 grid((unsigned)((cols + P::SC - 1) / P::SC), OPF_SUM_LANES / P::G);
        if (staged)
            opf_colsum_staged_kernel<Term, SP><<<grid, P::THREADS, 0, s->stream>>>(t, rows, cols,
                                                                                    part, amax);
    }
    if (!staged) {
        dim3 grid((unsigned)((cols + 31) / 32), OPF_SUM_LANES / COLSUM_WARPS);
        opf_colsum_kernel<Term><<<grid, COLSUM_WARPS * 32, 0, s->stream>>>(t, rows, cols, part,
                                                                         amax);
    }
    dim3 fold((unsigned)((cols + 255) / 256), sums);
    opf_colsum_fold_kernel<OD><<<fold, 256, 0, s->stream>>>(part, cols, out, out2);
    opf_ctx_scratch_pop(ctx, mark);  /* stream-ordered: later work reuses it after these */
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

#endif
