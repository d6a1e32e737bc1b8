/* Sampling one row of logits on the host, per sequence (see row_sampler.c). */
#ifndef CLLM_ROW_SAMPLER_H
#define CLLM_ROW_SAMPLER_H

#include <stdint.h>

/* A request's sampling parameters. The filters act in llama.cpp's order, on the logits as the
   model gave them (after the penalties): top-k, then top-p over the top-k's probabilities,
   then min-p; the temperature then scales what is left, and a token is drawn. */
struct cllm_sampling {
    float temperature;        /* <= 0: the most likely token (greedy) */
    int32_t top_k;            /* <= 0: off */
    float top_p;              /* >= 1: off */
    float min_p;              /* <= 0: off */
    float repeat_penalty;     /* 1: off */
    float presence_penalty;   /* 0: off */
    float frequency_penalty;  /* 0: off */
    int32_t penalty_last_n;   /* how many of the latest tokens the penalties count; 0: off */
    uint64_t seed;
    /* Whether a sample leaves the distribution it drew from in the row: the log-softmax of the
       row is then the drawn token's distribution (for log-probabilities). */
    int keep_distribution;
};

/* A sequence's sampler: its parameters, its random generator and its latest tokens. */
struct cllm_row_sampler;

/* NULL when out of memory. */
struct cllm_row_sampler * cllm_row_sampler_new(const struct cllm_sampling * params);
void cllm_row_sampler_free(struct cllm_row_sampler * sampler);

/* The next uniform number in [0, 1) of the sampler's generator, for a draw made elsewhere (on
   the device). It stays staged: the sampler's next draw on the host takes it (where the
   device's token was not taken, as for a row with a bitmask), and staging again replaces it,
   so a sequence's tokens take one number each wherever they are drawn. */
double cllm_row_sampler_stage(struct cllm_row_sampler * sampler);

/* The number a draw takes: the staged one where there is one (the device's draw was not
   taken), else the generator's next, so that a token takes one number wherever it is drawn. */
double cllm_row_sampler_take(struct cllm_row_sampler * sampler);

const struct cllm_sampling * cllm_row_sampler_params(const struct cllm_row_sampler * sampler);

/* Count `token` as the sequence's latest (the penalties' history). */
void cllm_row_sampler_accept(struct cllm_row_sampler * sampler, int32_t token);

/* One thread's working memory for rows of `n_vocab` logits. NULL when out of memory. */
struct cllm_sampler_scratch;
struct cllm_sampler_scratch * cllm_sampler_scratch_new(int32_t n_vocab);
void cllm_sampler_scratch_free(struct cllm_sampler_scratch * scratch);

/* Ban the `n_banned` tokens at `banned` (their logits become -inf), apply the penalties, draw a
   token from `logits` (n_vocab entries, changed in place) and accept it. -1 where no token is
   allowed (every logit -inf). A sampler and a scratch are used by one thread at a time. */
int32_t cllm_row_sampler_sample(struct cllm_row_sampler * sampler, float * logits,
                                int32_t n_vocab, const int32_t * banned, int32_t n_banned,
                                struct cllm_sampler_scratch * scratch);

#endif
