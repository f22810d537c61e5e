/* train_state.c: --save and --resume of `opfuse train`. DIR holds
 * model.safetensors (opf_checkpoint_save: weights, quantized copies, recipe
 * state, optimizer state and step, RNG) and train.txt, the settings that
 * must match for the run to continue bit for bit. Both are written to a
 * temporary file and renamed, so a failed save leaves the previous
 * checkpoint whole. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train.h"

/* The settings, one "key value" per line. */
static void describe(const trainer *t, char *buf, size_t size)
{
    const train_opts *o = &t->o;
    snprintf(buf, size,
             "opfuse-train 1\nrecipe %s\nlayers %lld\nwidth %lld\nheads %lld\ntokens %lld\n"
             "data %s\ndigits %lld\nbatch %lld\nseed %lld\nquantize-head %d\n",
             o->recipe, (long long)o->layers, (long long)o->width, (long long)o->heads,
             (long long)t->data.T, o->data ? o->data : "addition",
             (long long)(o->data ? 0 : o->digits), (long long)o->batch, (long long)o->seed,
             o->quantize_head);
}

static bool write_text(const char *path, const char *text, char *msg, size_t size)
{
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    bool ok = f && fputs(text, f) >= 0 && fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (f && fclose(f) != 0) ok = false;
    if (ok && rename(tmp, path) != 0) ok = false;
    if (!ok) {
        snprintf(msg, size, "cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
    }
    return ok;
}

opf_status train_save(trainer *t, const char *dir)
{
    char path[4096], text[1024], msg[4400];
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "\nopfuse train: cannot create %s: %s\n", dir, strerror(errno));
        return OPF_ERR_IO;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    opf_status st = opf_checkpoint_save(t->ctx, t->gpt->seq, t->opt, path);
    if (st) return st;
    describe(t, text, sizeof text);
    snprintf(path, sizeof path, "%s/train.txt", dir);
    if (write_text(path, text, msg, sizeof msg)) return OPF_OK;
    fprintf(stderr, "\nopfuse train: %s\n", msg);
    return OPF_ERR_IO;
}

/* The first line where the saved settings and this run's differ. */
static bool same_settings(const char *saved, const char *now, const char *dir)
{
    while (*saved || *now) {
        size_t a = strcspn(saved, "\n"), b = strcspn(now, "\n");
        if (a != b || strncmp(saved, now, a)) {
            fprintf(stderr, "opfuse train: %s was saved with \"%.*s\", this run has \"%.*s\"\n",
                    dir, (int)a, saved, (int)b, now);
            return false;
        }
        saved += a + (saved[a] != 0), now += b + (now[b] != 0);
    }
    return true;
}

bool train_resume(trainer *t, const char *dir)
{
    char path[4096], saved[1024] = "", now[1024];
    snprintf(path, sizeof path, "%s/train.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "opfuse train: cannot resume from %s: %s: %s\n", dir, path, strerror(errno));
        return false;
    }
    size_t n = fread(saved, 1, sizeof saved - 1, f);
    saved[n] = 0;
    fclose(f);
    describe(t, now, sizeof now);
    if (!same_settings(saved, now, dir)) return false;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    opf_status st = opf_checkpoint_prepare(t->ctx, t->gpt->seq, t->quantized ? &t->recipe : NULL);
    if (!st) st = opf_checkpoint_load(t->ctx, t->gpt->seq, t->opt, path);
    if (st) fprintf(stderr, "opfuse train: cannot resume: %s\n", opf_last_error(t->ctx));
    return !st;
}
