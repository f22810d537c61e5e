/* test_inplace.c: every registered op class that sets .inplace (its
 * forward_impl stays correct when y's memory is x's) gives, run in place,
 * the bytes it gives into a separate output. For f32 and bf16 inputs
 * [8, 64], args come from the class's own resolve_fwd; forward_impl runs
 * twice through the vtable from the same rng state: once into fresh
 * outputs, once with x's slots pointing at a copy of x and outs[0] at that
 * same copy. Every output and aux must match byte for byte. Also: the
 * classes known to be safe set the flag (at least 5 of them). */
#include "test.h"

#include "ops/ops-impl.h"

enum { ROWS = 8, COLS = 64, MAX_SLOTS = 16 };

static opf_ctx *ctx;
static unsigned long long rng = 0x1A9ull;

/* A config (NULL: the class default) and kwargs (NULL: none) to run a class with. */
typedef struct ip_case {
    const char *cls;
    const void *cfg;
    const void *kwargs;
} ip_case;

static const opf_reshape_config reshape_cfg = {2, {ROWS * 2, COLS / 2}};
static const opf_constant_scale_config scale_cfg = {0.75};
static const opf_bias_config bias_cfg = {COLS, OPF_F32};
static const opf_dropout_config drop_cfg = {0.25};
static const opf_dropout_kwargs drop_eval = {false};
static const opf_inplace_config add_in_place = {true};

/* Classes that need a config, or have a variant worth a run; any other class
 * with .inplace runs once with its default config. */
static const ip_case cases[] = {
    {"reshape", &reshape_cfg, NULL},
    {"constant_scale", &scale_cfg, NULL},
    {"bias", &bias_cfg, NULL},
    {"dropout", &drop_cfg, NULL},
    {"dropout", &drop_cfg, &drop_eval},
    {"add_extra_input", NULL, NULL},
    {"add_extra_input", &add_in_place, NULL},
};
enum { N_CASES = sizeof cases / sizeof cases[0] };

/* The classes whose forward_impl was read and found safe in place. */
static const char *const expect_inplace[] = {
    "identity", "reshape", "constant_scale", "bias", "gelu", "qgelu", "relu",
    "srelu", "silu", "dropout", "add_extra_input", "make_extra_output", "quantize",
};

static void none_specs(opf_spec *s, int n)
{
    memset(s, 0, sizeof *s * (size_t)n);
    for (int i = 0; i < n; i++) s[i].ndim = OPF_SPEC_NONE_NDIM;
}

/* Fills a plain tensor with N(0, 1) values rounded to its dtype. */
static void fill_random(opf_tensor *t)
{
    int64_t n = opf_spec_numel(&t->spec);
    float *v = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(&rng, 1.0f);
    CHECK_OK(ctx, opf_convert(v, OPF_F32, t->data[OPF_COMP_DATA], t->spec.dtype, (size_t)n));
    free(v);
}

/* Can y live in x's memory? Plain, same dtype, same element count (a
 * reshape changes only the shape). */
static bool same_layout(const opf_spec *y, const opf_spec *x)
{
    return y->ndim >= 0 && y->scaling == OPF_SCALING_NONE && x->scaling == OPF_SCALING_NONE &&
           y->dtype == x->dtype && opf_spec_numel(y) == opf_spec_numel(x);
}

static opf_status alloc_specs(const opf_spec *s, opf_tensor *t, int n)
{
    memset(t, 0, sizeof *t * (size_t)n);
    for (int i = 0; i < n; i++)
        if (s[i].ndim >= 0) {
            opf_status st = opf_tensor_alloc(ctx, &s[i], &t[i]);
            if (st) return st;
        }
    return OPF_OK;
}

static void release_all(opf_tensor *t, int n)
{
    for (int i = 0; i < n; i++) opf_tensor_release(&t[i]);
}

/* forward_impl from rng state (seed, off), scratch popped after. */
static opf_status run_impl(const opf_op_class *cls, const void *args, opf_tensor *outs,
                           opf_tensor *aux, uint64_t seed, uint64_t off)
{
    opf_ctx_set_rng(ctx, seed, off);
    size_t mark = opf_ctx_scratch_mark(ctx);
    opf_status st = cls->forward_impl(ctx, args, outs, aux);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

/* Points every tensor slot of args that is x (its memory) at xb instead;
 * returns how many there were. */
static int redirect_x(const opf_schema *schema, void *args, const opf_tensor *x, const opf_tensor *xb)
{
    opf_slot slots[MAX_SLOTS];
    int n = opf_schema_slots(schema, args, slots, MAX_SLOTS), hits = 0;
    for (int i = 0; i < n && i < MAX_SLOTS; i++)
        if (slots[i].tensor->data[OPF_COMP_DATA] == x->data[OPF_COMP_DATA]) {
            memcpy(slots[i].tensor->data, xb->data, sizeof xb->data);
            hits++;
        }
    return hits;
}

static void run_case(const opf_op_class *cls, const ip_case *k, opf_dtype dt)
{
    char tag[96];
    snprintf(tag, sizeof tag, "%s %s%s%s", cls->name, opf_dtype_name(dt), k->cfg ? " cfg" : "",
             k->kwargs ? " kwargs" : "");
    const void *cfg = k->cfg;
    opf_bias_config bias = bias_cfg;
    if (cfg == &bias_cfg) {
        bias.dtype = dt;
        cfg = &bias;
    }
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls->name, cfg, "ip", &op));
    if (!op) return;
    for (int i = 0; i < opf_op_num_params(op); i++) fill_random(&opf_op_param(op, i)->value);

    opf_spec xs = opf_spec_make(2, (int64_t[]){ROWS, COLS}, dt);
    opf_tensor x, xb, extra[OPF_OP_MAX_EXTRA];
    memset(extra, 0, sizeof extra);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &xs, &x));
    fill_random(&x);
    opf_fwd_env env = {.ctx = ctx, .x = &x, .requires_grad = true, .kwargs = k->kwargs};
    for (int i = 0; i < cls->n_extra_in; i++) {
        CHECK_OK(ctx, opf_tensor_alloc(ctx, &xs, &extra[i]));
        fill_random(&extra[i]);
        env.extra_in[i] = &extra[i];
    }
    _Alignas(16) unsigned char args[OPF_OP_ARGS_MAX], args_b[OPF_OP_ARGS_MAX];
    memset(args, 0, sizeof args);
    opf_spec os[1 + OPF_OP_MAX_EXTRA], as[OPF_OP_MAX_AUX];
    none_specs(os, 1 + OPF_OP_MAX_EXTRA);
    none_specs(as, OPF_OP_MAX_AUX);
    int n_out = 1 + cls->n_extra_out;
    opf_tensor oa[1 + OPF_OP_MAX_EXTRA], ob[1 + OPF_OP_MAX_EXTRA], aa[OPF_OP_MAX_AUX],
        ab[OPF_OP_MAX_AUX];
    memset(oa, 0, sizeof oa), memset(ob, 0, sizeof ob), memset(aa, 0, sizeof aa), memset(ab, 0, sizeof ab);
    memset(&xb, 0, sizeof xb);
    CHECK_OK(ctx, cls->resolve_fwd(op, &env, args));
    CHECK_OK(NULL, cls->forward_fake(args, os, as));
    if (!same_layout(&os[0], &xs)) {
        CHECK(0, "%s: y is not laid out like x, so it never runs in place; add a case", tag);
        goto done;
    }
    uint64_t seed, off;
    opf_ctx_get_rng(ctx, &seed, &off);

    /* separate output */
    CHECK_OK(ctx, alloc_specs(os, oa, n_out));
    CHECK_OK(ctx, alloc_specs(as, aa, OPF_OP_MAX_AUX));
    CHECK_OK(ctx, run_impl(cls, args, oa, aa, seed, off));

    /* in place: x's slots and outs[0] on one copy of x */
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &xs, &xb));
    memcpy(xb.data[OPF_COMP_DATA], x.data[OPF_COMP_DATA], opf_dtype_nbytes(dt, ROWS * COLS));
    memcpy(args_b, args, cls->fwd_schema->size);
    CHECK(redirect_x(cls->fwd_schema, args_b, &x, &xb) >= 1, "%s: x is no slot of the args", tag);
    CHECK_OK(ctx, opf_tensor_wrap(&os[0], xb.data[OPF_COMP_DATA], &ob[0]));
    CHECK_OK(ctx, alloc_specs(os + 1, ob + 1, n_out - 1));
    CHECK_OK(ctx, alloc_specs(as, ab, OPF_OP_MAX_AUX));
    CHECK_OK(ctx, run_impl(cls, args_b, ob, ab, seed, off));

    CHECK(opf_test_same_bytes(&oa[0], &ob[0]), "%s: y in place differs", tag);
    for (int i = 1; i < n_out; i++)
        CHECK(opf_test_same_bytes(&oa[i], &ob[i]), "%s: output %d differs when y is in place", tag, i);
    for (int i = 0; i < OPF_OP_MAX_AUX; i++)
        if (as[i].ndim >= 0)
            CHECK(opf_test_same_bytes(&aa[i], &ab[i]), "%s: aux %d differs in place", tag, i);
done:
    opf_tensor_release(&ob[0]);
    release_all(ob + 1, n_out - 1);
    release_all(oa, n_out);
    release_all(aa, OPF_OP_MAX_AUX);
    release_all(ab, OPF_OP_MAX_AUX);
    release_all(extra, OPF_OP_MAX_EXTRA);
    opf_tensor_release(&x);
    opf_tensor_release(&xb);
    opf_op_destroy(op);
}

/* Runs every case of the class (its default config when the table has none). */
static int run_class(const opf_op_class *cls)
{
    static const opf_dtype dts[] = {OPF_F32, OPF_BF16};
    int runs = 0;
    for (int d = 0; d < 2; d++) {
        bool listed = false;
        for (int i = 0; i < N_CASES; i++)
            if (!strcmp(cases[i].cls, cls->name)) {
                listed = true;
                run_case(cls, &cases[i], dts[d]);
                runs++;
            }
        if (!listed) {
            ip_case dflt = {cls->name, NULL, NULL};
            run_case(cls, &dflt, dts[d]);
            runs++;
        }
    }
    return runs;
}

int main(void)
{
    if (opf_ctx_create(NULL, &ctx) != OPF_OK) return 1;
    int n_inplace = 0, runs = 0;
    for (int i = 0; i < opf_op_class_count(); i++) {
        const opf_op_class *cls = opf_op_class_at(i);
        if (!cls->inplace) continue;
        n_inplace++;
        CHECK(cls->forward_impl && cls->resolve_fwd && cls->forward_fake,
              "%s: in place needs a forward, its resolve and its fake", cls->name);
        if (cls->forward_impl && cls->resolve_fwd && cls->forward_fake) runs += run_class(cls);
    }
    CHECK(n_inplace >= 5, "only %d classes set inplace", n_inplace);
    for (size_t i = 0; i < sizeof expect_inplace / sizeof expect_inplace[0]; i++) {
        const opf_op_class *c = opf_op_class_find(expect_inplace[i]);
        CHECK(c && c->inplace, "%s should set inplace", expect_inplace[i]);
    }
    printf("in place: %d classes, %d runs\n", n_inplace, runs);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
