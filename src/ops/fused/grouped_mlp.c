/* grouped_mlp.c: GroupedMLP (the anchor's fused op
 * GroupedMLP_CuTeGEMMGLU), a joint fused op over GroupedLinear (FC1) +
 * a scaled activation + GroupedLinear (FC2), the expert MLP of a mixture of
 * experts: ScaledSwiGLU or ScaledClampedQGeGLU (GroupedMLP_CuTeGEMMGLU) or
 * the unary ScaledSReLU (GroupedMLP_CuTeGEMMUnary). The same object runs in the forward and the backward plan.
 *
 * It runs its parts' own kernels in sequence (one implementation of the
 * math): forward FC1 -> GLU -> FC2, backward FC2 -> GLU -> FC1, through each
 * part's class on that part's argument buffer, so results equal the unfused
 * plan bit for bit. What fusing buys here is one plan entry and one buffer:
 * the intermediates (FC1's output, the GLU's output) and every part's aux
 * tensors live in one arena (aux[0]) whose layout is a pure function of the
 * parts' fakes; saved tensors are views that hold a reference to it.
 *
 * The three parts' arguments do not fit one args struct (OPF_OP_ARGS_MAX),
 * so resolve_fwd / resolve_bwd fill each part's own args buffer and the
 * fused args reference them (REF fields); the pure half copies a part's args
 * and points its "x" (forward) or "dy" (backward) at the intermediate from
 * the previous part. A compiled graph cannot see tensors behind references,
 * so the op reports an unsupported reason and runs eagerly there.
 *
 * Backward override (the recipe's backward_override, numerics.md 3.7): each
 * grouped linear reads it from the recipe in its own resolve_fwd and saves
 * and computes what its unfused backward would (plain operands, no dy
 * quantization); the GLU has no quantizer to drop. So the fused op needs
 * nothing of its own there and matches the unfused plan bit for bit under
 * every override.
 *
 * Early stop (the anchor's rule): when the seq's first op requiring backward
 * is the GLU or FC2 (env->first_requires_grad: FC1 frozen, no input
 * gradient, FC1's split sizes from a channel), the parts before it resolve
 * their forward without requires_grad, save nothing, and run no backward:
 * no dx, no gradients of theirs, no dy quantization (which would draw
 * stochastic-rounding numbers or record delayed-scaling amaxes the unfused
 * plan does not). The first part that does run computes its dx into the
 * intermediate and drops it, as the unfused plan drops it.
 *
 * Extra inputs, in order: FC1's split sizes, the activation's per-row
 * scales, FC2's split sizes (the caller passes the same split tensor
 * twice), and with FC2's scale_bias its scales (the routing probabilities
 * again). Token buffers padded past the split sizes pass through: each
 * grouped linear leaves the padding rows zero.
 * Conditions: opf_grouped_mlp_decline_reason (grouped_mlp.h). */
#include "backend/act.h"
#include "ops/basic/linear-impl.h"
#include "ops/fused/grouped_mlp.h"
#include "ops/ops-impl.h"

enum { GM_PARTS = 3 };

/* ---- conditions ---------------------------------------------------------------- */

const char *opf_grouped_mlp_decline_reason(opf_op *const *ops, int n, const opf_recipe *r)
{
    if (!ops || n < GM_PARTS)
        return "needs three ops: grouped_linear, a scaled activation, grouped_linear";
    for (int k = 0; k < GM_PARTS; k++)
        if (!ops[k] || opf_op_is_fused(ops[k])) return "an op is missing or already fused";
    int act = opf_scaled_act_kind_of(ops[1]);
    if (strcmp(opf_op_class_of(ops[0])->name, "grouped_linear") || act < 0 ||
        strcmp(opf_op_class_of(ops[2])->name, "grouped_linear"))
        return "the ops are not grouped_linear + scaled_swiglu, scaled_srelu or "
               "scaled_clamped_qgeglu + grouped_linear";
    const opf_grouped_linear_config *f1 = opf_op_config_const(ops[0]), *f2 = opf_op_config_const(ops[2]);
    if (f1->groups != f2->groups) return "FC1 and FC2 have different group counts";
    if (act != OPF_ACT_SRELU && f1->out_features != 2 * f2->in_features)
        return "FC1's out_features is not twice FC2's in_features (the GLU halves FC1's output)";
    if (act == OPF_ACT_SRELU && f1->out_features != f2->in_features)
        return "FC1's out_features is not FC2's in_features (scaled_srelu keeps the width)";
    if (f1->scale_bias) return "FC1 scales its bias by the routing probabilities (only FC2 may)";
    const int64_t dims[] = {f1->in_features, f1->out_features, f2->in_features, f2->out_features};
    for (int i = 0; i < (int)(sizeof dims / sizeof dims[0]); i++)
        if (dims[i] % OPF_GROUPED_MLP_ALIGN) return "a feature count is not a multiple of 32";
    if (r && r->kind == OPF_RECIPE_MXFP8 && r->format != OPF_FORMAT_E4M3)
        return "an MXFP8 recipe whose backward format is not E4M3: the fused grouped MLP takes "
               "E4M3 gradients only";
    return NULL;
}

/* ---- args ------------------------------------------------------------------------ */

typedef struct gm_fwd {
    opf_tensor          x;                 /* the MLP input */
    void               *part[GM_PARTS];    /* each part's resolved forward args (its op's buffer) */
    const opf_op_class *cls[GM_PARTS];
    int64_t             first_grad;        /* parts before it run no backward (GM_PARTS: none runs) */
    int64_t             recompute;         /* activation_recompute_in_mlp honoured (see below) */
} gm_fwd;
#define GM_REF(st, m) OPF_F(st, m, OPF_FIELD_REF, 0)
static const opf_field gm_fwd_fields[] = {
    OPF_F_TENSOR_Q(gm_fwd, x), GM_REF(gm_fwd, part[0]), GM_REF(gm_fwd, part[1]),
    GM_REF(gm_fwd, part[2]),   GM_REF(gm_fwd, cls[0]),  GM_REF(gm_fwd, cls[1]),
    GM_REF(gm_fwd, cls[2]),    OPF_F_INT(gm_fwd, first_grad), OPF_F_INT(gm_fwd, recompute)};
OPF_SCHEMA(gm_fwd_schema, gm_fwd, gm_fwd_fields);

typedef struct gm_bwd {
    opf_tensor          dy;                /* gradient of the MLP output */
    void               *part[GM_PARTS];    /* each part's resolved backward args (NULL: skipped) */
    const opf_op_class *cls[GM_PARTS];
    int64_t             n_params[GM_PARTS], n_extra[GM_PARTS];
    int64_t             first;             /* the first part whose backward runs */
    const gm_fwd       *fwd;               /* recompute: the forward's args (the op's buffer) */
    opf_op             *ops[GM_PARTS];     /* recompute: the parts */
} gm_bwd;
static const opf_field gm_bwd_fields[] = {
    OPF_F_TENSOR_Q(gm_bwd, dy),         GM_REF(gm_bwd, part[0]),     GM_REF(gm_bwd, part[1]),
    GM_REF(gm_bwd, part[2]),            GM_REF(gm_bwd, cls[0]),      GM_REF(gm_bwd, cls[1]),
    GM_REF(gm_bwd, cls[2]),             OPF_F_INT(gm_bwd, n_params[0]), OPF_F_INT(gm_bwd, n_params[1]),
    OPF_F_INT(gm_bwd, n_params[2]),     OPF_F_INT(gm_bwd, n_extra[0]), OPF_F_INT(gm_bwd, n_extra[1]),
    OPF_F_INT(gm_bwd, n_extra[2]),      OPF_F_INT(gm_bwd, first),    GM_REF(gm_bwd, fwd),
    GM_REF(gm_bwd, ops[0]),             GM_REF(gm_bwd, ops[1]),      GM_REF(gm_bwd, ops[2])};
OPF_SCHEMA(gm_bwd_schema, gm_bwd, gm_bwd_fields);

static void none_specs(opf_spec *s, int n)
{
    memset(s, 0, sizeof *s * (size_t)n);
    for (int i = 0; i < n; i++) s[i].ndim = OPF_SPEC_NONE_NDIM;
}

/* The tensor field `name` of a part's args, or NULL. */
static opf_tensor *field_tensor(const opf_schema *s, void *args, const char *name)
{
    const opf_field *f = opf_schema_field(s, name);
    if (!f || (f->kind != OPF_FIELD_TENSOR && f->kind != OPF_FIELD_TENSOR_Q)) return NULL;
    return (opf_tensor *)((unsigned char *)args + f->offset);
}

/* The neighbours' quantizers inside the run, as the fuser would hand them. */
static const opf_quantizer *grad_q_of(const opf_op *op)
{
    const opf_op_class *c = opf_op_class_of(op);
    return c->grad_output_quantizer ? c->grad_output_quantizer(op) : NULL;
}
static const opf_quantizer *input_q_of(const opf_op *op)
{
    const opf_op_class *c = opf_op_class_of(op);
    return c->input_quantizer ? c->input_quantizer(op) : NULL;
}

static opf_status part_fail(opf_ctx *ctx, const opf_op *op, opf_status st)
{
    char why[400];
    snprintf(why, sizeof why, "%s", opf_last_error(NULL));
    return opf_error(ctx, st, "grouped_mlp \"%s\": %s", opf_op_name(op), why);
}

/* ---- the forward arena ---------------------------------------------------------- */

/* Two arenas: aux[0] lives as long as a saved view of it, aux[1] (only
 * with recompute) holds the activation's output and FC2's copies of it,
 * which no context keeps: the backward rebuilds them. */
enum { GM_KEPT, GM_TRANSIENT, GM_ARENAS };
typedef struct gm_layout {
    opf_spec out[GM_PARTS];                   /* each part's main output */
    opf_spec aux[GM_PARTS][OPF_OP_MAX_AUX];
    size_t   out_off[GM_PARTS - 1];           /* the intermediates */
    size_t   aux_off[GM_PARTS][OPF_OP_MAX_AUX];
    int      out_at[GM_PARTS - 1], aux_at[GM_PARTS][OPF_OP_MAX_AUX];  /* GM_KEPT or GM_TRANSIENT */
    size_t   total[GM_ARENAS];
} gm_layout;

static opf_status take(const opf_spec *s, int at, int *where, size_t *off, size_t *total)
{
    opf_layout L;
    opf_status st = opf_spec_layout(s, &L);
    if (st) return st;
    *where = at;
    *off = total[at];
    total[at] += (size_t)opf_round_up((int64_t)L.total_bytes, OPF_COMPONENT_ALIGN);
    return OPF_OK;
}

/* Every part's fake, and where its intermediates and aux go in the arenas. */
static opf_status plan_fwd(const gm_fwd *a, gm_layout *L)
{
    L->total[GM_KEPT] = L->total[GM_TRANSIENT] = 0;
    for (int k = 0; k < GM_PARTS; k++) {
        opf_spec outs[1 + OPF_OP_MAX_EXTRA];
        none_specs(outs, 1 + OPF_OP_MAX_EXTRA);
        none_specs(L->aux[k], OPF_OP_MAX_AUX);
        opf_status st = a->cls[k]->forward_fake(a->part[k], outs, L->aux[k]);
        if (st) return st;
        L->out[k] = outs[0];
        int at = a->recompute && k == 1 ? GM_TRANSIENT : GM_KEPT;
        if (k < GM_PARTS - 1 && (st = take(&outs[0], at, &L->out_at[k], &L->out_off[k], L->total)))
            return st;
        for (int i = 0; i < OPF_OP_MAX_AUX; i++) {
            at = a->recompute && k == 2 && opf_grouped_linear_aux_is_input(i) ? GM_TRANSIENT : GM_KEPT;
            if (L->aux[k][i].ndim >= 0 &&
                (st = take(&L->aux[k][i], at, &L->aux_at[k][i], &L->aux_off[k][i], L->total)))
                return st;
        }
    }
    return OPF_OK;
}

static opf_tensor arena_view(const opf_tensor *arenas, int at, const opf_spec *s, size_t off)
{
    opf_tensor t;
    opf_tensor_wrap(s, (unsigned char *)arenas[at].data[OPF_COMP_DATA] + off, &t);
    t.buf = arenas[at].buf;  /* a saved view keeps its arena alive */
    return t;
}

/* Part k's call: its args with x pointed at the previous intermediate, its
 * outputs and aux in the arena (the last part writes the fused output). */
typedef struct gm_call {
    _Alignas(16) unsigned char args[OPF_OP_ARGS_MAX];
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA];
    opf_tensor aux[OPF_OP_MAX_AUX];
} gm_call;

static opf_status part_call_fwd(const gm_fwd *a, const gm_layout *L, int k, const opf_tensor *arenas,
                                const opf_tensor *y, gm_call *c)
{
    memcpy(c->args, a->part[k], a->cls[k]->fwd_schema->size);
    memset(c->outs, 0, sizeof c->outs);
    memset(c->aux, 0, sizeof c->aux);
    for (int i = 0; i < OPF_OP_MAX_AUX; i++)
        if (L->aux[k][i].ndim >= 0)
            c->aux[i] = arena_view(arenas, L->aux_at[k][i], &L->aux[k][i], L->aux_off[k][i]);
    c->outs[0] = k < GM_PARTS - 1 ? arena_view(arenas, L->out_at[k], &L->out[k], L->out_off[k]) : *y;
    if (k == 0) return OPF_OK;
    opf_tensor *x = field_tensor(a->cls[k]->fwd_schema, c->args, "x");
    if (!x) return opf_error(NULL, OPF_ERR_INVALID_ARG, "grouped_mlp: %s has no input field \"x\"",
                             a->cls[k]->name);
    *x = arena_view(arenas, L->out_at[k - 1], &L->out[k - 1], L->out_off[k - 1]);
    return OPF_OK;
}

/* ---- forward ---------------------------------------------------------------------- */

/* activation_recompute_in_mlp (the activation's config): honoured for
 * scaled_srelu (the anchor's GroupedMLP_CuTeGEMMUnary) when the activation
 * runs its backward (and so keeps its input), and not under delayed scaling, whose re-run quantization would
 * record amaxes the forward already recorded; anywhere else the context
 * warns once and the MLP runs without it. */
static bool honour_recompute(opf_op *op, const opf_fwd_env *env, int first)
{
    opf_op *act = opf_op_basic(op, 1);
    const opf_scaled_act_config *c = opf_op_config_const(act);
    if (!c->activation_recompute_in_mlp) return false;
    const char *why = opf_scaled_act_kind_of(act) != OPF_ACT_SRELU ? "it is honoured for scaled_srelu only"
                    : env->recipe && env->recipe->kind == OPF_RECIPE_DELAYED
                        ? "delayed scaling's amax history cannot see a re-run quantization" : NULL;
    if (!why) return env->requires_grad && first <= 1;  /* the activation keeps its input */
    char key[96];
    snprintf(key, sizeof key, "activation_recompute_in_mlp:%s", opf_op_name(act));
    opf_ctx_warn_once(env->ctx, key, "%s \"%s\": activation_recompute_in_mlp is set but the fused "
                      "grouped MLP does not recompute it: %s", opf_op_class_of(act)->name,
                      opf_op_name(act), why);
    return false;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    gm_fwd *a = args;
    const void *const *kw = env->kwargs;
    opf_tensor mid[GM_PARTS - 1];
    const opf_tensor *x = env->x;
    int slot = 0;
    /* each part gets the requires_grad the unfused runner would give it */
    int first = !env->requires_grad ? GM_PARTS : env->first_requires_grad;
    if (first < 0 || first > GM_PARTS)
        return opf_error(env->ctx, OPF_ERR_INVALID_ARG, "grouped_mlp \"%s\": first_requires_grad "
                         "%d outside 0..%d", opf_op_name(op), first, GM_PARTS);
    for (int k = 0; k < GM_PARTS; k++) {
        opf_op *p = opf_op_basic(op, k);
        const opf_op_class *c = opf_op_class_of(p);
        opf_fwd_env e = {.ctx = env->ctx, .x = x, .recipe = env->recipe,
                         .requires_grad = k >= first, .kwargs = kw ? kw[k] : NULL,
                         .prev_grad_q = k ? grad_q_of(opf_op_basic(op, k - 1)) : env->prev_grad_q,
                         .next_input_q = k + 1 < GM_PARTS ? input_q_of(opf_op_basic(op, k + 1))
                                                          : env->next_input_q};
        for (int j = 0; j < opf_op_num_extra_in(p); j++) e.extra_in[j] = env->extra_in[slot++];
        if (k == 1) e.kwargs = &opf_scaled_act_in_mlp;  /* no warning of its own */
        memset(p->fwd_args, 0, c->fwd_schema->size);
        opf_status st = c->resolve_fwd(p, &e, p->fwd_args);
        if (st) return st;
        opf_spec outs[1 + OPF_OP_MAX_EXTRA], aux[OPF_OP_MAX_AUX];
        none_specs(outs, 1 + OPF_OP_MAX_EXTRA);
        none_specs(aux, OPF_OP_MAX_AUX);
        if ((st = c->forward_fake(p->fwd_args, outs, aux))) return part_fail(env->ctx, p, st);
        if (k + 1 < GM_PARTS) {  /* the next part sees a description of this output */
            memset(&mid[k], 0, sizeof mid[k]);
            mid[k].spec = outs[0];
            x = &mid[k];
        }
        a->part[k] = p->fwd_args;
        a->cls[k] = c;
    }
    a->x = *env->x;
    a->first_grad = first;
    a->recompute = honour_recompute(op, env, first);
    return OPF_OK;
}

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    gm_layout L;
    opf_status st = plan_fwd(args, &L);
    if (st) return st;
    outs[0] = L.out[GM_PARTS - 1];
    for (int at = 0; at < GM_ARENAS; at++) {
        int64_t bytes = L.total[at] ? (int64_t)L.total[at] : 1;
        if (at == GM_KEPT || L.total[at]) aux[at] = opf_spec_make(1, &bytes, OPF_U8);
    }
    return OPF_OK;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const gm_fwd *a = args;
    gm_layout L;
    gm_call c;
    opf_status st = plan_fwd(a, &L);
    for (int k = 0; k < GM_PARTS && !st; k++) {
        if ((st = part_call_fwd(a, &L, k, aux, &outs[0], &c))) break;
        size_t mark = opf_ctx_scratch_mark(ctx);
        st = a->cls[k]->forward_impl(ctx, c.args, c.outs, c.aux);
        opf_ctx_scratch_pop(ctx, mark);
    }
    return st;
}

/* Recompute: what a part kept of the transient arena is dropped (the
 * backward rebuilds it), so the arena dies with the forward. */
static void drop_transient(opf_op_ctx *octx, const opf_tensor *transient)
{
    for (int i = 0; transient->buf && i < octx->n_saved; i++)
        if (octx->saved[i].buf == transient->buf) {
            opf_tensor_release(&octx->saved[i]);
            memset(&octx->saved[i], 0, sizeof octx->saved[i]);
        }
}

/* Each part that runs backward keeps in its own context what its backward
 * reads, from the same views the forward wrote; the others keep nothing
 * and say so in requires_grad (the anchor's rule), which resolve_bwd reads. */
static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const gm_fwd *a = args;
    gm_layout L;
    gm_call c;
    opf_status st = plan_fwd(a, &L);
    for (int k = 0; k < GM_PARTS && !st; k++) {
        opf_op *p = opf_op_basic(op, k);
        octx[k].requires_grad = k >= a->first_grad;
        if (!octx[k].requires_grad) continue;
        if ((st = part_call_fwd(a, &L, k, aux, &outs[0], &c))) break;
        if (k) octx[k].prev_grad_q = opf_q_or_none(grad_q_of(opf_op_basic(op, k - 1)));
        if (a->cls[k]->setup_context) {
            st = a->cls[k]->setup_context(p, &octx[k], c.args, c.outs, c.aux);
            if (!st && a->recompute) drop_transient(&octx[k], &aux[GM_TRANSIENT]);
            continue;
        }
        for (int i = 0; i < OPF_OP_MAX_AUX; i++)  /* the default: keep the aux outputs */
            if (c.aux[i].data[0] || c.aux[i].data[OPF_COMP_COL_DATA])
                opf_tensor_retain(&c.aux[i], &octx[k].saved[octx[k].n_saved++]);
    }
    return st;
}

/* ---- backward --------------------------------------------------------------------- */

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *bargs)
{
    gm_bwd *b = bargs;
    opf_tensor mid[GM_PARTS - 1];
    const opf_tensor *dy = env->dy;
    b->first = GM_PARTS;
    b->fwd = op->fwd_args;
    for (int k = 0; k < GM_PARTS; k++) {
        opf_op *p = opf_op_basic(op, k);
        b->cls[k] = opf_op_class_of(p);
        b->n_params[k] = opf_op_num_params(p);
        b->n_extra[k] = opf_op_num_extra_in(p);
        b->part[k] = NULL;
        b->ops[k] = p;
        if (b->first == GM_PARTS && octx[k].requires_grad) b->first = k;
    }
    for (int k = GM_PARTS - 1; k >= b->first; k--) {
        opf_op *p = opf_op_basic(op, k);
        const opf_op_class *c = b->cls[k];
        opf_bwd_env e = {.ctx = env->ctx, .dy = dy,
                         .prev_grad_q = k ? grad_q_of(opf_op_basic(op, k - 1)) : env->prev_grad_q};
        memset(p->bwd_args, 0, c->bwd_schema->size);
        opf_status st = c->resolve_bwd(p, &octx[k], &e, p->bwd_args);
        if (st) return st;
        opf_spec g[OPF_OP_MAX_GRADS];
        none_specs(g, OPF_OP_MAX_GRADS);
        if ((st = c->backward_fake(p->bwd_args, g))) return part_fail(env->ctx, p, st);
        if (g[0].ndim == OPF_GRAD_PASSTHROUGH)
            return opf_error(env->ctx, OPF_ERR_UNSUPPORTED, "grouped_mlp \"%s\": part \"%s\" passes "
                             "its gradient through; the fused op expects a computed dx",
                             opf_op_name(op), opf_op_name(p));
        if (k) {
            memset(&mid[k - 1], 0, sizeof mid[k - 1]);
            mid[k - 1].spec = g[0];
            dy = &mid[k - 1];
        }
        b->part[k] = p->bwd_args;
    }
    b->dy = *env->dy;
    return OPF_OK;
}

/* Where part k's gradient i lands in the fused op's list (-1: an
 * intermediate dx): dx of part 0, then every part's parameters, then every
 * part's extra inputs. */
static int fused_slot(const gm_bwd *b, int k, int i)
{
    int64_t P = 0, before_p = 0, before_e = 0;
    for (int j = 0; j < GM_PARTS; j++) {
        P += b->n_params[j];
        if (j < k) before_p += b->n_params[j], before_e += b->n_extra[j];
    }
    if (i == 0) return k == 0 ? 0 : -1;
    if (i <= b->n_params[k]) return (int)(before_p + i);
    return (int)(1 + P + before_e + (i - 1 - b->n_params[k]));
}

static int part_grads(const gm_bwd *b, int k) { return (int)(1 + b->n_params[k] + b->n_extra[k]); }

static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    const gm_bwd *b = bargs;
    for (int k = (int)b->first; k < GM_PARTS; k++) {  /* skipped parts: no gradients */
        opf_spec g[OPF_OP_MAX_GRADS];
        none_specs(g, OPF_OP_MAX_GRADS);
        opf_status st = b->cls[k]->backward_fake(b->part[k], g);
        if (st) return st;
        for (int i = 0; i < part_grads(b, k); i++)
            if (fused_slot(b, k, i) >= 0) grads[fused_slot(b, k, i)] = g[i];
    }
    return OPF_OK;
}

/* A plain intermediate gradient in scratch, aligned like a buffer. */
static opf_status scratch_tensor(opf_ctx *ctx, const opf_spec *s, opf_tensor *t)
{
    opf_layout L;
    opf_status st = opf_spec_layout(s, &L);
    if (st) return st;
    size_t bytes = L.total_bytes + OPF_COMPONENT_ALIGN;
    unsigned char *p = (unsigned char *)opf_op_scratch_on(ctx, s->device, (int64_t)((bytes + 3) / 4));
    if (!p) return opf_error(ctx, OPF_ERR_NO_MEMORY, "grouped_mlp: no scratch for %zu bytes", bytes);
    uintptr_t at = ((uintptr_t)p + OPF_COMPONENT_ALIGN - 1) & ~(uintptr_t)(OPF_COMPONENT_ALIGN - 1);
    return opf_tensor_wrap(s, (void *)at, t);
}

/* Part k's backward: dy from the part after it, dx into the intermediate
 * (or the fused dx), parameter and extra-input gradients into the fused list. */
static opf_status part_bwd(opf_ctx *ctx, const gm_bwd *b, int k, const void *pargs, opf_tensor *mid,
                           opf_tensor *grads)
{
    _Alignas(16) unsigned char args[OPF_OP_ARGS_MAX];
    memcpy(args, pargs, b->cls[k]->bwd_schema->size);
    if (k < GM_PARTS - 1) {
        opf_tensor *dy = field_tensor(b->cls[k]->bwd_schema, args, "dy");
        if (!dy) return opf_error(ctx, OPF_ERR_INVALID_ARG, "grouped_mlp: %s has no gradient "
                                  "field \"dy\"", b->cls[k]->name);
        *dy = mid[k];
    }
    opf_tensor g[OPF_OP_MAX_GRADS];
    memset(g, 0, sizeof g);
    for (int i = 0; i < part_grads(b, k); i++) {
        int s = fused_slot(b, k, i);
        g[i] = s >= 0 ? grads[s] : mid[k - 1];
    }
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_status st = b->cls[k]->backward_impl(ctx, args, g);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

/* Recompute: the activation's output and FC2's forward again, in scratch,
 * from what the forward kept (the activation's input and scales, FC2's
 * parameters and scales), then FC2's context and backward args as its
 * forward made them: the same bits as the dropped ones. */
static opf_status recompute_fc2(opf_ctx *ctx, const gm_bwd *b, void *fc2_bargs)
{
    const gm_fwd *a = b->fwd;
    gm_layout L;
    opf_tensor arenas[GM_ARENAS], y;
    gm_call c;
    opf_status st = plan_fwd(a, &L);
    for (int at = 0; at < GM_ARENAS && !st; at++) {
        int64_t n = L.total[at] ? (int64_t)L.total[at] : 1;
        opf_spec s = opf_spec_make(1, &n, OPF_U8);
        st = scratch_tensor(ctx, &s, &arenas[at]);
    }
    if (!st) st = scratch_tensor(ctx, &L.out[2], &y);
    if (st) return st;
    memcpy(c.args, a->part[1], a->cls[1]->fwd_schema->size);
    memset(c.aux, 0, sizeof c.aux);
    opf_tensor *x = field_tensor(a->cls[1]->fwd_schema, c.args, "x");
    const opf_tensor *kept = field_tensor(b->cls[1]->bwd_schema, b->part[1], "x");
    if (!x || !kept) return opf_error(ctx, OPF_ERR_STATE, "grouped_mlp: recompute finds no input of %s",
                                      a->cls[1]->name);
    *x = *kept;  /* the activation's input as its context keeps it */
    c.outs[0] = arena_view(arenas, L.out_at[1], &L.out[1], L.out_off[1]);
    if ((st = a->cls[1]->forward_impl(ctx, c.args, c.outs, c.aux)) ||
        (st = part_call_fwd(a, &L, 2, arenas, &y, &c)) ||
        (st = a->cls[2]->forward_impl(ctx, c.args, c.outs, c.aux)))
        return st;
    opf_op_ctx tmp;
    memset(&tmp, 0, sizeof tmp);
    tmp.requires_grad = true;
    tmp.prev_grad_q = opf_q_or_none(grad_q_of(b->ops[1]));
    opf_bwd_env e = {.ctx = ctx, .dy = &b->dy, .prev_grad_q = grad_q_of(b->ops[1])};
    st = a->cls[2]->setup_context(b->ops[2], &tmp, c.args, c.outs, c.aux);
    memset(fc2_bargs, 0, b->cls[2]->bwd_schema->size);
    if (!st) st = b->cls[2]->resolve_bwd(b->ops[2], &tmp, &e, fc2_bargs);
    for (int i = 0; i < tmp.n_saved; i++) opf_tensor_release(&tmp.saved[i]);  /* scratch views */
    return st;
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const gm_bwd *b = bargs;
    opf_tensor mid[GM_PARTS - 1];  /* mid[k]: the gradient of part k's output */
    _Alignas(16) unsigned char fc2_args[OPF_OP_ARGS_MAX];
    const void *pargs[GM_PARTS] = {b->part[0], b->part[1], b->part[2]};
    if (b->fwd->recompute && b->first < GM_PARTS) {
        opf_status st = recompute_fc2(ctx, b, fc2_args);
        if (st) return st;
        pargs[2] = fc2_args;
    }
    for (int k = b->first > 1 ? (int)b->first : 1; k < GM_PARTS; k++) {
        opf_spec g[OPF_OP_MAX_GRADS];
        none_specs(g, OPF_OP_MAX_GRADS);
        opf_status st = b->cls[k]->backward_fake(b->part[k], g);
        if (!st) st = scratch_tensor(ctx, &g[0], &mid[k - 1]);
        if (st) return st;
    }
    for (int k = GM_PARTS - 1; k >= b->first; k--) {
        opf_status st = part_bwd(ctx, b, k, pargs[k], mid, grads);
        if (st) return st;
    }
    return OPF_OK;
}

static const char *unsupported(const opf_op *op)
{
    return "grouped_mlp runs its parts on their own argument buffers, which its args reference; "
           "a graph cannot see the tensors behind them";
}

const opf_op_class opf_op_class_grouped_mlp = {
    OPF_OP_CLASS_HEAD("grouped_mlp", 0, &gm_fwd_schema, &gm_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(NULL, setup_context),
    .module_type = "grouped_mlp",
    .covers = GM_PARTS,
    .unsupported_reason = unsupported,
};

static int match(opf_op *const *ops, int n, const opf_recipe *recipe, void *user)
{
    return opf_grouped_mlp_decline_reason(ops, n, recipe) ? 0 : GM_PARTS;
}

opf_status opf_fuse_grouped_mlp(opf_ctx *ctx, opf_op *const *ops_in, int n, const opf_recipe *recipe,
                                void *user, opf_op **ops_out, int *n_out)
{
    return opf_fusion_scan(ctx, ops_in, n, recipe, match, opf_fusion_build_class,
                           (void *)"grouped_mlp", ops_out, n_out);
}
