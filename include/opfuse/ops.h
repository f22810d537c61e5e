/* opfuse/ops.h: the built-in basic ops: their class names and configs.
 *
 * Every op is created through opf_op_create with its class name and config:
 *
 *     opf_layernorm_config c = {.hidden = 1024, .eps = 1e-5, .dtype = OPF_BF16};
 *     opf_op *ln;
 *     opf_op_create(ctx, "layernorm", &c, "ln1", &ln);
 *
 * dtype is the parameters' and activations' dtype (f32, bf16, f16); ops
 * store in it and compute in fp32 (docs/numerics.md section 6). Ops that take
 * no config pass NULL.
 */
#ifndef OPFUSE_OPS_H
#define OPFUSE_OPS_H

#include "opfuse/op.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "identity", "quantize", "add_extra_input", "make_extra_output" and the
 * activations "gelu", "qgelu", "relu", "srelu", "silu", "glu", "geglu",
 * "qgeglu", "reglu", "sreglu", "swiglu" take no config (NULL).
 * The scaled activations of a mixture-of-experts MLP, "scaled_swiglu",
 * "scaled_srelu" and "scaled_clamped_qgeglu", take extra input 0: per-row
 * scales (the routing probabilities) f32/bf16/f16, one per row of x;
 * y = act(x) * scales[row]. Their config, an opf_scaled_act_config, may be
 * NULL (the defaults below). */

typedef struct opf_reshape_config {
    int     ndim;
    int64_t shape[OPF_MAX_DIMS];  /* one entry may be -1 */
} opf_reshape_config;

typedef struct opf_constant_scale_config {
    double scale;
} opf_constant_scale_config;

typedef struct opf_bias_config {
    int64_t   size;
    opf_dtype dtype;
} opf_bias_config;

typedef struct opf_basic_linear_config {
    int64_t   in_features, out_features;
    opf_dtype dtype;
    bool      accumulate_into_main_grad;  /* wgrad accumulates into the fp32 main_grad */
} opf_basic_linear_config;

/* kwargs of "basic_linear" per call */
typedef struct opf_basic_linear_kwargs {
    int is_first_microbatch;  /* -1: none (always re-quantize), 1: quantize and cache, 0: reuse */
} opf_basic_linear_kwargs;

typedef struct opf_norm_config {
    int64_t   hidden;
    double    eps;                  /* 1e-5 */
    bool      zero_centered_gamma;
    opf_dtype dtype;
} opf_norm_config;
typedef opf_norm_config opf_layernorm_config;  /* "layernorm" */
typedef opf_norm_config opf_rmsnorm_config;    /* "rmsnorm" */

typedef struct opf_l2norm_config {             /* "l2normalization" */
    double eps;                                /* 1e-6 */
} opf_l2norm_config;

typedef struct opf_clamped_swiglu_config {     /* "clamped_swiglu" */
    double limit;                              /* 7 */
    double alpha;                              /* 1.702 */
} opf_clamped_swiglu_config;

typedef struct opf_scaled_act_config {         /* "scaled_swiglu", "scaled_srelu", "scaled_clamped_qgeglu" */
    /* Asks the fused grouped MLP to keep only its inputs and recompute the
     * activation in backward (the anchor's activation_recompute_in_mlp).
     * Honoured for scaled_srelu inside a fused grouped_mlp; elsewhere the op
     * runs normally and the context warns once (docs/fusions.md). */
    bool   activation_recompute_in_mlp;   /* false */
    double limit;                          /* scaled_clamped_qgeglu: 7 (> 0) */
    double alpha;                          /* scaled_clamped_qgeglu: 1.702 */
} opf_scaled_act_config;

typedef struct opf_inplace_config {            /* "add_extra_input", "make_extra_output" */
    bool in_place;
} opf_inplace_config;

typedef struct opf_quantize_config {           /* "quantize" */
    bool forward, backward;
} opf_quantize_config;

typedef struct opf_dropout_config {            /* "dropout" */
    double p;
} opf_dropout_config;

/* kwargs of "dropout" per call */
typedef struct opf_dropout_kwargs {
    bool training;
} opf_dropout_kwargs;

/* "grouped_linear": extra input 0 = split sizes (i64 [G]); their sum may be
 * less than x's rows (a fixed-capacity token buffer): the padding rows past
 * it are never read, and y's and dx's padding rows are zero. With
 * scale_bias, extra input 1 = per-row scales (the routing probabilities,
 * f32/bf16/f16, one per row of x): row r of group g adds scales[r] * bias_g
 * instead of bias_g, and the scales get a gradient. */
typedef struct opf_grouped_linear_config {
    int       groups;
    int64_t   in_features, out_features;
    bool      bias;
    opf_dtype dtype;
    bool      scale_bias;  /* needs bias */
} opf_grouped_linear_config;

#ifdef __cplusplus
}
#endif
#endif
