/* test_nonfinite.c: non-finite values (issue 13, item 4). One NaN or Inf
 * among 2,048 input elements makes every gradient non-finite; the optimizer
 * step then changes nothing (weights, master weights, AdamW moments, step
 * count), counts the skip and warns once, and the next finite step trains
 * as usual. opf_seq_check_finite stops a forward or backward at the first
 * non-finite output, naming the op; the refused call can be retried. */
#include <math.h>

#include "test.h"

enum { T = 64, H = 32 };

static opf_test_warnings W = {NULL, 0, ""};

static opf_ctx *make_ctx(void) { return opf_test_ctx_catching(&W); }

/* layernorm -> linear + bias -> gelu in f32 */
static opf_seq *make_seq(opf_ctx *ctx)
{
    opf_seq *seq;
    opf_op *op;
    opf_norm_config ln = {H, 1e-5, false, OPF_F32};
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_op_create(ctx, "layernorm", &ln, "ln", &op));
    CHECK_OK(ctx, opf_seq_append(seq, op));
    CHECK_OK(ctx, opf_seq_append_linear(seq, H, H, true, OPF_F32, "fc"));
    CHECK_OK(ctx, opf_op_create(ctx, "gelu", NULL, "act", &op));
    CHECK_OK(ctx, opf_seq_append(seq, op));
    return seq;
}

static float xv[T * H], gv[T * H];

static void fill_inputs(void)
{
    unsigned long long s = 11;
    for (int i = 0; i < T * H; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        xv[i] = (float)((int)(s >> 40) % 2001 - 1000) / 500.0f;
        gv[i] = (float)((int)(s >> 20) % 201 - 100) / 1e3f;
    }
}

/* zero_grad, forward, backward on x (xv with element bad set to v when
 * bad >= 0); recipe may be NULL. */
static void fwd_bwd(opf_ctx *ctx, opf_seq *seq, const opf_recipe *recipe, int bad, float v)
{
    float xb[T * H];
    memcpy(xb, xv, sizeof xb);
    if (bad >= 0) xb[bad] = v;
    opf_test_fwd_bwd(ctx, seq, recipe, T, H, xb, gv);
}

/* Every byte the optimizer may write: parameters, master weights, moments. */
static size_t snapshot(opf_seq *seq, opf_optim *opt, unsigned char *buf, size_t cap, bool *finite)
{
    size_t n = 0;
    *finite = true;
    for (int k = 0; k < opf_optim_num_slots(opt); k++) {
        opf_param *p;
        float *a[3];
        int64_t cnt;
        CHECK_OK(NULL, opf_optim_slot(opt, k, &p, &a[0], &a[1], &a[2], &cnt));
        for (int w = 0; w < 3; w++)
            for (int64_t i = 0; a[w] && i < cnt; i++) {
                *finite &= isfinite(a[w][i]) != 0;
                if (n + 4 <= cap) memcpy(buf + n, &a[w][i], 4);
                n += 4;
            }
        size_t pb = opf_dtype_nbytes(p->value.spec.dtype, (size_t)cnt);
        if (n + pb <= cap) memcpy(buf + n, p->value.data[0], pb);
        n += pb;
    }
    (void)seq;
    return n;
}

static void test_optim_skip(opf_optim_kind kind, float bad_value)
{
    opf_ctx *ctx = make_ctx();
    opf_seq *seq = make_seq(ctx);
    opf_optim *opt;
    CHECK_OK(ctx, opf_optim_create(ctx, seq, kind, NULL, &opt));
    static unsigned char before[1 << 16], after[1 << 16];
    bool finite;
    fwd_bwd(ctx, seq, NULL, -1, 0);
    CHECK_OK(ctx, opf_optim_step(opt));  /* moments nonzero from here */
    size_t nb = snapshot(seq, opt, before, sizeof before, &finite);
    CHECK(nb <= sizeof before && finite, "snapshot");
    for (int rep = 0; rep < 2; rep++) {
        fwd_bwd(ctx, seq, NULL, 1234, bad_value);  /* 1 of 2,048 */
        CHECK_OK(ctx, opf_optim_step(opt));
        size_t na = snapshot(seq, opt, after, sizeof after, &finite);
        CHECK(finite && na == nb && !memcmp(before, after, nb),
              "optim kind %d, %g at 1 of %d inputs: a skipped step changed the state "
              "(finite %d)", (int)kind, (double)bad_value, T * H, (int)finite);
        CHECK(opf_optim_step_count(opt) == 1, "step count %lld, want 1",
              (long long)opf_optim_step_count(opt));
        CHECK(opf_optim_skipped_steps(opt) == rep + 1, "skipped %lld, want %d",
              (long long)opf_optim_skipped_steps(opt), rep + 1);
        CHECK(W.n == 1 && strstr(W.last, "opf_optim_step") && strstr(W.last, "NaN"),
              "want one warning, got %d: %s", W.n, W.last);
    }
    fwd_bwd(ctx, seq, NULL, -1, 0);  /* finite again: trains */
    CHECK_OK(ctx, opf_optim_step(opt));
    size_t na = snapshot(seq, opt, after, sizeof after, &finite);
    CHECK(finite && na == nb && memcmp(before, after, nb), "a finite step after the skips");
    CHECK(opf_optim_step_count(opt) == 2 && opf_optim_skipped_steps(opt) == 2, "counts");
    opf_optim_destroy(opt);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
}

static void test_check_finite(void)
{
    opf_ctx *ctx = make_ctx();
    opf_seq *seq = make_seq(ctx);
    float xb[T * H], gb[T * H];
    memcpy(xb, xv, sizeof xb);
    memcpy(gb, gv, sizeof gb);
    xb[77] = NAN;
    opf_spec sp = {.ndim = 2, .shape = {T, H}, .dtype = OPF_F32};
    opf_tensor x, dy, y, dx;
    opf_tensor_wrap(&sp, xb, &x);
    opf_tensor_wrap(&sp, gb, &dy);
    opf_seq_call call = opf_seq_call_default();
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));  /* off: no check */
    opf_tensor_release(&y);
    opf_seq_discard(seq);
    opf_seq_check_finite(seq, true);
    CHECK_FAILS(ctx, opf_seq_forward(seq, &x, &call, &y, NULL), OPF_ERR_STATE, "op 0",
                "layernorm \"ln\"", "forward output 0", "NaN");
    xb[77] = xv[77];
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));  /* nothing pending after the refusal */
    opf_tensor_release(&y);
    gb[5] = INFINITY;  /* the gelu's dx is non-finite (bias + gelu fused in the backward) */
    CHECK_FAILS(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL), OPF_ERR_STATE, "op 2",
                "backward_activation_bias", ",act)", "backward input gradient", "infinity");
    gb[5] = gv[5];
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, NULL));  /* the forward was kept */
    opf_tensor_release(&dx);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
}

int main(void)
{
    fill_inputs();
    test_optim_skip(OPF_OPTIM_ADAMW, NAN);
    test_optim_skip(OPF_OPTIM_ADAMW, INFINITY);
    test_optim_skip(OPF_OPTIM_SGD, -INFINITY);
    test_check_finite();
    TEST_DONE();
}
