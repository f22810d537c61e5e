/* op.c: op instances (config, parameters, recipe state, channel bindings)
 * and the helpers op implementations share to read and write tensors. */
#include <stdio.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "core/core-impl.h"
#include "op/op-impl.h"
#include "quant/quant-impl.h"

/* Bytes of a block part, rounded so that the next part stays aligned for
 * any type an args struct or config may hold. */
static size_t part_bytes(size_t n)
{
    const size_t a = _Alignof(max_align_t);
    return (n + a - 1) / a * a;
}

static size_t schema_bytes(const opf_schema *s) { return s ? part_bytes(s->size) : 0; }

/* A zeroed op of class cls in one block from ctx: the struct, config_size
 * bytes of config, then the class's forward and backward args. NULL (with
 * the error set) when out of memory. */
static opf_op *op_new(opf_ctx *ctx, const char *fn, const opf_op_class *cls, size_t config_size)
{
    size_t at_cfg = part_bytes(sizeof(opf_op)), at_fwd = at_cfg + part_bytes(config_size);
    size_t at_bwd = at_fwd + schema_bytes(cls->fwd_schema);
    size_t bytes = at_bwd + schema_bytes(cls->bwd_schema);
    unsigned char *mem = opf_ctx_calloc(ctx, 1, bytes);
    if (!mem) {
        opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: %s: out of memory (%zu bytes)", fn, cls->name, bytes);
        return NULL;
    }
    opf_op *op = (opf_op *)mem;
    op->cls = cls;
    op->ctx = ctx;
    op->bytes = bytes;
    op->config = config_size ? mem + at_cfg : NULL;
    op->fwd_args = cls->fwd_schema ? mem + at_fwd : NULL;
    op->bwd_args = cls->bwd_schema ? mem + at_bwd : NULL;
    return op;
}

opf_status opf_op_create(opf_ctx *ctx, const char *class_name, const void *config,
                         const char *name, opf_op **out)
{
    const char *fn = "opf_op_create";
    OPF_CHECK_NULL(ctx, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, out);
    *out = NULL;
    OPF_CHECK_NULL(ctx, fn, class_name);
    const opf_op_class *cls = opf_op_class_find(class_name);
    if (!cls)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: no op class \"%s\" is registered", fn,
                         class_name);
    if (!config) config = cls->config_default;
    if (cls->config_size && !config)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s needs a config", fn, class_name);
    if (cls->covers > 0)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s is a fused class; use opf_fused_op_create",
                         fn, class_name);
    opf_op *op = op_new(ctx, fn, cls, cls->config_size);
    if (!op) return OPF_ERR_NO_MEMORY;
    if (op->config) memcpy(op->config, config, cls->config_size);
    op->n_gemms = cls->n_gemms;  /* the default; init may set a per-instance count */
    op->n_extra_in = cls->n_extra_in;
    op->n_extra_out = cls->n_extra_out;
    snprintf(op->name, sizeof op->name, "%s", name ? name : class_name);
    opf_status st = cls->init ? cls->init(ctx, op) : OPF_OK;
    if (st) {
        opf_op_destroy(op);
        return st;
    }
    *out = op;
    return OPF_OK;
}

void opf_op_destroy(opf_op *op)
{
    if (!op) return;
    if (op->cls->fini) op->cls->fini(op);
    for (int i = 0; i < op->n_params; i++) {
        opf_param *p = &op->params[i];
        opf_tensor_release(&p->value);
        opf_tensor_release(&p->grad);
        opf_tensor_release(&p->main_grad);
        opf_tensor_release(&p->qvalue);
    }
    opf_recipe_state_destroy(op->rs);
    opf_ctx_free(op->ctx, op->params, (size_t)op->cap_params * sizeof *op->params);
    opf_ctx_free(op->ctx, op, op->bytes);
}

const opf_op_class *opf_op_class_of(const opf_op *op) { return op->cls; }
const char *opf_op_name(const opf_op *op) { return op->name; }
void *opf_op_config(opf_op *op) { return op->config; }
const void *opf_op_config_const(const opf_op *op) { return op->config; }
int opf_op_num_params(const opf_op *op)
{
    if (!op->n_basic) return op->n_params;
    int n = 0;
    for (int k = 0; k < op->n_basic; k++) n += op->basic[k]->n_params;
    return n;
}

opf_param *opf_op_param(opf_op *op, int i)
{
    if (i < 0) return NULL;
    if (!op->n_basic) return i < op->n_params ? &op->params[i] : NULL;
    for (int k = 0; k < op->n_basic; k++) {
        if (i < op->basic[k]->n_params) return &op->basic[k]->params[i];
        i -= op->basic[k]->n_params;
    }
    return NULL;
}

const opf_param *opf_op_param_const(const opf_op *op, int i) { return opf_op_param((opf_op *)op, i); }

int opf_op_num_basic(const opf_op *op) { return op->n_basic ? op->n_basic : 1; }
opf_op *opf_op_basic(const opf_op *op, int i)
{
    if (!op->n_basic) return i == 0 ? (opf_op *)op : NULL;
    return i >= 0 && i < op->n_basic ? op->basic[i] : NULL;
}
bool opf_op_is_fused(const opf_op *op) { return op->n_basic > 0; }
int opf_op_num_extra_in(const opf_op *op) { return op->n_extra_in; }
int opf_op_num_extra_out(const opf_op *op) { return op->n_extra_out; }

opf_status opf_fused_op_create(opf_ctx *ctx, const char *class_name, opf_op *const *basic, int n,
                               opf_op **out)
{
    const char *fn = "opf_fused_op_create";
    OPF_CHECK_NULL(ctx, fn, out);
    *out = NULL;
    OPF_CHECK_NULL(ctx, fn, class_name);
    OPF_CHECK_NULL(ctx, fn, basic);
    const opf_op_class *cls = opf_op_class_find(class_name);
    if (!cls || cls->covers <= 0)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: \"%s\" is not a registered fused class", fn,
                         class_name);
    if (n != cls->covers || n > OPF_FUSED_MAX)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s covers %d ops, got %d", fn, class_name,
                         cls->covers, n);
    int ein = 0, eout = 0;
    for (int k = 0; k < n; k++) {
        if (!basic[k] || basic[k]->n_basic)
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s: op %d is %s", fn, class_name, k,
                             basic[k] ? "itself fused (fusions never nest)" : "NULL");
        ein += basic[k]->n_extra_in;
        eout += basic[k]->n_extra_out;
    }
    if (ein > OPF_OP_MAX_EXTRA || eout > OPF_OP_MAX_EXTRA)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s: %d/%d extra inputs/outputs > %d", fn,
                         class_name, ein, eout, OPF_OP_MAX_EXTRA);
    opf_op *op = op_new(ctx, fn, cls, 0);
    if (!op) return OPF_ERR_NO_MEMORY;
    op->n_gemms = cls->n_gemms;
    op->n_basic = n;
    memcpy(op->basic, basic, sizeof *basic * (size_t)n);
    op->n_extra_in = ein;
    op->n_extra_out = eout;
    int len = snprintf(op->name, sizeof op->name, "%s(", class_name);
    for (int k = 0; k < n && len > 0 && (size_t)len < sizeof op->name; k++)
        len += snprintf(op->name + len, sizeof op->name - (size_t)len, "%s%s", k ? "," : "", basic[k]->name);
    if (len > 0 && (size_t)len < sizeof op->name) snprintf(op->name + len, sizeof op->name - (size_t)len, ")");
    opf_status st = cls->init ? cls->init(ctx, op) : OPF_OK;
    if (st) {
        opf_op_destroy(op);
        return st;
    }
    *out = op;
    return OPF_OK;
}
void *opf_op_user(opf_op *op) { return op->user; }
void opf_op_set_user(opf_op *op, void *user) { op->user = user; }
opf_recipe_state *opf_op_recipe_state(const opf_op *op) { return op->rs; }

/* Doubles the parameter slots (one at first: the linear ops have one, the
 * norms two; a slot is over 600 bytes). Runs at create time only. */
static opf_status grow_params(opf_op *op)
{
    int cap = op->cap_params ? 2 * op->cap_params : 1;
    if (cap > OPF_OP_MAX_PARAMS) cap = OPF_OP_MAX_PARAMS;
    opf_param *p = opf_ctx_calloc(op->ctx, (size_t)cap, sizeof *p);
    if (!p)
        return opf_error(op->ctx, OPF_ERR_NO_MEMORY, "%s: no memory for %d parameters", op->name,
                         cap);
    if (op->n_params) memcpy(p, op->params, (size_t)op->n_params * sizeof *p);
    opf_ctx_free(op->ctx, op->params, (size_t)op->cap_params * sizeof *p);
    op->params = p;
    op->cap_params = cap;
    return OPF_OK;
}

int opf_op_add_param(opf_ctx *ctx, opf_op *op, const char *name, const opf_spec *spec)
{
    if (!ctx || !op || !name || !spec)
        return -(int)opf_error(ctx, OPF_ERR_INVALID_ARG, "opf_op_add_param: %s is NULL",
                               !ctx ? "ctx" : !op ? "op" : !name ? "name" : "spec");
    if (op->n_params == OPF_OP_MAX_PARAMS)
        return -(int)opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: more than %d parameters", op->name,
                               OPF_OP_MAX_PARAMS);
    if (op->n_params == op->cap_params && grow_params(op)) return -(int)OPF_ERR_NO_MEMORY;
    opf_param *p = &op->params[op->n_params];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    opf_spec on = *spec;  /* parameters live on the context's device */
    on.device = opf_ctx_device(ctx);
    opf_status st = opf_tensor_alloc(ctx, &on, &p->value);
    if (!st) st = opf_tensor_alloc(ctx, &on, &p->grad);
    if (st) {
        opf_tensor_release(&p->value);
        return -(int)st;
    }
    if (!st) st = opf_op_zero(ctx, op->name, &p->value);
    if (!st) st = opf_op_zero(ctx, op->name, &p->grad);
    if (st) {
        opf_tensor_release(&p->value);
        opf_tensor_release(&p->grad);
        return -(int)st;
    }
    p->requires_grad = true;
    return op->n_params++;
}

opf_status opf_op_set_param_quantized(opf_ctx *ctx, opf_op *op, int i, const opf_quantizer *q)
{
    const char *fn = "opf_op_set_param_quantized";
    OPF_CHECK_NULL(ctx, fn, op);
    OPF_CHECK_NULL(ctx, fn, q);
    opf_param *p = opf_op_param(op, i);
    if (!p)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: \"%s\" has no parameter %d", fn, op->name, i);
    if (p->primary_q.scaling != OPF_SCALING_NONE || !p->value.data[OPF_COMP_DATA])
        return opf_error(ctx, OPF_ERR_STATE, "%s: \"%s\" parameter \"%s\" is already quantized",
                         fn, op->name, p->name);
    if (q->scaling == OPF_SCALING_NONE || q->delayed)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: \"%s\" parameter \"%s\": the quantizer "
                         "must quantize without delayed scaling (its scale would need an amax "
                         "history the parameter does not keep)", fn, op->name, p->name);
    opf_tensor t;
    opf_status st = opf_quantize_alloc(ctx, q, &p->value, &t);
    if (st) return st;
    opf_tensor_release(&p->qvalue);
    p->qvalue = t;
    p->qvalue_valid = true;
    p->primary_q = *q;
    opf_spec logical = p->value.spec;  /* the value's data goes: only the quantized copy stays */
    opf_tensor_release(&p->value);
    p->value.spec = logical;
    return OPF_OK;
}

/* ---- per-op recipe override --------------------------------------------------------- */

static opf_status recipe_settable(const opf_op *op, const char *fn)
{
    OPF_CHECK_NULL(NULL, fn, op);
    if (op->n_basic)
        return opf_error(op->ctx, OPF_ERR_INVALID_ARG, "%s: \"%s\" is a fused op; set the recipe of "
                         "its basic ops", fn, op->name);
    if (op->locked)
        return opf_error(op->ctx, OPF_ERR_STATE, "%s: op \"%s\": its seq has been built (plans and "
                         "graphs assume the recipe); set it before the seq's first forward", fn,
                         op->name);
    return OPF_OK;
}

/* The state of the old recipe goes; the next forward builds the new one. */
static void drop_recipe_state(opf_op *op)
{
    opf_recipe_state_destroy(op->rs);
    op->rs = NULL;
    op->recipe_kind = OPF_RECIPE_NONE;
    for (int i = 0; i < op->n_params; i++)  /* a quantized primary is no cache: it stays */
        if (op->params[i].primary_q.scaling == OPF_SCALING_NONE) op->params[i].qvalue_valid = false;
}

opf_status opf_op_set_recipe(opf_op *op, const opf_recipe *r)
{
    const char *fn = "opf_op_set_recipe";
    opf_status st = recipe_settable(op, fn);
    if (st) return st;
    if (r && (st = opf_recipe_validate(r)))
        return opf_error(op->ctx, st, "%s: op \"%s\": %s", fn, op->name, opf_last_error(NULL));
    if (r && r->kind == OPF_RECIPE_NONE) r = NULL;
    op->has_own_recipe = true;
    op->own_quantized = r != NULL;
    if (r) op->own_recipe = *r;
    drop_recipe_state(op);
    return OPF_OK;
}

opf_status opf_op_clear_recipe(opf_op *op)
{
    opf_status st = recipe_settable(op, "opf_op_clear_recipe");
    if (st || !op->has_own_recipe) return st;
    op->has_own_recipe = false;
    drop_recipe_state(op);
    return OPF_OK;
}

bool opf_op_has_recipe(const opf_op *op, const opf_recipe **r)
{
    if (r) *r = op && op->has_own_recipe && op->own_quantized ? &op->own_recipe : NULL;
    return op && op->has_own_recipe;
}

const opf_recipe *opf_op_recipe_for(const opf_op *op, const opf_recipe *call)
{
    if (!op->has_own_recipe) return call;
    return op->own_quantized ? &op->own_recipe : NULL;
}

opf_status opf_op_reset_recipe(opf_ctx *ctx, opf_op *op, const opf_recipe *r)
{
    r = opf_op_recipe_for(op, r);
    opf_recipe_kind kind = r ? r->kind : OPF_RECIPE_NONE;
    if (op->n_gemms == 0) return OPF_OK;
    opf_recipe_state *rs = NULL;
    if (kind != OPF_RECIPE_NONE) {
        opf_status st = opf_recipe_state_create(ctx, r, op->cls->module_type, op->name,
                                                op->n_gemms, &rs);
        if (st) return st;
    }
    drop_recipe_state(op);
    op->rs = rs;
    op->recipe_kind = kind;
    return OPF_OK;
}

const opf_quantizer *opf_op_quantizer(const opf_op *op, opf_tensor_role role, int gemm)
{
    if ((unsigned)role >= OPF_ROLE_COUNT || !op->rs) return NULL;
    opf_quantizer *q = (opf_quantizer *)&op->qslot[role];  /* per-op storage, valid until the next call */
    if (opf_recipe_state_quantizer(op->rs, role, gemm, q)) return NULL;
    return q->scaling == OPF_SCALING_NONE ? NULL : q;
}

static opf_status bind(opf_op *op, opf_channel_bind *b, int n, int index, const char *channel,
                       bool to_caller, const char *what)
{
    if (op->locked)
        return opf_error(NULL, OPF_ERR_STATE, "%s: channel bindings are locked once a sequence "
                         "has run the op", op->name);
    if (index < 0 || index >= n)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: extra %s index %d outside 0..%d", op->name,
                         what, index, n - 1);
    if (channel && (!*channel || strlen(channel) >= sizeof b->name))
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: channel name \"%s\" must be 1..%zu chars",
                         op->name, channel, sizeof b->name - 1);
    snprintf(b[index].name, sizeof b[index].name, "%s", channel ? channel : "");
    b[index].to_caller = to_caller;
    return OPF_OK;
}

opf_status opf_op_set_extra_input(opf_op *op, int index, const char *channel)
{
    OPF_CHECK_NULL(NULL, "opf_op_set_extra_input", op);
    return bind(op, op->extra_in, op->n_extra_in, index, channel, false, "input");
}

opf_status opf_op_set_extra_output(opf_op *op, int index, const char *channel, bool to_caller)
{
    OPF_CHECK_NULL(NULL, "opf_op_set_extra_output", op);
    return bind(op, op->extra_out, op->n_extra_out, index, channel, to_caller, "output");
}

void opf_op_ctx_clear(opf_op_ctx *c)
{
    for (int i = 0; i < c->n_saved; i++) opf_tensor_release(&c->saved[i]);
    c->n_saved = 0;
    c->valid = false;
}

/* ---- helpers for implementations ------------------------------------------ */

float *opf_op_scratch_on(opf_ctx *ctx, opf_device dev, int64_t n)
{
    return opf_ctx_scratch_push_on(ctx, dev, (size_t)(n > 0 ? n : 1) * sizeof(float));
}

float *opf_op_scratch(opf_ctx *ctx, int64_t n)
{
    return opf_op_scratch_on(ctx, opf_ctx_device(ctx), n);
}

opf_status opf_op_load_f32(opf_ctx *ctx, const opf_tensor *t, float *ws, const float **out)
{
    if (t->spec.scaling == OPF_SCALING_NONE && t->spec.dtype == OPF_F32) {
        *out = t->data[OPF_COMP_DATA];
        return OPF_OK;
    }
    opf_tensor w;
    opf_spec s = opf_spec_make(t->spec.ndim, t->spec.shape, OPF_F32);
    s.device = t->spec.device;
    opf_tensor_wrap(&s, ws, &w);
    *out = ws;
    if (t->spec.scaling == OPF_SCALING_NONE) {
        const struct opf_elem_kernels *k = opf_op_elem(ctx, "load", t);
        return k ? k->cast(ctx, t, &w) : OPF_ERR_UNSUPPORTED;
    }
    unsigned which = (t->spec.usage & OPF_USAGE_ROWWISE) ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE;
    return opf_dequantize(ctx, t, which, &w);
}

/* An fp32 tensor of spec like's shape and device in scratch. */
static opf_status f32_scratch(opf_ctx *ctx, const opf_spec *like, opf_tensor *out)
{
    int64_t n = opf_spec_numel(like);
    float *ws = opf_op_scratch_on(ctx, like->device, n);
    if (!ws) return opf_error(ctx, OPF_ERR_NO_MEMORY, "op: no scratch for %lld floats", (long long)n);
    opf_spec s = opf_spec_make(like->ndim, like->shape, OPF_F32);
    s.device = like->device;
    return opf_tensor_wrap(&s, ws, out);
}

opf_status opf_op_plain_view(opf_ctx *ctx, const opf_tensor *t, opf_tensor *out)
{
    if (t->spec.scaling == OPF_SCALING_NONE) {
        *out = *t;
        return OPF_OK;
    }
    const float *v;
    opf_status st = f32_scratch(ctx, &t->spec, out);
    return st ? st : opf_op_load_f32(ctx, t, out->data[OPF_COMP_DATA], &v);
}

opf_status opf_op_kernel_out(opf_ctx *ctx, const opf_tensor *out, opf_tensor *target)
{
    if (out->spec.scaling != OPF_SCALING_NONE) return f32_scratch(ctx, &out->spec, target);
    *target = *out;
    return OPF_OK;
}

const struct opf_elem_kernels *opf_op_elem(opf_ctx *ctx, const char *who, const opf_tensor *t)
{
    if (opf_device_check(ctx, who, "the tensor", t->spec.device)) return NULL;
    return opf_backend_kernels(ctx, who, t->spec.device, OPF_KERNELS_ELEM);
}

opf_status opf_op_zero(opf_ctx *ctx, const char *who, opf_tensor *t)
{
    opf_layout L;
    if (!t->data[0] || opf_spec_layout(&t->spec, &L)) return OPF_OK;
    if (t->spec.device == OPF_DEVICE_CPU) {
        memset(t->data[0], 0, L.comp[0].nbytes);
        return OPF_OK;
    }
    const struct opf_elem_kernels *k = opf_op_elem(ctx, who, t);
    opf_tensor bytes;  /* the first component as bytes: fill 0 zeroes any dtype */
    opf_spec s = opf_spec_make(1, (int64_t[]){(int64_t)L.comp[0].nbytes}, OPF_U8);
    s.device = t->spec.device;
    opf_tensor_wrap(&s, t->data[0], &bytes);
    return k ? k->fill(ctx, 0.0, &bytes) : OPF_ERR_UNSUPPORTED;
}

opf_status opf_op_add(opf_ctx *ctx, const char *who, const opf_tensor *a, const opf_tensor *b,
                      opf_tensor *out)
{
    const struct opf_elem_kernels *k = opf_op_elem(ctx, who, out);
    opf_tensor pa, pb;
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = opf_op_plain_view(ctx, a, &pa);
    if (!st) st = opf_op_plain_view(ctx, b, &pb);
    return st ? st : k->add(ctx, &pa, &pb, out);
}

bool opf_op_qout(const opf_quantizer *q, opf_dtype act_dtype, opf_tensor *out,
                 opf_quantize_state *qs, opf_qout *o)
{
    bool quantized = q && q->scaling != OPF_SCALING_NONE;
    if (quantized && (q->stochastic || opf_quantize_check_state_device(NULL, "store", q,
                                                                       out->spec.device)))
        return false;
    memset(qs, 0, sizeof *qs);
    if (quantized) opf_quantize_state_delayed(q, qs);
    *o = (opf_qout){.out = out, .q = quantized ? q : NULL, .state = qs,
                    .hp = quantized && !q->delayed ? act_dtype : OPF_F32};
    return true;
}

opf_status opf_op_out_spec(const opf_spec *plain, const opf_quantizer *q, opf_spec *out)
{
    if (!q || q->scaling == OPF_SCALING_NONE) {
        *out = *plain;
        return OPF_OK;
    }
    return opf_quantizer_spec(q, plain, out);
}

/* t (fp32) becomes a scratch copy of itself rounded to dt and back (RNE),
 * by two casts of the device's kernels. */
static opf_status round_through(opf_ctx *ctx, const struct opf_elem_kernels *k, opf_dtype dt,
                                opf_tensor *t)
{
    opf_tensor h, r;
    opf_status st = f32_scratch(ctx, &t->spec, &h);  /* n floats hold n values of dt */
    if (!st) st = f32_scratch(ctx, &t->spec, &r);
    h.spec.dtype = dt;
    if (!st) st = k->cast(ctx, t, &h);
    if (!st) st = k->cast(ctx, &h, &r);
    if (!st) *t = r;
    return st;
}

opf_status opf_op_store_f32(opf_ctx *ctx, const float *y, opf_dtype act_dtype,
                            const opf_quantizer *q, opf_tensor *out)
{
    const struct opf_elem_kernels *k = opf_op_elem(ctx, "store", out);
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_tensor in;
    opf_spec s = opf_spec_make(out->spec.ndim, out->spec.shape, OPF_F32);
    s.device = out->spec.device;
    opf_status st = opf_tensor_wrap(&s, (void *)y, &in);
    if (st) return opf_error(ctx, st, "store: %s", opf_last_error(NULL));
    if (out->spec.scaling == OPF_SCALING_NONE) return k->cast(ctx, &in, out);
    /* Delayed scaling casts the fp32 value; other recipes see the value
     * rounded to the activation dtype first (numerics.md 6.1, 6.3). */
    size_t mark = opf_ctx_scratch_mark(ctx);
    if (!q->delayed && act_dtype != OPF_F32) st = round_through(ctx, k, act_dtype, &in);
    opf_tensor view = *out;
    view.spec.dtype = OPF_F32;  /* quantized layouts do not depend on the logical dtype */
    if (!st) st = opf_quantize(ctx, q, &in, &view);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

opf_status opf_op_copy_tensor(opf_ctx *ctx, const char *who, const opf_tensor *src, opf_tensor *dst)
{
    opf_layout ls, ld;
    if (opf_spec_layout(&src->spec, &ls) || opf_spec_layout(&dst->spec, &ld))
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: %s", who, opf_last_error(NULL));
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (ls.comp[c].present != ld.comp[c].present || ls.comp[c].nbytes != ld.comp[c].nbytes)
            return opf_error(ctx, OPF_ERR_SHAPE, "%s: component %d of the copy has %zu bytes, "
                             "the source %zu", who, c, ld.comp[c].nbytes, ls.comp[c].nbytes);
    }
    const struct opf_elem_kernels *k = opf_op_elem(ctx, who, dst);
    opf_status st = k ? OPF_OK : OPF_ERR_UNSUPPORTED;
    for (int c = 0; c < OPF_COMP_COUNT && !st; c++)
        if (ls.comp[c].present && ls.comp[c].nbytes && src->data[c] != dst->data[c])
            st = k->copy(ctx, src->data[c], dst->data[c], ls.comp[c].nbytes);
    return st;
}
