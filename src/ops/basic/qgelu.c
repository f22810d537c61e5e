/* qgelu.c: the "qgelu" op class. QGELU (quick GELU): y = x*sigmoid(1.702x) elementwise.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_qgelu = OPF_ACT_CLASS("qgelu", 0, true);
