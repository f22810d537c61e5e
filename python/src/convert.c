/* convert.c: Python value objects (opfuse.Spec, Recipe, Quantizer: anything
 * with the attributes below) to the C structs and back. Absent attributes
 * or None keep the C default, so the Python classes may grow fields first. */
#include "ext.h"

PyObject *opf_py_list(PyObject *o, const char *what)
{
    PyObject *l = PySequence_Check(o) ? PySequence_List(o) : NULL;
    if (!l && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, what);
    return l;
}

/* Fetches attribute name of o; 0 with *out NULL when absent or None. */
static int get_attr(PyObject *o, const char *name, PyObject **out)
{
    *out = NULL;
    if (!PyObject_HasAttrString(o, name))
        return 0;
    PyObject *v = PyObject_GetAttrString(o, name);
    if (!v)
        return -1;
    if (v == Py_None) {
        Py_DECREF(v);
        return 0;
    }
    *out = v;
    return 0;
}

int opf_py_attr_int(PyObject *o, const char *name, long long *out)
{
    PyObject *v;
    if (get_attr(o, name, &v) < 0)
        return -1;
    if (!v)
        return 0;
    long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

int opf_py_attr_float(PyObject *o, const char *name, double *out)
{
    PyObject *v;
    if (get_attr(o, name, &v) < 0)
        return -1;
    if (!v)
        return 0;
    double x = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (x == -1.0 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

int opf_py_attr_bool(PyObject *o, const char *name, bool *out)
{
    PyObject *v;
    if (get_attr(o, name, &v) < 0)
        return -1;
    if (!v)
        return 0;
    int x = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (x < 0)
        return -1;
    *out = x;
    return 0;
}

/* Enum-typed fields read through a long long. */
#define ATTR_ENUM(o, name, field)                         \
    do {                                                  \
        long long v_ = (long long)(field);                \
        if (opf_py_attr_int(o, name, &v_) < 0)            \
            return -1;                                    \
        (field) = (__typeof__(field))v_;                  \
    } while (0)

#define ATTR_FLOAT(o, name, field)                        \
    do {                                                  \
        double v_ = (double)(field);                      \
        if (opf_py_attr_float(o, name, &v_) < 0)          \
            return -1;                                    \
        (field) = (__typeof__(field))v_;                  \
    } while (0)

int opf_py_to_spec(PyObject *o, opf_spec *out)
{
    PyObject *shape;
    if (get_attr(o, "shape", &shape) < 0)
        return -1;
    if (!shape) {
        PyErr_SetString(PyExc_TypeError, "a spec needs a shape");
        return -1;
    }
    PyObject *seq = opf_py_list(shape, "spec.shape must be a sequence");
    Py_DECREF(shape);
    if (!seq)
        return -1;
    Py_ssize_t n = PyList_Size(seq);
    if (n > OPF_MAX_DIMS) {
        Py_DECREF(seq);
        opf_raise_msg(OPF_ERR_SHAPE, "spec has %zd dims, at most %d", n, OPF_MAX_DIMS);
        return -1;
    }
    int64_t dims[OPF_MAX_DIMS];
    for (Py_ssize_t i = 0; i < n; i++) {
        dims[i] = PyLong_AsLongLong(PyList_GetItem(seq, i));
        if (dims[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = opf_spec_make((int)n, dims, OPF_F32);
    ATTR_ENUM(o, "dtype", out->dtype);
    ATTR_ENUM(o, "scaling", out->scaling);
    ATTR_ENUM(o, "qdtype", out->qdtype);
    ATTR_ENUM(o, "usage", out->usage);
    ATTR_ENUM(o, "flags", out->flags);
    return 0;
}

PyObject *opf_py_from_spec(const opf_spec *s)
{
    PyObject *shape = PyTuple_New(s->ndim);
    for (int i = 0; shape && i < s->ndim; i++)
        PyTuple_SetItem(shape, i, PyLong_FromLongLong(s->shape[i]));
    return Py_BuildValue("{s:N,s:i,s:i,s:i,s:I,s:I}", "shape", shape, "dtype", s->dtype,
                         "scaling", s->scaling, "qdtype", s->qdtype, "usage", s->usage, "flags",
                         s->flags);
}

int opf_py_to_recipe(PyObject *o, opf_recipe *out)
{
    long long kind = OPF_RECIPE_NONE;
    if (opf_py_attr_int(o, "kind", &kind) < 0)
        return -1;
    if (kind < 0 || kind >= OPF_RECIPE_COUNT) {
        opf_raise_msg(OPF_ERR_INVALID_ARG, "recipe kind %lld out of range", kind);
        return -1;
    }
    if (kind == OPF_RECIPE_CUSTOM) {
        opf_raise_msg(OPF_ERR_UNSUPPORTED,
                      "custom recipes are not reachable from Python yet: build the "
                      "quantizers with opfuse.Quantizer");
        return -1;
    }
    opf_recipe r = opf_recipe_default((opf_recipe_kind)kind);
    ATTR_ENUM(o, "format", r.format);
    ATTR_FLOAT(o, "margin", r.margin);
    ATTR_ENUM(o, "amax_history_len", r.amax_history_len);
    ATTR_ENUM(o, "amax_algo", r.amax_algo);
    ATTR_FLOAT(o, "amax_epsilon", r.amax_epsilon);
    ATTR_ENUM(o, "x_block_dim", r.x_block_dim);
    ATTR_ENUM(o, "w_block_dim", r.w_block_dim);
    ATTR_ENUM(o, "grad_block_dim", r.grad_block_dim);
    ATTR_ENUM(o, "backward_override", r.backward_override);
    if (opf_py_attr_bool(o, "reduce_amax", &r.reduce_amax) < 0 ||
        opf_py_attr_bool(o, "reject_nonfinite_amax", &r.reject_nonfinite_amax) < 0 ||
        opf_py_attr_bool(o, "power_2_scales", &r.power_2_scales) < 0 ||
        opf_py_attr_bool(o, "mxfp8_2d_weights", &r.mxfp8_2d_weights) < 0 ||
        opf_py_attr_bool(o, "nvfp4_rht", &r.nvfp4_rht) < 0 ||
        opf_py_attr_bool(o, "nvfp4_stochastic", &r.nvfp4_stochastic) < 0 ||
        opf_py_attr_bool(o, "nvfp4_2d_weights", &r.nvfp4_2d_weights) < 0)
        return -1;
    *out = r;
    return 0;
}

int opf_py_to_quantizer(PyObject *o, opf_quantizer *out)
{
    opf_quantizer q = opf_quantizer_default();
    ATTR_ENUM(o, "scaling", q.scaling);
    ATTR_ENUM(o, "qdtype", q.qdtype);
    ATTR_ENUM(o, "usage", q.usage);
    ATTR_FLOAT(o, "amax_epsilon", q.amax_epsilon);
    ATTR_ENUM(o, "rht_sign_mask", q.rht_sign_mask);
    ATTR_ENUM(o, "slot", q.slot);
    if (opf_py_attr_bool(o, "swizzled", &q.swizzled) < 0 ||
        opf_py_attr_bool(o, "pow2_scales", &q.pow2_scales) < 0 ||
        opf_py_attr_bool(o, "mxfp8_2d", &q.mxfp8_2d) < 0 ||
        opf_py_attr_bool(o, "rht", &q.rht) < 0 ||
        opf_py_attr_bool(o, "stochastic", &q.stochastic) < 0)
        return -1;
    PyObject *state;
    if (get_attr(o, "state", &state) < 0)
        return -1;
    if (state) {
        bool backward = false;
        if (opf_py_attr_bool(o, "backward", &backward) < 0) {
            Py_DECREF(state);
            return -1;
        }
        q.delayed = opf_py_recipe_state_delayed(state, backward);
        Py_DECREF(state);
        if (!q.delayed)
            return -1;
    }
    *out = q;
    return 0;
}

PyObject *opf_py_from_quantizer(const opf_quantizer *q)
{
    return Py_BuildValue("{s:i,s:i,s:I,s:O,s:O,s:f,s:O,s:O,s:i,s:O,s:i}", "scaling", q->scaling,
                         "qdtype", q->qdtype, "usage", q->usage, "swizzled",
                         q->swizzled ? Py_True : Py_False, "pow2_scales",
                         q->pow2_scales ? Py_True : Py_False, "amax_epsilon", q->amax_epsilon,
                         "mxfp8_2d", q->mxfp8_2d ? Py_True : Py_False, "rht",
                         q->rht ? Py_True : Py_False, "rht_sign_mask", (int)q->rht_sign_mask,
                         "stochastic", q->stochastic ? Py_True : Py_False, "slot", q->slot);
}
