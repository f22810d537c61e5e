/* opfuse.c: the opfuse command: `demo`, `train`, `graph`, `bench <what>`. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "apps.h"
#include "bench.h"

typedef struct command {
    const char *group, *name;
    int (*run)(int argc, char **argv);
    const char *help;
} command;

static const command commands[] = {
    {"demo", NULL, opf_demo_train, "train a residual LayerNorm-MLP with every recipe\n"
                                   "                   [--device cpu|cuda] (cuda: losses compared to the cpu's)"},
    {"demo", NULL, opf_demo_quantize, "then quantize a sample tensor with every recipe"},
    {"train", NULL, opf_app_train, "train a small GPT (the addition task or --data FILE):\n"
                                   "                   [--recipe fp32|bf16|fp8-delayed|fp8-current|fp8-block|mxfp8|nvfp4]\n"
                                   "                   [--compile] [--steps N] [--save DIR] [--resume DIR] (--help)"},
    {"graph", NULL, opf_app_graph, "compile the LayerNorm-MLP, write lnmlp_graph.txt/.dot(/.svg/.png)\n"
                                   "                   into DIR (default: the binary's folder, build/):\n"
                                   "                   [--recipe none|delayed|current|block|mxfp8|nvfp4]\n"
                                   "                   [--dir DIR] [--inference]"},
    {"bench", "quantize", opf_bench_quantize, "quantize GB/s per format vs memcpy"},
    {"bench", "gemm", opf_bench_gemm, "opf_gemm vs OpenBLAS sgemm"},
    {"bench", "ops", opf_bench_ops, "host time per op; LayerNorm-MLP step vs PyTorch CPU"},
    {"bench", "act", opf_bench_act, "activation ops fwd/bwd on one f32 [128, 1024] tensor"},
    {"bench", "fusion", opf_bench_fusion, "LayerNorm-MLP step with fusions on vs off"},
    {"bench", "compile", opf_bench_compile, "LayerNorm-MLP step host time, eager vs compiled"},
    {"bench", "cuda", opf_bench_cuda, "GPU quantize GB/s vs a device copy; cuBLASLt GEMM TFLOP/s"},
    {"bench", "cuda-train", opf_bench_cuda_train, "GPU Linear and LayerNorm-MLP steps per recipe; CUDA graphs"},
    {"bench", "train", opf_bench_train, "GPT training tokens/s per recipe vs PyTorch (--device cuda)"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: opfuse <command> [args]\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        const command *c = &commands[i];
        bool again = !c->name && i > 0 && !strcmp(c->group, commands[i - 1].group);
        fprintf(f, "  %-5s %-10s %s\n", again ? "" : c->group, c->name ? c->name : "", c->help);
    }
    fprintf(f, "  bench all        every benchmark\n");
}

static bool is_help(const char *a) { return !strcmp(a, "--help") || !strcmp(a, "-h"); }

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    /* `help`, or --help anywhere: this usage (train has its own, with every option) */
    if (strcmp(argv[1], "train"))
        for (int i = 1; i < argc; i++)
            if (is_help(argv[i]) || (i == 1 && !strcmp(argv[1], "help"))) {
                usage(stdout);
                return 0;
            }
    bool all = argc >= 3 && !strcmp(argv[1], "bench") && !strcmp(argv[2], "all");
    int rc = 0, ran = 0;
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        const command *c = &commands[i];
        if (strcmp(argv[1], c->group)) continue;
        if (c->name && !all && (argc < 3 || strcmp(argv[2], c->name))) continue;
        int skip = c->name ? 3 : 2;
        rc |= c->run(argc - skip, argv + skip);
        ran++;
    }
    if (!ran) {
        usage(stderr);
        return 2;
    }
    return rc;
}
