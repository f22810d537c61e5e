/* test_checkpoint_bad.c: every malformed or mismatched checkpoint is refused
 * with the right status and a message naming the problem, and leaves the
 * seq, optimizer, recipe state and RNG byte for byte as they were; saving
 * is atomic (a failed save leaves the old file and no temporary behind);
 * the fuzz corpus replays cleanly through the loader. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"
#include "../../fuzz/checkpoint_harness.h"

static char dir[64], good_path[128], wonly_path[128];
static fz_fixture F;   /* FP8 delayed model, a step past the saved state */
static fz_blob good;   /* its checkpoint */
static char *hdr;      /* the checkpoint's header text and its byte buffer */
static const uint8_t *body;
static size_t blen, hlen;  /* the buffer's size, the header's (padded) length */

/* length prefix + header + buffer (+ extra bytes) */
static fz_blob assemble(const char *h, const void *extra, size_t n_extra)
{
    fz_blob b = {NULL, 0};
    uint64_t n = strlen(h);
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)(n >> (8 * i));
    fz_put(&b, len, 8), fz_put(&b, h, n), fz_put(&b, body, blen), fz_put(&b, extra, n_extra);
    return b;
}

/* h with the first occurrence of find replaced (NULL and a failed check if
 * find is absent). */
static char *edit(const char *h, const char *find, const char *repl)
{
    const char *at = strstr(h, find);
    CHECK(at != NULL, "the header has no \"%s\"", find);
    if (!at) return NULL;
    size_t a = (size_t)(at - h), f = strlen(find), r = strlen(repl), n = strlen(h);
    char *out = malloc(n - f + r + 1);
    memcpy(out, h, a), memcpy(out + a, repl, r), memcpy(out + a + r, at + f, n - a - f + 1);
    return out;
}

/* The value text of field in tensor's entry: "[a,b]" or "\"BF16\"". */
static char *field_of(const char *h, const char *tensor, const char *field)
{
    char key[256];
    snprintf(key, sizeof key, "\"%s\":{", tensor);
    const char *e = strstr(h, key);
    CHECK(e != NULL, "no tensor %s", tensor);
    snprintf(key, sizeof key, "\"%s\":", field);
    const char *v = e ? strstr(e, key) : NULL;
    if (!v) return NULL;
    v += strlen(key);
    const char *end = *v == '[' ? strchr(v, ']') + 1 : strchr(v + 1, '"') + 1;
    char *out = malloc((size_t)(end - v) + 1);
    memcpy(out, v, (size_t)(end - v));
    out[end - v] = '\0';
    return out;
}

/* h with tensor's field set to value. */
static char *set_field(const char *h, const char *tensor, const char *field, const char *value)
{
    char *old = field_of(h, tensor, field), find[512], repl[512];
    if (!old) return NULL;
    snprintf(find, sizeof find, "\"%s\":%s", field, old);
    snprintf(repl, sizeof repl, "\"%s\":%s", field, value);
    char key[256];
    snprintf(key, sizeof key, "\"%s\":{", tensor);
    const char *e = strstr(h, key);
    size_t pre = (size_t)(e - h);
    char *tail = edit(h + pre, find, repl), *out = malloc(pre + strlen(tail) + 1);
    memcpy(out, h, pre), strcpy(out + pre, tail);
    free(tail), free(old);
    return out;
}

static void offsets_of(const char *tensor, unsigned long long *a, unsigned long long *b)
{
    char *v = field_of(hdr, tensor, "data_offsets");
    CHECK(v && sscanf(v, "[%llu,%llu]", a, b) == 2, "offsets of %s", tensor);
    free(v);
}

/* Loads data into F and expects status want, a message with every given
 * substring, and no change of state. */
static void expect_bad_(int line, const void *data, size_t n, opf_status want, const char *const *subs)
{
    fz_blob before = fz_snapshot(F.ctx, F.seq, F.opt);
    opf_status st = opf_checkpoint_load_mem(F.ctx, F.seq, F.opt, data, n, "bad.safetensors");
    const char *msg = opf_last_error(F.ctx);
    CHECK(st == want && opf_test_msg_has(msg, subs), "line %d: %s (want %s): \"%s\"", line,
          opf_status_str(st), opf_status_str(want), msg);
    fz_blob after = fz_snapshot(F.ctx, F.seq, F.opt);
    CHECK(fz_blob_eq(&before, &after), "line %d: a refused load changed the state", line);
    free(before.p), free(after.p);
}
#define EXPECT_BAD(data, n, want, ...) \
    expect_bad_(__LINE__, data, n, want, (const char *const[]){__VA_ARGS__, NULL})

/* A header edit assembled and expected to fail with a corrupt-file message. */
static void bad_header_(int line, char *h, const char *const *subs)
{
    if (!h) return;
    fz_blob b = assemble(h, NULL, 0);
    expect_bad_(line, b.p, b.n, OPF_ERR_CORRUPT, subs);
    free(b.p), free(h);
}
#define BAD_HEADER(h, ...) bad_header_(__LINE__, h, (const char *const[]){__VA_ARGS__, NULL})

static void test_truncated(void)
{
    EXPECT_BAD(good.p, 0, OPF_ERR_CORRUPT, "bad.safetensors", "0 bytes");
    EXPECT_BAD(good.p, 7, OPF_ERR_CORRUPT, "7 bytes", "8-byte header length");
    EXPECT_BAD(good.p, 8, OPF_ERR_CORRUPT, "only 0 bytes follow", "truncated");
    EXPECT_BAD(good.p, 8 + hlen / 2, OPF_ERR_CORRUPT, "header length", "truncated");
    EXPECT_BAD(good.p, 8 + hlen, OPF_ERR_CORRUPT, "data_offsets", "not inside the 0-byte buffer");
    EXPECT_BAD(good.p, good.n - 1, OPF_ERR_CORRUPT, "not inside the", "-byte buffer");
    fz_blob more = assemble(hdr, "\0", 1);
    EXPECT_BAD(more.p, more.n, OPF_ERR_CORRUPT, "1 bytes belong to no tensor");
    free(more.p);
}

static void test_header_length(void)
{
    unsigned char *p = malloc(good.n);
    memcpy(p, good.p, good.n);
    memset(p, 0, 8);
    p[7] = 0x80;  /* 2^63 */
    EXPECT_BAD(p, good.n, OPF_ERR_CORRUPT, "header length 9223372036854775808 outside 2..");
    memset(p, 0, 8);
    p[0] = 1;
    EXPECT_BAD(p, good.n, OPF_ERR_CORRUPT, "header length 1 outside 2..");
    memset(p, 0xFF, 8);
    EXPECT_BAD(p, good.n, OPF_ERR_CORRUPT, "header length 18446744073709551615");
    free(p);
}

static void test_json(void)
{
    BAD_HEADER(edit(hdr, "\"dtype\"", "\"dtype"), "not valid JSON");
    BAD_HEADER(strdup("[1, 2]  "), "not a JSON object");
    BAD_HEADER(strdup("\"x\"     "), "not a JSON object");
    char *h = malloc(strlen(hdr) + 2);
    strcpy(h, hdr), strcat(h, "x");
    BAD_HEADER(h, "data after its JSON");
    BAD_HEADER(edit(hdr, "\"ops.0.ln.weight\":{", "\"ops.0.ln.weight\":5,\"z\":{"),
               "\"ops.0.ln.weight\"", "not an object");
    BAD_HEADER(edit(hdr, "\"ops.0.ln.weight\":{", "\"ops.0.ln.weight\":{\"x\":1,"),
               "\"ops.0.ln.weight\"", "unknown key \"x\"");
    BAD_HEADER(edit(hdr, "\"ops.0.ln.weight\":{\"dtype\":\"BF16\",",
                    "\"ops.0.ln.weight\":{\"dtype\":\"BF16\",\"dtype\":\"BF16\","),
               "repeated key \"dtype\"");
    BAD_HEADER(edit(hdr, "\"ops.0.ln.weight\":{\"dtype\":\"BF16\",", "\"ops.0.ln.weight\":{"),
               "\"ops.0.ln.weight\"", "no \"dtype\"");
}

static void test_entries(void)
{
    const char *w = "ops.1.fc.weight";
    BAD_HEADER(set_field(hdr, w, "dtype", "\"BF17\""), w, "unknown dtype \"BF17\"");
    BAD_HEADER(set_field(hdr, w, "dtype", "7"), w, "unknown dtype (not a string)");
    BAD_HEADER(set_field(hdr, w, "dtype", "\"F32\""), w, "F32 [32,32] needs 4096 bytes", "hold 2048");
    BAD_HEADER(set_field(hdr, w, "shape", "[-1,32]"), w, "shape entry 0");
    BAD_HEADER(set_field(hdr, w, "shape", "[32.5,32]"), w, "shape entry 0");
    BAD_HEADER(set_field(hdr, w, "shape", "[32,\"32\"]"), w, "shape entry 1");
    BAD_HEADER(set_field(hdr, w, "shape", "{}"), w, "shape is not an array");
    BAD_HEADER(set_field(hdr, w, "shape", "[1,1,1,1,1,1,1,32,32]"), w, "9 dims, at most 8");
    BAD_HEADER(set_field(hdr, w, "shape", "[1e300,1e300]"), w, "shape entry 0");
    BAD_HEADER(set_field(hdr, w, "shape", "[4294967296,4294967296]"), w, "needs 18446744073709551615");
    BAD_HEADER(set_field(hdr, w, "data_offsets", "[1]"), w, "data_offsets is not [begin, end]");
    BAD_HEADER(set_field(hdr, w, "data_offsets", "[0,-2]"), w, "data_offsets is not [begin, end]");
    unsigned long long a, b;
    offsets_of(w, &a, &b);
    char v[64];
    snprintf(v, sizeof v, "[%llu,%llu]", b, a);
    BAD_HEADER(set_field(hdr, w, "data_offsets", v), w, "are not inside");
}

static void test_offsets(void)
{
    const char *w = "ops.1.fc.weight";
    unsigned long long a, b;
    offsets_of(w, &a, &b);
    char v[64];
    snprintf(v, sizeof v, "[%llu,%llu]", a - 2, b - 2);  /* into the tensor before it */
    BAD_HEADER(set_field(hdr, w, "data_offsets", v), "tensor \"ops.1.fc.weight\"", "overlaps");
    snprintf(v, sizeof v, "[%zu,%llu]", blen, blen + (b - a));  /* moved past the end */
    BAD_HEADER(set_field(hdr, w, "data_offsets", v), w, "are not inside the");
    /* moved to the end with its bytes appended: a hole where it was */
    char *h = set_field(hdr, w, "data_offsets", v);
    unsigned char *pad = calloc(1, b - a);
    fz_blob f = assemble(h, pad, b - a);
    char gap[96];
    snprintf(gap, sizeof gap, "a gap of %llu bytes at offset %llu", b - a, a);
    EXPECT_BAD(f.p, f.n, OPF_ERR_CORRUPT, gap);
    free(f.p), free(h), free(pad);
}

/* Entries added at the end of the buffer, with their bytes. */
static void bad_extra_(int line, const char *entry, size_t nbytes, const char *const *subs)
{
    char ins[256];
    snprintf(ins, sizeof ins, "{%s,", entry);
    char *h = edit(hdr, "{", ins);
    unsigned char *pad = calloc(1, nbytes + 1);
    fz_blob f = assemble(h, pad, nbytes);
    expect_bad_(line, f.p, f.n, OPF_ERR_CORRUPT, subs);
    free(f.p), free(h), free(pad);
}
#define BAD_EXTRA(entry, n, ...) bad_extra_(__LINE__, entry, n, (const char *const[]){__VA_ARGS__, NULL})

static void test_names(void)
{
    BAD_HEADER(set_field(hdr, "ctx.rng", "dtype", "\"I64\""), "tensor \"ctx.rng\" is I64 [2], the seq "
               "expects U64 [2]");
    BAD_HEADER(set_field(hdr, "ops.1.fc.weight", "dtype", "\"F16\""),
               "\"ops.1.fc.weight\" is F16 [32,32], the seq expects BF16 [32,32]");
    BAD_HEADER(set_field(hdr, "ops.1.fc.weight", "shape", "[16,64]"),
               "\"ops.1.fc.weight\" is BF16 [16,64], the seq expects BF16 [32,32]");
    BAD_HEADER(set_field(hdr, "ops.1.fc.recipe.fwd.amax_history", "shape", "[3,2]"),
               "amax_history\" is F32 [3,2], the seq expects F32 [2,3]");
    BAD_HEADER(edit(hdr, "\"ops.0.ln.weight\"", "\"ops.0.ln.weightX\""),
               "tensor \"ops.0.ln.weight\" is missing");
    BAD_HEADER(edit(hdr, "\"ctx.rng\"", "\"ctx.rn\""), "tensor \"ctx.rng\" is missing");
    char e[160];
    snprintf(e, sizeof e, "\"extra\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[%zu,%zu]}", blen,
             blen + 4);
    BAD_EXTRA(e, 4, "unknown tensor \"extra\"");
    snprintf(e, sizeof e, "\"ctx.rng\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[%zu,%zu]}", blen,
             blen + 4);
    BAD_EXTRA(e, 4, "tensor \"ctx.rng\" appears twice");
}

static void test_metadata(void)
{
    BAD_HEADER(edit(hdr, "\"format\":\"opfuse-checkpoint\"", "\"format\":\"other\""),
               "metadata \"format\" is \"other\", expected \"opfuse-checkpoint\"");
    BAD_HEADER(edit(hdr, "\"format\":", "\"formax\":"), "metadata \"format\" is missing");
    BAD_HEADER(edit(hdr, "\"version\":\"2\"", "\"version\":\"3\""), "metadata \"version\" is \"3\"");
    BAD_HEADER(edit(hdr, "\"version\":\"2\"", "\"version\":1"), "metadata \"version\" is not a string");
    BAD_HEADER(edit(hdr, "\"version\":\"2\"", "\"version\":\"2\",\"version\":\"2\""),
               "metadata \"version\" appears twice");
    BAD_HEADER(edit(hdr, "\"__metadata__\":{", "\"__metadata__\":7,\"__metadata__\":{"),
               "\"__metadata__\" is not an object");
    BAD_HEADER(edit(hdr, "\"__metadata__\":{", "\"__metadata__\":{},\"__metadata__\":{"),
               "\"__metadata__\" appears twice");
    BAD_HEADER(edit(hdr, "\"__metadata__\":{", "\"__metadata__\":{\"zzz\":\"1\","),
               "unknown metadata \"zzz\"");
    BAD_HEADER(edit(hdr, "\"ops\":\"4\"", "\"ops\":\"5\""), "holds \"5\" ops, the seq has 4");
    BAD_HEADER(edit(hdr, "\"ops\":\"4\"", "\"ops\":\"+4\""), "holds \"+4\" ops");
    BAD_HEADER(edit(hdr, "\"ops.3.class\":\"gelu\"", "\"ops.3.class\":\"relu\""),
               "op 3 is a \"relu\" in the checkpoint, the seq's op \"act\" is a \"gelu\"");
    BAD_HEADER(edit(hdr, "\"ops.3.name\":\"act\"", "\"ops.3.name\":\"ac2\""),
               "op 3 is called \"ac2\" in the checkpoint, \"act\" in the seq");
    BAD_HEADER(edit(hdr, "\"ops.2.class\"", "\"ops.2.klass\""), "metadata \"ops.2.class\" is missing");
    BAD_HEADER(edit(hdr, "history=2", "history=3"), "op 1 \"fc\" was saved with recipe",
               "history=3", "opf_checkpoint_prepare");
    BAD_HEADER(edit(hdr, "qdtype=e4m3", "qdtype=e2m1"), "metadata \"ops.1.fc.weight.q\"",
               "not a quantized spec");
    BAD_HEADER(edit(hdr, "usage=3", "usage=0"), "not a quantized spec");
    BAD_HEADER(edit(hdr, "flags=0", "flags=8"), "not a quantized spec");
    BAD_HEADER(edit(hdr, "usage=3", "usage=3 "), "not a quantized spec");
    BAD_HEADER(edit(hdr, "usage=3", "usage=1"), "unknown tensor \"ops.1.fc.weight.q.col_data\"");
    BAD_HEADER(edit(hdr, "\"ops.1.fc.weight.q\"", "\"ops.1.fc.weight.Q\""),
               "unknown tensor \"ops.1.fc.weight.q.");
    BAD_HEADER(edit(hdr, "\"optim.kind\":\"adamw\"", "\"optim.kind\":\"sgd\""),
               "optimizer \"sgd\" in the checkpoint, \"adamw\" given");
    BAD_HEADER(edit(hdr, "\"optim.step\":\"", "\"optim.step\":\"-"), "\"optim.step\" is \"-",
               "not a step count");
    BAD_HEADER(edit(hdr, "\"optim.step\":", "\"optim.steps\":"), "\"optim.step\" is missing");
}

/* Seqs that do not match the file. */
static void test_mismatch(void)
{
    fz_fixture m;
    CHECK_OK(F.ctx, fz_fixture_init(&m, F.ctx, OPF_RECIPE_MXFP8));
    fz_blob before = fz_snapshot(m.ctx, m.seq, m.opt);
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, m.seq, m.opt, good_path), OPF_ERR_CORRUPT,
                good_path, "op 1 \"fc\" was saved with recipe \"fp8-delayed", "\"mxfp8 format=e4m3");
    fz_blob after = fz_snapshot(m.ctx, m.seq, m.opt);
    CHECK(fz_blob_eq(&before, &after), "a refused load changed the mxfp8 model");
    free(before.p), free(after.p);
    /* no recipe state at all: never ran, never prepared */
    fz_fixture_fini(&m);
    CHECK_OK(F.ctx, fz_fixture_init(&m, F.ctx, OPF_RECIPE_NONE));
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, m.seq, m.opt, good_path), OPF_ERR_CORRUPT,
                "the seq's op has \"none\"");
    /* a different model: one op more */
    opf_op *op;
    CHECK_OK(F.ctx, opf_op_create(F.ctx, "identity", NULL, "id", &op));
    opf_optim_destroy(m.opt);  /* an optimizer freezes its seq */
    CHECK_OK(F.ctx, opf_seq_append(m.seq, op));
    CHECK_OK(F.ctx, opf_optim_create(F.ctx, m.seq, OPF_OPTIM_ADAMW, NULL, &m.opt));
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, m.seq, NULL, good_path), OPF_ERR_CORRUPT,
                "holds \"4\" ops, the seq has 5");
    /* an optimizer of another seq */
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, F.seq, m.opt, good_path), OPF_ERR_INVALID_ARG,
                "optimizer slot 0", "not in this seq");
    CHECK_FAILS(F.ctx, opf_checkpoint_save(F.ctx, F.seq, m.opt, good_path), OPF_ERR_INVALID_ARG,
                "optimizer slot 0", "not in this seq");
    fz_fixture_fini(&m);
}

static void test_args(void)
{
    CHECK_FAILS(NULL, opf_checkpoint_load_mem(NULL, F.seq, F.opt, good.p, good.n, NULL),
                OPF_ERR_INVALID_ARG, "ctx is NULL");
    CHECK_FAILS(F.ctx, opf_checkpoint_load_mem(F.ctx, NULL, F.opt, good.p, good.n, NULL),
                OPF_ERR_INVALID_ARG, "seq is NULL");
    CHECK_FAILS(F.ctx, opf_checkpoint_load_mem(F.ctx, F.seq, F.opt, NULL, 5, NULL),
                OPF_ERR_INVALID_ARG, "data is NULL");
    CHECK_FAILS(F.ctx, opf_checkpoint_load_mem(F.ctx, F.seq, F.opt, NULL, 0, NULL), OPF_ERR_CORRUPT,
                "\"<memory>\"", "0 bytes");
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, F.seq, F.opt, NULL), OPF_ERR_INVALID_ARG,
                "path is NULL");
    CHECK_FAILS(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, NULL), OPF_ERR_INVALID_ARG,
                "path is NULL");
    CHECK_FAILS(NULL, opf_checkpoint_save(NULL, F.seq, F.opt, good_path), OPF_ERR_INVALID_ARG,
                "ctx is NULL");
    CHECK_FAILS(F.ctx, opf_checkpoint_prepare(F.ctx, NULL, NULL), OPF_ERR_INVALID_ARG, "seq is NULL");
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    r.amax_history_len = 0;
    CHECK_FAILS(F.ctx, opf_checkpoint_prepare(F.ctx, F.seq, &r), OPF_ERR_INVALID_ARG,
                "opf_checkpoint_prepare");
    char missing[160];
    snprintf(missing, sizeof missing, "%s/none.safetensors", dir);
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, F.seq, F.opt, missing), OPF_ERR_IO, missing,
                "No such file or directory");
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, F.seq, F.opt, dir), OPF_ERR_IO, dir,
                "not a regular file");
}

/* Between a forward and its backward the seq is mid-step. */
static void test_pending(void)
{
    uint16_t xb[FZ_T * FZ_H] = {0};
    opf_tensor x, y;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {FZ_T, FZ_H}, .dtype = OPF_BF16}, xb, &x);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &F.recipe;
    CHECK_OK(F.ctx, opf_seq_forward(F.seq, &x, &call, &y, NULL));
    opf_tensor_release(&y);
    fz_blob mid = fz_snapshot(F.ctx, F.seq, F.opt);
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, F.seq, F.opt, good_path), OPF_ERR_STATE,
                "backward is pending");
    CHECK_FAILS(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, good_path), OPF_ERR_STATE,
                "backward is pending");
    CHECK_FAILS(F.ctx, opf_checkpoint_prepare(F.ctx, F.seq, &F.recipe), OPF_ERR_STATE,
                "backward is pending");
    fz_blob after = fz_snapshot(F.ctx, F.seq, F.opt);
    CHECK(fz_blob_eq(&mid, &after), "a refused call mid-step changed the state");
    opf_seq_discard(F.seq);
    free(mid.p), free(after.p);
}

/* Loads that work: weights only (optimizer skipped or absent). */
static void test_weights_only(void)
{
    CHECK_OK(F.ctx, opf_checkpoint_load(F.ctx, F.seq, NULL, good_path));
    int64_t steps = opf_optim_step_count(F.opt);
    CHECK(steps == 2, "a weights-only load kept the optimizer (step %lld)", (long long)steps);
    CHECK_FAILS(F.ctx, opf_checkpoint_load(F.ctx, F.seq, F.opt, wonly_path), OPF_ERR_CORRUPT,
                "holds no optimizer state", "opt = NULL");
    CHECK_OK(F.ctx, opf_checkpoint_load(F.ctx, F.seq, NULL, wonly_path));
    CHECK_OK(F.ctx, opf_checkpoint_load(F.ctx, F.seq, F.opt, good_path));
    CHECK(opf_optim_step_count(F.opt) == 1, "the full load restored the step count");
    opf_param *w = opf_op_param(opf_seq_at(F.seq, 1), 0);
    CHECK(w->qvalue_valid, "the cached weight came back valid");
    CHECK_OK(F.ctx, fz_step(&F, false));  /* away from the file's state again */
}

static int count_tmp(const char *d)
{
    DIR *dp = opendir(d);
    int n = 0;
    for (struct dirent *e; dp && (e = readdir(dp));) n += strstr(e->d_name, ".tmp.") != NULL;
    if (dp) closedir(dp);
    return n;
}

static void test_atomic(void)
{
    char path[160], nodir[160];
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/c.safetensors", dir);
    CHECK_FAILS(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, nodir), OPF_ERR_IO, nodir,
                "No such file or directory");
    CHECK(count_tmp(dir) == 0, "a temporary file was left behind");
    /* replacing a file keeps its permission bits; the new bytes are whole */
    snprintf(path, sizeof path, "%s/replace.safetensors", dir);
    CHECK_OK(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, path));
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && (sb.st_mode & 0777) == 0644, "a new file is 0644");
    chmod(path, 0640);
    CHECK_OK(F.ctx, fz_step(&F, false));
    CHECK_OK(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, path));
    CHECK(stat(path, &sb) == 0 && (sb.st_mode & 0777) == 0640, "the replaced file kept 0640");
    char path2[160];
    snprintf(path2, sizeof path2, "%s/fresh.safetensors", dir);
    CHECK_OK(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, path2));
    fz_blob a = fz_read_file(path), b = fz_read_file(path2);
    CHECK(a.n > 0 && fz_blob_eq(&a, &b), "the replaced file holds exactly the new checkpoint");
    free(b.p);
    CHECK(count_tmp(dir) == 0, "a temporary file was left behind");
    /* a write that fails half way (file size limit): the old file stays */
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = 4096;
    signal(SIGXFSZ, SIG_IGN);
    CHECK_OK(F.ctx, fz_step(&F, false));
    if (setrlimit(RLIMIT_FSIZE, &lim) == 0) {
        CHECK_FAILS(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, path), OPF_ERR_IO, path,
                    "File too large");
        setrlimit(RLIMIT_FSIZE, &old);
        b = fz_read_file(path);
        CHECK(fz_blob_eq(&a, &b), "a failed save changed the old checkpoint");
        CHECK(count_tmp(dir) == 0, "a failed save left its temporary file");
        free(b.p);
    }
    free(a.p);
    /* the target is a directory: the rename fails, the temporary goes */
    char sub[160];
    snprintf(sub, sizeof sub, "%s/adir", dir);
    mkdir(sub, 0755);
    CHECK_FAILS(F.ctx, opf_checkpoint_save(F.ctx, F.seq, F.opt, sub), OPF_ERR_IO, sub,
                "cannot rename");
    CHECK(count_tmp(dir) == 0, "a failed rename left its temporary file");
    rmdir(sub);
    unlink(path), unlink(path2);
}

/* The committed fuzz seeds: every one goes through the loader cleanly, and
 * the valid checkpoints load. */
static void test_corpus(void)
{
    char root[512], cdir[600];
    snprintf(root, sizeof root, "%s", __FILE__);
    char *cut = strstr(root, "tests/io/test_checkpoint_bad.c");
    CHECK(cut != NULL, "cannot find the source tree from %s", __FILE__);
    if (!cut) return;
    *cut = '\0';
    snprintf(cdir, sizeof cdir, "%sfuzz/corpus", root);
    DIR *dp = opendir(cdir);
    CHECK(dp != NULL, "no corpus at %s", cdir);
    int files = 0;
    for (struct dirent *e; dp && (e = readdir(dp));) {
        if (e->d_name[0] == '.') continue;
        char p[1200];
        snprintf(p, sizeof p, "%s/%s", cdir, e->d_name);
        fz_blob b = fz_read_file(p);
        int ok = fz_run_input(F.ctx, b.p, b.n);
        bool valid = strstr(e->d_name, ".safetensors") != NULL;
        CHECK(!valid || ok >= 1, "corpus file %s does not load (%d loads worked)", e->d_name, ok);
        free(b.p);
        files++;
    }
    if (dp) closedir(dp);
    CHECK(files >= 6, "only %d corpus files", files);
}

static void setup(opf_ctx *ctx)
{
    snprintf(dir, sizeof dir, "/tmp/opf_ckbad_XXXXXX");
    if (!mkdtemp(dir)) abort();
    snprintf(good_path, sizeof good_path, "%s/good.safetensors", dir);
    snprintf(wonly_path, sizeof wonly_path, "%s/weights.safetensors", dir);
    CHECK_OK(ctx, fz_fixture_init(&F, ctx, OPF_RECIPE_DELAYED));
    CHECK_OK(ctx, fz_step(&F, false));
    CHECK_OK(ctx, fz_step(&F, true));  /* cached quantized weight in the file */
    CHECK_OK(ctx, opf_checkpoint_save(ctx, F.seq, F.opt, good_path));
    CHECK_OK(ctx, opf_checkpoint_save(ctx, F.seq, NULL, wonly_path));
    CHECK_OK(ctx, fz_step(&F, false));  /* the state now differs from the file */
    good = fz_read_file(good_path);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | good.p[i];
    hlen = (size_t)n;
    hdr = malloc(n + 1);
    memcpy(hdr, good.p + 8, n);
    hdr[n] = '\0';
    while (n && hdr[n - 1] == ' ') hdr[--n] = '\0';  /* the padding: edits re-measure */
    body = good.p + 8 + hlen;
    blen = good.n - 8 - hlen;
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    setup(ctx);
    test_truncated();
    test_header_length();
    test_json();
    test_entries();
    test_offsets();
    test_names();
    test_metadata();
    test_mismatch();
    test_args();
    test_pending();
    test_weights_only();
    test_atomic();
    test_corpus();
    fz_fixture_fini(&F);
    unlink(good_path), unlink(wonly_path);
    rmdir(dir);
    free(good.p), free(hdr);
    TEST_DONE();
}
