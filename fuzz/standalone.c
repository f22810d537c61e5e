/* standalone.c: a main() for a fuzz target where libFuzzer is missing (gcc,
 * or clang without its runtime). It feeds LLVMFuzzerTestOneInput every file
 * named (a directory: its files), then N pseudo-random inputs: random bytes,
 * or a corpus file with a few bytes changed or cut short. No coverage
 * feedback; the point is a short, reproducible run under the sanitizers in
 * every build (ctest label fuzz). An input that aborts (or that a sanitizer
 * reports) is written to ./standalone-crash: run it again by naming it.
 *   fuzz_X_standalone [-runs=N] [-seed=S] [-max_len=L] [FILE|DIR]... */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* In sanitizer runtimes: called before a report ends the process. */
void __sanitizer_set_death_callback(void (*cb)(void)) __attribute__((weak));

/* The input being run, saved by the crash handlers (async-signal-safe). */
static const uint8_t *cur_p;
static size_t cur_n;

static void fs_save_current(void)
{
    int fd = open("standalone-crash", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    for (size_t off = 0; off < cur_n;) {
        ssize_t k = write(fd, cur_p + off, cur_n - off);
        if (k <= 0) break;
        off += (size_t)k;
    }
    close(fd);
    static const char msg[] = "standalone: the failing input is in ./standalone-crash\n";
    if (write(2, msg, sizeof msg - 1) < 0) return;
}

static void fs_on_abort(int sig)
{
    fs_save_current();
    signal(sig, SIG_DFL);
    raise(sig);
}

typedef struct fs_file {
    uint8_t *p;
    size_t   n;
} fs_file;

static fs_file *files;
static int n_files;

static void fs_add_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return;
    fs_file b = {NULL, 0};
    uint8_t chunk[4096];
    size_t k;
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (!(b.p = realloc(b.p, b.n + k))) abort();
        memcpy(b.p + b.n, chunk, k), b.n += k;
    }
    fclose(f);
    if (!(files = realloc(files, sizeof *files * (size_t)(n_files + 1)))) abort();
    files[n_files++] = b;
}

static void fs_add(const char *path)
{
    struct stat st;
    if (stat(path, &st)) {
        fprintf(stderr, "standalone: %s: not found\n", path);
        exit(2);
    }
    if (!S_ISDIR(st.st_mode)) return fs_add_file(path);
    DIR *d = opendir(path);
    struct dirent *e;
    char buf[4096];
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.' && snprintf(buf, sizeof buf, "%s/%s", path, e->d_name) < (int)sizeof buf)
            fs_add_file(buf);
    if (d) closedir(d);
}

/* xorshift64*: the same inputs for the same seed on every machine. */
static uint64_t fs_state;
static uint64_t fs_rand(void)
{
    fs_state ^= fs_state >> 12, fs_state ^= fs_state << 25, fs_state ^= fs_state >> 27;
    return fs_state * 0x2545F4914F6CDD1DULL;
}

static void fs_run(const uint8_t *p, size_t n)
{
    /* A private copy, so that a read past the end is caught by ASan. */
    uint8_t *c = malloc(n ? n : 1);
    if (!c) abort();
    if (n) memcpy(c, p, n);
    cur_p = c, cur_n = n;
    LLVMFuzzerTestOneInput(c, n);
    free(c);
}

int main(int argc, char **argv)
{
    long runs = 1000, max_len = 512;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "-runs=", 6)) runs = atol(argv[i] + 6);
        else if (!strncmp(argv[i], "-seed=", 6)) seed = strtoull(argv[i] + 6, NULL, 10);
        else if (!strncmp(argv[i], "-max_len=", 9)) max_len = atol(argv[i] + 9);
        else fs_add(argv[i]);
    }
    signal(SIGABRT, fs_on_abort);
    signal(SIGSEGV, fs_on_abort);
    if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(fs_save_current);
    fs_state = seed * 0x9E3779B97F4A7C15ULL + 1;
    if (max_len < 1) max_len = 1;
    clock_t t0 = clock();
    for (int i = 0; i < n_files; i++) fs_run(files[i].p, files[i].n);
    uint8_t *buf = malloc((size_t)max_len);
    if (!buf) abort();
    for (long r = 0; r < runs; r++) {
        uint64_t how = fs_rand();
        if (n_files && (how & 1)) {
            /* A corpus file with up to 8 bytes changed, maybe cut short. */
            const fs_file *f = &files[(how >> 8) % (uint64_t)n_files];
            uint8_t *c = malloc(f->n ? f->n : 1);
            if (!c) abort();
            if (f->n) memcpy(c, f->p, f->n);
            size_t n = f->n;
            for (int k = (int)((how >> 1) & 7); k >= 0 && n; k--) c[fs_rand() % n] = (uint8_t)fs_rand();
            if ((how >> 4) % 4 == 0 && n) n = fs_rand() % n;
            fs_run(c, n);
            free(c);
        } else {
            size_t n = (size_t)(fs_rand() % (uint64_t)max_len);
            for (size_t k = 0; k < n; k++) buf[k] = (uint8_t)fs_rand();
            fs_run(buf, n);
        }
    }
    printf("standalone: %d files and %ld generated inputs in %.1f s CPU, no failure\n", n_files, runs,
           (double)(clock() - t0) / CLOCKS_PER_SEC);
    free(buf);
    for (int i = 0; i < n_files; i++) free(files[i].p);
    free(files);
    return 0;
}
