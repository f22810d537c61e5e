/* norm_bwd_one.cu: the LayerNorm / RMSNorm backward of a few hundred rows in
 * one launch. The backward is two independent jobs over the same inputs:
 * dx, a warp a row (norm.cuh's norm_rows), and the dgamma / dbeta column
 * sums (colsum.cuh's one-kernel form, a block per 32 columns). Launched one
 * after the other, each is a grid of a few dozen blocks whose time is its
 * latency, not its traffic, and the second waits for the first to end.
 * Here one grid holds both: its first blocks are the rows' and the rest the
 * column sums', so the two run side by side on different SMs, with no
 * fork or join (which cost more than they saved as two graph branches,
 * bench/RESULTS.md). Each block runs the same device code as its own
 * kernel would, so the bits are the two-launch path's; one block size
 * serves both: ONE_WARPS warps (the rows' warps; the column sums' G).
 *
 * Taken where the column sums take their one-kernel form (rows <=
 * COLSUM_WHOLE_ROWS), the grid is one wave and the call is all bf16 (x,
 * dz, gamma, dgamma and dbeta; dx any dtype): the training step's case,
 * compiled for that alone (each dtype more would be two more kernels of
 * nvcc time).
 * OPF_CUDA_NORM_ONE_LAUNCH=0 turns it off (read at each call, so a test
 * and a benchmark can time both paths in one process).
 *
 * Measured at [256, 1024] (H200, ncu, warm L2): 8.3 us where the two
 * kernels took 5.6 + 6.2; the 256-token LayerNorm-MLP step as a CUDA graph
 * about 2 us faster (bench/RESULTS.md). The merged grid takes longer than
 * its slower half: its column blocks run G = 16 warps, two chains a
 * thread, where the column kernel alone runs 32; loading all of a thread's
 * rows at once (a batch of 16, 127 registers) changed nothing. */
#include <stdlib.h>

#include "backend/cuda/norm.cuh"

enum { ONE_WARPS = 16 };

template <bool LN> using one_term = gamma_term<LN, OPF_BF16, false>;

/* Blocks [0, row_blocks): dx; the rest: dgamma (and dbeta) of 32 columns
 * each. */
template <bool LN>
__global__ void __launch_bounds__(ONE_WARPS *LANES)
    norm_bwd_one_kernel(norm_args a, int slots, unsigned row_blocks, one_term<LN> t, void *dg,
                        void *db)
{
    extern __shared__ __align__(16) char smem[];
    if (blockIdx.x < row_blocks)
        norm_rows<LN ? LN_BWD : RMS_BWD, OPF_BF16>(a, slots, blockIdx.x, row_blocks, smem);
    else
        opf_colsum_whole_block<one_term<LN>, OPF_BF16, ONE_WARPS>(t, a.rows, a.H, dg, db, NULL,
                                                                  blockIdx.x - row_blocks);
}

static unsigned long long launches;  /* opf_cuda_norm_one_launches */

extern "C" unsigned long long opf_cuda_norm_one_launches(void)
{
    return __atomic_load_n(&launches, __ATOMIC_RELAXED);
}

/* Besides the dtypes and the rows: a LayerNorm's dbeta given, and the
 * grid one wave (a block an SM at its 97 registers a thread; the only
 * case measured is [256, 1024]: 16 + 32 blocks). */
bool norm_bwd_one_takes(const opf_cuda_state *s, const norm_args &a, bool ln,
                        const opf_tensor *dgamma, const opf_tensor *dbeta)
{
    const char *v = getenv("OPF_CUDA_NORM_ONE_LAUNCH");
    if ((v && v[0] == '0') || a.rows <= 0 || a.H <= 0 || !opf_colsum_whole(a.rows)) return false;
    int64_t blocks = (a.rows + ONE_WARPS - 1) / ONE_WARPS + (a.H + 31) / 32;
    return blocks <= s->sm_count && one_dtype(a, OPF_BF16, true) &&
           dgamma->spec.dtype == OPF_BF16 && (ln ? dbeta != NULL : dbeta == NULL) &&
           (!dbeta || dbeta->spec.dtype == OPF_BF16);
}

/* A warp a row (no row left for a second pass, so no second buffer), each
 * staged when the block's rows fit its shared memory, else read from global
 * memory as launch_rows does for long rows. */
opf_status norm_bwd_one(opf_ctx *ctx, opf_cuda_state *s, norm_args a, bool ln, opf_tensor *dgamma,
                        opf_tensor *dbeta, const char *fn)
{
    /* Once per kernel and device: the dynamic shared memory a block may
     * opt in to, the most less the column sums' static buffer. */
    static unsigned long long attrs_set[2];  /* a bit per device */
    static int dyn_max[2];
    if (opf_cuda_once_needed(&attrs_set[ln], s->device)) {
        const void *k = ln ? (const void *)norm_bwd_one_kernel<true>
                           : (const void *)norm_bwd_one_kernel<false>;
        cudaFuncAttributes fa;
        OPF_CUDA_TRY(ctx, fn, cudaFuncGetAttributes(&fa, k));
        int most = BLOCK_SMEM_MAX - (int)fa.sharedSizeBytes;
        OPF_CUDA_TRY(ctx, fn, cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   most));
        __atomic_store_n(&dyn_max[ln], most, __ATOMIC_RELAXED);  /* the same value on any device */
        opf_cuda_once_done(&attrs_set[ln], s->device);
    }
    a.vec = vec_ok(a);
    a.prefetch = prefetch_ok(a);
    size_t slot = (size_t)row_bytes(a.H, a.xt) + (size_t)row_bytes(a.H, a.dzt);
    int slots = slot * ONE_WARPS <= (size_t)__atomic_load_n(&dyn_max[ln], __ATOMIC_RELAXED);
    size_t smem = slots * slot * ONE_WARPS;
    unsigned row_blocks = (unsigned)((a.rows + ONE_WARPS - 1) / ONE_WARPS);
    unsigned grid = row_blocks + (unsigned)((a.H + 31) / 32);
    void *dg = dgamma->data[0];
    if (ln)
        norm_bwd_one_kernel<true><<<grid, ONE_WARPS * LANES, smem, s->stream>>>(
            a, slots, row_blocks, one_term<true>{a.x, a.dz, a.mu, a.rs, a.H, a.act, a.dact}, dg,
            dbeta ? dbeta->data[0] : NULL);
    else
        norm_bwd_one_kernel<false><<<grid, ONE_WARPS * LANES, smem, s->stream>>>(
            a, slots, row_blocks, one_term<false>{a.x, a.dz, a.mu, a.rs, a.H, a.act, a.dact}, dg,
            NULL);
    OPF_CUDA_LAUNCHED(ctx, fn);
    __atomic_fetch_add(&launches, 1, __ATOMIC_RELAXED);
    return OPF_OK;
}
