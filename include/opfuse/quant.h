/* opfuse/quant.h: recipes, recipe state, quantizers, quantize / dequantize /
 * requantize, and copy usage.
 *
 * A recipe says how a module's tensors are quantized (FP8 delayed, current or
 * block scaling, MXFP8, NVFP4, or a user factory). A quantizer is the plain
 * value that quantizes one tensor: scaling mode, element dtype, which copies,
 * options, and for delayed scaling the state slot it reads its scale from and
 * accumulates its amax into. All math follows docs/numerics.md section 3
 * bit for bit.
 *
 *     opf_recipe r = opf_recipe_default(OPF_RECIPE_MXFP8);
 *     opf_recipe_state *rs;
 *     opf_recipe_state_create(ctx, &r, "linear", "fc1", 1, &rs);
 *     opf_quantizer q;
 *     opf_recipe_state_quantizer(rs, OPF_ROLE_INPUT, 0, &q);
 *     opf_spec qs;
 *     opf_quantizer_spec(&q, &x.spec, &qs);
 *     opf_tensor xq;
 *     opf_tensor_alloc(ctx, &qs, &xq);
 *     opf_quantize(ctx, &q, &x, &xq);
 *     ...
 *     opf_tensor_release(&xq);
 *     opf_recipe_state_destroy(rs);
 */
#ifndef OPFUSE_QUANT_H
#define OPFUSE_QUANT_H

#include <stdbool.h>
#include <stdint.h>

#include "opfuse/export.h"
#include "opfuse/context.h"
#include "opfuse/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum opf_recipe_kind {
    OPF_RECIPE_NONE    = 0,
    OPF_RECIPE_DELAYED = 1,  /* FP8 per-tensor, scales from an amax history (3.1) */
    OPF_RECIPE_CURRENT = 2,  /* FP8 per-tensor, scale from this tensor's amax (3.2) */
    OPF_RECIPE_BLOCK   = 3,  /* FP8 1x128 / 128x128 blocks (3.5) */
    OPF_RECIPE_MXFP8   = 4,  /* 1x32 / 32x1 blocks, E8M0 scales (3.3) */
    OPF_RECIPE_NVFP4   = 5,  /* E2M1, 1x16 / 16x16 blocks, E4M3 scales (3.4) */
    OPF_RECIPE_CUSTOM  = 6,  /* a user factory per quantizer role (3.6) */
    OPF_RECIPE_COUNT
} opf_recipe_kind;

typedef enum opf_format {
    OPF_FORMAT_E4M3   = 0,
    OPF_FORMAT_E5M2   = 1,
    OPF_FORMAT_HYBRID = 2,  /* forward tensors E4M3, backward tensors E5M2 */
    OPF_FORMAT_E2M1   = 3,
    OPF_FORMAT_COUNT
} opf_format;

typedef enum opf_amax_algo {
    OPF_AMAX_MAX         = 0,  /* max over the history window */
    OPF_AMAX_MOST_RECENT = 1,
    OPF_AMAX_ALGO_COUNT
} opf_amax_algo;

/* Tensor roles of a GEMM module. Forward slots are [input, weight, output]
 * per GEMM, backward slots [grad_output, grad_input]. */
typedef enum opf_tensor_role {
    OPF_ROLE_INPUT       = 0,
    OPF_ROLE_WEIGHT      = 1,
    OPF_ROLE_OUTPUT      = 2,
    OPF_ROLE_GRAD_OUTPUT = 3,
    OPF_ROLE_GRAD_INPUT  = 4,
    OPF_ROLE_COUNT
} opf_tensor_role;

/* Names for messages ("fp8-delayed", "input", "e4m3", "max"); "invalid"
 * for a value outside the enum. */
OPF_API const char *opf_recipe_name(opf_recipe_kind k);
OPF_API const char *opf_role_name(opf_tensor_role r);
OPF_API const char *opf_format_name(opf_format f);
OPF_API const char *opf_amax_algo_name(opf_amax_algo a);

typedef struct opf_quantizer_role {
    const char     *module_type;  /* "linear", "grouped_linear", "layernorm", ... */
    opf_tensor_role tensor;
    const char     *name;         /* the module's name, may be NULL */
} opf_quantizer_role;

/* Optional MAX all-reduce of amaxes across processes, in place on n floats. */
typedef opf_status (*opf_amax_reduce_fn)(void *user, float *amax, int n);

typedef struct opf_delayed_state opf_delayed_state;

/* How to quantize one tensor. A plain value: copy it, compare it with
 * opf_quantizer_equal. Start from opf_quantizer_default(). */
typedef struct opf_quantizer {
    opf_scaling scaling;        /* OPF_SCALING_NONE: do not quantize */
    opf_dtype   qdtype;         /* e4m3 / e5m2 (FP8 modes), e2m1 (NVFP4) */
    unsigned    usage;          /* OPF_USAGE_* copies to produce */
    bool        swizzled;       /* MXFP8/NVFP4: write GEMM-swizzled scales */
    /* current and block scaling (2.1) */
    bool        pow2_scales;
    float       amax_epsilon;
    /* MXFP8: one 32x32 block amax drives both copies (weights) */
    bool        mxfp8_2d;
    /* NVFP4 */
    bool        rht;            /* random Hadamard transform on the columnwise copy */
    uint16_t    rht_sign_mask;  /* 0xD7E8 */
    bool        stochastic;     /* stochastic rounding with the context's Philox */
    /* per-tensor FP8: delayed scaling when `delayed` is set (scale read from
     * and amax accumulated into slot `slot`), current scaling otherwise. The
     * state is referenced, not owned. */
    opf_delayed_state *delayed;
    int                slot;
    /* current scaling / NVFP4: optional amax reduction (sequence parallel) */
    opf_amax_reduce_fn amax_reduce;
    void              *amax_reduce_user;
} opf_quantizer;

OPF_API opf_quantizer opf_quantizer_default(void);
OPF_API bool opf_quantizer_equal(const opf_quantizer *a, const opf_quantizer *b);
/* Hash of the value fields (the delayed state by identity). */
OPF_API uint64_t opf_quantizer_hash(const opf_quantizer *q);

/* What a user factory returns for one role: a ready quantizer, or a request
 * for per-tensor delayed scaling with the given parameters, for which the
 * recipe state allocates and updates the amax history like the built-in
 * recipe. */
typedef struct opf_quantizer_request {
    bool          delayed;
    opf_quantizer quantizer;         /* when !delayed */
    opf_format    format;            /* when delayed: E4M3 or HYBRID */
    float         margin;
    int           amax_history_len;
    opf_amax_algo amax_algo;
} opf_quantizer_request;

typedef opf_status (*opf_quantizer_factory)(void *user, const opf_quantizer_role *role,
                                            opf_quantizer_request *out);

/* What the backward GEMMs of a linear read (numerics.md 3.7; not allowed
 * with delayed scaling). The forward stays quantized either way; the
 * backward quantizes nothing (no dy, dx or grad-output quantizer) and runs
 * dgrad and wgrad as plain GEMMs in the compute dtype on
 *   HIGH_PRECISION  the original input and weight, kept unquantized;
 *   DEQUANTIZED     the forward's quantized operands, decoded. */
typedef enum opf_backward_override {
    OPF_BACKWARD_NONE           = 0,
    OPF_BACKWARD_HIGH_PRECISION = 1,
    OPF_BACKWARD_DEQUANTIZED    = 2,
    OPF_BACKWARD_OVERRIDE_COUNT
} opf_backward_override;

typedef struct opf_recipe {
    opf_recipe_kind kind;
    opf_format      format;           /* E4M3 or HYBRID (FP8 kinds), E2M1 (NVFP4) */
    /* delayed scaling */
    float           margin;           /* 0; |margin| <= OPF_MAX_MARGIN (scaled max = fp8 max * 2^-margin) */
    int             amax_history_len; /* 1024 */
    opf_amax_algo   amax_algo;        /* max */
    bool            reduce_amax;      /* true */
    /* What the update does with a non-finite (infinite or NaN) amax of a
     * slot. false, the anchor's rule: it enters the history like any amax;
     * an infinity then holds the slot's scale where it was (2.2 keeps the
     * previous scale for an amax that is not finite) for as long as it stays
     * in the window, up to amax_history_len - 1 more steps under max. true:
     * it is kept out: the slot is handled as a step it did not see (an amax
     * of 0): no roll, the scale as it was, and its current row cleared, so
     * the history stays finite and the next finite amax updates the scale
     * at once (an infinity bounds nothing, so the scale it would freeze is
     * only older, not safer). Either way the update counts such amaxes and
     * the context warns once (opf_delayed_state_nonfinite_amaxes). It
     * filters only what the update rolls in: a history written with
     * opf_delayed_state_write or loaded from a checkpoint is taken as it is
     * (checkpoints do not record the field; one loads under either value).
     * For a custom recipe it applies to the delayed states its requests
     * make. Like any recipe field, changing it between calls of a seq
     * resets the recipe states. */
    bool            reject_nonfinite_amax; /* false */
    /* current and block scaling */
    bool            power_2_scales;   /* current: false; block: true */
    float           amax_epsilon;     /* 0 */
    /* block scaling: 1 (1x128) or 2 (128x128) per tensor class */
    int             x_block_dim;      /* 1 */
    int             w_block_dim;      /* 2 */
    int             grad_block_dim;   /* 1 */
    /* MXFP8 */
    bool            mxfp8_2d_weights; /* false */
    /* NVFP4 */
    bool            nvfp4_rht;        /* true: input / grad columnwise copies */
    bool            nvfp4_stochastic; /* true: gradients */
    bool            nvfp4_2d_weights; /* true: 16x16 weight tiles */
    /* custom */
    opf_quantizer_factory factory;
    void                 *factory_user;
    /* backward GEMMs (3.7): none, or not quantized (none for DELAYED) */
    opf_backward_override backward_override; /* none */
} opf_recipe;

/* Defaults of numerics.md section 3 for a kind. */
OPF_API opf_recipe opf_recipe_default(opf_recipe_kind kind);
/* OPF_ERR_INVALID_ARG with a message for inconsistent fields (history length
 * < 1, E5M2 for training, 2D x 2D block GEMMs, custom without factory, a
 * backward override with delayed scaling...). */
OPF_API opf_status opf_recipe_validate(const opf_recipe *r);

/* The built-in rule of a recipe for one role: what quantizer a tensor of that
 * role gets (usage bits rowwise+columnwise; the caller narrows them). For
 * DELAYED the quantizer's state is left NULL (opf_recipe_state fills it). */
OPF_API opf_status opf_recipe_quantizer(const opf_recipe *r, const opf_quantizer_role *role,
                                        opf_quantizer *out);

/* ---- delayed scaling state (3.1) ------------------------------------------ */

/* The largest delayed-scaling |margin|: past it fp8 max * 2^-margin leaves
 * the normal floats and the scale collapses toward 0 (or grows to inf). */
#define OPF_MAX_MARGIN 64

/* n_slots slots, each with scale (init 1) and an amax history of L rows
 * (init 0). `backward` picks the direction's format under HYBRID. The arrays
 * live in the memory of ctx's device (a CUDA context: device memory, where
 * the quantize kernels and the update use them with no host round trip); a
 * state quantizes tensors of that device only. |margin| <= OPF_MAX_MARGIN;
 * n_slots x (history_len + 2) floats must stay within OPF_MAX_BYTES (else
 * OPF_ERR_SHAPE). */
OPF_API opf_status opf_delayed_state_create(opf_ctx *ctx, opf_format format, float margin,
                                            int history_len, opf_amax_algo algo, bool backward,
                                            int n_slots, opf_delayed_state **out);
OPF_API void opf_delayed_state_destroy(opf_delayed_state *s);  /* NULL: no-op */
OPF_API int opf_delayed_state_slots(const opf_delayed_state *s);
OPF_API int opf_delayed_state_history_len(const opf_delayed_state *s);
OPF_API opf_dtype opf_delayed_state_dtype(const opf_delayed_state *s);
/* scale[n_slots]; history row-major [L][n_slots], row 0 = current step. The
 * pointers stay valid for the state's life, in the memory of the state's
 * device: on the CPU callers may read and write them; from the host, a
 * device state's arrays are reached through read/write below. */
OPF_API float *opf_delayed_state_scale(opf_delayed_state *s);
OPF_API float *opf_delayed_state_history(opf_delayed_state *s);
/* The device whose memory holds the arrays (the creating context's). */
OPF_API opf_device opf_delayed_state_device(const opf_delayed_state *s);
/* Explicit copies between host arrays (scale[n_slots], history[L][n_slots];
 * either may be NULL) and the state, whatever its device (counted
 * device-to-host / host-to-device copies on a device; read returns once the
 * values are on the host). ctx NULL: the state's context. Checkpoints and
 * tests use these. */
OPF_API opf_status opf_delayed_state_read(opf_ctx *ctx, opf_delayed_state *s, float *scale,
                                          float *history);
OPF_API opf_status opf_delayed_state_write(opf_ctx *ctx, opf_delayed_state *s,
                                           const float *scale, const float *history);
/* The update after a step (fused path of 3.1): optional reduce() on a copy of
 * row 0, then per slot: no roll on zero amax, roll, amax by algorithm, new
 * scale by 2.2. A non-finite amax is counted, and rolled in or kept out as
 * set below. ctx NULL: the state's context. */
OPF_API opf_status opf_delayed_state_update(opf_ctx *ctx, opf_delayed_state *s,
                                            opf_amax_reduce_fn reduce, void *reduce_user);
/* Keep non-finite amaxes out of the history from the next update on
 * (opf_recipe.reject_nonfinite_amax says what that means; false at
 * creation: the anchor's rule). A recipe state sets it from its recipe.
 * NULL: no-op. */
OPF_API void opf_delayed_state_set_reject_nonfinite(opf_delayed_state *s, bool reject);
/* How many non-finite amaxes the updates have met since creation or the
 * last reset (one per slot and update, rolled in or kept out). The count
 * lives with the arrays: on the CPU the update warns (once per context) as
 * soon as it meets one; on a device the update counts there and never waits
 * for the host, so this call is where the host learns of them: one counted
 * read (8 bytes device to host), warning once per context when nonzero.
 * Read it every so often (with the loss, say). NULL: 0. */
OPF_API int64_t opf_delayed_state_nonfinite_amaxes(opf_delayed_state *s);
/* Scales back to 1, history and the non-finite count to 0 (on a device:
 * one counted copy). */
OPF_API void opf_delayed_state_reset(opf_delayed_state *s);

/* ---- recipe state: the quantizers of one module ---------------------------- */

typedef struct opf_recipe_state opf_recipe_state;

/* Builds the quantizers of a module with num_gemms GEMMs under recipe r
 * (copied). For DELAYED (and custom delayed requests) it allocates a forward
 * state of 3*num_gemms slots and a backward state of 2*num_gemms slots. */
OPF_API opf_status opf_recipe_state_create(opf_ctx *ctx, const opf_recipe *r,
                                           const char *module_type, const char *name, int num_gemms,
                                           opf_recipe_state **out);
OPF_API void opf_recipe_state_destroy(opf_recipe_state *rs);  /* NULL: no-op */
OPF_API const opf_recipe *opf_recipe_state_recipe(const opf_recipe_state *rs);
/* The quantizer for (role, gemm); OPF_ERR_INVALID_ARG when out of range. */
OPF_API opf_status opf_recipe_state_quantizer(const opf_recipe_state *rs, opf_tensor_role role,
                                              int gemm, opf_quantizer *out);
/* Delayed states (NULL for other recipes). */
OPF_API opf_delayed_state *opf_recipe_state_delayed(opf_recipe_state *rs, bool backward);
/* Runs the delayed update of one direction (no-op for stateless recipes).
 * ctx NULL: the state's context. */
OPF_API opf_status opf_recipe_state_update(opf_ctx *ctx, opf_recipe_state *rs, bool backward,
                                           opf_amax_reduce_fn reduce, void *reduce_user);
/* opf_delayed_state_nonfinite_amaxes summed over both directions (on a
 * device: a counted read per delayed state); 0 for stateless recipes and
 * NULL. */
OPF_API int64_t opf_recipe_state_nonfinite_amaxes(opf_recipe_state *rs);

/* ---- quantize / dequantize ---------------------------------------------- */

/* Pure: the spec of quantizing a tensor of spec *in with q (same shape and
 * logical dtype; scaling, qdtype, usage, flags from q). Errors as
 * opf_spec_layout plus OPF_ERR_DTYPE for inputs other than f32/bf16/f16. */
OPF_API opf_status opf_quantizer_spec(const opf_quantizer *q, const opf_spec *in, opf_spec *out);

/* Quantizes *in (plain f32/bf16/f16) into *out, which the caller allocated
 * with the spec opf_quantizer_spec returned (checked). Writes the data and
 * scale components; for delayed scaling max-accumulates the amax into the
 * state's current row; for stochastic rounding advances the context's RNG
 * offset. On error nothing is written. */
OPF_API opf_status opf_quantize(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                opf_tensor *out);
/* opf_quantizer_spec + opf_tensor_alloc + opf_quantize. On failure *out is
 * all zero bytes (opf_tensor_release on it is a no-op). */
OPF_API opf_status opf_quantize_alloc(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                      opf_tensor *out);

/* Decodes one copy (OPF_USAGE_ROWWISE or OPF_USAGE_COLUMNWISE) of a quantized
 * tensor into *out, a plain tensor of the logical shape (columnwise copies
 * are transposed back) in f32, bf16 or f16. NVFP4 uses S_dec = fl(1/S_enc). */
OPF_API opf_status opf_dequantize(opf_ctx *ctx, const opf_tensor *q, unsigned which,
                                  opf_tensor *out);

/* Decodes *in (rowwise copy if present, else columnwise) to fp32 and
 * quantizes it with q into *out (allocated with opf_quantizer_spec of in's
 * logical spec). */
OPF_API opf_status opf_requantize(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                  opf_tensor *out);

/* Derives or drops copies so that t->spec.usage == usage. Dropping is always
 * allowed. Deriving is allowed where the data determines the other copy
 * exactly: per-tensor FP8 (byte transpose), FP8 block 2D, NVFP4 2D and MXFP8
 * 2D (the same blocks both ways). Anything else returns OPF_ERR_UNSUPPORTED
 * and leaves *t untouched. Deriving allocates a new buffer. */
OPF_API opf_status opf_tensor_update_usage(opf_ctx *ctx, opf_tensor *t, unsigned usage);

/* The 16-point random Hadamard transform of 3.4.3 on one vector: y = x T with
 * T = diag(signs) H16 / 4, summed in fp32, result rounded to bf16. */
OPF_API void opf_rht16(const float *x, float *y, uint16_t sign_mask);

#ifdef __cplusplus
}
#endif
#endif
