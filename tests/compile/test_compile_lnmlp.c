/* test_compile_lnmlp.c: the residual-free LayerNorm-MLP compiled against
 * eager, bit for bit, under every recipe and dtype: outputs, input
 * gradients, parameter gradients, over several steps with fresh inputs. */
#include "compile_util.h"

static void run_case(opf_recipe_kind kind, opf_dtype dt)
{
    const int64_t m = 64, h = 64, f = 128;
    cu_pair p;
    if (!cu_pair_build(&p, 7, cu_ln_gelu_mlp, dt, h, f)) return;
    opf_recipe r;
    opf_seq_call call = cu_call(kind, &r);
    if (kind == OPF_RECIPE_NVFP4) r.nvfp4_stochastic = false;
    opf_spec xspec = opf_spec_make(2, (int64_t[]){m, h}, dt);
    opf_graph *g = NULL;
    CHECK_OK(p.cb, opf_compile(p.b, &xspec, &call, NULL, &g));
    for (int step = 0; g && step < 3; step++) {
        char tag[64];
        snprintf(tag, sizeof tag, "%s %s step %d", opf_recipe_name(kind), opf_dtype_name(dt), step);
        cu_compare_step(&p, g, NULL, &call, m, h, dt, 1.0f, tag);
        cu_compare_grads(tag, p.a, p.b);  /* and one CHECK per parameter, naming it */
    }
    opf_graph_destroy(g);
    cu_pair_close(&p);
}

int main(void)
{
    cu_rng = 0xC0DE5EEDull;
    for (int k = 0; k < CU_NREC; k++)
        for (int d = 0; d < CU_NDT; d++) {
            if (cu_recipes[k] == OPF_RECIPE_BLOCK) continue; /* needs multiples of 128: test_compile_linear */
            run_case(cu_recipes[k], cu_dtypes[d]);
        }
    TEST_DONE();
}
