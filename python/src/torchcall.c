/* torchcall.c: the impls of opfuse.torch's custom ops, one C call each.
 *
 * A ClassCall is the kernel torch's dispatcher calls for one op class and
 * direction: it takes the op's arguments packed as three lists (below),
 * fills the C args struct from them field by field, runs the class
 * fake for the output specs, allocates the outputs as torch tensors
 * (torch.empty / torch.zeros), runs the class impl on their memory and
 * returns them: the work a Python impl would do per call, without the
 * Python. A call runs on the device of its tensors: the CPU, or a GPU
 * through that GPU's default CUDA context (opfuse.default_context), whose
 * work is queued on torch's current stream of the GPU. The flattening is
 * classop.c's; torch is reached only through
 * the callables and dtype tables that torch_setup hands over, so the
 * extension keeps to the stable ABI and needs no torch headers. */
#include "classop.h"
#include <string.h>

/* What fake tensors point at: presence is all a fake reads. */
static unsigned char fake_byte;

/* What torch_setup stores: torch.empty, torch.zeros, the default-context
 * getter, the torch dtype -> opf dtype map, per opf dtype the {"dtype":
 * torch dtype} keywords of an allocation, and the getter of torch's current
 * stream of a GPU (as an int). */
static struct {
    PyObject *empty, *zeros, *context, *from_torch, *stream_of;
    PyObject *dtype_kw[OPF_DTYPE_COUNT];
    PyObject *s_dtype, *s_shape, *s_data_ptr, *s_is_contiguous, *s_is_cpu, *s_nbytes, *s_is_cuda,
             *s_get_device, *s_item, *s_device;
} T;

static PyObject *py_torch_setup(PyObject *mod, PyObject *a)
{
    PyObject *empty, *zeros, *context, *from_torch, *to_torch, *stream_of = Py_None;
    if (!PyArg_ParseTuple(a, "OOOO!O!|O", &empty, &zeros, &context, &PyDict_Type, &from_torch,
                          &PyDict_Type, &to_torch, &stream_of))
        return NULL;
    PyObject *olds[] = {T.empty, T.zeros, T.context, T.from_torch, T.stream_of};
    Py_INCREF(empty), Py_INCREF(zeros), Py_INCREF(context), Py_INCREF(from_torch);
    Py_INCREF(stream_of);
    T.empty = empty, T.zeros = zeros, T.context = context, T.from_torch = from_torch;
    T.stream_of = stream_of;
    for (int i = 0; i < 5; i++) Py_XDECREF(olds[i]);
    for (int d = 0; d < OPF_DTYPE_COUNT; d++) {
        PyObject *key = PyLong_FromLong(d), *dt = key ? PyDict_GetItem(to_torch, key) : NULL;
        Py_XDECREF(key);
        Py_CLEAR(T.dtype_kw[d]);
        if (dt && !(T.dtype_kw[d] = Py_BuildValue("{s:O}", "dtype", dt))) return NULL;
    }
    const char *names[] = {"dtype", "shape", "data_ptr", "is_contiguous", "is_cpu", "nbytes",
                           "is_cuda", "get_device", "item", "device"};
    PyObject **slots[] = {&T.s_dtype, &T.s_shape, &T.s_data_ptr, &T.s_is_contiguous, &T.s_is_cpu,
                          &T.s_nbytes, &T.s_is_cuda, &T.s_get_device, &T.s_item, &T.s_device};
    for (int i = 0; i < 10; i++)
        if (!*slots[i] && !(*slots[i] = PyUnicode_InternFromString(names[i]))) return NULL;
    Py_RETURN_NONE;
}

/* ---- torch tensors in --------------------------------------------------------------- */

static int attr_true(PyObject *t, PyObject *name, int call)
{
    PyObject *v = call ? PyObject_CallMethodObjArgs(t, name, NULL) : PyObject_GetAttr(t, name);
    int r = v ? PyObject_IsTrue(v) : -1;
    Py_XDECREF(v);
    return r;
}

static long long attr_ll(PyObject *t, PyObject *name, int call)
{
    PyObject *v = call ? PyObject_CallMethodObjArgs(t, name, NULL) : PyObject_GetAttr(t, name);
    long long r = v ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    return r;
}

/* Where a torch tensor's memory is: the CPU or GPU index. */
typedef struct {
    opf_device dev;
    int        index;
} torch_dev;

static int torch_device(PyObject *t, const char *field, torch_dev *out)
{
    int cpu = attr_true(t, T.s_is_cpu, 0), cuda = cpu == 0 ? attr_true(t, T.s_is_cuda, 0) : 0;
    long long index = cuda > 0 ? attr_ll(t, T.s_get_device, 1) : 0;
    if (cpu < 0 || cuda < 0 || PyErr_Occurred()) return -1;
    if (!cpu && !cuda) {
        PyObject *d = PyObject_GetAttr(t, T.s_device), *ds = d ? PyObject_Str(d) : NULL;
        PyObject *b = ds ? PyUnicode_AsUTF8String(ds) : NULL;
        opf_raise_msg(OPF_ERR_UNSUPPORTED, "%s: tensor on %s: opfuse takes CPU and CUDA tensors",
                      field, b ? PyBytes_AsString(b) : "?");
        Py_XDECREF(b), Py_XDECREF(ds), Py_XDECREF(d);
        return -1;
    }
    *out = (torch_dev){cpu ? OPF_DEVICE_CPU : OPF_DEVICE_CUDA, (int)index};
    return 0;
}

/* The address, size and device of a contiguous torch tensor's memory. */
static int torch_memory(PyObject *t, const char *field, void **ptr, size_t *nbytes, torch_dev *d)
{
    int on = torch_device(t, field, d);
    int contig = on == 0 ? attr_true(t, T.s_is_contiguous, 1) : -1;
    if (contig == 0) opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: tensor is not contiguous", field);
    if (contig <= 0) return -1;
    long long addr = attr_ll(t, T.s_data_ptr, 1), n = attr_ll(t, T.s_nbytes, 0);
    if (PyErr_Occurred()) return -1;
    *ptr = (void *)(uintptr_t)addr;
    *nbytes = (size_t)n;
    return 0;
}

static opf_dtype torch_dtype(PyObject *t, const char *field)
{
    PyObject *dt = PyObject_GetAttr(t, T.s_dtype);
    PyObject *v = dt ? PyDict_GetItem(T.from_torch, dt) : NULL;  /* borrowed */
    if (dt && !v) {
        PyObject *s = PyObject_Str(dt), *b = s ? PyUnicode_AsUTF8String(s) : NULL;
        opf_raise_msg(OPF_ERR_DTYPE, "%s: torch dtype %s has no opfuse dtype", field,
                      b ? PyBytes_AsString(b) : "?");
        Py_XDECREF(b);
        Py_XDECREF(s);
    }
    Py_XDECREF(dt);
    return v ? (opf_dtype)PyLong_AsLong(v) : (opf_dtype)-1;
}

/* The shape and dtype of a torch tensor. */
static int torch_spec(PyObject *t, const char *field, opf_spec *out)
{
    opf_dtype dt = torch_dtype(t, field);
    if ((int)dt < 0) return -1;
    PyObject *shape = PyObject_GetAttr(t, T.s_shape);
    Py_ssize_t nd = shape ? PySequence_Size(shape) : -1;
    if (nd > OPF_MAX_DIMS) opf_raise_msg(OPF_ERR_SHAPE, "%s: %zd dims, at most %d", field, nd,
                                         OPF_MAX_DIMS);
    int64_t dims[OPF_MAX_DIMS];
    for (Py_ssize_t i = 0; nd >= 0 && nd <= OPF_MAX_DIMS && i < nd; i++) {
        PyObject *d = PySequence_GetItem(shape, i);
        dims[i] = d ? PyLong_AsLongLong(d) : -1;
        Py_XDECREF(d);
    }
    Py_XDECREF(shape);
    if (PyErr_Occurred()) return -1;
    *out = opf_spec_make((int)nd, dims, dt);
    return 0;
}

/* ---- packed arguments ----------------------------------------------------------------
 * Every custom op takes (Tensor[] tensors, int[] values, SymInt[] shapes),
 * read field by field in the order of the flattened schema:
 *   plain tensor       values: present (0/1); tensors: the tensor when present
 *   plain or quantized values: mask (bit c: component c is in tensors), dtype,
 *                      scaling, qdtype, usage, flags; tensors: the components
 *                      in order; shapes: ndim, dims (quantized only: a plain
 *                      value is its component 0's shape and dtype)
 *   quantizer          values: its OPF_PY_Q_FIELDS ints
 *   float              values: the bits of the double
 *   int, enum, bool, reference   values: one int
 * and values ends with the plan (forward) or n_grads (backward), shapes
 * with the row count of the main input (2D); a fake needs it to tell
 * which output dims follow the rows under dynamic shapes, C does not. For
 * fakes the tensors are (shape, dtype) pairs and no memory is read. */

enum { MAX_VALUES = 4096, MAX_SHAPES = 1024 };

typedef struct {
    PyObject        *tensors;  /* a list */
    Py_ssize_t       n_tensors, ti, vi, si, nv, nsh;
    const long long *v, *sh;
    bool             fake;
    torch_dev        gpu;      /* the GPU of the call's first GPU tensor (dev CPU: none yet) */
} packed;

/* The memory of the next tensor of a call, which joins the call's device:
 * its tensors' GPU, when any (one GPU a call; CPU tensors with GPU ones
 * are the C call's to refuse, with its message). */
static int call_memory(packed *p, PyObject *t, const char *field, void **ptr, size_t *nbytes,
                       opf_device *dev)
{
    torch_dev d;
    if (torch_memory(t, field, ptr, nbytes, &d) < 0) return -1;
    *dev = d.dev;
    if (d.dev == OPF_DEVICE_CPU) return 0;
    if (p->gpu.dev == OPF_DEVICE_CPU) p->gpu = d;
    if (p->gpu.index == d.index) return 0;
    opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: tensor on cuda:%d, the call's other tensors on "
                  "cuda:%d", field, d.index, p->gpu.index);
    return -1;
}

static int next_value(packed *p, const char *field, long long *out)
{
    if (p->vi >= p->nv) {
        opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: the values list ends early", field);
        return -1;
    }
    *out = p->v[p->vi++];
    return 0;
}

static PyObject *next_tensor(packed *p, const char *field)
{
    if (p->ti >= p->n_tensors)
        return opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: the tensors list ends early", field);
    return PyList_GetItem(p->tensors, p->ti++);
}

/* A tensor of the list as a plain value (fake: its (shape, dtype) pair). */
static int source_plain(packed *p, const char *field, opf_tensor *out)
{
    PyObject *t = next_tensor(p, field);
    if (!t) return -1;
    if (!p->fake) {
        size_t nbytes;
        return torch_spec(t, field, &out->spec) < 0 ? -1
               : call_memory(p, t, field, &out->data[0], &nbytes, &out->spec.device);
    }
    PyObject *shape, *dims = NULL;
    int dt;
    if (!PyArg_ParseTuple(t, "Oi", &shape, &dt) ||
        !(dims = opf_py_list(shape, "a fake tensor's shape is a sequence")))
        return -1;
    Py_ssize_t nd = PyList_Size(dims);
    int64_t d[OPF_MAX_DIMS];
    for (Py_ssize_t i = 0; i < nd && i < OPF_MAX_DIMS; i++)
        d[i] = PyLong_AsLongLong(PyList_GetItem(dims, i));
    Py_DECREF(dims);
    if (nd > OPF_MAX_DIMS) opf_raise_msg(OPF_ERR_SHAPE, "%s: %zd dims", field, nd);
    out->spec = opf_spec_make((int)nd, d, (opf_dtype)dt);
    out->data[0] = &fake_byte;
    return PyErr_Occurred() ? -1 : 0;
}

static int source_component(packed *p, const char *field, const opf_tensor *t, int c,
                            size_t need)
{
    PyObject *o = next_tensor(p, field);
    if (!o) return -1;
    if (p->fake) {
        ((opf_tensor *)t)->data[c] = &fake_byte;
        return 0;
    }
    size_t nbytes;
    opf_tensor *w = (opf_tensor *)t;
    if (call_memory(p, o, field, &w->data[c], &nbytes, &w->spec.device) < 0) return -1;
    if (nbytes >= need) return 0;
    char sb[128];
    opf_spec_str(&t->spec, sb, sizeof sb);
    opf_raise_msg(OPF_ERR_SHAPE, "%s (%s): component %d has %zu bytes, needs %zu", field, sb, c,
                  nbytes, need);
    return -1;
}

static int read_quantized(packed *p, const char *field, opf_tensor *out)
{
    long long m[6];
    for (int i = 0; i < 6; i++)
        if (next_value(p, field, &m[i]) < 0) return -1;
    if (m[2] == OPF_SCALING_NONE) return m[0] & 1 ? source_plain(p, field, out) : 0;
    long long nd = p->si < p->nsh ? p->sh[p->si++] : -1;
    if (nd < 0 || nd > OPF_MAX_DIMS || p->si + nd > p->nsh) {
        opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: the shapes list has no shape for it", field);
        return -1;
    }
    int64_t dims[OPF_MAX_DIMS];
    for (int i = 0; i < nd; i++) dims[i] = p->sh[p->si + i];
    out->spec = opf_spec_make((int)nd, dims, (opf_dtype)m[1]);
    p->si += nd;
    out->spec.scaling = (opf_scaling)m[2];
    out->spec.qdtype = (opf_dtype)m[3];
    out->spec.usage = (unsigned)m[4];
    out->spec.flags = (unsigned)m[5];
    opf_layout L;
    opf_status st = opf_spec_layout(&out->spec, &L);
    if (st) {
        opf_raise_msg(st, "%s: %s", field, opf_last_error(NULL));
        return -1;
    }
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (!(m[0] & (1 << c))) continue;
        if (!L.comp[c].present) {
            opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: component %d is passed but the spec has "
                          "none", field, c);
            return -1;
        }
        if (source_component(p, field, out, c, L.comp[c].nbytes) < 0) return -1;
    }
    return 0;
}

/* A runtime field (OPF_FIELD_RUNTIME) whose value is the next tensor's: a
 * one-element i64 or i32 tensor, a graph input, so that a compiled graph
 * takes every value without recompiling (is_first_microbatch). A fake
 * reads none: the class's specs do not follow a runtime value. On a GPU
 * the value is read with item() (the host waits for torch's stream). */
static int runtime_value(packed *p, const flat_field *f, long long *v)
{
    PyObject *t = next_tensor(p, f->name);
    if (!t) return -1;
    *v = 0;
    if (p->fake) return 0;
    void *ptr;
    size_t nbytes;
    torch_dev d;
    opf_dtype dt = torch_dtype(t, f->name);
    if ((int)dt < 0 || torch_memory(t, f->name, &ptr, &nbytes, &d) < 0) return -1;
    if ((dt != OPF_I64 && dt != OPF_I32) || nbytes != opf_dtype_nbytes(dt, 1)) {
        opf_raise_msg(OPF_ERR_DTYPE, "%s: a runtime value is one i64 or i32 element, not %s of "
                      "%zu bytes", f->name, opf_dtype_name(dt), nbytes);
        return -1;
    }
    if (d.dev != OPF_DEVICE_CPU) {
        *v = attr_ll(t, T.s_item, 1);
        return PyErr_Occurred() ? -1 : 0;
    }
    *v = dt == OPF_I64 ? *(const int64_t *)ptr : *(const int32_t *)ptr;
    return 0;
}

static int read_value(packed *p, const flat_field *f, char *at)
{
    long long v;
    if (f->f->kind == OPF_FIELD_QUANTIZER) {
        if (p->vi + OPF_PY_Q_FIELDS > p->nv) {
            opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: the values list ends early", f->name);
            return -1;
        }
        opf_py_quantizer_from_ints(p->v + p->vi, (opf_quantizer *)at);
        p->vi += OPF_PY_Q_FIELDS;
        return 0;
    }
    if (next_value(p, f->name, &v) < 0) return -1;
    if (v == OPF_PY_FROM_TENSOR && (f->f->flags & OPF_FIELD_RUNTIME) && runtime_value(p, f, &v))
        return -1;
    double d;
    memcpy(&d, &v, sizeof d);
    switch (f->f->kind) {
    case OPF_FIELD_INT: *(int64_t *)at = v; break;
    case OPF_FIELD_ENUM:
    case OPF_FIELD_I32: *(int *)at = (int)v; break;
    case OPF_FIELD_FLOAT: *(double *)at = d; break;
    case OPF_FIELD_F32: *(float *)at = (float)d; break;
    case OPF_FIELD_BOOL: *(bool *)at = v != 0; break;
    case OPF_FIELD_REF: *(void **)at = (void *)(uintptr_t)v; break;
    default: break;
    }
    return 0;
}

/* A list of ints into buf (at most max); its length, or -1. */
static Py_ssize_t int_array(PyObject *o, long long *buf, Py_ssize_t max, const char *what)
{
    PyObject *l = opf_py_list(o, what);
    if (!l) return -1;
    Py_ssize_t n = PyList_Size(l);
    for (Py_ssize_t i = 0; i < n && i < max; i++) buf[i] = PyLong_AsLongLong(PyList_GetItem(l, i));
    Py_DECREF(l);
    if (n > max) opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: %zd ints, at most %zd", what, n, max);
    return PyErr_Occurred() ? -1 : n;
}

/* ---- the callable ------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    const opf_op_class *cls;
    const opf_schema   *schema;
    int                 bwd, n_fields;
    flat_field          ff[MAX_FLAT];
} opf_py_classcall;

static PyTypeObject *classcall_type;

static int classcall_init(PyObject *self, PyObject *args, PyObject *kw)
{
    opf_py_classcall *cc = (opf_py_classcall *)self;
    const char *name;
    int bwd;
    if (!PyArg_ParseTuple(args, "sp", &name, &bwd)) return -1;
    cc->cls = opf_py_find_class(name);
    cc->schema = cc->cls ? opf_py_class_schema(cc->cls, bwd) : NULL;
    cc->n_fields = cc->schema ? opf_py_flatten(cc->schema, cc->ff) : -1;
    cc->bwd = bwd;
    return cc->n_fields < 0 ? -1 : 0;
}

static int read_field(packed *p, const flat_field *f, char *at)
{
    long long present;
    if (f->f->kind == OPF_FIELD_TENSOR_Q) return read_quantized(p, f->name, (opf_tensor *)at);
    if (f->f->kind != OPF_FIELD_TENSOR) return read_value(p, f, at);
    if (next_value(p, f->name, &present) < 0) return -1;
    return present ? source_plain(p, f->name, (opf_tensor *)at) : 0;
}

/* The args struct of one call from its packed arguments; *last gets the
 * plan or n_grads. */
static int unpack(const opf_py_classcall *cc, PyObject *tensors, PyObject *values,
                  PyObject *shapes, bool fake, void *args, long long *last, torch_dev *gpu)
{
    long long v[MAX_VALUES], sh[MAX_SHAPES];
    packed p = {.tensors = tensors, .v = v, .sh = sh, .fake = fake};
    if (!PyList_Check(tensors)) {
        PyErr_SetString(PyExc_TypeError, "tensors must be a list");
        return -1;
    }
    p.n_tensors = PyList_Size(tensors);
    if ((p.nv = int_array(values, v, MAX_VALUES, "values")) < 0 ||
        (p.nsh = int_array(shapes, sh, MAX_SHAPES, "shapes")) < 0)
        return -1;
    memset(args, 0, cc->schema->size);
    for (int i = 0; i < cc->n_fields; i++)
        if (read_field(&p, &cc->ff[i], (char *)args + cc->ff[i].off) < 0) return -1;
    if (next_value(&p, cc->bwd ? "n_grads" : "plan", last) < 0) return -1;
    if (p.si++ >= p.nsh) {
        opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: the shapes list has no row count", cc->schema->name);
        return -1;
    }
    if (p.ti != p.n_tensors || p.vi != p.nv || p.si != p.nsh) {
        opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: %zd tensors, %zd values and %zd shape ints left "
                      "over", cc->schema->name, p.n_tensors - p.ti, p.nv - p.vi, p.nsh - p.si);
        return -1;
    }
    *gpu = p.gpu;
    opf_status st = opf_schema_validate(cc->schema, args);
    if (st) opf_raise_msg(st, "%s: %s", cc->schema->name, opf_last_error(NULL));
    return st ? -1 : 0;
}

/* Unpacks one call and runs the class fake: the specs of the tensors the
 * call returns, in order, and their count (-1 with an exception set). */
static int call_specs(const opf_py_classcall *cc, PyObject *targs, bool fake, void *args,
                      opf_py_fake_specs *fs, opf_spec **specs, torch_dev *gpu)
{
    PyObject *tensors, *values, *shapes;
    if (!PyArg_ParseTuple(targs, "OOO", &tensors, &values, &shapes)) return -1;
    long long last;
    if (unpack(cc, tensors, values, shapes, fake, args, &last, gpu) < 0) return -1;
    int n_grads = cc->bwd ? (int)last : 1;
    if (cc->bwd && (n_grads < 1 || n_grads > OPF_OP_MAX_GRADS)) {
        opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: %d gradients, expected 1..%d", cc->cls->name,
                      n_grads, OPF_OP_MAX_GRADS);
        return -1;
    }
    opf_status st = opf_py_run_fake(cc->cls, cc->bwd, args, fs);
    if (st) {
        opf_raise_msg(st, "%s: %s", cc->cls->name, opf_last_error(NULL));
        return -1;
    }
    return opf_py_out_specs(cc->cls, cc->bwd, n_grads, fs, specs);
}

static PyObject *shape_tuple(int ndim, const int64_t *dims)
{
    PyObject *shape = PyTuple_New(ndim);
    for (int i = 0; shape && i < ndim; i++) PyTuple_SetItem(shape, i, PyLong_FromLongLong(dims[i]));
    return shape;
}

/* A torch tensor for a, on the CPU (device NULL) or device ("cuda:N"). */
static PyObject *torch_alloc(const opf_py_alloc *a, PyObject *device)
{
    PyObject *kw = T.dtype_kw[a->dtype];
    if (!kw) return opf_raise_msg(OPF_ERR_DTYPE, "no torch dtype for %s", opf_dtype_name(a->dtype));
    if (device && (kw = PyDict_Copy(kw)) && PyDict_SetItem(kw, T.s_device, device) < 0)
        Py_CLEAR(kw);
    else if (!device)
        Py_INCREF(kw);
    PyObject *shape = kw ? shape_tuple(a->ndim, a->shape) : NULL;
    PyObject *targs = shape ? Py_BuildValue("(N)", shape) : NULL;
    PyObject *t = targs ? PyObject_Call(a->zero ? T.zeros : T.empty, targs, kw) : NULL;
    Py_XDECREF(targs);
    Py_XDECREF(kw);
    return t;
}

/* Allocates the tensors of specs[0..n) on the call's device into list r
 * (in order) and points the C outputs at them. */
static int alloc_outputs(const opf_spec *specs, int n, torch_dev gpu, PyObject *r,
                         opf_tensor *outs)
{
    PyObject *device = gpu.dev == OPF_DEVICE_CPU ? NULL
                       : PyUnicode_FromFormat("cuda:%d", gpu.index);
    if (gpu.dev != OPF_DEVICE_CPU && !device) return -1;
    int rc = 0;
    for (int i = 0; rc == 0 && i < n; i++) {
        memset(&outs[i], 0, sizeof outs[i]);
        opf_py_alloc al[OPF_COMP_COUNT];
        int na = opf_py_allocs(&specs[i], al);
        if (na < 0) rc = -1;
        if (na > 0) outs[i].spec = specs[i];
        /* what the op reads on the host stays there (OPF_SPEC_HOST) */
        PyObject *on = specs[i].flags & OPF_SPEC_HOST ? NULL : device;
        for (int j = 0; rc == 0 && j < na; j++) {
            PyObject *t = torch_alloc(&al[j], on);
            size_t nbytes;
            torch_dev d = {OPF_DEVICE_CPU, 0};
            rc = t ? torch_memory(t, "output", &outs[i].data[al[j].comp], &nbytes, &d) : -1;
            outs[i].spec.device = d.dev;
            if (t && PyList_Append(r, t) < 0) rc = -1;
            Py_XDECREF(t);
        }
    }
    Py_XDECREF(device);
    return rc;
}

/* The thread's default context of the call's device (opfuse.default_context),
 * kept in the thread state's dict so that a call costs no Python: a new
 * reference. A GPU's context then queues on torch's current stream. */
static PyObject *thread_context(torch_dev gpu)
{
    static PyObject *key;
    PyObject *d = PyThreadState_GetDict();
    if (!key && !(key = PyUnicode_InternFromString("opfuse.torch context"))) return NULL;
    PyObject *k = gpu.dev == OPF_DEVICE_CPU ? key
                  : PyUnicode_FromFormat("opfuse.torch context cuda:%d", gpu.index);
    if (!k) return NULL;
    PyObject *c = d ? PyDict_GetItem(d, k) : NULL;  /* borrowed */
    if (c && PyObject_TypeCheck(c, opf_py_ctx_type) && !((opf_py_ctx *)c)->closed) {
        Py_INCREF(c);
    } else {
        c = gpu.dev == OPF_DEVICE_CPU ? PyObject_CallObject(T.context, NULL)
                                      : PyObject_CallFunction(T.context, "si", "cuda", gpu.index);
        if (c && d && PyDict_SetItem(d, k, c) < 0) Py_CLEAR(c);
    }
    if (k != key) Py_DECREF(k);
    if (c && opf_py_torch_follow(c) < 0) Py_CLEAR(c);
    return c;
}

int opf_py_torch_follow(PyObject *ctx_obj)
{
    opf_ctx *ctx = opf_py_ctx_get(ctx_obj);
    if (!ctx) return -1;
    const opf_py_ctx *c = (const opf_py_ctx *)ctx_obj;
    if (c->device == OPF_DEVICE_CPU) return 0;
    if (!T.stream_of || T.stream_of == Py_None) {
        opf_raise_msg(OPF_ERR_STATE, "a CUDA context called from opfuse.torch: the current "
                      "stream is unknown (import opfuse.torch with a CUDA build of torch)");
        return -1;
    }
    PyObject *v = PyObject_CallFunction(T.stream_of, "i", c->index);
    unsigned long long sp = v ? PyLong_AsUnsignedLongLong(v) : 0;
    Py_XDECREF(v);
    if (PyErr_Occurred()) return -1;
    /* torch's default stream is 0: the legacy default stream, which the
     * runtime names (void *)1 (NULL would be the context's own) */
    opf_status st = opf_ctx_set_stream(ctx, (void *)(uintptr_t)(sp ? sp : 1));
    return st ? (opf_raise(st, ctx), -1) : 0;
}

/* ClassCall(tensors, values, shapes): the outputs' tensors, computed. */
static PyObject *classcall_call(PyObject *self, PyObject *targs, PyObject *kw)
{
    opf_py_classcall *cc = (opf_py_classcall *)self;
    if (!T.empty) return opf_raise_msg(OPF_ERR_STATE, "opfuse._C.torch_setup has not run");
    _Alignas(64) unsigned char args[OPF_OP_ARGS_MAX];
    opf_py_fake_specs fs;
    opf_spec *specs;
    torch_dev gpu;
    int n = call_specs(cc, targs, false, args, &fs, &specs, &gpu);
    if (n < 0) return NULL;
    PyObject *ctx_obj = thread_context(gpu);
    opf_ctx *ctx = ctx_obj ? opf_py_ctx_get(ctx_obj) : NULL;
    opf_tensor outs[OPF_OP_MAX_GRADS];
    PyObject *r = ctx ? PyList_New(0) : NULL;
    if (r && alloc_outputs(specs, n, gpu, r, outs) < 0) Py_CLEAR(r);
    opf_status st = OPF_OK;
    if (r) {
        size_t mark = opf_ctx_scratch_mark(ctx);
        const opf_op_class *c = cc->cls;
        Py_BEGIN_ALLOW_THREADS
        st = cc->bwd ? c->backward_impl(ctx, args, outs)
                     : c->forward_impl(ctx, args, outs, outs + 1 + c->n_extra_out);
        Py_END_ALLOW_THREADS
        opf_ctx_scratch_pop(ctx, mark);
        if (st) Py_CLEAR(r);
    }
    if (st) opf_raise(st, ctx);
    Py_XDECREF(ctx_obj);
    return r;
}

/* (shape, dtype, zeroed) of each torch tensor that holds spec s. */
static PyObject *alloc_list(const opf_spec *s)
{
    opf_py_alloc al[OPF_COMP_COUNT];
    int na = opf_py_allocs(s, al);
    PyObject *r = na < 0 ? NULL : PyList_New(na);
    for (int j = 0; r && j < na; j++) {
        PyObject *e = Py_BuildValue("(NiO)", shape_tuple(al[j].ndim, al[j].shape), al[j].dtype,
                                    al[j].zero ? Py_True : Py_False);
        if (!e) Py_CLEAR(r);
        else PyList_SetItem(r, j, e);
    }
    return r;
}

/* ClassCall.fake(tensors, values, shapes) with (shape, dtype) pairs for
 * tensors: per output that has tensors, (spec, its tensors as (shape,
 * dtype, zeroed)), with spec = (shape, dtype, scaling, qdtype, usage, flags). */
static PyObject *classcall_fake(PyObject *self, PyObject *targs)
{
    opf_py_classcall *cc = (opf_py_classcall *)self;
    _Alignas(64) unsigned char args[OPF_OP_ARGS_MAX];
    opf_py_fake_specs fs;
    opf_spec *specs;
    torch_dev gpu;
    int n = call_specs(cc, targs, true, args, &fs, &specs, &gpu);
    PyObject *r = n < 0 ? NULL : PyList_New(0);
    for (int i = 0; r && i < n; i++) {
        const opf_spec *sp = &specs[i];
        if (sp->ndim < 0) continue;
        PyObject *e = Py_BuildValue("((NiiiII)N)", shape_tuple(sp->ndim, sp->shape), sp->dtype,
                                    sp->scaling, sp->qdtype, sp->usage, sp->flags, alloc_list(sp));
        if (!e || PyList_Append(r, e) < 0) Py_CLEAR(r);
        Py_XDECREF(e);
    }
    return r;
}

static PyMethodDef classcall_methods[] = {
    {"fake", classcall_fake, METH_VARARGS,
     "fake(tensors, values, shapes): per output (spec, [(shape, dtype, zeroed)]), from the C "
     "fake."},
    {NULL, NULL, 0, NULL},
};

static void classcall_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
    Py_DECREF(tp);
}

static PyType_Slot classcall_slots[] = {
    {Py_tp_init, classcall_init},
    {Py_tp_call, classcall_call},
    {Py_tp_methods, classcall_methods},
    {Py_tp_dealloc, classcall_dealloc},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_doc, "ClassCall(cls, bwd): the torch kernel of one op class's forward or backward, "
                "called as (tensors, values, shapes)."},
    {0, NULL},
};
static PyType_Spec classcall_spec = {"opfuse._C.ClassCall", sizeof(opf_py_classcall), 0,
                                     Py_TPFLAGS_DEFAULT, classcall_slots};

/* ---- the autograd kernel -----------------------------------------------------------
 * A compiled graph calls its forward ops with grad mode off, yet the
 * dispatcher still enters the autograd kernel, and torch's (Python) one
 * redispatches with every argument converted twice more. FastAutograd
 * sits at the backend's autograd key in front of it: when nothing below
 * autograd would intercept the call (the keyset past autograd is the
 * backend alone: no fake or functional tensors, no modes, no functorch
 * layers) and no gradient is wanted, it runs the kernel directly;
 * otherwise it hands the call to torch's autograd kernel unchanged. */

typedef struct {
    PyObject_HEAD
    PyObject *kernel, *fallback, *backend_keys, *after_autograd, *grad_enabled, *s_requires_grad;
} opf_py_fastag;

static PyTypeObject *fastag_type;

static int fastag_init(PyObject *self, PyObject *args, PyObject *kw)
{
    opf_py_fastag *f = (opf_py_fastag *)self;
    PyObject *o[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &o[0], &o[1], &o[2], &o[3], &o[4])) return -1;
    PyObject **slots[] = {&f->kernel, &f->fallback, &f->backend_keys, &f->after_autograd,
                          &f->grad_enabled};
    for (int i = 0; i < 5; i++) {
        PyObject *old = *slots[i];
        Py_INCREF(o[i]);
        *slots[i] = o[i];
        Py_XDECREF(old);
    }
    if (!f->s_requires_grad) f->s_requires_grad = PyUnicode_InternFromString("requires_grad");
    return f->s_requires_grad ? 0 : -1;
}

/* 1: the call may skip autograd and everything else down to the backend. */
static int fastag_direct(opf_py_fastag *f, PyObject *keyset, PyObject *tensors)
{
    PyObject *below = PyNumber_And(keyset, f->after_autograd);
    int r = below ? PyObject_RichCompareBool(below, f->backend_keys, Py_EQ) : -1;
    Py_XDECREF(below);
    if (r <= 0) return r;
    PyObject *g = PyObject_CallObject(f->grad_enabled, NULL);
    r = g ? !PyObject_IsTrue(g) : -1;
    Py_XDECREF(g);
    for (Py_ssize_t i = 0; r == 0 && PyList_Check(tensors) && i < PyList_Size(tensors); i++) {
        PyObject *rg = PyObject_GetAttr(PyList_GetItem(tensors, i), f->s_requires_grad);
        r = !rg ? -1 : PyObject_IsTrue(rg) ? 2 : 0;
        Py_XDECREF(rg);
    }
    return r < 0 ? -1 : r != 2;
}

/* FastAutograd(keyset, tensors, values, shapes) */
static PyObject *fastag_call(PyObject *self, PyObject *args, PyObject *kw)
{
    opf_py_fastag *f = (opf_py_fastag *)self;
    if (PyTuple_Size(args) == 4 && !kw) {
        int direct = fastag_direct(f, PyTuple_GetItem(args, 0), PyTuple_GetItem(args, 1));
        if (direct < 0) return NULL;
        if (direct) {
            PyObject *rest = PyTuple_GetSlice(args, 1, 4);
            PyObject *r = rest ? PyObject_Call(f->kernel, rest, NULL) : NULL;
            Py_XDECREF(rest);
            return r;
        }
    }
    return PyObject_Call(f->fallback, args, kw);
}

static void fastag_dealloc(PyObject *self)
{
    opf_py_fastag *f = (opf_py_fastag *)self;
    PyObject **slots[] = {&f->kernel, &f->fallback, &f->backend_keys, &f->after_autograd,
                          &f->grad_enabled, &f->s_requires_grad};
    for (int i = 0; i < 6; i++) Py_CLEAR(*slots[i]);
    classcall_dealloc(self);
}

static PyType_Slot fastag_slots[] = {
    {Py_tp_init, fastag_init},
    {Py_tp_call, fastag_call},
    {Py_tp_dealloc, fastag_dealloc},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_doc, "FastAutograd(kernel, fallback, backend_keys, after_autograd, is_grad_enabled): "
                "an autograd kernel that runs kernel directly when nothing needs the dispatcher."},
    {0, NULL},
};
static PyType_Spec fastag_spec = {"opfuse._C.FastAutograd", sizeof(opf_py_fastag), 0,
                                  Py_TPFLAGS_DEFAULT, fastag_slots};

int opf_py_torchcall_init_types(PyObject *m)
{
    classcall_type = (PyTypeObject *)PyType_FromSpec(&classcall_spec);
    fastag_type = (PyTypeObject *)PyType_FromSpec(&fastag_spec);
    if (!classcall_type || !fastag_type) return -1;
    Py_INCREF(classcall_type);
    Py_INCREF(fastag_type);
    if (PyModule_AddObject(m, "ClassCall", (PyObject *)classcall_type) < 0) return -1;
    return PyModule_AddObject(m, "FastAutograd", (PyObject *)fastag_type);
}

/* ---- eager seq calls on torch tensors (op.c) -----------------------------------------
 * Seq.forward_torch / backward_torch take and return torch tensors, so the
 * eager path of opfuse.torch makes no DLPack round trip in Python per
 * call: a torch tensor in is read through its attributes, a result out is
 * one capsule handed to torch's own importer. */

static struct {
    PyObject *from_dlpack, *to_torch, *s_contiguous, *s_clone;
} E;

static PyObject *py_torch_eager_setup(PyObject *mod, PyObject *a)
{
    PyObject *from_dlpack, *to_torch;
    if (!PyArg_ParseTuple(a, "OO", &from_dlpack, &to_torch)) return NULL;
    PyObject *olds[] = {E.from_dlpack, E.to_torch};
    Py_INCREF(from_dlpack), Py_INCREF(to_torch);
    E.from_dlpack = from_dlpack, E.to_torch = to_torch;
    Py_XDECREF(olds[0]), Py_XDECREF(olds[1]);
    if (!E.s_contiguous && !(E.s_contiguous = PyUnicode_InternFromString("contiguous")))
        return NULL;
    if (!E.s_clone && !(E.s_clone = PyUnicode_InternFromString("clone"))) return NULL;
    Py_RETURN_NONE;
}

int opf_py_torch_in(PyObject *t, const char *field, PyObject *ctx_obj, opf_tensor *out,
                    PyObject *hold)
{
    if (!E.from_dlpack || !T.from_torch) {
        opf_raise_msg(OPF_ERR_STATE, "%s: opfuse.torch is not set up (import opfuse.torch)",
                      field);
        return -1;
    }
    torch_dev d;
    int contig = torch_device(t, field, &d) < 0 ? -1 : attr_true(t, T.s_is_contiguous, 1);
    if (contig < 0) return -1;
    /* a GPU tensor must be on the context's GPU (a CPU context's refusal is
     * the C call's, with its message) */
    const opf_py_ctx *c = (const opf_py_ctx *)ctx_obj;
    if (d.dev == OPF_DEVICE_CUDA && c->device == OPF_DEVICE_CUDA && d.index != c->index) {
        opf_raise_msg(OPF_ERR_INVALID_ARG, "%s: tensor on cuda:%d, the context on cuda:%d", field,
                      d.index, c->index);
        return -1;
    }
    /* a strided tensor runs as its contiguous copy, kept alive by hold */
    PyObject *used = t;
    if (contig) Py_INCREF(t);
    else used = PyObject_CallMethodObjArgs(t, E.s_contiguous, NULL);
    opf_spec spec;
    long long addr = used ? attr_ll(used, T.s_data_ptr, 1) : -1;
    int r = -1;
    if (used && !PyErr_Occurred() && torch_spec(used, field, &spec) == 0) {
        spec.device = d.dev;
        opf_status st = opf_tensor_wrap(&spec, (void *)(uintptr_t)addr, out);
        r = st ? (opf_raise(st, NULL), -1) : PyList_Append(hold, used);
    }
    Py_XDECREF(used);
    return r;
}

/* Element types torch imports natively through DLPack; others go through
 * opfuse.torch's to_torch (raw bytes viewed as the torch dtype). */
static int torch_native(opf_dtype dt)
{
    return dt == OPF_F32 || dt == OPF_F16 || dt == OPF_BF16 || dt == OPF_I32 || dt == OPF_I64;
}

PyObject *opf_py_torch_out(opf_tensor *t, PyObject *ctx, PyObject *owner, int copy_caller)
{
    int caller = !t->buf;
    int native = t->spec.scaling == OPF_SCALING_NONE && torch_native(t->spec.dtype);
    PyObject *o = opf_py_tensor_wrap(t, ctx, owner), *r = NULL;
    if (!o) return NULL;
    if (native) {
        PyObject *cap = opf_py_tensor_capsule(o);
        r = cap ? PyObject_CallFunctionObjArgs(E.from_dlpack, cap, NULL) : NULL;
        Py_XDECREF(cap);
    } else {
        r = PyObject_CallFunctionObjArgs(E.to_torch, o, NULL);
    }
    Py_DECREF(o);
    /* caller memory (a gradient passed straight through) is copied out */
    if (r && copy_caller && caller) {
        PyObject *c = PyObject_CallMethodObjArgs(r, E.s_clone, NULL);
        Py_DECREF(r);
        r = c;
    }
    return r;
}

static PyObject *py_torch_follow(PyObject *mod, PyObject *ctx)
{
    if (opf_py_torch_follow(ctx) < 0) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef opf_py_torchcall_methods[] = {
    {"torch_setup", py_torch_setup, METH_VARARGS,
     "torch_setup(empty, zeros, default_context, from_torch, to_torch, stream_of=None): what "
     "ClassCall calls (stream_of(i): torch's current stream of GPU i as an int)."},
    {"torch_follow", py_torch_follow, METH_O,
     "torch_follow(ctx): a CUDA context's later work on torch's current stream of its GPU."},
    {"torch_eager_setup", py_torch_eager_setup, METH_VARARGS,
     "torch_eager_setup(from_dlpack, to_torch): how Seq.forward_torch makes torch tensors."},
    {NULL, NULL, 0, NULL},
};
