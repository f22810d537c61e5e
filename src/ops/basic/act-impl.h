/* act-impl.h: the activation ops (GELU, QGELU, ReLU, SReLU, SiLU and the
 * gated GLU family), all generated in act.c from one table, OPF_ACT_CLASSES
 * below: a row per class gives its name, the kernel kind it runs
 * (opf_act_kind, backend/act.h) and its default parameter. Each class knows
 * its kind when it is built, so no call looks it up by name.
 *
 * Plain:  x [..., n]  -> y [..., n],  y = f(x),        dx = f'(x)·dy
 * Gated:  x [..., 2H] -> y [..., H],  y = f(a)·b with a = x[..., :H] (activated)
 *         and b = x[..., H:] (linear); dx = [f'(a)·dy·b | f(a)·dy]
 * All math in fp32 in the backend's kernels (docs/numerics.md 6.3). The
 * output is quantized with the next op's input quantizer, dx with the
 * previous op's grad-output quantizer (kept in the op context at forward
 * time, as the anchor's fuser hands it on). Backward needs the input x, which setup_context
 * retains. Plain classes may run in place (opf_op_class.inplace: forward
 * loads x whole before it stores y). */
#ifndef OPFUSE_ACT_IMPL_H
#define OPFUSE_ACT_IMPL_H

#include "backend/backend-impl.h"
#include "ops/ops-impl.h"

/* The activation classes: X(class name, kind, alpha), alpha being the
 * slope of the x·σ(αx) kinds (ClampedSwiGLU takes its own from its config,
 * an opf_clamped_swiglu_config: limit > 0, usually 7; alpha usually 1.702).
 * Whether a class is gated (halves the last dim, never runs in place)
 * follows from its kind: opf_act_is_glu. */
#define OPF_ACT_CLASSES(X)                                                                    \
    X(gelu, OPF_ACT_GELU, 0.0)                      /* GELU, tanh form */                     \
    X(qgelu, OPF_ACT_QGELU, 1.702)                  /* quick GELU: x·σ(1.702x) */             \
    X(relu, OPF_ACT_RELU, 0.0)                      /* max(x, 0) */                           \
    X(srelu, OPF_ACT_SRELU, 0.0)                    /* squared ReLU: x^2 for x > 0, else 0 */ \
    X(silu, OPF_ACT_SILU, 1.0)                      /* swish: x·σ(x) */                       \
    X(glu, OPF_ACT_GLU, 0.0)                        /* σ(a)·b: the first half is the gate */  \
    X(geglu, OPF_ACT_GEGLU, 0.0)                    /* gelu(a)·b */                           \
    X(qgeglu, OPF_ACT_QGEGLU, 1.702)                /* qgelu(a)·b */                          \
    X(reglu, OPF_ACT_REGLU, 0.0)                    /* relu(a)·b */                           \
    X(sreglu, OPF_ACT_SREGLU, 0.0)                  /* srelu(a)·b */                          \
    X(swiglu, OPF_ACT_SWIGLU, 1.0)                  /* silu(a)·b */                           \
    X(clamped_swiglu, OPF_ACT_CLAMPED_SWIGLU, 1.702) /* swish(min(a, L))·(clamp(b, ±L) + 1) */

/* Forward args of every activation. */
typedef struct opf_act_fwd {
    opf_tensor    x;        /* [..., n] ([..., 2H] gated), plain or quantized */
    opf_quantizer next_q;   /* the next op's input quantizer (none: plain output) */
    int           act;      /* opf_act_kind */
    double        alpha;    /* sigmoid slope (opf_act_params) */
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

/* The forward of every activation class: y (plain or quantized by
 * a->next_q) from a->x. Fused ops that end in an activation call it. */
opf_status opf_act_forward(opf_ctx *ctx, const opf_act_fwd *a, opf_tensor *y);

/* The kind of an op's class; -1 when it is no activation class. Compares
 * class pointers: for fusion matching, not needed by the classes' own calls. */
int opf_act_kind_of(const opf_op *op);

/* The table's alpha of kind k (in range). */
double opf_act_default_alpha(opf_act_kind k);

/* n floats of scratch (see opf_op_scratch) into *out, else OPF_ERR_NO_MEMORY
 * naming who. */
opf_status opf_act_scratch(opf_ctx *ctx, const char *who, int64_t n, float **out);

/* t's values as fp32 for a kernel, as opf_op_load_f32 gives them (t's own
 * data when plain f32, else decoded into scratch taken here). */
opf_status opf_act_load(opf_ctx *ctx, const char *who, const opf_tensor *t, const float **out);

/* The leading rows and the last dim of a spec (rows = 0 when the last dim is). */
static inline int64_t opf_act_cols(const opf_spec *s) { return s->shape[s->ndim - 1]; }
static inline int64_t opf_act_rows(const opf_spec *s)
{
    int64_t c = opf_act_cols(s);
    return c ? opf_spec_numel(s) / c : 0;
}

#endif
