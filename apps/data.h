/* data.h: the token streams `opfuse train` learns from.
 *
 *  - The embedded default: D-digit additions written as text, one per row,
 *    "482+119=0601" (the sum zero-padded to D + 1 digits), deterministic
 *    from (seed, split, index). Only the answer digits are targets, so the
 *    loss and the exact-match accuracy measure the sum.
 *  - A text file (--data FILE), read through a memory map as bytes (vocab
 *    256): rows are windows of T + 1 bytes from the first 90% (training) or
 *    the last 10% (evaluation).
 *  - Uniform random tokens of a given vocabulary (benchmarks: the shapes of
 *    a real model without its data). */
#ifndef OPFUSE_APPS_DATA_H
#define OPFUSE_APPS_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { OPF_ADD_PLUS = 10, OPF_ADD_EQ = 11, OPF_ADD_PAD = 12, OPF_ADD_VOCAB = 13 };

typedef struct opf_data {
    bool           addition;
    bool           random;        /* uniform random tokens of [0, vocab) */
    int            digits;        /* addition: digits of each operand */
    const uint8_t *bytes;         /* file: the mapped bytes */
    size_t         n, n_train;    /* file: all bytes, the training part */
    int64_t        T;             /* tokens per row */
    int64_t        vocab;         /* token ids used (the model may have more) */
} opf_data;

/* The addition task with `digits` (1..9) digits per operand. */
void opf_data_addition(int digits, opf_data *d);
/* Uniform random rows of T tokens from [0, vocab). */
void opf_data_random(int64_t vocab, int64_t T, opf_data *d);
/* Maps the file at path for rows of T tokens; false with msg when it cannot
 * be read, is empty, or is shorter than 2 (T + 1) bytes. */
bool opf_data_open(const char *path, int64_t T, opf_data *d, char *msg, size_t size);
void opf_data_close(opf_data *d);

/* Rows [B, T] of tokens and targets (negative: not scored) of batch `index`
 * of the split (0: training, 1: evaluation). */
void opf_data_batch(const opf_data *d, uint64_t seed, int split, int64_t index, int64_t B,
                    int32_t *tok, int32_t *tgt);

/* Addition: the prompt length ("482+119=") and the answer length (D + 1). */
int opf_data_prompt_len(const opf_data *d);
int opf_data_answer_len(const opf_data *d);
/* The text of a token (addition: its character; file: the byte). */
char opf_data_char(const opf_data *d, int32_t tok);

#endif
