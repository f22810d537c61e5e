/* device.c: where tensors live: device names, the one-device-per-call rule
 * every dispatcher checks, counted device memory and copies between
 * devices (through the runtime of device-impl.h). */
#include <stdio.h>
#include <string.h>

#include "core/context-impl.h"
#include "core/core-impl.h"
#include "core/device-impl.h"

const char *opf_device_name(opf_device d)
{
    static const char *const names[] = {[OPF_DEVICE_CPU] = "cpu", [OPF_DEVICE_CUDA] = "cuda"};
    static _Thread_local char other[24];
    if ((unsigned)d < OPF_DEVICE_COUNT) return names[d];
    snprintf(other, sizeof other, "device %d", (int)d);
    return other;
}

opf_status opf_device_check(opf_ctx *ctx, const char *fn, const char *what, opf_device dev)
{
    if ((unsigned)dev >= OPF_DEVICE_COUNT)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s is on device %d, not a device", fn,
                         what, (int)dev);
    /* Host memory is reachable from every context; a device's only from a
     * context of that device. */
    if (dev == OPF_DEVICE_CPU || !ctx || dev == ctx->device) return OPF_OK;
    return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s is on %s, the context on %s", fn, what,
                     opf_device_name(dev), opf_device_name(ctx->device));
}

opf_status opf_same_device(opf_ctx *ctx, const char *fn, int n, const opf_spec *const specs[],
                           const char *const names[], opf_device *out)
{
    int first = -1;
    for (int i = 0; i < n; i++) {
        if (!specs[i]) continue;
        if (first < 0) {
            first = i;
        } else if (specs[i]->device != specs[first]->device) {
            const char *a = names[first], *b = names[i];
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s is on %s, %s on %s (the tensors of "
                             "one call must be on one device; opf_tensor_to moves them)", fn, a,
                             opf_device_name(specs[first]->device), b,
                             opf_device_name(specs[i]->device));
        }
    }
    opf_device dev = first < 0 ? OPF_DEVICE_CPU : specs[first]->device;
    opf_status st = opf_device_check(ctx, fn, first < 0 ? "the call" : names[first], dev);
    if (!st && out) *out = dev;
    return st;
}

/* ---- device memory, counted as the host allocator counts ------------------ */

opf_status opf_device_alloc(opf_ctx *ctx, size_t bytes, void **out)
{
    opf_status st = ctx->rt->alloc(ctx, bytes, out);
    if (st) return st;
    opf_alloc_stats *s = &ctx->device_stats;
    s->n_alloc++;
    s->bytes_live += bytes;
    if (s->bytes_live > s->bytes_peak) s->bytes_peak = s->bytes_live;
    return OPF_OK;
}

void opf_device_free(opf_ctx *ctx, void *ptr, size_t bytes)
{
    if (!ptr) return;
    ctx->rt->free(ctx, ptr);
    ctx->device_stats.n_free++;
    ctx->device_stats.bytes_live -= bytes;
}

opf_status opf_device_memset(opf_ctx *ctx, opf_device dev, void *p, int value, size_t n)
{
    if (!n) return OPF_OK;
    if (dev == OPF_DEVICE_CPU || !ctx->rt) {
        memset(p, value, n);
        return OPF_OK;
    }
    return ctx->rt->memset(ctx, p, value, n);
}

/* ---- graph capture (the compiler's replays) ------------------------------- */

bool opf_device_can_capture(const opf_ctx *ctx)
{
    return ctx->rt && ctx->rt->capture_begin && ctx->rt->capture_end && ctx->rt->graph_launch;
}

static opf_status no_capture(opf_ctx *ctx, const char *fn)
{
    return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: %s cannot capture its work into graphs", fn,
                     ctx->rt ? ctx->rt->name : opf_device_name(ctx->device));
}

opf_status opf_device_capture_begin(opf_ctx *ctx)
{
    return opf_device_can_capture(ctx) ? ctx->rt->capture_begin(ctx)
                                       : no_capture(ctx, "opf_device_capture_begin");
}

opf_status opf_device_capture_end(opf_ctx *ctx, void **graph)
{
    *graph = NULL;
    return opf_device_can_capture(ctx) ? ctx->rt->capture_end(ctx, graph)
                                       : no_capture(ctx, "opf_device_capture_end");
}

opf_status opf_device_graph_launch(opf_ctx *ctx, void *graph)
{
    return opf_device_can_capture(ctx) ? ctx->rt->graph_launch(ctx, graph)
                                       : no_capture(ctx, "opf_device_graph_launch");
}

void opf_device_graph_free(opf_ctx *ctx, void *graph)
{
    if (graph && ctx->rt && ctx->rt->graph_free) ctx->rt->graph_free(ctx, graph);
}

opf_status opf_device_scratch_reserve(opf_ctx *ctx, size_t bytes)
{
    return ctx->rt && ctx->rt->scratch_reserve ? ctx->rt->scratch_reserve(ctx, bytes) : OPF_OK;
}

opf_status opf_device_side_fork(opf_ctx *ctx, int64_t out_elems, bool *forked)
{
    *forked = false;
    return ctx->rt && ctx->rt->side_fork ? ctx->rt->side_fork(ctx, out_elems, forked) : OPF_OK;
}

opf_status opf_device_side_enter(opf_ctx *ctx) { return ctx->rt->side_enter(ctx); }
opf_status opf_device_side_join(opf_ctx *ctx) { return ctx->rt->side_join(ctx); }

/* ---- copies ---------------------------------------------------------------- */

static opf_status copy_bytes(opf_ctx *ctx, void *dst, opf_device to, const void *src,
                             opf_device from, size_t bytes)
{
    if (from == OPF_DEVICE_CPU && to == OPF_DEVICE_CPU) {
        memmove(dst, src, bytes);
        return OPF_OK;
    }
    opf_copy_kind kind = from == OPF_DEVICE_CPU ? OPF_COPY_H2D
                       : to == OPF_DEVICE_CPU   ? OPF_COPY_D2H
                                                : OPF_COPY_D2D;
    return ctx->rt->copy(ctx, dst, src, bytes, kind);
}

opf_status opf_tensor_copy(opf_ctx *ctx, const opf_tensor *src, opf_tensor *dst)
{
    const char *fn = "opf_tensor_copy";
    OPF_CHECK_NULL(ctx, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, src);
    OPF_CHECK_NULL(ctx, fn, dst);
    opf_spec a = src->spec, b = dst->spec;
    a.device = b.device = OPF_DEVICE_CPU;
    if (!opf_spec_equal(&a, &b)) {
        char x[160], y[160];
        opf_spec_str(&src->spec, x, sizeof x);
        opf_spec_str(&dst->spec, y, sizeof y);
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: source is %s, destination %s", fn, x, y);
    }
    opf_status st;
    if ((st = opf_device_check(ctx, fn, "the source", src->spec.device)) ||
        (st = opf_device_check(ctx, fn, "the destination", dst->spec.device)))
        return st;
    opf_layout L;
    if ((st = opf_spec_layout(&a, &L))) return opf_error(ctx, st, "%s: %s", fn, opf_last_error(NULL));
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && L.comp[c].nbytes && (!src->data[c] || !dst->data[c]))
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the %s has no memory for component %d",
                             fn, src->data[c] ? "destination" : "source", c);
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && L.comp[c].nbytes && src->data[c] != dst->data[c] &&
            (st = copy_bytes(ctx, dst->data[c], dst->spec.device, src->data[c], src->spec.device,
                             L.comp[c].nbytes)))
            return st;
    return OPF_OK;
}

opf_status opf_tensor_to(opf_ctx *ctx, const opf_tensor *src, opf_device dev, opf_tensor *out)
{
    const char *fn = "opf_tensor_to";
    OPF_CHECK_NULL(ctx, fn, out);
    OPF_CHECK_NULL(ctx, fn, src);
    opf_spec s = src->spec;
    s.device = dev;
    opf_tensor t;
    opf_status st = opf_tensor_alloc(ctx, &s, &t);
    if (!st && (st = opf_tensor_copy(ctx, src, &t))) opf_tensor_release(&t);
    if (!st) *out = t;
    return st;
}
