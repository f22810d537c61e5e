/* graph.c: `opfuse graph`: compiles the residual LayerNorm-MLP of `opfuse
 * demo` and writes its graph as text (lnmlp_graph.txt) and Graphviz DOT
 * (lnmlp_graph.dot), rendered to .svg and .png when `dot` is on PATH.
 *
 *     opfuse graph [--recipe none|delayed|current|block|mxfp8|nvfp4]
 *                  [--dir DIR] [--inference]
 *
 * The files go to DIR (created if missing), by default the folder of the
 * opfuse binary (build/), never the working directory: that is often the
 * source tree. Compiling traces specs only, so the shapes can be those of a
 * real block. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <libgen.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "apps.h"
#include "model.h"

/* Multiples of 128: every recipe's block sizes divide them. */
enum { TOKENS = 128, HIDDEN = 128, FFN = 512 };

static const struct {
    const char     *name;
    opf_recipe_kind kind;
} recipes[] = {
    {"none", OPF_RECIPE_NONE},   {"delayed", OPF_RECIPE_DELAYED}, {"current", OPF_RECIPE_CURRENT},
    {"block", OPF_RECIPE_BLOCK}, {"mxfp8", OPF_RECIPE_MXFP8},     {"nvfp4", OPF_RECIPE_NVFP4},
};

typedef struct graph_args {
    opf_recipe_kind kind;
    const char     *dir;  /* NULL: the binary's folder */
    bool            inference;
} graph_args;

static void graph_usage(void)
{
    fprintf(stderr, "usage: opfuse graph [--recipe none|delayed|current|block|mxfp8|nvfp4] "
                    "[--dir DIR] [--inference]\n");
}

static bool parse(int argc, char **argv, graph_args *a)
{
    *a = (graph_args){OPF_RECIPE_NONE, NULL, false};
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--inference")) {
            a->inference = true;
        } else if (!strcmp(argv[i], "--dir") && i + 1 < argc) {
            a->dir = argv[++i];
        } else if (!strcmp(argv[i], "--recipe") && i + 1 < argc) {
            const char *r = argv[++i];
            size_t k = 0;
            while (k < sizeof recipes / sizeof recipes[0] && strcmp(recipes[k].name, r)) k++;
            if (k == sizeof recipes / sizeof recipes[0]) {
                fprintf(stderr, "opfuse graph: unknown recipe \"%s\"\n", r);
                return false;
            }
            a->kind = recipes[k].kind;
        } else {
            fprintf(stderr, "opfuse graph: unknown argument \"%s\"\n", argv[i]);
            return false;
        }
    }
    return true;
}

/* Writes path with dump(g, f). */
static opf_status write_dump(const char *path, const opf_graph *g,
                             opf_status (*dump)(const opf_graph *, FILE *))
{
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "opfuse graph: cannot open %s for writing\n", path);
        return OPF_ERR_IO;
    }
    opf_status st = dump(g, f);
    if (fclose(f) && !st) st = OPF_ERR_IO;
    if (st) fprintf(stderr, "opfuse graph: writing %s failed: %s\n", path, opf_last_error(NULL));
    return st;
}

/* Quotes s for a POSIX shell: 'it'\''s'. */
static void shell_quote(const char *s, char *buf, size_t size)
{
    size_t n = 0;
    if (size < 3) return;
    buf[n++] = '\'';
    for (; *s && n + 5 < size; s++) {
        if (*s == '\'') {
            memcpy(buf + n, "'\\''", 4);
            n += 4;
        } else {
            buf[n++] = *s;
        }
    }
    buf[n++] = '\'';
    buf[n] = 0;
}

/* Renders PREFIX.dot to PREFIX.svg and PREFIX.png with Graphviz if present. */
static int render(const char *prefix)
{
    if (system("command -v dot >/dev/null 2>&1") != 0) {
        printf("graphviz not installed: wrote %s.dot; install graphviz to render\n", prefix);
        return 0;
    }
    static const char *const fmts[] = {"svg", "png"};
    char in[1100], out[1100], qin[2200], qout[2200], cmd[4500];
    snprintf(in, sizeof in, "%s.dot", prefix);
    shell_quote(in, qin, sizeof qin);
    int rc = 0;
    for (int i = 0; i < 2; i++) {
        snprintf(out, sizeof out, "%s.%s", prefix, fmts[i]);
        shell_quote(out, qout, sizeof qout);
        snprintf(cmd, sizeof cmd, "dot -T%s %s -o %s", fmts[i], qin, qout);
        if (system(cmd) != 0) {
            fprintf(stderr, "opfuse graph: `%s` failed\n", cmd);
            rc = 1;
        } else {
            printf("wrote %s\n", out);
        }
    }
    return rc;
}

/* The bytes an eager step of the same seq allocates at its peak (after a
 * warm-up step), for comparison with the planned arena. */
static opf_status eager_step_peak(opf_ctx *ctx, opf_seq *seq, const opf_seq_call *call, size_t *peak)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){TOKENS, HIDDEN}, OPF_F32);
    opf_tensor x, dy, y, dx;
    opf_status st = opf_tensor_alloc(ctx, &s, &x);
    if (!st) st = opf_tensor_alloc(ctx, &s, &dy);
    if (st) return st;
    memset(x.data[0], 0, sizeof(float) * TOKENS * HIDDEN);
    memset(dy.data[0], 0, sizeof(float) * TOKENS * HIDDEN);
    for (int k = 0; k < 2 && !st; k++) {
        opf_alloc_stats a;
        opf_ctx_alloc_stats(ctx, &a);
        opf_ctx_alloc_reset_peak(ctx);
        st = opf_seq_forward(seq, &x, call, &y, NULL);
        if (!st && call->requires_grad) st = opf_seq_backward(seq, &dy, NULL, &dx, NULL);
        if (!st && call->requires_grad) opf_tensor_release(&dx);
        if (!st) opf_tensor_release(&y);
        opf_alloc_stats b;
        opf_ctx_alloc_stats(ctx, &b);
        *peak = b.bytes_peak - a.bytes_live;
    }
    opf_tensor_release(&x);
    opf_tensor_release(&dy);
    return st;
}

/* Writes DIR/lnmlp_graph into prefix: DIR as given (made if missing) or the
 * folder of the running binary. */
static bool output_prefix(const char *dir, char *prefix, size_t size)
{
    char exe[1024];
    if (!dir) {
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0) {
            fprintf(stderr, "opfuse graph: cannot find the binary's folder; name one with --dir\n");
            return false;
        }
        exe[n] = 0;
        dir = dirname(exe);
    } else if (mkdir(dir, 0777) && errno != EEXIST) {
        fprintf(stderr, "opfuse graph: cannot create %s: %s\n", dir, strerror(errno));
        return false;
    }
    if ((size_t)snprintf(prefix, size, "%s/lnmlp_graph", dir) >= size) {
        fprintf(stderr, "opfuse graph: the folder name is too long\n");
        return false;
    }
    return true;
}

int opf_app_graph(int argc, char **argv)
{
    graph_args a;
    char prefix[1024];
    if (!parse(argc, argv, &a)) {
        graph_usage();
        return 2;
    }
    if (!output_prefix(a.dir, prefix, sizeof prefix)) return 1;
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    opf_seq *seq = NULL;
    opf_graph *g = NULL;
    opf_recipe r = opf_recipe_default(a.kind);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = a.kind == OPF_RECIPE_NONE ? NULL : &r;
    call.input_requires_grad = false;
    call.requires_grad = !a.inference;
    int64_t xs[2] = {TOKENS, HIDDEN};
    opf_spec x = opf_spec_make(2, xs, OPF_F32);
    opf_status st = opf_model_ln_mlp(ctx, HIDDEN, FFN, OPF_F32, &seq);
    if (!st) st = opf_compile(seq, &x, &call, NULL, &g);
    int rc = 0;
    if (st) {
        fprintf(stderr, "opfuse graph: %s\n", opf_last_error(ctx));
        rc = 1;
        goto done;
    }
    char path[1100];
    snprintf(path, sizeof path, "%s.txt", prefix);
    if (write_dump(path, g, opf_graph_dump)) rc = 1;
    else printf("wrote %s\n", path);
    snprintf(path, sizeof path, "%s.dot", prefix);
    if (write_dump(path, g, opf_graph_dump_dot)) rc = 1;
    else printf("wrote %s\n", path);
    opf_graph_stats s;
    opf_graph_get_stats(g, &s);
    size_t eager_peak = 0;
    if (eager_step_peak(ctx, seq, &call, &eager_peak))
        fprintf(stderr, "opfuse graph: eager step: %s\n", opf_last_error(ctx));
    printf("LayerNorm-MLP (tokens %d, hidden %d, ffn %d, fp32), recipe %s, %s: %d forward + %d "
           "backward nodes, %d fused, %d eager; arena %zu bytes planned (%zu without reuse; the "
           "eager step peaks at %zu)\n", TOKENS, HIDDEN, FFN, opf_recipe_name(a.kind),
           a.inference ? "inference" : "training", s.n_forward, s.n_backward, s.n_fused, s.n_eager,
           s.arena_bytes, s.unplanned_bytes, eager_peak);
    if (!rc) rc = render(prefix);
done:
    opf_graph_destroy(g);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
    return rc;
}
