/* clamped_swiglu.c: the "clamped_swiglu" op class. x = [a | b],
 * y = a'*sigmoid(alpha*a')*b' with a' = min(a, limit) and
 * b' = clamp(b, -limit, limit) + 1; takes an opf_clamped_swiglu_config
 * (limit > 0, usually 7; alpha usually 1.702), checked in opf_act_init.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_clamped_swiglu =
    OPF_ACT_CLASS("clamped_swiglu", sizeof(opf_clamped_swiglu_config), false);
