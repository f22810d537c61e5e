/* grouped_linear.c: G independent linears over consecutive row groups of one
 * input (the anchor's GroupedLinear). Extra input 0 holds the
 * split sizes, a plain i64 [G] tensor that sums to the rows of x (its 2D
 * view) or less (padding rows past the sum: never read, zero in y and dx);
 * group g computes y_g = x_g W_g^T (+ b_g) on its rows with the
 * BasicLinear data flow of docs/numerics.md 5.2 and the quantizers of GEMM g
 * of the op's recipe state: fprop gemm(W_g, x_g, TN), dgrad gemm(W_g, dy_g,
 * NN), wgrad gemm(x_g, dy_g, NT). db_g is the fp32 column sum of the plain
 * dy_g (5.5). The split sizes get no gradient.
 *
 * scale_bias (the anchor's, for an MoE FC2): extra input 1 holds per-row
 * scales s (routing probabilities); row r adds fl(s_r b_g) in place of b_g:
 * the GEMM writes fp32, then y = fl(acc + fl(s_r b_gj)) rounds once (the
 * elem table's scaled_bias_add). Backward: db_gj = sum over the group's rows
 * of fl(dy_rj s_r) and ds_r = sum over j of fl(dy_rj b_gj) (scaled_dbias);
 * padding rows get ds 0.
 *
 * Like the anchor's split-quantize path, the split sizes are read on the
 * host in resolve_fwd and become values of the args. That, and the
 * parameter reference below, make a compiled graph run the op eagerly
 * (unsupported_reason). The per-group quantized x_g and W_g live in
 * two packed byte buffers (aux[0], aux[1]) whose layout is a pure function of
 * the specs, so the fake describes them and backward finds them again.
 *
 * Quantized data do not cross the op's boundary: a quantized x (or dy) is
 * decoded first, y and dx are plain in the activation dtype, and the class
 * hands neighbours no input / grad-output quantizer (one quantizer cannot
 * cover G groups). The bias is added in the GEMM epilogue in its own dtype.
 *
 * Limits: parameters are at most OPF_OP_MAX_PARAMS (so G <= 64, or <= 32
 * with bias); init sets the op's own GEMM count to G, so its recipe state
 * holds exactly G quantizers per role. The G weights (and biases) do not fit
 * one args struct (OPF_OP_ARGS_MAX): the args carry group 0's weight and
 * bias (their specs are every group's) and a reference to the op's
 * parameter array, from which the real half reads group g's tensors.
 *
 * Backward override (the recipe's backward_override, numerics.md 3.7; as in
 * basic_linear.c): fprop is quantized as always, x_g and W_g with rowwise
 * copies only; the backward quantizes nothing (dy stays plain, dx is plain)
 * and dgrad / wgrad are plain GEMMs per group on
 *   high_precision  the original x (as it came, decoded if it came
 *                   quantized) and the parameters W_g, saved instead of
 *                   the packs;
 *   dequantized     the saved packs' rowwise copies decoded to the
 *                   activation dtype.
 *
 * Weights: Kaiming-uniform per group, with the Philox mapping of
 * basic_linear.c (one rng_advance per weight); biases start at zero. */
#include <math.h>

#include "backend/backend-impl.h"
#include "ops/basic/linear-impl.h"
#include "ops/ops-impl.h"
#include "opfuse/gemm.h"

#define GL_MAX   OPF_OP_MAX_PARAMS

typedef struct grouped_fwd {
    opf_tensor    x;              /* [..., in]: plain, or quantized (decoded into aux[2]) */
    opf_tensor    w0, b0;         /* group 0's weight and bias (absent without): every group's specs */
    opf_tensor    probs;          /* scale_bias: the per-row scales (absent without) */
    opf_param    *params;         /* the op's weight0..G-1, then bias0..G-1 */
    opf_quantizer x_q, w_q;       /* group 0's; under delayed scaling group g uses slot + 3g */
    int64_t       rows[GL_MAX];   /* split sizes */
    int64_t       groups;
    int64_t       ovr;            /* opf_backward_override: what setup_context saves */
    bool          bias, wgrad;
} grouped_fwd;

#define GL_R8(st, b) OPF_F_INT(st, rows[b + 0]), OPF_F_INT(st, rows[b + 1]), \
    OPF_F_INT(st, rows[b + 2]), OPF_F_INT(st, rows[b + 3]), OPF_F_INT(st, rows[b + 4]), \
    OPF_F_INT(st, rows[b + 5]), OPF_F_INT(st, rows[b + 6]), OPF_F_INT(st, rows[b + 7])
#define GL_ROWS(st) GL_R8(st, 0), GL_R8(st, 8), GL_R8(st, 16), GL_R8(st, 24), GL_R8(st, 32), \
                    GL_R8(st, 40), GL_R8(st, 48), GL_R8(st, 56)
#define GL_W(st) OPF_F_TENSOR(st, w0), OPF_F(st, b0, OPF_FIELD_TENSOR, OPF_FIELD_OPTIONAL), \
                 OPF_F(st, probs, OPF_FIELD_TENSOR, OPF_FIELD_OPTIONAL), OPF_F(st, params, OPF_FIELD_REF, 0)
_Static_assert(GL_MAX == 64, "the schema tables list 64 groups");

static const opf_field grouped_fwd_fields[] = {
    OPF_F_TENSOR_Q(grouped_fwd, x), GL_W(grouped_fwd),
    OPF_F_QUANT(grouped_fwd, x_q),  OPF_F_QUANT(grouped_fwd, w_q),
    GL_ROWS(grouped_fwd),           OPF_F_INT(grouped_fwd, groups), OPF_F_INT(grouped_fwd, ovr),
    OPF_F_BOOL(grouped_fwd, bias),  OPF_F_BOOL(grouped_fwd, wgrad)};
OPF_SCHEMA(grouped_fwd_schema, grouped_fwd, grouped_fwd_fields);

typedef struct grouped_bwd {
    opf_tensor    dy;             /* [..., out], plain or quantized (decoded) */
    opf_tensor    x;              /* saved: plain x, or the pack of quantized x_g; absent without wgrad */
    opf_tensor    wpack;          /* saved pack of quantized W_g; absent: the plain parameters */
    opf_tensor    w0, b0;         /* group 0's weight and bias: gradient specs */
    opf_tensor    probs;          /* scale_bias: the saved per-row scales */
    opf_param    *params;         /* the op's parameters: plain operands */
    opf_quantizer x_q, w_q, dy_q; /* group 0's (pack layouts; dy quantization) */
    int64_t       rows[GL_MAX];
    int64_t       groups;
    int64_t       ovr;            /* opf_backward_override: decode packs, quantize nothing */
    int           act_dtype;
    bool          bias, wgrad;
} grouped_bwd;
static const opf_field grouped_bwd_fields[] = {
    OPF_F_TENSOR_Q(grouped_bwd, dy), OPF_F(grouped_bwd, x, OPF_FIELD_TENSOR, OPF_FIELD_OPTIONAL),
    OPF_F(grouped_bwd, wpack, OPF_FIELD_TENSOR, OPF_FIELD_OPTIONAL), GL_W(grouped_bwd),
    OPF_F_QUANT(grouped_bwd, x_q),   OPF_F_QUANT(grouped_bwd, w_q), OPF_F_QUANT(grouped_bwd, dy_q),
    GL_ROWS(grouped_bwd),            OPF_F_INT(grouped_bwd, groups), OPF_F_INT(grouped_bwd, ovr),
    OPF_F_ENUM(grouped_bwd, act_dtype), OPF_F_BOOL(grouped_bwd, bias),
    OPF_F_BOOL(grouped_bwd, wgrad)};
OPF_SCHEMA(grouped_bwd_schema, grouped_bwd, grouped_bwd_fields);

/* aux slots of the forward, saved slots, attrs */
enum { AUX_XPACK, AUX_WPACK, AUX_XDEC, AUX_ROWS };

bool opf_grouped_linear_aux_is_input(int i) { return i == AUX_XPACK || i == AUX_XDEC; }
enum { SV_ROWS, SV_WPACK, SV_X, SV_PROBS, SV_COUNT };
enum { AT_ACT_DTYPE, AT_WGRAD, AT_QUANTIZED, AT_ROWS, AT_OVERRIDE };

static bool is_float_plain(opf_dtype d) { return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16; }
static bool is_q(const opf_quantizer *q) { return q->scaling != OPF_SCALING_NONE; }

static opf_status fail(opf_ctx *ctx, const opf_op *op, opf_status st)
{
    char why[400];
    snprintf(why, sizeof why, "%s", opf_last_error(NULL));
    return opf_error(ctx, st, "grouped_linear \"%s\": %s", opf_op_name(op), why);
}

/* Group g's quantizer from group 0's: delayed slots step by `stride` per
 * GEMM (forward [input, weight, output], backward [grad_output,
 * grad_input]; numerics.md 3). */
static opf_quantizer group_q(const opf_quantizer *q0, int g, int stride)
{
    opf_quantizer q = *q0;
    if (q.delayed) q.slot += stride * g;
    return q;
}

/* ---- packed per-group quantized tensors ---------------------------------------- */

typedef struct pack_plan {
    opf_spec spec[GL_MAX];  /* ndim < 0: empty group, nothing stored */
    size_t   off[GL_MAX];
    size_t   total;
} pack_plan;

/* Layout of G quantized tensors of the plain specs plain[g] in one buffer. */
static opf_status plan_pack(const opf_quantizer *q, const opf_spec *plain, int G, pack_plan *pp)
{
    pp->total = 0;
    for (int g = 0; g < G; g++) {
        pp->spec[g].ndim = OPF_SPEC_NONE_NDIM;
        pp->off[g] = pp->total;
        if (opf_spec_numel(&plain[g]) == 0) continue;
        opf_layout L;
        opf_status st = opf_quantizer_spec(q, &plain[g], &pp->spec[g]);
        if (!st) st = opf_spec_layout(&pp->spec[g], &L);
        if (st) {
            char why[320];
            snprintf(why, sizeof why, "%s", opf_last_error(NULL));
            return opf_error(NULL, st, "group %d (%lld rows): %s", g, (long long)plain[g].shape[0], why);
        }
        pp->total += (size_t)opf_round_up((int64_t)L.total_bytes, OPF_COMPONENT_ALIGN);
    }
    return OPF_OK;
}

static opf_spec pack_spec(const pack_plan *pp)
{
    int64_t n = pp->total ? (int64_t)pp->total : 1;
    return opf_spec_make(1, &n, OPF_U8);
}

static opf_status pack_view(const opf_tensor *pack, const pack_plan *pp, int g, opf_tensor *out)
{
    return opf_tensor_wrap(&pp->spec[g], (unsigned char *)pack->data[OPF_COMP_DATA] + pp->off[g], out);
}

/* The plain specs of x_g ([rows_g, in], dtype dt, on the weights' device)
 * and of the weights. */
static void x_specs(const int64_t *rows, int G, int64_t in, opf_dtype dt, opf_device dev,
                    opf_spec *out)
{
    for (int g = 0; g < G; g++) {
        out[g] = opf_spec_make(2, (int64_t[]){rows[g], in}, dt);
        out[g].device = dev;
    }
}

static void w_specs(const opf_tensor *w0, int G, opf_spec *out)
{
    for (int g = 0; g < G; g++) out[g] = w0->spec;
}

/* Rows [off, off + m) of a plain tensor, as a 2D [m, K] view. */
static opf_tensor row_view(const opf_tensor *t, int64_t off, int64_t m)
{
    int64_t M, K;
    opf_shape_2d(&t->spec, &M, &K);
    opf_spec s = opf_spec_make(2, (int64_t[]){m, K}, t->spec.dtype);
    s.device = t->spec.device;
    opf_tensor v;
    opf_tensor_wrap(&s, (unsigned char *)t->data[OPF_COMP_DATA] +
                            opf_dtype_nbytes(t->spec.dtype, (size_t)(off * K)), &v);
    return v;
}

/* Elements [off, off + m) of a plain tensor, as a 1D view. */
static opf_tensor vec_view(const opf_tensor *t, int64_t off, int64_t m)
{
    opf_spec s = opf_spec_make(1, &m, t->spec.dtype);
    s.device = t->spec.device;
    opf_tensor v;
    opf_tensor_wrap(&s, (unsigned char *)t->data[OPF_COMP_DATA] +
                            opf_dtype_nbytes(t->spec.dtype, (size_t)off), &v);
    return v;
}

static int64_t split_sum(const int64_t *rows, int G)
{
    int64_t m = 0;
    for (int g = 0; g < G; g++) m += rows[g];
    return m;
}

/* Zero the padding rows past the split sizes (of a 2D-viewed t). */
static opf_status zero_padding(opf_ctx *ctx, const opf_elem_kernels *k, const int64_t *rows, int G,
                               opf_tensor *t)
{
    int64_t M, K, used = split_sum(rows, G);
    opf_shape_2d(&t->spec, &M, &K);
    if (used >= M) return OPF_OK;
    opf_tensor pad = row_view(t, used, M - used);
    return k->fill(ctx, 0.0, &pad);
}

/* The GEMMs of one grouped call (backend-impl.h's grouped_gemm), in
 * scratch: each entry holds copies of its operands, so views made per group
 * may go out of scope before the call. */
typedef struct gemm_batch {
    int              count;
    opf_tensor       a[2 * GL_MAX], b[2 * GL_MAX], d[2 * GL_MAX];
    opf_gemm_options o[2 * GL_MAX];
    opf_gemm_args    args[2 * GL_MAX];
} gemm_batch;

static opf_status batch_begin(opf_ctx *ctx, gemm_batch **out)
{
    *out = (gemm_batch *)opf_ctx_scratch_push(ctx, sizeof(gemm_batch));  /* host: a list */
    if (!*out) return opf_error(ctx, OPF_ERR_NO_MEMORY, "grouped_linear: no scratch for the GEMM list");
    (*out)->count = 0;
    return OPF_OK;
}

/* Appends d = gemm(a, b) (+ bias), checked as opf_gemm checks shapes and
 * formats; the operands were made by this op, on the context's device. */
static opf_status batch_add(opf_ctx *ctx, gemm_batch *bt, const opf_tensor *a, const opf_tensor *b,
                            opf_gemm_layout layout, const opf_tensor *bias, const opf_tensor *d)
{
    opf_spec ds;
    opf_status st = opf_gemm_out_spec(&a->spec, &b->spec, layout, d->spec.dtype, &ds);
    if (st) return opf_error(ctx, st, "grouped_linear: %s", opf_last_error(NULL));
    int i = bt->count++;
    int64_t m, n, ar, ac;
    bt->a[i] = *a, bt->b[i] = *b, bt->d[i] = *d;
    bt->o[i] = opf_gemm_options_default();
    bt->o[i].bias = bias;
    opf_shape_2d(&d->spec, &m, &n);
    opf_shape_2d(&a->spec, &ar, &ac);
    bt->args[i] = (opf_gemm_args){&bt->a[i], &bt->b[i], layout, &bt->o[i], &bt->d[i], m, n,
                                  layout == OPF_GEMM_TN ? ac : ar, {0}};
    return OPF_OK;
}

static opf_status batch_run(opf_ctx *ctx, const gemm_batch *bt)
{
    const opf_backend_i *be = opf_backend_get(opf_ctx_device(ctx));
    if (!be || !be->grouped_gemm)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "grouped_linear: no grouped GEMM on device %d",
                         (int)opf_ctx_device(ctx));
    return bt->count ? be->grouped_gemm(ctx, bt->count, bt->args) : OPF_OK;
}

/* ---- init ---------------------------------------------------------------------------- */

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_grouped_linear_config *c = opf_op_config(op);
    const char *name = opf_op_name(op);
    int per = c->bias ? 2 : 1;
    if (c->groups < 1 || c->groups * per > OPF_OP_MAX_PARAMS)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "grouped_linear \"%s\": %d groups%s need %d "
                         "parameters; an op holds 1..%d", name, c->groups,
                         c->bias ? " with bias" : "", c->groups * per, OPF_OP_MAX_PARAMS);
    if (c->in_features < 1 || c->out_features < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "grouped_linear \"%s\": in_features %lld and "
                         "out_features %lld must both be >= 1", name, (long long)c->in_features,
                         (long long)c->out_features);
    if (!is_float_plain(c->dtype))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "grouped_linear \"%s\": dtype %s, expected "
                         "f32, bf16 or f16", name, opf_dtype_name(c->dtype));
    if (c->scale_bias && !c->bias)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "grouped_linear \"%s\": scale_bias scales the "
                         "bias, which this op has not (bias false)", name);
    op->n_gemms = c->groups;  /* one fprop/dgrad/wgrad set per group */
    op->n_extra_in = c->scale_bias ? 2 : 1;  /* the scales: a second extra input */
    opf_spec ws = opf_spec_make(2, (int64_t[]){c->out_features, c->in_features}, c->dtype);
    opf_spec bs = opf_spec_make(1, &c->out_features, c->dtype);
    char pn[32];
    for (int i = 0; i < c->groups * per; i++) {
        bool w = i < c->groups;
        snprintf(pn, sizeof pn, "%s%d", w ? "weight" : "bias", w ? i : i - c->groups);
        int k = opf_op_add_param(ctx, op, pn, w ? &ws : &bs);
        if (k < 0) return (opf_status)-k;
        opf_status st = w ? opf_linear_init_weight(ctx, &opf_op_param(op, k)->value, c->in_features,
                                                   "grouped_linear") : OPF_OK;
        if (st) return st;
    }
    return OPF_OK;
}

/* ---- forward ------------------------------------------------------------------------- */

static opf_dtype act_dtype(const grouped_fwd *a) { return a->x.spec.dtype; }

static opf_status forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const grouped_fwd *a = args;
    int G = (int)a->groups;
    int64_t M, K, N = a->w0.spec.shape[0];
    opf_shape_2d(&a->x.spec, &M, &K);
    opf_spec xs[GL_MAX], ws[GL_MAX], y;
    x_specs(a->rows, G, K, act_dtype(a), a->w0.spec.device, xs);
    w_specs(&a->w0, G, ws);
    opf_status st;
    if (a->x.spec.scaling != OPF_SCALING_NONE) {
        aux[AUX_XDEC] = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, act_dtype(a));
        aux[AUX_XDEC].device = a->x.spec.device;
    }
    if (is_q(&a->x_q)) {
        pack_plan px, pw;
        if ((st = plan_pack(&a->x_q, xs, G, &px)) || (st = plan_pack(&a->w_q, ws, G, &pw))) return st;
        aux[AUX_XPACK] = pack_spec(&px);
        aux[AUX_WPACK] = pack_spec(&pw);
        for (int g = 0; g < G; g++)
            if (px.spec[g].ndim >= 0) xs[g] = px.spec[g], ws[g] = pw.spec[g];
    }
    for (int g = 0; g < G; g++)  /* every group's GEMM must be possible */
        if (a->rows[g] && (st = opf_gemm_out_spec(&ws[g], &xs[g], OPF_GEMM_TN, act_dtype(a), &y)))
            return st;
    aux[AUX_ROWS] = opf_spec_make(1, &a->groups, OPF_I64);
    aux[AUX_ROWS].flags = OPF_SPEC_HOST;  /* the split sizes, read on the host */
    outs[0] = opf_spec_make(a->x.spec.ndim, a->x.spec.shape, act_dtype(a));
    outs[0].shape[outs[0].ndim - 1] = N;
    outs[0].device = a->x.spec.device;
    return OPF_OK;
}

/* Group g: quantize x_g and W_g into the packs (under a recipe), then
 * append the fprop GEMM into y's rows (into acc's, without the bias, under
 * scale_bias). */
static opf_status forward_group(opf_ctx *ctx, const grouped_fwd *a, int g, const opf_tensor *x,
                                int64_t off, const pack_plan *px, const pack_plan *pw,
                                opf_tensor *aux, opf_tensor *y, gemm_batch *bt)
{
    int G = (int)a->groups;
    opf_tensor xg = row_view(x, off, a->rows[g]), yg = row_view(y, off, a->rows[g]), xq, wq;
    bool plain_bias = a->bias && !a->probs.data[OPF_COMP_DATA];
    const opf_tensor *xo = &xg, *wo = &a->params[g].value;
    opf_status st;
    if (is_q(&a->x_q)) {
        opf_quantizer qx = group_q(&a->x_q, g, 3), qw = group_q(&a->w_q, g, 3);
        if ((st = pack_view(&aux[AUX_XPACK], px, g, &xq)) || (st = opf_quantize(ctx, &qx, &xg, &xq)) ||
            (st = pack_view(&aux[AUX_WPACK], pw, g, &wq)) || (st = opf_quantize(ctx, &qw, wo, &wq)))
            return st;
        xo = &xq, wo = &wq;
    }
    return batch_add(ctx, bt, wo, xo, OPF_GEMM_TN, plain_bias ? &a->params[G + g].value : NULL, &yg);
}

/* scale_bias after the GEMMs: y's rows = acc's + fl(s_r b_g), group by group. */
static opf_status scaled_bias_fwd(opf_ctx *ctx, const grouped_fwd *a, const opf_elem_kernels *k,
                                  const opf_tensor *acc, opf_tensor *y)
{
    int64_t off = 0;
    opf_status st = OPF_OK;
    for (int g = 0; g < a->groups && !st; off += a->rows[g], g++) {
        if (!a->rows[g]) continue;
        opf_tensor ag = row_view(acc, off, a->rows[g]), yg = row_view(y, off, a->rows[g]);
        opf_tensor sg = vec_view(&a->probs, off, a->rows[g]);
        st = k->scaled_bias_add(ctx, &ag, &sg, &a->params[a->groups + g].value, &yg);
    }
    return st;
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const grouped_fwd *a = args;
    int G = (int)a->groups;
    const opf_tensor *x = &a->x;
    opf_status st;
    if (x->spec.scaling != OPF_SCALING_NONE) {  /* decode once, then split */
        int64_t n = opf_spec_numel(&x->spec);
        float *ws = opf_op_scratch(ctx, n);
        const float *v;
        if (!ws) return opf_error(ctx, OPF_ERR_NO_MEMORY, "grouped_linear: no scratch");
        if ((st = opf_op_load_f32(ctx, x, ws, &v)) ||
            (st = opf_op_store_f32(ctx, v, act_dtype(a), NULL, &aux[AUX_XDEC])))
            return st;
        x = &aux[AUX_XDEC];
    }
    memcpy(aux[AUX_ROWS].data[OPF_COMP_DATA], a->rows, sizeof(int64_t) * (size_t)G);
    pack_plan px, pw;
    if (is_q(&a->x_q)) {
        opf_spec xs[GL_MAX], ws[GL_MAX];
        x_specs(a->rows, G, a->w0.spec.shape[1], act_dtype(a), a->w0.spec.device, xs);
        w_specs(&a->w0, G, ws);
        if ((st = plan_pack(&a->x_q, xs, G, &px)) || (st = plan_pack(&a->w_q, ws, G, &pw)))
            return opf_error(ctx, st, "grouped_linear: %s", opf_last_error(NULL));
    }
    const opf_elem_kernels *k = opf_op_elem(ctx, "grouped_linear", &outs[0]);
    if (!k) return OPF_ERR_UNSUPPORTED;
    bool scaled = a->probs.data[OPF_COMP_DATA] != NULL;
    opf_tensor acc = outs[0];
    if (scaled) {  /* the GEMMs write fp32; the scaled bias rounds once */
        opf_spec s = opf_spec_make(outs[0].spec.ndim, outs[0].spec.shape, OPF_F32);
        s.device = outs[0].spec.device;
        if ((st = opf_linear_scratch_tensor(ctx, &s, &acc))) return st;
    }
    gemm_batch *bt;
    if ((st = batch_begin(ctx, &bt))) return st;
    int64_t off = 0;
    for (int g = 0; g < G && !st; off += a->rows[g], g++)
        if (a->rows[g]) st = forward_group(ctx, a, g, x, off, &px, &pw, aux, &acc, bt);
    if (!st) st = batch_run(ctx, bt);
    if (!st && scaled) st = scaled_bias_fwd(ctx, a, k, &acc, &outs[0]);
    return st ? st : zero_padding(ctx, k, a->rows, G, &outs[0]);
}

/* x, split sizes, dtypes: every check that needs no recipe state. */
static opf_status check_inputs(opf_ctx *ctx, const opf_op *op, const opf_fwd_env *env, int64_t *rows)
{
    const opf_grouped_linear_config *c = opf_op_config_const(op);
    const char *name = opf_op_name(op);
    const opf_tensor *x = env->x, *s = env->extra_in[0];
    int64_t M, K;
    opf_shape_2d(&x->spec, &M, &K);
    if (!is_float_plain(x->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "grouped_linear \"%s\": input dtype %s, expected "
                         "f32, bf16 or f16", name, opf_dtype_name(x->spec.dtype));
    if (x->spec.ndim < 1 || K != c->in_features)
        return opf_error(ctx, OPF_ERR_SHAPE, "grouped_linear \"%s\": input has %lld features, "
                         "weights expect %lld", name, (long long)K, (long long)c->in_features);
    if (!s || !s->data[OPF_COMP_DATA])
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "grouped_linear \"%s\": extra input 0 (split "
                         "sizes) is missing", name);
    if (s->spec.scaling != OPF_SCALING_NONE || s->spec.dtype != OPF_I64 || s->spec.ndim != 1 ||
        s->spec.shape[0] != c->groups) {
        char b[160];
        opf_spec_str(&s->spec, b, sizeof b);
        return opf_error(ctx, OPF_ERR_SHAPE, "grouped_linear \"%s\": split sizes are %s, expected "
                         "plain i64[%d]", name, b, c->groups);
    }
    /* The one host read of a step on a device (split sizes shape the GEMMs):
     * an explicit, counted device-to-host copy. */
    opf_tensor host;
    opf_spec hs = s->spec;
    hs.device = OPF_DEVICE_CPU;
    opf_tensor_wrap(&hs, rows, &host);
    opf_status st = opf_tensor_copy(ctx, s, &host);
    if (st) return st;
    int64_t sum = 0;
    for (int g = 0; g < c->groups; g++) {
        if (rows[g] < 0)
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "grouped_linear \"%s\": split size %d is "
                             "%lld", name, g, (long long)rows[g]);
        sum += rows[g];
    }
    if (sum > M)
        return opf_error(ctx, OPF_ERR_SHAPE, "grouped_linear \"%s\": split sizes sum to %lld, the "
                         "input has only %lld rows", name, (long long)sum, (long long)M);
    const opf_tensor *p = c->scale_bias ? env->extra_in[1] : NULL;
    if (c->scale_bias && (!p || !p->data[OPF_COMP_DATA]))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "grouped_linear \"%s\": extra input 1 (the "
                         "scale_bias scales) is missing", name);
    if (p && (p->spec.scaling != OPF_SCALING_NONE || !is_float_plain(p->spec.dtype) ||
              opf_spec_numel(&p->spec) != M)) {
        char b[160];
        opf_spec_str(&p->spec, b, sizeof b);
        return opf_error(ctx, OPF_ERR_SHAPE, "grouped_linear \"%s\": scale_bias scales are %s, "
                         "expected %lld plain f32/bf16/f16 values (one per row)", name, b,
                         (long long)M);
    }
    if (env->recipe && env->recipe->kind == OPF_RECIPE_NVFP4 &&
        (x->spec.dtype == OPF_F16 || c->dtype == OPF_F16))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "grouped_linear \"%s\": nvfp4 GEMMs cannot "
                         "write f16 (input %s, weights %s); use bf16 or f32", name,
                         opf_dtype_name(x->spec.dtype), opf_dtype_name(c->dtype));
    return OPF_OK;
}

/* Group 0's quantizer for a role, usage narrowed; every group's must be it
 * up to the delayed slot (they share one rule per role). */
static opf_status role_q(opf_ctx *ctx, const opf_op *op, opf_tensor_role role, int stride,
                         unsigned usage, opf_quantizer *out)
{
    int G = ((const opf_grouped_linear_config *)opf_op_config_const(op))->groups;
    opf_quantizer q0 = opf_q_or_none(opf_op_quantizer(op, role, 0));
    q0.usage = usage;
    for (int g = 1; g < G; g++) {
        opf_quantizer q = opf_q_or_none(opf_op_quantizer(op, role, g)), want = group_q(&q0, g, stride);
        q.usage = usage;
        if (!opf_quantizer_equal(&q, &want))
            return opf_error(ctx, OPF_ERR_UNSUPPORTED, "grouped_linear \"%s\": the %s quantizer of "
                             "group %d differs from group 0's beyond its delayed-scaling slot",
                             opf_op_name(op), opf_role_name(role), g);
    }
    if (!is_q(&q0))
        return opf_error(ctx, OPF_ERR_STATE, "grouped_linear \"%s\": no %s quantizer (no recipe "
                         "state, or the recipe quantizes no %s)", opf_op_name(op),
                         opf_role_name(role), opf_role_name(role));
    *out = q0;
    return OPF_OK;
}

static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    grouped_fwd *a = args;
    opf_ctx *ctx = env->ctx;
    const opf_grouped_linear_config *c = opf_op_config(op);
    int64_t rows[GL_MAX];
    opf_status st = check_inputs(ctx, op, env, rows);
    if (st) return st;
    const opf_recipe *r = env->recipe;
    opf_recipe_state *rs = opf_op_recipe_state(op);
    const opf_recipe *have = rs ? opf_recipe_state_recipe(rs) : NULL;
    if (r && !(have && have->kind == r->kind && have->backward_override == r->backward_override) &&
        (st = opf_op_reset_recipe(ctx, op, r)))
        return fail(ctx, op, st);
    a->x = *env->x;
    a->groups = c->groups;
    a->bias = c->bias;
    a->ovr = r ? r->backward_override : OPF_BACKWARD_NONE;
    a->wgrad = false;
    a->params = opf_op_param(op, 0);
    a->w0 = a->params[0].value;
    if (c->bias) a->b0 = a->params[c->groups].value;
    else memset(&a->b0, 0, sizeof a->b0);
    if (c->scale_bias) a->probs = *env->extra_in[1];
    else memset(&a->probs, 0, sizeof a->probs);
    for (int i = 0; i < c->groups; i++)
        a->wgrad |= env->requires_grad && opf_op_param(op, i)->requires_grad;
    for (int g = 0; g < c->groups; g++) a->rows[g] = rows[g];
    /* the backward reads columnwise copies only when it runs quantized GEMMs */
    const unsigned both = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    bool bq = a->ovr == OPF_BACKWARD_NONE;
    a->x_q = a->w_q = opf_quantizer_default();
    if (r && ((st = role_q(ctx, op, OPF_ROLE_INPUT, 3, a->wgrad && bq ? both : OPF_USAGE_ROWWISE,
                           &a->x_q)) ||
              (st = role_q(ctx, op, OPF_ROLE_WEIGHT, 3,
                           env->requires_grad && bq ? both : OPF_USAGE_ROWWISE, &a->w_q))))
        return st;
    return OPF_OK;  /* the runner runs the fake */
}

static opf_status setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const grouped_fwd *a = args;
    /* high precision keeps the originals: x as it came (decoded) and the
     * parameters, which backward reads from the op */
    bool quant = is_q(&a->x_q), packs = quant && a->ovr != OPF_BACKWARD_HIGH_PRECISION;
    int64_t M, K;
    opf_shape_2d(&a->x.spec, &M, &K);
    opf_tensor_retain(&aux[AUX_ROWS], &octx->saved[SV_ROWS]);
    if (packs) opf_tensor_retain(&aux[AUX_WPACK], &octx->saved[SV_WPACK]);
    if (a->wgrad) {
        const opf_tensor *x = packs ? &aux[AUX_XPACK]
                              : a->x.spec.scaling != OPF_SCALING_NONE ? &aux[AUX_XDEC] : &a->x;
        opf_tensor_retain(x, &octx->saved[SV_X]);
    }
    if (a->probs.data[OPF_COMP_DATA]) opf_tensor_retain(&a->probs, &octx->saved[SV_PROBS]);
    octx->n_saved = SV_COUNT;
    octx->attrs[AT_ACT_DTYPE] = act_dtype(a);
    octx->attrs[AT_WGRAD] = a->wgrad;
    octx->attrs[AT_QUANTIZED] = quant;
    octx->attrs[AT_ROWS] = M;
    octx->attrs[AT_OVERRIDE] = a->ovr;
    return OPF_OK;
}

/* ---- backward ------------------------------------------------------------------------ */

static opf_status backward_fake(const void *bargs, opf_spec *grads)
{
    const grouped_bwd *b = bargs;
    int G = (int)b->groups;
    int64_t K = b->w0.spec.shape[1];
    grads[0] = opf_spec_make(b->dy.spec.ndim, b->dy.spec.shape, (opf_dtype)b->act_dtype);
    grads[0].shape[grads[0].ndim - 1] = K;
    grads[0].device = b->dy.spec.device;
    int P = b->bias ? 2 * G : G;
    for (int g = 0; g < G; g++) {
        if (b->wgrad) grads[1 + g] = b->w0.spec;
        if (b->bias) grads[1 + G + g] = b->b0.spec;
    }
    if (b->probs.data[OPF_COMP_DATA]) grads[1 + P + 1] = b->probs.spec;  /* after the split sizes' */
    if (!is_q(&b->dy_q)) return OPF_OK;
    opf_spec ds[GL_MAX];
    x_specs(b->rows, G, b->w0.spec.shape[0], b->dy.spec.dtype, b->w0.spec.device, ds);
    for (int g = 0; g < G; g++) {  /* each group's dy must quantize */
        opf_spec q;
        opf_status st = b->rows[g] ? opf_quantizer_spec(&b->dy_q, &ds[g], &q) : OPF_OK;
        if (st) {
            char why[320];
            snprintf(why, sizeof why, "%s", opf_last_error(NULL));
            return opf_error(NULL, st, "group %d gradient: %s", g, why);
        }
    }
    return OPF_OK;
}

/* The packs' layouts of the saved operands (as the forward laid them out). */
static opf_status plan_saved(const grouped_bwd *b, pack_plan *px, pack_plan *pw)
{
    int G = (int)b->groups;
    opf_spec xs[GL_MAX], ws[GL_MAX];
    x_specs(b->rows, G, b->w0.spec.shape[1], (opf_dtype)b->act_dtype, b->w0.spec.device, xs);
    w_specs(&b->w0, G, ws);
    opf_status st = b->wgrad ? plan_pack(&b->x_q, xs, G, px) : OPF_OK;
    return st ? st : plan_pack(&b->w_q, ws, G, pw);
}

/* A saved pack view's rowwise copy (the one fprop read) decoded into
 * scratch in the activation dtype: a dequantized-override operand. */
static opf_status decoded(opf_ctx *ctx, const grouped_bwd *b, const opf_tensor *q, opf_tensor *out)
{
    opf_spec s = opf_spec_make(q->spec.ndim, q->spec.shape, (opf_dtype)b->act_dtype);
    s.device = q->spec.device;
    opf_status st = opf_linear_scratch_tensor(ctx, &s, out);
    return st ? st : opf_dequantize(ctx, q, OPF_USAGE_ROWWISE, out);
}

/* Group g's dbias: the column sum of dy_g, or under scale_bias the scaled
 * sums and the scales' gradient on the group's rows. */
static opf_status group_dbias(opf_ctx *ctx, const grouped_bwd *b, int g, const opf_tensor *dyg,
                              int64_t off, opf_tensor *grads, const opf_elem_kernels *k)
{
    int G = (int)b->groups;
    if (!b->probs.data[OPF_COMP_DATA]) return k->dbias(ctx, dyg, &grads[1 + G + g]);
    opf_tensor sg = vec_view(&b->probs, off, b->rows[g]);
    opf_tensor dsg = vec_view(&grads[1 + 2 * G + 1], off, b->rows[g]);
    return k->scaled_dbias(ctx, dyg, &sg, &b->params[G + g].value, &grads[1 + G + g], &dsg);
}

/* Group g of the backward: dbias, dy_g (quantized under a recipe without
 * an override), and the dgrad (into dx's rows) and wgrad GEMMs appended to
 * bt. The W_g / x_g operands are the saved packs (decoded under the
 * dequantized override) or, without packs, the plain parameter and the saved
 * plain x's rows. Scratch made here lives until the batch has run. */
static opf_status backward_group(opf_ctx *ctx, const grouped_bwd *b, int g, const opf_tensor *dy,
                                 int64_t off, const pack_plan *px, const pack_plan *pw,
                                 opf_tensor *grads, const opf_elem_kernels *k, gemm_batch *bt)
{
    bool packed = is_q(&b->w_q), wgrad = b->wgrad, decode = b->ovr != OPF_BACKWARD_NONE;
    opf_tensor dyg = row_view(dy, off, b->rows[g]), dxg = row_view(&grads[0], off, b->rows[g]);
    opf_tensor dyq, wq, xq, xg, wd, xd;
    const opf_tensor *dyo = &dyg, *wo = &b->params[g].value, *xo = &xg;
    opf_status st = b->bias ? group_dbias(ctx, b, g, &dyg, off, grads, k) : OPF_OK;
    if (st) return st;
    if (is_q(&b->dy_q)) {
        opf_quantizer q = group_q(&b->dy_q, g, 2);
        opf_spec s;
        if ((st = opf_quantizer_spec(&q, &dyg.spec, &s)) ||
            (st = opf_linear_scratch_tensor(ctx, &s, &dyq)) || (st = opf_quantize(ctx, &q, &dyg, &dyq)))
            return st;
        dyo = &dyq;
    }
    if (packed) {
        if ((st = pack_view(&b->wpack, pw, g, &wq))) return st;
        if (wgrad && (st = pack_view(&b->x, px, g, &xq))) return st;
        wo = &wq, xo = &xq;
        if (decode && ((st = decoded(ctx, b, &wq, &wd)) || (wgrad && (st = decoded(ctx, b, &xq, &xd)))))
            return st;
        if (decode) wo = &wd, xo = &xd;
    } else if (wgrad) {
        xg = row_view(&b->x, off, b->rows[g]);
    }
    if ((st = batch_add(ctx, bt, wo, dyo, OPF_GEMM_NN, NULL, &dxg))) return st;
    return wgrad ? batch_add(ctx, bt, xo, dyo, OPF_GEMM_NT, NULL, &grads[1 + g]) : OPF_OK;
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    const grouped_bwd *b = bargs;
    int G = (int)b->groups;
    opf_tensor dyd;
    const opf_tensor *dy = &b->dy;
    opf_status st;
    const opf_elem_kernels *k = opf_op_elem(ctx, "grouped_linear", dy);
    if (!k) return OPF_ERR_UNSUPPORTED;
    if (dy->spec.scaling != OPF_SCALING_NONE) {  /* decode once to fp32, then split */
        opf_spec s = opf_spec_make(dy->spec.ndim, dy->spec.shape, OPF_F32);
        const float *v;
        if ((st = opf_linear_scratch_tensor(ctx, &s, &dyd)) ||
            (st = opf_op_load_f32(ctx, dy, dyd.data[OPF_COMP_DATA], &v)))
            return st;
        dy = &dyd;
    }
    pack_plan px, pw;
    gemm_batch *bt;
    if (is_q(&b->w_q) && (st = plan_saved(b, &px, &pw)))
        return opf_error(ctx, st, "grouped_linear: %s", opf_last_error(NULL));
    if ((st = batch_begin(ctx, &bt))) return st;
    int64_t off = 0;
    for (int g = 0; g < G && !st; off += b->rows[g], g++) {
        if (b->rows[g]) st = backward_group(ctx, b, g, dy, off, &px, &pw, grads, k, bt);
        else if (b->wgrad) st = k->fill(ctx, 0.0, &grads[1 + g]);  /* an empty group */
        if (!st && !b->rows[g] && b->bias) st = k->fill(ctx, 0.0, &grads[1 + G + g]);
    }
    if (!st) st = batch_run(ctx, bt);
    if (!st) st = zero_padding(ctx, k, b->rows, G, &grads[0]);
    if (!st && b->probs.data[OPF_COMP_DATA]) {  /* padding rows' scales: gradient 0 */
        opf_tensor ds = vec_view(&grads[1 + 2 * G + 1], split_sum(b->rows, G),
                                 opf_spec_numel(&b->probs.spec) - split_sum(b->rows, G));
        st = k->fill(ctx, 0.0, &ds);
    }
    return st;
}

static opf_status resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *bargs)
{
    grouped_bwd *b = bargs;
    opf_ctx *ctx = env->ctx;
    const opf_grouped_linear_config *c = opf_op_config(op);
    const opf_tensor *dy = env->dy;
    int64_t m, n;
    opf_shape_2d(&dy->spec, &m, &n);
    if (!is_float_plain(dy->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "grouped_linear \"%s\": gradient dtype %s, expected "
                         "f32, bf16 or f16", opf_op_name(op), opf_dtype_name(dy->spec.dtype));
    if (dy->spec.ndim < 1 || n != c->out_features || m != octx->attrs[AT_ROWS])
        return opf_error(ctx, OPF_ERR_SHAPE, "grouped_linear \"%s\": gradient is [%lld, %lld] as "
                         "2D, the output was [%lld, %lld]", opf_op_name(op), (long long)m,
                         (long long)n, (long long)octx->attrs[AT_ROWS], (long long)c->out_features);
    bool wgrad = octx->attrs[AT_WGRAD] != 0;
    int64_t ovr = octx->attrs[AT_OVERRIDE];
    b->dy = *dy;
    b->x = octx->saved[SV_X];
    b->wpack = octx->saved[SV_WPACK];
    b->params = opf_op_param(op, 0);
    b->w0 = b->params[0].value;
    if (c->bias) b->b0 = b->params[c->groups].value;
    if (c->scale_bias) b->probs = octx->saved[SV_PROBS];
    b->groups = c->groups;
    b->ovr = ovr;
    b->bias = c->bias;
    b->wgrad = wgrad;
    b->act_dtype = (int)octx->attrs[AT_ACT_DTYPE];
    memcpy(b->rows, octx->saved[SV_ROWS].data[OPF_COMP_DATA], sizeof(int64_t) * (size_t)c->groups);
    const unsigned both = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    b->x_q = b->w_q = b->dy_q = opf_quantizer_default();
    opf_status st;
    bool quant = octx->attrs[AT_QUANTIZED] != 0;
    if (quant && ovr == OPF_BACKWARD_NONE &&
        ((st = role_q(ctx, op, OPF_ROLE_INPUT, 3, wgrad ? both : OPF_USAGE_ROWWISE, &b->x_q)) ||
         (st = role_q(ctx, op, OPF_ROLE_WEIGHT, 3, both, &b->w_q)) ||
         (st = role_q(ctx, op, OPF_ROLE_GRAD_OUTPUT, 2, wgrad ? both : OPF_USAGE_ROWWISE, &b->dy_q))))
        return st;
    /* dequantized: the packs' layouts as the forward made them (rowwise only) */
    if (quant && ovr == OPF_BACKWARD_DEQUANTIZED &&
        ((st = role_q(ctx, op, OPF_ROLE_INPUT, 3, OPF_USAGE_ROWWISE, &b->x_q)) ||
         (st = role_q(ctx, op, OPF_ROLE_WEIGHT, 3, OPF_USAGE_ROWWISE, &b->w_q))))
        return st;
    return OPF_OK;  /* the runner runs the fake */
}

/* A graph replays args recorded once: it can neither follow the params
 * reference nor see new split sizes, which are data. */
static const char *unsupported(const opf_op *op)
{
    return "grouped_linear reads split sizes from its input's data and reaches its weights "
           "through a reference";
}

const opf_op_class opf_op_class_grouped_linear = {
    OPF_OP_CLASS_HEAD("grouped_linear", sizeof(opf_grouped_linear_config), &grouped_fwd_schema,
                      &grouped_bwd_schema),
    OPF_OP_CLASS_STD_HOOKS(init, setup_context),
    .module_type = "grouped_linear",
    .n_extra_in = 1,
    .n_gemms = 1,  /* the default; init sets the op's own to its group count */
    .unsupported_reason = unsupported,
};
