/* backend.c: the kernel table of each device. */
#include "backend/backend-impl.h"
#include "core/core-impl.h"

static const opf_backend_i cpu_backend = {
    .name = "cpu",
    .quantize = {
        [OPF_SCALING_TENSOR]   = opf_cpu_quantize_tensor_fp8,
        [OPF_SCALING_MXFP8]    = opf_cpu_quantize_mxfp8,
        [OPF_SCALING_BLOCK_1D] = opf_cpu_quantize_block,
        [OPF_SCALING_BLOCK_2D] = opf_cpu_quantize_block,
        [OPF_SCALING_NVFP4_1D] = opf_cpu_quantize_nvfp4,
        [OPF_SCALING_NVFP4_2D] = opf_cpu_quantize_nvfp4,
    },
    .dequantize = {
        [OPF_SCALING_TENSOR]   = opf_cpu_dequantize_tensor_fp8,
        [OPF_SCALING_MXFP8]    = opf_cpu_dequantize_mxfp8,
        [OPF_SCALING_BLOCK_1D] = opf_cpu_dequantize_block,
        [OPF_SCALING_BLOCK_2D] = opf_cpu_dequantize_block,
        [OPF_SCALING_NVFP4_1D] = opf_cpu_dequantize_nvfp4,
        [OPF_SCALING_NVFP4_2D] = opf_cpu_dequantize_nvfp4,
    },
    .gemm = opf_cpu_gemm,
    .grouped_gemm = opf_cpu_grouped_gemm,
    .scale = &opf_cpu_scale,
    .norm = &opf_cpu_norm,
    .act = &opf_cpu_act,
    .elem = &opf_cpu_elem,
    .optim = &opf_cpu_optim,
};

const opf_backend_i *opf_backend_get(opf_device dev)
{
    return dev == OPF_DEVICE_CPU ? &cpu_backend : NULL;
}

static const char *const family_names[] = {
    [OPF_KERNELS_SCALE] = "scale",      [OPF_KERNELS_NORM] = "norm",
    [OPF_KERNELS_ACT] = "activation",   [OPF_KERNELS_ELEM] = "element-wise",
    [OPF_KERNELS_OPTIM] = "optimizer",
};
_Static_assert(sizeof family_names / sizeof family_names[0] == OPF_KERNELS_COUNT,
               "one name per kernel family");

static const void *family_of(const opf_backend_i *be, opf_kernel_family f)
{
    switch (f) {
    case OPF_KERNELS_SCALE: return be->scale;
    case OPF_KERNELS_NORM: return be->norm;
    case OPF_KERNELS_ACT: return be->act;
    case OPF_KERNELS_ELEM: return be->elem;
    case OPF_KERNELS_OPTIM: return be->optim;
    default: return NULL;
    }
}

const void *opf_backend_kernels(opf_ctx *ctx, const char *who, opf_device dev,
                                opf_kernel_family f)
{
    const opf_backend_i *be = opf_backend_get(dev);
    const void *k = be && (unsigned)f < OPF_KERNELS_COUNT ? family_of(be, f) : NULL;
    if (!k)
        opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: no %s kernels on device %d", who,
                  (unsigned)f < OPF_KERNELS_COUNT ? family_names[f] : "such", (int)dev);
    return k;
}
