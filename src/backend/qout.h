/* qout.h: the output of a fused kernel entry (norm.h's *_fwd_q, act.h's
 * *_q), plain or quantized, and the reference composition of such an entry.
 *
 * A fused entry computes its fp32 results as the plain entry of its family
 * does, then either rounds each value once into a plain output or quantizes
 * them: each value rounded to hp first (F32: unrounded; delayed scaling
 * casts the fp32 value, numerics.md 6.1, 6.3), then quantized with q as the
 * device's quantize kernel does from a plain tensor of those values. That is
 * what the op layer's opf_op_store_f32 makes of an fp32 result, so a fused
 * entry gives the op's old bits; a device may do it in fewer passes (the
 * amax taken while the values are written, the cast in the same kernel)
 * but not with other bits.
 *
 * The composition below is the CPU's entry and every other device's
 * fallback: the values in hp into scratch, then the device's quantize
 * kernel. Block scaling reads the input dtype (its value for an infinite
 * scale is the input dtype's largest finite value, numerics.md 2.1), so its
 * values go to the kernel widened back to fp32, as the op layer always did.
 *
 * Usage (a device's fallback, the CPU's entry):
 *   opf_tensor t;
 *   size_t mark = opf_ctx_scratch_mark(ctx);
 *   st = opf_qout_begin(ctx, o, &t);               t: o->out, or hp scratch
 *   ... write the values into t, each rounded once into t's dtype ...
 *   if (!st) st = opf_qout_end(ctx, be, o, &t);   the quantize, if any
 *   opf_ctx_scratch_pop(ctx, mark);
 */
#ifndef OPFUSE_BACKEND_QOUT_H
#define OPFUSE_BACKEND_QOUT_H

#include <stdbool.h>

#include "opfuse/context.h"
#include "opfuse/quant.h"
#include "opfuse/tensor.h"

struct opf_quantize_state;
struct opf_backend_i;

typedef struct opf_qout {
    /* plain f32/bf16/f16, or quantized with the spec opf_quantizer_spec(q)
     * gives (its logical dtype is not read); the caller's memory */
    opf_tensor                      *out;
    /* NULL or scaling NONE: out is plain. Else out's quantizer, not
     * stochastic (the generator's advance is the dispatcher's). */
    const opf_quantizer             *q;
    /* q's delayed scale and amax slot, as opf_quantize resolves them; NULL
     * when q is not delayed */
    const struct opf_quantize_state *state;
    /* quantized out: the dtype each value is rounded to before quantizing */
    opf_dtype                        hp;
} opf_qout;

static inline bool opf_qout_quantized(const opf_qout *o)
{
    return o->q && o->q->scaling != OPF_SCALING_NONE;
}

/* Whether a quantized o is current-scaling per-tensor FP8 with no amax
 * reduction: the case a device fuses as values + amax, then the cast. */
static inline bool opf_qout_current_fp8(const opf_qout *o)
{
    return opf_qout_quantized(o) && o->q->scaling == OPF_SCALING_TENSOR && !o->q->delayed &&
           !o->q->amax_reduce;
}

/* Whether a quantized o takes plain values of dtype dt as they are: dt is
 * hp, or hp is F32 (dt's values widen exactly) and the scaling per-tensor,
 * whose kernels compute from the widened value alone. The other formats
 * take dt only when it is hp (FP8 block scaling reads the input dtype
 * itself: its value for an infinite scale, numerics.md 2.1). */
static inline bool opf_qout_reads_as_is(const opf_qout *o, opf_dtype dt)
{
    return dt == o->hp || (o->hp == OPF_F32 && o->q->scaling == OPF_SCALING_TENSOR);
}

/* Where a composed entry writes its values: out itself when plain, else an
 * hp tensor of out's shape in scratch on out's device (pushed on the
 * context's scratch stack: the caller pops it). */
opf_status opf_qout_begin(opf_ctx *ctx, const opf_qout *o, opf_tensor *t);

/* After the values are in t (from opf_qout_begin): nothing when out is
 * plain, else quantizes t into out with be's quantize kernel (block scaling
 * from t widened to fp32, scratch pushed likewise). */
opf_status opf_qout_end(opf_ctx *ctx, const struct opf_backend_i *be, const opf_qout *o,
                        const opf_tensor *t);

/* Plain values x (f32/bf16/f16, out's shape and device) into o by be's
 * kernels, without opf_qout_end's widening: plain out gets x cast (nothing
 * when x is out); quantized out gets be's quantize kernel from x itself when
 * opf_qout_reads_as_is (opf_quantize's bits from x: what a consumer that
 * quantized x itself would get), else from x rounded into an hp tensor in
 * scratch (pushed; the caller pops it). The quantizer's delayed amax slot
 * is updated once, as by opf_quantize. */
opf_status opf_qout_from_plain(opf_ctx *ctx, const struct opf_backend_i *be, const opf_qout *o,
                               const opf_tensor *x);

/* fp32 values r (out's shape, out's device) into o by be's kernels: cast
 * into a plain out (unless r is out), else rounded to hp by the cast
 * kernel, then opf_qout_end. Pushes scratch; the caller pops it. */
opf_status opf_qout_store_f32(opf_ctx *ctx, const struct opf_backend_i *be, const opf_qout *o,
                              const opf_tensor *r);

#endif
