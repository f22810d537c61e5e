/* names.c: what a checkpoint of a seq holds and what each tensor is called
 * (the scheme of docs/checkpoint.md), and the metadata strings that
 * describe recipes and quantized specs. Saving and loading both build their
 * lists here, so the two can never disagree on a name. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/io-impl.h"

/* Suffixes of the quantized copy's components, in opf_component order. */
static const char *const comp_names[] = {
    [OPF_COMP_DATA] = "data",         [OPF_COMP_SCALE_INV] = "scale_inv",
    [OPF_COMP_COL_DATA] = "col_data", [OPF_COMP_COL_SCALE_INV] = "col_scale_inv",
    [OPF_COMP_AMAX] = "amax",         [OPF_COMP_COL_AMAX] = "col_amax",
};
_Static_assert(sizeof comp_names / sizeof comp_names[0] == OPF_COMP_COUNT,
               "comp_names must name every component");

void opf_ck_list_free(opf_ck_list *l)
{
    for (int i = 0; i < l->n; i++) opf_ctx_free(l->ctx, l->v[i].staged, l->v[i].nbytes);
    if (l->ctx) opf_ctx_free(l->ctx, l->v, sizeof *l->v * (size_t)l->cap);
    memset(l, 0, sizeof *l);
}

/* nbytes between host memory and an item's place, as u8 tensors. */
static opf_status item_copy(opf_ctx *ctx, const opf_ck_item *it, void *host, bool to_host)
{
    opf_spec s = opf_spec_make(1, (int64_t[]){(int64_t)it->nbytes}, OPF_U8);
    opf_tensor h, d;
    opf_tensor_wrap(&s, host, &h);
    s.device = it->device;
    opf_tensor_wrap(&s, it->ptr, &d);
    return to_host ? opf_tensor_copy(ctx, &d, &h) : opf_tensor_copy(ctx, &h, &d);
}

opf_status opf_ck_stage(opf_ctx *ctx, opf_ck_list *l)
{
    for (int i = 0; i < l->n; i++) {
        opf_ck_item *it = &l->v[i];
        if (it->device == OPF_DEVICE_CPU || !it->nbytes || it->staged) continue;
        if (!(it->staged = opf_ctx_alloc(l->ctx, it->nbytes)))
            return opf_error(ctx, OPF_ERR_NO_MEMORY, "checkpoint: no host memory for \"%s\" "
                             "(%zu bytes)", it->name, it->nbytes);
        opf_status st = item_copy(ctx, it, it->staged, true);
        if (st) return st;
    }
    return OPF_OK;
}

opf_status opf_ck_item_put(opf_ctx *ctx, const opf_ck_item *it, const void *src)
{
    if (it->device != OPF_DEVICE_CPU) return item_copy(ctx, it, (void *)src, false);
    memcpy(it->ptr, src, it->nbytes);
    return OPF_OK;
}

static opf_status add(const opf_ck_src *s, opf_ck_list *l, const char *name, opf_st_dtype dt,
                      int ndim, const int64_t *shape, size_t nbytes, void *ptr, opf_device dev)
{
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        opf_ck_item *v = opf_ctx_alloc(l->ctx, sizeof *v * (size_t)cap);
        if (!v) return opf_error(s->ctx, OPF_ERR_NO_MEMORY, "checkpoint \"%s\": out of memory", s->who);
        if (l->n) memcpy(v, l->v, sizeof *v * (size_t)l->n);
        opf_ctx_free(l->ctx, l->v, sizeof *v * (size_t)l->cap);
        l->v = v, l->cap = cap;
    }
    opf_ck_item *it = &l->v[l->n++];
    memset(it, 0, sizeof *it);
    snprintf(it->name, sizeof it->name, "%s", name);
    it->dtype = dt;
    it->ndim = ndim;
    for (int i = 0; i < ndim; i++) it->shape[i] = shape[i];
    it->nbytes = nbytes;
    it->ptr = ptr;
    it->device = dev;
    return OPF_OK;
}

void opf_ck_param_name(const opf_seq *seq, int op, int param, char *buf, size_t size)
{
    const opf_op *o = seq->ops[op];
    snprintf(buf, size, "ops.%d.%s.%s", op, opf_op_name(o), opf_op_param_const(o, param)->name);
}

bool opf_ck_find_param(const opf_seq *seq, const opf_param *p, int *op, int *param)
{
    for (int i = 0; i < seq->n; i++)
        for (int j = 0; j < seq->ops[i]->n_params; j++)
            if (&seq->ops[i]->params[j] == p) {
                *op = i, *param = j;
                return true;
            }
    return false;
}

/* Only plain tensors are copied byte for byte (a device's through the host). */
static opf_status check_plain(const opf_ck_src *s, const char *name, const opf_tensor *t)
{
    if (t->spec.scaling != OPF_SCALING_NONE || !t->data[OPF_COMP_DATA])
        return opf_error(s->ctx, OPF_ERR_UNSUPPORTED, "checkpoint \"%s\": parameter \"%s\" is not "
                         "a plain tensor", s->who, name);
    return OPF_OK;
}

/* The quantized copy's components "<param>.q.<component>", 2D [rows, cols]
 * as opf_spec_layout gives them (packed e2m1: U8 [rows, cols / 2]). */
static opf_status add_qvalue(const opf_ck_src *s, opf_ck_list *l, const char *pname,
                             opf_tensor *q)
{
    opf_layout L;
    if (opf_spec_layout(&q->spec, &L))
        return opf_error(s->ctx, OPF_ERR_UNSUPPORTED, "checkpoint \"%s\": the quantized copy of "
                         "\"%s\" has no valid spec", s->who, pname);
    opf_status st = OPF_OK;
    for (int c = 0; c < OPF_COMP_COUNT && !st; c++) {
        const opf_component_desc *d = &L.comp[c];
        if (!d->present) continue;
        char name[OPF_CK_NAME_MAX + 32];  /* op and param names are short: never truncated */
        snprintf(name, sizeof name, "%s.q.%s", pname, comp_names[c]);
        int64_t shape[2] = {d->rows, d->cols};
        int ndim = 2;
        if (d->dtype == OPF_E2M1) {
            if (d->cols % 2) ndim = 1, shape[0] = (int64_t)d->nbytes;
            else shape[1] = d->cols / 2;
        }
        st = add(s, l, name, opf_st_dtype_of(d->dtype), ndim, shape, d->nbytes, q->data[c],
                 q->spec.device);
    }
    return st;
}

static opf_status add_params(const opf_ck_src *s, opf_ck_list *l)
{
    opf_status st = OPF_OK;
    for (int i = 0; i < s->seq->n && !st; i++) {
        opf_op *op = s->seq->ops[i];
        for (int j = 0; j < op->n_params && !st; j++) {
            opf_param *p = &op->params[j];
            char name[OPF_CK_NAME_MAX];
            opf_ck_param_name(s->seq, i, j, name, sizeof name);
            opf_tensor *q = s->qv[i * OPF_OP_MAX_PARAMS + j];
            if (p->primary_q.scaling != OPF_SCALING_NONE) {  /* quantized primary: q only */
                if (!q)
                    st = opf_error(s->ctx, OPF_ERR_INVALID_ARG, "checkpoint \"%s\": parameter "
                                   "\"%s\" lives quantized, the file has no quantized value",
                                   s->who, name);
                else st = add_qvalue(s, l, name, q);
                continue;
            }
            if ((st = check_plain(s, name, &p->value))) break;
            const opf_spec *v = &p->value.spec;
            size_t nb = opf_dtype_nbytes(v->dtype, (size_t)opf_spec_numel(v));
            st = add(s, l, name, opf_st_dtype_of(v->dtype), v->ndim, v->shape, nb,
                     p->value.data[OPF_COMP_DATA], v->device);
            if (!st && q) st = add_qvalue(s, l, name, q);
        }
    }
    return st;
}

/* Delayed scaling: "ops.<i>.<op>.recipe.{fwd,bwd}.{scale,amax_history}". */
static opf_status add_recipe_state(const opf_ck_src *s, opf_ck_list *l)
{
    opf_status st = OPF_OK;
    for (int i = 0; i < s->seq->n && !st; i++) {
        opf_recipe_state *rs = opf_op_recipe_state(s->seq->ops[i]);
        for (int d = 0; rs && d < 2 && !st; d++) {
            opf_delayed_state *ds = opf_recipe_state_delayed(rs, d == 1);
            if (!ds) continue;
            int64_t slots = opf_delayed_state_slots(ds), len = opf_delayed_state_history_len(ds);
            char base[OPF_CK_NAME_MAX], name[OPF_CK_NAME_MAX + 16];
            snprintf(base, sizeof base, "ops.%d.%s.recipe.%s", i, opf_op_name(s->seq->ops[i]),
                     d ? "bwd" : "fwd");
            snprintf(name, sizeof name, "%s.scale", base);
            opf_device dev = opf_delayed_state_device(ds);
            st = add(s, l, name, OPF_ST_F32, 1, &slots, sizeof(float) * (size_t)slots,
                     opf_delayed_state_scale(ds), dev);
            snprintf(name, sizeof name, "%s.amax_history", base);
            int64_t hs[2] = {len, slots};
            if (!st)
                st = add(s, l, name, OPF_ST_F32, 2, hs, sizeof(float) * (size_t)(len * slots),
                         opf_delayed_state_history(ds), dev);
        }
    }
    return st;
}

/* "optim.<param name>.{master,m,v}", fp32 in the parameter's shape. */
static opf_status add_optim(const opf_ck_src *s, opf_ck_list *l)
{
    opf_status st = OPF_OK;
    for (int k = 0; k < opf_optim_num_slots(s->opt) && !st; k++) {
        opf_param *p;
        float *buf[3];
        int64_t n;
        int i, j;
        opf_optim_slot(s->opt, k, &p, &buf[0], &buf[1], &buf[2], &n);
        if (!opf_ck_find_param(s->seq, p, &i, &j))
            return opf_error(s->ctx, OPF_ERR_INVALID_ARG, "checkpoint \"%s\": optimizer slot %d "
                             "holds a parameter that is not in this seq", s->who, k);
        char pname[OPF_CK_NAME_MAX], name[OPF_CK_NAME_MAX + 16];
        opf_ck_param_name(s->seq, i, j, pname, sizeof pname);
        static const char *const what[3] = {"master", "m", "v"};
        const opf_spec *v = &p->value.spec;
        for (int w = 0; w < 3 && !st; w++) {
            if (!buf[w]) continue;
            snprintf(name, sizeof name, "optim.%s.%s", pname, what[w]);
            st = add(s, l, name, OPF_ST_F32, v->ndim, v->shape, sizeof(float) * (size_t)n, buf[w],
                     v->device);
        }
    }
    return st;
}

static int by_item_name(const void *a, const void *b)
{
    return strcmp(((const opf_ck_item *)a)->name, ((const opf_ck_item *)b)->name);
}

/* Op names are free text, so two tensors could end up with one name. */
static opf_status check_unique(const opf_ck_src *s, const opf_ck_list *l)
{
    opf_ck_item *v = opf_ctx_calloc(s->ctx, (size_t)l->n, sizeof *v);
    if (!v) return opf_error(s->ctx, OPF_ERR_NO_MEMORY, "checkpoint \"%s\": out of memory", s->who);
    if (l->n) memcpy(v, l->v, sizeof *v * (size_t)l->n);
    qsort(v, (size_t)l->n, sizeof *v, by_item_name);
    opf_status st = OPF_OK;
    for (int i = 1; i < l->n && !st; i++)
        if (!strcmp(v[i].name, v[i - 1].name))
            st = opf_error(s->ctx, OPF_ERR_INVALID_ARG, "checkpoint \"%s\": two tensors would be "
                           "called \"%s\" (rename an op)", s->who, v[i].name);
    opf_ctx_free(s->ctx, v, sizeof *v * (size_t)l->n);
    return st;
}

opf_status opf_ck_collect(const opf_ck_src *s, opf_ck_list *out)
{
    memset(out, 0, sizeof *out);
    out->ctx = s->ctx;
    opf_status st = add_params(s, out);
    if (!st) st = add_recipe_state(s, out);
    if (!st && s->opt) st = add_optim(s, out);
    int64_t two = 2;
    if (!st)
        st = add(s, out, "ctx.rng", OPF_ST_U64, 1, &two, 2 * sizeof(uint64_t), s->rng,
                 OPF_DEVICE_CPU);
    if (!st) st = check_unique(s, out);
    if (st) opf_ck_list_free(out);
    return st;
}

/* ---- metadata strings --------------------------------------------------------- */

/* The recipe fields that change what an op computes, per kind, under their
 * checkpoint labels (a NULL label continues the previous one: "blocks=1,2,1").
 * Values print through the recipe's field table, bools as 0/1. */
typedef struct ck_field {
    int         kind;  /* opf_recipe_kind; -1: every kind */
    const char *label, *field;
} ck_field;
static const ck_field ck_fields[] = {
    {-1, "format", "format"},
    {OPF_RECIPE_DELAYED, "margin", "margin"},         {OPF_RECIPE_DELAYED, "history", "amax_history_len"},
    {OPF_RECIPE_DELAYED, "algo", "amax_algo"},        {OPF_RECIPE_CURRENT, "pow2", "power_2_scales"},
    {OPF_RECIPE_CURRENT, "eps", "amax_epsilon"},      {OPF_RECIPE_BLOCK, "pow2", "power_2_scales"},
    {OPF_RECIPE_BLOCK, "eps", "amax_epsilon"},        {OPF_RECIPE_BLOCK, "blocks", "x_block_dim"},
    {OPF_RECIPE_BLOCK, NULL, "w_block_dim"},          {OPF_RECIPE_BLOCK, NULL, "grad_block_dim"},
    {OPF_RECIPE_MXFP8, "2d_weights", "mxfp8_2d_weights"}, {OPF_RECIPE_NVFP4, "rht", "nvfp4_rht"},
    {OPF_RECIPE_NVFP4, "stochastic", "nvfp4_stochastic"},
    {OPF_RECIPE_NVFP4, "2d_weights", "nvfp4_2d_weights"},
};

static size_t ck_value(const opf_recipe *r, const char *name, char *buf, size_t size)
{
    const opf_field *f = opf_schema_field(&opf_recipe_schema, name);
    const void *p = (const char *)r + f->offset;
    int n = f->kind == OPF_FIELD_BOOL ? snprintf(buf, size, "%d", *(const bool *)p)
                                      : opf_field_print(f, p, buf, size);
    return n < 0 ? size : (size_t)n;
}

void opf_ck_recipe_str(const opf_op *op, char *buf, size_t size)
{
    const opf_recipe_state *rs = opf_op_recipe_state(op);
    if (!rs) {
        snprintf(buf, size, "none");
        return;
    }
    const opf_recipe *r = opf_recipe_state_recipe(rs);
    size_t n = ck_value(r, "kind", buf, size);
    for (size_t i = 0; i < sizeof ck_fields / sizeof ck_fields[0] && n < size; i++) {
        if (ck_fields[i].kind >= 0 && ck_fields[i].kind != (int)r->kind) continue;
        const char *l = ck_fields[i].label;
        n += l ? (size_t)snprintf(buf + n, size - n, " %s=", l) : (size_t)snprintf(buf + n, size - n, ",");
        if (n < size) n += ck_value(r, ck_fields[i].field, buf + n, size - n);
    }
}

void opf_ck_qspec_str(const opf_spec *q, char *buf, size_t size)
{
    snprintf(buf, size, "scaling=%s qdtype=%s dtype=%s usage=%u flags=%u",
             opf_scaling_name(q->scaling), opf_dtype_name(q->qdtype), opf_dtype_name(q->dtype),
             q->usage, q->flags);
}

static int find_scaling(const char *name)
{
    for (int i = 1; i < OPF_SCALING_COUNT; i++)
        if (!strcmp(opf_scaling_name((opf_scaling)i), name)) return i;
    return -1;
}

static int find_dtype(const char *name)
{
    for (int i = 0; i < OPF_DTYPE_COUNT; i++)
        if (!strcmp(opf_dtype_name((opf_dtype)i), name)) return i;
    return -1;
}

bool opf_ck_qspec_parse(const char *s, const opf_spec *value, opf_spec *out)
{
    char sc[32], qd[32], dt[32];
    unsigned usage, flags;
    if (sscanf(s, "scaling=%31s qdtype=%31s dtype=%31s usage=%u flags=%u", sc, qd, dt, &usage,
               &flags) != 5)
        return false;
    int scaling = find_scaling(sc), qdtype = find_dtype(qd), dtype = find_dtype(dt);
    if (scaling < 0 || qdtype < 0 || dtype != (int)value->dtype) return false;
    const unsigned known = OPF_SPEC_SWIZZLED | OPF_SPEC_MXFP8_2D | OPF_SPEC_NVFP4_RHT;
    if (flags & ~known) return false;
    opf_spec q = *value;
    q.scaling = (opf_scaling)scaling;
    q.qdtype = (opf_dtype)qdtype;
    q.usage = usage;
    q.flags = flags;
    char again[160];
    opf_ck_qspec_str(&q, again, sizeof again);
    opf_layout L;
    if (strcmp(again, s) || opf_spec_layout(&q, &L)) return false;  /* canonical and valid only */
    *out = q;
    return true;
}
