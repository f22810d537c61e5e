/* qgeglu.c: the "qgeglu" op class. QGEGLU: x = [a | b], y = qgelu(a)*b.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_qgeglu = OPF_ACT_CLASS("qgeglu", 0, false);
