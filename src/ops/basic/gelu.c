/* gelu.c: the "gelu" op class. GELU (tanh approximation): y = f(x) elementwise.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_gelu = OPF_ACT_CLASS("gelu", 0, true);
