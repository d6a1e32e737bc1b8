/* Sampling inside llama.cpp's decode graph, one sampler per sequence slot (see slot_sampler.c). */
#ifndef CLLM_SLOT_SAMPLER_H
#define CLLM_SLOT_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#include "llama.h"

/* What a context's slot samplers share: each slot's row of logit biases and its last row of
   logits, kept on the device. */
struct cllm_slot_table;

/* A table for `n_slots` slots of a `n_vocab` vocabulary whose end-of-generation tokens are the
   `n_eog` ids at `eog_ids` (copied). The caller holds one reference, each sampler another; the
   table goes with the last. NULL when out of memory. */
struct cllm_slot_table * cllm_slot_table_new(int32_t n_vocab, int32_t n_slots, int32_t n_eog,
                                             const int32_t * eog_ids);
void cllm_slot_table_release(struct cllm_slot_table * table);

/* Whether llama.cpp attached the samplers: their device rows exist once it has. */
int cllm_slot_table_ready(const struct cllm_slot_table * table);

/* A sampler chain for slot `slot` of `table`, to attach when the context is made
   (llama_context_params.samplers): greedy in the graph, or a draw (cllm_slot_sampler_draw).
   NULL when out of memory. */
struct llama_sampler * cllm_slot_sampler_new(struct cllm_slot_table * table, int32_t slot);

/* Whether this slot bans its end-of-generation tokens now. */
int cllm_slot_sampler_bans_eog(struct llama_sampler * chain);

/* Ban (nonzero) or allow this slot's end-of-generation tokens from the next decode on. Writes
   the device row when the ban changes, so no decode may be running then. */
void cllm_slot_sampler_ban_eog(struct llama_sampler * chain, int ban);

struct cllm_row_sampler;

/* Whether this slot draws its token in the graph, and how: `source` (not NULL) gives each of
   its rows a uniform number, and the draw is at `temperature` (> 0); NULL: the argmax. Writes
   the device tables when that changes, so no decode may be running then. The slot keeps
   `source` until told otherwise, and the caller keeps it alive until then. */
void cllm_slot_sampler_draw(struct llama_sampler * chain, struct cllm_row_sampler * source,
                            float temperature);

/* While held (nonzero), this slot's row takes no number from its generator: a row kept in a
   decode run's batch after it stopped, so that its sequence's random stream is as without. */
void cllm_slot_sampler_hold(struct llama_sampler * chain, int held);

/* Whether this slot draws its token in the graph. */
int cllm_slot_sampler_draws(struct llama_sampler * chain);

/* Where the host reads slots' logits back to: `n_slots` rows of `n_vocab` floats, a row per
   slot, owned by the table (page-locked where the logits' device has such memory). NULL until
   llama.cpp attached the samplers. */
float * cllm_slot_table_host_rows(const struct cllm_slot_table * table);

/* Copy the logits of the `n` slots from `first_slot` on (each one's last output) into their
   host rows, in one copy, after the decode that computed them has finished. 0, or -1 when the
   slots are out of range or the table has no rows yet. */
int cllm_slot_table_read_logits(const struct cllm_slot_table * table, int32_t first_slot,
                                int32_t n);

/* The greedy choice, on the logits' device, of each row i < n with a bitmask (masks[i] not NULL:
   bit j % 32 of word j / 32 set where token j is allowed) among its allowed tokens, from the last
   logits of slot slots[i] and its bias, into tokens[i]; rows without one are left as they are.
   Only the bitmasks (as 16-bit halves in int32s: n_vocab / 4 bytes a row) go to the device and
   only the tokens come back.
   After the decode that computed the logits has finished; on a CPU device with `n_threads`.
   0, or -1 when the table has no rows yet, n is out of range or the device failed. */
int cllm_slot_table_masked_argmax(struct cllm_slot_table * table, int32_t n,
                                  const int32_t * slots, const uint32_t * const * masks,
                                  int32_t * tokens, int n_threads);

/* One row drawn on the device with filters (cllm_slot_table_filtered_draw). */
struct cllm_slot_draw {
    int32_t slot;
    float temperature; /* > 0 */
    int32_t top_k;     /* <= 0: off */
    float top_p;       /* >= 1: off */
    float min_p;       /* <= 0: off */
    float uniform;     /* in [0, 1): the row's number from its sequence's generator */
};

/* The token each of the `n` rows draws, on the logits' device, from the last logits of its slot
   and its bias, filtered as row_sampler.c filters (top-k, top-p over what top-k kept, min-p, on
   the logits before the temperature; the cuts here fall between tied tokens, where the host
   keeps them all), into tokens[i]. Each row's logits are sorted on the device; only the rows'
   parameters go there and only the tokens come back. After the decode that computed the logits
   has finished; on a CPU device with `n_threads`. 0, or -1 when the table has no rows yet, n is
   out of range or the device failed. */
int cllm_slot_table_filtered_draw(struct cllm_slot_table * table, int32_t n,
                                  const struct cllm_slot_draw * draws, int32_t * tokens,
                                  int n_threads);

#endif
