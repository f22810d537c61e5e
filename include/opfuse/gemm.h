/* opfuse/gemm.h: the GEMM of the quant layer, with the anchor's layout
 * convention (docs/numerics.md section 5.1) over row-major operands.
 *
 *   TN: D = B * A^T    A [N,K] rowwise copy,    B [M,K] rowwise copy
 *   NN: D = B * A      A [K,N] columnwise copy, B [M,K] rowwise copy
 *   NT: D = B^T * A    A [L,N] columnwise copy, B [L,M] columnwise copy
 *
 * D is [M, N]. Shapes above are the operands' logical 2D views. Operands are
 * plain (f32/bf16/f16) or quantized (both with the same family; FP8 block
 * 1D x 2D allowed). Computes D = alpha * acc + beta * D_old (+ bias), then
 * rounds to D's dtype, or for an FP8 D quantizes with the per-tensor out
 * quantizer. Linear: fprop gemm(W, x, TN), dgrad gemm(W, dy, NN), wgrad
 * gemm(x, dy, NT). D's bytes must not overlap any byte of A, B or the bias,
 * not even in part (OPF_ERR_INVALID_ARG naming the operand).
 *
 *     opf_gemm_options o = opf_gemm_options_default();
 *     st = opf_gemm(ctx, &w_q, &x_q, OPF_GEMM_TN, &o, &y);
 */
#ifndef OPFUSE_GEMM_H
#define OPFUSE_GEMM_H

#include "opfuse/export.h"
#include "opfuse/quant.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum opf_gemm_layout {
    OPF_GEMM_TN = 0,
    OPF_GEMM_NN = 1,
    OPF_GEMM_NT = 2,
    OPF_GEMM_LAYOUT_COUNT
} opf_gemm_layout;

typedef struct opf_gemm_options {
    float  alpha;                  /* 1 */
    float  beta;                   /* 1; used only when accumulate */
    bool   accumulate;             /* D = alpha*acc + beta*D (D's old values) */
    const opf_tensor *bias;        /* NULL or plain [N], added after alpha */
    bool   split_accumulator;      /* informational on CPU (always fp32) */
    /* FP8 output: D is a per-tensor FP8 tensor allocated with
     * opf_quantizer_spec(out_quantizer, plain D spec); no accumulate. */
    const opf_quantizer *out_quantizer;
} opf_gemm_options;

OPF_API opf_gemm_options opf_gemm_options_default(void);

/* Pure: the plain spec of D for operands a, b (dtype = dt). */
OPF_API opf_status opf_gemm_out_spec(const opf_spec *a, const opf_spec *b, opf_gemm_layout layout,
                                     opf_dtype dt, opf_spec *out);

/* Computes D. *d is allocated by the caller (plain f32/bf16/f16 of shape
 * [M,N], or FP8 as above) and must not share memory with a or b. opts NULL
 * means opf_gemm_options_default(); opts->bias, when set, is a 1D [N] tensor. Returns OPF_ERR_SHAPE naming the dims for a
 * mismatch, OPF_ERR_UNSUPPORTED for a missing operand copy or a pair of
 * formats that cannot multiply. On error *d is untouched. */
OPF_API opf_status opf_gemm(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b,
                            opf_gemm_layout layout, const opf_gemm_options *opts, opf_tensor *d);

#ifdef __cplusplus
}
#endif
#endif
