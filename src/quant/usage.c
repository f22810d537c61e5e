/* usage.c: opf_tensor_update_usage, dropping copies or deriving one copy from
 * the other where the format makes them carry the same values
 * (docs/numerics.md 4.1, 4.2, 3.4.4, 3.5). */
#include <string.h>

#include "backend/backend-impl.h"
#include "core/core-impl.h"
#include "opfuse/quant.h"

/* Can `to` be computed from `from` exactly for this spec? */
static bool derivable(const opf_spec *s, unsigned from)
{
    switch (s->scaling) {
    case OPF_SCALING_TENSOR:
    case OPF_SCALING_BLOCK_2D:
        return true;
    case OPF_SCALING_NVFP4_2D:  /* rotated columnwise values do not give the rowwise ones */
        return !(from == OPF_USAGE_COLUMNWISE && (s->flags & OPF_SPEC_NVFP4_RHT));
    case OPF_SCALING_MXFP8:
        return (s->flags & OPF_SPEC_MXFP8_2D) != 0;
    default:
        return false;
    }
}

static uint8_t get_nibble(const uint8_t *p, int64_t i) { return (p[i >> 1] >> ((i & 1) * 4)) & 0xF; }
static void set_nibble(uint8_t *p, int64_t i, uint8_t v)
{
    int sh = (int)(i & 1) * 4;
    p[i >> 1] = (uint8_t)((p[i >> 1] & ~(0xF << sh)) | (v << sh));
}

/* dst[c][r] = src[r][c] for an R x C matrix of 1-byte, 4-byte or 4-bit elements. */
static void transpose(const void *src, void *dst, int64_t R, int64_t C, int bits)
{
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) {
            if (bits == 8) ((uint8_t *)dst)[c * R + r] = ((const uint8_t *)src)[r * C + c];
            else if (bits == 32) ((float *)dst)[c * R + r] = ((const float *)src)[r * C + c];
            else set_nibble(dst, c * R + r, get_nibble(src, r * C + c));
        }
}

/* Scale of tile grid: dst (Rd x Cd padded) gets src transposed over the
 * tiles that exist (tr x tc), where element (i, j) of the tile grid lives at
 * src[(i*rep_r) * src_cols + j]; rows of src may replicate tiles (NVFP4 2D). */
static void derive_scales(const opf_spec *s, const opf_layout *L, unsigned to, opf_tensor *t)
{
    int64_t m = L->m, k = L->k;
    opf_component from_c = to == OPF_USAGE_COLUMNWISE ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV;
    opf_component to_c = to == OPF_USAGE_COLUMNWISE ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV;
    const opf_component_desc *fd = &L->comp[from_c], *td = &L->comp[to_c];
    const uint8_t *f8 = t->data[from_c];
    uint8_t *t8 = t->data[to_c];
    const float *f32 = t->data[from_c];
    float *t32 = t->data[to_c];
    switch (s->scaling) {
    case OPF_SCALING_TENSOR:
        t32[0] = f32[0];
        break;
    case OPF_SCALING_BLOCK_2D: /* tile grid [ceil(M/128)][ceil(K/128)] transposed */
        for (int64_t i = 0; i < fd->rows; i++)
            for (int64_t j = 0; j < (to == OPF_USAGE_COLUMNWISE ? opf_ceil_div(k, 128)
                                                                 : opf_ceil_div(m, 128)); j++)
                t32[j * td->cols + i] = f32[i * fd->cols + j];
        break;
    case OPF_SCALING_NVFP4_2D: /* one sf per 16x16 tile, replicated over its 16 rows */
        for (int64_t r = 0; r < td->rows && r < (to == OPF_USAGE_COLUMNWISE ? k : m); r++)
            for (int64_t j = 0; j < (to == OPF_USAGE_COLUMNWISE ? m : k) / 16; j++)
                t8[r * td->cols + j] = f8[(j * 16) * fd->cols + r / 16];
        break;
    case OPF_SCALING_MXFP8: /* 32x32 tiles: row scale [m][kb], col scale [mb][k] */
        if (to == OPF_USAGE_COLUMNWISE) {
            for (int64_t mb = 0; mb < m / 32; mb++)
                for (int64_t c = 0; c < k; c++) t8[mb * td->cols + c] = f8[(mb * 32) * fd->cols + c / 32];
        } else {
            for (int64_t r = 0; r < m; r++)
                for (int64_t kb = 0; kb < k / 32; kb++) t8[r * td->cols + kb] = f8[(r / 32) * fd->cols + kb * 32];
        }
        break;
    default:
        break;
    }
}

static void derive_copy(const opf_spec *s, const opf_layout *L, unsigned to, opf_tensor *t)
{
    opf_component from_c = to == OPF_USAGE_COLUMNWISE ? OPF_COMP_DATA : OPF_COMP_COL_DATA;
    opf_component to_c = to == OPF_USAGE_COLUMNWISE ? OPF_COMP_COL_DATA : OPF_COMP_DATA;
    const opf_component_desc *fd = &L->comp[from_c];
    if (s->scaling == OPF_SCALING_MXFP8)  /* both copies [M, K], same bytes */
        memcpy(t->data[to_c], t->data[from_c], fd->nbytes);
    else
        transpose(t->data[from_c], t->data[to_c], fd->rows, fd->cols,
                  s->qdtype == OPF_E2M1 ? 4 : 8);
    derive_scales(s, L, to, t);
    if (s->scaling == OPF_SCALING_NVFP4_2D) {  /* no rotation: both amaxes are the tensor's */
        opf_component a = to == OPF_USAGE_COLUMNWISE ? OPF_COMP_COL_AMAX : OPF_COMP_AMAX;
        opf_component b = to == OPF_USAGE_COLUMNWISE ? OPF_COMP_AMAX : OPF_COMP_COL_AMAX;
        *(float *)t->data[a] = *(const float *)t->data[b];
    }
}

static opf_status drop(opf_ctx *ctx, opf_tensor *t, unsigned usage)
{
    opf_spec s = t->spec;
    s.usage = usage;
    if (!(usage & OPF_USAGE_COLUMNWISE)) s.flags &= ~(unsigned)OPF_SPEC_NVFP4_RHT;
    opf_layout L;
    if (opf_spec_layout(&s, &L))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "update_usage: %s", opf_last_error(NULL));
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (!L.comp[c].present) t->data[c] = NULL;
    t->spec = s;
    return OPF_OK;
}

/* Puts t's scale components (MXFP8 or NVFP4) into the swizzled layout or
 * back, in place, by the device's swizzle entry: each component is copied
 * into the context's workspace and swizzled from there (numerics.md 4.4). */
static opf_status swizzle_scales(opf_ctx *ctx, opf_tensor *t, bool to_swizzled)
{
    const opf_backend_i *be = opf_backend_get(t->spec.device);
    if (!be || !be->scale || !be->elem)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "update_usage: no swizzle kernel on device %d",
                         (int)t->spec.device);
    opf_layout L;
    opf_status st = opf_spec_layout(&t->spec, &L);
    size_t need = 0;
    for (int c = OPF_COMP_SCALE_INV; !st && c <= OPF_COMP_COL_SCALE_INV; c += 2)
        if (L.comp[c].present && L.comp[c].nbytes > need) need = L.comp[c].nbytes;
    if (st || (st = opf_ctx_workspace_reserve(ctx, need))) return st;
    uint8_t *tmp = opf_ctx_workspace(ctx, need);
    for (int c = OPF_COMP_SCALE_INV; !st && c <= OPF_COMP_COL_SCALE_INV; c += 2) {
        const opf_component_desc *d = &L.comp[c];
        if (!d->present) continue;
        /* MXFP8 columnwise scales are stored transposed: swizzled through that view */
        bool tr = c == OPF_COMP_COL_SCALE_INV && t->spec.scaling == OPF_SCALING_MXFP8;
        st = be->elem->copy(ctx, t->data[c], tmp, d->nbytes);
        if (!st) st = be->scale->swizzle(ctx, tmp, t->data[c], tr ? d->cols : d->rows,
                                         tr ? d->rows : d->cols, tr, to_swizzled);
    }
    return st;
}

opf_status opf_tensor_update_usage(opf_ctx *ctx, opf_tensor *t, unsigned usage)
{
    const char *fn = "update_usage";
    OPF_CHECK_NULL(ctx, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, t);
    unsigned both = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE, have = t->spec.usage;
    if (t->spec.scaling == OPF_SCALING_NONE)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the tensor is not quantized", fn);
    if (!usage || (usage & ~both))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: usage 0x%x must be rowwise and/or columnwise",
                         fn, usage);
    unsigned add = usage & ~have;
    if (!add) return drop(ctx, t, usage);
    unsigned from = have & ~add;
    if (!derivable(&t->spec, from))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED,
                         "%s: %s cannot derive its %s copy from the %s copy (the copies are "
                         "quantized independently); quantize again with both usages", fn,
                         opf_scaling_name(t->spec.scaling),
                         add == OPF_USAGE_ROWWISE ? "rowwise" : "columnwise",
                         add == OPF_USAGE_ROWWISE ? "columnwise" : "rowwise");
    if (t->spec.device != OPF_DEVICE_CPU)  /* the derivation below reads the bytes on the host */
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: deriving a %s copy on %s has no kernel; "
                         "quantize again with both usages", fn,
                         add == OPF_USAGE_ROWWISE ? "rowwise" : "columnwise",
                         opf_device_name(t->spec.device));
    opf_spec s = t->spec;
    s.usage = have | add;
    s.flags &= ~(unsigned)OPF_SPEC_SWIZZLED;
    opf_tensor n;
    opf_status st = opf_tensor_alloc(ctx, &s, &n);
    if (st) return st;
    opf_tensor old = *t;
    bool swz = (old.spec.flags & OPF_SPEC_SWIZZLED) != 0;
    opf_layout L, Lo;
    opf_spec_layout(&s, &L);
    opf_spec_layout(&old.spec, &Lo);
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (old.data[c]) memcpy(n.data[c], old.data[c], Lo.comp[c].nbytes);
    n.spec.flags = old.spec.flags;  /* copied scales are still in the old layout */
    if (swz && (st = swizzle_scales(ctx, &n, false))) goto fail;
    n.spec.flags &= ~(unsigned)OPF_SPEC_SWIZZLED;
    derive_copy(&s, &L, add, &n);
    if (swz && (st = swizzle_scales(ctx, &n, true))) goto fail;
    n.spec.flags = old.spec.flags;
    if (usage != n.spec.usage && (st = drop(ctx, &n, usage))) goto fail;
    opf_tensor_release(t);
    *t = n;
    return OPF_OK;
fail:
    opf_tensor_release(&n);
    return st;
}
