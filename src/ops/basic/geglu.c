/* geglu.c: the "geglu" op class. GEGLU: x = [a | b], y = gelu(a)*b.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_geglu = OPF_ACT_CLASS("geglu", 0, false);
