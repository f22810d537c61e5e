/* elem.h: the kernel-table entries for bias and dbias, constant scale and add, dropout (Philox), cast and cast+transpose, gradient sum and accumulate (main_grad), fill and copy, grouped GEMM.
 * Each entry takes the context (later: its stream), tensors or plain pointers
 * with sizes, and scratch from the context's workspace; none allocates, none
 * sees an op, a seq or a recipe object. */
#ifndef OPFUSE_BACKEND_ELEM_H
#define OPFUSE_BACKEND_ELEM_H

#include "opfuse/context.h"
#include "opfuse/tensor.h"

typedef struct opf_elem_kernels {
    int reserved_;  /* placeholder until the family's entries land */
} opf_elem_kernels;

extern const opf_elem_kernels opf_cpu_elem;

#endif
