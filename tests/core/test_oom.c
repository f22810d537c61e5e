/* test_oom.c: the allocation-failure sweep (issue 13, item 1). Each public
 * entry runs on a fresh model with the context's nth allocation failing, for
 * n = 1, 2, ... until the entry makes fewer than n allocations. Each refused
 * call must say OPF_ERR_NO_MEMORY with a message, leak nothing, leave every
 * byte of state as it was (gradients, saved contexts, recipe state, RNG,
 * optimizer) and succeed when retried. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <unistd.h>

#include "core/context-impl.h"
#include "test.h"
#include "../../fuzz/checkpoint_harness.h"

static uint16_t xb[FZ_T * FZ_H], gb[FZ_T * FZ_H];
static opf_tensor x, dy;
static char ckpt[64];

static opf_seq_call call_of(fz_fixture *f)
{
    opf_seq_call call = opf_seq_call_default();
    call.recipe = f->recipe.kind == OPF_RECIPE_NONE ? NULL : &f->recipe;
    return call;
}

static opf_status forward(fz_fixture *f)
{
    opf_seq_call call = call_of(f);
    opf_tensor y;
    opf_status st = opf_seq_forward(f->seq, &x, &call, &y, NULL);
    if (!st) opf_tensor_release(&y);
    return st;
}

static opf_status backward(fz_fixture *f)
{
    opf_tensor dx;
    opf_status st = opf_seq_backward(f->seq, &dy, NULL, &dx, NULL);
    if (!st) opf_tensor_release(&dx);
    return st;
}

static opf_status forward_backward(fz_fixture *f)
{
    opf_status st = forward(f);
    return st ? st : backward(f);
}

static opf_status step(fz_fixture *f) { return opf_optim_step(f->opt); }
static opf_status save(fz_fixture *f) { return opf_checkpoint_save(f->ctx, f->seq, f->opt, ckpt); }
static opf_status load(fz_fixture *f) { return opf_checkpoint_load(f->ctx, f->seq, f->opt, ckpt); }

static opf_status compile(fz_fixture *f)
{
    opf_seq_call call = call_of(f);
    opf_graph *g = NULL;
    opf_status st = opf_compile(f->seq, &x.spec, &call, NULL, &g);
    opf_graph_destroy(g);
    return st;
}

static opf_status quantize(fz_fixture *f)
{
    opf_recipe r = opf_recipe_default(OPF_RECIPE_CURRENT);
    opf_quantizer_role role = {"linear", OPF_ROLE_INPUT, "q"};
    opf_quantizer q;
    opf_tensor out;
    opf_status st = opf_recipe_quantizer(&r, &role, &q);
    if (!st && !(st = opf_quantize_alloc(f->ctx, &q, &x, &out))) opf_tensor_release(&out);
    return st;
}

static opf_status gemm(fz_fixture *f)
{
    opf_tensor d;
    opf_status st = opf_tensor_alloc(f->ctx, &x.spec, &d);
    if (!st) st = opf_gemm(f->ctx, &x, &x, OPF_GEMM_TN, NULL, &d);
    opf_tensor_release(&d);
    return st;
}

typedef struct entry {
    const char *name;
    opf_status (*setup)(fz_fixture *f);  /* before the failures, may be NULL */
    opf_status (*run)(fz_fixture *f);
} entry;

static const entry entries[] = {
    {"forward", NULL, forward},           {"backward", forward, backward},
    {"optim_step", forward_backward, step}, {"checkpoint_save", forward_backward, save},
    {"checkpoint_load", NULL, load},      {"compile", NULL, compile},
    {"quantize", NULL, quantize},         {"gemm", NULL, gemm},
};

/* One failure point: true while the entry still reached the nth allocation. */
static bool sweep_one(const entry *e, opf_recipe_kind kind, uint64_t nth, int *changed,
                      int *retry_failed)
{
    opf_ctx *ctx;
    if (opf_ctx_create(NULL, &ctx)) abort();
    fz_fixture f;
    CHECK_OK(ctx, fz_fixture_init(&f, ctx, kind));
    if (e->setup) CHECK_OK(ctx, e->setup(&f));
    fz_blob before = fz_snapshot(ctx, f.seq, f.opt);
    opf_ctx_fail_alloc(ctx, nth);
    opf_clear_error(ctx);
    opf_status st = e->run(&f);
    bool reached = !opf_ctx_fail_alloc_pending(ctx);
    opf_ctx_fail_alloc(ctx, 0);
    if (st) {
        CHECK(st == OPF_ERR_NO_MEMORY && opf_last_error(ctx)[0],
              "%s (%s) alloc %llu: %s \"%s\"", e->name, opf_recipe_name(kind),
              (unsigned long long)nth, opf_status_str(st), opf_last_error(ctx));
        fz_blob after = fz_snapshot(ctx, f.seq, f.opt);
        *changed += !fz_blob_eq(&before, &after);
        free(after.p);
        if ((st = e->run(&f))) (*retry_failed)++;
    }
    free(before.p);
    fz_fixture_fini(&f);
    /* The context keeps its scratch, header slabs and caches until destroyed
     * (AddressSanitizer checks those); no tensor buffer may outlive the model. */
    CHECK(ctx->live_buffers == 0, "%s (%s) alloc %llu: %lld buffers leaked", e->name,
          opf_recipe_name(kind), (unsigned long long)nth, (long long)ctx->live_buffers);
    opf_ctx_destroy(ctx);
    return reached;
}

int main(void)
{
    unsigned long long s = 7;
    for (int i = 0; i < FZ_T * FZ_H; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        xb[i] = opf_f32_to_bf16((float)((int)(s >> 40) % 2001 - 1000) / 500.0f);
        gb[i] = opf_f32_to_bf16((float)((int)(s >> 20) % 201 - 100) / 1e4f);
    }
    opf_spec sp = {.ndim = 2, .shape = {FZ_T, FZ_H}, .dtype = OPF_BF16};
    opf_tensor_wrap(&sp, xb, &x);
    opf_tensor_wrap(&sp, gb, &dy);
    snprintf(ckpt, sizeof ckpt, "/tmp/opf_test_oom_%d.safetensors", (int)getpid());
    /* every built-in recipe kind (a custom recipe needs a factory) */
    const opf_recipe_kind kinds[] = {OPF_RECIPE_NONE,  OPF_RECIPE_DELAYED, OPF_RECIPE_CURRENT,
                                     OPF_RECIPE_BLOCK, OPF_RECIPE_MXFP8,   OPF_RECIPE_NVFP4};
    for (int k = 0; k < (int)(sizeof kinds / sizeof kinds[0]); k++) {
        {   /* the file checkpoint_load reads */
            opf_ctx *ctx;
            fz_fixture f;
            if (opf_ctx_create(NULL, &ctx) || fz_fixture_init(&f, ctx, kinds[k]) ||
                forward_backward(&f) || step(&f) || save(&f))
                return 1;
            fz_fixture_fini(&f);
            opf_ctx_destroy(ctx);
        }
        for (size_t e = 0; e < sizeof entries / sizeof entries[0]; e++) {
            const entry *en = &entries[e];
            int changed = 0, retry_failed = 0;
            uint64_t n = 1;
            while (sweep_one(en, kinds[k], n, &changed, &retry_failed) && n < 100000) n++;
            printf("%-16s %-12s %4llu failure points, %d changed state, %d retries failed\n",
                   en->name, opf_recipe_name(kinds[k]), (unsigned long long)n - 1, changed,
                   retry_failed);
            CHECK(changed == 0 && retry_failed == 0,
                  "%s (%s): %d refused calls changed state, %d retries failed", en->name,
                  opf_recipe_name(kinds[k]), changed, retry_failed);
        }
    }
    unlink(ckpt);
    TEST_DONE();
}
