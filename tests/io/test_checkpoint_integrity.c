/* test_checkpoint_integrity.c: checkpoints carry CRC-32C checksums of the
 * header and of every tensor, and a load refuses a flipped bit by tensor
 * name, leaving the state as it was; files of version 1 (no checksums)
 * still load; non-finite fp32 master weights load with a warning naming the
 * tensor; a save removes the temporary files a crashed save to the same path
 * left behind; saving through a symbolic link writes its target and keeps
 * the link. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"
#include "io/io-impl.h"
#include "../../fuzz/checkpoint_harness.h"

static char dir[64];
static fz_fixture F;  /* FP8 delayed model with AdamW */

static void write_all(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(p, 1, n, f) == n, "cannot write %s", path);
    if (f) fclose(f);
}

static char *find_bytes(const void *hay, size_t n, const char *needle, size_t k)
{
    const char *h = hay;
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(h + i, needle, k)) return (char *)(h + i);
    return NULL;
}

static size_t header_len(const fz_blob *b)
{
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b->p[i];
    return (size_t)n;
}

/* The name of the tensor whose bytes hold buffer offset pos: the entry
 * "name":{"dtype":..,"shape":..,"data_offsets":[a,b]} with a <= pos < b. */
static bool tensor_at(const fz_blob *b, uint64_t pos, char *name, size_t size)
{
    size_t hl = header_len(b);
    char *h = malloc(hl + 1);
    memcpy(h, b->p + 8, hl);
    h[hl] = '\0';
    bool found = false;
    for (char *at = strstr(h, "\"data_offsets\":["); at && !found;
         at = strstr(at + 1, "\"data_offsets\":[")) {
        unsigned long long a, e;
        if (sscanf(at, "\"data_offsets\":[%llu,%llu]", &a, &e) != 2 || pos < a || pos >= e) continue;
        char *open = at;
        while (open > h && *open != '{') open--;
        char *q = open - 2;  /* the name's closing quote is before ':' */
        char *s = q - 1;
        while (s > h && *s != '"') s--;
        snprintf(name, size, "%.*s", (int)(q - s - 1), s + 1);
        found = true;
    }
    free(h);
    return found;
}

static void test_crc32c(void)
{
    CHECK(opf_crc32c(0, "123456789", 9) == 0xE3069283u, "CRC-32C check value: %08x",
          opf_crc32c(0, "123456789", 9));
    uint32_t part = opf_crc32c(0, "1234", 4);
    CHECK(opf_crc32c(part, "56789", 5) == 0xE3069283u, "CRC-32C in pieces");
    CHECK(opf_crc32c(0, "", 0) == 0, "CRC-32C of nothing");
}

/* One flipped bit anywhere in the file is refused; in the buffer the
 * message names the tensor. */
static void test_flipped_bits(const char *path)
{
    fz_blob good = fz_read_file(path);
    size_t hl = header_len(&good), off = 8 + hl;
    CHECK_OK(F.ctx, fz_load_checked(&F, true, good.p, good.n));
    int refused = 0, tried = 0, named = 0;
    for (size_t pos = off; pos < good.n; pos += 37) {
        for (int bit = 0; bit < 8; bit += 3) {
            good.p[pos] ^= (unsigned char)(1u << bit);
            opf_status st = fz_load_checked(&F, true, good.p, good.n);
            good.p[pos] ^= (unsigned char)(1u << bit);
            char name[OPF_CK_NAME_MAX], want[OPF_CK_NAME_MAX + 16];
            tried++;
            refused += st == OPF_ERR_CORRUPT;
            if (st == OPF_ERR_CORRUPT && tensor_at(&good, pos - off, name, sizeof name)) {
                snprintf(want, sizeof want, "tensor \"%s\"", name);
                named += strstr(opf_last_error(F.ctx), want) && strstr(opf_last_error(F.ctx), "checksum");
            }
        }
    }
    CHECK(tried > 100 && refused == tried, "%d of %d flipped data bits refused", refused, tried);
    CHECK(named == tried, "%d of %d refusals name the tensor and the checksum (last: %s)", named,
          tried, opf_last_error(F.ctx));
    /* the header: a changed step count parses and matches, the checksum does not */
    const char *key = "\"optim.step\":\"";
    char *at = find_bytes(good.p + 8, hl, key, strlen(key));
    CHECK(at != NULL, "no optim.step in the header");
    if (at) {
        char *digit = at + strlen(key);
        *digit = *digit == '1' ? '2' : '1';
        CHECK_FAILS(F.ctx, fz_load_checked(&F, true, good.p, good.n), OPF_ERR_CORRUPT, "header",
                    "checksum");
        *digit = *digit == '1' ? '2' : '1';
    }
    /* the header checksum itself */
    const char *ck = "\"header.crc32c\":\"";
    at = find_bytes(good.p + 8, hl, ck, strlen(ck));
    CHECK(at != NULL, "no header.crc32c in the header");
    if (at) {
        char *hex = at + strlen(ck);
        *hex = *hex == '0' ? '1' : '0';
        CHECK_FAILS(F.ctx, fz_load_checked(&F, true, good.p, good.n), OPF_ERR_CORRUPT, "header",
                    "checksum");
    }
    free(good.p);
}

/* Version 1 files (the committed fuzz seeds, written before checksums) load. */
static void test_version1(void)
{
    char p[512];
    snprintf(p, sizeof p, "%s", __FILE__);
    char *cut = strstr(p, "tests/io/test_checkpoint_integrity.c");
    if (!cut) return;
    snprintf(cut, sizeof p - (size_t)(cut - p), "fuzz/corpus/delayed-step.safetensors");
    fz_blob b = fz_read_file(p);
    CHECK(b.n > 0 && find_bytes(b.p, b.n, "\"version\":\"1\"", 13), "no version 1 file at %s", p);
    fz_fixture f;
    CHECK_OK(F.ctx, fz_fixture_init(&f, F.ctx, OPF_RECIPE_DELAYED));
    CHECK_OK(F.ctx, fz_load_checked(&f, true, b.p, b.n));
    fz_fixture_fini(&f);
    free(b.p);
}

static char warned[4096];
static void on_warn(void *user, const char *msg)
{
    (void)user;
    snprintf(warned + strlen(warned), sizeof warned - strlen(warned), "%s\n", msg);
}

/* NaN and Inf in the fp32 master weights: loaded, with a warning. */
static void test_nonfinite_master(void)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.warn = on_warn;
    opf_ctx *ctx;
    CHECK_OK(NULL, opf_ctx_create(&o, &ctx));
    fz_fixture f;
    CHECK_OK(ctx, fz_fixture_init(&f, ctx, OPF_RECIPE_DELAYED));
    CHECK_OK(ctx, fz_step(&f, false));
    char path[160];
    snprintf(path, sizeof path, "%s/nan.safetensors", dir);
    CHECK_OK(ctx, opf_checkpoint_save(ctx, f.seq, f.opt, path));
    CHECK_OK(ctx, opf_checkpoint_load(ctx, f.seq, f.opt, path));
    CHECK(warned[0] == '\0', "a finite checkpoint warned: %s", warned);
    float *master;
    int64_t n;
    int k = opf_optim_num_slots(f.opt) - 1;
    CHECK_OK(ctx, opf_optim_slot(f.opt, k, NULL, &master, NULL, NULL, &n));
    master[0] = NAN;
    master[n - 1] = INFINITY;
    CHECK_OK(ctx, opf_checkpoint_save(ctx, f.seq, f.opt, path));
    CHECK_OK(ctx, opf_checkpoint_load(ctx, f.seq, f.opt, path));
    CHECK(strstr(warned, "non-finite") && strstr(warned, ".master") && strstr(warned, "2 of"),
          "no warning naming the master weights: \"%s\"", warned);
    fz_fixture_fini(&f);
    opf_ctx_destroy(ctx);
    unlink(path);
}

static int count_tmp(const char *d, const char *prefix)
{
    DIR *dp = opendir(d);
    int n = 0;
    for (struct dirent *e; dp && (e = readdir(dp));)
        n += !strncmp(e->d_name, prefix, strlen(prefix)) && strstr(e->d_name, ".tmp.");
    if (dp) closedir(dp);
    return n;
}

/* Temporaries of crashed saves to the same path go; others stay. */
static void test_stale_temporaries(void)
{
    char path[160], stale[200], other[200];
    snprintf(path, sizeof path, "%s/run.safetensors", dir);
    snprintf(stale, sizeof stale, "%s.tmp.AbC123", path);
    write_all(stale, "half a checkpoint", 17);
    snprintf(stale, sizeof stale, "%s.tmp.zzzzzz", path);
    write_all(stale, "another", 7);
    snprintf(other, sizeof other, "%s/run2.safetensors.tmp.AbC123", dir);
    write_all(other, "not ours", 8);
    snprintf(stale, sizeof stale, "%s.tmp.toolongname", path);
    write_all(stale, "not a temporary of ours", 23);
    CHECK(count_tmp(dir, "run.safetensors") == 3, "setup");
    CHECK_OK(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, path));
    CHECK(count_tmp(dir, "run.safetensors") == 1, "%d temporaries of run.safetensors remain",
          count_tmp(dir, "run.safetensors"));
    struct stat sb;
    CHECK(stat(stale, &sb) == 0, "a file that is not a save's temporary was removed");
    CHECK(stat(other, &sb) == 0, "another path's temporary was removed");
    unlink(stale), unlink(other), unlink(path);
}

/* A symbolic link (relative, chained, dangling) stays a link; its target
 * gets the checkpoint. */
static void test_symlink(void)
{
    char sub[160], target[200], link1[200], link2[200], plain[200];
    snprintf(sub, sizeof sub, "%s/real", dir);
    mkdir(sub, 0755);
    snprintf(target, sizeof target, "%s/real/ck.safetensors", dir);
    snprintf(link1, sizeof link1, "%s/latest", dir);
    snprintf(link2, sizeof link2, "%s/alias", dir);
    snprintf(plain, sizeof plain, "%s/plain.safetensors", dir);
    CHECK(symlink("real/ck.safetensors", link1) == 0, "symlink");  /* dangling for now */
    CHECK(symlink("latest", link2) == 0, "symlink");
    for (int round = 0; round < 2; round++) {
        CHECK_OK(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, link2));
        struct stat sb;
        CHECK(lstat(link1, &sb) == 0 && S_ISLNK(sb.st_mode), "the first link is no longer a link");
        CHECK(lstat(link2, &sb) == 0 && S_ISLNK(sb.st_mode), "the second link is no longer a link");
        CHECK(lstat(target, &sb) == 0 && S_ISREG(sb.st_mode), "the target is not a regular file");
        CHECK(count_tmp(sub, "") == 0 && count_tmp(dir, "") == 0, "a temporary was left");
        CHECK_OK(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, plain));
        fz_blob a = fz_read_file(target), b = fz_read_file(plain);
        CHECK(a.n > 0 && fz_blob_eq(&a, &b), "the target does not hold the checkpoint");
        free(a.p), free(b.p);
        CHECK_OK(F.ctx, opf_checkpoint_load(F.ctx, F.seq, F.opt, link2));
        CHECK_OK(F.ctx, fz_step(&F, false));
    }
    unlink(link2), unlink(link1), unlink(target), unlink(plain), rmdir(sub);
    /* a loop of links is an error naming the path */
    snprintf(link1, sizeof link1, "%s/loop", dir);
    CHECK(symlink("loop", link1) == 0, "symlink");
    CHECK_FAILS(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, link1), OPF_ERR_IO, link1);
    unlink(link1);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    snprintf(dir, sizeof dir, "/tmp/opf_ckint_XXXXXX");
    if (!mkdtemp(dir)) abort();
    CHECK_OK(ctx, fz_fixture_init(&F, ctx, OPF_RECIPE_DELAYED));
    CHECK_OK(ctx, fz_step(&F, false));
    CHECK_OK(ctx, fz_step(&F, true));
    char path[160];
    snprintf(path, sizeof path, "%s/good.safetensors", dir);
    CHECK_OK(ctx, opf_checkpoint_save(ctx, F.seq, F.opt, path));
    test_crc32c();
    test_flipped_bits(path);
    test_version1();
    test_nonfinite_master();
    test_stale_temporaries();
    test_symlink();
    unlink(path);
    fz_fixture_fini(&F);
    opf_ctx_destroy(ctx);
    rmdir(dir);
    TEST_DONE();
}
