/* glu.c: the "glu" op class. GLU: x = [a | b], y = sigmoid(a)*b (the first half is the gate).
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_glu = OPF_ACT_CLASS("glu", 0, false);
