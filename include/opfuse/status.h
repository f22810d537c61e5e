/* opfuse/status.h: status codes, messages and the library's assertion.
 *
 * Every fallible public function returns an opf_status. OPF_OK is 0; any
 * other value says what kind of failure happened and opf_last_error() gives a
 * sentence naming the op and the values involved. On failure the function
 * leaves its inputs and the caller's state untouched.
 *
 *     opf_status st = opf_quantize(ctx, &x, &q, &out);
 *     if (st != OPF_OK)
 *         fprintf(stderr, "%s: %s\n", opf_status_str(st), opf_last_error(ctx));
 */
#ifndef OPFUSE_STATUS_H
#define OPFUSE_STATUS_H

#include "opfuse/export.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum opf_status {
    OPF_OK              = 0,
    OPF_ERR_INVALID_ARG = 1,  /* NULL pointer, bad enum, option out of range */
    OPF_ERR_SHAPE       = 2,  /* shapes do not match or a format cannot take them */
    OPF_ERR_DTYPE       = 3,  /* dtype (pair) not supported */
    OPF_ERR_UNSUPPORTED = 4,  /* valid request this build / device / format cannot do */
    OPF_ERR_NO_MEMORY   = 5,  /* allocator returned NULL */
    OPF_ERR_DEVICE      = 6,  /* a device runtime call failed */
    OPF_ERR_IO          = 7,  /* file system failure */
    OPF_ERR_CORRUPT     = 8,  /* malformed data (checkpoint, header) */
    OPF_ERR_STATE       = 9,  /* call out of order (e.g. backward before forward) */
    OPF_STATUS_COUNT
} opf_status;

/* Name of a status code ("OPF_ERR_SHAPE"); never NULL. */
OPF_API const char *opf_status_str(opf_status st);

/* Invariant failures inside the library (never user errors) call the abort
 * hook with file, line and the failed expression, then print them to stderr
 * and call abort(): a hook may log or flush, or leave by exit() or longjmp,
 * but when it returns the process still aborts (the code after a failed
 * invariant never runs). Pass NULL to restore the default. Process-wide. */
typedef void (*opf_abort_fn)(const char *file, int line, const char *expr);
OPF_API void opf_set_abort_hook(opf_abort_fn fn);
OPF_API void opf_assert_fail(const char *file, int line, const char *expr);

#define OPF_ASSERT(x) \
    do { if (!(x)) opf_assert_fail(__FILE__, __LINE__, #x); } while (0)

#ifdef __cplusplus
}
#endif
#endif
