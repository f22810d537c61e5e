/* norm-impl.h: what the norm ops (layernorm.c, rmsnorm.c, l2normalization.c)
 * share among themselves and with fused ops built on them.
 *  - The pieces of the three ops whose logic is the same (norm_common.c): the
 *    config and input checks, the saved context, the class table. They
 *    dispatch to the backend's norm kernels (backend/norm.h, where the math
 *    and its order are) through opf_backend_kernels, with the plain views of
 *    ops-impl.h.
 *  - The RMSNorm and LayerNorm backward args and their dispatch (rmsnorm.c,
 *    layernorm.c), so the add + norm backward fusions
 *    (ops/fused/backward_add_norm.c) run the same kernels and add the
 *    residual gradient before the one rounding of dx.
 * Every message names the op's class and the op: layernorm "ln": ... */
#ifndef OPFUSE_NORM_IMPL_H
#define OPFUSE_NORM_IMPL_H

#include "backend/backend-impl.h"
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

/* The RMSNorm backward (the backend's rmsnorm_bwd, numerics.md 6.2): dx into
 * dx (plain, or quantized with a->dx_q), dgamma into dgamma; dadd (NULL:
 * none; plain or quantized like dy) is added to dx in fp32 before dx is
 * rounded. */
opf_status opf_rmsnorm_backward(opf_ctx *ctx, const opf_rmsnorm_bwd *a, const opf_tensor *dadd,
                                opf_tensor *dx, opf_tensor *dgamma);

/* Backward args of "layernorm". */
typedef struct opf_layernorm_bwd {
    opf_tensor    dy;      /* [..., H] */
    opf_tensor    x;       /* the forward input */
    opf_tensor    mu;      /* [rows] fp32 */
    opf_tensor    rsigma;  /* [rows] fp32 */
    opf_tensor    weight, bias;
    opf_quantizer dx_q;    /* the previous op's grad-output quantizer, or none */
    bool          zero_centered;
} opf_layernorm_bwd;
extern const opf_schema opf_layernorm_bwd_schema;

/* The LayerNorm backward as opf_rmsnorm_backward, with dbeta. */
opf_status opf_layernorm_backward(opf_ctx *ctx, const opf_layernorm_bwd *a,
                                  const opf_tensor *dadd, opf_tensor *dx, opf_tensor *dgamma,
                                  opf_tensor *dbeta);

/* ---- the class hooks' checks ----------------------------------------------------- */

/* init of layernorm/rmsnorm: checks the opf_norm_config (hidden >= 1, eps,
 * dtype f32/bf16/f16) and adds "weight" (ones, zeros when zero-centred) and,
 * with_bias, "bias" (zeros), each [hidden] of the config's dtype. */
opf_status opf_norm_init(opf_ctx *ctx, opf_op *op, bool with_bias);

/* eps finite and >= 0, else OPF_ERR_INVALID_ARG. */
opf_status opf_norm_check_eps(opf_ctx *ctx, const opf_op *op, double eps);

/* t (`what`: "input", "gradient") has a logical dtype f32/bf16/f16, else
 * OPF_ERR_DTYPE. */
opf_status opf_norm_check_dtype(opf_ctx *ctx, const opf_op *op, const char *what,
                                const opf_tensor *t);

/* t is at least 1-D with last dim H (else OPF_ERR_SHAPE) and a float dtype. */
opf_status opf_norm_check_input(opf_ctx *ctx, const opf_op *op, const char *what,
                                const opf_tensor *t, int64_t H);

/* The context holds `want` saved tensors (x first), else OPF_ERR_STATE. */
opf_status opf_norm_check_saved(opf_ctx *ctx, const opf_op *op, const opf_op_ctx *octx, int want);

/* Backward of layernorm/rmsnorm: the context holds n_saved tensors, and dy
 * passes opf_norm_check_input and has as many elements as the saved x. */
opf_status opf_norm_check_bwd(opf_ctx *ctx, const opf_op *op, const opf_op_ctx *octx,
                              const opf_tensor *dy, int64_t H, int n_saved);

/* setup_context of the three: keeps x, then the n_aux aux tensors. */
void opf_norm_save(opf_op_ctx *octx, const opf_tensor *x, const opf_tensor *aux, int n_aux);

/* The class table of norm op `cname` (its class and module type), for a file
 * that defines the static hooks init, resolve_fwd, setup_context,
 * resolve_bwd, forward_fake, forward_impl, backward_fake, backward_impl. */
#define OPF_NORM_CLASS(cname, config_type, fwd, bwd)                                      \
    const opf_op_class opf_op_class_##cname = {                                           \
        OPF_OP_CLASS_HEAD(#cname, sizeof(config_type), (fwd), (bwd)),                     \
        OPF_OP_CLASS_STD_HOOKS(init, setup_context), .module_type = #cname}

#endif
