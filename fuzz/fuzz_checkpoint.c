/* fuzz_checkpoint.c: libFuzzer target for the checkpoint loader. Every
 * input is loaded (opf_checkpoint_load_mem, the parser behind
 * opf_checkpoint_load) into two small models, with and without their
 * optimizer; a refused load must say why and change nothing, and nothing
 * may crash, leak or read out of bounds (AddressSanitizer).
 * Build and run: fuzz/run.sh. */
#include "checkpoint_harness.h"

static opf_ctx *ctx;

static void quiet(void *user, const char *msg) { (void)user, (void)msg; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!ctx) {
        opf_ctx_options o = opf_ctx_options_default();
        o.num_threads = 1;
        o.warn = quiet;
        if (opf_ctx_create(&o, &ctx)) abort();
    }
    fz_run_input(ctx, data, size);
    return 0;
}
