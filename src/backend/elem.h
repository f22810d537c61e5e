/* elem.h: the kernel-table entries of the element-wise family: bias and
 * dbias, constant scale, add (residual add, gradient sum, accumulation into
 * an existing buffer such as an fp32 main_grad), dropout (Philox), cast and
 * cast+transpose, fill (constant or Philox-uniform) and copy. The grouped
 * GEMM sits beside the GEMM in backend-impl.h.
 *
 * Each entry takes the context (later: its stream) and plain tensors: one
 * data component, dtype f32, bf16 or f16 unless an entry says otherwise,
 * shapes read as 2D views (opf_shape_2d) where rows matter. Values are read
 * exactly into fp32, computed in fp32 and rounded (RNE) once into the output's
 * dtype (numerics.md 1.1). Quantized tensors never reach these entries as
 * inputs: the op decodes them first (dbias_q writes one, through qout.h).
 * The caller validated every argument (dtypes, equal element counts,
 * allocated outputs); an entry only fails for what the device itself
 * reports. None allocates, and none sees an op, a seq or a recipe.
 *
 * Aliasing: an element-wise output may be exactly one of its inputs (same
 * pointer and dtype: out = a + b into a), never a partial overlap. */
#ifndef OPFUSE_BACKEND_ELEM_H
#define OPFUSE_BACKEND_ELEM_H

#include "backend/qout.h"
#include "opfuse/context.h"
#include "opfuse/tensor.h"

typedef struct opf_elem_kernels {
    /* y[r, j] = x[r, j] + bias[j]; x, y [rows, n] (the last dim is n), bias [n]. */
    opf_status (*bias_add)(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *bias,
                           opf_tensor *y);
    /* db[j] = sum over r of dy[r, j] for dy [rows, n]: an fp32 column sum in
     * lanesum.h's order, rounded once into db [n] (numerics.md 5.5, 6.4). */
    opf_status (*dbias)(opf_ctx *ctx, const opf_tensor *dy, opf_tensor *db);
    /* The bias's backward handing the previous op its gradient in that op's
     * format: db as dbias's (same bits), and dx = dy's values into *dx by
     * opf_qout_from_plain's rule: plain, dy cast (nothing when dx->out is
     * dy); quantized, exactly what the device's quantize kernel makes of dy
     * itself when dy's dtype is dx->hp (or hp is f32 and the scaling
     * per-tensor), else of dy rounded to hp. dx->out never overlaps dy
     * unless it is dy (plain). A device may take the amax while it sums
     * (current-scaling FP8: one read of dy, then the cast pass). */
    opf_status (*dbias_q)(opf_ctx *ctx, const opf_tensor *dy, opf_tensor *db, const opf_qout *dx);
    /* A bias scaled per row (a grouped linear's scale_bias): y[r, j] =
     * acc[r, j] + fl(s[r] * bias[j]) in fp32, rounded once into y; acc, y
     * [rows, n], s [rows], bias [n]. */
    opf_status (*scaled_bias_add)(opf_ctx *ctx, const opf_tensor *acc, const opf_tensor *s,
                                  const opf_tensor *bias, opf_tensor *y);
    /* Its backward for dy [rows, n]: db[j] = the fp32 column sum (lanesum.h)
     * of fl(dy[r, j] * s[r]) (into db [n]), ds[r] = the fp32 sum over j, left
     * to right, of fl(dy[r, j] * bias[j]) (into ds [rows]); each rounded once. */
    opf_status (*scaled_dbias)(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *s,
                               const opf_tensor *bias, opf_tensor *db, opf_tensor *ds);
    /* y = fl32(s * x), one fp32 multiply per element (s is already fp32). */
    opf_status (*scale)(opf_ctx *ctx, const opf_tensor *x, float s, opf_tensor *y);
    /* out = fl32(a + b) for a, b, out of equal element counts (each of its own
     * dtype). out == a accumulates into a (gradient sum, main_grad += g). */
    opf_status (*add)(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b, opf_tensor *out);
    /* Training dropout with keep probability 1 - p, p in [0, 1). Element e
     * takes word e % 4 of philox4x32_10(counter {lo32(offset + e/4),
     * hi32(offset + e/4), 0, 0}, key {lo32(seed), hi32(seed)}); it is kept when
     * the word >= (uint32_t)(p * 2^32). mask (u8, x's element count) gets 1
     * for kept elements; y = fl32(x * s) kept, x * 0 dropped, with
     * s = fl32(1 / (1 - p)) (the quotient in double). The caller reserved
     * ceil(n / 4) counters from offset. */
    opf_status (*dropout_fwd)(opf_ctx *ctx, const opf_tensor *x, double p, uint64_t seed,
                              uint64_t offset, opf_tensor *y, opf_tensor *mask);
    /* dx = dy * (mask ? s : 0) with the forward's mask and s. */
    opf_status (*dropout_bwd)(opf_ctx *ctx, const opf_tensor *dy, const opf_tensor *mask,
                              double p, opf_tensor *dx);
    /* y = x converted to y's dtype (RNE); equal dtypes copy the bits. */
    opf_status (*cast)(opf_ctx *ctx, const opf_tensor *x, opf_tensor *y);
    /* x [rows, cols] into y_t [cols, rows], transposed and converted to y_t's
     * dtype; y (NULL or [rows, cols]) also gets the plain converted copy. */
    opf_status (*cast_transpose)(opf_ctx *ctx, const opf_tensor *x, opf_tensor *y,
                                 opf_tensor *y_t);
    /* Every element of t = value rounded to t's dtype (f32/bf16/f16: through
     * fp32; u8, i32, i64: truncated). value 0 fills any dtype with zero bytes. */
    opf_status (*fill)(opf_ctx *ctx, double value, opf_tensor *t);
    /* Uniform U(-bound, bound) initial values: element i takes word i % 4 of
     * philox4x32_10(counter {lo32(offset + i/4), hi32(offset + i/4), stream,
     * 0}, key {lo32(seed), hi32(seed)}); with u = (word >> 8) * 2^-24,
     * v = fl32(bound * (2u - 1)) in double, then rounded to t's dtype. The
     * caller reserved ceil(numel / 4) counters from offset. */
    opf_status (*fill_uniform)(opf_ctx *ctx, uint64_t seed, uint64_t offset, uint32_t stream,
                               double bound, opf_tensor *t);
    /* nbytes of device memory from src to dst (no overlap unless equal). */
    opf_status (*copy)(opf_ctx *ctx, const void *src, void *dst, size_t nbytes);
} opf_elem_kernels;

extern const opf_elem_kernels opf_cpu_elem;

struct opf_backend_i;
/* dbias_q composed on be's kernels: be's dbias, then opf_qout_from_plain
 * of dy into dx (scratch popped). The CPU's dbias_q, and another device's
 * fallback. */
opf_status opf_dbias_q_composed(opf_ctx *ctx, const struct opf_backend_i *be, const opf_tensor *dy,
                                opf_tensor *db, const opf_qout *dx);

#endif
