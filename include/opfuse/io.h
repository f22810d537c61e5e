/* opfuse/io.h: checkpoints of a training run as safetensors files.
 *
 * A checkpoint holds what a run needs to continue bit for bit: every
 * parameter value (in its own dtype), the cached quantized weight copies
 * (data, scales, amaxes, and their spec), the optimizer state (fp32 master
 * weights, moments, step count), the delayed-scaling state of every op
 * (scales and amax histories of both directions) and the context's Philox
 * seed and offset. Gradients are not saved: save between optimizer steps.
 * The file is plain safetensors (docs/checkpoint.md gives the tensor names
 * and the metadata), so other tools can read the weights.
 *
 * Saving is atomic: the file appears whole under its name or not at all.
 * Loading checks the whole file against the seq (op classes and names,
 * recipes, every tensor's name, dtype and shape) before it changes
 * anything; on any error nothing is changed.
 *
 * Integrity: files of format version 2 (written since checksums came) hold a
 * CRC-32C (Castagnoli) of the header and of every tensor's bytes in their
 * metadata; a load verifies them all and refuses a corrupted file naming the
 * tensor (or the header). Version 1 files, written before, carry none and
 * still load, unchecked.
 *
 * The seq to load into must be built like the saved one (same op classes,
 * names and configs, in order) and carry recipe state for the same recipe:
 * a seq that has run a forward with that recipe does, a fresh one gets it
 * from opf_checkpoint_prepare.
 *
 *     // after opf_optim_step
 *     opf_checkpoint_save(ctx, seq, opt, "run/step100.safetensors");
 *
 *     // later, in a new process: the same model, a fresh optimizer
 *     opf_checkpoint_prepare(ctx, seq, &recipe);   // NULL when training unquantized
 *     opf_status st = opf_checkpoint_load(ctx, seq, opt, "run/step100.safetensors");
 *     if (st != OPF_OK) fprintf(stderr, "%s\n", opf_last_error(ctx));
 */
#ifndef OPFUSE_IO_H
#define OPFUSE_IO_H

#include <stddef.h>

#include "opfuse/export.h"
#include "opfuse/fuser.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the checkpoint of seq (and opt, may be NULL: weights, quantized
 * copies and recipe state only) and of ctx's RNG to path. The bytes go to a
 * temporary file beside path (path + ".tmp.XXXXXX"), which is flushed,
 * synced and renamed over path, and the directory is synced. A new file
 * takes the permission bits of the one it replaces, else 0644.
 * Reads seq, opt and ctx; changes nothing in them.
 * A symbolic link at path (or a chain of them, at most 40) is followed: the
 * file it names gets the checkpoint and the link stays. Temporary files that
 * earlier saves to the same file left when their process died
 * (path + ".tmp." + six letters or digits) are removed first, so concurrent
 * saves to one path are not supported.
 * Errors: OPF_ERR_INVALID_ARG for NULL ctx, seq or path, an optimizer over
 * another seq's parameters, or two tensors that would get the same name;
 * OPF_ERR_STATE while a backward is pending; OPF_ERR_UNSUPPORTED for tensors
 * not on the CPU; OPF_ERR_IO (message: the path and the system's reason)
 * when a file operation fails: the temporary file is removed and whatever
 * was at path before is untouched. */
OPF_API opf_status opf_checkpoint_save(opf_ctx *ctx, opf_seq *seq, opf_optim *opt,
                                       const char *path);

/* Reads the checkpoint at path into seq, opt (may be NULL: the optimizer
 * state in the file is checked for form and skipped) and ctx's RNG.
 * Parameter values, quantized weight copies (cached ones are restored and
 * marked valid; a parameter without one in the file has its cache marked
 * stale), delayed-scaling state, optimizer slots and step count, and the RNG
 * seed and offset are overwritten; gradients are left alone.
 * Errors, each with nothing changed: OPF_ERR_INVALID_ARG for NULL ctx, seq or
 * path or an optimizer over another seq; OPF_ERR_STATE while a backward is
 * pending; OPF_ERR_IO when the file cannot be opened or read; OPF_ERR_NO_MEMORY;
 * OPF_ERR_CORRUPT when the file is not a well-formed safetensors file (header
 * length, JSON, dtypes, shapes, offsets that overlap, leave gaps or run past
 * the end) or does not match this seq (format or version, op count, class,
 * name or recipe, a tensor missing, unknown, or of another dtype or shape,
 * optimizer kind, a checksum missing or not matching). The message names the
 * file, the tensor or op, and the values found and expected.
 * Non-finite fp32 master weights in the file (NaN or Inf in a tensor
 * "optim.*.master") do not refuse the load, which is of what was saved, but
 * each such tensor is reported through the context's warning callback
 * (opf_ctx_options.warn) with its name and count. */
OPF_API opf_status opf_checkpoint_load(opf_ctx *ctx, opf_seq *seq, opf_optim *opt,
                                       const char *path);

/* opf_checkpoint_load on a checkpoint held in memory: size bytes at data
 * (read only, not kept). name labels the messages (NULL: "<memory>"). */
OPF_API opf_status opf_checkpoint_load_mem(opf_ctx *ctx, opf_seq *seq, opf_optim *opt,
                                           const void *data, size_t size, const char *name);

/* Readies a freshly built seq for a load (opf_seq_prepare, with the message
 * also in ctx): gives every op the recipe state for recipe (NULL: none), as
 * the first forward with that recipe would, and records the recipe in the
 * seq's plan cache so that the next forward with a recipe of the same kind
 * (and, for delayed scaling, the same history length) keeps the loaded state
 * instead of starting afresh. A seq already holding state for such a recipe
 * keeps it; otherwise the state is made anew (amax histories restart, cached
 * quantized weights are marked stale). Errors: OPF_ERR_INVALID_ARG for a NULL
 * seq or a recipe that opf_recipe_validate refuses; OPF_ERR_STATE while a
 * backward is pending; what building the seq's groups reports. */
OPF_API opf_status opf_checkpoint_prepare(opf_ctx *ctx, opf_seq *seq, const opf_recipe *recipe);

#ifdef __cplusplus
}
#endif
#endif
