/* test_ownership.c: an op belongs to one seq (a second seq refuses it and
 * leaves it to the first); an optimizer freezes its seq's ops (mutations
 * refused while it lives) and refuses to step once its seq is gone, in
 * either order of destruction; every public entry taking a context refuses
 * a NULL one (those that return no status do nothing and answer neutrally;
 * the delayed-state entries take NULL for the state's own context). */
#include "test.h"

static opf_op *mk(opf_ctx *ctx, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    CHECK_OK(ctx, opf_op_create(ctx, cls, cfg, name, &op));
    return op;
}

static void test_one_seq(opf_ctx *ctx)
{
    opf_seq *a, *b;
    CHECK_OK(ctx, opf_seq_create(ctx, &a));
    CHECK_OK(ctx, opf_seq_create(ctx, &b));
    opf_op *bias = NULL;
    opf_bias_config bc = {16, OPF_F32};
    CHECK_OK(ctx, opf_op_create(ctx, "bias", &bc, "b0", &bias));
    CHECK_OK(ctx, opf_seq_append(a, bias));
    CHECK_FAILS(ctx, opf_seq_append(b, bias), OPF_ERR_INVALID_ARG, "opf_seq_insert", "\"b0\"",
                "another seq");
    CHECK_FAILS(ctx, opf_seq_insert(b, 0, bias), OPF_ERR_INVALID_ARG, "\"b0\"", "another seq");
    CHECK(opf_seq_len(a) == 1 && opf_seq_at(a, 0) == bias && opf_seq_len(b) == 0,
          "a refused append changed a seq");
    CHECK(opf_op_num_params(bias) == 1, "the op was destroyed by the refusal");
    /* removed with out: the caller owns it and may give it to another seq */
    opf_op *out = NULL;
    CHECK_OK(ctx, opf_seq_remove(a, 0, &out));
    CHECK(out == bias, "remove");
    CHECK_OK(ctx, opf_seq_append(b, bias));
    CHECK(opf_seq_at(b, 0) == bias, "re-append");
    opf_seq_destroy(a);
    opf_seq_destroy(b);  /* under ASan: one free of the op */
}

static void test_optim_follows(opf_ctx *ctx)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, 8, 8, true, OPF_F32, "fc"));
    opf_optim *opt;
    CHECK_OK(ctx, opf_optim_create(ctx, seq, OPF_OPTIM_SGD, NULL, &opt));
    int slots = opf_optim_num_slots(opt);
    CHECK_FAILS(ctx, opf_seq_append(seq, mk(ctx, "identity", NULL, "late")), OPF_ERR_STATE,
                "opf_seq_insert", "optimizer", "\"late\"");
    CHECK_FAILS(ctx, opf_seq_append_linear(seq, 8, 8, false, OPF_F32, "fc2"), OPF_ERR_STATE,
                "optimizer");
    CHECK_FAILS(ctx, opf_seq_remove(seq, 0, NULL), OPF_ERR_STATE, "opf_seq_remove", "optimizer");
    CHECK(opf_seq_len(seq) == 2 && opf_optim_num_slots(opt) == slots, "a refused mutation changed "
          "the seq (%d ops) or the optimizer (%d slots)", opf_seq_len(seq), opf_optim_num_slots(opt));
    CHECK_OK(ctx, opf_optim_step(opt));
    /* a second optimizer over the same seq: both must go before a mutation */
    opf_optim *opt2;
    CHECK_OK(ctx, opf_optim_create(ctx, seq, OPF_OPTIM_ADAMW, NULL, &opt2));
    opf_optim_destroy(opt);
    CHECK_FAILS(ctx, opf_seq_remove(seq, 1, NULL), OPF_ERR_STATE, "optimizer");
    opf_optim_destroy(opt2);
    CHECK_OK(ctx, opf_seq_remove(seq, 1, NULL));
    CHECK_OK(ctx, opf_seq_append(seq, mk(ctx, "identity", NULL, "late")));
    /* the seq destroyed first: the optimizer refuses to step, then goes */
    CHECK_OK(ctx, opf_optim_create(ctx, seq, OPF_OPTIM_ADAMW, NULL, &opt));
    opf_seq_destroy(seq);
    CHECK_FAILS(ctx, opf_optim_step(opt), OPF_ERR_STATE, "opf_optim_step", "seq", "destroyed");
    opf_optim_destroy(opt);
}

static opf_status reduce(void *user, float *amax, int n)
{
    (void)user, (void)amax, (void)n;
    return OPF_OK;
}

static int match(opf_op *const *ops, int n, const opf_recipe *r, void *user)
{
    (void)ops, (void)n, (void)r, (void)user;
    return 0;
}

#define REFUSED(expr)                                                                   \
    do {                                                                                \
        opf_status st_ = (expr);                                                        \
        CHECK(st_ == OPF_ERR_INVALID_ARG, "%s with a NULL context -> %s", #expr,         \
              opf_status_str(st_));                                                     \
    } while (0)

/* Every public entry that takes an opf_ctx, called with NULL and arguments
 * that are otherwise valid. */
static void test_null_ctx(opf_ctx *ctx)
{
    opf_seq *seq;
    CHECK_OK(ctx, opf_seq_create(ctx, &seq));
    CHECK_OK(ctx, opf_seq_append_linear(seq, 16, 16, false, OPF_F32, "fc"));
    opf_optim *opt = NULL;
    CHECK_OK(ctx, opf_optim_create(ctx, seq, OPF_OPTIM_SGD, NULL, &opt));
    opf_spec sp = opf_spec_make(2, (int64_t[]){16, 16}, OPF_F32);
    opf_tensor a, b, d, q;
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sp, &a));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sp, &b));
    CHECK_OK(ctx, opf_tensor_alloc(ctx, &sp, &d));
    memset(&q, 0, sizeof q);
    opf_recipe r = opf_recipe_default(OPF_RECIPE_DELAYED);
    opf_quantizer qz = opf_quantizer_default();
    opf_op *op = NULL, *lin = opf_seq_at(seq, 0), *ops_out[1];
    opf_seq *out_seq = NULL;
    opf_optim *out_opt = NULL;
    opf_delayed_state *ds = NULL;
    opf_recipe_state *rs = NULL;
    float buf[64];
    int n_out = 0;

    REFUSED(opf_seq_create(NULL, &out_seq));
    REFUSED(opf_optim_create(NULL, seq, OPF_OPTIM_SGD, NULL, &out_opt));
    REFUSED(opf_gemm(NULL, &a, &b, OPF_GEMM_NN, NULL, &d));
    REFUSED(opf_checkpoint_save(NULL, seq, opt, "/nonexistent/x"));
    REFUSED(opf_checkpoint_load(NULL, seq, opt, "/nonexistent/x"));
    REFUSED(opf_checkpoint_load_mem(NULL, seq, opt, buf, sizeof buf, NULL));
    REFUSED(opf_checkpoint_prepare(NULL, seq, &r));
    double norm;
    REFUSED(opf_clip_grad_norm(NULL, &seq, 1, 1.0, &norm));
    REFUSED(opf_fused_op_create(NULL, "identity", &lin, 1, &op));
    REFUSED(opf_fusion_scan(NULL, &lin, 1, &r, match, opf_fusion_build_class, "x", ops_out, &n_out));
    REFUSED(opf_fusion_build_class(NULL, &lin, 1, &r, "x", &op));
    REFUSED(opf_op_create(NULL, "identity", NULL, "x", &op));
    CHECK(opf_op_add_param(NULL, lin, "p", &sp) == -(int)OPF_ERR_INVALID_ARG, "opf_op_add_param");
    REFUSED(opf_op_reset_recipe(NULL, lin, &r));
    REFUSED(opf_delayed_state_create(NULL, OPF_FORMAT_E4M3, 0, 4, OPF_AMAX_MAX, false, 3, &ds));
    CHECK_OK(ctx, opf_delayed_state_create(ctx, OPF_FORMAT_E4M3, 0, 4, OPF_AMAX_MAX, false, 3, &ds));
    /* the state's own context stands in for NULL (quant.h) */
    CHECK_OK(NULL, opf_delayed_state_read(NULL, ds, buf, buf + 8));
    CHECK_OK(NULL, opf_delayed_state_write(NULL, ds, buf, buf + 8));
    CHECK_OK(NULL, opf_delayed_state_update(NULL, ds, reduce, NULL));
    REFUSED(opf_recipe_state_create(NULL, &r, "linear", "x", 1, &rs));
    CHECK_OK(ctx, opf_recipe_state_create(ctx, &r, "linear", "x", 1, &rs));
    CHECK_OK(NULL, opf_recipe_state_update(NULL, rs, false, reduce, NULL));
    REFUSED(opf_quantize(NULL, &qz, &a, &q));
    REFUSED(opf_quantize_alloc(NULL, &qz, &a, &q));
    REFUSED(opf_dequantize(NULL, &a, 0, &d));
    REFUSED(opf_requantize(NULL, &qz, &a, &q));
    REFUSED(opf_tensor_update_usage(NULL, &a, 1));
    REFUSED(opf_tensor_alloc(NULL, &sp, &q));
    REFUSED(opf_tensor_to(NULL, &a, OPF_DEVICE_CPU, &q));
    REFUSED(opf_tensor_copy(NULL, &a, &d));
    REFUSED(opf_tensor_swizzle(NULL, &a, true));
    REFUSED(opf_ctx_sync(NULL));
    REFUSED(opf_ctx_workspace_reserve(NULL, 64));

    /* no status to return: NULL in, nothing done, a neutral answer */
    opf_alloc_stats as;
    opf_sync_stats ss;
    uint64_t seed = 1, off = 1;
    opf_ctx_destroy(NULL);
    opf_clear_error(NULL);
    CHECK(opf_last_error(NULL) != NULL, "opf_last_error(NULL)");
    CHECK(opf_ctx_device(NULL) == OPF_DEVICE_CPU, "opf_ctx_device(NULL)");
    CHECK(!opf_ctx_deterministic(NULL), "opf_ctx_deterministic(NULL)");
    CHECK(opf_ctx_num_threads(NULL) == 0, "opf_ctx_num_threads(NULL)");
    memset(&as, 0xff, sizeof as);
    opf_ctx_alloc_stats(NULL, &as);
    CHECK(as.n_alloc == 0 && as.bytes_live == 0, "opf_ctx_alloc_stats(NULL)");
    opf_ctx_host_alloc_stats(NULL, &as);
    memset(&ss, 0xff, sizeof ss);
    opf_ctx_sync_stats(NULL, &ss);
    opf_ctx_warn(NULL, "a warning without a context");
    opf_ctx_warn_once(NULL, "k", "a warning without a context");
    opf_ctx_alloc_reset_peak(NULL);
    CHECK(opf_ctx_alloc(NULL, 64) == NULL, "opf_ctx_alloc(NULL)");
    opf_ctx_free(NULL, NULL, 0);
    CHECK(opf_ctx_workspace(NULL, 64) == NULL, "opf_ctx_workspace(NULL)");
    CHECK(opf_ctx_scratch_mark(NULL) == 0, "opf_ctx_scratch_mark(NULL)");
    CHECK(opf_ctx_scratch_push(NULL, 64) == NULL, "opf_ctx_scratch_push(NULL)");
    opf_ctx_scratch_pop(NULL, 0);
    opf_ctx_set_rng(NULL, 1, 2);
    opf_ctx_get_rng(NULL, &seed, &off);
    CHECK(seed == 0 && off == 0, "opf_ctx_get_rng(NULL)");
    CHECK(opf_ctx_rng_advance(NULL, 4) == 0, "opf_ctx_rng_advance(NULL)");

    opf_recipe_state_destroy(rs);
    opf_delayed_state_destroy(ds);
    opf_tensor_release(&a), opf_tensor_release(&b), opf_tensor_release(&d), opf_tensor_release(&q);
    opf_optim_destroy(opt);
    opf_seq_destroy(seq);
}

int main(void)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) return 1;
    test_one_seq(ctx);
    test_optim_follows(ctx);
    test_null_ctx(ctx);
    opf_ctx_destroy(ctx);
    TEST_DONE();
}
