/* act.h: the kernel-table entries for every activation forward and backward, GLU, scaled and clamped variants, fused dact + dbias + quantize.
 * Each entry takes the context (later: its stream), tensors or plain pointers
 * with sizes, and scratch from the context's workspace; none allocates, none
 * sees an op, a seq or a recipe object. */
#ifndef OPFUSE_BACKEND_ACT_H
#define OPFUSE_BACKEND_ACT_H

#include "opfuse/context.h"
#include "opfuse/tensor.h"

typedef struct opf_act_kernels {
    int reserved_;  /* placeholder until the family's entries land */
} opf_act_kernels;

extern const opf_act_kernels opf_cpu_act;

#endif
