/* optim.h: the kernel-table entries for SGD and AdamW steps over many tensors
 * at once (as nvte_multi_tensor_adam): one call updates every parameter of a
 * step from its gradient, its fp32 master weights and moments, and writes
 * the master weights back in the parameter's dtype.
 *
 * Each entry takes the context (later: its stream) and pointers in the
 * device's memory; none allocates, none sees an op, a seq or a recipe
 * object. Arguments are validated by the caller. */
#ifndef OPFUSE_BACKEND_OPTIM_H
#define OPFUSE_BACKEND_OPTIM_H

#include <stdint.h>

#include "opfuse/context.h"
#include "opfuse/tensor.h"

/* One parameter of a multi-tensor step; every array has n elements. */
typedef struct opf_optim_tensor {
    const void *grad;          /* in: f32, bf16 or f16 (grad_dtype) */
    opf_dtype   grad_dtype;
    float      *master;        /* in/out: fp32 master weights */
    float      *m, *v;         /* in/out: fp32 moments; m NULL for SGD without momentum,
                                * v NULL for SGD */
    void       *param;         /* out: the master weights in param_dtype (f32, bf16, f16) */
    opf_dtype   param_dtype;
    int64_t     n;
} opf_optim_tensor;

/* The non-finite guard of a step on a device (issue: the verdict stays on
 * the device, no host wait). check writes the verdict into *found; the step
 * entries then do nothing when it is set and add one to *skipped (after
 * every tensor of the step), else step as usual. The step that AdamW's bias
 * corrections use is the one the host passes less the skips the host has
 * not seen yet (*skipped - known): the host computes the corrections for
 * the OPF_OPTIM_BC_WINDOW latest candidates with the CPU's powf (bit for
 * bit); a device further behind computes them itself (pow in double,
 * rounded: equal to powf but for a rare last-bit difference). On the CPU
 * the caller reads the verdict itself and passes no guard. */
enum { OPF_OPTIM_BC_WINDOW = 16 };
typedef struct opf_optim_guard {
    int32_t *found;    /* [1] in the device's memory: nonzero: a gradient is not finite */
    int64_t *skipped;  /* [1] in the device's memory: the steps skipped so far */
    int64_t  known;    /* *skipped as the host last read it */
} opf_optim_guard;

typedef struct opf_optim_kernels {
    /* *found (an int32 in the device's memory) = 1 when any gradient of t
     * holds a NaN or an infinity, else 0: one read-only pass over the
     * gradients. The step needs the verdict before its first write (a skip
     * leaves every master weight and moment as it was), and without
     * gradient clipping nothing else reads the gradients first, so it
     * cannot ride on another pass; it costs one read of the gradients
     * against the step's read of gradient, master and moments and their
     * write-back. */
    opf_status (*check)(opf_ctx *ctx, const opf_optim_tensor *t, int count, int32_t *found);
    /* Per element: d = g + weight_decay * w; with momentum (m set)
     * d = m = momentum * m + d; w -= lr * d. guard: NULL or as above. */
    opf_status (*sgd)(opf_ctx *ctx, const opf_optim_tensor *t, int count, float lr,
                      float momentum, float weight_decay, const opf_optim_guard *guard);
    /* AdamW step number `step` (from 1), decoupled weight decay: m and v
     * move toward g and g*g, and w -= lr * (m_hat / (sqrt(v_hat) + eps) +
     * weight_decay * w) with the bias corrections 1 - beta^step. The CPU
     * kernel (src/backend/cpu/optim.c) fixes the order of the operations that
     * another device must reproduce. guard: NULL or as above. */
    opf_status (*adamw)(opf_ctx *ctx, const opf_optim_tensor *t, int count, float lr,
                        float beta1, float beta2, float eps, float weight_decay, int64_t step,
                        const opf_optim_guard *guard);
} opf_optim_kernels;

extern const opf_optim_kernels opf_cpu_optim;

#endif
