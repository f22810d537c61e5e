/* sreglu.c: the "sreglu" op class. SReGLU: x = [a | b], y = srelu(a)*b.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_sreglu = OPF_ACT_CLASS("sreglu", 0, false);
