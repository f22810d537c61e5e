/* scale_math.c: scale-from-amax primitives (docs/numerics.md 2.1 and 2.2), the
 * FP8 decode table, the byte transpose and the Hadamard transform shared by
 * the CPU quantize kernels and the quant layer (declared in
 * backend/scale-math.h). */
#include <float.h>
#include <math.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "backend/scale-math.h"
#include "core/codec-impl.h"
#include "core/core-impl.h"

float opf_fp8_max(opf_dtype qdtype)
{
    switch (qdtype) {
    case OPF_E4M3: return 448.0f;
    case OPF_E5M2: return 57344.0f;
    default:       return 0.0f;
    }
}

float opf_input_max_finite(opf_dtype in_dtype)
{
    switch (in_dtype) {
    case OPF_BF16: return 0x1.FEp127f;
    case OPF_F16:  return 65504.0f;
    default:       return FLT_MAX;
    }
}

float opf_scale_from_amax(float amax, float fp8_max, bool pow2, float eps, float value_for_inf)
{
    return opf_scale_from_amax_impl(amax, fp8_max, pow2, eps, value_for_inf);
}

float opf_delayed_scale(float amax, float scaled_max, float prev)
{
    float s = (isfinite(amax) && amax > 0.0f) ? scaled_max / amax : prev;
    return isinf(s) ? FLT_MAX : s;
}

void opf_fp8_decode_table(opf_dtype qdtype, float lut[256])
{
    for (int b = 0; b < 256; b++)
        lut[b] = qdtype == OPF_E4M3 ? opf_e4m3_to_f32_impl((uint8_t)b)
                                 : opf_e5m2_to_f32_impl((uint8_t)b);
}

/* The byte transpose works on B x B blocks, B = 32 with AVX2, 16 with SSE2,
 * 8 otherwise: a whole block is loaded row by row, transposed in registers and
 * stored row by row; partial blocks at the edges go through a local block. */

/* One round of the in-register transpose: out[i] and out[i + 8] interleave
 * in[2i] and in[2i + 1], their low and their high halves, in units of `bits`
 * (pfx: _mm256 for AVX2, _mm for SSE2). Four rounds, 8 to 64 bits, turn 16
 * rows of a lane into its 16 columns. */
#define INTERLEAVE_ROUND(pfx, bits, out, in)                              \
    for (int i = 0; i < 8; i++) {                                          \
        out[i] = pfx##_unpacklo_epi##bits(in[2 * i], in[2 * i + 1]);       \
        out[i + 8] = pfx##_unpackhi_epi##bits(in[2 * i], in[2 * i + 1]);   \
    }

#if defined(__AVX2__)
enum { TB = 32 };

/* Rows of a (stride lda) to rows of b (stride ldb): four rounds of
 * interleaves inside each 128-bit lane turn 16 rows into 16 columns of 16
 * bytes, per half of the block; a last exchange of lanes joins the halves. */
static void transpose_block(const uint8_t *a, int64_t lda, uint8_t *b, int64_t ldb)
{
    __m256i r[32], t[32];
    for (int i = 0; i < 32; i++) r[i] = _mm256_loadu_si256((const __m256i *)(a + i * lda));
    for (int h = 0; h < 32; h += 16) {
        __m256i *x = r + h, *y = t + h;
        INTERLEAVE_ROUND(_mm256, 8, y, x)
        INTERLEAVE_ROUND(_mm256, 16, x, y)
        INTERLEAVE_ROUND(_mm256, 32, y, x)
        INTERLEAVE_ROUND(_mm256, 64, x, y)
    }
    /* r[j] now holds column c(j) of each lane (c = j's 4 bits reversed):
     * rows 0-15 in r[j], rows 16-31 in r[j + 16]. */
    static const uint8_t col[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    for (int j = 0; j < 16; j++) {
        __m256i lo = _mm256_permute2x128_si256(r[j], r[j + 16], 0x20);
        __m256i hi = _mm256_permute2x128_si256(r[j], r[j + 16], 0x31);
        _mm256_storeu_si256((__m256i *)(b + col[j] * ldb), lo);
        _mm256_storeu_si256((__m256i *)(b + (16 + col[j]) * ldb), hi);
    }
}
#elif defined(__SSE2__)
enum { TB = 16 };

/* The same with one 128-bit lane: four rounds of interleaves. */
static void transpose_block(const uint8_t *a, int64_t lda, uint8_t *b, int64_t ldb)
{
    __m128i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm_loadu_si128((const __m128i *)(a + i * lda));
    INTERLEAVE_ROUND(_mm, 8, t, r)
    INTERLEAVE_ROUND(_mm, 16, r, t)
    INTERLEAVE_ROUND(_mm, 32, t, r)
    INTERLEAVE_ROUND(_mm, 64, r, t)
    static const uint8_t col[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    for (int j = 0; j < 16; j++) _mm_storeu_si128((__m128i *)(b + col[j] * ldb), r[j]);
}
#else
enum { TB = 8 };

static void transpose_block(const uint8_t *a, int64_t lda, uint8_t *b, int64_t ldb)
{
    for (int r = 0; r < TB; r++)
        for (int c = 0; c < TB; c++) b[c * ldb + r] = a[r * lda + c];
}
#endif

/* An edge block of h x w < TB x TB bytes through zero-padded local blocks. */
static void transpose_partial(const uint8_t *src, int64_t lds, uint8_t *dst, int64_t ldd,
                              int64_t h, int64_t w)
{
    uint8_t a[TB * TB] = {0}, b[TB * TB];
    for (int64_t r = 0; r < h; r++) memcpy(a + r * TB, src + r * lds, (size_t)w);
    transpose_block(a, TB, b, TB);
    for (int64_t c = 0; c < w; c++) memcpy(dst + c * ldd, b + c * TB, (size_t)h);
}

/* The general path: blocks straight from src to dst, down the rows first,
 * so that consecutive blocks fill the same lines of dst. */
static void transpose_direct(const uint8_t *src, int64_t lds, uint8_t *dst, int64_t ldd,
                             int64_t rows, int64_t cols)
{
    for (int64_t c0 = 0; c0 < cols; c0 += TB) {
        int64_t w = cols - c0 < TB ? cols - c0 : TB;
        for (int64_t r0 = 0; r0 < rows; r0 += TB) {
            int64_t h = rows - r0 < TB ? rows - r0 : TB;
            const uint8_t *s = src + r0 * lds + c0;
            uint8_t *d = dst + c0 * ldd + r0;
            if (h == TB && w == TB) transpose_block(s, lds, d, ldd);
            else transpose_partial(s, lds, d, ldd, h, w);
        }
    }
}

#if defined(__AVX2__)
enum { NT_ROWS = 512 };  /* src rows per local strip of the streaming path */

/* The streaming path, for dst lines that the caller will not read back
 * (every transposed copy is a final output): TB columns of src at a time
 * are transposed into a local strip of TB rows, which then goes to dst with
 * non-temporal stores of whole lines. Full lines written around the cache
 * skip the read for ownership that strided partial writes cost (measured:
 * 20-25% faster for the columnwise copies). Needs 32-byte alignment of the
 * dst rows and rows a multiple of TB. */
static void transpose_stream(const uint8_t *src, int64_t lds, uint8_t *dst, int64_t ldd,
                             int64_t rows, int64_t cols)
{
    _Alignas(32) uint8_t t[TB * NT_ROWS];
    for (int64_t r0 = 0; r0 < rows; r0 += NT_ROWS) {
        int64_t h = rows - r0 < NT_ROWS ? rows - r0 : NT_ROWS;
        for (int64_t c0 = 0; c0 < cols; c0 += TB) {
            int64_t w = cols - c0 < TB ? cols - c0 : TB;
            for (int64_t r = 0; r < h; r += TB) {
                if (w == TB) transpose_block(src + (r0 + r) * lds + c0, lds, t + r, NT_ROWS);
                else transpose_partial(src + (r0 + r) * lds + c0, lds, t + r, NT_ROWS, TB, w);
            }
            for (int64_t c = 0; c < w; c++) {
                uint8_t *d = dst + (c0 + c) * ldd + r0;
                for (int64_t i = 0; i < h; i += 32)
                    _mm256_stream_si256((__m256i *)(d + i),
                                        _mm256_load_si256((const __m256i *)(t + c * NT_ROWS + i)));
            }
        }
    }
    _mm_sfence();  /* the streamed lines are visible before anything that follows */
}
#endif

void opf_transpose_bytes(const uint8_t *src, int64_t lds, uint8_t *dst, int64_t ldd, int64_t rows,
                         int64_t cols)
{
#if defined(__AVX2__)
    if (rows % TB == 0 && ((uintptr_t)dst % 32 | (uint64_t)ldd % 32) == 0) {
        transpose_stream(src, lds, dst, ldd, rows, cols);
        return;
    }
#endif
    transpose_direct(src, lds, dst, ldd, rows, cols);
}

/* ---- the 16-point random Hadamard transform (numerics.md 3.4.3) ----------
 *
 * Applied to the columnwise NVFP4 copies of activations and gradients.
 *
 * y_c = sum_r x_r * s_r * H16[r][c] / 4 with s_r = -1 where bit r of the sign
 * mask is set (0xD7E8 by default) and H16 the Sylvester Hadamard matrix.
 *
 * Summation order (fixed, so the CUDA kernel can reproduce it): for each c the
 * accumulator starts at +0.0f and adds the terms for r = 0, 1, ..., 15 one by
 * one, each addition rounded to fp32 (RNE). Each term is fl(x_r * 0.25) with
 * the sign applied afterwards, which equals fl(x_r * (+-0.25)) exactly. The
 * sum is then rounded to bf16 (RNE) and widened back to fp32, as TE does
 * before taking the amax and quantizing; a NaN sum gives the canonical +NaN
 * (0x7FC00000), whatever NaN the adds propagated (the quantizer ignores NaN
 * in amaxes and encodes every NaN to +6 anyway). Columns whose terms agree
 * in sign pattern over r = 0..j share those first j + 1 additions (the
 * compiler's common subexpressions: the same operations in the same order,
 * 171 adds instead of 256 per column). The tensor core sums the 16 products
 * in an internal order, so in rare double-rounding cases TE can differ from
 * this fixed order before the bf16 round (numerics.md 3.4.3, caveat).
 *
 * The inputs are used as given: the anchor only accepts bf16, so callers
 * round f32/f16 inputs to bf16 first (the NVFP4 quantizer does). */

/* Bit r of kHadamardNeg[c] is set where H16[r][c] = -1, i.e. where
 * popcount(r AND c) is odd. Column 0 is all +1. */
static const uint16_t kHadamardNeg[16] = {
    0x0000, 0xAAAA, 0xCCCC, 0x6666, 0xF0F0, 0x5A5A, 0x3C3C, 0x9696,
    0xFF00, 0x55AA, 0x33CC, 0x9966, 0x0FF0, 0xA55A, 0xC33C, 0x6996,
};

/* Column k of y from column k of x, for every k < w: the loop over columns
 * is the one that vectorizes, and inside it the loops over r and c unroll,
 * so that acc[] lives in registers and whether a term enters as p or as its
 * negation is known at compile time (the data sign s_r is folded into p).
 * acc[c] adds its 16 terms in the order r = 0..15 in every lane. A column is
 * read whole before it is written, so x and y may be the same tile. NaN
 * results are made canonical because which NaN operand an add returns
 * depends on the operand order the compiler picks. */
void opf_rht16_cols(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t w,
                    uint16_t sign_mask)
{
    uint32_t flip[16];
    for (int r = 0; r < 16; r++) flip[r] = ((sign_mask >> r) & 1u) << 31;
#pragma omp simd
    for (int64_t k = 0; k < w; k++) {
        float acc[16];
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) acc[c] = 0.0f;
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
            float t = x[r * ldx + k] * 0.25f;  /* exact unless it underflows */
            float p = opf_bits_f32(opf_f32_bits(t) ^ flip[r]), n = -p;
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++) acc[c] = acc[c] + ((kHadamardNeg[c] >> r) & 1u ? n : p);
        }
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) {
            /* opf_f32_to_bf16_impl and back, in place: RNE on the low 16 bits (a
             * carry into the exponent is the correct result, inf included). */
            uint32_t b = opf_f32_bits(acc[c]);
            uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
            r = (b & OPF_F32_ABS_MASK) > OPF_F32_INF_BITS ? OPF_F32_QNAN_BITS : r;
            y[c * ldy + k] = opf_bits_f32(r);
        }
    }
}
