/* test_layers.c: the layering rules of docs/architecture.md, read from the
 * source tree (found from this file's path; the sources are not compiled
 * into the test).
 *
 *  1. No `#pragma omp` in src/op, src/ops, src/fuser, src/compile: the math
 *     runs behind the backend table (src/backend/).
 *  2. No per-element loop there either. A loop is per-element when
 *     - its induction variable is 64-bit (int64_t, size_t, uint64_t,
 *       ptrdiff_t): element, row and column counts are int64_t in opfuse
 *       (opf_spec.shape, opf_spec_numel), while the small counts an op may
 *       loop over (parameters, slots, components, groups) are int; or
 *     - its condition is bounded by a tensor size (numel, rows, cols, a
 *       shape[] entry, nbytes); or
 *     - its header or first body line reads a tensor's memory through a
 *       data pointer (`data[c])[i]`).
 *  3. src/backend includes no header of src/quant, src/op, src/ops,
 *     src/fuser, src/compile or src/io.
 *  4. No layer includes a private header of a higher layer; the order is
 *     core < backend < quant < op < ops < fuser < compile < io.
 *  5. A resolve (resolve_fwd / resolve_bwd) in src/ops runs no fake: the
 *     runner (op/run.c) runs each fake once per call, after the resolve.
 *
 * Comments and string literals are blanked before matching. A justified
 * exception is a row of `allowed` below, with its reason. */
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_bad, n_files;

typedef struct allowed {
    const char *file;  /* path suffix */
    const char *text;  /* a substring of the offending line */
    const char *why;
} allowed;
static const allowed allowed_rows[] = {
    {"src/compile/exec.c", "for (int64_t a = 128; a >= 1 && st; a /= 2)",
     "eight alignment candidates for the leading size's probe, not tensor elements"},
    {"src/compile/trace.c", "for (size_t off = 0; off + sizeof(void *) <= s->size;",
     "scans an args struct (at most OPF_OP_ARGS_MAX bytes) for tagged pointers, host memory "
     "that is no tensor"},
    {"src/ops/basic/grouped_linear.c", "rows[g] = ((const int64_t *)s->data[OPF_COMP_DATA])[g];",
     "the split sizes (at most 64 host values) become values of the args in resolve, as the "
     "anchor's split-quantize path reads them on the host"},
    {"src/ops/fused/grouped_mlp.c", "c->forward_fake(p->fwd_args, outs, aux)",
     "resolve chains its parts: part k+1's resolve needs part k's output spec, which only "
     "part k's fake gives"},
    {"src/ops/fused/grouped_mlp.c", "c->backward_fake(p->bwd_args, g)",
     "resolve chains its parts backward: part k-1's dy spec is part k's dx spec"},
};

/* line, or the line after it (the body of a loop header), is a row of allowed. */
static bool is_allowed(const char *path, const char *line, const char *next)
{
    for (size_t i = 0; i < sizeof allowed_rows / sizeof allowed_rows[0]; i++) {
        size_t lp = strlen(path), lf = strlen(allowed_rows[i].file);
        if (lp >= lf && !strcmp(path + lp - lf, allowed_rows[i].file) &&
            (strstr(line, allowed_rows[i].text) || (next && strstr(next, allowed_rows[i].text))))
            return true;
    }
    return false;
}

static void offend(const char *path, int line_no, const char *rule, const char *line)
{
    while (*line == ' ') line++;
    fprintf(stderr, "%s:%d: %s: %s\n", path, line_no, rule, line);
    n_bad++;
}

/* The file with comments and string literals blanked (newlines kept). */
static char *read_code(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (!s || fread(s, 1, (size_t)n, f) != (size_t)n) n = 0;
    fclose(f);
    if (!s) return NULL;
    s[n] = 0;
    enum { CODE, BLOCK, LINE, STR, CHR } st = CODE;
    for (long i = 0; i < n; i++) {
        char c = s[i], d = i + 1 < n ? s[i + 1] : 0;
        bool keep = c == '\n';
        if (st == CODE) {
            if (c == '/' && d == '*') st = BLOCK, s[i] = s[i + 1] = ' ', i++;
            else if (c == '/' && d == '/') st = LINE, s[i] = ' ';
            else if (c == '"') st = STR;
            else if (c == '\'') st = CHR;
            continue;
        }
        if (st == BLOCK && c == '*' && d == '/') {
            s[i] = s[i + 1] = ' ', i++, st = CODE;
            continue;
        }
        if (st == LINE && c == '\n') st = CODE;
        if ((st == STR || st == CHR) && c == '\\') {
            s[i] = ' ';
            if (i + 1 < n && s[i + 1] != '\n') s[++i] = ' ';
            continue;
        }
        if ((st == STR && c == '"') || (st == CHR && c == '\'')) {
            st = CODE;
            continue;
        }
        if (!keep) s[i] = ' ';
    }
    return s;
}

static const char *const layers[] = {"core", "backend", "quant", "op", "ops", "fuser", "compile",
                                     "io"};
enum { N_LAYERS = sizeof layers / sizeof layers[0] };

static int layer_of(const char *name, size_t len)
{
    for (int i = 0; i < N_LAYERS; i++)
        if (strlen(layers[i]) == len && !strncmp(layers[i], name, len)) return i;
    return -1;
}

/* Rules 3 and 4 for one line: an include of "<layer>/..." above `mine`. */
static void check_include(const char *path, int no, const char *line, int mine)
{
    const char *p = strstr(line, "#include \"");
    if (!p) return;
    p += strlen("#include \"");
    const char *slash = strchr(p, '/');
    int theirs = slash ? layer_of(p, (size_t)(slash - p)) : -1;
    if (theirs > mine)
        offend(path, no, mine == 1 ? "the backend includes a higher layer's header"
                                   : "a lower layer includes a higher layer's private header", line);
}

static bool has_any(const char *s, const char *const *subs)
{
    for (; *subs; subs++)
        if (strstr(s, *subs)) return true;
    return false;
}

/* Rule 2 for a `for` header starting at line (and its next line). */
static bool per_element(const char *line, const char *next)
{
    static const char *const wide[] = {"for (int64_t ", "for (size_t ", "for (uint64_t ",
                                       "for (ptrdiff_t ", NULL};
    static const char *const sizes[] = {"numel", "rows", "cols", "shape[", "nbytes", NULL};
    if (has_any(line, wide)) return true;
    const char *c1 = strchr(strstr(line, "for ("), ';'), *c2 = c1 ? strchr(c1 + 1, ';') : NULL;
    if (c1 && c2) {
        char cond[256];
        size_t n = (size_t)(c2 - c1) < sizeof cond ? (size_t)(c2 - c1) : sizeof cond - 1;
        memcpy(cond, c1, n);
        cond[n] = 0;
        if (has_any(cond, sizes)) return true;
    }
    const char *d = strstr(line, "data[");
    if (!d && next) d = strstr(next, "data[");
    return d && strstr(d, "])[");
}

/* Rule 5: a resolve's definition begins with a line that names it in
 * column 0; its body opens with a brace in column 0 (a `;` first: a
 * declaration) and ends at the next closing brace there. */
static bool names_resolve(const char *line)
{
    return (strstr(line, "resolve_fwd(opf_op *op") || strstr(line, "resolve_bwd(opf_op *op")) &&
           line[0] != ' ';
}

static void check_file(const char *path, int layer, bool no_math, bool is_ops)
{
    char *code = read_code(path);
    if (!code) {
        offend(path, 0, "unreadable", "");
        return;
    }
    n_files++;
    bool in_resolve = false, named = false;
    int no = 0;
    for (char *line = code; line; no++) {
        char *end = strchr(line, '\n'), *next = end ? end + 1 : NULL;
        if (end) *end = 0;
        char *nend = next ? strchr(next, '\n') : NULL;
        if (nend) *nend = 0;
        if (!is_allowed(path, line, next)) {
            check_include(path, no + 1, line, layer);
            if (no_math && strstr(line, "#pragma omp")) offend(path, no + 1, "OpenMP", line);
            if (no_math && strstr(line, "for (") && per_element(line, next))
                offend(path, no + 1, "per-element loop", line);
            if (is_ops && in_resolve && strstr(line, "_fake("))
                offend(path, no + 1, "a resolve runs a fake", line);
        }
        if (is_ops && names_resolve(line)) named = true;
        if (named && strchr(line, ';')) named = false;
        if (named && line[0] == '{') in_resolve = true, named = false;
        if (line[0] == '}') in_resolve = false;
        if (nend) *nend = '\n';
        line = next;
    }
    free(code);
}

static bool is_source(const char *name)
{
    size_t n = strlen(name);
    return n > 2 && name[n - 2] == '.' && (name[n - 1] == 'c' || name[n - 1] == 'h');
}

static void walk(const char *dir, int layer, bool no_math, bool is_ops)
{
    DIR *d = opendir(dir);
    if (!d) {
        offend(dir, 0, "missing directory", "");
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        DIR *sub = opendir(path);
        if (sub) {
            closedir(sub);
            walk(path, layer, no_math, is_ops);
        } else if (is_source(e->d_name)) {
            check_file(path, layer, no_math, is_ops);
        }
    }
    closedir(d);
}

int main(void)
{
    /* this file is <root>/tests/lint/test_layers.c */
    char root[1024];
    snprintf(root, sizeof root, "%s", __FILE__);
    for (int up = 0; up < 3; up++) {
        char *s = strrchr(root, '/');
        if (!s) {
            fprintf(stderr, "cannot find the source tree from %s\n", __FILE__);
            return 1;
        }
        *s = 0;
    }
    for (int i = 0; i < N_LAYERS; i++) {
        char dir[1100];
        snprintf(dir, sizeof dir, "%s/src/%s", root, layers[i]);
        bool no_math = !strcmp(layers[i], "op") || !strcmp(layers[i], "ops") ||
                       !strcmp(layers[i], "fuser") || !strcmp(layers[i], "compile");
        walk(dir, i, no_math, !strcmp(layers[i], "ops"));
    }
    printf("%d files read, %d offences\n", n_files, n_bad);
    return n_bad || n_files < 50 ? 1 : 0;
}
