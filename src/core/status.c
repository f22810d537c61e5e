/* status.c: status names, the abort hook, and last-error bookkeeping. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core-impl.h"
#include "core/context-impl.h"

static const char *const status_names[] = {
    [OPF_OK]              = "OPF_OK",
    [OPF_ERR_INVALID_ARG] = "OPF_ERR_INVALID_ARG",
    [OPF_ERR_SHAPE]       = "OPF_ERR_SHAPE",
    [OPF_ERR_DTYPE]       = "OPF_ERR_DTYPE",
    [OPF_ERR_UNSUPPORTED] = "OPF_ERR_UNSUPPORTED",
    [OPF_ERR_NO_MEMORY]   = "OPF_ERR_NO_MEMORY",
    [OPF_ERR_DEVICE]      = "OPF_ERR_DEVICE",
    [OPF_ERR_IO]          = "OPF_ERR_IO",
    [OPF_ERR_CORRUPT]     = "OPF_ERR_CORRUPT",
    [OPF_ERR_STATE]       = "OPF_ERR_STATE",
};
_Static_assert(sizeof(status_names) / sizeof(status_names[0]) == OPF_STATUS_COUNT,
               "status_names must list every opf_status");

const char *opf_status_str(opf_status st)
{
    if ((unsigned)st >= OPF_STATUS_COUNT) return "OPF_ERR_UNKNOWN";
    return status_names[st];
}

static opf_abort_fn abort_hook;

void opf_set_abort_hook(opf_abort_fn fn) { abort_hook = fn; }

void opf_assert_fail(const char *file, int line, const char *expr)
{
    /* The caller's invariant is broken: nothing after it may run, so a hook
     * that returns is followed by the default's message and abort. */
    if (abort_hook) abort_hook(file, line, expr);
    fprintf(stderr, "opfuse: %s:%d: assertion failed: %s\n", file, line, expr);
    abort();
}

/* The message of the last failure on this thread, for calls without a ctx. */
static _Thread_local char thread_error[OPF_ERROR_MAX];

opf_status opf_set_error(opf_ctx *ctx, opf_status st, const char *fmt, ...)
{
    /* Format into a local first: callers may pass opf_last_error() itself. */
    char msg[OPF_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(thread_error, msg, sizeof msg);
    if (ctx) memcpy(ctx->error, msg, sizeof msg);
    return st;
}

const char *opf_last_error(const opf_ctx *ctx) { return ctx ? ctx->error : thread_error; }

void opf_clear_error(opf_ctx *ctx)
{
    thread_error[0] = '\0';
    if (ctx) ctx->error[0] = '\0';
}
