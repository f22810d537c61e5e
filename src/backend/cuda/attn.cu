/* attn.cu: causal self-attention (backend/nn.h's attn_fwd / attn_bwd) on
 * the GPU as batched fp32 GEMMs through cuBLASLt (OPF_CUDA_ATTENTION=gemm,
 * and where flash.cu's kernels, the default, do not fit); nn.cu keeps the
 * kernels that give the CPU's bits (OPF_CUDA_ATTENTION=exact).
 *
 * The heads of a chunk of (batch, head) pairs are copied out of qkv into
 * contiguous [pairs, T, D] blocks; in cuBLASLt's column-major terms each is
 * a D x T matrix with ld D (Qc, Kc, Vc). Per pair, with S[i][j] row-major
 * stored as the T x T column-major S_cm[j][i]:
 *   forward   S_cm  = scale Kc^T Qc                      (m T, n T, k D)
 *             P     = exp(S - lse_i) for j <= i, else 0  (a block per row)
 *             Oc    = Vc P_cm                            (m D, n T, k T)
 *   backward  S_cm recomputed; dP_cm = Vc^T dOc;
 *             dS    = P (dP - D_i) scale, D_i = dO_i . O_i
 *             dVc   = dOc P_cm^T, dQc = Kc dS_cm, dKc = Qc dS_cm^T
 * The GEMMs run the full T x T square (the masked half is zeros): twice the
 * causal work, on the tensor-free fp32 pipe, which at GPT-2's shapes is
 * still far below the memory traffic of the score matrices.
 *
 * Scratch: the score matrices dominate (4 T^2 bytes per pair, twice in the
 * backward), so the pairs go in chunks of at most CHUNK_BYTES of scratch.
 * The results differ from the CPU's in the last bits (the GEMMs' sums are
 * cuBLASLt's order, the exponentials CUDA's): test_cuda_nn bounds them. */
#include "backend/cuda/cuda-impl.h"

static const size_t CHUNK_BYTES = (size_t)1 << 30;

typedef struct heads {
    int64_t B, T, H, D, C;
    int64_t bh0, nb;  /* the chunk: pairs bh0 .. bh0 + nb - 1 */
} heads;

/* Copies the chunk's heads of `which` parts of x (row stride `parts` C:
 * qkv's three, or o / do's one) into dst[p] = [nb, T, D], or back when
 * `back` (dst read, x written). */
static __global__ void heads_kernel(float *x, int parts, float *d0, float *d1, float *d2,
                                    heads h, bool back)
{
    int64_t n = h.nb * h.T * h.D, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        int64_t d = e % h.D, t = e / h.D % h.T, bh = h.bh0 + e / (h.D * h.T);
        int64_t b = bh / h.H, hh = bh % h.H;
        float *row = x + (b * h.T + t) * parts * h.C + hh * h.D + d;
        float *dst[3] = {d0, d1, d2};
        for (int p = 0; p < parts; p++) {
            if (back) row[p * h.C] = dst[p][e];
            else dst[p][e] = row[p * h.C];
        }
    }
}

/* Sum of v over the block (256 threads), in every thread. */
static __device__ float block_sum(float v, float *sh)
{
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? sh[lane] : 0.0f;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

static __device__ float block_max(float v, float *sh)
{
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? sh[lane] : -INFINITY;
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

/* Row i of pair p (block p * T + i): P in place of S, lse [B, H, T]. */
static __global__ void softmax_kernel(float *S, float *lse, heads h)
{
    __shared__ float sh[32];
    int64_t row = blockIdx.x, i = row % h.T;
    float *s = S + row * h.T;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, s[j]);
    m = block_max(m, sh);
    float l = 0.0f;
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) l += expf(s[j] - m);
    l = block_sum(l, sh);
    float ls = m + logf(l);
    for (int64_t j = threadIdx.x; j < h.T; j += blockDim.x) s[j] = j <= i ? expf(s[j] - ls) : 0.0f;
    if (threadIdx.x == 0) lse[(h.bh0 + row / h.T) * h.T + i] = ls;
}

/* Row i of pair p: P in place of S (from lse), dS in place of dP. D_i =
 * dO_i . O_i over the chunk's contiguous dO and O. */
static __global__ void dsoftmax_kernel(float *S, float *dP, const float *lse, const float *dO,
                                       const float *O, float scale, heads h)
{
    __shared__ float sh[32];
    int64_t row = blockIdx.x, i = row % h.T;
    float di = 0.0f;
    for (int64_t d = threadIdx.x; d < h.D; d += blockDim.x) di += dO[row * h.D + d] * O[row * h.D + d];
    di = block_sum(di, sh);
    float ls = lse[(h.bh0 + row / h.T) * h.T + i];
    float *s = S + row * h.T, *dp = dP + row * h.T;
    for (int64_t j = threadIdx.x; j < h.T; j += blockDim.x) {
        float p = j <= i ? expf(s[j] - ls) : 0.0f;
        s[j] = p;
        dp[j] = p * (dp[j] - di) * scale;
    }
}

static opf_status launch_heads(opf_ctx *ctx, opf_cuda_state *s, const float *x, int parts,
                               float *d0, float *d1, float *d2, const heads *h, bool back,
                               const char *fn)
{
    heads_kernel<<<opf_cuda_grid(s, h->nb * h->T * h->D, 256), 256, 0, s->stream>>>(
        (float *)x, parts, d0, d1, d2, *h, back);
    OPF_CUDA_LAUNCHED(ctx, fn);
    return OPF_OK;
}

/* Pairs per chunk: `per` bytes of scratch each, within CHUNK_BYTES. */
static int64_t chunk_pairs(int64_t BH, size_t per)
{
    int64_t n = (int64_t)(CHUNK_BYTES / per);
    return n < 1 ? 1 : n < BH ? n : BH;
}

/* Bytes of n floats rounded up to 256: each scratch region starts where
 * cuBLASLt's heuristic assumes (256-byte alignment) whatever T and D are. */
static size_t region(int64_t n) { return opf_cuda_pad256(sizeof(float) * (size_t)n); }

/* Splits scratch ws into count regions of the given float counts. */
static void carve(void *ws, float **out[], const int64_t *n, int count)
{
    char *p = (char *)ws;
    for (int i = 0; i < count; i++) *out[i] = (float *)p, p += region(n[i]);
}

static opf_status fwd_gemm(opf_ctx *ctx, const float *qkv, float *o, float *lse, int64_t B,
                           int64_t T, int64_t H, int64_t D)
{
    const char *fn = "attention forward (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    int64_t BH = B * H, TD = T * D, TT = T * T;
    if (BH <= 0 || T <= 0 || D <= 0) return OPF_OK;
    int64_t nb = chunk_pairs(BH, 4 * region(TD) + region(TT));
    void *ws;
    opf_status st = opf_cuda_scratch(ctx, s, 4 * region(nb * TD) + region(nb * TT), &ws);
    if (st) return st;
    float *q, *k, *v, *oc, *S;
    float **out[] = {&q, &k, &v, &oc, &S};
    const int64_t n[] = {nb * TD, nb * TD, nb * TD, nb * TD, nb * TT};
    carve(ws, out, n, 5);
    float scale = 1.0f / sqrtf((float)D);
    for (int64_t bh0 = 0; bh0 < BH && !st; bh0 += nb) {
        heads h = {B, T, H, D, H * D, bh0, bh0 + nb <= BH ? nb : BH - bh0};
        st = launch_heads(ctx, s, qkv, 3, q, k, v, &h, false, fn);
        if (!st) st = opf_cuda_sgemm_batched(ctx, s, true, false, T, T, D, scale, k, D, TD, q, D, TD,
                                             S, TT, h.nb);
        if (st) break;
        softmax_kernel<<<(unsigned)(h.nb * T), 256, 0, s->stream>>>(S, lse, h);
        OPF_CUDA_LAUNCHED(ctx, fn);
        st = opf_cuda_sgemm_batched(ctx, s, false, false, D, T, T, 1.0f, v, D, TD, S, T, TT, oc,
                                    TD, h.nb);
        if (!st) st = launch_heads(ctx, s, o, 1, oc, NULL, NULL, &h, true, fn);
    }
    return st;
}

static opf_status bwd_gemm(opf_ctx *ctx, const float *qkv, const float *o, const float *lse,
                           const float *dout, float *dqkv, int64_t B, int64_t T, int64_t H,
                           int64_t D)
{
    const char *fn = "attention backward (cuda)";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    int64_t BH = B * H, TD = T * D, TT = T * T;
    if (BH <= 0 || T <= 0 || D <= 0) return OPF_OK;
    int64_t nb = chunk_pairs(BH, 8 * region(TD) + 2 * region(TT));
    void *ws;
    opf_status st = opf_cuda_scratch(ctx, s, 8 * region(nb * TD) + 2 * region(nb * TT), &ws);
    if (st) return st;
    float *q, *k, *v, *oc, *dO, *dq, *dk, *dv, *S, *dP;
    int64_t a = nb * TD, b = nb * TT;
    float **out[] = {&q, &k, &v, &oc, &dO, &dq, &dk, &dv, &S, &dP};
    const int64_t n[] = {a, a, a, a, a, a, a, a, b, b};
    carve(ws, out, n, 10);
    float scale = 1.0f / sqrtf((float)D);
    for (int64_t bh0 = 0; bh0 < BH && !st; bh0 += nb) {
        heads h = {B, T, H, D, H * D, bh0, bh0 + nb <= BH ? nb : BH - bh0};
        int64_t n = h.nb;
        st = launch_heads(ctx, s, qkv, 3, q, k, v, &h, false, fn);
        if (!st) st = launch_heads(ctx, s, o, 1, oc, NULL, NULL, &h, false, fn);
        if (!st) st = launch_heads(ctx, s, dout, 1, dO, NULL, NULL, &h, false, fn);
        if (!st) st = opf_cuda_sgemm_batched(ctx, s, true, false, T, T, D, scale, k, D, TD, q, D, TD,
                                             S, TT, n);
        if (!st) st = opf_cuda_sgemm_batched(ctx, s, true, false, T, T, D, 1.0f, v, D, TD, dO, D,
                                             TD, dP, TT, n);
        if (st) break;
        dsoftmax_kernel<<<(unsigned)(n * T), 256, 0, s->stream>>>(S, dP, lse, dO, oc, scale, h);
        OPF_CUDA_LAUNCHED(ctx, fn);
        st = opf_cuda_sgemm_batched(ctx, s, false, true, D, T, T, 1.0f, dO, D, TD, S, T, TT, dv, TD,
                                    n);
        if (!st) st = opf_cuda_sgemm_batched(ctx, s, false, false, D, T, T, 1.0f, k, D, TD, dP, T,
                                             TT, dq, TD, n);
        if (!st) st = opf_cuda_sgemm_batched(ctx, s, false, true, D, T, T, 1.0f, q, D, TD, dP, T,
                                             TT, dk, TD, n);
        if (!st) st = launch_heads(ctx, s, dqkv, 3, dq, dk, dv, &h, true, fn);
    }
    return st;
}

/* ---- storage dtypes --------------------------------------------------------
 * Kernels that read one dtype get a plain f32 / bf16 / f16 array of another
 * as a copy cast by elem.cu (widening exact, narrowing RNE) in the context's
 * device scratch; a result written in another dtype is cast at the end. */

opf_status opf_cuda_attn_cast(opf_ctx *ctx, const void *x, opf_dtype xt, void *y, opf_dtype yt,
                              int64_t n)
{
    opf_spec sx = opf_spec_make(1, &n, xt), sy = opf_spec_make(1, &n, yt);
    sx.device = sy.device = OPF_DEVICE_CUDA;
    opf_tensor tx, ty;
    opf_status st = opf_tensor_wrap(&sx, (void *)x, &tx);
    if (!st) st = opf_tensor_wrap(&sy, y, &ty);
    return st ? st : opf_cuda_elem.cast(ctx, &tx, &ty);
}

/* x (n values of xt; NULL: none) as want: x itself, or device scratch
 * holding a copy when `copy` (an input), else nothing yet (an output). */
static opf_status attn_as(opf_ctx *ctx, const char *fn, const char *what, const void *x,
                          opf_dtype xt, opf_dtype want, int64_t n, bool copy, const void **out)
{
    *out = x;
    if (xt == want || !x) return OPF_OK;
    size_t bytes = opf_dtype_nbytes(want, (size_t)(n > 0 ? n : 1));
    void *p = opf_ctx_scratch_push_on(ctx, OPF_DEVICE_CUDA, bytes);
    if (!p)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no device scratch for %s as %s (%zu bytes)",
                         fn, what, opf_dtype_name(want), bytes);
    *out = p;
    return copy ? opf_cuda_attn_cast(ctx, x, xt, p, want, n) : OPF_OK;
}

opf_status opf_cuda_attn_io_open(opf_ctx *ctx, const char *fn, opf_cuda_attn_io *io,
                                 const void *qkv, opf_dtype qkv_t, const void *dout,
                                 opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t, opf_dtype in_t,
                                 opf_dtype out_t, int64_t nq)
{
    const void *w = NULL;
    *io = (opf_cuda_attn_io){.out = dqkv, .out_t = dqkv_t, .kernel_out_t = out_t, .nq = nq,
                             .mark = opf_ctx_scratch_mark(ctx)};
    opf_status st = attn_as(ctx, fn, "qkv", qkv, qkv_t, in_t, nq, true, &io->qkv);
    if (!st) st = attn_as(ctx, fn, "do", dout, dout_t, in_t, nq / 3, true, &io->dout);
    if (!st) st = attn_as(ctx, fn, "dqkv", dqkv, dqkv_t, out_t, nq, false, &w);
    io->dqkv = (void *)w;
    if (st) opf_ctx_scratch_pop(ctx, io->mark);
    return st;
}

opf_status opf_cuda_attn_io_close(opf_ctx *ctx, const opf_cuda_attn_io *io, opf_status st)
{
    if (!st && io->dqkv != io->out)
        st = opf_cuda_attn_cast(ctx, io->dqkv, io->kernel_out_t, io->out, io->out_t, io->nq);
    opf_ctx_scratch_pop(ctx, io->mark);  /* stream-ordered: later work reuses it after these */
    return st;
}

opf_status opf_cuda_attn_fwd_f32(opf_ctx *ctx, opf_cuda_attn_fwd_fn body, const void *qkv,
                                 opf_dtype qkv_t, float *o, float *lse, int64_t B, int64_t T,
                                 int64_t H, int64_t D, const char *fn)
{
    opf_cuda_attn_io io;
    opf_status st = opf_cuda_attn_io_open(ctx, fn, &io, qkv, qkv_t, NULL, OPF_F32, NULL, OPF_F32,
                                          OPF_F32, OPF_F32, B * T * 3 * H * D);
    if (st) return st;
    return opf_cuda_attn_io_close(ctx, &io, body(ctx, (const float *)io.qkv, o, lse, B, T, H, D));
}

opf_status opf_cuda_attn_bwd_f32(opf_ctx *ctx, opf_cuda_attn_bwd_fn body, const void *qkv,
                                 opf_dtype qkv_t, const float *o, const float *lse,
                                 const void *dout, opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t,
                                 int64_t B, int64_t T, int64_t H, int64_t D, const char *fn)
{
    opf_cuda_attn_io io;
    opf_status st = opf_cuda_attn_io_open(ctx, fn, &io, qkv, qkv_t, dout, dout_t, dqkv, dqkv_t,
                                          OPF_F32, OPF_F32, B * T * 3 * H * D);
    if (st) return st;
    st = body(ctx, (const float *)io.qkv, o, lse, (const float *)io.dout, (float *)io.dqkv, B, T,
              H, D);
    return opf_cuda_attn_io_close(ctx, &io, st);
}

opf_status opf_cuda_attn_fwd_gemm(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, float *o,
                                  float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                  opf_dtype in_dt)
{
    (void)in_dt;  /* fp32 GEMMs whatever the logical dtype */
    return opf_cuda_attn_fwd_f32(ctx, fwd_gemm, qkv, qkv_t, o, lse, B, T, H, D,
                                 "attention forward (cuda)");
}

opf_status opf_cuda_attn_bwd_gemm(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const float *o,
                                  const float *lse, const void *dout, opf_dtype dout_t, void *dqkv,
                                  opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H, int64_t D,
                                  opf_dtype in_dt)
{
    (void)in_dt;
    return opf_cuda_attn_bwd_f32(ctx, bwd_gemm, qkv, qkv_t, o, lse, dout, dout_t, dqkv, dqkv_t, B,
                                 T, H, D, "attention backward (cuda)");
}

/* ---- o's storage dtype -----------------------------------------------------
 * The paths other than cuDNN's compute o in fp32; nn.h's o_t is met here
 * once for all of them (and for cuDNN's fallback to flash2). The scratch is
 * the context's stack, not opf_cuda_scratch: f takes that one itself. */

opf_status opf_cuda_attn_fwd_typed_o(opf_ctx *ctx, const char *fn, opf_cuda_attn_fwd_o32_fn f,
                                     const void *qkv, opf_dtype qkv_t, void *o, opf_dtype o_t,
                                     float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                                     opf_dtype in_dt)
{
    int64_t n = B * T * H * D;
    size_t mark = opf_ctx_scratch_mark(ctx);
    const void *o32;
    opf_status st = attn_as(ctx, fn, "o", o, o_t, OPF_F32, n, false, &o32);
    if (!st) st = f(ctx, qkv, qkv_t, (float *)o32, lse, B, T, H, D, in_dt);
    if (!st && o32 != o) st = opf_cuda_attn_cast(ctx, o32, OPF_F32, o, o_t, n);
    opf_ctx_scratch_pop(ctx, mark);  /* stream-ordered, as io_close's */
    return st;
}

opf_status opf_cuda_attn_bwd_typed_o(opf_ctx *ctx, const char *fn, opf_cuda_attn_bwd_o32_fn f,
                                     const void *qkv, opf_dtype qkv_t, const void *o,
                                     opf_dtype o_t, const float *lse, const void *dout,
                                     opf_dtype dout_t, void *dqkv, opf_dtype dqkv_t, int64_t B,
                                     int64_t T, int64_t H, int64_t D, opf_dtype in_dt)
{
    size_t mark = opf_ctx_scratch_mark(ctx);
    const void *o32;
    opf_status st = attn_as(ctx, fn, "o", o, o_t, OPF_F32, B * T * H * D, true, &o32);
    if (!st)
        st = f(ctx, qkv, qkv_t, (const float *)o32, lse, dout, dout_t, dqkv, dqkv_t, B, T, H, D,
               in_dt);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}
