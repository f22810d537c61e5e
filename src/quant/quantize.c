/* quantize.c: quantizer values, the quantized spec, and the validated entry
 * points quantize / dequantize / requantize / update_usage, which dispatch to
 * the device's kernels (src/backend/). */
#include <string.h>

#include "quant/quant-impl.h"
#include "core/core-impl.h"

opf_quantizer opf_quantizer_default(void)
{
    opf_quantizer q;
    memset(&q, 0, sizeof q);
    q.scaling = OPF_SCALING_NONE;
    q.qdtype = OPF_E4M3;
    q.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
    q.rht_sign_mask = 0xD7E8;
    return q;
}

bool opf_quantizer_equal(const opf_quantizer *a, const opf_quantizer *b)
{
    return a->scaling == b->scaling && a->qdtype == b->qdtype && a->usage == b->usage &&
           a->swizzled == b->swizzled && a->pow2_scales == b->pow2_scales &&
           opf_f32_bits(a->amax_epsilon) == opf_f32_bits(b->amax_epsilon) &&
           a->mxfp8_2d == b->mxfp8_2d && a->rht == b->rht &&
           a->rht_sign_mask == b->rht_sign_mask && a->stochastic == b->stochastic &&
           a->delayed == b->delayed && a->slot == b->slot && a->amax_reduce == b->amax_reduce &&
           a->amax_reduce_user == b->amax_reduce_user;
}

uint64_t opf_quantizer_hash(const opf_quantizer *q)
{
    uint64_t h = OPF_HASH_SEED;
    h = opf_hash_mix(h, (uint64_t)q->scaling);
    h = opf_hash_mix(h, (uint64_t)q->qdtype);
    h = opf_hash_mix(h, q->usage);
    h = opf_hash_mix(h, (uint64_t)q->swizzled | (uint64_t)q->pow2_scales << 1 |
                            (uint64_t)q->mxfp8_2d << 2 | (uint64_t)q->rht << 3 |
                            (uint64_t)q->stochastic << 4);
    h = opf_hash_mix(h, opf_f32_bits(q->amax_epsilon));
    h = opf_hash_mix(h, q->rht_sign_mask);
    h = opf_hash_mix(h, (uint64_t)(uintptr_t)q->delayed);
    h = opf_hash_mix(h, (uint64_t)q->slot);
    return h;
}

static bool is_nvfp4(opf_scaling s) { return s == OPF_SCALING_NVFP4_1D || s == OPF_SCALING_NVFP4_2D; }
static bool is_float_plain(opf_dtype d) { return d == OPF_F32 || d == OPF_BF16 || d == OPF_F16; }

/* Options that only one family may set. */
static opf_status check_quantizer(opf_ctx *ctx, const opf_quantizer *q)
{
    const char *fn = "quantize";
    if ((unsigned)q->scaling >= OPF_SCALING_COUNT)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: scaling mode %d", fn, (int)q->scaling);
    const char *mode = opf_scaling_name(q->scaling);
    if (q->delayed && q->scaling != OPF_SCALING_TENSOR)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: delayed-scaling state on a %s quantizer",
                         fn, mode);
    if (q->delayed && (q->slot < 0 || q->slot >= opf_delayed_state_slots(q->delayed)))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: slot %d outside the state's %d slots", fn,
                         q->slot, opf_delayed_state_slots(q->delayed));
    if (q->delayed && q->qdtype != opf_delayed_state_dtype(q->delayed))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: quantizer dtype %s but its delayed state is %s",
                         fn, opf_dtype_name(q->qdtype),
                         opf_dtype_name(opf_delayed_state_dtype(q->delayed)));
    if ((q->rht || q->stochastic) && !is_nvfp4(q->scaling))
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "%s: Hadamard transform and stochastic rounding are nvfp4 options, "
                         "not %s", fn, mode);
    if (q->rht && q->scaling == OPF_SCALING_NVFP4_2D && (q->usage & OPF_USAGE_COLUMNWISE))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED,
                         "%s: nvfp4 16x16 tiles give identical copies; a Hadamard-rotated "
                         "columnwise copy cannot share them (turn off rht for 2D)", fn);
    if (q->mxfp8_2d && q->scaling != OPF_SCALING_MXFP8)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: 32x32 blocks are an mxfp8 option, not %s",
                         fn, mode);
    if (q->swizzled && q->scaling != OPF_SCALING_MXFP8 && !is_nvfp4(q->scaling))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s scales have no swizzled layout", fn,
                         mode);
    if (!(q->amax_epsilon >= 0.0f))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: amax_epsilon %g must be >= 0", fn,
                         (double)q->amax_epsilon);
    return OPF_OK;
}

opf_status opf_quantizer_spec(const opf_quantizer *q, const opf_spec *in, opf_spec *out)
{
    OPF_CHECK_NULL(NULL, "opf_quantizer_spec", q);
    OPF_CHECK_NULL(NULL, "opf_quantizer_spec", in);
    OPF_CHECK_NULL(NULL, "opf_quantizer_spec", out);
    opf_status st = check_quantizer(NULL, q);
    if (st) return st;
    if (in->scaling != OPF_SCALING_NONE)
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "quantize: the input is already quantized (%s); use opf_requantize",
                         opf_scaling_name(in->scaling));
    if (!is_float_plain(in->dtype))
        return opf_error(NULL, OPF_ERR_DTYPE, "quantize: input dtype %s, expected f32/bf16/f16",
                         opf_dtype_name(in->dtype));
    if (q->scaling == OPF_SCALING_TENSOR && q->usage == OPF_USAGE_COLUMNWISE)
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "quantize: per-tensor FP8 cannot quantize a columnwise copy alone (it is "
                         "the transpose of the rowwise copy; quantize both and drop the rowwise)");
    opf_spec s = *in;
    if (q->scaling != OPF_SCALING_NONE) {
        s.scaling = q->scaling;
        s.qdtype = q->qdtype;
        s.usage = q->usage;
        s.flags = (q->swizzled ? OPF_SPEC_SWIZZLED : 0) | (q->mxfp8_2d ? OPF_SPEC_MXFP8_2D : 0) |
                  (q->rht && (q->usage & OPF_USAGE_COLUMNWISE) ? OPF_SPEC_NVFP4_RHT : 0);
    }
    opf_layout L;
    if ((st = opf_spec_layout(&s, &L))) return st;
    *out = s;
    return OPF_OK;
}

/* The kernels of the device t is on (check_in_out made in and out agree). */
static const opf_backend_i *backend_of(const opf_tensor *t) { return opf_backend_get(t->spec.device); }

/* The arguments every entry takes: a context, an input and an output that
 * share no memory. */
static opf_status check_in_out(opf_ctx *ctx, const char *fn, const opf_tensor *in,
                               const opf_tensor *out)
{
    OPF_CHECK_NULL(ctx, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, in);
    OPF_CHECK_NULL(ctx, fn, out);
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (in->data[c] && out->data[c] && in->data[c] == out->data[c])
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: input and output share memory", fn);
    return opf_same_device(ctx, fn, 2, (const opf_spec *[]){&in->spec, &out->spec},
                           (const char *[]){"the input", "the output"}, NULL);
}

/* Every component the layout lists must have memory behind it. */
static opf_status check_components(opf_ctx *ctx, const char *fn, const char *what,
                                   const opf_tensor *t)
{
    opf_layout L;
    if (opf_spec_layout(&t->spec, &L))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s: %s", fn, what, opf_last_error(NULL));
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && L.comp[c].nbytes && !t->data[c])
            return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s has no memory for component %d", fn,
                             what, c);
    return OPF_OK;
}

void opf_quantize_state_delayed(const opf_quantizer *q, opf_quantize_state *qs)
{
    if (!q || !q->delayed) return;  /* validated: per-tensor scaling, slot in range */
    qs->delayed_scale = opf_delayed_state_scale(q->delayed) + q->slot;
    qs->delayed_amax = opf_delayed_state_history(q->delayed) + q->slot;
}

opf_status opf_quantize_check_state_device(opf_ctx *ctx, const char *fn, const opf_quantizer *q,
                                           opf_device dev)
{
    opf_device sd = q && q->delayed ? opf_delayed_state_device(q->delayed) : dev;
    if (sd == dev) return OPF_OK;
    return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the delayed-scaling state is on %s, the "
                     "tensors on %s (a state lives on its context's device)", fn,
                     opf_device_name(sd), opf_device_name(dev));
}

/* The device's plain cast (scaling NONE: a dtype conversion). */
static opf_status plain_cast(opf_ctx *ctx, const opf_tensor *in, opf_tensor *out)
{
    const opf_elem_kernels *k = opf_backend_kernels(ctx, "quantize (plain cast)",
                                                    in->spec.device, OPF_KERNELS_ELEM);
    return k ? k->cast(ctx, in, out) : OPF_ERR_UNSUPPORTED;
}

opf_status opf_quantize(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                        opf_tensor *out)
{
    const char *fn = "quantize";
    OPF_CHECK_NULL(ctx, fn, q);
    opf_status st = check_in_out(ctx, fn, in, out);
    if (st) return st;
    opf_spec want;
    if ((st = opf_quantizer_spec(q, &in->spec, &want)))
        return opf_error(ctx, st, "%s", opf_last_error(NULL));
    if (!opf_spec_equal(&want, &out->spec)) {
        char a[160], b[160];
        opf_spec_str(&want, a, sizeof a);
        opf_spec_str(&out->spec, b, sizeof b);
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: output is %s, the quantizer makes %s", fn, b, a);
    }
    if ((st = check_components(ctx, fn, "input", in)) || (st = check_components(ctx, fn, "output", out)))
        return st;
    int64_t n = opf_spec_numel(&in->spec);
    if (q->scaling == OPF_SCALING_NONE && in->spec.device != OPF_DEVICE_CPU)
        return plain_cast(ctx, in, out);
    if (q->scaling == OPF_SCALING_NONE)
        return opf_convert(in->data[OPF_COMP_DATA], in->spec.dtype, out->data[OPF_COMP_DATA],
                           out->spec.dtype, (size_t)n);
    if ((st = opf_quantize_check_state_device(ctx, fn, q, in->spec.device))) return st;
    const opf_backend_i *be = backend_of(in);
    opf_quantize_kernel k = be ? be->quantize[q->scaling] : NULL;
    if (!k)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: no %s kernel on this device", fn,
                         opf_scaling_name(q->scaling));
    opf_quantize_state qs = {0};
    opf_ctx_get_rng(ctx, &qs.rng_seed, &qs.rng_offset);
    opf_quantize_state_delayed(q, &qs);
    if ((st = k(ctx, q, in, out, &qs))) return st;
    /* Stochastic rounding used one Philox counter per 16 elements and copy id. */
    if (q->stochastic) opf_ctx_rng_advance(ctx, (uint64_t)opf_ceil_div(n, 16));
    return OPF_OK;
}

opf_status opf_quantize_alloc(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                              opf_tensor *out)
{
    OPF_CHECK_NULL(ctx, "quantize", ctx);
    OPF_CHECK_NULL(ctx, "quantize", q);
    OPF_CHECK_NULL(ctx, "quantize", in);
    OPF_CHECK_NULL(ctx, "quantize", out);
    opf_spec s;
    opf_tensor t;
    memset(&t, 0, sizeof t);
    opf_status st = opf_quantizer_spec(q, &in->spec, &s);
    if (st) st = opf_error(ctx, st, "%s", opf_last_error(NULL));
    else if (!(st = opf_tensor_alloc(ctx, &s, &t)) && (st = opf_quantize(ctx, q, in, &t)))
        opf_tensor_release(&t);
    if (st) memset(&t, 0, sizeof t);  /* what a refused call leaves: safe to release */
    *out = t;
    return st;
}

/* Decodes copy `which` of q into fp32 dst[M*K] (logical order). */
static opf_status decode_f32(opf_ctx *ctx, const char *fn, const opf_tensor *q, unsigned which,
                             float *dst)
{
    const opf_backend_i *be = backend_of(q);
    opf_dequantize_kernel k = be ? be->dequantize[q->spec.scaling] : NULL;
    if (!k)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: no %s kernel on this device", fn,
                         opf_scaling_name(q->spec.scaling));
    return k(ctx, q, which, dst);
}

static opf_status check_which(opf_ctx *ctx, const char *fn, const opf_tensor *q, unsigned which)
{
    if (q->spec.scaling == OPF_SCALING_NONE)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the tensor is not quantized", fn);
    if (which != OPF_USAGE_ROWWISE && which != OPF_USAGE_COLUMNWISE)
        return opf_error(ctx, OPF_ERR_INVALID_ARG,
                         "%s: which=0x%x must be exactly one of rowwise (1) or columnwise (2)",
                         fn, which);
    if (!(q->spec.usage & which))
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the tensor has no %s copy", fn,
                         which == OPF_USAGE_ROWWISE ? "rowwise" : "columnwise");
    return check_components(ctx, fn, "input", q);
}

/* A device's bf16/f16 output: decoded to fp32 in device scratch, then the
 * device's cast. */
static opf_status decode_cast(opf_ctx *ctx, const char *fn, const opf_tensor *q, unsigned which,
                              opf_tensor *out)
{
    const opf_elem_kernels *k = opf_backend_kernels(ctx, fn, out->spec.device, OPF_KERNELS_ELEM);
    if (!k) return OPF_ERR_UNSUPPORTED;
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_spec s = opf_spec_make(out->spec.ndim, out->spec.shape, OPF_F32);
    s.device = out->spec.device;
    opf_tensor tmp;
    void *mem = opf_ctx_scratch_push_on(ctx, s.device, (size_t)opf_spec_numel(&s) * sizeof(float));
    opf_status st = mem ? opf_tensor_wrap(&s, mem, &tmp)
                        : opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no device scratch", fn);
    if (!st) st = decode_f32(ctx, fn, q, which, mem);
    if (!st) st = k->cast(ctx, &tmp, out);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

opf_status opf_dequantize(opf_ctx *ctx, const opf_tensor *q, unsigned which, opf_tensor *out)
{
    const char *fn = "dequantize";
    opf_status st = check_in_out(ctx, fn, q, out);
    if (st || (st = check_which(ctx, fn, q, which))) return st;
    const opf_spec *o = &out->spec;
    if (o->scaling != OPF_SCALING_NONE || !is_float_plain(o->dtype))
        return opf_error(ctx, OPF_ERR_DTYPE, "%s: output must be plain f32/bf16/f16, got %s %s", fn,
                         opf_dtype_name(o->dtype), opf_scaling_name(o->scaling));
    int64_t n = opf_spec_numel(&q->spec);
    if (opf_spec_numel(o) != n)
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: output has %lld elements, input %lld", fn,
                         (long long)opf_spec_numel(o), (long long)n);
    if ((st = check_components(ctx, fn, "output", out))) return st;
    if (o->dtype == OPF_F32) return decode_f32(ctx, fn, q, which, out->data[OPF_COMP_DATA]);
    if (o->device != OPF_DEVICE_CPU) return decode_cast(ctx, fn, q, which, out);
    size_t bytes = (size_t)n * sizeof(float);
    if ((st = opf_ctx_workspace_reserve(ctx, bytes))) return st;
    float *tmp = opf_ctx_workspace(ctx, bytes);
    if ((st = decode_f32(ctx, fn, q, which, tmp))) return st;
    return opf_convert(tmp, OPF_F32, out->data[OPF_COMP_DATA], o->dtype, (size_t)n);
}

opf_status opf_requantize(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                          opf_tensor *out)
{
    const char *fn = "requantize";
    OPF_CHECK_NULL(ctx, fn, q);
    opf_status st = check_in_out(ctx, fn, in, out);
    if (st) return st;
    unsigned which = (in->spec.usage & OPF_USAGE_ROWWISE) ? OPF_USAGE_ROWWISE : OPF_USAGE_COLUMNWISE;
    if ((st = check_which(ctx, fn, in, which))) return st;
    if (which == OPF_USAGE_COLUMNWISE && (in->spec.flags & OPF_SPEC_NVFP4_RHT))
        return opf_error(ctx, OPF_ERR_UNSUPPORTED,
                         "%s: only a Hadamard-rotated columnwise nvfp4 copy is present; its "
                         "values are not the tensor's", fn);
    opf_spec logical = opf_spec_make(in->spec.ndim, in->spec.shape, in->spec.dtype), want;
    logical.device = in->spec.device;
    if ((st = opf_quantizer_spec(q, &logical, &want)))
        return opf_error(ctx, st, "%s", opf_last_error(NULL));
    if (!opf_spec_equal(&want, &out->spec))
        return opf_error(ctx, OPF_ERR_SHAPE, "%s: output spec does not match the quantizer's", fn);
    /* The decoded values are fp32: quantize them as an fp32 tensor (so block
     * scaling's value-for-inf is FLT_MAX) into a view of out with dtype f32;
     * the quantized layout does not depend on the logical dtype. */
    opf_spec plain = opf_spec_make(in->spec.ndim, in->spec.shape, OPF_F32);
    plain.device = in->spec.device;
    opf_tensor tmp;
    if ((st = opf_tensor_alloc(ctx, &plain, &tmp))) return st;
    st = decode_f32(ctx, fn, in, which, tmp.data[OPF_COMP_DATA]);
    if (!st && q->scaling == OPF_SCALING_NONE) {
        /* A plain output has its own dtype's layout: cast, not an f32 view. */
        st = plain.device != OPF_DEVICE_CPU
                 ? plain_cast(ctx, &tmp, out)
                 : opf_convert(tmp.data[OPF_COMP_DATA], OPF_F32, out->data[OPF_COMP_DATA],
                               out->spec.dtype, (size_t)opf_spec_numel(&plain));
    } else if (!st) {
        opf_tensor view = *out;
        view.spec.dtype = OPF_F32;
        st = opf_quantize(ctx, q, &tmp, &view);
    }
    opf_tensor_release(&tmp);
    return st;
}
