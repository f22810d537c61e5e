/* tensor.c: reference-counted buffers, tensors over them, scale swizzling. */
#include <stdatomic.h>
#include <string.h>

#include "core/context-impl.h"
#include "core/core-impl.h"
#include "core/device-impl.h"

struct opf_buffer {
    atomic_int refs;
    opf_ctx   *ctx;    /* whose allocator owns `mem` */
    void      *mem;    /* in the free list: the next free header */
    size_t     bytes;
    opf_device device; /* CPU: ctx's allocator; else its device runtime */
};

/* Headers come from 4 KiB slabs (the allocator's smallest size class), one
 * cache line of each holding the chain of slabs, the rest cut into headers. */
enum { SLAB_BYTES = 4096, SLAB_LINK = 64 };

static void header_put(opf_ctx *ctx, opf_buffer *b)
{
    b->mem = ctx->free_headers;
    ctx->free_headers = b;
}

static opf_buffer *header_get(opf_ctx *ctx)
{
    if (!ctx->free_headers) {
        char *slab = opf_ctx_alloc(ctx, SLAB_BYTES);
        if (!slab) return NULL;
        *(void **)slab = ctx->header_slabs;
        ctx->header_slabs = slab;
        for (size_t off = SLAB_LINK; off + sizeof(opf_buffer) <= SLAB_BYTES;
             off += sizeof(opf_buffer))
            header_put(ctx, (opf_buffer *)(slab + off));
    }
    opf_buffer *b = ctx->free_headers;
    ctx->free_headers = b->mem;
    return b;
}

void opf_buffer_slabs_free(opf_ctx *ctx)
{
    while (ctx->header_slabs) {
        void *slab = ctx->header_slabs;
        ctx->header_slabs = *(void **)slab;
        opf_ctx_free(ctx, slab, SLAB_BYTES);
    }
    ctx->free_headers = NULL;
}

static void point_into(opf_tensor *t, const opf_spec *spec, const opf_layout *L, void *base)
{
    opf_spec s = *spec;  /* spec may point into *t */
    memset(t, 0, sizeof *t);
    t->spec = s;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L->comp[c].present) t->data[c] = (char *)base + L->comp[c].offset;
}

/* The memory of a buffer on dev: the counting allocator for the host, the
 * context's runtime for its device. */
static opf_status buffer_mem(opf_ctx *ctx, opf_device dev, size_t bytes, void **mem)
{
    if (dev != OPF_DEVICE_CPU) {
        opf_status st = opf_device_alloc(ctx, bytes, mem);
        return st ? opf_error(ctx, st, "opf_tensor_alloc: %s", ctx->error) : OPF_OK;
    }
    *mem = opf_ctx_alloc(ctx, bytes);
    return *mem ? OPF_OK : opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_tensor_alloc: cannot allocate "
                                     "%zu bytes", bytes);
}

/* Scales are zero in their padding (numerics.md 4.1 leaves it undefined;
 * zero keeps dumps and checkpoints deterministic). */
static opf_status zero_scales(opf_ctx *ctx, const opf_layout *L, opf_tensor *t)
{
    for (int c = OPF_COMP_SCALE_INV; c < OPF_COMP_COUNT; c++) {
        if (c == OPF_COMP_COL_DATA || !L->comp[c].present) continue;
        if (t->spec.device == OPF_DEVICE_CPU) {
            memset(t->data[c], 0, L->comp[c].nbytes);
        } else {
            opf_status st = ctx->rt->memset(ctx, t->data[c], 0, L->comp[c].nbytes);
            if (st) return st;
        }
    }
    return OPF_OK;
}

opf_status opf_tensor_alloc(opf_ctx *ctx, const opf_spec *spec, opf_tensor *out)
{
    OPF_CHECK_NULL(ctx, "opf_tensor_alloc", out);
    memset(out, 0, sizeof *out);
    OPF_CHECK_NULL(ctx, "opf_tensor_alloc", ctx);
    OPF_CHECK_NULL(ctx, "opf_tensor_alloc", spec);
    opf_layout L;
    opf_status st = opf_spec_layout(spec, &L);
    if (st) return opf_error(ctx, st, "%s", opf_last_error(NULL));
    if ((st = opf_device_check(ctx, "opf_tensor_alloc", "the spec", spec->device))) return st;
    size_t bytes = L.total_bytes ? L.total_bytes : 1;
    opf_buffer *b = header_get(ctx);
    if (!b)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_tensor_alloc: cannot allocate a buffer "
                         "header");
    void *mem = NULL;
    if ((st = buffer_mem(ctx, spec->device, bytes, &mem))) {
        header_put(ctx, b);
        return st;
    }
    ctx->live_buffers++;
    atomic_init(&b->refs, 1);
    b->ctx = ctx;
    b->mem = mem;
    b->bytes = bytes;
    b->device = spec->device;
    point_into(out, spec, &L, mem);
    out->buf = b;
    if ((st = zero_scales(ctx, &L, out))) opf_tensor_release(out);
    return st;
}

opf_status opf_tensor_wrap(const opf_spec *spec, void *base, opf_tensor *out)
{
    OPF_CHECK_NULL(NULL, "opf_tensor_wrap", out);
    OPF_CHECK_NULL(NULL, "opf_tensor_wrap", spec);
    opf_layout L;
    opf_status st = opf_spec_layout(spec, &L);
    if (st) return st;
    if (!base && L.total_bytes)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "opf_tensor_wrap: base is NULL for %zu bytes",
                         L.total_bytes);
    point_into(out, spec, &L, base);
    return OPF_OK;
}

void opf_tensor_retain(const opf_tensor *src, opf_tensor *dst)
{
    *dst = *src;
    if (src->buf) atomic_fetch_add(&src->buf->refs, 1);
}

void opf_tensor_release(opf_tensor *t)
{
    if (!t) return;
    opf_buffer *b = t->buf;
    if (b && atomic_fetch_sub(&b->refs, 1) == 1) {
        opf_ctx *ctx = b->ctx;
        if (b->device == OPF_DEVICE_CPU) opf_ctx_free(ctx, b->mem, b->bytes);
        else opf_device_free(ctx, b->mem, b->bytes);
        header_put(ctx, b);
        if (--ctx->live_buffers == 0 && ctx->destroyed) opf_ctx_finish(ctx);
    }
    memset(t, 0, sizeof *t);
}

size_t opf_tensor_buffer_bytes(const opf_tensor *t) { return t && t->buf ? t->buf->bytes : 0; }

/* ---- swizzle (numerics.md 4.4) ---------------------------------------------- */

size_t opf_swizzle_index(int64_t i, int64_t j, int64_t C)
{
    return (size_t)(((i / 128) * (C / 4) + (j / 4)) * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 +
                    (j % 4));
}

static opf_status check_swizzle_dims(const char *fn, const void *src, const void *dst, int64_t R,
                                     int64_t C)
{
    OPF_CHECK_NULL(NULL, fn, src);
    OPF_CHECK_NULL(NULL, fn, dst);
    if (R < 0 || C < 0 || R % 128 || C % 4)
        return opf_error(NULL, OPF_ERR_SHAPE,
                         "%s: scales are %lld x %lld; rows must be a multiple of 128 and "
                         "columns of 4", fn, (long long)R, (long long)C);
    return OPF_OK;
}

opf_status opf_swizzle_scales(const uint8_t *src, uint8_t *dst, int64_t R, int64_t C,
                              bool src_is_transposed)
{
    opf_status st = check_swizzle_dims("opf_swizzle_scales", src, dst, R, C);
    if (st) return st;
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < C; j++)
            dst[opf_swizzle_index(i, j, C)] = src_is_transposed ? src[j * R + i] : src[i * C + j];
    return OPF_OK;
}

opf_status opf_unswizzle_scales(const uint8_t *src, uint8_t *dst, int64_t R, int64_t C,
                                bool dst_is_transposed)
{
    opf_status st = check_swizzle_dims("opf_unswizzle_scales", src, dst, R, C);
    if (st) return st;
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < C; j++) {
            uint8_t v = src[opf_swizzle_index(i, j, C)];
            if (dst_is_transposed) dst[j * R + i] = v;
            else dst[i * C + j] = v;
        }
    return OPF_OK;
}

/* One scale component: its swizzle matrix is R x C; MXFP8 columnwise scales
 * are stored C x R (compact) and swizzled through the transposed view. */
static opf_status swizzle_component(opf_ctx *ctx, const opf_component_desc *d, uint8_t *p,
                                    bool transposed, bool to_swizzled)
{
    int64_t R = transposed ? d->cols : d->rows, C = transposed ? d->rows : d->cols;
    uint8_t *tmp = opf_ctx_workspace(ctx, d->nbytes);
    if (!tmp) return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_tensor_swizzle: no workspace");
    memcpy(tmp, p, d->nbytes);
    return to_swizzled ? opf_swizzle_scales(tmp, p, R, C, transposed)
                       : opf_unswizzle_scales(tmp, p, R, C, transposed);
}

opf_status opf_tensor_swizzle(opf_ctx *ctx, opf_tensor *t, bool swizzled)
{
    OPF_CHECK_NULL(ctx, "opf_tensor_swizzle", ctx);
    OPF_CHECK_NULL(ctx, "opf_tensor_swizzle", t);
    opf_scaling s = t->spec.scaling;
    bool mx = s == OPF_SCALING_MXFP8;
    if (!mx && s != OPF_SCALING_NVFP4_1D && s != OPF_SCALING_NVFP4_2D)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED,
                         "opf_tensor_swizzle: %s scales have no swizzled layout",
                         opf_scaling_name(s));
    if (((t->spec.flags & OPF_SPEC_SWIZZLED) != 0) == swizzled) return OPF_OK;
    if (t->spec.device != OPF_DEVICE_CPU)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "opf_tensor_swizzle: the tensor is on %s; "
                         "scales are swizzled on the host only (quantize with swizzled set)",
                         opf_device_name(t->spec.device));
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    if (st) return opf_error(ctx, st, "%s", opf_last_error(NULL));
    size_t need = 0;
    for (int c = OPF_COMP_SCALE_INV; c <= OPF_COMP_COL_SCALE_INV; c += 2)
        if (L.comp[c].present && L.comp[c].nbytes > need) need = L.comp[c].nbytes;
    if ((st = opf_ctx_workspace_reserve(ctx, need))) return st;
    if (L.comp[OPF_COMP_SCALE_INV].present)
        swizzle_component(ctx, &L.comp[OPF_COMP_SCALE_INV], t->data[OPF_COMP_SCALE_INV], false,
                          swizzled);
    if (L.comp[OPF_COMP_COL_SCALE_INV].present)
        swizzle_component(ctx, &L.comp[OPF_COMP_COL_SCALE_INV], t->data[OPF_COMP_COL_SCALE_INV],
                          mx, swizzled);
    t->spec.flags ^= OPF_SPEC_SWIZZLED;
    return OPF_OK;
}
