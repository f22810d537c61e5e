/* fusion_scan.c: helpers that make the usual fusion-function shapes one
 * call: a left-to-right scan with a match predicate (a k-wide sliding window
 * or a greedy anchor) and a builder. */
#include "core/core-impl.h"
#include "op/op-impl.h"

static bool in_list(opf_op *const *list, int n, const opf_op *op)
{
    for (int i = 0; i < n; i++)
        if (list[i] == op) return true;
    return false;
}

opf_status opf_fusion_scan(opf_ctx *ctx, opf_op *const *ops_in, int n, const opf_recipe *recipe,
                           opf_fusion_match_fn match, opf_fusion_build_fn build, void *user,
                           opf_op **ops_out, int *n_out)
{
    OPF_CHECK_NULL(NULL, "opf_fusion_scan", ctx);
    int o = 0;
    for (int i = 0; i < n;) {
        int k = opf_op_is_fused(ops_in[i]) ? 0 : match(ops_in + i, n - i, recipe, user);
        for (int j = 1; j < k; j++)
            if (i + j >= n || opf_op_is_fused(ops_in[i + j])) k = 0;  /* fusions never nest */
        for (int j = 0; j < k; j++)  /* an op under its own recipe runs by itself */
            if (opf_op_has_recipe(ops_in[i + j], NULL)) k = 0;
        opf_op *f = NULL;
        if (k >= 1) {
            opf_status st = build(ctx, ops_in + i, k, recipe, user, &f);
            if (st) {
                for (int j = 0; j < o; j++)
                    if (!in_list(ops_in, n, ops_out[j])) opf_op_destroy(ops_out[j]);
                return st;
            }
        }
        if (f) {
            ops_out[o++] = f;
            i += k;
        } else {
            ops_out[o++] = ops_in[i++];
        }
    }
    *n_out = o;
    return OPF_OK;
}

opf_status opf_fusion_build_class(opf_ctx *ctx, opf_op *const *ops, int n, const opf_recipe *recipe,
                                  void *user, opf_op **fused)
{
    return opf_fused_op_create(ctx, (const char *)user, ops, n, fused);
}
