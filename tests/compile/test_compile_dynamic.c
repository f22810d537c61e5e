/* test_compile_dynamic.c: the dynamic leading dimension beyond the guard
 * test's cases: FP8 block scaling (multiples of 128), a 3-D input whose
 * leading size multiplies into the GEMMs' rows, a residual channel that
 * follows x's leading size, and the compile errors when no smaller size
 * traces (MXFP8 with a maximum of 32). Every size matches eager bit
 * for bit with one graph. */
#include "../test.h"
#include "compile/compile_util.h"

/* make_extra_output -> ln -> fc1 -> gelu -> fc2 -> add_extra_input: the
 * residual is an internal channel; x may be 3-D ([B, S, H]). */
static opf_seq *residual_mlp(opf_ctx *ctx, opf_dtype dt, int64_t h, int64_t f)
{
    opf_seq *seq;
    opf_seq_create(ctx, &seq);
    opf_op *op = cu_op(ctx, "make_extra_output", NULL, "res.out");
    opf_op_set_extra_output(op, 0, "res", false);
    opf_seq_append(seq, op);
    opf_norm_config ln = {.hidden = h, .eps = 1e-5, .dtype = dt};
    cu_append(ctx, seq, "layernorm", &ln, "ln");
    opf_seq_append_linear(seq, h, f, true, dt, "fc1");
    cu_append(ctx, seq, "gelu", NULL, "act");
    opf_seq_append_linear(seq, f, h, true, dt, "fc2");
    op = cu_op(ctx, "add_extra_input", NULL, "res.in");
    opf_op_set_extra_input(op, 0, "res");
    opf_seq_append(seq, op);
    return seq;
}

static void run_sizes(opf_recipe_kind kind, opf_dtype dt, int ndim, int64_t max, const int64_t *sizes,
                      int n_sizes, int64_t seqlen)
{
    const int64_t h = 128, f = 256;
    char tag[96];
    snprintf(tag, sizeof tag, "%s %s %dD max %lld", opf_recipe_name(kind), opf_dtype_name(dt), ndim,
             (long long)max);
    cu_pair p;
    if (!cu_pair_build(&p, 11, residual_mlp, dt, h, f)) return;
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
    opf_compile_options o = opf_compile_options_default();
    o.max_leading = max;
    opf_compiled *c = NULL;
    CHECK_OK(p.cb, opf_compiled_create(p.b, &o, &c));
    for (int i = 0; c && i < n_sizes; i++) {
        int64_t shape[3] = {sizes[i], ndim == 3 ? seqlen : h, h};
        opf_tensor x = cu_rand(p.ca, ndim, shape, dt, 1.0f), dy = cu_rand(p.ca, ndim, shape, dt, 0.1f);
        cu_step s;
        memset(&s, 0, sizeof s);
        opf_seq_zero_grad(p.a);
        opf_seq_zero_grad(p.b);
        cu_eager_step(&p, &call, &x, &dy, &s);
        cu_compiled_step(&p, NULL, c, &call, &x, &dy, &s);
        char t2[128];
        snprintf(t2, sizeof t2, "%s size %lld", tag, (long long)sizes[i]);
        cu_check_step(t2, &p, &s);
        CHECK(s.yb.spec.ndim == ndim && s.yb.spec.shape[0] == sizes[i], "%s: y has the call's shape", t2);
        cu_step_release(&s);
        opf_tensor_release(&x), opf_tensor_release(&dy);
    }
    CHECK(opf_compiled_recompiles(c) == 0 && opf_compiled_num_graphs(c) == 1,
          "%s: %d recompiles, %d graphs", tag, opf_compiled_recompiles(c), opf_compiled_num_graphs(c));
    opf_compiled_destroy(c);
    cu_pair_close(&p);
}

/* MXFP8 rows must be multiples of 32: a maximum of 32 leaves no smaller size. */
static void no_second_size(void)
{
    cu_pair p;
    if (!cu_pair_build(&p, 5, residual_mlp, OPF_BF16, 128, 256)) return;
    opf_recipe r;
    opf_seq_call call = cu_call(OPF_RECIPE_MXFP8, &r);
    opf_compile_options o = opf_compile_options_default();
    o.max_leading = 32;
    opf_spec xs = opf_spec_make(2, (int64_t[]){32, 128}, OPF_BF16);
    opf_graph *g = NULL;
    CHECK_FAILS(p.cb, opf_compile(p.b, &xs, &call, &o, &g), OPF_ERR_SHAPE, "max_leading 32",
                "no smaller leading size", "max_leading = 0");
    CHECK(g == NULL, "no graph on failure");
    /* a fixed-size compile still works, and so does the seq */
    o.max_leading = 0;
    CHECK_OK(p.cb, opf_compile(p.b, &xs, &call, &o, &g));
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

int main(void)
{
    const int64_t block_sizes[] = {256, 128, 256};
    run_sizes(OPF_RECIPE_BLOCK, OPF_BF16, 2, 256, block_sizes, 3, 0);
    const int64_t sizes3[] = {8, 3, 1, 5, 8};  /* [B, 16, 128]: rows B * 16 */
    run_sizes(OPF_RECIPE_NONE, OPF_F32, 3, 8, sizes3, 5, 16);
    run_sizes(OPF_RECIPE_NVFP4, OPF_BF16, 3, 8, sizes3, 5, 16);
    const int64_t mx_sizes[] = {4, 2, 6, 4};  /* [B, 16, 128]: rows multiples of 32 */
    run_sizes(OPF_RECIPE_MXFP8, OPF_BF16, 3, 6, mx_sizes, 4, 16);
    no_second_size();
    TEST_DONE();
}
