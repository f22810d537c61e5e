/* scale.c: scale-from-amax primitives (docs/numerics.md 2.1 and 2.2), the
 * FP8 decode table and the byte transpose shared by the quantizers. */
#include <float.h>
#include <math.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/codec-impl.h"
#include "core/core-impl.h"
#include "quant/scale-impl.h"

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
        for (int i = 0; i < 8; i++) {
            y[i] = _mm256_unpacklo_epi8(x[2 * i], x[2 * i + 1]);
            y[i + 8] = _mm256_unpackhi_epi8(x[2 * i], x[2 * i + 1]);
        }
        for (int i = 0; i < 8; i++) {
            x[i] = _mm256_unpacklo_epi16(y[2 * i], y[2 * i + 1]);
            x[i + 8] = _mm256_unpackhi_epi16(y[2 * i], y[2 * i + 1]);
        }
        for (int i = 0; i < 8; i++) {
            y[i] = _mm256_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
            y[i + 8] = _mm256_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
        }
        for (int i = 0; i < 8; i++) {
            x[i] = _mm256_unpacklo_epi64(y[2 * i], y[2 * i + 1]);
            x[i + 8] = _mm256_unpackhi_epi64(y[2 * i], y[2 * i + 1]);
        }
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
    for (int i = 0; i < 8; i++) {
        t[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        t[i + 8] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm_unpacklo_epi16(t[2 * i], t[2 * i + 1]);
        r[i + 8] = _mm_unpackhi_epi16(t[2 * i], t[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        t[i] = _mm_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[i + 8] = _mm_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm_unpacklo_epi64(t[2 * i], t[2 * i + 1]);
        r[i + 8] = _mm_unpackhi_epi64(t[2 * i], t[2 * i + 1]);
    }
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
