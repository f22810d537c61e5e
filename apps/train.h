/* train.h: the pieces of `opfuse train` (train.c: options and the loop;
 * train_eval.c: evaluation and samples; train_state.c: --save / --resume). */
#ifndef OPFUSE_APPS_TRAIN_H
#define OPFUSE_APPS_TRAIN_H

#include <stdio.h>

#include "data.h"
#include "gpt.h"

typedef struct train_opts {
    const char *recipe, *device, *data, *save, *resume;
    const char *compare;  /* "bf16,fp8-current,...": train each, write out.csv (+ .png) */
    const char *out;      /* --compare's file prefix */
    bool        compile;
    bool        quantize_head;  /* lm_head under the recipe too (default: unquantized) */
    int64_t     steps, batch, layers, width, heads, context, digits, seed;
    int64_t     warmup, eval_every, save_every, eval_batches;
    int64_t     random_vocab;  /* > 0: uniform random tokens of this vocabulary (bench) */
    int64_t     stop_after;  /* > 0: end after this step (the schedule still spans steps) */
    double      lr, min_lr, clip, weight_decay;
    bool        quiet;    /* no progress line even on a terminal */
    bool        profile;  /* --profile: device time per phase (and per node, compiled) */
} train_opts;

/* --profile: a step's phases, each timed between device synchronizations. */
enum { PH_FORWARD, PH_LOSS_BACKWARD, PH_BACKWARD, PH_TIE, PH_CLIP, PH_OPTIM, PH_COUNT };

typedef struct trainer {
    train_opts     o;
    opf_recipe     recipe;
    bool           quantized;  /* recipe.kind != NONE */
    opf_data       data;
    opf_ctx       *ctx;
    opf_gpt       *gpt;
    opf_optim     *opt;
    opf_compiled  *cc;
    int32_t       *tok, *tgt;  /* [batch, T] on the host */
    opf_tensor     tok_d, tgt_d;  /* the last batch's on the model's device (train.c) */
    double         last_loss;
    FILE          *csv;        /* --compare: one row per evaluation */
    double         eval_loss, accuracy, seconds, tokens_per_s;  /* the last evaluation; the run */
    double         phase_s[PH_COUNT];  /* --profile: seconds per phase over the profiled steps */
} trainer;

/* The options of a plain `opfuse train`. */
train_opts train_default_opts(void);
/* Builds t's data, context, model and optimizer (and compiled seq) from
 * t->o: 0, or the exit code (1 or 2) with the message on stderr. Free
 * with train_close, also after a failure. */
int train_open(trainer *t);
void train_close(trainer *t);
/* One training step s (0-based: the data batch and the learning rate's
 * schedule): forward, loss, backward, tied gradients, clipping, AdamW. */
opf_status train_step(trainer *t, int64_t s, float *loss);

/* --compare LIST (train_compare.c): trains base's configuration under each
 * recipe of the list, writes PREFIX.csv, PREFIX.png where gnuplot is
 * installed, and prints a table. run trains one trainer (its exit code). */
int train_compare(const train_opts *base, int (*run)(trainer *t));

/* One forward of tokens [B, T] (B rows of tok) through the model: logits
 * (released by the caller; a view when compiled) and, with tgt, the loss. */
opf_status train_forward(trainer *t, const int32_t *tok, const int32_t *tgt, int64_t B, bool grad,
                         opf_tensor *logits, float *loss);

/* Evaluation loss over o.eval_batches fixed batches and, for addition, the
 * exact-match accuracy of greedy answers to the same problems. */
opf_status train_eval(trainer *t, double *loss, double *accuracy);
/* Prints a few generated samples. */
opf_status train_sample(trainer *t);

/* The checkpoint of DIR (DIR/model.safetensors, DIR/train.txt). */
opf_status train_save(trainer *t, const char *dir);
/* Loads DIR into the fresh model and optimizer; false with a message on
 * stderr when DIR is unreadable or was written by another configuration. */
bool train_resume(trainer *t, const char *dir);

#endif
