/* cuda.h: the C interface of the CUDA backend (src/backend/cuda/).
 *
 * What core and the tests call, with no CUDA header behind it, so plain C
 * files include it. A context gets its CUDA state (device, stream, caching
 * device allocator, pinned staging, device workspace, cuBLASLt handle and
 * workspace) from opf_cuda_ctx_init and gives it back with opf_cuda_ctx_free.
 * Every kernel entry below finds that state from the context it is handed:
 * the context holds it (core's opf_ctx_device_state), set when
 * opf_ctx_create makes a CUDA context (through core's device runtime table,
 * src/backend/backend.c) and cleared when the context is finished.
 *
 *     opf_ctx_options o = opf_ctx_options_default();
 *     o.device = OPF_DEVICE_CUDA;
 *     opf_ctx_create(&o, &ctx);          // OPF_ERR_UNSUPPORTED without a GPU
 *     opf_tensor_alloc(ctx, &spec, &t);  // spec.device OPF_DEVICE_CUDA
 *
 * Work is ordered on the context's stream. Copies to the host return when
 * the bytes are there; everything else is asynchronous: opf_cuda_sync waits.
 * Every wait and every copy between host and device is counted in the
 * context's opf_sync_stats (opf_ctx_sync_stats).
 *
 * Delayed scaling keeps its whole state on the device (src/quant/delayed.c):
 * the quantize kernels read the slot's scale there and max-accumulate the
 * amax into the slot's entry of history row 0, in device memory, so a step
 * needs no flush and no host round trip. */
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

/* The device runtime's init and fini (opf_ctx_create / the context's end
 * call them). OPF_ERR_UNSUPPORTED with a message when the machine has no
 * usable GPU (or not device_index); OPF_ERR_STATE if ctx already has CUDA
 * state. */
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
/* cuDNN for OPF_CUDA_ATTENTION=cudnn (src/backend/cuda/cudnn_attn.cu):
 * opens libcudnn.so.9 at the first call of the process and gives its
 * cudnnGetVersion() (91900 for 9.19.0) in *version. OPF_ERR_UNSUPPORTED
 * (*version 0) naming why when opfuse was built without cuDNN's headers or
 * the library does not load (dlerror's text). Needs no GPU; ctx may be NULL
 * (the message is then the thread's last error). */
opf_status opf_cuda_cudnn_version(opf_ctx *ctx, size_t *version);
/* For tests, with or without a GPU: builds the cuDNN attention's forward
 * (bwd false) or backward graph of that call shape (dt bf16 or f16; atomic:
 * the backward whose dQ goes through the atomic fp32 accumulator, else the
 * deterministic one) with no handle and finalizes every descriptor and the
 * operation graph, as cuDNN does before choosing an engine; *n_ops its
 * operations. The status and message of the first descriptor cuDNN
 * refuses; OPF_ERR_UNSUPPORTED where cuDNN is not usable or older than 9.8
 * (which needs a GPU for this). */
opf_status opf_cuda_cudnn_graph_check(opf_ctx *ctx, bool bwd, bool atomic, int64_t B,
                                      int64_t T, int64_t H, int64_t D, opf_dtype dt, int *n_ops);

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
/* opf_ctx_set_stream and opf_ctx_stream (context.h) of a CUDA context. */
opf_status opf_cuda_set_stream(opf_ctx *ctx, void *stream);
void *opf_cuda_stream(const opf_ctx *ctx);

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

/* ---- nn: embedding, attention, cross-entropy, sumsq (nn.cu); grouped GEMM
 * (grouped_gemm.cu) ------------------------------------------------------- */
extern const struct opf_nn_kernels opf_cuda_nn;
/* GroupedLinear's GEMMs, as opf_grouped_gemm_kernel (backend-impl.h). */
opf_status opf_cuda_grouped_gemm(opf_ctx *, int, const struct opf_gemm_args *);
/* For tests: y[i] = expf or logf (as the nn kernels compute them) of the
 * float whose bits are first + i * stride (mod 2^32), i < n; y on the device. */
opf_status opf_cuda_nn_math(opf_ctx *ctx, bool log, uint32_t first, uint32_t stride, int64_t n,
                            float *y);

/* ---- CUDA graphs (graph.cu): the compiler's capture and replay -----------
 * capture_begin starts recording the work queued on ctx's stream (nothing
 * runs); capture_end stops it, always, and instantiates what was recorded
 * into *out: it fails (OPF_ERR_DEVICE naming the cause) when a call inside
 * the capture synchronized, allocated device memory or waited on a host
 * copy. launch queues one replay on ctx's stream; free releases the graph
 * (NULL: no-op). Kernel scratch must not grow inside a capture:
 * scratch_reserve sizes it ahead (a warm-up run does the same). */
typedef struct opf_cuda_graph opf_cuda_graph;
opf_status opf_cuda_capture_begin(opf_ctx *ctx);
opf_status opf_cuda_capture_end(opf_ctx *ctx, opf_cuda_graph **out);
opf_status opf_cuda_graph_launch(opf_ctx *ctx, opf_cuda_graph *g);
void opf_cuda_graph_free(opf_ctx *ctx, opf_cuda_graph *g);
/* Kernels, copies and fills the graph holds (0: launch does nothing). */
size_t opf_cuda_graph_num_nodes(const opf_cuda_graph *g);
opf_status opf_cuda_scratch_reserve(opf_ctx *ctx, size_t bytes);

/* ---- the side queue (runtime.cu): device-impl.h's side_fork, side_enter
 * and side_join. A second stream with its own cuBLASLt workspace and kernel
 * scratch, made at the first fork outside a capture (none is made inside
 * one: the work then stays on the context's stream); the fork and the join
 * are events, so a capture records them as a graph's branches.
 * OPF_CUDA_SIDE unset or 0 never uses it (the default), 1 always, auto for
 * work of fewer than four waves of 128 x 128 output tiles. Off by default:
 * measured on an H200 (bench/RESULTS.md, Dec 3) it won nothing, the
 * LayerNorm-MLP step at 256 x 1024 compiled 0.105-0.112 ms without, 0.113-
 * 0.122 ms with auto; GPT-2 124M 478k tokens/s without, 467k with. */
opf_status opf_cuda_side_fork(opf_ctx *ctx, int64_t out_elems, bool *forked);
opf_status opf_cuda_side_enter(opf_ctx *ctx);
opf_status opf_cuda_side_join(opf_ctx *ctx);

/* ---- norm and activation families (norm.cu, act.cu) ---------------------
 * The kernel tables of backend/norm.h and backend/act.h, bit for bit with
 * the CPU's. */
struct opf_norm_kernels;
struct opf_act_kernels;
extern const struct opf_norm_kernels opf_cuda_norm;
extern const struct opf_act_kernels opf_cuda_act;

/* ---- nvfp4 (quantize_nvfp4.cu) -------------------------------------------- */
opf_status opf_cuda_quantize_nvfp4(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                   opf_tensor *, const struct opf_quantize_state *);
opf_status opf_cuda_dequantize_nvfp4(opf_ctx *, const opf_tensor *, unsigned, float *);
/* The GEMM's operand: copy `which` as stored ([rows, cols], the columnwise
 * copy transposed) into bf16 out[rows*cols], fp4 * its e4m3 block scale
 * (exact in bf16); the global scale S_dec is left out (it goes into alpha). */
opf_status opf_cuda_dequantize_nvfp4_bf16(opf_ctx *, const opf_tensor *, unsigned, void *out);

/* ---- element-wise, optimizer and scale families (elem.cu, optim.cu,
 * scale.cu): the CPU contracts of backend/elem.h, optim.h and scale.h, on
 * device memory, bit for bit. */
struct opf_elem_kernels;
struct opf_optim_kernels;
struct opf_scale_kernels;
extern const struct opf_elem_kernels opf_cuda_elem;
extern const struct opf_optim_kernels opf_cuda_optim;
extern const struct opf_scale_kernels opf_cuda_scale;

/* ---- fused outputs (norm.cu, act.cu; qout.h) ------------------------------
 * The fused *_q entries write values and their amax in one kernel, then
 * quantize_tensor_fp8.cu's cast pass reads that amax: the current-scaling
 * FP8 cast of in into out (whose amax component the producer zeroed and
 * max-accumulated with the amax keys of in's values), the bits
 * opf_cuda_quantize_tensor_fp8 gives from in. opf_cuda_fused() is false
 * when the environment sets OPF_CUDA_UNFUSED=1: every *_q entry then runs
 * the composition of the unfused kernels (to compare and to fall back). */
opf_status opf_cuda_quantize_tensor_fp8_cast(opf_ctx *, const opf_quantizer *, const opf_tensor *,
                                             opf_tensor *);
bool opf_cuda_fused(void);

/* How many norm backward calls of the process took the one-launch path
 * (norm_bwd_one.cu), for tests to see which path ran. */
unsigned long long opf_cuda_norm_one_launches(void);

/* How many current-scaling FP8 quantizes of the process ran in one pass
 * (quantize_tensor_fp8.cu: the amax and the cast in one cooperative launch,
 * where the tensor fits one wave), for tests to see which path ran. */
unsigned long long opf_cuda_fp8_one_pass_calls(void);

#ifdef __cplusplus
}
#endif
#endif
