/* gpt.h: a GPT-style decoder built from opfuse ops, for `opfuse train`.
 *
 * One seq maps int32 token ids [B, T] to logits [B, T, vocab]:
 *   embedding (wte + wpe)
 *   per block:  make_extra_output -> layernorm -> linear(C, 3C) + bias -> attention
 *               -> linear(C, C) + bias -> add_extra_input        (residual 1)
 *               make_extra_output -> layernorm -> linear(C, 4C) + bias -> gelu
 *               -> linear(4C, C) + bias -> add_extra_input       (residual 2)
 *   layernorm, lm_head: linear(C, vocab) without bias, tied to wte, unquantized
 *   under every recipe unless cfg.quantize_head
 * and a "cross_entropy" op outside the seq turns logits and targets into the
 * loss. The residuals travel through named channels ("b0.res1", ...).
 *
 * Every tensor lives on the context's device (the CPU or a GPU: the
 * initial weights are drawn on the host and copied once).
 *
 * Weight tying: lm_head's weight shares wte's memory; its gradient is added
 * into wte's after each backward (opf_gpt_tie_grads), so the optimizer steps
 * the one matrix once, and its quantized copy is marked stale after each
 * step (opf_gpt_after_step). */
#ifndef OPFUSE_APPS_GPT_H
#define OPFUSE_APPS_GPT_H

#include "opfuse.h"

typedef struct opf_gpt_config {
    int64_t   vocab;    /* token ids in [0, vocab) */
    int64_t   context;  /* longest sequence */
    int64_t   layers, width, heads;
    opf_dtype dtype;    /* parameters and activations */
    uint64_t  seed;     /* initial weights */
    /* false (the default): lm_head runs in dtype under any recipe
     * (opf_op_set_recipe), as the anchor's models keep their output layer
     * outside quantized autocast; true: it takes the run's recipe too */
    bool      quantize_head;
} opf_gpt_config;

typedef struct opf_gpt {
    opf_gpt_config cfg;
    opf_ctx       *ctx;
    opf_seq       *seq;   /* tokens -> logits; owns its ops */
    opf_op        *loss;  /* "cross_entropy", owned */
    opf_op        *emb, *head;  /* inside seq */
    opf_op_ctx     loss_ctx;
    opf_tensor     one;   /* f32 [1] = 1 on the context's device: the loss's gradient */
} opf_gpt;

/* Whether the config can be built; if not, msg says why (a width the heads
 * do not divide, sizes < 1). */
bool opf_gpt_check(const opf_gpt_config *c, char *msg, size_t size);

/* Builds the seq (OPF_ERR_INVALID_ARG for a config opf_gpt_check refuses)
 * and draws the initial weights from cfg->seed. */
opf_status opf_gpt_create(opf_ctx *ctx, const opf_gpt_config *cfg, opf_gpt **out);
void opf_gpt_destroy(opf_gpt *g);  /* NULL: no-op */

/* Number of trained parameters (the tied matrix counted once). */
int64_t opf_gpt_num_params(opf_gpt *g);

/* The loss of logits [B, T, vocab] against targets [B, T] (negative:
 * ignored), both on the context's device, into *loss: an f32 [1] tensor
 * there (released by the caller; opf_gpt_read reads it). With grad, its
 * backward follows (opf_gpt_loss_backward). */
opf_status opf_gpt_loss(opf_gpt *g, const opf_tensor *logits, const opf_tensor *targets, bool grad,
                        opf_tensor *loss);
/* The value of a one-element f32 tensor: a host read, or on a device a
 * copy to the host (the one synchronization of a logged step). */
opf_status opf_gpt_read(opf_gpt *g, const opf_tensor *t, float *v);
/* dlogits (released by the caller) of the last opf_gpt_loss with grad. */
opf_status opf_gpt_loss_backward(opf_gpt *g, opf_tensor *dlogits);

/* After a backward: lm_head's gradient added into wte's (fp32 sum,
 * rounded once, on the device), then cleared. */
opf_status opf_gpt_tie_grads(opf_gpt *g);
/* After an optimizer step: lm_head's quantized weight copy is stale. */
void opf_gpt_after_step(opf_gpt *g);

#endif
