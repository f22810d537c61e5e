/* core-impl.h: private helpers of the core layer shared by every layer. */
#ifndef OPFUSE_CORE_IMPL_H
#define OPFUSE_CORE_IMPL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "opfuse/context.h"
#include "opfuse/status.h"
#include "opfuse/tensor.h"

#if defined(__GNUC__)
#define OPF_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define OPF_PRINTF(a, b)
#endif

/* Records a message for ctx (if not NULL) and for this thread, returns st.
 * Usage: return opf_error(ctx, OPF_ERR_SHAPE, "gemm: K %lld != %lld", ...);
 * The public opf_set_error (context.h) is the same function. */
opf_status opf_set_error(opf_ctx *ctx, opf_status st, const char *fmt, ...) OPF_PRINTF(3, 4);
#define opf_error opf_set_error

/* Null checks that name the function and the argument. */
#define OPF_CHECK_NULL(ctx, fn, p)                                                     \
    do {                                                                               \
        if ((p) == NULL)                                                               \
            return opf_error((ctx), OPF_ERR_INVALID_ARG, "%s: %s is NULL", (fn), #p);  \
    } while (0)

static inline int64_t opf_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t opf_round_up(int64_t a, int64_t b) { return opf_ceil_div(a, b) * b; }

/* A function that CUDA kernels call too (nvcc compiles it for both sides);
 * nothing in C. */
#ifdef __CUDACC__
#define OPF_HD __host__ __device__
#else
#define OPF_HD
#endif

static inline OPF_HD uint32_t opf_f32_bits(float f)
{
    union { float f; uint32_t u; } v = {f};
    return v.u;
}
static inline OPF_HD float opf_bits_f32(uint32_t u)
{
    union { uint32_t u; float f; } v = {u};
    return v.f;
}

/* The one hash mixer of the library (guard keys, schema and quantizer
 * hashes): folds v into h. Start from OPF_HASH_SEED. */
#define OPF_HASH_SEED 0xCBF29CE484222325ull
static inline uint64_t opf_hash_mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0x100000001B3ull;
}

/* n zeroed elements of `size` bytes from the context's allocator (counted);
 * NULL when out of memory or n * size overflows. Free with
 * opf_ctx_free(ctx, p, n * size). */
void *opf_ctx_calloc(opf_ctx *ctx, size_t n, size_t size);

/* Whether a tensor on dev can be used with ctx (device.c): host memory
 * always, a device's memory only on a context of that device. Otherwise
 * OPF_ERR_INVALID_ARG naming fn, `what` and both devices. ctx NULL: only
 * checks that dev is a device. */
opf_status opf_device_check(opf_ctx *ctx, const char *fn, const char *what, opf_device dev);
/* The one device of a call's tensors, the check every dispatcher makes
 * before it picks the kernels of a device: the specs[i] that are not NULL
 * must all be on one device (else OPF_ERR_INVALID_ARG "fn: A is on cuda, B
 * on cpu", with names[i]) that passes opf_device_check. *out (may be NULL)
 * gets it; CPU when every spec is NULL. Changes nothing on failure. */
opf_status opf_same_device(opf_ctx *ctx, const char *fn, int n, const opf_spec *const specs[],
                           const char *const names[], opf_device *out);

/* Scratch on device dev (CPU: the host stack of opf_ctx_scratch_push; ctx's
 * device: a stack in that device's memory, used in stream order), released
 * by opf_ctx_scratch_pop like the host stack (one mark covers both). NULL
 * when out of memory or dev is neither the CPU nor ctx's device. */
void *opf_ctx_scratch_push_on(opf_ctx *ctx, opf_device dev, size_t bytes);

/* The 2D view [M, K] of a shape: M = prod(shape[:-1]), K = shape[-1]. */
void opf_shape_2d(const opf_spec *s, int64_t *m, int64_t *k);

#endif
