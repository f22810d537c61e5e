/* data.c: the addition task and memory-mapped text files of data.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data.h"

/* A 64-bit mix of (seed, split, index, k): every draw is a pure function of
 * where it is used, so a resumed run sees the same rows. */
static uint64_t mix(uint64_t seed, uint64_t split, uint64_t index, uint64_t k)
{
    uint64_t z = seed * 0x9E3779B97F4A7C15ull ^ (split + 1) * 0xC2B2AE3D27D4EB4Full ^
                 index * 0x165667B19E3779F9ull ^ k * 0xD6E8FEB86659FD93ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void opf_data_addition(int digits, opf_data *d)
{
    memset(d, 0, sizeof *d);
    d->addition = true;
    d->digits = digits;
    d->vocab = OPF_ADD_VOCAB;
    int64_t len = 3 * digits + 3;     /* the whole text, so a decoded answer fits a row */
    d->T = (len + 7) / 8 * 8;         /* rows padded to a multiple of 8 tokens */
}

void opf_data_random(int64_t vocab, int64_t T, opf_data *d)
{
    memset(d, 0, sizeof *d);
    d->random = true;
    d->vocab = vocab;
    d->T = T;
}

int opf_data_prompt_len(const opf_data *d) { return 2 * d->digits + 2; }
int opf_data_answer_len(const opf_data *d) { return d->digits + 1; }

char opf_data_char(const opf_data *d, int32_t tok)
{
    if (!d->addition) return (char)tok;
    return tok < 10 ? (char)('0' + tok) : tok == OPF_ADD_PLUS ? '+' : tok == OPF_ADD_EQ ? '=' : ' ';
}

/* Writes the digits of v, most significant first, as n tokens. */
static void put_number(int32_t *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--, v /= 10) p[i] = (int32_t)(v % 10);
}

static void addition_row(const opf_data *d, uint64_t seed, int split, int64_t index, int32_t *tok,
                         int32_t *tgt)
{
    int D = d->digits;
    uint64_t lim = 1;
    for (int i = 0; i < D; i++) lim *= 10;
    uint64_t a = mix(seed, (uint64_t)split, (uint64_t)index, 0) % lim;
    uint64_t b = mix(seed, (uint64_t)split, (uint64_t)index, 1) % lim;
    int32_t text[32];
    put_number(text, a, D);
    text[D] = OPF_ADD_PLUS;
    put_number(text + D + 1, b, D);
    text[2 * D + 1] = OPF_ADD_EQ;
    put_number(text + 2 * D + 2, a + b, D + 1);
    int len = 3 * D + 3, first = opf_data_prompt_len(d) - 1;
    for (int64_t t = 0; t < d->T; t++) {
        tok[t] = t < len - 1 ? text[t] : OPF_ADD_PAD;
        tgt[t] = t >= first && t < len - 1 ? text[t + 1] : -1;
    }
}

static void file_row(const opf_data *d, uint64_t seed, int split, int64_t index, int32_t *tok,
                     int32_t *tgt)
{
    size_t lo = split ? d->n_train : 0, hi = split ? d->n : d->n_train;
    size_t span = hi - lo - (size_t)d->T;  /* >= 1 by opf_data_open */
    size_t start = lo + (size_t)(mix(seed, (uint64_t)split, (uint64_t)index, 2) % span);
    for (int64_t t = 0; t < d->T; t++) {
        tok[t] = d->bytes[start + (size_t)t];
        tgt[t] = d->bytes[start + (size_t)t + 1];
    }
}

/* Token t + 1 of the row is token t's target, as in a text. */
static void random_row(const opf_data *d, uint64_t seed, int split, int64_t index, int32_t *tok,
                       int32_t *tgt)
{
    uint64_t v = (uint64_t)d->vocab;
    for (int64_t t = 0; t <= d->T; t++) {
        int32_t x = (int32_t)(mix(seed, (uint64_t)split, (uint64_t)index, 3 + (uint64_t)t) % v);
        if (t < d->T) tok[t] = x;
        if (t > 0) tgt[t - 1] = x;
    }
}

void opf_data_batch(const opf_data *d, uint64_t seed, int split, int64_t index, int64_t B,
                    int32_t *tok, int32_t *tgt)
{
    for (int64_t r = 0; r < B; r++) {
        int64_t row = index * B + r;
        if (d->addition) addition_row(d, seed, split, row, tok + r * d->T, tgt + r * d->T);
        else if (d->random) random_row(d, seed, split, row, tok + r * d->T, tgt + r * d->T);
        else file_row(d, seed, split, row, tok + r * d->T, tgt + r * d->T);
    }
}

bool opf_data_open(const char *path, int64_t T, opf_data *d, char *msg, size_t size)
{
    memset(d, 0, sizeof *d);
    int fd = open(path, O_RDONLY);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb)) {
        snprintf(msg, size, "cannot read %s: %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        return false;
    }
    size_t n = (size_t)sb.st_size, need = 2 * (size_t)(T + 1) * 10;
    if (n == 0) {
        snprintf(msg, size, "%s is empty", path);
        close(fd);
        return false;
    }
    if (n < need) {
        snprintf(msg, size, "%s has %zu bytes; rows of %lld tokens need at least %zu (10%% of "
                 "them are held out)", path, n, (long long)T, need);
        close(fd);
        return false;
    }
    void *p = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(msg, size, "cannot map %s: %s", path, strerror(errno));
        return false;
    }
    d->bytes = p;
    d->n = n;
    d->n_train = n - n / 10;
    d->T = T;
    d->vocab = 256;
    return true;
}

void opf_data_close(opf_data *d)
{
    if (d->bytes) munmap((void *)d->bytes, d->n);
    memset(d, 0, sizeof *d);
}
