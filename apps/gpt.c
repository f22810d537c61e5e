/* gpt.c: builds the GPT decoder of gpt.h from opfuse ops, draws its initial
 * weights (GPT-2's: normal(0, 0.02), the projections into the residual
 * stream scaled by 1/sqrt(2 layers)), and ties the output projection to the
 * token embedding. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt.h"
#include "op/op-impl.h"  /* opf_param_accumulate: the gradient sum of backward */

typedef struct builder {
    opf_ctx   *ctx;
    opf_seq   *seq;
    opf_status st;  /* the first failure sticks */
} builder;

static opf_op *add(builder *b, const char *cls, const void *cfg, const char *name)
{
    opf_op *op = NULL;
    if (b->st || (b->st = opf_op_create(b->ctx, cls, cfg, name, &op))) return NULL;
    return (b->st = opf_seq_append(b->seq, op)) ? NULL : op;
}

static void linear(builder *b, int64_t in, int64_t out, bool bias, opf_dtype dt, const char *name)
{
    if (!b->st) b->st = opf_seq_append_linear(b->seq, in, out, bias, dt, name);
}

/* make_extra_output("<p>.<ch>") ... add_extra_input("<p>.<ch>") around what
 * the caller appends between the two calls. The add is in place, as the
 * anchor's residual adds are: so the fuser folds it and the linear before
 * it into one GEMM that accumulates onto the residual
 * (forward_linear_bias_add), and the add is no pass of its own (opfuse has
 * no views: the output is still a new tensor). */
static void residual_open(builder *b, const char *prefix, const char *ch)
{
    char name[64], chan[64];
    snprintf(name, sizeof name, "%s.%s.out", prefix, ch);
    snprintf(chan, sizeof chan, "%s.%s", prefix, ch);
    opf_op *op = add(b, "make_extra_output", NULL, name);
    if (op) b->st = opf_op_set_extra_output(op, 0, chan, false);
}

static void residual_close(builder *b, const char *prefix, const char *ch)
{
    char name[64], chan[64];
    snprintf(name, sizeof name, "%s.%s.in", prefix, ch);
    snprintf(chan, sizeof chan, "%s.%s", prefix, ch);
    static const opf_inplace_config in_place = {.in_place = true};
    opf_op *op = add(b, "add_extra_input", &in_place, name);
    if (op) b->st = opf_op_set_extra_input(op, 0, chan);
}

static void block(builder *b, const opf_gpt_config *c, int layer)
{
    char p[16], n[64];
    int64_t C = c->width;
    opf_norm_config ln = {C, 1e-5, false, c->dtype};
    opf_attention_config ac = {c->heads};
    snprintf(p, sizeof p, "b%d", layer);
    residual_open(b, p, "res1");
    snprintf(n, sizeof n, "%s.ln1", p), add(b, "layernorm", &ln, n);
    snprintf(n, sizeof n, "%s.qkv", p), linear(b, C, 3 * C, true, c->dtype, n);
    snprintf(n, sizeof n, "%s.attn", p), add(b, "attention", &ac, n);
    snprintf(n, sizeof n, "%s.proj", p), linear(b, C, C, true, c->dtype, n);
    residual_close(b, p, "res1");
    residual_open(b, p, "res2");
    snprintf(n, sizeof n, "%s.ln2", p), add(b, "layernorm", &ln, n);
    snprintf(n, sizeof n, "%s.fc1", p), linear(b, C, 4 * C, true, c->dtype, n);
    snprintf(n, sizeof n, "%s.gelu", p), add(b, "gelu", NULL, n);
    snprintf(n, sizeof n, "%s.fc2", p), linear(b, 4 * C, C, true, c->dtype, n);
    residual_close(b, p, "res2");
}

bool opf_gpt_check(const opf_gpt_config *c, char *msg, size_t size)
{
    if (c->vocab < 2 || c->context < 1 || c->layers < 1 || c->width < 1 || c->heads < 1)
        snprintf(msg, size, "vocab %lld, context %lld, layers %lld, width %lld and heads %lld must "
                 "be positive (vocab >= 2)", (long long)c->vocab, (long long)c->context,
                 (long long)c->layers, (long long)c->width, (long long)c->heads);
    else if (c->width % c->heads)
        snprintf(msg, size, "width %lld is not divisible by %lld heads", (long long)c->width,
                 (long long)c->heads);
    else
        return true;
    return false;
}

/* ---- initial weights ------------------------------------------------------------- */

static double normal(uint64_t *s)
{
    double u[2];
    for (int i = 0; i < 2; i++) {
        uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        u[i] = ((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
    }
    return sqrt(-2.0 * log(u[0] + 1e-300)) * cos(6.283185307179586 * u[1]);
}

/* Drawn on the host in f32, rounded to the parameter's dtype there, then
 * copied to wherever the parameter lives. */
static opf_status fill_normal(opf_ctx *ctx, opf_param *p, double sigma, uint64_t *s)
{
    int64_t n = opf_spec_numel(&p->value.spec);
    float *v = malloc(sizeof(float) * (size_t)n);
    if (!v) return OPF_ERR_NO_MEMORY;
    for (int64_t i = 0; i < n; i++) v[i] = (float)(sigma * normal(s));
    opf_spec hs = p->value.spec;
    hs.device = OPF_DEVICE_CPU;
    opf_tensor h;
    opf_status st = opf_tensor_alloc(ctx, &hs, &h);
    if (!st) {
        st = opf_convert(v, OPF_F32, h.data[0], hs.dtype, (size_t)n);
        if (!st) st = opf_tensor_copy(ctx, &h, &p->value);
        opf_tensor_release(&h);
    }
    free(v);
    return st;
}

static bool ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), k = strlen(tail);
    return n >= k && !strcmp(s + n - k, tail);
}

/* Linear weights and embeddings drawn in seq order; norms keep ones and
 * zeros, biases zeros. */
static opf_status init_weights(opf_gpt *g)
{
    uint64_t s = g->cfg.seed * 0x2545F4914F6CDD1Dull + 1;
    double proj = 0.02 / sqrt(2.0 * (double)g->cfg.layers);
    opf_status st = OPF_OK;
    for (int i = 0; i < opf_seq_len(g->seq) && !st; i++) {
        opf_op *op = opf_seq_at(g->seq, i);
        const char *cls = opf_op_class_of(op)->name, *name = opf_op_name(op);
        if (op == g->head) continue;  /* tied: wte's values */
        if (!strcmp(cls, "embedding")) {
            st = fill_normal(g->ctx, opf_op_param(op, 0), 0.02, &s);
            if (!st) st = fill_normal(g->ctx, opf_op_param(op, 1), 0.01, &s);
        } else if (!strcmp(cls, "basic_linear")) {
            bool out = ends_with(name, ".proj") || ends_with(name, ".fc2");
            st = fill_normal(g->ctx, opf_op_param(op, 0), out ? proj : 0.02, &s);
        }
    }
    return st;
}

/* ---- the model ------------------------------------------------------------------- */

/* lm_head's weight becomes a reference to wte's memory. */
static void tie(opf_gpt *g)
{
    opf_param *w = opf_op_param(g->head, 0);
    opf_tensor_release(&w->value);
    opf_tensor_retain(&opf_op_param(g->emb, 0)->value, &w->value);
}

static opf_status build(opf_gpt *g)
{
    const opf_gpt_config *c = &g->cfg;
    builder b = {g->ctx, g->seq, OPF_OK};
    opf_embedding_config ec = {c->vocab, c->context, c->width, c->dtype};
    opf_norm_config ln = {c->width, 1e-5, false, c->dtype};
    g->emb = add(&b, "embedding", &ec, "emb");
    for (int l = 0; l < c->layers; l++) block(&b, c, l);
    add(&b, "layernorm", &ln, "ln_f");
    linear(&b, c->width, c->vocab, false, c->dtype, "lm_head");
    if (b.st) return b.st;
    g->head = opf_seq_at(g->seq, opf_seq_len(g->seq) - 1);
    tie(g);
    opf_status st = c->quantize_head ? OPF_OK : opf_op_set_recipe(g->head, NULL);
    float one = 1.0f;
    opf_tensor h;
    if (!st) st = opf_tensor_wrap(&(opf_spec){.ndim = 1, .shape = {1}, .dtype = OPF_F32}, &one, &h);
    if (!st) st = opf_tensor_to(g->ctx, &h, opf_ctx_device(g->ctx), &g->one);
    if (st) return st;
    return opf_op_create(g->ctx, "cross_entropy", NULL, "loss", &g->loss);
}

opf_status opf_gpt_create(opf_ctx *ctx, const opf_gpt_config *cfg, opf_gpt **out)
{
    char msg[256];
    if (!opf_gpt_check(cfg, msg, sizeof msg)) return OPF_ERR_INVALID_ARG;
    opf_gpt *g = calloc(1, sizeof *g);
    if (!g) return OPF_ERR_NO_MEMORY;
    g->cfg = *cfg;
    g->ctx = ctx;
    opf_status st = opf_seq_create(ctx, &g->seq);
    if (!st && !(st = build(g))) st = init_weights(g);
    if (st) {
        opf_gpt_destroy(g);
        return st;
    }
    *out = g;
    return OPF_OK;
}

void opf_gpt_destroy(opf_gpt *g)
{
    if (!g) return;
    opf_op_ctx_clear(&g->loss_ctx);
    opf_tensor_release(&g->one);
    opf_op_destroy(g->loss);
    opf_seq_destroy(g->seq);
    free(g);
}

static void count_param(void *user, opf_op *op, opf_param *p)
{
    opf_gpt *g = ((void **)user)[0];
    int64_t *n = ((void **)user)[1];
    if (op != g->head) *n += opf_spec_numel(&p->value.spec);
}

int64_t opf_gpt_num_params(opf_gpt *g)
{
    int64_t n = 0;
    void *u[2] = {g, &n};
    opf_seq_for_each_param(g->seq, count_param, u);
    return n;
}

opf_status opf_gpt_loss(opf_gpt *g, const opf_tensor *logits, const opf_tensor *targets, bool grad,
                        opf_tensor *loss)
{
    opf_fwd_env env = {.ctx = g->ctx, .x = logits, .extra_in = {targets}, .requires_grad = grad};
    opf_tensor outs[1 + OPF_OP_MAX_EXTRA];
    opf_status st = opf_op_forward(g->loss, &env, grad ? &g->loss_ctx : NULL, outs);
    if (!st) *loss = outs[0];
    return st;
}

opf_status opf_gpt_read(opf_gpt *g, const opf_tensor *t, float *v)
{
    if (t->spec.device == OPF_DEVICE_CPU) return *v = *(const float *)t->data[0], OPF_OK;
    opf_tensor h;
    opf_status st = opf_tensor_to(g->ctx, t, OPF_DEVICE_CPU, &h);
    if (!st) *v = *(const float *)h.data[0], opf_tensor_release(&h);
    return st;
}

opf_status opf_gpt_loss_backward(opf_gpt *g, opf_tensor *dlogits)
{
    opf_tensor dt[OPF_OP_MAX_EXTRA];
    opf_bwd_env env = {.ctx = g->ctx, .dy = &g->one};
    memset(dt, 0, sizeof dt);
    return opf_op_backward(g->loss, &g->loss_ctx, &env, dlogits, dt);
}

/* wte.grad += lm_head.grad (the library's gradient accumulation: an fp32
 * sum rounded once to the grad's dtype, or a cast when wte has none yet),
 * on the parameters' device. */
opf_status opf_gpt_tie_grads(opf_gpt *g)
{
    opf_param *h = opf_op_param(g->head, 0), *e = opf_op_param(g->emb, 0);
    if (!h->has_grad) return OPF_OK;
    opf_status st = opf_param_accumulate(g->ctx, e, &h->grad);
    h->has_grad = false;
    return st;
}

void opf_gpt_after_step(opf_gpt *g) { opf_op_param(g->head, 0)->qvalue_valid = false; }
