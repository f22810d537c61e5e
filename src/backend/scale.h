/* scale.h: the kernel-table entries for amax, the delayed-scaling update (history roll, amax reduction, scale), the scale-from-amax math shared with the quant layer.
 * Each entry takes the context (later: its stream), tensors or plain pointers
 * with sizes, and scratch from the context's workspace; none allocates, none
 * sees an op, a seq or a recipe object. */
#ifndef OPFUSE_BACKEND_SCALE_H
#define OPFUSE_BACKEND_SCALE_H

#include "opfuse/context.h"
#include "opfuse/tensor.h"

typedef struct opf_scale_kernels {
    int reserved_;  /* placeholder until the family's entries land */
} opf_scale_kernels;

extern const opf_scale_kernels opf_cpu_scale;

#endif
