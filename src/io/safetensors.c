/* safetensors.c: the safetensors container: the parser that checks a file's
 * form before anyone reads a byte of it, and the header writer.
 *
 * Layout: an 8-byte little-endian header length N, N bytes of JSON
 *   {"__metadata__": {string: string}, name: {"dtype": D, "shape": [..],
 *    "data_offsets": [begin, end]}, ...}
 * (possibly padded with spaces), then the byte buffer. Offsets are relative
 * to the buffer; the tensors tile it exactly, in any JSON order. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/io-impl.h"

static const struct { const char *name; size_t size; } st_dtypes[] = {
    [OPF_ST_BOOL] = {"BOOL", 1},       [OPF_ST_U8] = {"U8", 1},
    [OPF_ST_I8] = {"I8", 1},           [OPF_ST_F8_E5M2] = {"F8_E5M2", 1},
    [OPF_ST_F8_E4M3] = {"F8_E4M3", 1}, [OPF_ST_F8_E8M0] = {"F8_E8M0", 1},
    [OPF_ST_I16] = {"I16", 2},         [OPF_ST_U16] = {"U16", 2},
    [OPF_ST_F16] = {"F16", 2},         [OPF_ST_BF16] = {"BF16", 2},
    [OPF_ST_I32] = {"I32", 4},         [OPF_ST_U32] = {"U32", 4},
    [OPF_ST_F32] = {"F32", 4},         [OPF_ST_F64] = {"F64", 8},
    [OPF_ST_I64] = {"I64", 8},         [OPF_ST_U64] = {"U64", 8},
};
_Static_assert(sizeof st_dtypes / sizeof st_dtypes[0] == OPF_ST_DTYPE_COUNT,
               "st_dtypes must list every safetensors dtype");

static const opf_st_dtype from_opf[] = {
    [OPF_F32] = OPF_ST_F32,      [OPF_F16] = OPF_ST_F16,      [OPF_BF16] = OPF_ST_BF16,
    [OPF_E4M3] = OPF_ST_F8_E4M3, [OPF_E5M2] = OPF_ST_F8_E5M2, [OPF_E2M1] = OPF_ST_U8,
    [OPF_E8M0] = OPF_ST_F8_E8M0, [OPF_I32] = OPF_ST_I32,      [OPF_I64] = OPF_ST_I64,
    [OPF_U8] = OPF_ST_U8,
};
_Static_assert(sizeof from_opf / sizeof from_opf[0] == OPF_DTYPE_COUNT,
               "from_opf must map every opf_dtype");

const char *opf_st_dtype_name(opf_st_dtype dt)
{
    return (unsigned)dt < OPF_ST_DTYPE_COUNT ? st_dtypes[dt].name : "invalid";
}

size_t opf_st_dtype_size(opf_st_dtype dt)
{
    return (unsigned)dt < OPF_ST_DTYPE_COUNT ? st_dtypes[dt].size : 0;
}

opf_st_dtype opf_st_dtype_of(opf_dtype dt) { return from_opf[dt]; }

static int find_dtype(const char *name)
{
    for (int i = 0; i < OPF_ST_DTYPE_COUNT; i++)
        if (!strcmp(st_dtypes[i].name, name)) return i;
    return -1;
}

void opf_st_shape_str(int ndim, const int64_t *shape, char *buf, size_t size)
{
    int n = snprintf(buf, size, "[");
    for (int i = 0; i < ndim && n > 0 && (size_t)n < size; i++)
        n += snprintf(buf + n, size - (size_t)n, "%s%lld", i ? "," : "", (long long)shape[i]);
    if (n > 0 && (size_t)n < size) snprintf(buf + n, size - (size_t)n, "]");
}

/* ---- parsing ------------------------------------------------------------- */

#define BAD(...) opf_error(ctx, OPF_ERR_CORRUPT, __VA_ARGS__)

/* A JSON number that is a whole number in [0, 2^53] (exact in a double). */
static bool get_uint(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j)) return false;
    double d = j->valuedouble;
    if (!(d >= 0 && d <= 9007199254740992.0) || floor(d) != d) return false;
    *out = (uint64_t)d;
    return true;
}

static opf_status parse_shape(opf_ctx *ctx, const char *who, const char *name, const cJSON *j,
                              opf_st_entry *e)
{
    if (!cJSON_IsArray(j))
        return BAD("checkpoint \"%s\": tensor \"%s\": shape is not an array", who, name);
    int nd = cJSON_GetArraySize(j);
    if (nd > OPF_MAX_DIMS)
        return BAD("checkpoint \"%s\": tensor \"%s\": %d dims, at most %d", who, name, nd,
                   OPF_MAX_DIMS);
    int i = 0;
    for (const cJSON *d = j->child; d; d = d->next, i++) {
        uint64_t v;
        if (!get_uint(d, &v))
            return BAD("checkpoint \"%s\": tensor \"%s\": shape entry %d is not a whole number "
                       ">= 0", who, name, i);
        e->shape[i] = (int64_t)v;
    }
    e->ndim = nd;
    return OPF_OK;
}

static opf_status parse_offsets(opf_ctx *ctx, const char *who, const char *name, const cJSON *j,
                                opf_st_entry *e)
{
    if (!cJSON_IsArray(j) || cJSON_GetArraySize(j) != 2 || !get_uint(j->child, &e->begin) ||
        !get_uint(j->child->next, &e->end))
        return BAD("checkpoint \"%s\": tensor \"%s\": data_offsets is not [begin, end] of whole "
                   "numbers >= 0", who, name);
    return OPF_OK;
}

/* The three keys of an entry, each exactly once and nothing else. */
static opf_status entry_fields(opf_ctx *ctx, const char *who, const char *name, const cJSON *j,
                               const cJSON *f[3])
{
    static const char *const keys[3] = {"dtype", "shape", "data_offsets"};
    f[0] = f[1] = f[2] = NULL;
    for (const cJSON *c = j->child; c; c = c->next) {
        int k = 0;
        while (k < 3 && strcmp(c->string, keys[k])) k++;
        if (k == 3 || f[k])
            return BAD("checkpoint \"%s\": tensor \"%s\": %s key \"%s\"", who, name,
                       k == 3 ? "unknown" : "repeated", c->string);
        f[k] = c;
    }
    for (int k = 0; k < 3; k++)
        if (!f[k]) return BAD("checkpoint \"%s\": tensor \"%s\": no \"%s\"", who, name, keys[k]);
    return OPF_OK;
}

/* Bytes the entry's dtype and shape need must equal end - begin. */
static opf_status check_size(opf_ctx *ctx, const char *who, const opf_st_entry *e,
                             uint64_t buf_size)
{
    if (e->begin > e->end || e->end > buf_size)
        return BAD("checkpoint \"%s\": tensor \"%s\": data_offsets [%llu, %llu] are not inside "
                   "the %llu-byte buffer", who, e->name, (unsigned long long)e->begin,
                   (unsigned long long)e->end, (unsigned long long)buf_size);
    uint64_t bytes = st_dtypes[e->dtype].size;
    for (int i = 0; i < e->ndim; i++)
        if (__builtin_mul_overflow(bytes, (uint64_t)e->shape[i], &bytes)) bytes = UINT64_MAX;
    if (bytes != e->end - e->begin) {
        char sh[160];
        opf_st_shape_str(e->ndim, e->shape, sh, sizeof sh);
        return BAD("checkpoint \"%s\": tensor \"%s\": %s %s needs %llu bytes, data_offsets "
                   "[%llu, %llu] hold %llu", who, e->name, st_dtypes[e->dtype].name, sh,
                   (unsigned long long)bytes, (unsigned long long)e->begin,
                   (unsigned long long)e->end, (unsigned long long)(e->end - e->begin));
    }
    return OPF_OK;
}

static opf_status parse_entry(opf_ctx *ctx, const char *who, const cJSON *j, uint64_t buf_size,
                              opf_st_entry *e)
{
    const char *name = j->string;
    memset(e, 0, sizeof *e);
    e->name = name;
    if (!cJSON_IsObject(j))
        return BAD("checkpoint \"%s\": tensor \"%s\": the entry is not an object", who, name);
    const cJSON *f[3];
    opf_status st = entry_fields(ctx, who, name, j, f);
    if (st) return st;
    int dt = cJSON_IsString(f[0]) ? find_dtype(f[0]->valuestring) : -1;
    if (dt < 0)
        return BAD("checkpoint \"%s\": tensor \"%s\": unknown dtype %s%s%s", who, name,
                   cJSON_IsString(f[0]) ? "\"" : "",
                   cJSON_IsString(f[0]) ? f[0]->valuestring : "(not a string)",
                   cJSON_IsString(f[0]) ? "\"" : "");
    e->dtype = (opf_st_dtype)dt;
    if ((st = parse_shape(ctx, who, name, f[1], e))) return st;
    if ((st = parse_offsets(ctx, who, name, f[2], e))) return st;
    return check_size(ctx, who, e, buf_size);
}

static opf_status parse_meta(opf_ctx *ctx, opf_st_file *f, const cJSON *j)
{
    const char *who = f->who;
    if (f->m) return BAD("checkpoint \"%s\": \"__metadata__\" appears twice", who);
    if (!cJSON_IsObject(j)) return BAD("checkpoint \"%s\": \"__metadata__\" is not an object", who);
    int n = cJSON_GetArraySize(j);
    f->m = opf_ctx_calloc(ctx, (size_t)n, sizeof *f->m);
    f->cap_meta = n;
    if (!f->m) return opf_error(ctx, OPF_ERR_NO_MEMORY, "checkpoint \"%s\": out of memory", who);
    for (const cJSON *c = j->child; c; c = c->next) {
        if (!cJSON_IsString(c))
            return BAD("checkpoint \"%s\": metadata \"%s\" is not a string", who, c->string);
        f->m[f->n_meta++] = (opf_st_meta){c->string, c->valuestring, false};
    }
    return OPF_OK;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const opf_st_entry *)a)->name, ((const opf_st_entry *)b)->name);
}
static int by_key(const void *a, const void *b)
{
    return strcmp(((const opf_st_meta *)a)->key, ((const opf_st_meta *)b)->key);
}
static int by_offset(const void *a, const void *b)
{
    const opf_st_entry *x = *(const opf_st_entry *const *)a, *y = *(const opf_st_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* The tensors must tile the buffer: sorted by offset, each begins where the
 * previous ended, the first at 0, the last at the buffer's end. */
static opf_status check_tiling(opf_ctx *ctx, const opf_st_file *f)
{
    const opf_st_entry **s = opf_ctx_calloc(ctx, (size_t)f->n, sizeof *s);
    if (!s) return opf_error(ctx, OPF_ERR_NO_MEMORY, "checkpoint \"%s\": out of memory", f->who);
    for (int i = 0; i < f->n; i++) s[i] = &f->e[i];
    qsort(s, (size_t)f->n, sizeof *s, by_offset);
    uint64_t pos = 0;
    opf_status st = OPF_OK;
    for (int i = 0; i < f->n && !st; i++) {
        if (s[i]->begin < pos)
            st = BAD("checkpoint \"%s\": tensor \"%s\" at [%llu, %llu] overlaps \"%s\" at [%llu, "
                     "%llu]", f->who, s[i]->name, (unsigned long long)s[i]->begin,
                     (unsigned long long)s[i]->end, s[i - 1]->name,
                     (unsigned long long)s[i - 1]->begin, (unsigned long long)s[i - 1]->end);
        else if (s[i]->begin > pos)
            st = BAD("checkpoint \"%s\": a gap of %llu bytes at offset %llu, before tensor \"%s\"",
                     f->who, (unsigned long long)(s[i]->begin - pos), (unsigned long long)pos,
                     s[i]->name);
        pos = s[i]->end;
    }
    if (!st && pos != f->buf_size)
        st = BAD("checkpoint \"%s\": the tensors end at byte %llu of the %llu-byte buffer (%llu "
                 "bytes belong to no tensor)", f->who, (unsigned long long)pos,
                 (unsigned long long)f->buf_size, (unsigned long long)(f->buf_size - pos));
    opf_ctx_free(ctx, s, sizeof *s * (size_t)f->n);
    return st;
}

/* Sorts the names and keys (for lookup) and refuses repeats. */
static opf_status sort_names(opf_ctx *ctx, opf_st_file *f)
{
    qsort(f->e, (size_t)f->n, sizeof *f->e, by_name);
    for (int i = 1; i < f->n; i++)
        if (!strcmp(f->e[i].name, f->e[i - 1].name))
            return BAD("checkpoint \"%s\": tensor \"%s\" appears twice", f->who, f->e[i].name);
    if (f->m) qsort(f->m, (size_t)f->n_meta, sizeof *f->m, by_key);
    for (int i = 1; i < f->n_meta; i++)
        if (!strcmp(f->m[i].key, f->m[i - 1].key))
            return BAD("checkpoint \"%s\": metadata \"%s\" appears twice", f->who, f->m[i].key);
    return OPF_OK;
}

/* Length prefix and JSON text: the root object, or an error. */
static opf_status parse_json(opf_ctx *ctx, opf_st_file *f, const uint8_t *data, size_t size)
{
    const char *who = f->who;
    if (size < 8)
        return BAD("checkpoint \"%s\": %zu bytes, too short for the 8-byte header length", who,
                   size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | data[i];
    if (n < 2 || n > OPF_CK_HEADER_MAX)
        return BAD("checkpoint \"%s\": header length %llu outside 2..%llu", who,
                   (unsigned long long)n, (unsigned long long)OPF_CK_HEADER_MAX);
    if (n > size - 8)
        return BAD("checkpoint \"%s\": header length %llu, but only %zu bytes follow the length "
                   "(truncated?)", who, (unsigned long long)n, size - 8);
    const char *hdr = (const char *)data + 8, *end = NULL;
    f->root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!f->root)
        return BAD("checkpoint \"%s\": the header is not valid JSON (error at byte %lld of %llu)",
                   who, end ? (long long)(end - hdr) : -1LL, (unsigned long long)n);
    for (const char *p = end; p < hdr + n; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
            return BAD("checkpoint \"%s\": the header has data after its JSON (byte %lld of %llu)",
                       who, (long long)(p - hdr), (unsigned long long)n);
    if (!cJSON_IsObject(f->root))
        return BAD("checkpoint \"%s\": the header is not a JSON object", who);
    f->buf = data + 8 + n;
    f->buf_size = size - 8 - n;
    return OPF_OK;
}

opf_status opf_st_parse(opf_ctx *ctx, const char *who, const uint8_t *data, size_t size,
                        opf_st_file *out)
{
    memset(out, 0, sizeof *out);
    out->ctx = ctx;
    out->who = who;
    opf_status st = parse_json(ctx, out, data, size);
    if (st) return st;
    int n = cJSON_GetArraySize(out->root);
    out->e = opf_ctx_calloc(ctx, (size_t)n, sizeof *out->e);
    out->cap = n;
    if (!out->e) return opf_error(ctx, OPF_ERR_NO_MEMORY, "checkpoint \"%s\": out of memory", who);
    for (const cJSON *c = out->root->child; c && !st; c = c->next) {
        if (!strcmp(c->string, "__metadata__")) st = parse_meta(ctx, out, c);
        else st = parse_entry(ctx, who, c, out->buf_size, &out->e[out->n++]);
    }
    if (!st) st = check_tiling(ctx, out);
    if (!st) st = sort_names(ctx, out);
    return st;
}

void opf_st_free(opf_st_file *f)
{
    cJSON_Delete(f->root);
    if (f->ctx) {
        opf_ctx_free(f->ctx, f->e, sizeof *f->e * (size_t)f->cap);
        opf_ctx_free(f->ctx, f->m, sizeof *f->m * (size_t)f->cap_meta);
    }
    memset(f, 0, sizeof *f);
}

opf_st_entry *opf_st_find(opf_st_file *f, const char *name)
{
    opf_st_entry key = {.name = name};
    opf_st_entry *e = f->n ? bsearch(&key, f->e, (size_t)f->n, sizeof *f->e, by_name) : NULL;
    if (e) e->used = true;
    return e;
}

const char *opf_st_meta_get(opf_st_file *f, const char *key)
{
    opf_st_meta k = {.key = key};
    opf_st_meta *m = f->n_meta ? bsearch(&k, f->m, (size_t)f->n_meta, sizeof *f->m, by_key) : NULL;
    if (!m) return NULL;
    m->used = true;
    return m->value;
}

/* ---- writing -------------------------------------------------------------- */

static cJSON *entry_json(const opf_ck_item *it, uint64_t begin)
{
    cJSON *o = cJSON_CreateObject(), *sh = cJSON_CreateArray(), *off = cJSON_CreateArray();
    bool ok = o && sh && off && cJSON_AddStringToObject(o, "dtype", opf_st_dtype_name(it->dtype));
    for (int d = 0; ok && d < it->ndim; d++)
        ok = cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)it->shape[d]));
    ok = ok && cJSON_AddItemToArray(off, cJSON_CreateNumber((double)begin)) &&
         cJSON_AddItemToArray(off, cJSON_CreateNumber((double)(begin + it->nbytes)));
    if (ok && cJSON_AddItemToObject(o, "shape", sh)) {
        sh = NULL;
        if (cJSON_AddItemToObject(o, "data_offsets", off)) return o;
    }
    cJSON_Delete(sh), cJSON_Delete(off), cJSON_Delete(o);
    return NULL;
}

opf_status opf_st_header(opf_ctx *ctx, const opf_ck_list *items, cJSON *meta, char **out,
                         size_t *len)
{
    cJSON *root = cJSON_CreateObject();
    bool ok = root && meta && cJSON_AddItemToObject(root, "__metadata__", meta);
    if (!ok) cJSON_Delete(meta);
    uint64_t pos = 0;
    for (int i = 0; ok && i < items->n; i++) {
        cJSON *e = entry_json(&items->v[i], pos);
        ok = e && cJSON_AddItemToObject(root, items->v[i].name, e);
        if (!ok) cJSON_Delete(e);
        pos += items->v[i].nbytes;
    }
    char *text = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!text) return opf_error(ctx, OPF_ERR_NO_MEMORY, "checkpoint: out of memory for the header");
    size_t n = strlen(text), padded = (n + 7) / 8 * 8;
    char *h = opf_ctx_alloc(ctx, padded + 1);
    if (h) memcpy(h, text, n);
    cJSON_free(text);
    if (!h) return opf_error(ctx, OPF_ERR_NO_MEMORY, "checkpoint: out of memory for the header");
    memset(h + n, ' ', padded - n);  /* so the buffer starts 8-byte aligned */
    h[padded] = '\0';
    *out = h;
    *len = padded;
    return OPF_OK;
}

/* The first of the key's occurrences in len bytes at h from pos, or len. */
static size_t find_key(const char *h, size_t len, size_t pos, const char *key, size_t k)
{
    for (; pos + k <= len; pos++)
        if (!memcmp(h + pos, key, k)) return pos;
    return len;
}

bool opf_ck_header_crc(const char *hdr, size_t len, size_t *digits, uint32_t *crc)
{
    static const char key[] = "\"" OPF_CK_HEADER_CRC "\":\"";
    size_t k = sizeof key - 1, at = find_key(hdr, len, 0, key, k);
    if (at == len || at + k + 9 > len || hdr[at + k + 8] != '"' ||
        find_key(hdr, len, at + 1, key, k) != len)
        return false;
    *digits = at + k;
    static const char zeros[8] = "00000000";
    uint32_t c = opf_crc32c(0, hdr, *digits);
    c = opf_crc32c(c, zeros, 8);
    *crc = opf_crc32c(c, hdr + *digits + 8, len - *digits - 8);
    return true;
}
