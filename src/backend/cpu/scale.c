/* scale.c: the CPU reference kernels for amax, the delayed-scaling update
 * (history roll, amax choice, scale; docs/numerics.md 3.1) and the scale
 * swizzle (4.4). */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"
#include "backend/scale-math.h"
#include "backend/scale.h"
#include "core/core-impl.h"

enum { AMAX_PAR_MIN = 1 << 15 };  /* below this many elements one thread is faster */

static opf_status cpu_amax(opf_ctx *ctx, const opf_tensor *x, float *amax)
{
    int64_t n = opf_spec_numel(&x->spec);
    int nt = opf_cpu_threads(ctx, n, AMAX_PAR_MIN);
    *amax = opf_cpu_input_amax(x->data[OPF_COMP_DATA], x->spec.dtype, n, nt);
    return OPF_OK;
}

/* One slot given its amax a; its column of the history is h[i * n]. */
static void update_slot(const opf_delayed_arrays *s, int j, float a)
{
    if (a == 0.0f) return;  /* no roll, scale unchanged */
    float *h = s->history + j;
    if (!isfinite(a)) {
        if (s->nonfinite) ++*s->nonfinite;
        if (s->reject_nonfinite) {  /* as a step the slot did not see, row 0 ready for the next */
            h[0] = 0.0f;
            return;
        }
    }
    size_t n = (size_t)s->n, L = (size_t)s->len;
    /* The window is a and the L-1 previous amaxes H[1..L-1]; fmaxf skips NaN. */
    float amax = 0.0f;
    for (size_t i = 1; i < L; i++) amax = fmaxf(amax, h[i * n]);
    amax = fmaxf(amax, a);
    for (size_t i = 1; i + 1 < L; i++) h[i * n] = h[(i + 1) * n];
    if (L > 1) h[(L - 1) * n] = a;
    h[0] = 0.0f;
    if (s->algo == OPF_AMAX_MOST_RECENT) amax = a;
    s->scale[j] = opf_delayed_scale(amax, s->scaled_max, s->scale[j]);
}

static opf_status cpu_delayed_update(opf_ctx *ctx, const opf_delayed_arrays *states, int count)
{
    (void)ctx;
    for (int k = 0; k < count; k++) {
        const opf_delayed_arrays *s = &states[k];
        for (int j = 0; j < s->n; j++) {
            float a = (s->reduced && s->reduced[j] != 0.0f) ? s->reduced[j] : s->history[j];
            update_slot(s, j, a);
        }
    }
    return OPF_OK;
}

/* The index math is core's (opf_swizzle_index), shared with the public
 * opf_swizzle_scales / opf_unswizzle_scales this wraps. */
static opf_status cpu_swizzle(opf_ctx *ctx, const uint8_t *src, uint8_t *dst, int64_t rows,
                              int64_t cols, bool transposed, bool to_swizzled)
{
    (void)ctx;
    return to_swizzled ? opf_swizzle_scales(src, dst, rows, cols, transposed)
                       : opf_unswizzle_scales(src, dst, rows, cols, transposed);
}

const opf_scale_kernels opf_cpu_scale = {
    .amax = cpu_amax,
    .delayed_update = cpu_delayed_update,
    .swizzle = cpu_swizzle,
};
