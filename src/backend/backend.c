/* backend.c: the kernel table of each device. */
#include "backend/backend-impl.h"
#ifdef OPF_HAVE_CUDA
#include "backend/cuda/cuda.h"
#endif

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
    .nn = &opf_cpu_nn,
};

#ifdef OPF_HAVE_CUDA
/* Filled family by family as the kernels land (src/backend/cuda/). */
static const opf_backend_i cuda_backend = {
    .name = "cuda",
    .quantize = {
        [OPF_SCALING_TENSOR]   = opf_cuda_quantize_tensor_fp8,
        [OPF_SCALING_MXFP8]    = opf_cuda_quantize_mxfp8,
        [OPF_SCALING_BLOCK_1D] = opf_cuda_quantize_block,
        [OPF_SCALING_BLOCK_2D] = opf_cuda_quantize_block,
    },
    .dequantize = {
        [OPF_SCALING_TENSOR]   = opf_cuda_dequantize_tensor_fp8,
        [OPF_SCALING_MXFP8]    = opf_cuda_dequantize_mxfp8,
        [OPF_SCALING_BLOCK_1D] = opf_cuda_dequantize_block,
        [OPF_SCALING_BLOCK_2D] = opf_cuda_dequantize_block,
    },
    .gemm = opf_cuda_gemm,
};
#endif

const opf_backend_i *opf_backend_get(opf_device dev)
{
#ifdef OPF_HAVE_CUDA
    if (dev == OPF_DEVICE_CUDA) return &cuda_backend;
#endif
    return dev == OPF_DEVICE_CPU ? &cpu_backend : NULL;
}
