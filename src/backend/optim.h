/* optim.h: the kernel-table entries for SGD and AdamW steps over many tensors at once.
 * Each entry takes the context (later: its stream), tensors or plain pointers
 * with sizes, and scratch from the context's workspace; none allocates, none
 * sees an op, a seq or a recipe object. */
#ifndef OPFUSE_BACKEND_OPTIM_H
#define OPFUSE_BACKEND_OPTIM_H

#include "opfuse/context.h"
#include "opfuse/tensor.h"

typedef struct opf_optim_kernels {
    int reserved_;  /* placeholder until the family's entries land */
} opf_optim_kernels;

extern const opf_optim_kernels opf_cpu_optim;

#endif
