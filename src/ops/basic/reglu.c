/* reglu.c: the "reglu" op class. ReGLU: x = [a | b], y = relu(a)*b.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_reglu = OPF_ACT_CLASS("reglu", 0, false);
