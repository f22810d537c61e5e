/* nn_common.c: the helpers of nn-impl.h. */
#include <math.h>

#include "ops/basic/nn-impl.h"

const opf_nn_kernels *opf_nn_kernels_of(opf_ctx *ctx, const char *who, const opf_tensor *t)
{
    const opf_backend_i *be = opf_backend_get(t->spec.device);
    if (!be || !be->nn)
        opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: no attention/embedding kernels for device %d",
                  who, (int)t->spec.device);
    return be ? be->nn : NULL;
}

opf_status opf_nn_scratch(opf_ctx *ctx, const char *who, int64_t n, float **v)
{
    *v = opf_op_scratch(ctx, n);
    return *v ? OPF_OK
              : opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: no scratch for %lld floats", who, (long long)n);
}

opf_status opf_nn_in(opf_ctx *ctx, const opf_tensor *t, const float **v)
{
    int64_t n = opf_spec_numel(&t->spec);
    bool plain32 = t->spec.scaling == OPF_SCALING_NONE && t->spec.dtype == OPF_F32;
    float *ws = NULL;
    if (!plain32 && !(ws = opf_op_scratch(ctx, n)))
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "no scratch for %lld floats", (long long)n);
    return opf_op_load_f32(ctx, t, ws, v);
}

opf_status opf_nn_out(opf_ctx *ctx, const opf_tensor *out, float **v)
{
    if (out->spec.scaling == OPF_SCALING_NONE && out->spec.dtype == OPF_F32) {
        *v = out->data[0];
        return OPF_OK;
    }
    return opf_nn_scratch(ctx, "output", opf_spec_numel(&out->spec), v);
}

opf_status opf_nn_in_typed(opf_ctx *ctx, const opf_tensor *t, const void **v, opf_dtype *dt)
{
    if (t->spec.scaling == OPF_SCALING_NONE) {
        *v = t->data[0];
        *dt = t->spec.dtype;
        return OPF_OK;
    }
    *dt = OPF_F32;
    return opf_nn_in(ctx, t, (const float **)v);
}

opf_status opf_nn_out_typed(opf_ctx *ctx, const opf_tensor *out, void **v, opf_dtype *dt)
{
    if (out->spec.scaling == OPF_SCALING_NONE) {
        *v = out->data[0];
        *dt = out->spec.dtype;
        return OPF_OK;
    }
    *dt = OPF_F32;
    return opf_nn_out(ctx, out, (float **)v);
}

opf_status opf_nn_finish(opf_ctx *ctx, const float *v, opf_dtype act, const opf_quantizer *q,
                         opf_tensor *out)
{
    if (v == out->data[0]) return OPF_OK;  /* the kernel wrote it */
    opf_quantizer none = opf_quantizer_default();
    return opf_op_store_f32(ctx, v, act, q ? q : &none, out);
}

opf_status opf_nn_check_dtype(opf_ctx *ctx, const opf_op *op, const char *what,
                              const opf_tensor *t, opf_dtype want)
{
    if (t->spec.dtype != want || t->spec.scaling != OPF_SCALING_NONE)
        return opf_error(ctx, OPF_ERR_DTYPE, "%s \"%s\": %s is %s, expected plain %s",
                         opf_op_class_of(op)->name, opf_op_name(op), what,
                         opf_dtype_name(t->spec.dtype), opf_dtype_name(want));
    return OPF_OK;
}

opf_status opf_nn_check_float(opf_ctx *ctx, const opf_op *op, const char *what,
                              const opf_tensor *t)
{
    opf_dtype d = t->spec.dtype;
    if (d != OPF_F32 && d != OPF_BF16 && d != OPF_F16)
        return opf_error(ctx, OPF_ERR_DTYPE, "%s \"%s\": %s dtype %s, expected f32, bf16 or f16",
                         opf_op_class_of(op)->name, opf_op_name(op), what, opf_dtype_name(d));
    return OPF_OK;
}

/* The classes are built in (ops-impl.h); kept for callers of the first
 * version, which registered them on demand. */
opf_status opf_nn_register(void) { return OPF_OK; }
