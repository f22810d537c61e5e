/* backward_activation_bias.c: BackwardActivationBias (the anchor's fused op,
 * found by its sliding window over the seq), a backward-only fusion of Bias + (GELU | ReLU) that follows an op X,
 * in the anchor's case one with a grad-output quantizer (a BasicLinear,
 * usually); below, the plain form for an X without one. X stays outside
 * the fused op: it only supplies the quantizer, which the fuser hands the
 * fused op as env->prev_grad_q (X is the basic-op neighbour before the
 * bias).
 *
 * One kernel, the backend's dact_dbias: p = f'(x) * dy in fp32, with x the
 * activation's saved input; dbias = the fp32 column sum of p (lanesum.h),
 * taken before any rounding (numerics.md 6.3, last line); then dx = p
 * rounded to the activation dtype or quantized with X's grad-output
 * quantizer (per-tensor delayed FP8 casts the fp32 value, numerics.md 6.1),
 * so X gets its dy already quantized. Unfused, the activation rounds dx
 * first and the bias sums the rounded values: dbias agrees within the
 * dtype's tolerance (bit for bit in f32).
 *
 * Applies under a recipe without a backward override when X's grad-output
 * quantizer exists, as in the anchor (an override quantizes no gradient,
 * so there is nothing to fuse the quantization into).
 *
 * Beyond the anchor: where X has no grad-output quantizer (no recipe, bf16
 * training; an X that is no Linear), dx is plain, and the fused op takes
 * the backend's dact_dbias_stored, whose dbias sums dx as stored. Those
 * are the unfused ops' bits exactly (the activation rounds dx, the bias
 * sums the rounded values), in one pass where the device fuses it (on the
 * GPU one kernel where the two ops launched two). A plain dx_q at run time
 * takes that entry too.
 *
 * The fused op consumes what the unfused forwards saved: nothing for the
 * bias, the input for the activation (read through the activation's own
 * resolve_bwd). Both ops are recognized by their class pointers. */
#include "ops/basic/act-impl.h"

typedef struct bab_bwd {
    opf_tensor    x;     /* the activation's saved input */
    opf_tensor    dy;    /* gradient of the activation's output */
    opf_tensor    b;     /* the bias (the spec of its gradient) */
    opf_quantizer dx_q;  /* X's grad-output quantizer, or none */
    int           act;   /* opf_act_kind: GELU or RELU */
    double        alpha;
} bab_bwd;
static const opf_field bab_bwd_fields[] = {
    OPF_F_TENSOR_Q(bab_bwd, x), OPF_F_TENSOR_Q(bab_bwd, dy), OPF_F_TENSOR(bab_bwd, b),
    OPF_F_QUANT(bab_bwd, dx_q), OPF_F_ENUM(bab_bwd, act),   OPF_F_FLOAT(bab_bwd, alpha)};
OPF_SCHEMA(bab_bwd_schema, bab_bwd, bab_bwd_fields);

/* The activations this fusion takes (the anchor's dact + dbias kernels). */
static bool is_fusable_act(const opf_op *op)
{
    int k = opf_act_kind_of(op);
    return k == OPF_ACT_GELU || k == OPF_ACT_RELU;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *bargs)
{
    bab_bwd *b = bargs;
    opf_op *bias = opf_op_basic(op, 0), *act = opf_op_basic(op, 1);
    opf_act_bwd ab;
    memset(&ab, 0, sizeof ab);
    opf_bwd_env aenv = {.ctx = env->ctx, .dy = env->dy};
    opf_status st = opf_op_class_of(act)->resolve_bwd(act, &octx[1], &aenv, &ab);
    if (st) return st;
    const opf_tensor *bv = &opf_op_param(bias, 0)->value;
    int64_t n = bv->spec.shape[0], w = ab.x.spec.shape[ab.x.spec.ndim - 1];
    if (w != n)
        return opf_error(env->ctx, OPF_ERR_SHAPE, "backward_activation_bias \"%s\": the activation "
                         "had %lld features, the bias has %lld", opf_op_name(op), (long long)w,
                         (long long)n);
    b->x = ab.x;
    b->dy = ab.dy;
    b->b = *bv;
    b->dx_q = opf_q_or_none(env->prev_grad_q);
    b->act = ab.act;
    b->alpha = ab.alpha;
    return OPF_OK;
}

static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    const bab_bwd *b = bargs;
    opf_spec plain = opf_spec_make(b->x.spec.ndim, b->x.spec.shape, b->x.spec.dtype);
    plain.device = b->x.spec.device;
    grads[1] = b->b.spec;  /* the bias's one parameter; the activation has none */
    return opf_op_out_spec(&plain, &b->dx_q, &grads[0]);
}

/* The saved x and dy as plain tensors (the tensor entries' inputs). */
static opf_status plain_views(opf_ctx *ctx, const bab_bwd *b, opf_tensor *xv, opf_tensor *dyv)
{
    opf_status st = opf_op_plain_view(ctx, &b->x, xv);
    return st ? st : opf_op_plain_view(ctx, &b->dy, dyv);
}

/* A plain dx through dact_dbias_stored (dbias of the stored dx, the
 * unfused bits); a quantized one through dact_dbias_q (dx quantized in the
 * same entry), or, for stochastic rounding, the fp32 dact_dbias and
 * opf_op_store_f32. */
static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const bab_bwd *b = bargs;
    const opf_act_kernels *K =
        opf_backend_kernels(ctx, "backward_activation_bias", b->x.spec.device, OPF_KERNELS_ACT);
    if (!K) return OPF_ERR_UNSUPPORTED;
    int64_t n = b->b.spec.shape[0], numel = opf_spec_numel(&b->x.spec), rows = n ? numel / n : 0;
    opf_act_kind k = (opf_act_kind)b->act;
    opf_act_params prm = {(float)b->alpha, 0.0f};
    opf_quantize_state qs;
    opf_qout o;
    opf_tensor xv, dyv;
    opf_status st;
    if (b->dx_q.scaling == OPF_SCALING_NONE) {
        st = plain_views(ctx, b, &xv, &dyv);
        return st ? st : K->dact_dbias_stored(ctx, k, prm, &xv, &dyv, &grads[0], &grads[1]);
    }
    float *db = opf_op_scratch(ctx, n);
    if (!db) return opf_error(ctx, OPF_ERR_NO_MEMORY, "backward_activation_bias: no scratch");
    if (opf_op_qout(&b->dx_q, b->x.spec.dtype, &grads[0], &qs, &o)) {
        st = plain_views(ctx, b, &xv, &dyv);
        if (!st) st = K->dact_dbias_q(ctx, k, prm, &xv, &dyv, &o, db);
        return st ? st : opf_op_store_f32(ctx, db, grads[1].spec.dtype, NULL, &grads[1]);
    }
    float *xs = opf_op_scratch(ctx, numel), *dys = opf_op_scratch(ctx, numel);
    float *p = opf_op_scratch(ctx, numel);
    if (!xs || !dys || !p)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "backward_activation_bias: no scratch");
    const float *x, *dy;
    st = opf_op_load_f32(ctx, &b->x, xs, &x);
    if (!st) st = opf_op_load_f32(ctx, &b->dy, dys, &dy);
    if (!st) st = K->dact_dbias(ctx, k, prm, x, dy, p, db, rows, n);
    if (!st) st = opf_op_store_f32(ctx, db, grads[1].spec.dtype, NULL, &grads[1]);
    return st ? st : opf_op_store_f32(ctx, p, b->x.spec.dtype, &b->dx_q, &grads[0]);
}

const opf_op_class opf_op_class_backward_activation_bias =
    OPF_BACKWARD_FUSED_CLASS("backward_activation_bias", 2, &bab_bwd_schema);

/* X's grad-output quantizer: X is ops[i - 1], or the last basic op of it
 * when an earlier fusion covered it (the fuser's neighbour is a basic op). */
static bool has_grad_output_q(const opf_op *x)
{
    const opf_op *last = opf_op_basic(x, opf_op_num_basic(x) - 1);
    const opf_op_class *c = opf_op_class_of(last);
    return c->grad_output_quantizer && c->grad_output_quantizer(last);
}

/* ops[i], ops[i + 1] = Bias, GELU|ReLU after an X, neither under a recipe
 * of its own (such an op runs by itself, as opf_fusion_scan has it). Under
 * a recipe without a backward override: X with a quantizer (the anchor's
 * case) or without one (the plain form). With no recipe: the plain form,
 * so X must have no quantizer and no recipe of its own that could give it
 * one at run time. */
static bool matches_at(opf_op *const *ops, int n, int i, const opf_recipe *recipe)
{
    if (i < 1 || i + 1 >= n || opf_op_is_fused(ops[i]) || opf_op_is_fused(ops[i + 1]) ||
        opf_op_class_of(ops[i]) != &opf_op_class_bias || !is_fusable_act(ops[i + 1]) ||
        opf_op_has_recipe(ops[i], NULL) || opf_op_has_recipe(ops[i + 1], NULL))
        return false;
    if (!recipe)
        return !has_grad_output_q(ops[i - 1]) && !opf_op_has_recipe(ops[i - 1], NULL);
    return recipe->backward_override == OPF_BACKWARD_NONE;
}

static bool in_list(opf_op *const *list, int n, const opf_op *op)
{
    for (int i = 0; i < n; i++)
        if (list[i] == op) return true;
    return false;
}

/* A window whose first element (X) is kept, so opf_fusion_scan's "match at
 * the window start" does not fit: the walk is written out. */
opf_status opf_fuse_backward_activation_bias(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                             const opf_recipe *recipe, void *user,
                                             opf_op **ops_out, int *n_out)
{
    int o = 0;
    for (int i = 0; i < n;) {
        if (!matches_at(ops_in, n, i, recipe)) {
            ops_out[o++] = ops_in[i++];
            continue;
        }
        opf_op *f = NULL;
        opf_status st = opf_fused_op_create(ctx, "backward_activation_bias", ops_in + i, 2, &f);
        if (st) {
            for (int j = 0; j < o; j++)  /* the ones created here, not the inputs */
                if (!in_list(ops_in, n, ops_out[j])) opf_op_destroy(ops_out[j]);
            return st;
        }
        ops_out[o++] = f;
        i += 2;
    }
    *n_out = o;
    return OPF_OK;
}
