/* tensor.c: opfuse._C.Tensor and zero-copy DLPack exchange.
 *
 * Import (from_dlpack, from_components) wraps the producer's memory: the
 * consumed capsule's managed tensor is kept by an owner capsule whose
 * destructor calls the producer's deleter. Export (Tensor.__dlpack__ and the
 * per-component views) hands out a managed tensor holding a reference to the
 * Tensor object, so the opf buffer lives as long as any consumer.
 *
 * Device tensors (spec.device CUDA) cross as kDLCUDA with their GPU's index.
 * An export to a consumer that names its stream (__dlpack__(stream=...))
 * waits for the producing context when that context queues its work on
 * another stream; an import with a context (from_dlpack(..., ctx=))
 * checks the GPU against the context's and hands the producer the
 * context's stream to order itself before.
 *
 * Dtypes without a DLPack code that NumPy understands (bf16, the FP8 and FP4
 * element types, e8m0) are exported "raw" as unsigned integers of the same
 * width (e2m1 as packed bytes); the Python layer views them as ml_dtypes or
 * torch dtypes without a copy. */

#include "ext.h"
#include "dlpack.h"
#include <stdlib.h>
#include <string.h>

PyTypeObject *opf_py_tensor_type;
static PyTypeObject *view_type;

static const char *const OWNER_NAME = "opfuse.dlpack_owner";

/* ---- dtype mapping -------------------------------------------------------------- */

static opf_dl_dtype dl_dtype_of(opf_dtype dt, int raw)
{
    static const opf_dl_dtype native[OPF_DTYPE_COUNT] = {
        [OPF_F32] = {OPF_DL_FLOAT, 32, 1},       [OPF_F16] = {OPF_DL_FLOAT, 16, 1},
        [OPF_BF16] = {OPF_DL_BFLOAT, 16, 1},     [OPF_E4M3] = {OPF_DL_F8_E4M3FN, 8, 1},
        [OPF_E5M2] = {OPF_DL_F8_E5M2, 8, 1},     [OPF_E2M1] = {OPF_DL_UINT, 8, 1},
        [OPF_E8M0] = {OPF_DL_F8_E8M0FNU, 8, 1},  [OPF_I32] = {OPF_DL_INT, 32, 1},
        [OPF_I64] = {OPF_DL_INT, 64, 1},         [OPF_U8] = {OPF_DL_UINT, 8, 1},
    };
    opf_dl_dtype d = native[dt];
    if (raw && dt != OPF_F32 && dt != OPF_F16 && dt != OPF_I32 && dt != OPF_I64)
        d.code = OPF_DL_UINT;
    return d;
}

/* The opf dtype of a DLPack dtype; -1 when none. */
static int opf_dtype_of_dl(opf_dl_dtype d)
{
    if (d.lanes != 1)
        return -1;
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        opf_dl_dtype n = dl_dtype_of((opf_dtype)dt, 0);
        if (dt != OPF_E2M1 && n.code == d.code && n.bits == d.bits)
            return dt;
    }
    if (d.code == OPF_DL_BOOL && d.bits == 8)
        return OPF_U8;
    return -1;
}

/* ---- Tensor ------------------------------------------------------------------------- */

PyObject *opf_py_tensor_wrap(opf_tensor *t, PyObject *ctx, PyObject *owner)
{
    opf_py_tensor *o = PyObject_New(opf_py_tensor, opf_py_tensor_type);
    if (!o) {
        opf_tensor_release(t);
        return NULL;
    }
    o->t = *t;
    memset(t, 0, sizeof *t);
    o->owner = owner;
    o->ctx = ctx;
    o->index = ctx && PyObject_TypeCheck(ctx, opf_py_ctx_type) ? ((opf_py_ctx *)ctx)->index : 0;
    Py_XINCREF(owner);
    Py_XINCREF(ctx);
    return (PyObject *)o;
}

const opf_tensor *opf_py_tensor_get(PyObject *o, int allow_none)
{
    if (allow_none && o == Py_None)
        return NULL;
    if (!PyObject_TypeCheck(o, opf_py_tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "expected an opfuse._C.Tensor");
        return NULL;
    }
    return &((opf_py_tensor *)o)->t;
}

static void tensor_dealloc(PyObject *self)
{
    opf_py_tensor *o = (opf_py_tensor *)self;
    opf_tensor_release(&o->t);
    Py_CLEAR(o->owner);
    Py_CLEAR(o->ctx);
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyObject *tensor_spec(PyObject *self, void *unused)
{
    return opf_py_from_spec(&((opf_py_tensor *)self)->t.spec);
}

static PyObject *tensor_buffer_bytes(PyObject *self, void *unused)
{
    return PyLong_FromSize_t(opf_tensor_buffer_bytes(&((opf_py_tensor *)self)->t));
}

/* ---- export ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject    *tensor;   /* what keeps the memory alive (a Tensor, a RecipeState) */
    PyObject    *ctx;      /* the Context that produced it (NULL: caller memory) */
    opf_dl_device dev;
    void        *ptr;
    int          ndim;
    int64_t      shape[OPF_MAX_DIMS];
    opf_dl_dtype dtype;
} view_obj;

/* Both capsule kinds hold one reference to the viewed Tensor; the deleter
 * may run on any thread. */
static void release_export(PyObject *tensor, void *mem)
{
    PyGILState_STATE g = PyGILState_Ensure();
    Py_XDECREF(tensor);
    PyGILState_Release(g);
    free(mem);
}

static void managed_delete(opf_dl_managed *m)
{
    release_export(m->manager_ctx, m);
}

static void managed_v_delete(opf_dl_managed_v *m)
{
    release_export(m->manager_ctx, m);
}

static void export_capsule_destructor(PyObject *cap)
{
    /* Only a capsule nobody consumed still owns its managed tensor. */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        opf_dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
        m->deleter(m);
    } else if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        opf_dl_managed_v *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        m->deleter(m);
    }
}

/* True when the consumer passed max_version >= (1, 0). */
static int wants_versioned(PyObject *kw)
{
    PyObject *mv = kw ? PyDict_GetItemString(kw, "max_version") : NULL;
    if (!mv || mv == Py_None || !PySequence_Check(mv) || PySequence_Size(mv) < 1)
        return 0;
    PyObject *major = PySequence_GetItem(mv, 0);
    long v = major ? PyLong_AsLong(major) : 0;
    Py_XDECREF(major);
    PyErr_Clear();
    return v >= 1;
}

/* The DLPack device of memory on dev, GPU index. */
static opf_dl_device dl_device(opf_device dev, int index)
{
    opf_dl_device d = {OPF_DL_CPU, 0};
    if (dev == OPF_DEVICE_CUDA)
        d = (opf_dl_device){OPF_DL_CUDA, index};
    return d;
}

/* The consumer's stream of an export (the array API's __dlpack__ stream:
 * None is the legacy default stream, 1; -1 asks for no ordering). When the
 * producing context queues on another stream, the host waits for it: the
 * simple order, and an export of a context's result is rare on the hot
 * path (opfuse.torch's own calls share torch's stream). */
static int order_for_consumer(const view_obj *v, PyObject *kw)
{
    PyObject *ctx_obj = v->ctx;
    if (v->dev.device_type != OPF_DL_CUDA || !ctx_obj)
        return 0;
    PyObject *so = kw ? PyDict_GetItemString(kw, "stream") : NULL;
    long long want = 1;
    if (so && so != Py_None && (want = PyLong_AsLongLong(so)) == -1 && PyErr_Occurred())
        return -1;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    if (!ctx)
        return -1;
    if (want == -1 || (uintptr_t)opf_ctx_stream(ctx) == (uintptr_t)want)
        return 0;
    opf_status st = opf_ctx_sync(ctx);
    return st ? (opf_raise(st, ctx), -1) : 0;
}

/* The capsule of a view; order: wait for the producer where the consumer's
 * stream asks (order_for_consumer). */
static PyObject *view_capsule(PyObject *self, PyObject *kw, int order)
{
    view_obj *v = (view_obj *)self;
    if (order && order_for_consumer(v, kw) < 0)
        return NULL;
    int versioned = wants_versioned(kw);
    size_t head = versioned ? sizeof(opf_dl_managed_v) : sizeof(opf_dl_managed);
    void *mem = calloc(1, head + sizeof(int64_t) * OPF_MAX_DIMS);
    if (!mem)
        return PyErr_NoMemory();
    int64_t *shape = (int64_t *)((char *)mem + head);
    memcpy(shape, v->shape, sizeof(int64_t) * (size_t)v->ndim);
    opf_dl_tensor dl = {v->ptr, v->dev, v->ndim, v->dtype, shape, NULL, 0};
    Py_INCREF(v->tensor);
    PyObject *cap;
    if (versioned) {
        opf_dl_managed_v *m = mem;
        m->version.major = 1;
        m->version.minor = 0;
        m->manager_ctx = v->tensor;
        m->deleter = managed_v_delete;
        m->dl_tensor = dl;
        cap = PyCapsule_New(m, "dltensor_versioned", export_capsule_destructor);
    } else {
        opf_dl_managed *m = mem;
        m->dl_tensor = dl;
        m->manager_ctx = v->tensor;
        m->deleter = managed_delete;
        cap = PyCapsule_New(m, "dltensor", export_capsule_destructor);
    }
    if (!cap) {
        Py_DECREF(v->tensor);
        free(mem);
    }
    return cap;
}

static PyObject *view_dlpack(PyObject *self, PyObject *args, PyObject *kw)
{
    return view_capsule(self, kw, 1);
}

static PyObject *view_dlpack_device(PyObject *self, PyObject *unused)
{
    opf_dl_device d = ((view_obj *)self)->dev;
    return Py_BuildValue("(ii)", d.device_type, d.device_id);
}

static PyObject *tensor_dlpack_device(PyObject *self, PyObject *unused)
{
    const opf_py_tensor *t = (const opf_py_tensor *)self;
    opf_dl_device d = dl_device(t->t.spec.device, t->index);
    return Py_BuildValue("(ii)", d.device_type, d.device_id);
}

static void view_dealloc(PyObject *self)
{
    Py_CLEAR(((view_obj *)self)->tensor);
    Py_CLEAR(((view_obj *)self)->ctx);
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyObject *view_at(PyObject *keep, PyObject *ctx, opf_dl_device dev, void *ptr, int ndim,
                         const int64_t *shape, opf_dl_dtype dt)
{
    view_obj *v = PyObject_New(view_obj, view_type);
    if (!v)
        return NULL;
    v->tensor = keep;
    v->ctx = ctx;
    Py_INCREF(keep);
    Py_XINCREF(ctx);
    v->dev = dev;
    v->ptr = ptr;
    v->ndim = ndim;
    memcpy(v->shape, shape, sizeof(int64_t) * (size_t)ndim);
    v->dtype = dt;
    return (PyObject *)v;
}

/* A view of a Tensor's memory, on its device. */
static PyObject *view_new(PyObject *tensor, void *ptr, int ndim, const int64_t *shape,
                          opf_dl_dtype dt)
{
    const opf_py_tensor *t = (const opf_py_tensor *)tensor;
    return view_at(tensor, t->ctx, dl_device(t->t.spec.device, t->index), ptr, ndim, shape, dt);
}

PyObject *opf_py_view(PyObject *keep, PyObject *ctx, void *ptr, int ndim, const int64_t *shape,
                      opf_dtype dt, int raw)
{
    const opf_py_ctx *c = (const opf_py_ctx *)ctx;
    return view_at(keep, ctx, dl_device(c->device, c->index), ptr, ndim, shape,
                   dl_dtype_of(dt, raw));
}

/* A DLPack-exportable view of one component: the logical shape for the
 * data of a plain tensor, [rows, cols] of the layout otherwise (packed
 * bytes for e2m1). None when the component is absent. */
static PyObject *tensor_component(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"component", "raw", NULL};
    int comp = OPF_COMP_DATA, raw = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ip", names, &comp, &raw))
        return NULL;
    const opf_tensor *t = &((opf_py_tensor *)self)->t;
    if (comp < 0 || comp >= OPF_COMP_COUNT)
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "component %d out of range [0, %d)", comp,
                             OPF_COMP_COUNT);
    if (!t->data[comp])
        Py_RETURN_NONE;
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    const opf_component_desc *c = &L.comp[comp];
    if (t->spec.scaling == OPF_SCALING_NONE && comp == OPF_COMP_DATA)
        return view_new(self, t->data[comp], t->spec.ndim, t->spec.shape,
                        dl_dtype_of(t->spec.dtype, raw));
    int64_t shape[2] = {c->rows, c->cols};
    if (c->dtype == OPF_E2M1)
        shape[1] = (c->cols + 1) / 2;
    return view_new(self, t->data[comp], 2, shape, dl_dtype_of(c->dtype, raw));
}

static PyObject *tensor_export(PyObject *self, PyObject *kw, int order)
{
    const opf_tensor *t = &((opf_py_tensor *)self)->t;
    if (t->spec.scaling != OPF_SCALING_NONE)
        return opf_raise_msg(OPF_ERR_UNSUPPORTED,
                             "a quantized tensor has no single DLPack view: export its "
                             "components (component(i))");
    PyObject *v = view_new(self, t->data[0], t->spec.ndim, t->spec.shape,
                           dl_dtype_of(t->spec.dtype, 0));
    if (!v)
        return NULL;
    PyObject *cap = view_capsule(v, kw, order);
    Py_DECREF(v);
    return cap;
}

static PyObject *tensor_dlpack(PyObject *self, PyObject *args, PyObject *kw)
{
    return tensor_export(self, kw, 1);
}

/* For a consumer on the producing context's stream (opfuse.torch's eager
 * calls): no ordering. */
PyObject *opf_py_tensor_capsule(PyObject *tensor)
{
    return tensor_export(tensor, NULL, 0);
}

static PyObject *tensor_data_ptr(PyObject *self, PyObject *args)
{
    int comp = 0;
    if (!PyArg_ParseTuple(args, "|i", &comp))
        return NULL;
    if (comp < 0 || comp >= OPF_COMP_COUNT)
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "component %d out of range", comp);
    return PyLong_FromVoidPtr(((opf_py_tensor *)self)->t.data[comp]);
}

/* ---- import ------------------------------------------------------------------------ */

static void owner_destructor(PyObject *cap)
{
    opf_dl_managed *m = PyCapsule_GetPointer(cap, OWNER_NAME);
    if (m && m->deleter)
        m->deleter(m);
}

/* The keywords of obj.__dlpack__ for an import into Context ctx: the
 * context's stream when obj is on a GPU, so that the producer orders its
 * pending work before the context's (*kw NULL: none to pass). */
static int producer_kwargs(PyObject *obj, PyObject *ctx_obj, PyObject **kw)
{
    *kw = NULL;
    opf_ctx *ctx = ctx_obj ? opf_py_ctx_get(ctx_obj) : NULL;
    if (!ctx || !PyObject_HasAttrString(obj, "__dlpack_device__"))
        return ctx_obj && !ctx ? -1 : 0;
    PyObject *d = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    int type = 0, id = 0;
    int ok = d && PyArg_ParseTuple(d, "ii", &type, &id);
    Py_XDECREF(d);
    if (!ok)
        return -1;
    void *stream = opf_ctx_stream(ctx);
    if (type == OPF_DL_CUDA && stream)
        *kw = Py_BuildValue("{s:K}", "stream", (unsigned long long)(uintptr_t)stream);
    return type == OPF_DL_CUDA && stream && !*kw ? -1 : 0;
}

/* The capsule of obj (itself, or what obj.__dlpack__ gives). */
static PyObject *dl_capsule(PyObject *obj, PyObject *ctx_obj)
{
    if (PyCapsule_IsValid(obj, "dltensor")) {
        Py_INCREF(obj);
        return obj;
    }
    PyObject *kw, *fn = NULL, *empty = NULL, *cap = NULL;
    if (producer_kwargs(obj, ctx_obj, &kw) < 0)
        return NULL;
    if ((fn = PyObject_GetAttrString(obj, "__dlpack__")) && (empty = PyTuple_New(0)))
        cap = PyObject_Call(fn, empty, kw);
    Py_XDECREF(fn);
    Py_XDECREF(empty);
    Py_XDECREF(kw);
    return cap;
}

/* 0 when a tensor on d may be imported (into Context ctx_obj when not
 * NULL: a GPU tensor must be on the context's GPU), else -1 with the
 * exception set. */
static int check_import_device(opf_dl_device d, int allow_cuda, PyObject *ctx_obj)
{
    if (d.device_type == OPF_DL_CPU || d.device_type == OPF_DL_CUDA_HOST)
        return 0;
    if (d.device_type != OPF_DL_CUDA)
        opf_raise_msg(OPF_ERR_UNSUPPORTED, "DLPack tensor on device type %d: opfuse takes CPU "
                      "and CUDA tensors", d.device_type);
    else if (!allow_cuda)
        opf_raise_msg(OPF_ERR_UNSUPPORTED, "DLPack tensor on cuda:%d: this call reads host "
                      "memory (pass a CPU tensor)", d.device_id);
    const opf_py_ctx *c = (const opf_py_ctx *)ctx_obj;
    if (PyErr_Occurred() || !c || (c->device == OPF_DEVICE_CUDA && c->index == d.device_id))
        return PyErr_Occurred() ? -1 : 0;
    char dev[32];
    opf_py_device_str(c->device, c->index, dev, sizeof dev);
    opf_raise_msg(OPF_ERR_INVALID_ARG, "DLPack tensor on cuda:%d, the context on %s", d.device_id,
                  dev);
    return -1;
}

/* Consumes obj.__dlpack__() and returns the owner capsule of its managed
 * tensor, which must be compact row-major, on the CPU (or with allow_cuda
 * on a GPU: ctx_obj's, when given). */
static PyObject *dl_consume(PyObject *obj, PyObject *ctx_obj, int allow_cuda,
                            opf_dl_managed **out)
{
    PyObject *cap = dl_capsule(obj, ctx_obj);
    if (!cap)
        return NULL;
    opf_dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
    if (!m) {
        Py_DECREF(cap);
        return NULL;
    }
    PyCapsule_SetName(cap, "used_dltensor");
    Py_DECREF(cap);
    PyObject *owner = PyCapsule_New(m, OWNER_NAME, owner_destructor);
    if (!owner) {
        if (m->deleter)
            m->deleter(m);
        return NULL;
    }
    const opf_dl_tensor *d = &m->dl_tensor;
    if (check_import_device(d->device, allow_cuda, ctx_obj) < 0) {
        Py_DECREF(owner);
        return NULL;
    }
    if (d->ndim > OPF_MAX_DIMS) {
        Py_DECREF(owner);
        return opf_raise_msg(OPF_ERR_SHAPE, "DLPack tensor has %d dims, at most %d", d->ndim,
                             OPF_MAX_DIMS);
    }
    int64_t expect = 1;
    for (int i = d->ndim - 1; d->strides && i >= 0; i--) {
        if (d->shape[i] != 1 && d->strides[i] != expect) {
            Py_DECREF(owner);
            return opf_raise_msg(OPF_ERR_INVALID_ARG,
                                 "DLPack tensor is not contiguous (dim %d has stride %lld, "
                                 "expected %lld): pass a contiguous copy",
                                 i, (long long)d->strides[i], (long long)expect);
        }
        expect *= d->shape[i];
    }
    *out = m;
    return owner;
}

static void *dl_data(const opf_dl_managed *m)
{
    return (char *)m->dl_tensor.data + m->dl_tensor.byte_offset;
}

/* The device of a DLPack tensor as a spec's; the GPU's index into *index. */
static opf_device spec_device(const opf_dl_tensor *d, int *index)
{
    *index = d->device.device_type == OPF_DL_CUDA ? d->device.device_id : 0;
    return d->device.device_type == OPF_DL_CUDA ? OPF_DEVICE_CUDA : OPF_DEVICE_CPU;
}

/* from_dlpack(obj, dtype=-1, ctx=None): a plain Tensor over obj's memory
 * (host or GPU). dtype, when given, reinterprets elements of the same width
 * (uint16 as bf16, uint8 as e4m3, ...). With ctx, a GPU tensor must be on
 * the context's GPU, and its producer orders itself before the context's
 * stream. */
static PyObject *py_from_dlpack(PyObject *mod, PyObject *args, PyObject *kw)
{
    static char *names[] = {"obj", "dtype", "ctx", NULL};
    PyObject *obj, *ctx_obj = Py_None;
    int dtype = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|iO", names, &obj, &dtype, &ctx_obj))
        return NULL;
    if (ctx_obj == Py_None)
        ctx_obj = NULL;
    else if (!opf_py_ctx_get(ctx_obj))
        return NULL;
    opf_dl_managed *m;
    PyObject *owner = dl_consume(obj, ctx_obj, 1, &m);
    if (!owner)
        return NULL;
    const opf_dl_tensor *d = &m->dl_tensor;
    int have = opf_dtype_of_dl(d->dtype);
    if (dtype < 0)
        dtype = have;
    if (dtype < 0 || dtype >= OPF_DTYPE_COUNT || dtype == OPF_E2M1 ||
        opf_dtype_info((opf_dtype)dtype)->bits != d->dtype.bits) {
        Py_DECREF(owner);
        return opf_raise_msg(OPF_ERR_DTYPE,
                             "DLPack dtype (code %d, %d bits) cannot be taken as %s",
                             d->dtype.code, d->dtype.bits,
                             dtype < 0 ? "any opfuse dtype" : opf_dtype_name((opf_dtype)dtype));
    }
    opf_spec s = opf_spec_make(d->ndim, d->shape, (opf_dtype)dtype);
    int index;
    s.device = spec_device(d, &index);
    opf_tensor t;
    opf_status st = opf_tensor_wrap(&s, dl_data(m), &t);
    if (st != OPF_OK) {
        Py_DECREF(owner);
        return opf_raise(st, NULL);
    }
    PyObject *r = opf_py_tensor_wrap(&t, NULL, owner);
    if (r)
        ((opf_py_tensor *)r)->index = index;
    Py_DECREF(owner);
    return r;
}

/* from_components(spec, comps): a (quantized) Tensor over caller memory, one
 * DLPack object or None per component in opf_component order; each present
 * component must hold at least the layout's bytes. */
static PyObject *py_from_components(PyObject *mod, PyObject *args)
{
    PyObject *spec_obj, *comps;
    if (!PyArg_ParseTuple(args, "OO", &spec_obj, &comps))
        return NULL;
    opf_spec s;
    if (opf_py_to_spec(spec_obj, &s) < 0)
        return NULL;
    opf_layout L;
    opf_status st = opf_spec_layout(&s, &L);
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    PyObject *seq = opf_py_list(comps, "components must be a sequence");
    if (!seq)
        return NULL;
    PyObject *owners = PyList_New(0);
    opf_tensor t = {.spec = s};
    Py_ssize_t n = PyList_Size(seq);
    int index = -1;  /* the components' device, from the first */
    for (int c = 0; c < OPF_COMP_COUNT && owners; c++) {
        PyObject *item = c < n ? PyList_GetItem(seq, c) : Py_None;
        if (!L.comp[c].present || item == Py_None) {
            if (L.comp[c].present) {
                opf_raise_msg(OPF_ERR_INVALID_ARG, "component %d of %s is missing", c,
                              opf_scaling_name(s.scaling));
                Py_CLEAR(owners);
            }
            continue;
        }
        opf_dl_managed *m;
        PyObject *owner = dl_consume(item, NULL, 1, &m);
        if (!owner || PyList_Append(owners, owner) < 0) {
            Py_XDECREF(owner);
            Py_CLEAR(owners);
            break;
        }
        Py_DECREF(owner);
        int ci;
        opf_device dev = spec_device(&m->dl_tensor, &ci);
        if (index >= 0 && (dev != t.spec.device || ci != index)) {
            opf_raise_msg(OPF_ERR_INVALID_ARG, "component %d is on %s:%d, the ones before on "
                          "%s:%d", c, opf_device_name(dev), ci, opf_device_name(t.spec.device),
                          index);
            Py_CLEAR(owners);
            break;
        }
        t.spec.device = dev;
        index = ci;
        int64_t numel = 1;
        for (int i = 0; i < m->dl_tensor.ndim; i++)
            numel *= m->dl_tensor.shape[i];
        size_t bytes = (size_t)numel * (m->dl_tensor.dtype.bits / 8u);
        if (bytes < L.comp[c].nbytes) {
            opf_raise_msg(OPF_ERR_SHAPE, "component %d holds %zu bytes, %s needs %zu", c, bytes,
                          opf_scaling_name(s.scaling), L.comp[c].nbytes);
            Py_CLEAR(owners);
            break;
        }
        t.data[c] = dl_data(m);
    }
    Py_DECREF(seq);
    if (!owners)
        return NULL;
    PyObject *r = opf_py_tensor_wrap(&t, NULL, owners);
    if (r && index > 0)
        ((opf_py_tensor *)r)->index = index;
    Py_DECREF(owners);
    return r;
}

/* empty(ctx, spec): a Tensor allocated by the context in its device's memory
 * (scale padding zeroed). */
static PyObject *py_empty(PyObject *mod, PyObject *args)
{
    PyObject *ctx_obj, *spec_obj;
    if (!PyArg_ParseTuple(args, "OO", &ctx_obj, &spec_obj))
        return NULL;
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    opf_spec s;
    if (!ctx || opf_py_to_spec(spec_obj, &s) < 0)
        return NULL;
    s.device = opf_ctx_device(ctx);
    opf_tensor t;
    opf_status st = opf_tensor_alloc(ctx, &s, &t);
    if (st != OPF_OK)
        return opf_raise(st, ctx);
    return opf_py_tensor_wrap(&t, ctx_obj, NULL);
}

static PyObject *py_spec_layout(PyObject *mod, PyObject *spec_obj)
{
    opf_spec s;
    if (opf_py_to_spec(spec_obj, &s) < 0)
        return NULL;
    opf_layout L;
    opf_status st = opf_spec_layout(&s, &L);
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    PyObject *comps = PyList_New(OPF_COMP_COUNT);
    for (int c = 0; comps && c < OPF_COMP_COUNT; c++) {
        const opf_component_desc *d = &L.comp[c];
        PyObject *item = d->present ? Py_BuildValue("(iLLnn)", d->dtype, (long long)d->rows,
                                                    (long long)d->cols, (Py_ssize_t)d->nbytes,
                                                    (Py_ssize_t)d->offset)
                                    : (Py_INCREF(Py_None), Py_None);
        PyList_SetItem(comps, c, item);
    }
    PyObject *r = Py_BuildValue("{s:L,s:L,s:N,s:n}", "m", (long long)L.m, "k", (long long)L.k,
                                "components", comps, "total_bytes", (Py_ssize_t)L.total_bytes);
    return r;
}

static PyObject *py_spec_str(PyObject *mod, PyObject *spec_obj)
{
    opf_spec s;
    if (opf_py_to_spec(spec_obj, &s) < 0)
        return NULL;
    char buf[256];
    opf_spec_str(&s, buf, sizeof buf);
    return PyUnicode_FromString(buf);
}

static PyObject *py_dtype_info(PyObject *mod, PyObject *arg)
{
    long dt = PyLong_AsLong(arg);
    if (dt == -1 && PyErr_Occurred())
        return NULL;
    const opf_dtype_traits *tr = opf_dtype_info((opf_dtype)dt);
    if (!tr)
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "dtype %ld out of range", dt);
    return Py_BuildValue("{s:s,s:i,s:O,s:d}", "name", tr->name, "bits", tr->bits, "is_float",
                         tr->is_float ? Py_True : Py_False, "max_finite", tr->max_finite);
}

/* convert(src, src_dtype, dst, dst_dtype): opf_convert between two DLPack
 * buffers of n elements each (raw views). */
static PyObject *py_convert(PyObject *mod, PyObject *args)
{
    PyObject *src, *dst;
    int sdt, ddt;
    if (!PyArg_ParseTuple(args, "OiOi", &src, &sdt, &dst, &ddt))
        return NULL;
    opf_dl_managed *ms, *md;
    PyObject *os = dl_consume(src, NULL, 0, &ms);
    if (!os)
        return NULL;
    PyObject *od = dl_consume(dst, NULL, 0, &md);
    if (!od) {
        Py_DECREF(os);
        return NULL;
    }
    size_t n = 1;
    for (int i = 0; i < ms->dl_tensor.ndim; i++)
        n *= (size_t)ms->dl_tensor.shape[i];
    opf_status st = OPF_ERR_SHAPE;
    size_t dst_bytes = 1;
    for (int i = 0; i < md->dl_tensor.ndim; i++)
        dst_bytes *= (size_t)md->dl_tensor.shape[i];
    dst_bytes *= md->dl_tensor.dtype.bits / 8u;
    if (sdt >= 0 && sdt < OPF_DTYPE_COUNT && ddt >= 0 && ddt < OPF_DTYPE_COUNT &&
        sdt != OPF_E2M1 && opf_dtype_nbytes((opf_dtype)ddt, n) <= dst_bytes)
        st = opf_convert(dl_data(ms), (opf_dtype)sdt, dl_data(md), (opf_dtype)ddt, n);
    else
        opf_raise_msg(OPF_ERR_SHAPE, "convert: destination too small or bad dtype");
    Py_DECREF(os);
    Py_DECREF(od);
    if (PyErr_Occurred())
        return NULL;
    if (st != OPF_OK)
        return opf_raise(st, NULL);
    Py_RETURN_NONE;
}

static PyMethodDef tensor_methods[] = {
    {"component", (PyCFunction)(void (*)(void))tensor_component, METH_VARARGS | METH_KEYWORDS,
     "component(i=0, raw=True): a DLPack view of component i, or None."},
    {"__dlpack__", (PyCFunction)(void (*)(void))tensor_dlpack, METH_VARARGS | METH_KEYWORDS,
     NULL},
    {"__dlpack_device__", tensor_dlpack_device, METH_NOARGS, NULL},
    {"data_ptr", tensor_data_ptr, METH_VARARGS, "Address of component i."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef tensor_getset[] = {
    {"spec", tensor_spec, NULL, "The tensor's spec as a dict.", NULL},
    {"buffer_bytes", tensor_buffer_bytes, NULL, "Bytes of the library buffer (0: caller memory).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot tensor_slots[] = {
    {Py_tp_dealloc, tensor_dealloc},
    {Py_tp_methods, tensor_methods},
    {Py_tp_getset, tensor_getset},
    {Py_tp_doc, "An opf_tensor: a library buffer reference or caller memory."},
    {0, NULL},
};

static PyType_Spec tensor_type_spec = {"opfuse._C.Tensor", sizeof(opf_py_tensor), 0,
                                       Py_TPFLAGS_DEFAULT, tensor_slots};

static PyMethodDef view_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))view_dlpack, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__dlpack_device__", view_dlpack_device, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot view_slots[] = {
    {Py_tp_dealloc, view_dealloc},
    {Py_tp_methods, view_methods},
    {Py_tp_doc, "A DLPack-exportable view of one tensor component."},
    {0, NULL},
};

static PyType_Spec view_type_spec = {"opfuse._C.ComponentView", sizeof(view_obj), 0,
                                     Py_TPFLAGS_DEFAULT, view_slots};

static PyMethodDef tensor_module_methods[] = {
    {"from_dlpack", (PyCFunction)(void (*)(void))py_from_dlpack, METH_VARARGS | METH_KEYWORDS,
     "from_dlpack(obj, dtype=-1, ctx=None): a Tensor over obj's memory (zero-copy; host or "
     "GPU; with ctx, a GPU tensor must be on the context's GPU)."},
    {"from_components", py_from_components, METH_VARARGS,
     "from_components(spec, comps): a Tensor over per-component DLPack buffers."},
    {"empty", py_empty, METH_VARARGS, "empty(ctx, spec): an allocated Tensor."},
    {"spec_layout", py_spec_layout, METH_O, "The layout of a spec."},
    {"spec_str", py_spec_str, METH_O, "The spec as text."},
    {"dtype_info", py_dtype_info, METH_O, "Traits of a dtype."},
    {"convert", py_convert, METH_VARARGS, "opf_convert between DLPack buffers."},
    {NULL, NULL, 0, NULL},
};

int opf_py_tensor_init_type(PyObject *m)
{
    opf_py_tensor_type = (PyTypeObject *)PyType_FromSpec(&tensor_type_spec);
    view_type = (PyTypeObject *)PyType_FromSpec(&view_type_spec);
    if (!opf_py_tensor_type || !view_type)
        return -1;
    Py_INCREF(opf_py_tensor_type);
    Py_INCREF(view_type);
    if (PyModule_AddObject(m, "Tensor", (PyObject *)opf_py_tensor_type) < 0 ||
        PyModule_AddObject(m, "ComponentView", (PyObject *)view_type) < 0)
        return -1;
    return opf_py_add_methods(m, tensor_module_methods);
}
