/* gemm.c: opf_gemm, the GEMM entry of the quant layer. It checks operands,
 * output and options against docs/numerics.md 5.1-5.5 (layout convention,
 * copy selection, format pairs, shapes, output dtypes) and then runs the
 * device's GEMM kernel. opf_gemm_out_spec (the fake) runs the same operand
 * checks, so real and fake fail alike. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "quant/quant-impl.h"
#include "core/core-impl.h"

#define GEMM_MSG 320

/* The op name of each layout in messages (no formatting on the success path). */
static const char *const layout_names[] = {
    [OPF_GEMM_TN] = "gemm TN",
    [OPF_GEMM_NN] = "gemm NN",
    [OPF_GEMM_NT] = "gemm NT",
};
_Static_assert(sizeof(layout_names) / sizeof(layout_names[0]) == OPF_GEMM_LAYOUT_COUNT,
               "layout_names must list every opf_gemm_layout");

/* Where K sits in each operand's 2D view (0 = rows, 1 = cols), 5.1: TN A [N,K]
 * B [M,K]; NN A [K,N] B [M,K]; NT A [K,N] B [K,M]. An operand whose K is its
 * column dim uses its rowwise copy, else its columnwise copy. */
static const struct { int a_k, b_k; } layout_rules[] = {
    [OPF_GEMM_TN] = {1, 1},
    [OPF_GEMM_NN] = {0, 1},
    [OPF_GEMM_NT] = {0, 0},
};
_Static_assert(sizeof(layout_rules) / sizeof(layout_rules[0]) == OPF_GEMM_LAYOUT_COUNT,
               "layout_rules must list every opf_gemm_layout");

/* Formats that can multiply with each other. */
enum { FAM_PLAIN, FAM_FP8, FAM_MXFP8, FAM_BLOCK, FAM_NVFP4 };
static const int scaling_family[] = {
    [OPF_SCALING_NONE] = FAM_PLAIN,      [OPF_SCALING_TENSOR] = FAM_FP8,
    [OPF_SCALING_MXFP8] = FAM_MXFP8,     [OPF_SCALING_BLOCK_1D] = FAM_BLOCK,
    [OPF_SCALING_BLOCK_2D] = FAM_BLOCK,  [OPF_SCALING_NVFP4_1D] = FAM_NVFP4,
    [OPF_SCALING_NVFP4_2D] = FAM_NVFP4,
};
_Static_assert(sizeof(scaling_family) / sizeof(scaling_family[0]) == OPF_SCALING_COUNT,
               "scaling_family must list every opf_scaling");

static bool is_float_plain(opf_dtype d) { return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16; }

opf_gemm_options opf_gemm_options_default(void)
{
    opf_gemm_options o;
    memset(&o, 0, sizeof o);
    o.alpha = 1.0f;
    o.beta = 1.0f;
    return o;
}

/* What an operand is, for messages: "mxfp8(e4m3)" or "plain bf16". */
static void describe(const opf_spec *s, char *buf, size_t size)
{
    if (s->scaling == OPF_SCALING_NONE)
        snprintf(buf, size, "plain %s", opf_dtype_name(s->dtype));
    else
        snprintf(buf, size, "%s(%s)", opf_scaling_name(s->scaling), opf_dtype_name(s->qdtype));
}

static const char *copy_name(bool rowwise) { return rowwise ? "rowwise" : "columnwise"; }

static const char *usage_name(unsigned u)
{
    switch (u & (OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE)) {
    case OPF_USAGE_ROWWISE: return "rowwise only";
    case OPF_USAGE_COLUMNWISE: return "columnwise only";
    case OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE: return "both";
    default: return "none";
    }
}

/* One operand alone: a valid spec, a float dtype when plain, the copy the
 * layout reads; returns its 2D view in dims. */
static opf_status check_operand(opf_ctx *ctx, const char *op, const char *name, const opf_spec *s,
                                bool rowwise, int64_t dims[2])
{
    if ((unsigned)s->scaling >= OPF_SCALING_COUNT)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s has scaling mode %d", op, name,
                         (int)s->scaling);
    if (s->ndim < 1 || s->ndim > OPF_MAX_DIMS)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: %s has ndim %d, operands need 1..%d dims", op,
                         name, s->ndim, OPF_MAX_DIMS);
    if (s->scaling == OPF_SCALING_NONE && !is_float_plain(s->dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: %s is plain %s; plain operands must be f32, "
                         "bf16 or f16", op, name, opf_dtype_name(s->dtype));
    opf_layout L;
    opf_status st = opf_spec_layout(s, &L);
    if (st) {
        char why[GEMM_MSG];
        snprintf(why, sizeof why, "%s", opf_last_error(NULL));
        return opf_error(ctx, st, "%s: %s: %s", op, name, why);
    }
    unsigned need = rowwise ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE;
    if (s->scaling != OPF_SCALING_NONE && !(s->usage & need))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED,
                         "%s: %s has no %s copy (its copies: %s); this layout reads %s's %s copy",
                         op, name, copy_name(rowwise), usage_name(s->usage), name,
                         copy_name(rowwise));
    dims[0] = L.m;
    dims[1] = L.k;
    return OPF_OK;
}

/* Can these two formats multiply, into out_dt? (5.3) */
static opf_status check_pair(opf_ctx *ctx, const char *op, const opf_spec *a, const opf_spec *b,
                             bool a_row, bool b_row, opf_dtype out_dt)
{
    char da[64], db[64];  /* described only for a message */
    bool qa = a->scaling != OPF_SCALING_NONE, qb = b->scaling != OPF_SCALING_NONE;
    int fam = scaling_family[a->scaling];
    if (qa != qb || fam != scaling_family[b->scaling]) {
        describe(a, da, sizeof da);
        describe(b, db, sizeof db);
        if (qa != qb)
            return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: A is %s but B is %s; both operands "
                             "must be quantized or both plain", op, da, db);
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: cannot multiply A %s with B %s (different "
                         "quantization formats)", op, da, db);
    }
    if (a->scaling == OPF_SCALING_BLOCK_2D && b->scaling == OPF_SCALING_BLOCK_2D)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: A and B are both %s (128x128 tiles); 2D x "
                         "2D block GEMMs are not supported, quantize one operand in 1D blocks",
                         op, opf_scaling_name(a->scaling));
    if (fam == FAM_FP8 && a->qdtype == OPF_E5M2 && b->qdtype == OPF_E5M2)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: A and B are both e5m2; an FP8 GEMM needs "
                         "at least one e4m3 operand", op);
    if (fam == FAM_NVFP4 && out_dt == OPF_F16)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: nvfp4 GEMMs cannot write f16 output (use "
                         "bf16 or f32)", op);
    /* Rotated copies only multiply with rotated copies (3.4.3: H H^T = I). */
    bool ra = fam == FAM_NVFP4 && !a_row && (a->flags & OPF_SPEC_NVFP4_RHT);
    bool rb = fam == FAM_NVFP4 && !b_row && (b->flags & OPF_SPEC_NVFP4_RHT);
    if (ra != rb)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: A's %s copy is %sHadamard-rotated but B's "
                         "%s copy is %s; both or neither must be", op, copy_name(a_row),
                         ra ? "" : "not ", copy_name(b_row), rb ? "rotated" : "not");
    return opf_same_device(ctx, op, 2, (const opf_spec *[]){a, b}, (const char *[]){"A", "B"},
                           NULL);
}

/* Everything about A and B: formats, copies, shapes. Gives M, N, K. */
static opf_status check_operands(opf_ctx *ctx, const char *op, const opf_spec *a,
                                 const opf_spec *b, opf_gemm_layout layout, opf_dtype out_dt,
                                 int64_t *m, int64_t *n, int64_t *k)
{
    int ak = layout_rules[layout].a_k, bk = layout_rules[layout].b_k;
    int64_t da[2], db[2];
    opf_status st;
    if ((st = check_operand(ctx, op, "A", a, ak == 1, da)) ||
        (st = check_operand(ctx, op, "B", b, bk == 1, db)) ||
        (st = check_pair(ctx, op, a, b, ak == 1, bk == 1, out_dt)))
        return st;
    if (da[ak] != db[bk])
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: A has K=%lld, B has K=%lld (A is [%lld,%lld], "
                         "B is [%lld,%lld] as 2D)", op, (long long)da[ak], (long long)db[bk],
                         (long long)da[0], (long long)da[1], (long long)db[0], (long long)db[1]);
    *k = da[ak];
    *n = da[1 - ak];
    *m = db[1 - bk];
    return OPF_OK;
}

static opf_status check_layout(opf_ctx *ctx, opf_gemm_layout layout, const char **op)
{
    if ((unsigned)layout >= OPF_GEMM_LAYOUT_COUNT)
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "gemm: layout %d is not TN (0), NN (1) or NT (2)", (int)layout);
    *op = layout_names[layout];
    return OPF_OK;
}

opf_status opf_gemm_out_spec(const opf_spec *a, const opf_spec *b, opf_gemm_layout layout,
                             opf_dtype dt, opf_spec *out)
{
    OPF_CHECK_NULL(NULL, "gemm", a);
    OPF_CHECK_NULL(NULL, "gemm", b);
    OPF_CHECK_NULL(NULL, "gemm", out);
    const char *op = "gemm";
    opf_status st = check_layout(NULL, layout, &op);
    if (st) return st;
    if (!is_float_plain(dt))
        return opf_error(NULL, OPF_ERR_DTYPE, "%s: output dtype %s, expected f32, bf16 or f16 (an "
                         "FP8 output is the quantized spec of this one)", op, opf_dtype_name(dt));
    int64_t m, n, k;
    if ((st = check_operands(NULL, op, a, b, layout, dt, &m, &n, &k))) return st;
    /* fprop and dgrad keep B's leading dims ([batch, seq, N]); wgrad is 2D. */
    opf_spec s;
    if (layout == OPF_GEMM_NT) {
        s = opf_spec_make(2, (int64_t[]){m, n}, dt);
    } else {
        s = opf_spec_make(b->ndim, b->shape, dt);
        s.shape[b->ndim - 1] = n;
    }
    s.device = b->device;
    *out = s;
    return OPF_OK;
}

/* The memory the kernel reads from an operand. */
static opf_status check_operand_memory(opf_ctx *ctx, const char *op, const char *name,
                                       const opf_tensor *t, bool rowwise)
{
    opf_layout L;
    opf_spec_layout(&t->spec, &L);  /* valid: checked by check_operand */
    opf_component need[3] = {OPF_COMP_DATA, OPF_COMP_COUNT, OPF_COMP_COUNT};
    if (t->spec.scaling != OPF_SCALING_NONE) {
        need[0] = rowwise ? OPF_COMP_DATA : OPF_COMP_COL_DATA;
        need[1] = rowwise ? OPF_COMP_SCALE_INV : OPF_COMP_COL_SCALE_INV;
        if (scaling_family[t->spec.scaling] == FAM_NVFP4)
            need[2] = rowwise ? OPF_COMP_AMAX : OPF_COMP_COL_AMAX;
    }
    static const char *const comp_names[] = {"data", "scale_inv", "columnwise data",
                                             "columnwise scale_inv", "amax", "columnwise amax"};
    for (int i = 0; i < 3; i++) {
        opf_component c = need[i];
        if (c != OPF_COMP_COUNT && L.comp[c].present && L.comp[c].nbytes && !t->data[c])
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s's %s pointer is NULL", op, name,
                             comp_names[c]);
    }
    return OPF_OK;
}

static opf_status check_fp8_output(opf_ctx *ctx, const char *op, const opf_gemm_options *o,
                                   const opf_tensor *d)
{
    const opf_quantizer *q = o->out_quantizer;
    if (q->scaling != OPF_SCALING_TENSOR)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: the output quantizer must be per-tensor "
                         "FP8 (%s), got %s", op, opf_scaling_name(OPF_SCALING_TENSOR),
                         opf_scaling_name(q->scaling));
    if (o->accumulate)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: accumulate=true cannot add into an FP8 "
                         "output", op);
    opf_spec plain = opf_spec_make(d->spec.ndim, d->spec.shape, d->spec.dtype), want;
    plain.device = d->spec.device;
    opf_status st = opf_quantizer_spec(q, &plain, &want);
    if (st) {
        char why[GEMM_MSG];
        snprintf(why, sizeof why, "%s", opf_last_error(NULL));
        return opf_error(ctx, st, "%s: output quantizer: %s", op, why);
    }
    if (!opf_spec_equal(&want, &d->spec)) {
        char w[160], h[160];
        opf_spec_str(&want, w, sizeof w);
        opf_spec_str(&d->spec, h, sizeof h);
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: D is %s, the output quantizer makes %s",
                         op, h, w);
    }
    opf_layout L;
    opf_spec_layout(&d->spec, &L);
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && L.comp[c].nbytes && !d->data[c])
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: D has no memory for component %d", op,
                             c);
    return OPF_OK;
}

/* D: shape [M, N] as 2D, a plain float dtype, or FP8 through out_quantizer. */
static opf_status check_output(opf_ctx *ctx, const char *op, const opf_gemm_options *o,
                               const opf_tensor *d, int64_t m, int64_t n)
{
    if (d->spec.ndim < 1 || d->spec.ndim > OPF_MAX_DIMS)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: D has ndim %d", op, d->spec.ndim);
    int64_t dm, dn;
    opf_shape_2d(&d->spec, &dm, &dn);
    if (dm != m || dn != n)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: D is [%lld,%lld] as 2D, expected [M=%lld, "
                         "N=%lld]", op, (long long)dm, (long long)dn, (long long)m, (long long)n);
    if (!is_float_plain(d->spec.dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: D has logical dtype %s, expected f32, bf16 or "
                         "f16", op, opf_dtype_name(d->spec.dtype));
    if (o->out_quantizer) return check_fp8_output(ctx, op, o, d);
    if (d->spec.scaling != OPF_SCALING_NONE)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: D is quantized (%s) but "
                         "opts->out_quantizer is NULL", op, opf_scaling_name(d->spec.scaling));
    if (!d->data[OPF_COMP_DATA] && m * n > 0)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: D's data pointer is NULL", op);
    return OPF_OK;
}

static opf_status check_bias(opf_ctx *ctx, const char *op, const opf_tensor *bias, int64_t n)
{
    if (!bias) return OPF_OK;
    const opf_spec *s = &bias->spec;
    if (s->scaling != OPF_SCALING_NONE || !is_float_plain(s->dtype)) {
        char what[64];
        describe(s, what, sizeof what);
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: bias is %s, expected plain f32, bf16 or f16",
                         op, what);
    }
    if (s->ndim != 1 || s->shape[0] != n)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: bias has shape [%lld] (ndim %d), expected "
                         "[N=%lld]", op, s->ndim > 0 ? (long long)s->shape[0] : 0LL, s->ndim,
                         (long long)n);
    if (!bias->data[OPF_COMP_DATA] && n > 0)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: bias's data pointer is NULL", op);
    return OPF_OK;
}

/* The byte ranges of t's components (empty where there is no pointer); a
 * component without a layout, or of no bytes, counts one byte. */
static void comp_ranges(const opf_tensor *t, uintptr_t lo[OPF_COMP_COUNT],
                        uintptr_t hi[OPF_COMP_COUNT])
{
    opf_layout L;
    bool laid = opf_spec_layout(&t->spec, &L) == OPF_OK;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        lo[c] = (uintptr_t)t->data[c];
        size_t nb = laid && L.comp[c].present ? L.comp[c].nbytes : 0;
        hi[c] = !t->data[c] ? lo[c] : lo[c] + (nb ? nb : 1);  /* empty: still its address */
    }
}

/* D's bytes must not overlap, even in part, the bytes the kernel reads. */
static opf_status check_alias(opf_ctx *ctx, const char *op, const opf_tensor *a,
                              const opf_tensor *b, const opf_tensor *bias, const opf_tensor *d)
{
    const opf_tensor *in[3] = {a, b, bias};
    static const char *const names[3] = {"A", "B", "bias"};
    uintptr_t dlo[OPF_COMP_COUNT], dhi[OPF_COMP_COUNT], lo[OPF_COMP_COUNT], hi[OPF_COMP_COUNT];
    comp_ranges(d, dlo, dhi);
    for (int i = 0; i < 3; i++) {
        if (!in[i]) continue;
        comp_ranges(in[i], lo, hi);
        for (int c = 0; c < OPF_COMP_COUNT; c++)
            for (int e = 0; e < OPF_COMP_COUNT; e++)
                if (lo[c] < hi[c] && dlo[e] < dhi[e] && lo[c] < dhi[e] && dlo[e] < hi[c])
                    return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: D shares memory with %s (D's "
                                     "bytes [%p, %p) overlap [%p, %p))", op, names[i],
                                     (void *)dlo[e], (void *)dhi[e], (void *)lo[c], (void *)hi[c]);
    }
    return OPF_OK;
}

opf_status opf_gemm(opf_ctx *ctx, const opf_tensor *a, const opf_tensor *b,
                    opf_gemm_layout layout, const opf_gemm_options *opts, opf_tensor *d)
{
    if (!ctx) return opf_error(NULL, OPF_ERR_INVALID_ARG, "gemm: ctx is NULL");
    OPF_CHECK_NULL(ctx, "gemm", a);
    OPF_CHECK_NULL(ctx, "gemm", b);
    OPF_CHECK_NULL(ctx, "gemm", d);
    opf_gemm_options defaults = opf_gemm_options_default();
    const opf_gemm_options *o = opts ? opts : &defaults;
    const char *op = "gemm";
    opf_status st = check_layout(ctx, layout, &op);
    if (st) return st;
    int ak = layout_rules[layout].a_k, bk = layout_rules[layout].b_k;
    int64_t m, n, k;
    if ((st = check_operands(ctx, op, &a->spec, &b->spec, layout, d->spec.dtype, &m, &n, &k)))
        return st;
    /* One device for A, B, D and bias; its kernels run the GEMM. */
    opf_device dev;
    const opf_spec *specs[] = {&a->spec, &b->spec, &d->spec, o->bias ? &o->bias->spec : NULL};
    if ((st = opf_same_device(ctx, op, 4, specs, (const char *[]){"A", "B", "D", "bias"}, &dev)))
        return st;
    if ((st = check_operand_memory(ctx, op, "A", a, ak == 1)) ||
        (st = check_operand_memory(ctx, op, "B", b, bk == 1)) ||
        (st = check_output(ctx, op, o, d, m, n)) || (st = check_bias(ctx, op, o->bias, n)) ||
        (st = check_alias(ctx, op, a, b, o->bias, d)))
        return st;
    const opf_backend_i *be = opf_backend_get(dev);
    if (!be || !be->gemm)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: no GEMM kernel on %s", op,
                         opf_device_name(dev));
    if ((st = opf_quantize_check_state_device(ctx, op, o->out_quantizer, dev))) return st;
    opf_gemm_args args = {a, b, layout, o, d, m, n, k, {0}};
    opf_quantize_state_delayed(o->out_quantizer, &args.out_state);
    return be->gemm(ctx, &args);
}
