/* act.h: the kernel-table entries for every activation forward and backward,
 * the GLU, scaled and clamped variants, and the fused dact + dbias.
 *
 * Every entry works on fp32 arrays in the device's memory, row-major, and
 * computes in fp32 exactly as numerics.md 6.3 writes it (exp, tanh and σ of
 * 6.3.1); the caller widens inputs to fp32 before and rounds or quantizes
 * the outputs after (the quant layer's entries), so none sees a dtype or a
 * quantizer. The kind selects the element function; its parameters come as
 * plain values. Entries take validated arguments, allocate nothing and
 * return OPF_OK on the CPU (a device reports its launch errors).
 *
 * Shapes, with x [rows, cols]:
 *   plain kinds:  y [rows, cols] = f(x)
 *   GLU kinds:    x = [a | b], a = x[:, :h] (activated), b = x[:, h:],
 *                 h = cols / 2; y [rows, h] = f(a)·b
 * The *_q entries are the same math on plain f32/bf16/f16 tensors (read as
 * their exact fp32 values) with an output that is plain (each value rounded
 * once into its dtype) or quantized (qout.h): the op layer's fused path,
 * where a device reads bf16 directly and writes the rounded or quantized
 * values in one pass. rows = numel(x) / cols, cols = x's last dim. The CPU
 * composes them (widen, the fp32 entry, opf_qout_store_f32).
 *
 * Usage, a fused op's activation pass in place over t [m, n]:
 *     be->act->fwd(ctx, OPF_ACT_GELU, (opf_act_params){0}, t, t, m, n);
 * and the same from a bf16 tensor xt into a plain or quantized output:
 *     opf_qout o = {.out = &y, .q = &next_q, .state = &qs, .hp = OPF_BF16};
 *     be->act->fwd_q(ctx, OPF_ACT_GELU, (opf_act_params){0}, &xt, &o); */
#ifndef OPFUSE_BACKEND_ACT_H
#define OPFUSE_BACKEND_ACT_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/qout.h"
#include "opfuse/context.h"
#include "opfuse/tensor.h"

/* The activation a kernel computes: plain kinds first, then the GLUs. */
typedef enum opf_act_kind {
    OPF_ACT_GELU           = 0,   /* tanh-form GELU */
    OPF_ACT_QGELU          = 1,   /* x·σ(αx), α = 1.702 */
    OPF_ACT_RELU           = 2,
    OPF_ACT_SRELU          = 3,   /* squared ReLU */
    OPF_ACT_SILU           = 4,   /* x·σ(αx), α = 1 */
    OPF_ACT_GLU            = 5,   /* σ(a)·b */
    OPF_ACT_GEGLU          = 6,
    OPF_ACT_QGEGLU         = 7,
    OPF_ACT_REGLU          = 8,
    OPF_ACT_SREGLU         = 9,
    OPF_ACT_SWIGLU         = 10,
    OPF_ACT_CLAMPED_SWIGLU = 11,  /* a' = min(a, limit), b' = clamp(b, ±limit) + 1 */
    OPF_ACT_COUNT
} opf_act_kind;

/* Whether kind k (in range) halves the last dim: y = f(a)·b. */
static inline bool opf_act_is_glu(opf_act_kind k) { return k >= OPF_ACT_GLU; }

/* The parameters of a kind; unused ones are ignored. */
typedef struct opf_act_params {
    float alpha;  /* slope of the x·σ(αx) kinds: QGELU(-GLU) 1.702, SiLU and SwiGLU 1 */
    float limit;  /* ClampedSwiGLU's limit (> 0, finite) */
} opf_act_params;

typedef struct opf_act_kernels {
    /* y = f(x) or f(a)·b (shapes above). In place (y == x) for plain kinds. */
    opf_status (*fwd)(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const float *x, float *y,
                      int64_t rows, int64_t cols);
    /* dx [rows, cols] from dy (the shape of y): plain dx = f'(x)·dy; GLU
     * dx = [f'(a)·dy·b | f(a)·dy]. dx may be x or dy for plain kinds. */
    opf_status (*bwd)(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const float *x,
                      const float *dy, float *dx, int64_t rows, int64_t cols);
    /* The backward of bias + a plain activation in one pass: dx = f'(x)·dy
     * as bwd gives it and dbias[j] = the column sum of dx[r, j] over the
     * rows in lanesum.h's order (dbias [cols]). Quantizing dx is the caller's. */
    opf_status (*dact_dbias)(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const float *x,
                             const float *dy, float *dx, float *dbias, int64_t rows, int64_t cols);
    /* Any kind with a scale per row (s [rows]), the output of fwd times s:
     * y[r, j] = fl(fl(f(a) b) s[r]) for a GLU kind (ClampedSwiGLU: f(a') b'),
     * fl(f(x) s[r]) for a plain kind (y [rows, cols]). */
    opf_status (*scaled_glu_fwd)(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const float *x,
                                 const float *s, float *y, int64_t rows, int64_t cols);
    /* Its backward, with g = fl(dy s[r]): dx = bwd's dx for the gradient g
     * and ds[r] = the sum over j, left to right, of fl(u dy) with u the
     * unscaled output (fl(f(a) b), or f(x)). work: 2·rows·h floats of
     * scratch, h the output's last dim. */
    opf_status (*scaled_glu_bwd)(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const float *x,
                                 const float *s, const float *dy, float *dx, float *ds, float *work,
                                 int64_t rows, int64_t cols);
    /* fwd from the tensor x into y (plain or quantized; y->out's shape is
     * fwd's y). */
    opf_status (*fwd_q)(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const opf_tensor *x,
                        const opf_qout *y);
    /* bwd from the tensors x and dy into dx (x's shape). */
    opf_status (*bwd_q)(opf_ctx *ctx, opf_act_kind k, opf_act_params p, const opf_tensor *x,
                        const opf_tensor *dy, const opf_qout *dx);
    /* dact_dbias (plain kinds) from the tensors x and dy into dx; dbias [cols]
     * fp32 is the sum of the fp32 terms, before dx is rounded. */
    opf_status (*dact_dbias_q)(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                               const opf_tensor *x, const opf_tensor *dy, const opf_qout *dx,
                               float *dbias);
    /* dact_dbias (plain kinds) with dbias summing dx as stored: dx = f'(x)·dy
     * rounded once into the plain tensor dx (x's shape), db [cols] (its own
     * dtype) = the column sums of those rounded values in lanesum.h's order,
     * rounded once. The bits of bwd_q into dx and then the bias's dbias of
     * dx (elem.h), which a device may give in one pass. */
    opf_status (*dact_dbias_stored)(opf_ctx *ctx, opf_act_kind k, opf_act_params p,
                                    const opf_tensor *x, const opf_tensor *dy, opf_tensor *dx,
                                    opf_tensor *db);
} opf_act_kernels;

extern const opf_act_kernels opf_cpu_act;

/* Which fp32 entry a composed *_q call runs. */
typedef enum opf_act_pass {
    OPF_ACT_PASS_FWD        = 0,
    OPF_ACT_PASS_BWD        = 1,
    OPF_ACT_PASS_DACT_DBIAS = 2,
} opf_act_pass;

/* The composed *_q entry of pass `pass` on be's kernels: x and dy (NULL for
 * the forward) widened by be's cast into fp32 scratch (unless f32), the
 * fp32 entry, then opf_qout_store_f32. The CPU's *_q, and another device's
 * fallback. dbias: DACT_DBIAS only. */
opf_status opf_act_q_composed(opf_ctx *ctx, const struct opf_backend_i *be, opf_act_pass pass,
                              opf_act_kind k, opf_act_params p, const opf_tensor *x,
                              const opf_tensor *dy, const opf_qout *o, float *dbias);

/* dact_dbias_stored composed on be's kernels: be's bwd_q into dx, then be's
 * dbias of dx into db. The CPU's entry, and another device's fallback. */
opf_status opf_act_dact_dbias_stored_composed(opf_ctx *ctx, const struct opf_backend_i *be,
                                              opf_act_kind k, opf_act_params p,
                                              const opf_tensor *x, const opf_tensor *dy,
                                              opf_tensor *dx, opf_tensor *db);

#endif
