/* grouped_mlp.h: the conditions of the GroupedMLP joint fusion
 * (ops/fused/grouped_mlp.c), exposed so callers and tests can ask why a
 * sequence was not fused. */
#ifndef OPFUSE_GROUPED_MLP_H
#define OPFUSE_GROUPED_MLP_H

#include "opfuse/op.h"

/* Dimensions the fused grouped MLP takes are multiples of this (the
 * anchor's CuTe kernels want 64; the CPU reference needs only whole MXFP8
 * blocks, so 32). */
#define OPF_GROUPED_MLP_ALIGN 32

/* NULL when ops[0..3) (of n available) can become one grouped_mlp under
 * recipe r (NULL: no quantization), else a static sentence saying why not:
 * the ops must be grouped_linear (FC1) + a scaled activation (scaled_swiglu,
 * scaled_clamped_qgeglu or scaled_srelu) + grouped_linear (FC2), none
 * already fused, with equal group counts, FC1 out_features == 2 x FC2
 * in_features (== for scaled_srelu), no scale_bias on FC1, every feature
 * count a multiple of
 * OPF_GROUPED_MLP_ALIGN, and not an MXFP8 recipe whose backward format is
 * not E4M3 (HYBRID). ops may be NULL when n is 0. */
const char *opf_grouped_mlp_decline_reason(opf_op *const *ops, int n, const opf_recipe *r);

#endif
