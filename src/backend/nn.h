/* nn.h: the kernel-table entries a language model needs beyond the linear
 * layers: token + position embedding, causal self-attention, softmax
 * cross-entropy over the vocabulary, and the sum of squares behind gradient
 * clipping.
 *
 * Every entry works on arrays in the device's memory, row-major, with int32
 * token ids: fp32, but for the typed ones (attention's qkv, o, do and dqkv,
 * cross-entropy's logits and dx, sumsq's and clipping's x), which are plain
 * f32, bf16 or f16 of a dtype passed beside them, read as fp32 and written
 * by rounding each fp32 result once (RNE). The caller decodes quantized
 * inputs and quantizes outputs (as for backend/act.h), so none sees a
 * quantizer or an op. Entries take validated arguments (ids in range or,
 * for targets, negative = ignored), allocate nothing but context scratch,
 * and return OPF_OK on the CPU unless that scratch runs out.
 *
 * The order of the fp32 math is fixed here, so every bit is independent of
 * the thread count and a CUDA kernel can reproduce it:
 *  - embed_bwd: dwte[v] = the sum of dy[r] over the rows r with tok[r] = v,
 *    in increasing r, from 0; dwpe[t] = the sum over b of dy[b*T + t], in
 *    increasing b, from 0.
 *  - attention, per batch b and head h (scale = 1.0f / sqrtf(D), no FMA):
 *    s_ij = fl(dot(q_i, k_j) * scale), the dot summed over d in order; for
 *    j = 0..i in order (online softmax, one key at a time) m' = max(m, s),
 *    c = expf(m - m'), p = expf(s - m'), l = fl(l c) + p,
 *    acc_d = fl(acc_d c) + fl(p v_jd); o_id = acc_d / l (then rounded to
 *    o_t), lse_i = m + logf(l).
 *    backward: D_i = dot(do_i, o_i), o as stored (widened); for i in order,
 *    j = 0..i in order:
 *    p = expf(s_ij - lse_i), dv_j += p do_i, dp = dot(do_i, v_j),
 *    ds = fl(fl(p fl(dp - D_i)) * scale), dq_i += ds k_j, dk_j += ds q_i.
 *  - cross-entropy, per row r: m = max_j x_j, e = S(expf(x_j - m)) in
 *    lanesum.h's order (lane j mod 32), lse_r = m + logf(e); loss = (the
 *    sum over rows with tgt_r >= 0, in r order, of lse_r - x_{r, tgt_r}, in
 *    double) / count,
 *    rounded to fp32. dx_j = fl(expf(x_j - lse_r) - [j == tgt_r]) * g with
 *    g = fl(dloss / count); ignored rows get 0.
 *  - sumsq: the sum of x_i^2 in double, in lanesum.h's order twice: a lane
 *    sum over each 4096-value chunk, then a lane sum of the chunk sums.
 * Cross-entropy's expf is act-math.h's opf_expf_impl (numerics.md 6.3.1:
 * fp32 operations only, 0.976 ulp), the activations' own, which every
 * device computes alike at a fraction of the cost of a libm port on a GPU
 * (no float <-> double conversions, which Hopper runs at an eighth of the
 * fp32 rate). Attention's expf and every logf are the C library's (glibc on
 * the reference machines); the CUDA kernels (cuda/nn.cu) carry ports of
 * glibc's and match every bit. NaN outputs are NaN everywhere, without the
 * CPU's NaN payload bits on the GPU.
 *
 * Usage (attention forward over a bf16 qkv [B, T, 3C]):
 *   be->nn->attn_fwd(ctx, qkv, OPF_BF16, o, OPF_BF16, lse, B, T, H, C / H, OPF_BF16);
 */
#ifndef OPFUSE_BACKEND_NN_H
#define OPFUSE_BACKEND_NN_H

#include <stdint.h>

#include "opfuse/context.h"
#include "opfuse/tensor.h"

/* One array of the clipping entries: n values of dtype dt (f32, bf16 or f16)
 * at x, in the device's memory. */
typedef struct opf_nn_span {
    void     *x;
    opf_dtype dt;
    int64_t   n;
} opf_nn_span;

typedef struct opf_nn_kernels {
    /* y [rows, C] = wte[tok[r]] + wpe[r mod T]; wte [V, C], wpe [>= T, C].
     * The one entry that checks its data: a token outside [0, V) is
     * OPF_ERR_INVALID_ARG (the message names the row and the id). */
    opf_status (*embed_fwd)(opf_ctx *ctx, const int32_t *tok, const float *wte, const float *wpe,
                            float *y, int64_t rows, int64_t T, int64_t C, int64_t V);
    /* dwte [V, C] and dwpe [P, C], P >= T (both overwritten; rows of dwpe
     * past T are 0) from dy [rows, C]. */
    opf_status (*embed_bwd)(opf_ctx *ctx, const int32_t *tok, const float *dy, float *dwte,
                            float *dwpe, int64_t rows, int64_t T, int64_t C, int64_t V, int64_t P);
    /* Causal attention over qkv [B, T, 3C] (q, k, v side by side; head h in
     * columns h*D .. h*D + D - 1 of each, C = H*D), stored as qkv_t (f32,
     * bf16 or f16): o [B, T, C], stored as o_t (f32, bf16 or f16: each value
     * computed in fp32 and rounded once, RNE), and the logsumexp of each
     * softmax row, lse [B, H, T] (fp32). No [T, T] matrix. in_dt is qkv's
     * logical dtype (its values, and do's, are exact in it): bf16/f16 let a
     * backend multiply in that precision on tensor cores; the CPU computes
     * fp32 regardless. A storage dtype other than the kernels' own costs a
     * converted copy in context scratch (OPF_ERR_NO_MEMORY without it).
     * o_t 16-bit is what the attention op passes (its output's dtype): o is
     * then that output's bits, saved for the backward at half the bytes,
     * as cuDNN and the anchor (Transformer Engine) keep O; cuDNN's path
     * writes it in place (cuda/cudnn_attn.cu), the others round their fp32
     * o once. */
    opf_status (*attn_fwd)(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, void *o,
                           opf_dtype o_t, float *lse, int64_t B, int64_t T, int64_t H, int64_t D,
                           opf_dtype in_dt);
    /* dqkv [B, T, 3C] (overwritten; stored as dqkv_t, each value computed
     * in fp32 and rounded once) from do [B, T, C] (stored as dout_t) and the
     * forward's qkv, o (stored as o_t) and lse (fp32); scores recomputed,
     * never stored. o is read as stored, widened exactly: the row term
     * D_i = dot(do_i, o_i) takes the o the forward rounded to o_t, not its
     * fp32 value (with o_t 16-bit, D_i moves by the rounding of o, as in
     * cuDNN's backward, which reads the O it wrote). in_dt: as attn_fwd's. */
    opf_status (*attn_bwd)(opf_ctx *ctx, const void *qkv, opf_dtype qkv_t, const void *o,
                           opf_dtype o_t, const float *lse, const void *dout, opf_dtype dout_t,
                           void *dqkv, opf_dtype dqkv_t, int64_t B, int64_t T, int64_t H,
                           int64_t D, opf_dtype in_dt);
    /* Mean softmax cross-entropy of logits x [rows, V] (plain f32, bf16 or
     * f16 of dtype xt, read as fp32) against tgt [rows] (negative: ignored)
     * into loss[0] (0 when no row counts); lse [rows] out (0 for ignored
     * rows). */
    opf_status (*xent_fwd)(opf_ctx *ctx, const void *x, opf_dtype xt, const int32_t *tgt,
                           float *lse, float *loss, int64_t rows, int64_t V);
    /* dx [rows, V] (dtype dxt, each value computed in fp32 and rounded once)
     * = dloss[0] * d(mean loss)/dx from x, tgt and the forward's lse. */
    opf_status (*xent_bwd)(opf_ctx *ctx, const void *x, opf_dtype xt, const int32_t *tgt,
                           const float *lse, const float *dloss, void *dx, opf_dtype dxt,
                           int64_t rows, int64_t V);
    /* *out = the sum of squares of n values of x (f32, bf16 or f16). */
    opf_status (*sumsq)(opf_ctx *ctx, const void *x, opf_dtype dt, int64_t n, double *out);
    /* Gradient clipping with no host read, over count arrays at once (all of
     * a model's gradients in a few launches): *acc, one double in the
     * device's memory, becomes (add ? *acc : 0) + S_0, then + S_1, ..., one
     * array at a time in order, S_k the sum of squares of array k as sumsq
     * computes it (count 0: *acc is left alone); clip_scale then, when
     * norm = sqrt(*sumsq) is finite and above max_norm, scales every array
     * (in place) by f = fl32(max_norm / (norm + 1e-6)): x = fl32(f * x)
     * rounded to its dtype. */
    opf_status (*sumsq_acc)(opf_ctx *ctx, const opf_nn_span *x, int count, double *acc, bool add);
    opf_status (*clip_scale)(opf_ctx *ctx, const opf_nn_span *x, int count, const double *sumsq,
                             double max_norm);
} opf_nn_kernels;

extern const opf_nn_kernels opf_cpu_nn;

#endif
