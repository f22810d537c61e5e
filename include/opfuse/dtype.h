/* opfuse/dtype.h: element types, their traits and the exact scalar codecs.
 *
 * Every conversion follows docs/numerics.md section 1 (the reference copy of
 * the anchor's numerics): fp32 -> bf16/fp16/e4m3/e5m2/e2m1 round to nearest
 * even; the FP8 and FP4 encoders saturate to the largest finite value
 * (infinities included), FP8 maps NaN to 0x7F and FP4 maps NaN to +6; fp32 ->
 * e8m0 rounds up. Decoders are exact.
 *
 *     uint8_t q = opf_f32_to_e4m3(500.0f);   // 0x7E (448, saturated)
 *     float   v = opf_e4m3_to_f32(q);        // 448.0f
 */
#ifndef OPFUSE_DTYPE_H
#define OPFUSE_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "opfuse/export.h"
#include "opfuse/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum opf_dtype {
    OPF_F32  = 0,
    OPF_F16  = 1,
    OPF_BF16 = 2,
    OPF_E4M3 = 3,   /* OCP e4m3fn: no inf, NaN = S.1111.111 */
    OPF_E5M2 = 4,
    OPF_E2M1 = 5,   /* FP4, packed two per byte: even index in the low nibble */
    OPF_E8M0 = 6,   /* power-of-two scale, 0xFF = NaN */
    OPF_I32  = 7,
    OPF_I64  = 8,
    OPF_U8   = 9,
    OPF_DTYPE_COUNT
} opf_dtype;

typedef struct opf_dtype_traits {
    const char *name;        /* "bf16", "e4m3", ... */
    int         bits;        /* bits per element (4 for e2m1) */
    bool        is_float;
    double      max_finite;  /* largest finite value (integers: largest value) */
} opf_dtype_traits;

/* Traits of a dtype; NULL when dt is out of range. */
OPF_API const opf_dtype_traits *opf_dtype_info(opf_dtype dt);
/* Name of a dtype, "invalid" when out of range. */
OPF_API const char *opf_dtype_name(opf_dtype dt);
/* Bytes needed for n elements (e2m1 rounds up to whole bytes). */
OPF_API size_t opf_dtype_nbytes(opf_dtype dt, size_t n);

/* ---- scalar codecs (numerics.md section 1) ---------------------------- */
OPF_API uint16_t opf_f32_to_bf16(float x);
OPF_API float    opf_bf16_to_f32(uint16_t h);
OPF_API uint16_t opf_f32_to_f16(float x);
OPF_API float    opf_f16_to_f32(uint16_t h);
OPF_API uint8_t  opf_f32_to_e4m3(float x);
OPF_API float    opf_e4m3_to_f32(uint8_t q);
OPF_API uint8_t  opf_f32_to_e5m2(float x);
OPF_API float    opf_e5m2_to_f32(uint8_t q);
OPF_API uint8_t  opf_f32_to_e2m1(float x);      /* returns a 4-bit code in the low nibble */
OPF_API float    opf_e2m1_to_f32(uint8_t code); /* reads the low nibble */
OPF_API uint8_t  opf_f32_to_e8m0(float x);      /* smallest power of two >= x, section 1.4 */
OPF_API float    opf_e8m0_to_f32(uint8_t e);    /* 2^(e-127); 0xFF -> NaN */

/* ---- array codecs ------------------------------------------------------
 * opf_convert: dst[i] = convert(src[i]) for n elements, any float dtype to any
 * float dtype (through fp32, which is exact for every decode; a dtype to
 * itself is a plain copy, so infinities and NaN signs survive). e2m1 arrays
 * are packed (n may be odd: the last high nibble is written as 0). Parallel
 * with OpenMP; the result does not depend on the thread count. Returns
 * OPF_ERR_INVALID_ARG for NULL with n > 0 or overlapping src and dst, and
 * OPF_ERR_DTYPE for integer dtypes. */
OPF_API opf_status opf_convert(const void *src, opf_dtype src_dt, void *dst, opf_dtype dst_dt,
                               size_t n);

/* Typed helpers behind opf_convert, exposed for tests and the bindings. */
OPF_API void opf_f32_to_bf16_n(const float *x, uint16_t *y, size_t n);
OPF_API void opf_bf16_to_f32_n(const uint16_t *x, float *y, size_t n);
OPF_API void opf_f32_to_f16_n(const float *x, uint16_t *y, size_t n);
OPF_API void opf_f16_to_f32_n(const uint16_t *x, float *y, size_t n);
OPF_API void opf_f32_to_e4m3_n(const float *x, uint8_t *y, size_t n);
OPF_API void opf_e4m3_to_f32_n(const uint8_t *x, float *y, size_t n);
OPF_API void opf_f32_to_e5m2_n(const float *x, uint8_t *y, size_t n);
OPF_API void opf_e5m2_to_f32_n(const uint8_t *x, float *y, size_t n);
OPF_API void opf_f32_to_e2m1_n(const float *x, uint8_t *packed, size_t n);
OPF_API void opf_e2m1_to_f32_n(const uint8_t *packed, float *y, size_t n);
OPF_API void opf_f32_to_e8m0_n(const float *x, uint8_t *y, size_t n);
OPF_API void opf_e8m0_to_f32_n(const uint8_t *x, float *y, size_t n);

#ifdef __cplusplus
}
#endif
#endif
