/* make_corpus.c: writes the seed corpus of the checkpoint fuzz target into
 * the folder given (fuzz/corpus): valid checkpoints of the harness's two
 * models (with and without cached quantized weights and optimizer state),
 * and a few small edge cases of the container. */
#include <stdio.h>

#include "checkpoint_harness.h"

static int save(fz_fixture *f, bool with_opt, const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    opf_status st = opf_checkpoint_save(f->ctx, f->seq, with_opt ? f->opt : NULL, path);
    if (st) fprintf(stderr, "%s: %s\n", path, opf_last_error(f->ctx));
    return st != OPF_OK;
}

static int raw(const char *dir, const char *name, const char *header)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    size_t n = strlen(header);
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)((unsigned long long)n >> (8 * i));
    int bad = fwrite(len, 1, 8, f) != 8 || fwrite(header, 1, n, f) != n || fwrite("\1\2\3\4", 1, 4, f) != 4;
    return fclose(f) || bad;
}

static int models(opf_ctx *ctx, const char *dir)
{
    static const struct { opf_recipe_kind kind; const char *name; } m[2] = {
        {OPF_RECIPE_DELAYED, "delayed"}, {OPF_RECIPE_MXFP8, "mxfp8"}};
    int bad = 0;
    for (int k = 0; k < 2; k++) {
        fz_fixture f;
        char name[64];
        if (fz_fixture_init(&f, ctx, m[k].kind) || fz_step(&f, false)) return 1;
        snprintf(name, sizeof name, "%s-step.safetensors", m[k].name);
        bad |= save(&f, true, dir, name);
        snprintf(name, sizeof name, "%s-weights-only.safetensors", m[k].name);
        bad |= save(&f, false, dir, name);
        if (fz_step(&f, true)) return 1;
        snprintf(name, sizeof name, "%s-cached.safetensors", m[k].name);
        bad |= save(&f, true, dir, name);
        fz_fixture_fini(&f);
    }
    return bad;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    int bad = models(ctx, argv[1]);
    bad |= raw(argv[1], "edge-empty-object", "{}");
    bad |= raw(argv[1], "edge-one-tensor",
               "{\"__metadata__\":{\"format\":\"opfuse-checkpoint\",\"version\":\"1\"},"
               "\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}");
    bad |= raw(argv[1], "edge-nested", "{\"a\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[0,4]},"
               "\"__metadata__\":{\"ops\":\"3\",\"ops.0.class\":\"layernorm\"}}");
    opf_ctx_destroy(ctx);
    return bad;
}
