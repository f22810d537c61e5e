/* custom_recipe.c: a custom recipe that mixes formats per module and per
 * role (docs/recipes.md walks through it). Copy from here.
 *
 * The model is fc1(+bias) -> gelu -> fc2(+bias) in bf16, trained with
 * AdamW to reproduce its input. The factory gives
 *   fc1: MXFP8 for every role (the built-in MXFP8 rule);
 *   fc2: FP8 delayed scaling for input and weight (a request: the recipe
 *        state keeps their amax history), FP8 current scaling for the rest
 *        (E5M2 gradients under HYBRID).
 * It prints each linear's quantizers and the loss, and fails unless the
 * loss halves and fc2's delayed scales moved. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <opfuse.h>

enum { HIDDEN = 64, FFN = 128, BATCH = 64, STEPS = 30 };

/* The quantizer factory: called for every (module, role) of every op with
 * recipe state when the recipe state is built, never per step. */
static opf_status mixed_factory(void *user, const opf_quantizer_role *role, opf_quantizer_request *out)
{
    const opf_recipe *fallback = user;  /* current scaling, HYBRID */
    opf_recipe mx = opf_recipe_default(OPF_RECIPE_MXFP8);
    bool fc2 = role->name && !strcmp(role->name, "fc2");
    if (role->name && !strcmp(role->name, "fc1")) return opf_recipe_quantizer(&mx, role, &out->quantizer);
    if (fc2 && (role->tensor == OPF_ROLE_INPUT || role->tensor == OPF_ROLE_WEIGHT)) {
        out->delayed = true;  /* the recipe state allocates and updates the history */
        out->format = OPF_FORMAT_E4M3;
        out->margin = 0;
        out->amax_history_len = 16;
        out->amax_algo = OPF_AMAX_MAX;
        return OPF_OK;
    }
    return opf_recipe_quantizer(fallback, role, &out->quantizer);
}

#define TRY(ctx, expr)                                                   \
    do {                                                                 \
        opf_status st_ = (expr);                                         \
        if (st_) {                                                       \
            fprintf(stderr, "%s: %s: %s\n", #expr, opf_status_str(st_),  \
                    opf_last_error(ctx));                                \
            exit(1);                                                     \
        }                                                                \
    } while (0)

static void print_quantizers(opf_op *op)
{
    printf("%s:", opf_op_name(op));
    for (int r = 0; r < OPF_ROLE_COUNT; r++) {
        const opf_quantizer *q = opf_op_quantizer(op, (opf_tensor_role)r, 0);
        if (!q) continue;
        printf("  %s %s/%s%s", opf_role_name((opf_tensor_role)r), opf_scaling_name(q->scaling),
               opf_dtype_name(q->qdtype), q->delayed ? " (delayed)" : "");
    }
    printf("\n");
}

/* The loss of reproducing x, and its gradient into dy (bf16). */
static float reconstruction_loss(opf_ctx *ctx, const opf_tensor *x, const opf_tensor *y, opf_tensor *dy)
{
    static float xv[BATCH * HIDDEN], yv[BATCH * HIDDEN];
    const int n = BATCH * HIDDEN;
    TRY(ctx, opf_convert(x->data[0], OPF_BF16, xv, OPF_F32, n));
    TRY(ctx, opf_convert(y->data[0], OPF_BF16, yv, OPF_F32, n));
    float loss = 0;
    for (int i = 0; i < n; i++) {
        float d = yv[i] - xv[i];
        loss += d * d / (float)n;
        yv[i] = 2 * d / (float)n;
    }
    TRY(ctx, opf_convert(yv, OPF_F32, dy->data[0], OPF_BF16, n));
    return loss;
}

/* fc1(+bias) -> gelu -> fc2(+bias), bf16 */
static opf_seq *build_model(opf_ctx *ctx)
{
    opf_seq *seq;
    opf_op *act;
    TRY(ctx, opf_seq_create(ctx, &seq));
    TRY(ctx, opf_seq_append_linear(seq, HIDDEN, FFN, true, OPF_BF16, "fc1"));
    TRY(ctx, opf_op_create(ctx, "gelu", NULL, "act", &act));
    TRY(ctx, opf_seq_append(seq, act));
    TRY(ctx, opf_seq_append_linear(seq, FFN, HIDDEN, true, OPF_BF16, "fc2"));
    return seq;
}

int main(void)
{
    opf_ctx *ctx;
    TRY(NULL, opf_ctx_create(NULL, &ctx));
    opf_seq *seq = build_model(ctx);
    opf_optim *opt;
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = 1e-2f;
    TRY(ctx, opf_optim_create(ctx, seq, OPF_OPTIM_ADAMW, &oo, &opt));

    opf_recipe current = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CUSTOM);
    r.factory = mixed_factory;
    r.factory_user = &current;
    TRY(ctx, opf_recipe_validate(&r));
    opf_seq_call call = opf_seq_call_default();
    call.recipe = &r;
    call.input_requires_grad = false;

    opf_spec xs = opf_spec_make(2, (int64_t[]){BATCH, HIDDEN}, OPF_BF16);
    opf_tensor x, dy, y;
    TRY(ctx, opf_tensor_alloc(ctx, &xs, &x));
    TRY(ctx, opf_tensor_alloc(ctx, &xs, &dy));
    static float xv[BATCH * HIDDEN];
    unsigned long long s = 7;
    for (int i = 0; i < BATCH * HIDDEN; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        xv[i] = (float)((int)(s >> 41) - (1 << 22)) / (float)(1 << 22);
    }
    TRY(ctx, opf_convert(xv, OPF_F32, x.data[0], OPF_BF16, BATCH * HIDDEN));

    float first = 0, last = 0;
    for (int step = 0; step < STEPS; step++) {
        opf_seq_zero_grad(seq);
        TRY(ctx, opf_seq_forward(seq, &x, &call, &y, NULL));
        last = reconstruction_loss(ctx, &x, &y, &dy);
        if (step == 0) first = last;
        opf_tensor_release(&y);
        TRY(ctx, opf_seq_backward(seq, &dy, NULL, NULL, NULL));
        TRY(ctx, opf_optim_step(opt));
        if (step % 10 == 0 || step == STEPS - 1) printf("step %2d  loss %.5f\n", step, last);
    }

    opf_op *fc1 = opf_seq_at(seq, 0), *fc2 = opf_seq_at(seq, 3);
    print_quantizers(fc1);
    print_quantizers(fc2);
    float scale[6];
    opf_delayed_state *ds = opf_recipe_state_delayed(opf_op_recipe_state(fc2), false);
    bool moved = false;
    if (ds) TRY(ctx, opf_delayed_state_read(ctx, ds, scale, NULL));
    for (int i = 0; ds && i < opf_delayed_state_slots(ds) && i < 6; i++) moved |= scale[i] != 1.0f;
    int ok = last < 0.5f * first && moved && opf_recipe_state_delayed(opf_op_recipe_state(fc1), false) == NULL;
    opf_tensor_release(&x);
    opf_tensor_release(&dy);
    opf_optim_destroy(opt);
    opf_seq_destroy(seq);
    opf_ctx_destroy(ctx);
    printf("%s\n", ok ? "ok" : "FAILED: the loss did not halve, or the delayed state is not fc2's alone");
    return ok ? 0 : 1;
}
