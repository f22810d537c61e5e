/* qout.c: the reference composition of a fused entry's output (qout.h). */
#include "backend/backend-impl.h"
#include "core/core-impl.h"

/* A tensor of dtype dt with t's logical shape and device in scratch. */
static opf_status scratch_like(opf_ctx *ctx, const opf_spec *like, opf_dtype dt, opf_tensor *out)
{
    opf_spec s = opf_spec_make(like->ndim, like->shape, dt);
    s.device = like->device;
    int64_t n = opf_spec_numel(&s);
    size_t bytes = (size_t)(n > 0 ? n : 1) * (dt == OPF_F32 ? 4u : 2u);
    void *p = opf_ctx_scratch_push_on(ctx, s.device, bytes);
    if (!p)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "fused output: no scratch for %lld values",
                         (long long)n);
    return opf_tensor_wrap(&s, p, out);
}

opf_status opf_qout_begin(opf_ctx *ctx, const opf_qout *o, opf_tensor *t)
{
    if (!opf_qout_quantized(o)) {
        *t = *o->out;
        return OPF_OK;
    }
    return scratch_like(ctx, &o->out->spec, o->hp, t);
}

/* be's quantize kernel of a quantized o from in, read in its own dtype. */
static opf_status quantize_in(opf_ctx *ctx, const opf_backend_i *be, const opf_qout *o,
                              const opf_tensor *in)
{
    opf_quantize_kernel k = be->quantize[o->q->scaling];
    if (!k)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "fused output: no %s kernel on %s",
                         opf_scaling_name(o->q->scaling), be->name);
    opf_tensor view = *o->out;
    view.spec.dtype = in->spec.dtype;  /* a quantized layout does not depend on it */
    opf_quantize_state none = {0};
    return k(ctx, o->q, in, &view, o->state ? o->state : &none);
}

opf_status opf_qout_end(opf_ctx *ctx, const opf_backend_i *be, const opf_qout *o,
                        const opf_tensor *t)
{
    if (!opf_qout_quantized(o)) return OPF_OK;
    opf_tensor in = *t;
    opf_status st = OPF_OK;
    bool block = o->q->scaling == OPF_SCALING_BLOCK_1D || o->q->scaling == OPF_SCALING_BLOCK_2D;
    if (block && t->spec.dtype != OPF_F32) {
        st = scratch_like(ctx, &t->spec, OPF_F32, &in);
        if (!st) st = be->elem->cast(ctx, t, &in);
    }
    return st ? st : quantize_in(ctx, be, o, &in);
}

opf_status opf_qout_from_plain(opf_ctx *ctx, const opf_backend_i *be, const opf_qout *o,
                               const opf_tensor *x)
{
    if (!opf_qout_quantized(o))
        return x->data[0] == o->out->data[0] ? OPF_OK : be->elem->cast(ctx, x, o->out);
    if (opf_qout_reads_as_is(o, x->spec.dtype)) return quantize_in(ctx, be, o, x);
    opf_tensor t;
    opf_status st = scratch_like(ctx, &x->spec, o->hp, &t);
    if (!st) st = be->elem->cast(ctx, x, &t);
    return st ? st : quantize_in(ctx, be, o, &t);
}

opf_status opf_qout_store_f32(opf_ctx *ctx, const opf_backend_i *be, const opf_qout *o,
                              const opf_tensor *r)
{
    if (!opf_qout_quantized(o))
        return r->data[0] == o->out->data[0] ? OPF_OK : be->elem->cast(ctx, r, o->out);
    if (o->hp == OPF_F32) return opf_qout_end(ctx, be, o, r);
    opf_tensor t;
    opf_status st = opf_qout_begin(ctx, o, &t);
    if (!st) st = be->elem->cast(ctx, r, &t);
    return st ? st : opf_qout_end(ctx, be, o, &t);
}
