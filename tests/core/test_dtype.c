/* test_dtype.c: dtype traits, byte sizes, hand-checked scalar codes, exact
 * round trips, opf_convert (round trips and every bad input) and thread-count
 * independence of the array codecs. The bit-for-bit sweep against numpy /
 * ml_dtypes lives in tests/oracle/test_codecs.py. */
#include <float.h>
#include <omp.h>
#include <stdint.h>

#include "test.h"

static float f32_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---- traits ------------------------------------------------------------- */

static const opf_dtype_traits want_traits[OPF_DTYPE_COUNT] = {
    [OPF_F32] = {"f32", 32, true, FLT_MAX},      [OPF_F16] = {"f16", 16, true, 65504.0},
    [OPF_BF16] = {"bf16", 16, true, 0x1.FEp127}, [OPF_E4M3] = {"e4m3", 8, true, 448.0},
    [OPF_E5M2] = {"e5m2", 8, true, 57344.0},     [OPF_E2M1] = {"e2m1", 4, true, 6.0},
    [OPF_E8M0] = {"e8m0", 8, true, 0x1p127},     [OPF_I32] = {"i32", 32, false, 2147483647.0},
    [OPF_I64] = {"i64", 64, false, 0x1p63},      [OPF_U8] = {"u8", 8, false, 255.0},
};

static void test_traits(void)
{
    for (int d = 0; d < OPF_DTYPE_COUNT; d++) {
        const opf_dtype_traits *t = opf_dtype_info((opf_dtype)d), *w = &want_traits[d];
        CHECK(t && !strcmp(t->name, w->name) && t->bits == w->bits &&
                  t->is_float == w->is_float && t->max_finite == w->max_finite,
              "traits of dtype %d", d);
        CHECK(!strcmp(opf_dtype_name((opf_dtype)d), w->name), "name of dtype %d", d);
    }
    CHECK(opf_dtype_info(OPF_DTYPE_COUNT) == NULL, "info(COUNT)");
    CHECK(opf_dtype_info((opf_dtype)-1) == NULL, "info(-1)");
    CHECK(!strcmp(opf_dtype_name((opf_dtype)42), "invalid"), "name(42)");
    /* max_finite is what the decoders give for the largest code. */
    CHECK(opf_bf16_to_f32(0x7F7F) == (float)want_traits[OPF_BF16].max_finite, "bf16 max");
    CHECK(opf_f16_to_f32(0x7BFF) == 65504.0f, "f16 max");
    CHECK(opf_e4m3_to_f32(0x7E) == 448.0f && opf_e5m2_to_f32(0x7B) == 57344.0f, "fp8 max");
    CHECK(opf_e2m1_to_f32(0x7) == 6.0f && opf_e8m0_to_f32(0xFE) == 0x1p127f, "e2m1/e8m0 max");
}

static void test_nbytes(void)
{
    static const struct { opf_dtype dt; size_t n, want; } rows[] = {
        {OPF_F32, 3, 12},  {OPF_F16, 5, 10},  {OPF_BF16, 0, 0}, {OPF_E4M3, 7, 7},
        {OPF_E5M2, 1, 1},  {OPF_E2M1, 0, 0},  {OPF_E2M1, 1, 1}, {OPF_E2M1, 2, 1},
        {OPF_E2M1, 3, 2},  {OPF_E2M1, 1001, 501}, {OPF_E8M0, 9, 9}, {OPF_I32, 2, 8},
        {OPF_I64, 2, 16},  {OPF_U8, 4, 4},    {(opf_dtype)99, 4, 0},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        CHECK(opf_dtype_nbytes(rows[i].dt, rows[i].n) == rows[i].want, "nbytes(%d, %zu) = %zu",
              (int)rows[i].dt, rows[i].n, opf_dtype_nbytes(rows[i].dt, rows[i].n));
}

/* ---- scalar codes worked out by hand from numerics.md section 1 --------- */

typedef struct { opf_dtype dt; uint32_t in_bits; unsigned code; } code_row;
#define NAN_BITS 0x7FC00000u
#define NNAN_BITS 0xFFC00000u
#define INF_BITS 0x7F800000u
#define NINF_BITS 0xFF800000u

static const code_row code_rows[] = {
    {OPF_BF16, 0x3F800000u, 0x3F80},  /* 1.0 */
    {OPF_BF16, 0x3F808000u, 0x3F80},  /* tie, even below */
    {OPF_BF16, 0x3F818000u, 0x3F82},  /* tie, even above */
    {OPF_BF16, 0x80000000u, 0x8000},  /* -0 */
    {OPF_BF16, 0x7F7FFFFFu, 0x7F80},  /* FLT_MAX overflows to inf */
    {OPF_BF16, NNAN_BITS, 0xFFC0},    {OPF_BF16, 0x7F800001u, 0x7FC0},
    {OPF_F16, 0x477FE000u, 0x7BFF},   /* 65504 */
    {OPF_F16, 0x477FF000u, 0x7C00},   /* 65520: tie to inf */
    {OPF_F16, 0x33800000u, 0x0001},   /* 2^-24 */
    {OPF_F16, 0x33000000u, 0x0000},   /* 2^-25: tie to 0 */
    {OPF_F16, 0xB3C00000u, 0x8002},   /* -1.5 * 2^-24: tie to even 2 */
    {OPF_F16, 0x7F802000u, 0x7C01},   /* NaN payload kept */
    {OPF_F16, 0xFF800001u, 0xFC01},   /* payload truncated to 0: still a NaN */
    {OPF_E4M3, 0x43FA0000u, 0x7E},    /* 500 saturates */
    {OPF_E4M3, 0x43E80000u, 0x7E},    /* 464 = max + half ulp */
    {OPF_E4M3, INF_BITS, 0x7E},       {OPF_E4M3, NINF_BITS, 0xFE},
    {OPF_E4M3, NNAN_BITS, 0x7F},      {OPF_E4M3, 0x3A800000u, 0x00},  /* 2^-10 tie to 0 */
    {OPF_E4M3, 0xBA800001u, 0x81},    /* just above -2^-10 */
    {OPF_E4M3, 0x3B400000u, 0x02},    /* 1.5 * 2^-9: tie to 2 */
    {OPF_E4M3, 0x3C700000u, 0x08},    /* 7.5 * 2^-9: tie to min normal */
    {OPF_E4M3, 0x3F880000u, 0x38},    /* 1.0625: tie to 1.0 */
    {OPF_E4M3, 0x3F980000u, 0x3A},    /* 1.1875: tie to 1.25 */
    {OPF_E5M2, 0x49742400u, 0x7B},    /* 1e6 */
    {OPF_E5M2, 0x47700000u, 0x7B},    /* 61440 */
    {OPF_E5M2, 0x37000000u, 0x00},    /* 2^-17 tie to 0 */
    {OPF_E5M2, 0xB7C00000u, 0x82},    /* -1.5 * 2^-16 */
    {OPF_E5M2, NAN_BITS, 0x7F},
    {OPF_E2M1, 0x3E800000u, 0x0},     /* 0.25 */
    {OPF_E2M1, 0x3F400000u, 0x2},     /* 0.75 */
    {OPF_E2M1, 0x3FA00000u, 0x2},     /* 1.25 */
    {OPF_E2M1, 0x40A00000u, 0x6},     /* 5 */
    {OPF_E2M1, 0x40A00001u, 0x7},
    {OPF_E2M1, 0xBDCCCCCDu, 0x8},     /* -0.1 keeps its sign */
    {OPF_E2M1, NINF_BITS, 0xF},       {OPF_E2M1, NNAN_BITS, 0x7},
    {OPF_E8M0, 0x3F800000u, 127},     {OPF_E8M0, 0x3FC00000u, 128},
    {OPF_E8M0, 0x00000000u, 0},       {OPF_E8M0, 0x00400000u, 0},  /* 2^-127 */
    {OPF_E8M0, 0x00400001u, 1},       {OPF_E8M0, 0x00000001u, 0},
    {OPF_E8M0, 0x7F000000u, 254},     {OPF_E8M0, 0x7F7FFFFFu, 254},
    {OPF_E8M0, INF_BITS, 254},        {OPF_E8M0, NAN_BITS, 255},
};

static unsigned encode1(opf_dtype dt, float x)
{
    switch (dt) {
    case OPF_BF16: return opf_f32_to_bf16(x);
    case OPF_F16: return opf_f32_to_f16(x);
    case OPF_E4M3: return opf_f32_to_e4m3(x);
    case OPF_E5M2: return opf_f32_to_e5m2(x);
    case OPF_E2M1: return opf_f32_to_e2m1(x);
    case OPF_E8M0: return opf_f32_to_e8m0(x);
    default: return 0xDEAD;
    }
}

static float decode1(opf_dtype dt, unsigned c)
{
    switch (dt) {
    case OPF_BF16: return opf_bf16_to_f32((uint16_t)c);
    case OPF_F16: return opf_f16_to_f32((uint16_t)c);
    case OPF_E4M3: return opf_e4m3_to_f32((uint8_t)c);
    case OPF_E5M2: return opf_e5m2_to_f32((uint8_t)c);
    case OPF_E2M1: return opf_e2m1_to_f32((uint8_t)c);
    case OPF_E8M0: return opf_e8m0_to_f32((uint8_t)c);
    default: return NAN;
    }
}

static void test_scalar_codes(void)
{
    for (size_t i = 0; i < sizeof code_rows / sizeof code_rows[0]; i++) {
        const code_row *r = &code_rows[i];
        unsigned got = encode1(r->dt, f32_of(r->in_bits));
        CHECK(got == r->code, "%s(0x%08X) = 0x%X, want 0x%X", opf_dtype_name(r->dt), r->in_bits,
              got, r->code);
    }
    CHECK(opf_e8m0_to_f32(0) == 0x1p-127f && bits_of(opf_e8m0_to_f32(0)) == 0x00400000u,
          "e8m0 0 is the subnormal 2^-127");
    CHECK(bits_of(opf_e8m0_to_f32(255)) == NAN_BITS, "e8m0 255 is NaN");
    CHECK(bits_of(opf_e4m3_to_f32(0xFF)) == NNAN_BITS, "e4m3 0xFF is -NaN");
    CHECK(opf_e5m2_to_f32(0xFC) == -INFINITY && isnan(opf_e5m2_to_f32(0x7D)), "e5m2 inf/NaN");
    CHECK(opf_e4m3_to_f32(0x01) == 0x1p-9f && opf_e5m2_to_f32(0x03) == 0x1.8p-15f, "fp8 subnormals");
    CHECK(opf_e2m1_to_f32(0xF5) == 3.0f, "e2m1 decode reads the low nibble only");
}

/* Every non-NaN code decodes and re-encodes to itself (e5m2 infinities excepted:
 * they saturate on the way back, numerics.md 1.3). */
static void test_round_trips(void)
{
    static const struct { opf_dtype dt; unsigned ncodes; } fmts[] = {
        {OPF_BF16, 65536}, {OPF_F16, 65536}, {OPF_E4M3, 256},
        {OPF_E5M2, 256},   {OPF_E2M1, 16},   {OPF_E8M0, 255},
    };
    for (size_t f = 0; f < sizeof fmts / sizeof fmts[0]; f++) {
        int bad = 0;
        for (unsigned c = 0; c < fmts[f].ncodes; c++) {
            float v = decode1(fmts[f].dt, c);
            if (isnan(v) || isinf(v)) continue;
            bad += encode1(fmts[f].dt, v) != c;
        }
        CHECK(bad == 0, "%s: %d codes do not round trip", opf_dtype_name(fmts[f].dt), bad);
    }
    CHECK(opf_f32_to_e5m2(opf_e5m2_to_f32(0x7C)) == 0x7B, "e5m2 inf saturates");
}

/* ---- opf_convert -------------------------------------------------------- */

static unsigned long long rng_state = 12345;

static void fill_random(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        switch (i % 4) {
        case 0: x[i] = opf_test_normal(&rng_state, 1.0f); break;
        case 1: x[i] = opf_test_uniform(&rng_state, -600.0f, 600.0f); break;
        case 2: x[i] = opf_test_normal(&rng_state, 1e-3f); break;
        default: x[i] = f32_of((uint32_t)opf_test_rand_u64(&rng_state)); break;
        }
    }
}

static void test_convert_round_trips(void)
{
    enum { N = 10001 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    uint16_t *h = malloc(N * sizeof *h), *h2 = malloc(N * sizeof *h2);
    uint8_t *q = malloc(N), *q2 = malloc(N), *p = malloc(N), *p2 = malloc(N);
    fill_random(x, N);

    /* f32 -> bf16 -> f32 -> bf16 is stable and equals the array codec. */
    CHECK_OK(NULL, opf_convert(x, OPF_F32, h, OPF_BF16, N));
    opf_f32_to_bf16_n(x, h2, N);
    CHECK(!memcmp(h, h2, N * sizeof *h), "convert f32->bf16 == opf_f32_to_bf16_n");
    CHECK_OK(NULL, opf_convert(h, OPF_BF16, y, OPF_F32, N));
    CHECK_OK(NULL, opf_convert(y, OPF_F32, h2, OPF_BF16, N));
    CHECK(!memcmp(h, h2, N * sizeof *h), "bf16 -> f32 -> bf16 round trip");

    /* bf16 -> e4m3 goes through fp32 exactly. */
    CHECK_OK(NULL, opf_convert(h, OPF_BF16, q, OPF_E4M3, N));
    opf_f32_to_e4m3_n(y, q2, N);
    CHECK(!memcmp(q, q2, N), "convert bf16->e4m3 == decode + encode");

    /* e2m1 (odd n) -> e4m3 -> e2m1 is the identity: e4m3 holds every e2m1 value. */
    opf_f32_to_e2m1_n(x, p, N);
    CHECK((p[N / 2] >> 4) == 0, "odd n leaves the last high nibble 0");
    CHECK_OK(NULL, opf_convert(p, OPF_E2M1, q, OPF_E4M3, N));
    memset(p2, 0xFF, N);
    CHECK_OK(NULL, opf_convert(q, OPF_E4M3, p2, OPF_E2M1, N));
    CHECK(!memcmp(p, p2, N / 2 + 1) && p2[N / 2 + 1] == 0xFF, "e2m1 -> e4m3 -> e2m1");

    /* Same dtype copies, clearing only the spare nibble of an odd e2m1 array. */
    p[N / 2] |= 0xA0;
    CHECK_OK(NULL, opf_convert(p, OPF_E2M1, p2, OPF_E2M1, N));
    CHECK(p2[N / 2] == (p[N / 2] & 0x0F) && !memcmp(p, p2, N / 2), "e2m1 copy");
    q[0] = 0xFF;  /* -NaN survives a same-dtype copy */
    CHECK_OK(NULL, opf_convert(q, OPF_E4M3, q2, OPF_E4M3, N));
    CHECK(!memcmp(q, q2, N), "e4m3 copy");
    CHECK_OK(NULL, opf_convert(NULL, OPF_F16, NULL, OPF_E8M0, 0));

    free(x); free(y); free(h); free(h2); free(q); free(q2); free(p); free(p2);
}

static void test_convert_bad_input(void)
{
    float x[4] = {1, 2, 3, 4};
    uint8_t y[16], before[16];
    memset(y, 0x5A, sizeof y);
    memcpy(before, y, sizeof y);
    CHECK_FAILS(NULL, opf_convert(NULL, OPF_F32, y, OPF_E4M3, 4), OPF_ERR_INVALID_ARG,
                "opf_convert", "src is NULL", "f32 -> e4m3", "n = 4");
    CHECK_FAILS(NULL, opf_convert(x, OPF_F32, NULL, OPF_BF16, 3), OPF_ERR_INVALID_ARG,
                "opf_convert", "dst is NULL", "f32 -> bf16", "n = 3");
    CHECK_FAILS(NULL, opf_convert(x, OPF_I32, y, OPF_F32, 4), OPF_ERR_DTYPE, "opf_convert",
                "src dtype i32");
    CHECK_FAILS(NULL, opf_convert(x, OPF_F32, y, OPF_U8, 4), OPF_ERR_DTYPE, "dst dtype u8");
    CHECK_FAILS(NULL, opf_convert(x, OPF_I64, y, OPF_E2M1, 0), OPF_ERR_DTYPE, "src dtype i64");
    CHECK_FAILS(NULL, opf_convert(x, (opf_dtype)99, y, OPF_F32, 4), OPF_ERR_INVALID_ARG,
                "src dtype 99");
    CHECK_FAILS(NULL, opf_convert(x, OPF_F32, y, (opf_dtype)-3, 4), OPF_ERR_INVALID_ARG,
                "dst dtype -3");
    CHECK_FAILS(NULL, opf_convert(y, OPF_E4M3, y + 2, OPF_E5M2, 4), OPF_ERR_INVALID_ARG,
                "overlap", "e4m3 -> e5m2");
    CHECK_FAILS(NULL, opf_convert(y + 4, OPF_F16, y, OPF_F32, 2), OPF_ERR_INVALID_ARG,
                "overlap", "f16 -> f32");
    CHECK(!memcmp(y, before, sizeof y), "failed converts leave dst untouched");
    /* Adjacent, not overlapping: fine. */
    CHECK_OK(NULL, opf_convert(y, OPF_E4M3, y + 4, OPF_E5M2, 4));
}

/* ---- thread-count independence ------------------------------------------ */

/* The typed array codecs, called through one signature. */
static void encode_n(opf_dtype dt, const float *x, void *c, size_t n)
{
    switch (dt) {
    case OPF_BF16: opf_f32_to_bf16_n(x, c, n); break;
    case OPF_F16: opf_f32_to_f16_n(x, c, n); break;
    case OPF_E4M3: opf_f32_to_e4m3_n(x, c, n); break;
    case OPF_E5M2: opf_f32_to_e5m2_n(x, c, n); break;
    case OPF_E2M1: opf_f32_to_e2m1_n(x, c, n); break;
    case OPF_E8M0: opf_f32_to_e8m0_n(x, c, n); break;
    default: break;
    }
}

static void decode_n(opf_dtype dt, const void *c, float *y, size_t n)
{
    switch (dt) {
    case OPF_BF16: opf_bf16_to_f32_n(c, y, n); break;
    case OPF_F16: opf_f16_to_f32_n(c, y, n); break;
    case OPF_E4M3: opf_e4m3_to_f32_n(c, y, n); break;
    case OPF_E5M2: opf_e5m2_to_f32_n(c, y, n); break;
    case OPF_E2M1: opf_e2m1_to_f32_n(c, y, n); break;
    case OPF_E8M0: opf_e8m0_to_f32_n(c, y, n); break;
    default: break;
    }
}

/* Code i of an encoded array (e2m1: nibble i of the packed bytes). */
static unsigned code_at(opf_dtype dt, const uint8_t *c, size_t i)
{
    if (dt == OPF_BF16 || dt == OPF_F16) return ((const uint16_t *)(const void *)c)[i];
    if (dt == OPF_E2M1) return (c[i / 2] >> (4 * (i & 1))) & 0xFu;
    return c[i];
}

static const opf_dtype narrow_dtypes[] = {OPF_BF16, OPF_F16, OPF_E4M3, OPF_E5M2, OPF_E2M1,
                                          OPF_E8M0};

static void test_thread_independence(void)
{
    const size_t n = ((size_t)1 << 20) + 3;
    float *x = malloc(n * sizeof *x), *y1 = malloc(n * sizeof *y1), *y2 = malloc(n * sizeof *y2);
    uint8_t *c1 = malloc(2 * n), *c2 = malloc(2 * n);
    fill_random(x, n);
    for (size_t k = 0; k < sizeof narrow_dtypes / sizeof narrow_dtypes[0]; k++) {
        opf_dtype dt = narrow_dtypes[k];
        size_t nb = opf_dtype_nbytes(dt, n);
        omp_set_num_threads(1);
        encode_n(dt, x, c1, n);
        decode_n(dt, c1, y1, n);
        omp_set_num_threads(2);
        encode_n(dt, x, c2, n);
        decode_n(dt, c2, y2, n);
        CHECK(!memcmp(c1, c2, nb) && !memcmp(y1, y2, n * sizeof *y1), "%s: 1 vs 2 threads",
              opf_dtype_name(dt));
        /* The array codec is the scalar codec, element by element. */
        size_t bad = 0;
        for (size_t i = 0; i < n; i += 7) {
            unsigned code = code_at(dt, c1, i);
            bad += code != encode1(dt, x[i]);
            bad += bits_of(y1[i]) != bits_of(decode1(dt, code));
        }
        CHECK(bad == 0, "%s: %zu array results differ from the scalar codec",
              opf_dtype_name(dt), bad);
    }
    omp_set_num_threads(1);
    CHECK_OK(NULL, opf_convert(x, OPF_F32, c1, OPF_F16, n));
    CHECK_OK(NULL, opf_convert(c1, OPF_F16, y1, OPF_E5M2, n));
    omp_set_num_threads(2);
    CHECK_OK(NULL, opf_convert(c1, OPF_F16, y2, OPF_E5M2, n));
    CHECK(!memcmp(y1, y2, n), "convert f16->e5m2: 1 vs 2 threads");
    free(x); free(y1); free(y2); free(c1); free(c2);
}

int main(void)
{
    test_traits();
    test_nbytes();
    test_scalar_codes();
    test_round_trips();
    test_convert_round_trips();
    test_convert_bad_input();
    test_thread_independence();
    TEST_DONE();
}
