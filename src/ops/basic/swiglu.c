/* swiglu.c: the "swiglu" op class. SwiGLU: x = [a | b], y = silu(a)*b.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_swiglu = OPF_ACT_CLASS("swiglu", 0, false);
