/* op.c: op instances, seqs, optimizers, compiled seqs and checkpoints, over
 * include/opfuse/op.h, ops.h, fuser.h, compile.h and io.h.
 *
 * An Op made by Op(...) owns its opf_op until it is appended to a Seq; from
 * then on the seq owns it and the Python object only borrows it (holding a
 * reference to the Seq). */

#include "classop.h"
#include <stddef.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    opf_seq  *seq;
    PyObject *ctx;
    opf_recipe recipe;  /* the last call's recipe, kept for the fuser's plan cache */
    PyObject *held;     /* the inputs a pending backward reads (the seq keeps pointers) */
} opf_py_seq;

typedef struct {
    PyObject_HEAD
    opf_op   *op;
    PyObject *ctx;
    PyObject *seq;  /* the owning Seq, or NULL while the op is our own */
} opf_py_op;

static PyTypeObject *op_type, *seq_type, *optim_type, *compiled_type;

static void generic_free(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
    Py_DECREF(tp);
}

/* ---- configs -------------------------------------------------------------------------
 * Configs have no schema; each built-in class's struct is filled from the
 * attributes of a Python object (absent ones keep the class default). */

static int shape_attr(PyObject *cfg, opf_reshape_config *c)
{
    PyObject *shape = PyObject_GetAttrString(cfg, "shape");
    if (!shape)
        return -1;
    PyObject *seq = opf_py_list(shape, "reshape: shape must be a sequence");
    Py_DECREF(shape);
    if (!seq)
        return -1;
    c->ndim = (int)PyList_Size(seq);
    for (int i = 0; i < c->ndim && i < OPF_MAX_DIMS; i++)
        c->shape[i] = PyLong_AsLongLong(PyList_GetItem(seq, i));
    Py_DECREF(seq);
    return PyErr_Occurred() ? -1 : 0;
}

#define INT_FIELD(c, f)                                               \
    do {                                                              \
        long long v_ = (long long)(c)->f;                             \
        if (opf_py_attr_int(cfg, #f, &v_) < 0)                        \
            return -1;                                                \
        (c)->f = (__typeof__((c)->f))v_;                              \
    } while (0)
#define FLOAT_FIELD(c, f)                                             \
    do {                                                              \
        if (opf_py_attr_float(cfg, #f, &(c)->f) < 0)                  \
            return -1;                                                \
    } while (0)
#define BOOL_FIELD(c, f)                                              \
    do {                                                              \
        if (opf_py_attr_bool(cfg, #f, &(c)->f) < 0)                   \
            return -1;                                                \
    } while (0)

static int pack_config(const char *name, PyObject *cfg, void *buf)
{
    if (!strcmp(name, "layernorm") || !strcmp(name, "rmsnorm")) {
        opf_norm_config *c = buf;
        INT_FIELD(c, hidden);
        FLOAT_FIELD(c, eps);
        BOOL_FIELD(c, zero_centered_gamma);
        INT_FIELD(c, dtype);
    } else if (!strcmp(name, "basic_linear")) {
        opf_basic_linear_config *c = buf;
        INT_FIELD(c, in_features);
        INT_FIELD(c, out_features);
        INT_FIELD(c, dtype);
        BOOL_FIELD(c, accumulate_into_main_grad);
    } else if (!strcmp(name, "bias")) {
        opf_bias_config *c = buf;
        INT_FIELD(c, size);
        INT_FIELD(c, dtype);
    } else if (!strcmp(name, "reshape")) {
        return shape_attr(cfg, buf);
    } else if (!strcmp(name, "constant_scale")) {
        FLOAT_FIELD((opf_constant_scale_config *)buf, scale);
    } else if (!strcmp(name, "l2normalization")) {
        FLOAT_FIELD((opf_l2norm_config *)buf, eps);
    } else if (!strcmp(name, "clamped_swiglu")) {
        opf_clamped_swiglu_config *c = buf;
        FLOAT_FIELD(c, limit);
        FLOAT_FIELD(c, alpha);
    } else if (!strcmp(name, "add_extra_input") || !strcmp(name, "make_extra_output")) {
        BOOL_FIELD((opf_inplace_config *)buf, in_place);
    } else if (!strcmp(name, "quantize")) {
        opf_quantize_config *c = buf;
        BOOL_FIELD(c, forward);
        BOOL_FIELD(c, backward);
    } else if (!strcmp(name, "dropout")) {
        FLOAT_FIELD((opf_dropout_config *)buf, p);
    } else if (!strcmp(name, "attention")) {
        INT_FIELD((opf_attention_config *)buf, heads);
    } else if (!strcmp(name, "grouped_linear")) {
        opf_grouped_linear_config *c = buf;
        INT_FIELD(c, groups);
        INT_FIELD(c, in_features);
        INT_FIELD(c, out_features);
        BOOL_FIELD(c, bias);
        INT_FIELD(c, dtype);
        BOOL_FIELD(c, scale_bias);
    } else {
        opf_raise_msg(OPF_ERR_UNSUPPORTED, "op class \"%s\": no Python config mapping; pass None",
                      name);
        return -1;
    }
    return 0;
}

/* ---- schema values ----------------------------------------------------------------
 * Value fields (int, float, bool, enum) of an args or kwargs struct from the
 * mapping `values` (field name -> value); absent names keep what is there. */
int opf_py_pack_values(const opf_schema *s, PyObject *values, void *args)
{
    for (int i = 0; i < s->n_fields; i++) {
        const opf_field *f = &s->fields[i];
        PyObject *v = PyMapping_HasKeyString(values, f->name)
                          ? PyMapping_GetItemString(values, f->name)
                          : NULL;
        if (!v || v == Py_None) {
            Py_XDECREF(v);
            continue;
        }
        char *p = (char *)args + f->offset;
        switch (f->kind) {
        case OPF_FIELD_INT: *(int64_t *)p = PyLong_AsLongLong(v); break;
        case OPF_FIELD_ENUM: *(int *)p = (int)PyLong_AsLong(v); break;
        case OPF_FIELD_FLOAT: *(double *)p = PyFloat_AsDouble(v); break;
        case OPF_FIELD_BOOL: *(bool *)p = PyObject_IsTrue(v) > 0; break;
        default: break;
        }
        Py_DECREF(v);
        if (PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* ---- Op --------------------------------------------------------------------------- */

static PyObject *op_wrap(opf_op *op, PyObject *ctx, PyObject *seq)
{
    opf_py_op *o = PyObject_New(opf_py_op, op_type);
    if (!o)
        return NULL;
    o->op = op;
    o->ctx = ctx;
    o->seq = seq;
    Py_XINCREF(ctx);
    Py_XINCREF(seq);
    return (PyObject *)o;
}

opf_op *opf_py_op_get(PyObject *o)
{
    if (!PyObject_TypeCheck(o, op_type)) {
        PyErr_SetString(PyExc_TypeError, "expected an opfuse Op");
        return NULL;
    }
    opf_py_op *p = (opf_py_op *)o;
    if (!p->op)
        opf_raise_msg(OPF_ERR_STATE, "op was destroyed");
    else if (p->ctx && !opf_py_ctx_get(p->ctx))
        return NULL;
    return p->op;
}

/* Op.create(ctx, class_name, config=None, name=None) */
static PyObject *py_op_create(PyObject *mod, PyObject *args)
{
    PyObject *ctx_obj, *cfg = Py_None;
    const char *cls_name, *name = NULL;
    if (!PyArg_ParseTuple(args, "Os|Oz", &ctx_obj, &cls_name, &cfg, &name))
        return NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    if (!ctx)
        return NULL;
    const opf_op_class *cls = opf_op_class_find(cls_name);
    if (!cls)
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "no op class \"%s\" is registered", cls_name);
    _Alignas(16) unsigned char buf[1024] = {0};
    const void *config = NULL;
    if (cfg != Py_None) {
        if (cls->config_size > sizeof buf)
            return opf_raise_msg(OPF_ERR_UNSUPPORTED, "op class \"%s\": config too large",
                                 cls_name);
        if (cls->config_default)
            memcpy(buf, cls->config_default, cls->config_size);
        if (pack_config(cls_name, cfg, buf) < 0)
            return NULL;
        config = buf;
    }
    opf_op *op;
    opf_status st = opf_op_create(ctx, cls_name, config, name, &op);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    PyObject *r = op_wrap(op, ctx_obj, NULL);
    if (!r)
        opf_op_destroy(op);
    return r;
}

static void op_dealloc(PyObject *self)
{
    opf_py_op *o = (opf_py_op *)self;
    if (!o->seq)
        opf_op_destroy(o->op);
    Py_CLEAR(o->seq);
    Py_CLEAR(o->ctx);
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyObject *op_info(PyObject *self, PyObject *unused)
{
    opf_op *op = opf_py_op_get(self);
    if (!op)
        return NULL;
    const opf_op_class *cls = opf_op_class_of(op);
    return Py_BuildValue("{s:s,s:s,s:i,s:i,s:i,s:O}", "class_name", cls->name, "name",
                         opf_op_name(op), "num_params", opf_op_num_params(op), "n_extra_in",
                         opf_op_num_extra_in(op), "n_extra_out", opf_op_num_extra_out(op),
                         "fused", opf_op_is_fused(op) ? Py_True : Py_False);
}

static PyObject *retained(const opf_tensor *t, PyObject *ctx)
{
    if (!t->data[0])
        Py_RETURN_NONE;
    opf_tensor r;
    opf_tensor_retain(t, &r);
    return opf_py_tensor_wrap(&r, ctx, NULL);
}

/* param(i): {name, value, grad, main_grad, qvalue, requires_grad, has_grad};
 * the tensors share the parameter's memory (qvalue: its quantized copy, the
 * weight cache, or None). */
static PyObject *op_param(PyObject *self, PyObject *args)
{
    int i;
    if (!PyArg_ParseTuple(args, "i", &i))
        return NULL;
    opf_op *op = opf_py_op_get(self);
    if (!op)
        return NULL;
    if (i < 0 || i >= opf_op_num_params(op))
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "op \"%s\" has %d parameters, asked for %d",
                             opf_op_name(op), opf_op_num_params(op), i);
    opf_param *p = opf_op_param(op, i);
    PyObject *ctx = ((opf_py_op *)self)->ctx;
    return Py_BuildValue("{s:s,s:N,s:N,s:N,s:N,s:O,s:O}", "name", p->name, "value",
                         retained(&p->value, ctx), "grad", retained(&p->grad, ctx), "main_grad",
                         retained(&p->main_grad, ctx), "qvalue", retained(&p->qvalue, ctx),
                         "requires_grad",
                         p->requires_grad ? Py_True : Py_False, "has_grad",
                         p->has_grad ? Py_True : Py_False);
}

/* Sets the bool field at offset off of parameter i: (i, on). */
static PyObject *set_param_flag(PyObject *self, PyObject *args, size_t off)
{
    int i, on;
    if (!PyArg_ParseTuple(args, "ip", &i, &on))
        return NULL;
    opf_op *op = opf_py_op_get(self);
    if (!op)
        return NULL;
    if (i < 0 || i >= opf_op_num_params(op))
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "parameter %d out of range", i);
    *(bool *)((char *)opf_op_param(op, i) + off) = on;
    Py_RETURN_NONE;
}

static PyObject *op_set_requires_grad(PyObject *self, PyObject *args)
{
    return set_param_flag(self, args, offsetof(opf_param, requires_grad));
}

/* set_has_grad(i, on): whether grad holds a gradient (an optimizer steps
 * only those): set by a caller that wrote the gradient itself. */
static PyObject *op_set_has_grad(PyObject *self, PyObject *args)
{
    return set_param_flag(self, args, offsetof(opf_param, has_grad));
}

static PyObject *op_zero_grad(PyObject *self, PyObject *unused)
{
    opf_op *op = opf_py_op_get(self);
    if (!op)
        return NULL;
    opf_op_zero_grad(op);
    Py_RETURN_NONE;
}

/* set_param_quantized(i, quantizer): opf_op_set_param_quantized (the
 * value's memory goes; param(i)["qvalue"] is the parameter). */
static PyObject *op_set_param_quantized(PyObject *self, PyObject *args)
{
    int i;
    PyObject *qo;
    opf_quantizer q;
    if (!PyArg_ParseTuple(args, "iO", &i, &qo) || opf_py_to_quantizer(qo, &q) < 0)
        return NULL;
    opf_op *op = opf_py_op_get(self);
    if (!op)
        return NULL;
    opf_ctx *ctx = opf_py_ctx_get(((opf_py_op *)self)->ctx);
    if (!ctx)
        return NULL;
    opf_status st = opf_op_set_param_quantized(ctx, op, i, &q);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    Py_RETURN_NONE;
}

static PyObject *op_set_channel(PyObject *self, PyObject *args)
{
    int out, index, to_caller = 0;
    const char *channel;
    if (!PyArg_ParseTuple(args, "piz|p", &out, &index, &channel, &to_caller))
        return NULL;
    opf_op *op = opf_py_op_get(self);
    if (!op)
        return NULL;
    opf_status st = out ? opf_op_set_extra_output(op, index, channel, to_caller)
                        : opf_op_set_extra_input(op, index, channel);
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    Py_RETURN_NONE;
}

static PyMethodDef op_methods[] = {
    {"info", op_info, METH_NOARGS, "Class, name and counts as a dict."},
    {"param", op_param, METH_VARARGS, "param(i): the parameter's tensors (shared memory)."},
    {"set_requires_grad", op_set_requires_grad, METH_VARARGS, NULL},
    {"set_has_grad", op_set_has_grad, METH_VARARGS, NULL},
    {"zero_grad", op_zero_grad, METH_NOARGS, NULL},
    {"set_param_quantized", op_set_param_quantized, METH_VARARGS,
     "set_param_quantized(i, quantizer): quantized primary."},
    {"set_channel", op_set_channel, METH_VARARGS,
     "set_channel(is_output, index, channel, to_caller=False)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot op_slots[] = {
    {Py_tp_dealloc, op_dealloc},
    {Py_tp_methods, op_methods},
    {Py_tp_doc, "An opf_op instance (made by op_create)."},
    {0, NULL},
};
static PyType_Spec op_spec = {"opfuse._C.Op", sizeof(opf_py_op), 0, Py_TPFLAGS_DEFAULT, op_slots};

/* ---- Seq ------------------------------------------------------------------------- */

static opf_seq *seq_get(PyObject *o)
{
    if (!PyObject_TypeCheck(o, seq_type)) {
        PyErr_SetString(PyExc_TypeError, "expected an opfuse Seq");
        return NULL;
    }
    opf_py_seq *s = (opf_py_seq *)o;
    return opf_py_ctx_get(s->ctx) ? s->seq : NULL;
}

static int seq_init(PyObject *self, PyObject *args, PyObject *kw)
{
    PyObject *ctx_obj;
    if (!PyArg_ParseTuple(args, "O", &ctx_obj))
        return -1;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    if (!ctx)
        return -1;
    opf_py_seq *s = (opf_py_seq *)self;
    opf_status st = opf_seq_create(ctx, &s->seq);
    if (st != OPF_OK) {
        opf_raise(st, ctx);
        return -1;
    }
    s->ctx = ctx_obj;
    Py_INCREF(ctx_obj);
    return 0;
}

static void seq_dealloc(PyObject *self)
{
    opf_py_seq *s = (opf_py_seq *)self;
    opf_seq_destroy(s->seq);
    Py_CLEAR(s->held);
    Py_CLEAR(s->ctx);
    generic_free(self);
}

static PyObject *seq_append(PyObject *self, PyObject *arg)
{
    opf_seq *seq = seq_get(self);
    opf_op *op = seq ? opf_py_op_get(arg) : NULL;
    if (!op)
        return NULL;
    opf_py_op *o = (opf_py_op *)arg;
    if (o->seq)
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "op \"%s\" already belongs to a seq",
                             opf_op_name(op));
    opf_status st = opf_seq_append(seq, op);
    /* The seq owns the op now, also on failure (where it destroyed it). */
    if (st != OPF_OK) {
        o->op = NULL;
        return opf_raise(st, NULL);
    }
    o->seq = self;
    Py_INCREF(self);
    Py_RETURN_NONE;
}

static PyObject *seq_append_linear(PyObject *self, PyObject *args)
{
    long long in, out;
    int bias, dt;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "LLpi|z", &in, &out, &bias, &dt, &name))
        return NULL;
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    opf_status st = opf_seq_append_linear(seq, in, out, bias, (opf_dtype)dt, name);
    if (st != OPF_OK)
        return opf_raise(st, opf_py_ctx_get(((opf_py_seq *)self)->ctx));
    Py_RETURN_NONE;
}

static PyObject *seq_len(PyObject *self, PyObject *unused)
{
    opf_seq *seq = seq_get(self);
    return seq ? PyLong_FromLong(opf_seq_len(seq)) : NULL;
}

static PyObject *seq_at(PyObject *self, PyObject *args)
{
    int i;
    if (!PyArg_ParseTuple(args, "i", &i))
        return NULL;
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    if (i < 0 || i >= opf_seq_len(seq))
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "seq has %d ops, asked for %d",
                             opf_seq_len(seq), i);
    return op_wrap(opf_seq_at(seq, i), ((opf_py_seq *)self)->ctx, self);
}

/* What one forward call needs alive while it runs. */
typedef struct {
    opf_seq_call call;
    opf_tensor   extra[OPF_OP_MAX_EXTRA * 16];
    const void  *kw_ptr[256];
    _Alignas(16) unsigned char kw_buf[256][64];
} call_store;

/* Per-op kwargs from a sequence of (None or mapping), one per op. */
static int pack_kwargs(opf_seq *seq, PyObject *kwargs, call_store *cs)
{
    PyObject *list = opf_py_list(kwargs, "kwargs must be a sequence (one entry per op)");
    if (!list)
        return -1;
    int n = opf_seq_len(seq);
    if (PyList_Size(list) != n || n > 256) {
        Py_DECREF(list);
        opf_raise_msg(OPF_ERR_INVALID_ARG, "kwargs has %zd entries, the seq has %d ops",
                      PySequence_Size(kwargs), n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        PyObject *d = PyList_GetItem(list, i);
        const opf_schema *s = opf_op_class_of(opf_seq_at(seq, i))->kwargs_schema;
        cs->kw_ptr[i] = NULL;
        if (d == Py_None)
            continue;
        if (!s || s->size > sizeof cs->kw_buf[i]) {
            Py_DECREF(list);
            opf_raise_msg(OPF_ERR_INVALID_ARG, "op %d (\"%s\") takes no kwargs", i,
                          opf_op_name(opf_seq_at(seq, i)));
            return -1;
        }
        memset(cs->kw_buf[i], 0, sizeof cs->kw_buf[i]);
        /* Runtime ints default to -1 ("unset"), as the C kwargs structs document. */
        for (int f = 0; f < s->n_fields; f++)
            if (s->fields[f].kind == OPF_FIELD_INT)
                *(int64_t *)(cs->kw_buf[i] + s->fields[f].offset) = -1;
            else if (s->fields[f].kind == OPF_FIELD_ENUM)
                *(int *)(cs->kw_buf[i] + s->fields[f].offset) = -1;
        if (opf_py_pack_values(s, d, cs->kw_buf[i]) < 0) {
            Py_DECREF(list);
            return -1;
        }
        cs->kw_ptr[i] = cs->kw_buf[i];
    }
    Py_DECREF(list);
    cs->call.kwargs = cs->kw_ptr;
    return 0;
}

/* An input of a call on Context ctx: an opfuse Tensor, or with torch a torch
 * tensor (opf_py_torch_in); either way what *out points at joins hold. */
static int call_in(PyObject *o, const char *field, PyObject *ctx, int torch, PyObject *hold,
                   opf_tensor *out)
{
    if (torch)
        return opf_py_torch_in(o, field, ctx, out, hold);
    const opf_tensor *t = opf_py_tensor_get(o, 0);
    if (!t)
        return -1;
    *out = *t;
    return PyList_Append(hold, o);
}

/* Fills cs from the forward arguments; the recipe goes into the Seq object. */
static int build_call(opf_py_seq *s, PyObject *recipe, int rg, int irg, PyObject *extra_in,
                      PyObject *kwargs, int torch, PyObject *hold, call_store *cs)
{
    cs->call = opf_seq_call_default();
    cs->call.requires_grad = rg;
    cs->call.input_requires_grad = irg;
    if (recipe != Py_None) {
        if (opf_py_to_recipe(recipe, &s->recipe) < 0)
            return -1;
        cs->call.recipe = &s->recipe;
    }
    if (extra_in != Py_None) {
        PyObject *list = opf_py_list(extra_in, "extra_in must be a sequence");
        if (!list)
            return -1;
        Py_ssize_t n = PyList_Size(list);
        for (Py_ssize_t i = 0; i < n && i < (Py_ssize_t)(sizeof cs->extra / sizeof cs->extra[0]);
             i++) {
            PyObject *e = PyList_GetItem(list, i);
            memset(&cs->extra[i], 0, sizeof cs->extra[i]);
            if (e != Py_None && call_in(e, "extra_in", s->ctx, torch, hold, &cs->extra[i]) < 0) {
                Py_DECREF(list);
                return -1;
            }
        }
        Py_DECREF(list);
        cs->call.n_extra_in = (int)n;
        cs->call.extra_in = cs->extra;
    }
    if (kwargs != Py_None && pack_kwargs(s->seq, kwargs, cs) < 0)
        return -1;
    return 0;
}

/* A result taking over *t: a Tensor, or with torch a torch tensor (grads:
 * caller memory copied out). */
static PyObject *call_out(opf_tensor *t, PyObject *ctx, PyObject *owner, int torch, int grads)
{
    return torch ? opf_py_torch_out(t, ctx, owner, grads) : opf_py_tensor_wrap(t, ctx, owner);
}

/* A list of n results taking over ts (zeroed entries become None). */
static PyObject *tensor_list(opf_tensor *ts, int n, PyObject *ctx, PyObject *owner, int torch,
                             int grads)
{
    PyObject *l = PyList_New(n);
    for (int i = 0; l && i < n; i++) {
        PyObject *t;
        if (ts[i].data[0] || ts[i].buf) {
            t = call_out(&ts[i], ctx, owner, torch, grads);
            if (!t) {
                for (int j = i + 1; j < n; j++)
                    opf_tensor_release(&ts[j]);
                Py_DECREF(l);
                return NULL;
            }
        } else {
            t = Py_None;
            Py_INCREF(t);
        }
        PyList_SetItem(l, i, t);
    }
    return l;
}

/* Forward of a seq, eagerly (c NULL: results are library buffers) or through
 * a compiled seq (results are arena views kept alive by `owner`); torch:
 * tensors in and out are torch tensors. A forward that records for
 * backward keeps its inputs alive until the backward (or discard). */
static PyObject *run_forward(PyObject *seq_obj, opf_compiled *c, PyObject *owner, PyObject *args,
                             PyObject *kw, int torch)
{
    static char *names[] = {"x", "recipe", "requires_grad", "input_requires_grad", "extra_in",
                            "kwargs", NULL};
    PyObject *xo, *recipe = Py_None, *extra_in = Py_None, *kwargs = Py_None;
    int rg = 1, irg = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OppOO", names, &xo, &recipe, &rg, &irg,
                                     &extra_in, &kwargs))
        return NULL;
    opf_py_seq *s = (opf_py_seq *)seq_obj;
    opf_seq *seq = seq_get(seq_obj);
    PyObject *hold = seq ? PyList_New(0) : NULL;
    opf_tensor x;
    /* torch: the context's work goes on torch's current stream */
    call_store *cs = hold && (!torch || opf_py_torch_follow(s->ctx) == 0) &&
                             call_in(xo, "x", s->ctx, torch, hold, &x) == 0
                         ? PyMem_Malloc(sizeof *cs) : NULL;
    if (!cs) {
        Py_XDECREF(hold);
        return hold && !PyErr_Occurred() ? PyErr_NoMemory() : NULL;
    }
    PyObject *r = NULL, *ctx = c ? NULL : s->ctx;
    if (build_call(s, recipe, rg, irg, extra_in, kwargs, torch, hold, cs) == 0) {
        opf_tensor y = {0}, eo[64] = {{{0}}};
        opf_status st = c ? opf_compiled_forward(c, &x, &cs->call, &y, eo)
                          : opf_seq_forward(seq, &x, &cs->call, &y, eo);
        if (st != OPF_OK) {
            opf_raise(st, opf_py_ctx_get(s->ctx));
        } else {
            r = Py_BuildValue("(NN)", call_out(&y, ctx, owner, torch, 0),
                              tensor_list(eo, opf_seq_num_extra_out(seq), ctx, owner, torch, 0));
            if (rg) {
                PyObject *old = s->held;
                s->held = hold;
                Py_INCREF(hold);
                Py_XDECREF(old);
            }
        }
    }
    Py_DECREF(hold);
    PyMem_Free(cs);
    return r;
}

static PyObject *seq_forward(PyObject *self, PyObject *args, PyObject *kw)
{
    return run_forward(self, NULL, NULL, args, kw, 0);
}

static PyObject *seq_forward_torch(PyObject *self, PyObject *args, PyObject *kw)
{
    return run_forward(self, NULL, NULL, args, kw, 1);
}

/* trace(x, recipe, requires_grad, input_requires_grad, extra_in, kwargs): the
 * program of the graph opf_compile makes for this call (classop.c); x and
 * extra_in are read for their specs only. */
static PyObject *seq_trace(PyObject *self, PyObject *args)
{
    PyObject *xo, *recipe, *extra_in, *kwargs;
    int rg, irg;
    if (!PyArg_ParseTuple(args, "OOppOO", &xo, &recipe, &rg, &irg, &extra_in, &kwargs))
        return NULL;
    opf_py_seq *s = (opf_py_seq *)self;
    opf_seq *seq = seq_get(self);
    const opf_tensor *x = seq ? opf_py_tensor_get(xo, 0) : NULL;
    PyObject *hold = x ? PyList_New(0) : NULL;
    call_store *cs = hold ? PyMem_Calloc(1, sizeof *cs) : NULL;
    if (!cs) {
        Py_XDECREF(hold);
        return hold ? PyErr_NoMemory() : NULL;
    }
    PyObject *r = NULL;
    opf_graph *g = NULL;
    opf_compile_options o = opf_compile_options_default();
    if (build_call(s, recipe, rg, irg, extra_in, kwargs, 0, hold, cs) == 0) {
        opf_status st = opf_compile(seq, &x->spec, &cs->call, &o, &g);
        r = st ? opf_raise(st, opf_py_ctx_get(s->ctx)) : opf_py_graph_program(g, seq);
    }
    opf_graph_destroy(g);
    Py_DECREF(hold);
    PyMem_Free(cs);
    return r;
}

/* Gradients passed from Python: a sequence of tensors or None, into ts (as
 * call_in). */
static int tensor_array(PyObject *o, PyObject *ctx, int torch, PyObject *hold, opf_tensor *ts,
                        int max, int *n)
{
    *n = 0;
    if (o == Py_None)
        return 0;
    PyObject *l = opf_py_list(o, "expected a sequence of tensors");
    if (!l)
        return -1;
    for (Py_ssize_t i = 0; i < PyList_Size(l) && i < max; i++) {
        PyObject *t = PyList_GetItem(l, i);
        if (t != Py_None && call_in(t, "dextra_out", ctx, torch, hold, &ts[i]) < 0) {
            Py_DECREF(l);
            return -1;
        }
        (*n)++;
    }
    Py_DECREF(l);
    return 0;
}

/* Backward of the last forward, eagerly or compiled (as run_forward); it
 * lets go of the forward's inputs. */
static PyObject *run_backward(PyObject *seq_obj, opf_compiled *c, PyObject *owner,
                              PyObject *args, int torch)
{
    PyObject *dyo, *deo = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &dyo, &deo))
        return NULL;
    opf_py_seq *s = (opf_py_seq *)seq_obj;
    opf_seq *seq = seq_get(seq_obj);
    PyObject *hold = seq ? PyList_New(0) : NULL;
    opf_tensor dy, de[64] = {{{0}}}, dx = {0}, di[64] = {{{0}}};
    int n_de;
    if (!hold || (torch && opf_py_torch_follow(s->ctx) < 0) ||
        call_in(dyo, "dy", s->ctx, torch, hold, &dy) < 0 ||
        tensor_array(deo, s->ctx, torch, hold, de, 64, &n_de) < 0) {
        Py_XDECREF(hold);
        return NULL;
    }
    opf_status st = c ? opf_compiled_backward(c, &dy, n_de ? de : NULL, &dx, di)
                      : opf_seq_backward(seq, &dy, n_de ? de : NULL, &dx, di);
    Py_DECREF(hold);
    if (st != OPF_OK)
        return opf_raise(st, opf_py_ctx_get(s->ctx));
    Py_CLEAR(s->held);
    PyObject *ctx = c ? NULL : s->ctx;
    PyObject *dxo = dx.data[0] ? call_out(&dx, ctx, owner, torch, 1)
                               : (Py_INCREF(Py_None), Py_None);
    return Py_BuildValue("(NN)", dxo,
                         tensor_list(di, opf_seq_num_extra_in(seq), ctx, owner, torch, 1));
}

static PyObject *seq_backward(PyObject *self, PyObject *args)
{
    return run_backward(self, NULL, NULL, args, 0);
}

static PyObject *seq_backward_torch(PyObject *self, PyObject *args)
{
    return run_backward(self, NULL, NULL, args, 1);
}

static PyObject *seq_zero_grad(PyObject *self, PyObject *unused)
{
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    opf_seq_zero_grad(seq);
    Py_RETURN_NONE;
}

static PyObject *seq_discard(PyObject *self, PyObject *unused)
{
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    opf_seq_discard(seq);
    Py_CLEAR(((opf_py_seq *)self)->held);
    Py_RETURN_NONE;
}

static PyObject *seq_set_fusions(PyObject *self, PyObject *args)
{
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    opf_seq_set_fusions(seq, on);
    Py_RETURN_NONE;
}

/* set_recompute(first, count): opf_seq_set_recompute; clear_recompute():
 * opf_seq_clear_recompute. */
static PyObject *seq_set_recompute(PyObject *self, PyObject *args)
{
    int first, count;
    if (!PyArg_ParseTuple(args, "ii", &first, &count))
        return NULL;
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    opf_status st = opf_seq_set_recompute(seq, first, count);
    if (st != OPF_OK)
        return opf_raise(st, opf_py_ctx_get(((opf_py_seq *)self)->ctx));
    Py_RETURN_NONE;
}

static PyObject *seq_clear_recompute(PyObject *self, PyObject *unused)
{
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    opf_status st = opf_seq_clear_recompute(seq);
    if (st != OPF_OK)
        return opf_raise(st, opf_py_ctx_get(((opf_py_seq *)self)->ctx));
    Py_RETURN_NONE;
}

static PyObject *seq_prepare(PyObject *self, PyObject *recipe)
{
    opf_py_seq *s = (opf_py_seq *)self;
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    const opf_recipe *r = NULL;
    if (recipe != Py_None) {
        if (opf_py_to_recipe(recipe, &s->recipe) < 0)
            return NULL;
        r = &s->recipe;
    }
    opf_status st = opf_seq_prepare(seq, r);
    if (st != OPF_OK)
        return opf_raise(st, opf_py_ctx_get(s->ctx));
    Py_RETURN_NONE;
}

/* plans(): [(forward plan, backward plan) per group], each a list of
 * (op name, class name, first, count). */
static PyObject *seq_plans(PyObject *self, PyObject *unused)
{
    opf_seq *seq = seq_get(self);
    if (!seq)
        return NULL;
    int ng = opf_seq_num_groups(seq);
    PyObject *groups = PyList_New(ng);
    for (int g = 0; groups && g < ng; g++) {
        PyObject *pair = PyTuple_New(2);
        for (int b = 0; b < 2; b++) {
            opf_plan_entry e[128];
            int n = opf_seq_plan(seq, g, b, e, 128);
            PyObject *l = PyList_New(n < 128 ? n : 128);
            for (int i = 0; i < n && i < 128; i++)
                PyList_SetItem(l, i, Py_BuildValue("(ssii)", opf_op_name(e[i].op),
                                                   opf_op_class_of(e[i].op)->name, e[i].first,
                                                   e[i].count));
            PyTuple_SetItem(pair, b, l);
        }
        PyList_SetItem(groups, g, pair);
    }
    return groups;
}

static PyMethodDef seq_methods[] = {
    {"append", seq_append, METH_O, "append(op): the seq takes ownership."},
    {"append_linear", seq_append_linear, METH_VARARGS,
     "append_linear(in, out, bias, dtype, name=None)."},
    {"size", seq_len, METH_NOARGS, "Number of ops."},
    {"at", seq_at, METH_VARARGS, "at(i): a borrowed Op."},
    {"forward", (PyCFunction)(void (*)(void))seq_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(x, recipe=None, requires_grad=True, input_requires_grad=True, extra_in=None, "
     "kwargs=None) -> (y, extra_out)."},
    {"backward", seq_backward, METH_VARARGS, "backward(dy, dextra_out=None) -> (dx, dextra_in)."},
    {"forward_torch", (PyCFunction)(void (*)(void))seq_forward_torch,
     METH_VARARGS | METH_KEYWORDS, "forward with torch tensors in and out (opfuse.torch's eager "
     "path)."},
    {"backward_torch", seq_backward_torch, METH_VARARGS,
     "backward with torch tensors in and out; caller memory in the results is copied."},
    {"trace", seq_trace, METH_VARARGS,
     "trace(x, recipe, requires_grad, input_requires_grad, extra_in, kwargs): the compiled "
     "graph's program."},
    {"zero_grad", seq_zero_grad, METH_NOARGS, NULL},
    {"discard", seq_discard, METH_NOARGS, NULL},
    {"set_fusions", seq_set_fusions, METH_VARARGS, NULL},
    {"prepare", seq_prepare, METH_O, "prepare(recipe)."},
    {"set_recompute", seq_set_recompute, METH_VARARGS, "set_recompute(first, count)."},
    {"clear_recompute", seq_clear_recompute, METH_NOARGS, NULL},
    {"plans", seq_plans, METH_NOARGS, "Forward and backward plans per group."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot seq_slots[] = {
    {Py_tp_init, seq_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, seq_dealloc},
    {Py_tp_methods, seq_methods},
    {Py_tp_doc, "Seq(ctx): an opf_seq."},
    {0, NULL},
};
static PyType_Spec seq_spec = {"opfuse._C.Seq", sizeof(opf_py_seq), 0, Py_TPFLAGS_DEFAULT,
                               seq_slots};

/* ---- Optim ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    opf_optim *opt;
    PyObject  *seq;
} opf_py_optim;

static int optim_init(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"seq", "kind", "lr", "momentum", "beta1", "beta2", "eps",
                            "weight_decay", NULL};
    opf_optim_options o = opf_optim_options_default();
    PyObject *seq_obj;
    int kind = OPF_OPTIM_ADAMW;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|iffffff", names, &seq_obj, &kind, &o.lr,
                                     &o.momentum, &o.beta1, &o.beta2, &o.eps, &o.weight_decay))
        return -1;
    opf_seq *seq = seq_get(seq_obj);
    if (!seq)
        return -1;
    opf_ctx *ctx = opf_py_ctx_get(((opf_py_seq *)seq_obj)->ctx);
    opf_py_optim *p = (opf_py_optim *)self;
    opf_status st = opf_optim_create(ctx, seq, (opf_optim_kind)kind, &o, &p->opt);
    if (st != OPF_OK) {
        opf_raise(st, ctx);
        return -1;
    }
    p->seq = seq_obj;
    Py_INCREF(seq_obj);
    return 0;
}

static void optim_dealloc(PyObject *self)
{
    opf_py_optim *p = (opf_py_optim *)self;
    opf_optim_destroy(p->opt);
    Py_CLEAR(p->seq);
    generic_free(self);
}

static PyObject *optim_step(PyObject *self, PyObject *unused)
{
    opf_py_optim *p = (opf_py_optim *)self;
    if (!seq_get(p->seq))
        return NULL;
    opf_status st = opf_optim_step(p->opt);
    if (st != OPF_OK)
        return opf_raise(st, opf_py_ctx_get(((opf_py_seq *)p->seq)->ctx));
    Py_RETURN_NONE;
}

static PyObject *optim_steps(PyObject *self, void *unused)
{
    return PyLong_FromLongLong(opf_optim_step_count(((opf_py_optim *)self)->opt));
}

static PyMethodDef optim_methods[] = {
    {"step", optim_step, METH_NOARGS, "One optimizer step over the seq's parameters."},
    {NULL, NULL, 0, NULL},
};
static PyGetSetDef optim_getset[] = {
    {"step_count", optim_steps, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};
static PyType_Slot optim_slots[] = {
    {Py_tp_init, optim_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, optim_dealloc},
    {Py_tp_methods, optim_methods},
    {Py_tp_getset, optim_getset},
    {Py_tp_doc, "Optim(seq, kind=ADAMW, lr, momentum, beta1, beta2, eps, weight_decay)."},
    {0, NULL},
};
static PyType_Spec optim_spec = {"opfuse._C.Optim", sizeof(opf_py_optim), 0, Py_TPFLAGS_DEFAULT,
                                 optim_slots};

/* ---- Compiled ------------------------------------------------------------------------
 * Outputs are views into the graph's arena: valid until the next forward. */

typedef struct {
    PyObject_HEAD
    opf_compiled *c;
    PyObject     *seq;
} opf_py_compiled;

static int compiled_init(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"seq", "max_leading", "max_variants", NULL};
    opf_compile_options o = opf_compile_options_default();
    PyObject *seq_obj;
    long long ml = 0;
    int mv = o.max_variants;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Li", names, &seq_obj, &ml, &mv))
        return -1;
    opf_seq *seq = seq_get(seq_obj);
    if (!seq)
        return -1;
    o.max_leading = ml;
    o.max_variants = mv;
    opf_py_compiled *p = (opf_py_compiled *)self;
    opf_status st = opf_compiled_create(seq, &o, &p->c);
    if (st != OPF_OK) {
        opf_raise(st, NULL);
        return -1;
    }
    p->seq = seq_obj;
    Py_INCREF(seq_obj);
    return 0;
}

static void compiled_dealloc(PyObject *self)
{
    opf_py_compiled *p = (opf_py_compiled *)self;
    opf_compiled_destroy(p->c);
    Py_CLEAR(p->seq);
    generic_free(self);
}

static PyObject *compiled_forward(PyObject *self, PyObject *args, PyObject *kw)
{
    opf_py_compiled *p = (opf_py_compiled *)self;
    return run_forward(p->seq, p->c, self, args, kw, 0);
}

static PyObject *compiled_backward(PyObject *self, PyObject *args)
{
    opf_py_compiled *p = (opf_py_compiled *)self;
    return run_backward(p->seq, p->c, self, args, 0);
}

static PyObject *compiled_stats(PyObject *self, PyObject *unused)
{
    opf_py_compiled *p = (opf_py_compiled *)self;
    opf_graph_stats st;
    opf_graph *g = opf_compiled_last_graph(p->c);
    opf_graph_get_stats(g, &st);
    opf_graph_reason rs[64];
    int n = opf_graph_reasons(g, rs, 64);
    PyObject *reasons = PyList_New(0);
    for (int i = 0; reasons && i < n && i < 64; i++) {
        PyObject *t = Py_BuildValue("(ssO)", rs[i].op_name, rs[i].reason,
                                    rs[i].backward ? Py_True : Py_False);
        PyList_Append(reasons, t);
        Py_XDECREF(t);
    }
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:n,s:i,s:i,s:N}", "n_forward", st.n_forward,
                         "n_backward", st.n_backward, "n_eager", st.n_eager, "n_fused",
                         st.n_fused, "n_values", st.n_values, "n_inplace", st.n_inplace,
                         "arena_bytes", (Py_ssize_t)st.arena_bytes, "recompiles",
                         opf_compiled_recompiles(p->c), "num_graphs",
                         opf_compiled_num_graphs(p->c), "reasons", reasons);
}

static PyMethodDef compiled_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))compiled_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(x, recipe=None, ...) -> (y, extra_out): arena views."},
    {"backward", compiled_backward, METH_VARARGS, "backward(dy, dextra_out=None)."},
    {"stats", compiled_stats, METH_NOARGS, "Stats, recompiles and eager reasons."},
    {NULL, NULL, 0, NULL},
};
static PyType_Slot compiled_slots[] = {
    {Py_tp_init, compiled_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, compiled_dealloc},
    {Py_tp_methods, compiled_methods},
    {Py_tp_doc, "Compiled(seq, max_leading=0, max_variants=8): opf_compiled."},
    {0, NULL},
};
static PyType_Spec compiled_spec = {"opfuse._C.Compiled", sizeof(opf_py_compiled), 0,
                                    Py_TPFLAGS_DEFAULT, compiled_slots};

/* ---- checkpoints ---------------------------------------------------------------------- */

static PyObject *py_checkpoint(PyObject *mod, PyObject *args)
{
    PyObject *seq_obj, *opt_obj;
    const char *path;
    int save;
    if (!PyArg_ParseTuple(args, "pOOs", &save, &seq_obj, &opt_obj, &path))
        return NULL;
    opf_seq *seq = seq_get(seq_obj);
    if (!seq)
        return NULL;
    opf_optim *opt = NULL;
    if (opt_obj != Py_None) {
        if (!PyObject_TypeCheck(opt_obj, optim_type)) {
            PyErr_SetString(PyExc_TypeError, "optim must be an opfuse Optim or None");
            return NULL;
        }
        opt = ((opf_py_optim *)opt_obj)->opt;
    }
    opf_ctx *ctx = opf_py_ctx_get(((opf_py_seq *)seq_obj)->ctx);
    opf_status st = save ? opf_checkpoint_save(ctx, seq, opt, path)
                         : opf_checkpoint_load(ctx, seq, opt, path);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    Py_RETURN_NONE;
}

/* ---- module ------------------------------------------------------------------------ */

static PyObject *py_op_classes(PyObject *mod, PyObject *unused)
{
    int n = opf_op_class_count();
    PyObject *l = PyList_New(n);
    for (int i = 0; l && i < n; i++)
        PyList_SetItem(l, i, PyUnicode_FromString(opf_op_class_at(i)->name));
    return l;
}

PyMethodDef opf_py_op_methods[] = {
    {"op_create", py_op_create, METH_VARARGS,
     "op_create(ctx, class_name, config=None, name=None) -> Op."},
    {"op_classes", py_op_classes, METH_NOARGS, "Names of the registered op classes."},
    {"checkpoint", py_checkpoint, METH_VARARGS, "checkpoint(save, seq, optim, path)."},
    {NULL, NULL, 0, NULL},
};

int opf_py_op_init_types(PyObject *m)
{
    op_type = (PyTypeObject *)PyType_FromSpec(&op_spec);
    seq_type = (PyTypeObject *)PyType_FromSpec(&seq_spec);
    optim_type = (PyTypeObject *)PyType_FromSpec(&optim_spec);
    compiled_type = (PyTypeObject *)PyType_FromSpec(&compiled_spec);
    if (!op_type || !seq_type || !optim_type || !compiled_type)
        return -1;
    PyTypeObject *types[] = {op_type, seq_type, optim_type, compiled_type};
    const char *names[] = {"Op", "Seq", "Optim", "Compiled"};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0)
            return -1;
    }
    return 0;
}
