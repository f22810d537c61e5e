/* basic_linear.c: y = x W^T without bias (the anchor's BasicLinear,
 * the anchor's basic op; data flow of docs/numerics.md 5.2-5.5).
 *
 *   fprop  y  = gemm(W, x, TN)    W rowwise,    x rowwise
 *   dgrad  dx = gemm(W, dy, NN)   W columnwise, dy rowwise
 *   wgrad  dW = gemm(x, dy, NT)   x columnwise, dy columnwise
 *
 * Under a recipe the op quantizes with its own quantizers (input, weight,
 * grad_output of GEMM 0): x with rowwise (+ columnwise when the weight needs
 * a gradient), W with rowwise (+ columnwise when backward runs), dy with
 * rowwise (+ columnwise for wgrad). An input or gradient that arrives
 * already quantized in the right format with the copies needed is used as
 * is; one in another format is decoded and quantized again.
 *
 * Quantized outputs: y (and dx) come out quantized when the next op's input
 * quantizer (the previous op's grad-output quantizer) is set. Per-tensor FP8
 * (delayed or current scaling) is produced by the GEMM epilogue from the
 * fp32 result (numerics 5.3, "FP8 output"; the anchor allows delayed only).
 * Every other format goes through opf_op_store_f32: the fp32 result is
 * rounded to the activation dtype and quantized, bit for bit what the next
 * op would produce from the plain output.
 *
 * Weight cache (kwarg is_first_microbatch): -1 or no kwargs quantizes W in
 * forward_impl on every call (into aux[1]); 1 quantizes W, both copies, in
 * forward_impl too, into param->qvalue (args field w_cache): resolve_fwd
 * (the half that owns op state) only makes sure the buffer exists with the
 * quantizer's spec, reusing it when it already has it; 0 reads that copy
 * even if the weight changed since (OPF_ERR_STATE without one). 0 and 1
 * give the same args but for the field itself, which is a runtime kwarg
 * (OPF_FIELD_RUNTIME): one compiled graph runs every microbatch, writing the
 * call's value into its args. A quantized primary weight
 * (opf_op_set_param_quantized) is that cache for good: every call reads it
 * as is_first_microbatch == 0 does, whatever the kwarg says.
 *
 * Weight init: Kaiming-uniform with a = sqrt(5), i.e. U(-b, b) with
 * b = 1/sqrt(in_features), from the context's Philox stream: element i of
 * the [out, in] weight uses word i % 4 of
 *     Philox4x32-10(counter = {lo32(o + i/4), hi32(o + i/4), 0x4C494E57, 0},
 *                   key = {lo32(seed), hi32(seed)})
 * where o = opf_ctx_rng_advance(ctx, ceil(numel/4)) (so every op draws
 * fresh numbers) and 0x4C494E57 ("LINW") keeps the stream apart from the
 * stochastic-rounding counters; with u = (word >> 8) * 2^-24,
 * w = fl32(b * (2u - 1)) in double, then rounded to the weight dtype.
 *
 * Backward saves the weight operand and (for wgrad) the x operand; the x
 * copy keeps only its columnwise data where the format allows. With
 * accumulate_into_main_grad, wgrad writes the fp32 param->main_grad (added
 * unless is_first_microbatch == 1, numerics 5.5) and returns no gradient.
 *
 * Backward override (the recipe's backward_override, numerics.md 3.7,
 * as the anchor's notes on it say): fprop is quantized as always, x and W with their
 * rowwise copies only (nothing reads a columnwise copy); the backward
 * quantizes nothing: the op offers no grad-output quantizer (so the ops
 * before it emit plain gradients and BackwardActivationBias does not
 * apply), dy stays plain (a quantized dy is decoded), dx is plain, and
 * dgrad / wgrad are plain GEMMs on
 *   high_precision  the original W (the parameter) and x, saved instead of
 *                   the operands; so that x is the original, the op offers
 *                   no input quantizer either and quantizes x itself (the
 *                   neighbour's plain output rounded to the activation
 *                   dtype, then quantized: the same bits the neighbour
 *                   would have made, so the forward is unchanged);
 *   dequantized     the saved quantized operands, their rowwise copies
 *                   decoded to the activation dtype.
 *
 * The fused ops built around this op (forward_linear_*, backward_linear_*)
 * reuse its args, resolve, saved state and GEMMs through linear-impl.h; the
 * GEMM helpers therefore take alpha, a bias and a tensor to accumulate onto
 * (numerics 5.3: D = alpha * acc (+ bias) + beta * C). */
#include <math.h>

#include "backend/elem.h"
#include "core/device-impl.h"
#include "ops/basic/linear-impl.h"

#define LINW_TAG 0x4C494E57u  /* Philox counter word 2 of weight init */

static const opf_field linear_fwd_fields[] = {
    OPF_F_TENSOR_Q(opf_linear_fwd, x),  OPF_F_TENSOR_Q(opf_linear_fwd, w),
    OPF_F_OPT(opf_linear_fwd, w_cache),
    OPF_F_QUANT(opf_linear_fwd, x_q),   OPF_F_QUANT(opf_linear_fwd, w_q),
    OPF_F_QUANT(opf_linear_fwd, out_q), OPF_F_ENUM(opf_linear_fwd, x_mode),
    OPF_F_BOOL(opf_linear_fwd, wgrad),
    OPF_F(opf_linear_fwd, is_first_microbatch, OPF_FIELD_ENUM, OPF_FIELD_KWARG | OPF_FIELD_RUNTIME),
    OPF_F_ENUM(opf_linear_fwd, bwd_override)};
OPF_SHARED_SCHEMA(opf_linear_fwd_schema, opf_linear_fwd, linear_fwd_fields);

static const opf_field linear_bwd_fields[] = {
    OPF_F_TENSOR_Q(opf_linear_bwd, dy), OPF_F_TENSOR_Q(opf_linear_bwd, w),
    OPF_F_OPT(opf_linear_bwd, x),
    OPF_F(opf_linear_bwd, main_grad, OPF_FIELD_TENSOR, OPF_FIELD_OPTIONAL),
    OPF_F_TENSOR(opf_linear_bwd, weight),
    OPF_F_QUANT(opf_linear_bwd, dy_q),  OPF_F_QUANT(opf_linear_bwd, dx_q),
    OPF_F_ENUM(opf_linear_bwd, dy_mode), OPF_F_ENUM(opf_linear_bwd, act_dtype),
    OPF_F_BOOL(opf_linear_bwd, wgrad),  OPF_F_BOOL(opf_linear_bwd, to_main_grad),
    OPF_F(opf_linear_bwd, is_first_microbatch, OPF_FIELD_ENUM, OPF_FIELD_KWARG | OPF_FIELD_RUNTIME),
    OPF_F_ENUM(opf_linear_bwd, bwd_override)};
OPF_SHARED_SCHEMA(opf_linear_bwd_schema, opf_linear_bwd, linear_bwd_fields);

static const opf_field linear_kwargs_fields[] = {
    OPF_F(opf_basic_linear_kwargs, is_first_microbatch, OPF_FIELD_ENUM,
          OPF_FIELD_KWARG | OPF_FIELD_RUNTIME)};
OPF_SCHEMA(linear_kwargs_schema, opf_basic_linear_kwargs, linear_kwargs_fields);

/* attrs of the op context */
enum { AT_ACT_DTYPE, AT_WGRAD, AT_FIRST_MB, AT_ROWS, AT_QUANTIZED, AT_OVERRIDE };

static bool is_q(const opf_quantizer *q) { return q->scaling != OPF_SCALING_NONE; }
static bool is_nvfp4(opf_scaling s) { return s == OPF_SCALING_NVFP4_1D || s == OPF_SCALING_NVFP4_2D; }
/* Does the forward use the parameter's weight cache (written when
 * is_first_microbatch == 1, read as is when 0)? resolve sets w_cache exactly
 * then; deciding by value fields rather than by w_cache's data keeps the
 * fake right on data-free args. Both values give the same args but for the
 * runtime field itself, so one compiled graph runs every microbatch. */
static bool has_cache(const opf_linear_fwd *a)
{
    return a->is_first_microbatch >= 0 && is_q(&a->w_q);
}

/* Re-reports the thread's last error under the op's name (the message is
 * copied first: opf_error writes into the buffer it lives in). */
static opf_status fail(opf_ctx *ctx, const opf_op *op, opf_status st)
{
    char why[400];
    snprintf(why, sizeof why, "%s", opf_last_error(NULL));
    return opf_error(ctx, st, "basic_linear \"%s\": %s", opf_op_name(op), why);
}

/* ---- init ------------------------------------------------------------------ */

opf_status opf_linear_init_weight(opf_ctx *ctx, opf_tensor *w, int64_t fan_in, const char *who)
{
    const opf_elem_kernels *k = opf_op_elem(ctx, who, w);
    if (!k) return OPF_ERR_UNSUPPORTED;
    uint64_t seed, off;
    opf_ctx_get_rng(ctx, &seed, NULL);
    off = opf_ctx_rng_advance(ctx, (uint64_t)opf_ceil_div(opf_spec_numel(&w->spec), 4));
    return k->fill_uniform(ctx, seed, off, LINW_TAG, 1.0 / sqrt((double)fan_in), w);
}

static opf_status init(opf_ctx *ctx, opf_op *op)
{
    const opf_basic_linear_config *c = opf_op_config(op);
    const char *name = opf_op_name(op);
    if (c->in_features < 1 || c->out_features < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "basic_linear \"%s\": in_features %lld and "
                         "out_features %lld must both be >= 1", name, (long long)c->in_features,
                         (long long)c->out_features);
    if (!opf_is_act_dtype(c->dtype))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "basic_linear \"%s\": dtype %s, expected f32, "
                         "bf16 or f16", name, opf_dtype_name(c->dtype));
    int64_t shape[2] = {c->out_features, c->in_features};
    opf_spec s = opf_spec_make(2, shape, c->dtype);
    int i = opf_op_add_param(ctx, op, "weight", &s);
    if (i < 0) return (opf_status)-i;
    opf_param *p = opf_op_param(op, i);
    char who[96];
    snprintf(who, sizeof who, "basic_linear \"%s\"", name);
    opf_status st = opf_linear_init_weight(ctx, &p->value, c->in_features, who);
    if (!st && c->accumulate_into_main_grad) {
        opf_spec g = opf_spec_make(2, shape, OPF_F32);
        g.device = p->value.spec.device;
        if (!(st = opf_tensor_alloc(ctx, &g, &p->main_grad)))
            st = opf_op_elem(ctx, who, &p->main_grad)->fill(ctx, 0.0, &p->main_grad);
    }
    return st;
}

/* The backward override of the op's recipe state (none without one). */
static opf_backward_override op_override(const opf_op *op)
{
    const opf_recipe_state *rs = opf_op_recipe_state(op);
    return rs ? opf_recipe_state_recipe(rs)->backward_override : OPF_BACKWARD_NONE;
}

/* High precision: the op keeps its original input, so it takes it plain. */
static const opf_quantizer *input_quantizer(const opf_op *op)
{
    if (op_override(op) == OPF_BACKWARD_HIGH_PRECISION) return NULL;
    return opf_op_quantizer(op, OPF_ROLE_INPUT, 0);
}

/* Any override: the backward quantizes no gradient. */
static const opf_quantizer *grad_output_quantizer(const opf_op *op)
{
    if (op_override(op) != OPF_BACKWARD_NONE) return NULL;
    return opf_op_quantizer(op, OPF_ROLE_GRAD_OUTPUT, 0);
}

/* ---- shared helpers -------------------------------------------------------------- */

/* The op's quantizer for a role with the given copies (none without state). */
static opf_quantizer role_q(const opf_op *op, opf_tensor_role role, unsigned usage)
{
    opf_quantizer q = opf_q_or_none(opf_op_quantizer(op, role, 0));
    if (is_q(&q)) q.usage = usage;
    return q;
}

/* Can quantized t serve as an operand of quantizer q's format with the
 * copies in `need`? (Hadamard-rotated or not as q would make it.) */
static bool fits(const opf_spec *t, const opf_quantizer *q, unsigned need)
{
    if (t->scaling != q->scaling || t->qdtype != q->qdtype || (t->usage & need) != need)
        return false;
    if (!(need & OPF_USAGE_COLUMNWISE)) return true;
    return ((t->flags & OPF_SPEC_NVFP4_RHT) != 0) == (q->rht && is_nvfp4(q->scaling));
}

/* How to turn a (plain or quantized) input t into an operand for q. */
static int operand_mode(const opf_spec *t, const opf_quantizer *q)
{
    if (t->scaling == OPF_SCALING_NONE) return is_q(q) ? OPF_LIN_QUANTIZE : OPF_LIN_AS_IS;
    return is_q(q) && fits(t, q, q->usage) ? OPF_LIN_AS_IS : OPF_LIN_RECAST;
}

/* The operand's spec: t itself, its quantized spec, or (RECAST without a
 * quantizer) plain in `plain_dt`. */
static opf_status operand_spec(const opf_spec *t, int mode, const opf_quantizer *q,
                               opf_dtype plain_dt, opf_spec *out)
{
    if (mode == OPF_LIN_AS_IS) {
        *out = *t;
        return OPF_OK;
    }
    opf_spec plain = opf_spec_make(t->ndim, t->shape, t->dtype);
    plain.device = t->device;
    if (!is_q(q)) plain.dtype = plain_dt;
    return opf_op_out_spec(&plain, q, out);
}

/* A tensor of spec s in scratch memory, aligned like a buffer, zeroed. */
opf_status opf_linear_scratch_tensor(opf_ctx *ctx, const opf_spec *s, opf_tensor *t)
{
    opf_layout L;
    opf_status st = opf_spec_layout(s, &L);
    if (st) return opf_error(ctx, st, "linear: %s", opf_last_error(NULL));
    size_t bytes = L.total_bytes + OPF_COMPONENT_ALIGN;
    unsigned char *p = (unsigned char *)opf_op_scratch_on(ctx, s->device, (int64_t)((bytes + 3) / 4));
    if (!p) return opf_error(ctx, OPF_ERR_NO_MEMORY, "linear: no scratch for %zu bytes", bytes);
    uintptr_t a = ((uintptr_t)p + OPF_COMPONENT_ALIGN - 1) & ~(uintptr_t)(OPF_COMPONENT_ALIGN - 1);
    opf_tensor all;  /* every component at once, as bytes */
    opf_spec sb = opf_spec_make(1, (int64_t[]){(int64_t)L.total_bytes}, OPF_U8);
    sb.device = s->device;
    opf_tensor_wrap(&sb, (void *)a, &all);
    if ((st = opf_op_zero(ctx, "linear", &all))) return st;
    return opf_tensor_wrap(s, (void *)a, t);
}

/* Decodes quantized t to fp32 and writes it into out (plain: rounded to its
 * dtype; quantized: with q, rounded to t's logical dtype first unless q is
 * delayed, like any op output). */
static opf_status recast(opf_ctx *ctx, const opf_tensor *t, const opf_quantizer *q, opf_tensor *out)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *ws = opf_op_scratch(ctx, n);
    const float *v;
    if (!ws) return opf_error(ctx, OPF_ERR_NO_MEMORY, "basic_linear: no scratch for %lld floats",
                              (long long)n);
    opf_status st = opf_op_load_f32(ctx, t, ws, &v);
    return st ? st : opf_op_store_f32(ctx, v, t->spec.dtype, q, out);
}

/* y (fp32, t's shape) = the values of t: decoded when quantized, else cast. */
static opf_status load_into(opf_ctx *ctx, const opf_tensor *t, opf_tensor *y)
{
    const float *v;
    if (t->spec.scaling != OPF_SCALING_NONE) return opf_op_load_f32(ctx, t, y->data[OPF_COMP_DATA], &v);
    const opf_elem_kernels *k = opf_op_elem(ctx, "basic_linear", y);
    return k ? k->cast(ctx, t, y) : OPF_ERR_UNSUPPORTED;
}

/* D = alpha * gemm(a, b) (+ bias) (+ c) into d, plain or quantized with
 * out_q: per-tensor FP8 by the GEMM epilogue (it cannot accumulate), other
 * cases from an fp32 result in scratch. c goes straight into a plain d of
 * its own dtype (the GEMM then adds into d), else into the fp32 result. */
static opf_status gemm_out(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b,
                           opf_gemm_layout layout, const opf_gemm_options *opts,
                           const opf_tensor *c, const opf_quantizer *out_q, opf_dtype act,
                           opf_tensor *d)
{
    opf_gemm_options o = opts ? *opts : opf_gemm_options_default();
    o.accumulate = c != NULL;
    o.beta = 1.0f;
    o.out_quantizer = NULL;
    bool c_fits = c && c->spec.scaling == OPF_SCALING_NONE && c->spec.dtype == d->spec.dtype;
    opf_status st;
    if (!is_q(out_q) && (!c || c_fits)) {
        if (c && (st = opf_op_copy_tensor(ctx, "basic_linear", c, d))) return st;
        return opf_gemm(ctx, a, b, layout, &o, d);
    }
    if (!c && out_q->scaling == OPF_SCALING_TENSOR) {
        o.out_quantizer = out_q;
        return opf_gemm(ctx, a, b, layout, &o, d);
    }
    opf_spec s = opf_spec_make(d->spec.ndim, d->spec.shape, OPF_F32);
    s.device = d->spec.device;
    opf_tensor y;
    st = opf_linear_scratch_tensor(ctx, &s, &y);
    if (!st && c) st = load_into(ctx, c, &y);
    if (!st) st = opf_gemm(ctx, a, b, layout, &o, &y);
    return st ? st : opf_op_store_f32(ctx, y.data[OPF_COMP_DATA], act, out_q, d);
}

/* ---- forward ------------------------------------------------------------------------ */

opf_status opf_linear_forward_fake(const void *args, opf_spec *outs, opf_spec *aux)
{
    const opf_linear_fwd *a = args;
    opf_spec xs, ws, ys;
    opf_status st = operand_spec(&a->x.spec, a->x_mode, &a->x_q, a->x.spec.dtype, &xs);
    if (st) return st;
    if (a->x_mode != OPF_LIN_AS_IS) aux[OPF_LIN_AUX_X] = xs;
    bool cache = has_cache(a);
    if (is_q(&a->w_q)) {
        opf_spec plain_w = opf_spec_make(a->w.spec.ndim, a->w.spec.shape, a->w.spec.dtype);
        plain_w.device = a->w.spec.device;  /* w itself when it lives quantized */
        if ((st = opf_quantizer_spec(&a->w_q, &plain_w, &ws))) return st;
        if (cache && !opf_spec_equal(&ws, &a->w_cache.spec)) {
            char h[160], w[160];
            opf_spec_str(&a->w_cache.spec, h, sizeof h);
            opf_spec_str(&ws, w, sizeof w);
            return opf_error(NULL, OPF_ERR_SHAPE, "the weight cache is %s, the weight quantizer "
                             "makes %s", h, w);
        }
        if (!cache) aux[OPF_LIN_AUX_W] = ws;
    } else {
        ws = a->w.spec;
    }
    if ((st = opf_gemm_out_spec(&ws, &xs, OPF_GEMM_TN, a->x.spec.dtype, &ys))) return st;
    return opf_op_out_spec(&ys, &a->out_q, &outs[0]);
}

opf_status opf_linear_fprop(opf_ctx *ctx, const opf_linear_fwd *a, opf_tensor *aux,
                            const opf_gemm_options *opts, const opf_tensor *c,
                            const opf_quantizer *out_q, opf_tensor *d)
{
    const opf_tensor *x = &a->x, *w = &a->w;
    opf_tensor wc = a->w_cache;  /* the parameter's cache: written here */
    opf_tensor *ax = &aux[OPF_LIN_AUX_X], *aw = has_cache(a) ? &wc : &aux[OPF_LIN_AUX_W];
    opf_status st = OPF_OK;
    if (a->x_mode == OPF_LIN_QUANTIZE) st = opf_quantize(ctx, &a->x_q, x, ax);
    else if (a->x_mode == OPF_LIN_RECAST) st = recast(ctx, x, &a->x_q, ax);
    if (st) return st;
    if (a->x_mode != OPF_LIN_AS_IS) x = ax;
    if (is_q(&a->w_q)) {
        if (a->is_first_microbatch != 0 && (st = opf_quantize(ctx, &a->w_q, w, aw))) return st;
        w = aw;
    }
    return gemm_out(ctx, w, x, OPF_GEMM_TN, opts, c, out_q, a->x.spec.dtype, d);
}

static opf_status forward_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const opf_linear_fwd *a = args;
    return opf_linear_fprop(ctx, a, aux, NULL, NULL, &a->out_q, &outs[0]);
}

/* Input checks of resolve_fwd that need no recipe state. */
static opf_status check_input(opf_ctx *ctx, const opf_op *op, const opf_tensor *x)
{
    const opf_basic_linear_config *c = opf_op_config_const(op);
    const char *name = opf_op_name(op);
    if (!opf_is_act_dtype(x->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "basic_linear \"%s\": input dtype %s, expected f32, "
                         "bf16 or f16", name, opf_dtype_name(x->spec.dtype));
    int64_t k = x->spec.ndim ? x->spec.shape[x->spec.ndim - 1] : 0;
    if (x->spec.ndim < 1 || k != c->in_features)
        return opf_error(ctx, OPF_ERR_SHAPE, "basic_linear \"%s\": input has %lld features "
                         "(ndim %d), weight expects %lld", name, (long long)k, x->spec.ndim,
                         (long long)c->in_features);
    if (x->spec.scaling != OPF_SCALING_NONE && !(x->spec.usage & OPF_USAGE_ROWWISE) &&
        (x->spec.flags & OPF_SPEC_NVFP4_RHT))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "basic_linear \"%s\": the input's only copy is "
                         "a Hadamard-rotated columnwise copy; its values are not the input's", name);
    return OPF_OK;
}

/* The recipe state follows env->recipe (the fuser resets it too; this
 * covers ops driven on their own). */
static opf_status ensure_recipe(opf_ctx *ctx, opf_op *op, const opf_recipe *r)
{
    opf_recipe_state *rs = opf_op_recipe_state(op);
    const opf_recipe *have = rs ? opf_recipe_state_recipe(rs) : NULL;
    if (have && have->kind == r->kind && have->backward_override == r->backward_override)
        return OPF_OK;
    opf_status st = opf_op_reset_recipe(ctx, op, r);
    return st ? fail(ctx, op, st) : OPF_OK;
}

/* is_first_microbatch == 1: param->qvalue of spec `want` (the weight
 * quantizer's), for forward_impl to write. An existing buffer of that spec
 * is kept, so the cache's memory stays put from step to step (a compiled
 * graph records it once); otherwise a new one replaces it. */
static opf_status cache_buffer(opf_ctx *ctx, opf_op *op, opf_param *p, const opf_spec *want)
{
    bool have = p->qvalue.data[OPF_COMP_DATA] || p->qvalue.data[OPF_COMP_COL_DATA];
    if (!have || !opf_spec_equal(want, &p->qvalue.spec)) {
        opf_tensor t;
        opf_status st = opf_tensor_alloc(ctx, want, &t);
        if (st) return fail(ctx, op, st);
        opf_tensor_release(&p->qvalue);
        p->qvalue = t;
    }
    p->qvalue_valid = true;
    return OPF_OK;
}

/* is_first_microbatch == 0: the cache must exist and match the recipe. */
static opf_status check_cache(opf_ctx *ctx, const opf_op *op, const opf_param *p,
                              const opf_quantizer *wq)
{
    opf_spec want;
    opf_status st = opf_quantizer_spec(wq, &p->value.spec, &want);
    if (st) return fail(ctx, op, st);
    if (!p->qvalue_valid || !p->qvalue.data[OPF_COMP_DATA])
        return opf_error(ctx, OPF_ERR_STATE, "basic_linear \"%s\": is_first_microbatch=0 reuses "
                         "the cached quantized weight, but there is none (run with "
                         "is_first_microbatch=1 first; recipe changes and optimizer steps drop it)",
                         opf_op_name(op));
    if (!opf_spec_equal(&want, &p->qvalue.spec)) {
        char h[160], w[160];
        opf_spec_str(&p->qvalue.spec, h, sizeof h);
        opf_spec_str(&want, w, sizeof w);
        if (p->primary_q.scaling != OPF_SCALING_NONE)
            return opf_error(ctx, OPF_ERR_STATE, "basic_linear \"%s\": the weight lives quantized "
                             "as %s, the recipe makes %s (quantize it with the recipe's weight "
                             "quantizer, both copies)", opf_op_name(op), h, w);
        return opf_error(ctx, OPF_ERR_STATE, "basic_linear \"%s\": the cached weight is %s, the "
                         "recipe makes %s (run with is_first_microbatch=1)", opf_op_name(op), h, w);
    }
    return OPF_OK;
}

/* The class's resolve_fwd: everything but the cache's buffer, which waits
 * for the fake's checks (after_fake), so a refused call changes nothing. */
static opf_status resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    opf_linear_fwd *a = args;
    opf_ctx *ctx = env->ctx;
    const opf_basic_linear_config *c = opf_op_config(op);
    opf_param *p = opf_op_param(op, 0);
    const opf_basic_linear_kwargs *kw = env->kwargs;
    int first = kw ? kw->is_first_microbatch : -1;
    bool quant = env->recipe != NULL;
    opf_backward_override ovr = quant ? env->recipe->backward_override : OPF_BACKWARD_NONE;
    opf_status st = check_input(ctx, op, env->x);
    if (st) return st;
    if (first < -1 || first > 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "basic_linear \"%s\": is_first_microbatch %d "
                         "must be -1, 0 or 1", opf_op_name(op), first);
    if (quant && env->recipe->kind == OPF_RECIPE_NVFP4 &&
        (env->x->spec.dtype == OPF_F16 || c->dtype == OPF_F16))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "basic_linear \"%s\": nvfp4 GEMMs cannot write "
                         "f16 (input %s, weight %s); use bf16 or f32", opf_op_name(op),
                         opf_dtype_name(env->x->spec.dtype), opf_dtype_name(c->dtype));
    if (quant && (st = ensure_recipe(ctx, op, env->recipe))) return st;
    if (p->primary_q.scaling != OPF_SCALING_NONE) {
        /* a quantized primary weight is its own cache: read as is, never rewritten */
        if (!quant || ovr == OPF_BACKWARD_HIGH_PRECISION)
            return opf_error(ctx, OPF_ERR_UNSUPPORTED, "basic_linear \"%s\": the weight lives only "
                             "quantized; it needs a recipe%s", opf_op_name(op),
                             quant ? " without the high-precision backward override" : "");
        first = 0;
    }
    const unsigned both = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    a->wgrad = env->requires_grad && p->requires_grad;
    a->is_first_microbatch = first;
    a->bwd_override = ovr;
    a->x = *env->x;
    /* wgrad reads x's columnwise copy, unless an override keeps it out of
     * the backward's quantized GEMMs */
    bool colwise_x = a->wgrad && ovr == OPF_BACKWARD_NONE;
    a->x_q = quant ? role_q(op, OPF_ROLE_INPUT, colwise_x ? both : OPF_USAGE_ROWWISE)
                   : opf_quantizer_default();
    a->x_mode = operand_mode(&a->x.spec, &a->x_q);
    a->out_q = opf_q_or_none(env->next_input_q);
    a->w = first == 0 && p->primary_q.scaling != OPF_SCALING_NONE ? p->qvalue : p->value;
    /* dgrad reads W's columnwise copy; a cached copy keeps both for any call */
    bool colwise_w = env->requires_grad && ovr == OPF_BACKWARD_NONE;
    unsigned wu = colwise_w || first != -1 ? both : OPF_USAGE_ROWWISE;
    a->w_q = quant ? role_q(op, OPF_ROLE_WEIGHT, wu) : opf_quantizer_default();
    if (is_q(&a->w_q) && first == 0 && (st = check_cache(ctx, op, p, &a->w_q))) return st;
    /* the cache's spec for the fake's checks; its buffer only after them */
    if (has_cache(a) && (st = opf_quantizer_spec(&a->w_q, &p->value.spec, &a->w_cache.spec)))
        return fail(ctx, op, st);
    return OPF_OK;
}

/* After the fake accepted the args: the cache's buffer (is_first_microbatch
 * == 1 writes it, 0 reads it). */
static opf_status after_fake(opf_op *op, const opf_fwd_env *env, void *args, const opf_spec *outs,
                             const opf_spec *aux)
{
    opf_linear_fwd *a = args;
    if (!has_cache(a)) return OPF_OK;
    opf_param *p = opf_op_param(op, 0);
    opf_status st;
    if (a->is_first_microbatch == 1 && (st = cache_buffer(env->ctx, op, p, &a->w_cache.spec)))
        return st;
    a->w_cache = p->qvalue;
    return OPF_OK;
}

/* The class's traced steps for fused ops that cover basic_linear. */
opf_status opf_linear_resolve_fwd(opf_op *op, const opf_fwd_env *env, void *args)
{
    return resolve_fwd(op, env, args);
}

opf_status opf_linear_after_fake(opf_op *op, const opf_fwd_env *env, void *args)
{
    return after_fake(op, env, args, NULL, NULL);
}

opf_status opf_linear_setup_context(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux)
{
    const opf_linear_fwd *a = args;
    int64_t m, k;
    opf_shape_2d(&a->x.spec, &m, &k);
    /* high precision keeps the originals: the parameter (not its quantized
     * or cached copy) and the input as it came */
    bool orig = a->bwd_override == OPF_BACKWARD_HIGH_PRECISION;
    const opf_tensor *w = orig ? &opf_op_param(op, 0)->value
                        : has_cache(a) ? &a->w_cache
                        : is_q(&a->w_q) ? &aux[OPF_LIN_AUX_W] : &a->w;
    opf_tensor_retain(w, &octx->saved[0]);
    octx->n_saved = 1;
    if (a->wgrad)
        opf_tensor_retain(a->x_mode != OPF_LIN_AS_IS && !orig ? &aux[OPF_LIN_AUX_X] : &a->x,
                          &octx->saved[octx->n_saved++]);
    octx->attrs[AT_ACT_DTYPE] = a->x.spec.dtype;
    octx->attrs[AT_WGRAD] = a->wgrad;
    octx->attrs[AT_FIRST_MB] = a->is_first_microbatch;
    octx->attrs[AT_ROWS] = m;
    octx->attrs[AT_QUANTIZED] = octx->saved[0].spec.scaling != OPF_SCALING_NONE;
    octx->attrs[AT_OVERRIDE] = a->bwd_override;
    return OPF_OK;
}

/* ---- backward ----------------------------------------------------------------------- */

/* The dy operand's spec (RECAST without a quantizer decodes to fp32). */
static opf_status dy_spec(const opf_linear_bwd *b, opf_spec *out)
{
    return operand_spec(&b->dy.spec, b->dy_mode, &b->dy_q, OPF_F32, out);
}

/* The spec of a saved w or x as a backward GEMM operand: itself, or under
 * an override, when quantized, its plain decoded copy in act_dtype. */
static opf_spec saved_operand_spec(const opf_linear_bwd *b, const opf_spec *t)
{
    if (b->bwd_override == OPF_BACKWARD_NONE || t->scaling == OPF_SCALING_NONE) return *t;
    opf_spec s = opf_spec_make(t->ndim, t->shape, (opf_dtype)b->act_dtype);
    s.device = t->device;
    return s;
}

opf_status opf_linear_backward_fake(const void *bargs, opf_spec *grads)
{
    const opf_linear_bwd *b = bargs;
    opf_spec ds, dxs, dws, ws = saved_operand_spec(b, &b->w.spec);
    opf_status st = dy_spec(b, &ds);
    if (st || (st = opf_gemm_out_spec(&ws, &ds, OPF_GEMM_NN, (opf_dtype)b->act_dtype, &dxs)) ||
        (st = opf_op_out_spec(&dxs, &b->dx_q, &grads[0])))
        return st;
    if (!b->wgrad) return OPF_OK;
    opf_spec xs = saved_operand_spec(b, &b->x.spec);
    if ((st = opf_gemm_out_spec(&xs, &ds, OPF_GEMM_NT, b->weight.spec.dtype, &dws))) return st;
    if (!b->to_main_grad) grads[1] = b->weight.spec;
    return OPF_OK;
}

/* Makes the dy operand in scratch when it is not dy itself. */
static opf_status dy_operand(opf_ctx *ctx, const opf_linear_bwd *b, opf_tensor *t, const opf_tensor **out)
{
    *out = &b->dy;
    if (b->dy_mode == OPF_LIN_AS_IS) return OPF_OK;
    opf_spec s;
    opf_status st = dy_spec(b, &s);
    if (st || (st = opf_linear_scratch_tensor(ctx, &s, t))) return st;
    *out = t;
    if (b->dy_mode == OPF_LIN_QUANTIZE) return opf_quantize(ctx, &b->dy_q, &b->dy, t);
    if (!is_q(&b->dy_q)) {
        const float *v;
        return opf_op_load_f32(ctx, &b->dy, t->data[OPF_COMP_DATA], &v);
    }
    return recast(ctx, &b->dy, &b->dy_q, t);
}

/* A saved w or x as the backward operand: itself, or (override) its
 * rowwise copy, the one fprop read, decoded into scratch; a tensor with a
 * columnwise copy only (an input that came so) decodes that one. */
static opf_status saved_operand(opf_ctx *ctx, const opf_linear_bwd *b, const opf_tensor *t,
                                opf_tensor *tmp, const opf_tensor **out)
{
    *out = t;
    if (b->bwd_override == OPF_BACKWARD_NONE || t->spec.scaling == OPF_SCALING_NONE) return OPF_OK;
    opf_spec s = saved_operand_spec(b, &t->spec);
    opf_status st = opf_linear_scratch_tensor(ctx, &s, tmp);
    unsigned which = t->spec.usage & OPF_USAGE_ROWWISE ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE;
    if (!st) st = opf_dequantize(ctx, t, which, tmp);
    if (!st) *out = tmp;
    return st;
}

static opf_status wgrad_gemm(opf_ctx *ctx, const opf_linear_bwd *b, const opf_tensor *x,
                             const opf_tensor *dy, opf_gemm_options o, opf_tensor *grads)
{
    if (!b->to_main_grad) return opf_gemm(ctx, x, dy, OPF_GEMM_NT, &o, &grads[1]);
    o.accumulate = b->is_first_microbatch != 1;
    opf_tensor mg = b->main_grad;  /* written in place: the fp32 accumulator */
    return opf_gemm(ctx, x, dy, OPF_GEMM_NT, &o, &mg);
}

/* dgrad, then wgrad. wgrad needs nothing dgrad makes: where the device has
 * a side queue and finds dW too small to fill it alone, wgrad is queued
 * there after dgrad and runs beside it (the same bits either way; dgrad
 * still goes first, so a dgrad that fails leaves main_grad untouched). */
opf_status opf_linear_backward(opf_ctx *ctx, const opf_linear_bwd *b, float alpha,
                               const opf_tensor *c, opf_tensor *grads)
{
    opf_tensor dyq, wt, xt;
    const opf_tensor *dy, *w, *x = NULL;
    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = alpha;
    opf_status st = dy_operand(ctx, b, &dyq, &dy);
    if (!st) st = saved_operand(ctx, b, &b->w, &wt, &w);
    if (!st && b->wgrad) st = saved_operand(ctx, b, &b->x, &xt, &x);
    bool side = false;
    if (!st && b->wgrad) st = opf_device_side_fork(ctx, opf_spec_numel(&b->weight.spec), &side);
    if (!st) st = gemm_out(ctx, w, dy, OPF_GEMM_NN, &o, c, &b->dx_q, (opf_dtype)b->act_dtype,
                           &grads[0]);
    if (st || !b->wgrad) return st;
    if (!side) return wgrad_gemm(ctx, b, x, dy, o, grads);
    st = opf_device_side_enter(ctx);
    if (!st) st = wgrad_gemm(ctx, b, x, dy, o, grads);
    opf_status sj = opf_device_side_join(ctx);
    return st ? st : sj;
}

static opf_status backward_impl(opf_ctx *ctx, const void *bargs, opf_tensor *grads)
{
    return opf_linear_backward(ctx, bargs, 1.0f, NULL, grads);
}

static opf_status check_dy(opf_ctx *ctx, const opf_op *op, const opf_op_ctx *octx, const opf_tensor *dy)
{
    const opf_basic_linear_config *c = opf_op_config_const(op);
    int64_t m, n;
    opf_shape_2d(&dy->spec, &m, &n);
    if (!opf_is_act_dtype(dy->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "basic_linear \"%s\": gradient dtype %s, expected "
                         "f32, bf16 or f16", opf_op_name(op), opf_dtype_name(dy->spec.dtype));
    if (dy->spec.ndim < 1 || n != c->out_features || m != octx->attrs[AT_ROWS])
        return opf_error(ctx, OPF_ERR_SHAPE, "basic_linear \"%s\": gradient is [%lld, %lld] as "
                         "2D, the output was [%lld, %lld]", opf_op_name(op), (long long)m,
                         (long long)n, (long long)octx->attrs[AT_ROWS], (long long)c->out_features);
    return OPF_OK;
}

opf_status opf_linear_resolve_bwd(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env, void *bargs)
{
    opf_linear_bwd *b = bargs;
    opf_ctx *ctx = env->ctx;
    const opf_basic_linear_config *c = opf_op_config(op);
    opf_param *p = opf_op_param(op, 0);
    opf_status st = check_dy(ctx, op, octx, env->dy);
    if (st) return st;
    bool wgrad = octx->attrs[AT_WGRAD] != 0, quant = octx->attrs[AT_QUANTIZED] != 0;
    int ovr = (int)octx->attrs[AT_OVERRIDE];
    b->dy = *env->dy;
    b->w = octx->saved[0];
    b->weight = p->value;
    b->act_dtype = (int)octx->attrs[AT_ACT_DTYPE];
    b->is_first_microbatch = (int)octx->attrs[AT_FIRST_MB];
    b->bwd_override = ovr;
    /* an override quantizes no gradient, whatever the previous op offered */
    b->dx_q = ovr == OPF_BACKWARD_NONE ? octx->prev_grad_q : opf_quantizer_default();
    b->dy_q = opf_quantizer_default();
    if (quant && ovr == OPF_BACKWARD_NONE) {
        b->dy_q = role_q(op, OPF_ROLE_GRAD_OUTPUT,
                         OPF_USAGE_ROWWISE | (wgrad ? OPF_USAGE_COLUMNWISE : 0));
        if (!is_q(&b->dy_q))
            return opf_error(ctx, OPF_ERR_STATE, "basic_linear \"%s\": the forward was quantized "
                             "but the op has no recipe now (reset between forward and backward)",
                             opf_op_name(op));
    }
    b->dy_mode = operand_mode(&b->dy.spec, &b->dy_q);
    if (wgrad) {
        b->x = octx->saved[1];
        /* wgrad reads x's columnwise copy only (per-tensor FP8 cannot hold
         * a columnwise copy alone); an override decodes the rowwise one. */
        if (ovr == OPF_BACKWARD_NONE && b->x.spec.scaling != OPF_SCALING_NONE &&
            b->x.spec.scaling != OPF_SCALING_TENSOR &&
            b->x.spec.usage == (OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE) &&
            (st = opf_tensor_update_usage(ctx, &b->x, OPF_USAGE_COLUMNWISE)))
            return fail(ctx, op, st);
        b->wgrad = true;
        b->to_main_grad = c->accumulate_into_main_grad;
        if (b->to_main_grad) b->main_grad = p->main_grad;
    }
    return OPF_OK;  /* the runner's backward_fake checks the rest (fused ops: their fake) */
}

const opf_op_class opf_op_class_basic_linear = {
    OPF_OP_CLASS_HEAD("basic_linear", sizeof(opf_basic_linear_config), &opf_linear_fwd_schema,
                      &opf_linear_bwd_schema),
    .module_type = "linear",
    .kwargs_schema = &linear_kwargs_schema,
    .n_gemms = 1,
    .init = init,
    .input_quantizer = input_quantizer,
    .grad_output_quantizer = grad_output_quantizer,
    .resolve_fwd = resolve_fwd,
    .after_fake = after_fake,
    .setup_context = opf_linear_setup_context,
    .resolve_bwd = opf_linear_resolve_bwd,
    .forward_fake = opf_linear_forward_fake,
    .forward_impl = forward_impl,
    .backward_fake = opf_linear_backward_fake,
    .backward_impl = backward_impl,
};
