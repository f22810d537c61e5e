/* context-impl.h: the private layout of opf_ctx. */
#ifndef OPFUSE_CONTEXT_IMPL_H
#define OPFUSE_CONTEXT_IMPL_H

#include "opfuse/context.h"

struct opf_device_runtime;

/* room for a device library's own explanation (cuDNN's cudnnGetLastErrorString) */
#define OPF_ERROR_MAX 1024

/* AddressSanitizer (gcc defines __SANITIZE_ADDRESS__, clang has the feature). */
#if defined(__SANITIZE_ADDRESS__)
#define OPF_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define OPF_ASAN 1
#endif
#endif
#ifndef OPF_ASAN
#define OPF_ASAN 0
#endif

/* Debug builds (unoptimized: Release keeps its asserts, so NDEBUG cannot
 * tell) and sanitizer builds record the thread that allocates through a
 * context and warn (once) when a second one does. */
#if !defined(__OPTIMIZE__) || OPF_ASAN
#define OPF_CTX_THREAD_CHECK 1
#else
#define OPF_CTX_THREAD_CHECK 0
#endif

struct opf_ctx {
    opf_device      device;
    int             device_index;
    bool            deterministic;
    int             num_threads;
    uint64_t        rng_seed, rng_offset;
    opf_allocator   allocator;
    opf_warn_fn     warn;
    void           *warn_user;
    opf_alloc_stats stats;          /* host memory */
    /* The runtime of a device context (NULL on the CPU) and the counters of
     * the device memory its tensors hold. */
    const struct opf_device_runtime *rt;
    void           *device_state;   /* the runtime's own state, set by its init */
    opf_alloc_stats device_stats;
    opf_sync_stats  sync_stats;     /* counted by the runtime (device-impl.h) */
    void           *workspace;
    size_t          workspace_bytes;
    char            error[OPF_ERROR_MAX];
    /* scratch stacks, host and (device contexts) device memory: chunks
     * reused across calls, freed with the context; one mark covers both */
    struct opf_scratch_stack {
        struct opf_scratch_chunk { char *mem; size_t size, used; } chunk[16];
        int n, top;
    } scratch, dscratch;
    /* size-class cache of freed blocks (default allocator only): a repeated
     * step reuses its buffers instead of going back to malloc and the kernel */
    bool            caching;
    void           *cache[256];
    size_t          cached_bytes;
    /* keys of the warnings opf_ctx_warn_once has emitted */
    uint64_t        warned[128];
    int             n_warned;
    /* buffer headers (tensor.c): a free list carved from 4 KiB slabs of the
     * counting allocator, so that a step takes no header from malloc */
    opf_buffer     *free_headers;
    void           *header_slabs;
    /* Buffers not yet released. A destroyed context with live buffers stays
     * allocated (destroyed set) until the last of them is released. */
    int64_t         live_buffers;
    bool            destroyed;
    /* allocation-failure injection (tests): opf_ctx_alloc calls left before
     * the one that fails; 0 = off */
    uint64_t        fail_countdown;
    /* OPF_CTX_THREAD_CHECK: the first thread that allocated (an address in
     * its thread-local storage), and whether a second one was reported;
     * both read and written with atomics */
    uintptr_t       user_thread;
    int             thread_reported;
};

/* Test API (not exported): the nth call of opf_ctx_alloc from now (1 = the
 * next) returns NULL as if out of memory, once; 0 turns it off. Drives the
 * allocation-failure sweeps over every public entry (tests/core/test_oom.c). */
void opf_ctx_fail_alloc(opf_ctx *ctx, uint64_t nth);
/* Whether the injected failure is still ahead (the call made fewer
 * allocations than nth). */
bool opf_ctx_fail_alloc_pending(const opf_ctx *ctx);

/* Frees what is left of a destroyed context once no buffer refers to it. */
void opf_ctx_finish(opf_ctx *ctx);
/* tensor.c: returns the header slabs to the allocator (at finish). */
void opf_buffer_slabs_free(opf_ctx *ctx);

#endif
