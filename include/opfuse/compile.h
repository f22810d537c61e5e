/* opfuse/compile.h: compile a seq into a static graph and replay it.
 *
 * opf_compile traces the seq's forward and backward plans on specs only (the
 * ops' fakes; no tensor data is read) into a graph with one node per plan
 * entry, plans every activation, saved tensor and input gradient into one
 * arena reserved at compile time (parameter gradients go into the
 * parameters' grads, or, when added to one, into a buffer the first such
 * call allocates), and then replays the same *_impl functions the eager
 * fuser calls, with no allocation and none of the traced half:
 *
 *     opf_compile_options o = opf_compile_options_default();
 *     o.max_leading = 64;                        // any batch 1..64, one graph
 *     opf_graph *g;
 *     opf_compile(seq, &x_spec, &call, &o, &g);  // call: recipe, grad flags, kwargs
 *     for (...) {
 *         opf_graph_forward(g, &x, &call, &y, NULL);   // y: a view into the arena
 *         opf_graph_backward(g, &dy, NULL, &dx, NULL);
 *         opf_optim_step(opt);
 *     }
 *     opf_graph_destroy(g);
 *
 * The passes (src/compile/): trace, gate, guard, plan memory, execute, dump.
 *
 *  - A node per plan entry records the op's args flattened through its
 *    schema: tensor slots refer to graph values (inputs, arena values, or
 *    memory the op owns such as parameters), value fields are baked in.
 *    Forward and backward keep their own fusion plans; fused ops are nodes
 *    like any other.
 *  - Gate: an op runs as an *eager node* (its traced half re-run on every
 *    call, inside the graph) when its class has no fake, reports an
 *    unsupported reason, or is handed kwargs its class does not declare.
 *    opf_graph_reasons lists them; each reason is warned once per context.
 *  - Guard: input specs, the recipe (hence every quantizer, which are values),
 *    the grad flags and the value fields of the kwargs form the key of a
 *    graph. Tensor kwargs (quantized ones included) are graph inputs: their
 *    data may change on every call. opf_compiled keeps a bounded cache of
 *    graphs by key and recompiles on a miss. Guards compare values: a
 *    graph replays only when every one of these equals what it was
 *    compiled for, field by field; the 64-bit key only finds candidates, so
 *    two calls whose keys collide get two graphs, never each other's.
 *    Float kwargs (OPF_FIELD_FLOAT, OPF_FIELD_F32) are guarded by their
 *    bits: every distinct value compiles its own graph (up to
 *    max_variants), 0.0 and -0.0 are different values, a NaN matches only
 *    the same NaN bits, and 1e-9 apart is apart. A float that changes every
 *    step (a schedule) belongs in a tensor kwarg, whose data is an input.
 *  - Dynamic leading dimension: with max_leading > 0, one graph runs any
 *    leading size of x in [1, max_leading] (traced at the maximum, sizes
 *    patched per call; the fakes re-check each new size once).
 *  - Memory: liveness over the node order, in-place reuse where an op class
 *    allows it (opf_op_class.inplace), one arena per graph.
 *  - Delayed scaling: the amax/scale updates after forward and backward are
 *    nodes of the graph.
 *  - On a GPU (x on the context's device): the arena is one device
 *    allocation, the inputs are copied into it on each call, and each
 *    direction replays captured CUDA graphs, one per run of nodes between
 *    eager nodes, captured on the second call of each leading size and
 *    runtime-kwarg combination (the first walks the nodes as a warm-up); a
 *    replayed step allocates nothing. Ops that draw random numbers (dropout,
 *    stochastic rounding) or synchronize are walked instead, with a warning.
 *
 * Outputs (y, dx, extra outputs, extra-input gradients) are views into the
 * graph's arena, valid until the graph's next forward; releasing them is a
 * no-op. Parameter gradients accumulate into each parameter's grad exactly
 * as eagerly. Inputs, parameters and kwargs are never written or freed by
 * a graph, also when an eager node runs inside it.
 *
 * A graph references the seq's ops and their recipe state: it stays valid
 * while the seq is not mutated and its recipe state is not rebuilt (a
 * forward with another recipe, opf_seq_prepare), fusions are switched
 * (opf_seq_set_fusions) or a checkpoint load replaces a quantized weight. A
 * stale graph refuses to run (OPF_ERR_STATE); opf_compiled recompiles it.
 * Fusion functions registered after a compile apply to later compiles, as
 * they apply to plans built after the registration.
 */
#ifndef OPFUSE_COMPILE_H
#define OPFUSE_COMPILE_H

#include <stdio.h>

#include "opfuse/export.h"
#include "opfuse/fuser.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct opf_graph opf_graph;

typedef struct opf_compile_options {
    int64_t max_leading;   /* > 0: x's leading dimension may be 1..max_leading; 0: fixed */
    int     max_variants;  /* opf_compiled: graphs kept; 8. At the limit it warns and evicts */
    bool    no_device_graphs;  /* x on a GPU: walk the nodes on every call instead of
                                  replaying captured CUDA graphs (false) */
} opf_compile_options;

OPF_API opf_compile_options opf_compile_options_default(void);

/* Compiles seq for inputs of spec *x (with max_leading > 0, x->shape[0] is
 * replaced by max_leading) and the settings of *call: recipe, requires_grad
 * (false: a forward-only inference graph that saves nothing for backward),
 * input_requires_grad, extra inputs (their specs; an eager node's probe also
 * reads the data of those that have it, e.g. grouped_linear's split sizes)
 * and kwargs (value fields are baked in; tensor fields become graph inputs,
 * only their specs are read here). Builds the seq's recipe state and plans as its
 * forward would. Errors: an op class that is not registered, specs the ops
 * reject (the op's message), a backward pending on the seq. */
OPF_API opf_status opf_compile(opf_seq *seq, const opf_spec *x, const opf_seq_call *call,
                               const opf_compile_options *opts, opf_graph **out);
OPF_API void opf_graph_destroy(opf_graph *g);  /* NULL: no-op */

/* Runs the forward graph. x, call->extra_in and the tensor kwargs must match
 * the compiled specs (the leading size of x may vary up to max_leading) and
 * call's recipe, grad flags and value kwargs the compiled ones; otherwise
 * OPF_ERR_INVALID_ARG names what differs (opf_compiled recompiles instead).
 * *y and extra_out (opf_seq_num_extra_out entries) receive arena views
 * (two of them may be one value: an op that hands its input on, as
 * make_extra_output, gives y and its extra output the same memory). */
OPF_API opf_status opf_graph_forward(opf_graph *g, const opf_tensor *x, const opf_seq_call *call,
                                     opf_tensor *y, opf_tensor *extra_out);
/* Runs the backward graph of the last forward (once per forward).
 * dextra_out: gradients of the public extra outputs (NULL or entries without
 * data count as zero). *dx (may be NULL) and dextra_in (may be NULL) receive
 * arena views; a gradient that is not computed comes back zeroed (no data). */
OPF_API opf_status opf_graph_backward(opf_graph *g, const opf_tensor *dy,
                                      const opf_tensor *dextra_out, opf_tensor *dx,
                                      opf_tensor *dextra_in);

/* ---- introspection -----------------------------------------------------------
 * These read a graph and never fail on a valid one; with g NULL the counts
 * are 0, stats are zeroed, and opf_graph_node / the dumps return
 * OPF_ERR_INVALID_ARG. Strings point into the graph (or the op) and live as
 * long as it. */

typedef enum opf_node_kind {
    OPF_NODE_FORWARD = 0,     /* an op's forward_impl on baked args */
    OPF_NODE_BACKWARD,        /* an op's backward_impl on baked args (+ parameter grads) */
    OPF_NODE_EAGER_FORWARD,   /* the op's whole eager forward, run inside the graph */
    OPF_NODE_EAGER_BACKWARD,
    OPF_NODE_GRAD_ADD,        /* two gradients of one channel summed */
    OPF_NODE_AMAX_UPDATE,     /* delayed scaling: amax history roll and new scales */
    OPF_NODE_RECOMPUTE,       /* a recompute span: keep or restore its Philox offset and scales */
    OPF_NODE_KIND_COUNT
} opf_node_kind;

OPF_API const char *opf_node_kind_name(opf_node_kind k);

typedef struct opf_graph_node_info {
    opf_node_kind kind;
    bool          backward;     /* part of the backward graph */
    const char   *op_name;      /* "fc1", "forward_linear_bias_activation(fc1,fc1_bias,gelu)" */
    const char   *class_name;   /* NULL for GRAD_ADD / AMAX_UPDATE */
    bool          fused;        /* the op is a fused op */
    int           first, count; /* basic ops covered (seq indices) */
    const char   *reason;       /* eager nodes: why */
    int           n_outputs;    /* arena values the node writes */
} opf_graph_node_info;

OPF_API int opf_graph_num_nodes(const opf_graph *g);
OPF_API opf_status opf_graph_node(const opf_graph *g, int i, opf_graph_node_info *out);

typedef struct opf_graph_reason {
    const char *op_name;
    const char *reason;
    bool        backward;
} opf_graph_reason;
/* The eager nodes and their reasons; returns the count (writes at most max). */
OPF_API int opf_graph_reasons(const opf_graph *g, opf_graph_reason *out, int max);

typedef struct opf_graph_stats {
    int     n_forward, n_backward;  /* nodes of each graph */
    int     n_eager, n_fused;       /* eager nodes; nodes of fused ops */
    int     n_values;               /* arena values */
    int     n_inplace;              /* values that reuse their input's storage */
    size_t  arena_bytes;            /* the planned peak: the arena's size */
    size_t  unplanned_bytes;        /* sum of every arena value: no reuse at all */
    size_t  saved_bytes;            /* forward values the backward reads */
    int64_t max_leading;            /* 0: fixed shapes */
    bool    forward_only;
} opf_graph_stats;
OPF_API void opf_graph_get_stats(const opf_graph *g, opf_graph_stats *out);

/* Node timing, for benchmarks: while on, each node's wall time accumulates
 * (a clock read around each node; on a GPU, with a synchronization before
 * and after, so it is the node's kernel time, and the nodes are walked
 * instead of replayed as device graphs). opf_graph_node_seconds gives node i's
 * total since the last reset; summed over the nodes it is the time spent in
 * the kernels (the ops' impls, gradient sums, updates), so a step's time
 * minus it is the host overhead around them. */
OPF_API void opf_graph_set_profile(opf_graph *g, bool on);
OPF_API void opf_graph_reset_profile(opf_graph *g);
OPF_API double opf_graph_node_seconds(const opf_graph *g, int i);
/* The profile as a table written to f: the nodes grouped by op class (or
 * node kind) and direction, costliest first, in ms per step over `steps`
 * profiled steps, with each group's share and node count. g and f are the
 * caller's (read and written only). NULL g or f, or steps <= 0:
 * OPF_ERR_INVALID_ARG with a message; a failed write: OPF_ERR_IO. */
OPF_API opf_status opf_graph_dump_profile(const opf_graph *g, int64_t steps, FILE *f);

/* Human-readable listing: one line per node with its class, fused/eager
 * state and reason, input and output values with shapes and formats, and
 * the memory plan. */
OPF_API opf_status opf_graph_dump(const opf_graph *g, FILE *f);
/* Graphviz DOT of the same: fused nodes, eager nodes (with their reason),
 * forward and backward clusters, edges labelled with shapes and formats. */
OPF_API opf_status opf_graph_dump_dot(const opf_graph *g, FILE *f);

/* ---- export ---------------------------------------------------------------------
 * A graph as another runtime can re-express it node by node (opfuse.torch
 * calls each node's op class as a torch custom op): every value's origin,
 * every node's args (value fields as baked) and the graph value each of its
 * tensors reads or writes, component by component. */

typedef enum opf_graph_value_kind {
    OPF_GRAPH_VALUE_NODE = 0,     /* written by node `def` */
    OPF_GRAPH_VALUE_X,            /* the main input */
    OPF_GRAPH_VALUE_EXTRA_IN,     /* public extra input `index` */
    OPF_GRAPH_VALUE_DY,           /* the main output's gradient */
    OPF_GRAPH_VALUE_DEXTRA_OUT,   /* public extra output `index`'s gradient */
    OPF_GRAPH_VALUE_KWARG,        /* a tensor kwarg of op `index` (seq order) */
    OPF_GRAPH_VALUE_KIND_COUNT
} opf_graph_value_kind;

typedef struct opf_graph_value_info {
    opf_spec             spec;    /* at the traced size */
    opf_graph_value_kind kind;
    int                  index;   /* EXTRA_IN, DEXTRA_OUT: which; KWARG: the op */
    size_t               field;   /* KWARG: offset of the tensor field in the op's kwargs struct */
    int                  def;     /* NODE: the node writing it; -1 otherwise */
    int                  def_out; /* NODE: its place among that node's tensors (forward:
                                     outs[1 + OPF_OP_MAX_EXTRA] then aux[OPF_OP_MAX_AUX];
                                     backward: grads; grad add: 0) */
    const char          *name;    /* "fc1.y" */
} opf_graph_value_info;

OPF_API int opf_graph_num_values(const opf_graph *g);
OPF_API opf_status opf_graph_value(const opf_graph *g, int v, opf_graph_value_info *out);

/* The public values (-1: none): y, dx, and per public extra input / output
 * its value and its gradient's. The arrays point into the graph. */
typedef struct opf_graph_io {
    int        x, y, dy, dx;
    int        n_extra_in, n_extra_out;
    const int *extra_in, *dextra_in;    /* [n_extra_in] */
    const int *extra_out, *dextra_out;  /* [n_extra_out] */
} opf_graph_io;
OPF_API void opf_graph_get_io(const opf_graph *g, opf_graph_io *out);

/* FORWARD and BACKWARD nodes: the args' schema and the baked args (NULL
 * for other kinds). Tensor data pointers in them are arena addresses or
 * the op's own memory (parameters); opf_graph_node_ref says which value. */
OPF_API opf_status opf_graph_node_args(const opf_graph *g, int i, const opf_schema **schema,
                                       const void **args);

/* One tensor of a node: an args slot it reads or an output it writes. */
typedef struct opf_graph_ref {
    const opf_tensor *t;             /* in the node's args, or its output */
    bool              output;
    int               out_index;     /* output: its place among the node's tensors */
    int               value[OPF_COMP_COUNT];  /* -1: absent, or memory of the op's (t->data) */
    int               comp[OPF_COMP_COUNT];   /* the value's component it points at */
    size_t            offset[OPF_COMP_COUNT]; /* bytes into that component */
} opf_graph_ref;
OPF_API int opf_graph_node_num_refs(const opf_graph *g, int i);
OPF_API opf_status opf_graph_node_ref(const opf_graph *g, int i, int r, opf_graph_ref *out);

/* ---- guarded cache -------------------------------------------------------------
 * opf_compiled wraps a seq: each call computes the guard key, runs the graph
 * of that key, or compiles one (a recompile when the cache already held one
 * or the graph went stale). */
typedef struct opf_compiled opf_compiled;

OPF_API opf_status opf_compiled_create(opf_seq *seq, const opf_compile_options *opts,
                                       opf_compiled **out);
OPF_API void opf_compiled_destroy(opf_compiled *c);  /* NULL: no-op; the seq stays */
OPF_API opf_status opf_compiled_forward(opf_compiled *c, const opf_tensor *x,
                                        const opf_seq_call *call, opf_tensor *y,
                                        opf_tensor *extra_out);
OPF_API opf_status opf_compiled_backward(opf_compiled *c, const opf_tensor *dy,
                                         const opf_tensor *dextra_out, opf_tensor *dx,
                                         opf_tensor *dextra_in);
/* Compilations after the first one. */
OPF_API int opf_compiled_recompiles(const opf_compiled *c);
OPF_API int opf_compiled_num_graphs(const opf_compiled *c);
/* The graph the last call ran (NULL before the first). */
OPF_API opf_graph *opf_compiled_last_graph(opf_compiled *c);

#ifdef __cplusplus
}
#endif
#endif
