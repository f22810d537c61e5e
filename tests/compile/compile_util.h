/* compile_util.h: helpers shared by the compile tests (tests/compile/test_*.c).
 *
 * Random tensors, model builders, an eager/compiled pair of contexts of the
 * same seed (identical parameters and Philox draws), one step run on both and
 * compared bit for bit, parameter and gradient comparisons, checksums, and a
 * user op without fakes (an eager node in every graph). A test that includes
 * compile/compile-impl.h before this header also gets the scenario 8 checks:
 * each traced node's args against the eager plan entry's, the plans, the
 * stats, and the per-class report.
 *
 * Every function is static inline and every object CU_UNUSED, so an includer
 * builds clean under -Wall -Wextra whatever it uses. Names start with cu_. */
#ifndef OPFUSE_TESTS_COMPILE_UTIL_H
#define OPFUSE_TESTS_COMPILE_UTIL_H

#include "../test.h"

#define CU_UNUSED __attribute__((unused))

/* The randomness of cu_rand; a test may reseed it (cu_rng = ...) in main. */
static unsigned long long cu_rng CU_UNUSED = 0xC0DE5EEDull;

/* The recipes and dtypes the compiled-vs-eager tables sweep. */
static const opf_recipe_kind cu_recipes[] CU_UNUSED = {OPF_RECIPE_NONE,  OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                                       OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8,   OPF_RECIPE_NVFP4};
enum { CU_NREC = sizeof cu_recipes / sizeof cu_recipes[0] };
static const opf_dtype cu_dtypes[] CU_UNUSED = {OPF_F32, OPF_BF16};
enum { CU_NDT = sizeof cu_dtypes / sizeof cu_dtypes[0] };

/* ---- tensors -------------------------------------------------------------------- */

/* A plain tensor of N(0, sigma) values rounded to dt, allocated in ctx. */
static inline opf_tensor cu_rand(opf_ctx *ctx, int ndim, const int64_t *shape, opf_dtype dt, float sigma)
{
    opf_spec s = opf_spec_make(ndim, shape, dt);
    int64_t n = opf_spec_numel(&s);
    float *v = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = opf_test_normal(&cu_rng, sigma);
    opf_tensor t;
    memset(&t, 0, sizeof t);
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &s, &t));
    if (t.data[0]) CHECK_OK(ctx, opf_convert(v, OPF_F32, t.data[0], dt, (size_t)n));
    free(v);
    return t;
}

/* The same, [m, k]. */
static inline opf_tensor cu_rand2(opf_ctx *ctx, int64_t m, int64_t k, opf_dtype dt, float sigma)
{
    return cu_rand(ctx, 2, (int64_t[]){m, k}, dt, sigma);
}

/* FNV-1a over every component of t's layout. */
static inline uint64_t cu_checksum(const opf_tensor *t)
{
    uint64_t h = 0xCBF29CE484222325ull;
    opf_layout L;
    if (opf_spec_layout(&t->spec, &L)) return 0;
    for (int c = 0; c < OPF_COMP_COUNT; c++) {
        if (!L.comp[c].present || !t->data[c]) continue;
        const unsigned char *b = t->data[c];
        for (size_t i = 0; i < L.comp[c].nbytes; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    }
    return h;
}

static inline bool cu_present(const opf_tensor *t) { return t->data[0] || t->data[OPF_COMP_COL_DATA]; }

/* Same presence, spec and bytes (a eager, b compiled); one CHECK that says what differs. */
static inline bool cu_same_tensor(const char *tag, const char *what, const opf_tensor *a, const opf_tensor *b)
{
    if (!cu_present(a) && !cu_present(b)) return true;
    if (cu_present(a) != cu_present(b)) {
        CHECK(0, "%s: %s present eagerly %d, compiled %d", tag, what, cu_present(a), cu_present(b));
        return false;
    }
    if (!opf_spec_equal(&a->spec, &b->spec)) {
        char sa[160], sb[160];
        opf_spec_str(&a->spec, sa, sizeof sa), opf_spec_str(&b->spec, sb, sizeof sb);
        CHECK(0, "%s: %s spec eager %s, compiled %s", tag, what, sa, sb);
        return false;
    }
    bool same = opf_test_same_bytes(a, b);
    CHECK(same, "%s: %s differs from eager", tag, what);
    return same;
}

/* ---- ops and models ------------------------------------------------------------- */

/* An op of class cls (CHECKed); NULL when the class refuses the config. */
static inline opf_op *cu_op(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    opf_status st = opf_op_create(ctx, cls, cfg, name, &op);
    CHECK(st == OPF_OK, "create %s: %s", cls, opf_last_error(ctx));
    return op;
}

/* Creates an op and appends it to seq, both CHECKed. */
static inline void cu_append(opf_ctx *ctx, opf_seq *seq, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = cu_op(ctx, cls, cfg, name);
    if (op) CHECK_OK(ctx, opf_seq_append(seq, op));
}

/* layernorm "ln" -> fc1 (+bias) -> act_cls act_name -> fc2 (+bias): the
 * LayerNorm-MLP with gelu, or with a user op in the activation's place. */
static inline opf_seq *cu_ln_mlp(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f, const char *act_cls,
                                 const char *act_name)
{
    opf_seq *seq = NULL;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    opf_layernorm_config ln = {.hidden = h, .eps = 1e-5, .dtype = dt};
    cu_append(ctx, seq, "layernorm", &ln, "ln");
    CHECK_OK(ctx, opf_seq_append_linear(seq, h, f, true, dt, "fc1"));
    cu_append(ctx, seq, act_cls, NULL, act_name);
    CHECK_OK(ctx, opf_seq_append_linear(seq, f, h, true, dt, "fc2"));
    return seq;
}

/* The LayerNorm-MLP with gelu: a cu_build_fn. */
typedef opf_seq *(*cu_build_fn)(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f);
static inline opf_seq *cu_ln_gelu_mlp(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    return cu_ln_mlp(ctx, dt, h, f, "gelu", "gelu");
}

/* ---- parameters and gradients --------------------------------------------------- */

/* How many parameter gradients of a and b (same structure) differ in
 * has_grad or bytes. */
static inline int cu_grads_differ(opf_seq *a, opf_seq *b)
{
    int bad = 0;
    for (int i = 0; i < opf_seq_len(a); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++) {
            const opf_param *pa = opf_op_param_const(opf_seq_at(a, i), p);
            const opf_param *pb = opf_op_param_const(opf_seq_at(b, i), p);
            bad += pa->has_grad != pb->has_grad || !opf_test_same_bytes(&pa->grad, &pb->grad);
        }
    return bad;
}

/* How many parameter values of a and b differ. */
static inline int cu_params_differ(opf_seq *a, opf_seq *b)
{
    int bad = 0;
    for (int i = 0; i < opf_seq_len(a); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++)
            bad += !opf_test_same_bytes(&opf_op_param_const(opf_seq_at(a, i), p)->value,
                                        &opf_op_param_const(opf_seq_at(b, i), p)->value);
    return bad;
}

/* Every parameter gradient of a (eager) and b (compiled), one CHECK each for
 * has_grad and for presence, spec and bytes. */
static inline void cu_compare_grads(const char *tag, opf_seq *a, opf_seq *b)
{
    for (int i = 0; i < opf_seq_len(a); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++) {
            const opf_param *pa = opf_op_param_const(opf_seq_at(a, i), p);
            const opf_param *pb = opf_op_param_const(opf_seq_at(b, i), p);
            char what[96];
            snprintf(what, sizeof what, "grad of %s.%s", opf_op_name(opf_seq_at(a, i)), pa->name);
            CHECK(pa->has_grad == pb->has_grad, "%s: %s: has_grad %d eager, %d compiled", tag, what,
                  pa->has_grad, pb->has_grad);
            cu_same_tensor(tag, what, &pa->grad, &pb->grad);
        }
}

/* The same random values in every 1-D parameter (biases start at zero, norm
 * weights at one) of both seqs; weights keep their seeded init. */
static inline void cu_randomize_params(opf_ctx *ctx, opf_seq *a, opf_seq *b)
{
    for (int i = 0; i < opf_seq_len(a); i++)
        for (int p = 0; p < opf_op_num_params(opf_seq_at(a, i)); p++) {
            opf_param *pa = opf_op_param(opf_seq_at(a, i), p), *pb = opf_op_param(opf_seq_at(b, i), p);
            if (pa->value.spec.ndim != 1) continue;
            opf_tensor t = cu_rand(ctx, 1, pa->value.spec.shape, pa->value.spec.dtype, 0.5f);
            size_t n = opf_dtype_nbytes(t.spec.dtype, (size_t)opf_spec_numel(&t.spec));
            memcpy(pa->value.data[0], t.data[0], n);
            memcpy(pb->value.data[0], t.data[0], n);
            opf_tensor_release(&t);
        }
}

/* Delayed states of every op of a and b: same slots, scales and histories. */
static inline int cu_delayed_differ(opf_seq *a, opf_seq *b, int *n_states)
{
    int bad = 0;
    for (int i = 0; i < opf_seq_len(a); i++) {
        opf_recipe_state *ra = opf_op_recipe_state(opf_seq_at(a, i)), *rb = opf_op_recipe_state(opf_seq_at(b, i));
        if (!ra || !rb) {
            bad += (ra == NULL) != (rb == NULL);
            continue;
        }
        for (int bwd = 0; bwd < 2; bwd++) {
            opf_delayed_state *da = opf_recipe_state_delayed(ra, bwd), *db = opf_recipe_state_delayed(rb, bwd);
            if (!da || !db) {
                bad += (da == NULL) != (db == NULL);
                continue;
            }
            ++*n_states;
            int ns = opf_delayed_state_slots(da), L = opf_delayed_state_history_len(da);
            if (ns != opf_delayed_state_slots(db) || L != opf_delayed_state_history_len(db)) {
                bad++;
                continue;
            }
            bad += memcmp(opf_delayed_state_scale(da), opf_delayed_state_scale(db), sizeof(float) * (size_t)ns) != 0;
            bad += memcmp(opf_delayed_state_history(da), opf_delayed_state_history(db),
                          sizeof(float) * (size_t)(ns * L)) != 0;
        }
    }
    return bad;
}

/* ---- an eager/compiled pair ----------------------------------------------------- */

typedef struct cu_pair {
    opf_ctx   *ca, *cb;  /* eager, compiled */
    opf_seq   *a, *b;    /* the same model built in each */
    opf_optim *oa, *ob;  /* optimizers of a and b, when cu_pair_sgd made them */
} cu_pair;

/* Two contexts of one seed; num_threads 0 is the default; warn (may be
 * NULL) receives the compiled context's warnings. False when one fails. */
static inline bool cu_pair_open(cu_pair *p, uint64_t seed, int num_threads, opf_warn_fn warn, void *warn_user)
{
    memset(p, 0, sizeof *p);
    opf_ctx_options o = opf_ctx_options_default();
    o.seed = seed;
    o.num_threads = num_threads;
    CHECK_OK(NULL, opf_ctx_create(&o, &p->ca));
    o.warn = warn, o.warn_user = warn_user;
    CHECK_OK(NULL, opf_ctx_create(&o, &p->cb));
    if (p->ca && p->cb) return true;
    opf_ctx_destroy(p->ca), opf_ctx_destroy(p->cb);
    return false;
}

/* A pair of one seed (no warning hook) with build(dt, h, f) on each side. */
static inline bool cu_pair_build(cu_pair *p, uint64_t seed, cu_build_fn build, opf_dtype dt, int64_t h, int64_t f)
{
    if (!cu_pair_open(p, seed, 0, NULL, NULL)) return false;
    p->a = build(p->ca, dt, h, f);
    p->b = build(p->cb, dt, h, f);
    return true;
}

/* Destroys the optimizers and seqs (NULL is fine), then the contexts. */
static inline void cu_pair_close(cu_pair *p)
{
    opf_optim_destroy(p->oa), opf_optim_destroy(p->ob);
    opf_seq_destroy(p->a), opf_seq_destroy(p->b);
    opf_ctx_destroy(p->ca), opf_ctx_destroy(p->cb);
    memset(p, 0, sizeof *p);
}

/* SGD with the same options on both seqs: the same updates on both sides. */
static inline bool cu_pair_sgd(cu_pair *p, float lr, float momentum)
{
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = lr, oo.momentum = momentum;
    CHECK_OK(p->ca, opf_optim_create(p->ca, p->a, OPF_OPTIM_SGD, &oo, &p->oa));
    CHECK_OK(p->cb, opf_optim_create(p->cb, p->b, OPF_OPTIM_SGD, &oo, &p->ob));
    return p->oa && p->ob;
}

/* One optimizer step on each side. */
static inline void cu_pair_optim_step(cu_pair *p)
{
    CHECK_OK(p->ca, opf_optim_step(p->oa));
    CHECK_OK(p->cb, opf_optim_step(p->ob));
}

/* *r the default recipe of kind, and the default call under it (no recipe
 * for OPF_RECIPE_NONE). r may be tuned afterwards: the call points at it. */
static inline opf_seq_call cu_call(opf_recipe_kind kind, opf_recipe *r)
{
    *r = opf_recipe_default(kind);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = kind == OPF_RECIPE_NONE ? NULL : r;
    return call;
}

/* opf_compile with the status CHECKed under tag; true when *g was made. */
static inline bool cu_compile(opf_ctx *cb, const char *tag, opf_seq *b, const opf_spec *xs,
                              const opf_seq_call *call, const opf_compile_options *o, opf_graph **g)
{
    opf_status st = opf_compile(b, xs, call, o, g);
    CHECK(st == OPF_OK, "%s: compile: %s", tag, opf_last_error(cb));
    return st == OPF_OK;
}

/* One forward + backward on each side. The compiled outputs (yb, dxb, deb)
 * are arena views: not released. */
typedef struct cu_step {
    opf_tensor ya, dxa, dea[2];  /* eager; dea: the extra inputs' gradients */
    opf_tensor yb, dxb, deb[2];  /* compiled */
} cu_step;

/* The eager step of p->a (gradients accumulate; zero them first if wanted). */
static inline void cu_eager_step(cu_pair *p, const opf_seq_call *call, const opf_tensor *x,
                                 const opf_tensor *dy, cu_step *s)
{
    CHECK_OK(p->ca, opf_seq_forward(p->a, x, call, &s->ya, NULL));
    CHECK_OK(p->ca, opf_seq_backward(p->a, dy, NULL, &s->dxa, s->dea));
}

/* The compiled step of p->b: through the cache c when given, else graph g. */
static inline void cu_compiled_step(cu_pair *p, opf_graph *g, opf_compiled *c, const opf_seq_call *call,
                                    const opf_tensor *x, const opf_tensor *dy, cu_step *s)
{
    if (c) {
        CHECK_OK(p->cb, opf_compiled_forward(c, x, call, &s->yb, NULL));
        CHECK_OK(p->cb, opf_compiled_backward(c, dy, NULL, &s->dxb, s->deb));
    } else {
        CHECK_OK(p->cb, opf_graph_forward(g, x, call, &s->yb, NULL));
        CHECK_OK(p->cb, opf_graph_backward(g, dy, NULL, &s->dxb, s->deb));
    }
}

/* y, dx and every parameter gradient of the two sides have the same bytes. */
static inline void cu_check_step(const char *tag, cu_pair *p, const cu_step *s)
{
    CHECK(s->ya.data[0] && opf_test_same_bytes(&s->ya, &s->yb), "%s: y differs", tag);
    CHECK(s->dxa.data[0] && opf_test_same_bytes(&s->dxa, &s->dxb), "%s: dx differs", tag);
    int bad = cu_grads_differ(p->a, p->b);
    CHECK(bad == 0, "%s: %d parameter gradients differ", tag, bad);
}

static inline void cu_step_release(cu_step *s)
{
    opf_tensor_release(&s->ya), opf_tensor_release(&s->dxa);
    opf_tensor_release(&s->dea[0]), opf_tensor_release(&s->dea[1]);
}

/* A whole step on fresh x [m, k] ~ N(0, 1) and dy ~ N(0, dy_sigma), with
 * zeroed gradients: eager, compiled (c or g), compared (cu_check_step). */
static inline void cu_compare_step(cu_pair *p, opf_graph *g, opf_compiled *c, const opf_seq_call *call,
                                   int64_t m, int64_t k, opf_dtype dt, float dy_sigma, const char *tag)
{
    opf_tensor x = cu_rand2(p->ca, m, k, dt, 1.0f), dy = cu_rand2(p->ca, m, k, dt, dy_sigma);
    cu_step s;
    memset(&s, 0, sizeof s);
    opf_seq_zero_grad(p->a);
    opf_seq_zero_grad(p->b);
    cu_eager_step(p, call, &x, &dy, &s);
    cu_compiled_step(p, g, c, call, &x, &dy, &s);
    cu_check_step(tag, p, &s);
    cu_step_release(&s);
    opf_tensor_release(&x), opf_tensor_release(&dy);
}

/* ---- a user op without fakes: y = s x, s a learnable scalar (1.25) ------------------
 * Per the contract of a class without fakes, forward_impl allocates outs[0]
 * and backward_impl the gradients it returns, so a graph runs it as an eager
 * node. Plain inputs of any float dtype, computed in f32 through scratch.
 * Register cu_nofake_class (name CU_NOFAKE) before use. */

#define CU_NOFAKE "cu_scale_nofake"

typedef struct cu_nf_fwd {
    opf_tensor x, s;
} cu_nf_fwd;
static const opf_field cu_nf_fwd_fields[] CU_UNUSED = {OPF_F_TENSOR(cu_nf_fwd, x), OPF_F_TENSOR(cu_nf_fwd, s)};
OPF_SCHEMA(cu_nf_fwd_schema, cu_nf_fwd, cu_nf_fwd_fields);

typedef struct cu_nf_bwd {
    opf_tensor dy, x, s;
} cu_nf_bwd;
static const opf_field cu_nf_bwd_fields[] CU_UNUSED = {OPF_F_TENSOR(cu_nf_bwd, dy), OPF_F_TENSOR(cu_nf_bwd, x),
                                                       OPF_F_TENSOR(cu_nf_bwd, s)};
OPF_SCHEMA(cu_nf_bwd_schema, cu_nf_bwd, cu_nf_bwd_fields);

static inline opf_status cu_nf_init(opf_ctx *ctx, opf_op *op)
{
    opf_spec s = opf_spec_make(1, (int64_t[]){1}, OPF_F32);
    int i = opf_op_add_param(ctx, op, "scale", &s);
    if (i < 0) return (opf_status)-i;
    *(float *)opf_op_param(op, i)->value.data[0] = 1.25f;
    return OPF_OK;
}

static inline opf_status cu_nf_resolve(opf_op *op, const opf_fwd_env *env, void *args)
{
    cu_nf_fwd *a = args;
    if (env->x->spec.scaling != OPF_SCALING_NONE) return OPF_ERR_DTYPE;
    a->x = *env->x;
    a->s = opf_op_param(op, 0)->value;
    return OPF_OK;
}

/* out = c * in (both plain, same shape), computed in f32 through scratch. */
static inline opf_status cu_nf_scale(opf_ctx *ctx, const opf_tensor *in, float c, opf_tensor *out)
{
    int64_t n = opf_spec_numel(&in->spec);
    size_t mark = opf_ctx_scratch_mark(ctx);
    float *v = opf_ctx_scratch_push(ctx, sizeof(float) * (size_t)n);
    opf_status st = v ? opf_convert(in->data[0], in->spec.dtype, v, OPF_F32, (size_t)n) : OPF_ERR_NO_MEMORY;
    for (int64_t i = 0; !st && i < n; i++) v[i] *= c;
    if (!st) st = opf_convert(v, OPF_F32, out->data[0], out->spec.dtype, (size_t)n);
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static inline opf_status cu_nf_impl(opf_ctx *ctx, const void *args, opf_tensor *outs, opf_tensor *aux)
{
    const cu_nf_fwd *a = args;
    opf_status st = opf_tensor_alloc(ctx, &a->x.spec, &outs[0]);
    return st ? st : cu_nf_scale(ctx, &a->x, *(const float *)a->s.data[0], &outs[0]);
}

static inline opf_status cu_nf_setup(opf_op *op, opf_op_ctx *c, const void *args, const opf_tensor *outs,
                                     const opf_tensor *aux)
{
    opf_tensor_retain(&((const cu_nf_fwd *)args)->x, &c->saved[c->n_saved++]);
    return OPF_OK;
}

static inline opf_status cu_nf_resolve_bwd(opf_op *op, const opf_op_ctx *c, const opf_bwd_env *env, void *b)
{
    cu_nf_bwd *a = b;
    if (env->dy->spec.scaling != OPF_SCALING_NONE) return OPF_ERR_DTYPE;
    a->dy = *env->dy;
    a->x = c->saved[0];
    a->s = opf_op_param(op, 0)->value;
    return OPF_OK;
}

/* dx = s dy, ds = sum(dy x) (sequential fp32 sum: deterministic) */
static inline opf_status cu_nf_bimpl(opf_ctx *ctx, const void *b, opf_tensor *g)
{
    const cu_nf_bwd *a = b;
    opf_status st = opf_tensor_alloc(ctx, &a->dy.spec, &g[0]);
    if (!st) st = opf_tensor_alloc(ctx, &a->s.spec, &g[1]);
    if (!st) st = cu_nf_scale(ctx, &a->dy, *(const float *)a->s.data[0], &g[0]);
    int64_t n = opf_spec_numel(&a->dy.spec);
    size_t mark = opf_ctx_scratch_mark(ctx);
    float *dy = opf_ctx_scratch_push(ctx, sizeof(float) * (size_t)n);
    float *x = opf_ctx_scratch_push(ctx, sizeof(float) * (size_t)n);
    if (!st && (!dy || !x)) st = OPF_ERR_NO_MEMORY;
    if (!st) st = opf_convert(a->dy.data[0], a->dy.spec.dtype, dy, OPF_F32, (size_t)n);
    if (!st) st = opf_convert(a->x.data[0], a->x.spec.dtype, x, OPF_F32, (size_t)n);
    float ds = 0;
    for (int64_t i = 0; !st && i < n; i++) ds += dy[i] * x[i];
    if (!st) *(float *)g[1].data[0] = ds;
    opf_ctx_scratch_pop(ctx, mark);
    return st;
}

static const opf_op_class cu_nofake_class CU_UNUSED = {
    .abi_version = OPF_OP_ABI_VERSION, .name = CU_NOFAKE,
    .fwd_schema = &cu_nf_fwd_schema, .bwd_schema = &cu_nf_bwd_schema, .fusible = true,
    .init = cu_nf_init, .resolve_fwd = cu_nf_resolve, .setup_context = cu_nf_setup,
    .resolve_bwd = cu_nf_resolve_bwd, .forward_impl = cu_nf_impl, .backward_impl = cu_nf_bimpl,
};

/* ---- scenario 8: a graph's conformance with the eager seq (needs compile-impl.h) ---- */

#ifdef OPFUSE_COMPILE_IMPL_H

enum { CU_MAXSLOTS = 64 };

/* Per op class: what the conformance checks saw. */
typedef struct cu_class_report {
    int nodes;  /* traced nodes whose args were compared with eager */
    int eager;  /* eager nodes (output specs only) */
    int slots;  /* tensor slots compared */
    int bad;    /* slots or specs that disagreed */
} cu_class_report;
static cu_class_report cu_report[256] CU_UNUSED;
static int cu_n_zero_dextra CU_UNUSED;  /* zeros blocks bound for a missing extra-output gradient */

static inline int cu_class_index(const opf_op_class *c)
{
    for (int i = 0; i < opf_op_class_count() && i < 256; i++)
        if (opf_op_class_at(i) == c) return i;
    return 0;
}

/* The eager seq's plan entry over [first, first + count) in one direction. */
static inline opf_op *cu_eager_entry(opf_seq *a, bool bwd, int first, int count)
{
    for (int gi = 0; gi < opf_seq_num_groups(a); gi++) {
        opf_plan_entry e[16];
        int n = opf_seq_plan(a, gi, bwd, e, 16);
        for (int i = 0; i < n && i < 16; i++)
            if (e[i].first == first && e[i].count == count) return e[i].op;
    }
    return NULL;
}

static inline bool cu_same_layout(const opf_spec *a, const opf_spec *b)
{
    opf_layout la, lb;
    if (opf_spec_layout(a, &la) || opf_spec_layout(b, &lb)) return false;
    bool same = la.m == lb.m && la.k == lb.k && la.total_bytes == lb.total_bytes;
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        same &= la.comp[c].present == lb.comp[c].present && la.comp[c].nbytes == lb.comp[c].nbytes;
    return same;
}

/* The node's baked args against the eager op's args of the same entry:
 * slot count, and per slot presence, spec and layout. With zero_dextra (no
 * extra-output gradient given) the graph binds its zeros block where eager
 * has no gradient: a "dextra" slot present only in the graph is expected. */
static inline void cu_check_node_args(const char *tag, const opf_gnode *n, opf_op *eop, bool zero_dextra,
                                      cu_class_report *rep)
{
    const char *dir = n->backward ? "backward" : "forward";
    void *eargs = n->backward ? eop->bwd_args : eop->fwd_args;
    opf_slot sg[CU_MAXSLOTS], se[CU_MAXSLOTS];
    int ng = opf_schema_slots(n->schema, n->args, sg, CU_MAXSLOTS);
    int ne = opf_schema_slots(n->schema, eargs, se, CU_MAXSLOTS);
    CHECK(ng == ne && ng <= CU_MAXSLOTS, "%s: %s %s: %d slots compiled, %d eager", tag, n->op->name, dir,
          ng, ne);
    rep->bad += ng != ne;
    for (int i = 0; i < ng && i < ne && i < CU_MAXSLOTS; i++) {
        const opf_tensor *tg = sg[i].tensor, *te = se[i].tensor;
        bool zeros = zero_dextra && n->backward && !strcmp(sg[i].field->name, "dextra") && cu_present(tg) &&
                     !cu_present(te);
        cu_n_zero_dextra += zeros;
        bool ok = zeros || cu_present(tg) == cu_present(te);
        if (ok && cu_present(tg) && cu_present(te))
            ok = opf_spec_equal(&tg->spec, &te->spec) && cu_same_layout(&tg->spec, &te->spec);
        char a[160] = "-", b[160] = "-";
        if (!ok) opf_spec_str(&tg->spec, a, sizeof a), opf_spec_str(&te->spec, b, sizeof b);
        CHECK(ok, "%s: %s %s slot %s: compiled %s (present %d), eager %s (present %d)", tag,
              n->op->name, dir, sg[i].field->name, a, cu_present(tg), b, cu_present(te));
        rep->slots++;
        rep->bad += !ok;
    }
    rep->nodes++;
}

/* Class names of the compiled nodes of one direction that run ops, as "a,b,c". */
static inline void cu_graph_plan_str(const opf_graph *g, bool bwd, char *buf, size_t size)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info in;
        if (opf_graph_node(g, i, &in) || in.backward != bwd || !in.class_name) continue;
        at += (size_t)snprintf(buf + at, size - at, "%s%s", at ? "," : "", in.class_name);
        if (at >= size) break;
    }
}

/* Class names of the eager plan of one direction in execution order, as
 * "a,b,c", less the ops that hand their input on there (they leave no
 * node), except the first to run: its input is the graph's x or dy, which a
 * node copies. */
static inline void cu_eager_plan_str(opf_seq *a, bool bwd, char *buf, size_t size)
{
    size_t at = 0;
    buf[0] = '\0';
    int ng = opf_seq_num_groups(a), seen = 0;
    for (int k = 0; k < ng; k++) {
        int gi = bwd ? ng - 1 - k : k;
        opf_plan_entry e[16];
        int n = opf_seq_plan(a, gi, bwd, e, 16);
        for (int j = 0; j < n && j < 16 && at < size; j++) {
            const opf_plan_entry *en = &e[bwd ? n - 1 - j : j];
            const opf_op_class *c = opf_op_class_of(en->op);
            bool handed_on = seen++ && (bwd ? c->backward_is_dy : c->forward_is_input);
            if (handed_on) continue;
            at += (size_t)snprintf(buf + at, size - at, "%s%s", at ? "," : "", c->name);
        }
    }
}

static inline void cu_check_stats(opf_ctx *cb, const char *tag, const opf_graph *g)
{
    opf_graph_stats s;
    opf_graph_get_stats(g, &s);
    int eager = 0, fused = 0;
    for (int i = 0; i < opf_graph_num_nodes(g); i++) {
        opf_graph_node_info in;
        CHECK_OK(cb, opf_graph_node(g, i, &in));
        eager += in.kind == OPF_NODE_EAGER_FORWARD || in.kind == OPF_NODE_EAGER_BACKWARD;
        fused += in.fused;
    }
    CHECK(s.arena_bytes > 0 && s.n_values > 0 && s.arena_bytes <= s.unplanned_bytes, "%s: stats arena %zu "
          "(unplanned %zu), %d values", tag, s.arena_bytes, s.unplanned_bytes, s.n_values);
    CHECK(s.n_forward > 0 && s.n_backward > 0 && s.n_forward + s.n_backward == opf_graph_num_nodes(g),
          "%s: stats %d + %d nodes of %d", tag, s.n_forward, s.n_backward, opf_graph_num_nodes(g));
    CHECK(s.n_eager == eager && s.n_fused == fused && opf_graph_reasons(g, NULL, 0) == eager,
          "%s: stats eager %d fused %d, nodes say %d / %d", tag, s.n_eager, s.n_fused, eager, fused);
    CHECK(!s.forward_only && s.max_leading == 0, "%s: stats forward_only %d max_leading %lld", tag,
          s.forward_only, (long long)s.max_leading);
}

/* The public outputs of one step: y, the first extra output, dx, the first
 * extra input's gradient. */
typedef struct cu_outs {
    opf_tensor y, eo, dx, dei;
} cu_outs;

static inline void cu_outs_release(cu_outs *o)
{
    opf_tensor_release(&o->y), opf_tensor_release(&o->eo);
    opf_tensor_release(&o->dx), opf_tensor_release(&o->dei);
}

/* Scenario 8 for one graph g of the seq compiled in cb against the eager
 * seq a: plans, node args, public output specs (ea eager, eb compiled),
 * stats. */
static inline void cu_check_conformance(opf_ctx *cb, const char *tag, opf_seq *a, const opf_graph *g,
                                        const cu_outs *ea, const cu_outs *eb, bool zero_dextra)
{
    for (int bwd = 0; bwd < 2; bwd++) {
        char pg[512], pe[512];
        cu_graph_plan_str(g, bwd, pg, sizeof pg);
        cu_eager_plan_str(a, bwd, pe, sizeof pe);
        CHECK(!strcmp(pg, pe), "%s: compiled %s nodes %s, eager plan %s", tag, bwd ? "backward" : "forward",
              pg, pe);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const opf_gnode *n = &g->nodes[i];
        if (!n->op) continue;
        cu_class_report *rep = &cu_report[cu_class_index(n->op->cls)];
        if (n->kind == OPF_NODE_EAGER_FORWARD || n->kind == OPF_NODE_EAGER_BACKWARD) {
            rep->eager++;
            continue;
        }
        opf_op *eop = cu_eager_entry(a, n->backward, n->first, n->count);
        CHECK(eop && eop->cls == n->op->cls, "%s: node %s has no eager entry of its class", tag, n->op->name);
        if (eop && eop->cls == n->op->cls) cu_check_node_args(tag, n, eop, zero_dextra, rep);
    }
    const opf_tensor *pa[] = {&ea->y, &ea->eo, &ea->dx, &ea->dei};
    const opf_tensor *pb[] = {&eb->y, &eb->eo, &eb->dx, &eb->dei};
    static const char *const names[] = {"y", "extra output", "dx", "extra-input grad"};
    const opf_op *last = opf_seq_at(a, opf_seq_len(a) - 1);
    for (int k = 0; k < 4; k++) {
        bool ok = cu_present(pa[k]) == cu_present(pb[k]) &&
                  (!cu_present(pa[k]) || opf_spec_equal(&pa[k]->spec, &pb[k]->spec));
        CHECK(ok, "%s: %s spec differs (scenario 8)", tag, names[k]);
        cu_report[cu_class_index(last->cls)].bad += !ok;
    }
    cu_check_stats(cb, tag, g);
}

/* Prints the per-class report of the fused classes (fused) or of the basic
 * ones, and CHECKs each was checked (an eager-only class as an eager node)
 * with no mismatch. The callback class is a user step: reported, not required. */
static inline void cu_report_classes(bool fused)
{
    printf("conformance per %sclass (compiled vs eager args):\n", fused ? "fused " : "");
    for (int i = 0; i < opf_op_class_count(); i++) {
        const opf_op_class *c = opf_op_class_at(i);
        const cu_class_report *r = &cu_report[i];
        if ((c->covers > 0) != fused) {
            if (!fused) printf("  %-32s fused: test_compile_fused\n", c->name);
            continue;
        }
        printf("  %-32s %4d nodes, %5d slots, %3d eager nodes, %d mismatches\n", c->name, r->nodes,
               r->slots, r->eager, r->bad);
        if (!strcmp(c->name, "callback")) continue;
        /* the language-model classes take token ids, qkv or logits with targets, not these
         * rows' inputs: tests/train/train_short.sh compiles embedding and attention in the
         * GPT (eager == compiled, byte for byte) */
        if (!strcmp(c->name, "embedding") || !strcmp(c->name, "attention") ||
            !strcmp(c->name, "cross_entropy"))
            continue;
        bool eager_only = c->unsupported_reason != NULL;
        CHECK(eager_only ? r->eager > 0 : r->nodes > 0 && r->slots > 0, "class %s: never checked", c->name);
        CHECK(r->bad == 0, "class %s: %d mismatches", c->name, r->bad);
    }
}

#endif /* OPFUSE_COMPILE_IMPL_H */

#endif
