/* norm.h: the kernel-table entries for LayerNorm, RMSNorm and L2
 * normalization, forward and backward, and the add + RMSNorm / LayerNorm
 * backward (nvte_layernorm_fwd, nvte_rmsnorm_bwd, nvte_rmsnorm_bwd_add in
 * TE's C API; the LayerNorm one is opfuse's).
 * Each entry takes the context (later: its stream) and plain tensors; its
 * scratch comes from the context's workspace (pushed and popped inside). None
 * allocates, none sees an op, a seq, a quantizer or a recipe object.
 *
 * Tensors. x, dz/dy and the residual gradient are plain f32/bf16/f16 [..., H],
 * row-major, rows = numel / H; H is gamma's length (LayerNorm, RMSNorm) or
 * x's last dim (L2). The caller dequantizes a quantized input first. Every
 * step is fp32; z/y, dx, dgamma and dbeta are plain f32/bf16/f16 outputs,
 * each value rounded once into its dtype. The forward's z may instead be
 * quantized (normalize + amax + cast): layernorm_fwd_q and rmsnorm_fwd_q
 * take an opf_qout (qout.h) and give z's values exactly as the plain entry
 * computes them, rounded to the qout's hp and quantized as the device's
 * quantize kernel does; a device fuses the passes, the CPU composes them
 * (the plain entry into hp scratch, then the quantize kernel). A quantized
 * dx is still the caller's: it passes an f32 dx and quantizes it.
 * mu, rsigma and rnorm are [rows] f32.
 *
 * The compute dtype. LayerNorm and RMSNorm see x and dz as the dtype of gamma
 * sees them (TE casts inputs to the module dtype): a value arriving in
 * another dtype is rounded to gamma's dtype first (unless that is f32). L2
 * normalization sees x as the dtype of its output (y forward, dx backward)
 * and reads dy unrounded. zero_centered: g_j = gamma_j + 1.0f (fp32).
 *
 * The order of the fp32 math (numerics.md 6.1, 6.2), rn = fl(1/H), no FMA,
 * each operation rounded once. Every sum S(t_0 .. t_{n-1}) is a warp's tree
 * reduction, fixed so a CUDA kernel with one warp per row reproduces it bit
 * for bit: lane l = j mod 32 adds its terms left to right, then the 32 lanes
 * fold in halves (lane i += lane i+16, then i+8, i+4, i+2, i+1); a sequential
 * fp32 sum loses too much to an offset mean. The column sums of dgamma and
 * dbeta fold over rows the same way, row r in lane r mod 32.
 *   LayerNorm   mu = S(x_j) * rn,  m2 = S(fl(d_j * d_j)), d_j = fl(x_j - mu)
 *               rs = 1.0f / sqrtf(fl(rn * m2) + eps)
 *               z_j = fl(g_j * fl(rs * d_j)) + beta_j
 *     backward  y_j = fl(rs * d_j), e_j = fl(g_j * dz_j)
 *               a = S(e_j) * rn,  c = S(fl(e_j * y_j)) * rn
 *               dx_j = rs * fl(e_j - fl(fl(c * y_j) + a))
 *               (+ dadd_j in fp32 before the rounding of dx, when given)
 *               dgamma_j = S_rows(fl(dz_j * y_j)),  dbeta_j = S_rows(dz_j)
 *   RMSNorm     mu, m2 as LayerNorm (TE's shared statistics: the mean square
 *               rebuilt from the mean and the centred sum)
 *               rs = 1.0f / sqrtf(fl(fl(rn * m2) + fl(mu * mu)) + eps)
 *               z_j = fl(g_j * fl(rs * x_j))
 *     backward  y_j = fl(rs * x_j), e_j = fl(g_j * dz_j)
 *               c = S(fl(e_j * y_j)) * rn,  dx_j = rs * fl(e_j - fl(c * y_j))
 *               (+ dadd_j in fp32 before the rounding of dx, when given)
 *               dgamma_j = S_rows(fl(dz_j * y_j))
 *   L2          s = S(fl(x_j * x_j)),  r = 1.0f / sqrtf(s + eps),  y_j = fl(x_j * r)
 *     backward  c = S(fl(dy_j * y_j)),  dx_j = r * fl(dy_j - fl(c * y_j))
 * TE's kernels use other trees, rsqrtf and FMA, so they agree with these within
 * numerics.md 8.3 tolerances, not bit for bit (numerics.md 9.6). The order is
 * fixed inside each row and column, so no bit depends on the thread count.
 *
 * Usage (a LayerNorm forward with a plain output):
 *   const opf_backend_i *be = opf_backend_get(x.spec.device);
 *   st = be->norm->layernorm_fwd(ctx, &x, &gamma, &beta, 1e-5f, false, &z, &mu, &rsigma);
 * and with z quantized with current-scaling FP8 after rounding to bf16:
 *   opf_qout o = {.out = &zq, .q = &q, .state = NULL, .hp = OPF_BF16};
 *   st = be->norm->layernorm_fwd_q(ctx, &x, &gamma, &beta, 1e-5f, false, &o, &mu, &rsigma);
 */
#ifndef OPFUSE_BACKEND_NORM_H
#define OPFUSE_BACKEND_NORM_H

#include <stdbool.h>

#include "backend/lanesum.h"
#include "backend/qout.h"
#include "opfuse/context.h"
#include "opfuse/tensor.h"

/* Lanes of a sum (a warp; lanesum.h). */
enum { OPF_NORM_LANES = OPF_SUM_LANES };

typedef struct opf_norm_kernels {
    /* z = LayerNorm(x); mu, rsigma [rows] out. gamma, beta [H] of one dtype. */
    opf_status (*layernorm_fwd)(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                const opf_tensor *beta, float eps, bool zero_centered,
                                opf_tensor *z, opf_tensor *mu, opf_tensor *rsigma);
    /* dx, dgamma, dbeta ([H], gamma's dtype) from dz and the forward's x, mu,
     * rsigma; dadd as rmsnorm_bwd's (the add + LayerNorm backward). */
    opf_status (*layernorm_bwd)(opf_ctx *ctx, const opf_tensor *dz, const opf_tensor *x,
                                const opf_tensor *mu, const opf_tensor *rsigma,
                                const opf_tensor *gamma, bool zero_centered,
                                const opf_tensor *dadd, opf_tensor *dx, opf_tensor *dgamma,
                                opf_tensor *dbeta);
    /* z = RMSNorm(x); rsigma [rows] out. */
    opf_status (*rmsnorm_fwd)(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                              float eps, bool zero_centered, opf_tensor *z, opf_tensor *rsigma);
    /* dx and dgamma; dadd (NULL: none, else plain [..., H] like dz) is added
     * to dx in fp32 before its one rounding (the add + RMSNorm backward). */
    opf_status (*rmsnorm_bwd)(opf_ctx *ctx, const opf_tensor *dz, const opf_tensor *x,
                              const opf_tensor *rsigma, const opf_tensor *gamma,
                              bool zero_centered, const opf_tensor *dadd, opf_tensor *dx,
                              opf_tensor *dgamma);
    /* y = x * rsqrt(sum(x^2) + eps) per row; rnorm [rows] out. */
    opf_status (*l2norm_fwd)(opf_ctx *ctx, const opf_tensor *x, float eps, opf_tensor *y,
                             opf_tensor *rnorm);
    /* dx from dy and the forward's x, rnorm. */
    opf_status (*l2norm_bwd)(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *x,
                             const opf_tensor *rnorm, opf_tensor *dx);
    /* layernorm_fwd with z given as an output z->out, plain or quantized
     * (qout.h); a plain z->out is layernorm_fwd's z. */
    opf_status (*layernorm_fwd_q)(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                  const opf_tensor *beta, float eps, bool zero_centered,
                                  const opf_qout *z, opf_tensor *mu, opf_tensor *rsigma);
    /* rmsnorm_fwd likewise. */
    opf_status (*rmsnorm_fwd_q)(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *gamma,
                                float eps, bool zero_centered, const opf_qout *z,
                                opf_tensor *rsigma);
} opf_norm_kernels;

extern const opf_norm_kernels opf_cpu_norm;

/* The composed LayerNorm (beta given) or RMSNorm (beta and mu NULL)
 * forward with a qout: be's plain entry into opf_qout_begin's tensor, then
 * opf_qout_end. The CPU's *_fwd_q, and another device's fallback. */
opf_status opf_norm_fwd_q_composed(opf_ctx *ctx, const struct opf_backend_i *be,
                                   const opf_tensor *x, const opf_tensor *gamma,
                                   const opf_tensor *beta, float eps, bool zero_centered,
                                   const opf_qout *z, opf_tensor *mu, opf_tensor *rsigma);

#endif
