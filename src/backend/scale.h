/* scale.h: the kernel-table entries for amax, the delayed-scaling update
 * (history roll, amax choice, scale; docs/numerics.md 3.1) over many states at
 * once, and the swizzle of a scale matrix between its compact and
 * GEMM-swizzled layouts (4.4). The scale-from-amax math itself, which the
 * quantize kernels and the quant layer share, is in backend/scale-math.h.
 *
 * Each entry takes the context (later: its stream) and plain tensors or
 * pointers in the device's memory; none allocates, none sees an op, a seq or
 * a recipe object. Arguments are validated by the caller. */
#ifndef OPFUSE_BACKEND_SCALE_H
#define OPFUSE_BACKEND_SCALE_H

#include <stdbool.h>
#include <stdint.h>

#include "opfuse/context.h"
#include "opfuse/quant.h"
#include "opfuse/tensor.h"

/* One delayed-scaling state as plain arrays: n slots (one per quantized
 * tensor), an amax history of len rows. */
typedef struct opf_delayed_arrays {
    float       *history;     /* [len][n] fp32, in/out: row 0 holds this step's amaxes */
    float       *scale;       /* [n] fp32, in/out: the scales of the next step */
    const float *reduced;     /* [n] fp32 row 0 after the amax reduction, or NULL */
    int          n, len;
    uint64_t    *nonfinite;   /* [1] in the device's memory, or NULL: += the slots whose amax
                               * was infinite or NaN (the host reads it; the update never waits) */
    float        scaled_max;  /* fp8_max * 2^-margin (numerics.md 2.2) */
    opf_amax_algo algo;
    bool         reject_nonfinite;  /* keep non-finite amaxes out of the history */
} opf_delayed_arrays;

typedef struct opf_scale_kernels {
    /* *amax = max |x| over a plain f32/bf16/f16 tensor, NaN ignored, from 0
     * (exact). amax: one fp32 in the device's memory. */
    opf_status (*amax)(opf_ctx *ctx, const opf_tensor *x, float *amax);

    /* numerics.md 3.1 steps 2-5 for every slot of `count` states: the slot's
     * amax a is reduced[j] when reduced is set and nonzero, else history
     * row 0; a == 0 leaves the slot untouched; otherwise the window of a and
     * the len - 1 older amaxes gives the amax (max, NaN skipped, or a for
     * most_recent), the history rolls (a becomes the oldest row, row 0 is
     * cleared) and scale = opf_delayed_scale(amax, scaled_max, scale).
     * A non-finite a adds one to *nonfinite (when set) and, under
     * reject_nonfinite, only clears row 0 (no roll, scale unchanged). */
    opf_status (*delayed_update)(opf_ctx *ctx, const opf_delayed_arrays *states, int count);

    /* One scale matrix of rows x cols bytes (rows a multiple of 128, cols of
     * 4) from src to dst (distinct): to_swizzled writes the GEMM-swizzled
     * layout from the compact one, else back. The compact side is stored
     * [rows][cols], or [cols][rows] when transposed (MXFP8 columnwise). */
    opf_status (*swizzle)(opf_ctx *ctx, const uint8_t *src, uint8_t *dst, int64_t rows,
                          int64_t cols, bool transposed, bool to_swizzled);
} opf_scale_kernels;

extern const opf_scale_kernels opf_cpu_scale;

#endif
