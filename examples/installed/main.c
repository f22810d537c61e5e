/* main.c: a program built against an installed opfuse, outside this tree:
 * with pkg-config (Makefile) or with CMake's find_package (CMakeLists.txt).
 *
 * Quantizes x [64, 128] and w [32, 128] with MXFP8 and multiplies them,
 * y = x w^T (the "TN" GEMM), then compares y with the fp32 product. Prints
 * one line and exits 0 when the error is within MXFP8's precision. */
#include <math.h>
#include <stdio.h>

#include <opfuse.h>

enum { M = 64, N = 32, K = 128 };

/* Fills t's f32 data with a smooth pattern in [-1, 1]. */
static void fill(opf_tensor *t, int64_t n, float phase)
{
    float *p = t->data[0];
    for (int64_t i = 0; i < n; i++) p[i] = sinf(0.37f * (float)i + phase);
}

/* Quantizes *in for the role with r into *out (both copies MXFP8 makes). */
static opf_status quantize(opf_ctx *ctx, const opf_recipe *r, opf_tensor_role role,
                           const opf_tensor *in, opf_tensor *out)
{
    opf_quantizer_role qr = {"linear", role, "example"};
    opf_quantizer q;
    opf_status st = opf_recipe_quantizer(r, &qr, &q);
    return st ? st : opf_quantize_alloc(ctx, &q, in, out);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    opf_spec xs = opf_spec_make(2, (int64_t[]){M, K}, OPF_F32);
    opf_spec ws = opf_spec_make(2, (int64_t[]){N, K}, OPF_F32);
    opf_spec ys = opf_spec_make(2, (int64_t[]){M, N}, OPF_F32);
    opf_tensor x = {0}, w = {0}, xq = {0}, wq = {0}, y = {0};
    opf_recipe r = opf_recipe_default(OPF_RECIPE_MXFP8);
    opf_status st = opf_tensor_alloc(ctx, &xs, &x);
    if (!st) st = opf_tensor_alloc(ctx, &ws, &w);
    if (!st) st = opf_tensor_alloc(ctx, &ys, &y);
    if (!st) {
        fill(&x, (int64_t)M * K, 0.0f);
        fill(&w, (int64_t)N * K, 1.0f);
        st = quantize(ctx, &r, OPF_ROLE_INPUT, &x, &xq);
    }
    if (!st) st = quantize(ctx, &r, OPF_ROLE_WEIGHT, &w, &wq);
    if (!st) st = opf_gemm(ctx, &wq, &xq, OPF_GEMM_TN, NULL, &y);
    int rc = 1;
    if (st) {
        fprintf(stderr, "example: %s\n", opf_last_error(ctx));
    } else {
        const float *xp = x.data[0], *wp = w.data[0], *yp = y.data[0];
        double err = 0, ref_max = 0;
        for (int i = 0; i < M; i++) {
            for (int j = 0; j < N; j++) {
                double ref = 0;
                for (int k = 0; k < K; k++) ref += (double)xp[i * K + k] * wp[j * K + k];
                err = fmax(err, fabs(yp[i * N + j] - ref));
                ref_max = fmax(ref_max, fabs(ref));
            }
        }
        /* Each E4M3 operand carries a relative error up to 2^-4. */
        rc = err <= 0.125 * ref_max ? 0 : 1;
        printf("opfuse example: MXFP8 GEMM [%d x %d] x [%d x %d]^T, max |error| %.4f of max |y| %.2f: "
               "%s\n", M, K, N, K, err, ref_max, rc ? "FAIL" : "ok");
    }
    opf_tensor_release(&y);
    opf_tensor_release(&wq);
    opf_tensor_release(&xq);
    opf_tensor_release(&w);
    opf_tensor_release(&x);
    opf_ctx_destroy(ctx);
    return rc;
}
