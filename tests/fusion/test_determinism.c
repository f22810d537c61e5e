/* test_determinism.c: the determinism request (opf_ctx_options.deterministic)
 * and a run-to-run test of the fused grouped MLP.
 *
 * Each repeat builds a fresh deterministic context of one seed, the grouped
 * MLP (FC1 + scaled_swiglu + FC2) and its inputs, and runs one forward and
 * backward; every output (y, dx, the scales' gradient, every parameter
 * gradient) must have the same bytes as the first repeat's: bytes, not
 * values, so -0 and +0 differ. Each repeat also asserts that the fusion
 * happened (one grouped_mlp entry in both plans) and that its inputs and
 * parameters were finite (NaN compares unequal, but NaN payloads and
 * infinities would make a byte test vacuous). Under every recipe.
 * Repeats: 4, or OPF_DETERMINISM_REPEATS. */
#include <math.h>

#include "test.h"

enum { GROUPS = 3, K = 64, H = 64, N = 32, ROWS = 96, MAX_OUT = 16 };
static const int64_t split[GROUPS] = {32, 0, 64};

/* The bytes of one repeat: y, dx, d(scales), then the parameter gradients. */
typedef struct run_bytes {
    unsigned char *b[MAX_OUT];
    size_t         n[MAX_OUT];
    int            count;
} run_bytes;

static void keep(run_bytes *r, const opf_tensor *t)
{
    opf_layout L;
    size_t n = 0;
    if (t->data[0] && !opf_spec_layout(&t->spec, &L)) n = L.comp[OPF_COMP_DATA].nbytes;  /* plain */
    unsigned char *c = malloc(n ? n : 1);
    if (n) memcpy(c, t->data[0], n);
    r->b[r->count] = c;
    r->n[r->count++] = n;
}

static void fill(opf_ctx *ctx, opf_tensor *t, unsigned long long *seed, float sigma)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *v = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(seed, sigma);
    CHECK_OK(ctx, opf_convert(v, OPF_F32, t->data[0], t->spec.dtype, (size_t)n));
    free(v);
}

static bool finite(const opf_tensor *t)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *v = malloc(sizeof(float) * (size_t)n);
    bool ok = !opf_convert(t->data[0], t->spec.dtype, v, OPF_F32, (size_t)n);
    for (int64_t i = 0; ok && i < n; i++) ok = isfinite(v[i]);
    free(v);
    return ok;
}

static opf_tensor make(opf_ctx *ctx, int ndim, const int64_t *shape, opf_dtype dt)
{
    opf_spec s = opf_spec_make(ndim, shape, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    return t;
}

static opf_seq *model(opf_ctx *ctx)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_grouped_linear_config c1 = {.groups = GROUPS, .in_features = K, .out_features = 2 * H,
                                    .bias = true, .dtype = OPF_BF16};
    opf_grouped_linear_config c2 = {.groups = GROUPS, .in_features = H, .out_features = N,
                                    .bias = true, .dtype = OPF_BF16};
    const char *cls[3] = {"grouped_linear", "scaled_swiglu", "grouped_linear"};
    const void *cfg[3] = {&c1, NULL, &c2};
    for (int k = 0; k < 3; k++) {
        opf_op *op = NULL;
        CHECK_OK(ctx, opf_op_create(ctx, cls[k], cfg[k], k == 1 ? "glu" : k ? "fc2" : "fc1", &op));
        if (op) CHECK_OK(ctx, opf_seq_append(seq, op));
    }
    return seq;
}

/* True when both plans of the seq's one group are one grouped_mlp. */
static bool fused(opf_seq *seq)
{
    opf_plan_entry e[4];
    bool ok = opf_seq_num_groups(seq) == 1;
    for (int b = 0; b < 2 && ok; b++)
        ok = opf_seq_plan(seq, 0, b, e, 4) == 1 && !strcmp(opf_op_class_of(e[0].op)->name, "grouped_mlp");
    return ok;
}

static void one_run(opf_recipe_kind kind, run_bytes *r, const char *tag, int rep)
{
    opf_ctx_options o = opf_ctx_options_default();
    o.deterministic = true;
    o.seed = 99;
    opf_ctx *ctx = NULL;
    CHECK_OK(NULL, opf_ctx_create(&o, &ctx));
    if (!ctx) return;
    CHECK(opf_ctx_deterministic(ctx), "%s: the request is kept", tag);
    opf_seq *seq = model(ctx);
    unsigned long long seed = 5;
    for (int i = 0; i < opf_seq_len(seq); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, i)); p++) {
            opf_param *pr = opf_op_param(opf_seq_at(seq, i), p);
            if (pr->value.spec.ndim == 1) fill(ctx, &pr->value, &seed, 0.2f);
            CHECK(finite(&pr->value), "%s repeat %d: parameter %s is not finite", tag, rep, pr->name);
        }
    opf_tensor x = make(ctx, 2, (int64_t[]){ROWS, K}, OPF_BF16), dy = make(ctx, 2, (int64_t[]){ROWS, N}, OPF_BF16);
    opf_tensor sc = make(ctx, 1, (int64_t[]){ROWS}, OPF_F32), sp = make(ctx, 1, (int64_t[]){GROUPS}, OPF_I64);
    fill(ctx, &x, &seed, 1.0f), fill(ctx, &dy, &seed, 0.2f), fill(ctx, &sc, &seed, 1.0f);
    memcpy(sp.data[0], split, sizeof split);
    CHECK(finite(&x) && finite(&dy) && finite(&sc), "%s repeat %d: inputs not finite", tag, rep);
    opf_recipe rc = opf_recipe_default(kind);
    opf_tensor pub[3] = {sp, sc, sp}, dpub[3], y, dx;
    memset(dpub, 0, sizeof dpub);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = kind == OPF_RECIPE_NONE ? NULL : &rc;
    call.n_extra_in = 3;
    call.extra_in = pub;
    CHECK_OK(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
    CHECK(fused(seq), "%s repeat %d: the grouped MLP was not fused", tag, rep);
    CHECK_OK(ctx, opf_seq_backward(seq, &dy, NULL, &dx, dpub));
    keep(r, &y), keep(r, &dx), keep(r, &dpub[1]);
    for (int i = 0; i < opf_seq_len(seq); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(seq, i)) && r->count < MAX_OUT; p++)
            keep(r, &opf_op_param_const(opf_seq_at(seq, i), p)->grad);
    opf_tensor *ts[] = {&x, &dy, &sc, &sp, &y, &dx, &dpub[0], &dpub[1], &dpub[2]};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) opf_tensor_release(ts[i]);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
}

static void free_run(run_bytes *r)
{
    for (int i = 0; i < r->count; i++) free(r->b[i]);
    r->count = 0;
}

static void test_repeats(opf_recipe_kind kind, int repeats)
{
    char tag[64];
    snprintf(tag, sizeof tag, "determinism %s", opf_recipe_name(kind));
    run_bytes first = {0}, again = {0};
    one_run(kind, &first, tag, 0);
    CHECK(first.count >= 7, "%s: %d outputs kept", tag, first.count);
    for (int rep = 1; rep < repeats; rep++) {
        one_run(kind, &again, tag, rep);
        bool same = again.count == first.count;
        for (int i = 0; same && i < first.count; i++)
            same = again.n[i] == first.n[i] && !memcmp(again.b[i], first.b[i], first.n[i]);
        CHECK(same, "%s: repeat %d differs from the first in its bytes", tag, rep);
        free_run(&again);
    }
    free_run(&first);
}

int main(void)
{
    const char *env = getenv("OPF_DETERMINISM_REPEATS");
    int repeats = env && atoi(env) > 1 ? atoi(env) : 4;
    const opf_recipe_kind kinds[] = {OPF_RECIPE_NONE,  OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                     OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8,   OPF_RECIPE_NVFP4};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) test_repeats(kinds[k], repeats);
    TEST_DONE();
}
