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

/* ---- the class tables ----------------------------------------------------------
 * Each op file ends with its class: OPF_OP_CLASS_HEAD, then its hooks (the
 * file's static functions, named after the fields they fill), then what is
 * particular to the class. */

/* What every built-in class fills: ABI version, registry name, config size
 * (0: takes no config), both schemas (NULL: no such direction), fusible. */
#define OPF_OP_CLASS_HEAD(cls_name, config_bytes, fwd, bwd)                               \
    .abi_version = OPF_OP_ABI_VERSION, .name = (cls_name), .config_size = (config_bytes), \
    .fwd_schema = (fwd), .bwd_schema = (bwd), .fusible = true

/* The hooks of one direction, for a file that defines the static
 * resolve_fwd, forward_fake, forward_impl (resolve_bwd, backward_fake,
 * backward_impl). */
#define OPF_OP_CLASS_FWD_HOOKS \
    .resolve_fwd = resolve_fwd, .forward_fake = forward_fake, .forward_impl = forward_impl
#define OPF_OP_CLASS_BWD_HOOKS \
    .resolve_bwd = resolve_bwd, .backward_fake = backward_fake, .backward_impl = backward_impl

/* The hooks of a basic op: both directions', then init and setup_context
 * (NULL: the class has none). */
#define OPF_OP_CLASS_STD_HOOKS(init_fn, setup_fn) \
    OPF_OP_CLASS_FWD_HOOKS, OPF_OP_CLASS_BWD_HOOKS, .init = (init_fn), .setup_context = (setup_fn)

/* A forward-only fused class over n basic ops whose file defines the
 * static resolve_fwd, setup_context, forward_fake and forward_impl; its
 * first part is basic_linear, whose weight cache after_fake completes
 * (linear-impl.h). */
#define OPF_FORWARD_FUSED_CLASS(cls_name, n, schema)                                      \
    {OPF_OP_CLASS_HEAD(cls_name, 0, (schema), NULL), OPF_OP_CLASS_FWD_HOOKS,              \
     .setup_context = setup_context, .after_fake = opf_fused_linear_after_fake, .covers = (n)}

/* A backward-only fused class over n basic ops whose file defines the
 * static resolve_bwd, backward_fake and backward_impl. */
#define OPF_BACKWARD_FUSED_CLASS(cls_name, n, schema)                                     \
    {OPF_OP_CLASS_HEAD(cls_name, 0, NULL, (schema)), OPF_OP_CLASS_BWD_HOOKS, .covers = (n)}

/* OPF_SCHEMA for a schema that other files name (declared extern in a
 * header): the same table, not static, named after the args struct st. */
#define OPF_SHARED_SCHEMA(var, st, fields) \
    const opf_schema var = {#st, sizeof(st), (int)(sizeof(fields) / sizeof(fields[0])), fields}

/* ---- what the fusion functions ask of an op ---------------------------------- */

/* Is op of the class named `name`? (fused ops never match a basic name) */
static inline bool opf_op_is_class(const opf_op *op, const char *name)
{
    return !opf_op_is_fused(op) && !strcmp(opf_op_class_of(op)->name, name);
}

/* The in_place flag of add_extra_input / make_extra_output (their config
 * always exists: NULL at creation copies the default). */
static inline bool opf_op_in_place(const opf_op *op)
{
    return ((const opf_inplace_config *)opf_op_config_const(op))->in_place;
}

/* ---- what several basic ops share (basic_common.c) ------------------------------ */

/* The args of a direction that reads one tensor and nothing else: x forward,
 * dy backward (identity's; make_extra_output's forward, add_extra_input's
 * backward). */
typedef struct opf_x_args {
    opf_tensor x;
} opf_x_args;
typedef struct opf_dy_args {
    opf_tensor dy;
} opf_dy_args;
extern const opf_schema opf_x_args_schema, opf_dy_args_schema;

/* f32, bf16 or f16: the dtypes an activation or a gradient may have. */
static inline bool opf_is_act_dtype(opf_dtype d)
{
    return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16;
}

/* Two tensors an op adds: both of an activation dtype (else OPF_ERR_DTYPE)
 * and of one shape (else OPF_ERR_SHAPE). Messages start with the op's class
 * and name and call the tensors what_a and what_b ("input", "extra input"). */
opf_status opf_op_check_addends(opf_ctx *ctx, const opf_op *op, const char *what_a,
                                const opf_tensor *a, const char *what_b, const opf_tensor *b);

/* The last step of a kernel call that wrote `plain`, the target
 * opf_op_kernel_out gave for out: nothing when that was out itself, else the
 * fp32 values rounded to act and quantized into out with q
 * (opf_op_store_f32). */
static inline opf_status opf_op_finish_out(opf_ctx *ctx, const opf_tensor *plain, opf_dtype act,
                                           const opf_quantizer *q, opf_tensor *out)
{
    if (out->spec.scaling == OPF_SCALING_NONE) return OPF_OK;
    return opf_op_store_f32(ctx, plain->data[OPF_COMP_DATA], act, q, out);
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
    X(grouped_linear) X(embedding) X(attention) X(cross_entropy)

/* Built-in fused op classes (src/ops/fused/, one file each) and basic ops
 * that only fused paths need. */
#define OPF_BUILTIN_FUSED_OPS(X)                                               \
    X(scaled_swiglu) X(scaled_srelu) X(scaled_clamped_qgeglu)                  \
    X(forward_linear_bias_activation) X(forward_linear_bias_add)               \
    X(forward_linear_bias) X(forward_linear_add)                               \
    X(forward_linear_scale_add) X(backward_linear_add) X(backward_linear_scale) \
    X(backward_activation_bias) X(backward_add_rmsnorm) X(backward_add_layernorm) \
    X(grouped_mlp)

#define OPF_DECLARE_CLASS(n) extern const opf_op_class opf_op_class_##n;
OPF_BUILTIN_OPS(OPF_DECLARE_CLASS)
OPF_BUILTIN_FUSED_OPS(OPF_DECLARE_CLASS)
#undef OPF_DECLARE_CLASS

/* The opf_act_kind (backend/act.h) of a scaled activation op
 * (scaled_act.c), or -1 for any other op. */
int opf_scaled_act_kind_of(const opf_op *op);

/* The kwargs a fused grouped MLP hands its scaled activation: the op runs
 * inside the fused path, so its activation_recompute_in_mlp needs no
 * warning of its own (the fused op decides and warns). */
extern const int opf_scaled_act_in_mlp;

/* The fusion function of each built-in fused op, defined in its file. */
#define OPF_BUILTIN_FUSION_FNS(X)                                              \
    X(JOINT, grouped_mlp)                                                      \
    X(FORWARD, forward_linear_bias_add) X(FORWARD, forward_linear_bias_activation) \
    X(FORWARD, forward_linear_scale_add)                                       \
    X(BACKWARD, backward_linear_add) X(BACKWARD, backward_linear_scale)        \
    X(BACKWARD, backward_activation_bias) X(BACKWARD, backward_add_rmsnorm) \
    X(BACKWARD, backward_add_layernorm)
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
