/* test_gemm_overlap.c: GEMM refuses an output whose bytes overlap an
 * operand's anywhere (not only at the same address), and accepts D beside
 * an operand in one buffer. D = A^T B in NN form: A [M, K], B [K, N]. */
#include "test.h"

enum { M = 8, K = 16, N = 8 };

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    /* one buffer: B [K, N] at 0, then room for D [M, N] at several offsets */
    static float buf[K * N + 2 * M * N], abuf[M * K];
    for (int i = 0; i < K * N; i++) buf[i] = (float)(i % 7) - 3.0f;
    for (int i = 0; i < M * K; i++) abuf[i] = (float)(i % 5) - 2.0f;
    opf_spec sa = opf_spec_make(2, (int64_t[]){M, K}, OPF_F32);
    opf_spec sb = opf_spec_make(2, (int64_t[]){K, N}, OPF_F32);
    opf_spec sd = opf_spec_make(2, (int64_t[]){M, N}, OPF_F32);
    opf_tensor a, b, d;
    opf_tensor_wrap(&sa, abuf, &a);
    opf_tensor_wrap(&sb, buf, &b);
    /* D starting inside B (its last row), and D ending inside B from below */
    int64_t starts[] = {K * N - N, 1, K * N - 1};
    for (int i = 0; i < 3; i++) {
        opf_tensor_wrap(&sd, buf + starts[i], &d);
        CHECK_FAILS(ctx, opf_gemm(ctx, &b, &a, OPF_GEMM_NN, NULL, &d), OPF_ERR_INVALID_ARG,
                    "D shares memory with A");
    }
    /* D overlapping the start of A from below */
    static float both[M * K + M * N];
    opf_tensor a2;
    opf_tensor_wrap(&sa, both + M * N - 1, &a2);
    opf_tensor_wrap(&sd, both, &d);
    CHECK_FAILS(ctx, opf_gemm(ctx, &b, &a2, OPF_GEMM_NN, NULL, &d), OPF_ERR_INVALID_ARG,
                "D shares memory with B");
    /* right after B in the same buffer: fine */
    opf_tensor_wrap(&sd, buf + K * N, &d);
    CHECK_OK(ctx, opf_gemm(ctx, &b, &a, OPF_GEMM_NN, NULL, &d));
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
