/* test_delayed_nonfinite.c: non-finite amaxes in the delayed-scaling update
 * (issue 13, item 4). By default an infinite amax rolls into the history as
 * the anchor does and holds the scale for history-1 more steps; with
 * opf_recipe.reject_nonfinite_amax it is kept out (no roll, scale as it
 * was, row 0 cleared) and the next finite amax updates the scale at once.
 * Both modes count such amaxes and warn once per context. Checked on a bare
 * state (inf, NaN, through the reduction hook, reset) and through a seq
 * whose input holds one infinity. */
#include "test.h"

/* Only this file's warning counts. */
static opf_test_warnings W = {"non-finite amax", 0, ""};

static opf_ctx *make_ctx(void) { return opf_test_ctx_catching(&W); }

static int same(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

static bool all_finite(const float *v, int n)
{
    for (int i = 0; i < n; i++)
        if (!isfinite(v[i])) return false;
    return true;
}

/* Slot 0's amax per step and the scale expected after it, forward HYBRID
 * (448), margin 1 (scaled max 224), history 4, max over the window. */
typedef struct step {
    float amax;
    float scale_anchor, scale_reject;
} step;

static const step script[] = {
    {2.0f, 112.0f, 112.0f},
    {INFINITY, 112.0f, 112.0f},  /* anchor: inf enters the window; reject: kept out */
    {4.0f, 112.0f, 56.0f},       /* anchor: window {4,2,inf}: held */
    {8.0f, 112.0f, 28.0f},
    {1.0f, 112.0f, 28.0f},       /* anchor: window {1,8,4,inf}: held L-1 = 3 steps on */
    {1.0f, 28.0f, 28.0f},        /* anchor: inf left the window */
    {NAN, 28.0f, 28.0f},         /* anchor: NaN enters, max skips it */
    {16.0f, 14.0f, 14.0f},
};

static void test_script(bool reject)
{
    opf_ctx *ctx = make_ctx();
    opf_delayed_state *s;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_HYBRID, 1.0f, 4, OPF_AMAX_MAX, false,
                                           2, &s));
    CHECK(opf_delayed_state_nonfinite_amaxes(s) == 0 && W.n == 0, "fresh state: no count");
    opf_delayed_state_set_reject_nonfinite(s, reject);
    float *scale = opf_delayed_state_scale(s), *h = opf_delayed_state_history(s);
    int64_t nonfinite = 0;
    for (size_t t = 0; t < sizeof script / sizeof script[0]; t++) {
        h[0] = script[t].amax;
        h[1] = 3.0f;  /* slot 1: finite throughout */
        CHECK_OK(ctx, opf_delayed_state_update(ctx, s, NULL, NULL));
        nonfinite += !isfinite(script[t].amax);
        float want = reject ? script[t].scale_reject : script[t].scale_anchor;
        CHECK(same(scale[0], want), "reject %d step %zu: scale %.9g, want %.9g", (int)reject, t,
              (double)scale[0], (double)want);
        CHECK(same(scale[1], 224.0f / 3.0f), "reject %d step %zu: the finite slot's scale %g",
              (int)reject, t, (double)scale[1]);
        CHECK(same(h[0], 0.0f), "reject %d step %zu: row 0 cleared", (int)reject, t);
        if (reject)
            CHECK(all_finite(h, 2 * 4), "reject %d step %zu: the history stays finite",
                  (int)reject, t);
        CHECK(opf_delayed_state_nonfinite_amaxes(s) == nonfinite, "step %zu: count %lld, want %lld",
              t, (long long)opf_delayed_state_nonfinite_amaxes(s), (long long)nonfinite);
        CHECK(W.n == (nonfinite ? 1 : 0), "reject %d step %zu: %d warnings", (int)reject, t,
              W.n);
    }
    CHECK(strstr(W.last, reject ? "kept out" : "reject_nonfinite_amax"), "warning: %s", W.last);
    opf_delayed_state_reset(s);
    CHECK(opf_delayed_state_nonfinite_amaxes(s) == 0, "reset clears the count");
    opf_delayed_state_destroy(s);
    CHECK(opf_delayed_state_nonfinite_amaxes(NULL) == 0, "NULL");
    opf_ctx_destroy(ctx);
}

/* A reduction that reports an infinity from another rank for slot 0. */
static opf_status reduce_inf(void *user, float *amax, int n)
{
    (void)user, (void)n;
    amax[0] = INFINITY;
    return OPF_OK;
}

static void test_reduced(void)
{
    opf_ctx *ctx = make_ctx();
    opf_delayed_state *s;
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0.0f, 2, OPF_AMAX_MOST_RECENT,
                                           false, 1, &s));
    opf_delayed_state_set_reject_nonfinite(s, true);
    float *h = opf_delayed_state_history(s);
    h[0] = 7.0f;  /* local amax finite, the reduced one not */
    CHECK_OK(ctx, opf_delayed_state_update(ctx, s, reduce_inf, NULL));
    CHECK(same(h[0], 0.0f) && same(h[1], 0.0f) && same(opf_delayed_state_scale(s)[0], 1.0f),
          "reduced inf kept out: H {%g, %g}, scale %g", (double)h[0], (double)h[1],
          (double)opf_delayed_state_scale(s)[0]);
    CHECK(opf_delayed_state_nonfinite_amaxes(s) == 1 && W.n == 1, "counted once, W.last once");
    opf_delayed_state_destroy(s);
    opf_ctx_destroy(ctx);
}

/* ---- through a seq ------------------------------------------------------------ */

enum { T = 32, H = 32 };

/* One forward and backward of a bias-free f32 linear on x = mag * pattern,
 * element bad (when >= 0) infinite. */
static void step_seq(opf_ctx *ctx, opf_seq *seq, const opf_recipe *r, float mag, int bad)
{
    static float xb[T * H], gv[T * H];
    for (int i = 0; i < T * H; i++) {
        xb[i] = mag * (float)(i % 7 - 3) / 3.0f;
        gv[i] = (float)(i % 5 - 2) / 8.0f;
    }
    if (bad >= 0) xb[bad] = INFINITY;
    opf_test_fwd_bwd(ctx, seq, r, T, H, xb, gv);
}

static void test_seq(bool reject)
{
    enum { L = 4 };
    opf_ctx *ctx = make_ctx();
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, H, H, false, OPF_F32, "fc"));
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    CHECK(!r.reject_nonfinite_amax, "the default is the anchor's rule");
    r.amax_history_len = L;
    r.reject_nonfinite_amax = reject;
    step_seq(ctx, seq, &r, 1.0f, -1);
    opf_recipe_state *rs = opf_op_recipe_state(opf_seq_at(seq, 0));
    opf_delayed_state *fw = opf_recipe_state_delayed(rs, false);
    CHECK(fw != NULL, "a delayed forward state");
    if (!fw) return;
    float *scale = opf_delayed_state_scale(fw), *h = opf_delayed_state_history(fw);
    int n = opf_delayed_state_slots(fw);
    float s1 = scale[0];  /* the input slot after a finite step, amax 1 */
    CHECK(same(s1, 448.0f), "input scale after amax 1: %g", (double)s1);
    step_seq(ctx, seq, &r, 1.0f, 77);  /* one infinity among T x H inputs */
    CHECK(same(scale[0], s1), "the step with the infinity keeps the scale: %g", (double)scale[0]);
    CHECK(opf_recipe_state_nonfinite_amaxes(rs) >= 1 && W.n == 1,
          "reject %d: count %lld, %d warnings", (int)reject,
          (long long)opf_recipe_state_nonfinite_amaxes(rs), W.n);
    CHECK(all_finite(h, n * L) == reject, "reject %d: history finite %d", (int)reject,
          (int)all_finite(h, n * L));
    for (int t = 0; t < L; t++) {  /* inputs of amax 2, finite */
        step_seq(ctx, seq, &r, 2.0f, -1);
        bool held = t < L - 1;     /* the anchor: inf in the window of the next L-1 updates */
        float want = reject || !held ? 224.0f : s1;
        CHECK(same(scale[0], want), "reject %d finite step %d: input scale %g, want %g",
              (int)reject, t, (double)scale[0], (double)want);
    }
    CHECK(all_finite(h, n * L), "reject %d: the history is finite again", (int)reject);
    CHECK(W.n == 1, "one warning per context, got %d: %s", W.n, W.last);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
}

int main(void)
{
    test_script(false);
    test_script(true);
    test_reduced();
    test_seq(false);
    test_seq(true);
    TEST_DONE();
}
