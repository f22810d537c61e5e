/* checkpoint_harness.h: what the checkpoint fuzz target, its corpus maker
 * and the corpus replay test (tests/io/test_checkpoint_bad.c) share: a small
 * fixed model to load into, a byte snapshot of all the state a load may
 * change, and the rule that a refused load changes none of it.
 *
 * The model: layernorm(32) -> linear(32, 32) + bias -> gelu in bf16, with
 * AdamW, prepared for either FP8 delayed scaling (history 2) or MXFP8. */
#ifndef OPFUSE_FUZZ_CHECKPOINT_HARNESS_H
#define OPFUSE_FUZZ_CHECKPOINT_HARNESS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opfuse.h"

enum { FZ_T = 32, FZ_H = 32 };

typedef struct fz_fixture {
    opf_ctx   *ctx;
    opf_seq   *seq;
    opf_optim *opt;
    opf_recipe recipe;
} fz_fixture;

/* A growing byte string. */
typedef struct fz_blob {
    unsigned char *p;
    size_t         n;
} fz_blob;

static inline void fz_put(fz_blob *b, const void *src, size_t n)
{
    unsigned char *p = realloc(b->p, b->n + n + 1);
    if (!p) abort();
    b->p = p;
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}

static inline bool fz_blob_eq(const fz_blob *a, const fz_blob *b)
{
    return a->n == b->n && (a->n == 0 || !memcmp(a->p, b->p, a->n));
}

/* The whole file at path (empty when it cannot be opened). */
static inline fz_blob fz_read_file(const char *path)
{
    fz_blob b = {NULL, 0};
    FILE *f = fopen(path, "rb");
    if (!f) return b;
    unsigned char chunk[4096];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) fz_put(&b, chunk, n);
    fclose(f);
    return b;
}

/* Builds the model in f (context given) and readies it for recipe kind. */
static inline opf_status fz_fixture_init(fz_fixture *f, opf_ctx *ctx, opf_recipe_kind kind)
{
    memset(f, 0, sizeof *f);
    f->ctx = ctx;
    f->recipe = opf_recipe_default(kind);
    f->recipe.amax_history_len = 2;
    opf_norm_config ln = {FZ_H, 1e-5, false, OPF_BF16};
    opf_op *op = NULL;
    opf_status st = opf_seq_create(ctx, &f->seq);
    if (!st) st = opf_op_create(ctx, "layernorm", &ln, "ln", &op);
    if (!st) st = opf_seq_append(f->seq, op);
    if (!st) st = opf_seq_append_linear(f->seq, FZ_H, FZ_H, true, OPF_BF16, "fc");
    if (!st) st = opf_op_create(ctx, "gelu", NULL, "act", &op);
    if (!st) st = opf_seq_append(f->seq, op);
    if (!st) st = opf_optim_create(ctx, f->seq, OPF_OPTIM_ADAMW, NULL, &f->opt);
    if (!st) st = opf_checkpoint_prepare(ctx, f->seq, kind == OPF_RECIPE_NONE ? NULL : &f->recipe);
    return st;
}

static inline void fz_fixture_fini(fz_fixture *f)
{
    opf_optim_destroy(f->opt);
    opf_seq_destroy(f->seq);
    memset(f, 0, sizeof *f);
}

/* One training step on fixed data; cache_weights: cache the quantized
 * weight (is_first_microbatch = 1) and skip the optimizer so it stays valid. */
static inline opf_status fz_step(fz_fixture *f, bool cache_weights)
{
    static uint16_t xb[FZ_T * FZ_H], gb[FZ_T * FZ_H];
    unsigned long long s = 99;
    for (int i = 0; i < FZ_T * FZ_H; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        xb[i] = opf_f32_to_bf16((float)((int)(s >> 40) % 2001 - 1000) / 500.0f);
        gb[i] = opf_f32_to_bf16((float)((int)(s >> 20) % 201 - 100) / 1e4f);
    }
    opf_spec sp = {.ndim = 2, .shape = {FZ_T, FZ_H}, .dtype = OPF_BF16};
    opf_tensor x, dy, y, dx;
    opf_tensor_wrap(&sp, xb, &x);
    opf_tensor_wrap(&sp, gb, &dy);
    opf_basic_linear_kwargs first = {1};
    const void *kw[4] = {NULL, &first, NULL, NULL};
    opf_seq_call call = opf_seq_call_default();
    call.recipe = f->recipe.kind == OPF_RECIPE_NONE ? NULL : &f->recipe;
    call.kwargs = cache_weights ? kw : NULL;
    opf_seq_zero_grad(f->seq);
    opf_status st = opf_seq_forward(f->seq, &x, &call, &y, NULL);
    if (st) return st;
    st = opf_seq_backward(f->seq, &dy, NULL, &dx, NULL);
    opf_tensor_release(&y), opf_tensor_release(&dx);
    if (!st && !cache_weights) st = opf_optim_step(f->opt);
    return st;
}

static inline size_t fz_plain_bytes(const opf_tensor *t)
{
    return opf_dtype_nbytes(t->spec.dtype, (size_t)opf_spec_numel(&t->spec));
}

static inline void fz_snap_param(fz_blob *b, opf_param *p)
{
    fz_put(b, p->value.data[0], fz_plain_bytes(&p->value));
    fz_put(b, p->grad.data[0], fz_plain_bytes(&p->grad));
    fz_put(b, &p->has_grad, sizeof p->has_grad);
    fz_put(b, &p->qvalue_valid, sizeof p->qvalue_valid);
    fz_put(b, &p->qvalue, sizeof p->qvalue);  /* spec and pointers: the same copy */
    opf_layout L;
    if (!p->qvalue.data[0] && !p->qvalue.data[2]) return;
    if (opf_spec_layout(&p->qvalue.spec, &L)) abort();
    for (int c = 0; c < OPF_COMP_COUNT; c++)
        if (L.comp[c].present) fz_put(b, p->qvalue.data[c], L.comp[c].nbytes);
}

/* Every byte of state a load may write: parameters (values, gradients,
 * quantized copies), recipe state, optimizer, RNG. */
static inline fz_blob fz_snapshot(opf_ctx *ctx, opf_seq *seq, opf_optim *opt)
{
    fz_blob b = {NULL, 0};
    for (int i = 0; i < opf_seq_len(seq); i++) {
        opf_op *op = opf_seq_at(seq, i);
        for (int j = 0; j < opf_op_num_params(op); j++) fz_snap_param(&b, opf_op_param(op, j));
        opf_recipe_state *rs = opf_op_recipe_state(op);
        fz_put(&b, &rs, sizeof rs);
        for (int d = 0; rs && d < 2; d++) {
            opf_delayed_state *ds = opf_recipe_state_delayed(rs, d);
            if (!ds) continue;
            size_t s = (size_t)opf_delayed_state_slots(ds), L = (size_t)opf_delayed_state_history_len(ds);
            fz_put(&b, opf_delayed_state_scale(ds), sizeof(float) * s);
            fz_put(&b, opf_delayed_state_history(ds), sizeof(float) * s * L);
        }
    }
    for (int k = 0; opt && k < opf_optim_num_slots(opt); k++) {
        float *m[3];
        int64_t n;
        opf_optim_slot(opt, k, NULL, &m[0], &m[1], &m[2], &n);
        for (int w = 0; w < 3; w++)
            if (m[w]) fz_put(&b, m[w], sizeof(float) * (size_t)n);
    }
    int64_t steps = opt ? opf_optim_step_count(opt) : -1;
    uint64_t rng[2];
    opf_ctx_get_rng(ctx, &rng[0], &rng[1]);
    fz_put(&b, &steps, sizeof steps);
    fz_put(&b, rng, sizeof rng);
    return b;
}

/* Loads data into f (opt or none); a refused load must leave every byte of
 * state as it was and say why. Returns the status. */
static inline opf_status fz_load_checked(fz_fixture *f, bool with_opt, const uint8_t *data, size_t size)
{
    opf_optim *opt = with_opt ? f->opt : NULL;
    fz_blob before = fz_snapshot(f->ctx, f->seq, f->opt);
    opf_status st = opf_checkpoint_load_mem(f->ctx, f->seq, opt, data, size, "fuzz");
    if (st != OPF_OK) {
        fz_blob after = fz_snapshot(f->ctx, f->seq, f->opt);
        if (!fz_blob_eq(&before, &after)) {
            fprintf(stderr, "a refused load (%s: %s) changed the state\n", opf_status_str(st),
                    opf_last_error(f->ctx));
            abort();
        }
        if (st != OPF_ERR_CORRUPT && st != OPF_ERR_NO_MEMORY) {
            fprintf(stderr, "unexpected status %s: %s\n", opf_status_str(st), opf_last_error(f->ctx));
            abort();
        }
        if (!*opf_last_error(f->ctx)) {
            fprintf(stderr, "a refused load left no message\n");
            abort();
        }
        free(after.p);
    }
    free(before.p);
    return st;
}

/* One input against both fixtures, with and without the optimizer; the
 * number of loads that succeeded. */
static inline int fz_run_input(opf_ctx *ctx, const uint8_t *data, size_t size)
{
    static const opf_recipe_kind kinds[2] = {OPF_RECIPE_DELAYED, OPF_RECIPE_MXFP8};
    int ok = 0;
    for (int k = 0; k < 2; k++)
        for (int with_opt = 1; with_opt >= 0; with_opt--) {
            fz_fixture f;
            if (fz_fixture_init(&f, ctx, kinds[k])) abort();
            ok += fz_load_checked(&f, with_opt, data, size) == OPF_OK;
            fz_fixture_fini(&f);
        }
    return ok;
}

#endif
