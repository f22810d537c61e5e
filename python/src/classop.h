/* classop.h: what classop.c (op classes seen from Python) shares with
 * torchcall.c (the same classes called with torch tensors). */
#ifndef OPF_PYEXT_CLASSOP_H
#define OPF_PYEXT_CLASSOP_H

#include "ext.h"

#define MAX_FLAT 160

/* One field of an args struct with its bundles flattened away. */
typedef struct {
    const opf_field *f;
    size_t           off;  /* from the start of the top-level args struct */
    char             name[96];
} flat_field;

/* The fields of s into out (MAX_FLAT of them); their count, or -1 with an
 * exception set. */
int opf_py_flatten(const opf_schema *s, flat_field *out);
/* The registered class, or NULL with InvalidArgError set. */
const opf_op_class *opf_py_find_class(const char *name);
/* The class's forward or backward schema, or NULL with UnsupportedError set. */
const opf_schema *opf_py_class_schema(const opf_op_class *c, int bwd);
/* A quantizer from its OPF_PY_Q_FIELDS integers (classop.c, quantizer_tuple). */
enum { OPF_PY_Q_FIELDS = 14 };
/* A runtime field's value in the values list: read it from the next tensor
 * (torchcall.c, runtime_value). */
#define OPF_PY_FROM_TENSOR (-(1LL << 62))
void opf_py_quantizer_from_ints(const long long *f, opf_quantizer *q);

/* Output specs of one fake call: forward outs at [0, 1 + OPF_OP_MAX_EXTRA),
 * aux after them; backward grads. */
typedef struct {
    opf_spec outs[1 + OPF_OP_MAX_EXTRA + OPF_OP_MAX_AUX];
    opf_spec grads[OPF_OP_MAX_GRADS];
} opf_py_fake_specs;
opf_status opf_py_run_fake(const opf_op_class *c, int bwd, const void *args,
                           opf_py_fake_specs *fs);
/* The output specs an impl call fills, in order (forward: the outputs, then
 * every aux slot; backward: n_grads gradients); their count. */
int opf_py_out_specs(const opf_op_class *c, int bwd, int n_grads, opf_py_fake_specs *fs,
                     opf_spec **out);

/* How the torch side holds one output spec: one tensor per present
 * component. A plain spec is its own shape and dtype; a quantized
 * component is 2D, fp32 where its dtype is fp32 and bytes otherwise, and
 * zeroed unless it is data (scales carry padding that must read as zero). */
typedef struct {
    int       comp;
    int       ndim;
    int64_t   shape[OPF_MAX_DIMS];
    opf_dtype dtype;  /* OPF_F32, OPF_U8 or a plain spec's dtype */
    bool      zero;
} opf_py_alloc;
/* The tensors of spec s (none for an absent or pass-through spec); their
 * count (at most OPF_COMP_COUNT), or -1 with an exception set. */
int opf_py_allocs(const opf_spec *s, opf_py_alloc *a);

/* A compiled graph as opfuse.torch's program (classop.c, "graph programs"). */
PyObject *opf_py_graph_program(const opf_graph *g, opf_seq *seq);

#endif
