/* forward_linear_bias_activation.c: the forward-only fusions of basic_linear
 * + bias (+ gelu | relu), the anchor's fused op (ForwardLinearBiasActivation). Two
 * classes, since a class covers a fixed number of ops:
 *
 *   forward_linear_bias_activation   basic_linear, bias, gelu | relu (3 ops)
 *   forward_linear_bias              basic_linear, bias              (2 ops)
 *
 * and one fusion function that builds the 3-op class where an activation
 * follows the bias and the 2-op class otherwise. The anchor reserves the
 * activation slot without using it; here the activation runs right after
 * the GEMM, on its output in the activation dtype.
 *
 * Conditions: the linear is not row tensor-parallel (opfuse has no tensor
 * parallelism yet, so this always holds). The anchor also needs an fp16/bf16
 * weight, a limit of cuBLAS's bias epilogue; the CPU GEMM adds any float
 * bias in fp32, so f32 weights fuse too.
 *
 * Numerics (docs/numerics.md 5.3, 5.5, 6.3): the fprop GEMM of basic_linear
 * (its own operand quantization, linear-impl.h) with the bias in its
 * epilogue, t = fl(fl(alpha' * acc) + bias) in fp32; then
 *   - no activation: t is rounded to the activation dtype, or quantized
 *     with the next op's input quantizer (per-tensor FP8 by the GEMM's FP8
 *     output, other formats through opf_op_store_f32);
 *   - an activation: t rounded to the activation dtype (the activation's
 *     saved input, written there by the GEMM), then the activation op's own
 *     forward on it, y = f(t) stored with the next op's quantizer. As the
 *     anchor (whose activation reads the GEMM's 16-bit output) and as the
 *     unfused plan's activation reads its input. An earlier version applied
 *     f to the fp32 t: on a GPU that cost an fp32 [tokens, 4 x hidden]
 *     round trip and a second rounding pass (0.44 ms a GPT-2 FC1 node on
 *     an H200 against its 0.12 ms GEMM).
 * The unfused ops round the GEMM output, and the bias output, to the
 * activation dtype; the fused op rounds once, after the bias, so it is at
 * least as precise and, for f32 activations, bitwise equal.
 *
 * Contexts, as the basic ops' own forwards leave them: the linear's by
 * basic_linear's setup_context; the bias keeps nothing but the previous-op
 * gradient quantizer the runner would give it (the linear's grad-output
 * quantizer, read by BackwardActivationBias); the activation keeps its
 * input (aux slot 2) through its own class's setup_context. */
#include "ops/basic/act-impl.h"
#include "ops/basic/linear-impl.h"

enum { AUX_ACT_IN = OPF_LIN_NUM_AUX };  /* the activation's input, kept for its backward */

typedef struct flba_fwd {
    opf_linear_fwd lin;            /* the linear part, resolved by basic_linear itself */
    opf_tensor     bias;           /* [out_features] */
    opf_quantizer  out_q;          /* the next op's input quantizer; none: plain output */
    bool           has_act;        /* the 3-op class */
    int            act;            /* opf_act_kind: OPF_ACT_GELU or OPF_ACT_RELU */
    bool           save_act_input; /* backward follows: produce the activation's input */
} flba_fwd;
static const opf_field flba_fwd_fields[] = {
    OPF_F_LINEAR_FWD(flba_fwd, lin), OPF_F_TENSOR(flba_fwd, bias), OPF_F_QUANT(flba_fwd, out_q),
    OPF_F_BOOL(flba_fwd, has_act),   OPF_F_ENUM(flba_fwd, act),
    OPF_F_BOOL(flba_fwd, save_act_input)};
OPF_SCHEMA(flba_fwd_schema, flba_fwd, flba_fwd_fields);
_Static_assert(offsetof(flba_fwd, lin) == 0, "after_fake reads the linear part first");

/* The activations the 3-op class takes (the anchor's: GELU | ReLU). */
static int act_kind(const opf_op *op)
{
    int k = opf_act_kind_of(op);
    return k == OPF_ACT_GELU || k == OPF_ACT_RELU ? k : -1;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const flba_fwd *a = args;
    opf_spec lin_out[1 + OPF_OP_MAX_EXTRA];
    opf_status st = opf_linear_forward_fake(&a->lin, lin_out, aux);
    if (st) return st;
    const opf_spec *y = &lin_out[0];
    if (a->bias.spec.ndim != 1 || a->bias.spec.shape[0] != y->shape[y->ndim - 1])
        return opf_error(NULL, OPF_ERR_SHAPE, "the linear has %lld outputs, the bias %lld values",
                         (long long)y->shape[y->ndim - 1],
                         (long long)(a->bias.spec.ndim ? a->bias.spec.shape[0] : 0));
    if (a->has_act && a->act != OPF_ACT_GELU && a->act != OPF_ACT_RELU)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "act %d is not gelu (%d) or relu (%d)", a->act,
                         OPF_ACT_GELU, OPF_ACT_RELU);
    if (a->save_act_input) aux[AUX_ACT_IN] = *y;
    return opf_op_out_spec(y, &a->out_q, &outs[0]);
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    flba_fwd *a = args;
    opf_op *lin = opf_op_basic(op, 0), *bias = opf_op_basic(op, 1);
    opf_op *act = opf_op_num_basic(op) == 3 ? opf_op_basic(op, 2) : NULL;
    opf_fwd_env le = opf_fused_part_env(env, 0);
    opf_status st = opf_linear_resolve_fwd(lin, &le, &a->lin);
    if (st) return st;
    a->bias = opf_op_param(bias, 0)->value;
    a->out_q = opf_q_or_none(env->next_input_q);
    a->has_act = act != NULL;
    a->act = act ? act_kind(act) : OPF_ACT_GELU;
    a->save_act_input = act && env->requires_grad;
    return OPF_OK;  /* the runner runs the fake, then the linear's after_fake */
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const flba_fwd *a = args;
    opf_gemm_options o = opf_gemm_options_default();
    o.bias = &a->bias;
    if (!a->has_act) return opf_linear_fprop(ctx, &a->lin, aux, &o, NULL, &a->out_q, &outs[0]);
    /* GEMM + bias rounded once to the activation dtype, straight into the
     * activation's saved input when it is kept; then the activation op's own
     * forward on it */
    opf_quantizer plain = opf_quantizer_default();
    opf_tensor t;
    opf_status st = OPF_OK;
    if (a->save_act_input) {
        t = aux[AUX_ACT_IN];
    } else {
        const opf_spec *ys = &outs[0].spec;
        opf_spec s = opf_spec_make(ys->ndim, ys->shape, a->lin.x.spec.dtype);
        s.device = ys->device;
        st = opf_linear_scratch_tensor(ctx, &s, &t);
    }
    if (!st) st = opf_linear_fprop(ctx, &a->lin, aux, &o, NULL, &plain, &t);
    opf_act_fwd af = {.x = t, .next_q = a->out_q, .act = a->act,
                      .alpha = opf_act_default_alpha((opf_act_kind)a->act), .limit = 0.0};
    return st ? st : opf_act_forward(ctx, &af, &outs[0]);
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const flba_fwd *a = args;
    opf_status st = opf_fused_linear_setup_context(op, octx, &a->lin, outs, aux);
    if (st) return st;
    if (!a->has_act) return OPF_OK;
    /* the activation's own args, as its resolve would have made them from
     * the bias output it now reads from aux */
    opf_op *act = opf_op_basic(op, 2);
    opf_act_fwd af = {.x = aux[AUX_ACT_IN], .next_q = a->out_q, .act = a->act,
                      .alpha = opf_act_default_alpha((opf_act_kind)a->act), .limit = 0.0};
    return opf_op_class_of(act)->setup_context(act, &octx[2], &af, outs, NULL);
}

const opf_op_class opf_op_class_forward_linear_bias_activation =
    OPF_FORWARD_FUSED_CLASS("forward_linear_bias_activation", 3, &flba_fwd_schema);
const opf_op_class opf_op_class_forward_linear_bias =
    OPF_FORWARD_FUSED_CLASS("forward_linear_bias", 2, &flba_fwd_schema);

/* basic_linear + bias, then gelu | relu when one follows. */
static int match(opf_op *const *ops, int n, const opf_recipe *recipe, void *user)
{
    if (n < 2 || !opf_op_is_class(ops[0], "basic_linear") || !opf_op_is_class(ops[1], "bias"))
        return 0;
    return n >= 3 && act_kind(ops[2]) >= 0 ? 3 : 2;
}

static opf_status build(opf_ctx *ctx, opf_op *const *ops, int n, const opf_recipe *recipe,
                        void *user, opf_op **fused)
{
    const char *cls = n == 3 ? "forward_linear_bias_activation" : "forward_linear_bias";
    return opf_fused_op_create(ctx, cls, ops, n, fused);
}

opf_status opf_fuse_forward_linear_bias_activation(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                                   const opf_recipe *recipe, void *user,
                                                   opf_op **ops_out, int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, build, NULL, ops_out, n_out);
}
