/* test_recipe_names.c: recipe and delayed-state messages name enum values
 * (opf_format_name, opf_amax_algo_name, opf_recipe_name) instead of numbers,
 * and opf_quantize_alloc leaves *out zeroed when it fails. */
#include "test.h"

static void test_names(void)
{
    CHECK(!strcmp(opf_format_name(OPF_FORMAT_E4M3), "e4m3") &&
          !strcmp(opf_format_name(OPF_FORMAT_E5M2), "e5m2") &&
          !strcmp(opf_format_name(OPF_FORMAT_HYBRID), "hybrid") &&
          !strcmp(opf_format_name(OPF_FORMAT_E2M1), "e2m1") &&
          !strcmp(opf_format_name((opf_format)42), "invalid"), "opf_format_name");
    CHECK(!strcmp(opf_amax_algo_name(OPF_AMAX_MAX), "max") &&
          !strcmp(opf_amax_algo_name(OPF_AMAX_MOST_RECENT), "most_recent") &&
          !strcmp(opf_amax_algo_name((opf_amax_algo)-1), "invalid"), "opf_amax_algo_name");
}

static void test_messages(opf_ctx *ctx)
{
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    r.format = OPF_FORMAT_E5M2;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "fp8-delayed", "format e5m2");
    r.format = (opf_format)9;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "format 9 (invalid)");
    r = opf_recipe_default(OPF_RECIPE_NVFP4);
    r.format = OPF_FORMAT_HYBRID;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "format hybrid", "e2m1");
    r = opf_recipe_default(OPF_RECIPE_DELAYED);
    r.amax_algo = (opf_amax_algo)7;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "amax_algo 7 (invalid)", "max",
                "most_recent");
    r.kind = (opf_recipe_kind)77;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "kind 77 (invalid)");
    opf_delayed_state *ds = NULL;
    CHECK_FAILS(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E2M1, 0, 4, OPF_AMAX_MAX, false, 3, &ds),
                OPF_ERR_INVALID_ARG, "format e2m1");
    CHECK_FAILS(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, 4, (opf_amax_algo)5, false, 3,
                                              &ds), OPF_ERR_INVALID_ARG, "amax algorithm 5 (invalid)");
}

/* A refused opf_quantize_alloc: *out all zero bytes, safe to release. */
static void test_quantize_alloc_out(opf_ctx *ctx)
{
    float x[64] = {0};
    opf_spec s = opf_spec_make(2, (int64_t[]){4, 16}, OPF_F32);
    opf_tensor in, out, zero;
    opf_tensor_wrap(&s, x, &in);
    memset(&zero, 0, sizeof zero);
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_MXFP8;  /* 16 columns: not a multiple of 32 */
    q.qdtype = OPF_E4M3;
    q.usage = OPF_USAGE_ROWWISE;
    memset(&out, 0xA5, sizeof out);
    opf_status st = opf_quantize_alloc(ctx, &q, &in, &out);
    CHECK(st != OPF_OK && !memcmp(&out, &zero, sizeof out), "a refused quantize_alloc (%s) left "
          "*out unzeroed", opf_status_str(st));
    /* refused by the quantize itself, after the allocation: a NULL data pointer */
    q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.qdtype = OPF_E4M3;
    q.usage = OPF_USAGE_ROWWISE;
    in.data[0] = NULL;
    memset(&out, 0xA5, sizeof out);
    st = opf_quantize_alloc(ctx, &q, &in, &out);
    CHECK(st != OPF_OK && !memcmp(&out, &zero, sizeof out), "a refused quantize_alloc (%s) left "
          "*out unzeroed", opf_status_str(st));
    opf_tensor_release(&out);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    test_names();
    test_messages(ctx);
    test_quantize_alloc_out(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
