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

typedef struct opf_optim_kernels {
    /* Per element: d = g + weight_decay * w; with momentum (m set)
     * d = m = momentum * m + d; w -= lr * d. */
    opf_status (*sgd)(opf_ctx *ctx, const opf_optim_tensor *t, int count, float lr,
                      float momentum, float weight_decay);
    /* AdamW step number `step` (from 1), decoupled weight decay: m and v
     * move toward g and g*g, and w -= lr * (m_hat / (sqrt(v_hat) + eps) +
     * weight_decay * w) with the bias corrections 1 - beta^step. The CPU
     * kernel (src/backend/cpu/optim.c) fixes the order of the operations that
     * another device must reproduce. */
    opf_status (*adamw)(opf_ctx *ctx, const opf_optim_tensor *t, int count, float lr,
                        float beta1, float beta2, float eps, float weight_decay, int64_t step);
} opf_optim_kernels;

extern const opf_optim_kernels opf_cpu_optim;

#endif
