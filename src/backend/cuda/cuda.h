/* cuda.h: the C interface of the CUDA backend (src/backend/cuda/).
 *
 * What core and the tests call, with no CUDA header behind it, so plain C
 * files include it. A context gets its CUDA state (device, stream, caching
 * device allocator, pinned staging, device workspace, cuBLASLt handle and
 * workspace) from opf_cuda_ctx_init and gives it back with opf_cuda_ctx_free.
 * Every kernel entry below finds that state from the context it is handed.
 *
 * Until core holds the state itself, the CUDA side keeps a small table from
 * context to state; a CPU context with CUDA state attached runs these
 * kernels on device memory (tensors with spec.device = OPF_DEVICE_CUDA).
 *
 *     opf_ctx *ctx;                       // a context of the caller
 *     if (opf_cuda_ctx_init(ctx, 0) == OPF_ERR_UNSUPPORTED) ...;  // no GPU
 *     void *p;
 *     opf_cuda_alloc(ctx, bytes, &p);
 *     opf_cuda_copy(ctx, p, host, bytes, OPF_CUDA_H2D);
 *     ...
 *     opf_cuda_free(ctx, p);
 *     opf_cuda_ctx_free(ctx);
 *
 * Work is ordered on the context's stream. Copies to the host return when
 * the bytes are there; everything else is asynchronous: opf_cuda_sync waits.
 *
 * Delayed scaling keeps its amax on the device: the quantize kernels
 * max-accumulate it per (state, slot), and opf_cuda_delayed_flush brings it
 * into row 0 of each state's history on the host. Flush before
 * opf_delayed_state_update, before reading the history and before
 * destroying a state quantized since the last flush. */
#ifndef OPFUSE_BACKEND_CUDA_H
#define OPFUSE_BACKEND_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "opfuse/context.h"
#include "opfuse/gemm.h"
#include "opfuse/quant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- runtime (runtime.cu) ------------------------------------------------ */

/* OPF_ERR_UNSUPPORTED with a message when the machine has no usable GPU
 * (or not device_index); OPF_ERR_STATE if ctx already has CUDA state. */
opf_status opf_cuda_ctx_init(opf_ctx *ctx, int device_index);
/* Waits for the stream, frees every cached and live block. NULL or a context
 * without CUDA state: no-op. */
void opf_cuda_ctx_free(opf_ctx *ctx);
/* True when ctx has CUDA state. */
bool opf_cuda_ctx_ready(const opf_ctx *ctx);
/* Number of GPUs the driver shows (0 when none or no driver). */
int opf_cuda_device_count(void);
/* "NVIDIA H200, 132 SMs, cc 9.0, 139 GiB" into buf. */
opf_status opf_cuda_device_name(opf_ctx *ctx, char *buf, size_t size);

/* Device memory from the caching allocator, 256-byte aligned. Blocks are
 * reused in stream order (a freed block goes to later work on the same
 * stream). Out of memory is OPF_ERR_NO_MEMORY naming the bytes asked and
 * free. bytes 0 gives *out NULL. */
opf_status opf_cuda_alloc(opf_ctx *ctx, size_t bytes, void **out);
void opf_cuda_free(opf_ctx *ctx, void *ptr);  /* NULL: no-op */
/* Counters of the device allocator (live bytes and peak, as the CPU one). */
void opf_cuda_alloc_stats(const opf_ctx *ctx, opf_alloc_stats *out);
/* Bytes kept in the cache (freed, not returned to the driver). */
size_t opf_cuda_cached_bytes(const opf_ctx *ctx);
/* Returns every cached block to the driver. */
void opf_cuda_empty_cache(opf_ctx *ctx);

typedef enum opf_cuda_copy_kind {
    OPF_CUDA_H2D = 0,  /* through pinned staging */
    OPF_CUDA_D2H = 1,  /* through pinned staging; returns when the bytes are on the host */
    OPF_CUDA_D2D = 2,  /* asynchronous */
} opf_cuda_copy_kind;
opf_status opf_cuda_copy(opf_ctx *ctx, void *dst, const void *src, size_t bytes,
                         opf_cuda_copy_kind kind);
/* Byte fill of device memory, asynchronous. */
opf_status opf_cuda_memset(opf_ctx *ctx, void *dst, int value, size_t bytes);
/* Waits for everything queued on the context's stream. */
opf_status opf_cuda_sync(opf_ctx *ctx);
/* Waits for the stream and max-accumulates the device amaxes of every
 * delayed-scaling slot quantized since the last flush into row 0 of its
 * state's history (numerics.md 3.1); forgets the slots. */
opf_status opf_cuda_delayed_flush(opf_ctx *ctx);

/* Device tensors come from opf_tensor_alloc on a CUDA context (spec.device
 * OPF_DEVICE_CUDA) and move with opf_tensor_to / opf_tensor_copy (core). */

/* Event timing on the context's stream (benchmarks). */
typedef struct opf_cuda_timer opf_cuda_timer;
opf_status opf_cuda_timer_create(opf_ctx *ctx, int n_marks, opf_cuda_timer **out);
void opf_cuda_timer_destroy(opf_cuda_timer *t);
opf_status opf_cuda_timer_mark(opf_ctx *ctx, opf_cuda_timer *t, int i);
/* Milliseconds between marks i and j (syncs on mark j). */
opf_status opf_cuda_timer_ms(opf_cuda_timer *t, int i, int j, float *ms);

/* ---- kernel entries: the slots of the cuda backend table ------------------
 * Same contracts as the CPU entries of backend-impl.h, on device tensors.
 * Dequantize writes fp32 to device memory. */
struct opf_quantize_state;
opf_status opf_cuda_quantize_tensor_fp8(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                        opf_tensor *, const struct opf_quantize_state *);
opf_status opf_cuda_dequantize_tensor_fp8(opf_ctx *, const opf_tensor *, unsigned, float *);
opf_status opf_cuda_quantize_mxfp8(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                   opf_tensor *, const struct opf_quantize_state *);
opf_status opf_cuda_dequantize_mxfp8(opf_ctx *, const opf_tensor *, unsigned, float *);
/* The same decode into bf16 out[M*K] (exact: the input of the MXFP8 GEMM). */
opf_status opf_cuda_dequantize_mxfp8_bf16(opf_ctx *, const opf_tensor *, unsigned, void *out);
opf_status opf_cuda_quantize_block(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                   opf_tensor *, const struct opf_quantize_state *);
opf_status opf_cuda_dequantize_block(opf_ctx *, const opf_tensor *, unsigned, float *);

/* The GEMM entry (gemm.cu), arguments as struct opf_gemm_args. */
struct opf_gemm_args;
opf_status opf_cuda_gemm(opf_ctx *, const struct opf_gemm_args *);
/* Drops the cached cuBLASLt algorithm choices (one per shape). */
void opf_cuda_gemm_clear_cache(opf_ctx *ctx);

/* ---- element-wise, optimizer and scale families (elem.cu, optim.cu,
 * scale.cu): the CPU contracts of backend/elem.h, optim.h and scale.h, on
 * device memory, bit for bit. */
struct opf_elem_kernels;
struct opf_optim_kernels;
struct opf_scale_kernels;
extern const struct opf_elem_kernels opf_cuda_elem;
extern const struct opf_optim_kernels opf_cuda_optim;
extern const struct opf_scale_kernels opf_cuda_scale;

#ifdef __cplusplus
}
#endif
#endif
