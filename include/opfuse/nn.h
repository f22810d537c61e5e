/* opfuse/nn.h: the ops a language model needs beyond the linear layers, and
 * training helpers.
 *
 * Op classes (built in, created with opf_op_create):
 *   "embedding"      x: int32 token ids [B, T] -> y [B, T, width] =
 *                    wte[token] + wpe[position]; parameters "wte" [vocab,
 *                    width] and "wpe" [context, width]. Backward: the
 *                    parameter gradients (token ids get none).
 *   "attention"      x: qkv [B, T, 3 * width] (q | k | v, heads side by side)
 *                    -> y [B, T, width]: causal softmax(q k^T / sqrt(d)) v per
 *                    head, computed in fp32 one key at a time (no [T, T]
 *                    matrix), never quantized; saves the logsumexp per row.
 *   "cross_entropy"  x: logits [..., V]; extra input 0: int32 targets [...]
 *                    (negative: ignored) -> y: f32 [1], the mean loss over
 *                    the counted targets. Backward: dlogits from the saved
 *                    logsumexp (the probabilities are formed once, there).
 * The math and its order are the backend's (src/backend/nn.h).
 *
 *     opf_attention_config ac = {.heads = 4};
 *     opf_op *attn;
 *     opf_op_create(ctx, "attention", &ac, "attn0", &attn);
 */
#ifndef OPFUSE_NN_H
#define OPFUSE_NN_H

#include "opfuse/fuser.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct opf_embedding_config {  /* "embedding" */
    int64_t   vocab;    /* token ids in [0, vocab) */
    int64_t   context;  /* positions in [0, context): T <= context */
    int64_t   width;
    opf_dtype dtype;    /* parameters and output: f32, bf16 or f16 */
} opf_embedding_config;

typedef struct opf_attention_config {  /* "attention" */
    int64_t heads;      /* width / heads is the head size */
} opf_attention_config;

/* "cross_entropy" takes no config (NULL). */

/* Does nothing: the classes above are built in. Kept for callers written
 * when they were registered on demand. */
OPF_API opf_status opf_nn_register(void);

/* Global gradient-norm clipping over every parameter gradient of the seqs
 * (grad, or main_grad where used): *norm (may be NULL) receives the norm
 * sqrt(sum g^2) (the sum in double, seq by seq, parameter by parameter);
 * when it exceeds max_norm > 0 every gradient is scaled by
 * fl32(max_norm / (norm + 1e-6)). Parameters without a gradient are skipped.
 * A non-finite norm is returned and nothing is scaled. */
OPF_API opf_status opf_clip_grad_norm(opf_ctx *ctx, opf_seq *const *seqs, int n_seqs,
                                      double max_norm, double *norm);

/* Sets the learning rate of later steps (a schedule's value), > 0. */
OPF_API opf_status opf_optim_set_lr(opf_optim *opt, float lr);

#ifdef __cplusplus
}
#endif
#endif
