/* runtime.cu: the CUDA state of a context: device and stream, a caching
 * device allocator, pinned staging for host copies, the kernels' device
 * scratch, the cuBLASLt handle and workspace, event timers (cuDNN's handle
 * and plans are cudnn_attn.cu's; freed here with the state). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda-impl.h"

enum {
    SMALL_CLASS = 512,               /* blocks below 1 MiB round up to this */
    STAGE_BYTES = 8 << 20,           /* each half of the pinned staging buffer */
    LT_WS_BYTES = 32 << 20,          /* cuBLASLt workspace on Hopper (cuda-hopper.md) */
};

/* ---- the state in the context ------------------------------------------ */

opf_cuda_state *opf_cuda_state_of(opf_ctx *ctx, const char *fn)
{
    opf_cuda_state *s = ctx ? (opf_cuda_state *)opf_ctx_device_state(ctx) : NULL;
    if (!s)
        opf_error(ctx, OPF_ERR_STATE, "%s: the context has no CUDA state (a CUDA context comes "
                  "from opf_ctx_create with device OPF_DEVICE_CUDA)", fn);
    return s;
}

static opf_cuda_state *state_if_any(const opf_ctx *ctx)
{
    return ctx ? (opf_cuda_state *)opf_ctx_device_state(ctx) : NULL;
}

bool opf_cuda_ctx_ready(const opf_ctx *ctx) { return state_if_any(ctx) != NULL; }

/* Every host wait goes through these two, so the context counts it. */
opf_status opf_cuda_stream_sync(opf_ctx *ctx, opf_cuda_state *s, const char *fn)
{
    opf_ctx_count_sync(ctx);
    OPF_CUDA_TRY(ctx, fn, cudaStreamSynchronize(s->stream));
    return opf_cuda_deferred_check(ctx, s);
}

opf_status opf_cuda_deferred_check(opf_ctx *ctx, opf_cuda_state *s)
{
    const char *fn = "embedding (cuda, checked in a device graph)";
    if (!s->deferred_armed) return OPF_OK;
    unsigned long long w = ~0ull;
    OPF_CUDA_TRY(ctx, fn, cudaMemcpy(&w, s->deferred_bad, sizeof w, cudaMemcpyDeviceToHost));
    if (w == ~0ull) return OPF_OK;
    OPF_CUDA_TRY(ctx, fn, cudaMemset(s->deferred_bad, 0xFF, sizeof w));
    return opf_error(ctx, OPF_ERR_INVALID_ARG, "embedding: token %d at row %lld is outside the "
                     "vocabulary (found on the device by a replayed graph, reported at this "
                     "wait; that call's embedding rows for it are NaN)",
                     (int)(int32_t)(uint32_t)(w & 0xFFFFFFFFull), (long long)(w >> 32));
}

static opf_status event_sync(opf_ctx *ctx, cudaEvent_t ev, const char *fn)
{
    opf_ctx_count_sync(ctx);
    OPF_CUDA_TRY(ctx, fn, cudaEventSynchronize(ev));
    return OPF_OK;
}

opf_status opf_cuda_fail(opf_ctx *ctx, cudaError_t e, const char *fn, const char *call)
{
    if (e == cudaErrorMemoryAllocation) {
        size_t free_b = 0, total = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total);
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: %s: %s (%zu bytes free of %zu)", fn, call,
                         cudaGetErrorString(e), free_b, total);
    }
    cudaGetLastError();  /* clear a non-sticky error so later calls can run */
    return opf_error(ctx, OPF_ERR_DEVICE, "%s: %s failed: %s (%s)", fn, call, cudaGetErrorString(e),
                     cudaGetErrorName(e));
}

opf_status opf_cublas_fail(opf_ctx *ctx, cublasStatus_t e, const char *fn, const char *call)
{
    opf_status st = e == CUBLAS_STATUS_NOT_SUPPORTED ? OPF_ERR_UNSUPPORTED
                    : e == CUBLAS_STATUS_ALLOC_FAILED ? OPF_ERR_NO_MEMORY
                                                       : OPF_ERR_DEVICE;
    return opf_error(ctx, st, "%s: %s failed: %s (%s)", fn, call, cublasLtGetStatusString(e),
                     cublasLtGetStatusName(e));
}

int opf_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

static void state_destroy(opf_cuda_state *s);

static opf_status state_create(opf_ctx *ctx, int dev, opf_cuda_state *s)
{
    const char *fn = "opf_cuda_ctx_init";
    s->device = dev;
    OPF_CUDA_TRY(ctx, fn, cudaSetDevice(dev));
    OPF_CUDA_TRY(ctx, fn, cudaDeviceGetAttribute(&s->sm_count, cudaDevAttrMultiProcessorCount, dev));
    OPF_CUDA_TRY(ctx, fn, cudaStreamCreateWithFlags(&s->own_stream, cudaStreamNonBlocking));
    s->stream = s->own_stream;
    OPF_CUDA_TRY(ctx, fn, cudaEventCreateWithFlags(&s->switched, cudaEventDisableTiming));
    OPF_CUBLAS_TRY(ctx, fn, cublasLtCreate(&s->lt));
    s->lt_ws_bytes = LT_WS_BYTES;
    OPF_CUDA_TRY(ctx, fn, cudaMalloc(&s->lt_ws, s->lt_ws_bytes));
    s->pinned_bytes = 2 * (size_t)STAGE_BYTES;
    OPF_CUDA_TRY(ctx, fn, cudaMallocHost(&s->pinned, s->pinned_bytes));
    for (int i = 0; i < 2; i++)
        OPF_CUDA_TRY(ctx, fn, cudaEventCreateWithFlags(&s->staged[i], cudaEventDisableTiming));
    OPF_CUDA_TRY(ctx, fn, cudaMalloc(&s->deferred_bad, sizeof *s->deferred_bad));
    OPF_CUDA_TRY(ctx, fn, cudaMemset(s->deferred_bad, 0xFF, sizeof *s->deferred_bad));
    /* the side queue's resources are made at its first fork (side_fork) */
    const char *v = getenv("OPF_CUDA_SIDE");
    s->side_mode = !v ? 0 : !strcmp(v, "1") ? 1 : !strcmp(v, "auto") ? 2 : 0;
    return OPF_OK;
}

opf_status opf_cuda_ctx_init(opf_ctx *ctx, int device_index)
{
    const char *fn = "opf_cuda_ctx_init";
    OPF_CHECK_NULL(ctx, fn, ctx);
    if (state_if_any(ctx)) return opf_error(ctx, OPF_ERR_STATE, "%s: the context has CUDA state", fn);
    int n = opf_cuda_device_count();
    if (n == 0)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: no CUDA GPU on this machine (the CPU "
                         "backend keeps working)", fn);
    if (device_index < 0 || device_index >= n)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: device %d asked, the machine has %d GPU%s",
                         fn, device_index, n, n == 1 ? "" : "s");
    opf_cuda_state *s = (opf_cuda_state *)calloc(1, sizeof *s);
    if (!s) return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
    opf_status st = state_create(ctx, device_index, s);
    if (st) state_destroy(s);
    else opf_ctx_set_device_state(ctx, s);
    return st;
}

static void drop_blocks(opf_cuda_block *b, int n)
{
    for (int i = 0; i < n; i++) cudaFree(b[i].ptr);
}

static void state_destroy(opf_cuda_state *s)
{
    if (s->other.stream) cudaStreamSynchronize(s->other.stream);  /* the side queue's work first */
    if (s->stream) cudaStreamSynchronize(s->stream);  /* the caller's, when one is set */
    if (s->own_stream) cudaStreamSynchronize(s->own_stream);
    drop_blocks(s->free_list, s->n_free);
    drop_blocks(s->live, s->n_live);
    free(s->free_list);
    free(s->live);
    opf_cuda_algo_cache_clear(s);  /* the cached cuBLASLt descriptors */
    free(s->algos);
    opf_cudnn_state_free(s->cudnn);  /* cuDNN's handle and plans (cudnn_attn.cu) */
    cudaFree(s->ws);
    for (int i = 0; i < s->n_retired; i++) cudaFree(s->ws_retired[i]);
    cudaFree(s->deferred_bad);
    free(s->ws_retired);
    cudaFree(s->lt_ws);
    cudaFree(s->other.ws);
    cudaFree(s->other.lt_ws);
    if (s->other.stream) cudaStreamDestroy(s->other.stream);
    if (s->side_fork) cudaEventDestroy(s->side_fork);
    if (s->side_done) cudaEventDestroy(s->side_done);
    cudaFreeHost(s->pinned);
    for (int i = 0; i < 2; i++)
        if (s->staged[i]) cudaEventDestroy(s->staged[i]);
    if (s->switched) cudaEventDestroy(s->switched);
    if (s->lt) cublasLtDestroy(s->lt);
    if (s->own_stream) cudaStreamDestroy(s->own_stream);
    free(s);
}

void opf_cuda_ctx_free(opf_ctx *ctx)
{
    opf_cuda_state *s = state_if_any(ctx);
    if (!s) return;
    opf_ctx_set_device_state(ctx, NULL);
    state_destroy(s);
}

opf_status opf_cuda_device_name(opf_ctx *ctx, char *buf, size_t size)
{
    const char *fn = "opf_cuda_device_name";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    cudaDeviceProp p;
    OPF_CUDA_TRY(ctx, fn, cudaGetDeviceProperties(&p, s->device));
    snprintf(buf, size, "%s, %d SMs, cc %d.%d, %.0f GiB", p.name, p.multiProcessorCount, p.major,
             p.minor, (double)p.totalGlobalMem / (1 << 30));
    return OPF_OK;
}

/* ---- the stream -----------------------------------------------------------
 * One stream at a time carries the context's work. A switch makes the new
 * stream wait for an event recorded on the old one, so the context's work
 * stays one chain in queue order whatever stream each part ran on: what the
 * allocator, the staging halves and the scratch assume (below). */

/* OPF_ERR_STATE when st is capturing a graph (a switch would cut the graph).
 * cudaStreamIsCapturing is the one query legal on a capturing stream: most
 * others (cudaStreamGetDevice among them) fail there and invalidate the
 * capture, so this runs before anything else touches st. A handle it
 * refuses is no stream (OPF_ERR_INVALID_ARG), except the legacy stream's
 * refusal while a blocking stream captures (OPF_ERR_STATE). */
static opf_status not_capturing(opf_ctx *ctx, cudaStream_t st, const char *fn, const char *which)
{
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(st, &cs);
    if (e == cudaErrorStreamCaptureImplicit) {
        cudaGetLastError();
        cs = cudaStreamCaptureStatusActive;
    } else if (e != cudaSuccess) {
        cudaGetLastError();
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %s stream %p is not a CUDA stream "
                         "(cudaStreamIsCapturing: %s)", fn, which, (void *)st,
                         cudaGetErrorString(e));
    }
    if (cs == cudaStreamCaptureStatusNone) return OPF_OK;
    return opf_error(ctx, OPF_ERR_STATE, "%s: %s stream is capturing a graph: switch before or "
                     "after the capture", fn, which);
}

/* OPF_ERR_INVALID_ARG unless st is a stream of the context's device. The
 * special handles (legacy and per-thread default streams) are the current
 * device's: accepted when that is the context's. */
static opf_status stream_on_device(opf_ctx *ctx, const opf_cuda_state *s, cudaStream_t st,
                                   const char *fn)
{
#if CUDART_VERSION >= 12080
    if (st == cudaStreamLegacy || st == cudaStreamPerThread) {
        int cur = -1;  /* the handles mean the current device's stream: it must be ours */
        OPF_CUDA_TRY(ctx, fn, cudaGetDevice(&cur));
        if (cur == s->device) return OPF_OK;
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the default stream handle %p is the "
                         "current device's (cuda:%d), the context is on cuda:%d: make cuda:%d "
                         "current first", fn, (void *)st, cur, s->device, s->device);
    }
    int dev = -1;
    cudaError_t e = cudaStreamGetDevice(st, &dev);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: %p is not a CUDA stream "
                         "(cudaStreamGetDevice: %s)", fn, (void *)st, cudaGetErrorString(e));
    }
    if (dev != s->device)
        return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: the stream is on cuda:%d, the context "
                         "on cuda:%d", fn, dev, s->device);
#else
    (void)ctx, (void)s, (void)st, (void)fn;
#endif
    return OPF_OK;
}

opf_status opf_cuda_set_stream(opf_ctx *ctx, void *stream)
{
    const char *fn = "opf_ctx_set_stream";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (s->on_side)
        return opf_error(ctx, OPF_ERR_STATE, "%s: called inside an op's side-queue work", fn);
    cudaStream_t next = stream ? (cudaStream_t)stream : s->own_stream;
    if (next == s->stream) return OPF_OK;
    /* capture first: the device query below would break a capture in progress */
    opf_status st = not_capturing(ctx, s->stream, fn, "the current");
    if (!st) st = not_capturing(ctx, next, fn, "the new");
    if (!st) st = stream_on_device(ctx, s, next, fn);
    if (st) return st;
    OPF_CUDA_TRY(ctx, fn, cudaEventRecord(s->switched, s->stream));
    OPF_CUDA_TRY(ctx, fn, cudaStreamWaitEvent(next, s->switched, 0));
    s->stream = next;
    return OPF_OK;
}

/* ---- the side queue ------------------------------------------------------- */

void opf_cuda_swap_lanes(opf_cuda_state *s)
{
    opf_cuda_lane cur = {s->stream, s->lt_ws, s->ws, s->ws_bytes};
    s->stream = s->other.stream, s->lt_ws = s->other.lt_ws;
    s->ws = s->other.ws, s->ws_bytes = s->other.ws_bytes;
    s->other = cur;
    s->on_side = !s->on_side;
}

static bool capturing(cudaStream_t st)
{
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(st, &cs);
    if (e != cudaSuccess) cudaGetLastError();
    return e != cudaSuccess || cs != cudaStreamCaptureStatusNone;
}

/* The side queue's stream, workspace and events, made once (outside a
 * capture: cudaMalloc would break one). */
static opf_status side_make(opf_ctx *ctx, opf_cuda_state *s, const char *fn)
{
    if (s->other.stream) return OPF_OK;
    cudaStream_t st = NULL;
    void *ws = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaMalloc(&ws, s->lt_ws_bytes);
    for (int i = 0; i < 2 && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming);
    if (e != cudaSuccess) {
        for (int i = 0; i < 2; i++)
            if (ev[i]) cudaEventDestroy(ev[i]);
        cudaFree(ws);
        if (st) cudaStreamDestroy(st);
        return opf_cuda_fail(ctx, e, fn, "the side queue's stream, workspace or events");
    }
    s->other.stream = st, s->other.lt_ws = ws;
    s->side_fork = ev[0], s->side_done = ev[1];
    return OPF_OK;
}

opf_status opf_cuda_side_fork(opf_ctx *ctx, int64_t out_elems, bool *forked)
{
    const char *fn = "opf_cuda_side_fork";
    *forked = false;
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (s->on_side) return opf_error(ctx, OPF_ERR_STATE, "%s: already on the side queue", fn);
    const int64_t tile = 128 * 128;
    bool worth = s->side_mode == 1 || (s->side_mode == 2 && out_elems < 4 * tile * s->sm_count);
    if (!worth || (!s->other.stream && capturing(s->stream))) return OPF_OK;
    opf_status st = side_make(ctx, s, fn);
    if (st) return st;
    OPF_CUDA_TRY(ctx, fn, cudaEventRecord(s->side_fork, s->stream));
    *forked = true;
    return OPF_OK;
}

opf_status opf_cuda_side_enter(opf_ctx *ctx)
{
    const char *fn = "opf_cuda_side_enter";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (s->on_side || !s->other.stream)
        return opf_error(ctx, OPF_ERR_STATE, "%s: %s", fn,
                         s->on_side ? "already on the side queue" : "no fork before it");
    OPF_CUDA_TRY(ctx, fn, cudaStreamWaitEvent(s->other.stream, s->side_fork, 0));
    opf_cuda_swap_lanes(s);
    return OPF_OK;
}

/* Back on the context's queue, after the side's work. Should the record or
 * the wait fail outside a capture, the host waits for the side instead, so
 * nothing the op frees next is still read there (inside a capture the
 * failure ends the capture, which capture_end reports). */
opf_status opf_cuda_side_join(opf_ctx *ctx)
{
    const char *fn = "opf_cuda_side_join";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (!s->on_side) return OPF_OK;  /* side_enter failed: nothing was queued there */
    cudaError_t e = cudaEventRecord(s->side_done, s->stream);
    opf_cuda_swap_lanes(s);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(s->stream, s->side_done, 0);
    if (e == cudaSuccess) return OPF_OK;
    cudaGetLastError();
    if (!capturing(s->stream)) {
        opf_ctx_count_sync(ctx);
        cudaStreamSynchronize(s->other.stream);
    }
    return opf_cuda_fail(ctx, e, fn, "the join's event");
}

void *opf_cuda_stream(const opf_ctx *ctx)
{
    opf_cuda_state *s = state_if_any(ctx);
    return s ? (void *)s->stream : NULL;
}

/* ---- caching allocator ----------------------------------------------------
 * Size classes: multiples of 512 bytes below 1 MiB, above that four classes
 * per power of two (at most 25% slack). A freed block goes to the free list
 * of its class; the next allocation of that class takes it. The context's
 * work is one chain in queue order (a stream switch waits for the old
 * stream, above), so queue order alone makes the reuse safe: work queued
 * after the free runs after the work that used the block before. */

static size_t size_class(size_t bytes)
{
    if (bytes < ((size_t)1 << 20)) return (bytes + SMALL_CLASS - 1) / SMALL_CLASS * SMALL_CLASS;
    int top = 63 - __builtin_clzll((unsigned long long)bytes);
    size_t step = (size_t)1 << (top - 2);
    return (bytes + step - 1) / step * step;
}

static bool push_block(opf_cuda_block **arr, int *n, int *cap, opf_cuda_block b)
{
    if (*n == *cap) {
        int nc = *cap ? *cap * 2 : 64;
        opf_cuda_block *p = (opf_cuda_block *)realloc(*arr, (size_t)nc * sizeof *p);
        if (!p) return false;
        *arr = p;
        *cap = nc;
    }
    (*arr)[(*n)++] = b;
    return true;
}

static int find_block(const opf_cuda_block *arr, int n, const void *ptr, size_t size)
{
    for (int i = n - 1; i >= 0; i--)
        if (ptr ? arr[i].ptr == ptr : arr[i].size == size) return i;
    return -1;
}

static void empty_cache(opf_cuda_state *s)
{
    drop_blocks(s->free_list, s->n_free);
    s->n_free = 0;
    s->cached_bytes = 0;
}

/* cudaMalloc, and once more after returning the cache to the driver. */
static opf_status device_malloc(opf_ctx *ctx, opf_cuda_state *s, size_t size, size_t asked,
                                void **out)
{
    cudaError_t e = cudaMalloc(out, size);
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        opf_ctx_count_sync(ctx);
        cudaStreamSynchronize(s->stream);
        empty_cache(s);
        e = cudaMalloc(out, size);
    }
    if (e == cudaErrorMemoryAllocation) {
        size_t free_b = 0, total = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total);
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_cuda_alloc: out of device memory: %zu bytes "
                         "asked (class %zu), %zu bytes free of %zu", asked, size, free_b, total);
    }
    OPF_CUDA_TRY(ctx, "opf_cuda_alloc", e);
    return OPF_OK;
}

opf_status opf_cuda_alloc(opf_ctx *ctx, size_t bytes, void **out)
{
    const char *fn = "opf_cuda_alloc";
    OPF_CHECK_NULL(ctx, fn, out);
    *out = NULL;
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (bytes == 0) return OPF_OK;
    size_t size = size_class(bytes);
    opf_cuda_block b = {NULL, size};
    int i = find_block(s->free_list, s->n_free, NULL, size);
    if (i >= 0) {
        b = s->free_list[i];
        s->free_list[i] = s->free_list[--s->n_free];
        s->cached_bytes -= size;
    } else {
        opf_status st = device_malloc(ctx, s, size, bytes, &b.ptr);
        if (st) return st;
    }
    if (!push_block(&s->live, &s->n_live, &s->cap_live, b)) {
        cudaFree(b.ptr);
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
    }
    s->stats.n_alloc++;
    s->stats.bytes_live += size;
    if (s->stats.bytes_live > s->stats.bytes_peak) s->stats.bytes_peak = s->stats.bytes_live;
    *out = b.ptr;
    return OPF_OK;
}

void opf_cuda_free(opf_ctx *ctx, void *ptr)
{
    opf_cuda_state *s = ptr ? state_if_any(ctx) : NULL;
    if (!s) return;
    int i = find_block(s->live, s->n_live, ptr, 0);
    if (i < 0) return;  /* not ours: ignore, as free() of a foreign pointer cannot be checked */
    opf_cuda_block b = s->live[i];
    s->live[i] = s->live[--s->n_live];
    s->stats.n_free++;
    s->stats.bytes_live -= b.size;
    if (push_block(&s->free_list, &s->n_free, &s->cap_free, b))
        s->cached_bytes += b.size;
    else
        cudaFree(b.ptr);
}

void opf_cuda_alloc_stats(const opf_ctx *ctx, opf_alloc_stats *out)
{
    opf_cuda_state *s = state_if_any(ctx);
    memset(out, 0, sizeof *out);
    if (s) *out = s->stats;
}

size_t opf_cuda_cached_bytes(const opf_ctx *ctx)
{
    opf_cuda_state *s = state_if_any(ctx);
    return s ? s->cached_bytes : 0;
}

void opf_cuda_empty_cache(opf_ctx *ctx)
{
    opf_cuda_state *s = state_if_any(ctx);
    if (!s) return;
    opf_ctx_count_sync(ctx);
    cudaStreamSynchronize(s->stream);
    empty_cache(s);
}

/* Growing frees the old scratch, except after a capture: a captured graph
 * replays the addresses it recorded, so outgrown scratch is kept until the
 * context goes (each growth is to a larger size class, four per power of
 * two, so what is kept adds up to a few times the last size). */
opf_status opf_cuda_scratch(opf_ctx *ctx, opf_cuda_state *s, size_t bytes, void **out)
{
    const char *fn = "cuda scratch";
    if (bytes > s->ws_bytes) {
        /* the old scratch may still be read by queued work: wait for it
         * (none yet, as on a side queue's first use: nothing to wait for) */
        opf_status st = s->ws ? opf_cuda_stream_sync(ctx, s, fn) : OPF_OK;
        if (st) return st;
        if (s->ws && s->captured) {  /* a captured graph may read it: keep it */
            void **r = (void **)realloc(s->ws_retired, (size_t)(s->n_retired + 1) * sizeof *r);
            if (!r) return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
            s->ws_retired = r;
            r[s->n_retired++] = s->ws;
        } else {
            cudaFree(s->ws);
        }
        s->ws = NULL;
        s->ws_bytes = 0;
        size_t want = size_class(bytes);
        if ((st = device_malloc(ctx, s, want, bytes, &s->ws))) return st;
        s->ws_bytes = want;
    }
    *out = s->ws;
    return OPF_OK;
}

/* ---- copies ---------------------------------------------------------------
 * Host copies go through the two halves of the pinned buffer in turn: while
 * one half is on the bus the host fills or drains the other. */

static opf_status copy_h2d(opf_ctx *ctx, opf_cuda_state *s, char *dst, const char *src,
                           size_t bytes)
{
    const char *fn = "opf_cuda_copy (host to device)";
    for (size_t off = 0, i = 0; off < bytes; off += STAGE_BYTES, i ^= 1) {
        size_t n = bytes - off < STAGE_BYTES ? bytes - off : STAGE_BYTES;
        char *stage = (char *)s->pinned + i * STAGE_BYTES;
        opf_status st = event_sync(ctx, s->staged[i], fn);
        if (st) return st;
        memcpy(stage, src + off, n);
        OPF_CUDA_TRY(ctx, fn, cudaMemcpyAsync(dst + off, stage, n, cudaMemcpyHostToDevice,
                                              s->stream));
        OPF_CUDA_TRY(ctx, fn, cudaEventRecord(s->staged[i], s->stream));
    }
    /* The source may be reused at once; the staging halves guard themselves. */
    return OPF_OK;
}

static opf_status copy_d2h(opf_ctx *ctx, opf_cuda_state *s, char *dst, const char *src,
                           size_t bytes)
{
    const char *fn = "opf_cuda_copy (device to host)";
    size_t prev_off = 0, prev_n = 0;
    int i = 0;
    opf_status st;
    for (size_t off = 0; off < bytes; off += STAGE_BYTES, i ^= 1) {
        size_t n = bytes - off < STAGE_BYTES ? bytes - off : STAGE_BYTES;
        char *stage = (char *)s->pinned + (size_t)i * STAGE_BYTES;
        if ((st = event_sync(ctx, s->staged[i], fn))) return st;
        OPF_CUDA_TRY(ctx, fn, cudaMemcpyAsync(stage, src + off, n, cudaMemcpyDeviceToHost,
                                              s->stream));
        OPF_CUDA_TRY(ctx, fn, cudaEventRecord(s->staged[i], s->stream));
        if (prev_n) {  /* drain the other half while this one is on the bus */
            if ((st = event_sync(ctx, s->staged[i ^ 1], fn))) return st;
            memcpy(dst + prev_off, (char *)s->pinned + (size_t)(i ^ 1) * STAGE_BYTES, prev_n);
        }
        prev_off = off;
        prev_n = n;
    }
    if (prev_n) {
        if ((st = event_sync(ctx, s->staged[i ^ 1], fn))) return st;
        memcpy(dst + prev_off, (char *)s->pinned + (size_t)(i ^ 1) * STAGE_BYTES, prev_n);
    }
    return opf_cuda_deferred_check(ctx, s);  /* the copy waited: report what a graph found */
}

opf_status opf_cuda_copy(opf_ctx *ctx, void *dst, const void *src, size_t bytes,
                         opf_cuda_copy_kind kind)
{
    const char *fn = "opf_cuda_copy";
    opf_cuda_state *s = opf_cuda_state_of(ctx, fn);
    if (!s) return OPF_ERR_STATE;
    if (bytes == 0) return OPF_OK;
    OPF_CHECK_NULL(ctx, fn, dst);
    OPF_CHECK_NULL(ctx, fn, src);
    switch (kind) {
    case OPF_CUDA_H2D:
        opf_ctx_count_copy(ctx, OPF_COPY_H2D, bytes);
        return copy_h2d(ctx, s, (char *)dst, (const char *)src, bytes);
    case OPF_CUDA_D2H:
        opf_ctx_count_copy(ctx, OPF_COPY_D2H, bytes);
        return copy_d2h(ctx, s, (char *)dst, (const char *)src, bytes);
    case OPF_CUDA_D2D:
        OPF_CUDA_TRY(ctx, fn, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s->stream));
        return OPF_OK;
    }
    return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: copy kind %d is not H2D, D2H or D2D", fn,
                     (int)kind);
}

opf_status opf_cuda_memset(opf_ctx *ctx, void *dst, int value, size_t bytes)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "opf_cuda_memset");
    if (!s) return OPF_ERR_STATE;
    OPF_CUDA_TRY(ctx, "opf_cuda_memset", cudaMemsetAsync(dst, value, bytes, s->stream));
    return OPF_OK;
}

opf_status opf_cuda_sync(opf_ctx *ctx)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "opf_cuda_sync");
    return s ? opf_cuda_stream_sync(ctx, s, "opf_cuda_sync") : OPF_ERR_STATE;
}

/* ---- timers -------------------------------------------------------------- */

struct opf_cuda_timer {
    int          n;
    cudaEvent_t *ev;
};

opf_status opf_cuda_timer_create(opf_ctx *ctx, int n_marks, opf_cuda_timer **out)
{
    const char *fn = "opf_cuda_timer_create";
    OPF_CHECK_NULL(ctx, fn, out);
    opf_cuda_timer *t = (opf_cuda_timer *)calloc(1, sizeof *t);
    cudaEvent_t *ev = (cudaEvent_t *)calloc((size_t)n_marks, sizeof *ev);
    if (!t || !ev) {
        free(t);
        free(ev);
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of host memory", fn);
    }
    t->ev = ev;
    *out = t;
    for (; t->n < n_marks; t->n++) {
        cudaError_t e = cudaEventCreate(&t->ev[t->n]);
        if (e != cudaSuccess) {
            opf_cuda_timer_destroy(t);
            *out = NULL;
            return opf_cuda_fail(ctx, e, fn, "cudaEventCreate");
        }
    }
    return OPF_OK;
}

void opf_cuda_timer_destroy(opf_cuda_timer *t)
{
    if (!t) return;
    for (int i = 0; i < t->n; i++) cudaEventDestroy(t->ev[i]);
    free(t->ev);
    free(t);
}

opf_status opf_cuda_timer_mark(opf_ctx *ctx, opf_cuda_timer *t, int i)
{
    opf_cuda_state *s = opf_cuda_state_of(ctx, "opf_cuda_timer_mark");
    if (!s) return OPF_ERR_STATE;
    OPF_CUDA_TRY(ctx, "opf_cuda_timer_mark", cudaEventRecord(t->ev[i], s->stream));
    return OPF_OK;
}

opf_status opf_cuda_timer_ms(opf_cuda_timer *t, int i, int j, float *ms)
{
    OPF_CUDA_TRY(NULL, "opf_cuda_timer_ms", cudaEventSynchronize(t->ev[j]));
    OPF_CUDA_TRY(NULL, "opf_cuda_timer_ms", cudaEventElapsedTime(ms, t->ev[i], t->ev[j]));
    return OPF_OK;
}
