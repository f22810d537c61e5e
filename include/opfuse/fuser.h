/* opfuse/fuser.h: opf_seq, the sequential container, and the fuser that runs
 * it eagerly forward and backward; training steps (SGD, AdamW).
 *
 * A seq is an ordered list of ops it owns. Runs of adjacent fusible ops form
 * fuser groups; a non-fusible op (a user callback step) is a group by
 * itself. Each group has a forward plan and a backward plan: lists of ops
 * covering its basic ops (fusions, from the fusion registries, can make the
 * two plans differ). Extra inputs and outputs (residual connections) are
 * named channels inside a group; unbound ones are public and the caller
 * passes or receives them in order.
 *
 *     opf_seq *seq;
 *     opf_seq_create(ctx, &seq);
 *     opf_seq_append(seq, layernorm_op);          // the seq owns the op now
 *     opf_seq_append_linear(seq, 1024, 4096, true, OPF_BF16, "fc1");
 *     opf_seq_append(seq, gelu_op);
 *     opf_seq_call call = opf_seq_call_default();
 *     call.recipe = &recipe;                      // NULL: no quantization
 *     opf_optim *opt;                             // AdamW over the seq's parameters
 *     opf_optim_create(ctx, seq, OPF_OPTIM_ADAMW, NULL, &opt);
 *     opf_tensor y, dx;
 *     opf_seq_forward(seq, &x, &call, &y, NULL);
 *     opf_seq_backward(seq, &dy, NULL, &dx, NULL);
 *     opf_optim_step(opt);                        // then opf_seq_zero_grad(seq)
 *
 * Plans are cached per recipe and per first op needing backward (a few at
 * once), so alternating calls with and without gradients (activation
 * recompute) reuse their fused ops. A new recipe or opf_seq_set_fusions
 * makes them again; a change of the fusion registries reaches a seq's plans
 * the next time it switches plans.
 */
#ifndef OPFUSE_FUSER_H
#define OPFUSE_FUSER_H

#include "opfuse/export.h"
#include "opfuse/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct opf_seq opf_seq;

/* The most ops one fuser group may hold: a longer run of adjacent fusible
 * ops is refused when the seq builds its plans (first forward or
 * opf_seq_prepare) with OPF_ERR_UNSUPPORTED naming this limit. A callback
 * step (opf_seq_append_callback) or an activation-recompute span ends a
 * group. A GPT block of opfuse train is 16 ops, so one group holds about
 * 60 blocks (the fuser's plan arrays of this size live on the stack while
 * the plans are built). */
#define OPF_MAX_GROUP_OPS 1024

OPF_API opf_status opf_seq_create(opf_ctx *ctx, opf_seq **out);
/* Destroys the seq and every op it owns. NULL: no-op. */
OPF_API void opf_seq_destroy(opf_seq *seq);

/* Mutations take ownership of op (also on failure: the op is destroyed) and
 * invalidate the groups and plans; they fail with OPF_ERR_STATE while a
 * backward is pending, and while an optimizer created over the seq exists
 * (opf_optim_create freezes the ops: destroy the optimizer, change the seq,
 * create one anew). An op belongs to one seq: inserting one that another
 * seq holds fails with OPF_ERR_INVALID_ARG and leaves it to that seq (not
 * destroyed); opf_seq_remove with out hands it back first. */
OPF_API opf_status opf_seq_append(opf_seq *seq, opf_op *op);
OPF_API opf_status opf_seq_insert(opf_seq *seq, int index, opf_op *op);
/* Removes op `index`; *out receives it (the caller owns it then) or, when
 * out is NULL, it is destroyed. */
OPF_API opf_status opf_seq_remove(opf_seq *seq, int index, opf_op **out);
OPF_API int opf_seq_len(const opf_seq *seq);
OPF_API opf_op *opf_seq_at(const opf_seq *seq, int index);

/* Container: appends basic_linear (+ bias) as separate basic ops. */
OPF_API opf_status opf_seq_append_linear(opf_seq *seq, int64_t in_features, int64_t out_features,
                                         bool bias, opf_dtype dtype, const char *name);

/* A user step that is not fusible: it forms a group by itself. forward
 * allocates *y (opf_tensor_alloc); backward allocates *dx. backward may be
 * NULL for a step that needs none (then nothing before it gets gradients). */
typedef struct opf_callback_i {
    opf_status (*forward)(void *user, opf_ctx *ctx, const opf_tensor *x, opf_tensor *y);
    opf_status (*backward)(void *user, opf_ctx *ctx, const opf_tensor *dy, opf_tensor *dx);
    void *user;
} opf_callback_i;
OPF_API opf_status opf_seq_append_callback(opf_seq *seq, const opf_callback_i *cb,
                                           const char *name);

/* Per-call settings. */
typedef struct opf_seq_call {
    const opf_recipe  *recipe;             /* NULL: no quantization */
    bool               requires_grad;      /* a backward will follow (grad mode on) */
    bool               input_requires_grad;/* dx wanted */
    int                n_extra_in;         /* public extra inputs, in basic-op/slot order */
    const opf_tensor  *extra_in;
    const void *const *kwargs;             /* NULL or one entry per op of the seq */
} opf_seq_call;

OPF_API opf_seq_call opf_seq_call_default(void);   /* requires_grad and input_requires_grad true */

/* Runs the forward. *y receives the main output (a counted reference the
 * caller releases); extra_out, when not NULL, receives the public extra
 * outputs in order (opf_seq_num_extra_out of them). Outputs are never
 * written after they are returned, but may share memory with each other or
 * with x (a make_extra_output hands its input on by reference). A refused
 * forward (any status, out of memory included) leaves the amaxes recorded
 * since the last delayed-scaling update and the Philox offset as they were. */
OPF_API opf_status opf_seq_forward(opf_seq *seq, const opf_tensor *x, const opf_seq_call *call,
                                   opf_tensor *y, opf_tensor *extra_out);
/* Runs the backward of the last forward. dextra_out: gradients of the public
 * extra outputs (NULL or entries with no data count as zero). *dx receives the
 * input gradient (zeroed tensor when not wanted or stopped early); dextra_in
 * the gradients of the public extra inputs. Parameter gradients accumulate
 * into each parameter's grad (or main_grad).
 *
 * All or nothing: a refused backward (any status, out of memory included)
 * leaves the parameters' gradients, the forward's saved state (the backward
 * stays pending and may be retried, or dropped with opf_seq_discard), the
 * amaxes recorded since the last update and the Philox offset as they were.
 * To that end each op's parameter gradients are held until the whole walk
 * has run and then added (plain gradients: no allocation), and the saved
 * contexts are released at the end rather than op by op (a recompute
 * span's as soon as its backward ran: a retry re-runs the span). One
 * exception: a linear with accumulate_into_main_grad adds its wgrad into
 * main_grad inside its GEMM, so a backward refused after that op ran has
 * changed main_grad. */
OPF_API opf_status opf_seq_backward(opf_seq *seq, const opf_tensor *dy,
                                    const opf_tensor *dextra_out, opf_tensor *dx,
                                    opf_tensor *dextra_in);
/* Builds groups, the recipe state of every op for recipe (NULL: none) and
 * the plans, as the first forward with that recipe would, without running
 * anything: a checkpoint can then be loaded into the fresh state. A later
 * forward with an equal recipe keeps that state. */
OPF_API opf_status opf_seq_prepare(opf_seq *seq, const opf_recipe *recipe);

/* ---- activation recompute ---------------------------------------------------------
 * Marks basic ops [first, first + count) as a recompute span (the anchor's
 * activation checkpointing). The span becomes a fuser group of its own.
 * Its forward keeps only its input; the backward re-runs the span's forward
 * (the same plans, kwargs, Philox offsets and delayed-scaling scales, so the
 * same bits) and then its backward. Eager and compiled alike: a compiled
 * graph re-runs the span's nodes in its backward graph, and its memory plan
 * no longer keeps the span's saved tensors across the two.
 * The span is held by its first and last op: ops inserted between them join
 * it; removing either drops it. Spans must not overlap, hold only fusible
 * ops, and read no public extra input (OPF_ERR_INVALID_ARG at the next
 * forward); a channel must not cross a span's edge (it is a group edge).
 * Kwargs given to a span's ops must stay valid until the backward.
 * OPF_ERR_STATE while a backward is pending. */
OPF_API opf_status opf_seq_set_recompute(opf_seq *seq, int first, int count);
/* Drops every recompute span (OPF_ERR_STATE while a backward is pending). */
OPF_API opf_status opf_seq_clear_recompute(opf_seq *seq);
/* The number of recompute spans; span i's range in *first, *count. */
OPF_API int opf_seq_num_recompute(const opf_seq *seq);
OPF_API opf_status opf_seq_recompute_span(const opf_seq *seq, int i, int *first, int *count);

/* Drops the saved state of a forward whose backward will not run. */
OPF_API void opf_seq_discard(opf_seq *seq);

/* Introspection (valid after a forward): groups and plans. */
OPF_API int opf_seq_num_groups(opf_seq *seq);
OPF_API int opf_seq_num_extra_in(opf_seq *seq);
OPF_API int opf_seq_num_extra_out(opf_seq *seq);
typedef struct opf_plan_entry {
    opf_op *op;      /* the op that runs (a basic op or a fused op) */
    int     first;   /* index of the first basic op it covers in the seq */
    int     count;   /* number of basic ops it covers */
} opf_plan_entry;
/* The forward or backward plan of group g; returns the number of entries
 * (writes at most max). */
OPF_API int opf_seq_plan(opf_seq *seq, int group, bool backward, opf_plan_entry *entries, int max);
/* Index of the first basic op that needed a backward in the last forward. */
OPF_API int opf_seq_first_requiring_backward(const opf_seq *seq);

/* ---- fusions -------------------------------------------------------------------
 * Three ordered registries of fusion functions: joint (the fused op runs in
 * both plans), forward-only and backward-only. For each group the fuser runs
 * the joint functions in order on the group's basic ops, then the forward
 * functions and, independently, the backward functions on the joint result.
 * A function reads ops_in[0..n) (basic ops and fused ops from earlier
 * functions) and writes a list to ops_out (capacity n) where some contiguous
 * runs of ops_in are replaced by fused ops it created with
 * opf_fused_op_create; everything else must be copied unchanged. The fuser
 * maps the result back to the basic ops by identity and rejects a function
 * that drops, duplicates or reorders ops, naming it. Fused ops returned are
 * owned by the seq from then on. recipe is NULL without quantization. */
/* opf_fusion_fn and the scan helpers are declared in op.h. */
/* Registers fn under a unique name (thread-safe); prepend puts it first in its
 * registry. Plans built after the call use it. */
OPF_API opf_status opf_register_forward_fusion(const char *name, opf_fusion_fn fn, void *user,
                                               bool prepend);
OPF_API opf_status opf_register_backward_fusion(const char *name, opf_fusion_fn fn, void *user,
                                                bool prepend);
OPF_API opf_status opf_register_joint_fusion(const char *name, opf_fusion_fn fn, void *user,
                                             bool prepend);
/* Removes a registered function by name (OPF_ERR_INVALID_ARG if unknown). */
OPF_API opf_status opf_unregister_fusion(const char *name);
/* Turns every fusion on or off for this seq (on by default); rebuilds plans. */
OPF_API void opf_seq_set_fusions(opf_seq *seq, bool enabled);
/* Stop at the first non-finite activation (off by default; no cost when
 * off): when on, every plain (unquantized) output of each op's forward and
 * every input gradient of its backward is checked, and the first holding a
 * NaN or an infinity fails the call with OPF_ERR_STATE (all or nothing,
 * as any refusal) naming the op (index, class, name) and the tensor. On a
 * device the verdict is read back (a counted copy and host wait per
 * output: a debugging aid, not for production). */
OPF_API void opf_seq_check_finite(opf_seq *seq, bool enabled);

/* ---- training ------------------------------------------------------------- */

/* Zeroes every parameter gradient (and main_grad) of the seq. */
OPF_API void opf_seq_zero_grad(opf_seq *seq);
/* Calls fn on every parameter of the seq in order. */
OPF_API void opf_seq_for_each_param(opf_seq *seq, void (*fn)(void *user, opf_op *op, opf_param *p),
                                    void *user);

typedef struct opf_optim_options {
    float lr;            /* 1e-3 */
    float momentum;      /* SGD; 0 */
    float beta1, beta2;  /* AdamW; 0.9, 0.999 */
    float eps;           /* AdamW; 1e-8 */
    float weight_decay;  /* decoupled (AdamW) / L2 (SGD); 0 */
} opf_optim_options;
OPF_API opf_optim_options opf_optim_options_default(void);

typedef enum opf_optim_kind { OPF_OPTIM_SGD = 0, OPF_OPTIM_ADAMW = 1 } opf_optim_kind;

/* An optimizer over the parameters of a seq, with FP32 master weights: each
 * step updates the fp32 master copy, writes it back rounded to the
 * parameter's dtype and marks quantized weight copies stale (they are
 * re-quantized on the next forward).
 * The optimizer holds the parameters the seq has at creation, and the seq
 * refuses appends, inserts and removes (OPF_ERR_STATE, with a message) while
 * the optimizer exists; build the seq first. The two may be destroyed in
 * either order; once the seq is gone opf_optim_step fails with
 * OPF_ERR_STATE and the slots hold no parameter. */
typedef struct opf_optim opf_optim;
OPF_API opf_status opf_optim_create(opf_ctx *ctx, opf_seq *seq, opf_optim_kind kind,
                                    const opf_optim_options *opts, opf_optim **out);
OPF_API void opf_optim_destroy(opf_optim *opt);
/* One step. A step whose gradients hold a NaN or an infinity is skipped, as
 * PyTorch's gradient scaler does: master weights, moments, parameters and
 * the step count stay as they were, the skip is counted
 * (opf_optim_skipped_steps) and warned about once per context. The check is
 * one read-only pass over the gradients before the step (the verdict must
 * come before the first write). On the CPU the call knows and warns at
 * once; on a device the verdict, the skip and the count stay on the device
 * (no host wait) and the warning comes when the host reads the count. */
OPF_API opf_status opf_optim_step(opf_optim *opt);
/* The steps skipped for non-finite gradients so far (on a device: one
 * counted read of the device's count, opf_ctx_sync_stats; warns once when
 * nonzero). NULL: 0. Read it every few skipped steps on a device (at most
 * 16 unseen skips keep AdamW's bias corrections the CPU's bit for bit;
 * backend/optim.h). */
OPF_API int64_t opf_optim_skipped_steps(opf_optim *opt);

/* The optimizer's state, for checkpoints: one slot per parameter of the seq
 * (opf_seq_for_each_param order) with its fp32 master copy and moments (m:
 * SGD momentum or AdamW first moment, NULL when unused; v: AdamW second
 * moment or NULL), each of *n floats, readable and writable, in the memory
 * of the optimizer's context's device (device memory on a CUDA context:
 * copy through opf_tensor_copy). */
OPF_API opf_optim_kind opf_optim_kind_of(const opf_optim *opt);
OPF_API int opf_optim_num_slots(const opf_optim *opt);
OPF_API opf_status opf_optim_slot(opf_optim *opt, int i, opf_param **param, float **master,
                                  float **m, float **v, int64_t *n);
/* Steps taken, skipped ones not counted (on a device: a counted read). */
OPF_API int64_t opf_optim_step_count(const opf_optim *opt);
OPF_API void opf_optim_set_step_count(opf_optim *opt, int64_t steps);

#ifdef __cplusplus
}
#endif
#endif
