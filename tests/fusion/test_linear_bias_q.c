/* test_linear_bias_q.c: Linear -> Bias backward with the bias quantizing
 * the linear's dy (bias.c, elem.h's dbias_q).
 *
 * Seq [basic_linear, bias] against the reference composition: the same ops
 * with an identity between them, so the bias has no prevQ, passes dy
 * through plain and the linear quantizes it itself (what every step did
 * before the bias quantized). Under every recipe, f32 and bf16, fusions on
 * and off: dx, dW, db and the linear's delayed-scaling state byte for byte
 * (same weights, same RNG state); the linear took its dy as it came
 * (OPF_LIN_AS_IS: no second quantization, no second amax record) and the
 * reference's quantized it (OPF_LIN_QUANTIZE). Also the bias on its own:
 * without prevQ dx is dy itself (no copy), with one dx is opf_quantize of
 * dy and the fake's spec is the real one's; and bad gradients fail naming
 * the op and the values. */
#include "test.h"

#include "op/op-impl.h"
#include "ops/basic/linear-impl.h"

enum { M = 96, K = 64, N = 96, STEPS = 3 };

static const opf_recipe_kind kinds[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                        OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
enum { NK = sizeof kinds / sizeof kinds[0] };

static opf_op *mk(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

static opf_tensor rand_t(opf_ctx *ctx, unsigned long long *s, int64_t r, int64_t c, opf_dtype dt)
{
    opf_spec sp = opf_spec_make(2, (int64_t[]){r, c}, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sp, &t));
    float *f = malloc(sizeof(float) * (size_t)(r * c));
    for (int64_t i = 0; i < r * c; i++) f[i] = opf_test_normal(s, 1.0f);
    CHECK_OK(ctx, opf_convert(f, OPF_F32, t.data[0], dt, (size_t)(r * c)));
    free(f);
    return t;
}

/* [linear, (identity), bias] with the given weight and bias values. */
static opf_seq *lb_seq(opf_ctx *ctx, opf_dtype dt, bool identity, const opf_tensor *w,
                       const opf_tensor *b, bool fuse)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_basic_linear_config lc = {.in_features = K, .out_features = N, .dtype = dt};
    opf_bias_config bc = {N, dt};
    opf_op *lin = mk(ctx, "basic_linear", &lc, "fc"), *bias = mk(ctx, "bias", &bc, "b");
    CHECK_OK(ctx, opf_tensor_copy(ctx, w, &opf_op_param(lin, 0)->value));
    CHECK_OK(ctx, opf_tensor_copy(ctx, b, &opf_op_param(bias, 0)->value));
    opf_seq_append(seq, lin);
    if (identity) opf_seq_append(seq, mk(ctx, "identity", NULL, "id"));
    opf_seq_append(seq, bias);
    opf_seq_set_fusions(seq, fuse);
    return seq;
}

typedef struct lb_run {
    opf_tensor dx[STEPS];
    int        dy_mode;  /* the linear's, last step */
} lb_run;

/* STEPS forward + backward steps of seq on xs / dys, the RNG reset first. */
static void lb_steps(opf_ctx *ctx, opf_seq *seq, const opf_recipe *r, const opf_tensor *xs,
                     const opf_tensor *dys, lb_run *out)
{
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r;
    opf_ctx_set_rng(ctx, 0xB1A5, 0);
    for (int s = 0; s < STEPS; s++) {
        opf_tensor y;
        CHECK_OK(ctx, opf_seq_forward(seq, &xs[s], &call, &y, NULL));
        CHECK_OK(ctx, opf_seq_backward(seq, &dys[s], NULL, &out->dx[s], NULL));
        opf_tensor_release(&y);
    }
    out->dy_mode = ((const opf_linear_bwd *)opf_seq_at(seq, 0)->bwd_args)->dy_mode;
}

static bool same_delayed(opf_op *a, opf_op *b)
{
    opf_recipe_state *ra = opf_op_recipe_state(a), *rb = opf_op_recipe_state(b);
    if (!ra || !rb) return !ra && !rb;
    for (int bwd = 0; bwd < 2; bwd++) {
        opf_delayed_state *x = opf_recipe_state_delayed(ra, bwd), *y = opf_recipe_state_delayed(rb, bwd);
        if (!x || !y) {
            if (x || y) return false;
            continue;
        }
        int n = opf_delayed_state_history_len(x);
        if (memcmp(opf_delayed_state_history(x), opf_delayed_state_history(y), sizeof(float) * (size_t)n) ||
            memcmp(opf_delayed_state_scale(x), opf_delayed_state_scale(y), sizeof(float)))
            return false;
    }
    return true;
}

static void lb_case(opf_ctx *ctx, opf_recipe_kind rk, opf_dtype dt, bool fuse, unsigned long long *s)
{
    char w[128];
    snprintf(w, sizeof w, "linear -> bias %s %s fusions %s", opf_recipe_name(rk), opf_dtype_name(dt),
             fuse ? "on" : "off");
    opf_tensor wt = rand_t(ctx, s, N, K, dt), bt = rand_t(ctx, s, 1, N, dt), xs[STEPS], dys[STEPS];
    bt.spec = opf_spec_make(1, (int64_t[]){N}, dt);
    for (int i = 0; i < STEPS; i++) xs[i] = rand_t(ctx, s, M, K, dt), dys[i] = rand_t(ctx, s, M, N, dt);
    opf_recipe r = opf_recipe_default(rk);
    opf_seq *got = lb_seq(ctx, dt, false, &wt, &bt, fuse), *ref = lb_seq(ctx, dt, true, &wt, &bt, fuse);
    lb_run a, b;
    lb_steps(ctx, got, rk ? &r : NULL, xs, dys, &a);
    lb_steps(ctx, ref, rk ? &r : NULL, xs, dys, &b);
    bool same_dx = true;
    for (int i = 0; i < STEPS; i++) same_dx = same_dx && opf_test_same_bytes(&a.dx[i], &b.dx[i]);
    opf_op *gl = opf_seq_at(got, 0), *rl = opf_seq_at(ref, 0), *gb = opf_seq_at(got, 1), *rb = opf_seq_at(ref, 2);
    CHECK(same_dx, "%s: dx differs from the reference", w);
    CHECK(opf_test_same_bytes(&opf_op_param(gl, 0)->grad, &opf_op_param(rl, 0)->grad),
          "%s: dW differs from the reference", w);
    CHECK(opf_test_same_bytes(&opf_op_param(gb, 0)->grad, &opf_op_param(rb, 0)->grad),
          "%s: db differs from the reference", w);
    CHECK(same_delayed(gl, rl), "%s: the linear's delayed state differs from the reference", w);
    int want = rk ? OPF_LIN_QUANTIZE : OPF_LIN_AS_IS;
    CHECK(a.dy_mode == OPF_LIN_AS_IS && b.dy_mode == want,
          "%s: the linear's dy mode %d (want %d, as is), the reference's %d (want %d)", w,
          a.dy_mode, OPF_LIN_AS_IS, b.dy_mode, want);
    for (int i = 0; i < STEPS; i++)
        opf_tensor_release(&a.dx[i]), opf_tensor_release(&b.dx[i]), opf_tensor_release(&xs[i]),
            opf_tensor_release(&dys[i]);
    opf_tensor_release(&wt), opf_tensor_release(&bt);
    opf_seq_destroy(got), opf_seq_destroy(ref);
}

static void test_seq(opf_ctx *ctx)
{
    unsigned long long s = 0x11B1A5ull;
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16};
    for (int k = 0; k < NK; k++)
        for (int d = 0; d < 2; d++)
            for (int f = 0; f < 2; f++) lb_case(ctx, kinds[k], dts[d], f, &s);
}

/* The bias alone, forward with prevQ q (NULL: none), then backward of dy. */
static opf_status bias_bwd(opf_ctx *ctx, opf_op *b, const opf_quantizer *q, const opf_tensor *x,
                           const opf_tensor *dy, opf_tensor *dx)
{
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_fwd_env env = {.ctx = ctx, .x = x, .prev_grad_q = q, .recipe = &r, .requires_grad = true};
    opf_op_ctx octx;
    opf_tensor y;
    memset(&octx, 0, sizeof octx);
    opf_status st = opf_op_forward(b, &env, &octx, &y);
    opf_bwd_env benv = {.ctx = ctx, .dy = dy};
    if (!st) st = opf_op_backward(b, &octx, &benv, dx, NULL);
    opf_tensor_release(&y);
    opf_op_ctx_clear(&octx);
    return st;
}

static void test_alone(opf_ctx *ctx)
{
    unsigned long long s = 0xA10Eull;
    opf_bias_config bc = {N, OPF_BF16};
    opf_op *b = mk(ctx, "bias", &bc, "b");
    opf_tensor x = rand_t(ctx, &s, M, N, OPF_BF16), dy = rand_t(ctx, &s, M, N, OPF_BF16), dx, want;
    CHECK_OK(ctx, bias_bwd(ctx, b, NULL, &x, &dy, &dx));
    CHECK(dx.data[0] == dy.data[0], "bias without prevQ: dx is not dy itself");
    opf_tensor_release(&dx);
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR, q.qdtype = OPF_E5M2;
    CHECK_OK(ctx, bias_bwd(ctx, b, &q, &x, &dy, &dx));
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &dy, &want));
    CHECK(dx.data[0] != dy.data[0] && opf_test_same_bytes(&dx, &want),
          "bias with prevQ: dx is not opf_quantize of dy");
    opf_spec fake[OPF_OP_MAX_GRADS];
    CHECK(!opf_op_class_of(b)->backward_fake(b->bwd_args, fake) && opf_spec_equal(&fake[0], &dx.spec),
          "bias with prevQ: the fake's dx spec is not the real one's");
    opf_tensor_release(&dx), opf_tensor_release(&want);
    opf_tensor_release(&x), opf_tensor_release(&dy);
    opf_op_destroy(b);
}

/* Bad gradients: a wrong feature count, a non-float dtype, a shape the
 * previous op's format cannot take. */
static void test_bad(opf_ctx *ctx)
{
    unsigned long long s = 0xBADull;
    opf_bias_config bc = {N, OPF_F32};
    opf_op *b = mk(ctx, "bias", &bc, "b");
    opf_tensor x = rand_t(ctx, &s, M, N, OPF_F32), dy = rand_t(ctx, &s, M, N + 1, OPF_F32), dx;
    CHECK_FAILS(ctx, bias_bwd(ctx, b, NULL, &x, &dy, &dx), OPF_ERR_SHAPE, "bias \"b\"", "97 features",
                "has 96");
    opf_tensor_release(&dy);
    opf_spec is = opf_spec_make(2, (int64_t[]){M, N}, OPF_I32);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &is, &dy));
    CHECK_FAILS(ctx, bias_bwd(ctx, b, NULL, &x, &dy, &dx), OPF_ERR_DTYPE, "bias \"b\"", "i32");
    opf_tensor_release(&dy), opf_tensor_release(&x);
    opf_quantizer q = opf_quantizer_default();  /* NVFP4 takes multiples of 16 */
    opf_recipe nv = opf_recipe_default(OPF_RECIPE_NVFP4);
    opf_quantizer_role qr = {"linear", OPF_ROLE_GRAD_OUTPUT, "test"};
    CHECK_OK(ctx, opf_recipe_quantizer(&nv, &qr, &q));
    x = rand_t(ctx, &s, 5, N, OPF_F32), dy = rand_t(ctx, &s, 5, N, OPF_F32);
    CHECK_FAILS(ctx, bias_bwd(ctx, b, &q, &x, &dy, &dx), OPF_ERR_SHAPE, "bias \"b\"", "nvfp4");
    opf_tensor_release(&dy), opf_tensor_release(&x);
    opf_op_destroy(b);
}

int main(void)
{
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(NULL, &ctx));
    test_seq(ctx);
    test_alone(ctx);
    test_bad(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
