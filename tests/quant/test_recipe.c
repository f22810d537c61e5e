/* test_recipe.c: recipe defaults and validation (backward override
 * included), the per-role quantizer rules, recipe state (delayed slots,
 * custom factories), quantizer specs, update_usage and requantize. */
#include "test.h"

static opf_quantizer role_q(const opf_recipe *r, const char *mt, opf_tensor_role t)
{
    opf_quantizer_role role = {mt, t, "fc1"};
    opf_quantizer q = opf_quantizer_default();
    CHECK_OK(NULL, opf_recipe_quantizer(r, &role, &q));
    return q;
}

static void test_rules(void)
{
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    CHECK(r.amax_history_len == 1024 && r.format == OPF_FORMAT_HYBRID && r.margin == 0, "defaults");
    opf_quantizer q = role_q(&r, "linear", OPF_ROLE_INPUT);
    CHECK(q.scaling == OPF_SCALING_TENSOR && q.qdtype == OPF_E4M3, "delayed input e4m3");
    q = role_q(&r, "linear", OPF_ROLE_GRAD_OUTPUT);
    CHECK(q.qdtype == OPF_E5M2, "HYBRID grads e5m2");
    r.format = OPF_FORMAT_E4M3;
    CHECK(role_q(&r, "linear", OPF_ROLE_GRAD_OUTPUT).qdtype == OPF_E4M3, "E4M3 grads");

    r = opf_recipe_default(OPF_RECIPE_CURRENT);
    r.power_2_scales = true;
    r.amax_epsilon = 1e-3f;
    q = role_q(&r, "linear", OPF_ROLE_WEIGHT);
    CHECK(q.scaling == OPF_SCALING_TENSOR && q.pow2_scales && q.amax_epsilon == 1e-3f && !q.delayed,
          "current");

    r = opf_recipe_default(OPF_RECIPE_BLOCK);
    CHECK(r.power_2_scales && r.format == OPF_FORMAT_E4M3, "block defaults");
    CHECK(role_q(&r, "linear", OPF_ROLE_INPUT).scaling == OPF_SCALING_BLOCK_1D, "x 1D");
    CHECK(role_q(&r, "linear", OPF_ROLE_WEIGHT).scaling == OPF_SCALING_BLOCK_2D, "w 2D");
    CHECK(role_q(&r, "linear", OPF_ROLE_GRAD_OUTPUT).scaling == OPF_SCALING_BLOCK_1D, "grad 1D");

    r = opf_recipe_default(OPF_RECIPE_MXFP8);
    r.mxfp8_2d_weights = true;
    CHECK(role_q(&r, "linear", OPF_ROLE_WEIGHT).mxfp8_2d, "mxfp8 2D linear weights");
    CHECK(!role_q(&r, "layernorm", OPF_ROLE_WEIGHT).mxfp8_2d, "not for other modules");
    CHECK(!role_q(&r, "linear", OPF_ROLE_INPUT).mxfp8_2d, "not for inputs");

    r = opf_recipe_default(OPF_RECIPE_NVFP4);
    q = role_q(&r, "linear", OPF_ROLE_INPUT);
    CHECK(q.scaling == OPF_SCALING_NVFP4_1D && q.qdtype == OPF_E2M1 && q.rht && !q.stochastic,
          "nvfp4 input: RHT, no SR");
    q = role_q(&r, "linear", OPF_ROLE_WEIGHT);
    CHECK(q.scaling == OPF_SCALING_NVFP4_2D && !q.rht && !q.stochastic, "nvfp4 weight: 2D");
    q = role_q(&r, "linear", OPF_ROLE_GRAD_OUTPUT);
    CHECK(q.rht && q.stochastic && q.scaling == OPF_SCALING_NVFP4_1D, "nvfp4 grad: RHT + SR");
    r.nvfp4_2d_weights = r.nvfp4_rht = r.nvfp4_stochastic = false;
    q = role_q(&r, "linear", OPF_ROLE_GRAD_OUTPUT);
    CHECK(!q.rht && !q.stochastic, "options off");
    CHECK(role_q(&r, "linear", OPF_ROLE_WEIGHT).scaling == OPF_SCALING_NVFP4_1D, "1D weights");

    r = opf_recipe_default(OPF_RECIPE_NONE);
    CHECK(role_q(&r, "linear", OPF_ROLE_INPUT).scaling == OPF_SCALING_NONE, "none");
}

static void test_validate(void)
{
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    r.amax_history_len = 0;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "amax_history_len 0");
    r = opf_recipe_default(OPF_RECIPE_CURRENT);
    r.format = OPF_FORMAT_E5M2;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "fp8-current", "format e5m2");
    r = opf_recipe_default(OPF_RECIPE_BLOCK);
    r.x_block_dim = 2;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "x 2, w 2", "2D x 2D");
    r.x_block_dim = 3;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "x 3");
    r = opf_recipe_default(OPF_RECIPE_CUSTOM);
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "factory");
    r = opf_recipe_default(OPF_RECIPE_CURRENT);
    r.amax_epsilon = -1.0f;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "amax_epsilon -1");
    r = opf_recipe_default(OPF_RECIPE_NVFP4);
    r.format = OPF_FORMAT_E4M3;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "nvfp4", "e2m1");
    r.kind = (opf_recipe_kind)42;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "kind 42");
}

static bool same_quantizers(const opf_recipe *a, const opf_recipe *b)
{
    for (int t = 0; t < OPF_ROLE_COUNT; t++) {
        opf_quantizer_role role = {"linear", (opf_tensor_role)t, "fc1"};
        opf_quantizer qa, qb;
        if (opf_recipe_quantizer(a, &role, &qa) || opf_recipe_quantizer(b, &role, &qb) ||
            !opf_quantizer_equal(&qa, &qb))
            return false;
    }
    return true;
}

static opf_status noop_factory(void *user, const opf_quantizer_role *role, opf_quantizer_request *out)
{
    (void)user, (void)role;
    out->quantizer.scaling = OPF_SCALING_TENSOR;
    return OPF_OK;
}

/* numerics.md 3.7: every recipe but delayed scaling takes an override, which
 * leaves the quantizer rules alone (the ops honour it). */
static void test_backward_override(opf_ctx *ctx)
{
    static const opf_recipe_kind ok_kinds[] = {OPF_RECIPE_NONE, OPF_RECIPE_CURRENT, OPF_RECIPE_BLOCK,
                                               OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4, OPF_RECIPE_CUSTOM};
    for (int k = 0; k < OPF_RECIPE_COUNT; k++)
        CHECK(opf_recipe_default((opf_recipe_kind)k).backward_override == OPF_BACKWARD_NONE,
              "%s: default override none", opf_recipe_name((opf_recipe_kind)k));
    for (size_t k = 0; k < sizeof ok_kinds / sizeof ok_kinds[0]; k++)
        for (int o = 0; o < OPF_BACKWARD_OVERRIDE_COUNT; o++) {
            opf_recipe r = opf_recipe_default(ok_kinds[k]), plain;
            r.factory = noop_factory;
            plain = r;
            r.backward_override = (opf_backward_override)o;
            CHECK(opf_recipe_validate(&r) == OPF_OK, "%s override %d: %s",
                  opf_recipe_name(ok_kinds[k]), o, opf_last_error(NULL));
            CHECK(same_quantizers(&r, &plain), "%s override %d: same quantizers",
                  opf_recipe_name(ok_kinds[k]), o);
        }
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    r.backward_override = OPF_BACKWARD_HIGH_PRECISION;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG,
                "backward_override must be none for fp8-delayed", "high_precision");
    r.backward_override = OPF_BACKWARD_DEQUANTIZED;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG,
                "backward_override must be none for fp8-delayed", "dequantized");
    opf_quantizer_role role = {"linear", OPF_ROLE_INPUT, "fc1"};
    opf_quantizer q = opf_quantizer_default();
    CHECK_FAILS(NULL, opf_recipe_quantizer(&r, &role, &q), OPF_ERR_INVALID_ARG, "fp8-delayed",
                "backward_override");
    CHECK(q.scaling == OPF_SCALING_NONE, "quantizer untouched on error");
    opf_recipe_state *rs = (opf_recipe_state *)&r;
    CHECK_FAILS(ctx, opf_recipe_state_create(ctx, &r, "linear", "fc1", 1, &rs), OPF_ERR_INVALID_ARG,
                "backward_override must be none for fp8-delayed");
    CHECK(rs == NULL, "no state on error");
    r = opf_recipe_default(OPF_RECIPE_MXFP8);
    r.backward_override = OPF_BACKWARD_OVERRIDE_COUNT;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "mxfp8", "backward_override 3",
                "0..2");
    r.backward_override = (opf_backward_override)-1;
    CHECK_FAILS(NULL, opf_recipe_validate(&r), OPF_ERR_INVALID_ARG, "backward_override -1");
    r = opf_recipe_default(OPF_RECIPE_NVFP4);
    r.backward_override = OPF_BACKWARD_DEQUANTIZED;
    CHECK_OK(ctx, opf_recipe_state_create(ctx, &r, "linear", "fc1", 1, &rs));
    CHECK(opf_recipe_state_recipe(rs)->backward_override == OPF_BACKWARD_DEQUANTIZED,
          "the state keeps the override");
    opf_recipe_state_destroy(rs);
}

static void test_state(opf_ctx *ctx)
{
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    r.amax_history_len = 3;
    opf_recipe_state *rs;
    CHECK_OK(ctx, opf_recipe_state_create(ctx, &r, "linear", "fc", 2, &rs));
    opf_delayed_state *f = opf_recipe_state_delayed(rs, false), *b = opf_recipe_state_delayed(rs, true);
    CHECK(f && b && opf_delayed_state_slots(f) == 6 && opf_delayed_state_slots(b) == 4, "slots");
    CHECK(opf_delayed_state_dtype(f) == OPF_E4M3 && opf_delayed_state_dtype(b) == OPF_E5M2, "dtypes");
    opf_quantizer q;
    CHECK_OK(ctx, opf_recipe_state_quantizer(rs, OPF_ROLE_WEIGHT, 1, &q));
    CHECK(q.delayed == f && q.slot == 4, "weight of gemm 1 is forward slot 4 (got %d)", q.slot);
    CHECK_OK(ctx, opf_recipe_state_quantizer(rs, OPF_ROLE_GRAD_INPUT, 1, &q));
    CHECK(q.delayed == b && q.slot == 3, "grad_input of gemm 1 is backward slot 3");
    CHECK_FAILS(NULL, opf_recipe_state_quantizer(rs, OPF_ROLE_INPUT, 2, &q), OPF_ERR_INVALID_ARG,
                "gemm 2", "2 gemms");
    CHECK_OK(ctx, opf_recipe_state_update(ctx, rs, false, NULL, NULL));
    opf_recipe_state_destroy(rs);
    opf_recipe_state_destroy(NULL);

    r = opf_recipe_default(OPF_RECIPE_MXFP8);
    CHECK_OK(ctx, opf_recipe_state_create(ctx, &r, "linear", "fc", 1, &rs));
    CHECK(!opf_recipe_state_delayed(rs, false), "stateless");
    CHECK_OK(ctx, opf_recipe_state_update(ctx, rs, true, NULL, NULL));
    opf_recipe_state_destroy(rs);
    CHECK_FAILS(ctx, opf_recipe_state_create(ctx, &r, "linear", "fc", 0, &rs), OPF_ERR_INVALID_ARG,
                "num_gemms 0");
}

/* Custom: weights MXFP8, grads delayed E5M2 with history 4, the rest current. */
static int factory_calls;
static opf_status my_factory(void *user, const opf_quantizer_role *role, opf_quantizer_request *out)
{
    factory_calls++;
    CHECK(user == (void *)&factory_calls, "user pointer");
    if (role->tensor == OPF_ROLE_WEIGHT) {
        out->quantizer.scaling = OPF_SCALING_MXFP8;
    } else if (role->tensor == OPF_ROLE_GRAD_OUTPUT || role->tensor == OPF_ROLE_GRAD_INPUT) {
        out->delayed = true;
        out->format = OPF_FORMAT_HYBRID;
        out->amax_history_len = 4;
    } else {
        out->quantizer.scaling = OPF_SCALING_TENSOR;
    }
    return OPF_OK;
}

static opf_status bad_factory(void *user, const opf_quantizer_role *role, opf_quantizer_request *out)
{
    (void)user, (void)out;
    return role->tensor == OPF_ROLE_OUTPUT ? OPF_ERR_UNSUPPORTED : OPF_OK;
}

static void test_custom(opf_ctx *ctx)
{
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CUSTOM);
    r.factory = my_factory;
    r.factory_user = &factory_calls;
    opf_recipe_state *rs;
    CHECK_OK(ctx, opf_recipe_state_create(ctx, &r, "linear", "proj", 1, &rs));
    CHECK(factory_calls > 0, "factory called");
    opf_quantizer q;
    opf_recipe_state_quantizer(rs, OPF_ROLE_WEIGHT, 0, &q);
    CHECK(q.scaling == OPF_SCALING_MXFP8 && !q.delayed, "weight from factory");
    opf_recipe_state_quantizer(rs, OPF_ROLE_INPUT, 0, &q);
    CHECK(q.scaling == OPF_SCALING_TENSOR && !q.delayed, "input current scaling");
    opf_recipe_state_quantizer(rs, OPF_ROLE_GRAD_OUTPUT, 0, &q);
    opf_delayed_state *b = opf_recipe_state_delayed(rs, true);
    CHECK(b && q.delayed == b && q.qdtype == OPF_E5M2 && opf_delayed_state_history_len(b) == 4,
          "grad delayed request");
    CHECK(!opf_recipe_state_delayed(rs, false), "no forward state");
    opf_recipe_state_destroy(rs);
    r.factory = bad_factory;
    CHECK_FAILS(ctx, opf_recipe_state_create(ctx, &r, "linear", "proj", 1, &rs),
                OPF_ERR_UNSUPPORTED, "factory failed", "output", "proj");
}

static void fill_random(float *x, int64_t n, unsigned long long seed, float sigma)
{
    for (int64_t i = 0; i < n; i++) x[i] = opf_test_normal(&seed, sigma);
}

static void test_quantizer_spec(void)
{
    opf_spec in = opf_spec_make(2, (int64_t[]){64, 128}, OPF_BF16), out;
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_MXFP8;
    q.swizzled = true;
    CHECK_OK(NULL, opf_quantizer_spec(&q, &in, &out));
    CHECK(out.scaling == OPF_SCALING_MXFP8 && out.dtype == OPF_BF16 && out.usage == 3 &&
          (out.flags & OPF_SPEC_SWIZZLED), "mxfp8 spec");
    q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.usage = OPF_USAGE_COLUMNWISE;
    CHECK_FAILS(NULL, opf_quantizer_spec(&q, &in, &out), OPF_ERR_INVALID_ARG, "per-tensor FP8",
                "columnwise copy alone");
    q.usage = 3;
    q.rht = true;
    CHECK_FAILS(NULL, opf_quantizer_spec(&q, &in, &out), OPF_ERR_INVALID_ARG, "nvfp4 options");
    q.rht = false;
    q.swizzled = true;
    CHECK_FAILS(NULL, opf_quantizer_spec(&q, &in, &out), OPF_ERR_INVALID_ARG, "swizzled");
    q.swizzled = false;
    in.dtype = OPF_I32;
    CHECK_FAILS(NULL, opf_quantizer_spec(&q, &in, &out), OPF_ERR_DTYPE, "i32");
    in.dtype = OPF_F32;
    in.scaling = OPF_SCALING_MXFP8;
    CHECK_FAILS(NULL, opf_quantizer_spec(&q, &in, &out), OPF_ERR_INVALID_ARG, "already quantized");
    in.scaling = OPF_SCALING_NONE;
    q.scaling = OPF_SCALING_NVFP4_1D;
    q.qdtype = OPF_E2M1;
    in.shape[0] = 40;
    CHECK_FAILS(NULL, opf_quantizer_spec(&q, &in, &out), OPF_ERR_SHAPE, "[40, 128]");
}

/* Quantize with q, then check update_usage's derived copy equals a fresh
 * quantization with both usages (byte for byte). */
static void check_derive(opf_ctx *ctx, opf_quantizer q, const opf_tensor *x, const char *what)
{
    opf_tensor both, one;
    q.usage = 3;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, x, &both));
    q.usage = OPF_USAGE_ROWWISE;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, x, &one));
    CHECK_OK(ctx, opf_tensor_update_usage(ctx, &one, 3));
    opf_layout L;
    opf_spec_layout(&both.spec, &L);
    CHECK(one.spec.usage == 3 && one.spec.flags == both.spec.flags, "%s: spec", what);
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present)
            CHECK(memcmp(one.data[c], both.data[c], L.comp[c].nbytes) == 0,
                  "%s: derived component %d differs", what, c);
    /* and back: drop rowwise, derive it from the columnwise copy */
    CHECK_OK(ctx, opf_tensor_update_usage(ctx, &one, OPF_USAGE_COLUMNWISE));
    CHECK(one.data[OPF_COMP_DATA] == NULL && one.spec.usage == OPF_USAGE_COLUMNWISE, "%s: dropped", what);
    CHECK_OK(ctx, opf_tensor_update_usage(ctx, &one, OPF_USAGE_ROWWISE));
    CHECK(memcmp(one.data[OPF_COMP_DATA], both.data[OPF_COMP_DATA], L.comp[OPF_COMP_DATA].nbytes) == 0 &&
          memcmp(one.data[OPF_COMP_SCALE_INV], both.data[OPF_COMP_SCALE_INV],
                 L.comp[OPF_COMP_SCALE_INV].nbytes) == 0, "%s: rowwise re-derived", what);
    CHECK(one.data[OPF_COMP_COL_DATA] == NULL, "%s: columnwise dropped after deriving", what);
    opf_tensor_release(&both);
    opf_tensor_release(&one);
}

static void test_usage(opf_ctx *ctx)
{
    enum { M = 256, K = 384 };
    static float xs[M * K];
    fill_random(xs, M * K, 3, 2.0f);
    opf_tensor x;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {M, K}, .dtype = OPF_F32}, xs, &x);
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    check_derive(ctx, q, &x, "fp8");
    q.scaling = OPF_SCALING_BLOCK_2D;
    check_derive(ctx, q, &x, "block2d");
    q.scaling = OPF_SCALING_MXFP8;
    q.mxfp8_2d = true;
    check_derive(ctx, q, &x, "mxfp8 2d");
    q.swizzled = true;
    check_derive(ctx, q, &x, "mxfp8 2d swizzled");
    q = opf_quantizer_default();
    q.scaling = OPF_SCALING_NVFP4_2D;
    q.qdtype = OPF_E2M1;
    check_derive(ctx, q, &x, "nvfp4 2d");
    q.swizzled = true;
    check_derive(ctx, q, &x, "nvfp4 2d swizzled");

    /* formats whose copies are independent refuse, leaving the tensor as it was */
    static const opf_scaling indep[] = {OPF_SCALING_MXFP8, OPF_SCALING_BLOCK_1D, OPF_SCALING_NVFP4_1D};
    for (int i = 0; i < 3; i++) {
        q = opf_quantizer_default();
        q.scaling = indep[i];
        q.qdtype = indep[i] == OPF_SCALING_NVFP4_1D ? OPF_E2M1 : OPF_E4M3;
        q.usage = OPF_USAGE_ROWWISE;
        opf_tensor t;
        CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &x, &t));
        opf_tensor before = t;
        CHECK_FAILS(ctx, opf_tensor_update_usage(ctx, &t, 3), OPF_ERR_UNSUPPORTED,
                    opf_scaling_name(indep[i]), "columnwise");
        CHECK(memcmp(&before, &t, sizeof t) == 0, "tensor untouched");
        opf_tensor_release(&t);
    }
    opf_tensor p;
    opf_spec ps = opf_spec_make(2, (int64_t[]){4, 4}, OPF_F32);
    opf_tensor_alloc(ctx, &ps, &p);
    CHECK_FAILS(ctx, opf_tensor_update_usage(ctx, &p, 1), OPF_ERR_INVALID_ARG, "not quantized");
    opf_tensor_release(&p);
    q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    opf_tensor t;
    opf_quantize_alloc(ctx, &q, &x, &t);
    CHECK_FAILS(ctx, opf_tensor_update_usage(ctx, &t, 0), OPF_ERR_INVALID_ARG, "usage 0x0");
    opf_tensor_release(&t);
}

static void test_requantize(opf_ctx *ctx)
{
    enum { M = 128, K = 256 };
    static float xs[M * K];
    fill_random(xs, M * K, 5, 1.0f);
    opf_tensor x, a, b, c;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {M, K}, .dtype = OPF_F32}, xs, &x);
    opf_quantizer mx = opf_quantizer_default(), cs = opf_quantizer_default();
    mx.scaling = OPF_SCALING_MXFP8;
    cs.scaling = OPF_SCALING_TENSOR;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &mx, &x, &a));
    /* MXFP8 values requantized to MXFP8 are exactly representable: same bytes */
    opf_spec s;
    opf_quantizer_spec(&mx, &x.spec, &s);
    opf_tensor_alloc(ctx, &s, &b);
    CHECK_OK(ctx, opf_requantize(ctx, &mx, &a, &b));
    static float y[M * K], z[M * K];
    opf_tensor yt, zt;
    opf_tensor_wrap(&x.spec, y, &yt);
    opf_tensor_wrap(&x.spec, z, &zt);
    for (unsigned w = OPF_USAGE_ROWWISE; w <= OPF_USAGE_ROWWISE; w++) {
        CHECK_OK(ctx, opf_dequantize(ctx, &a, w, &yt));
        CHECK_OK(ctx, opf_dequantize(ctx, &b, w, &zt));
        CHECK(memcmp(y, z, sizeof y) == 0, "mxfp8 -> mxfp8 keeps every value (copy %u)", w);
    }
    opf_quantizer_spec(&cs, &x.spec, &s);
    opf_tensor_alloc(ctx, &s, &c);
    CHECK_OK(ctx, opf_requantize(ctx, &cs, &a, &c));
    opf_dequantize(ctx, &a, OPF_USAGE_ROWWISE, &yt);
    opf_dequantize(ctx, &c, OPF_USAGE_ROWWISE, &zt);
    int bad = 0;
    for (int i = 0; i < M * K; i++) bad += fabsf(y[i] - z[i]) > 0.0675f + 0.125f * fabsf(y[i]);
    CHECK(bad == 0, "mxfp8 -> fp8 within E4M3 tolerance (%d off)", bad);
    CHECK_FAILS(ctx, opf_requantize(ctx, &cs, &x, &c), OPF_ERR_INVALID_ARG, "not quantized");
    CHECK_FAILS(ctx, opf_requantize(ctx, &mx, &a, &c), OPF_ERR_SHAPE, "does not match");
    opf_tensor_release(&a);
    opf_tensor_release(&b);
    opf_tensor_release(&c);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    test_rules();
    test_validate();
    test_backward_override(ctx);
    test_state(ctx);
    test_custom(ctx);
    test_quantizer_spec();
    test_usage(ctx);
    test_requantize(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
