/* fusions.c: the built-in fusion functions, in the anchor's registration
 * order (the anchor's registry order): joint first, then forward: LinearBiasAdd,
 * LinearBiasActivation, LinearScaleAdd; backward: LinearAdd, LinearScale,
 * ActivationBias, AddRMSNorm. Earlier functions win; fusions never nest. */
#include "ops/ops-impl.h"

static const opf_builtin_fusion table[] = {
#define OPF_ROW(w, n) {OPF_FUSION_##w, #n, opf_fuse_##n, NULL},
    OPF_BUILTIN_FUSION_FNS(OPF_ROW)
#undef OPF_ROW
    {0, NULL, NULL, NULL},
};

const opf_builtin_fusion *opf_builtin_fusions(void) { return table; }
