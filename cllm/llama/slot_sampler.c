/* One llama.cpp backend sampler per sequence slot, attached to every slot when the context is
 * made, so that llama.cpp reserves its graph once (attaching one later re-reserves it: 31 ms a
 * time, measured on an H100).
 *
 * llama.cpp builds each sampler into the graph on its own row of logits. Done row by row, the
 * greedy choice took three kernels a row (copy, bias, argmax), and 64 rows cost about as much
 * as copying every row's logits to the host (Llama-3.2-1B shape on an H200). So the first
 * sampler built into a graph builds it for all the micro-batch's rows at once, and each
 * sampler's token is a view of the result:
 *
 *   - the rows' logits go to their slots' rows of a device table (set_rows), where a row the
 *     host samples instead (temperature, penalties, log-probabilities, grammar masks) reads
 *     them back after the decode. The graph is then the same whichever way each row is
 *     sampled, so llama.cpp may reuse it from step to step; and a row survives the later
 *     micro-batches of its decode (split streams decode each run of adjacent sequences in one
 *     of its own, whose graph reuses the same buffers);
 *   - each row gets its slot's row of a bias table (0, or -inf at the end-of-generation tokens
 *     while the slot bans them), and one argmax takes every row's token: only tokens leave the
 *     device (llama.cpp's own greedy sampler copies the logits too);
 *   - a slot that samples with a temperature alone (the OpenAI API's default request) draws in
 *     the graph too: every row's biased logits times its slot's 1 / T, a softmax, a cumulative
 *     sum, and the first entry past the row's uniform number (from the sequence's own
 *     generator, row_sampler.c, one a token as the host's draws take; scaled by the row's total
 *     so that rounding never runs past the end). Each row's token is then the argmax's or the
 *     draw's by its slot's flag: the graph is the same for greedy and sampled rows, so a mix of
 *     them keeps llama.cpp's graph reuse. Filters and penalties stay on the host.
 *
 * Which slot each row belongs to is the graph's one input, written by the samplers of the rows
 * present (llama.cpp sets inputs for those only). The tables live in a buffer of the output
 * device, written only when a slot's ban changes: per-slot graph inputs instead are placed on
 * the CPU by ggml's scheduler, and copying 128 of them to the GPU every step cost more than
 * the logits did (H200: 279 against 773 tok/s at one stream).
 *
 * A greedy row constrained by a grammar gets its bitmask only while the step computes (the
 * matchers advance meanwhile), too late for the step's graph. Once the step has finished, a
 * small graph of our own on the same device (cllm_slot_table_masked_argmax) adds the rows'
 * bitmasks, expanded there from 16-bit halves, to their slots' logits and takes the argmax:
 * the bitmasks go up (12 KB a row for a 49k vocabulary, as int32 indices) and the tokens come
 * back, where reading the rows' logits back to the host (192 KB a row) took most of a
 * constrained step's sampling.
 */
#include "slot_sampler.h"

#include "row_sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

struct cllm_slot_table {
    int32_t n_vocab, n_slots, n_eog;
    int32_t * eog_ids;
    int refs;
    struct ggml_context * ctx;
    ggml_backend_buffer_t buffer;
    /* [n_vocab, n_slots] on the host, where rows the host samples are read back to: page-locked
       memory of the logits' device where it has such (host_buffer), else malloc's. */
    ggml_backend_buffer_t host_buffer;
    float * host_rows;
    /* [n_vocab, n_slots] each, made when llama.cpp attaches a sampler */
    struct ggml_tensor * bias;
    struct ggml_tensor * logits; /* each slot's logits of its last output */
    /* [1, n_slots] each: 1 / T of a slot that draws in the graph (else 1), and 1 where it does
       (else 0: the argmax) */
    struct ggml_tensor * inv_temp;
    struct ggml_tensor * draws;
    /* The graph being built or run: each row's slot and uniform number (its inputs) and each
       row's token. */
    struct ggml_tensor * row_slots;
    struct ggml_tensor * row_uniforms;
    struct ggml_tensor * tokens;
    ggml_backend_buffer_type_t buft; /* the logits' device's */
    struct slot_masker * masker;     /* made at the first masked choice */
};

/* Bitmasks reach the device as 16-bit halves, each the index of a row of a pattern table whose
   row p holds 16 biases: 0 for each set bit of p, -inf for each clear one. ggml_get_rows then
   expands a row's bitmask (n_vocab / 8 bytes) into its n_vocab biases on the device; uploading
   the biases themselves would move 16 times more. */
#define MASK_PATTERN_BITS 16

/* What the masked choice on the device needs: a backend of its own for the logits' device (a
   second stream beside llama.cpp's, which does not share its backends), the pattern table, the
   graph's allocator, and page-locked staging for the graph's inputs and output. */
struct slot_masker {
    ggml_backend_t backend;
    struct ggml_context * ctx;
    ggml_backend_buffer_t buffer;  /* the pattern table's */
    struct ggml_tensor * patterns; /* F16 [MASK_PATTERN_BITS, 2^MASK_PATTERN_BITS] */
    ggml_gallocr_t galloc;
    ggml_backend_buffer_t staging_buffer;
    int32_t * staging; /* n_slots slots, then their bitmasks' halves, then their tokens */
    int32_t n_halves;  /* 16-bit halves of one bitmask */
};

static void masker_free(struct slot_masker * k);

/* `size` bytes on the host, page-locked where `buft`'s device offers such memory (`*buffer`
   then holds them), else malloc's (`*buffer` NULL). */
static void * alloc_host(ggml_backend_buffer_type_t buft, size_t size,
                         ggml_backend_buffer_t * buffer) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    ggml_backend_buffer_type_t host = dev != NULL ? ggml_backend_dev_host_buffer_type(dev) : NULL;
    *buffer = host != NULL ? ggml_backend_buft_alloc_buffer(host, size) : NULL;
    return *buffer != NULL ? ggml_backend_buffer_get_base(*buffer) : malloc(size);
}

static void free_host(ggml_backend_buffer_t buffer, void * data) {
    if (buffer != NULL) {
        ggml_backend_buffer_free(buffer);
    } else {
        free(data);
    }
}

struct slot_sampler {
    struct cllm_slot_table * table;
    int32_t slot;
    int32_t row; /* its row in the graph last built, when it has one there */
    int banned;
    struct cllm_row_sampler * source; /* the generator of a slot that draws, else NULL */
    float temperature;                /* of a slot that draws */
    int held;                         /* its row is in the graph, its token not wanted */
};

struct cllm_slot_table * cllm_slot_table_new(int32_t n_vocab, int32_t n_slots, int32_t n_eog,
                                             const int32_t * eog_ids) {
    struct cllm_slot_table * t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return NULL;
    }
    t->eog_ids = malloc((n_eog > 0 ? (size_t) n_eog : 1) * sizeof(int32_t));
    if (t->eog_ids == NULL) {
        free(t);
        return NULL;
    }
    if (n_eog > 0) {
        memcpy(t->eog_ids, eog_ids, (size_t) n_eog * sizeof(int32_t));
    }
    t->refs = 1;
    t->n_vocab = n_vocab;
    t->n_slots = n_slots;
    t->n_eog = n_eog;
    return t;
}

void cllm_slot_table_release(struct cllm_slot_table * t) {
    if (--t->refs > 0) {
        return;
    }
    if (t->buffer != NULL) {
        ggml_backend_buffer_free(t->buffer);
    }
    free_host(t->host_buffer, t->host_rows);
    masker_free(t->masker);
    if (t->ctx != NULL) {
        ggml_free(t->ctx);
    }
    free(t->eog_ids);
    free(t);
}

int cllm_slot_table_ready(const struct cllm_slot_table * t) {
    return t->bias != NULL;
}

/* The host's copy of every slot's logits row. Page-locked where the logits' device offers it:
 * a copy from a GPU into ordinary memory is staged by the driver at a fraction of the bus's
 * speed, and a constrained step at 64 rows reads 12 MB (SmolLM2's vocabulary) or 33 MB (Llama
 * 3's) back. */
static int slot_table_alloc_host_rows(struct cllm_slot_table * t, ggml_backend_buffer_type_t buft) {
    size_t size = (size_t) t->n_vocab * (size_t) t->n_slots * sizeof(float);
    t->host_rows = alloc_host(buft, size, &t->host_buffer);
    return t->host_rows != NULL;
}

/* The bias and logits rows in a buffer of `buft` (the device that computes the logits), all 0. */
static int slot_table_alloc(struct cllm_slot_table * t, ggml_backend_buffer_type_t buft) {
    struct ggml_init_params params = {
        /* .mem_size   = */ 4 * ggml_tensor_overhead(),
        /* .mem_buffer = */ NULL,
        /* .no_alloc   = */ true,
    };
    t->ctx = ggml_init(params);
    if (t->ctx == NULL) {
        return 0;
    }
    struct ggml_tensor * bias = ggml_new_tensor_2d(t->ctx, GGML_TYPE_F32, t->n_vocab, t->n_slots);
    ggml_set_name(bias, "cllm_slot_bias");
    struct ggml_tensor * logits = ggml_new_tensor_2d(t->ctx, GGML_TYPE_F32, t->n_vocab, t->n_slots);
    ggml_set_name(logits, "cllm_slot_logits");
    struct ggml_tensor * inv_temp = ggml_new_tensor_2d(t->ctx, GGML_TYPE_F32, 1, t->n_slots);
    ggml_set_name(inv_temp, "cllm_slot_inv_temp");
    struct ggml_tensor * draws = ggml_new_tensor_2d(t->ctx, GGML_TYPE_F32, 1, t->n_slots);
    ggml_set_name(draws, "cllm_slot_draws");
    t->buffer = ggml_backend_alloc_ctx_tensors_from_buft(t->ctx, buft);
    if (t->buffer == NULL) {
        return 0;
    }
    ggml_backend_buffer_clear(t->buffer, 0);
    for (int32_t slot = 0; slot < t->n_slots; slot++) {  /* greedy: 1 / T = 1, no draw */
        const float one = 1.0f;
        ggml_backend_tensor_set(inv_temp, &one, (size_t) slot * sizeof(float), sizeof(float));
    }
    if (!slot_table_alloc_host_rows(t, buft)) {
        return 0;
    }
    t->bias = bias;
    t->logits = logits;
    t->inv_temp = inv_temp;
    t->draws = draws;
    t->buft = buft;
    return 1;
}

static const char * slot_name(const struct llama_sampler * smpl) {
    (void) smpl;
    return "cllm-slot";
}

static int slot_bans(const struct slot_sampler * s, llama_token token) {
    if (!s->banned) {
        return 0;
    }
    for (int32_t i = 0; i < s->table->n_eog; i++) {
        if (s->table->eog_ids[i] == token) {
            return 1;
        }
    }
    return 0;
}

/* The same choice on the host, for a caller that samples this chain there (cllm does not). */
static void slot_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p) {
    const struct slot_sampler * s = smpl->ctx;
    int64_t best = -1;
    for (size_t i = 0; i < cur_p->size; i++) {
        if (!slot_bans(s, cur_p->data[i].id)
                && (best < 0 || cur_p->data[i].logit > cur_p->data[best].logit)) {
            best = (int64_t) i;
        }
    }
    cur_p->selected = best < 0 ? 0 : best;
}

static void slot_free(struct llama_sampler * smpl) {
    struct slot_sampler * s = smpl->ctx;
    cllm_slot_table_release(s->table);
    free(s);
}

static bool slot_backend_init(struct llama_sampler * smpl, ggml_backend_buffer_type_t buft,
                              uint32_t n_outputs_max_per_seq) {
    struct slot_sampler * s = smpl->ctx;
    if (n_outputs_max_per_seq != 1) {  /* one row a slot a step: one logits view to keep */
        return false;
    }
    return s->table->bias != NULL || slot_table_alloc(s->table, buft);
}

/* The token each row draws from `biased` ([n_vocab, n_rows]) at its slot's temperature: the
   first entry whose cumulative probability passes the row's uniform number times the row's
   total (so never past the last entry with any probability). Float, [1, n_rows]. */
static struct ggml_tensor * rows_draws(struct cllm_slot_table * t, struct ggml_context * ctx,
                                       struct ggml_tensor * biased) {
    const int64_t n_vocab = biased->ne[0], n_rows = biased->ne[1];
    t->row_uniforms = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, n_rows);
    ggml_set_name(t->row_uniforms, "cllm_row_uniforms");
    ggml_set_input(t->row_uniforms);
    struct ggml_tensor * inv_temp = ggml_get_rows(ctx, t->inv_temp, t->row_slots);
    struct ggml_tensor * probs = ggml_soft_max(ctx, ggml_mul(ctx, biased, inv_temp));
    struct ggml_tensor * cdf = ggml_cumsum(ctx, probs);
    struct ggml_tensor * total = ggml_cont(ctx, ggml_view_2d(ctx, cdf, 1, n_rows, cdf->nb[1],
                                                             (size_t) (n_vocab - 1) * cdf->nb[0]));
    struct ggml_tensor * target = ggml_mul(ctx, t->row_uniforms, total);
    struct ggml_tensor * past = ggml_step(ctx, ggml_sub(ctx, cdf, target));
    /* the entries past the draw are counted; the draw is the first of them */
    return ggml_scale_bias(ctx, ggml_sum_rows(ctx, past), -1.0f, (float) n_vocab);
}

/* Every row's token for the graph whose logits (padded by one row) are `padded`: their logits
   stored in their slots' rows of the logits table, their slots' bias added, then the argmax,
   or the draw where the row's slot draws. */
static struct ggml_tensor * rows_tokens(struct cllm_slot_table * t, struct ggml_context * ctx,
                                        struct ggml_cgraph * gf, struct ggml_tensor * padded) {
    const int64_t n_rows = padded->ne[1] - 1;
    struct ggml_tensor * rows = ggml_view_2d(ctx, padded, padded->ne[0], n_rows, padded->nb[1], 0);
    t->row_slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_rows);
    ggml_set_name(t->row_slots, "cllm_row_slots");
    ggml_set_input(t->row_slots);
    /* The store runs in every graph that has rows: a sampler of one of them is active. */
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, t->logits, rows, t->row_slots));
    struct ggml_tensor * biased = ggml_add(ctx, rows, ggml_get_rows(ctx, t->bias, t->row_slots));
    struct ggml_tensor * best = ggml_reshape_2d(ctx, ggml_cast(ctx, ggml_argmax(ctx, biased),
                                                               GGML_TYPE_F32), 1, n_rows);
    struct ggml_tensor * drawn = rows_draws(t, ctx, biased);
    struct ggml_tensor * draws = ggml_get_rows(ctx, t->draws, t->row_slots);
    struct ggml_tensor * token = ggml_add(ctx, best,
                                          ggml_mul(ctx, ggml_sub(ctx, drawn, best), draws));
    t->tokens = ggml_cast(ctx, ggml_reshape_1d(ctx, token, n_rows), GGML_TYPE_I32);
    ggml_set_name(t->tokens, "cllm_rows_token");
    return t->tokens;
}

static void slot_backend_apply(struct llama_sampler * smpl, struct ggml_context * ctx,
                               struct ggml_cgraph * gf, struct llama_sampler_data * data) {
    struct slot_sampler * s = smpl->ctx;
    struct cllm_slot_table * t = s->table;
    struct ggml_tensor * logits = data->logits;
    struct ggml_tensor * padded = logits->view_src;
    if (t->bias == NULL || ggml_nelements(logits) != t->n_vocab || padded == NULL
            || padded->ne[0] != t->n_vocab || padded->ne[1] < 2) {  /* not a decode's rows */
        data->sampled = ggml_argmax(ctx, logits);
        return;
    }
    struct ggml_tensor * tokens = t->tokens != NULL ? t->tokens : rows_tokens(t, ctx, gf, padded);
    s->row = (int32_t) (logits->view_offs / padded->nb[1]);
    data->sampled = ggml_view_1d(ctx, tokens, 1, (size_t) s->row * tokens->nb[0]);
    ggml_set_name(data->sampled, "cllm_slot_token");
    data->logits = NULL;  /* only the token leaves the device */
}

/* Before each graph is built (for every sampler): the next one builds the rows' tokens anew. */
static void slot_backend_reset(struct llama_sampler * smpl) {
    struct slot_sampler * s = smpl->ctx;
    s->table->row_slots = NULL;
    s->table->row_uniforms = NULL;
    s->table->tokens = NULL;
}

/* Before each run of the graph, for the samplers with a row in it: which slot that row is, and
   its uniform number (the next of its sequence's generator where the slot draws). */
static void slot_backend_set_input(struct llama_sampler * smpl) {
    const struct slot_sampler * s = smpl->ctx;
    struct ggml_tensor * row_slots = s->table->row_slots;
    if (row_slots != NULL && s->row < row_slots->ne[0]) {
        ggml_backend_tensor_set(row_slots, &s->slot, (size_t) s->row * sizeof(int32_t),
                                sizeof(int32_t));
        const float u = s->source != NULL && !s->held
                        ? (float) cllm_row_sampler_stage(s->source) : 0.5f;
        ggml_backend_tensor_set(s->table->row_uniforms, &u, (size_t) s->row * sizeof(float),
                                sizeof(float));
    }
}

static struct llama_sampler_i slot_sampler_i = {
    /* .name              = */ slot_name,
    /* .accept            = */ NULL,
    /* .apply             = */ slot_apply,
    /* .reset             = */ NULL,
    /* .clone             = */ NULL,
    /* .free              = */ slot_free,
    /* .backend_init      = */ slot_backend_init,
    /* .backend_accept    = */ NULL,
    /* .backend_apply     = */ slot_backend_apply,
    /* .backend_set_input = */ slot_backend_set_input,
    /* .backend_reset     = */ slot_backend_reset,
    /* .copy_state        = */ NULL,
};

struct llama_sampler * cllm_slot_sampler_new(struct cllm_slot_table * table, int32_t slot) {
    struct slot_sampler * s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return NULL;
    }
    s->table = table;
    s->slot = slot;
    table->refs++;
    struct llama_sampler * chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(chain, llama_sampler_init(&slot_sampler_i, s));
    return chain;
}

static struct slot_sampler * slot_of(struct llama_sampler * chain) {
    return llama_sampler_chain_get(chain, 0)->ctx;
}

int cllm_slot_sampler_bans_eog(struct llama_sampler * chain) {
    return slot_of(chain)->banned;
}

void cllm_slot_sampler_ban_eog(struct llama_sampler * chain, int ban) {
    struct slot_sampler * s = slot_of(chain);
    const struct cllm_slot_table * t = s->table;
    ban = ban != 0;
    if (s->banned == ban || t->bias == NULL) {
        s->banned = ban;
        return;
    }
    const float value = ban ? -INFINITY : 0.0f;
    for (int32_t i = 0; i < t->n_eog; i++) {
        const size_t cell = (size_t) s->slot * (size_t) t->n_vocab + (size_t) t->eog_ids[i];
        ggml_backend_tensor_set(t->bias, &value, cell * sizeof(float), sizeof(float));
    }
    s->banned = ban;
}

void cllm_slot_sampler_draw(struct llama_sampler * chain, struct cllm_row_sampler * source,
                            float temperature) {
    struct slot_sampler * s = slot_of(chain);
    const struct cllm_slot_table * t = s->table;
    const int changed = (s->source != NULL) != (source != NULL)
                        || (source != NULL && s->temperature != temperature);
    if (changed && t->inv_temp != NULL) {
        const float inv_temp = source != NULL ? 1.0f / temperature : 1.0f;
        const float draws = source != NULL ? 1.0f : 0.0f;
        const size_t at = (size_t) s->slot * sizeof(float);
        ggml_backend_tensor_set(t->inv_temp, &inv_temp, at, sizeof(float));
        ggml_backend_tensor_set(t->draws, &draws, at, sizeof(float));
    }
    s->source = source;
    s->temperature = temperature;
}

void cllm_slot_sampler_hold(struct llama_sampler * chain, int held) {
    slot_of(chain)->held = held;
}

int cllm_slot_sampler_draws(struct llama_sampler * chain) {
    return slot_of(chain)->source != NULL;
}

float * cllm_slot_table_host_rows(const struct cllm_slot_table * t) {
    return t->host_rows;
}

int cllm_slot_table_read_logits(const struct cllm_slot_table * t, int32_t first_slot, int32_t n) {
    const struct ggml_tensor * rows = t->logits;
    if (rows == NULL || first_slot < 0 || n < 0 || first_slot + n > t->n_slots) {
        return -1;
    }
    size_t offset = (size_t) first_slot * rows->nb[1];
    ggml_backend_tensor_get(rows, (char *) t->host_rows + offset, offset, (size_t) n * rows->nb[1]);
    return 0;
}

static void masker_free(struct slot_masker * k) {
    if (k == NULL) {
        return;
    }
    if (k->galloc != NULL) {
        ggml_gallocr_free(k->galloc);
    }
    if (k->buffer != NULL) {
        ggml_backend_buffer_free(k->buffer);
    }
    if (k->ctx != NULL) {
        ggml_free(k->ctx);
    }
    free_host(k->staging_buffer, k->staging);
    if (k->backend != NULL) {
        ggml_backend_free(k->backend);
    }
    free(k);
}

/* The pattern table on the device: row p, column b is 0 when bit b of p is set, else -inf. */
static int masker_fill_patterns(struct slot_masker * k) {
    const size_t n_rows = (size_t) 1 << MASK_PATTERN_BITS;
    ggml_fp16_t * rows = malloc(n_rows * MASK_PATTERN_BITS * sizeof(ggml_fp16_t));
    if (rows == NULL) {
        return 0;
    }
    const ggml_fp16_t allowed = ggml_fp32_to_fp16(0.0f), banned = ggml_fp32_to_fp16(-INFINITY);
    for (size_t p = 0; p < n_rows; p++) {
        for (int b = 0; b < MASK_PATTERN_BITS; b++) {
            rows[p * MASK_PATTERN_BITS + (size_t) b] = (p >> b) & 1 ? allowed : banned;
        }
    }
    ggml_backend_tensor_set(k->patterns, rows, 0, ggml_nbytes(k->patterns));
    free(rows);
    return 1;
}

/* A CPU device's backend computes with `n_threads` (the context's); other devices ignore it. */
static void masker_set_threads(struct slot_masker * k, int n_threads) {
    ggml_backend_dev_t dev = ggml_backend_get_device(k->backend);
    ggml_backend_reg_t reg = dev != NULL ? ggml_backend_dev_backend_reg(dev) : NULL;
    ggml_backend_set_n_threads_t set = reg == NULL ? NULL : (ggml_backend_set_n_threads_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (set != NULL && n_threads > 0) {
        set(k->backend, n_threads);
    }
}

static struct slot_masker * masker_new(const struct cllm_slot_table * t, int n_threads) {
    struct slot_masker * k = calloc(1, sizeof(*k));
    if (k == NULL) {
        return NULL;
    }
    k->n_halves = 2 * ((t->n_vocab + 31) / 32);
    struct ggml_init_params params = {
        /* .mem_size   = */ ggml_tensor_overhead(),
        /* .mem_buffer = */ NULL,
        /* .no_alloc   = */ true,
    };
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(t->buft);
    if (dev == NULL && ggml_backend_buft_is_host(t->buft)) {  /* the CPU's names no device */
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    k->backend = dev != NULL ? ggml_backend_dev_init(dev, NULL) : NULL;
    k->ctx = ggml_init(params);
    if (k->backend == NULL || k->ctx == NULL) {
        masker_free(k);
        return NULL;
    }
    masker_set_threads(k, n_threads);
    k->patterns = ggml_new_tensor_2d(k->ctx, GGML_TYPE_F16, MASK_PATTERN_BITS,
                                     (int64_t) 1 << MASK_PATTERN_BITS);
    k->buffer = ggml_backend_alloc_ctx_tensors_from_buft(k->ctx, t->buft);
    k->galloc = ggml_gallocr_new(t->buft);
    size_t staging = (size_t) t->n_slots * (2 + (size_t) k->n_halves) * sizeof(int32_t);
    k->staging = alloc_host(t->buft, staging, &k->staging_buffer);
    if (k->buffer == NULL || k->galloc == NULL || k->staging == NULL
            || !masker_fill_patterns(k)) {
        masker_free(k);
        return NULL;
    }
    return k;
}

/* The graph of the choice for `n` rows: their slots' last logits plus their slots' biases plus
   their bitmasks' biases, and the argmax of each row. */
static struct ggml_tensor * masked_tokens(const struct cllm_slot_table * t,
                                          struct ggml_context * ctx, int32_t n,
                                          struct ggml_tensor ** slots,
                                          struct ggml_tensor ** halves) {
    const struct slot_masker * k = t->masker;
    *slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    *halves = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) n * k->n_halves);
    ggml_set_input(*slots);
    ggml_set_input(*halves);
    struct ggml_tensor * expanded = ggml_get_rows(ctx, k->patterns, *halves);
    struct ggml_tensor * mask_bias = ggml_view_2d(
        ctx, expanded, t->n_vocab, n, (size_t) k->n_halves * MASK_PATTERN_BITS * sizeof(float), 0);
    struct ggml_tensor * logits = ggml_add(ctx, ggml_get_rows(ctx, t->logits, *slots),
                                           ggml_get_rows(ctx, t->bias, *slots));
    struct ggml_tensor * tokens = ggml_argmax(ctx, ggml_add(ctx, logits, mask_bias));
    ggml_set_output(tokens);
    return tokens;
}

/* Stage the rows that have a bitmask: their slots, then their bitmasks as 16-bit halves.
   Returns how many. */
static int32_t masker_stage(const struct cllm_slot_table * t, int32_t n, const int32_t * slots,
                            const uint32_t * const * masks) {
    const struct slot_masker * k = t->masker;
    const int32_t n_halves = k->n_halves;  /* read once, so that the loop below vectorizes */
    int32_t * row_slots = k->staging;
    int32_t * halves = row_slots + t->n_slots;
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        if (masks[i] == NULL) {
            continue;
        }
        row_slots[m] = slots[i];
        const uint32_t * restrict words = masks[i];
        int32_t * restrict row = halves + (size_t) m * (size_t) n_halves;
        for (int32_t w = 0; w < n_halves / 2; w++) {
            row[2 * w] = (int32_t) (words[w] & 0xFFFFu);
            row[2 * w + 1] = (int32_t) (words[w] >> 16);
        }
        m++;
    }
    return m;
}

/* A context for a small graph of `graph_size` nodes of the rows' choice (tensors only). */
static struct ggml_context * small_graph_ctx(size_t graph_size) {
    struct ggml_init_params params = {
        /* .mem_size   = */ graph_size * ggml_tensor_overhead()
                            + ggml_graph_overhead_custom(graph_size, false),
        /* .mem_buffer = */ NULL,
        /* .no_alloc   = */ true,
    };
    return ggml_init(params);
}

/* Compute `gf` (its inputs set) on the masker's backend and read its `m` tokens into `out`. */
static int compute_tokens(const struct slot_masker * k, struct ggml_cgraph * gf,
                          struct ggml_tensor * chosen, int32_t * out, int32_t m) {
    if (ggml_backend_graph_compute(k->backend, gf) != GGML_STATUS_SUCCESS) {
        return -1;
    }
    ggml_backend_tensor_get(chosen, out, 0, (size_t) m * sizeof(int32_t));
    return 0;
}

int cllm_slot_table_masked_argmax(struct cllm_slot_table * t, int32_t n, const int32_t * slots,
                                  const uint32_t * const * masks, int32_t * tokens,
                                  int n_threads) {
    if (t->logits == NULL || n < 0 || n > t->n_slots) {
        return -1;
    }
    if (t->masker == NULL && (t->masker = masker_new(t, n_threads)) == NULL) {
        return -1;
    }
    const struct slot_masker * k = t->masker;
    const int32_t m = masker_stage(t, n, slots, masks);
    if (m == 0) {
        return 0;
    }
    const size_t graph_size = 16;
    struct ggml_context * ctx = small_graph_ctx(graph_size);
    if (ctx == NULL) {
        return -1;
    }
    struct ggml_tensor * row_slots, * halves;
    struct ggml_tensor * chosen = masked_tokens(t, ctx, m, &row_slots, &halves);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, graph_size, false);
    ggml_build_forward_expand(gf, chosen);
    int rc = -1;
    if (ggml_gallocr_alloc_graph(k->galloc, gf)) {
        int32_t * staged_halves = k->staging + t->n_slots;
        int32_t * out = staged_halves + (size_t) t->n_slots * (size_t) k->n_halves;
        ggml_backend_tensor_set(row_slots, k->staging, 0, (size_t) m * sizeof(int32_t));
        ggml_backend_tensor_set(halves, staged_halves, 0,
                                (size_t) m * (size_t) k->n_halves * sizeof(int32_t));
        rc = compute_tokens(k, gf, chosen, out, m);
        for (int32_t i = 0, j = 0; rc == 0 && i < n; i++) {
            if (masks[i] != NULL) {
                /* A row whose bitmask allows nothing its slot may sample (all -inf: its
                   grammar failed and lets only an end token through, which the slot bans)
                   has no maximum: CUDA's argmax says -1, as the host's sampling does, and
                   the row samples no token (ggml-cpu's argmax says 0, a token the grammar
                   refuses). Either way the request ends with the grammar's error. */
                tokens[i] = out[j++];
            }
        }
    }
    ggml_free(ctx);
    return rc;
}

/* Whether `backend` runs every node of `gf` (a sort of a whole vocabulary row is beyond some
   devices' kernels): the graph runs there alone, with no scheduler to move a node elsewhere. */
static int backend_runs(ggml_backend_t backend, struct ggml_cgraph * gf) {
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        if (!ggml_backend_supports_op(backend, ggml_graph_node(gf, i))) {
            return 0;
        }
    }
    return 1;
}

/* The rows' parameters as graph inputs, each [1, m] but the slots [m]. */
enum { DRAW_SLOTS, DRAW_INV_TEMP, DRAW_TOP_K, DRAW_TOP_P, DRAW_LOG_MIN_P, DRAW_UNIFORM,
       DRAW_INPUTS };

/* 1 where `x` > 0, else 0, as a float mask: ggml_step of x, or of -x where `negate`. */
static struct ggml_tensor * positive(struct ggml_context * ctx, struct ggml_tensor * x,
                                     int negate) {
    return ggml_step(ctx, negate ? ggml_scale(ctx, x, -1.0f) : x);
}

/* The graph of the filtered draw for `m` rows: their slots' logits and biases sorted, the
   filters as a 0/1 mask over the sorted positions, the draw by inverse CDF at each row's
   temperature, and the token at the drawn position. */
static struct ggml_tensor * filtered_tokens(const struct cllm_slot_table * t,
                                            struct ggml_context * ctx, int32_t m,
                                            struct ggml_tensor ** in) {
    const int64_t n_vocab = t->n_vocab;
    in[DRAW_SLOTS] = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, m);
    for (int i = DRAW_INV_TEMP; i < DRAW_INPUTS; i++) {
        in[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, m);
    }
    for (int i = 0; i < DRAW_INPUTS; i++) {
        ggml_set_input(in[i]);
    }
    struct ggml_tensor * logits = ggml_add(ctx, ggml_get_rows(ctx, t->logits, in[DRAW_SLOTS]),
                                           ggml_get_rows(ctx, t->bias, in[DRAW_SLOTS]));
    struct ggml_tensor * order = ggml_argsort(ctx, logits, GGML_SORT_ORDER_DESC);
    struct ggml_tensor * sorted = ggml_reshape_2d(
        ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, n_vocab, m), order), n_vocab, m);
    /* top-p: keep a position while the probability before it (at T = 1) is under p */
    struct ggml_tensor * p1 = ggml_soft_max(ctx, sorted);
    struct ggml_tensor * before = ggml_sub(ctx, ggml_cumsum(ctx, p1), p1);
    struct ggml_tensor * keep = positive(ctx, ggml_sub(ctx, before, in[DRAW_TOP_P]), 1);
    /* top-k: keep positions under k */
    struct ggml_tensor * positions = ggml_reshape_2d(ctx, ggml_arange(ctx, 0.0f, (float) n_vocab,
                                                                      1.0f), n_vocab, 1);
    struct ggml_tensor * k = ggml_repeat(ctx, in[DRAW_TOP_K], sorted);
    keep = ggml_mul(ctx, keep, positive(ctx, ggml_sub(ctx, k, positions), 0));
    /* min-p: keep logits at or above the best one's plus log(min_p) */
    struct ggml_tensor * best = ggml_cont(ctx, ggml_view_2d(ctx, sorted, 1, m, sorted->nb[1], 0));
    struct ggml_tensor * floor = ggml_add(ctx, best, in[DRAW_LOG_MIN_P]);
    keep = ggml_mul(ctx, keep, ggml_step(ctx, ggml_scale_bias(ctx, ggml_sub(ctx, sorted, floor),
                                                              1.0f, 1e-6f)));
    /* the draw over what is kept */
    struct ggml_tensor * scaled = ggml_add(ctx, ggml_mul(ctx, sorted, in[DRAW_INV_TEMP]),
                                           ggml_log(ctx, keep));
    struct ggml_tensor * cdf = ggml_cumsum(ctx, ggml_soft_max(ctx, scaled));
    struct ggml_tensor * total = ggml_cont(ctx, ggml_view_2d(ctx, cdf, 1, m, cdf->nb[1],
                                                             (size_t) (n_vocab - 1) * cdf->nb[0]));
    struct ggml_tensor * past = ggml_step(ctx, ggml_sub(ctx, cdf, ggml_mul(ctx, in[DRAW_UNIFORM],
                                                                           total)));
    struct ggml_tensor * at = ggml_clamp(ctx, ggml_scale_bias(ctx, ggml_sum_rows(ctx, past), -1.0f,
                                                              (float) n_vocab),
                                         0.0f, (float) (n_vocab - 1));
    struct ggml_tensor * ids = ggml_reshape_3d(ctx, ggml_cast(ctx, order, GGML_TYPE_F32), 1,
                                               n_vocab, m);
    struct ggml_tensor * token = ggml_get_rows(ctx, ids, ggml_reshape_2d(
        ctx, ggml_cast(ctx, at, GGML_TYPE_I32), 1, m));
    struct ggml_tensor * tokens = ggml_cast(ctx, ggml_reshape_1d(ctx, token, m), GGML_TYPE_I32);
    ggml_set_output(tokens);
    return tokens;
}

/* Stage the rows' parameters in the masker's staging (its room for bitmasks is far larger):
   the slots, then each float input's m values, then room for the tokens. */
static void drawer_stage(const struct cllm_slot_table * t, int32_t n,
                         const struct cllm_slot_draw * d, int32_t * staging) {
    float * f = (float *) (staging + n);
    for (int32_t i = 0; i < n; i++) {
        staging[i] = d[i].slot;
        f[0 * n + i] = 1.0f / d[i].temperature;
        f[1 * n + i] = (float) (d[i].top_k > 0 && d[i].top_k < t->n_vocab ? d[i].top_k
                                                                            : t->n_vocab);
        /* top-p 0 keeps the best token alone, as the host does: its probability before is 0 */
        f[2 * n + i] = d[i].top_p >= 1.0f ? 2.0f : d[i].top_p > 1e-6f ? d[i].top_p : 1e-6f;
        f[3 * n + i] = d[i].min_p > 0.0f ? logf(d[i].min_p) : -1e30f;
        f[4 * n + i] = d[i].uniform;
    }
}

int cllm_slot_table_filtered_draw(struct cllm_slot_table * t, int32_t n,
                                  const struct cllm_slot_draw * draws, int32_t * tokens,
                                  int n_threads) {
    if (t->logits == NULL || n < 0 || n > t->n_slots) {
        return -1;
    }
    if (n == 0) {
        return 0;
    }
    if (t->masker == NULL && (t->masker = masker_new(t, n_threads)) == NULL) {
        return -1;
    }
    const struct slot_masker * k = t->masker;
    const size_t graph_size = 64;
    struct ggml_context * ctx = small_graph_ctx(graph_size);
    if (ctx == NULL) {
        return -1;
    }
    struct ggml_tensor * in[DRAW_INPUTS];
    struct ggml_tensor * chosen = filtered_tokens(t, ctx, n, in);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, graph_size, false);
    ggml_build_forward_expand(gf, chosen);
    int rc = -1;
    if (backend_runs(k->backend, gf) && ggml_gallocr_alloc_graph(k->galloc, gf)) {
        drawer_stage(t, n, draws, k->staging);
        for (int i = 0; i < DRAW_INPUTS; i++) {
            ggml_backend_tensor_set(in[i], k->staging + (size_t) i * (size_t) n, 0,
                                    (size_t) n * sizeof(int32_t));
        }
        rc = compute_tokens(k, gf, chosen, tokens, n);
    }
    ggml_free(ctx);
    return rc;
}
