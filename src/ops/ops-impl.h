/* ops-impl.h: the built-in op classes (one file each under src/ops/basic/)
 * and small helpers their implementations share. */
#ifndef OPFUSE_OPS_IMPL_H
#define OPFUSE_OPS_IMPL_H

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "core/core-impl.h"
#include "op/op-impl.h"
#include "opfuse/ops.h"

/* Registers one built-in class (used only by opf_ops_register_builtins). */
opf_status opf_op_class_register_builtin(const opf_op_class *cls);

/* A forward-only fused class over n basic ops whose file defines the
 * static resolve_fwd, setup_context, forward_fake and forward_impl; its
 * first part is basic_linear, whose weight cache after_fake completes
 * (linear-impl.h). */
#define OPF_FORWARD_FUSED_CLASS(cls_name, n, schema) \
    {                                                \
        .abi_version = OPF_OP_ABI_VERSION,           \
        .name = cls_name,                            \
        .fwd_schema = (schema),                      \
        .fusible = true,                             \
        .resolve_fwd = resolve_fwd,                  \
        .setup_context = setup_context,              \
        .forward_fake = forward_fake,                \
        .forward_impl = forward_impl,                \
        .after_fake = opf_fused_linear_after_fake,   \
        .covers = (n),                               \
    }

/* The quantizer a plan neighbour handed over, or "none". */
static inline opf_quantizer opf_q_or_none(const opf_quantizer *q)
{
    return q ? *q : opf_quantizer_default();
}

/* The list of built-in classes; each defined in its own file under src/ops/basic/
 * (shared code: norm_common.c), but the activations: act.c builds them from one table. */
#define OPF_BUILTIN_OPS(X)                                                     \
    X(identity) X(reshape) X(constant_scale) X(bias) X(basic_linear)           \
    X(layernorm) X(rmsnorm) X(l2normalization)                                 \
    X(gelu) X(qgelu) X(relu) X(srelu) X(silu)                                  \
    X(glu) X(geglu) X(qgeglu) X(reglu) X(sreglu) X(swiglu) X(clamped_swiglu)   \
    X(add_extra_input) X(make_extra_output) X(quantize) X(dropout)             \
    X(grouped_linear)

/* Built-in fused op classes (src/ops/fused/, one file each) and basic ops
 * that only fused paths need. */
#define OPF_BUILTIN_FUSED_OPS(X)                                               \
    X(scaled_swiglu)                                                           \
    X(forward_linear_bias_activation) X(forward_linear_bias_add)               \
    X(forward_linear_bias) X(forward_linear_add)                               \
    X(forward_linear_scale_add) X(backward_linear_add) X(backward_linear_scale) \
    X(backward_activation_bias) X(backward_add_rmsnorm) X(grouped_mlp)

#define OPF_DECLARE_CLASS(n) extern const opf_op_class opf_op_class_##n;
OPF_BUILTIN_OPS(OPF_DECLARE_CLASS)
OPF_BUILTIN_FUSED_OPS(OPF_DECLARE_CLASS)
#undef OPF_DECLARE_CLASS

/* The fusion function of each built-in fused op, defined in its file. */
#define OPF_BUILTIN_FUSION_FNS(X)                                              \
    X(JOINT, grouped_mlp)                                                      \
    X(FORWARD, forward_linear_bias_add) X(FORWARD, forward_linear_bias_activation) \
    X(FORWARD, forward_linear_scale_add)                                       \
    X(BACKWARD, backward_linear_add) X(BACKWARD, backward_linear_scale)        \
    X(BACKWARD, backward_activation_bias) X(BACKWARD, backward_add_rmsnorm)
#define OPF_DECLARE_FUSION(w, n)                                               \
    opf_status opf_fuse_##n(opf_ctx *ctx, opf_op *const *ops_in, int n, const opf_recipe *recipe, \
                            void *user, opf_op **ops_out, int *n_out);
OPF_BUILTIN_FUSION_FNS(OPF_DECLARE_FUSION)
#undef OPF_DECLARE_FUSION

/* The built-in fusion functions (src/ops/fused/), in registration order;
 * the fuser registers them on first use. NULL-terminated. */
enum { OPF_FUSION_JOINT = 0, OPF_FUSION_FORWARD = 1, OPF_FUSION_BACKWARD = 2 };
typedef struct opf_builtin_fusion {
    int           which;  /* OPF_FUSION_* */
    const char   *name;
    opf_fusion_fn fn;
    void         *user;
} opf_builtin_fusion;
const opf_builtin_fusion *opf_builtin_fusions(void);

#endif
