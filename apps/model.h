/* model.h: the small models the opfuse command builds from basic ops. */
#ifndef OPFUSE_APPS_MODEL_H
#define OPFUSE_APPS_MODEL_H

#include "opfuse.h"

/* Residual LayerNorm-MLP block:
 *   x -> make_extra_output("res") -> layernorm -> linear(h, f) + bias -> gelu
 *     -> linear(f, h) + bias -> add_extra_input("res") */
opf_status opf_model_ln_mlp(opf_ctx *ctx, int64_t hidden, int64_t ffn, opf_dtype dt, opf_seq **out);

/* Mean squared error of y against t (both [n] values in y's dtype / f32) and
 * its gradient dy = 2 (y - t) / n written into dy (allocated like y). */
opf_status opf_model_mse(opf_ctx *ctx, const opf_tensor *y, const float *t, double *loss,
                         opf_tensor *dy);

#endif
