/* delayed.c: FP8 delayed-scaling state (scales and amax history) and its
 * update after a step, the fused path of docs/numerics.md 3.1: the amax
 * reduction here, the roll and the new scales in the device's kernel.
 *
 * The arrays live in the memory of the context's device: on a CUDA context
 * the quantize kernels read the scale and max-accumulate the amax there and
 * the device's delayed_update rolls them, so a step never waits for the
 * host. Host code reaches them only through opf_delayed_state_read/_write,
 * explicit (counted) copies.
 *
 * Non-finite amaxes: the update counts them into a 64-bit word that lives
 * with the arrays (a device state: the first 8 bytes of its device block),
 * and rolls them in (the anchor's rule) or keeps them out
 * (opf_recipe.reject_nonfinite_amax). On the CPU the host sees the count
 * right after the update and warns then; on a device the count stays
 * there, the step never waits for it, and the host learns of it only when
 * it asks (opf_delayed_state_nonfinite_amaxes: one counted read), warning
 * then, as the optimizer does with its skipped steps. */
#include <math.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/scale-math.h"
#include "core/core-impl.h"
#include "core/size-impl.h"
#include "opfuse/tensor.h"
#include "opfuse/quant.h"
#include "quant/quant-impl.h"

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
    opf_device    device;      /* where the arrays are: the context's device */
    opf_tensor    dev_mem;     /* a device state's count and arrays (f32 [2 + n * (L + 3)]) */
    bool          reject;      /* keep non-finite amaxes out of the history */
    uint64_t     *nonfinite;   /* [1] the count, with the arrays: here on the CPU, else dev_mem */
    uint64_t      count_host;  /* the CPU's count; a device's as the host last read it */
    float        *scale;       /* [n] */
    float        *history;     /* [L][n], row 0 = current step */
    float        *reduced;     /* [n] scratch for the reduced copy of row 0 */
    float        *kept;        /* [n] row 0 at the start of a call (opf_delayed_state_keep_row0) */
};

enum { COUNT_FLOATS = 2 };  /* the 64-bit count ahead of a device state's arrays */

/* The count and arrays of a device state: one f32 tensor on the context's
 * device (its buffer is aligned for the 64-bit count). */
static opf_status device_arrays(opf_ctx *ctx, opf_delayed_state *s, size_t nfl)
{
    opf_spec sp = opf_spec_make(1, (int64_t[]){(int64_t)(nfl + COUNT_FLOATS)}, OPF_F32);
    sp.device = opf_ctx_device(ctx);
    opf_status st = opf_tensor_alloc(ctx, &sp, &s->dev_mem);
    if (st) return st;
    s->device = sp.device;
    s->nonfinite = s->dev_mem.data[OPF_COMP_DATA];
    s->scale = (float *)s->dev_mem.data[OPF_COMP_DATA] + COUNT_FLOATS;
    return OPF_OK;
}

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
    opf_enum_label lb;
    if (format != OPF_FORMAT_E4M3 && format != OPF_FORMAT_E5M2 && format != OPF_FORMAT_HYBRID)
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "%s: format %s is not an FP8 format (e4m3, e5m2 or hybrid)", fn,
                         opf_enum_label_of(&lb, opf_format_name(format), (int)format));
    if ((unsigned)algo >= OPF_AMAX_ALGO_COUNT)
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "%s: amax algorithm %s is neither max nor most_recent", fn,
                         opf_enum_label_of(&lb, "invalid", (int)algo));
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
    /* One block: the struct, then (on the CPU) scale, history, the reduce
     * scratch and the kept row 0; a device holds those in its own memory. */
    bool on_device = opf_ctx_device(ctx) != OPF_DEVICE_CPU;
    size_t head = (sizeof(opf_delayed_state) + 63) / 64 * 64;
    size_t nfl = 0, bytes = 0;
    if (!opf_mul_size((size_t)n_slots, (size_t)history_len + 3, &nfl) ||
        !opf_mul_size(nfl, sizeof(float), &bytes) ||
        !opf_add_size(head, on_device ? 0 : bytes, &bytes))
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
    s->nonfinite = &s->count_host;
    if (on_device && (st = device_arrays(ctx, s, nfl))) {
        opf_ctx_free(ctx, s, bytes);
        return st;
    }
    s->history = s->scale + n_slots;
    s->reduced = s->history + (size_t)n_slots * (size_t)history_len;
    s->kept = s->reduced + n_slots;
    opf_delayed_state_reset(s);
    *out = s;
    return OPF_OK;
}

void opf_delayed_state_destroy(opf_delayed_state *s)
{
    if (!s) return;
    opf_tensor_release(&s->dev_mem);
    opf_ctx_free(s->ctx, s, s->bytes);
}

int opf_delayed_state_slots(const opf_delayed_state *s) { return s ? s->n : 0; }
int opf_delayed_state_history_len(const opf_delayed_state *s) { return s ? s->len : 0; }
opf_dtype opf_delayed_state_dtype(const opf_delayed_state *s) { return s ? s->dtype : OPF_E4M3; }
float *opf_delayed_state_scale(opf_delayed_state *s) { return s ? s->scale : NULL; }
float *opf_delayed_state_history(opf_delayed_state *s) { return s ? s->history : NULL; }
opf_device opf_delayed_state_device(const opf_delayed_state *s)
{
    return s ? s->device : OPF_DEVICE_CPU;
}

/* n floats between host memory and the state's arrays (memcpy on the CPU,
 * the runtime's counted copy on a device). */
static opf_status move_floats(opf_ctx *ctx, const opf_delayed_state *s, float *dst,
                              const float *src, size_t n, bool to_state)
{
    opf_spec sp = opf_spec_make(1, (int64_t[]){(int64_t)n}, OPF_F32);
    opf_tensor host, mine;
    opf_tensor_wrap(&sp, to_state ? (void *)src : dst, &host);
    sp.device = s->device;
    opf_tensor_wrap(&sp, to_state ? dst : (void *)src, &mine);
    return n ? opf_tensor_copy(ctx, to_state ? &host : &mine, to_state ? &mine : &host) : OPF_OK;
}

opf_status opf_delayed_state_read(opf_ctx *ctx, opf_delayed_state *s, float *scale,
                                  float *history)
{
    OPF_CHECK_NULL(ctx, "opf_delayed_state_read", s);
    opf_ctx *c = ctx ? ctx : s->ctx;
    size_t hn = (size_t)s->n * (size_t)s->len;
    opf_status st = scale ? move_floats(c, s, scale, s->scale, (size_t)s->n, false) : OPF_OK;
    return !st && history ? move_floats(c, s, history, s->history, hn, false) : st;
}

opf_status opf_delayed_state_write(opf_ctx *ctx, opf_delayed_state *s, const float *scale,
                                   const float *history)
{
    OPF_CHECK_NULL(ctx, "opf_delayed_state_write", s);
    opf_ctx *c = ctx ? ctx : s->ctx;
    size_t hn = (size_t)s->n * (size_t)s->len;
    opf_status st = scale ? move_floats(c, s, s->scale, scale, (size_t)s->n, true) : OPF_OK;
    return !st && history ? move_floats(c, s, s->history, history, hn, true) : st;
}

void opf_delayed_state_reset(opf_delayed_state *s)
{
    if (!s) return;
    s->count_host = 0;
    if (s->device == OPF_DEVICE_CPU) {
        for (int j = 0; j < s->n; j++) s->scale[j] = 1.0f;
        memset(s->history, 0, (size_t)s->n * (size_t)s->len * sizeof(float));
        return;
    }
    /* A device state: the count, ones and zeros staged on the host, one copy
     * (at creation and on a recipe change, never inside a step). */
    size_t nfl = COUNT_FLOATS + (size_t)s->n * ((size_t)s->len + 1);
    size_t mark = opf_ctx_scratch_mark(s->ctx);
    float *host = opf_ctx_scratch_push(s->ctx, nfl * sizeof(float));
    if (host) {
        for (size_t j = 0; j < nfl; j++)
            host[j] = j >= COUNT_FLOATS && j < COUNT_FLOATS + (size_t)s->n ? 1.0f : 0.0f;
        move_floats(s->ctx, s, (float *)s->nonfinite, host, nfl, true);
    }
    opf_ctx_scratch_pop(s->ctx, mark);
}

/* n floats within the state's arrays (memcpy on the CPU, an asynchronous
 * copy on the device: no host wait). */
static void copy_row(const opf_delayed_state *s, float *dst, const float *src)
{
    if (s->device == OPF_DEVICE_CPU) {
        memcpy(dst, src, (size_t)s->n * sizeof(float));
        return;
    }
    opf_spec sp = opf_spec_make(1, (int64_t[]){s->n}, OPF_F32);
    sp.device = s->device;
    opf_tensor a, b;
    opf_tensor_wrap(&sp, (void *)src, &a);
    opf_tensor_wrap(&sp, dst, &b);
    opf_tensor_copy(s->ctx, &a, &b);  /* wrapped device memory on its own device: cannot fail */
}

void opf_delayed_state_keep_row0(opf_delayed_state *s)
{
    if (s) copy_row(s, s->kept, s->history);
}

void opf_delayed_state_rollback_row0(opf_delayed_state *s)
{
    if (s) copy_row(s, s->history, s->kept);
}

static const char NONFINITE_KEY[] = "delayed scaling: non-finite amax";

/* Once per context, whichever state meets one first. */
static void warn_nonfinite(opf_ctx *ctx, const opf_delayed_state *s, uint64_t count)
{
    if (s->reject)
        opf_ctx_warn_once(ctx, NONFINITE_KEY, "delayed scaling: %llu non-finite amax(es) so far "
                          "(an infinity or NaN in a quantized tensor), kept out of the amax "
                          "history (reject_nonfinite_amax): those slots kept their scales for "
                          "that step", (unsigned long long)count);
    else
        opf_ctx_warn_once(ctx, NONFINITE_KEY, "delayed scaling: %llu non-finite amax(es) so far "
                          "(an infinity or NaN in a quantized tensor), rolled into the amax "
                          "history as the anchor does: a slot's scale then holds for up to %d "
                          "more steps; opf_recipe.reject_nonfinite_amax keeps them out",
                          (unsigned long long)count, s->len - 1);
}

/* reduced = reduce(copy of row 0). The hook is host code: on a device the
 * row makes a counted round trip (a distributed run's one host wait). */
static opf_status reduce_row0(opf_ctx *ctx, opf_delayed_state *s, opf_amax_reduce_fn reduce,
                              void *reduce_user)
{
    size_t mark = opf_ctx_scratch_mark(s->ctx);
    float *row = opf_ctx_scratch_push(s->ctx, (size_t)s->n * sizeof(float));
    opf_status st = row ? move_floats(s->ctx, s, row, s->history, (size_t)s->n, false)
                        : opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_delayed_state_update: no scratch");
    if (!st && (st = reduce(reduce_user, row, s->n)) != OPF_OK)
        st = opf_error(ctx, st, "opf_delayed_state_update: amax reduction of %d slots failed "
                       "with %s; state unchanged", s->n, opf_status_str(st));
    if (!st) st = move_floats(s->ctx, s, s->reduced, row, (size_t)s->n, true);
    opf_ctx_scratch_pop(s->ctx, mark);
    return st;
}

static opf_delayed_arrays arrays_of(const opf_delayed_state *s, bool reduced)
{
    return (opf_delayed_arrays){.history = s->history, .scale = s->scale,
                                .reduced = reduced ? s->reduced : NULL, .n = s->n, .len = s->len,
                                .nonfinite = s->nonfinite, .scaled_max = s->scaled_max,
                                .algo = s->algo, .reject_nonfinite = s->reject};
}

/* The update of states[0..count) (one device, arrays a) by its kernels k,
 * then the CPU's warnings. */
static opf_status update_batch(opf_ctx *ctx, const opf_scale_kernels *k,
                               opf_delayed_state *const *states, const opf_delayed_arrays *a,
                               int count)
{
    /* The arrays are in the memory of the states' device, so is the roll. */
    opf_status st = k->delayed_update(states[0]->ctx, a, count);
    for (int i = 0; !st && i < count; i++)
        if (states[i]->device == OPF_DEVICE_CPU && states[i]->count_host)
            warn_nonfinite(ctx, states[i], states[i]->count_host);
    return st;
}

opf_status opf_delayed_state_update(opf_ctx *ctx, opf_delayed_state *s,
                                    opf_amax_reduce_fn reduce, void *reduce_user)
{
    const char *fn = "opf_delayed_state_update";
    OPF_CHECK_NULL(ctx, fn, s);
    if (!ctx) ctx = s->ctx;
    const opf_scale_kernels *k = opf_backend_kernels(ctx, fn, s->device, OPF_KERNELS_SCALE);
    if (!k) return OPF_ERR_UNSUPPORTED;
    opf_status st = reduce ? reduce_row0(ctx, s, reduce, reduce_user) : OPF_OK;
    if (st) return st;
    opf_delayed_arrays a = arrays_of(s, reduce != NULL);
    return update_batch(ctx, k, &s, &a, 1);
}

opf_status opf_delayed_states_update(opf_ctx *ctx, opf_delayed_state *const *states, int count)
{
    const char *fn = "opf_delayed_states_update";
    /* states a kernel call: a whole seq's in one (the device splits them
     * into its launches) */
    enum { CHUNK = 256 };
    opf_delayed_state *group[CHUNK];
    opf_delayed_arrays a[CHUNK];
    int n = 0;
    opf_status first = OPF_OK;
    for (int i = 0; i <= count; i++) {
        opf_delayed_state *s = i < count ? states[i] : NULL;
        if (i < count && !s) continue;
        /* a group ends at the end, when full, or where the device or context changes */
        if (n && (!s || n == CHUNK || s->device != group[0]->device || s->ctx != group[0]->ctx)) {
            opf_ctx *c = ctx ? ctx : group[0]->ctx;
            const opf_scale_kernels *k =
                opf_backend_kernels(c, fn, group[0]->device, OPF_KERNELS_SCALE);
            opf_status st = k ? update_batch(c, k, group, a, n) : OPF_ERR_UNSUPPORTED;
            if (!first) first = st;
            n = 0;
        }
        if (s) {
            group[n] = s;
            a[n++] = arrays_of(s, false);
        }
    }
    return first;
}

void opf_delayed_state_set_reject_nonfinite(opf_delayed_state *s, bool reject)
{
    if (s) s->reject = reject;
}

int64_t opf_delayed_state_nonfinite_amaxes(opf_delayed_state *s)
{
    if (!s) return 0;
    /* A device's count: 8 bytes moved as two floats (a counted read); when
     * the read fails, the count last read. */
    uint64_t count;
    if (s->device != OPF_DEVICE_CPU &&
        !move_floats(s->ctx, s, (float *)&count, (const float *)s->nonfinite, COUNT_FLOATS, false))
        s->count_host = count;
    if (s->count_host) warn_nonfinite(s->ctx, s, s->count_host);
    return (int64_t)s->count_host;
}
