/* opfuse/tensor.h: specs (allocation-free tensor descriptions), their memory
 * layouts, tensors, reference-counted buffers and scale swizzling.
 *
 * A spec says what a tensor is: logical shape, logical (high-precision) dtype,
 * device, and for a quantized tensor its scaling mode, element dtype and which
 * copies (rowwise, columnwise) exist. opf_spec_layout() turns a spec into the
 * list of components with their dtypes, 2D shapes and byte sizes (padding
 * included, docs/numerics.md section 4.2). Every size in the library comes
 * from it.
 *
 * Quantized tensors are viewed as 2D [M, K] with M = prod(shape[:-1]) and
 * K = shape[-1].
 *
 *     opf_spec s = opf_spec_make(2, (int64_t[]){256, 1024}, OPF_BF16);
 *     s.scaling = OPF_SCALING_MXFP8; s.qdtype = OPF_E4M3;
 *     s.usage = OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE;
 *     opf_layout L;
 *     if (opf_spec_layout(&s, &L) == OPF_OK)
 *         printf("%zu bytes\n", L.total_bytes);
 */
#ifndef OPFUSE_TENSOR_H
#define OPFUSE_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "opfuse/export.h"
#include "opfuse/dtype.h"
#include "opfuse/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bounds of every spec, checked by opf_spec_layout (OPF_ERR_SHAPE naming the
 * dims) and by every entry that takes a spec: at most OPF_MAX_DIMS dims,
 * OPF_MAX_NUMEL elements, and OPF_MAX_BYTES bytes of storage (padding
 * included). The counts are far above any memory, so every product of them
 * the library forms fits in int64_t. opf_ctx_alloc refuses more than
 * OPF_MAX_BYTES too. */
#define OPF_MAX_DIMS 8
#define OPF_MAX_NUMEL ((int64_t)1 << 48)
#define OPF_MAX_BYTES ((int64_t)1 << 50)
/* Every component inside a buffer starts at a multiple of this. */
#define OPF_COMPONENT_ALIGN 256

typedef struct opf_ctx opf_ctx;

typedef enum opf_device {
    OPF_DEVICE_CPU  = 0,
    OPF_DEVICE_CUDA = 1,
    OPF_DEVICE_COUNT
} opf_device;

typedef enum opf_scaling {
    OPF_SCALING_NONE      = 0,  /* plain tensor of spec.dtype */
    OPF_SCALING_TENSOR    = 1,  /* per-tensor FP8 (delayed or current scaling) */
    OPF_SCALING_MXFP8     = 2,  /* 1x32 rowwise / 32x1 columnwise E8M0 scales */
    OPF_SCALING_BLOCK_1D  = 3,  /* FP8 1x128 blocks, fp32 scales */
    OPF_SCALING_BLOCK_2D  = 4,  /* FP8 128x128 tiles, fp32 scales */
    OPF_SCALING_NVFP4_1D  = 5,  /* E2M1, 1x16 blocks, E4M3 scales + fp32 global amax */
    OPF_SCALING_NVFP4_2D  = 6,  /* E2M1, 16x16 tiles */
    OPF_SCALING_COUNT
} opf_scaling;

/* Which copies of a quantized tensor exist (bits of opf_spec.usage). */
enum {
    OPF_USAGE_ROWWISE    = 1u << 0,
    OPF_USAGE_COLUMNWISE = 1u << 1,
};

/* Bits of opf_spec.flags. */
enum {
    OPF_SPEC_SWIZZLED = 1u << 0,  /* MXFP8/NVFP4 scales in the GEMM-swizzled layout (4.4) */
    OPF_SPEC_MXFP8_2D = 1u << 1,  /* MXFP8 32x32 blocks: one scale drives both copies */
    OPF_SPEC_NVFP4_RHT = 1u << 2, /* NVFP4 columnwise copy holds Hadamard-rotated values */
    OPF_SPEC_HOST      = 1u << 3, /* a fake's small index tensor the op reads on the host: stays in
                                    host memory whatever the call's device */
};

typedef struct opf_spec {
    int         ndim;                 /* 0..OPF_MAX_DIMS */
    int64_t     shape[OPF_MAX_DIMS];  /* logical shape */
    opf_dtype   dtype;                /* logical dtype (f32, bf16, f16 when quantized) */
    opf_device  device;
    opf_scaling scaling;              /* OPF_SCALING_NONE for a plain tensor */
    opf_dtype   qdtype;               /* element dtype when quantized: e4m3, e5m2, e2m1 */
    unsigned    usage;                /* OPF_USAGE_* bits; ignored when not quantized */
    unsigned    flags;                /* OPF_SPEC_* bits */
} opf_spec;

/* Components of a tensor's storage. A plain tensor has only OPF_COMP_DATA. */
typedef enum opf_component {
    OPF_COMP_DATA          = 0,  /* rowwise data (plain data when unquantized) */
    OPF_COMP_SCALE_INV     = 1,  /* rowwise decode scales */
    OPF_COMP_COL_DATA      = 2,  /* columnwise data (transposed for TENSOR, BLOCK, NVFP4) */
    OPF_COMP_COL_SCALE_INV = 3,  /* columnwise decode scales */
    OPF_COMP_AMAX          = 4,  /* fp32 [1]: amax of the input (TENSOR, NVFP4 rowwise) */
    OPF_COMP_COL_AMAX      = 5,  /* fp32 [1]: NVFP4 columnwise amax (after RHT) */
    OPF_COMP_COUNT
} opf_component;

typedef struct opf_component_desc {
    bool      present;
    opf_dtype dtype;
    int64_t   rows, cols;  /* 2D shape in elements, padding included */
    size_t    nbytes;
    size_t    offset;      /* from the start of the buffer, OPF_COMPONENT_ALIGN aligned */
} opf_component_desc;

typedef struct opf_layout {
    int64_t            m, k;  /* the 2D view [M, K] of the logical shape */
    opf_component_desc comp[OPF_COMP_COUNT];
    size_t             total_bytes;
} opf_layout;

/* A plain spec on the CPU with the given shape and dtype (no quantization). */
OPF_API opf_spec opf_spec_make(int ndim, const int64_t *shape, opf_dtype dtype);
/* Number of logical elements (1 for ndim 0); -1 for a spec outside the
 * bounds above (ndim outside 0..OPF_MAX_DIMS, a negative dim, more than
 * OPF_MAX_NUMEL elements). */
OPF_API int64_t opf_spec_numel(const opf_spec *spec);
/* True when two specs describe the same layout (all fields compared). */
OPF_API bool opf_spec_equal(const opf_spec *a, const opf_spec *b);
/* Writes "bf16[256,1024] mxfp8(e4m3,row+col)" into buf (always terminated);
 * a spec with ndim outside 0..OPF_MAX_DIMS prints as "bf16[ndim 9]". */
OPF_API void opf_spec_str(const opf_spec *spec, char *buf, size_t size);
/* Human name of a scaling mode ("mxfp8"). */
OPF_API const char *opf_scaling_name(opf_scaling s);
/* Human name of a device ("cpu", "cuda"; "device 7" past the list). */
OPF_API const char *opf_device_name(opf_device d);

/* Pure: fills *out from *spec. Checks the spec and returns OPF_ERR_SHAPE for
 * shapes a format cannot take (MXFP8: M, K multiples of 32; NVFP4: multiples
 * of 16; FP8 block: multiples of 16), OPF_ERR_DTYPE for element dtypes a mode
 * cannot hold, OPF_ERR_INVALID_ARG for no usage bit or a columnwise-only
 * per-tensor FP8 spec. The message is in opf_last_error(NULL). */
OPF_API opf_status opf_spec_layout(const opf_spec *spec, opf_layout *out);

/* ---- buffers and tensors -----------------------------------------------
 * A buffer is a reference-counted block from a context's allocator. Tensors
 * never own memory: they point into a buffer and hold one reference to it
 * (or none for caller memory). */
typedef struct opf_buffer opf_buffer;

typedef struct opf_tensor {
    opf_spec    spec;
    void       *data[OPF_COMP_COUNT];  /* NULL where the component is absent */
    opf_buffer *buf;                   /* counted reference; NULL for caller memory */
} opf_tensor;

/* Allocates one buffer laid out by opf_spec_layout(spec) on spec->device and
 * points *out into it: host memory for the CPU, device memory from the
 * context's caching allocator for CUDA (a CUDA spec needs a CUDA context).
 * Scale padding is zero-filled; the rest is uninitialized. On failure *out
 * is zeroed. Release with opf_tensor_release. */
OPF_API opf_status opf_tensor_alloc(opf_ctx *ctx, const opf_spec *spec, opf_tensor *out);
/* A new tensor on device dev with src's spec (device aside) and bytes, every
 * component the layout lists copied. CPU <-> CUDA copies go through the
 * context's pinned staging and return when the bytes are in place (a copy to
 * the host waits for the work queued before it). *out is a new reference the
 * caller releases; src is unchanged. NULL src or out: OPF_ERR_INVALID_ARG; a
 * device other than the host or the context's (OPF_ERR_INVALID_ARG, naming
 * both): *out untouched on any failure. */
OPF_API opf_status opf_tensor_to(opf_ctx *ctx, const opf_tensor *src, opf_device dev,
                                 opf_tensor *out);
/* Copies every component of src into dst, whose spec must equal src's but
 * for the device (else OPF_ERR_SHAPE naming both specs); either may be on the
 * host or on the context's device. NULL ctx, src or dst, or a component
 * without memory: OPF_ERR_INVALID_ARG, nothing copied. Same memory: no-op. */
OPF_API opf_status opf_tensor_copy(opf_ctx *ctx, const opf_tensor *src, opf_tensor *dst);
/* Points *out at caller memory laid out by opf_spec_layout(spec) starting at
 * base. No reference is taken: the caller keeps base alive. */
OPF_API opf_status opf_tensor_wrap(const opf_spec *spec, void *base, opf_tensor *out);
/* Another counted reference to the same memory: *dst = *src, refcount + 1. */
OPF_API void opf_tensor_retain(const opf_tensor *src, opf_tensor *dst);
/* Drops the reference and zeroes *t. NULL or a zeroed tensor is a no-op. */
OPF_API void opf_tensor_release(opf_tensor *t);
/* Bytes held by the tensor's buffer (0 for caller memory). */
OPF_API size_t opf_tensor_buffer_bytes(const opf_tensor *t);

/* ---- scale swizzling (numerics.md section 4.4) -------------------------
 * Byte scales (E8M0, E4M3) of R x C (R multiple of 128, C multiple of 4).
 * swizzle: dst[swizzle_index(i,j)] = src[i*C + j]; unswizzle is its inverse.
 * src_is_transposed: src is stored as C x R (MXFP8 columnwise compact scales),
 * element (i, j) read from src[j*R + i]. */
OPF_API size_t opf_swizzle_index(int64_t i, int64_t j, int64_t C);
OPF_API opf_status opf_swizzle_scales(const uint8_t *src, uint8_t *dst, int64_t R, int64_t C,
                                      bool src_is_transposed);
OPF_API opf_status opf_unswizzle_scales(const uint8_t *src, uint8_t *dst, int64_t R, int64_t C,
                                        bool dst_is_transposed);
/* Convert an MXFP8/NVFP4 tensor's scale components between compact and
 * swizzled in place (uses the context workspace) and update spec.flags. */
OPF_API opf_status opf_tensor_swizzle(opf_ctx *ctx, opf_tensor *t, bool swizzled);

#ifdef __cplusplus
}
#endif
#endif
