/* backend.c: the kernel table of each device, and the runtime table core
 * asks for device memory and copies (core/device-impl.h: core declares
 * opf_device_runtime_get, this layer defines it, so core reaches CUDA
 * without including a backend header). */
#include "backend/backend-impl.h"
#include "core/device-impl.h"
#include "core/core-impl.h"
#ifdef OPF_HAVE_CUDA
#include "backend/cuda/cuda.h"
#endif

/* The CPU file (family) of each scaling: X(scaling, family) names its
 * kernels opf_cpu_quantize_<family> and opf_cpu_dequantize_<family>. */
#define CPU_SCALING_FAMILIES(X)                                                \
    X(TENSOR, tensor_fp8) X(MXFP8, mxfp8) X(BLOCK_1D, block) X(BLOCK_2D, block)  \
    X(NVFP4_1D, nvfp4) X(NVFP4_2D, nvfp4)
#define QUANTIZE_ENTRY(s, family)   [OPF_SCALING_##s] = opf_cpu_quantize_##family,
#define DEQUANTIZE_ENTRY(s, family) [OPF_SCALING_##s] = opf_cpu_dequantize_##family,

static const opf_backend_i cpu_backend = {
    .name = "cpu",
    .quantize = {CPU_SCALING_FAMILIES(QUANTIZE_ENTRY)},
    .dequantize = {CPU_SCALING_FAMILIES(DEQUANTIZE_ENTRY)},
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
        [OPF_SCALING_NVFP4_1D] = opf_cuda_quantize_nvfp4,
        [OPF_SCALING_NVFP4_2D] = opf_cuda_quantize_nvfp4,
    },
    .dequantize = {
        [OPF_SCALING_TENSOR]   = opf_cuda_dequantize_tensor_fp8,
        [OPF_SCALING_MXFP8]    = opf_cuda_dequantize_mxfp8,
        [OPF_SCALING_BLOCK_1D] = opf_cuda_dequantize_block,
        [OPF_SCALING_BLOCK_2D] = opf_cuda_dequantize_block,
        [OPF_SCALING_NVFP4_1D] = opf_cuda_dequantize_nvfp4,
        [OPF_SCALING_NVFP4_2D] = opf_cuda_dequantize_nvfp4,
    },
    .gemm = opf_cuda_gemm,
    .grouped_gemm = opf_cuda_grouped_gemm,
    .nn = &opf_cuda_nn,
    .norm = &opf_cuda_norm,
    .act = &opf_cuda_act,
    .scale = &opf_cuda_scale,
    .elem = &opf_cuda_elem,
    .optim = &opf_cuda_optim,
};
#endif

#ifdef OPF_HAVE_CUDA
static opf_status cuda_copy(opf_ctx *ctx, void *dst, const void *src, size_t bytes,
                            opf_copy_kind kind)
{
    static const opf_cuda_copy_kind kinds[] = {
        [OPF_COPY_H2D] = OPF_CUDA_H2D, [OPF_COPY_D2H] = OPF_CUDA_D2H, [OPF_COPY_D2D] = OPF_CUDA_D2D};
    return opf_cuda_copy(ctx, dst, src, bytes, kinds[kind]);
}

/* The runtime's graph handles are opaque to core. */
static opf_status cuda_capture_end(opf_ctx *ctx, void **graph)
{
    return opf_cuda_capture_end(ctx, (opf_cuda_graph **)graph);
}
static opf_status cuda_graph_launch(opf_ctx *ctx, void *graph) { return opf_cuda_graph_launch(ctx, graph); }
static void cuda_graph_free(opf_ctx *ctx, void *graph) { opf_cuda_graph_free(ctx, graph); }

static const opf_device_runtime cuda_runtime = {
    .name = "cuda",
    .init = opf_cuda_ctx_init,
    .fini = opf_cuda_ctx_free,
    .alloc = opf_cuda_alloc,
    .free = opf_cuda_free,
    .trim = opf_cuda_empty_cache,
    .copy = cuda_copy,
    .memset = opf_cuda_memset,
    .sync = opf_cuda_sync,
    .set_stream = opf_cuda_set_stream,
    .stream = opf_cuda_stream,
    .capture_begin = opf_cuda_capture_begin,
    .capture_end = cuda_capture_end,
    .graph_launch = cuda_graph_launch,
    .graph_free = cuda_graph_free,
    .scratch_reserve = opf_cuda_scratch_reserve,
    .side_fork = opf_cuda_side_fork,
    .side_enter = opf_cuda_side_enter,
    .side_join = opf_cuda_side_join,
};
#endif

const opf_device_runtime *opf_device_runtime_get(opf_device dev)
{
#ifdef OPF_HAVE_CUDA
    if (dev == OPF_DEVICE_CUDA) return &cuda_runtime;
#endif
    (void)dev;
    return NULL;
}

const opf_backend_i *opf_backend_get(opf_device dev)
{
#ifdef OPF_HAVE_CUDA
    if (dev == OPF_DEVICE_CUDA) return &cuda_backend;
#endif
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
