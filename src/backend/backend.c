/* backend.c: the kernel table of each device. */
#include "backend/backend-impl.h"

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
