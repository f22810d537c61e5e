/* opfuse/context.h: the context (device, allocator with counters, workspace,
 * Philox RNG, determinism, warnings, last error).
 *
 * One context per thread of use. Everything the library allocates goes
 * through the context's allocator, whose counters let tests prove that a
 * step performs no allocation.
 *
 * Debug aids: unoptimized (debug) and AddressSanitizer builds record the
 * first thread that allocates through a context and warn once, through the
 * warning callback, when a second thread does (sharing a context between
 * threads is a race; handing one over after the first thread stops is
 * legal but warns too). Under AddressSanitizer the blocks the default
 * allocator's cache keeps are poisoned (all but their first pointer-sized
 * word, the cache's link), so a use after free through the cache is
 * reported as one.
 *
 *     opf_ctx_options o = opf_ctx_options_default();
 *     o.seed = 1234;
 *     opf_ctx *ctx;
 *     if (opf_ctx_create(&o, &ctx) != OPF_OK) return 1;
 *     ...
 *     opf_ctx_destroy(ctx);
 */
#ifndef OPFUSE_CONTEXT_H
#define OPFUSE_CONTEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "opfuse/export.h"
#include "opfuse/status.h"
#include "opfuse/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Allocator hooks. alloc returns memory aligned to at least `align` bytes or
 * NULL; free(NULL) must be a no-op. */
typedef struct opf_allocator {
    void *(*alloc)(void *user, size_t bytes, size_t align);
    void  (*free)(void *user, void *ptr);
    void  *user;
} opf_allocator;

/* Warnings (never errors) go here; the default prints to stderr. */
typedef void (*opf_warn_fn)(void *user, const char *msg);

/* The most threads a context may ask for (opf_ctx_options.num_threads). */
#define OPF_MAX_THREADS 1024

typedef struct opf_ctx_options {
    opf_device     device;         /* OPF_DEVICE_CPU */
    int            device_index;   /* 0 */
    bool           deterministic;  /* same bits across runs and thread counts (CPU always);
                                      where a device cannot honour it, opf_ctx_create fails
                                      with OPF_ERR_UNSUPPORTED and one message listing what
                                      the request needs */
    uint64_t       seed;           /* Philox key; 0 */
    uint64_t       offset;         /* Philox counter start; 0 */
    int            num_threads;    /* OpenMP threads for element-wise kernels; 0 = default,
                                    * at most OPF_MAX_THREADS */
    opf_allocator  allocator;      /* zeroed = aligned malloc */
    opf_warn_fn    warn;           /* NULL = stderr */
    void          *warn_user;
} opf_ctx_options;

typedef struct opf_alloc_stats {
    uint64_t n_alloc;      /* allocations made through the context so far */
    uint64_t n_free;
    size_t   bytes_live;
    size_t   bytes_peak;
} opf_alloc_stats;

OPF_API opf_ctx_options opf_ctx_options_default(void);
/* Creates a context; OPF_ERR_UNSUPPORTED for a device this build lacks or
 * this machine does not have (device OPF_DEVICE_CUDA without a GPU: the
 * message says so, and CPU contexts keep working). A CUDA context owns the
 * GPU's state: a stream its work is queued on, a caching device allocator,
 * pinned host staging for copies and the cuBLASLt workspace. It makes both
 * host tensors (spec.device CPU) and device tensors (spec.device CUDA). */
OPF_API opf_status opf_ctx_create(const opf_ctx_options *opts, opf_ctx **out);
/* destroy(NULL) is a no-op. Destroy the ops, seqs, graphs and optimizers
 * made with the context before it. Tensor buffers may outlive it: a context
 * destroyed while buffers are alive frees its workspace and caches at once
 * and the rest (itself, the buffer headers) when the last of those buffers
 * is released, so opf_tensor_release stays valid after destroy (on the
 * context's thread, as every call on it; a custom allocator must stay
 * usable until then). */
OPF_API void opf_ctx_destroy(opf_ctx *ctx);

/* Last error message of this context (ctx NULL: of this thread); "" if none. */
OPF_API const char *opf_last_error(const opf_ctx *ctx);
/* Clears the last error. */
OPF_API void opf_clear_error(opf_ctx *ctx);
/* Sets the last error of ctx (and of this thread) to the printf-style
 * message and returns st: for user ops and fusion functions, whose failures
 * then read like the library's own. */
OPF_API opf_status opf_set_error(opf_ctx *ctx, opf_status st, const char *fmt, ...);

/* A NULL context: every entry that returns a status refuses it with
 * OPF_ERR_INVALID_ARG (but for those documented to use an object's own
 * context); the others do nothing and answer neutrally (the CPU, 0, zeroed
 * stats, NULL memory; warnings go to stderr). */
OPF_API opf_device opf_ctx_device(const opf_ctx *ctx);
OPF_API bool opf_ctx_deterministic(const opf_ctx *ctx);
OPF_API int opf_ctx_num_threads(const opf_ctx *ctx);
/* Counters of the memory of the context's device: the host allocator on a
 * CPU context, the device memory of its tensors on a CUDA context (bytes as
 * asked; the caching allocator's rounding is not counted). */
OPF_API void opf_ctx_alloc_stats(const opf_ctx *ctx, opf_alloc_stats *out);
/* Counters of the host allocator, whatever the context's device. ctx and
 * out must not be NULL. */
OPF_API void opf_ctx_host_alloc_stats(const opf_ctx *ctx, opf_alloc_stats *out);
/* Counters of the host's waits on the device and of copies between host and
 * device memory made through the context (all zero on a CPU context). A
 * training step on a device keeps n_sync and n_d2h unchanged once its
 * buffers are warm: amax, scales and the delayed-scaling state stay on the
 * device; the split sizes of grouped ops are the one documented read. */
typedef struct opf_sync_stats {
    uint64_t n_sync;     /* stream or event synchronizations (the host waited) */
    uint64_t n_d2h;      /* device-to-host copies */
    uint64_t bytes_d2h;
    uint64_t n_h2d;      /* host-to-device copies */
    uint64_t bytes_h2d;
} opf_sync_stats;
/* ctx and out must not be NULL. Usage: take the counters before and after a
 * step and compare. */
OPF_API void opf_ctx_sync_stats(const opf_ctx *ctx, opf_sync_stats *out);
/* Waits for the work queued on the context's device (CPU: returns at once).
 * NULL ctx: OPF_ERR_INVALID_ARG. A device error is OPF_ERR_DEVICE with the
 * runtime's message. */
OPF_API opf_status opf_ctx_sync(opf_ctx *ctx);
/* The stream a CUDA context queues its work on: by default one the context
 * creates and owns; with set_stream the caller's cudaStream_t (passed as a
 * void *: the CUDA runtime's value, cudaStreamLegacy being (void *)1), so
 * that the library's kernels, copies and fills are ordered with the
 * caller's own work on it (a framework's current stream); NULL goes back
 * to the context's own stream. Switching orders the new stream after
 * everything queued on the old one (an event recorded on the old stream,
 * waited for by the new one: no host wait, one record and one wait per
 * switch, nothing when the stream does not change), so memory the caching
 * allocator freed on the old stream and the pinned staging stay safe to
 * reuse on the new one. The caller's stream must be of the context's
 * device (else OPF_ERR_INVALID_ARG naming both) and stay alive while it is
 * set and until the context is destroyed or switched back (destroy waits
 * for the stream that is set). Refused (OPF_ERR_STATE, nothing changed)
 * while either stream is capturing a graph. A CPU context has no stream:
 * OPF_ERR_UNSUPPORTED with a message; NULL ctx: OPF_ERR_INVALID_ARG.
 *
 *     opf_ctx_set_stream(ctx, (void *)torch_stream);   // later work on it
 *     ... ops ...
 *     opf_ctx_set_stream(ctx, NULL);                   // the context's own
 */
OPF_API opf_status opf_ctx_set_stream(opf_ctx *ctx, void *stream);
/* The stream work is queued on now (the caller's or the context's own);
 * NULL for a CPU or NULL context. */
OPF_API void *opf_ctx_stream(const opf_ctx *ctx);
/* Emits a warning through the callback (printf-style). */
OPF_API void opf_ctx_warn(opf_ctx *ctx, const char *fmt, ...);

/* Emits a warning (printf-style, through the warning callback) only the
 * first time this context sees `key` (compared by a 64-bit hash of the
 * string; the first 128 keys are remembered). ctx and key must not be NULL. */
OPF_API void opf_ctx_warn_once(opf_ctx *ctx, const char *key, const char *fmt, ...);
/* Restarts the peak counters (opf_alloc_stats.bytes_peak, host and device)
 * at the bytes live now, so that one step's peak can be read after it. ctx
 * must not be NULL. */
OPF_API void opf_ctx_alloc_reset_peak(opf_ctx *ctx);

/* Raw allocation through the context's allocator (counted). NULL when out
 * of memory or bytes > OPF_MAX_BYTES (opfuse/tensor.h). */
OPF_API void *opf_ctx_alloc(opf_ctx *ctx, size_t bytes);
OPF_API void opf_ctx_free(opf_ctx *ctx, void *ptr, size_t bytes);

/* Workspace: scratch owned by the context. reserve grows it (allocating);
 * get returns it without allocating, or NULL if smaller than `bytes`. */
OPF_API opf_status opf_ctx_workspace_reserve(opf_ctx *ctx, size_t bytes);
OPF_API void *opf_ctx_workspace(opf_ctx *ctx, size_t bytes);

/* Scratch stack for op implementations, separate from the workspace above
 * (which kernels such as the GEMM use internally). push returns `bytes` of
 * 64-byte aligned memory or NULL; it allocates only when the stack has never
 * been this deep before, so a repeated step allocates nothing after the
 * first. pop releases everything pushed since `mark` (from scratch_mark). */
OPF_API size_t opf_ctx_scratch_mark(const opf_ctx *ctx);
OPF_API void *opf_ctx_scratch_push(opf_ctx *ctx, size_t bytes);
OPF_API void opf_ctx_scratch_pop(opf_ctx *ctx, size_t mark);

/* ---- Philox4x32-10 --------------------------------------------------------
 * The counter-based generator used for stochastic rounding and dropout, the
 * same on CPU and CUDA: out = philox(counter, key) with 10 rounds. */
OPF_API void opf_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);
OPF_API void opf_ctx_set_rng(opf_ctx *ctx, uint64_t seed, uint64_t offset);
OPF_API void opf_ctx_get_rng(const opf_ctx *ctx, uint64_t *seed, uint64_t *offset);
/* Reserves n counter values for one kernel launch: returns the offset to use
 * and advances the context's offset by n. */
OPF_API uint64_t opf_ctx_rng_advance(opf_ctx *ctx, uint64_t n);

#ifdef __cplusplus
}
#endif
#endif
