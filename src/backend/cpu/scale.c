/* scale.c: the CPU reference kernels for amax, the delayed-scaling update (history roll, amax reduction, scale), the scale-from-amax math shared with the quant layer. */
#include "backend/scale.h"

const opf_scale_kernels opf_cpu_scale = {
    .reserved_ = 0,
};
