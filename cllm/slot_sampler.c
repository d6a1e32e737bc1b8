/* One llama.cpp backend sampler per sequence slot, attached to every slot when the context is
 * made, so that llama.cpp reserves its graph once (attaching one later re-reserves it: 31 ms a
 * time, measured on an H100).
 *
 * Every step, each slot's row is reduced to its argmax inside the graph, after adding the slot's
 * row of a bias table (0, or -inf at the end-of-generation tokens while the slot bans them), and
 * only that token is copied to the host. llama.cpp's own greedy sampler leaves the row's logits
 * among its outputs, so they are copied too; here they are not. The table lives in a buffer of
 * the output device, written only when a slot's ban changes: a per-step graph input instead is
 * placed on the CPU by ggml's scheduler, and copying 128 slots' inputs to the GPU every step
 * cost more than the logits did (H200, bench/results/h200-slot-samplers/).
 *
 * A row that the host samples instead (temperature, penalties, log-probabilities, grammar
 * masks) reads its logits back after the decode from the slot's row of a second device table,
 * where the graph copies them on the way to the argmax. The graph is then the same whichever
 * way each row is sampled, so llama.cpp may reuse it from step to step; and a row survives
 * the later micro-batches of its decode (split streams decode each run of sequences in a
 * micro-batch of its own, whose graph reuses the same buffers).
 */
#include "slot_sampler.h"

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
    /* [n_vocab, n_slots] each, made when llama.cpp attaches a sampler */
    struct ggml_tensor * bias;
    struct ggml_tensor * logits; /* each slot's logits of its last output */
};

struct slot_sampler {
    struct cllm_slot_table * table;
    int32_t slot;
    int banned;
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
    if (t->ctx != NULL) {
        ggml_free(t->ctx);
    }
    free(t->eog_ids);
    free(t);
}

int cllm_slot_table_ready(const struct cllm_slot_table * t) {
    return t->bias != NULL;
}

/* The bias and logits rows in a buffer of `buft` (the device that computes the logits), all 0. */
static int slot_table_alloc(struct cllm_slot_table * t, ggml_backend_buffer_type_t buft) {
    struct ggml_init_params params = {
        /* .mem_size   = */ 2 * ggml_tensor_overhead(),
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
    t->buffer = ggml_backend_alloc_ctx_tensors_from_buft(t->ctx, buft);
    if (t->buffer == NULL) {
        return 0;
    }
    ggml_backend_buffer_clear(t->buffer, 0);
    t->bias = bias;
    t->logits = logits;
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

/* The table's row `slot` of `rows`, as a vector in the graph's context. */
static struct ggml_tensor * slot_row(struct ggml_context * ctx, struct ggml_tensor * rows,
                                     int32_t slot) {
    return ggml_view_1d(ctx, rows, rows->ne[0], (size_t) slot * rows->nb[1]);
}

static void slot_backend_apply(struct llama_sampler * smpl, struct ggml_context * ctx,
                               struct ggml_cgraph * gf, struct llama_sampler_data * data) {
    (void) gf;
    const struct slot_sampler * s = smpl->ctx;
    const struct cllm_slot_table * t = s->table;
    struct ggml_tensor * logits = data->logits;
    if (t->bias != NULL && ggml_nelements(logits) == t->n_vocab) {  /* not llama.cpp's probe */
        /* The copy feeds the argmax, so it runs exactly when this slot has a row in the
           micro-batch (llama.cpp builds inactive slots' branches without computing them). */
        logits = ggml_cpy(ctx, logits, slot_row(ctx, t->logits, s->slot));
        logits = ggml_add(ctx, logits, slot_row(ctx, t->bias, s->slot));
    }
    data->sampled = ggml_argmax(ctx, logits);
    ggml_set_name(data->sampled, "cllm_slot_argmax");
    data->logits = NULL;  /* only the token leaves the device */
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
    /* .backend_set_input = */ NULL,
    /* .backend_reset     = */ NULL,
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

int cllm_slot_sampler_read_logits(struct llama_sampler * chain, float * dst, size_t n_vocab) {
    const struct slot_sampler * s = slot_of(chain);
    const struct ggml_tensor * rows = s->table->logits;
    if (rows == NULL || (size_t) rows->ne[0] != n_vocab) {
        return -1;
    }
    ggml_backend_tensor_get(rows, dst, (size_t) s->slot * rows->nb[1], n_vocab * sizeof(float));
    return 0;
}
