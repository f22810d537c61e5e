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
 * ([32][cols]) to a fold kernel, a thread a column. The adds are
 * opf_dev_add's (x86's NaN bits, as the CPU's sums give them).
 *
 * A Term gives the terms and what the pass writes besides (act.cu's dact +
 * dbias writes dx):
 *   enum { BATCH };                               rows loaded ahead (registers:
 *                                                 BATCH x in, plus what finish
 *                                                 needs for all of them)
 *   struct in;                                    what one term loads
 *   void  load(int64_t r, int64_t c, in &v);      issues its loads
 *   float finish(int64_t r, int64_t c, const in &v, unsigned &key);
 *                                                 the term (key: the amax key
 *                                                 of anything it stored) */
#ifndef OPFUSE_CUDA_COLSUM_CUH
#define OPFUSE_CUDA_COLSUM_CUH

#include "backend/cuda/cuda-impl.h"
#include "backend/lanesum.h"

enum { COLSUM_WARPS = 4 };

/* part[l * cols + c] = class l's sum of column c; amax (or NULL) merges
 * the keys of what the terms stored. */
template <typename Term>
__global__ void __launch_bounds__(COLSUM_WARPS * 32)
opf_colsum_kernel(Term term, int64_t rows, int64_t cols, float *part, unsigned *amax)
{
    int lane = threadIdx.x & 31, l = (int)blockIdx.y * COLSUM_WARPS + (int)(threadIdx.x >> 5);
    int64_t c = (int64_t)blockIdx.x * 32 + lane;
    bool live = c < cols;
    unsigned key = 0;
    float acc = 0.0f;
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
            if (live && r < rows) acc = opf_dev_add(acc, term.finish(r, c, in[k], key));
        }
    }
    if (live) part[(int64_t)l * cols + c] = acc;
    if (amax) opf_dev_warp_amax(key, amax);
}

/* out[c] (dtype OD) = column c's 32 class sums folded in halves. */
template <opf_dtype OD>
__global__ void opf_colsum_fold_kernel(const float *part, int64_t cols, void *out)
{
    int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
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

/* The launches on s's stream (no columns: nothing to launch). */
template <typename Term, opf_dtype OD = OPF_F32>
static opf_status opf_cuda_colsum(opf_ctx *ctx, opf_cuda_state *s, const char *fn, const Term &t,
                                  int64_t rows, int64_t cols, void *out, unsigned *amax = NULL)
{
    if (cols == 0) return OPF_OK;
    size_t mark = opf_ctx_scratch_mark(ctx);
    float *part = (float *)opf_ctx_scratch_push_on(ctx, OPF_DEVICE_CUDA,
                                                   sizeof(float) * OPF_SUM_LANES * (size_t)cols);
    if (!part)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for 32 x %lld partial sums", fn,
                         (long long)cols);
    dim3 grid((unsigned)((cols + 31) / 32), OPF_SUM_LANES / COLSUM_WARPS);
    opf_colsum_kernel<Term><<<grid, COLSUM_WARPS * 32, 0, s->stream>>>(t, rows, cols, part, amax);
    opf_colsum_fold_kernel<OD><<<(unsigned)((cols + 255) / 256), 256, 0, s->stream>>>(part, cols,
                                                                                      out);
    opf_ctx_scratch_pop(ctx, mark);  /* stream-ordered: later work reuses it after these */
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

#endif
