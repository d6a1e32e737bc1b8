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
 *     device (llama.cpp's own greedy sampler copies the logits too).
 *
 * Which slot each row belongs to is the graph's one input, written by the samplers of the rows
 * present (llama.cpp sets inputs for those only). The tables live in a buffer of the output
 * device, written only when a slot's ban changes: per-slot graph inputs instead are placed on
 * the CPU by ggml's scheduler, and copying 128 of them to the GPU every step cost more than
 * the logits did (H200, bench/results/h200-slot-samplers/).
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
    /* [n_vocab, n_slots] on the host, where rows the host samples are read back to: page-locked
       memory of the logits' device where it has such (host_buffer), else malloc's. */
    ggml_backend_buffer_t host_buffer;
    float * host_rows;
    /* [n_vocab, n_slots] each, made when llama.cpp attaches a sampler */
    struct ggml_tensor * bias;
    struct ggml_tensor * logits; /* each slot's logits of its last output */
    /* The graph being built or run: each row's slot (its input) and each row's token. */
    struct ggml_tensor * row_slots;
    struct ggml_tensor * tokens;
};

struct slot_sampler {
    struct cllm_slot_table * table;
    int32_t slot;
    int32_t row; /* its row in the graph last built, when it has one there */
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
    if (t->host_buffer != NULL) {
        ggml_backend_buffer_free(t->host_buffer);
    } else {
        free(t->host_rows);
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

/* The host's copy of every slot's logits row. Page-locked where the logits' device offers it:
 * a copy from a GPU into ordinary memory is staged by the driver at a fraction of the bus's
 * speed, and a constrained step at 64 rows reads 12 MB (SmolLM2's vocabulary) or 33 MB (Llama
 * 3's) back. */
static int slot_table_alloc_host_rows(struct cllm_slot_table * t, ggml_backend_buffer_type_t buft) {
    size_t size = (size_t) t->n_vocab * (size_t) t->n_slots * sizeof(float);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    ggml_backend_buffer_type_t host = dev != NULL ? ggml_backend_dev_host_buffer_type(dev) : NULL;
    if (host != NULL) {
        t->host_buffer = ggml_backend_buft_alloc_buffer(host, size);
    }
    t->host_rows = t->host_buffer != NULL ? ggml_backend_buffer_get_base(t->host_buffer)
                                          : malloc(size);
    return t->host_rows != NULL;
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
    if (!slot_table_alloc_host_rows(t, buft)) {
        return 0;
    }
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

/* Every row's token for the graph whose logits (padded by one row) are `padded`: their logits
   stored in their slots' rows of the logits table, their slots' bias added, the argmax taken. */
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
    t->tokens = ggml_argmax(ctx, biased);
    ggml_set_name(t->tokens, "cllm_rows_argmax");
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
    s->table->tokens = NULL;
}

/* Before each run of the graph, for the samplers with a row in it: which slot that row is. */
static void slot_backend_set_input(struct llama_sampler * smpl) {
    const struct slot_sampler * s = smpl->ctx;
    struct ggml_tensor * row_slots = s->table->row_slots;
    if (row_slots != NULL && s->row < row_slots->ne[0]) {
        ggml_backend_tensor_set(row_slots, &s->slot, (size_t) s->row * sizeof(int32_t),
                                sizeof(int32_t));
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
