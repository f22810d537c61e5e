/* backend-impl.h: the kernel table each device implements.
 *
 * The quant layer validates arguments and then calls these entries; a kernel
 * may assume its arguments are consistent (shapes match the layouts, the
 * output is allocated with the spec opf_quantizer_spec gave, dtypes are
 * supported). Kernels never allocate except from the context's workspace. */
#ifndef OPFUSE_BACKEND_IMPL_H
#define OPFUSE_BACKEND_IMPL_H

#include "opfuse/gemm.h"
#include "opfuse/quant.h"

/* One header per kernel family, each a sub-table of entries. */
#include "backend/act.h"
#include "backend/elem.h"
#include "backend/nn.h"
#include "backend/norm.h"
#include "backend/optim.h"
#include "backend/scale.h"

/* What a quantize kernel reads and writes besides its tensors, resolved by
 * the dispatcher (quant/quantize.c) into plain pointers in the device's
 * memory, so no kernel reaches into the quant layer's objects. */
typedef struct opf_quantize_state {
    const float *delayed_scale;  /* delayed scaling: the slot's scale (read); else NULL */
    float       *delayed_amax;   /* delayed scaling: the slot's entry of amax-history row 0,
                                    max-accumulated with the input's amax; else NULL */
    uint64_t     rng_seed, rng_offset;  /* stochastic rounding's Philox stream */
} opf_quantize_state;

/* Quantize a plain f32/bf16/f16 tensor into the copies out->spec.usage asks
 * for. Delayed scaling (q->delayed set) reads its scale from s->delayed_scale
 * and max-accumulates the amax into *s->delayed_amax; stochastic rounding
 * draws from s->rng_seed / rng_offset. */
typedef opf_status (*opf_quantize_kernel)(opf_ctx *ctx, const opf_quantizer *q,
                                          const opf_tensor *in, opf_tensor *out,
                                          const opf_quantize_state *s);
/* Decode one copy (OPF_USAGE_ROWWISE or _COLUMNWISE) into fp32 out[M*K] in the
 * logical row-major order (columnwise copies transposed back). */
typedef opf_status (*opf_dequantize_kernel)(opf_ctx *ctx, const opf_tensor *q, unsigned which,
                                            float *out);

/* A GEMM whose operands are already validated. m, n, k as in gemm.h. */
typedef struct opf_gemm_args {
    const opf_tensor       *a, *b;
    opf_gemm_layout         layout;
    const opf_gemm_options *opts;
    opf_tensor             *d;
    int64_t                 m, n, k;
    opf_quantize_state      out_state;  /* opts->out_quantizer's delayed scale and amax */
} opf_gemm_args;
typedef opf_status (*opf_gemm_kernel)(opf_ctx *ctx, const opf_gemm_args *args);
/* count independent GEMMs, each as the GEMM kernel takes it (GroupedLinear's
 * groups: one launch on a device that batches them). Each D is written as
 * the single GEMM would write it; no D is read by another GEMM of the call. */
typedef opf_status (*opf_grouped_gemm_kernel)(opf_ctx *ctx, int count, const opf_gemm_args *args);

typedef struct opf_backend_i {
    const char           *name;
    opf_quantize_kernel   quantize[OPF_SCALING_COUNT];   /* NULL for NONE */
    opf_dequantize_kernel dequantize[OPF_SCALING_COUNT];
    opf_gemm_kernel       gemm;
    opf_grouped_gemm_kernel grouped_gemm;
    const opf_scale_kernels *scale;  /* amax, delayed-scaling update */
    const opf_norm_kernels  *norm;   /* LayerNorm, RMSNorm, L2 normalization */
    const opf_act_kernels   *act;    /* activations, GLUs, dact + dbias + quantize */
    const opf_elem_kernels  *elem;   /* bias, scale, add, dropout, cast, sums, fill, copy */
    const opf_optim_kernels *optim;  /* SGD, AdamW over many tensors */
    const opf_nn_kernels    *nn;     /* embedding, causal attention, cross-entropy, sumsq */
} opf_backend_i;

/* The table of a device; NULL when this build lacks it. */
const opf_backend_i *opf_backend_get(opf_device dev);

/* The kernel families of a table, as opf_backend_kernels names them. */
typedef enum opf_kernel_family {
    OPF_KERNELS_SCALE = 0,  /* opf_scale_kernels */
    OPF_KERNELS_NORM  = 1,  /* opf_norm_kernels */
    OPF_KERNELS_ACT   = 2,  /* opf_act_kernels */
    OPF_KERNELS_ELEM  = 3,  /* opf_elem_kernels */
    OPF_KERNELS_OPTIM = 4,  /* opf_optim_kernels */
    OPF_KERNELS_COUNT
} opf_kernel_family;

/* The sub-table of family f on device dev (a pointer to the family's struct,
 * commented above); NULL, with OPF_ERR_UNSUPPORTED naming `who`, the family
 * and the device, when this build has no such kernels there. The one lookup
 * every op dispatcher goes through:
 *   const opf_norm_kernels *k = opf_backend_kernels(ctx, "rmsnorm", dev, OPF_KERNELS_NORM);
 */
const void *opf_backend_kernels(opf_ctx *ctx, const char *who, opf_device dev,
                                opf_kernel_family f);

/* CPU kernels (src/backend/cpu/). 2D tiles share one file per scaling family. */
opf_status opf_cpu_quantize_tensor_fp8(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                       opf_tensor *, const opf_quantize_state *);
opf_status opf_cpu_quantize_mxfp8(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                  opf_tensor *, const opf_quantize_state *);
opf_status opf_cpu_quantize_block(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                  opf_tensor *, const opf_quantize_state *);
opf_status opf_cpu_quantize_nvfp4(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                  opf_tensor *, const opf_quantize_state *);
opf_status opf_cpu_dequantize_tensor_fp8(opf_ctx *, const opf_tensor *, unsigned, float *);
opf_status opf_cpu_dequantize_mxfp8(opf_ctx *, const opf_tensor *, unsigned, float *);
opf_status opf_cpu_dequantize_block(opf_ctx *, const opf_tensor *, unsigned, float *);
opf_status opf_cpu_dequantize_nvfp4(opf_ctx *, const opf_tensor *, unsigned, float *);
opf_status opf_cpu_gemm(opf_ctx *, const opf_gemm_args *);
opf_status opf_cpu_grouped_gemm(opf_ctx *, int, const opf_gemm_args *);

#endif
