/* layout.c: specs and opf_spec_layout, the single source of every size
 * (docs/numerics.md section 4.2 for the quantized formats). */
#include <stdio.h>
#include <string.h>

#include "core/core-impl.h"
#include "core/size-impl.h"

static const char *const scaling_names[] = {
    [OPF_SCALING_NONE] = "none",         [OPF_SCALING_TENSOR] = "fp8",
    [OPF_SCALING_MXFP8] = "mxfp8",       [OPF_SCALING_BLOCK_1D] = "fp8-block1d",
    [OPF_SCALING_BLOCK_2D] = "fp8-block2d", [OPF_SCALING_NVFP4_1D] = "nvfp4",
    [OPF_SCALING_NVFP4_2D] = "nvfp4-2d",
};
_Static_assert(sizeof(scaling_names) / sizeof(scaling_names[0]) == OPF_SCALING_COUNT,
               "scaling_names must list every opf_scaling");

const char *opf_scaling_name(opf_scaling s)
{
    return (unsigned)s < OPF_SCALING_COUNT ? scaling_names[s] : "invalid";
}

opf_spec opf_spec_make(int ndim, const int64_t *shape, opf_dtype dtype)
{
    opf_spec s;
    memset(&s, 0, sizeof s);
    s.ndim = ndim;
    for (int i = 0; i < ndim && i < OPF_MAX_DIMS; i++) s.shape[i] = shape[i];
    s.dtype = dtype;
    return s;
}

int64_t opf_spec_numel(const opf_spec *spec)
{
    int64_t n;
    return opf_numel_checked(spec->ndim, spec->shape, &n) ? n : -1;
}

void opf_shape_2d(const opf_spec *s, int64_t *m, int64_t *k)
{
    int64_t rows = 1;
    for (int i = 0; i + 1 < s->ndim; i++) rows *= s->shape[i];
    *m = rows;
    *k = s->ndim > 0 ? s->shape[s->ndim - 1] : 1;
}

bool opf_spec_equal(const opf_spec *a, const opf_spec *b)
{
    if (a->ndim != b->ndim || a->dtype != b->dtype || a->device != b->device ||
        a->scaling != b->scaling)
        return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    if (a->scaling == OPF_SCALING_NONE) return true;
    return a->qdtype == b->qdtype && a->usage == b->usage && a->flags == b->flags;
}

void opf_spec_str(const opf_spec *spec, char *buf, size_t size)
{
    if (!size) return;
    int n = snprintf(buf, size, "%s[", opf_dtype_name(spec->dtype));
    if (spec->ndim < 0 || spec->ndim > OPF_MAX_DIMS) {
        if (n > 0 && (size_t)n < size) snprintf(buf + n, size - n, "ndim %d]", spec->ndim);
        return;
    }
    for (int i = 0; i < spec->ndim && n > 0 && (size_t)n < size; i++)
        n += snprintf(buf + n, size - n, "%s%lld", i ? "," : "", (long long)spec->shape[i]);
    if (n > 0 && (size_t)n < size) n += snprintf(buf + n, size - n, "]");
    if (spec->scaling != OPF_SCALING_NONE && n > 0 && (size_t)n < size) {
        const char *use = spec->usage == (OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE) ? "row+col"
                        : spec->usage == OPF_USAGE_ROWWISE ? "row"
                        : spec->usage == OPF_USAGE_COLUMNWISE ? "col" : "none";
        snprintf(buf + n, size - n, " %s(%s,%s%s)", opf_scaling_name(spec->scaling),
                 opf_dtype_name(spec->qdtype), use,
                 (spec->flags & OPF_SPEC_SWIZZLED) ? ",swizzled" : "");
    }
}

/* Per format: the element dtypes it may hold and the multiple M and K must be. */
typedef struct format_rule {
    opf_dtype qdtype_a, qdtype_b;  /* allowed element dtypes */
    int64_t   multiple;            /* M and K must be multiples of this (1 = any) */
} format_rule;

static const format_rule format_rules[OPF_SCALING_COUNT] = {
    [OPF_SCALING_TENSOR]   = {OPF_E4M3, OPF_E5M2, 1},
    [OPF_SCALING_MXFP8]    = {OPF_E4M3, OPF_E5M2, 32},
    [OPF_SCALING_BLOCK_1D] = {OPF_E4M3, OPF_E5M2, 1},
    [OPF_SCALING_BLOCK_2D] = {OPF_E4M3, OPF_E5M2, 1},
    [OPF_SCALING_NVFP4_1D] = {OPF_E2M1, OPF_E2M1, 16},
    [OPF_SCALING_NVFP4_2D] = {OPF_E2M1, OPF_E2M1, 16},
};

/* A component too large for OPF_MAX_BYTES gets nbytes SIZE_MAX, which
 * opf_spec_layout's checked sum refuses. */
static void set_comp(opf_layout *L, opf_component c, opf_dtype dt, int64_t rows, int64_t cols)
{
    opf_component_desc *d = &L->comp[c];
    size_t n;
    d->present = true;
    d->dtype = dt;
    d->rows = rows;
    d->cols = cols;
    d->nbytes = opf_mul_size((size_t)rows, (size_t)cols, &n) ? opf_dtype_nbytes(dt, n) : SIZE_MAX;
}

static opf_status check_spec(const opf_spec *s, int64_t m, int64_t k)
{
    const char *fn = "opf_spec_layout";
    if (s->ndim < 0 || s->ndim > OPF_MAX_DIMS)
        return opf_error(NULL, OPF_ERR_SHAPE, "%s: ndim %d outside 0..%d", fn, s->ndim,
                         OPF_MAX_DIMS);
    for (int i = 0; i < s->ndim; i++)
        if (s->shape[i] < 0)
            return opf_error(NULL, OPF_ERR_SHAPE, "%s: dim %d is %lld", fn, i,
                             (long long)s->shape[i]);
    int64_t numel;
    if (!opf_numel_checked(s->ndim, s->shape, &numel)) {
        char str[160];
        opf_spec_str(s, str, sizeof str);
        return opf_error(NULL, OPF_ERR_SHAPE, "%s: %s has more than %lld elements", fn, str,
                         (long long)OPF_MAX_NUMEL);
    }
    if ((unsigned)s->device >= OPF_DEVICE_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: device %d", fn, (int)s->device);
    if ((unsigned)s->dtype >= OPF_DTYPE_COUNT)
        return opf_error(NULL, OPF_ERR_DTYPE, "%s: dtype %d", fn, (int)s->dtype);
    if ((unsigned)s->scaling >= OPF_SCALING_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: scaling mode %d", fn, (int)s->scaling);
    if (s->scaling == OPF_SCALING_NONE) return OPF_OK;

    const format_rule *r = &format_rules[s->scaling];
    const char *mode = opf_scaling_name(s->scaling);
    if (s->dtype != OPF_F32 && s->dtype != OPF_BF16 && s->dtype != OPF_F16)
        return opf_error(NULL, OPF_ERR_DTYPE, "%s: %s needs an f32/bf16/f16 logical dtype, got %s",
                         fn, mode, opf_dtype_name(s->dtype));
    if (s->qdtype != r->qdtype_a && s->qdtype != r->qdtype_b)
        return opf_error(NULL, OPF_ERR_DTYPE, "%s: %s cannot hold %s elements", fn, mode,
                         opf_dtype_name(s->qdtype));
    if (s->ndim < 1)
        return opf_error(NULL, OPF_ERR_SHAPE, "%s: %s needs at least 1 dim", fn, mode);
    if (m % r->multiple || k % r->multiple)
        return opf_error(NULL, OPF_ERR_SHAPE,
                         "%s: %s needs both dims of the 2D view to be multiples of %lld, "
                         "got [%lld, %lld]",
                         fn, mode, (long long)r->multiple, (long long)m, (long long)k);
    unsigned both = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    if (!(s->usage & both) || (s->usage & ~both))
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: %s usage 0x%x must be rowwise and/or "
                         "columnwise", fn, mode, s->usage);
    if ((s->flags & OPF_SPEC_SWIZZLED) && s->scaling != OPF_SCALING_MXFP8 &&
        s->scaling != OPF_SCALING_NVFP4_1D && s->scaling != OPF_SCALING_NVFP4_2D)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: %s scales have no swizzled layout", fn,
                         mode);
    if ((s->flags & OPF_SPEC_NVFP4_RHT) && s->scaling != OPF_SCALING_NVFP4_1D &&
        s->scaling != OPF_SCALING_NVFP4_2D)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: the Hadamard flag is for nvfp4, not %s",
                         fn, mode);
    if ((s->flags & OPF_SPEC_MXFP8_2D) && s->scaling != OPF_SCALING_MXFP8)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: the 32x32 flag is for mxfp8, not %s", fn,
                         mode);
    return OPF_OK;
}

/* Components of each quantized format, numerics.md 4.2. */
static void quantized_components(const opf_spec *s, int64_t m, int64_t k, opf_layout *L)
{
    bool row = s->usage & OPF_USAGE_ROWWISE, col = s->usage & OPF_USAGE_COLUMNWISE;
    opf_dtype q = s->qdtype;
    switch (s->scaling) {
    case OPF_SCALING_TENSOR:
        if (row) set_comp(L, OPF_COMP_DATA, q, m, k), set_comp(L, OPF_COMP_SCALE_INV, OPF_F32, 1, 1);
        if (col) set_comp(L, OPF_COMP_COL_DATA, q, k, m),
                 set_comp(L, OPF_COMP_COL_SCALE_INV, OPF_F32, 1, 1);
        set_comp(L, OPF_COMP_AMAX, OPF_F32, 1, 1);
        break;
    case OPF_SCALING_MXFP8:
        if (row) set_comp(L, OPF_COMP_DATA, q, m, k),
                 set_comp(L, OPF_COMP_SCALE_INV, OPF_E8M0, opf_round_up(m, 128),
                          opf_round_up(k / 32, 4));
        if (col) set_comp(L, OPF_COMP_COL_DATA, q, m, k),
                 set_comp(L, OPF_COMP_COL_SCALE_INV, OPF_E8M0, opf_round_up(m / 32, 4),
                          opf_round_up(k, 128));
        break;
    case OPF_SCALING_BLOCK_1D:
        if (row) set_comp(L, OPF_COMP_DATA, q, m, k),
                 set_comp(L, OPF_COMP_SCALE_INV, OPF_F32, opf_ceil_div(k, 128), opf_round_up(m, 4));
        if (col) set_comp(L, OPF_COMP_COL_DATA, q, k, m),
                 set_comp(L, OPF_COMP_COL_SCALE_INV, OPF_F32, opf_ceil_div(m, 128),
                          opf_round_up(k, 4));
        break;
    case OPF_SCALING_BLOCK_2D:
        if (row) set_comp(L, OPF_COMP_DATA, q, m, k),
                 set_comp(L, OPF_COMP_SCALE_INV, OPF_F32, opf_ceil_div(m, 128),
                          opf_round_up(opf_ceil_div(k, 128), 4));
        if (col) set_comp(L, OPF_COMP_COL_DATA, q, k, m),
                 set_comp(L, OPF_COMP_COL_SCALE_INV, OPF_F32, opf_ceil_div(k, 128),
                          opf_round_up(opf_ceil_div(m, 128), 4));
        break;
    case OPF_SCALING_NVFP4_1D:
    case OPF_SCALING_NVFP4_2D:
        if (row) set_comp(L, OPF_COMP_DATA, q, m, k),
                 set_comp(L, OPF_COMP_SCALE_INV, OPF_E4M3, opf_round_up(m, 128),
                          opf_round_up(k / 16, 4));
        if (col) set_comp(L, OPF_COMP_COL_DATA, q, k, m),
                 set_comp(L, OPF_COMP_COL_SCALE_INV, OPF_E4M3, opf_round_up(k, 128),
                          opf_round_up(m / 16, 4));
        set_comp(L, OPF_COMP_AMAX, OPF_F32, 1, 1);
        set_comp(L, OPF_COMP_COL_AMAX, OPF_F32, 1, 1);
        break;
    default:
        break;
    }
}

opf_status opf_spec_layout(const opf_spec *spec, opf_layout *out)
{
    OPF_CHECK_NULL(NULL, "opf_spec_layout", spec);
    OPF_CHECK_NULL(NULL, "opf_spec_layout", out);
    int64_t m = 0, k = 0, numel;
    if (opf_numel_checked(spec->ndim, spec->shape, &numel)) opf_shape_2d(spec, &m, &k);
    opf_status st = check_spec(spec, m, k);
    if (st) return st;
    opf_layout L;
    memset(&L, 0, sizeof L);
    L.m = m;
    L.k = k;
    if (spec->scaling == OPF_SCALING_NONE)
        set_comp(&L, OPF_COMP_DATA, spec->dtype, m, k);
    else
        quantized_components(spec, m, k, &L);
    size_t off = 0;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (!L.comp[c].present) continue;
        L.comp[c].offset = off;
        size_t padded;
        if (!opf_add_size(L.comp[c].nbytes, OPF_COMPONENT_ALIGN - 1, &padded) ||
            !opf_add_size(off, padded / OPF_COMPONENT_ALIGN * OPF_COMPONENT_ALIGN, &off)) {
            char str[160];
            opf_spec_str(spec, str, sizeof str);
            return opf_error(NULL, OPF_ERR_SHAPE, "opf_spec_layout: %s needs more than %lld bytes",
                             str, (long long)OPF_MAX_BYTES);
        }
    }
    L.total_bytes = off;
    *out = L;
    return OPF_OK;
}
