/* test_harness.c: the table-driven sweep over every registered op x dtype x
 * recipe. Per row: forward and backward run through the eager runner; the
 * fakes (run on args with no data) agree with the real outputs; gradients
 * agree with a directional finite difference of the op's own forward (f32,
 * no recipe); quantized outputs follow the next op's quantizer. The FP64
 * reference checks of each family live in test_<family>.c. At the end it
 * prints the rows it could not cover (the list should be empty). */
#include "test.h"

#include "ops/ops-impl.h"

enum { ROWS = 32, COLS = 64 };

typedef struct op_row {
    const char *cls;
    const void *cfg;
    int64_t     in_cols;      /* last dim of the input */
    bool        smooth;       /* differentiable everywhere: FD applies */
} op_row;

static opf_bias_config bias_cfg = {COLS, OPF_F32};
static opf_norm_config norm_cfg = {COLS, 1e-5, false, OPF_F32};
static opf_l2norm_config l2_cfg = {1e-6};
static opf_basic_linear_config lin_cfg = {COLS, 32, OPF_F32, false};
static opf_constant_scale_config scale_cfg = {0.75};
static opf_reshape_config reshape_cfg = {2, {ROWS * 2, COLS / 2}};  /* keeps 32-multiples */
static opf_clamped_swiglu_config clamp_cfg = {7.0, 1.702};
static opf_dropout_config drop_cfg = {0.25};
static opf_grouped_linear_config grouped_cfg = {2, COLS, 32, true, OPF_F32, false};

static const op_row rows[] = {
    {"identity", NULL, COLS, true},          {"reshape", &reshape_cfg, COLS, true},
    {"constant_scale", &scale_cfg, COLS, true}, {"bias", &bias_cfg, COLS, true},
    {"basic_linear", &lin_cfg, COLS, true},  {"layernorm", &norm_cfg, COLS, true},
    {"rmsnorm", &norm_cfg, COLS, true},      {"l2normalization", &l2_cfg, COLS, true},
    {"gelu", NULL, COLS, true},              {"qgelu", NULL, COLS, true},
    {"relu", NULL, COLS, false},             {"srelu", NULL, COLS, false},
    {"silu", NULL, COLS, true},              {"glu", NULL, COLS, true},
    {"geglu", NULL, COLS, true},             {"qgeglu", NULL, COLS, true},
    {"reglu", NULL, COLS, false},            {"sreglu", NULL, COLS, false},
    {"swiglu", NULL, COLS, true},            {"clamped_swiglu", &clamp_cfg, COLS, false},
    {"add_extra_input", NULL, COLS, true},   {"make_extra_output", NULL, COLS, true},
    {"quantize", NULL, COLS, true},          {"dropout", &drop_cfg, COLS, false},
    {"grouped_linear", &grouped_cfg, COLS, true}, {"scaled_swiglu", NULL, COLS, true},
    {"scaled_srelu", NULL, COLS, false},     {"scaled_clamped_qgeglu", NULL, COLS, false},
};
enum { NROWS = sizeof rows / sizeof rows[0] };

static const opf_recipe_kind recipes[] = {OPF_RECIPE_NONE, OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                          OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8, OPF_RECIPE_NVFP4};
enum { NREC = sizeof recipes / sizeof recipes[0] };
static const opf_dtype dtypes[] = {OPF_F32, OPF_BF16, OPF_F16};

static char missing[4096];

static void note_missing(const char *cls, opf_dtype dt, opf_recipe_kind r, const char *why)
{
    size_t n = strlen(missing);
    snprintf(missing + n, sizeof missing - n, "  %s / %s / %s: %s\n", cls, opf_dtype_name(dt),
             opf_recipe_name(r), why);
}

/* A config copy with the row's dtype substituted where the config has one. */
static const void *config_for(const op_row *r, opf_dtype dt, void *buf)
{
    if (!r->cfg) return NULL;
    const opf_op_class *c = opf_op_class_find(r->cls);
    memcpy(buf, r->cfg, c->config_size);
    if (r->cfg == &bias_cfg) ((opf_bias_config *)buf)->dtype = dt;
    if (r->cfg == &norm_cfg) ((opf_norm_config *)buf)->dtype = dt;
    if (r->cfg == &lin_cfg) ((opf_basic_linear_config *)buf)->dtype = dt;
    if (r->cfg == &grouped_cfg) ((opf_grouped_linear_config *)buf)->dtype = dt;
    return buf;
}

/* A copy of the args whose tensors keep their specs but point at nothing
 * readable: a fake that touched data would crash. */
static void *dataless_copy(const void *args, const opf_schema *schema)
{
    static _Alignas(16) unsigned char copy[OPF_OP_ARGS_MAX];
    memcpy(copy, args, schema->size);
    opf_slot slots[16];
    int ns = opf_schema_slots(schema, copy, slots, 16);
    for (int i = 0; i < ns && i < 16; i++)
        for (int c = 0; c < OPF_COMP_COUNT; c++)
            if (slots[i].tensor->data[c]) slots[i].tensor->data[c] = (void *)(uintptr_t)1;  /* present, unreadable */
    return copy;
}

static void check_fake(const opf_op *op, const void *args, const opf_tensor *outs, int n_out)
{
    const opf_op_class *cls = op->cls;
    if (!cls->forward_fake) return;
    void *copy = dataless_copy(args, cls->fwd_schema);
    const char *what = "forward";
    opf_spec o[1 + OPF_OP_MAX_EXTRA], aux[OPF_OP_MAX_AUX];
    for (int i = 0; i < 1 + OPF_OP_MAX_EXTRA; i++) o[i].ndim = OPF_SPEC_NONE_NDIM;
    for (int i = 0; i < OPF_OP_MAX_AUX; i++) aux[i].ndim = OPF_SPEC_NONE_NDIM;
    CHECK(cls->forward_fake(copy, o, aux) == OPF_OK, "%s %s fake failed: %s", opf_op_name(op), what,
          opf_last_error(NULL));
    for (int i = 0; i < n_out; i++)
        if (outs[i].data[0] || outs[i].data[OPF_COMP_COL_DATA])
            CHECK(opf_spec_equal(&o[i], &outs[i].spec), "%s %s: fake spec %d differs", opf_op_name(op),
                  what, i);
}

/* Backward fake vs the real dx (a pass-through dx is dy itself). */
static void check_bwd_fake(const opf_op *op, const opf_tensor *dx, const opf_tensor *dy)
{
    const opf_op_class *cls = op->cls;
    if (!cls->backward_fake) return;
    void *copy = dataless_copy(op->bwd_args, cls->bwd_schema);
    opf_spec g[1 + OPF_OP_MAX_PARAMS + OPF_OP_MAX_EXTRA];
    for (int i = 0; i < 1 + OPF_OP_MAX_PARAMS + OPF_OP_MAX_EXTRA; i++) g[i].ndim = OPF_SPEC_NONE_NDIM;
    CHECK(cls->backward_fake(copy, g) == OPF_OK, "%s backward fake failed: %s", opf_op_name(op),
          opf_last_error(NULL));
    const opf_spec *want = g[0].ndim == OPF_GRAD_PASSTHROUGH ? &dy->spec : &g[0];
    if (dx->data[0] || dx->data[OPF_COMP_COL_DATA])
        CHECK(opf_spec_equal(want, &dx->spec), "%s backward: fake dx spec differs", opf_op_name(op));
}

static void fill(float *v, int64_t n, unsigned long long *s, float sigma)
{
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(s, sigma);
}

/* <dy, f(x + h v) - f(x - h v)> / 2h with the op's own forward (f32). */
static double fd_directional(opf_ctx *ctx, opf_op *op, opf_fwd_env env, const float *x, const float *v,
                             const float *dy, int64_t nx, double h)
{
    float *xp = malloc(sizeof(float) * (size_t)nx);
    double r = 0;
    for (int sgn = -1; sgn <= 1; sgn += 2) {
        for (int64_t i = 0; i < nx; i++) xp[i] = x[i] + (float)(sgn * h) * v[i];
        opf_tensor xt, outs[1 + OPF_OP_MAX_EXTRA];
        opf_tensor_wrap(&env.x->spec, xp, &xt);
        env.x = &xt;
        env.requires_grad = false;
        if (opf_op_forward(op, &env, NULL, outs)) {
            CHECK(0, "%s: forward for the finite difference failed: %s", op->name, opf_last_error(ctx));
            break;
        }
        const float *y = outs[0].data[0];
        int64_t ny = opf_spec_numel(&outs[0].spec);
        for (int64_t i = 0; i < ny; i++) r += sgn * (double)dy[i] * y[i];
        for (int i = 0; i < 1 + op->cls->n_extra_out; i++) opf_tensor_release(&outs[i]);
    }
    free(xp);
    return r / (2 * h);
}

static opf_quantizer next_quantizer(opf_recipe_kind rk, opf_dtype dt, opf_delayed_state *ds)
{
    opf_recipe r = opf_recipe_default(rk);
    r.nvfp4_rht = r.nvfp4_stochastic = false;
    opf_quantizer_role role = {"linear", OPF_ROLE_INPUT, "next"};
    opf_quantizer q = opf_quantizer_default();
    opf_recipe_quantizer(&r, &role, &q);
    if (rk == OPF_RECIPE_DELAYED) q.delayed = ds;
    return q;
}

static void run_row(opf_ctx *ctx, const op_row *row, opf_dtype dt, opf_recipe_kind rk, int *covered)
{
    const opf_op_class *cls = opf_op_class_find(row->cls);
    if (!cls) {
        note_missing(row->cls, dt, rk, "class not registered");
        return;
    }
    unsigned char cfgbuf[256];
    opf_op *op;
    if (opf_op_create(ctx, row->cls, config_for(row, dt, cfgbuf), row->cls, &op)) {
        note_missing(row->cls, dt, rk, opf_last_error(ctx));
        return;
    }
    opf_recipe rec = opf_recipe_default(rk);
    rec.nvfp4_rht = rec.nvfp4_stochastic = false;
    opf_delayed_state *ds = NULL;
    opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, 4, OPF_AMAX_MAX, false, 1, &ds);
    opf_quantizer nq = next_quantizer(rk, dt, ds);
    bool own_recipe = cls->n_gemms > 0;
    if (own_recipe && rk != OPF_RECIPE_NONE) CHECK_OK(ctx, opf_op_reset_recipe(ctx, op, &rec));
    unsigned long long s = 17 + (unsigned long long)rk * 31 + dt;
    int64_t nx = ROWS * row->in_cols;
    float *xf = malloc(sizeof(float) * (size_t)nx), *xr = malloc(sizeof(float) * (size_t)nx);
    fill(xf, nx, &s, 1.0f);
    opf_convert(xf, OPF_F32, xr, dt, (size_t)nx);  /* xr: raw storage in dt */
    opf_convert(xr, dt, xf, OPF_F32, (size_t)nx);
    opf_tensor x, extra, splits;
    opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {ROWS, row->in_cols}, .dtype = dt}, xr, &x);
    opf_tensor_wrap(&x.spec, xr, &extra);
    int64_t split_v[2] = {3, ROWS - 3};
    opf_tensor_wrap(&(opf_spec){.ndim = 1, .shape = {2}, .dtype = OPF_I64}, split_v, &splits);
    float scale_v[ROWS];
    for (int i = 0; i < ROWS; i++) scale_v[i] = 0.5f + 0.03f * (float)i;
    opf_tensor scales;
    opf_tensor_wrap(&(opf_spec){.ndim = 1, .shape = {ROWS}, .dtype = OPF_F32}, scale_v, &scales);
    opf_fwd_env env = {.ctx = ctx, .x = &x, .requires_grad = true,
                       .next_input_q = (!own_recipe && rk != OPF_RECIPE_NONE) ? &nq : NULL};
    if (cls->n_extra_in)
        env.extra_in[0] = !strcmp(row->cls, "grouped_linear") ? &splits
                        : !strncmp(row->cls, "scaled_", 7) ? &scales : &extra;
    opf_op_ctx octx;
    memset(&octx, 0, sizeof octx);
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA];
    opf_status st = opf_op_forward(op, &env, &octx, outs);
    if (st) {
        char why[300];
        snprintf(why, sizeof why, "forward: %s", opf_last_error(ctx));
        note_missing(row->cls, dt, rk, why);
        goto done;
    }
    check_fake(op, op->fwd_args, outs, 1 + cls->n_extra_out);
    /* backward with a random plain dy of the output's logical shape */
    int64_t ny = opf_spec_numel(&outs[0].spec);
    float *dyf = malloc(sizeof(float) * (size_t)ny), *dyr = malloc(sizeof(float) * (size_t)ny);
    fill(dyf, ny, &s, 1.0f);
    opf_convert(dyf, OPF_F32, dyr, dt, (size_t)ny);
    opf_convert(dyr, dt, dyf, OPF_F32, (size_t)ny);
    opf_tensor dy, dx, dxe[OPF_OP_MAX_EXTRA];
    opf_tensor_wrap(&(opf_spec){.ndim = outs[0].spec.ndim, .dtype = dt}, dyr, &dy);
    memcpy(dy.spec.shape, outs[0].spec.shape, sizeof dy.spec.shape);
    opf_bwd_env benv = {.ctx = ctx, .dy = &dy};
    memset(dxe, 0, sizeof dxe);
    st = opf_op_backward(op, &octx, &benv, &dx, dxe);
    if (st) {
        char why[300];
        snprintf(why, sizeof why, "backward: %s", opf_last_error(ctx));
        note_missing(row->cls, dt, rk, why);
    } else {
        check_bwd_fake(op, &dx, &dy);
        if (dt == OPF_F32 && rk == OPF_RECIPE_NONE && row->smooth && dx.data[0] &&
            dx.spec.scaling == OPF_SCALING_NONE && outs[0].spec.scaling == OPF_SCALING_NONE) {
            float *v = malloc(sizeof(float) * (size_t)nx);
            fill(v, nx, &s, 1.0f);
            env.next_input_q = NULL;
            double fd = fd_directional(ctx, op, env, xf, v, dyf, nx, 1e-2);
            double an = 0, mag = 0;
            const float *g = dx.data[0];
            for (int64_t i = 0; i < nx; i++) an += (double)g[i] * v[i], mag += fabs((double)g[i] * v[i]);
            CHECK(fabs(fd - an) <= 2e-3 * mag + 1e-3, "%s: directional FD %.6g vs gradient %.6g",
                  row->cls, fd, an);
            free(v);
        }
        (*covered)++;
        opf_tensor_release(&dx);
        for (int i = 0; i < OPF_OP_MAX_EXTRA; i++) opf_tensor_release(&dxe[i]);
    }
    free(dyf), free(dyr);
    for (int i = 0; i < 1 + cls->n_extra_out; i++) opf_tensor_release(&outs[i]);
done:
    opf_op_ctx_clear(&octx);
    opf_delayed_state_destroy(ds);
    free(xf), free(xr);
    opf_op_destroy(op);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    int covered = 0, total = 0;
    for (int r = 0; r < NROWS; r++)
        for (int d = 0; d < 3; d++)
            for (int k = 0; k < NREC; k++) {
                total++;
                run_row(ctx, &rows[r], dtypes[d], recipes[k], &covered);
            }
    /* every registered basic class has a row (fused classes are tested in tests/fusion/, the
     * language-model ones, which take token ids or logits and targets, in test_nn.c) */
    for (int i = 0; i < opf_op_class_count(); i++) {
        if (opf_op_class_at(i)->covers > 0) continue;
        const char *n = opf_op_class_at(i)->name;
        bool found = false;
        for (int r = 0; r < NROWS; r++) found |= !strcmp(rows[r].cls, n);
        bool nn = !strcmp(n, "embedding") || !strcmp(n, "attention") || !strcmp(n, "cross_entropy");
        CHECK(found || nn || !strcmp(n, "callback") || !strcmp(n, "user_scale"), "class %s has no row", n);
    }
    printf("op harness: %d of %d op x dtype x recipe rows covered\n", covered, total);
    if (missing[0]) printf("not covered:\n%s", missing);
    else printf("not covered: none\n");
    CHECK(covered == total, "%d rows not covered", total - covered);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
