/* opfuse/export.h: OPF_API marks the functions the shared library exports.
 *
 * The library builds with -fvisibility=hidden, so a function leaves
 * libopfuse.so only when its declaration in a public header carries OPF_API;
 * everything else (the op implementations, the kernels, the fusions) stays
 * internal and free to change. tests/core/test_exports.sh checks that the
 * exported symbols and the OPF_API declarations are the same set. */
#ifndef OPFUSE_EXPORT_H
#define OPFUSE_EXPORT_H

#if defined(__GNUC__) || defined(__clang__)
#define OPF_API __attribute__((visibility("default")))
#else
#define OPF_API
#endif

#endif
