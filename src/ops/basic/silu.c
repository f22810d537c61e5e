/* silu.c: the "silu" op class. SiLU (swish): y = x*sigmoid(x) elementwise.
 * The math is the shared activation table (act.c, numerics.md 6.3). */
#include "ops/basic/act-impl.h"

const opf_op_class opf_op_class_silu = OPF_ACT_CLASS("silu", 0, true);
