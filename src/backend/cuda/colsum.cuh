/* colsum.cuh: column sums over the rows of a [rows, cols] matrix on the GPU
 * in lanesum.h's order, bit for bit with the CPU's opf_cpu_colsum: the sum of
 * column c is 32 lane sums, lane l over the rows r with r mod 32 = l in row
 * order, folded in halves.
 *
 * A block of 32 warps takes 32 columns, a lane each: warp w makes lane
 * class w's sum, loading COLSUM_AHEAD rows ahead of its adds so that the
 * memory traffic runs in parallel although each sum is sequential; the 32
 * class sums then fold through shared memory. Every thread of the grid
 * sums rows / 32 terms, so the parallelism is 32 x cols.
 *
 * A Term gives the terms and what the pass writes besides (act.cu's dact +
 * dbias writes dx):
 *   struct in;                                    what one term loads
 *   void  load(int64_t r, int64_t c, in &v);      issues its loads
 *   float finish(int64_t r, int64_t c, const in &v, unsigned &key);
 *                                                 the term (key: the amax key
 *                                                 of anything it stored) */
#ifndef OPFUSE_CUDA_COLSUM_CUH
#define OPFUSE_CUDA_COLSUM_CUH

#include "backend/cuda/cuda-impl.h"
#include "backend/lanesum.h"

enum { COLSUM_AHEAD = 8, COLSUM_THREADS = 32 * OPF_SUM_LANES };

/* out[c] (dtype OD) = the column sums; amax (or NULL) merges the keys. */
template <typename Term, opf_dtype OD>
__global__ void __launch_bounds__(COLSUM_THREADS)
opf_colsum_kernel(Term term, int64_t rows, int64_t cols, void *out, unsigned *amax)
{
    __shared__ float part[OPF_SUM_LANES][33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int64_t c = (int64_t)blockIdx.x * 32 + lane;
    bool live = c < cols;
    unsigned key = 0;
    float acc = 0.0f;
    for (int64_t r0 = w; r0 < rows; r0 += OPF_SUM_LANES * COLSUM_AHEAD) {
        typename Term::in in[COLSUM_AHEAD];
#pragma unroll
        for (int k = 0; k < COLSUM_AHEAD; k++) {
            int64_t r = r0 + OPF_SUM_LANES * k;
            if (live && r < rows) term.load(r, c, in[k]);
        }
#pragma unroll
        for (int k = 0; k < COLSUM_AHEAD; k++) {
            int64_t r = r0 + OPF_SUM_LANES * k;
            if (live && r < rows) acc = __fadd_rn(acc, term.finish(r, c, in[k], key));
        }
    }
    part[w][lane] = acc;
    __syncthreads();
    for (int off = OPF_SUM_LANES / 2; off; off >>= 1) {
        if (w < off) part[w][lane] = __fadd_rn(part[w][lane], part[w + off][lane]);
        __syncthreads();
    }
    if (w == 0 && live)
        ((typename opf_dev_plain<OD>::store *)out)[c] = opf_dev_from_f32<OD>(part[0][lane]);
    if (amax) opf_dev_warp_amax(key, amax);
}

/* The launch on s's stream (no columns: nothing to launch). */
template <typename Term, opf_dtype OD = OPF_F32>
static opf_status opf_cuda_colsum(opf_ctx *ctx, opf_cuda_state *s, const char *fn, const Term &t,
                                  int64_t rows, int64_t cols, void *out, unsigned *amax = NULL)
{
    if (cols == 0) return OPF_OK;
    unsigned grid = (unsigned)((cols + 31) / 32);
    opf_colsum_kernel<Term, OD><<<grid, COLSUM_THREADS, 0, s->stream>>>(t, rows, cols, out, amax);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

#endif
