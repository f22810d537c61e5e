/* linear-impl.h: the pieces of basic_linear (basic_linear.c) that the fused
 * ops built around it reuse (src/ops/fused/forward_linear_*.c,
 * backward_linear_*.c): its argument structs and schemas, its traced half
 * (resolve, setup_context: what it saves for backward), and its math with
 * the GEMM options a fusion folds in (alpha, bias, accumulation into a
 * given tensor). A fused op resolves the linear part through
 * opf_linear_resolve_fwd / opf_linear_resolve_bwd on the basic op, so the
 * quantizers, operand modes, weight cache and saved tensors are exactly the
 * basic op's; it then adds its epilogue through the options below. */
#ifndef OPFUSE_LINEAR_IMPL_H
#define OPFUSE_LINEAR_IMPL_H

#include "ops/ops-impl.h"
#include "opfuse/gemm.h"

/* How the forward (backward) makes the x (dy) GEMM operand. */
enum {
    OPF_LIN_AS_IS    = 0,  /* the input itself */
    OPF_LIN_QUANTIZE = 1,  /* a plain input quantized with the op's quantizer */
    OPF_LIN_RECAST   = 2,  /* a quantized input of another format, decoded and requantized */
    OPF_LIN_MODE_COUNT
};

/* The aux slots the linear forward fills (a fused op may use the slots
 * after OPF_LIN_NUM_AUX for its own parts). */
enum { OPF_LIN_AUX_X = 0, OPF_LIN_AUX_W = 1, OPF_LIN_NUM_AUX = 2 };

typedef struct opf_linear_fwd {
    opf_tensor    x;        /* input [..., in], plain or quantized */
    opf_tensor    w;        /* the plain weight, or its cached quantized copy */
    opf_tensor    w_cache;  /* the parameter's cached quantized copy to write
                               (is_first_microbatch == 1); absent otherwise */
    opf_quantizer x_q;      /* QUANTIZE / RECAST: x operand into aux[0] (RECAST + none: plain) */
    opf_quantizer w_q;      /* quantize w into w_cache when present, else aux[1];
                               none: w is the operand */
    opf_quantizer out_q;    /* next op's input quantizer; none: plain y */
    int           x_mode;   /* OPF_LIN_* */
    bool          wgrad;    /* save x for the weight gradient */
    int           is_first_microbatch;
    int           bwd_override; /* the recipe's opf_backward_override: what is saved */
} opf_linear_fwd;

typedef struct opf_linear_bwd {
    opf_tensor    dy;         /* [..., out], plain or quantized */
    opf_tensor    w;          /* saved weight operand */
    opf_tensor    x;          /* saved x operand; absent without wgrad */
    opf_tensor    main_grad;  /* fp32 [out, in] accumulator, or absent */
    opf_tensor    weight;     /* the parameter (spec of dW) */
    opf_quantizer dy_q;       /* QUANTIZE / RECAST target; none: plain */
    opf_quantizer dx_q;       /* previous op's grad-output quantizer; none: plain dx */
    int           dy_mode;    /* OPF_LIN_* */
    int           act_dtype;  /* dtype of dx */
    bool          wgrad;      /* x is present: compute dW */
    bool          to_main_grad; /* dW goes into main_grad, no gradient returned */
    int           is_first_microbatch; /* runtime kwarg: 1 writes main_grad, else adds to it */
    int           bwd_override; /* opf_backward_override: a quantized w or x is decoded
                                   to act_dtype; dy_q and dx_q are none */
} opf_linear_bwd;

extern const opf_schema opf_linear_fwd_schema;
extern const opf_schema opf_linear_bwd_schema;

/* A schema field that nests the linear's args in a fused op's args. */
#define OPF_F_LINEAR_FWD(st, m) {#m, offsetof(st, m), OPF_FIELD_BUNDLE, 0, &opf_linear_fwd_schema}
#define OPF_F_LINEAR_BWD(st, m) {#m, offsetof(st, m), OPF_FIELD_BUNDLE, 0, &opf_linear_bwd_schema}

/* ---- forward ---------------------------------------------------------------
 * For fused ops: the steps of basic_linear's forward as its class runs them.
 * op is the basic_linear op; env->kwargs its own kwargs
 * (opf_basic_linear_kwargs or NULL); env->next_input_q sets out_q. The
 * fused op's resolve calls opf_linear_resolve_fwd, its fake
 * opf_linear_forward_fake (the runner runs it once per call), its after_fake
 * opf_linear_after_fake (the weight cache's buffer, once the fake accepted
 * the args). */
opf_status opf_linear_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args);
opf_status opf_linear_forward_fake(const void *args, opf_spec *outs, opf_spec *aux);
opf_status opf_linear_after_fake(opf_op *op, const opf_fwd_env *env, void *args);
/* Saves (weight operand, x operand when wgrad) and the attrs the backward
 * reads; aux is the forward's aux (slots OPF_LIN_AUX_*). Under a
 * high-precision backward override it saves the original weight and input
 * instead of the operands. */
opf_status opf_linear_setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                    const opf_tensor *outs, const opf_tensor *aux);

/* fprop: d = alpha * x W^T (+ bias) (+ c), numerics.md 5.3/5.5. The x and W
 * operands are made into aux[OPF_LIN_AUX_X / _W] as a says (W into
 * a->w_cache instead when present: the parameter's cache, written here). opts: NULL or
 * the alpha and bias to fold in (its accumulate and out_quantizer are
 * ignored). c: NULL, or a tensor of d's shape added with beta = 1 (into d
 * directly when it is plain in d's dtype, else through an fp32 copy). d is
 * plain (rounded to its dtype) or quantized with out_q: per-tensor FP8 by
 * the GEMM's FP8 output when there is no c; every other case from the fp32
 * result through opf_op_store_f32 (rounded to x's dtype first unless out_q
 * is delayed scaling). */
opf_status opf_linear_fprop(opf_ctx *ctx, const opf_linear_fwd *a, opf_tensor *aux,
                            const opf_gemm_options *opts, const opf_tensor *c,
                            const opf_quantizer *out_q, opf_tensor *d);

/* ---- backward ------------------------------------------------------------- */

/* The class entries: octx is the linear's own context, env->dy its output
 * gradient. The fake's checks run in the fake (the runner's, or the fused
 * op's, which calls opf_linear_backward_fake). */
opf_status opf_linear_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                                  void *bargs);
opf_status opf_linear_backward_fake(const void *bargs, opf_spec *grads);
/* dgrad into grads[0]: dx = alpha * dy W (+ c), plain or quantized with
 * b->dx_q (as opf_linear_fprop treats d); wgrad (when b->wgrad) with the
 * same alpha: dW = alpha * dy^T x into grads[1], or into main_grad. Under a
 * backward override, quantized w and x are first decoded (their rowwise
 * copy, the one fprop read) into scratch in act_dtype. */
opf_status opf_linear_backward(opf_ctx *ctx, const opf_linear_bwd *b, float alpha,
                               const opf_tensor *c, opf_tensor *grads);

/* ---- helpers ----------------------------------------------------------------- */

/* Kaiming-uniform initial values of a weight (basic_linear.c's file comment:
 * U(-b, b), b = 1/sqrt(fan_in), from the context's Philox stream), rounded
 * to w's dtype; the Philox offset advances by ceil(numel / 4). `who` names
 * the op in the out-of-memory message. GroupedLinear draws each group's
 * weight the same way. */
opf_status opf_linear_init_weight(opf_ctx *ctx, opf_tensor *w, int64_t fan_in, const char *who);

/* A tensor of spec s in scratch memory (opf_op_scratch), zeroed. */
opf_status opf_linear_scratch_tensor(opf_ctx *ctx, const opf_spec *s, opf_tensor *t);

/* Whether grouped_linear's forward aux slot i holds only copies of its
 * input (the packed quantized x_g, the decoded x), which a recompute may
 * drop and rebuild from the input (grouped_linear.c). */
bool opf_grouped_linear_aux_is_input(int i);

/* The env basic op k of a fused op would get for its own part: its kwargs
 * (env->kwargs of a fused op is the array of the covered ops' kwargs), no
 * extra inputs, and no next-op quantizer (the fused op quantizes its own
 * output). */
static inline opf_fwd_env opf_fused_part_env(const opf_fwd_env *env, int k)
{
    opf_fwd_env e = *env;
    e.kwargs = env->kwargs ? ((const void *const *)env->kwargs)[k] : NULL;
    e.next_input_q = NULL;
    for (int i = 0; i < OPF_OP_MAX_EXTRA; i++) e.extra_in[i] = NULL;
    return e;
}

/* For a forward-only fused op's setup_context: the runner gives octx[0] the
 * previous op's grad-output quantizer; every later covered op gets what the
 * unfused runner would have given it, its basic predecessor's (as the
 * anchor's fuser does; e.g. the Bias after a Linear keeps the Linear's, which
 * BackwardActivationBias reads). */
static inline void opf_fused_chain_grad_q(opf_op *fused, opf_op_ctx *octx)
{
    for (int k = 1; k < opf_op_num_basic(fused); k++) {
        opf_op *prev = opf_op_basic(fused, k - 1);
        const opf_op_class *c = opf_op_class_of(prev);
        const opf_quantizer *q = c->grad_output_quantizer ? c->grad_output_quantizer(prev) : NULL;
        octx[k].prev_grad_q = q ? *q : opf_quantizer_default();
    }
}

/* setup_context of a forward-only fused op whose first part is the linear
 * (args lin): the linear's own context, then the chained grad quantizers of
 * the later parts. */
static inline opf_status opf_fused_linear_setup_context(opf_op *fused, opf_op_ctx *octx,
                                                        const opf_linear_fwd *lin,
                                                        const opf_tensor *outs,
                                                        const opf_tensor *aux)
{
    opf_status st = opf_linear_setup_context(opf_op_basic(fused, 0), &octx[0], lin, outs, aux);
    if (!st) opf_fused_chain_grad_q(fused, octx);
    return st;
}

/* after_fake of a forward-only fused class whose first part is basic_linear
 * and whose args start with that part's opf_linear_fwd (each such file
 * asserts the offset): the linear's weight cache. */
static inline opf_status opf_fused_linear_after_fake(opf_op *fused, const opf_fwd_env *env,
                                                     void *args, const opf_spec *outs,
                                                     const opf_spec *aux)
{
    opf_fwd_env le = opf_fused_part_env(env, 0);
    return opf_linear_after_fake(opf_op_basic(fused, 0), &le, args);
}

/* Re-reports the thread's last error (a pure fake's) under the fused op's
 * name: "<op name>: <message>" (the op name lists its class and parts). */
static inline opf_status opf_fused_fail(opf_ctx *ctx, const opf_op *op, opf_status st)
{
    char why[400];
    snprintf(why, sizeof why, "%s", opf_last_error(NULL));
    return opf_error(ctx, st, "%s: %s", opf_op_name(op), why);
}

/* The sum of y and e, an add whose output is e's dtype: e must be of a
 * float dtype and y's exact shape. y_name and e_name say what they are. */
static inline opf_status opf_fused_check_sum(const opf_spec *y, const opf_spec *e,
                                             const char *y_name, const char *e_name)
{
    if (e->dtype != OPF_F32 && e->dtype != OPF_BF16 && e->dtype != OPF_F16)
        return opf_error(NULL, OPF_ERR_DTYPE, "%s dtype %s, expected f32/bf16/f16", e_name,
                         opf_dtype_name(e->dtype));
    bool same = y->ndim == e->ndim;
    for (int i = 0; same && i < y->ndim; i++) same = y->shape[i] == e->shape[i];
    if (same) return OPF_OK;
    char ys[160], es[160];
    opf_spec_str(y, ys, sizeof ys);
    opf_spec_str(e, es, sizeof es);
    return opf_error(NULL, OPF_ERR_SHAPE, "%s is %s, %s is %s; shapes must match", y_name, ys,
                     e_name, es);
}

/* The output spec of an in-place add_extra_input fed by y: y's shape in the
 * extra input's dtype (opf_fused_check_sum). */
static inline opf_status opf_fused_add_out_spec(const opf_spec *y, const opf_spec *e, opf_spec *out)
{
    opf_status st = opf_fused_check_sum(y, e, "the linear's output", "the extra input");
    if (st) return st;
    *out = opf_spec_make(y->ndim, y->shape, e->dtype);
    out->device = y->device;
    return OPF_OK;
}

/* For forward fusions of basic_linear (part 0) that end in an in-place
 * add_extra_input (the last part, the only one with an extra input): the
 * linear's resolve into lin and the extra input into extra. */
static inline opf_status opf_fused_linear_add_resolve(opf_op *fused, const opf_fwd_env *env,
                                                      opf_linear_fwd *lin, opf_tensor *extra)
{
    if (!env->extra_in[0])
        return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "%s: the extra input of add_extra_input "
                         "\"%s\" is missing", opf_op_name(fused),
                         opf_op_name(opf_op_basic(fused, opf_op_num_basic(fused) - 1)));
    *extra = *env->extra_in[0];
    opf_fwd_env le = opf_fused_part_env(env, 0);
    return opf_linear_resolve_fwd(opf_op_basic(fused, 0), &le, lin);
}

/* Their forward: the fprop GEMM with the epilogue o (alpha, bias) adding
 * extra, the sum plain in the extra input's dtype (out). */
static inline opf_status opf_fused_linear_add_fprop(opf_ctx *ctx, const opf_linear_fwd *lin,
                                                    opf_tensor *aux, const opf_gemm_options *o,
                                                    const opf_tensor *extra, opf_tensor *out)
{
    opf_quantizer plain = opf_quantizer_default();
    return opf_linear_fprop(ctx, lin, aux, o, extra, &plain, out);
}


#endif
