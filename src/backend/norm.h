/* norm.h: the kernel-table entries for LayerNorm, RMSNorm and L2 normalization, forward and backward (quantized output), add + RMSNorm backward.
 * Each entry takes the context (later: its stream), tensors or plain pointers
 * with sizes, and scratch from the context's workspace; none allocates, none
 * sees an op, a seq or a recipe object. */
#ifndef OPFUSE_BACKEND_NORM_H
#define OPFUSE_BACKEND_NORM_H

#include "opfuse/context.h"
#include "opfuse/tensor.h"

typedef struct opf_norm_kernels {
    int reserved_;  /* placeholder until the family's entries land */
} opf_norm_kernels;

extern const opf_norm_kernels opf_cpu_norm;

#endif
