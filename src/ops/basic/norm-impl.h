/* norm-impl.h: what the norm ops (layernorm.c, rmsnorm.c, l2normalization.c)
 * share among themselves and with fused ops built on them.
 *  - The pieces of the three ops whose logic is the same (norm_common.c): the
 *    warp-like sums, the loads that see values as the op's dtype does, the
 *    config and input checks, the saved context, the class table.
 *  - The RMSNorm backward args and its fp32 backward kernel (rmsnorm.c), so
 *    BackwardAddRMSNorm (ops/fused/backward_add_rmsnorm.c) reuses the exact
 *    math and adds the residual gradient before the one rounding of dx.
 * Every message names the op's class and the op: layernorm "ln": ... */
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

/* ---- the fp32 math (order as the ops' file comments specify) ---------------- */

/* Lanes of a sum; columns per block of a column sum; fewer elements than
 * OPF_NORM_PAR_MIN run on one thread. */
enum { OPF_NORM_LANES = 32, OPF_NORM_COL_BLOCK = 64, OPF_NORM_PAR_MIN = 1 << 15 };

/* Threads for `work` elements: 1 when small, else the ctx's count (0: OpenMP's). */
int opf_norm_threads(opf_ctx *ctx, int64_t work);

/* S(t_0 .. t_{n-1}), like a warp's reduction: lane l = j mod 32 adds its
 * terms left to right, then the 32 lanes fold in halves (lane i += lane
 * i+16, then i+8, i+4, i+2, i+1). */
float opf_norm_lane_sum(const float *t, int64_t n);

/* One row's statistics: *mu = S(x_j) * rn and the returned
 * m2 = S(fl(d_j * d_j)), d_j = fl(x_j - mu) (a second pass); t (n floats)
 * is overwritten with the squares. */
float opf_norm_row_m2(const float *x, int64_t n, float rn, float *t, float *mu);

/* Column sums over rows of [rows, H]: dg[j] = S over rows of
 * fl(dz[r,j] * y[r,j]) and, unless db is NULL, db[j] = S over rows of
 * dz[r,j], row r in lane r mod 32, blocks of columns on nt threads. */
void opf_norm_param_grads(const float *dz, const float *y, int64_t rows, int64_t H, float *dg,
                          float *db, int nt);

/* ---- loads --------------------------------------------------------------------- */

/* The values of t as the dtype `act` sees them (TE casts to the module
 * dtype): decoded to fp32 into ws (numel floats) or read in place, then
 * rounded to act unless t is already plain act. *out points at them. */
opf_status opf_norm_load_as(opf_ctx *ctx, const opf_tensor *t, opf_dtype act, float *ws,
                            const float **out);

/* g_j = gamma_j of the weight w ([H]), + 1 in fp32 when zero-centred
 * (numerics.md 6.1), into g (H floats). */
opf_status opf_norm_load_gamma(opf_ctx *ctx, const opf_tensor *w, bool zero_centered, float *g);

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
#define OPF_NORM_CLASS(cname, config_type, fwd, bwd)                                  \
    const opf_op_class opf_op_class_##cname = {                                       \
        .abi_version = OPF_OP_ABI_VERSION, .name = #cname, .module_type = #cname,     \
        .config_size = sizeof(config_type), .fwd_schema = (fwd), .bwd_schema = (bwd), \
        .fusible = true, .init = init, .resolve_fwd = resolve_fwd,                    \
        .setup_context = setup_context, .resolve_bwd = resolve_bwd,                   \
        .forward_fake = forward_fake, .forward_impl = forward_impl,                   \
        .backward_fake = backward_fake, .backward_impl = backward_impl}

#endif
