/* quantize_tensor_fp8.c: per-tensor FP8 on the CPU, docs/numerics.md 3.1
 * (delayed scaling) and 3.2 (current scaling). One scale for the whole
 * tensor; the columnwise copy is the byte transpose of the rowwise one with
 * the same scale_inv. The AMAX component receives the amax that the scale
 * was (delayed: will be) computed from: the local input amax for delayed
 * scaling, the reduced amax for current scaling. */
#include <float.h>
#include <omp.h>
#include <string.h>

#include "backend/backend-impl.h"
#include "backend/cpu/cpu-impl.h"
#include "backend/scale-math.h"
#include "core/codec-impl.h"
#include "core/core-impl.h"

enum {
    CHUNK = 4096,          /* elements per unit of parallel work in flat passes */
    TILE = 64,             /* tile edge of the dequantizing transpose */
    STRIP_M = 512,         /* rows per strip of the transposing pass... */
    STRIP_K = 512,         /* ...and columns: 256 KiB of bytes that stay in L2, and
                            * runs of 512 bytes per columnwise row, which keep the
                            * strided writes cheap (measured: shorter runs, or
                            * strips of whole rows, were 15-60% slower) */
    PAR_MIN = 1 << 15,     /* below this many elements one thread is faster */
    LUT_MIN = 1 << 18,     /* from this many 16-bit inputs a byte table pays off */
};

/* q = cvt(fl(x_f * s)) over the flat tensor, straight from the input dtype;
 * the columnwise copy, when wanted, is transposed from q afterwards (a pass
 * over the bytes costs less than casting in short strided strips). lut, if
 * not NULL, holds the byte of every 16-bit input pattern. */
static void cast_flat(const void *x, opf_dtype dt, int64_t n, float s, opf_dtype qd,
                      const uint8_t *lut, uint8_t *q, int nt)
{
    int64_t nchunks = opf_ceil_div(n, CHUNK);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t k = 0; k < nchunks; k++) {
        int64_t i0 = k * CHUNK, len = n - i0 < CHUNK ? n - i0 : CHUNK;
        if (lut) {
            const uint16_t *restrict h = (const uint16_t *)x + i0;
            uint8_t *restrict out = q + i0;
            for (int64_t i = 0; i < len; i++) out[i] = lut[h[i]];
        } else {
            opf_cpu_fp8_cast_from(x, dt, i0, len, s, qd, q + i0);
        }
    }
}

/* Without wide SIMD (SSE2 only: a portable build), casting a 16-bit input
 * costs more than looking its byte up: one scale for every element, so each
 * of the 65536 input patterns has one output byte, cast once into lut by the
 * same code. With AVX2 or more the vector cast is as fast or faster. */
static const uint8_t *byte_table(const void *x, opf_dtype dt, int64_t n, float s, opf_dtype qd,
                                 uint8_t lut[65536])
{
#if defined(__AVX2__)
    (void)x, (void)dt, (void)n, (void)s, (void)qd, (void)lut;
    return NULL;
#else
    (void)x;
    if (dt == OPF_F32 || n < LUT_MIN) return NULL;
    uint16_t h[CHUNK];
    for (int64_t h0 = 0; h0 < 65536; h0 += CHUNK) {
        for (int64_t i = 0; i < CHUNK; i++) h[i] = (uint16_t)(h0 + i);
        opf_cpu_fp8_cast_from(h, dt, 0, CHUNK, s, qd, lut + h0);
    }
    return lut;
#endif
}

/* The columnwise copy [K, M] from the rowwise bytes, in strips of STRIP_M
 * rows x STRIP_K columns: the strip's lines of q stay in cache between the
 * blocks that read them, and every row of qt receives runs of STRIP_M bytes,
 * long enough to keep the strided writes cheap. */
static void transpose_all(const uint8_t *q, int64_t M, int64_t K, uint8_t *qt, int nt)
{
    int64_t tm = opf_ceil_div(M, STRIP_M), tk = opf_ceil_div(K, STRIP_K);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tm * tk; t++) {
        int64_t m0 = t / tk * STRIP_M, k0 = t % tk * STRIP_K;
        int64_t rows = M - m0 < STRIP_M ? M - m0 : STRIP_M;
        int64_t cols = K - k0 < STRIP_K ? K - k0 : STRIP_K;
        opf_transpose_bytes(q + m0 * K + k0, K, qt + k0 * M + m0, M, rows, cols);
    }
}

/* The scale of this quantization and the amax to record. Current scaling may
 * call the reduce hook, which can fail; nothing is written before that. */
static opf_status tensor_scale(opf_ctx *ctx, const opf_quantizer *q, const opf_quantize_state *qs,
                               float amax, float *scale, float *amax_out)
{
    if (q->delayed) {
        *scale = *qs->delayed_scale;
        *amax_out = amax;
        return OPF_OK;
    }
    if (q->amax_reduce) {
        opf_status st = q->amax_reduce(q->amax_reduce_user, &amax, 1);
        if (st != OPF_OK)
            return opf_error(ctx, st,
                             "quantize (fp8 current scaling): amax reduction failed with %s "
                             "(local amax %g); nothing written",
                             opf_status_str(st), (double)amax);
    }
    *scale = opf_scale_from_amax(amax, opf_fp8_max(q->qdtype), q->pow2_scales, q->amax_epsilon,
                                 FLT_MAX);
    *amax_out = amax;
    return OPF_OK;
}

opf_status opf_cpu_quantize_tensor_fp8(opf_ctx *ctx, const opf_quantizer *q, const opf_tensor *in,
                                       opf_tensor *out, const opf_quantize_state *qs)
{
    int64_t M, K;
    opf_shape_2d(&in->spec, &M, &K);
    int64_t n = M * K;
    int nt = opf_cpu_threads(ctx, n, PAR_MIN);
    const void *x = in->data[OPF_COMP_DATA];
    float amax = opf_cpu_input_amax(x, in->spec.dtype, n, nt), scale = 1.0f, amax_rec = 0.0f;
    opf_status st = tensor_scale(ctx, q, qs, amax, &scale, &amax_rec);
    if (st) return st;

    /* The columnwise copy is the byte transpose of the rowwise one (3.2). */
    uint8_t *row = out->data[OPF_COMP_DATA];
    float scale_inv = 1.0f / scale;  /* correctly rounded, as __frcp_rn (2.3) */
    uint8_t lut[65536];  /* 64 KiB on the caller's stack: kernels do not allocate */
    const uint8_t *table = byte_table(x, in->spec.dtype, n, scale, q->qdtype, lut);
    cast_flat(x, in->spec.dtype, n, scale, q->qdtype, table, row, nt);
    if (out->spec.usage & OPF_USAGE_COLUMNWISE) {
        transpose_all(row, M, K, out->data[OPF_COMP_COL_DATA], nt);
        *(float *)out->data[OPF_COMP_COL_SCALE_INV] = scale_inv;
    }
    *(float *)out->data[OPF_COMP_SCALE_INV] = scale_inv;
    *(float *)out->data[OPF_COMP_AMAX] = amax_rec;
    if (q->delayed) {
        /* 3.1: row 0 of the history max-accumulates the pre-scale amax. */
        if (amax > *qs->delayed_amax) *qs->delayed_amax = amax;
    }
    return OPF_OK;
}

opf_status opf_cpu_dequantize_tensor_fp8(opf_ctx *ctx, const opf_tensor *t, unsigned which,
                                         float *out)
{
    int64_t M, K;
    opf_shape_2d(&t->spec, &M, &K);
    int64_t n = M * K;
    int nt = opf_cpu_threads(ctx, n, PAR_MIN);
    float lut[256];
    opf_fp8_decode_table(t->spec.qdtype, lut);
    bool col = which == OPF_USAGE_COLUMNWISE;
    const uint8_t *d = t->data[col ? OPF_COMP_COL_DATA : OPF_COMP_DATA];
    float sinv = *(const float *)t->data[col ? OPF_COMP_COL_SCALE_INV : OPF_COMP_SCALE_INV];
    if (!col) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t i = 0; i < n; i++) out[i] = lut[d[i]] * sinv;
        return OPF_OK;
    }
    /* The columnwise copy is [K, M]: read it transposed, tile by tile. */
    int64_t tm = opf_ceil_div(M, TILE), tk = opf_ceil_div(K, TILE);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t tt = 0; tt < tm * tk; tt++) {
        int64_t m0 = tt / tk * TILE, k0 = tt % tk * TILE;
        int64_t m1 = m0 + TILE < M ? m0 + TILE : M, k1 = k0 + TILE < K ? k0 + TILE : K;
        for (int64_t m = m0; m < m1; m++)
            for (int64_t k = k0; k < k1; k++) out[m * K + k] = lut[d[k * M + m]] * sinv;
    }
    return OPF_OK;
}
