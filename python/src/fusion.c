/* fusion.c: fusion functions written in Python, registered with the C
 * fuser (fuser.h, "fusions").
 *
 * The fuser calls one C function per registration (py_fusion) with the
 * group's op list; it hands Python the list as (index, class, name, fused)
 * tuples and gets back, from the registered callable, a list whose entries
 * are an input index (the op unchanged) or (fused class, [indices]) (a run
 * of basic ops replaced by a new fused op of that class). The fuser then
 * checks that the result maps back to the basic ops, as for a C function.
 * A Python exception becomes the fusion's error (the seq's forward fails
 * with it), its text in the message. */
#include "ext.h"
#include <stdio.h>
#include <string.h>

typedef struct {
    char      name[64];
    PyObject *fn;  /* fn(ops, recipe name or None) -> entries */
} py_fusion_entry;

/* The Python exception as the context's error (and cleared). */
static opf_status python_error(opf_ctx *ctx, const char *name)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *s = value ? PyObject_Str(value) : NULL;
    PyObject *b = s ? PyUnicode_AsUTF8String(s) : NULL;
    PyObject *tn = type ? PyObject_GetAttrString(type, "__name__") : NULL;
    PyObject *tb8 = tn ? PyUnicode_AsUTF8String(tn) : NULL;
    opf_status st = opf_set_error(ctx, OPF_ERR_INVALID_ARG, "fusion \"%s\": the Python function "
                                  "raised %s: %s", name, tb8 ? PyBytes_AsString(tb8) : "?",
                                  b ? PyBytes_AsString(b) : "?");
    Py_XDECREF(tb8);
    Py_XDECREF(tn);
    Py_XDECREF(b);
    Py_XDECREF(s);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
    return st;
}

static PyObject *op_list(opf_op *const *in, int n)
{
    PyObject *l = PyList_New(n);
    for (int i = 0; l && i < n; i++) {
        PyObject *e = Py_BuildValue("(isOO)", i, opf_op_class_of(in[i])->name,
                                    opf_op_name(in[i]) ? PyUnicode_FromString(opf_op_name(in[i]))
                                                       : (Py_INCREF(Py_None), Py_None),
                                    opf_op_is_fused(in[i]) ? Py_True : Py_False);
        if (!e) Py_CLEAR(l);
        else PyList_SetItem(l, i, e);
    }
    return l;
}

/* One entry of the result: an input index, or a fused op over input
 * indices (created here; *made set when so). */
static opf_status entry_op(opf_ctx *ctx, const char *name, PyObject *e, opf_op *const *in, int n,
                           opf_op **out, bool *made)
{
    *made = false;
    if (PyLong_Check(e)) {
        long i = PyLong_AsLong(e);
        if (i < 0 || i >= n)
            return opf_set_error(ctx, OPF_ERR_INVALID_ARG, "fusion \"%s\": index %ld is not "
                                 "an op of the window (%d ops)", name, i, n);
        *out = in[i];
        return OPF_OK;
    }
    const char *cls;
    PyObject *idx;
    if (!PyArg_ParseTuple(e, "sO", &cls, &idx)) return python_error(ctx, name);
    PyObject *l = PySequence_List(idx);
    if (!l) return python_error(ctx, name);
    opf_op *basic[OPF_MAX_GROUP_OPS];
    Py_ssize_t m = PyList_Size(l);
    opf_status st = m < 1 || m > OPF_MAX_GROUP_OPS
                        ? opf_set_error(ctx, OPF_ERR_INVALID_ARG, "fusion \"%s\": a fused op "
                                        "over %zd ops", name, m)
                        : OPF_OK;
    for (Py_ssize_t k = 0; !st && k < m; k++) {
        long i = PyLong_AsLong(PyList_GetItem(l, k));
        if (PyErr_Occurred()) st = python_error(ctx, name);
        else if (i < 0 || i >= n || opf_op_is_fused(in[i]))
            st = opf_set_error(ctx, OPF_ERR_INVALID_ARG, "fusion \"%s\": a fused %s over "
                               "entry %ld, which is %s", name, cls, i,
                               i < 0 || i >= n ? "not in the window"
                                               : "a fused op already (fusions never nest)");
        else basic[k] = in[i];
    }
    Py_DECREF(l);
    if (!st) st = opf_fused_op_create(ctx, cls, basic, (int)m, out);
    *made = st == OPF_OK;
    return st;
}

static opf_status py_fusion(opf_ctx *ctx, opf_op *const *in, int n, const opf_recipe *recipe,
                            void *user, opf_op **out, int *n_out)
{
    py_fusion_entry *f = user;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *ops = op_list(in, n);
    PyObject *r = ops ? PyObject_CallFunction(f->fn, "Oz", ops,
                                              recipe ? opf_recipe_name(recipe->kind) : NULL)
                      : NULL;
    PyObject *l = r ? PySequence_List(r) : NULL;
    opf_status st = l ? OPF_OK : python_error(ctx, f->name);
    Py_ssize_t m = l ? PyList_Size(l) : 0;
    if (!st && m > n)
        st = opf_set_error(ctx, OPF_ERR_INVALID_ARG, "fusion \"%s\": %zd entries for a window of "
                           "%d ops", f->name, m, n);
    int k = 0;
    bool made[OPF_MAX_GROUP_OPS] = {false};
    for (; !st && k < m; k++) st = entry_op(ctx, f->name, PyList_GetItem(l, k), in, n, &out[k],
                                            &made[k]);
    if (st)  /* fused ops made before the error are not handed over */
        for (int j = 0; j < k; j++)
            if (made[j]) opf_op_destroy(out[j]);
    *n_out = st ? 0 : (int)m;
    Py_XDECREF(l);
    Py_XDECREF(r);
    Py_XDECREF(ops);
    PyGILState_Release(gil);
    return st;
}

/* register_fusion(which, name, fn, prepend): which 0 forward, 1 backward,
 * 2 joint. The entry lives until unregister_fusion (a registry may hold
 * it while plans are built on other threads). */
static PyObject *py_register_fusion(PyObject *mod, PyObject *a)
{
    int which, prepend;
    const char *name;
    PyObject *fn;
    if (!PyArg_ParseTuple(a, "isOp", &which, &name, &fn, &prepend)) return NULL;
    if (!PyCallable_Check(fn)) return opf_raise_msg(OPF_ERR_INVALID_ARG, "fusion \"%s\": fn is "
                                                    "not callable", name);
    py_fusion_entry *e = PyMem_Calloc(1, sizeof *e);
    if (!e) return PyErr_NoMemory();
    snprintf(e->name, sizeof e->name, "%s", name);
    e->fn = fn;
    Py_INCREF(fn);
    opf_status (*reg[])(const char *, opf_fusion_fn, void *, bool) = {
        opf_register_forward_fusion, opf_register_backward_fusion, opf_register_joint_fusion};
    opf_status st = which < 0 || which > 2 ? OPF_ERR_INVALID_ARG
                                           : reg[which](name, py_fusion, e, prepend);
    if (st) {
        Py_DECREF(fn);
        PyMem_Free(e);
        return which < 0 || which > 2 ? opf_raise_msg(st, "register_fusion: which is %d", which)
                                      : opf_raise(st, NULL);
    }
    return PyLong_FromVoidPtr(e);
}

/* unregister_fusion(name, handle): handle from register_fusion. */
static PyObject *py_unregister_fusion(PyObject *mod, PyObject *a)
{
    const char *name;
    PyObject *h;
    if (!PyArg_ParseTuple(a, "sO", &name, &h)) return NULL;
    py_fusion_entry *e = PyLong_AsVoidPtr(h);
    if (!e) return NULL;
    opf_status st = opf_unregister_fusion(name);
    if (st) return opf_raise(st, NULL);
    Py_DECREF(e->fn);
    PyMem_Free(e);
    Py_RETURN_NONE;
}

PyMethodDef opf_py_fusion_methods[] = {
    {"register_fusion", py_register_fusion, METH_VARARGS,
     "register_fusion(which, name, fn, prepend) -> handle: which 0 forward, 1 backward, 2 joint."},
    {"unregister_fusion", py_unregister_fusion, METH_VARARGS,
     "unregister_fusion(name, handle)."},
    {NULL, NULL, 0, NULL},
};
