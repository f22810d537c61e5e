/* module.c: the opfuse._C module: exception classes per status, init. */

#include "ext.h"
#include <stdarg.h>
#include <stdio.h>

PyObject *opf_py_errors[OPF_STATUS_COUNT];

/* Class names and the builtin exception each also derives from, so that
 * `except ValueError` keeps working for callers that do not know opfuse. */
static const struct {
    const char *name;
    const char *builtin;
} error_classes[OPF_STATUS_COUNT] = {
    [OPF_ERR_INVALID_ARG] = {"InvalidArgError", "ValueError"},
    [OPF_ERR_SHAPE]       = {"ShapeError", "ValueError"},
    [OPF_ERR_DTYPE]       = {"DtypeError", "TypeError"},
    [OPF_ERR_UNSUPPORTED] = {"UnsupportedError", "NotImplementedError"},
    [OPF_ERR_NO_MEMORY]   = {"NoMemoryError", "MemoryError"},
    [OPF_ERR_DEVICE]      = {"DeviceError", "RuntimeError"},
    [OPF_ERR_IO]          = {"IOError", "OSError"},
    [OPF_ERR_CORRUPT]     = {"CorruptError", "ValueError"},
    [OPF_ERR_STATE]       = {"StateError", "RuntimeError"},
};

static PyObject *raise_text(opf_status st, const char *msg)
{
    if (st <= OPF_OK || st >= OPF_STATUS_COUNT)
        st = OPF_ERR_INVALID_ARG;
    PyObject *args = Py_BuildValue("(s)", msg && *msg ? msg : opf_status_str(st));
    if (!args)
        return NULL;
    PyObject *exc = PyObject_CallObject(opf_py_errors[st], args);
    Py_DECREF(args);
    if (!exc)
        return NULL;
    PyObject *code = PyLong_FromLong(st);
    if (code) {
        PyObject_SetAttrString(exc, "status", code);
        Py_DECREF(code);
    }
    PyErr_SetObject(opf_py_errors[st], exc);
    Py_DECREF(exc);
    return NULL;
}

PyObject *opf_raise(opf_status st, const opf_ctx *ctx)
{
    return raise_text(st, opf_last_error(ctx));
}

PyObject *opf_raise_msg(opf_status st, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return raise_text(st, buf);
}

static int add_errors(PyObject *m)
{
    PyObject *builtins = PyEval_GetBuiltins();  /* borrowed */
    PyObject *base = PyErr_NewException("opfuse._C.Error", PyExc_RuntimeError, NULL);
    if (!base || PyModule_AddObject(m, "Error", base) < 0)
        return -1;
    Py_INCREF(base);
    for (int st = 1; st < OPF_STATUS_COUNT; st++) {
        PyObject *builtin = PyDict_GetItemString(builtins, error_classes[st].builtin);
        char qual[64];
        snprintf(qual, sizeof qual, "opfuse._C.%s", error_classes[st].name);
        PyObject *bases = PyTuple_Pack(2, base, builtin);
        if (!bases)
            return -1;
        PyObject *cls = PyErr_NewException(qual, bases, NULL);
        Py_DECREF(bases);
        if (!cls)
            return -1;
        PyObject *code = PyLong_FromLong(st);
        PyObject_SetAttrString(cls, "status", code);
        Py_XDECREF(code);
        opf_py_errors[st] = cls;
        Py_INCREF(cls);
        if (PyModule_AddObject(m, error_classes[st].name, cls) < 0)
            return -1;
    }
    opf_py_errors[OPF_OK] = base;
    return 0;
}

int opf_py_add_methods(PyObject *m, PyMethodDef *defs)
{
    PyObject *name = PyModule_GetNameObject(m);
    if (!name)
        return -1;
    for (PyMethodDef *d = defs; d->ml_name; d++) {
        PyObject *f = PyCFunction_NewEx(d, NULL, name);
        if (!f || PyModule_AddObject(m, d->ml_name, f) < 0) {
            Py_XDECREF(f);
            Py_DECREF(name);
            return -1;
        }
    }
    Py_DECREF(name);
    return 0;
}

static PyObject *py_status_str(PyObject *self, PyObject *arg)
{
    long st = PyLong_AsLong(arg);
    if (st == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(opf_status_str((opf_status)st));
}

static PyMethodDef module_methods[] = {
    {"status_str", py_status_str, METH_O, "Name of a status code."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_C", "opfuse C extension over the public C API.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__C(void)
{
    PyObject *m = PyModule_Create(&moddef);
    if (!m)
        return NULL;
    if (add_errors(m) < 0 || opf_py_ctx_init_type(m) < 0 || opf_py_tensor_init_type(m) < 0 ||
        opf_py_quant_init_types(m) < 0 || opf_py_op_init_types(m) < 0 ||
        opf_py_torchcall_init_types(m) < 0 ||
        opf_py_add_methods(m, opf_py_quant_methods) < 0 ||
        opf_py_add_methods(m, opf_py_op_methods) < 0 ||
        opf_py_add_methods(m, opf_py_classop_methods) < 0 ||
        opf_py_add_methods(m, opf_py_torchcall_methods) < 0 ||
        opf_py_add_methods(m, opf_py_fusion_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* the language-model ops (attention, embedding, cross_entropy) as well */
    opf_status st = opf_nn_register();
    if (st) {
        Py_DECREF(m);
        return opf_raise(st, NULL);
    }
    PyModule_AddIntConstant(m, "MAX_DIMS", OPF_MAX_DIMS);
    PyModule_AddIntConstant(m, "COMPONENT_ALIGN", OPF_COMPONENT_ALIGN);
    return m;
}
