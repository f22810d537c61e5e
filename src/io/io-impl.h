/* io-impl.h: private pieces of the checkpoint layer: the safetensors reader
 * and header writer (safetensors.c) and the list of tensors a checkpoint of
 * a seq holds, with their names (names.c). */
#ifndef OPFUSE_IO_IMPL_H
#define OPFUSE_IO_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "fuser/fuser-impl.h"
#include "opfuse/io.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; opfuse checkpoints copy host bytes as they are"
#endif

#define OPF_CK_FORMAT     "opfuse-checkpoint"
/* Version 2 adds CRC-32C checksums (metadata "header.crc32c" and
 * "crc32c.<tensor>"); version 1 files, written without them, still load. */
#define OPF_CK_VERSION    "2"
#define OPF_CK_VERSION1   "1"
#define OPF_CK_CRC_PREFIX "crc32c."
#define OPF_CK_HEADER_CRC "header.crc32c"
#define OPF_CK_NAME_MAX   256
/* A header longer than this is refused before it is parsed. */
#define OPF_CK_HEADER_MAX ((uint64_t)100 << 20)

/* CRC-32C of n bytes at data, continuing from crc (0 to start). */
uint32_t opf_crc32c(uint32_t crc, const void *data, size_t n);

/* The dtypes of safetensors. */
typedef enum opf_st_dtype {
    OPF_ST_BOOL = 0, OPF_ST_U8, OPF_ST_I8, OPF_ST_F8_E5M2, OPF_ST_F8_E4M3, OPF_ST_F8_E8M0,
    OPF_ST_I16, OPF_ST_U16, OPF_ST_F16, OPF_ST_BF16, OPF_ST_I32, OPF_ST_U32, OPF_ST_F32,
    OPF_ST_F64, OPF_ST_I64, OPF_ST_U64,
    OPF_ST_DTYPE_COUNT
} opf_st_dtype;

const char *opf_st_dtype_name(opf_st_dtype dt);
size_t opf_st_dtype_size(opf_st_dtype dt);
/* The safetensors dtype holding an opf_dtype's bytes (packed e2m1: U8). */
opf_st_dtype opf_st_dtype_of(opf_dtype dt);
/* "[64,128]" into buf. */
void opf_st_shape_str(int ndim, const int64_t *shape, char *buf, size_t size);

/* One tensor of a checkpoint: what it is called, what it holds and where
 * its bytes are (saving: the source; loading: the destination). */
typedef struct opf_ck_item {
    char         name[OPF_CK_NAME_MAX];
    opf_st_dtype dtype;
    int          ndim;
    int64_t      shape[OPF_MAX_DIMS];
    size_t       nbytes;
    void        *ptr;
    opf_device   device;  /* the memory ptr is in: a device's is copied, never read */
    void        *staged;  /* saving a device item: its bytes on the host (the list's) */
} opf_ck_item;

typedef struct opf_ck_list {
    opf_ctx     *ctx;  /* whose allocator holds v */
    opf_ck_item *v;
    int          n, cap;
} opf_ck_list;

void opf_ck_list_free(opf_ck_list *l);
/* Saving: brings every device item's bytes to the host (it->staged), one
 * explicit copy each through opf_tensor_copy. */
opf_status opf_ck_stage(opf_ctx *ctx, opf_ck_list *l);
/* Loading: the item's bytes from host memory src into its place (memcpy, or
 * a copy to the device). */
opf_status opf_ck_item_put(opf_ctx *ctx, const opf_ck_item *it, const void *src);

/* What a checkpoint of a seq covers. qv holds, per parameter (index
 * op * OPF_OP_MAX_PARAMS + param), the quantized copy to include or NULL;
 * rng points at {seed, offset}. opt may be NULL. */
typedef struct opf_ck_src {
    opf_ctx     *ctx;
    opf_seq     *seq;
    opf_optim   *opt;
    opf_tensor **qv;
    uint64_t    *rng;
    const char  *who;  /* the file, for messages */
} opf_ck_src;

/* Lists every tensor of the checkpoint of *s in file order. */
opf_status opf_ck_collect(const opf_ck_src *s, opf_ck_list *out);

/* Names and metadata strings (docs/checkpoint.md). */
void opf_ck_param_name(const opf_seq *seq, int op, int param, char *buf, size_t size);
void opf_ck_recipe_str(const opf_op *op, char *buf, size_t size);
void opf_ck_qspec_str(const opf_spec *q, char *buf, size_t size);
/* The quantized spec s describes for a parameter whose value has spec
 * *value; false when s is not a spec string this writer produces. */
bool opf_ck_qspec_parse(const char *s, const opf_spec *value, opf_spec *out);
/* The seq's op and parameter index of p; false when p is not in the seq. */
bool opf_ck_find_param(const opf_seq *seq, const opf_param *p, int *op, int *param);

/* ---- reading -------------------------------------------------------------- */

typedef struct opf_st_entry {
    const char  *name;
    opf_st_dtype dtype;
    int          ndim;
    int64_t      shape[OPF_MAX_DIMS];
    uint64_t     begin, end;  /* in the byte buffer */
    bool         used;
} opf_st_entry;

typedef struct opf_st_meta {
    const char *key, *value;
    bool        used;
} opf_st_meta;

typedef struct opf_st_file {
    opf_ctx       *ctx;      /* whose allocator holds e and m */
    const char    *who;
    cJSON         *root;
    opf_st_entry  *e;        /* sorted by name */
    int            n, cap;
    opf_st_meta   *m;        /* sorted by key */
    int            n_meta, cap_meta;
    const uint8_t *buf;      /* the byte buffer after the header */
    uint64_t       buf_size;
} opf_st_file;

/* Parses and checks the form of a safetensors file held in data: header
 * length, JSON, every entry (dtype, shape, offsets matching the size),
 * offsets contiguous from 0 to the end of the buffer, no duplicate names,
 * metadata string to string. OPF_ERR_CORRUPT with a message naming who. */
opf_status opf_st_parse(opf_ctx *ctx, const char *who, const uint8_t *data, size_t size,
                        opf_st_file *out);
void opf_st_free(opf_st_file *f);
/* The entry called name (marked used), or NULL. */
opf_st_entry *opf_st_find(opf_st_file *f, const char *name);
/* The metadata value of key (marked used), or NULL. */
const char *opf_st_meta_get(opf_st_file *f, const char *key);

/* ---- checksums ------------------------------------------------------------ */

/* The checksum of a header of len bytes at hdr: CRC-32C of the header with
 * the 8 hex digits of metadata "header.crc32c" read as "00000000" (the
 * writer prints the header with that placeholder, then fills it in).
 * *digits: their offset in hdr. False when the key is not there exactly once
 * with 8 characters of value. */
bool opf_ck_header_crc(const char *hdr, size_t len, size_t *digits, uint32_t *crc);

/* ---- writing -------------------------------------------------------------- */

/* The header of a file holding items in list order: JSON with meta (taken:
 * freed here) as "__metadata__", padded with spaces to a multiple of 8.
 * *out comes from the context's allocator: opf_ctx_free(ctx, *out, *len + 1). */
opf_status opf_st_header(opf_ctx *ctx, const opf_ck_list *items, cJSON *meta, char **out,
                         size_t *len);

#endif
