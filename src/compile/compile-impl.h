/* compile-impl.h: the graph IR of a compiled seq and the passes over it.
 *
 * trace.c   trace the plans on specs into nodes and values; gate eager nodes
 * plan.c    liveness, in-place reuse, arena placement; bake pointers; the
 *           affine patches of a dynamic leading dimension
 * exec.c    run the forward and backward graphs
 * replay.c  device graphs: segments, captured replays per variant, inputs
 *           staged in the arena
 * cache.c   the guard key and opf_compiled
 * dump.c    text and DOT dumps
 *
 * Tracing runs every op's traced half (resolve, setup_context) and its fake
 * on tensors whose data pointers are *tags*: an address that is never
 * dereferenced and encodes (value, component, byte offset). Whatever the
 * traced half copies into the args (views, reshapes, saved tensors handed
 * from forward to backward) keeps its tag, so after tracing every tensor in
 * every node says which graph value it reads or writes. Baking replaces the
 * tags with arena addresses; tags of graph inputs become per-call patches.
 * Pointers that are not tags (parameters, cached quantized weights) are the
 * op's own memory and stay as they are.
 */
#ifndef OPFUSE_COMPILE_IMPL_H
#define OPFUSE_COMPILE_IMPL_H

#include "fuser/walk-impl.h"
#include "opfuse/compile.h"

_Static_assert(sizeof(void *) == 8, "graph tags need 64-bit pointers");

/* Tag layout: 0x5A5A | value (12 bits) | component (4 bits) | offset (32 bits). */
#define OPF_TAG_BASE  ((uintptr_t)0x5A5A000000000000ull)
#define OPF_TAG_MASK  ((uintptr_t)0xFFFF000000000000ull)
#define OPF_GRAPH_MAX_VALUES 4096

static inline void *opf_tag(int v, int c) { return (void *)(OPF_TAG_BASE | (uintptr_t)v << 36 | (uintptr_t)c << 32); }
static inline bool opf_is_tag(const void *p) { return ((uintptr_t)p & OPF_TAG_MASK) == OPF_TAG_BASE; }
static inline int opf_tag_value(const void *p) { return (int)(((uintptr_t)p >> 36) & 0xFFF); }
static inline int opf_tag_comp(const void *p) { return (int)(((uintptr_t)p >> 32) & 0xF); }
static inline size_t opf_tag_offset(const void *p) { return (size_t)((uintptr_t)p & 0xFFFFFFFFu); }

typedef enum { OPF_VAL_ARENA = 0, OPF_VAL_INPUT = 1 } opf_val_kind;
typedef enum { OPF_IN_X, OPF_IN_EXTRA, OPF_IN_DY, OPF_IN_DEXTRA_OUT, OPF_IN_KWARG } opf_in_kind;

typedef struct opf_gval {
    opf_spec     spec;          /* at the traced (maximum) size */
    opf_val_kind kind;
    opf_in_kind  in_kind;       /* inputs: which one */
    int          in_index;      /* extra input / output index, or op index of a kwarg */
    size_t       in_field;      /* kwarg: offset of the tensor field in the kwargs struct */
    size_t       comp_off[OPF_COMP_COUNT];  /* arena: component offsets within the block */
    size_t       bytes;         /* arena: block size */
    int          def, last;     /* node writing it (-1: input), last node reading it */
    int          store;         /* arena block (shared by an in-place chain) */
    bool         keep;          /* handed to the caller: alive to the end */
    bool         pgrad;         /* a parameter's gradient: no arena block; exec.c
                                   points it at the grad or at the graph's
                                   gradient buffer per call */
    bool         backward;      /* defined by the backward graph */
    char         name[48];      /* for dumps: "fc1.out", "gelu.aux1", "x" */
    const opf_tensor *bound;    /* inputs: the caller's tensor of this call */
} opf_gval;

typedef struct opf_gstore {
    size_t bytes, offset;
    int    start, end;          /* node interval */
} opf_gstore;

/* A tensor inside a node (an args slot, an output, an eager input...) and
 * the value it refers to (-1: not a graph value). */
typedef struct opf_gref {
    opf_tensor *t;
    int         val;
    bool        output;         /* written by the node */
    void       *traced[OPF_COMP_COUNT];  /* t's data as traced (tags), kept past baking for
                                            opf_graph_node_ref */
} opf_gref;

typedef struct opf_gnode {
    opf_node_kind     kind;
    bool              backward;
    opf_op           *op;       /* NULL for GRAD_ADD / AMAX_UPDATE */
    int               first, count;
    const char       *reason;   /* eager nodes */
    const opf_schema *schema;   /* FORWARD / BACKWARD: the args' schema */
    void             *args;     /* FORWARD / BACKWARD: baked args */
    opf_tensor       *t;        /* FORWARD: outs[1 + MAX_EXTRA] + aux[MAX_AUX]; BACKWARD:
                                   grads[n_t]; eager: outs or grads, then inputs; GRAD_ADD:
                                   out, a, b */
    int               n_t, n_out;  /* tensors; of which outputs (the first n_out) */
    int               n_params;    /* BACKWARD: grads[1..n_params] go into params (exec.c) */
    bool              passthrough; /* backward: dx is dy */
    int               rc_phase;    /* RECOMPUTE: the opf_rc_phase (group in `first`) */
    int               x_val;       /* FORWARD: the main input's value (in-place candidate) */
    opf_gref         *refs;
    int               n_refs;
    /* eager nodes */
    opf_quantizer     qv[2];
    bool              has_q[2];
    bool              requires_grad;
    int               first_requires_grad; /* the env's (fused ops) */
    bool              restore_octx; /* eager backward after a traced forward */
    int               n_extra;      /* extra inputs (forward) / outputs (backward) in t */
    unsigned          in_mask;      /* eager: which inputs t[n_out + i] are present */
    /* scale components of quantized outputs, zeroed before the node runs (a
     * fresh buffer has zero scale padding; arena blocks are shared) */
    struct opf_gzero { void *p; size_t n; } *zero;
    int               n_zero;
    double            seconds;      /* profile */
} opf_gnode;

/* One affine patch of the dynamic leading dimension: *loc = base + slope * (b - b0). */
typedef struct opf_gpatch {
    int64_t *loc;
    int64_t  base, slope;
} opf_gpatch;

/* A runtime kwarg (OPF_FIELD_RUNTIME): each forward copies op `op`'s kwargs
 * field at `off` into the baked args at loc. */
typedef struct opf_grt {
    void          *loc;
    opf_field_kind kind, src_kind;
    int            op;
    size_t         off;
} opf_grt;

/* A per-call pointer patch: *loc = input component + offset. */
typedef struct opf_gbind {
    void  **loc;
    int     val, comp;
    size_t  off;
} opf_gbind;

/* A run of nodes [first, end) of one direction: captured as one device
 * graph, or one eager node, which runs (and allocates) on every call. */
typedef struct opf_gseg {
    int         first, end;
    bool        eager;
    const char *refused;       /* the capture failed: walked from then on, and why */
    opf_param **params;        /* grads its backward nodes accumulate into: a replay */
    bool       *had;           /* sets their has_grad as the walk would; had: a snapshot */
    int         n_params;
} opf_gseg;

/* The captured graphs of one direction for what the host decides when the
 * nodes run and a replay cannot change: the leading size, the runtime
 * kwargs, which parameter grads start fresh. */
typedef struct opf_gvariant {
    uint64_t key;
    int      calls;             /* the first call walks (warm-up), the second captures */
    void   **exec;              /* [segments of the direction]: NULL until captured */
} opf_gvariant;

#define OPF_GRAPH_MAX_CAPTURES 16  /* variants per direction; more walk */

struct opf_graph {
    opf_seq        *seq;
    opf_ctx        *ctx;
    uint64_t        epoch;         /* seq->epoch at compile */
    uint64_t        key;           /* guard key (cache.c) */
    opf_compile_options opts;
    /* what it was compiled for */
    opf_spec        x_spec;        /* traced size */
    opf_seq_call    call;          /* recipe points at `recipe`; extra_in / kwargs NULL */
    opf_recipe      recipe;
    bool            has_recipe;
    int             first_req;
    bool            forward_only;
    int             n_pub_in, n_pub_out;
    opf_spec       *extra_in_spec; /* [n_pub_in] */
    int             n_ops;         /* seq->n when traced: the size of the per-op arrays below
                                      (the seq may have changed since: a stale graph) */
    void          **kwargs;        /* [n_ops] traced kwargs copies (tensor fields tagged) */
    bool           *kw_given;      /* [n_ops] the call gave op i kwargs (value guard, cache.c) */
    /* the IR */
    opf_gval       *vals;
    int             n_vals, cap_vals;
    opf_gnode      *nodes;
    int             n_nodes, cap_nodes, n_fwd;  /* nodes [0, n_fwd) are the forward graph */
    opf_gstore     *stores;
    int             n_stores;
    int             y_val, dx_val;
    int            *extra_out_val, *dextra_in_val;  /* public */
    int             x_val, dy_val;
    int            *extra_in_val, *dextra_out_val;  /* inputs */
    opf_op_ctx     *octx;          /* [n_ops]: eager nodes' contexts */
    opf_op_ctx     *octx_traced;   /* [n_ops]: what the traced forward saved (baked) */
    bool           *fwd_eager;     /* [n_ops] */
    opf_op        **fused;         /* fused ops of the traced plans, owned */
    int             n_fused;
    /* memory */
    unsigned char  *arena;
    size_t          arena_bytes;
    void           *zeros;         /* zero block for missing dextra_out */
    size_t          zeros_bytes;
    /* parameter gradients to be added (exec.c place_grads): pgrad_bytes the
     * most one backward node needs (plan.c); allocated by the first call
     * that adds one (a variant's warm-up walk, before any capture) */
    void           *pgrad_buf;
    size_t          pgrad_bytes;
    opf_gbind      *binds;
    int             n_binds;
    opf_grt        *rt;            /* runtime kwargs */
    int             n_rt;
    opf_gpatch     *patches;       /* dynamic leading dimension */
    int             n_patches;
    int64_t         lead, lead0;   /* current and traced leading size */
    int             n_inplace;
    size_t          unplanned_bytes, saved_bytes;
    /* per-call state */
    bool            pending;
    bool            profile;
    opf_tensor     *held;          /* [n_vals]: references to bound inputs until backward */
    opf_tensor     *dzero;         /* [n_pub_out]: zero gradients for missing dextra_out */
    /* device graphs (replay.c): x on the context's device puts the arena
     * there, stages the inputs in it, and replays captured segments */
    bool            on_device;
    bool            capture;       /* on_device, a runtime that captures, not opted out */
    opf_gseg       *segs;          /* forward [0, n_fwd_segs), then backward */
    int             n_segs, n_fwd_segs;
    opf_gvariant    variants[2][OPF_GRAPH_MAX_CAPTURES];  /* [backward] */
    int             n_variants[2];
    int             launches[2];   /* graph launches of the last forward / backward */
    int             walked[2];     /* nodes walked (not replayed) by them */
};

/* trace.c */
opf_status opf_graph_trace(opf_graph *g, const opf_spec *x, const opf_seq_call *call);
void opf_graph_free_ir(opf_graph *g);
/* plan.c */
opf_status opf_graph_plan(opf_graph *g);
opf_status opf_graph_bake(opf_graph *g);
opf_status opf_graph_diff(opf_graph *g, opf_graph *g2, int64_t lead2);
opf_status opf_graph_set_lead(opf_graph *g, int64_t lead);
/* Memory of the arena's kind (opf_graph_device); bytes 0 gives NULL. */
opf_status opf_graph_mem_alloc(opf_graph *g, size_t bytes, void **out);
void opf_graph_mem_free(opf_graph *g, void *p, size_t bytes);
/* Where value v's component c starts (an arena value or a staged input). */
void *opf_graph_addr(const opf_graph *g, int v, int c);
/* A value as a tensor of the current call (arena or bound input). */
void opf_graph_value_tensor(const opf_graph *g, int v, opf_tensor *out);
/* replay.c */
opf_status opf_graph_segments(opf_graph *g);
void opf_graph_free_segments(opf_graph *g);
/* Copies the bound inputs of one direction into their arena blocks. */
opf_status opf_graph_stage_inputs(opf_graph *g, bool backward);
/* Runs one direction: a walk over its nodes, or its captured segments. */
opf_status opf_graph_run(opf_graph *g, bool backward, const opf_seq_call *call);
/* exec.c: nodes [first, end) in order (replay.c walks segments with it). */
opf_status opf_graph_walk(opf_graph *g, int first, int end, const opf_seq_call *call);
/* The memory the arena's values live in (the host or x's device). */
opf_device opf_graph_device(const opf_graph *g);

/* cache.c */
uint64_t opf_graph_key(const opf_seq *seq, const opf_spec *x, const opf_seq_call *call,
                       const opf_compile_options *opts);
/* Whether a call is one g was compiled for, by value: what the key hashes,
 * compared field by field with what the graph keeps (a key only narrows
 * the search; two calls may share one). */
bool opf_graph_matches(const opf_graph *g, const opf_spec *x, const opf_seq_call *call,
                       const opf_compile_options *opts);
/* The kwargs part of it (what an explicit graph checks per call). */
bool opf_graph_kwargs_match(const opf_graph *g, const opf_seq_call *call);
/* Tests only: fn replaces every key by fn(key) (NULL: off), to force
 * collisions. Not thread-safe. */
void opf_graph_key_test_hook(uint64_t (*fn)(uint64_t key));

#endif
