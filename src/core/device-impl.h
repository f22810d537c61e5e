/* device-impl.h: what core asks of a device's runtime: memory, copies and
 * the order of the work queued on it.
 *
 * Core declares this interface and the backend layer implements it: core
 * never includes a backend header, it reaches a device only through the
 * table opf_device_runtime_get returns, and that function is defined in
 * src/backend/backend.c, which fills one table per device the build has
 * (CUDA: the runtime of src/backend/cuda/cuda.h). The CPU has no table: its
 * memory is the context's own counting allocator (context.c).
 *
 * A context of a device calls init when it is created and fini when it is
 * finished (after the last of its buffers is released, context.c); tensors
 * on the device take their memory from alloc and give it back with free. */
#ifndef OPFUSE_DEVICE_IMPL_H
#define OPFUSE_DEVICE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "opfuse/context.h"

typedef enum opf_copy_kind {
    OPF_COPY_H2D = 0,  /* returns once src may be reused */
    OPF_COPY_D2H = 1,  /* returns once the bytes are on the host */
    OPF_COPY_D2D = 2,  /* queued on the device */
} opf_copy_kind;

typedef struct opf_device_runtime {
    const char *name;
    /* The device state of ctx; OPF_ERR_UNSUPPORTED with a message when the
     * machine has no such device (or not device_index). */
    opf_status (*init)(opf_ctx *ctx, int device_index);
    /* Waits for the device and frees everything init and alloc made. */
    void (*fini)(opf_ctx *ctx);
    /* Device memory, OPF_COMPONENT_ALIGN aligned; bytes 0 gives NULL. */
    opf_status (*alloc)(opf_ctx *ctx, size_t bytes, void **out);
    void (*free)(opf_ctx *ctx, void *ptr);
    /* Returns the blocks a caching allocator keeps to the driver. */
    void (*trim)(opf_ctx *ctx);
    opf_status (*copy)(opf_ctx *ctx, void *dst, const void *src, size_t bytes, opf_copy_kind kind);
    opf_status (*memset)(opf_ctx *ctx, void *dst, int value, size_t bytes);
    /* Waits for everything queued for ctx. */
    opf_status (*sync)(opf_ctx *ctx);
    /* opf_ctx_set_stream / opf_ctx_stream (context.h); NULL where the device
     * has no streams. */
    opf_status (*set_stream)(opf_ctx *ctx, void *stream);
    void *(*stream)(const opf_ctx *ctx);
    /* The determinism request (opf_ctx_options.deterministic): NULL when
     * every kernel of the device can give the same bits run to run (its
     * non-deterministic variants, atomics in sums or split-K GEMMs, then
     * read opf_ctx_deterministic and stay off), else one sentence listing
     * what the request needs that this machine lacks. NULL entry: honoured. */
    const char *(*determinism_needs)(opf_ctx *ctx);
    /* Graph capture of the work queued for ctx (the compiler's replays;
     * NULL where the device has none): capture_begin records instead of
     * running, capture_end always stops recording and gives the replayable
     * graph, graph_launch queues one replay, graph_free releases one (NULL:
     * no-op). Work inside a capture must not wait, allocate or copy to the
     * host; scratch_reserve grows the kernels' scratch ahead of it. */
    opf_status (*capture_begin)(opf_ctx *ctx);
    opf_status (*capture_end)(opf_ctx *ctx, void **graph);
    opf_status (*graph_launch)(opf_ctx *ctx, void *graph);
    void (*graph_free)(opf_ctx *ctx, void *graph);
    opf_status (*scratch_reserve)(opf_ctx *ctx, size_t bytes);
    /* A second queue beside the context's, for work of one op that does not
     * need the work the op queues before it on the context's queue (NULL
     * where the device has one queue). side_fork decides whether work
     * writing out_elems outputs is worth it (too small to fill the device
     * alone) and, if so (*forked), marks the point of the context's queue
     * the side work will follow; the op then queues its other work, calls
     * side_enter (what is queued next goes to the side, after the mark) and
     * queues the side work; side_join queues on the context's queue again,
     * ordered after the side work. An op joins before it returns, and side
     * work frees no device memory (the caching allocator's reuse is ordered
     * by the context's queue). */
    opf_status (*side_fork)(opf_ctx *ctx, int64_t out_elems, bool *forked);
    opf_status (*side_enter)(opf_ctx *ctx);
    opf_status (*side_join)(opf_ctx *ctx);
} opf_device_runtime;

/* The runtime of dev; NULL for the CPU and for a device this build lacks.
 * Defined by the backend layer (src/backend/backend.c). */
const opf_device_runtime *opf_device_runtime_get(opf_device dev);

/* The runtime's state of ctx (CUDA: its opf_cuda_state), NULL before init
 * sets it and after fini clears it. */
void *opf_ctx_device_state(const opf_ctx *ctx);
void opf_ctx_set_device_state(opf_ctx *ctx, void *state);
/* The runtime counts, in ctx's opf_sync_stats, every wait of the host for
 * the device (stream or event synchronization) and every copy between host
 * and device memory, whoever asked for it. */
void opf_ctx_count_sync(opf_ctx *ctx);
void opf_ctx_count_copy(opf_ctx *ctx, opf_copy_kind kind, size_t bytes);

/* Device memory of ctx's device from its runtime, counted in
 * ctx->device_stats (opf_ctx_alloc_stats) as the host allocator counts. */
opf_status opf_device_alloc(opf_ctx *ctx, size_t bytes, void **out);
void opf_device_free(opf_ctx *ctx, void *ptr, size_t bytes);

/* Byte fill of n bytes at p, memory of dev: memset on the host, queued on
 * ctx's device otherwise. */
opf_status opf_device_memset(opf_ctx *ctx, opf_device dev, void *p, int value, size_t n);
/* The capture slots of ctx's runtime; OPF_ERR_UNSUPPORTED (with a message)
 * where ctx has no device runtime or its runtime cannot capture.
 * opf_device_can_capture says which, without a message. */
bool opf_device_can_capture(const opf_ctx *ctx);
opf_status opf_device_capture_begin(opf_ctx *ctx);
opf_status opf_device_capture_end(opf_ctx *ctx, void **graph);
opf_status opf_device_graph_launch(opf_ctx *ctx, void *graph);
void opf_device_graph_free(opf_ctx *ctx, void *graph);
opf_status opf_device_scratch_reserve(opf_ctx *ctx, size_t bytes);
/* The side queue of ctx's runtime (side_fork above); *forked false, and
 * nothing done, where it has none. side_enter and side_join only after a
 * side_fork that gave true; side_join also after a failed side_enter. */
opf_status opf_device_side_fork(opf_ctx *ctx, int64_t out_elems, bool *forked);
opf_status opf_device_side_enter(opf_ctx *ctx);
opf_status opf_device_side_join(opf_ctx *ctx);

#endif
