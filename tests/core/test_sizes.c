/* test_sizes.c: checked size arithmetic (issue 13, item 2). Every bound of
 * a spec, a context and a recipe is refused with a message instead of
 * wrapping: huge shapes, more than OPF_MAX_DIMS dims, huge allocations,
 * delayed-state sizes, margins and thread counts. */
#include <limits.h>
#include <stdint.h>

#include "test.h"

static void test_huge_spec(opf_ctx *ctx)
{
    int64_t big = (int64_t)1 << 31;
    opf_spec s = opf_spec_make(2, (int64_t[]){big, big}, OPF_F32);
    opf_layout L;
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_SHAPE, "2147483648,2147483648");
    opf_tensor t;
    CHECK_FAILS(ctx, opf_tensor_alloc(ctx, &s, &t), OPF_ERR_SHAPE, "f32[2147483648,2147483648]");
    CHECK(t.buf == NULL, "a refused alloc leaves no buffer");
    CHECK(opf_spec_numel(&s) == -1, "numel %lld", (long long)opf_spec_numel(&s));
    /* Past OPF_MAX_NUMEL, and a zero dim does not hide the overflow. */
    opf_spec z = opf_spec_make(3, (int64_t[]){INT64_MAX / 2, 4, 0}, OPF_F32);
    CHECK(opf_spec_numel(&z) == -1, "numel %lld", (long long)opf_spec_numel(&z));
    CHECK_FAILS(NULL, opf_spec_layout(&z, &L), OPF_ERR_SHAPE, "elements");
    /* Within the count but past the bytes. */
    opf_spec f = opf_spec_make(2, (int64_t[]){(int64_t)1 << 24, (int64_t)1 << 24}, OPF_F32);
    CHECK(opf_spec_numel(&f) == OPF_MAX_NUMEL, "numel %lld", (long long)opf_spec_numel(&f));
    CHECK_FAILS(NULL, opf_spec_layout(&f, &L), OPF_ERR_SHAPE, "bytes");
}

static void test_ndim(void)
{
    opf_spec s = opf_spec_make(2, (int64_t[]){3, 4}, OPF_BF16);
    s.ndim = OPF_MAX_DIMS + 1;
    CHECK(opf_spec_numel(&s) == -1, "numel of ndim 9: %lld", (long long)opf_spec_numel(&s));
    char buf[128];
    opf_spec_str(&s, buf, sizeof buf);
    CHECK(!strcmp(buf, "bf16[ndim 9]"), "str \"%s\"", buf);
    opf_layout L;
    CHECK_FAILS(NULL, opf_spec_layout(&s, &L), OPF_ERR_SHAPE, "ndim 9");
    s.ndim = -1;
    CHECK(opf_spec_numel(&s) == -1, "numel of ndim -1");
}

static void test_ctx_alloc(opf_ctx *ctx)
{
    CHECK(opf_ctx_alloc(ctx, SIZE_MAX) == NULL, "SIZE_MAX bytes");
    CHECK(opf_ctx_alloc(ctx, (size_t)OPF_MAX_BYTES + 1) == NULL, "OPF_MAX_BYTES + 1 bytes");
    opf_alloc_stats st;
    opf_ctx_alloc_stats(ctx, &st);
    CHECK(st.bytes_live == 0, "live %zu", st.bytes_live);
}

static void test_delayed_sizes(opf_ctx *ctx)
{
    opf_delayed_state *d = NULL;
    CHECK_FAILS(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, INT_MAX, OPF_AMAX_MAX,
                                              false, INT_MAX, &d),
                OPF_ERR_SHAPE, "2147483647 slots", "bytes");
    CHECK(d == NULL, "no state");
    CHECK_FAILS(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 300, 4, OPF_AMAX_MAX, false,
                                              1, &d),
                OPF_ERR_INVALID_ARG, "margin 300", "-64..64");
    CHECK_FAILS(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, -65, 4, OPF_AMAX_MAX, false,
                                              1, &d),
                OPF_ERR_INVALID_ARG, "margin -65");
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    r.margin = 300;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "margin 300");
    r.margin = OPF_MAX_MARGIN;
    CHECK_OK(NULL, opf_recipe_validate(&r));
}

static void test_threads(void)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.num_threads = 4096;
    opf_ctx *c = NULL;
    CHECK_FAILS(NULL, opf_ctx_create(&o, &c), OPF_ERR_INVALID_ARG, "num_threads 4096", "1024");
    CHECK(c == NULL, "no context");
    o.num_threads = OPF_MAX_THREADS;
    CHECK_OK(NULL, opf_ctx_create(&o, &c));
    opf_ctx_destroy(c);
}

static void test_linear(opf_ctx *ctx)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    int64_t big = (int64_t)1 << 31;
    CHECK_FAILS(ctx, opf_seq_append_linear(seq, big, big, false, OPF_F32, "huge"), OPF_ERR_SHAPE,
                "2147483648");
    CHECK(opf_seq_len(seq) == 0, "len %d", opf_seq_len(seq));
    opf_seq_destroy(seq);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    test_huge_spec(ctx);
    test_ndim();
    test_ctx_alloc(ctx);
    test_delayed_sizes(ctx);
    test_threads();
    test_linear(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
