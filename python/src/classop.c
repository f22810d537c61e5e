/* classop.c: op classes as torch custom ops, over op.h's public contract.
 *
 * opfuse.torch registers each op class's forward and backward as a custom
 * op whose arguments are the class's args struct flattened field by field.
 * Two entry points serve it (the impls and fakes are torchcall.c's
 * ClassCall):
 *
 *   class_fields(cls, bwd)          the flattened schema: (name, kind, flags)
 *   Seq.trace (op.c) -> opf_py_graph_program
 *                                   the graph opf_compile traces for a call,
 *                                   each node's fields recorded with the
 *                                   graph value or parameter every tensor
 *                                   component reads or writes
 *
 * Tensors are reported by their specs (shape, dtype, scaling, qdtype,
 * usage, flags), quantizers as tuples of their fields
 * (opf_py_quantizer_from_ints reads them back), references as integers. */
#include "classop.h"
#include <string.h>

/* "shape[0]" -> "shape_0", "rows[b + 1]" -> "rows_b_1": identifiers, as
 * torch's schema parser wants them. */
static void clean_name(char *dst, size_t size, const char *prefix, const char *name)
{
    size_t n = 0;
    for (const char *s = prefix; *s && n + 1 < size; s++) dst[n++] = *s;
    for (const char *s = name; *s && n + 1 < size; s++) {
        bool word = (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
                    (*s >= '0' && *s <= '9') || *s == '_';
        if (word) dst[n++] = *s;
        else if (*s != ' ' && *s != ']' && n && dst[n - 1] != '_') dst[n++] = '_';
    }
    dst[n] = 0;
}

static int flatten(const opf_schema *s, size_t base, const char *prefix, flat_field *out, int n)
{
    for (int i = 0; i < s->n_fields; i++) {
        const opf_field *f = &s->fields[i];
        if (f->kind == OPF_FIELD_BUNDLE) {
            char p[96];
            clean_name(p, sizeof p - 1, prefix, f->name);
            strcat(p, "_");
            if ((n = flatten(f->bundle, base + f->offset, p, out, n)) < 0) return -1;
            continue;
        }
        if (n == MAX_FLAT) {
            opf_raise_msg(OPF_ERR_UNSUPPORTED, "schema %s: more than %d fields", s->name, MAX_FLAT);
            return -1;
        }
        out[n].f = f;
        out[n].off = base + f->offset;
        clean_name(out[n].name, sizeof out[n].name, prefix, f->name);
        n++;
    }
    return n;
}

int opf_py_flatten(const opf_schema *s, flat_field *out)
{
    return flatten(s, 0, "", out, 0);
}

const opf_op_class *opf_py_find_class(const char *name)
{
    const opf_op_class *c = opf_op_class_find(name);
    if (!c) opf_raise_msg(OPF_ERR_INVALID_ARG, "no op class \"%s\" is registered", name);
    return c;
}

const opf_schema *opf_py_class_schema(const opf_op_class *c, int bwd)
{
    const opf_schema *s = bwd ? c->bwd_schema : c->fwd_schema;
    if (!s)
        opf_raise_msg(OPF_ERR_UNSUPPORTED, "op class \"%s\" has no %s", c->name,
                      bwd ? "backward" : "forward");
    return s;
}

static PyObject *py_class_fields(PyObject *mod, PyObject *args)
{
    const char *name;
    int bwd;
    if (!PyArg_ParseTuple(args, "sp", &name, &bwd)) return NULL;
    const opf_op_class *c = opf_py_find_class(name);
    const opf_schema *s = c ? opf_py_class_schema(c, bwd) : NULL;
    flat_field ff[MAX_FLAT];
    int n = s ? opf_py_flatten(s, ff) : -1;
    if (n < 0) return NULL;
    PyObject *r = PyList_New(n);
    for (int i = 0; r && i < n; i++)
        PyList_SetItem(r, i, Py_BuildValue("(siI)", ff[i].name, (int)ff[i].f->kind, ff[i].f->flags));
    return r;
}

/* ---- values ------------------------------------------------------------------------ */

static PyObject *spec_tuple(const opf_spec *s)
{
    PyObject *shape = PyTuple_New(s->ndim);
    for (int i = 0; shape && i < s->ndim; i++)
        PyTuple_SetItem(shape, i, PyLong_FromLongLong(s->shape[i]));
    return shape ? Py_BuildValue("(NiiiII)", shape, s->dtype, s->scaling, s->qdtype, s->usage,
                                 s->flags)
                 : NULL;
}

/* A quantizer as its fields in order, all integers (amax_epsilon by its
 * bits, the delayed state and the amax reduction by address): padding
 * bytes never reach the value. */
void opf_py_quantizer_from_ints(const long long *f, opf_quantizer *q)
{
    *q = opf_quantizer_default();
    q->scaling = (opf_scaling)f[0];
    q->qdtype = (opf_dtype)f[1];
    q->usage = (unsigned)f[2];
    q->swizzled = f[3];
    q->pow2_scales = f[4];
    uint32_t bits = (uint32_t)f[5];
    memcpy(&q->amax_epsilon, &bits, sizeof bits);
    q->mxfp8_2d = f[6];
    q->rht = f[7];
    q->rht_sign_mask = (uint16_t)f[8];
    q->stochastic = f[9];
    q->delayed = (opf_delayed_state *)(uintptr_t)f[10];
    q->slot = (int)f[11];
    q->amax_reduce = (opf_amax_reduce_fn)(uintptr_t)f[12];
    q->amax_reduce_user = (void *)(uintptr_t)f[13];
}

static PyObject *quantizer_tuple(const opf_quantizer *q)
{
    uint32_t bits;
    memcpy(&bits, &q->amax_epsilon, sizeof bits);
    return Py_BuildValue("(iiIiiIiiiiKiKK)", q->scaling, q->qdtype, q->usage, q->swizzled,
                         q->pow2_scales, bits, q->mxfp8_2d, q->rht, q->rht_sign_mask, q->stochastic,
                         (unsigned long long)(uintptr_t)q->delayed, q->slot,
                         (unsigned long long)(uintptr_t)q->amax_reduce,
                         (unsigned long long)(uintptr_t)q->amax_reduce_user);
}

static PyObject *value_to(const flat_field *ff, const char *p)
{
    switch (ff->f->kind) {
    case OPF_FIELD_QUANTIZER: return quantizer_tuple((const opf_quantizer *)p);
    case OPF_FIELD_INT: return PyLong_FromLongLong(*(const int64_t *)p);
    case OPF_FIELD_ENUM:
    case OPF_FIELD_I32: return PyLong_FromLong(*(const int *)p);
    case OPF_FIELD_FLOAT: return PyFloat_FromDouble(*(const double *)p);
    case OPF_FIELD_F32: return PyFloat_FromDouble(*(const float *)p);
    case OPF_FIELD_BOOL: return PyBool_FromLong(*(const bool *)p);
    case OPF_FIELD_REF: return PyLong_FromVoidPtr(*(void *const *)p);
    default: Py_RETURN_NONE;
    }
}

/* ---- fakes ------------------------------------------------------------------------- */

int opf_py_allocs(const opf_spec *s, opf_py_alloc *a)
{
    if (s->ndim < 0) return 0;
    if (s->scaling == OPF_SCALING_NONE) {
        a[0] = (opf_py_alloc){.comp = OPF_COMP_DATA, .ndim = s->ndim, .dtype = s->dtype};
        memcpy(a[0].shape, s->shape, sizeof s->shape);
        return 1;
    }
    opf_layout L;
    opf_status st = opf_spec_layout(s, &L);
    if (st) {
        opf_raise(st, NULL);
        return -1;
    }
    int n = 0;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        const opf_component_desc *d = &L.comp[c];
        if (!d->present) continue;
        bool f32 = d->dtype == OPF_F32;
        int64_t rows = d->rows > 0 ? d->rows : 1;
        a[n++] = (opf_py_alloc){
            .comp = c, .ndim = 2, .shape = {d->rows, f32 ? d->cols : (int64_t)d->nbytes / rows},
            .dtype = f32 ? OPF_F32 : OPF_U8,
            .zero = c != OPF_COMP_DATA && c != OPF_COMP_COL_DATA};
    }
    return n;
}

static void none_specs(opf_spec *s, int n)
{
    memset(s, 0, sizeof *s * (size_t)n);
    for (int i = 0; i < n; i++) s[i].ndim = OPF_SPEC_NONE_NDIM;
}

opf_status opf_py_run_fake(const opf_op_class *c, int bwd, const void *args, opf_py_fake_specs *fs)
{
    none_specs(fs->outs, 1 + OPF_OP_MAX_EXTRA + OPF_OP_MAX_AUX);
    none_specs(fs->grads, OPF_OP_MAX_GRADS);
    if (!bwd)
        return c->forward_fake ? c->forward_fake(args, fs->outs, fs->outs + 1 + OPF_OP_MAX_EXTRA)
                               : OPF_OK;
    return c->backward_fake ? c->backward_fake(args, fs->grads) : OPF_OK;
}

int opf_py_out_specs(const opf_op_class *c, int bwd, int n_grads, opf_py_fake_specs *fs,
                     opf_spec **out)
{
    if (bwd) {
        *out = fs->grads;
        return n_grads;
    }
    /* the aux slots follow the outputs directly, as forward_impl takes them */
    int n = 1 + c->n_extra_out;
    memmove(fs->outs + n, fs->outs + 1 + OPF_OP_MAX_EXTRA, sizeof fs->outs[0] * OPF_OP_MAX_AUX);
    *out = fs->outs;
    return n + OPF_OP_MAX_AUX;
}

/* Where one component of a tensor field comes from (a new reference), or
 * NULL without an exception when it cannot be placed. */
typedef PyObject *(*source_fn)(void *user, const opf_tensor *t, int comp);

/* One entry per flattened field: ("t", spec, sources) for a present tensor
 * (a plain spec without memory: its source ("empty",)), ("v", value)
 * otherwise (None for an absent tensor). */
static PyObject *record_with(const opf_schema *s, const void *args, const char *who,
                             source_fn source, void *user)
{
    flat_field ff[MAX_FLAT];
    int n = opf_py_flatten(s, ff);
    if (n < 0) return NULL;
    PyObject *r = PyList_New(n);
    for (int i = 0; r && i < n; i++) {
        const char *p = (const char *)args + ff[i].off;
        const opf_field_kind k = ff[i].f->kind;
        PyObject *e;
        if (k == OPF_FIELD_TENSOR || k == OPF_FIELD_TENSOR_Q) {
            const opf_tensor *t = (const opf_tensor *)p;
            bool any = false;
            PyObject *srcs = PyTuple_New(OPF_COMP_COUNT);
            for (int c = 0; srcs && c < OPF_COMP_COUNT; c++) {
                PyObject *src = Py_None;
                if (t->data[c]) {
                    any = true;
                    if (!(src = source(user, t, c))) {
                        Py_DECREF(srcs);
                        Py_DECREF(r);
                        return opf_raise_msg(OPF_ERR_UNSUPPORTED,
                                             "%s \"%s\": field %s reads memory the torch path "
                                             "cannot place", s->name, who, ff[i].name);
                    }
                } else {
                    Py_INCREF(src);
                }
                PyTuple_SetItem(srcs, c, src);
            }
            if (srcs && !any && t->spec.ndim > 0 && t->spec.scaling == OPF_SCALING_NONE) {
                /* a spec without memory (a quantized primary's value: the
                 * spec of its gradient): ("empty",) places a tensor of it */
                any = true;
                PyTuple_SetItem(srcs, 0, Py_BuildValue("(s)", "empty"));
            }
            e = !srcs ? NULL : any ? Py_BuildValue("(sNN)", "t", spec_tuple(&t->spec), srcs)
                                   : (Py_DECREF(srcs), Py_BuildValue("(sO)", "v", Py_None));
        } else {
            e = Py_BuildValue("(sN)", "v", value_to(&ff[i], p));
        }
        if (!e) {
            Py_DECREF(r);
            return NULL;
        }
        PyList_SetItem(r, i, e);
    }
    return r;
}

/* ---- graph programs ----------------------------------------------------------------
 * A compiled graph (compile.h, "export") as the program opfuse.torch replays
 * with custom ops under torch.compile: the seq's forward and backward plans
 * with their fused ops, channels and gradient sums, every tensor placed as a
 * graph value or a parameter. */

/* ("param"|"qparam", index over the seq's parameters, component) or NULL. */
static PyObject *param_source(opf_seq *seq, const void *p)
{
    for (int i = 0, k = 0; i < opf_seq_len(seq); i++) {
        opf_op *op = opf_seq_at(seq, i);
        for (int j = 0; j < opf_op_num_params(op); j++, k++) {
            const opf_param *pr = opf_op_param_const(op, j);
            for (int c = 0; c < OPF_COMP_COUNT; c++) {
                if (pr->value.data[c] == p) return Py_BuildValue("(sii)", "param", k, c);
                if (pr->qvalue.data[c] == p) return Py_BuildValue("(sii)", "qparam", k, c);
            }
        }
    }
    return NULL;
}

/* The node's args are recorded from a copy (buf) in which every component
 * that refers to a graph value is non-NULL: baking leaves graph inputs NULL
 * (they are bound per call). */
typedef struct {
    const opf_graph *g;
    opf_seq         *seq;
    int              node;
    const char      *args, *buf;
} graph_src;

/* ("val", value, component, byte offset) for graph memory, else param_source. */
static PyObject *graph_source(void *user, const opf_tensor *t, int c)
{
    graph_src *s = user;
    const opf_tensor *orig = (const opf_tensor *)(s->args + ((const char *)t - s->buf));
    for (int r = 0; r < opf_graph_node_num_refs(s->g, s->node); r++) {
        opf_graph_ref ref;
        if (opf_graph_node_ref(s->g, s->node, r, &ref) || ref.t != orig) continue;
        if (ref.value[c] >= 0)
            return Py_BuildValue("(siin)", "val", ref.value[c], ref.comp[c],
                                 (Py_ssize_t)ref.offset[c]);
        break;
    }
    return param_source(s->seq, t->data[c]);
}

/* (kind, backward, class or None, first, count, fields or None, outs, ins,
 * n_extra_out, n_grads):
 * outs the (place, value) pairs it writes, ins the values of its other refs
 * (what a gradient sum adds), the class's extra outputs and the gradients
 * a backward returns. */
static PyObject *graph_node(const opf_graph *g, opf_seq *seq, int i)
{
    opf_graph_node_info info;
    const opf_schema *schema;
    const void *args;
    if (opf_graph_node(g, i, &info) || opf_graph_node_args(g, i, &schema, &args))
        return opf_raise(OPF_ERR_INVALID_ARG, NULL);
    static unsigned char bound;  /* the stand-in pointer of a graph input */
    _Alignas(64) unsigned char buf[OPF_OP_ARGS_MAX];
    graph_src src = {g, seq, i, args, (const char *)buf};
    if (schema) {
        memcpy(buf, args, schema->size);
        for (int r = 0; r < opf_graph_node_num_refs(g, i); r++) {
            opf_graph_ref ref;
            opf_graph_node_ref(g, i, r, &ref);
            size_t at = (size_t)((const char *)ref.t - (const char *)args);
            if (ref.output || (const char *)ref.t < (const char *)args || at >= schema->size)
                continue;
            opf_tensor *t = (opf_tensor *)(buf + at);
            for (int c = 0; c < OPF_COMP_COUNT; c++)
                if (ref.value[c] >= 0 && !t->data[c]) t->data[c] = &bound;
        }
    }
    PyObject *fields = schema ? record_with(schema, buf, info.op_name, graph_source, &src)
                              : (Py_INCREF(Py_None), Py_None);
    PyObject *outs = PyList_New(0), *ins = PyList_New(0);
    for (int r = 0; fields && outs && ins && r < opf_graph_node_num_refs(g, i); r++) {
        opf_graph_ref ref;
        opf_graph_node_ref(g, i, r, &ref);
        int v = -1;
        for (int c = 0; c < OPF_COMP_COUNT && v < 0; c++) v = ref.value[c];
        PyObject *e = ref.output ? Py_BuildValue("(ii)", ref.out_index, v) : PyLong_FromLong(v);
        if (!e || PyList_Append(ref.output ? outs : ins, e) < 0) Py_CLEAR(fields);
        Py_XDECREF(e);
    }
    if (!fields || !outs || !ins) {
        Py_XDECREF(fields);
        Py_XDECREF(outs);
        Py_XDECREF(ins);
        return NULL;
    }
    /* what the custom op returns: its class's outputs, or the covered ops' gradients */
    const opf_op_class *c = info.class_name ? opf_op_class_find(info.class_name) : NULL;
    int n_grads = 1;
    for (int k = info.first; c && k < info.first + info.count; k++)
        n_grads += opf_op_num_params(opf_seq_at(seq, k)) + opf_op_num_extra_in(opf_seq_at(seq, k));
    return Py_BuildValue("(iizii" "NNN" "ii)", (int)info.kind, (int)info.backward, info.class_name,
                         info.first, info.count, fields, outs, ins, c ? c->n_extra_out : 0,
                         n_grads);
}

static PyObject *int_list(const int *v, int n)
{
    PyObject *l = PyList_New(n);
    for (int i = 0; l && i < n; i++) PyList_SetItem(l, i, PyLong_FromLong(v[i]));
    return l;
}

PyObject *opf_py_graph_program(const opf_graph *g, opf_seq *seq)
{
    int nv = opf_graph_num_values(g), nn = opf_graph_num_nodes(g);
    PyObject *vals = PyList_New(nv), *nodes = PyList_New(nn);
    for (int v = 0; vals && v < nv; v++) {
        opf_graph_value_info vi;
        opf_graph_value(g, v, &vi);
        PyObject *e = Py_BuildValue("(Niinii" "s)", spec_tuple(&vi.spec), (int)vi.kind, vi.index,
                                    (Py_ssize_t)vi.field, vi.def, vi.def_out, vi.name);
        if (!e) Py_CLEAR(vals);
        else PyList_SetItem(vals, v, e);
    }
    for (int i = 0; vals && nodes && i < nn; i++) {
        PyObject *e = graph_node(g, seq, i);
        if (!e) Py_CLEAR(nodes);
        else PyList_SetItem(nodes, i, e);
    }
    if (!vals || !nodes) {
        Py_XDECREF(vals);
        Py_XDECREF(nodes);
        return NULL;
    }
    opf_graph_io io;
    opf_graph_get_io(g, &io);
    return Py_BuildValue("{s:N,s:N,s:(iiii),s:N,s:N,s:N,s:N}", "values", vals, "nodes", nodes,
                         "io", io.x, io.y, io.dy, io.dx, "extra_in",
                         int_list(io.extra_in, io.n_extra_in), "dextra_in",
                         int_list(io.dextra_in, io.n_extra_in), "extra_out",
                         int_list(io.extra_out, io.n_extra_out), "dextra_out",
                         int_list(io.dextra_out, io.n_extra_out));
}

/* ---- delayed scaling ---------------------------------------------------------------
 * The eager fuser updates every op's delayed-scaling state (amax history
 * roll, new scales) after a forward that records for backward and after
 * each backward; a compiled graph does it through an ordered custom op
 * calling these. */

/* delayed_ops(ops) -> the addresses of the ops that keep delayed state */
static PyObject *py_delayed_ops(PyObject *mod, PyObject *ops)
{
    PyObject *l = opf_py_list(ops, "ops must be a sequence");
    PyObject *r = l ? PyList_New(0) : NULL;
    for (Py_ssize_t i = 0; r && i < PyList_Size(l); i++) {
        opf_op *op = opf_py_op_get(PyList_GetItem(l, i));
        opf_recipe_state *rs = op ? opf_op_recipe_state(op) : NULL;
        if (!op) Py_CLEAR(r);
        else if (rs && (opf_recipe_state_delayed(rs, false) || opf_recipe_state_delayed(rs, true))) {
            PyObject *a = PyLong_FromVoidPtr(op);
            if (!a || PyList_Append(r, a) < 0) Py_CLEAR(r);
            Py_XDECREF(a);
        }
    }
    Py_XDECREF(l);
    return r;
}

/* delayed_update(ctx, addresses, backward): one direction's update of each
 * op (addresses from delayed_ops; the ops must be alive). */
static PyObject *py_delayed_update(PyObject *mod, PyObject *a)
{
    PyObject *ctx_obj, *addrs;
    int backward;
    if (!PyArg_ParseTuple(a, "OOp", &ctx_obj, &addrs, &backward)) return NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    PyObject *l = ctx ? opf_py_list(addrs, "addresses must be a sequence") : NULL;
    opf_status st = OPF_OK;
    for (Py_ssize_t i = 0; l && !st && i < PyList_Size(l); i++) {
        opf_op *op = PyLong_AsVoidPtr(PyList_GetItem(l, i));
        opf_recipe_state *rs = op ? opf_op_recipe_state(op) : NULL;
        if (rs) st = opf_recipe_state_update(ctx, rs, backward, NULL, NULL);
    }
    if (!l) return NULL;
    Py_DECREF(l);
    if (PyErr_Occurred()) return NULL;
    if (st) return opf_raise(st, ctx);
    Py_RETURN_NONE;
}

PyMethodDef opf_py_classop_methods[] = {
    {"delayed_ops", py_delayed_ops, METH_O,
     "delayed_ops(ops): addresses of the ops whose recipe state keeps delayed scaling."},
    {"delayed_update", py_delayed_update, METH_VARARGS,
     "delayed_update(ctx, addresses, backward): the delayed-scaling update of those ops."},
    {"class_fields", py_class_fields, METH_VARARGS,
     "class_fields(cls, bwd): the flattened args schema as (name, kind, flags)."},
    {NULL, NULL, 0, NULL},
};
