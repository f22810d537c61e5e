/* quant.c: recipes, recipe state, quantize / dequantize / requantize, usage
 * updates and the GEMM, over include/opfuse/quant.h and gemm.h. */
#include "ext.h"

/* ---- RecipeState ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    opf_recipe_state *rs;
    PyObject         *ctx;
} opf_py_rstate;

static PyTypeObject *rstate_type;

opf_delayed_state *opf_py_recipe_state_delayed(PyObject *o, bool backward)
{
    if (!PyObject_TypeCheck(o, rstate_type)) {
        PyErr_SetString(PyExc_TypeError, "quantizer.state must be an opfuse RecipeState");
        return NULL;
    }
    opf_delayed_state *d = opf_recipe_state_delayed(((opf_py_rstate *)o)->rs, backward);
    if (!d)
        opf_raise_msg(OPF_ERR_INVALID_ARG, "recipe state has no delayed state");
    return d;
}

static int rstate_init(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"ctx", "recipe", "module_type", "name", "num_gemms", NULL};
    PyObject *ctx_obj, *rec;
    const char *module_type, *name = NULL;
    int num_gemms = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOs|zi", names, &ctx_obj, &rec, &module_type,
                                     &name, &num_gemms))
        return -1;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    opf_recipe r;
    if (!ctx || opf_py_to_recipe(rec, &r) < 0)
        return -1;
    opf_py_rstate *s = (opf_py_rstate *)self;
    opf_status st = opf_recipe_state_create(ctx, &r, module_type, name, num_gemms, &s->rs);
    if (st != OPF_OK) {
        opf_raise(st, ctx);
        return -1;
    }
    s->ctx = ctx_obj;
    Py_INCREF(ctx_obj);
    return 0;
}

static void rstate_dealloc(PyObject *self)
{
    opf_py_rstate *s = (opf_py_rstate *)self;
    opf_recipe_state_destroy(s->rs);
    Py_CLEAR(s->ctx);
    PyTypeObject *tp = Py_TYPE(self);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
    Py_DECREF(tp);
}

/* quantizer(role, gemm=0): the quantizer fields as a dict; delayed ones carry
 * state (this object), backward and slot. */
static PyObject *rstate_quantizer(PyObject *self, PyObject *args)
{
    int role, gemm = 0;
    if (!PyArg_ParseTuple(args, "i|i", &role, &gemm))
        return NULL;
    opf_py_rstate *s = (opf_py_rstate *)self;
    opf_quantizer q;
    opf_status st = opf_recipe_state_quantizer(s->rs, (opf_tensor_role)role, gemm, &q);
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    PyObject *d = opf_py_from_quantizer(&q);
    if (d && q.delayed) {
        bool backward = q.delayed == opf_recipe_state_delayed(s->rs, true);
        PyDict_SetItemString(d, "state", self);
        PyDict_SetItemString(d, "backward", backward ? Py_True : Py_False);
    }
    return d;
}

static PyObject *rstate_update(PyObject *self, PyObject *args)
{
    int backward = 0;
    if (!PyArg_ParseTuple(args, "|p", &backward))
        return NULL;
    opf_py_rstate *s = (opf_py_rstate *)self;
    opf_ctx *ctx = opf_py_ctx_get(s->ctx);
    if (!ctx)
        return NULL;
    opf_status st = opf_recipe_state_update(ctx, s->rs, backward, NULL, NULL);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    Py_RETURN_NONE;
}

/* delayed(backward): (scale view [slots], history view [L, slots]) or None. */
static PyObject *rstate_delayed(PyObject *self, PyObject *args)
{
    int backward = 0;
    if (!PyArg_ParseTuple(args, "|p", &backward))
        return NULL;
    opf_delayed_state *d = opf_recipe_state_delayed(((opf_py_rstate *)self)->rs, backward);
    if (!d)
        Py_RETURN_NONE;
    int64_t n = opf_delayed_state_slots(d);
    int64_t hist[2] = {opf_delayed_state_history_len(d), n};
    PyObject *ctx = ((opf_py_rstate *)self)->ctx;
    return Py_BuildValue("(NN)",
                         opf_py_view(self, ctx, opf_delayed_state_scale(d), 1, &n, OPF_F32, 1),
                         opf_py_view(self, ctx, opf_delayed_state_history(d), 2, hist, OPF_F32, 1));
}

static PyMethodDef rstate_methods[] = {
    {"quantizer", rstate_quantizer, METH_VARARGS, "quantizer(role, gemm=0) as a dict."},
    {"update", rstate_update, METH_VARARGS, "update(backward=False): the delayed update."},
    {"delayed", rstate_delayed, METH_VARARGS, "delayed(backward): (scale, history) views."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot rstate_slots[] = {
    {Py_tp_init, rstate_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, rstate_dealloc},
    {Py_tp_methods, rstate_methods},
    {Py_tp_doc, "RecipeState(ctx, recipe, module_type, name=None, num_gemms=1)."},
    {0, NULL},
};

static PyType_Spec rstate_spec = {"opfuse._C.RecipeState", sizeof(opf_py_rstate), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, rstate_slots};

int opf_py_quant_init_types(PyObject *m)
{
    rstate_type = (PyTypeObject *)PyType_FromSpec(&rstate_spec);
    if (!rstate_type)
        return -1;
    Py_INCREF(rstate_type);
    return PyModule_AddObject(m, "RecipeState", (PyObject *)rstate_type);
}

/* ---- module functions ------------------------------------------------------------- */

static PyObject *py_recipe_validate(PyObject *mod, PyObject *rec)
{
    opf_recipe r;
    if (opf_py_to_recipe(rec, &r) < 0)
        return NULL;
    opf_status st = opf_recipe_validate(&r);
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    Py_RETURN_NONE;
}

static PyObject *py_recipe_quantizer(PyObject *mod, PyObject *args)
{
    PyObject *rec;
    const char *module_type, *name = NULL;
    int role;
    if (!PyArg_ParseTuple(args, "Osi|z", &rec, &module_type, &role, &name))
        return NULL;
    opf_recipe r;
    if (opf_py_to_recipe(rec, &r) < 0)
        return NULL;
    opf_quantizer_role qr = {module_type, (opf_tensor_role)role, name};
    opf_quantizer q;
    opf_status st = opf_recipe_quantizer(&r, &qr, &q);
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    return opf_py_from_quantizer(&q);
}

static PyObject *py_quantizer_spec(PyObject *mod, PyObject *args)
{
    PyObject *qo, *so;
    if (!PyArg_ParseTuple(args, "OO", &qo, &so))
        return NULL;
    opf_quantizer q;
    opf_spec in, out;
    if (opf_py_to_quantizer(qo, &q) < 0 || opf_py_to_spec(so, &in) < 0)
        return NULL;
    opf_status st = opf_quantizer_spec(&q, &in, &out);
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    return opf_py_from_spec(&out);
}

/* Result tensors of the functions below: allocated by the context unless the
 * caller passed `out` (caller memory laid out as the result's spec). */
static PyObject *result(opf_status st, opf_ctx *ctx, PyObject *ctx_obj, opf_tensor *t,
                        PyObject *out)
{
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    if (out) {
        Py_INCREF(out);
        return out;
    }
    return opf_py_tensor_wrap(t, ctx_obj, NULL);
}

/* quantize(ctx, quantizer, x, out=None) */
static PyObject *py_quantize(PyObject *mod, PyObject *args)
{
    PyObject *ctx_obj, *qo, *xo, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOO|O", &ctx_obj, &qo, &xo, &out))
        return NULL;
    if (out == Py_None)
        out = NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    opf_quantizer q;
    if (!ctx || opf_py_to_quantizer(qo, &q) < 0)
        return NULL;
    const opf_tensor *x = opf_py_tensor_get(xo, 0);
    if (!x)
        return NULL;
    opf_tensor t = {0};
    if (out) {
        opf_tensor *o = (opf_tensor *)opf_py_tensor_get(out, 0);
        if (!o)
            return NULL;
        return result(opf_quantize(ctx, &q, x, o), ctx, ctx_obj, NULL, out);
    }
    return result(opf_quantize_alloc(ctx, &q, x, &t), ctx, ctx_obj, &t, NULL);
}

/* Allocates a plain tensor of x's logical shape in dtype dt. */
static opf_status alloc_plain(opf_ctx *ctx, const opf_spec *like, int dt, opf_tensor *t)
{
    opf_spec s = opf_spec_make(like->ndim, like->shape, (opf_dtype)dt);
    return opf_tensor_alloc(ctx, &s, t);
}

/* dequantize(ctx, q, which=ROWWISE, dtype=F32, out=None) */
static PyObject *py_dequantize(PyObject *mod, PyObject *args)
{
    PyObject *ctx_obj, *qo, *out = NULL;
    unsigned which = OPF_USAGE_ROWWISE;
    int dt = OPF_F32;
    if (!PyArg_ParseTuple(args, "OO|IiO", &ctx_obj, &qo, &which, &dt, &out))
        return NULL;
    if (out == Py_None)
        out = NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    const opf_tensor *q = ctx ? opf_py_tensor_get(qo, 0) : NULL;
    if (!q)
        return NULL;
    opf_tensor t = {0};
    if (out) {
        opf_tensor *o = (opf_tensor *)opf_py_tensor_get(out, 0);
        return o ? result(opf_dequantize(ctx, q, which, o), ctx, ctx_obj, NULL, out) : NULL;
    }
    if (dt < 0 || dt >= OPF_DTYPE_COUNT)
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "dequantize: dtype %d out of range", dt);
    opf_status st = alloc_plain(ctx, &q->spec, dt, &t);
    if (st == OPF_OK) {
        st = opf_dequantize(ctx, q, which, &t);
        if (st != OPF_OK)
            opf_tensor_release(&t);
    }
    return result(st, ctx, ctx_obj, &t, NULL);
}

/* requantize(ctx, quantizer, q) */
static PyObject *py_requantize(PyObject *mod, PyObject *args)
{
    PyObject *ctx_obj, *qo, *to;
    if (!PyArg_ParseTuple(args, "OOO", &ctx_obj, &qo, &to))
        return NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    opf_quantizer q;
    if (!ctx || opf_py_to_quantizer(qo, &q) < 0)
        return NULL;
    const opf_tensor *in = opf_py_tensor_get(to, 0);
    if (!in)
        return NULL;
    opf_spec plain = in->spec, qs;
    plain.scaling = OPF_SCALING_NONE;
    plain.flags = 0;
    opf_status st = opf_quantizer_spec(&q, &plain, &qs);
    opf_tensor t = {0};
    if (st == OPF_OK)
        st = opf_tensor_alloc(ctx, &qs, &t);
    if (st == OPF_OK && (st = opf_requantize(ctx, &q, in, &t)) != OPF_OK)
        opf_tensor_release(&t);
    return result(st, ctx, ctx_obj, &t, NULL);
}

/* update_usage(ctx, t, usage): derives or drops copies of t in place. */
static PyObject *py_update_usage(PyObject *mod, PyObject *args)
{
    PyObject *ctx_obj, *to;
    unsigned usage;
    if (!PyArg_ParseTuple(args, "OOI", &ctx_obj, &to, &usage))
        return NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    opf_tensor *t = ctx ? (opf_tensor *)opf_py_tensor_get(to, 0) : NULL;
    if (!t)
        return NULL;
    opf_status st = opf_tensor_update_usage(ctx, t, usage);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    opf_py_tensor *pt = (opf_py_tensor *)to;
    if (t->buf && !pt->ctx) {  /* a derived copy now lives in a library buffer */
        pt->ctx = ctx_obj;
        Py_INCREF(ctx_obj);
    }
    Py_RETURN_NONE;
}

static PyObject *py_swizzle(PyObject *mod, PyObject *args)
{
    PyObject *ctx_obj, *to;
    int swizzled;
    if (!PyArg_ParseTuple(args, "OOp", &ctx_obj, &to, &swizzled))
        return NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    opf_tensor *t = ctx ? (opf_tensor *)opf_py_tensor_get(to, 0) : NULL;
    if (!t)
        return NULL;
    opf_status st = opf_tensor_swizzle(ctx, t, swizzled);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    Py_RETURN_NONE;
}

/* gemm(ctx, a, b, layout, dtype=F32, alpha=1, beta=1, accumulate=False,
 *      bias=None, out=None, out_quantizer=None) */
static PyObject *py_gemm(PyObject *mod, PyObject *args, PyObject *kw)
{
    static char *names[] = {"ctx", "a", "b", "layout", "dtype", "alpha", "beta", "accumulate",
                            "bias", "out", "out_quantizer", NULL};
    PyObject *ctx_obj, *ao, *bo, *bias_o = Py_None, *out = Py_None, *oq = Py_None;
    int layout, dt = OPF_F32, acc = 0;
    float alpha = 1.0f, beta = 1.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOi|iffpOOO", names, &ctx_obj, &ao, &bo,
                                     &layout, &dt, &alpha, &beta, &acc, &bias_o, &out, &oq))
        return NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    const opf_tensor *a = ctx ? opf_py_tensor_get(ao, 0) : NULL;
    const opf_tensor *b = a ? opf_py_tensor_get(bo, 0) : NULL;
    if (!b)
        return NULL;
    opf_gemm_options o = opf_gemm_options_default();
    o.alpha = alpha;
    o.beta = beta;
    o.accumulate = acc;
    o.bias = opf_py_tensor_get(bias_o, 1);
    if (!o.bias && PyErr_Occurred())
        return NULL;
    opf_quantizer q;
    if (oq != Py_None) {
        if (opf_py_to_quantizer(oq, &q) < 0)
            return NULL;
        o.out_quantizer = &q;
    }
    if (out != Py_None) {
        opf_tensor *d = (opf_tensor *)opf_py_tensor_get(out, 0);
        return d ? result(opf_gemm(ctx, a, b, (opf_gemm_layout)layout, &o, d), ctx, ctx_obj,
                          NULL, out)
                 : NULL;
    }
    opf_spec ds, qs;
    opf_tensor d = {0};
    opf_status st = opf_gemm_out_spec(&a->spec, &b->spec, (opf_gemm_layout)layout,
                                      (opf_dtype)dt, &ds);
    if (st == OPF_OK && o.out_quantizer)
        st = opf_quantizer_spec(o.out_quantizer, &ds, &qs), ds = qs;
    if (st == OPF_OK)
        st = opf_tensor_alloc(ctx, &ds, &d);
    if (st == OPF_OK && (st = opf_gemm(ctx, a, b, (opf_gemm_layout)layout, &o, &d)) != OPF_OK)
        opf_tensor_release(&d);
    return result(st, ctx, ctx_obj, &d, NULL);
}

PyMethodDef opf_py_quant_methods[] = {
    {"recipe_validate", py_recipe_validate, METH_O, "opf_recipe_validate."},
    {"recipe_quantizer", py_recipe_quantizer, METH_VARARGS,
     "recipe_quantizer(recipe, module_type, role, name=None) as a dict."},
    {"quantizer_spec", py_quantizer_spec, METH_VARARGS, "quantizer_spec(q, spec) as a dict."},
    {"quantize", py_quantize, METH_VARARGS, "quantize(ctx, q, x, out=None) -> Tensor."},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(ctx, t, which=ROWWISE, dtype=F32, out=None) -> Tensor."},
    {"requantize", py_requantize, METH_VARARGS, "requantize(ctx, q, t) -> Tensor."},
    {"update_usage", py_update_usage, METH_VARARGS, "update_usage(ctx, t, usage) in place."},
    {"swizzle", py_swizzle, METH_VARARGS, "swizzle(ctx, t, swizzled) in place."},
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_VARARGS | METH_KEYWORDS,
     "gemm(ctx, a, b, layout, dtype=F32, alpha=1, beta=1, accumulate=False, bias=None, "
     "out=None, out_quantizer=None) -> Tensor."},
    {NULL, NULL, 0, NULL},
};
