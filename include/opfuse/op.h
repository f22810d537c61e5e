/* opfuse/op.h: the op contract: op classes (versioned vtables) in a registry,
 * argument structs described by field schemas, the traced half (resolve,
 * setup_context) and the pure half (impl, fake) of forward and backward,
 * parameters, per-call contexts with saved tensors, and quantizers per role.
 *
 * An op kind is a static const opf_op_class registered once by name. An op
 * instance (opf_op *) holds its class, name, config, parameters and recipe
 * state. The fuser drives an op through its class:
 *
 *     resolve_fwd(op, env, args)              read params, quantizers, kwargs
 *     forward_fake(args, out_specs, aux_specs) shapes, dtypes, formats
 *     (caller allocates out and aux from the specs)
 *     forward_impl(ctx, args, outs, aux)      the math; never allocates
 *     setup_context(op, octx, args, outs, aux) keep what backward needs
 *   and in backward
 *     resolve_bwd(op, octx, env, bargs)
 *     backward_fake(bargs, grads_spec) / backward_impl(ctx, bargs, grads)
 *
 * Eager and compiled execution call the same *_impl, so there is one
 * implementation of the math.
 */
#ifndef OPFUSE_OP_H
#define OPFUSE_OP_H

#include <stddef.h>
#include <stdint.h>

#include "opfuse/export.h"
#include "opfuse/quant.h"

#ifdef __cplusplus
extern "C" {
#endif

#define OPF_OP_ABI_VERSION 3
#define OPF_OP_MAX_PARAMS  64   /* parameters of one basic op */
#define OPF_OP_MAX_EXTRA   4    /* extra inputs or outputs of one basic op */
#define OPF_OP_MAX_AUX     6    /* tensors a forward may produce for backward */
#define OPF_OP_MAX_SAVED   8    /* tensors a context keeps */
#define OPF_OP_MAX_QUANT   8    /* quantizers per direction */
#define OPF_OP_ARGS_MAX    2048 /* bytes of one args struct */
#define OPF_OP_MAX_GRADS   160  /* dx + parameter grads + extra-input grads of one (fused) op */

typedef struct opf_op opf_op;
typedef struct opf_op_class opf_op_class;

/* ---- schemas ------------------------------------------------------------- */

typedef enum opf_field_kind {
    OPF_FIELD_TENSOR    = 0,  /* opf_tensor, plain */
    OPF_FIELD_TENSOR_Q  = 1,  /* opf_tensor, plain or quantized */
    OPF_FIELD_QUANTIZER = 2,  /* opf_quantizer: value-opaque, compared and hashed by value */
    OPF_FIELD_INT       = 3,  /* int64_t */
    OPF_FIELD_FLOAT     = 4,  /* double */
    OPF_FIELD_BOOL      = 5,  /* bool */
    OPF_FIELD_ENUM      = 6,  /* int */
    OPF_FIELD_BUNDLE    = 7,  /* a nested struct described by its own schema */
    OPF_FIELD_REF       = 8,  /* a pointer compared by identity, never baked into a graph */
    OPF_FIELD_F32       = 9,  /* float, compared and hashed by its bits */
    OPF_FIELD_I32       = 10, /* int */
    OPF_FIELD_KIND_COUNT
} opf_field_kind;

enum {
    OPF_FIELD_KWARG    = 1u << 0,  /* set by the caller per call (opf_seq kwargs) */
    OPF_FIELD_OPTIONAL = 1u << 1,  /* a tensor that may be absent (data[0] == NULL) */
    /* An int/enum/bool kwarg the impl reads on every call (with OPF_FIELD_KWARG
     * in the kwargs schema and in the args schemas that carry it, under the
     * same name). A compiled graph writes the call's value into its baked
     * args instead of baking it, so new values do not recompile; the guard
     * (and opf_schema_hash) sees only whether it is negative ("unset"),
     * because unset and set trace differently. */
    OPF_FIELD_RUNTIME  = 1u << 2,
};

typedef struct opf_schema opf_schema;

typedef struct opf_field {
    const char        *name;
    size_t             offset;  /* offsetof in the args struct */
    opf_field_kind     kind;
    unsigned           flags;   /* OPF_FIELD_* */
    /* OPF_FIELD_BUNDLE: the nested struct's schema. OPF_FIELD_ENUM
     * (optional): the enum's values, a schema whose fields name the values
     * 0..n_fields-1 in order (OPF_ENUM_VALUES): validate refuses other
     * values and print writes the names. */
    const opf_schema  *bundle;
} opf_field;

struct opf_schema {
    const char      *name;      /* "layernorm.fwd" */
    size_t           size;      /* sizeof the args struct (<= OPF_OP_ARGS_MAX) */
    int              n_fields;
    const opf_field *fields;
};

/* Schema shorthands for a class's args struct st:
 *     static const opf_field f[] = {OPF_F_TENSOR(my_fwd, x), OPF_F_FLOAT(my_fwd, eps)};
 *     OPF_SCHEMA(my_fwd_schema, my_fwd, f);                                      */
#define OPF_F(st, m, kind, flags) {#m, offsetof(st, m), kind, flags, NULL}
#define OPF_F_TENSOR(st, m)   OPF_F(st, m, OPF_FIELD_TENSOR, 0)
#define OPF_F_TENSOR_Q(st, m) OPF_F(st, m, OPF_FIELD_TENSOR_Q, 0)
#define OPF_F_OPT(st, m)      OPF_F(st, m, OPF_FIELD_TENSOR_Q, OPF_FIELD_OPTIONAL)
#define OPF_F_QUANT(st, m)    OPF_F(st, m, OPF_FIELD_QUANTIZER, 0)
#define OPF_F_INT(st, m)      OPF_F(st, m, OPF_FIELD_INT, 0)
#define OPF_F_FLOAT(st, m)    OPF_F(st, m, OPF_FIELD_FLOAT, 0)
#define OPF_F_BOOL(st, m)     OPF_F(st, m, OPF_FIELD_BOOL, 0)
#define OPF_F_ENUM(st, m)     OPF_F(st, m, OPF_FIELD_ENUM, 0)
#define OPF_F_F32(st, m)      OPF_F(st, m, OPF_FIELD_F32, 0)
#define OPF_F_I32(st, m)      OPF_F(st, m, OPF_FIELD_I32, 0)
#define OPF_F_REF(st, m)      OPF_F(st, m, OPF_FIELD_REF, 0)
/* An enum field with its values (validated, printed by name):
 *     static const opf_field algo_values[] = {{.name = "max"}, {.name = "most_recent"}};
 *     OPF_ENUM_VALUES(algo_enum, opf_amax_algo, algo_values);
 *     ... OPF_F_ENUM_OF(opf_recipe, amax_algo, algo_enum) ...                  */
#define OPF_F_ENUM_OF(st, m, values) {#m, offsetof(st, m), OPF_FIELD_ENUM, 0, &values}
#define OPF_ENUM_VALUES(var, type, names) OPF_SCHEMA(var, type, names)
#define OPF_SCHEMA(var, st, fields) \
    static const opf_schema var = {#st, sizeof(st), (int)(sizeof(fields) / sizeof(fields[0])), fields}

/* A tensor slot of flattened args: where it lives and what kind it is. */
typedef struct opf_slot {
    const opf_field *field;
    opf_tensor      *tensor;    /* into the args struct */
} opf_slot;

/* Flattens every tensor field (bundles recursively) into slots, in schema
 * order. Returns the count; writes at most max slots. */
OPF_API int opf_schema_slots(const opf_schema *s, void *args, opf_slot *slots, int max);
/* Hash of the value fields (ints, floats, bools, enums, quantizers, refs by
 * identity; tensors contribute only their specs; OPF_FIELD_RUNTIME fields
 * only their sign). Equal args give equal hashes. */
OPF_API uint64_t opf_schema_hash(const opf_schema *s, const void *args);
/* Checks fields: required tensors present, enums in range. */
OPF_API opf_status opf_schema_validate(const opf_schema *s, const void *args);
/* Value equality in the hash's terms: equal args have equal hashes. */
OPF_API bool opf_schema_equal(const opf_schema *s, const void *a, const void *b);
/* "layernorm.fwd{x: bf16[8,64], eps: 1e-05, ...}" into buf. */
OPF_API void opf_schema_print(const opf_schema *s, const void *args, char *buf, size_t size);
/* Looks up a field by name; NULL if absent. */
OPF_API const opf_field *opf_schema_field(const opf_schema *s, const char *name);

/* ---- parameters and contexts ----------------------------------------------- */

typedef struct opf_param {
    char        name[32];
    opf_tensor  value;          /* owned reference (fp32/bf16/fp16) */
    opf_tensor  grad;           /* same spec as value; zero-filled until backward */
    opf_tensor  main_grad;      /* optional fp32 accumulator (data NULL when unused) */
    bool        requires_grad;
    bool        has_grad;       /* grad holds a gradient from some backward */
    opf_tensor  qvalue;         /* optional quantized copy (quantized weights) */
    bool        qvalue_valid;   /* qvalue matches value (cleared by optimizer steps) */
    /* Quantized primary (opf_op_set_param_quantized) when its scaling is not
     * NONE: qvalue, made by this quantizer, is the parameter; value keeps its
     * logical spec but no data, and an optimizer re-quantizes its fp32 master
     * into qvalue after each step. */
    opf_quantizer primary_q;
} opf_param;

/* What one forward call leaves for its backward, per basic op. */
typedef struct opf_op_ctx {
    bool       requires_grad;  /* set when saved; a fused op clears it for covered ops that
                                * run no backward (opf_fwd_env.first_requires_grad) */
    int        n_saved;
    opf_tensor saved[OPF_OP_MAX_SAVED];  /* counted references */
    opf_quantizer prev_grad_q;           /* the previous op's grad-output quantizer */
    int64_t    attrs[8];                 /* op-specific small values (shapes, flags) */
    bool       valid;                    /* a forward ran and backward has not consumed it */
} opf_op_ctx;

/* Drops the saved tensors and marks the context consumed. */
OPF_API void opf_op_ctx_clear(opf_op_ctx *c);

/* ---- the environment handed to resolve_fwd / resolve_bwd ------------------- */

typedef struct opf_fwd_env {
    opf_ctx             *ctx;
    const opf_tensor    *x;                          /* main input */
    const opf_tensor    *extra_in[OPF_OP_MAX_EXTRA]; /* this op's extra inputs */
    const opf_quantizer *prev_grad_q;   /* previous basic op's grad-output quantizer or NULL */
    const opf_quantizer *next_input_q;  /* next basic op's input quantizer or NULL */
    const opf_recipe    *recipe;        /* NULL when not quantizing */
    bool                 requires_grad;
    const void          *kwargs;        /* class kwargs struct or NULL */
    /* Fused ops, with requires_grad: the first covered basic op whose
     * backward runs. The fuser runs no backward for ops before the seq's
     * first op requiring backward (the anchor's rule); a fused op that covers
     * that point skips its covered ops before it the same way. 0 for basic
     * ops and whenever every covered op runs backward. */
    int                  first_requires_grad;
} opf_fwd_env;

typedef struct opf_bwd_env {
    opf_ctx             *ctx;
    const opf_tensor    *dy;                          /* gradient of the main output */
    const opf_tensor    *dextra_out[OPF_OP_MAX_EXTRA];/* gradients of extra outputs (may be NULL) */
    const opf_quantizer *prev_grad_q;   /* quantizer for dx, or NULL */
} opf_bwd_env;

/* Specs and tensors produced by one op call. outs[0] is the main output,
 * outs[1..] the extra outputs. In backward, grads[0] is dx, then one per
 * parameter, then one per extra input. A spec with ndim < 0 means "none";
 * OPF_GRAD_PASSTHROUGH in dx's spec means "dx = dy unchanged". */
#define OPF_SPEC_NONE_NDIM   (-1)
#define OPF_GRAD_PASSTHROUGH (-2)

/* ---- the class --------------------------------------------------------------- */

struct opf_op_class {
    int               abi_version;      /* OPF_OP_ABI_VERSION */
    const char       *name;             /* lower-case registry key: "layernorm" */
    const char       *module_type;      /* quantizer role module type: "linear", ... */
    size_t            config_size;      /* bytes of the config the constructor copies */
    const opf_schema *fwd_schema;       /* forward args */
    const opf_schema *bwd_schema;       /* backward args */
    const opf_schema *kwargs_schema;    /* per-call kwargs, or NULL */
    int               n_extra_in, n_extra_out;
    int               n_gemms;          /* recipe-state size: quantizers per role */
    bool              fusible;          /* false: a user callback step, a group by itself */

    /* Creates parameters from the config (op->config is already a copy). */
    opf_status (*init)(opf_ctx *ctx, opf_op *op);
    /* Frees what init made beyond params (may be NULL). */
    void (*fini)(opf_op *op);
    /* The quantizer the previous op should use for this op's input, and the
     * one the next op should use for the gradient it hands back: NULL or a
     * pointer into the op's recipe state (valid until the recipe changes). */
    const opf_quantizer *(*input_quantizer)(const opf_op *op);
    const opf_quantizer *(*grad_output_quantizer)(const opf_op *op);

    /* traced half: may read the op's state */
    opf_status (*resolve_fwd)(opf_op *op, const opf_fwd_env *env, void *args);
    opf_status (*setup_context)(opf_op *op, opf_op_ctx *octx, const void *args,
                                const opf_tensor *outs, const opf_tensor *aux);
    opf_status (*resolve_bwd)(opf_op *op, const opf_op_ctx *octx, const opf_bwd_env *env,
                              void *bargs);
    /* Optional, traced half: runs once after forward_fake accepted args
     * (outs / aux: its specs), before any impl; the place for a step that
     * changes the op's state only once every check passed (BasicLinear
     * allocates its quantized-weight cache here). May update args. */
    opf_status (*after_fake)(opf_op *op, const opf_fwd_env *env, void *args, const opf_spec *outs,
                             const opf_spec *aux);
    /* pure half: reads only its args, writes only its outputs */
    opf_status (*forward_fake)(const void *args, opf_spec *outs, opf_spec *aux);
    opf_status (*forward_impl)(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux);
    opf_status (*backward_fake)(const void *bargs, opf_spec *grads);
    opf_status (*backward_impl)(opf_ctx *ctx, const void *bargs, opf_tensor *grads);

    /* NULL, or why this op must run eagerly inside a compiled graph. */
    const char *(*unsupported_reason)(const opf_op *op);

    /* The config copied when opf_op_create gets NULL (config_size bytes);
     * NULL: a config is required. */
    const void *config_default;

    /* Fused ops (see "fused ops" below): covers > 0 is the number of basic
     * ops one instance covers. A forward-only fused op has no backward_impl,
     * a backward-only one no forward_impl; a joint one has both. */
    int covers;
    /* Called once on each basic op before its first plan is built. */
    void (*pre_first_forward)(opf_op *op);
    /* forward_impl stays correct when outs[0] shares its memory with the
     * main input x (same layout, byte for byte): a compiled graph may then
     * run the op in place. */
    bool inplace;
    /* The op only hands its input on: every present forward output (outs,
     * no aux) is bitwise x (forward_is_input), every present gradient
     * bitwise dy (backward_is_dy). The eager runner and the compiler then
     * pass the input's tensor on and skip the impl: no copy, no kernel.
     * The fakes and impls still describe and write copies, for runners
     * whose outputs must be distinct memory (a torch op's may not alias its
     * inputs). */
    bool forward_is_input, backward_is_dy;
};

/* ---- fused ops ------------------------------------------------------------------
 * A fused op is an op instance over a contiguous run of basic ops. It holds
 * no parameters of its own: opf_op_num_params / opf_op_param enumerate the
 * covered basic ops' parameters in order, and its extra inputs and outputs
 * are those of the covered ops in order. The fuser calls it like a basic op,
 * except that octx points at the covered ops' contexts (one per basic op, in
 * order), env->kwargs at an array of the covered ops' kwargs, and
 * setup_context must leave in each basic op's context what that op's own
 * backward expects (forward-only fusions), while resolve_bwd reads what
 * their forwards saved (backward-only fusions). */

/* Creates a fused op of a registered class with cls->covers == n over
 * basic[0..n) (not owned). Destroy with opf_op_destroy (the basic ops stay). */
OPF_API opf_status opf_fused_op_create(opf_ctx *ctx, const char *class_name, opf_op *const *basic,
                                       int n, opf_op **out);
/* A fusion function (registered with the fuser, fuser.h): reads
 * ops_in[0..n) and writes to ops_out (capacity n) a list where some
 * contiguous runs are replaced by fused ops it created with
 * opf_fused_op_create; everything else is copied unchanged. */
typedef opf_status (*opf_fusion_fn)(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                    const opf_recipe *recipe, void *user, opf_op **ops_out,
                                    int *n_out);

/* Helpers that make the common fusion shapes one call. match returns how
 * many ops starting at ops[0] (n_avail of them) form a fusion (0: none);
 * build creates the fused op over them. opf_fusion_scan walks the list
 * left to right and replaces every match (a greedy anchor scan); a fixed
 * k-wide sliding window is a match that returns k or 0. Fused ops in the
 * input are never matched again. */
typedef int (*opf_fusion_match_fn)(opf_op *const *ops, int n_avail, const opf_recipe *recipe,
                                   void *user);
typedef opf_status (*opf_fusion_build_fn)(opf_ctx *ctx, opf_op *const *ops, int n,
                                          const opf_recipe *recipe, void *user, opf_op **fused);
OPF_API opf_status opf_fusion_scan(opf_ctx *ctx, opf_op *const *ops_in, int n,
                                   const opf_recipe *recipe, opf_fusion_match_fn match,
                                   opf_fusion_build_fn build, void *user, opf_op **ops_out,
                                   int *n_out);
/* The common builder: user is the fused class name (a const char *). */
OPF_API opf_status opf_fusion_build_class(opf_ctx *ctx, opf_op *const *ops, int n,
                                          const opf_recipe *recipe, void *user, opf_op **fused);

/* Number of basic ops an op covers (1 for a basic op) and the i-th of them. */
OPF_API int opf_op_num_basic(const opf_op *op);
OPF_API opf_op *opf_op_basic(const opf_op *op, int i);
OPF_API bool opf_op_is_fused(const opf_op *op);
/* Extra inputs and outputs of an op (summed over covered ops when fused). */
OPF_API int opf_op_num_extra_in(const opf_op *op);
OPF_API int opf_op_num_extra_out(const opf_op *op);

/* Registers a class; OPF_ERR_INVALID_ARG for a duplicate or non-lower-case
 * name, a wrong abi_version or a missing required entry. Thread-safe. The
 * class must outlive the process's use of it (a static const). */
OPF_API opf_status opf_op_class_register(const opf_op_class *cls);
/* The class registered under name, or NULL. Built-in ops are registered on
 * first use of the registry. */
OPF_API const opf_op_class *opf_op_class_find(const char *name);
/* Number of registered classes and the i-th (registration order). */
OPF_API int opf_op_class_count(void);
OPF_API const opf_op_class *opf_op_class_at(int i);

/* ---- instances ------------------------------------------------------------------ */

/* Creates an op of a registered class: copies config (cls->config_size
 * bytes), names it, and calls init. Destroy with opf_op_destroy. */
OPF_API opf_status opf_op_create(opf_ctx *ctx, const char *class_name, const void *config,
                                 const char *name, opf_op **out);
OPF_API void opf_op_destroy(opf_op *op);  /* NULL: no-op */

OPF_API const opf_op_class *opf_op_class_of(const opf_op *op);
OPF_API const char *opf_op_name(const opf_op *op);
OPF_API void *opf_op_config(opf_op *op);
OPF_API const void *opf_op_config_const(const opf_op *op);
OPF_API int opf_op_num_params(const opf_op *op);  /* fused: all covered ops' parameters */
OPF_API opf_param *opf_op_param(opf_op *op, int i);
OPF_API const opf_param *opf_op_param_const(const opf_op *op, int i);
/* Makes parameter i quantized primary (the anchor's quantized model init):
 * its value quantized with q (current scaling, block scaling, MXFP8 or NVFP4;
 * not delayed) becomes the parameter and the high-precision value is freed.
 * q must make what the op's recipe makes for the weight (basic_linear checks
 * it on each forward). Irreversible. */
OPF_API opf_status opf_op_set_param_quantized(opf_ctx *ctx, opf_op *op, int i,
                                              const opf_quantizer *q);

/* For init: adds a parameter of the given spec (allocated, zero-filled).
 * Returns its index or a negative status. The parameters may move: a
 * pointer from opf_op_param holds until the op's next opf_op_add_param. */
OPF_API int opf_op_add_param(opf_ctx *ctx, opf_op *op, const char *name, const opf_spec *spec);

/* Recipe state of the op (NULL until a recipe is set). */
OPF_API opf_recipe_state *opf_op_recipe_state(const opf_op *op);
/* Rebuilds the recipe state for recipe r (NULL: none). Called by the fuser
 * when the recipe kind changes; a no-op for ops with n_gemms == 0. */
OPF_API opf_status opf_op_reset_recipe(opf_ctx *ctx, opf_op *op, const opf_recipe *r);
/* Per-op recipe override, for the layers a model keeps in high precision
 * under a quantized recipe (a language model's output projection, as the
 * anchor's users leave it outside quantized autocast). From then on the op
 * runs under *r (copied) instead of the recipe of the call that runs it,
 * eagerly, compiled and from checkpoints alike; r NULL: unquantized (its
 * dtype's GEMM; no recipe state). opf_op_clear_recipe returns to the
 * call's recipe. Built-in fusions leave an op with an override out; a
 * user fusion function should too (opf_op_has_recipe).
 * OPF_ERR_INVALID_ARG for a fused op or a recipe opf_recipe_validate
 * refuses; OPF_ERR_STATE once the op's seq has been built (its first
 * forward, prepare or compile): set it before, or remove and re-append. */
OPF_API opf_status opf_op_set_recipe(opf_op *op, const opf_recipe *r);
OPF_API opf_status opf_op_clear_recipe(opf_op *op);
/* Whether the op has an override; *r (may be NULL) receives it (NULL:
 * unquantized). */
OPF_API bool opf_op_has_recipe(const opf_op *op, const opf_recipe **r);
/* The quantizer for (role, gemm) of the op's recipe state, or NULL. The
 * pointer is into the op and valid until the next call for the same role. */
OPF_API const opf_quantizer *opf_op_quantizer(const opf_op *op, opf_tensor_role role, int gemm);

/* Private per-op storage for classes (e.g. a user op's state). */
OPF_API void *opf_op_user(opf_op *op);
OPF_API void opf_op_set_user(opf_op *op, void *user);

/* ---- channels (extra inputs and outputs) ------------------------------------------- */

/* Binds extra input `index` to a named channel produced earlier in the same
 * fuser group (NULL: a public input the caller passes). */
OPF_API opf_status opf_op_set_extra_input(opf_op *op, int index, const char *channel);
/* Binds extra output `index` to a named channel; to_caller also returns it. */
OPF_API opf_status opf_op_set_extra_output(opf_op *op, int index, const char *channel,
                                           bool to_caller);

/* ---- eager execution of one op ------------------------------------------------------
 * What the fuser does for each op of a plan, usable on its own (tests, user
 * code). Forward: resolve, fake, allocate outs (1 + n_extra_out, returned as
 * counted references the caller releases) and aux, impl, and when
 * env->requires_grad keep what backward needs in *octx. Backward: resolve,
 * fake, allocate, impl; parameter gradients are accumulated into each
 * parameter's grad (has_grad set); *dx receives the input gradient (a
 * reference to dy itself for a pass-through) and dextra_in[i] the extra
 * inputs' gradients (zeroed tensors when none). The context is consumed.
 * A class that hands its input on (forward_is_input, backward_is_dy) gets
 * no impl call when x's (dy's) buffer is counted: its outputs are then
 * references to x (dy), sharing its memory with it and with each other;
 * over caller memory (opf_tensor_wrap) they are the impl's copies. */
OPF_API opf_status opf_op_forward(opf_op *op, const opf_fwd_env *env, opf_op_ctx *octx,
                                  opf_tensor *outs);
OPF_API opf_status opf_op_backward(opf_op *op, opf_op_ctx *octx, const opf_bwd_env *env,
                                   opf_tensor *dx, opf_tensor *dextra_in);

/* Zeroes every parameter gradient of the op and clears has_grad. */
OPF_API void opf_op_zero_grad(opf_op *op);

#ifdef __cplusplus
}
#endif
#endif
