/* srelu.c: the "srelu" op class. SReLU (squared ReLU): y = x^2 for x > 0, else 0.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_srelu = OPF_ACT_CLASS("srelu", 0, true);
