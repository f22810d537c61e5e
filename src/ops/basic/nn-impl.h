/* nn-impl.h: what the language-model ops (embedding.c, attention.c,
 * cross_entropy.c) share: the dispatch to the backend's nn kernels
 * (backend/nn.h), which compute on fp32 arrays, and the fp32 views those
 * kernels read and write (nn_common.c). */
#ifndef OPFUSE_NN_IMPL_H
#define OPFUSE_NN_IMPL_H

#include "backend/backend-impl.h"
#include "ops/ops-impl.h"
#include "opfuse/nn.h"

/* The nn kernels of t's device, or NULL with OPF_ERR_UNSUPPORTED naming `who`. */
const opf_nn_kernels *opf_nn_kernels_of(opf_ctx *ctx, const char *who, const opf_tensor *t);

/* *v: t's values as fp32 (t itself when plain f32, else decoded into scratch). */
opf_status opf_nn_in(opf_ctx *ctx, const opf_tensor *t, const float **v);

/* *v: where a kernel writes out's fp32 values: out itself when plain f32,
 * else scratch that opf_nn_finish then rounds (or quantizes with q) into out. */
opf_status opf_nn_out(opf_ctx *ctx, const opf_tensor *out, float **v);
opf_status opf_nn_finish(opf_ctx *ctx, const float *v, opf_dtype act, const opf_quantizer *q,
                         opf_tensor *out);

/* The typed forms, for kernels that read and write plain f32/bf16/f16:
 * *v, *dt = t's data and dtype when t is plain, else its decoded fp32 copy;
 * out's data and dtype when out is plain, else fp32 scratch for
 * opf_nn_finish. */
opf_status opf_nn_in_typed(opf_ctx *ctx, const opf_tensor *t, const void **v, opf_dtype *dt);
opf_status opf_nn_out_typed(opf_ctx *ctx, const opf_tensor *out, void **v, opf_dtype *dt);

/* n floats of scratch, or OPF_ERR_NO_MEMORY naming `who`. */
opf_status opf_nn_scratch(opf_ctx *ctx, const char *who, int64_t n, float **v);

/* "class \"name\"" checks: t's dtype is `want`, else OPF_ERR_DTYPE. */
opf_status opf_nn_check_dtype(opf_ctx *ctx, const opf_op *op, const char *what,
                              const opf_tensor *t, opf_dtype want);
/* t is plain or quantized with a float logical dtype (f32, bf16, f16). */
opf_status opf_nn_check_float(opf_ctx *ctx, const opf_op *op, const char *what,
                              const opf_tensor *t);

/* The class table of nn op `cname` for a file that defines the static hooks
 * resolve_fwd, setup_context, resolve_bwd, forward_fake, forward_impl,
 * backward_fake and backward_impl (init: a hook or NULL). */
#define OPF_NN_CLASS(cname, cfg_size, cfg_default, init_fn, extra_in)                  \
    const opf_op_class opf_op_class_##cname = {                                        \
        .abi_version = OPF_OP_ABI_VERSION, .name = #cname, .module_type = #cname,      \
        .config_size = (cfg_size), .config_default = (cfg_default),                    \
        .fwd_schema = &cname##_fwd_schema, .bwd_schema = &cname##_bwd_schema,          \
        .n_extra_in = (extra_in), .fusible = true, .init = (init_fn),                  \
        .resolve_fwd = resolve_fwd, .setup_context = setup_context,                    \
        .resolve_bwd = resolve_bwd, .forward_fake = forward_fake,                      \
        .forward_impl = forward_impl, .backward_fake = backward_fake,                  \
        .backward_impl = backward_impl}

#endif
