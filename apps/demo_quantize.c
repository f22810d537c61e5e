/* demo_quantize.c: `opfuse demo`: quantizes one sample tensor with every
 * recipe and prints format, bytes per element and error against the input. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "apps.h"
#include "opfuse.h"

typedef struct demo_row {
    const char *name;
    opf_scaling scaling;
    opf_dtype qdtype;
    bool delayed, pow2, mx2d, rht;
} demo_row;

static const demo_row demo_rows[] = {
    {"fp8 delayed (step 2)", OPF_SCALING_TENSOR, OPF_E4M3, true, false, false, false},
    {"fp8 current e4m3", OPF_SCALING_TENSOR, OPF_E4M3, false, false, false, false},
    {"fp8 current e5m2", OPF_SCALING_TENSOR, OPF_E5M2, false, false, false, false},
    {"fp8 current pow2", OPF_SCALING_TENSOR, OPF_E4M3, false, true, false, false},
    {"fp8 block 1x128", OPF_SCALING_BLOCK_1D, OPF_E4M3, false, true, false, false},
    {"fp8 block 128x128", OPF_SCALING_BLOCK_2D, OPF_E4M3, false, true, false, false},
    {"mxfp8 1x32", OPF_SCALING_MXFP8, OPF_E4M3, false, false, false, false},
    {"mxfp8 32x32", OPF_SCALING_MXFP8, OPF_E4M3, false, false, true, false},
    {"nvfp4 1x16", OPF_SCALING_NVFP4_1D, OPF_E2M1, false, false, false, false},
    {"nvfp4 16x16", OPF_SCALING_NVFP4_2D, OPF_E2M1, false, false, false, false},
};

/* Bytes of the rowwise copy (data + scales + amax) per element. */
static double bytes_per_element(const opf_tensor *t)
{
    opf_layout L;
    opf_spec_layout(&t->spec, &L);
    size_t b = 0;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present && c != OPF_COMP_COL_DATA && c != OPF_COMP_COL_SCALE_INV &&
            c != OPF_COMP_COL_AMAX)
            b += L.comp[c].nbytes;
    return (double)b / (double)(L.m * L.k);
}

static int demo_one(opf_ctx *ctx, const demo_row *r, const opf_tensor *x, const float *ref,
                    float *y, opf_delayed_state *ds)
{
    opf_quantizer q = opf_quantizer_default();
    q.scaling = r->scaling;
    q.qdtype = r->qdtype;
    q.usage = OPF_USAGE_ROWWISE;
    q.pow2_scales = r->pow2;
    q.mxfp8_2d = r->mx2d;
    if (r->delayed) {
        q.delayed = ds;
        for (int step = 0; step < 2; step++) {  /* two steps of history, then quantize */
            opf_tensor w;
            if (opf_quantize_alloc(ctx, &q, x, &w)) return 1;
            opf_tensor_release(&w);
            opf_delayed_state_update(ctx, ds, NULL, NULL);
        }
    }
    opf_tensor t, yt;
    if (opf_quantize_alloc(ctx, &q, x, &t)) return 1;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {x->spec.shape[0], x->spec.shape[1]},
                                .dtype = OPF_F32}, y, &yt);
    if (opf_dequantize(ctx, &t, OPF_USAGE_ROWWISE, &yt)) return 1;
    int64_t n = opf_spec_numel(&x->spec);
    double se = 0, sr = 0, maxe = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)y[i] - ref[i]);
        se += e * e;
        sr += (double)ref[i] * ref[i];
        if (e > maxe) maxe = e;
    }
    printf("| %-22s | %-5s | %14.3f | %12.5f | %10.4f |\n", r->name, opf_dtype_name(r->qdtype),
           bytes_per_element(&t), sqrt(se / sr), maxe);
    opf_tensor_release(&t);
    return 0;
}

int opf_demo_quantize(int argc, char **argv)
{
    (void)argc, (void)argv;
    enum { M = 256, K = 1024 };
    float *ref = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * K);
    uint16_t *xb = malloc(sizeof(uint16_t) * M * K);
    opf_ctx *ctx;
    opf_delayed_state *ds;
    if (!ref || !y || !xb || opf_ctx_create(NULL, &ctx)) return 1;
    opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, 16, OPF_AMAX_MAX, false, 1, &ds);
    /* Activations-like sample: normal values, a few outlier channels. */
    uint64_t s = 42;
    for (int i = 0; i < M * K; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u1 = ((s >> 11) + 1.0) / 9007199254740993.0;
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u2 = (s >> 11) / 9007199254740992.0;
        float v = (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
        if (i % K < 4) v *= 30.0f;
        xb[i] = opf_f32_to_bf16(v);
        ref[i] = opf_bf16_to_f32(xb[i]);
    }
    opf_tensor x;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {M, K}, .dtype = OPF_BF16}, xb, &x);
    printf("opfuse demo: one bf16 [%d, %d] tensor (normal, 4 outlier channels x30) quantized by "
           "every recipe\n\n", M, K);
    printf("| %-22s | %-5s | %14s | %12s | %10s |\n", "recipe / format", "elem", "bytes/element",
           "rel RMS err", "max |err|");
    printf("|------------------------|-------|----------------|--------------|------------|\n");
    int rc = 0;
    for (size_t i = 0; i < sizeof demo_rows / sizeof demo_rows[0]; i++)
        if (demo_one(ctx, &demo_rows[i], &x, ref, y, ds)) {
            fprintf(stderr, "%s: %s\n", demo_rows[i].name, opf_last_error(ctx));
            rc = 1;
        }
    printf("\nbf16 itself: 2 bytes/element. Scales, padding included, are counted.\n");
    opf_delayed_state_destroy(ds);
    opf_ctx_destroy(ctx);
    free(ref), free(y), free(xb);
    return rc;
}
