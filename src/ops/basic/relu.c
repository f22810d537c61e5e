/* relu.c: the "relu" op class. ReLU: y = max(x, 0) elementwise.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_relu = OPF_ACT_CLASS("relu", 0, true);
