/* test_core.c: status, context, allocator counters, specs and layouts of
 * every scaling mode, tensors, swizzling and Philox. */
#include "test.h"

static void test_status(void)
{
    for (int s = 0; s < OPF_STATUS_COUNT; s++)
        CHECK(strncmp(opf_status_str((opf_status)s), "OPF_", 4) == 0, "status %d", s);
    CHECK(strcmp(opf_status_str(OPF_ERR_SHAPE), "OPF_ERR_SHAPE") == 0, "name");
    CHECK(strcmp(opf_status_str((opf_status)99), "OPF_ERR_UNKNOWN") == 0, "unknown");
}

static void test_ctx(void)
{
    opf_ctx *ctx = NULL;
    CHECK_FAILS(NULL, opf_ctx_create(NULL, NULL), OPF_ERR_INVALID_ARG, "out");
    opf_ctx_options o = opf_ctx_options_default();
    o.device = OPF_DEVICE_COUNT;  /* CUDA contexts: tests/core/test_device.c */
    CHECK_FAILS(NULL, opf_ctx_create(&o, &ctx), OPF_ERR_INVALID_ARG, "device 2");
    CHECK(ctx == NULL, "ctx untouched on failure");
    o = opf_ctx_options_default();
    o.num_threads = -3;
    CHECK_FAILS(NULL, opf_ctx_create(&o, &ctx), OPF_ERR_INVALID_ARG, "num_threads -3");
    o = opf_ctx_options_default();
    o.seed = 7;
    o.offset = 11;
    CHECK_OK(NULL, opf_ctx_create(&o, &ctx));
    uint64_t seed, off;
    opf_ctx_get_rng(ctx, &seed, &off);
    CHECK(seed == 7 && off == 11, "rng %llu %llu", (unsigned long long)seed, (unsigned long long)off);
    CHECK(opf_ctx_rng_advance(ctx, 5) == 11, "advance returns the old offset");
    opf_ctx_get_rng(ctx, NULL, &off);
    CHECK(off == 16, "offset advanced to %llu", (unsigned long long)off);
    CHECK(strcmp(opf_last_error(ctx), "") == 0, "no error yet");
    CHECK(opf_ctx_workspace(ctx, 16) == NULL, "no workspace before reserve");
    CHECK_OK(ctx, opf_ctx_workspace_reserve(ctx, 4096));
    CHECK(opf_ctx_workspace(ctx, 4096) != NULL, "workspace after reserve");
    opf_alloc_stats a;
    opf_ctx_alloc_stats(ctx, &a);
    CHECK(a.n_alloc == 1 && a.bytes_live == 4096, "stats %llu %zu", (unsigned long long)a.n_alloc,
          a.bytes_live);
    opf_ctx_destroy(ctx);
    opf_ctx_destroy(NULL);
}

static opf_spec qspec(int64_t m, int64_t k, opf_scaling s, opf_dtype q, unsigned usage)
{
    opf_spec sp = opf_spec_make(2, (int64_t[]){m, k}, OPF_BF16);
    sp.scaling = s;
    sp.qdtype = q;
    sp.usage = usage;
    return sp;
}

typedef struct layout_case {
    opf_scaling s;
    opf_dtype q;
    int64_t m, k;
    int64_t rows[OPF_COMP_COUNT], cols[OPF_COMP_COUNT];  /* -1: absent */
} layout_case;

/* numerics.md 4.2, both copies requested. */
static const layout_case layout_cases[] = {
    {OPF_SCALING_TENSOR, OPF_E4M3, 48, 80, {48, 1, 80, 1, 1, -1}, {80, 1, 48, 1, 1, -1}},
    {OPF_SCALING_MXFP8, OPF_E4M3, 64, 96, {64, 128, 64, 4, -1, -1}, {96, 4, 96, 128, -1, -1}},
    {OPF_SCALING_MXFP8, OPF_E5M2, 256, 320, {256, 256, 256, 8, -1, -1}, {320, 12, 320, 384, -1, -1}},
    {OPF_SCALING_BLOCK_1D, OPF_E4M3, 144, 272, {144, 3, 272, 2, -1, -1}, {272, 144, 144, 272, -1, -1}},
    {OPF_SCALING_BLOCK_2D, OPF_E4M3, 144, 272, {144, 2, 272, 3, -1, -1}, {272, 4, 144, 4, -1, -1}},
    {OPF_SCALING_NVFP4_1D, OPF_E2M1, 48, 80, {48, 128, 80, 128, 1, 1}, {80, 8, 48, 4, 1, 1}},
    {OPF_SCALING_NVFP4_2D, OPF_E2M1, 256, 64, {256, 256, 64, 128, 1, 1}, {64, 4, 256, 16, 1, 1}},
};

static void test_layouts(void)
{
    for (size_t i = 0; i < sizeof layout_cases / sizeof layout_cases[0]; i++) {
        const layout_case *c = &layout_cases[i];
        opf_spec s = qspec(c->m, c->k, c->s, c->q, OPF_USAGE_ROWWISE | OPF_USAGE_COLUMNWISE);
        opf_layout L;
        CHECK_OK(NULL, opf_spec_layout(&s, &L));
        size_t end = 0;
        for (int j = 0; j < OPF_COMP_COUNT; j++) {
            const opf_component_desc *d = &L.comp[j];
            if (c->rows[j] < 0) {
                CHECK(!d->present, "case %zu comp %d should be absent", i, j);
                continue;
            }
            CHECK(d->present && d->rows == c->rows[j] && d->cols == c->cols[j],
                  "case %zu (%s) comp %d: %lld x %lld, want %lld x %lld", i,
                  opf_scaling_name(c->s), j, (long long)d->rows, (long long)d->cols,
                  (long long)c->rows[j], (long long)c->cols[j]);
            CHECK(d->offset % OPF_COMPONENT_ALIGN == 0 && d->offset >= end, "offset %zu", d->offset);
            CHECK(d->nbytes == opf_dtype_nbytes(d->dtype, (size_t)(d->rows * d->cols)), "nbytes");
            end = d->offset + d->nbytes;
        }
        CHECK(L.total_bytes >= end, "total %zu < %zu", L.total_bytes, end);
        /* rowwise only drops the columnwise components */
        s.usage = OPF_USAGE_ROWWISE;
        CHECK_OK(NULL, opf_spec_layout(&s, &L));
        CHECK(!L.comp[OPF_COMP_COL_DATA].present && !L.comp[OPF_COMP_COL_SCALE_INV].present,
              "rowwise only");
    }
    /* a plain tensor: one component, 3-D shape flattened */
    opf_spec p = opf_spec_make(3, (int64_t[]){2, 3, 5}, OPF_F16);
    opf_layout L;
    CHECK_OK(NULL, opf_spec_layout(&p, &L));
    CHECK(L.m == 6 && L.k == 5 && L.comp[OPF_COMP_DATA].nbytes == 60, "plain layout");
    char buf[96];
    opf_spec s = qspec(64, 96, OPF_SCALING_MXFP8, OPF_E4M3, 3);
    opf_spec_str(&s, buf, sizeof buf);
    CHECK(strcmp(buf, "bf16[64,96] mxfp8(e4m3,row+col)") == 0, "spec_str \"%s\"", buf);
}

static void test_layout_errors(void)
{
    opf_layout L;
    opf_spec s = qspec(48, 80, OPF_SCALING_MXFP8, OPF_E4M3, 3);
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_SHAPE, "mxfp8", "32", "[48, 80]");
    s = qspec(40, 64, OPF_SCALING_NVFP4_1D, OPF_E2M1, 3);
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_SHAPE, "nvfp4", "16", "[40, 64]");
    s = qspec(48, 24, OPF_SCALING_NVFP4_2D, OPF_E2M1, 3);
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_SHAPE, "nvfp4-2d", "[48, 24]");
    /* FP8 block scaling takes any shape: partial 1x128 blocks and 128x128
     * tiles at the edges (numerics.md 3.5), scale grids rounded as in 4.2 */
    s = qspec(303, 300, OPF_SCALING_BLOCK_1D, OPF_E4M3, 3);
    CHECK_OK(NULL, opf_spec_layout(&s, &L));
    CHECK(L.comp[OPF_COMP_SCALE_INV].rows == 3 && L.comp[OPF_COMP_SCALE_INV].cols == 304 &&
          L.comp[OPF_COMP_COL_SCALE_INV].rows == 3 && L.comp[OPF_COMP_COL_SCALE_INV].cols == 300,
          "block1d 303x300 scale grids");
    s = qspec(305, 256, OPF_SCALING_BLOCK_2D, OPF_E4M3, 3);
    CHECK_OK(NULL, opf_spec_layout(&s, &L));
    CHECK(L.comp[OPF_COMP_SCALE_INV].rows == 3 && L.comp[OPF_COMP_SCALE_INV].cols == 4 &&
          L.comp[OPF_COMP_COL_SCALE_INV].rows == 2 && L.comp[OPF_COMP_COL_SCALE_INV].cols == 4,
          "block2d 305x256 scale grids");
    s = qspec(64, 64, OPF_SCALING_MXFP8, OPF_E2M1, 3);
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_DTYPE, "mxfp8", "e2m1");
    s = qspec(64, 64, OPF_SCALING_NVFP4_1D, OPF_E4M3, 3);
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_DTYPE, "nvfp4", "e4m3");
    s = qspec(64, 64, OPF_SCALING_TENSOR, OPF_E4M3, 0);
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_INVALID_ARG, "usage 0x0");
    s = qspec(64, 64, OPF_SCALING_TENSOR, OPF_E4M3, 3);
    s.flags = OPF_SPEC_SWIZZLED;
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_INVALID_ARG, "fp8", "swizzled");
    s = qspec(64, 64, OPF_SCALING_TENSOR, OPF_E4M3, 3);
    s.dtype = OPF_I32;
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_DTYPE, "i32");
    s = opf_spec_make(2, (int64_t[]){4, -1}, OPF_F32);
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_SHAPE, "dim 1 is -1");
    s.ndim = 9;
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_SHAPE, "ndim 9");
    CHECK_FAILS(NULL, opf_spec_layout(NULL, &L), OPF_ERR_INVALID_ARG, "spec is NULL");
}

static void test_tensors(void)
{
    opf_ctx *ctx;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    opf_spec s = qspec(128, 64, OPF_SCALING_NVFP4_1D, OPF_E2M1, 3);
    opf_tensor t, u;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    opf_layout L;
    opf_spec_layout(&s, &L);
    CHECK(t.data[OPF_COMP_COL_DATA] == (char *)t.data[OPF_COMP_DATA] + L.comp[OPF_COMP_COL_DATA].offset,
          "component offsets");
    const uint8_t *sc = t.data[OPF_COMP_SCALE_INV];
    int zero = 1;
    for (size_t i = 0; i < L.comp[OPF_COMP_SCALE_INV].nbytes; i++) zero &= sc[i] == 0;
    CHECK(zero, "scales zero-filled");
    opf_tensor_retain(&t, &u);
    opf_tensor_release(&t);
    opf_alloc_stats a;
    opf_ctx_alloc_stats(ctx, &a);
    /* two counted allocations: the bytes and the slab of buffer headers */
    CHECK(a.n_alloc == 2 && a.n_free == 0, "retained buffer alive");
    opf_tensor_release(&u);
    opf_ctx_alloc_stats(ctx, &a);
    CHECK(a.n_free == 1 && a.bytes_live == 4096 && a.bytes_peak == 4096 + L.total_bytes,
          "freed, the header slab stays; peak %zu", a.bytes_peak);
    opf_tensor_release(&u);  /* zeroed: no-op */
    opf_tensor_release(NULL);
    s.ndim = -1;
    CHECK_FAILS(ctx, opf_tensor_alloc(ctx, &s, &t), OPF_ERR_SHAPE, "ndim -1");
    CHECK(t.buf == NULL && t.data[0] == NULL, "zeroed on failure");
    float mem[12];
    opf_spec p = opf_spec_make(2, (int64_t[]){3, 4}, OPF_F32);
    CHECK_OK(NULL, opf_tensor_wrap(&p, mem, &t));
    CHECK(t.data[OPF_COMP_DATA] == mem && t.buf == NULL, "wrap");
    CHECK_FAILS(NULL, opf_tensor_wrap(&p, NULL, &t), OPF_ERR_INVALID_ARG, "base is NULL");
    float mem2[12];
    CHECK_OK(NULL, opf_tensor_wrap(&t.spec, mem2, &t));  /* the spec may live in the target */
    CHECK(t.spec.ndim == 2 && t.spec.shape[1] == 4 && t.data[OPF_COMP_DATA] == mem2, "self wrap");
    opf_ctx_destroy(ctx);
}

static void test_swizzle(void)
{
    enum { R = 256, C = 12 };
    static uint8_t a[R * C], b[R * C], c[R * C];
    unsigned long long seed = 1;
    for (int i = 0; i < R * C; i++) a[i] = (uint8_t)opf_test_rand_u64(&seed);
    CHECK_OK(NULL, opf_swizzle_scales(a, b, R, C, false));
    /* a permutation: every index hit once, spot values */
    CHECK(b[opf_swizzle_index(37, 5, C)] == a[37 * C + 5], "element (37,5)");
    CHECK(opf_swizzle_index(0, 0, C) == 0 && opf_swizzle_index(1, 0, C) == 16 &&
          opf_swizzle_index(32, 0, C) == 4 && opf_swizzle_index(0, 4, C) == 512 &&
          opf_swizzle_index(128, 0, C) == 512 * (C / 4), "index formula");
    CHECK_OK(NULL, opf_unswizzle_scales(b, c, R, C, false));
    CHECK(memcmp(a, c, sizeof a) == 0, "round trip");
    /* transposed source (MXFP8 columnwise compact is C x R) */
    CHECK_OK(NULL, opf_swizzle_scales(a, b, R, C, true));
    CHECK(b[opf_swizzle_index(37, 5, C)] == a[5 * R + 37], "transposed element");
    CHECK_OK(NULL, opf_unswizzle_scales(b, c, R, C, true));
    CHECK(memcmp(a, c, sizeof a) == 0, "transposed round trip");
    CHECK_FAILS(NULL, opf_swizzle_scales(a, b, 100, C, false), OPF_ERR_SHAPE, "100 x 12");
    CHECK_FAILS(NULL, opf_swizzle_scales(a, b, R, 6, false), OPF_ERR_SHAPE, "256 x 6");
    CHECK_FAILS(NULL, opf_swizzle_scales(NULL, b, R, C, false), OPF_ERR_INVALID_ARG, "src");
}

static void test_tensor_swizzle(void)
{
    opf_ctx *ctx;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    opf_spec s = qspec(64, 256, OPF_SCALING_MXFP8, OPF_E4M3, 3);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    opf_layout L;
    opf_spec_layout(&s, &L);
    uint8_t *rs = t.data[OPF_COMP_SCALE_INV], *cs = t.data[OPF_COMP_COL_SCALE_INV];
    for (size_t i = 0; i < L.comp[OPF_COMP_SCALE_INV].nbytes; i++) rs[i] = (uint8_t)(i * 7);
    for (size_t i = 0; i < L.comp[OPF_COMP_COL_SCALE_INV].nbytes; i++) cs[i] = (uint8_t)(i * 13);
    uint8_t r0 = rs[5 * L.comp[OPF_COMP_SCALE_INV].cols + 3];
    uint8_t c0 = cs[1 * L.comp[OPF_COMP_COL_SCALE_INV].cols + 200];  /* row-block 1, column 200 */
    CHECK_OK(ctx, opf_tensor_swizzle(ctx, &t, true));
    CHECK(t.spec.flags & OPF_SPEC_SWIZZLED, "flag set");
    CHECK(rs[opf_swizzle_index(5, 3, L.comp[OPF_COMP_SCALE_INV].cols)] == r0, "rowwise moved");
    CHECK(cs[opf_swizzle_index(200, 1, L.comp[OPF_COMP_COL_SCALE_INV].rows)] == c0,
          "columnwise swizzled through the transposed view");
    CHECK_OK(ctx, opf_tensor_swizzle(ctx, &t, false));
    CHECK(rs[5 * L.comp[OPF_COMP_SCALE_INV].cols + 3] == r0 &&
          cs[1 * L.comp[OPF_COMP_COL_SCALE_INV].cols + 200] == c0, "back to compact");
    opf_tensor_release(&t);
    s = qspec(64, 256, OPF_SCALING_BLOCK_1D, OPF_E4M3, 3);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    CHECK_FAILS(ctx, opf_tensor_swizzle(ctx, &t, true), OPF_ERR_UNSUPPORTED, "fp8-block1d");
    opf_tensor_release(&t);
    opf_ctx_destroy(ctx);
}

/* Known-answer vectors of Philox4x32-10 (Random123's kat_vectors). */
static void test_philox(void)
{
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff,
         0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0,
         0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        opf_philox4x32_10(kat[i], kat[i] + 4, out);
        CHECK(memcmp(out, kat[i] + 6, sizeof out) == 0, "kat %d: %08x %08x %08x %08x", i, out[0],
              out[1], out[2], out[3]);
    }
}

int main(void)
{
    test_status();
    test_ctx();
    test_layouts();
    test_layout_errors();
    test_tensors();
    test_swizzle();
    test_tensor_swizzle();
    test_philox();
    TEST_DONE();
}
