/* save.c: opf_checkpoint_save: the metadata with the checksums, then an
 * atomic write (a temporary file beside the target, flushed, synced and
 * renamed over it, then the directory synced) so a crash leaves the old file
 * or the new one, never a mix. A symbolic link is followed to the file it
 * names, which is what gets replaced. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io-impl.h"

static bool meta_add(cJSON *m, const char *key, const char *value)
{
    return cJSON_AddStringToObject(m, key, value) != NULL;
}

static const void *item_bytes(const opf_ck_item *it)
{
    return it->staged ? it->staged : it->ptr;
}

/* "crc32c.<tensor>" per tensor, and the header's placeholder filled in by
 * fill_header_crc once the header is printed. */
static bool meta_checksums(cJSON *m, const opf_ck_list *items)
{
    char key[OPF_CK_NAME_MAX + 16], val[16];
    bool ok = meta_add(m, OPF_CK_HEADER_CRC, "00000000");
    for (int i = 0; ok && i < items->n; i++) {
        const opf_ck_item *it = &items->v[i];
        snprintf(key, sizeof key, OPF_CK_CRC_PREFIX "%s", it->name);
        snprintf(val, sizeof val, "%08x", (unsigned)opf_crc32c(0, item_bytes(it), it->nbytes));
        ok = meta_add(m, key, val);
    }
    return ok;
}

/* Format, ops (class, name, recipe), quantized specs, optimizer, checksums. */
static cJSON *metadata(const opf_seq *seq, opf_optim *opt, opf_tensor **qv,
                       const opf_ck_list *items)
{
    cJSON *m = cJSON_CreateObject();
    char key[OPF_CK_NAME_MAX + 8], val[512];
    bool ok = m && meta_add(m, "format", OPF_CK_FORMAT) && meta_add(m, "version", OPF_CK_VERSION);
    ok = ok && meta_checksums(m, items);
    snprintf(val, sizeof val, "%d", seq->n);
    ok = ok && meta_add(m, "ops", val);
    for (int i = 0; ok && i < seq->n; i++) {
        const opf_op *op = seq->ops[i];
        snprintf(key, sizeof key, "ops.%d.class", i);
        ok = meta_add(m, key, opf_op_class_of(op)->name);
        snprintf(key, sizeof key, "ops.%d.name", i);
        ok = ok && meta_add(m, key, opf_op_name(op));
        snprintf(key, sizeof key, "ops.%d.recipe", i);
        opf_ck_recipe_str(op, val, sizeof val);
        ok = ok && meta_add(m, key, val);
        for (int j = 0; ok && j < op->n_params; j++) {
            const opf_tensor *q = qv[i * OPF_OP_MAX_PARAMS + j];
            if (!q) continue;
            opf_ck_param_name(seq, i, j, key, sizeof key - 2);
            strcat(key, ".q");
            opf_ck_qspec_str(&q->spec, val, sizeof val);
            ok = meta_add(m, key, val);
        }
    }
    if (ok && opt) {
        snprintf(val, sizeof val, "%lld", (long long)opf_optim_step_count(opt));
        ok = meta_add(m, "optim.kind", opf_optim_kind_of(opt) == OPF_OPTIM_ADAMW ? "adamw" : "sgd") &&
             meta_add(m, "optim.step", val);
    }
    if (!ok) cJSON_Delete(m);
    return ok ? m : NULL;
}

/* Wider elements first, in list order otherwise: every tensor then starts
 * at a multiple of its element size (the buffer starts 8-byte aligned), so
 * readers may use the data in place. */
static opf_status align_order(opf_ctx *ctx, opf_ck_list *l)
{
    opf_ck_item *v = opf_ctx_calloc(ctx, (size_t)l->n, sizeof *v);
    if (!v) return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_checkpoint_save: out of memory");
    int n = 0;
    for (size_t size = 8; size >= 1; size /= 2)
        for (int i = 0; i < l->n; i++)
            if (opf_st_dtype_size(l->v[i].dtype) == size) v[n++] = l->v[i];
    OPF_ASSERT(n == l->n);
    opf_ctx_free(ctx, l->v, sizeof *v * (size_t)l->cap);
    l->v = v;
    l->cap = l->n;
    return OPF_OK;
}

static opf_status io_error(opf_ctx *ctx, const char *what, const char *path, int err)
{
    return opf_error(ctx, OPF_ERR_IO, "opf_checkpoint_save: %s \"%s\": %s", what, path,
                     strerror(err));
}

/* header length, header, then every tensor's bytes */
static int write_all(FILE *f, const char *hdr, size_t hlen, const opf_ck_list *items)
{
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    if (fwrite(len, 1, 8, f) != 8 || fwrite(hdr, 1, hlen, f) != hlen) return errno ? errno : EIO;
    for (int i = 0; i < items->n; i++) {
        size_t nb = items->v[i].nbytes;
        const void *bytes = item_bytes(&items->v[i]);
        if (nb && fwrite(bytes, 1, nb, f) != nb) return errno ? errno : EIO;
    }
    return fflush(f) ? errno : 0;
}

/* The replaced file's permission bits, else 0644. */
static mode_t target_mode(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (sb.st_mode & 07777) : 0644;
}

/* dir: room for path and its terminator (the temporary name's buffer: once
 * the file is renamed nothing may fail for want of memory). */
static int sync_dir(const char *path, char *dir)
{
    memcpy(dir, path, strlen(path) + 1);
    char *slash = strrchr(dir, '/');
    const char *d = !slash ? "." : slash == dir ? "/" : (*slash = '\0', dir);
    int fd = open(d, O_RDONLY | O_DIRECTORY), err = 0;
    if (fd < 0 || fsync(fd)) err = errno;
    if (fd >= 0) close(fd);
    return err;
}

/* mkstemp's six characters. */
static bool tmp_suffix(const char *s)
{
    for (int i = 0; i < 6; i++)
        if (!((s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= 'a' && s[i] <= 'z') ||
              (s[i] >= '0' && s[i] <= '9')))
            return false;
    return s[6] == '\0';
}

/* Removes "<target>.tmp.XXXXXX", what earlier saves to target left when the
 * process died between mkstemp and rename. dir: room for target. A save to
 * the same path running at the same time in another process loses its
 * temporary (and fails): concurrent saves to one path are not supported. */
static void remove_stale(const char *target, char *dir)
{
    memcpy(dir, target, strlen(target) + 1);
    char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : target;
    if (slash == dir) slash[1] = '\0';
    else if (slash) *slash = '\0';
    DIR *dp = opendir(slash ? dir : ".");
    if (!dp) return;  /* mkstemp will say what is wrong with the directory */
    size_t nb = strlen(base);
    for (struct dirent *e; (e = readdir(dp));)
        if (!strncmp(e->d_name, base, nb) && !strncmp(e->d_name + nb, ".tmp.", 5) &&
            tmp_suffix(e->d_name + nb + 5))
            unlinkat(dirfd(dp), e->d_name, 0);
    closedir(dp);
}

/* The file path names once symbolic links are followed (at most 40, as the
 * kernel allows), into out[PATH_MAX]: a relative link target is taken from
 * the link's directory. A missing file ends the walk (a dangling link's
 * target is created). Returns 0 or an errno value. */
static int resolve_links(const char *path, char *out)
{
    char link[PATH_MAX];
    size_t n = strlen(path);
    if (n >= PATH_MAX) return ENAMETOOLONG;
    memcpy(out, path, n + 1);
    for (int hops = 0;; hops++) {
        struct stat sb;
        if (lstat(out, &sb) || !S_ISLNK(sb.st_mode)) return 0;
        if (hops == 40) return ELOOP;
        ssize_t k = readlink(out, link, sizeof link - 1);
        if (k < 0) return errno;
        link[k] = '\0';
        char *slash = strrchr(out, '/');
        size_t keep = link[0] == '/' || !slash ? 0 : (size_t)(slash - out) + 1;
        if (keep + (size_t)k >= PATH_MAX) return ENAMETOOLONG;
        memcpy(out + keep, link, (size_t)k + 1);
    }
}

/* path: the caller's (messages); target: the file to replace. */
static opf_status write_atomic(opf_ctx *ctx, const char *path, const char *target, const char *hdr,
                               size_t hlen, const opf_ck_list *items)
{
    size_t n = strlen(target);
    char *tmp = opf_ctx_alloc(ctx, n + 12);
    if (!tmp) return opf_error(ctx, OPF_ERR_NO_MEMORY, "opf_checkpoint_save: out of memory");
    remove_stale(target, tmp);
    memcpy(tmp, target, n);
    memcpy(tmp + n, ".tmp.XXXXXX", 12);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        opf_status st = io_error(ctx, "cannot create a temporary file beside", path, errno);
        opf_ctx_free(ctx, tmp, n + 12);
        return st;
    }
    FILE *f = fdopen(fd, "wb");
    int err = f ? 0 : errno;
    errno = 0;
    if (!err) err = write_all(f, hdr, hlen, items);
    if (!err && (fchmod(fd, target_mode(target)) || fsync(fd))) err = errno;
    int rc = f ? fclose(f) : close(fd);
    if (rc && !err) err = errno;
    const char *what = "cannot write the temporary file for";
    if (!err && rename(tmp, target)) err = errno, what = "cannot rename the temporary file over";
    if (err) {
        unlink(tmp);
        opf_ctx_free(ctx, tmp, n + 12);
        return io_error(ctx, what, path, err);
    }
    err = sync_dir(target, tmp);
    opf_ctx_free(ctx, tmp, n + 12);
    return err ? io_error(ctx, "cannot sync the directory of", path, err) : OPF_OK;
}

/* The header's checksum into its placeholder. */
static void fill_header_crc(char *hdr, size_t hlen)
{
    size_t at;
    uint32_t crc;
    bool found = opf_ck_header_crc(hdr, hlen, &at, &crc);
    OPF_ASSERT(found);  /* the writer put the key there once; names cannot hold it */
    char hex[9];
    snprintf(hex, sizeof hex, "%08x", (unsigned)crc);
    memcpy(hdr + at, hex, 8);
}

opf_status opf_checkpoint_save(opf_ctx *ctx, opf_seq *seq, opf_optim *opt, const char *path)
{
    const char *fn = "opf_checkpoint_save";
    OPF_CHECK_NULL(ctx, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, seq);
    OPF_CHECK_NULL(ctx, fn, path);
    if (seq->pending)
        return opf_error(ctx, OPF_ERR_STATE, "%s: a backward is pending; save between steps", fn);
    size_t nq = (size_t)seq->n * OPF_OP_MAX_PARAMS;
    opf_tensor **qv = opf_ctx_calloc(ctx, nq, sizeof *qv);
    if (!qv) return opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of memory", fn);
    for (int i = 0; i < seq->n; i++)
        for (int j = 0; j < seq->ops[i]->n_params; j++) {
            opf_param *p = &seq->ops[i]->params[j];
            if (p->qvalue_valid && (p->qvalue.data[OPF_COMP_DATA] || p->qvalue.data[OPF_COMP_COL_DATA]))
                qv[i * OPF_OP_MAX_PARAMS + j] = &p->qvalue;
        }
    uint64_t rng[2];
    opf_ctx_get_rng(ctx, &rng[0], &rng[1]);
    opf_ck_src src = {ctx, seq, opt, qv, rng, path};
    opf_ck_list items;
    opf_status st = opf_ck_collect(&src, &items);
    char *hdr = NULL;
    size_t hlen = 0;
    if (!st) st = align_order(ctx, &items);
    if (!st) st = opf_ck_stage(ctx, &items);
    if (!st) {
        cJSON *meta = metadata(seq, opt, qv, &items);
        st = opf_st_header(ctx, &items, meta, &hdr, &hlen);
    }
    if (!st) fill_header_crc(hdr, hlen);
    char target[PATH_MAX];
    int err = st ? 0 : resolve_links(path, target);
    if (err) st = io_error(ctx, "cannot follow the symbolic links of", path, err);
    if (!st) st = write_atomic(ctx, path, target, hdr, hlen, &items);
    opf_ctx_free(ctx, hdr, hlen + 1);
    opf_ck_list_free(&items);
    opf_ctx_free(ctx, qv, nq * sizeof *qv);
    return st;
}
