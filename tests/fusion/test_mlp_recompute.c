/* test_mlp_recompute.c: the grouped MLP's activation_recompute_in_mlp
 * (ops/fused/grouped_mlp.c, issue 15 item 1):
 *   - with scaled_srelu in a fused grouped MLP the flag drops the
 *     activation's output and FC2's copies of it after the forward and
 *     rebuilds them in the backward: y, dx, the scales' gradients, every
 *     parameter gradient and the Philox offset equal the run without the
 *     flag bit for bit, under every recipe that honours it, with FC2's
 *     scale_bias and a padded token buffer; the bytes held from the forward
 *     to the backward fall by at least the activation's output;
 *   - where the flag is set but not honoured (scaled_swiglu, delayed
 *     scaling, a lone activation, fusions off, a compiled graph of a lone
 *     activation) the context warns once and the results are unchanged. */
#include "test.h"

enum { G = 2, K = 64, H = 64, N = 32, M = 96, USED = 64 };
static const int64_t split[G] = {32, 32};

static int warnings;
static void count_warning(void *user, const char *msg)
{
    (void)user;
    if (strstr(msg, "activation_recompute_in_mlp")) warnings++;
}

static opf_ctx *new_ctx(void)
{
    opf_ctx_options co = opf_ctx_options_default();
    co.warn = count_warning;
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(&co, &ctx));
    return ctx;
}

/* FC1 + act + FC2 (scale_bias), or the activation alone (lone). */
static opf_seq *model(opf_ctx *ctx, const char *act, bool flag, bool lone)
{
    opf_ctx_set_rng(ctx, 99, 0);
    int64_t f1 = strcmp(act, "scaled_srelu") ? 2 * H : H;
    opf_grouped_linear_config c1 = {G, K, f1, true, OPF_BF16, false};
    opf_grouped_linear_config c2 = {G, H, N, true, OPF_BF16, true};
    opf_scaled_act_config ca = {.activation_recompute_in_mlp = flag, .limit = 7.0, .alpha = 1.702};
    opf_seq *seq;
    opf_op *op;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    const char *cls[3] = {"grouped_linear", act, "grouped_linear"}, *names[3] = {"fc1", "act", "fc2"};
    const void *cfg[3] = {&c1, &ca, &c2};
    for (int k = lone ? 1 : 0; k < (lone ? 2 : 3); k++) {
        CHECK_OK(ctx, opf_op_create(ctx, cls[k], cfg[k], names[k], &op));
        CHECK_OK(ctx, opf_seq_append(seq, op));
    }
    unsigned long long seed = 4;
    for (int k = 0; k < opf_seq_len(seq); k++)  /* biases start at zero: give them values */
        for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, k)); p++) {
            opf_param *pr = opf_op_param(opf_seq_at(seq, k), p);
            float v[2 * H];
            int64_t n = pr->value.spec.ndim == 1 ? pr->value.spec.shape[0] : 0;
            for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(&seed, 0.3f);
            CHECK_OK(ctx, opf_convert(v, OPF_F32, pr->value.data[0], pr->value.spec.dtype, (size_t)n));
        }
    return seq;
}

typedef struct io {
    opf_tensor x, dy, split, scales, t[7];  /* t: y, dx, the public inputs' gradients */
    opf_tensor pub[4];
    int        n_pub;
} io;

static opf_tensor rand_rows(opf_ctx *ctx, int64_t cols, opf_dtype dt, float mean, unsigned long long *seed)
{
    int64_t w = cols ? cols : 1;
    double *v = malloc(sizeof(double) * (size_t)(M * w));
    for (int64_t i = 0; i < M * w; i++) v[i] = i < USED * w ? mean + opf_test_normal(seed, 0.5f) : 0.0;
    opf_tensor t = cols ? opf_test_make_tensor(ctx, 2, (int64_t[]){M, cols}, dt, v, NULL)
                        : opf_test_make_tensor(ctx, 1, (int64_t[]){M}, dt, v, NULL);
    free(v);
    return t;
}

static void io_make(opf_ctx *ctx, bool lone, int64_t in_cols, int64_t out_cols, io *s)
{
    unsigned long long seed = 12;
    memset(s, 0, sizeof *s);
    s->x = rand_rows(ctx, in_cols, OPF_BF16, 0.0f, &seed);
    s->dy = rand_rows(ctx, out_cols, OPF_BF16, 0.0f, &seed);
    s->scales = rand_rows(ctx, 0, OPF_F32, 0.5f, &seed);
    opf_spec ss = opf_spec_make(1, (int64_t[]){G}, OPF_I64);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &ss, &s->split));
    memcpy(s->split.data[0], split, sizeof split);
    opf_tensor pub[4] = {s->split, s->scales, s->split, s->scales};
    if (lone) s->pub[0] = s->scales, s->n_pub = 1;
    else memcpy(s->pub, pub, sizeof pub), s->n_pub = 4;
}

static void io_free(io *s)
{
    opf_tensor *ts[] = {&s->x, &s->dy, &s->split, &s->scales};
    for (int i = 0; i < 4; i++) opf_tensor_release(ts[i]);
    for (int i = 0; i < 7; i++) opf_tensor_release(&s->t[i]);
}

/* One forward and backward; *held: the context's live bytes between them. */
static void step(opf_ctx *ctx, opf_seq *seq, io *s, const opf_recipe *r, size_t *held)
{
    opf_seq_call call = opf_seq_call_default();
    call.recipe = r;
    call.n_extra_in = s->n_pub;
    call.extra_in = s->pub;
    opf_alloc_stats s0, s1;
    opf_ctx_alloc_stats(ctx, &s0);
    CHECK_OK(ctx, opf_seq_forward(seq, &s->x, &call, &s->t[0], NULL));
    opf_ctx_alloc_stats(ctx, &s1);
    if (held) *held = s1.bytes_live - s0.bytes_live;
    CHECK_OK(ctx, opf_seq_backward(seq, &s->dy, NULL, &s->t[1], &s->t[2]));
}

static void compare(opf_ctx *ca, opf_ctx *cb, opf_seq *a, opf_seq *b, io *sa, io *sb, const char *what)
{
    for (int i = 0; i < 2 + sa->n_pub; i++)
        if (i < 2 || (i - 2) % 2 == 1)  /* y, dx, the scales' gradients */
            CHECK(opf_test_same_bytes(&sa->t[i], &sb->t[i]), "%s: output %d differs", what, i);
    int bad = 0;
    for (int k = 0; k < opf_seq_len(a); k++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, k)); p++)
            bad += !opf_test_same_bytes(&opf_op_param(opf_seq_at(a, k), p)->grad,
                                        &opf_op_param(opf_seq_at(b, k), p)->grad);
    CHECK(bad == 0, "%s: %d parameter gradients differ", what, bad);
    uint64_t s1, o1, s2, o2;
    opf_ctx_get_rng(ca, &s1, &o1), opf_ctx_get_rng(cb, &s2, &o2);
    CHECK(o1 == o2, "%s: Philox offsets %llu vs %llu", what, (unsigned long long)o1, (unsigned long long)o2);
}

/* The flag on (a) against off (b); honoured: the held bytes must fall. */
static void flag_case(const char *act, opf_recipe_kind rk, bool lone, bool fusions, bool honoured)
{
    char what[160];
    snprintf(what, sizeof what, "%s%s%s %s", act, lone ? " lone" : "", fusions ? "" : " fusions off",
             opf_recipe_name(rk));
    opf_ctx *ca = new_ctx(), *cb = new_ctx();
    opf_recipe r = opf_recipe_default(rk);
    const opf_recipe *rp = rk == OPF_RECIPE_NONE ? NULL : &r;
    opf_seq *a = model(ca, act, true, lone), *b = model(cb, act, false, lone);
    opf_seq_set_fusions(a, fusions), opf_seq_set_fusions(b, fusions);
    int64_t f1 = strcmp(act, "scaled_srelu") ? 2 * H : H;
    io sa, sb;
    io_make(ca, lone, lone ? f1 : K, lone ? H : N, &sa);
    io_make(cb, lone, lone ? f1 : K, lone ? H : N, &sb);
    size_t held_a = 0, held_b = 0;
    warnings = 0;
    for (int s = 0; s < 2; s++) {
        for (int i = 0; i < 7; i++) opf_tensor_release(&sa.t[i]), opf_tensor_release(&sb.t[i]);
        step(ca, a, &sa, rp, &held_a);
        step(cb, b, &sb, rp, &held_b);
        compare(ca, cb, a, b, &sa, &sb, what);
    }
    size_t act_bytes = (size_t)M * H * 2;  /* the activation's bf16 output */
    if (honoured)
        CHECK(held_a + act_bytes <= held_b, "%s: bytes held for the backward %zu with the flag, %zu "
              "without: want a fall of %zu at least", what, held_a, held_b, act_bytes);
    CHECK(warnings == (honoured ? 0 : 1), "%s: %d warnings, want %d", what, warnings, honoured ? 0 : 1);
    io_free(&sa), io_free(&sb);
    opf_seq_destroy(a), opf_seq_destroy(b);
    opf_ctx_destroy(ca), opf_ctx_destroy(cb);
}

/* A compiled graph of a lone flagged activation warns once, over steps. */
static void test_compiled_warning(void)
{
    opf_ctx *ctx = new_ctx();
    opf_seq *seq = model(ctx, "scaled_srelu", true, true);
    io s;
    io_make(ctx, true, H, H, &s);
    opf_seq_call call = opf_seq_call_default();
    call.n_extra_in = s.n_pub;
    call.extra_in = s.pub;
    opf_graph *g = NULL;
    warnings = 0;
    CHECK_OK(ctx, opf_compile(seq, &s.x.spec, &call, NULL, &g));
    for (int i = 0; g && i < 2; i++) {
        opf_tensor y, dx;
        CHECK_OK(ctx, opf_graph_forward(g, &s.x, &call, &y, NULL));
        CHECK_OK(ctx, opf_graph_backward(g, &s.dy, NULL, &dx, NULL));
        opf_tensor_release(&y), opf_tensor_release(&dx);
    }
    CHECK(g && warnings == 1, "compiled lone scaled_srelu: %d warnings, want 1", warnings);
    opf_graph_destroy(g);
    io_free(&s);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
}

int main(void)
{
    const opf_recipe_kind honouring[] = {OPF_RECIPE_NONE, OPF_RECIPE_CURRENT, OPF_RECIPE_BLOCK,
                                         OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
    for (size_t i = 0; i < sizeof honouring / sizeof honouring[0]; i++)
        flag_case("scaled_srelu", honouring[i], false, true, true);
    flag_case("scaled_srelu", OPF_RECIPE_DELAYED, false, true, false);
    flag_case("scaled_swiglu", OPF_RECIPE_MXFP8, false, true, false);
    flag_case("scaled_srelu", OPF_RECIPE_NONE, false, false, false);
    flag_case("scaled_srelu", OPF_RECIPE_NONE, true, true, false);
    test_compiled_warning();
    TEST_DONE();
}
