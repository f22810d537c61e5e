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
#include "core/core-impl.h"
#include "quant/scale-impl.h"

enum {
    CHUNK = 4096,          /* elements per unit of parallel work in flat passes */
    TILE = 64,             /* tile edge of the transposing passes */
    PAR_MIN = 1 << 15,     /* below this many elements one thread is faster */
};

static int nthreads(opf_ctx *ctx, int64_t n)
{
    int t = ctx ? opf_ctx_num_threads(ctx) : 0;
    if (n < PAR_MIN) return 1;
    return t > 0 ? t : omp_get_max_threads();
}

/* amax of a plain f32/bf16/f16 array (NaN ignored, from 0), exact. For
 * non-NaN values |x| orders like the integer bits with the sign cleared, so
 * an integer max reduction gives it; NaN patterns lie above infinity's. */
static float input_amax(const void *x, opf_dtype dt, int64_t n, int nt)
{
    if (dt == OPF_F32) {
        const uint32_t *u = x;
        uint32_t m = 0;
#pragma omp parallel for simd num_threads(nt) reduction(max : m) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            uint32_t a = u[i] & 0x7FFFFFFFu;
            a = a > 0x7F800000u ? 0u : a;
            m = a > m ? a : m;
        }
        return opf_bits_f32(m);
    }
    const uint16_t *h = x;
    unsigned inf = dt == OPF_BF16 ? 0x7F80u : 0x7C00u, m = 0;
#pragma omp parallel for simd num_threads(nt) reduction(max : m) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        unsigned a = h[i] & 0x7FFFu;
        a = a > inf ? 0u : a;
        m = a > m ? a : m;
    }
    return dt == OPF_BF16 ? opf_bf16_to_f32((uint16_t)m) : opf_f16_to_f32((uint16_t)m);
}

/* q[i] = cvt(fl(x_f[i] * s)) over the flat tensor. */
static void cast_flat(const void *x, opf_dtype dt, int64_t n, float s, opf_dtype qd, uint8_t *q,
                      int nt)
{
    int64_t nchunks = opf_ceil_div(n, CHUNK);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t i0 = c * CHUNK, len = n - i0 < CHUNK ? n - i0 : CHUNK;
        if (dt == OPF_F32) {
            opf_fp8_scale_cast((const float *)x + i0, len, s, qd, q + i0);
        } else {
            float buf[CHUNK];
            opf_cpu_load_f32(x, dt, i0, len, buf);
            opf_fp8_scale_cast(buf, len, s, qd, q + i0);
        }
    }
}

/* Both copies in one pass over TILE x TILE tiles: the tile's bytes go to the
 * rowwise data as rows and to the columnwise data [K, M] transposed. The
 * local byte tile keeps the transposed reads in cache (rows of a large
 * power-of-two stride would all map to the same cache set). */
static void cast_both(const void *x, opf_dtype dt, int64_t M, int64_t K, float s, opf_dtype qd,
                      uint8_t *q, uint8_t *qt, int nt)
{
    int64_t tm = opf_ceil_div(M, TILE), tk = opf_ceil_div(K, TILE);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < tm * tk; t++) {
        int64_t m0 = t / tk * TILE, k0 = t % tk * TILE;
        int64_t rows = M - m0 < TILE ? M - m0 : TILE, cols = K - k0 < TILE ? K - k0 : TILE;
        float v[TILE];
        uint8_t b[TILE][TILE];
        for (int64_t r = 0; r < rows; r++) {
            opf_cpu_load_f32(x, dt, (m0 + r) * K + k0, cols, v);
            opf_fp8_scale_cast(v, cols, s, qd, b[r]);
            memcpy(q + (m0 + r) * K + k0, b[r], (size_t)cols);
        }
        for (int64_t c = 0; c < cols; c++)
            for (int64_t r = 0; r < rows; r++) qt[(k0 + c) * M + m0 + r] = b[r][c];
    }
}

/* The scale of this quantization and the amax to record. Current scaling may
 * call the reduce hook, which can fail; nothing is written before that. */
static opf_status tensor_scale(opf_ctx *ctx, const opf_quantizer *q, float amax, float *scale,
                               float *amax_out)
{
    if (q->delayed) {
        *scale = opf_delayed_state_scale(q->delayed)[q->slot];
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
                                       opf_tensor *out, uint64_t rng_seed, uint64_t rng_offset)
{
    int64_t M, K;
    opf_shape_2d(&in->spec, &M, &K);
    int64_t n = M * K;
    int nt = nthreads(ctx, n);
    const void *x = in->data[OPF_COMP_DATA];
    float amax = input_amax(x, in->spec.dtype, n, nt), scale = 1.0f, amax_rec = 0.0f;
    opf_status st = tensor_scale(ctx, q, amax, &scale, &amax_rec);
    if (st) return st;

    /* The columnwise copy is the byte transpose of the rowwise one (3.2). */
    uint8_t *row = out->data[OPF_COMP_DATA];
    float scale_inv = 1.0f / scale;  /* correctly rounded, as __frcp_rn (2.3) */
    if (out->spec.usage & OPF_USAGE_COLUMNWISE) {
        cast_both(x, in->spec.dtype, M, K, scale, q->qdtype, row, out->data[OPF_COMP_COL_DATA],
                  nt);
        *(float *)out->data[OPF_COMP_COL_SCALE_INV] = scale_inv;
    } else {
        cast_flat(x, in->spec.dtype, n, scale, q->qdtype, row, nt);
    }
    *(float *)out->data[OPF_COMP_SCALE_INV] = scale_inv;
    *(float *)out->data[OPF_COMP_AMAX] = amax_rec;
    if (q->delayed) {
        /* 3.1: row 0 of the history max-accumulates the pre-scale amax. */
        float *h0 = opf_delayed_state_history(q->delayed) + q->slot;
        if (amax > *h0) *h0 = amax;
    }
    return OPF_OK;
}

opf_status opf_cpu_dequantize_tensor_fp8(opf_ctx *ctx, const opf_tensor *t, unsigned which,
                                         float *out)
{
    int64_t M, K;
    opf_shape_2d(&t->spec, &M, &K);
    int64_t n = M * K;
    int nt = nthreads(ctx, n);
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
