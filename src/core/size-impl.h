/* size-impl.h: checked size arithmetic, the one place where element counts
 * and byte sizes are multiplied and added. Every size the library computes
 * from a user's numbers (spec element counts, layouts, scale shapes, delayed
 * state, context allocations) goes through these, so that an overflow is a
 * refused call (OPF_ERR_SHAPE naming the dims) and never a small buffer.
 * The bounds are public: OPF_MAX_DIMS, OPF_MAX_NUMEL, OPF_MAX_BYTES
 * (opfuse/tensor.h). */
#ifndef OPFUSE_SIZE_IMPL_H
#define OPFUSE_SIZE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "opfuse/tensor.h"

/* *out = a * b; false (and *out unchanged) when it exceeds OPF_MAX_BYTES. */
static inline bool opf_mul_size(size_t a, size_t b, size_t *out)
{
    size_t r;
    if (__builtin_mul_overflow(a, b, &r) || r > (size_t)OPF_MAX_BYTES) return false;
    *out = r;
    return true;
}

/* *out = a + b; false (and *out unchanged) when it exceeds OPF_MAX_BYTES. */
static inline bool opf_add_size(size_t a, size_t b, size_t *out)
{
    size_t r;
    if (__builtin_add_overflow(a, b, &r) || r > (size_t)OPF_MAX_BYTES) return false;
    *out = r;
    return true;
}

/* The element count of shape[0..ndim): false when ndim is outside
 * 0..OPF_MAX_DIMS, a dim is negative or the count exceeds OPF_MAX_NUMEL
 * (each partial product is checked, so a zero dim does not hide an overflow
 * of the others: [2^62, 4, 0] is refused like [2^62, 4]). */
static inline bool opf_numel_checked(int ndim, const int64_t *shape, int64_t *out)
{
    if (ndim < 0 || ndim > OPF_MAX_DIMS) return false;
    int64_t n = 1, nz = 1;  /* nz: the product of the nonzero dims */
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return false;
        if (shape[i] && (__builtin_mul_overflow(nz, shape[i], &nz) || nz > OPF_MAX_NUMEL))
            return false;
        n = shape[i] ? n * shape[i] : 0;
    }
    *out = n;
    return true;
}

#endif
