/* dtype.c: the dtype traits table, the exported scalar codecs (wrappers of
 * codec-impl.h) and the array codecs behind opf_convert.
 *
 * Array codecs are element-wise, so splitting them over OpenMP threads cannot
 * change a single bit of the result. */
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "core/codec-impl.h"
#include "core/core-impl.h"
#include "opfuse/dtype.h"

static const opf_dtype_traits opf_dtype_table[] = {
    [OPF_F32]  = {"f32", 32, true, FLT_MAX},
    [OPF_F16]  = {"f16", 16, true, 65504.0},
    [OPF_BF16] = {"bf16", 16, true, 0x1.FEp127},
    [OPF_E4M3] = {"e4m3", 8, true, 448.0},
    [OPF_E5M2] = {"e5m2", 8, true, 57344.0},
    [OPF_E2M1] = {"e2m1", 4, true, 6.0},
    [OPF_E8M0] = {"e8m0", 8, true, 0x1p127},
    [OPF_I32]  = {"i32", 32, false, 2147483647.0},
    [OPF_I64]  = {"i64", 64, false, 9223372036854775807.0},  /* rounds to 2^63 */
    [OPF_U8]   = {"u8", 8, false, 255.0},
};
_Static_assert(sizeof opf_dtype_table / sizeof opf_dtype_table[0] == OPF_DTYPE_COUNT,
               "opf_dtype_table needs one row per opf_dtype");

const opf_dtype_traits *opf_dtype_info(opf_dtype dt)
{
    return (unsigned)dt < OPF_DTYPE_COUNT ? &opf_dtype_table[dt] : NULL;
}

const char *opf_dtype_name(opf_dtype dt)
{
    const opf_dtype_traits *t = opf_dtype_info(dt);
    return t ? t->name : "invalid";
}

size_t opf_dtype_nbytes(opf_dtype dt, size_t n)
{
    const opf_dtype_traits *t = opf_dtype_info(dt);
    if (!t) return 0;
    if (t->bits == 4) return n / 2 + (n & 1);  /* no n * bits: it could overflow */
    return n * (size_t)(t->bits / 8);
}

/* ---- scalar codecs ---------------------------------------------------- */

uint16_t opf_f32_to_bf16(float x) { return opf_f32_to_bf16_impl(x); }
float opf_bf16_to_f32(uint16_t h) { return opf_bf16_to_f32_impl(h); }
uint16_t opf_f32_to_f16(float x) { return opf_f32_to_f16_impl(x); }
float opf_f16_to_f32(uint16_t h) { return opf_f16_to_f32_impl(h); }
uint8_t opf_f32_to_e4m3(float x) { return opf_f32_to_e4m3_impl(x); }
float opf_e4m3_to_f32(uint8_t q) { return opf_e4m3_to_f32_impl(q); }
uint8_t opf_f32_to_e5m2(float x) { return opf_f32_to_e5m2_impl(x); }
float opf_e5m2_to_f32(uint8_t q) { return opf_e5m2_to_f32_impl(q); }
uint8_t opf_f32_to_e2m1(float x) { return opf_f32_to_e2m1_impl(x); }
float opf_e2m1_to_f32(uint8_t code) { return opf_e2m1_to_f32_impl(code); }
uint8_t opf_f32_to_e8m0(float x) { return opf_f32_to_e8m0_impl(x); }
float opf_e8m0_to_f32(uint8_t e) { return opf_e8m0_to_f32_impl(e); }

/* ---- array codecs ----------------------------------------------------- */

/* Arrays shorter than this stay on the calling thread: below it the fork
 * costs more than the conversion. */
#define OPF_CODEC_PAR_MIN ((size_t)1 << 16)
/* Elements per work item; even, so e2m1 blocks start on a byte boundary. */
#define OPF_CODEC_BLOCK ((size_t)4096)

static size_t opf_min_size(size_t a, size_t b) { return a < b ? a : b; }

/* For each codec: a serial, vectorized kernel over one block (name_run) and
 * the exported array function, which hands blocks to the threads. */
#define OPF_ARRAY_CODEC(name, tin, tout, scalar)                                        \
    static void name##_run(const tin *restrict x, tout *restrict y, size_t n)           \
    {                                                                                   \
        _Pragma("omp simd")                                                             \
        for (size_t i = 0; i < n; i++) y[i] = scalar(x[i]);                             \
    }                                                                                   \
    void name##_n(const tin *x, tout *y, size_t n)                                      \
    {                                                                                   \
        size_t nb = (n + OPF_CODEC_BLOCK - 1) / OPF_CODEC_BLOCK;                        \
        _Pragma("omp parallel for schedule(static) if (n >= OPF_CODEC_PAR_MIN)")        \
        for (size_t b = 0; b < nb; b++) {                                               \
            size_t i0 = b * OPF_CODEC_BLOCK;                                            \
            name##_run(x + i0, y + i0, opf_min_size(OPF_CODEC_BLOCK, n - i0));          \
        }                                                                               \
    }

OPF_ARRAY_CODEC(opf_f32_to_bf16, float, uint16_t, opf_f32_to_bf16_impl)
OPF_ARRAY_CODEC(opf_bf16_to_f32, uint16_t, float, opf_bf16_to_f32_impl)
OPF_ARRAY_CODEC(opf_f32_to_f16, float, uint16_t, opf_f32_to_f16_impl)
OPF_ARRAY_CODEC(opf_f16_to_f32, uint16_t, float, opf_f16_to_f32_impl)
OPF_ARRAY_CODEC(opf_f32_to_e4m3, float, uint8_t, opf_f32_to_e4m3_impl)
OPF_ARRAY_CODEC(opf_e4m3_to_f32, uint8_t, float, opf_e4m3_to_f32_impl)
OPF_ARRAY_CODEC(opf_f32_to_e5m2, float, uint8_t, opf_f32_to_e5m2_impl)
OPF_ARRAY_CODEC(opf_e5m2_to_f32, uint8_t, float, opf_e5m2_to_f32_impl)
OPF_ARRAY_CODEC(opf_f32_to_e8m0, float, uint8_t, opf_f32_to_e8m0_impl)
OPF_ARRAY_CODEC(opf_e8m0_to_f32, uint8_t, float, opf_e8m0_to_f32_impl)

/* e2m1 packs two codes per byte, even index in the low nibble (numerics.md
 * 1.2); an odd n leaves the last high nibble 0. */
static void opf_f32_to_e2m1_run(const float *restrict x, uint8_t *restrict packed, size_t n)
{
    size_t pairs = n / 2;
#pragma omp simd
    for (size_t i = 0; i < pairs; i++)
        packed[i] = (uint8_t)(opf_f32_to_e2m1_impl(x[2 * i]) |
                              opf_f32_to_e2m1_impl(x[2 * i + 1]) << 4);
    if (n & 1) packed[pairs] = opf_f32_to_e2m1_impl(x[n - 1]);
}

static void opf_e2m1_to_f32_run(const uint8_t *restrict packed, float *restrict y, size_t n)
{
    size_t pairs = n / 2;
#pragma omp simd
    for (size_t i = 0; i < pairs; i++) {
        y[2 * i] = opf_e2m1_to_f32_impl(packed[i] & 0xFu);
        y[2 * i + 1] = opf_e2m1_to_f32_impl((uint8_t)(packed[i] >> 4));
    }
    if (n & 1) y[n - 1] = opf_e2m1_to_f32_impl(packed[pairs] & 0xFu);
}

void opf_f32_to_e2m1_n(const float *x, uint8_t *packed, size_t n)
{
    size_t nb = (n + OPF_CODEC_BLOCK - 1) / OPF_CODEC_BLOCK;
#pragma omp parallel for schedule(static) if (n >= OPF_CODEC_PAR_MIN)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * OPF_CODEC_BLOCK;
        opf_f32_to_e2m1_run(x + i0, packed + i0 / 2, opf_min_size(OPF_CODEC_BLOCK, n - i0));
    }
}

void opf_e2m1_to_f32_n(const uint8_t *packed, float *y, size_t n)
{
    size_t nb = (n + OPF_CODEC_BLOCK - 1) / OPF_CODEC_BLOCK;
#pragma omp parallel for schedule(static) if (n >= OPF_CODEC_PAR_MIN)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * OPF_CODEC_BLOCK;
        opf_e2m1_to_f32_run(packed + i0 / 2, y + i0, opf_min_size(OPF_CODEC_BLOCK, n - i0));
    }
}

/* ---- opf_convert ------------------------------------------------------ */

/* Block kernels of one float dtype, addressed by element index i0 (packed
 * e2m1 arrays start at byte i0 / 2; callers keep i0 even). */
typedef void (*opf_decode_block_fn)(const void *src, size_t i0, float *y, size_t n);
typedef void (*opf_encode_block_fn)(const float *x, void *dst, size_t i0, size_t n);

#define OPF_BLOCK_ADAPTERS(tag, tstore, dec, enc, scale)                                \
    static void opf_decode_##tag(const void *src, size_t i0, float *y, size_t n)        \
    {                                                                                   \
        dec((const tstore *)src + i0 / (scale), y, n);                                  \
    }                                                                                   \
    static void opf_encode_##tag(const float *x, void *dst, size_t i0, size_t n)        \
    {                                                                                   \
        enc(x, (tstore *)dst + i0 / (scale), n);                                        \
    }

OPF_BLOCK_ADAPTERS(bf16, uint16_t, opf_bf16_to_f32_run, opf_f32_to_bf16_run, 1)
OPF_BLOCK_ADAPTERS(f16, uint16_t, opf_f16_to_f32_run, opf_f32_to_f16_run, 1)
OPF_BLOCK_ADAPTERS(e4m3, uint8_t, opf_e4m3_to_f32_run, opf_f32_to_e4m3_run, 1)
OPF_BLOCK_ADAPTERS(e5m2, uint8_t, opf_e5m2_to_f32_run, opf_f32_to_e5m2_run, 1)
OPF_BLOCK_ADAPTERS(e2m1, uint8_t, opf_e2m1_to_f32_run, opf_f32_to_e2m1_run, 2)
OPF_BLOCK_ADAPTERS(e8m0, uint8_t, opf_e8m0_to_f32_run, opf_f32_to_e8m0_run, 1)

static void opf_decode_f32(const void *src, size_t i0, float *y, size_t n)
{
    memcpy(y, (const float *)src + i0, n * sizeof(float));
}

static void opf_encode_f32(const float *x, void *dst, size_t i0, size_t n)
{
    memcpy((float *)dst + i0, x, n * sizeof(float));
}

/* Indexed by opf_dtype; integer dtypes have no row (NULL kernels). */
static const struct opf_codec_row {
    opf_decode_block_fn decode;
    opf_encode_block_fn encode;
} opf_codec_table[OPF_DTYPE_COUNT] = {
    [OPF_F32] = {opf_decode_f32, opf_encode_f32},
    [OPF_F16] = {opf_decode_f16, opf_encode_f16},
    [OPF_BF16] = {opf_decode_bf16, opf_encode_bf16},
    [OPF_E4M3] = {opf_decode_e4m3, opf_encode_e4m3},
    [OPF_E5M2] = {opf_decode_e5m2, opf_encode_e5m2},
    [OPF_E2M1] = {opf_decode_e2m1, opf_encode_e2m1},
    [OPF_E8M0] = {opf_decode_e8m0, opf_encode_e8m0},
};

/* One block: decode into fp32 (in place when dst is f32), then encode (straight
 * from src when src is f32). */
static void opf_convert_block(const void *src, opf_dtype sdt, void *dst, opf_dtype ddt,
                              size_t i0, size_t n)
{
    float tmp[OPF_CODEC_BLOCK];
    if (sdt == OPF_F32) {
        opf_codec_table[ddt].encode((const float *)src + i0, dst, i0, n);
    } else if (ddt == OPF_F32) {
        opf_codec_table[sdt].decode(src, i0, (float *)dst + i0, n);
    } else {
        opf_codec_table[sdt].decode(src, i0, tmp, n);
        opf_codec_table[ddt].encode(tmp, dst, i0, n);
    }
}

static opf_status opf_convert_check_dtype(opf_dtype dt, const char *which)
{
    if ((unsigned)dt >= OPF_DTYPE_COUNT)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "opf_convert: %s dtype %d is not an opf_dtype",
                         which, (int)dt);
    if (!opf_codec_table[dt].decode)
        return opf_error(NULL, OPF_ERR_DTYPE,
                         "opf_convert: %s dtype %s is not a float dtype (f32, f16, bf16, e4m3, "
                         "e5m2, e2m1, e8m0)", which, opf_dtype_name(dt));
    return OPF_OK;
}

static opf_status opf_convert_check(const void *src, opf_dtype sdt, void *dst, opf_dtype ddt,
                                    size_t n)
{
    opf_status st = opf_convert_check_dtype(sdt, "src");
    if (st == OPF_OK) st = opf_convert_check_dtype(ddt, "dst");
    if (st != OPF_OK || n == 0) return st;
    if (!src || !dst)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "opf_convert: %s is NULL (%s -> %s, n = %zu)",
                         src ? "dst" : "src", opf_dtype_name(sdt), opf_dtype_name(ddt), n);
    uintptr_t s0 = (uintptr_t)src, s1 = s0 + opf_dtype_nbytes(sdt, n);
    uintptr_t d0 = (uintptr_t)dst, d1 = d0 + opf_dtype_nbytes(ddt, n);
    if (s0 < d1 && d0 < s1)
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "opf_convert: src and dst overlap (%s -> %s, n = %zu)",
                         opf_dtype_name(sdt), opf_dtype_name(ddt), n);
    return OPF_OK;
}

/* A dtype converted to itself is copied unchanged (NaN codes keep their sign
 * and e5m2 infinities stay infinite, which a trip through fp32 would not do);
 * only the unused high nibble of an odd e2m1 array is cleared. */
static void opf_convert_copy(const void *src, void *dst, opf_dtype dt, size_t n)
{
    size_t nbytes = opf_dtype_nbytes(dt, n);
    memcpy(dst, src, nbytes);
    if (dt == OPF_E2M1 && (n & 1)) ((uint8_t *)dst)[nbytes - 1] &= 0x0Fu;
}

opf_status opf_convert(const void *src, opf_dtype src_dt, void *dst, opf_dtype dst_dt,
                       size_t n)
{
    opf_status st = opf_convert_check(src, src_dt, dst, dst_dt, n);
    if (st != OPF_OK || n == 0) return st;
    if (src_dt == dst_dt) {
        opf_convert_copy(src, dst, src_dt, n);
        return OPF_OK;
    }
    size_t nb = (n + OPF_CODEC_BLOCK - 1) / OPF_CODEC_BLOCK;
#pragma omp parallel for schedule(static) if (n >= OPF_CODEC_PAR_MIN)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * OPF_CODEC_BLOCK;
        opf_convert_block(src, src_dt, dst, dst_dt, i0, opf_min_size(OPF_CODEC_BLOCK, n - i0));
    }
    return OPF_OK;
}
