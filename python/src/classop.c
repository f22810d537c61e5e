/* classop.c: op classes as torch custom ops, over op.h's public contract.
 *
 * opfuse.torch registers each op class's forward and backward as a custom
 * op whose arguments are the class's args struct flattened field by field.
 * Two entry points serve it (the impls and fakes are torchcall.c's
 * ClassCall):
 *
 *   class_fields(cls, bwd)          the flattened schema: (name, kind, flags)
 *   resolve(ops, x_spec, recipe, requires_grad, kwargs)
 *                                   resolve_fwd / setup_context / resolve_bwd
 *                                   once per op on placeholder tensors,
 *                                   recording where each tensor field's
 *                                   memory comes from and every value field
 *
 * resolve reports tensors by their specs (shape, dtype, scaling, qdtype,
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

static int spec_from(PyObject *v, opf_spec *s)
{
    PyObject *shape;
    int dt, sc, qd;
    unsigned us, fl;
    memset(s, 0, sizeof *s);
    if (!PyArg_ParseTuple(v, "OiiiII", &shape, &dt, &sc, &qd, &us, &fl)) return -1;
    PyObject *l = opf_py_list(shape, "tensor shape must be a sequence");
    if (!l) return -1;
    Py_ssize_t n = PyList_Size(l);
    if (n > OPF_MAX_DIMS) {
        Py_DECREF(l);
        opf_raise_msg(OPF_ERR_SHAPE, "tensor has %zd dims, at most %d", n, OPF_MAX_DIMS);
        return -1;
    }
    int64_t dims[OPF_MAX_DIMS] = {0};
    for (Py_ssize_t i = 0; i < n; i++) dims[i] = PyLong_AsLongLong(PyList_GetItem(l, i));
    Py_DECREF(l);
    *s = opf_spec_make((int)n, dims, (opf_dtype)dt);
    s->scaling = (opf_scaling)sc;
    s->qdtype = (opf_dtype)qd;
    s->usage = us;
    s->flags = fl;
    return PyErr_Occurred() ? -1 : 0;
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

/* None, "pass", or (spec, ((present, dtype, rows, cols, nbytes) x 6)). */
static PyObject *out_entry(const opf_spec *s)
{
    if (s->ndim == OPF_GRAD_PASSTHROUGH) return PyUnicode_FromString("pass");
    if (s->ndim < 0) Py_RETURN_NONE;
    opf_layout L;
    opf_status st = opf_spec_layout(s, &L);
    if (st) return opf_raise(st, NULL);
    PyObject *comps = PyTuple_New(OPF_COMP_COUNT);
    for (int c = 0; comps && c < OPF_COMP_COUNT; c++)
        PyTuple_SetItem(comps, c, Py_BuildValue("(iiLLn)", L.comp[c].present, L.comp[c].dtype,
                                                (long long)L.comp[c].rows, (long long)L.comp[c].cols,
                                                (Py_ssize_t)L.comp[c].nbytes));
    return comps ? Py_BuildValue("(NN)", spec_tuple(s), comps) : NULL;
}

static PyObject *out_list(const opf_spec *s, int n)
{
    PyObject *r = PyList_New(n);
    for (int i = 0; r && i < n; i++) {
        PyObject *e = out_entry(&s[i]);
        if (!e) {
            Py_DECREF(r);
            return NULL;
        }
        PyList_SetItem(r, i, e);
    }
    return r;
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

/* ---- resolve -------------------------------------------------------------------------
 * Placeholders stand for the tensors the torch side will pass: the main
 * input, the forward's outputs and aux, and dy. A field pointing at one of
 * them (or at a parameter's value or quantized copy) is recorded as that
 * source; any other memory cannot be placed and is refused. */

enum { SRC_X, SRC_OUT, SRC_AUX = SRC_OUT + 1 + OPF_OP_MAX_EXTRA, SRC_DY = SRC_AUX + OPF_OP_MAX_AUX,
       SRC_COUNT };
static unsigned char sentinel[SRC_COUNT][OPF_COMP_COUNT];

static void placeholder_tensor(const opf_spec *s, int src, opf_tensor *t)
{
    memset(t, 0, sizeof *t);
    t->spec = *s;
    opf_layout L;
    if (s->ndim < 0 || opf_spec_layout(s, &L)) return;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present) t->data[c] = &sentinel[src][c];
}

/* ("x"|"out"|"aux"|"dy"|"param"|"qparam", index, component) or NULL. */
static PyObject *source_of(opf_op *op, const void *p)
{
    const unsigned char *b = p;
    if (b >= &sentinel[0][0] && b < &sentinel[0][0] + sizeof sentinel) {
        int i = (int)(b - &sentinel[0][0]), src = i / OPF_COMP_COUNT, comp = i % OPF_COMP_COUNT;
        if (src == SRC_X) return Py_BuildValue("(sii)", "x", 0, comp);
        if (src == SRC_DY) return Py_BuildValue("(sii)", "dy", 0, comp);
        if (src < SRC_AUX) return Py_BuildValue("(sii)", "out", src - SRC_OUT, comp);
        return Py_BuildValue("(sii)", "aux", src - SRC_AUX, comp);
    }
    for (int i = 0; i < opf_op_num_params(op); i++) {
        const opf_param *pr = opf_op_param_const(op, i);
        for (int c = 0; c < OPF_COMP_COUNT; c++) {
            if (pr->value.data[c] == p) return Py_BuildValue("(sii)", "param", i, c);
            if (pr->qvalue.data[c] == p) return Py_BuildValue("(sii)", "qparam", i, c);
        }
    }
    return NULL;
}

/* One entry per flattened field: ("t", spec, sources) for a present tensor,
 * ("v", value) otherwise (None for an absent tensor). */
static PyObject *record(opf_op *op, const opf_schema *s, const void *args)
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
                    if (!(src = source_of(op, t->data[c]))) {
                        Py_DECREF(srcs);
                        Py_DECREF(r);
                        return opf_raise_msg(OPF_ERR_UNSUPPORTED,
                                             "%s \"%s\": field %s reads memory the torch path "
                                             "cannot place", s->name, opf_op_name(op), ff[i].name);
                    }
                } else {
                    Py_INCREF(src);
                }
                PyTuple_SetItem(srcs, c, src);
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

typedef struct {
    opf_ctx          *ctx;
    const opf_recipe *recipe;
    bool              requires_grad;
    PyObject         *kwargs;  /* a mapping or None */
} resolve_in;

/* The backward half: setup_context on placeholders, resolve_bwd, the fake. */
static PyObject *resolve_backward(opf_op *op, const resolve_in *in, const void *fargs,
                                  const opf_py_fake_specs *fs)
{
    const opf_op_class *c = opf_op_class_of(op);
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA + OPF_OP_MAX_AUX];
    for (int i = 0; i < 1 + OPF_OP_MAX_EXTRA + OPF_OP_MAX_AUX; i++)
        placeholder_tensor(&fs->outs[i], SRC_OUT + i, &outs[i]);
    opf_op_ctx octx;
    memset(&octx, 0, sizeof octx);
    octx.requires_grad = true;
    octx.prev_grad_q = opf_quantizer_default();
    opf_status st = OPF_OK;
    const opf_tensor *aux = outs + 1 + OPF_OP_MAX_EXTRA;
    if (c->setup_context) {
        st = c->setup_context(op, &octx, fargs, outs, aux);
    } else {
        for (int i = 0; i < OPF_OP_MAX_AUX; i++)
            if (aux[i].data[0] || aux[i].data[OPF_COMP_COL_DATA])
                opf_tensor_retain(&aux[i], &octx.saved[octx.n_saved++]);
    }
    octx.valid = !st;
    opf_tensor dy;
    placeholder_tensor(&fs->outs[0], SRC_DY, &dy);
    opf_bwd_env env = {.ctx = in->ctx, .dy = &dy};
    _Alignas(64) unsigned char bargs[OPF_OP_ARGS_MAX];
    memset(bargs, 0, c->bwd_schema->size);
    if (!st) st = c->resolve_bwd(op, &octx, &env, bargs);
    int n = 1 + opf_op_num_params(op) + opf_op_num_extra_in(op);
    opf_py_fake_specs bs;
    if (!st) st = opf_py_run_fake(c, 1, bargs, &bs);
    PyObject *r = st ? opf_raise(st, in->ctx) : record(op, c->bwd_schema, bargs);
    opf_op_ctx_clear(&octx);
    if (!r) return NULL;
    return Py_BuildValue("(NNi)", r, out_list(bs.grads, n), n);
}

static PyObject *resolve_one(opf_op *op, const resolve_in *in, opf_spec *x_spec, PyObject *kw)
{
    const opf_op_class *c = opf_op_class_of(op);
    if (opf_op_num_extra_in(op) || opf_op_num_extra_out(op) || opf_op_is_fused(op) ||
        !c->forward_impl)
        return opf_raise_msg(OPF_ERR_UNSUPPORTED, "op \"%s\" (%s): extra inputs, extra outputs "
                             "and fused ops are not in the torch custom-op path yet",
                             opf_op_name(op), c->name);
    _Alignas(16) unsigned char kwbuf[OPF_OP_ARGS_MAX];
    const void *kwargs = NULL;
    if (kw != Py_None && c->kwargs_schema) {
        memset(kwbuf, 0, c->kwargs_schema->size);
        if (opf_py_pack_values(c->kwargs_schema, kw, kwbuf) < 0) return NULL;
        kwargs = kwbuf;
    }
    opf_tensor x;
    placeholder_tensor(x_spec, SRC_X, &x);
    opf_fwd_env env = {.ctx = in->ctx, .x = &x, .recipe = in->recipe,
                       .requires_grad = in->requires_grad, .kwargs = kwargs};
    _Alignas(64) unsigned char args[OPF_OP_ARGS_MAX];
    memset(args, 0, c->fwd_schema->size);
    opf_py_fake_specs fs;
    opf_status st = c->resolve_fwd(op, &env, args);
    if (!st && (st = opf_schema_validate(c->fwd_schema, args)))
        opf_raise_msg(st, "%s: %s", opf_op_name(op), opf_last_error(NULL));
    if (!st && (st = opf_py_run_fake(c, 0, args, &fs)))
        opf_raise_msg(st, "%s: %s", opf_op_name(op), opf_last_error(NULL));
    if (!st && c->after_fake)
        st = c->after_fake(op, &env, args, fs.outs, fs.outs + 1 + OPF_OP_MAX_EXTRA);
    if (st) return PyErr_Occurred() ? NULL : opf_raise(st, in->ctx);
    PyObject *fwd = record(op, c->fwd_schema, args);
    PyObject *bwd = fwd && in->requires_grad && c->backward_impl
                        ? resolve_backward(op, in, args, &fs)
                        : (Py_INCREF(Py_None), Py_None);
    PyObject *r = fwd && bwd ? Py_BuildValue("{s:s,s:O,s:N,s:N,s:O}", "class", c->name, "fwd", fwd,
                                             "outs", out_list(fs.outs, 1 + c->n_extra_out), "aux",
                                             out_list(fs.outs + 1 + OPF_OP_MAX_EXTRA, OPF_OP_MAX_AUX),
                                             "bwd", bwd)
                             : NULL;
    Py_XDECREF(fwd);
    Py_XDECREF(bwd);
    *x_spec = fs.outs[0];
    return r;
}

/* resolve(ctx, ops, x_spec, recipe, requires_grad, kwargs) -> one dict per op */
static PyObject *py_resolve(PyObject *mod, PyObject *a)
{
    PyObject *ctx_obj, *ops, *xs, *recipe_obj, *kwargs;
    int rg;
    if (!PyArg_ParseTuple(a, "OOOOpO", &ctx_obj, &ops, &xs, &recipe_obj, &rg, &kwargs)) return NULL;
    resolve_in in = {.ctx = opf_py_ctx_get(ctx_obj), .requires_grad = rg, .kwargs = kwargs};
    opf_recipe recipe;
    opf_spec x;
    if (!in.ctx || spec_from(xs, &x) < 0) return NULL;
    if (recipe_obj != Py_None) {
        if (opf_py_to_recipe(recipe_obj, &recipe) < 0) return NULL;
        in.recipe = &recipe;
    }
    PyObject *l = opf_py_list(ops, "ops must be a sequence");
    if (!l) return NULL;
    Py_ssize_t n = PyList_Size(l);
    PyObject *r = PyList_New(n);
    for (Py_ssize_t i = 0; r && i < n; i++) {
        opf_op *op = opf_py_op_get(PyList_GetItem(l, i));
        PyObject *kw = kwargs == Py_None ? Py_None : PySequence_GetItem(kwargs, i);
        PyObject *e = op && kw ? resolve_one(op, &in, &x, kw) : NULL;
        if (kw != Py_None) Py_XDECREF(kw);
        if (!e) Py_CLEAR(r);
        else PyList_SetItem(r, i, e);
    }
    Py_DECREF(l);
    return r;
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
    {"resolve", py_resolve, METH_VARARGS,
     "resolve(ctx, ops, x_spec, recipe, requires_grad, kwargs): per-op field sources."},
    {NULL, NULL, 0, NULL},
};
