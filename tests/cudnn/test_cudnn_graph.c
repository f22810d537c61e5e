/* test_cudnn_graph.c: OPF_CUDA_ATTENTION=cudnn's graphs (src/backend/cuda/
 * cudnn_attn.cu) as cuDNN takes them before it looks for an engine: every
 * tensor, operation and the operation graph finalized by the cuDNN on this
 * machine, with no GPU needed (label cudnn: it runs in the CPU suite where
 * cuDNN 9.8 or later loads, and in gpu.sh's run). Forward and backward,
 * bf16 and f16, at GPT-2's shape, odd T, D 8 .. 128. Whether an engine
 * takes the graphs, and what they compute, only a GPU shows (test_cuda_nn).
 * Skipped (77) without CUDA in the build, without cuDNN's headers at
 * configure time, or where libcudnn.so.9 does not load. */
#ifndef OPF_HAVE_CUDA
#include <stdio.h>
int main(void)
{
    printf("SKIP: built without CUDA (OPF_CUDA=OFF)\n");
    return 77;
}
#else
#include <stdio.h>

#include "backend/cuda/cuda.h"
#include "test.h"

typedef struct graph_case {
    int64_t B, T, H, D;
} graph_case;

static const graph_case cases[] = {
    {16, 1024, 12, 64},  /* GPT-2 small */
    {2, 65, 3, 128},     /* partial tiles, the largest D */
    {2, 45, 5, 24},
    {1, 2, 1, 8},        /* the smallest cuDNN takes here */
    {8, 2048, 16, 128},  /* GPT-2 medium-like */
};

int main(void)
{
    int n_ops = 0;
    size_t version = 0;
    if (opf_cuda_cudnn_version(NULL, &version) != OPF_OK) {
        printf("SKIP: %s\n", opf_last_error(NULL));
        return 77;
    }
    opf_status st = opf_cuda_cudnn_graph_check(NULL, false, false, 1, 2, 1, 8, OPF_BF16, &n_ops);
    if (st == OPF_ERR_UNSUPPORTED) {
        printf("SKIP: %s\n", opf_last_error(NULL));
        return 77;
    }
    printf("cuDNN %zu.%zu.%zu\n", version / 10000, version / 100 % 100, version % 100);
    static const opf_dtype dts[] = {OPF_BF16, OPF_F16};
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++)
        for (int d = 0; d < 2; d++)
            for (int g = 0; g < 3; g++) {  /* forward, backward, atomic backward */
                const graph_case *k = &cases[c];
                bool bwd = g > 0, atomic = g == 2;
                int want = g == 0 ? 14 : g == 1 ? 21 : 22;
                st = opf_cuda_cudnn_graph_check(NULL, bwd, atomic, k->B, k->T, k->H, k->D,
                                                dts[d], &n_ops);
                CHECK(st == OPF_OK && n_ops == want,
                      "%s %s B %lld T %lld H %lld D %lld: %s, %d operations (want %d): %s",
                      g == 0 ? "forward" : g == 1 ? "backward" : "atomic backward",
                      opf_dtype_name(dts[d]), (long long)k->B, (long long)k->T, (long long)k->H,
                      (long long)k->D, opf_status_str(st), n_ops, want, opf_last_error(NULL));
            }
    printf("  forward, backward and atomic backward graphs, bf16 and f16, %d shapes\n",
           (int)(sizeof cases / sizeof cases[0]));
    CHECK_FAILS(NULL, opf_cuda_cudnn_graph_check(NULL, false, false, 1, 2, 1, 8, OPF_F32, &n_ops),
                OPF_ERR_DTYPE, "attention forward (cuda cudnn)", "f32");
    TEST_DONE();
}
#endif
