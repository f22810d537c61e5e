/* load.c: opf_checkpoint_load in two phases. Phase one parses the file and
 * checks it against the seq (metadata, then every tensor's name, dtype and
 * shape), allocating whatever the result needs (quantized weight copies) on
 * the side; nothing the caller can see changes. Phase two copies the bytes
 * in and swaps the copies in, and cannot fail. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "io/io-impl.h"

typedef struct loader {
    opf_ctx           *ctx;
    opf_seq           *seq;
    opf_optim         *opt;
    const char        *who;
    const char        *hdr;     /* the header's bytes in the file */
    size_t             hdr_len;
    bool               v1;      /* a version 1 file: no checksums */
    opf_st_file        f;
    opf_tensor        *staged;  /* [n * OPF_OP_MAX_PARAMS] quantized copies read from the file */
    opf_tensor       **qv;      /* pointers into staged, NULL where the file has none */
    uint64_t           rng[2];
    int64_t            step;
    opf_ck_list        items;
    const opf_st_entry **src;   /* the file's entry for each item */
} loader;

#define BAD(...) opf_error(L->ctx, OPF_ERR_CORRUPT, __VA_ARGS__)

/* A metadata value that must be there. */
static opf_status need(loader *L, const char *key, const char **out)
{
    *out = opf_st_meta_get(&L->f, key);
    if (!*out) return BAD("checkpoint \"%s\": metadata \"%s\" is missing", L->who, key);
    return OPF_OK;
}

/* Plain decimal digits, no sign, no spaces. */
static bool parse_count(const char *s, int64_t *out)
{
    int64_t v = 0;
    size_t n = strlen(s);
    if (n == 0 || n > 18) return false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return false;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return true;
}

static opf_status check_value(loader *L, const char *key, const char *want, const char *hint)
{
    const char *v;
    opf_status st = need(L, key, &v);
    if (!st && strcmp(v, want))
        st = BAD("checkpoint \"%s\": metadata \"%s\" is \"%s\", expected \"%s\"%s", L->who, key, v,
                 want, hint);
    return st;
}

/* Each op: same class, same name, same recipe as at save time. */
static opf_status check_op(loader *L, int i)
{
    const opf_op *op = L->seq->ops[i];
    char key[64], recipe[512];
    const char *v;
    opf_status st;
    snprintf(key, sizeof key, "ops.%d.class", i);
    if ((st = need(L, key, &v))) return st;
    if (strcmp(v, opf_op_class_of(op)->name))
        return BAD("checkpoint \"%s\": op %d is a \"%s\" in the checkpoint, the seq's op \"%s\" is "
                   "a \"%s\"", L->who, i, v, opf_op_name(op), opf_op_class_of(op)->name);
    snprintf(key, sizeof key, "ops.%d.name", i);
    if ((st = need(L, key, &v))) return st;
    if (strcmp(v, opf_op_name(op)))
        return BAD("checkpoint \"%s\": op %d is called \"%s\" in the checkpoint, \"%s\" in the seq",
                   L->who, i, v, opf_op_name(op));
    snprintf(key, sizeof key, "ops.%d.recipe", i);
    if ((st = need(L, key, &v))) return st;
    opf_ck_recipe_str(op, recipe, sizeof recipe);
    if (strcmp(v, recipe))
        return BAD("checkpoint \"%s\": op %d \"%s\" was saved with recipe \"%s\", the seq's op has "
                   "\"%s\" (build the seq's recipe state with opf_checkpoint_prepare and the "
                   "same recipe)", L->who, i, opf_op_name(op), v, recipe);
    return OPF_OK;
}

static opf_status check_optim(loader *L)
{
    const char *kind = opf_st_meta_get(&L->f, "optim.kind");
    const char *step = opf_st_meta_get(&L->f, "optim.step");
    if (!L->opt) return OPF_OK;  /* the optimizer's part is skipped */
    if (!kind)
        return BAD("checkpoint \"%s\": it holds no optimizer state (saved without one); load it "
                   "with opt = NULL", L->who);
    const char *want = opf_optim_kind_of(L->opt) == OPF_OPTIM_ADAMW ? "adamw" : "sgd";
    if (strcmp(kind, want))
        return BAD("checkpoint \"%s\": optimizer \"%s\" in the checkpoint, \"%s\" given", L->who,
                   kind, want);
    if (!step || !parse_count(step, &L->step))
        return BAD("checkpoint \"%s\": metadata \"optim.step\" is %s%s%s, not a step count", L->who,
                   step ? "\"" : "", step ? step : "missing", step ? "\"" : "");
    return OPF_OK;
}

static opf_status check_meta(loader *L)
{
    opf_status st = check_value(L, "format", OPF_CK_FORMAT, " (not an opfuse checkpoint)");
    const char *v;
    if (!st && !(st = need(L, "version", &v))) {
        L->v1 = !strcmp(v, OPF_CK_VERSION1);
        if (!L->v1 && strcmp(v, OPF_CK_VERSION))
            st = BAD("checkpoint \"%s\": metadata \"version\" is \"%s\", expected \"%s\" or \"%s\" "
                     "(written by another opfuse version)", L->who, v, OPF_CK_VERSION1,
                     OPF_CK_VERSION);
    }
    int64_t n;
    if (!st && !(st = need(L, "ops", &v)) && (!parse_count(v, &n) || n != L->seq->n))
        st = BAD("checkpoint \"%s\": it holds \"%s\" ops, the seq has %d", L->who, v, L->seq->n);
    for (int i = 0; i < L->seq->n && !st; i++) st = check_op(L, i);
    if (!st) st = check_optim(L);
    return st;
}

/* "<param>.q" in the metadata: allocate the copy the file's bytes go to. */
static opf_status stage_qvalues(loader *L)
{
    for (int i = 0; i < L->seq->n; i++)
        for (int j = 0; j < L->seq->ops[i]->n_params; j++) {
            char key[OPF_CK_NAME_MAX + 8];
            opf_ck_param_name(L->seq, i, j, key, sizeof key - 2);
            strcat(key, ".q");
            const char *v = opf_st_meta_get(&L->f, key);
            if (!v) continue;
            opf_spec q;
            const opf_param *p = &L->seq->ops[i]->params[j];
            if (!opf_ck_qspec_parse(v, &p->value.spec, &q))
                return BAD("checkpoint \"%s\": metadata \"%s\" is \"%s\", not a quantized spec for "
                           "a %s parameter of this shape", L->who, key, v,
                           opf_dtype_name(p->value.spec.dtype));
            opf_tensor *t = &L->staged[i * OPF_OP_MAX_PARAMS + j];
            q.device = p->value.spec.device;
            opf_status st = opf_tensor_alloc(L->ctx, &q, t);
            if (st) return st;
            L->qv[i * OPF_OP_MAX_PARAMS + j] = t;
        }
    return OPF_OK;
}

static opf_status match_item(loader *L, int k)
{
    const opf_ck_item *it = &L->items.v[k];
    const opf_st_entry *e = opf_st_find(&L->f, it->name);
    if (!e) return BAD("checkpoint \"%s\": tensor \"%s\" is missing", L->who, it->name);
    bool same = e->ndim == it->ndim;
    for (int d = 0; same && d < it->ndim; d++) same = e->shape[d] == it->shape[d];
    if (e->dtype != it->dtype || !same) {
        char hs[160], ws[160];
        opf_st_shape_str(e->ndim, e->shape, hs, sizeof hs);
        opf_st_shape_str(it->ndim, it->shape, ws, sizeof ws);
        return BAD("checkpoint \"%s\": tensor \"%s\" is %s %s, the seq expects %s %s", L->who,
                   it->name, opf_st_dtype_name(e->dtype), hs, opf_st_dtype_name(it->dtype), ws);
    }
    L->src[k] = e;
    return OPF_OK;
}

static bool is_checksum_key(const char *key)
{
    return !strncmp(key, OPF_CK_CRC_PREFIX, strlen(OPF_CK_CRC_PREFIX)) ||
           !strcmp(key, OPF_CK_HEADER_CRC);
}

/* 8 lowercase hex digits. */
static bool parse_crc(const char *s, uint32_t *out)
{
    uint32_t v = 0;
    for (int i = 0; i < 8; i++) {
        int d = s[i] >= '0' && s[i] <= '9' ? s[i] - '0' : s[i] >= 'a' && s[i] <= 'f' ? s[i] - 'a' + 10 : -1;
        if (d < 0) return false;
        v = v << 4 | (uint32_t)d;
    }
    *out = v;
    return s[8] == '\0';
}

/* A stored checksum: present and well formed. */
static opf_status stored_crc(loader *L, const char *key, const char *what, uint32_t *out)
{
    const char *v = opf_st_meta_get(&L->f, key);
    if (!v) return BAD("checkpoint \"%s\": %s has no checksum (metadata \"%s\" is missing)", L->who, what, key);
    if (!parse_crc(v, out))
        return BAD("checkpoint \"%s\": metadata \"%s\" is \"%s\", not 8 hex digits of a CRC-32C",
                   L->who, key, v);
    return OPF_OK;
}

/* Version 2: the header's checksum, then every tensor's (those a weights-only
 * load skips too), and no checksum for a tensor the file lacks. */
static opf_status check_sums(loader *L)
{
    if (L->v1) return OPF_OK;
    uint32_t want, got;
    size_t at;
    opf_status st = stored_crc(L, OPF_CK_HEADER_CRC, "the header", &want);
    if (!st && !opf_ck_header_crc(L->hdr, L->hdr_len, &at, &got))
        st = BAD("checkpoint \"%s\": the header's checksum cannot be located", L->who);
    if (!st && got != want)
        st = BAD("checkpoint \"%s\": the header's checksum does not match (CRC-32C %08x stored, "
                 "%08x of its bytes): the file is corrupt", L->who, (unsigned)want, (unsigned)got);
    char key[OPF_CK_NAME_MAX + 16], what[OPF_CK_NAME_MAX + 16];
    for (int i = 0; !st && i < L->f.n; i++) {
        const opf_st_entry *e = &L->f.e[i];
        snprintf(key, sizeof key, OPF_CK_CRC_PREFIX "%s", e->name);
        snprintf(what, sizeof what, "tensor \"%s\"", e->name);
        if ((st = stored_crc(L, key, what, &want))) break;
        got = opf_crc32c(0, L->f.buf + e->begin, (size_t)(e->end - e->begin));
        if (got != want)
            st = BAD("checkpoint \"%s\": tensor \"%s\": its checksum does not match (CRC-32C "
                     "%08x stored, %08x of its %llu bytes): the file is corrupt", L->who, e->name,
                     (unsigned)want, (unsigned)got, (unsigned long long)(e->end - e->begin));
    }
    for (int i = 0; !st && i < L->f.n_meta; i++)
        if (!L->f.m[i].used && is_checksum_key(L->f.m[i].key))
            st = BAD("checkpoint \"%s\": metadata \"%s\" is the checksum of a tensor the file "
                     "does not hold", L->who, L->f.m[i].key);
    return st;
}

/* Every tensor and metadata key of the file must have been asked for. */
static opf_status check_unknown(loader *L)
{
    for (int i = 0; i < L->f.n; i++) {
        opf_st_entry *e = &L->f.e[i];
        if (!L->opt && !strncmp(e->name, "optim.", 6) && opf_st_meta_get(&L->f, "optim.kind"))
            continue;  /* weights-only load: the optimizer's tensors are skipped */
        if (!e->used)
            return BAD("checkpoint \"%s\": unknown tensor \"%s\" (%s); this seq has no such "
                       "tensor", L->who, e->name, opf_st_dtype_name(e->dtype));
    }
    for (int i = 0; i < L->f.n_meta; i++)
        if (!L->f.m[i].used && (L->v1 || !is_checksum_key(L->f.m[i].key)))
            return BAD("checkpoint \"%s\": unknown metadata \"%s\" = \"%s\"", L->who, L->f.m[i].key,
                       L->f.m[i].value);
    return OPF_OK;
}

static opf_status check_all(loader *L)
{
    opf_status st = check_meta(L);
    if (!st) st = stage_qvalues(L);
    opf_ck_src src = {L->ctx, L->seq, L->opt, L->qv, L->rng, L->who};
    if (!st) st = opf_ck_collect(&src, &L->items);
    if (!st && !(L->src = opf_ctx_calloc(L->ctx, (size_t)L->items.n, sizeof *L->src)))
        st = opf_error(L->ctx, OPF_ERR_NO_MEMORY, "checkpoint \"%s\": out of memory", L->who);
    for (int k = 0; !st && k < L->items.n; k++) st = match_item(L, k);
    if (!st) st = check_unknown(L);
    if (!st) st = check_sums(L);
    return st;
}

/* Phase two: nothing here can fail but a device's copy (its error). */
static opf_status apply(loader *L)
{
    opf_status st = OPF_OK;
    for (int k = 0; k < L->items.n && !st; k++)
        if (L->items.v[k].nbytes)
            st = opf_ck_item_put(L->ctx, &L->items.v[k], L->f.buf + L->src[k]->begin);
    for (int i = 0; i < L->seq->n; i++)
        for (int j = 0; j < L->seq->ops[i]->n_params; j++) {
            opf_param *p = &L->seq->ops[i]->params[j];
            opf_tensor *t = L->qv[i * OPF_OP_MAX_PARAMS + j];
            p->qvalue_valid = t != NULL;
            if (!t) continue;
            opf_tensor_release(&p->qvalue);
            p->qvalue = *t;
            memset(t, 0, sizeof *t);
            L->seq->epoch++;  /* compiled graphs baked the old buffer's address */
        }
    if (L->opt) opf_optim_set_step_count(L->opt, L->step);
    opf_ctx_set_rng(L->ctx, L->rng[0], L->rng[1]);
    return st;
}

/* Non-finite fp32 master weights load (the file is what was saved) but are
 * reported: the next step would carry them into the parameters. */
static void warn_nonfinite(loader *L)
{
    static const char suffix[] = ".master";
    for (int k = 0; k < L->items.n; k++) {
        const opf_ck_item *it = &L->items.v[k];
        size_t n = strlen(it->name), sn = sizeof suffix - 1;
        if (it->dtype != OPF_ST_F32 || n < sn || strcmp(it->name + n - sn, suffix)) continue;
        const uint8_t *p = L->f.buf + L->src[k]->begin;
        size_t count = it->nbytes / 4, bad = 0;
        for (size_t i = 0; i < count; i++) {
            float v;
            memcpy(&v, p + 4 * i, 4);
            bad += !isfinite(v);
        }
        if (bad)
            opf_ctx_warn(L->ctx, "opf_checkpoint_load: checkpoint \"%s\": tensor \"%s\" holds "
                         "non-finite values: %zu of %zu fp32 master weights are NaN or Inf", L->who,
                         it->name, bad, count);
    }
}

opf_status opf_checkpoint_load_mem(opf_ctx *ctx, opf_seq *seq, opf_optim *opt, const void *data,
                                   size_t size, const char *name)
{
    const char *fn = "opf_checkpoint_load";
    OPF_CHECK_NULL(ctx, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, seq);
    if (!data && size) return opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: data is NULL", fn);
    if (seq->pending)
        return opf_error(ctx, OPF_ERR_STATE, "%s: a backward is pending; load between steps", fn);
    loader L = {.ctx = ctx, .seq = seq, .opt = opt, .who = name ? name : "<memory>"};
    size_t np = (size_t)seq->n * OPF_OP_MAX_PARAMS;
    L.staged = opf_ctx_calloc(ctx, np, sizeof *L.staged);
    L.qv = opf_ctx_calloc(ctx, np, sizeof *L.qv);
    opf_status st = L.staged && L.qv ? OPF_OK
                  : opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: out of memory", fn);
    for (int k = 0; !st && opt && k < opf_optim_num_slots(opt); k++) {
        opf_param *p;
        int i, j;
        opf_optim_slot(opt, k, &p, NULL, NULL, NULL, NULL);
        if (!opf_ck_find_param(seq, p, &i, &j))
            st = opf_error(ctx, OPF_ERR_INVALID_ARG, "%s: optimizer slot %d holds a parameter "
                           "that is not in this seq", fn, k);
    }
    if (!st) st = opf_st_parse(ctx, L.who, data ? data : (const void *)"", size, &L.f);
    if (!st) {
        L.hdr = (const char *)data + 8;
        L.hdr_len = (size_t)((const char *)L.f.buf - L.hdr);
        st = check_all(&L);
    }
    if (!st) st = apply(&L);
    if (!st) warn_nonfinite(&L);
    for (size_t i = 0; L.staged && i < np; i++) opf_tensor_release(&L.staged[i]);
    opf_ctx_free(ctx, L.staged, np * sizeof *L.staged);
    opf_ctx_free(ctx, L.qv, np * sizeof *L.qv);
    opf_ctx_free(ctx, L.src, (size_t)L.items.n * sizeof *L.src);
    opf_ck_list_free(&L.items);
    opf_st_free(&L.f);
    return st;
}

/* The whole file into memory: size it, then read it. */
static opf_status read_file(opf_ctx *ctx, const char *path, unsigned char **out, size_t *size)
{
    const char *fn = "opf_checkpoint_load";
    FILE *f = fopen(path, "rb");
    if (!f) return opf_error(ctx, OPF_ERR_IO, "%s: cannot open \"%s\": %s", fn, path, strerror(errno));
    struct stat sb;
    opf_status st = OPF_OK;
    unsigned char *buf = NULL;
    if (fstat(fileno(f), &sb))
        st = opf_error(ctx, OPF_ERR_IO, "%s: cannot stat \"%s\": %s", fn, path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = opf_error(ctx, OPF_ERR_IO, "%s: \"%s\" is not a regular file", fn, path);
    else if (!(buf = opf_ctx_alloc(ctx, (size_t)sb.st_size)))
        st = opf_error(ctx, OPF_ERR_NO_MEMORY, "%s: \"%s\": no memory for its %lld bytes", fn,
                       path, (long long)sb.st_size);
    else if (fread(buf, 1, (size_t)sb.st_size, f) != (size_t)sb.st_size)
        st = opf_error(ctx, OPF_ERR_IO, "%s: cannot read \"%s\": %s", fn, path,
                       ferror(f) ? strerror(errno) : "the file shrank while being read");
    fclose(f);
    if (st) {
        opf_ctx_free(ctx, buf, buf ? (size_t)sb.st_size : 0);
        return st;
    }
    *out = buf;
    *size = (size_t)sb.st_size;
    return OPF_OK;
}

opf_status opf_checkpoint_load(opf_ctx *ctx, opf_seq *seq, opf_optim *opt, const char *path)
{
    const char *fn = "opf_checkpoint_load";
    OPF_CHECK_NULL(ctx, fn, ctx);
    OPF_CHECK_NULL(ctx, fn, seq);
    OPF_CHECK_NULL(ctx, fn, path);
    if (seq->pending)
        return opf_error(ctx, OPF_ERR_STATE, "%s: a backward is pending; load between steps", fn);
    unsigned char *data = NULL;
    size_t size = 0;
    opf_status st = read_file(ctx, path, &data, &size);
    if (st) return st;
    st = opf_checkpoint_load_mem(ctx, seq, opt, data, size, path);
    opf_ctx_free(ctx, data, size);
    return st;
}
