/* delayed.c: FP8 delayed-scaling state (scales and amax history) and its
 * update after a step, the fused path of docs/numerics.md 3.1: the amax
 * reduction here, the roll and the new scales in the device's kernel. */
#include <math.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/scale-math.h"
#include "core/core-impl.h"
#include "core/size-impl.h"
#include "opfuse/quant.h"

struct opf_delayed_state {
    opf_ctx      *ctx;         /* whose allocator holds this block */
    size_t        bytes;
    opf_format    format;
    opf_amax_algo algo;
    bool          backward;
    int           n;           /* slots */
    int           len;         /* history rows L */
    opf_dtype     dtype;       /* element dtype of this direction */
    float         scaled_max;  /* fp8_max * 2^-margin (2.2) */
    float        *scale;       /* [n] */
    float        *history;     /* [L][n], row 0 = current step */
    float        *reduced;     /* [n] scratch for the reduced copy of row 0 */
};

/* Element dtype of one direction (3, "the dtype rule"). */
static opf_dtype format_dtype(opf_format f, bool backward)
{
    if (f == OPF_FORMAT_E4M3 || (f == OPF_FORMAT_HYBRID && !backward)) return OPF_E4M3;
    return OPF_E5M2;
}

static opf_status check_create(opf_ctx *ctx, opf_format format, float margin, int history_len,
                               opf_amax_algo algo, int n_slots, opf_delayed_state **out)
{
    const char *fn = "opf_delayed_state_create";
    OPF_CHECK_NULL(ctx, fn, out);
    OPF_CHECK_NULL(ctx, fn, ctx);
    if (format != OPF_FORMAT_E4M3 && format != OPF_FORMAT_E5M2 && format != OPF_FORMAT_HYBRID)
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "%s: format %d is not an FP8 format (e4m3, e5m2 or hybrid)", fn,
                         (int)format);
    if ((unsigned)algo >= OPF_AMAX_ALGO_COUNT)
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "%s: amax algorithm %d is neither max (0) nor most_recent (1)", fn,
                         (int)algo);
    if (history_len < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: amax history length %d < 1", fn,
                         history_len);
    if (n_slots < 1)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %d slots < 1", fn, n_slots);
    if (!(fabsf(margin) <= OPF_MAX_MARGIN))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: margin %g outside -%d..%d", fn,
                         (double)margin, OPF_MAX_MARGIN, OPF_MAX_MARGIN);
    return OPF_OK;
}

opf_status opf_delayed_state_create(opf_ctx *ctx, opf_format format, float margin,
                                    int history_len, opf_amax_algo algo, bool backward,
                                    int n_slots, opf_delayed_state **out)
{
    opf_status st = check_create(ctx, format, margin, history_len, algo, n_slots, out);
    if (st) return st;
    *out = NULL;
    /* One block: the struct, then scale, history and the reduce scratch. */
    size_t head = (sizeof(opf_delayed_state) + 63) / 64 * 64;
    size_t nfl = 0, bytes = 0;
    if (!opf_mul_size((size_t)n_slots, (size_t)history_len + 2, &nfl) ||
        !opf_mul_size(nfl, sizeof(float), &bytes) || !opf_add_size(head, bytes, &bytes))
        return opf_error(ctx, OPF_ERR_SHAPE,
                         "opf_delayed_state_create: %d slots x %d history rows need more than "
                         "%lld bytes", n_slots, history_len, (long long)OPF_MAX_BYTES);
    char *mem = opf_ctx_alloc(ctx, bytes);
    if (!mem)
        return opf_error(ctx, OPF_ERR_NO_MEMORY,
                         "opf_delayed_state_create: cannot allocate %zu bytes for %d slots x %d "
                         "history rows", bytes, n_slots, history_len);
    opf_delayed_state *s = (opf_delayed_state *)mem;
    memset(s, 0, sizeof *s);
    s->ctx = ctx;
    s->bytes = bytes;
    s->format = format;
    s->algo = algo;
    s->backward = backward;
    s->n = n_slots;
    s->len = history_len;
    s->dtype = format_dtype(format, backward);
    /* 2.2: computed on the host in float. */
    s->scaled_max = opf_fp8_max(s->dtype) * exp2f(-margin);
    s->scale = (float *)(mem + head);
    s->history = s->scale + n_slots;
    s->reduced = s->history + (size_t)n_slots * (size_t)history_len;
    opf_delayed_state_reset(s);
    *out = s;
    return OPF_OK;
}

void opf_delayed_state_destroy(opf_delayed_state *s)
{
    if (s) opf_ctx_free(s->ctx, s, s->bytes);
}

int opf_delayed_state_slots(const opf_delayed_state *s) { return s ? s->n : 0; }
int opf_delayed_state_history_len(const opf_delayed_state *s) { return s ? s->len : 0; }
opf_dtype opf_delayed_state_dtype(const opf_delayed_state *s) { return s ? s->dtype : OPF_E4M3; }
float *opf_delayed_state_scale(opf_delayed_state *s) { return s ? s->scale : NULL; }
float *opf_delayed_state_history(opf_delayed_state *s) { return s ? s->history : NULL; }

void opf_delayed_state_reset(opf_delayed_state *s)
{
    if (!s) return;
    for (int j = 0; j < s->n; j++) s->scale[j] = 1.0f;
    memset(s->history, 0, (size_t)s->n * (size_t)s->len * sizeof(float));
}

opf_status opf_delayed_state_update(opf_ctx *ctx, opf_delayed_state *s,
                                    opf_amax_reduce_fn reduce, void *reduce_user)
{
    OPF_CHECK_NULL(ctx, "opf_delayed_state_update", s);
    if (reduce) {
        memcpy(s->reduced, s->history, (size_t)s->n * sizeof(float));
        opf_status st = reduce(reduce_user, s->reduced, s->n);
        if (st != OPF_OK)
            return opf_error(ctx, st,
                             "opf_delayed_state_update: amax reduction of %d slots failed "
                             "with %s; state unchanged", s->n, opf_status_str(st));
    }
    opf_delayed_arrays a = {.history = s->history, .scale = s->scale,
                            .reduced = reduce ? s->reduced : NULL, .n = s->n, .len = s->len,
                            .scaled_max = s->scaled_max, .algo = s->algo};
    /* The arrays are host memory on every device (the context's host
     * allocator): a device's quantize kernels read the scale and max the amax
     * into row 0 through opf_quantize_state, so the roll runs on the CPU. */
    return opf_backend_get(OPF_DEVICE_CPU)->scale->delayed_update(s->ctx, &a, 1);
}
