/* test_delayed.c: the delayed-scaling state (docs/numerics.md 3.1, 2.2)
 * against hand-computed scales and histories over several steps, both amax
 * algorithms, margin, history 3 and 1, zero / inf / tiny amaxes, the
 * reduction hook, the amax the quantizer accumulates, the batched update
 * of many states against one at a time, and bad inputs. */
#include <float.h>

#include "quant/quant-impl.h"
#include "test.h"

/* Bitwise float equality (so -0 and NaN would not slip through). */
static int same(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

static opf_ctx *new_ctx(void)
{
    opf_ctx *ctx = NULL;
    opf_status st = opf_ctx_create(NULL, &ctx);
    CHECK(st == OPF_OK && ctx, "ctx");
    return ctx;
}

/* History column of slot j as H[0..L) (row-major [L][n]). */
static int hist_is(opf_delayed_state *s, int j, const float *want)
{
    int L = opf_delayed_state_history_len(s), n = opf_delayed_state_slots(s);
    const float *h = opf_delayed_state_history(s);
    for (int i = 0; i < L; i++)
        if (!same(h[i * n + j], want[i])) {
            fprintf(stderr, "  slot %d H[%d] = %g, want %g\n", j, i, (double)h[i * n + j],
                    (double)want[i]);
            return 0;
        }
    return 1;
}

/* One scripted step: the amax each slot saw, then the scale and history
 * expected after the update. Forward HYBRID (448), margin 1: scaled_max 224. */
typedef struct step {
    float amax;
    float scale_max, scale_recent;  /* expected scale per algorithm */
    float hist[3];                  /* expected history (same for both algorithms) */
} step;

static const step script[] = {
    {2.0f, 112.0f, 112.0f, {0, 0, 2}},       /* window {2,0,0} */
    {0.0f, 112.0f, 112.0f, {0, 0, 2}},       /* zero amax: no roll, scale kept */
    {8.0f, 28.0f, 28.0f, {0, 2, 8}},         /* window {8,0,2} */
    {1.0f, 28.0f, 224.0f, {0, 8, 1}},        /* window {1,2,8} */
    {4.0f, 28.0f, 56.0f, {0, 1, 4}},         /* window {4,8,1}: 2 dropped */
    {0.5f, 56.0f, 448.0f, {0, 4, 0.5f}},     /* window {0.5,1,4}: 8 dropped */
    {INFINITY, 56.0f, 448.0f, {0, 0.5f, INFINITY}},  /* inf: roll, scale kept */
    {3.0f, 56.0f, 224.0f / 3.0f, {0, INFINITY, 3}},  /* max window has inf: kept */
    /* 1e-45f is the smallest subnormal: 224 / it overflows to FLT_MAX. */
    {1e-45f, 56.0f, FLT_MAX, {0, 3, 1e-45f}},            /* inf still in the window */
    {1e-45f, 224.0f / 3.0f, FLT_MAX, {0, 1e-45f, 1e-45f}}, /* window {1e-45,3,1e-45} */
    {1e-45f, FLT_MAX, FLT_MAX, {0, 1e-45f, 1e-45f}},     /* all tiny: FLT_MAX */
};

static void test_script(opf_amax_algo algo)
{
    opf_ctx *ctx = new_ctx();
    opf_delayed_state *s = NULL;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 1.0f, 3, algo, false, 2, &s));
    CHECK(opf_delayed_state_dtype(s) == OPF_E4M3, "forward hybrid is e4m3");
    float *scale = opf_delayed_state_scale(s), *h = opf_delayed_state_history(s);
    for (size_t t = 0; t < sizeof script / sizeof script[0]; t++) {
        const step *st = &script[t];
        h[0] = st->amax;       /* slot 0 follows the script */
        h[1] = 0.0f;           /* slot 1 never sees data: stays at scale 1 */
        CHECK_OK(ctx, opf_delayed_state_update(ctx, s, NULL, NULL));
        float want = algo == OPF_AMAX_MAX ? st->scale_max : st->scale_recent;
        CHECK(same(scale[0], want), "algo %d step %zu: scale %.9g, want %.9g", (int)algo, t,
              (double)scale[0], (double)want);
        CHECK(hist_is(s, 0, st->hist), "algo %d step %zu: history", (int)algo, t);
        CHECK(same(scale[1], 1.0f), "idle slot keeps scale 1");
    }
    opf_delayed_state_reset(s);
    CHECK(same(scale[0], 1.0f) && same(h[0], 0.0f) && same(h[2 * 2], 0.0f), "reset");
    opf_delayed_state_destroy(s);
    opf_ctx_destroy(ctx);
}

/* Backward HYBRID is E5M2 (57344); margin 0; history 1 (the row 0 itself). */
static void test_backward_history1(void)
{
    opf_ctx *ctx = new_ctx();
    opf_delayed_state *s = NULL;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, 1, OPF_AMAX_MAX, true, 1,
                                           &s));
    CHECK(opf_delayed_state_dtype(s) == OPF_E5M2, "backward hybrid is e5m2");
    CHECK(opf_delayed_state_history_len(s) == 1 && opf_delayed_state_slots(s) == 1, "sizes");
    float *scale = opf_delayed_state_scale(s), *h = opf_delayed_state_history(s);
    h[0] = 7.0f;
    CHECK_OK(ctx, opf_delayed_state_update(ctx, s, NULL, NULL));
    CHECK(same(scale[0], 57344.0f / 7.0f) && same(h[0], 0.0f), "L=1: scale %.9g, H0 %g",
          (double)scale[0], (double)h[0]);
    h[0] = 57344.0f * 4;
    CHECK_OK(ctx, opf_delayed_state_update(ctx, s, NULL, NULL));
    CHECK(same(scale[0], 0.25f), "L=1 keeps no older amax: %g", (double)scale[0]);
    opf_delayed_state_destroy(s);

    /* E4M3 format: both directions 448; margin 2 gives 112. */
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 2.0f, 3, OPF_AMAX_MAX, true, 1,
                                           &s));
    CHECK(opf_delayed_state_dtype(s) == OPF_E4M3, "e4m3 backward is e4m3");
    opf_delayed_state_history(s)[0] = 7.0f;
    CHECK_OK(ctx, opf_delayed_state_update(ctx, s, NULL, NULL));
    CHECK(same(opf_delayed_state_scale(s)[0], 16.0f), "112/7 = 16");
    opf_delayed_state_destroy(s);
    opf_ctx_destroy(ctx);
}

/* The hook sees a copy of row 0 and may raise it (another rank's amax). */
static int hook_calls;
static opf_status reduce_max16(void *user, float *amax, int n)
{
    hook_calls++;
    CHECK(user == (void *)&hook_calls && n == 3, "hook args n=%d", n);
    amax[0] = amax[0] > 16.0f ? amax[0] : 16.0f;  /* another rank saw 16 */
    amax[2] = 0.0f;                               /* reduced 0: local H[0] is used */
    return OPF_OK;
}
static opf_status reduce_fails(void *user, float *amax, int n)
{
    (void)user;
    for (int i = 0; i < n; i++) amax[i] = 1e9f;  /* scribbles on its copy */
    return OPF_ERR_DEVICE;
}

static void test_reduce(void)
{
    opf_ctx *ctx = new_ctx();
    opf_delayed_state *s = NULL;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, 2, OPF_AMAX_MAX, false, 3,
                                           &s));
    float *scale = opf_delayed_state_scale(s), *h = opf_delayed_state_history(s);
    h[0] = 2.0f, h[1] = 0.0f, h[2] = 8.0f;
    CHECK_FAILS(ctx, opf_delayed_state_update(ctx, s, reduce_fails, NULL), OPF_ERR_DEVICE,
                "opf_delayed_state_update", "reduction", "unchanged");
    CHECK(same(h[0], 2.0f) && same(h[2], 8.0f) && same(scale[0], 1.0f), "failed hook: untouched");
    CHECK_OK(ctx, opf_delayed_state_update(ctx, s, reduce_max16, &hook_calls));
    CHECK(hook_calls == 1, "hook called once");
    /* slot 0: reduced 16 -> 448/16 = 28; slot 1: 0 -> kept; slot 2: local 8 -> 56. */
    CHECK(same(scale[0], 28.0f) && same(scale[1], 1.0f) && same(scale[2], 56.0f),
          "scales %g %g %g", (double)scale[0], (double)scale[1], (double)scale[2]);
    /* L = 2: H' = [0, a]. */
    CHECK(same(h[0], 0.0f) && same(h[3], 16.0f) && same(h[4], 0.0f) && same(h[5], 8.0f),
          "history rolled with the reduced amax");
    opf_delayed_state_destroy(s);
    opf_ctx_destroy(ctx);
}

/* A quantization max-accumulates its input amax into row 0 of its slot and
 * uses the slot's scale; its scale_inv stays with the tensor. */
static void test_quantize_accumulates(void)
{
    opf_ctx *ctx = new_ctx();
    opf_delayed_state *s = NULL;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, 3, OPF_AMAX_MAX, false, 2,
                                           &s));
    float x[2][4] = {{1, -3, 0.5f, NAN}, {2, 0, -0.25f, 1}};
    opf_spec in_spec = opf_spec_make(2, (int64_t[]){2, 4}, OPF_F32);
    opf_tensor in, out;
    CHECK_OK(ctx, opf_tensor_wrap(&in_spec, x, &in));
    opf_quantizer q = opf_quantizer_default();
    q.scaling = OPF_SCALING_TENSOR;
    q.delayed = s;
    q.slot = 1;
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &in, &out));
    float *h = opf_delayed_state_history(s);
    CHECK(same(h[1], 3.0f) && same(h[0], 0.0f), "slot 1 row 0 = 3 (NaN ignored): %g", (double)h[1]);
    CHECK(same(*(float *)out.data[OPF_COMP_AMAX], 3.0f), "AMAX component");
    CHECK(same(*(float *)out.data[OPF_COMP_SCALE_INV], 1.0f), "scale 1 at step 0");
    opf_tensor_release(&out);
    x[0][0] = 2.5f;
    x[0][1] = 1.0f;  /* amax 2.5 < 3: the slot keeps 3 */
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &in, &out));
    CHECK(same(h[1], 3.0f), "max-accumulate keeps 3");
    opf_tensor_release(&out);
    CHECK_OK(ctx, opf_delayed_state_update(ctx, s, NULL, NULL));
    CHECK(same(opf_delayed_state_scale(s)[1], 448.0f / 3.0f), "scale from the step's amax");
    CHECK_OK(ctx, opf_quantize_alloc(ctx, &q, &in, &out));
    float want_inv = 1.0f / (448.0f / 3.0f);
    CHECK(same(*(float *)out.data[OPF_COMP_SCALE_INV], want_inv), "scale_inv = 1/scale");
    /* e4m3(1 * 149.33) = 144 = 1.125 * 2^7: exponent field 14, mantissa 1. */
    CHECK(((uint8_t *)out.data[OPF_COMP_DATA])[7] == 0x71, "q = 0x%02x",
          ((uint8_t *)out.data[OPF_COMP_DATA])[7]);
    opf_tensor_release(&out);
    opf_delayed_state_destroy(s);
    opf_ctx_destroy(ctx);
}

/* Forward-direction create with the arguments the bad-input table varies. */
static opf_status mk(opf_ctx *ctx, opf_format f, float margin, int len, opf_amax_algo algo,
                     int slots, opf_delayed_state **out)
{
    return opf_delayed_state_create(ctx, f, margin, len, algo, false, slots, out);
}

static void test_bad_inputs(void)
{
    opf_ctx *ctx = new_ctx();
    opf_delayed_state *s = (opf_delayed_state *)&hook_calls;  /* must stay untouched */
    const char *fn = "opf_delayed_state_create";
    CHECK_FAILS(ctx, mk(ctx, OPF_FORMAT_HYBRID, 0, 0, OPF_AMAX_MAX, 3, &s), OPF_ERR_INVALID_ARG,
                fn, "history length 0");
    CHECK_FAILS(ctx, mk(ctx, OPF_FORMAT_HYBRID, 0, -2, OPF_AMAX_MAX, 3, &s), OPF_ERR_INVALID_ARG,
                fn, "history length -2");
    CHECK_FAILS(ctx, mk(ctx, OPF_FORMAT_HYBRID, 0, 4, OPF_AMAX_MAX, 0, &s), OPF_ERR_INVALID_ARG,
                fn, "0 slots");
    CHECK_FAILS(ctx, mk(ctx, OPF_FORMAT_E2M1, 0, 4, OPF_AMAX_MAX, 1, &s), OPF_ERR_INVALID_ARG, fn,
                "format e2m1");
    CHECK_FAILS(ctx, mk(ctx, (opf_format)42, 0, 4, OPF_AMAX_MAX, 1, &s), OPF_ERR_INVALID_ARG, fn,
                "format 42");
    CHECK_FAILS(ctx, mk(ctx, OPF_FORMAT_E4M3, 0, 4, (opf_amax_algo)7, 1, &s), OPF_ERR_INVALID_ARG,
                fn, "algorithm 7");
    CHECK_FAILS(ctx, mk(ctx, OPF_FORMAT_E4M3, NAN, 4, OPF_AMAX_MAX, 1, &s), OPF_ERR_INVALID_ARG,
                fn, "margin");
    CHECK_FAILS(ctx, mk(ctx, OPF_FORMAT_E4M3, 0, 4, OPF_AMAX_MAX, 1, NULL), OPF_ERR_INVALID_ARG,
                fn, "out is NULL");
    CHECK_FAILS(NULL, mk(NULL, OPF_FORMAT_E4M3, 0, 4, OPF_AMAX_MAX, 1, &s), OPF_ERR_INVALID_ARG,
                fn, "ctx is NULL");
    CHECK(s == (opf_delayed_state *)&hook_calls, "out untouched on failure");
    CHECK_FAILS(ctx, opf_delayed_state_update(ctx, NULL, NULL, NULL), OPF_ERR_INVALID_ARG,
                "opf_delayed_state_update", "NULL");
    /* NULL-tolerant accessors and destroy. */
    opf_delayed_state_destroy(NULL);
    opf_delayed_state_reset(NULL);
    CHECK(opf_delayed_state_slots(NULL) == 0 && opf_delayed_state_scale(NULL) == NULL &&
          opf_delayed_state_history(NULL) == NULL && opf_delayed_state_history_len(NULL) == 0,
          "NULL accessors");
    /* The state lives in the context's allocator: one block, freed on destroy. */
    opf_alloc_stats a0, a1, a2;
    opf_ctx_alloc_stats(ctx, &a0);
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E5M2, -1.0f, 1024, OPF_AMAX_MAX, false,
                                           6, &s));
    opf_ctx_alloc_stats(ctx, &a1);
    CHECK(a1.n_alloc == a0.n_alloc + 1 && a1.bytes_live >= a0.bytes_live + 6 * 1025 * 4,
          "one counted allocation");
    CHECK(opf_delayed_state_dtype(s) == OPF_E5M2, "e5m2 format");
    opf_delayed_state_history(s)[0] = 57344.0f;
    CHECK_OK(ctx, opf_delayed_state_update(ctx, s, NULL, NULL));
    CHECK(same(opf_delayed_state_scale(s)[0], 2.0f), "negative margin -1 doubles: %g",
          (double)opf_delayed_state_scale(s)[0]);
    opf_delayed_state_destroy(s);
    opf_ctx_alloc_stats(ctx, &a2);
    CHECK(a2.bytes_live == a0.bytes_live, "freed");
    opf_ctx_destroy(ctx);
}

/* opf_delayed_states_update over more states than one device call takes
 * (NULL entries among them) equals opf_delayed_state_update on copies, bit
 * for bit, over several steps with histories of 1 to 1024 rows. */
static void test_batched(void)
{
    enum { COUNT = 150, STEPS = 4 };
    static const int lens[] = {1, 3, 300, 1024, 16};
    opf_ctx *ctx = new_ctx();
    opf_delayed_state *a[COUNT], *b[COUNT];
    unsigned long long rng = 7;
    for (int k = 0; k < COUNT; k++) {
        a[k] = b[k] = NULL;
        if (k % 7 == 3) continue;  /* a hole */
        int n = 1 + k % 4, L = lens[k % 5];
        opf_amax_algo algo = k % 2 ? OPF_AMAX_MOST_RECENT : OPF_AMAX_MAX;
        CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, L, algo, k % 3 == 0,
                                               n, &a[k]));
        CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 0.0f, L, algo, k % 3 == 0,
                                               n, &b[k]));
        float *ha = opf_delayed_state_history(a[k]), *hb = opf_delayed_state_history(b[k]);
        for (int i = n; i < n * L; i++) ha[i] = hb[i] = opf_test_uniform(&rng, 0.0f, 500.0f);
    }
    for (int t = 0; t < STEPS; t++) {
        for (int k = 0; k < COUNT; k++) {
            if (!a[k]) continue;
            float *ha = opf_delayed_state_history(a[k]), *hb = opf_delayed_state_history(b[k]);
            for (int j = 0; j < opf_delayed_state_slots(a[k]); j++)
                ha[j] = hb[j] = (k + j + t) % 5 == 0 ? 0.0f : opf_test_uniform(&rng, 0.0f, 900.0f);
            CHECK_OK(ctx, opf_delayed_state_update(ctx, a[k], NULL, NULL));
        }
        CHECK_OK(ctx, opf_delayed_states_update(ctx, b, COUNT));
        for (int k = 0; k < COUNT; k++) {
            if (!a[k]) continue;
            int n = opf_delayed_state_slots(a[k]), L = opf_delayed_state_history_len(a[k]);
            CHECK(!memcmp(opf_delayed_state_scale(a[k]), opf_delayed_state_scale(b[k]),
                          sizeof(float) * (size_t)n), "batched: state %d step %d scales", k, t);
            CHECK(!memcmp(opf_delayed_state_history(a[k]), opf_delayed_state_history(b[k]),
                          sizeof(float) * (size_t)n * (size_t)L),
                  "batched: state %d step %d history", k, t);
        }
    }
    CHECK_OK(ctx, opf_delayed_states_update(ctx, b, 0));  /* nothing to do */
    for (int k = 0; k < COUNT; k++) opf_delayed_state_destroy(a[k]), opf_delayed_state_destroy(b[k]);
    opf_ctx_destroy(ctx);
}

int main(void)
{
    test_script(OPF_AMAX_MAX);
    test_script(OPF_AMAX_MOST_RECENT);
    test_backward_history1();
    test_reduce();
    test_quantize_accumulates();
    test_batched();
    test_bad_inputs();
    TEST_DONE();
}
