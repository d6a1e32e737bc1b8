# The subset of llama.h (pinned llama.cpp 0c1e57098) that cllm calls. Declarations only.
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t


cdef extern from "ggml.h" nogil:
    cdef enum ggml_log_level:
        GGML_LOG_LEVEL_NONE
        GGML_LOG_LEVEL_DEBUG
        GGML_LOG_LEVEL_INFO
        GGML_LOG_LEVEL_WARN
        GGML_LOG_LEVEL_ERROR
        GGML_LOG_LEVEL_CONT
    ctypedef void (*ggml_log_callback)(ggml_log_level level, const char * text, void * user_data) noexcept
    ctypedef bint (*ggml_abort_callback)(void * data) noexcept


cdef extern from "llama.h" nogil:
    cdef struct llama_vocab:
        pass
    cdef struct llama_model:
        pass
    cdef struct llama_context:
        pass
    cdef struct llama_sampler:
        pass
    ctypedef void * llama_memory_t

    ctypedef int32_t llama_pos
    ctypedef int32_t llama_token
    ctypedef int32_t llama_seq_id

    cdef enum llama_pooling_type:
        LLAMA_POOLING_TYPE_UNSPECIFIED
        LLAMA_POOLING_TYPE_NONE
        LLAMA_POOLING_TYPE_MEAN
        LLAMA_POOLING_TYPE_CLS
        LLAMA_POOLING_TYPE_LAST

    cdef enum llama_flash_attn_type:
        LLAMA_FLASH_ATTN_TYPE_AUTO
        LLAMA_FLASH_ATTN_TYPE_DISABLED
        LLAMA_FLASH_ATTN_TYPE_ENABLED

    ctypedef struct llama_batch:
        int32_t n_tokens
        llama_token * token
        float * embd
        llama_pos * pos
        int32_t * n_seq_id
        llama_seq_id ** seq_id
        int8_t * logits

    cdef struct llama_model_params:
        int32_t n_gpu_layers
        bint vocab_only
        bint use_extra_bufts

    cdef struct llama_sampler_seq_config:
        llama_seq_id seq_id
        llama_sampler * sampler

    cdef struct llama_context_params:
        uint32_t n_ctx
        uint32_t n_batch
        uint32_t n_ubatch
        uint32_t n_seq_max
        int32_t n_threads
        int32_t n_threads_batch
        llama_flash_attn_type flash_attn_type
        llama_pooling_type pooling_type
        bint embeddings
        bint no_perf
        bint kv_unified
        bint swa_full
        uint32_t n_outputs_max_per_seq
        llama_sampler_seq_config * samplers
        size_t n_samplers

    llama_model_params llama_model_default_params()
    llama_context_params llama_context_default_params()

    void llama_backend_init()
    void llama_log_set(ggml_log_callback log_callback, void * user_data)
    const char * llama_print_system_info()
    bint llama_supports_gpu_offload()

    llama_model * llama_model_load_from_file(const char * path_model, llama_model_params params)
    void llama_model_free(llama_model * model)
    llama_context * llama_init_from_model(llama_model * model, llama_context_params params)
    void llama_free(llama_context * ctx)

    uint32_t llama_n_ctx(const llama_context * ctx)
    uint32_t llama_n_ctx_seq(const llama_context * ctx)
    uint32_t llama_n_batch(const llama_context * ctx)
    int32_t llama_n_threads(llama_context * ctx)
    uint32_t llama_n_seq_max(const llama_context * ctx)
    llama_memory_t llama_get_memory(const llama_context * ctx)

    const llama_vocab * llama_model_get_vocab(const llama_model * model)
    int32_t llama_model_n_ctx_train(const llama_model * model)
    int32_t llama_model_n_swa(const llama_model * model)
    int32_t llama_model_desc(const llama_model * model, char * buf, size_t buf_size)
    uint64_t llama_model_size(const llama_model * model)
    uint64_t llama_model_n_params(const llama_model * model)
    int32_t llama_model_n_embd_out(const llama_model * model)
    const char * llama_model_chat_template(const llama_model * model, const char * name)
    int32_t llama_model_meta_count(const llama_model * model)
    int32_t llama_model_meta_key_by_index(const llama_model * model, int32_t i, char * buf, size_t buf_size)
    int32_t llama_model_meta_val_str_by_index(const llama_model * model, int32_t i, char * buf, size_t buf_size)

    int32_t llama_vocab_n_tokens(const llama_vocab * vocab)
    llama_token llama_vocab_bos(const llama_vocab * vocab)
    llama_token llama_vocab_eos(const llama_vocab * vocab)
    llama_token llama_vocab_eot(const llama_vocab * vocab)
    llama_token llama_vocab_fim_pre(const llama_vocab * vocab)
    llama_token llama_vocab_fim_suf(const llama_vocab * vocab)
    llama_token llama_vocab_fim_mid(const llama_vocab * vocab)
    llama_token llama_vocab_fim_pad(const llama_vocab * vocab)
    llama_token llama_vocab_fim_rep(const llama_vocab * vocab)
    llama_token llama_vocab_fim_sep(const llama_vocab * vocab)
    bint llama_vocab_is_eog(const llama_vocab * vocab, llama_token token)
    bint llama_vocab_is_control(const llama_vocab * vocab, llama_token token)
    bint llama_vocab_get_add_bos(const llama_vocab * vocab)

    int32_t llama_tokenize(const llama_vocab * vocab, const char * text, int32_t text_len,
                           llama_token * tokens, int32_t n_tokens_max,
                           bint add_special, bint parse_special)
    int32_t llama_token_to_piece(const llama_vocab * vocab, llama_token token, char * buf,
                                 int32_t length, int32_t lstrip, bint special)

    bint llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1)
    void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src,
                             llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1)
    void llama_memory_clear(llama_memory_t mem, bint data)
    llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id)
    llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id)
    size_t llama_state_seq_get_size(llama_context * ctx, llama_seq_id seq_id)
    size_t llama_state_seq_get_data(llama_context * ctx, uint8_t * dst, size_t size,
                                    llama_seq_id seq_id)
    size_t llama_state_seq_set_data(llama_context * ctx, const uint8_t * src, size_t size,
                                    llama_seq_id dest_seq_id)

    llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max)
    void llama_batch_free(llama_batch batch)
    int32_t llama_decode(llama_context * ctx, llama_batch batch)
    void llama_set_abort_callback(llama_context * ctx, ggml_abort_callback abort_callback,
                                  void * abort_callback_data)
    float * llama_get_logits(llama_context * ctx)
    float * llama_get_embeddings_seq(llama_context * ctx, llama_seq_id seq_id)
    ctypedef struct llama_perf_context_data:
        double t_start_ms
        double t_load_ms
        double t_p_eval_ms
        double t_eval_ms
        int32_t n_p_eval
        int32_t n_eval
        int32_t n_reused
    llama_perf_context_data llama_perf_context(const llama_context * ctx)

    void llama_sampler_free(llama_sampler * smpl)
    bint llama_set_sampler(llama_context * ctx, llama_seq_id seq_id, llama_sampler * smpl)
    void llama_synchronize(llama_context * ctx)
    llama_token llama_get_sampled_token_ith(llama_context * ctx, int32_t i)


cdef extern from "row_sampler.h" nogil:
    cdef struct cllm_sampling:
        float temperature
        int32_t top_k
        float top_p
        float min_p
        float repeat_penalty
        float presence_penalty
        float frequency_penalty
        int32_t penalty_last_n
        uint64_t seed
        int keep_distribution
    cdef struct cllm_row_sampler:
        pass
    cdef struct cllm_sampler_scratch:
        pass
    cllm_row_sampler * cllm_row_sampler_new(const cllm_sampling * params)
    void cllm_row_sampler_free(cllm_row_sampler * sampler)
    void cllm_row_sampler_accept(cllm_row_sampler * sampler, int32_t token)
    const cllm_sampling * cllm_row_sampler_params(const cllm_row_sampler * sampler)
    double cllm_row_sampler_take(cllm_row_sampler * sampler)
    cllm_sampler_scratch * cllm_sampler_scratch_new(int32_t n_vocab)
    void cllm_sampler_scratch_free(cllm_sampler_scratch * scratch)
    int32_t cllm_row_sampler_sample(cllm_row_sampler * sampler, float * logits, int32_t n_vocab,
                                    const int32_t * banned, int32_t n_banned,
                                    cllm_sampler_scratch * scratch)


cdef extern from "slot_sampler.h" nogil:
    cdef struct cllm_slot_table:
        pass
    cllm_slot_table * cllm_slot_table_new(int32_t n_vocab, int32_t n_slots, int32_t n_eog,
                                          const int32_t * eog_ids)
    void cllm_slot_table_release(cllm_slot_table * table)
    bint cllm_slot_table_ready(const cllm_slot_table * table)
    llama_sampler * cllm_slot_sampler_new(cllm_slot_table * table, int32_t slot)
    bint cllm_slot_sampler_bans_eog(llama_sampler * chain)
    void cllm_slot_sampler_ban_eog(llama_sampler * chain, bint ban)
    void cllm_slot_sampler_draw(llama_sampler * chain, cllm_row_sampler * source, float temperature)
    bint cllm_slot_sampler_draws(llama_sampler * chain)
    void cllm_slot_sampler_hold(llama_sampler * chain, bint held)
    float * cllm_slot_table_host_rows(const cllm_slot_table * table)
    int cllm_slot_table_read_logits(const cllm_slot_table * table, int32_t first_slot, int32_t n)
    cdef struct cllm_slot_draw:
        int32_t slot
        float temperature
        int32_t top_k
        float top_p
        float min_p
        float uniform
    int cllm_slot_table_filtered_draw(cllm_slot_table * table, int32_t n,
                                      const cllm_slot_draw * draws, int32_t * tokens,
                                      int n_threads)
    int cllm_slot_table_masked_argmax(cllm_slot_table * table, int32_t n, const int32_t * slots,
                                      const uint32_t * const * masks, int32_t * tokens,
                                      int n_threads)
