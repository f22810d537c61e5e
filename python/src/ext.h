/* ext.h: shared declarations of the opfuse._C extension.
 *
 * The extension is written against the CPython stable ABI (Py_LIMITED_API)
 * and the public opfuse C API only. Every type is a heap type made from a
 * PyType_Spec at module init; the type objects live in module globals. */
#ifndef OPF_PYEXT_H
#define OPF_PYEXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "opfuse/compile.h"
#include "opfuse/gemm.h"
#include "opfuse/io.h"
#include "opfuse/nn.h"

/* ---- errors (module.c) -------------------------------------------------------
 * One exception class per opf_status, all subclasses of opfuse.Error, each
 * carrying .status. opf_raise sets the exception for st with the context's
 * last error (or the thread's when ctx is NULL) and returns NULL. */
extern PyObject *opf_py_errors[OPF_STATUS_COUNT];
PyObject *opf_raise(opf_status st, const opf_ctx *ctx);
/* Sets the exception of st with a formatted message; returns NULL. */
PyObject *opf_raise_msg(opf_status st, const char *fmt, ...);

/* ---- context (context.c) ------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    opf_ctx   *ctx;
    int        closed;   /* close() ran: every use raises StateError */
    opf_device device;   /* of the context, and its index among the machine's GPUs */
    int        index;
} opf_py_ctx;
extern PyTypeObject *opf_py_ctx_type;
int opf_py_ctx_init_type(PyObject *m);
/* The live opf_ctx of a Context object, or NULL with StateError / TypeError set. */
opf_ctx *opf_py_ctx_get(PyObject *o);
/* "cpu" or "cuda:N" of a device and index, into buf. */
void opf_py_device_str(opf_device dev, int index, char *buf, size_t size);

/* ---- tensors (tensor.c) ---------------------------------------------------------
 * A Tensor holds one opf_tensor: either a counted reference to a library
 * buffer, or caller memory kept alive by `owner` (imported DLPack capsules). */
typedef struct {
    PyObject_HEAD
    opf_tensor t;
    PyObject  *owner;   /* what keeps caller memory alive; NULL for library buffers */
    PyObject  *ctx;     /* the Context the buffer came from (destroyed last) */
    int        index;   /* the GPU of a device tensor (t.spec.device CUDA) */
} opf_py_tensor;
extern PyTypeObject *opf_py_tensor_type;
int opf_py_tensor_init_type(PyObject *m);
/* A new Tensor taking over *t (the reference moves; *t is zeroed). */
PyObject *opf_py_tensor_wrap(opf_tensor *t, PyObject *ctx, PyObject *owner);
/* The opf_tensor of a Tensor object, or NULL with TypeError set. None gives
 * NULL without an error when allow_none. */
const opf_tensor *opf_py_tensor_get(PyObject *o, int allow_none);

/* A DLPack capsule of a plain Tensor (what Tensor.__dlpack__() gives), for
 * a consumer already ordered after the producing context's stream. */
PyObject *opf_py_tensor_capsule(PyObject *tensor);

/* Torch tensors in and out of an eager seq call (torchcall.c). _in points
 * *out at t's memory (at a contiguous copy when t is strided) and appends
 * the tensor used to the list hold, which the caller keeps alive while
 * the C side reads it. _out takes over *t as a torch tensor (as _wrap);
 * copy_caller: caller memory is cloned. */
int opf_py_torch_in(PyObject *t, const char *field, PyObject *ctx, opf_tensor *out,
                    PyObject *hold);
PyObject *opf_py_torch_out(opf_tensor *t, PyObject *ctx, PyObject *owner, int copy_caller);
/* On a CUDA Context: queues its later work on torch's current stream of its
 * GPU (opf_ctx_set_stream), so that it is ordered with torch's; a CPU
 * Context: nothing. -1 with an exception set on failure. */
int opf_py_torch_follow(PyObject *ctx);

/* A DLPack-exportable view of ndim x shape elements of dtype at ptr, in the
 * memory of Context ctx's device, keeping `keep` alive while any consumer
 * holds it; raw as in Tensor.component. */
PyObject *opf_py_view(PyObject *keep, PyObject *ctx, void *ptr, int ndim, const int64_t *shape,
                      opf_dtype dt, int raw);

/* ---- conversions (convert.c) ------------------------------------------------------ */
/* o as a new list (PySequence_List), or NULL with TypeError naming what. */
PyObject *opf_py_list(PyObject *o, const char *what);
/* Reads an integer / float / bool attribute of o, keeping *out when absent. */
int opf_py_attr_int(PyObject *o, const char *name, long long *out);
int opf_py_attr_float(PyObject *o, const char *name, double *out);
int opf_py_attr_bool(PyObject *o, const char *name, bool *out);
/* A spec from a Python object with shape, dtype, scaling, qdtype, usage, flags. */
int opf_py_to_spec(PyObject *o, opf_spec *out);
PyObject *opf_py_from_spec(const opf_spec *s);
/* Recipes and quantizers from the opfuse.Recipe / opfuse.Quantizer objects. */
int opf_py_to_recipe(PyObject *o, opf_recipe *out);
int opf_py_to_quantizer(PyObject *o, opf_quantizer *out);
PyObject *opf_py_from_quantizer(const opf_quantizer *q);

/* The opf_op of an Op object, or NULL with an exception set (op.c). */
opf_op *opf_py_op_get(PyObject *o);
/* Value fields of an args or kwargs struct from a mapping of field names (op.c). */
int opf_py_pack_values(const opf_schema *s, PyObject *values, void *args);

/* The delayed state of one direction of a RecipeState object (quant.c), or
 * NULL with an exception set. */
opf_delayed_state *opf_py_recipe_state_delayed(PyObject *o, bool backward);

/* ---- module functions by file ---------------------------------------------------- */
extern PyMethodDef opf_py_quant_methods[];
extern PyMethodDef opf_py_op_methods[];
extern PyMethodDef opf_py_classop_methods[];
extern PyMethodDef opf_py_torchcall_methods[];
extern PyMethodDef opf_py_fusion_methods[];
int opf_py_torchcall_init_types(PyObject *m);
int opf_py_op_init_types(PyObject *m);
int opf_py_quant_init_types(PyObject *m);

/* Adds every method of defs to module m. */
int opf_py_add_methods(PyObject *m, PyMethodDef *defs);

#endif
