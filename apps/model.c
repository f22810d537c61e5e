/* model.c: builds the residual LayerNorm-MLP from basic ops, and an MSE loss. */
#include <stdlib.h>

#include "model.h"

static opf_status add(opf_ctx *ctx, opf_seq *seq, const char *cls, const void *cfg, const char *name,
                      opf_op **op)
{
    opf_status st = opf_op_create(ctx, cls, cfg, name, op);
    return st ? st : opf_seq_append(seq, *op);
}

opf_status opf_model_ln_mlp(opf_ctx *ctx, int64_t hidden, int64_t ffn, opf_dtype dt, opf_seq **out)
{
    opf_seq *seq;
    opf_status st = opf_seq_create(ctx, &seq);
    if (st) return st;
    opf_op *op;
    opf_norm_config ln = {hidden, 1e-5, false, dt};
    if ((st = add(ctx, seq, "make_extra_output", NULL, "res.out", &op)) ||
        (st = opf_op_set_extra_output(op, 0, "res", false)) ||
        (st = add(ctx, seq, "layernorm", &ln, "ln", &op)) ||
        (st = opf_seq_append_linear(seq, hidden, ffn, true, dt, "fc1")) ||
        (st = add(ctx, seq, "gelu", NULL, "gelu", &op)) ||
        (st = opf_seq_append_linear(seq, ffn, hidden, true, dt, "fc2")) ||
        (st = add(ctx, seq, "add_extra_input", NULL, "res.in", &op)) ||
        (st = opf_op_set_extra_input(op, 0, "res"))) {
        opf_seq_destroy(seq);
        return st;
    }
    *out = seq;
    return OPF_OK;
}

/* On a device: y comes to the host and dy goes back (two explicit copies,
 * outside the step's kernels). */
static opf_status mse_on_device(opf_ctx *ctx, const opf_tensor *y, const float *t, double *loss,
                                opf_tensor *dy)
{
    opf_tensor yh, dyh;
    opf_status st = opf_tensor_to(ctx, y, OPF_DEVICE_CPU, &yh);
    if (st) return st;
    st = opf_model_mse(ctx, &yh, t, loss, &dyh);
    if (!st) st = opf_tensor_to(ctx, &dyh, y->spec.device, dy), opf_tensor_release(&dyh);
    opf_tensor_release(&yh);
    return st;
}

opf_status opf_model_mse(opf_ctx *ctx, const opf_tensor *y, const float *t, double *loss,
                         opf_tensor *dy)
{
    if (y->spec.device != OPF_DEVICE_CPU) return mse_on_device(ctx, y, t, loss, dy);
    int64_t n = opf_spec_numel(&y->spec);
    float *yf = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n);
    if (!yf || !g) {
        free(yf), free(g);
        return OPF_ERR_NO_MEMORY;
    }
    opf_status st = opf_convert(y->data[0], y->spec.dtype, yf, OPF_F32, (size_t)n);
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)yf[i] - t[i];
        s += d * d;
        g[i] = (float)(2.0 * d / (double)n);
    }
    *loss = s / (double)n;
    opf_spec sp = opf_spec_make(y->spec.ndim, y->spec.shape, y->spec.dtype);
    if (!st) st = opf_tensor_alloc(ctx, &sp, dy);
    if (!st) st = opf_convert(g, OPF_F32, dy->data[0], sp.dtype, (size_t)n);
    free(yf), free(g);
    return st;
}
