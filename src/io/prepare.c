/* prepare.c: opf_checkpoint_prepare: a fresh seq gets the recipe state a
 * checkpoint fills in (opf_seq_prepare: what the first forward with that
 * recipe would build, without running one; a later forward with an equal
 * recipe keeps it). */
#include "io/io-impl.h"

opf_status opf_checkpoint_prepare(opf_ctx *ctx, opf_seq *seq, const opf_recipe *recipe)
{
    const char *fn = "opf_checkpoint_prepare";
    OPF_CHECK_NULL(NULL, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, seq);
    opf_status st = opf_seq_prepare(seq, recipe);
    if (st) return opf_error(ctx, st, "%s: %s", fn, opf_last_error(seq->ctx));
    return OPF_OK;
}
