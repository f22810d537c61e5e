/* act-impl.h: the shared, table-driven implementation of the activation ops
 * (GELU, QGELU, ReLU, SReLU, SiLU and the gated GLU family). One table row
 * per activation in act.c; each op file (gelu.c, swiglu.c, ...) defines its
 * class with OPF_ACT_CLASS, plugging in the generic functions below.
 *
 * Plain:  x [..., n]  -> y [..., n],  y = f(x),        dx = f'(x)·dy
 * Gated:  x [..., 2H] -> y [..., H],  y = f(a)·b with a = x[..., :H] (activated)
 *         and b = x[..., H:] (linear); dx = [f'(a)·dy·b | f(a)·dy]
 * All math in fp32 (docs/numerics.md 6.3; exp and tanh from act-math.h,
 * 6.3.1, not the C library). The output is quantized with the
 * next op's input quantizer, dx with the previous op's grad-output quantizer
 * (kept in the op context at forward time, te-ops 3.9). Backward needs the
 * input x, which setup_context retains. */
#ifndef OPFUSE_ACT_IMPL_H
#define OPFUSE_ACT_IMPL_H

#include "ops/ops-impl.h"

typedef enum opf_act_kind {
    OPF_ACT_GELU           = 0,
    OPF_ACT_QGELU          = 1,
    OPF_ACT_RELU           = 2,
    OPF_ACT_SRELU          = 3,
    OPF_ACT_SILU           = 4,
    OPF_ACT_GLU            = 5,   /* sigmoid gate */
    OPF_ACT_GEGLU          = 6,
    OPF_ACT_QGEGLU         = 7,
    OPF_ACT_REGLU          = 8,
    OPF_ACT_SREGLU         = 9,
    OPF_ACT_SWIGLU         = 10,
    OPF_ACT_CLAMPED_SWIGLU = 11,  /* limit, alpha from opf_clamped_swiglu_config */
    OPF_ACT_COUNT
} opf_act_kind;

/* f or f' of one fp32 value; alpha is the sigmoid slope of the x·σ(αx)
 * family (QGELU 1.702, SiLU 1, ClampedSwiGLU from its config), unused by
 * the others. */
typedef float (*opf_act_fn)(float x, float alpha);

/* The element-function pair of a row. Rows that share a pair share its
 * loops: act.c has one vectorized loop per pair and direction, which
 * inlines f and f' (a call through opf_act_fn per element would not
 * vectorize). */
typedef enum opf_act_fn_kind {
    OPF_ACT_FN_GELU    = 0,  /* tanh-form GELU */
    OPF_ACT_FN_SWISH   = 1,  /* x·σ(αx): QGELU, SiLU and their GLUs */
    OPF_ACT_FN_RELU    = 2,
    OPF_ACT_FN_SRELU   = 3,
    OPF_ACT_FN_SIGMOID = 4,  /* GLU's gate */
    OPF_ACT_FN_COUNT
} opf_act_fn_kind;

typedef struct opf_act_row {
    const char     *name;     /* the class name */
    opf_act_fn      f, df;    /* one element, for scalar callers; the same bits as the loops */
    opf_act_fn_kind fn;       /* the pair f, df are */
    double          alpha;    /* default alpha handed to f and df */
    bool            gated;
    bool            clamped;  /* ClampedSwiGLU: a' = min(a, limit), b' = clamp(b) + 1 */
} opf_act_row;

/* Row of kind k (k in range). */
const opf_act_row *opf_act_row_at(opf_act_kind k);

/* y[i] = f(x[i]) and dx[i] = f'(x[i])·dy[i] for i < n with row k's f and
 * alpha (the plain form: the gate of a gated row is not applied), in one
 * vectorized loop, on all threads when n > 32768. fp32, host memory; y may
 * be x (in place), dx may be x or dy; no other overlap. Bit for bit the
 * values of opf_act_row_at(k)->f and ->df. Usage, a fused op's activation
 * pass: opf_act_apply_f32(OPF_ACT_GELU, 0.0f, t, t, n). */
void opf_act_apply_f32(opf_act_kind k, float alpha, const float *x, float *y, int64_t n);
void opf_act_apply_df_f32(opf_act_kind k, float alpha, const float *x, const float *dy, float *dx,
                          int64_t n);

/* Forward args of every activation. */
typedef struct opf_act_fwd {
    opf_tensor    x;        /* [..., n] ([..., 2H] gated), plain or quantized */
    opf_quantizer next_q;   /* the next op's input quantizer (none: plain output) */
    int           act;      /* opf_act_kind */
    double        alpha;    /* sigmoid slope (see opf_act_fn) */
    double        limit;    /* ClampedSwiGLU limit (0 for the others) */
} opf_act_fwd;

/* Backward args of every activation. */
typedef struct opf_act_bwd {
    opf_tensor    x;        /* the saved input */
    opf_tensor    dy;       /* gradient of the output, shape of y */
    opf_quantizer grad_q;   /* quantizer for dx (none: plain dx in x's dtype) */
    int           act;
    double        alpha;
    double        limit;
} opf_act_bwd;

extern const opf_schema opf_act_fwd_schema;
extern const opf_schema opf_act_bwd_schema;

/* The class entries shared by every activation. */
opf_status opf_act_init(opf_ctx *ctx, opf_op *op);
opf_status opf_act_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args);
opf_status opf_act_setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                 const opf_tensor *outs, const opf_tensor *aux);
opf_status opf_act_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                               void *bargs);
opf_status opf_act_forward_fake(const void *args, opf_spec *outs, opf_spec *aux);
opf_status opf_act_forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux);
opf_status opf_act_backward_fake(const void *bargs, opf_spec *grads);
opf_status opf_act_backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads);

/* The class of an activation: name (a string literal equal to the table
 * row's name), config size (0 when it takes none) and whether forward_impl
 * may write over its input (opf_op_class.inplace: true for the elementwise
 * rows; it loads x whole before it stores y). */
#define OPF_ACT_CLASS(cls_name, cfg_size, in_place) \
    {                                               \
        .abi_version   = OPF_OP_ABI_VERSION,        \
        .name          = cls_name,                  \
        .config_size   = (cfg_size),                \
        .fwd_schema    = &opf_act_fwd_schema,       \
        .bwd_schema    = &opf_act_bwd_schema,       \
        .fusible       = true,                      \
        .init          = opf_act_init,              \
        .resolve_fwd   = opf_act_resolve_fwd,       \
        .setup_context = opf_act_setup_context,     \
        .resolve_bwd   = opf_act_resolve_bwd,       \
        .forward_fake  = opf_act_forward_fake,      \
        .forward_impl  = opf_act_forward_impl,      \
        .backward_fake = opf_act_backward_fake,     \
        .backward_impl = opf_act_backward_impl,     \
        .inplace       = (in_place),                \
    }

#endif
