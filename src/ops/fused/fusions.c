/* fusions.c: the built-in fusion functions, in the anchor's registration
 * order (te-ops.md 3.4): joint first, then forward: LinearBiasAdd,
 * LinearBiasActivation, LinearScaleAdd; backward: LinearAdd, LinearScale,
 * ActivationBias, AddRMSNorm. Earlier functions win; fusions never nest. */
#include "ops/ops-impl.h"

/* Fused ops land one file at a time while in flight. */
#define OPF_DO_PRAGMA(x) _Pragma(#x)
#define OPF_WEAK_FN(w, n) OPF_DO_PRAGMA(weak opf_fuse_##n)
OPF_BUILTIN_FUSION_FNS(OPF_WEAK_FN)

static opf_builtin_fusion table[16];

const opf_builtin_fusion *opf_builtin_fusions(void)
{
    if (!table[0].name) {
        int i = 0;
#define OPF_ROW(w, n) \
    if (opf_fuse_##n) table[i++] = (opf_builtin_fusion){OPF_FUSION_##w, #n, opf_fuse_##n, NULL};
        OPF_BUILTIN_FUSION_FNS(OPF_ROW)
#undef OPF_ROW
    }
    return table;
}
