/* op_cases.h: the enumeration of op cases the digest test and the CUDA op
 * test share: every basic op class as a row (class, config, extra input),
 * the recipes and dtypes each row runs under, seeded random inputs and
 * parameters, and the quantizers a neighbour hands an op under a recipe.
 * Include after test.h. */
#ifndef OPFUSE_TEST_OP_CASES_H
#define OPFUSE_TEST_OP_CASES_H

#include "test.h"

enum { ROWS = 64, COLS = 128, HID = 64, STEPS_DELAYED = 3 };

static const opf_recipe_kind recipes[] = {OPF_RECIPE_NONE,  OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                          OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8,   OPF_RECIPE_NVFP4};
enum { NREC = sizeof recipes / sizeof recipes[0] };
static const opf_dtype dtypes[] = {OPF_F32, OPF_BF16, OPF_F16};
enum { NDT = sizeof dtypes / sizeof dtypes[0] };

static inline int steps_for(opf_recipe_kind rk) { return rk == OPF_RECIPE_DELAYED ? STEPS_DELAYED : 1; }

/* Uniform values in [lo, hi) stored as dt into dst (n elements). */
static inline void fill_raw(unsigned long long *s, void *dst, opf_dtype dt, int64_t n, float lo, float hi)
{
    float *f = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) f[i] = opf_test_uniform(s, lo, hi);
    opf_convert(f, OPF_F32, dst, dt, (size_t)n);
    free(f);
}

static inline opf_tensor rand_tensor(opf_ctx *ctx, unsigned long long *s, int ndim, const int64_t *shape, opf_dtype dt,
                              float lo, float hi)
{
    opf_spec sp = opf_spec_make(ndim, shape, dt);
    opf_tensor t;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sp, &t));
    if (t.data[0]) fill_raw(s, t.data[0], dt, opf_spec_numel(&sp), lo, hi);
    return t;
}

static inline opf_tensor rand2(opf_ctx *ctx, unsigned long long *s, int64_t m, int64_t k, opf_dtype dt)
{
    return rand_tensor(ctx, s, 2, (int64_t[]){m, k}, dt, -2.0f, 2.0f);
}

/* Non-trivial values in every parameter (weights small, 1-D ones around 1). */
static inline void randomize_params(opf_op *op, unsigned long long *s)
{
    for (int i = 0; i < opf_op_num_params(op); i++) {
        opf_param *p = opf_op_param(op, i);
        bool vec = p->value.spec.ndim == 1;
        fill_raw(s, p->value.data[0], p->value.spec.dtype, opf_spec_numel(&p->value.spec), vec ? 0.5f : -0.2f,
                 vec ? 1.5f : 0.2f);
        p->qvalue_valid = false;
    }
}

static inline void randomize_seq(opf_seq *seq, unsigned long long *s)
{
    for (int i = 0; i < opf_seq_len(seq); i++) randomize_params(opf_seq_at(seq, i), s);
}

/* The recipe as the cases use it: the defaults of its kind. */
static inline opf_recipe recipe_of(opf_recipe_kind rk) { return opf_recipe_default(rk); }

/* The quantizer a "linear" module of recipe r uses for role, with its own
 * delayed state when the recipe is delayed (*ds, which the caller destroys). */
static inline opf_status role_quantizer(opf_ctx *ctx, const opf_recipe *r, opf_tensor_role role, opf_quantizer *q,
                                 opf_delayed_state **ds)
{
    opf_quantizer_role qr = {"linear", role, "digest"};
    *q = opf_quantizer_default();
    *ds = NULL;
    opf_status st = opf_recipe_quantizer(r, &qr, q);
    if (st || r->kind != OPF_RECIPE_DELAYED) return st;
    bool bwd = role == OPF_ROLE_GRAD_OUTPUT || role == OPF_ROLE_GRAD_INPUT;
    st = opf_delayed_state_create(ctx, r->format, r->margin, 4, r->amax_algo, bwd, 1, ds);
    q->delayed = *ds, q->slot = 0;
    return st;
}

typedef enum extra_kind { EX_NONE, EX_LIKE_X, EX_LIKE_Y, EX_SPLITS, EX_SCALES } extra_kind;

typedef struct op_row {
    const char *name;      /* the case's name: the class, or class.variant */
    const char *cls;
    const void *cfg;       /* NULL: the class's default */
    ptrdiff_t   dtype_at;  /* offset of the config's dtype field (set to the case's), or -1 */
    extra_kind  extra;     /* extra input 0 */
} op_row;

static const opf_bias_config bias_cfg = {COLS, OPF_F32};
static const opf_norm_config norm_cfg = {COLS, 1e-5, false, OPF_F32};
static const opf_norm_config norm_zc_cfg = {COLS, 1e-5, true, OPF_F32};
static const opf_l2norm_config l2_cfg = {1e-6};
static const opf_basic_linear_config lin_cfg = {COLS, HID, OPF_F32, false};
static const opf_basic_linear_config lin_mg_cfg = {COLS, HID, OPF_F32, true};
static const opf_constant_scale_config scale_cfg = {0.75};
static const opf_reshape_config reshape_cfg = {2, {ROWS * 2, COLS / 2}};
static const opf_clamped_swiglu_config clamp_cfg = {1.5, 1.702};  /* a limit the inputs cross */
static const opf_dropout_config drop_cfg = {0.25};
static const opf_grouped_linear_config grouped_cfg = {2, COLS, HID, true, OPF_F32, false};
static const opf_inplace_config in_place_cfg = {true};
static const opf_quantize_config quant_fb_cfg = {true, true};

#define DT_AT(st) (ptrdiff_t) offsetof(st, dtype)
static const op_row op_rows[] = {
    {"identity", "identity", NULL, -1, EX_NONE},
    {"reshape", "reshape", &reshape_cfg, -1, EX_NONE},
    {"constant_scale", "constant_scale", &scale_cfg, -1, EX_NONE},
    {"bias", "bias", &bias_cfg, DT_AT(opf_bias_config), EX_NONE},
    {"basic_linear", "basic_linear", &lin_cfg, DT_AT(opf_basic_linear_config), EX_NONE},
    {"basic_linear.main_grad", "basic_linear", &lin_mg_cfg, DT_AT(opf_basic_linear_config), EX_NONE},
    {"layernorm", "layernorm", &norm_cfg, DT_AT(opf_norm_config), EX_NONE},
    {"layernorm.zero_centered", "layernorm", &norm_zc_cfg, DT_AT(opf_norm_config), EX_NONE},
    {"rmsnorm", "rmsnorm", &norm_cfg, DT_AT(opf_norm_config), EX_NONE},
    {"rmsnorm.zero_centered", "rmsnorm", &norm_zc_cfg, DT_AT(opf_norm_config), EX_NONE},
    {"l2normalization", "l2normalization", &l2_cfg, -1, EX_NONE},
    {"gelu", "gelu", NULL, -1, EX_NONE},
    {"qgelu", "qgelu", NULL, -1, EX_NONE},
    {"relu", "relu", NULL, -1, EX_NONE},
    {"srelu", "srelu", NULL, -1, EX_NONE},
    {"silu", "silu", NULL, -1, EX_NONE},
    {"glu", "glu", NULL, -1, EX_NONE},
    {"geglu", "geglu", NULL, -1, EX_NONE},
    {"qgeglu", "qgeglu", NULL, -1, EX_NONE},
    {"reglu", "reglu", NULL, -1, EX_NONE},
    {"sreglu", "sreglu", NULL, -1, EX_NONE},
    {"swiglu", "swiglu", NULL, -1, EX_NONE},
    {"clamped_swiglu", "clamped_swiglu", &clamp_cfg, -1, EX_NONE},
    {"scaled_swiglu", "scaled_swiglu", NULL, -1, EX_SCALES},
    {"add_extra_input", "add_extra_input", NULL, -1, EX_LIKE_X},
    {"add_extra_input.in_place", "add_extra_input", &in_place_cfg, -1, EX_LIKE_X},
    {"make_extra_output", "make_extra_output", NULL, -1, EX_NONE},
    {"make_extra_output.in_place", "make_extra_output", &in_place_cfg, -1, EX_NONE},
    {"quantize", "quantize", NULL, -1, EX_NONE},
    {"quantize.fwd_bwd", "quantize", &quant_fb_cfg, -1, EX_NONE},
    {"dropout", "dropout", &drop_cfg, -1, EX_NONE},
    {"grouped_linear", "grouped_linear", &grouped_cfg, DT_AT(opf_grouped_linear_config), EX_SPLITS},
};
enum { N_OP_ROWS = sizeof op_rows / sizeof op_rows[0] };

/* An extra input of the given kind for a [ROWS, ...] main input. Split sizes
 * are uneven, and multiples of 32 where the recipe quantizes in blocks. */
static inline opf_tensor make_extra(opf_ctx *ctx, extra_kind k, opf_dtype dt, opf_recipe_kind rk, unsigned long long *s)
{
    opf_tensor t;
    memset(&t, 0, sizeof t);
    if (k == EX_LIKE_X) return rand2(ctx, s, ROWS, COLS, dt);
    if (k == EX_LIKE_Y) return rand2(ctx, s, ROWS, HID, dt);
    if (k == EX_SCALES) return rand_tensor(ctx, s, 1, (int64_t[]){ROWS}, OPF_F32, 0.5f, 1.5f);
    if (k == EX_SPLITS) {
        opf_spec sp = opf_spec_make(1, (int64_t[]){2}, OPF_I64);
        CHECK_OK(ctx, opf_tensor_alloc(ctx, &sp, &t));
        int64_t first = rk <= OPF_RECIPE_CURRENT ? 11 : 32;
        ((int64_t *)t.data[0])[0] = first, ((int64_t *)t.data[0])[1] = ROWS - first;
    }
    return t;
}

/* A random plain tensor of t's logical shape in dt. */
static inline opf_tensor rand_like(opf_ctx *ctx, unsigned long long *s, const opf_tensor *t, opf_dtype dt)
{
    return rand_tensor(ctx, s, t->spec.ndim, t->spec.shape, dt, -1.0f, 1.0f);
}

typedef struct op_quant {
    const opf_quantizer *next_input, *grad;  /* NULL without a recipe */
} op_quant;

/* The config of row with the case's dtype where the config has one. */
static inline const void *row_config(const op_row *row, opf_dtype dt, unsigned char *buf, size_t size)
{
    if (!row->cfg || row->dtype_at < 0) return row->cfg;
    const opf_op_class *c = opf_op_class_find(row->cls);
    if (!c || c->config_size > size) return row->cfg;
    memcpy(buf, row->cfg, c->config_size);
    memcpy(buf + row->dtype_at, &dt, sizeof dt);
    return buf;
}

/* After a step under delayed scaling: roll the histories and rescale, as the
 * fuser does between steps. */
static inline void update_delayed(opf_ctx *ctx, opf_op *op, opf_delayed_state *const *ds, int n)
{
    opf_recipe_state *rs = opf_op_recipe_state(op);
    for (int bwd = 0; rs && bwd < 2; bwd++) CHECK_OK(ctx, opf_recipe_state_update(ctx, rs, bwd, NULL, NULL));
    for (int i = 0; i < n; i++)
        if (ds[i]) CHECK_OK(ctx, opf_delayed_state_update(ctx, ds[i], NULL, NULL));
}

#endif
