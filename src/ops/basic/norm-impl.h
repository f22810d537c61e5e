/* norm-impl.h: what the norm ops share with fused ops built on them. The
 * RMSNorm backward args and its fp32 backward kernel (rmsnorm.c), so
 * BackwardAddRMSNorm (ops/fused/backward_add_rmsnorm.c) reuses the exact math
 * and adds the residual gradient before the one rounding of dx. */
#ifndef OPFUSE_NORM_IMPL_H
#define OPFUSE_NORM_IMPL_H

#include "ops/ops-impl.h"

/* Backward args of "rmsnorm" (what its resolve_bwd fills). */
typedef struct opf_rmsnorm_bwd {
    opf_tensor    dy;      /* [..., H] */
    opf_tensor    x;       /* the forward input */
    opf_tensor    rsigma;  /* [rows] fp32 */
    opf_tensor    weight;
    opf_quantizer dx_q;    /* the previous op's grad-output quantizer, or none */
    bool          zero_centered;
} opf_rmsnorm_bwd;
extern const opf_schema opf_rmsnorm_bwd_schema;

/* The RMSNorm backward of numerics.md 6.2 in fp32, before any rounding:
 * dx (numel(x) floats) and dgamma (H floats), caller-provided (scratch).
 * Takes scratch of its own from ctx (the caller pops it). */
opf_status opf_rmsnorm_bwd_f32(opf_ctx *ctx, const opf_rmsnorm_bwd *a, float *dx, float *dgamma);

#endif
