/* train.c: `opfuse train`: trains the GPT of gpt.h on the addition task or
 * a text file, under one recipe, eagerly or compiled, with AdamW (warm-up
 * then cosine decay), global gradient-norm clipping, periodic evaluation,
 * checkpoints that resume bit for bit, and a sample at the end. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "apps.h"
#include "train.h"

typedef struct recipe_name {
    const char     *name;
    opf_recipe_kind kind;
    opf_dtype       dtype;
} recipe_name;

static const recipe_name recipes[] = {
    {"fp32", OPF_RECIPE_NONE, OPF_F32},         {"bf16", OPF_RECIPE_NONE, OPF_BF16},
    {"fp8-delayed", OPF_RECIPE_DELAYED, OPF_BF16}, {"fp8-current", OPF_RECIPE_CURRENT, OPF_BF16},
    {"fp8-block", OPF_RECIPE_BLOCK, OPF_BF16},  {"mxfp8", OPF_RECIPE_MXFP8, OPF_BF16},
    {"nvfp4", OPF_RECIPE_NVFP4, OPF_BF16},
};
enum { N_RECIPES = sizeof recipes / sizeof recipes[0] };

static void usage(void)
{
    fprintf(stderr,
            "usage: opfuse train [--recipe fp32|bf16|fp8-delayed|fp8-current|fp8-block|mxfp8|nvfp4]\n"
            "                    [--compile] [--device cpu|cuda] [--steps N] [--batch N]\n"
            "                    [--layers N] [--width N] [--heads N] [--seed N] [--lr X]\n"
            "                    [--data FILE [--context T]] [--digits D] [--eval-every N]\n"
            "                    [--save DIR [--save-every N]] [--resume DIR] [--stop-after N]\n"
            "                    [--compare RECIPE,RECIPE,... [--out PREFIX]] [--quantize-head]\n"
            "                    [--quiet] [--profile] [--random-vocab V]\n"
            "  --random-vocab V: uniform random tokens of a vocabulary of V (timing runs)\n"
            "  --profile: after the run, the device time of each phase of a step (forward,\n"
            "             backward, clipping, optimizer) and, with --compile, of the costliest\n"
            "             graph nodes; each is timed between synchronizations, so the run is slower\n");
}

train_opts train_default_opts(void)
{
    return (train_opts){.recipe = "bf16", .device = "cpu", .steps = 1500, .batch = 32,
                        .layers = 2, .width = 64, .heads = 4, .context = 64, .digits = 3,
                        .seed = 1, .warmup = -1, .eval_every = -1, .save_every = -1,
                        .eval_batches = 4, .lr = 3e-3, .min_lr = 3e-4, .clip = 1.0,
                        .weight_decay = 0.01};
}

/* --name VALUE options: integers and floats by table. */
typedef struct int_opt {
    const char *name;
    size_t      offset;
} int_opt;
static const int_opt int_opts[] = {
    {"--steps", offsetof(train_opts, steps)},   {"--batch", offsetof(train_opts, batch)},
    {"--layers", offsetof(train_opts, layers)}, {"--width", offsetof(train_opts, width)},
    {"--heads", offsetof(train_opts, heads)},   {"--context", offsetof(train_opts, context)},
    {"--digits", offsetof(train_opts, digits)}, {"--seed", offsetof(train_opts, seed)},
    {"--warmup", offsetof(train_opts, warmup)}, {"--eval-every", offsetof(train_opts, eval_every)},
    {"--save-every", offsetof(train_opts, save_every)},
    {"--stop-after", offsetof(train_opts, stop_after)},
    {"--random-vocab", offsetof(train_opts, random_vocab)},
};

static bool parse_int(const char *s, int64_t *v)
{
    char *end;
    long long x = strtoll(s, &end, 10);
    *v = x;
    return *s && !*end;
}

static int parse_one(train_opts *o, const char *k, const char *v)
{
    for (size_t i = 0; i < sizeof int_opts / sizeof int_opts[0]; i++)
        if (!strcmp(k, int_opts[i].name)) {
            if (v && parse_int(v, (int64_t *)((char *)o + int_opts[i].offset))) return 2;
            fprintf(stderr, "opfuse train: %s needs an integer, got \"%s\"\n", k, v ? v : "");
            return -1;
        }
    const char **str = !strcmp(k, "--recipe") ? &o->recipe : !strcmp(k, "--device") ? &o->device
                     : !strcmp(k, "--data") ? &o->data : !strcmp(k, "--save") ? &o->save
                     : !strcmp(k, "--resume") ? &o->resume : NULL;
    if (str && v) return *str = v, 2;
    if (!strcmp(k, "--compare") && v) return o->compare = v, 2;
    if (!strcmp(k, "--out") && v) return o->out = v, 2;
    if (!strcmp(k, "--lr") && v) return o->lr = atof(v), 2;
    if (!strcmp(k, "--compile")) return o->compile = true, 1;
    if (!strcmp(k, "--quiet")) return o->quiet = true, 1;
    if (!strcmp(k, "--profile")) return o->profile = true, 1;
    if (!strcmp(k, "--quantize-head")) return o->quantize_head = true, 1;
    fprintf(stderr, "opfuse train: unknown option or missing value: %s\n", k);
    return -1;
}

/* Fills the derived defaults; false with a message on bad values. */
static bool check_opts(train_opts *o)
{
    if (o->steps < 1 || o->batch < 1 || o->digits < 1 || o->digits > 9 || o->context < 2 ||
        !(o->lr > 0)) {
        fprintf(stderr, "opfuse train: --steps, --batch, --context (>= 2) and --lr must be "
                        "positive and --digits in 1..9\n");
        return false;
    }
    if (o->warmup < 0) o->warmup = o->steps / 20;
    if (o->eval_every <= 0) o->eval_every = o->steps / 6 > 0 ? o->steps / 6 : 1;
    if (o->save_every <= 0) o->save_every = o->eval_every;
    if (o->min_lr > o->lr) o->min_lr = o->lr;
    if (o->compare && (o->save || o->resume)) {
        fprintf(stderr, "opfuse train: --compare does not take --save or --resume\n");
        return false;
    }
    return true;
}

static const recipe_name *find_recipe(const char *name)
{
    for (int i = 0; i < N_RECIPES; i++)
        if (!strcmp(recipes[i].name, name)) return &recipes[i];
    return NULL;
}

/* Warm-up from lr/warmup to lr, then cosine decay to min_lr at the last step. */
static double lr_at(const train_opts *o, int64_t step)
{
    if (step < o->warmup) return o->lr * (double)(step + 1) / (double)o->warmup;
    double span = (double)(o->steps - o->warmup), t = span > 0 ? (step - o->warmup) / span : 1;
    return o->min_lr + 0.5 * (o->lr - o->min_lr) * (1 + cos(3.141592653589793 * fmin(t, 1.0)));
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- setup ------------------------------------------------------------------------ */

/* The context on the device the run asks for, or false with a message. */
static bool open_ctx(trainer *t)
{
    opf_ctx_options co = opf_ctx_options_default();
    co.seed = (uint64_t)t->o.seed;
    if (!strcmp(t->o.device, "cuda")) {
        co.device = OPF_DEVICE_CUDA;
    } else if (strcmp(t->o.device, "cpu")) {
        fprintf(stderr, "opfuse train: unknown device \"%s\" (cpu or cuda)\n", t->o.device);
        return false;
    }
    opf_status st = opf_ctx_create(&co, &t->ctx);
    if (!st) return true;
    fprintf(stderr, "opfuse train: cannot use --device %s: %s\n", t->o.device, opf_last_error(NULL));
    t->ctx = NULL;
    return false;
}

static bool setup_data(trainer *t)
{
    char msg[512];
    if (t->o.random_vocab > 0) {
        opf_data_random(t->o.random_vocab, t->o.context, &t->data);
        return true;
    }
    if (!t->o.data) {
        opf_data_addition((int)t->o.digits, &t->data);
        return true;
    }
    if (opf_data_open(t->o.data, t->o.context, &t->data, msg, sizeof msg)) return true;
    fprintf(stderr, "opfuse train: %s\n", msg);
    return false;
}

/* The model's vocabulary: the data's, padded to a multiple of 64 so that
 * every recipe's GEMM shapes fit the output projection. */
static int64_t model_vocab(const opf_data *d) { return (d->vocab + 63) / 64 * 64; }

static opf_status setup_model(trainer *t, opf_dtype dt)
{
    opf_gpt_config gc = {model_vocab(&t->data), t->data.T, t->o.layers, t->o.width, t->o.heads,
                         dt, (uint64_t)t->o.seed, t->o.quantize_head};
    char msg[256];
    if (!opf_gpt_check(&gc, msg, sizeof msg)) {
        fprintf(stderr, "opfuse train: %s\n", msg);
        return OPF_ERR_INVALID_ARG;
    }
    opf_optim_options oo = opf_optim_options_default();
    oo.lr = (float)t->o.lr;
    oo.beta2 = 0.95f;
    oo.weight_decay = (float)t->o.weight_decay;
    opf_status st = opf_gpt_create(t->ctx, &gc, &t->gpt);
    if (!st) st = opf_optim_create(t->ctx, t->gpt->seq, OPF_OPTIM_ADAMW, &oo, &t->opt);
    if (!st && t->o.compile) st = opf_compiled_create(t->gpt->seq, NULL, &t->cc);
    size_t n = (size_t)(t->o.batch * t->data.T);
    if (!st && (!(t->tok = malloc(n * sizeof *t->tok)) || !(t->tgt = malloc(n * sizeof *t->tgt))))
        st = OPF_ERR_NO_MEMORY;
    return st;
}

void train_close(trainer *t)
{
    opf_tensor_release(&t->tok_d), opf_tensor_release(&t->tgt_d);
    opf_compiled_destroy(t->cc);
    opf_optim_destroy(t->opt);
    opf_gpt_destroy(t->gpt);
    opf_ctx_destroy(t->ctx);
    opf_data_close(&t->data);
    free(t->tok), free(t->tgt);
}

/* ---- one step ------------------------------------------------------------------------ */

/* Rows [B, T] of token ids on the model's device into *slot (t->tok_d or
 * t->tgt_d): a view of the host rows on the CPU, one upload per batch to a
 * GPU. The slot keeps them until the next batch: a compiled backward reads
 * the forward's token ids. */
static opf_status upload(trainer *t, const int32_t *rows, int64_t B, opf_tensor *slot)
{
    opf_tensor h;
    opf_status st = opf_tensor_wrap(&(opf_spec){.ndim = 2, .shape = {B, t->data.T}, .dtype = OPF_I32},
                                    (void *)rows, &h);
    opf_device dev = opf_ctx_device(t->ctx);
    opf_tensor_release(slot);
    if (st || dev == OPF_DEVICE_CPU) return *slot = h, st;
    return opf_tensor_to(t->ctx, &h, dev, slot);
}

opf_status train_forward(trainer *t, const int32_t *tok, const int32_t *tgt, int64_t B, bool grad,
                         opf_tensor *logits, float *loss)
{
    opf_tensor l;
    opf_status st = upload(t, tok, B, &t->tok_d);
    opf_seq_call call = opf_seq_call_default();
    call.recipe = t->quantized ? &t->recipe : NULL;
    call.requires_grad = grad;
    call.input_requires_grad = false;
    if (!st) st = grad && t->cc ? opf_compiled_forward(t->cc, &t->tok_d, &call, logits, NULL)
                                : opf_seq_forward(t->gpt->seq, &t->tok_d, &call, logits, NULL);
    if (st || !tgt) return st;
    if (!(st = upload(t, tgt, B, &t->tgt_d))) st = opf_gpt_loss(t->gpt, logits, &t->tgt_d, grad, &l);
    if (!st && loss) st = opf_gpt_read(t->gpt, &l, loss);
    if (!st) opf_tensor_release(&l);
    if (st) opf_tensor_release(logits);
    return st;
}

static opf_status backward(trainer *t, const opf_tensor *dlogits)
{
    opf_tensor dx;
    opf_status st = t->cc ? opf_compiled_backward(t->cc, dlogits, NULL, &dx, NULL)
                          : opf_seq_backward(t->gpt->seq, dlogits, NULL, &dx, NULL);
    if (!st) opf_tensor_release(&dx);
    return st;
}

/* --profile: closes phase ph (the device's queue drained) and opens the
 * next; *mark is the clock at the phase's start. */
static opf_status phase_end(trainer *t, int ph, double *mark)
{
    if (!t->o.profile) return OPF_OK;
    opf_status st = opf_ctx_sync(t->ctx);
    double now = now_s();
    t->phase_s[ph] += now - *mark;
    *mark = now;
    return st;
}

opf_status train_step(trainer *t, int64_t s, float *loss)
{
    opf_tensor logits, dlogits;
    opf_status st = t->o.profile ? opf_ctx_sync(t->ctx) : OPF_OK;  /* the step before */
    double mark = now_s();
    if (st) return st;
    opf_seq_zero_grad(t->gpt->seq);
    opf_data_batch(&t->data, (uint64_t)t->o.seed, 0, s, t->o.batch, t->tok, t->tgt);
    st = train_forward(t, t->tok, t->tgt, t->o.batch, true, &logits, loss);
    if (!st) st = phase_end(t, PH_FORWARD, &mark);
    if (st) return st;
    st = opf_gpt_loss_backward(t->gpt, &dlogits);
    if (!st) st = phase_end(t, PH_LOSS_BACKWARD, &mark);
    if (!st) {
        st = backward(t, &dlogits);
        opf_tensor_release(&dlogits);
    }
    if (!st) st = phase_end(t, PH_BACKWARD, &mark);
    opf_tensor_release(&logits);
    opf_seq *seq = t->gpt->seq;
    if (!st) st = opf_gpt_tie_grads(t->gpt);
    if (!st) st = phase_end(t, PH_TIE, &mark);
    if (!st) st = opf_clip_grad_norm(t->ctx, &seq, 1, t->o.clip, NULL);
    if (!st) st = phase_end(t, PH_CLIP, &mark);
    if (!st) st = opf_optim_set_lr(t->opt, (float)lr_at(&t->o, s));
    if (!st) st = opf_optim_step(t->opt);
    opf_gpt_after_step(t->gpt);
    if (!st) st = phase_end(t, PH_OPTIM, &mark);
    return st;
}

/* ---- the loop --------------------------------------------------------------------- */

enum { LOG_EVERY = 10 };  /* steps between loss reads on a device */

/* The progress line, redrawn at most ten times a second. */
static void progress(const trainer *t, int64_t s, double loss, double t0, int64_t s0)
{
    static double next;
    double now = now_s(), el = now - t0, per = el / (double)(s + 1 - s0);
    if (now < next) return;
    next = now + 0.1;
    double tps = (double)(t->o.batch * t->data.T) / per, left = per * (double)(t->o.steps - s - 1);
    int width = 24, done = (int)((s + 1) * width / t->o.steps);
    char bar[32];
    for (int i = 0; i < width; i++) bar[i] = i < done ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\r[%s] step %lld/%lld  loss %.4f  %.0f tok/s  %dm%02ds left ", bar,
            (long long)(s + 1), (long long)t->o.steps, loss, tps, (int)left / 60, (int)left % 60);
    fflush(stderr);
}

/* What the compiler made of the model, once. */
static void report_graph(trainer *t, bool tty)
{
    opf_graph_stats gs;
    opf_graph_get_stats(opf_compiled_last_graph(t->cc), &gs);
    if (tty) fprintf(stderr, "\r%*s\r", 100, "");
    printf("compiled: %d forward + %d backward nodes (%d fused, %d eager), arena %.1f MiB\n",
           gs.n_forward, gs.n_backward, gs.n_fused, gs.n_eager, gs.arena_bytes / 1048576.0);
}

static opf_status evaluate(trainer *t, int64_t s, bool tty)
{
    double loss, acc;
    opf_status st = train_eval(t, &loss, &acc);
    if (st) return st;
    if (tty) fprintf(stderr, "\r%*s\r", 100, "");
    printf("step %5lld  train loss %.4f  eval loss %.4f", (long long)s, t->last_loss, loss);
    if (t->data.addition) printf("  exact match %5.1f%%", 100 * acc);
    printf("\n");
    fflush(stdout);
    if (t->csv)
        fprintf(t->csv, "%s,%lld,%.6f,%.6f,%.4f\n", t->o.recipe, (long long)s, t->last_loss, loss,
                t->data.addition ? acc : -1.0);
    t->eval_loss = loss, t->accuracy = acc;
    return OPF_OK;
}

/* --profile: from step s0 + 1 on (the first step warms up), phases and
 * graph nodes accumulate their time. */
static void profile_start(trainer *t)
{
    memset(t->phase_s, 0, sizeof t->phase_s);
    opf_graph *g = t->cc ? opf_compiled_last_graph(t->cc) : NULL;
    opf_graph_reset_profile(g);
    opf_graph_set_profile(g, true);
}

/* --profile's tables: the phases, then the graph's node groups. */
static void profile_report(const trainer *t, int64_t steps)
{
    static const char *const names[PH_COUNT] = {"forward + loss", "loss backward", "backward",
                                                "tied gradients", "clipping", "optimizer"};
    if (steps <= 0) return;
    double total = 0;
    for (int p = 0; p < PH_COUNT; p++) total += t->phase_s[p];
    printf("profile over %lld steps (device time between synchronizations), ms per step:\n",
           (long long)steps);
    for (int p = 0; p < PH_COUNT; p++)
        printf("  %-24s %9.3f  %5.1f%%\n", names[p], 1e3 * t->phase_s[p] / (double)steps,
               total > 0 ? 100 * t->phase_s[p] / total : 0.0);
    printf("  %-24s %9.3f\n", "step", 1e3 * total / (double)steps);
    if (t->cc && opf_graph_dump_profile(opf_compiled_last_graph(t->cc), steps, stdout))
        fprintf(stderr, "opfuse train: --profile: %s\n", opf_last_error(t->ctx));
}

static opf_status train_loop(trainer *t, int64_t s0)
{
    bool tty = !t->o.quiet && isatty(2);
    double t0 = now_s();
    opf_status st = OPF_OK;
    int64_t end = t->o.stop_after > 0 && t->o.stop_after < t->o.steps ? t->o.stop_after : t->o.steps;
    for (int64_t s = s0; s < end && !st; s++) {
        bool last = s + 1 == end, eval = (s + 1) % t->o.eval_every == 0 || last;
        /* a device's loss is read (a host synchronization) every LOG_EVERY steps only */
        bool read = opf_ctx_device(t->ctx) == OPF_DEVICE_CPU || eval || (s + 1) % LOG_EVERY == 0;
        float loss;
        if (t->o.profile && s == s0 + 1) profile_start(t);
        if ((st = train_step(t, s, read ? &loss : NULL))) break;
        if (read) t->last_loss = loss;
        if (read && !isfinite(loss)) {
            fprintf(stderr, "\nopfuse train: the loss is %g at step %lld\n", (double)loss, (long long)s + 1);
            return OPF_ERR_INVALID_ARG;
        }
        if (tty) progress(t, s, t->last_loss, t0, s0);
        if (s == s0 && t->cc) report_graph(t, tty);
        if (eval) st = evaluate(t, s + 1, tty);
        if (!st && t->o.save && ((s + 1) % t->o.save_every == 0 || last)) st = train_save(t, t->o.save);
    }
    t->seconds = now_s() - t0;
    t->tokens_per_s = (double)((end - s0) * t->o.batch * t->data.T) / t->seconds;
    if (!st && end > s0)
        printf("%lld steps in %.1f s: %.0f tokens/s\n", (long long)(end - s0), t->seconds,
               t->tokens_per_s);
    if (!st && t->o.profile) profile_report(t, end - s0 - 1);
    return st;
}

int train_open(trainer *t)
{
    const recipe_name *rn = find_recipe(t->o.recipe);
    if (!rn) {
        fprintf(stderr, "opfuse train: unknown recipe \"%s\"\n", t->o.recipe);
        return 2;
    }
    if (!setup_data(t) || !open_ctx(t)) return 1;
    t->recipe = opf_recipe_default(rn->kind);
    t->quantized = rn->kind != OPF_RECIPE_NONE;
    opf_status st = setup_model(t, rn->dtype);
    if (st == OPF_ERR_INVALID_ARG && !t->gpt) return 1;  /* the message is out */
    if (st) {
        fprintf(stderr, "opfuse train: %s: %s\n", opf_status_str(st), opf_last_error(t->ctx));
        return 1;
    }
    return 0;
}

static int run(trainer *t)
{
    int rc = train_open(t);
    if (rc) return rc;
    printf("opfuse train: %s, %lld layers x %lld wide, %lld heads, %lld parameters, recipe %s%s%s, "
           "%lld steps of %lld x %lld tokens\n",
           t->data.addition ? "addition" : t->o.data ? t->o.data : "random tokens",
           (long long)t->o.layers, (long long)t->o.width, (long long)t->o.heads,
           (long long)opf_gpt_num_params(t->gpt), t->o.recipe,
           t->quantized && !t->o.quantize_head ? " (head bf16)" : "", t->cc ? " (compiled)" : "",
           (long long)t->o.steps, (long long)t->o.batch, (long long)t->data.T);
    int64_t s0 = 0;
    if (t->o.resume) {
        if (!train_resume(t, t->o.resume)) return 1;
        s0 = opf_optim_step_count(t->opt);
        printf("resumed from %s at step %lld\n", t->o.resume, (long long)s0);
    }
    opf_status st = train_loop(t, s0);
    if (!st && !t->csv && t->o.random_vocab <= 0) st = train_sample(t);  /* random ids: no text */
    if (!st) return 0;
    fprintf(stderr, "opfuse train: %s: %s\n", opf_status_str(st), opf_last_error(t->ctx));
    return 1;
}

/* Trains t and frees what it built. */
static int run_one(trainer *t)
{
    int rc = run(t);
    train_close(t);
    return rc;
}

int opf_app_train(int argc, char **argv)
{
    trainer t;
    memset(&t, 0, sizeof t);
    t.o = train_default_opts();
    for (int i = 0; i < argc;) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return usage(), 0;
        int used = parse_one(&t.o, argv[i], i + 1 < argc ? argv[i + 1] : NULL);
        if (used < 0) return usage(), 2;
        i += used;
    }
    if (!check_opts(&t.o)) return 2;
    if (t.o.compare) return train_compare(&t.o, run_one);
    return run_one(&t);
}
