/* context.c: context lifetime, the counting allocator, workspace, warnings. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/context-impl.h"
#include "core/core-impl.h"
#include "core/device-impl.h"
#include "core/size-impl.h"

#if OPF_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n)   ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n)   ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

static void *default_alloc(void *user, size_t bytes, size_t align)
{
    (void)user;
    /* aligned_alloc needs a size that is a multiple of the alignment. */
    size_t n = (bytes + align - 1) / align * align;
    return aligned_alloc(align, n ? n : align);
}

static void default_free(void *user, void *p)
{
    (void)user;
    free(p);
}

static void cache_drain(opf_ctx *ctx);
static void scratch_free(opf_ctx *ctx);

static void default_warn(void *user, const char *msg)
{
    (void)user;
    fprintf(stderr, "opfuse: warning: %s\n", msg);
}

opf_ctx_options opf_ctx_options_default(void)
{
    opf_ctx_options o;
    memset(&o, 0, sizeof o);
    o.device = OPF_DEVICE_CPU;
    o.deterministic = true;
    return o;
}

/* The device state of a new context; on failure the context is freed and
 * the runtime's message (no GPU, bad index) is this thread's error. */
static opf_status device_init(opf_ctx *c, const opf_device_runtime *rt)
{
    opf_status st = rt->init(c, c->device_index);
    if (st == OPF_OK) {
        c->rt = rt;
        return OPF_OK;
    }
    char why[OPF_ERROR_MAX];
    snprintf(why, sizeof why, "%s", c->error);
    int index = c->device_index;
    c->allocator.free(c->allocator.user, c);
    return opf_error(NULL, st, "opf_ctx_create: %s device %d: %s", rt->name, index, why);
}

opf_status opf_ctx_create(const opf_ctx_options *opts, opf_ctx **out)
{
    OPF_CHECK_NULL(NULL, "opf_ctx_create", out);
    *out = NULL;
    opf_ctx_options o = opts ? *opts : opf_ctx_options_default();
    if ((unsigned)o.device >= OPF_DEVICE_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "opf_ctx_create: device %d is not a device",
                         (int)o.device);
    const opf_device_runtime *rt = NULL;
    if (o.device != OPF_DEVICE_CPU && !(rt = opf_device_runtime_get(o.device)))
        return opf_error(NULL, OPF_ERR_UNSUPPORTED,
                         "opf_ctx_create: device %s is not built into this library (the CPU "
                         "device is)", opf_device_name(o.device));
    if (o.num_threads < 0 || o.num_threads > OPF_MAX_THREADS)
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "opf_ctx_create: num_threads %d outside 0..%d", o.num_threads,
                         OPF_MAX_THREADS);
    if ((o.allocator.alloc == NULL) != (o.allocator.free == NULL))
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "opf_ctx_create: allocator needs both alloc and free");
    bool caching = !o.allocator.alloc;
    if (caching) o.allocator = (opf_allocator){default_alloc, default_free, NULL};
    /* The context itself comes from the allocator too (uncounted: the
     * counters live in it). */
    opf_ctx *c = o.allocator.alloc(o.allocator.user, sizeof *c, OPF_COMPONENT_ALIGN);
    if (!c) return opf_error(NULL, OPF_ERR_NO_MEMORY, "opf_ctx_create: out of memory");
    memset(c, 0, sizeof *c);
    c->device = o.device;
    c->device_index = o.device_index;
    c->deterministic = o.deterministic;
    c->num_threads = o.num_threads;
    c->rng_seed = o.seed;
    c->rng_offset = o.offset;
    c->allocator = o.allocator;
    c->caching = caching;
    c->warn = o.warn ? o.warn : default_warn;
    c->warn_user = o.warn_user;
    opf_status st = rt ? device_init(c, rt) : OPF_OK;
    if (st) return st;
    /* the CPU's kernels are deterministic by construction (fixed tiles and
     * reduction orders, whatever the thread count); a device says what its
     * request needs */
    const char *needs = rt && o.deterministic && rt->determinism_needs ? rt->determinism_needs(c) : NULL;
    if (needs) {
        opf_ctx_destroy(c);
        return opf_error(NULL, OPF_ERR_UNSUPPORTED, "opf_ctx_create: deterministic mode on %s "
                         "cannot be honoured: it needs %s", opf_device_name(o.device), needs);
    }
    *out = c;
    return OPF_OK;
}

void opf_ctx_destroy(opf_ctx *ctx)
{
    if (!ctx) return;
    opf_ctx_free(ctx, ctx->workspace, ctx->workspace_bytes);
    scratch_free(ctx);
    cache_drain(ctx);
    if (ctx->rt) ctx->rt->trim(ctx);
    ctx->caching = false;  /* what the live buffers free later goes straight back */
    ctx->destroyed = true;
    if (ctx->live_buffers == 0) opf_ctx_finish(ctx);
}

void opf_ctx_finish(opf_ctx *ctx)
{
    /* The device state goes last: releasing a device buffer needs it. */
    if (ctx->rt) ctx->rt->fini(ctx);
    opf_buffer_slabs_free(ctx);
    ctx->allocator.free(ctx->allocator.user, ctx);
}

/* The getters answer a NULL context with the neutral value (the CPU, 0,
 * zeroed stats): they have no status to refuse it with. */
opf_device opf_ctx_device(const opf_ctx *ctx) { return ctx ? ctx->device : OPF_DEVICE_CPU; }
bool opf_ctx_deterministic(const opf_ctx *ctx) { return ctx && ctx->deterministic; }
int opf_ctx_num_threads(const opf_ctx *ctx) { return ctx ? ctx->num_threads : 0; }
void opf_ctx_alloc_stats(const opf_ctx *ctx, opf_alloc_stats *out)
{
    *out = !ctx ? (opf_alloc_stats){0} : ctx->rt ? ctx->device_stats : ctx->stats;
}

void opf_ctx_host_alloc_stats(const opf_ctx *ctx, opf_alloc_stats *out)
{
    *out = ctx ? ctx->stats : (opf_alloc_stats){0};
}

void opf_ctx_sync_stats(const opf_ctx *ctx, opf_sync_stats *out)
{
    *out = ctx ? ctx->sync_stats : (opf_sync_stats){0};
}

void *opf_ctx_device_state(const opf_ctx *ctx) { return ctx->device_state; }
void opf_ctx_set_device_state(opf_ctx *ctx, void *state) { ctx->device_state = state; }

void opf_ctx_count_sync(opf_ctx *ctx) { ctx->sync_stats.n_sync++; }

void opf_ctx_count_copy(opf_ctx *ctx, opf_copy_kind kind, size_t bytes)
{
    opf_sync_stats *s = &ctx->sync_stats;
    if (kind == OPF_COPY_D2H) s->n_d2h++, s->bytes_d2h += bytes;
    if (kind == OPF_COPY_H2D) s->n_h2d++, s->bytes_h2d += bytes;
}

opf_status opf_ctx_sync(opf_ctx *ctx)
{
    OPF_CHECK_NULL(NULL, "opf_ctx_sync", ctx);
    return ctx->rt ? ctx->rt->sync(ctx) : OPF_OK;
}

opf_status opf_ctx_set_stream(opf_ctx *ctx, void *stream)
{
    const char *fn = "opf_ctx_set_stream";
    OPF_CHECK_NULL(NULL, fn, ctx);
    if (!ctx->rt || !ctx->rt->set_stream)
        return opf_error(ctx, OPF_ERR_UNSUPPORTED, "%s: a %s context has no stream (streams "
                         "belong to CUDA contexts)", fn, opf_device_name(ctx->device));
    return ctx->rt->set_stream(ctx, stream);
}

void *opf_ctx_stream(const opf_ctx *ctx)
{
    return ctx && ctx->rt && ctx->rt->stream ? ctx->rt->stream(ctx) : NULL;
}

static void vwarn(opf_ctx *ctx, const char *fmt, va_list ap)
{
    char msg[OPF_ERROR_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (ctx) ctx->warn(ctx->warn_user, msg);
    else fprintf(stderr, "opfuse: warning: %s\n", msg);
}

void opf_ctx_warn(opf_ctx *ctx, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vwarn(ctx, fmt, ap);
    va_end(ap);
}

void opf_ctx_warn_once(opf_ctx *ctx, const char *key, const char *fmt, ...)
{
    uint64_t h = 0xCBF29CE484222325ull;
    for (const unsigned char *p = (const unsigned char *)key; ctx && key && *p; p++)
        h = (h ^ *p) * 0x100000001B3ull;
    for (int i = 0; ctx && i < ctx->n_warned; i++)
        if (ctx->warned[i] == h) return;
    if (ctx && ctx->n_warned < (int)(sizeof ctx->warned / sizeof ctx->warned[0]))
        ctx->warned[ctx->n_warned++] = h;  /* without a context: every time, to stderr */
    va_list ap;
    va_start(ap, fmt);
    vwarn(ctx, fmt, ap);
    va_end(ap);
}

void opf_ctx_alloc_reset_peak(opf_ctx *ctx)
{
    if (!ctx) return;
    ctx->stats.bytes_peak = ctx->stats.bytes_live;
    ctx->device_stats.bytes_peak = ctx->device_stats.bytes_live;
}

/* Size classes: 4 KiB, then four steps per power of two (at most 25% slack). */
enum { CACHE_MAX_BYTES = 512u << 20 };

static int size_class(size_t bytes, size_t *class_bytes)
{
    if (bytes <= 4096) {
        *class_bytes = 4096;
        return 0;
    }
    int lg = 63 - __builtin_clzll((unsigned long long)bytes);  /* 2^lg <= bytes */
    size_t step = (size_t)1 << (lg - 2);
    size_t cls = (bytes + step - 1) / step * step;
    int idx = (lg - 12) * 4 + (int)(cls / step) - 4 + 1;
    *class_bytes = cls;
    return idx < 256 ? idx : -1;
}

/* Cached blocks are poisoned under AddressSanitizer (a use after
 * opf_ctx_free is reported as if the block were freed), all but the list
 * link in their first word: LeakSanitizer follows pointers only through
 * unpoisoned memory, and a live context's cache is no leak. */
static void cache_drain(opf_ctx *ctx)
{
    for (int i = 0; i < 256; i++)
        while (ctx->cache[i]) {
            void *p = ctx->cache[i];
            ctx->cache[i] = *(void **)p;
            ctx->allocator.free(ctx->allocator.user, p);
        }
    ctx->cached_bytes = 0;
}

#if OPF_CTX_THREAD_CHECK
static _Thread_local char thread_anchor;  /* its address names the thread */

/* A context serves one thread: the first that allocates is recorded, a
 * second one is reported once (a warning: handing a context over is legal,
 * sharing it at once is not, and cannot be told apart here). */
static void check_thread(opf_ctx *ctx)
{
    uintptr_t me = (uintptr_t)&thread_anchor, first = 0;
    if (__atomic_compare_exchange_n(&ctx->user_thread, &first, me, false, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED) || first == me)
        return;
    if (__atomic_exchange_n(&ctx->thread_reported, 1, __ATOMIC_RELAXED)) return;
    char msg[200];
    snprintf(msg, sizeof msg, "opf_ctx %p: allocation from a second thread; a context serves one "
             "thread (use one context per thread, or hand it over and stop using it)", (void *)ctx);
    ctx->warn(ctx->warn_user, msg);
}
#else
#define check_thread(ctx) ((void)(ctx))
#endif

void *opf_ctx_alloc(opf_ctx *ctx, size_t bytes)
{
    if (!ctx || bytes > (size_t)OPF_MAX_BYTES) return NULL;  /* the size classes would wrap */
    check_thread(ctx);
    if (ctx->fail_countdown && --ctx->fail_countdown == 0) return NULL;
    size_t cls_bytes = bytes;
    int cls = ctx->caching ? size_class(bytes, &cls_bytes) : -1;
    void *p = NULL;
    if (cls >= 0 && ctx->cache[cls]) {
        p = ctx->cache[cls];
        UNPOISON(p, cls_bytes);
        ctx->cache[cls] = *(void **)p;
        ctx->cached_bytes -= cls_bytes;
    } else {
        /* at least one byte: an allocator may answer NULL for zero */
        size_t want = cls >= 0 ? cls_bytes : bytes ? bytes : 1;
        p = ctx->allocator.alloc(ctx->allocator.user, want, OPF_COMPONENT_ALIGN);
    }
    if (!p) return NULL;
    ctx->stats.n_alloc++;
    ctx->stats.bytes_live += bytes;
    if (ctx->stats.bytes_live > ctx->stats.bytes_peak) ctx->stats.bytes_peak = ctx->stats.bytes_live;
    return p;
}

void opf_ctx_fail_alloc(opf_ctx *ctx, uint64_t nth) { ctx->fail_countdown = nth; }
bool opf_ctx_fail_alloc_pending(const opf_ctx *ctx) { return ctx->fail_countdown != 0; }

void opf_ctx_free(opf_ctx *ctx, void *ptr, size_t bytes)
{
    if (!ptr || !ctx) return;
    check_thread(ctx);
    size_t cls_bytes = bytes;
    int cls = ctx->caching ? size_class(bytes, &cls_bytes) : -1;
    if (cls >= 0 && ctx->cached_bytes + cls_bytes <= CACHE_MAX_BYTES) {
        *(void **)ptr = ctx->cache[cls];
        POISON((char *)ptr + sizeof(void *), cls_bytes - sizeof(void *));
        ctx->cache[cls] = ptr;
        ctx->cached_bytes += cls_bytes;
    } else {
        ctx->allocator.free(ctx->allocator.user, ptr);
    }
    ctx->stats.n_free++;
    ctx->stats.bytes_live -= bytes;
}

void *opf_ctx_calloc(opf_ctx *ctx, size_t n, size_t size)
{
    size_t bytes;
    if (!opf_mul_size(n, size, &bytes)) return NULL;
    void *p = opf_ctx_alloc(ctx, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

opf_status opf_ctx_workspace_reserve(opf_ctx *ctx, size_t bytes)
{
    OPF_CHECK_NULL(NULL, "opf_ctx_workspace_reserve", ctx);
    if (bytes <= ctx->workspace_bytes) return OPF_OK;
    void *p = opf_ctx_alloc(ctx, bytes);
    if (!p)
        return opf_error(ctx, OPF_ERR_NO_MEMORY, "workspace: cannot allocate %zu bytes", bytes);
    opf_ctx_free(ctx, ctx->workspace, ctx->workspace_bytes);
    ctx->workspace = p;
    ctx->workspace_bytes = bytes;
    return OPF_OK;
}

void *opf_ctx_workspace(opf_ctx *ctx, size_t bytes)
{
    return ctx && bytes <= ctx->workspace_bytes ? ctx->workspace : NULL;
}

void opf_ctx_set_rng(opf_ctx *ctx, uint64_t seed, uint64_t offset)
{
    if (!ctx) return;
    ctx->rng_seed = seed;
    ctx->rng_offset = offset;
}

void opf_ctx_get_rng(const opf_ctx *ctx, uint64_t *seed, uint64_t *offset)
{
    if (seed) *seed = ctx ? ctx->rng_seed : 0;
    if (offset) *offset = ctx ? ctx->rng_offset : 0;
}

uint64_t opf_ctx_rng_advance(opf_ctx *ctx, uint64_t n)
{
    if (!ctx) return 0;
    uint64_t o = ctx->rng_offset;
    ctx->rng_offset += n;
    return o;
}

/* A mark holds both stacks' (chunk index, bytes used / 64): 4 + 28 bits
 * each, so a chunk offset reaches 16 GiB. The device half is 0 on a CPU
 * context. */
enum { MARK_TOP_BITS = 4, MARK_USED_BITS = 28 };

static uint64_t stack_mark(const struct opf_scratch_stack *st)
{
    size_t used = st->top < st->n ? st->chunk[st->top].used : 0;
    return (uint64_t)st->top << MARK_USED_BITS | (uint64_t)(used >> 6);
}

static void stack_pop(struct opf_scratch_stack *st, uint64_t mark)
{
    int top = (int)(mark >> MARK_USED_BITS) & ((1 << MARK_TOP_BITS) - 1);
    st->top = top;
    if (top < st->n) st->chunk[top].used = (size_t)(mark & ((1u << MARK_USED_BITS) - 1)) << 6;
}

size_t opf_ctx_scratch_mark(const opf_ctx *ctx)
{
    enum { HALF = MARK_TOP_BITS + MARK_USED_BITS };
    if (!ctx) return 0;
    return (size_t)(stack_mark(&ctx->dscratch) << HALF | stack_mark(&ctx->scratch));
}

void opf_ctx_scratch_pop(opf_ctx *ctx, size_t mark)
{
    enum { HALF = MARK_TOP_BITS + MARK_USED_BITS };
    if (!ctx) return;
    stack_pop(&ctx->scratch, (uint64_t)mark & ((1ull << HALF) - 1));
    stack_pop(&ctx->dscratch, (uint64_t)mark >> HALF);
}

/* A new chunk of at least `bytes` (twice the one before, 1 MiB at least),
 * in the memory of the stack's side. */
static char *chunk_alloc(opf_ctx *ctx, bool device, size_t bytes, size_t *size)
{
    void *mem = NULL;
    if (!device) mem = opf_ctx_alloc(ctx, bytes);
    else if (opf_device_alloc(ctx, bytes, &mem)) mem = NULL;
    *size = bytes;
    return mem;
}

static void *stack_push(opf_ctx *ctx, struct opf_scratch_stack *st, bool device, size_t bytes)
{
    bytes = (bytes + 63) & ~(size_t)63;
    if (bytes >> (MARK_USED_BITS + 6)) return NULL;  /* past what a mark can hold */
    for (int i = st->top; i < 16; i++) {
        if (i == st->n) {  /* never this deep: a new chunk */
            size_t prev = i ? st->chunk[i - 1].size : 0, size = bytes > 2 * prev ? bytes : 2 * prev;
            if (size < (1u << 20)) size = 1u << 20;
            char *mem = chunk_alloc(ctx, device, size, &size);
            if (!mem) return NULL;
            st->chunk[i] = (struct opf_scratch_chunk){mem, size, 0};
            st->n++;
        }
        struct opf_scratch_chunk *c = &st->chunk[i];
        if (i > st->top) c->used = 0;
        if (c->size - c->used >= bytes) {
            st->top = i;
            void *p = c->mem + c->used;
            c->used += bytes;
            return p;
        }
    }
    return NULL;
}

void *opf_ctx_scratch_push(opf_ctx *ctx, size_t bytes)
{
    return ctx ? stack_push(ctx, &ctx->scratch, false, bytes) : NULL;
}

void *opf_ctx_scratch_push_on(opf_ctx *ctx, opf_device dev, size_t bytes)
{
    bool device = dev != OPF_DEVICE_CPU && ctx->rt && dev == ctx->device;
    if (dev != OPF_DEVICE_CPU && !device) return NULL;
    return stack_push(ctx, device ? &ctx->dscratch : &ctx->scratch, device, bytes);
}

static void scratch_free(opf_ctx *ctx)
{
    for (int i = 0; i < ctx->scratch.n; i++)
        opf_ctx_free(ctx, ctx->scratch.chunk[i].mem, ctx->scratch.chunk[i].size);
    for (int i = 0; i < ctx->dscratch.n; i++)
        opf_device_free(ctx, ctx->dscratch.chunk[i].mem, ctx->dscratch.chunk[i].size);
    ctx->scratch.n = ctx->dscratch.n = 0;
}
