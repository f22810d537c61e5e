/* op-impl.h: the private layout of an op instance and helpers the op
 * implementations share. */
#ifndef OPFUSE_OP_IMPL_H
#define OPFUSE_OP_IMPL_H

#include "opfuse/op.h"

typedef struct opf_channel_bind {
    char name[32];   /* "" = unbound */
    bool to_caller;  /* extra outputs only */
} opf_channel_bind;

#define OPF_FUSED_MAX 8  /* basic ops one fused op may cover */

/* An op lives in one block from its context's allocator: the struct, then
 * its config and its forward and backward args (each sized by the class and
 * aligned to max_align_t); the parameters are a second block that
 * opf_op_add_param grows. */
struct opf_op {
    const opf_op_class *cls;
    opf_ctx            *ctx;          /* the allocator of the blocks */
    size_t              bytes;        /* of the op's block */
    int                 n_basic;      /* 0: a basic op; else the covered ops */
    opf_op             *basic[OPF_FUSED_MAX];
    int                 n_extra_in, n_extra_out;
    char                name[64];
    void               *config;       /* cls->config_size bytes, owned */
    int                 n_params, cap_params;
    opf_param          *params;       /* cap_params slots, from ctx */
    int                 n_gemms;      /* recipe-state GEMMs: cls->n_gemms unless init sets it */
    opf_recipe_state   *rs;           /* NULL without a recipe */
    opf_recipe_kind     recipe_kind;
    /* opf_op_set_recipe: own_recipe (or none when !own_quantized) replaces
     * the call's recipe when has_own_recipe */
    bool                has_own_recipe, own_quantized;
    opf_recipe          own_recipe;
    opf_channel_bind    extra_in[OPF_OP_MAX_EXTRA], extra_out[OPF_OP_MAX_EXTRA];
    bool                locked;       /* channel bindings frozen by a fuser */
    const void         *owner;        /* the seq holding the op, or NULL */
    void               *user;
    opf_quantizer       qslot[OPF_ROLE_COUNT];  /* storage behind opf_op_quantizer */
    /* quantizers of the current call, with usage narrowed by the op */
    opf_quantizer       in_q, grad_q;
    bool                has_in_q, has_grad_q;
    /* args of the current call, reused (no allocation per call): the
     * class's fwd_schema / bwd_schema size, in the op's block (NULL when the
     * class has no such schema) */
    void               *fwd_args, *bwd_args;
};

/* The recipe op runs under in a call with recipe `call` (NULL: none):
 * its override where it has one, else call. */
const opf_recipe *opf_op_recipe_for(const opf_op *op, const opf_recipe *call);

/* A float view of a tensor's values: the tensor's data when it is plain
 * f32, else a decode (dequantize or convert) into ws (n floats). */
opf_status opf_op_load_f32(opf_ctx *ctx, const opf_tensor *t, float *ws, const float **out);

/* Writes fp32 values y (logical shape of out) into out: plain outputs get a
 * rounding to their dtype; quantized outputs are produced with q (rounding
 * to `act_dtype` first unless q is delayed scaling, numerics.md 6.1/6.3). */
opf_status opf_op_store_f32(opf_ctx *ctx, const float *y, opf_dtype act_dtype,
                            const opf_quantizer *q, opf_tensor *out);

/* out as the output of a fused kernel entry (backend/qout.h), giving the
 * bits opf_op_store_f32(ctx, y, act_dtype, q, out) gives: plain, or
 * quantized with q after rounding to act_dtype (delayed scaling: the fp32
 * value); qs receives q's delayed-state pointers (o points at it and at q
 * and out). false, o untouched, when out must take opf_op_store_f32:
 * stochastic rounding (the quant layer advances the context's generator)
 * or a delayed state on another device (the quant layer's message). */
struct opf_qout;
struct opf_quantize_state;
bool opf_op_qout(const opf_quantizer *q, opf_dtype act_dtype, opf_tensor *out,
                 struct opf_quantize_state *qs, struct opf_qout *o);

/* The output spec: plain `plain` or, with q (not NONE), its quantized spec. */
opf_status opf_op_out_spec(const opf_spec *plain, const opf_quantizer *q, opf_spec *out);

/* Copies every component of src into dst, whose layout must hold the same
 * components with the same byte sizes (same spec, or a reshape that keeps
 * the 2D view). `who` names the caller in the error message. */
opf_status opf_op_copy_tensor(opf_ctx *ctx, const char *who, const opf_tensor *src,
                              opf_tensor *dst);

/* t as a plain tensor a kernel can read: t itself when plain, else its
 * values decoded (as opf_op_load_f32 does) into an fp32 tensor in scratch. */
opf_status opf_op_plain_view(opf_ctx *ctx, const opf_tensor *t, opf_tensor *out);

/* Where a kernel writes op output out: out itself when plain, else an fp32
 * tensor of its shape in scratch, for opf_op_store_f32 to quantize into out. */
opf_status opf_op_kernel_out(opf_ctx *ctx, const opf_tensor *out, opf_tensor *target);

/* out (plain f32/bf16/f16) = a + b, summed in fp32 by the device's add
 * kernel; quantized a or b are decoded first (scratch). out may be a itself
 * (accumulation). `who` names the caller in errors. */
opf_status opf_op_add(opf_ctx *ctx, const char *who, const opf_tensor *a, const opf_tensor *b,
                      opf_tensor *out);

/* Zeroes the first component of t (a parameter, a gradient, a main_grad) on
 * its device: memset on the CPU, the device's fill elsewhere. */
opf_status opf_op_zero(opf_ctx *ctx, const char *who, opf_tensor *t);

/* The element-wise kernels (backend/elem.h) of the device t lives on; NULL,
 * with an error naming `who`, when this build has no kernels there. */
struct opf_elem_kernels;
const struct opf_elem_kernels *opf_op_elem(opf_ctx *ctx, const char *who, const opf_tensor *t);

/* n floats of scratch from the context's scratch stack (see context.h) in
 * the memory of the context's device (an op on a device context runs on
 * that device's tensors), or of dev for _on; callers take a mark first and
 * pop it before returning. Host structures take opf_ctx_scratch_push. */
float *opf_op_scratch(opf_ctx *ctx, int64_t n);
float *opf_op_scratch_on(opf_ctx *ctx, opf_device dev, int64_t n);

/* ---- the steps of one op call (run.c), shared by the eager runner and the
 * compiler, which replays only the *_impl between them ---- */

/* The traced half of a forward: zeroes args, resolve_fwd, schema check, the
 * fake's specs (all "none" for a class without a fake) and after_fake. The
 * one place a forward fake runs, for eager and compiled execution alike. */
opf_status opf_op_trace_forward(opf_op *op, const opf_fwd_env *env, void *args, opf_spec *out_s,
                                opf_spec *aux_s);
/* Whether the op's class hands its input on for these specs
 * (forward_is_input or backward_is_dy, by direction): in (x or dy) is set,
 * every present one of s[0..n) is its spec exactly, none of aux (forward:
 * the OPF_OP_MAX_AUX aux specs; backward: NULL) is present, and (backward)
 * the op has no parameters. The eager runner then passes counted references to
 * the input (when its buffer is counted) and skips the impl; the compiler
 * ties the outputs to the input's value (an arena value) and drops the
 * node. */
bool opf_op_outputs_are(const opf_op *op, bool backward, const opf_tensor *in, const opf_spec *s,
                        int n, const opf_spec *aux);
/* What the forward keeps for backward in octx (one context per covered
 * basic op): the previous op's grad quantizer and setup_context (default:
 * the aux tensors); marks the contexts valid. */
opf_status opf_op_save_context(opf_op *op, const opf_fwd_env *env, opf_op_ctx *octx,
                               const void *args, const opf_tensor *outs, const opf_tensor *aux);
/* The traced half of a backward: checks the contexts, resolve_bwd and the
 * fake's gradient specs (the one place a backward fake runs);
 * *n_grads = 1 + parameters + extra inputs. */
opf_status opf_op_trace_backward(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                                 void *bargs, opf_spec *gs, int *n_grads);
/* p->grad (+)= g: the first gradient is converted in, later ones summed in
 * fp32; sets has_grad (g written into grad itself: only that). */
opf_status opf_param_accumulate(opf_ctx *ctx, opf_param *p, const opf_tensor *g);
/* Whether a backward writes p's gradient, of spec s, into p->grad itself:
 * p's first gradient after zero_grad (has_grad clear, grad zeros) where s
 * is grad's spec; the eager backward (run.c) and a compiled node (compile/
 * exec.c) both ask. unwrite: a refused backward's g, written in place,
 * back to zeros (nothing when g is not p->grad or has_grad is set). */
bool opf_param_grad_in_place(const opf_param *p, const opf_spec *s);
void opf_param_unwrite_grad(opf_ctx *ctx, opf_param *p, const opf_tensor *g);
/* opf_op_backward in two steps, for a caller that must be able to take a
 * refused backward back (the seq's, all-or-nothing): staged runs the op's
 * backward into *dx, dextra_in[n_extra_in] and pgrad[opf_op_num_params]
 * (the parameters' gradients, empty where none) without touching the
 * saved context (octx) or any gradient a parameter has: a parameter
 * without one (has_grad clear, grad zeros) may get its gradient written
 * into grad itself (pgrad[i] then is grad), has_grad still clear; nothing
 * is returned on error, and such a grad is zeros again. commit adds pgrad
 * into the parameters' gradients (sets has_grad where pgrad is grad) and
 * releases pgrad; it allocates nothing for plain gradients. unstage takes
 * staged gradients back: releases pgrad, grads written in place zeroed. */
opf_status opf_op_backward_staged(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                                  opf_tensor *dx, opf_tensor *dextra_in, opf_tensor *pgrad);
opf_status opf_op_commit_grads(opf_ctx *ctx, opf_op *op, opf_tensor *pgrad);
void opf_op_unstage_grads(opf_ctx *ctx, opf_op *op, opf_tensor *pgrad);
/* The gradient g (named `what`) a caller hands to a backward of fn: not
 * NULL, with data, f32/bf16/f16, and when want is not NULL the shape and
 * device of the output it is the gradient of. Checked before anything runs,
 * so that a refused backward changes nothing and can be retried. */
opf_status opf_grad_check(opf_ctx *ctx, const char *fn, const char *what, const opf_tensor *g,
                          const opf_spec *want);

/* ---- schemas (schema.c, value_schemas.c) ---- */

/* Folds a spec (without its leading size when skip_dim0) into hash h. */
uint64_t opf_spec_hash(uint64_t h, const opf_spec *s, bool skip_dim0);
/* Prints one field's value at p into buf (snprintf's return). */
int opf_field_print(const opf_field *f, const void *p, char *buf, size_t size);
/* The field table of opf_recipe: compare (opf_schema_equal), hash, print. */
extern const opf_schema opf_recipe_schema;

/* Registers the built-in classes (ops/ops-impl.h lists them). */
void opf_ops_register_builtins(void);

#endif
