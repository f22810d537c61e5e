/* fusions.c: the built-in fusion functions, in the anchor's registration
 * order (te-ops.md 3.4): earlier functions win, fusions never nest. */
#include "ops/ops-impl.h"

static const opf_builtin_fusion table[] = {
    {0, NULL, NULL, NULL},
};

const opf_builtin_fusion *opf_builtin_fusions(void) { return table; }
