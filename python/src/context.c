/* context.c: opfuse._C.Context over opf_ctx.
 *
 * close() only marks the context closed: tensors, ops and seqs made from it
 * hold a reference to this object, and the opf_ctx is destroyed when the
 * last of them goes (the C contract: destroy the context last). */
#include "ext.h"
#include <stdio.h>
#include <string.h>

PyTypeObject *opf_py_ctx_type;

opf_ctx *opf_py_ctx_get(PyObject *o)
{
    if (!PyObject_TypeCheck(o, opf_py_ctx_type)) {
        PyErr_SetString(PyExc_TypeError, "expected an opfuse Context");
        return NULL;
    }
    opf_py_ctx *c = (opf_py_ctx *)o;
    if (c->closed || !c->ctx) {
        opf_raise_msg(OPF_ERR_STATE, "context is closed");
        return NULL;
    }
    return c->ctx;
}

void opf_py_device_str(opf_device dev, int index, char *buf, size_t size)
{
    if (dev == OPF_DEVICE_CPU)
        snprintf(buf, size, "cpu");
    else
        snprintf(buf, size, "%s:%d", opf_device_name(dev), index);
}

/* "cpu", "cuda" or "cuda:N" (N overrides *index). */
static int parse_device(const char *name, opf_device *dev, int *index)
{
    if (!strcmp(name, "cpu")) {
        *dev = OPF_DEVICE_CPU;
        return 0;
    }
    char tail = 0;
    int n = -1;
    if (!strcmp(name, "cuda") || (sscanf(name, "cuda:%d%c", &n, &tail) == 1 && n >= 0)) {
        *dev = OPF_DEVICE_CUDA;
        *index = n >= 0 ? n : *index;
        return 0;
    }
    opf_raise_msg(OPF_ERR_INVALID_ARG, "Context: device \"%s\" is not \"cpu\", \"cuda\" or "
                  "\"cuda:N\"", name);
    return -1;
}

static int ctx_init(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"seed", "offset", "num_threads", "deterministic", "device", "index",
                            NULL};
    unsigned long long seed = 0, offset = 0;
    int threads = 0, det = 1, index = 0;
    const char *device = "cpu";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|KKipsi", names, &seed, &offset, &threads, &det,
                                     &device, &index))
        return -1;
    opf_ctx_options o = opf_ctx_options_default();
    if (parse_device(device, &o.device, &index) < 0)
        return -1;
    o.device_index = index;
    o.seed = seed;
    o.offset = offset;
    o.num_threads = threads;
    o.deterministic = det;
    opf_py_ctx *c = (opf_py_ctx *)self;
    opf_ctx_destroy(c->ctx);
    c->ctx = NULL;
    opf_status st = opf_ctx_create(&o, &c->ctx);
    if (st != OPF_OK) {
        opf_raise(st, NULL);
        return -1;
    }
    c->closed = 0;
    c->device = o.device;
    c->index = o.device == OPF_DEVICE_CPU ? 0 : index;
    return 0;
}

static void ctx_dealloc(PyObject *self)
{
    opf_py_ctx *c = (opf_py_ctx *)self;
    opf_ctx_destroy(c->ctx);
    PyTypeObject *tp = Py_TYPE(self);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(self);
    Py_DECREF(tp);
}

static PyObject *ctx_close(PyObject *self, PyObject *unused)
{
    ((opf_py_ctx *)self)->closed = 1;
    Py_RETURN_NONE;
}

static PyObject *ctx_closed(PyObject *self, void *unused)
{
    return PyBool_FromLong(((opf_py_ctx *)self)->closed);
}

static PyObject *ctx_alloc_stats(PyObject *self, PyObject *unused)
{
    opf_ctx *ctx = opf_py_ctx_get(self);
    if (!ctx)
        return NULL;
    opf_alloc_stats s;
    opf_ctx_alloc_stats(ctx, &s);
    return Py_BuildValue("{s:K,s:K,s:n,s:n}", "n_alloc", (unsigned long long)s.n_alloc,
                         "n_free", (unsigned long long)s.n_free, "bytes_live",
                         (Py_ssize_t)s.bytes_live, "bytes_peak", (Py_ssize_t)s.bytes_peak);
}

static PyObject *ctx_get_rng(PyObject *self, PyObject *unused)
{
    opf_ctx *ctx = opf_py_ctx_get(self);
    if (!ctx)
        return NULL;
    uint64_t seed, offset;
    opf_ctx_get_rng(ctx, &seed, &offset);
    return Py_BuildValue("(KK)", (unsigned long long)seed, (unsigned long long)offset);
}

static PyObject *ctx_set_rng(PyObject *self, PyObject *args)
{
    unsigned long long seed, offset;
    if (!PyArg_ParseTuple(args, "KK", &seed, &offset))
        return NULL;
    opf_ctx *ctx = opf_py_ctx_get(self);
    if (!ctx)
        return NULL;
    opf_ctx_set_rng(ctx, seed, offset);
    Py_RETURN_NONE;
}

static PyObject *ctx_last_error(PyObject *self, PyObject *unused)
{
    opf_py_ctx *c = (opf_py_ctx *)self;
    return PyUnicode_FromString(c->ctx ? opf_last_error(c->ctx) : "");
}

/* set_stream(stream): opf_ctx_set_stream with a cudaStream_t as an int
 * (torch.cuda.Stream.cuda_stream; 0, torch's default stream, is the legacy
 * default stream), None for the context's own. */
static PyObject *ctx_set_stream(PyObject *self, PyObject *arg)
{
    opf_ctx *ctx = opf_py_ctx_get(self);
    if (!ctx)
        return NULL;
    void *stream = NULL;
    if (arg != Py_None) {
        unsigned long long v = PyLong_AsUnsignedLongLong(arg);
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        stream = (void *)(uintptr_t)(v ? v : 1);
    }
    opf_status st = opf_ctx_set_stream(ctx, stream);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    Py_RETURN_NONE;
}

static PyObject *ctx_sync(PyObject *self, PyObject *unused)
{
    opf_ctx *ctx = opf_py_ctx_get(self);
    if (!ctx)
        return NULL;
    opf_status st = opf_ctx_sync(ctx);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    Py_RETURN_NONE;
}

static PyObject *ctx_stream(PyObject *self, void *unused)
{
    opf_ctx *ctx = opf_py_ctx_get(self);
    if (!ctx)
        return NULL;
    void *s = opf_ctx_stream(ctx);
    return s ? PyLong_FromVoidPtr(s) : (Py_INCREF(Py_None), Py_None);
}

static PyObject *ctx_device(PyObject *self, void *unused)
{
    opf_py_ctx *c = (opf_py_ctx *)self;
    char buf[32];
    opf_py_device_str(c->device, c->index, buf, sizeof buf);
    return PyUnicode_FromString(buf);
}

static PyObject *ctx_index(PyObject *self, void *unused)
{
    return PyLong_FromLong(((opf_py_ctx *)self)->index);
}

static PyObject *ctx_enter(PyObject *self, PyObject *unused)
{
    if (!opf_py_ctx_get(self))
        return NULL;
    Py_INCREF(self);
    return self;
}

static PyObject *ctx_exit(PyObject *self, PyObject *args)
{
    return ctx_close(self, NULL);
}

static PyMethodDef ctx_methods[] = {
    {"close", ctx_close, METH_NOARGS, "Marks the context closed; later use raises StateError."},
    {"alloc_stats", ctx_alloc_stats, METH_NOARGS, "Allocator counters as a dict."},
    {"get_rng", ctx_get_rng, METH_NOARGS, "(seed, offset) of the Philox generator."},
    {"set_rng", ctx_set_rng, METH_VARARGS, "Sets the Philox seed and offset."},
    {"last_error", ctx_last_error, METH_NOARGS, "The context's last error message."},
    {"set_stream", ctx_set_stream, METH_O,
     "set_stream(stream): later work queued on a cudaStream_t given as an int (0: the legacy "
     "default stream); None: the context's own stream. A CPU context raises UnsupportedError."},
    {"sync", ctx_sync, METH_NOARGS, "Waits for the work queued on the context's device."},
    {"__enter__", ctx_enter, METH_NOARGS, NULL},
    {"__exit__", ctx_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ctx_getset[] = {
    {"closed", ctx_closed, NULL, "True after close().", NULL},
    {"stream", ctx_stream, NULL, "The cudaStream_t work is queued on, as an int (None: CPU).",
     NULL},
    {"device", ctx_device, NULL, "\"cpu\" or \"cuda:N\".", NULL},
    {"index", ctx_index, NULL, "The GPU's index (0 on the CPU).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot ctx_slots[] = {
    {Py_tp_init, ctx_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, ctx_dealloc},
    {Py_tp_methods, ctx_methods},
    {Py_tp_getset, ctx_getset},
    {Py_tp_doc, "Context(seed=0, offset=0, num_threads=0, deterministic=True, device=\"cpu\", "
                "index=0): an opf_ctx on the CPU or on GPU index (device \"cuda\" or "
                "\"cuda:N\")."},
    {0, NULL},
};

static PyType_Spec ctx_spec = {"opfuse._C.Context", sizeof(opf_py_ctx), 0,
                               Py_TPFLAGS_DEFAULT, ctx_slots};

int opf_py_ctx_init_type(PyObject *m)
{
    opf_py_ctx_type = (PyTypeObject *)PyType_FromSpec(&ctx_spec);
    if (!opf_py_ctx_type)
        return -1;
    Py_INCREF(opf_py_ctx_type);
    return PyModule_AddObject(m, "Context", (PyObject *)opf_py_ctx_type);
}
