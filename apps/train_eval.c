/* train_eval.c: evaluation (loss over fixed held-out batches; for the
 * addition task the exact-match accuracy of greedily decoded answers) and
 * the samples printed at the end of `opfuse train`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train.h"

/* The most likely token id below d->vocab at position pos of each row of
 * logits [B, T, V]. */
static opf_status argmax_at(const trainer *t, const opf_tensor *logits, int64_t B, int64_t pos,
                            int32_t *out)
{
    int64_t T = t->data.T, V = logits->spec.shape[2];
    float row[1024];
    size_t esz = opf_dtype_nbytes(logits->spec.dtype, 1);
    opf_tensor h = *logits;  /* a device's logits come to the host first */
    opf_status st = logits->spec.device == OPF_DEVICE_CPU ? OPF_OK
                  : opf_tensor_to(t->ctx, logits, OPF_DEVICE_CPU, &h);
    for (int64_t r = 0; r < B && !st; r++) {
        const char *p = (const char *)h.data[0] + (size_t)((r * T + pos) * V) * esz;
        st = opf_convert(p, logits->spec.dtype, row, OPF_F32, (size_t)t->data.vocab);
        int32_t best = 0;
        for (int32_t j = 1; j < t->data.vocab; j++) best = row[j] > row[best] ? j : best;
        out[r] = best;
    }
    if (logits->spec.device != OPF_DEVICE_CPU) opf_tensor_release(&h);
    return st;
}

/* Greedy answers to the prompts of tok [B, T] written over the answer
 * positions (everything after the prompt is padding before). */
static opf_status decode_answers(trainer *t, int32_t *tok, int64_t B)
{
    int64_t T = t->data.T, p = opf_data_prompt_len(&t->data), n = opf_data_answer_len(&t->data);
    int32_t next[4096];
    for (int64_t r = 0; r < B; r++)
        for (int64_t k = p; k < T; k++) tok[r * T + k] = OPF_ADD_PAD;
    opf_status st = OPF_OK;
    for (int64_t k = 0; k < n && !st && k + p < T; k++) {
        opf_tensor logits;
        if ((st = train_forward(t, tok, NULL, B, false, &logits, NULL))) break;
        st = argmax_at(t, &logits, B, p - 1 + k, next);
        opf_tensor_release(&logits);
        for (int64_t r = 0; r < B && !st; r++) tok[r * T + p + k] = next[r];
    }
    return st;
}

/* Rows whose decoded answer equals every target digit. */
static int64_t count_exact(const trainer *t, const int32_t *tok, const int32_t *tgt, int64_t B)
{
    int64_t T = t->data.T, p = opf_data_prompt_len(&t->data), n = opf_data_answer_len(&t->data), ok = 0;
    for (int64_t r = 0; r < B; r++) {
        bool same = true;
        for (int64_t k = 0; k < n; k++) same &= tok[r * T + p + k] == tgt[r * T + p - 1 + k];
        ok += same;
    }
    return ok;
}

opf_status train_eval(trainer *t, double *loss, double *accuracy)
{
    int64_t B = t->o.batch, right = 0;
    double sum = 0;
    opf_status st = OPF_OK;
    for (int64_t i = 0; i < t->o.eval_batches && !st; i++) {
        opf_tensor logits;
        float l;
        opf_data_batch(&t->data, (uint64_t)t->o.seed, 1, i, B, t->tok, t->tgt);
        if ((st = train_forward(t, t->tok, t->tgt, B, false, &logits, &l))) break;
        opf_tensor_release(&logits);
        sum += l;
        if (t->data.addition && !(st = decode_answers(t, t->tok, B)))
            right += count_exact(t, t->tok, t->tgt, B);
    }
    *loss = sum / (double)t->o.eval_batches;
    *accuracy = (double)right / (double)(t->o.eval_batches * B);
    return st;
}

static void print_row(const trainer *t, const int32_t *tok, int64_t n)
{
    for (int64_t k = 0; k < n; k++) putchar(opf_data_char(&t->data, tok[k]));
}

static opf_status sample_addition(trainer *t)
{
    int64_t B = t->o.batch, T = t->data.T, p = opf_data_prompt_len(&t->data);
    int64_t n = opf_data_answer_len(&t->data);
    opf_data_batch(&t->data, (uint64_t)t->o.seed + 1, 1, 0, B, t->tok, t->tgt);
    opf_status st = decode_answers(t, t->tok, B);
    for (int64_t r = 0; r < 6 && r < B && !st; r++) {
        printf("  ");
        print_row(t, t->tok + r * T, p + n);
        printf("  %s\n", count_exact(t, t->tok + r * T, t->tgt + r * T, 1) ? "right" : "wrong");
    }
    return st;
}

/* A continuation of a held-out prompt, one greedy byte at a time, every row
 * of the batch the same (so each forward has the shapes of training). */
static opf_status sample_text(trainer *t)
{
    int64_t B = t->o.batch, T = t->data.T, have = T / 2, len = 160;
    char *text = malloc((size_t)(have + len) + 1);
    if (!text) return OPF_ERR_NO_MEMORY;
    opf_data_batch(&t->data, (uint64_t)t->o.seed + 1, 1, 0, 1, t->tok, t->tgt);
    for (int64_t k = 0; k < have; k++) text[k] = (char)t->tok[k];
    opf_status st = OPF_OK;
    for (int64_t g = 0; g < len && !st; g++, have++) {
        int64_t from = have > T ? have - T : 0, n = have - from;
        for (int64_t r = 0; r < B; r++)
            for (int64_t k = 0; k < T; k++) t->tok[r * T + k] = k < n ? (uint8_t)text[from + k] : 0;
        opf_tensor logits;
        int32_t next[4096];
        if ((st = train_forward(t, t->tok, NULL, B, false, &logits, NULL))) break;
        st = argmax_at(t, &logits, 1, n - 1, next);
        opf_tensor_release(&logits);
        text[have] = (char)next[0];
    }
    text[have] = 0;
    if (!st) printf("%s\n", text);
    free(text);
    return st;
}

opf_status train_sample(trainer *t)
{
    printf("samples (greedy):\n");
    return t->data.addition ? sample_addition(t) : sample_text(t);
}
