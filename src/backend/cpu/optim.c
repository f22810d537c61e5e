/* optim.c: the CPU reference kernels for SGD and AdamW steps over many tensors at once. */
#include "backend/optim.h"

const opf_optim_kernels opf_cpu_optim = {
    .reserved_ = 0,
};
