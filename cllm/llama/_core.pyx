# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""llama.cpp bound directly: a Model, a Context with one KV cache shared by all sequences, and a
batch step that decodes and samples every sequence with the GIL released."""
import os
import secrets
from array import array

from cllm.config import usable_cores

from cpython cimport array as carray
from cython.parallel cimport prange, threadid
from libc.math cimport expf, logf, sqrt, INFINITY
from libc.stdint cimport int32_t, uint32_t
from libc.stdio cimport fputs, stderr
from libc.stdlib cimport calloc, free, malloc

from cllm.llama._llama cimport *

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from *:
    """
    /* A flag another thread sets once the data it guards is written: read it with acquire
       order, so that the data reads after it are not moved before it. */
    static inline int cllm_load_acquire(const volatile int *flag) {
        return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    }
    """
    int cllm_load_acquire(const volatile int * flag) nogil

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clock_id, timespec * ts)
    int CLOCK_MONOTONIC


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


class ModelLoadError(RuntimeError):
    """A model file could not be loaded; the message names the path and the reason."""


class DecodeError(RuntimeError):
    """llama_decode failed; `code` is its return value."""

    def __init__(self, code, message):
        super().__init__(f"llama_decode returned {code}: {message}")
        self.code = code


class KVCacheFullError(DecodeError):
    """No room in the KV cache for this batch: the scheduler should preempt and retry."""


class DecodeAborted(DecodeError):
    """The decode was stopped from another thread (Embedder.abort)."""


cdef int _log_threshold = GGML_LOG_LEVEL_WARN


cdef void _log_to_stderr(ggml_log_level level, const char * text, void * user_data) noexcept nogil:
    # llama.cpp logs every tensor at INFO while loading; keep warnings and errors only.
    if level >= _log_threshold and level != GGML_LOG_LEVEL_CONT:
        fputs(text, stderr)


def set_log_level(str level):
    """'debug', 'info', 'warn' or 'error': the least severe llama.cpp message printed."""
    global _log_threshold
    levels = {"debug": GGML_LOG_LEVEL_DEBUG, "info": GGML_LOG_LEVEL_INFO,
              "warn": GGML_LOG_LEVEL_WARN, "error": GGML_LOG_LEVEL_ERROR}
    _log_threshold = levels[level]


llama_log_set(_log_to_stderr, NULL)
llama_backend_init()


def system_info():
    return llama_print_system_info().decode()


def supports_gpu_offload():
    return llama_supports_gpu_offload()


cdef _check_gguf_file(str path):
    """Reject what llama.cpp would only report in its log, with the reason in the exception."""
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")


cdef class Model:
    """A loaded GGUF model and its vocabulary."""
    cdef llama_model * model
    cdef const llama_vocab * vocab
    cdef readonly str path
    cdef readonly tuple eog_tokens  # every token that ends generation (EOS, EOT, ...), by id
    cdef object __weakref__

    def __cinit__(self, path, int n_gpu_layers=-1, bint repack=False):
        self.path = os.fspath(path)
        _check_gguf_file(self.path)
        cdef llama_model_params params = llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # llama.cpp's extra CPU buffer types (AMX, repacked weights). Off by default: its AMX
        # path crashes on Sapphire Rapids machines where the kernel reports AMX (seen here).
        params.use_extra_bufts = repack
        cdef bytes c_path = self.path.encode()
        cdef const char * p = c_path
        with nogil:
            self.model = llama_model_load_from_file(p, params)
        if self.model is NULL:
            raise ModelLoadError(
                f"{self.path}: llama.cpp could not load it "
                "(truncated, corrupt or unsupported GGUF)")
        self.vocab = llama_model_get_vocab(self.model)
        self.eog_tokens = tuple(t for t in range(llama_vocab_n_tokens(self.vocab))
                                if llama_vocab_is_eog(self.vocab, t))

    def __dealloc__(self):
        if self.model is not NULL:
            llama_model_free(self.model)

    @property
    def n_vocab(self):
        return llama_vocab_n_tokens(self.vocab)

    @property
    def n_ctx_train(self):
        return llama_model_n_ctx_train(self.model)

    @property
    def n_params(self):
        return llama_model_n_params(self.model)

    @property
    def size_bytes(self):
        return llama_model_size(self.model)

    @property
    def bos_token(self):
        return llama_vocab_bos(self.vocab)

    @property
    def eos_token(self):
        return llama_vocab_eos(self.vocab)

    @property
    def eot_token(self):
        return llama_vocab_eot(self.vocab)

    @property
    def adds_bos(self):
        return llama_vocab_get_add_bos(self.vocab)

    @property
    def description(self):
        cdef char buf[256]
        cdef int n = llama_model_desc(self.model, buf, sizeof(buf))
        return buf[:max(n, 0)].decode("utf-8", "replace")

    @property
    def chat_template(self):
        """The GGUF's default chat template (Jinja source), or None."""
        cdef const char * tmpl = llama_model_chat_template(self.model, NULL)
        return None if tmpl is NULL else tmpl.decode("utf-8", "replace")

    @property
    def metadata(self):
        """Every GGUF key/value pair, values as strings (arrays are summarised by llama.cpp)."""
        cdef int i, n = llama_model_meta_count(self.model)
        result = {}
        for i in range(n):
            key = _read_meta(self.model, i, True)
            result[key] = _read_meta(self.model, i, False)
        return result

    def is_eog(self, int token):
        """Whether `token` ends generation (EOS, EOT and the model's other end tokens)."""
        return llama_vocab_is_eog(self.vocab, token)

    def is_control(self, int token):
        """Whether `token` is a control token ('<|im_start|>'): text never spells it."""
        return llama_vocab_is_control(self.vocab, token)

    def tokenize(self, str text, bint add_special=True, bint parse_special=False):
        """Token ids of `text`; `add_special` adds BOS where the model wants it,
        `parse_special` turns special-token text (e.g. '<|im_start|>') into its token."""
        cdef bytes data = text.encode("utf-8")
        cdef const char * c_text = data
        cdef int32_t n_text = len(data)
        cdef int32_t capacity = n_text + 2
        cdef carray.array tokens = array("i")
        cdef int32_t n
        while True:
            carray.resize(tokens, capacity)
            with nogil:
                n = llama_tokenize(self.vocab, c_text, n_text,
                                   <llama_token *> tokens.data.as_ints, capacity,
                                   add_special, parse_special)
            if n >= 0:
                break
            if n == -2147483648:
                raise ValueError("text too long to tokenize")
            capacity = -n
        return tokens.tolist()[:n]

    @property
    def native_tokenizer(self):
        """(the vocabulary's address, llama_tokenize's address), valid while this Model lives:
        for a library that tokenizes from its own threads (llguidance) without calling back
        into Python, whose GIL each call would have to take."""
        return <size_t> self.vocab, <size_t> <void *> llama_tokenize

    def token_to_piece(self, int token, bint special=False):
        """The bytes of one token: a piece of a multi-byte UTF-8 character may stand alone.
        ValueError for an id outside the vocabulary (llama.cpp would abort the process), such
        as LLAMA_TOKEN_NULL (-1), what a vocabulary without BOS or EOS reports for them."""
        if token < 0 or token >= llama_vocab_n_tokens(self.vocab):
            raise ValueError(f"token id {token} outside the vocabulary "
                             f"[0, {llama_vocab_n_tokens(self.vocab)})")
        cdef char buf[128]
        cdef int32_t n = llama_token_to_piece(self.vocab, token, buf, sizeof(buf), 0, special)
        if n < 0:
            return self._long_piece(token, -n, special)
        return buf[:n]

    cdef bytes _long_piece(self, int token, int32_t size, bint special):
        cdef bytearray out = bytearray(size)
        cdef char * buf = out
        llama_token_to_piece(self.vocab, token, buf, size, 0, special)
        return bytes(out)

    def detokenize(self, tokens, bint special=False):
        """Text of a token list; bytes that are not valid UTF-8 become U+FFFD."""
        pieces = [self.token_to_piece(t, special) for t in tokens]
        return b"".join(pieces).decode("utf-8", "replace")


cdef str _read_meta(llama_model * model, int i, bint key):
    cdef int32_t size = 256
    cdef int32_t n
    cdef bytearray buf
    while True:
        buf = bytearray(size)
        if key:
            n = llama_model_meta_key_by_index(model, i, buf, size)
        else:
            n = llama_model_meta_val_str_by_index(model, i, buf, size)
        if n < size:
            return bytes(buf[:max(n, 0)]).decode("utf-8", "replace")
        size = n + 1



_FLASH_ATTN = {"auto": LLAMA_FLASH_ATTN_TYPE_AUTO, "on": LLAMA_FLASH_ATTN_TYPE_ENABLED,
               "off": LLAMA_FLASH_ATTN_TYPE_DISABLED}
cdef carray.array _INT_ARRAY = array("i")
cdef carray.array _FLOAT_ARRAY = array("f")
# Greedy rows per thread of the argmax: fewer do not repay waking a thread.
cdef int _ROWS_PER_THREAD = 4

cdef llama_context * _new_context(Model model, llama_context_params params, int n_threads,
                                  str what) except NULL:
    """A llama.cpp context over `model` with `params`, `n_threads` (0: every core this process
    may use) for prompts and decodes alike and no perf counters; RuntimeError naming `what`
    when llama.cpp cannot make it."""
    params.n_threads = n_threads if n_threads > 0 else usable_cores()
    params.n_threads_batch = params.n_threads
    params.no_perf = True
    cdef llama_context * ctx
    with nogil:
        ctx = llama_init_from_model(model.model, params)
    if ctx is NULL:
        raise RuntimeError(f"llama.cpp could not create {what}")
    return ctx


cdef class Context:
    """One llama_context for up to `n_seq_max` sequences, a sampler per sampled sequence, and
    `step()`, which decodes one batch and samples every row that asks for a token.

    The KV cache holds `n_ctx` cells. Unified, any sequence may use any cell; otherwise each
    sequence owns `n_ctx / n_seq_max` of them, and attends only over its own; with
    `aligned_prefill` too, on a CPU, a sequence's logits then do not depend on which other
    sequences share its batches, nor on whether its prefix was computed in an earlier request."""
    cdef llama_context * ctx
    cdef llama_batch batch
    # Per sequence that samples with a temperature or penalties (NULL: greedy): row_sampler.c
    cdef cllm_row_sampler ** samplers
    cdef cllm_sampler_scratch ** scratch  # per thread of the host's sampling
    cdef unsigned char * ban_eog  # per sequence: its end-of-generation tokens are never sampled
    # Backend sampling: per slot, the slot sampler attached when the context was made
    # (slot_sampler.c), and whether this slot's rows take the graph's token (else the host
    # samples them from the logits it reads back into the table's host rows, a row per slot).
    cdef llama_sampler ** graph_chains
    cdef cllm_slot_table * slot_table  # what they share: each slot's bias row on the device
    cdef unsigned char * in_graph
    cdef int * eog_ids
    cdef int n_eog, n_threads
    # One step's outputs to sample: sequence, batch index, and logits where greedy (else NULL).
    cdef int * out_seq
    cdef int * out_row
    cdef int32_t * out_idx
    cdef float ** out_logits
    cdef float ** out_host  # each output's logits on the host, NULL where none came back
    cdef const uint32_t ** out_mask  # the allowed tokens' bitmask, NULL: unconstrained
    cdef const uint32_t ** out_device_mask  # out_mask where the device applies it, else NULL
    cdef unsigned char * out_on_device  # 1 where the device chose the output's token
    cdef cllm_slot_draw * draws  # the step's rows drawn with filters on the device
    cdef int * draw_out  # each draw's output
    cdef int32_t * draw_tokens  # and its token
    cdef const volatile int * masks_ready  # during a step: nonzero once the bitmasks are filled
    cdef int * out_tokens
    cdef readonly Model model
    cdef readonly int n_ctx, n_ctx_seq, n_seq_max, n_batch, n_vocab
    cdef readonly int mask_words  # uint32 words of one token bitmask: a bit per vocabulary entry
    cdef readonly bint kv_unified, aligned_prefill, backend_sampling
    # Whether greedy rows sampled in the graph with a bitmask take the device's masked choice;
    # where it fails it is turned off and the host masks them, reading their logits back.
    cdef public bint device_masks
    # Whether rows with filters and no penalty draw on the device after the step (as the
    # masked ones choose there); turned off where it fails, and the host draws them.
    cdef public bint device_filters
    # A decode run keeps the rows that stop in its batch until it ends (their tokens dropped,
    # their cells removed after each step), so every step of the run has the same shape and
    # llama.cpp may reuse its graph; only with backend sampling (the graph samples every row)
    # and without a sliding window.
    cdef public bint hold_run_shape
    cdef volatile int _interrupted  # set from any thread: a decode run stops after its step
    # During a decode run with constrained rows: decode_run's after_step, the array it reads
    # (each row's token if it goes on, else -1) and what it raised.
    cdef object _after_step
    cdef carray.array _going_on
    cdef object _after_step_error
    # Seconds decode runs spent in llama_decode, in after_step (the GIL included), waiting for
    # the step and sampling, and their steps; read by run_timing().
    cdef double _t_decode, _t_after_step, _t_wait, _t_sample
    cdef long _t_steps, _t_held_rows

    def __cinit__(self, Model model, int n_ctx=4096, int n_seq_max=16, int n_batch=512,
                  int n_ubatch=512, int n_threads=0, str flash_attn="auto", bint kv_unified=True,
                  bint aligned_prefill=False, bint backend_sampling=False):
        if n_seq_max < 1 or n_ctx < 1 or n_batch < 1 or n_ubatch < 1:
            raise ValueError("n_ctx, n_seq_max, n_batch and n_ubatch must be positive")
        if flash_attn not in _FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(_FLASH_ATTN)}")
        cdef llama_context_params params = llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_seq_max = n_seq_max
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch, n_batch)
        params.flash_attn_type = _FLASH_ATTN[flash_attn]
        params.kv_unified = kv_unified
        self.model = model
        self._alloc_sequences(n_seq_max)
        cdef llama_sampler_seq_config * configs = NULL
        if backend_sampling:
            params.n_outputs_max_per_seq = 1  # a step samples each sequence once
            configs = self._slot_samplers(n_seq_max)
            params.samplers, params.n_samplers = configs, n_seq_max
        try:
            self.ctx = _new_context(model, params, n_threads, f"a context (n_ctx={n_ctx}, "
                                    f"n_seq_max={n_seq_max}, n_batch={n_batch})")
        finally:
            free(configs)
        if backend_sampling and not cllm_slot_table_ready(self.slot_table):
            self._detach_slot_samplers()  # then the host samples every row
            backend_sampling = False
        self.n_ctx = llama_n_ctx(self.ctx)
        self.n_ctx_seq = llama_n_ctx_seq(self.ctx)
        self.kv_unified = kv_unified
        self.aligned_prefill = aligned_prefill and not kv_unified
        self.backend_sampling = backend_sampling
        self.device_masks = backend_sampling
        self.device_filters = backend_sampling
        self.n_batch = llama_n_batch(self.ctx)
        self.n_vocab = model.n_vocab
        self.mask_words = (self.n_vocab + 31) // 32
        self.n_threads = llama_n_threads(self.ctx)
        self.batch = llama_batch_init(self.n_batch, 0, 1)
        self.out_seq = <int *> malloc(self.n_batch * sizeof(int))
        self.out_row = <int *> malloc(self.n_batch * sizeof(int))
        self.out_idx = <int32_t *> malloc(self.n_batch * sizeof(int32_t))
        self.out_logits = <float **> malloc(self.n_batch * sizeof(float *))
        self.out_host = <float **> malloc(self.n_batch * sizeof(float *))
        self.out_mask = <const uint32_t **> calloc(self.n_batch, sizeof(uint32_t *))
        self.out_device_mask = <const uint32_t **> calloc(self.n_batch, sizeof(uint32_t *))
        self.out_on_device = <unsigned char *> calloc(self.n_batch, 1)
        self.draws = <cllm_slot_draw *> malloc(self.n_batch * sizeof(cllm_slot_draw))
        self.draw_out = <int *> malloc(self.n_batch * sizeof(int))
        self.draw_tokens = <int32_t *> malloc(self.n_batch * sizeof(int32_t))
        self.out_tokens = <int *> malloc(self.n_batch * sizeof(int))
        if (self.out_seq is NULL or self.out_row is NULL
                or self.out_idx is NULL or self.out_logits is NULL or self.out_tokens is NULL
                or self.out_host is NULL or self.out_mask is NULL
                or self.out_device_mask is NULL or self.out_on_device is NULL
                or self.draws is NULL or self.draw_out is NULL or self.draw_tokens is NULL):
            raise MemoryError()
        self.scratch = <cllm_sampler_scratch **> calloc(self.n_threads,
                                                        sizeof(cllm_sampler_scratch *))
        if self.scratch is NULL:
            raise MemoryError()
        for i in range(self.n_threads):
            self.scratch[i] = cllm_sampler_scratch_new(self.n_vocab)
            if self.scratch[i] is NULL:
                raise MemoryError()

    cdef void _alloc_sequences(self, int n_seq_max) except *:
        """The per-sequence arrays and the end-of-generation ids, before the context: the slot
        samplers llama.cpp attaches while making it are made from them."""
        self.n_seq_max = n_seq_max
        self.samplers = <cllm_row_sampler **> calloc(n_seq_max, sizeof(cllm_row_sampler *))
        self.ban_eog = <unsigned char *> calloc(n_seq_max, 1)
        self.graph_chains = <llama_sampler **> calloc(n_seq_max, sizeof(llama_sampler *))
        self.in_graph = <unsigned char *> calloc(n_seq_max, 1)
        eog = self.model.eog_tokens
        self.n_eog = len(eog)
        self.eog_ids = <int *> malloc(max(1, self.n_eog) * sizeof(int))
        if (self.samplers is NULL or self.ban_eog is NULL or self.graph_chains is NULL
                or self.in_graph is NULL or self.eog_ids is NULL):
            raise MemoryError()
        for i, token in enumerate(eog):
            self.eog_ids[i] = token

    cdef llama_sampler_seq_config * _slot_samplers(self, int n_seq_max) except NULL:
        """A slot sampler for every sequence id, for llama.cpp to attach as it makes the
        context: its graph is then reserved once, whatever each request asks for."""
        self.slot_table = cllm_slot_table_new(self.model.n_vocab, n_seq_max, self.n_eog,
                                              <int32_t *> self.eog_ids)
        cdef llama_sampler_seq_config * configs = <llama_sampler_seq_config *> malloc(
            n_seq_max * sizeof(llama_sampler_seq_config))
        if configs is NULL or self.slot_table is NULL:
            free(configs)
            raise MemoryError()
        cdef int seq_id
        for seq_id in range(n_seq_max):
            self.graph_chains[seq_id] = cllm_slot_sampler_new(self.slot_table, seq_id)
            if self.graph_chains[seq_id] is NULL:
                free(configs)
                raise MemoryError()
            configs[seq_id].seq_id = seq_id
            configs[seq_id].sampler = self.graph_chains[seq_id]
        return configs

    cdef void _detach_slot_samplers(self):
        """Where their table could not be made on the device (or llama.cpp attached none),
        llama.cpp still holds the samplers it attached, and with them it would copy no logits
        for the host: take them back (one more reserve, on this failure path only)."""
        cdef int seq_id
        for seq_id in range(self.n_seq_max):
            llama_set_sampler(self.ctx, seq_id, NULL)

    def __dealloc__(self):
        cdef int i
        if self.samplers is not NULL:
            for i in range(self.n_seq_max):
                cllm_row_sampler_free(self.samplers[i])
            free(self.samplers)
        if self.scratch is not NULL:
            for i in range(self.n_threads):
                cllm_sampler_scratch_free(self.scratch[i])
            free(self.scratch)
        free(self.ban_eog)
        free(self.eog_ids)
        free(self.out_seq)
        free(self.out_row)
        free(self.out_idx)
        free(self.out_logits)
        free(self.out_host)
        free(<void *> self.out_mask)
        free(<void *> self.out_device_mask)
        free(self.out_on_device)
        free(self.draws)
        free(self.draw_out)
        free(self.draw_tokens)
        free(self.out_tokens)
        if self.batch.token is not NULL:
            llama_batch_free(self.batch)
        if self.ctx is not NULL:
            llama_free(self.ctx)
        if self.graph_chains is not NULL:  # after the context, which uses them until freed
            for i in range(self.n_seq_max):
                if self.graph_chains[i] is not NULL:
                    llama_sampler_free(self.graph_chains[i])
            free(self.graph_chains)
        if self.slot_table is not NULL:
            cllm_slot_table_release(self.slot_table)
        free(self.in_graph)

    cdef void _check_seq(self, int seq_id) except *:
        if seq_id < 0 or seq_id >= self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} outside [0, {self.n_seq_max})")

    def set_sampler(self, int seq_id, float temperature=0.0, int top_k=0, float top_p=1.0,
                    float min_p=0.0, float repeat_penalty=1.0, float presence_penalty=0.0,
                    float frequency_penalty=0.0, int penalty_last_n=64, seed=None, history=(),
                    bint ban_eog=False, bint host_logits=False):
        """Sampling for `seq_id` until it is removed. Temperature 0 with no penalty is greedy, an
        argmax over the logits. `history` (e.g. the prompt) is what the penalties already saw.
        `ban_eog`: end-of-generation tokens are never sampled, so text runs on to its length.
        With `backend_sampling`, a greedy sequence is sampled inside the decode's graph (with a
        bitmask, on the same device just after it), and so is one with a temperature and no
        filter or penalty (with a bitmask, on the host): their logits never reach the host,
        unless `host_logits` (for log-probabilities: the host then samples every row, and a
        sampled row's logits become the distribution drawn from)."""
        self._check_seq(seq_id)
        self._free_sampler(seq_id)
        self._ban_eog(seq_id, ban_eog)
        cdef bint penalised = (repeat_penalty != 1.0 or presence_penalty != 0.0
                               or frequency_penalty != 0.0)
        cdef bint greedy = temperature <= 0.0 and not penalised
        cdef bint drawn = (not greedy and not penalised and top_k <= 0 and top_p >= 1.0
                           and min_p <= 0.0)
        self.in_graph[seq_id] = self.backend_sampling and (greedy or drawn) and not host_logits
        if greedy:
            return
        self.samplers[seq_id] = _new_row_sampler(
            temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty,
            frequency_penalty, penalty_last_n if penalised else 0, seed, history, host_logits)
        self._draw_in_graph(seq_id)

    cdef void _ban_eog(self, int seq_id, bint ban):
        """Whether `seq_id` may sample end-of-generation tokens, on the host and in the graph
        (whose bias row for the slot is written now, between decodes, if it changes)."""
        self.ban_eog[seq_id] = ban
        if self.backend_sampling and cllm_slot_sampler_bans_eog(self.graph_chains[seq_id]) != ban:
            llama_synchronize(self.ctx)  # no decode may still read the row
            cllm_slot_sampler_ban_eog(self.graph_chains[seq_id], ban)

    cdef void _draw_in_graph(self, int seq_id):
        """Point the slot's graph sampler at the sequence's generator where the graph draws its
        tokens, else back to the argmax (between decodes: the slot's tables change)."""
        if not self.backend_sampling:
            return
        cdef llama_sampler * chain = self.graph_chains[seq_id]
        cdef cllm_row_sampler * source = (self.samplers[seq_id] if self.in_graph[seq_id]
                                          else NULL)
        if source is NULL and not cllm_slot_sampler_draws(chain):
            return
        llama_synchronize(self.ctx)  # no decode may still read the tables or the generator
        cllm_slot_sampler_draw(chain, source, cllm_row_sampler_params(source).temperature
                               if source is not NULL else 0.0)

    cdef void _free_sampler(self, int seq_id):
        cdef cllm_row_sampler * sampler = self.samplers[seq_id]
        self.samplers[seq_id] = NULL
        self._draw_in_graph(seq_id)  # the graph lets go of it first
        cllm_row_sampler_free(sampler)

    def park_sampler(self, int seq_id):
        """Take `seq_id`'s sampler out with its state (a seeded generator's position, the
        penalties' history), for a preempted sequence to resume with: `restore_sampler` puts it
        back, in whichever slot the sequence gets next."""
        self._check_seq(seq_id)
        cdef ParkedSampler parked = ParkedSampler.__new__(ParkedSampler)
        parked.sampler, parked.ban_eog = self.samplers[seq_id], self.ban_eog[seq_id]
        parked.in_graph = self.in_graph[seq_id]
        self.samplers[seq_id], self.ban_eog[seq_id] = NULL, 0
        self._draw_in_graph(seq_id)
        return parked

    def restore_sampler(self, int seq_id, ParkedSampler parked):
        self._check_seq(seq_id)
        self._free_sampler(seq_id)
        self.samplers[seq_id] = parked.sampler
        self._ban_eog(seq_id, parked.ban_eog)
        self.in_graph[seq_id] = parked.in_graph
        parked.sampler = NULL
        self._draw_in_graph(seq_id)

    def remove_sequence(self, int seq_id):
        """Free every KV cell of `seq_id` and its sampler, so the id can start a new sequence."""
        self._check_seq(seq_id)
        llama_memory_seq_rm(llama_get_memory(self.ctx), seq_id, -1, -1)
        self._free_sampler(seq_id)
        self.ban_eog[seq_id] = 0

    def end_sequence(self, int seq_id):
        """Free `seq_id`'s sampler; its KV cells stay, as a prefix a later sequence may reuse."""
        self._check_seq(seq_id)
        self._free_sampler(seq_id)
        self.ban_eog[seq_id] = 0

    def share_prefix(self, int dst, int src, int length):
        """Make `dst` hold exactly the first `length` positions of `src` (dst == src: drop the
        rest). In a unified cache the cells are shared, not copied; between split streams
        llama.cpp copies src's whole stream at the next decode, and dst keeps the prefix."""
        self._check_seq(dst)
        self._check_seq(src)
        if length < 0:
            raise ValueError(f"length {length} is negative")
        cdef llama_memory_t mem = llama_get_memory(self.ctx)
        if src != dst:
            llama_memory_seq_rm(mem, dst, -1, -1)
            if length == 0:
                return
            if self.kv_unified:
                llama_memory_seq_cp(mem, src, dst, 0, length)
                return
            llama_memory_seq_cp(mem, src, dst, -1, -1)
        llama_memory_seq_rm(mem, dst, length, -1)

    def seq_pos_max(self, int seq_id):
        """The last position of `seq_id` in the KV cache, -1 when it holds none."""
        self._check_seq(seq_id)
        return llama_memory_seq_pos_max(llama_get_memory(self.ctx), seq_id)

    @property
    def graphs_reused(self):
        """How many times llama.cpp ran a step on the graph of the step before (the same
        shape, and the same KV span), since the context was made, rather than building one:
        on a GPU a new graph costs host time and, in ggml-cuda, its CUDA graph too."""
        return llama_perf_context(self.ctx).n_reused

    def kv_cells_used(self):
        """KV positions held, summed over sequences: a cell that several sequences share
        counts once for each."""
        cdef llama_memory_t mem = llama_get_memory(self.ctx)
        cdef int seq_id, used = 0
        cdef llama_pos lo, hi
        for seq_id in range(self.n_seq_max):
            hi = llama_memory_seq_pos_max(mem, seq_id)
            if hi >= 0:
                lo = llama_memory_seq_pos_min(mem, seq_id)
                used += hi - lo + 1
        return used

    def step(self, const int[::1] seq_ids, const int[::1] positions, const int[::1] n_tokens,
             const int[::1] sample, const int[::1] tokens, const int[::1] top_logprobs=None,
             const int[::1] mask_rows=None, const int[::1] masks=None,
             const int[::1] masks_ready=None):
        """Decode one batch and sample.

        Row r feeds `n_tokens[r]` tokens (taken in order from `tokens`) of sequence `seq_ids[r]`,
        the first at `positions[r]`. Rows with `sample[r]` get a token sampled from the logits of
        their last token; the others get -1. With `top_logprobs` (-1: none, k >= 0: the chosen
        token's log-probability and the k most likely), returns (tokens, Logprobs), else tokens.
        With `mask_rows` (-1: none, m >= 0: bitmask m of `masks`, which holds `mask_words` words
        per bitmask, a set bit for each allowed token), a row samples only among its allowed
        tokens: the others' logits become -inf before its sampler (or argmax) and the
        log-probabilities see them, so they report the constrained distribution.
        With `masks_ready`, another thread is still filling `masks` when the step starts: the
        step decodes (on a GPU, while the other thread works) and waits for
        `masks_ready[0] != 0` before it samples a masked row.

        With `aligned_prefill` (split streams only), the one-token rows decode together and
        each longer row on its own, cut at its last multiple of PREFILL_BLOCK (see there).
        Raises KVCacheFullError when the batch does not fit the KV cache (nothing is written),
        DecodeError for any other failure."""
        cdef Py_ssize_t r, n_rows = seq_ids.shape[0]
        if positions.shape[0] != n_rows or n_tokens.shape[0] != n_rows or sample.shape[0] != n_rows:
            raise ValueError("seq_ids, positions, n_tokens and sample must have one entry per row")
        if top_logprobs is not None and top_logprobs.shape[0] != n_rows:
            raise ValueError("top_logprobs must have one entry per row")
        self._check_rows(seq_ids, n_tokens, tokens)
        cdef const uint32_t * mask_data = self._check_masks(n_rows, mask_rows, masks)
        self._check_logprob_rows(seq_ids, sample, top_logprobs)
        cdef carray.array out = carray.clone(_INT_ARRAY, n_rows, False)
        cdef int k = 0
        cdef Logprobs lp = None
        if top_logprobs is not None:
            for r in range(n_rows):
                k = max(k, top_logprobs[r])
            lp = Logprobs.__new__(Logprobs, n_rows, k)
        cdef _Pieces pieces = _Pieces(positions, n_tokens, self.aligned_prefill)
        cdef _RowLogprobs wanted
        wanted.top = NULL
        if lp is not None:
            wanted.top = &top_logprobs[0]
            wanted.k = k
            wanted.chosen = lp.chosen.data.as_floats
            wanted.top_ids = lp.top_ids.data.as_ints
            wanted.top_lps = lp.top_logprobs.data.as_floats
        cdef const int * row_masks = &mask_rows[0] if mask_data != NULL else NULL
        cdef int32_t rc
        cdef int failed_call = 0
        if masks_ready is not None and masks_ready.shape[0] < 1:
            raise ValueError("masks_ready must hold one flag")
        self.masks_ready = &masks_ready[0] if masks_ready is not None else NULL
        with nogil:
            rc = self._decode_pieces(pieces, seq_ids, positions, n_tokens, sample, tokens,
                                     mask_data, row_masks, out.data.as_ints, &wanted,
                                     &failed_call)
        self.masks_ready = NULL
        if rc == 1 and failed_call == 0:
            raise KVCacheFullError(rc, "no room in the KV cache for this batch")
        if rc != 0:
            raise DecodeError(rc, "invalid batch" if rc == -1 else "decode failed")
        return out if lp is None else (out, lp)

    def decode_run(self, const int[::1] seq_ids, const int[::1] positions,
                   const int[::1] last_tokens, const int[::1] budgets, int n_steps,
                   const int[::1] mask_rows=None, const int[::1] masks=None,
                   const int[::1] masks_ready=None, after_step=None, bint end_at_stop=False):
        """Up to `n_steps` decode steps in C for sequences that are past their prompts.

        Row r continues `seq_ids[r]` from `last_tokens[r]` at `positions[r]` and stops after
        `budgets[r]` tokens, or after an end-of-generation token (which a sequence set to
        `ban_eog` never samples). The run
        ends early when every row has stopped, on `interrupt()`, when the KV cache is full, or,
        with `end_at_stop`, after the step in which a row stopped (a request waits for a slot).
        Returns (tokens, counts): row r's tokens are tokens[r * n_steps : r * n_steps + counts[r]].
        A step that fails ends the run with what the steps before it made, and leaves no cell of
        its own behind; DecodeError if the first step fails. With `hold_run_shape` (and backend
        sampling), rows that stop stay in the batch until the run ends, so that its steps are
        one shape.

        Constrained rows: `mask_rows`, `masks` and `masks_ready`, as step() takes them, hold the
        first step's bitmasks, and `after_step(going_on, more)` gets every step's tokens, with
        the GIL, while the next step (if any: `more`) decodes: going_on[r] is the token row r
        sampled if the row goes on (neither its budget nor an end token stopped it), else -1.
        It returns the rows that end there (their grammar is complete: what the next step
        computed for them is dropped), and, when `more`, refills `masks` in place for that
        step (`masks_ready` is nonzero once they are filled). What it raises ends the run,
        leaving no cell of the step in flight, and is raised here."""
        cdef Py_ssize_t n_rows = seq_ids.shape[0]
        if (positions.shape[0] != n_rows or last_tokens.shape[0] != n_rows
                or budgets.shape[0] != n_rows):
            raise ValueError("every argument needs one entry per row")
        if n_rows > self.n_batch or n_steps < 1:
            raise ValueError(f"{n_rows} rows, {n_steps} steps: "
                             f"need 1..{self.n_batch} rows, 1+ steps")
        self._check_rows(seq_ids, _ones(n_rows), last_tokens)
        cdef const uint32_t * mask_data = self._check_masks(n_rows, mask_rows, masks)
        if (mask_data != NULL) != (after_step is not None):
            raise ValueError("bitmasks and after_step go together")
        cdef carray.array tokens = carray.clone(_INT_ARRAY, n_rows * n_steps, False)
        cdef carray.array counts = carray.clone(_INT_ARRAY, n_rows, True)
        cdef const int * row_masks = &mask_rows[0] if mask_data != NULL else NULL
        cdef int32_t rc
        self._after_step = after_step
        if after_step is not None:
            self._going_on = carray.clone(_INT_ARRAY, n_rows, False)
        self._after_step_error = None
        self.masks_ready = &masks_ready[0] if masks_ready is not None else NULL
        try:
            with nogil:
                rc = self._run(seq_ids, positions, last_tokens, budgets, n_steps, mask_data,
                               row_masks, tokens.data.as_ints, counts.data.as_ints, end_at_stop)
        finally:
            self.masks_ready = NULL
            self._after_step = self._going_on = None
        if self._after_step_error is not None:
            error, self._after_step_error = self._after_step_error, None
            raise error
        cdef Py_ssize_t r
        if rc != 0 and rc != 1:
            for r in range(n_rows):
                if counts[r]:  # the caller retries from there, one step at a time
                    return tokens, counts
            raise DecodeError(rc, "invalid batch" if rc == -1 else "decode failed")
        return tokens, counts

    def run_timing(self):
        """Mean milliseconds per step of the decode runs since the last call: in llama_decode
        (on a GPU: building and launching the step), in after_step (the GIL included), waiting
        for the step to finish (on a GPU; a CPU computes it inside llama_decode), and sampling
        (reading host rows' logits back included), how many steps, and the rows a step carried
        after they stopped (held_rows, hold_run_shape)."""
        steps = max(1, self._t_steps)
        timing = {"steps": self._t_steps, "decode_ms": 1000 * self._t_decode / steps,
                  "after_step_ms": 1000 * self._t_after_step / steps,
                  "wait_ms": 1000 * self._t_wait / steps,
                  "sample_ms": 1000 * self._t_sample / steps,
                  "held_rows": self._t_held_rows / steps}
        self._t_decode = self._t_after_step = self._t_wait = self._t_sample = 0
        self._t_steps = self._t_held_rows = 0
        return timing

    def interrupt(self):
        """Make a running decode_run return after its current step (thread-safe). The flag
        stays set until `clear_interrupt()`, so a run that starts after it returns at once."""
        self._interrupted = 1

    def clear_interrupt(self):
        """Called by the decoding thread just before it reads its inbox: whatever arrives after
        that interrupts the next run."""
        self._interrupted = 0

    cdef int32_t _run(self, const int[::1] seq_ids, const int[::1] positions,
                      const int[::1] last_tokens, const int[::1] budgets, int n_steps,
                      const uint32_t * masks, const int * row_masks,
                      int * tokens, int * counts, bint end_at_stop) noexcept nogil:
        """The run's steps. With bitmasks, each step's tokens go to after_step while the next
        step decodes (on a GPU the matchers advance meanwhile); a row it ends was already fed
        to that step, whose cell for it is removed and whose token for it is dropped. With
        hold_run_shape, a step keeps the rows of the step before: one that stopped is fed its
        last token again at its next position, not sampled, and that cell removed after the
        step (where a stopped row's stream is full, the step takes the live rows alone)."""
        cdef Py_ssize_t r, i, n = 0, n_rows = seq_ids.shape[0]
        cdef int step
        cdef int32_t rc = 0
        cdef int unheard = 0  # 1 + the step whose tokens have not gone to after_step; 0: none
        cdef int * rows = <int *> malloc(n_rows * sizeof(int))  # batch index → row
        cdef int * sampled = <int *> calloc(n_rows, sizeof(int))  # 1 + the row's last step
        cdef unsigned char * ended = <unsigned char *> calloc(n_rows, 1)  # by after_step
        cdef unsigned char * live = <unsigned char *> calloc(n_rows, 1)  # samples this step
        cdef Py_ssize_t i_out
        cdef int n_live, first_live = 0
        # Not with a sliding window, which would count a held row's position.
        cdef bint hold = (self.hold_run_shape and self.backend_sampling
                          and llama_model_n_swa(self.model.model) == 0)
        cdef double t0, t1
        if rows is NULL or sampled is NULL or ended is NULL or live is NULL:
            free(rows)
            free(sampled)
            free(ended)
            free(live)
            return -3
        for step in range(n_steps):
            n_live = 0
            for r in range(n_rows):
                live[r] = not ended[r] and self._continues(tokens + r * n_steps, counts[r],
                                                           budgets[r])
                n_live += live[r]
            if step == 0:
                first_live = n_live
            elif self._interrupted or (end_at_stop and n_live < first_live):
                break
            if n_live == 0:
                break
            if not (hold and step > 0
                    and self._can_hold(n, rows, live, positions, tokens, counts, n_steps)):
                n = 0
                for r in range(n_rows):
                    if live[r]:
                        rows[n] = <int> r
                        n += 1
            self._batch_run_step(n, rows, seq_ids, positions, last_tokens, tokens, counts,
                                 n_steps)
            if hold:
                for i in range(n):  # a held row's generator stays where its sequence left it
                    cllm_slot_sampler_hold(self.graph_chains[seq_ids[rows[i]]],
                                           not live[rows[i]])
            t0 = _now()
            rc = llama_decode(self.ctx, self.batch)
            self._t_decode += _now() - t0
            if rc != 0:
                self._forget_step(n, rows, seq_ids, positions, counts)
                break
            if unheard:
                t0 = _now()
                if not self._end_constrained_rows(unheard, sampled, tokens, counts, budgets,
                                                  n_steps, ended, True):
                    unheard = 0
                    self._forget_step(n, rows, seq_ids, positions, counts)
                    break
                self._t_after_step += _now() - t0
                unheard = 0
            self._name_outputs(n, rows, live, seq_ids, masks, row_masks)
            t0 = _now()
            llama_synchronize(self.ctx)  # the step's end, timed apart from its sampling
            t1 = _now()
            self._t_wait += t1 - t0
            self._sample_outputs(n_live, self.out_tokens)
            self._t_sample += _now() - t1
            self._t_steps += 1
            self._t_held_rows += n - n_live
            i_out = 0  # the row's output among those sampled
            for i in range(n):
                r = rows[i]
                if live[r] and not ended[r]:
                    tokens[r * n_steps + counts[r]] = self.out_tokens[i_out]
                    counts[r] += 1
                    sampled[r] = step + 1
                else:  # held after it stopped, or fed to this step before after_step ended it
                    llama_memory_seq_rm(llama_get_memory(self.ctx), seq_ids[r],
                                        positions[r] + counts[r], -1)
                i_out += live[r]
            if masks != NULL:
                unheard = step + 1
        if unheard:  # the last step's tokens, with no step after them
            self._end_constrained_rows(unheard, sampled, tokens, counts, budgets, n_steps,
                                       ended, False)
        if hold:
            for r in range(n_rows):
                cllm_slot_sampler_hold(self.graph_chains[seq_ids[r]], False)
        free(rows)
        free(sampled)
        free(ended)
        free(live)
        return rc

    cdef bint _can_hold(self, Py_ssize_t n, const int * rows, const unsigned char * live,
                        const int[::1] positions, const int * tokens, const int * counts,
                        int n_steps) noexcept nogil:
        """Whether each of the step's rows that stopped can be fed again: a token to feed (not
        the -1 of a row that sampled none) and a cell for its next position (a split stream can
        be full); if not, the run's next steps are its live rows."""
        cdef Py_ssize_t i
        cdef int r
        for i in range(n):
            r = rows[i]
            if not live[r] and (positions[r] + counts[r] >= self.n_ctx_seq
                                or tokens[r * n_steps + counts[r] - 1] < 0):
                return False
        return True

    cdef void _name_outputs(self, Py_ssize_t n, const int * rows, const unsigned char * live,
                            const int[::1] seq_ids, const uint32_t * masks,
                            const int * row_masks) noexcept nogil:
        """out_seq, out_idx and out_mask of the step's outputs to sample: its live rows', in
        batch order (a row held after it stopped is computed but not sampled)."""
        cdef Py_ssize_t i, j = 0
        cdef int r
        for i in range(n):
            r = rows[i]
            if not live[r]:
                continue
            self.out_seq[j] = seq_ids[r]
            self.out_idx[j] = self.out_idx[i]
            self.out_mask[j] = NULL
            if masks != NULL and row_masks[r] >= 0:
                self.out_mask[j] = masks + <size_t> row_masks[r] * self.mask_words
            j += 1

    cdef void _batch_run_step(self, int n, const int * rows, const int[::1] seq_ids,
                              const int[::1] positions, const int[::1] last_tokens,
                              const int * tokens, const int * counts,
                              int n_steps) noexcept nogil:
        """The batch of a run's step: row rows[i]'s next token at batch index i."""
        cdef int i, r
        for i in range(n):
            r = rows[i]
            self._put(i, last_tokens[r] if counts[r] == 0 else tokens[r * n_steps + counts[r] - 1],
                      positions[r] + counts[r], seq_ids[r], True)
            self.out_idx[i] = i
        self.batch.n_tokens = n

    cdef inline void _put(self, int b, int token, llama_pos pos, int seq_id,
                          bint output) noexcept nogil:
        self.batch.token[b] = token
        self.batch.pos[b] = pos
        self.batch.n_seq_id[b] = 1
        self.batch.seq_id[b][0] = seq_id
        self.batch.logits[b] = output

    cdef bint _end_constrained_rows(self, int step, const int * sampled, const int * tokens,
                                    const int * counts, const int[::1] budgets, int n_steps,
                                    unsigned char * ended, bint more) noexcept with gil:
        """A decode run's after_step, for the tokens of the rows that sampled in step
        `step` - 1 (sampled[r] == step): mark the rows it ends. False if it raised (kept for
        decode_run to raise)."""
        cdef int * going_on = self._going_on.data.as_ints
        cdef Py_ssize_t r, e, n_rows = budgets.shape[0]
        for r in range(n_rows):
            going_on[r] = -1
            if (sampled[r] == step and not ended[r]
                    and self._continues(tokens + r * n_steps, counts[r], budgets[r])):
                going_on[r] = tokens[r * n_steps + counts[r] - 1]
        try:
            for e in self._after_step(self._going_on, more):
                if e < 0 or e >= n_rows:
                    raise IndexError(f"after_step ended row {e} of {n_rows}")
                ended[e] = 1
        except BaseException as exc:
            self._after_step_error = exc
            return False
        return True

    cdef void _forget_step(self, Py_ssize_t n, const int * rows, const int[::1] seq_ids,
                           const int[::1] positions, const int * counts) noexcept nogil:
        """Remove what a failed step wrote: llama.cpp rolls back only its last micro-batch."""
        cdef llama_memory_t mem = llama_get_memory(self.ctx)
        cdef Py_ssize_t i
        cdef int r
        for i in range(n):
            r = rows[i]
            llama_memory_seq_rm(mem, seq_ids[r], positions[r] + counts[r], -1)

    cdef bint _continues(self, const int * row_tokens, int count, int budget) noexcept nogil:
        """Whether a run's row goes on: not at its budget, and its last token neither an end of
        generation nor the -1 of a step that sampled none (fed on, llama.cpp would refuse the
        next step for every row)."""
        if count >= budget:
            return False
        return count == 0 or (row_tokens[count - 1] >= 0
                               and not llama_vocab_is_eog(self.model.vocab, row_tokens[count - 1]))

    cdef void _sample_outputs(self, int n, int * out) noexcept nogil:
        """Sample the step's n outputs, in batch order, into out; out_seq and out_idx name each
        one's sequence and batch index, out_mask its bitmask of allowed tokens (or NULL). Rows
        sampled in the graph take its token, or with a bitmask the device's masked choice (the
        host's, over their logits read back, where device_masks is off). The host's rows are
        spread over the threads, each masked first: the greedy ones by an argmax (on a GPU the
        logits of a 64-row step are 12 MB; one core scanning them took a third of the step),
        the others by their sequence's row sampler (row_sampler.c; a sampled row weighs as
        _ROWS_PER_THREAD greedy ones in the count of threads). The caller has waited for the
        step (llama_synchronize). out_host names where each output's logits lie on the host
        afterwards."""
        cdef int i, work = 0
        cdef float ** logits = self.out_logits
        self._await_masks(n)
        self._masked_on_device(n, out)
        self._filtered_on_device(n, out)
        self._host_logits(n)
        for i in range(n):
            logits[i] = NULL
            if self.out_on_device[i]:
                continue  # the device chose
            if self.in_graph[self.out_seq[i]] and self.out_mask[i] == NULL:
                out[i] = llama_get_sampled_token_ith(self.ctx, self.out_idx[i])
                continue
            out[i] = -1
            logits[i] = self.out_host[i]
            if logits[i] is not NULL:
                work += 1 if self.samplers[self.out_seq[i]] is NULL else _ROWS_PER_THREAD
        cdef int threads = min(self.n_threads, max(1, work // _ROWS_PER_THREAD))
        cdef const unsigned char * ban = self.ban_eog
        cdef const int * seqs = self.out_seq
        cdef const int * eog = self.eog_ids
        cdef const uint32_t ** masks = self.out_mask
        cdef cllm_row_sampler ** samplers = self.samplers
        cdef cllm_sampler_scratch ** scratch = self.scratch
        cdef int n_eog = self.n_eog, n_vocab = self.n_vocab
        for i in prange(n, num_threads=threads, schedule="dynamic"):
            if logits[i] is not NULL:
                if masks[i] != NULL:
                    _apply_mask(logits[i], n_vocab, masks[i])
                if samplers[seqs[i]] is NULL:
                    out[i] = _greedy(logits[i], n_vocab, eog, n_eog if ban[seqs[i]] else 0)
                else:
                    out[i] = cllm_row_sampler_sample(
                        samplers[seqs[i]], logits[i], n_vocab, <const int32_t *> eog,
                        n_eog if ban[seqs[i]] else 0, scratch[threadid()])

    cdef void _masked_on_device(self, int n, int * out) noexcept nogil:
        """Give the greedy rows sampled in the graph that have a bitmask the device's masked
        choice (slot_sampler.c), marking them in out_device_mask: only their bitmasks go there
        and their tokens come back, where reading their logits back took most of a constrained
        64-row step's sampling on an H200 (the graph's own token ignores the bitmask; a row
        that draws is masked and drawn on the host). Where the device fails, none is marked,
        and device_masks goes off for the context's life."""
        cdef int i, masked = 0
        for i in range(n):
            self.out_device_mask[i] = NULL
            self.out_on_device[i] = 0
            if (self.device_masks and self.in_graph[self.out_seq[i]]
                    and self.samplers[self.out_seq[i]] is NULL and self.out_mask[i] != NULL):
                self.out_device_mask[i] = self.out_mask[i]
                masked += 1
        if not masked:
            return
        if cllm_slot_table_masked_argmax(
                self.slot_table, n, <const int32_t *> self.out_seq, self.out_device_mask,
                <int32_t *> out, self.n_threads) != 0:
            self.device_masks = False
            return
        for i in range(n):
            self.out_on_device[i] = self.out_device_mask[i] != NULL

    cdef void _filtered_on_device(self, int n, int * out) noexcept nogil:
        """Draw on the device the rows whose sampler has filters and no penalty (no bitmask, no
        log-probabilities): their logits stay there, are sorted there, and only their tokens
        come back (read back, 64 rows of a 128k vocabulary took 24 ms a step on the host's 16
        threads, an H100's step of a 1B model being 5). Where the device fails, the host draws
        them, and device_filters goes off for the context's life."""
        if not self.device_filters:
            return
        cdef int i, m = 0
        cdef cllm_row_sampler * sampler
        cdef const cllm_sampling * p
        for i in range(n):
            sampler = self.samplers[self.out_seq[i]]
            if sampler is NULL or self.in_graph[self.out_seq[i]] or self.out_mask[i] != NULL:
                continue
            p = cllm_row_sampler_params(sampler)
            if p.penalty_last_n > 0 or p.keep_distribution or p.temperature <= 0.0:
                continue
            self.draws[m].slot = self.out_seq[i]
            self.draws[m].temperature = p.temperature
            self.draws[m].top_k = p.top_k
            self.draws[m].top_p = p.top_p
            self.draws[m].min_p = p.min_p
            self.draws[m].uniform = <float> cllm_row_sampler_take(sampler)
            self.draw_out[m] = i
            m += 1
        if not m:
            return
        if cllm_slot_table_filtered_draw(self.slot_table, m, self.draws, self.draw_tokens,
                                         self.n_threads) != 0:
            self.device_filters = False
            return
        for i in range(m):
            out[self.draw_out[i]] = self.draw_tokens[i]
            self.out_on_device[self.draw_out[i]] = 1
            cllm_row_sampler_accept(self.samplers[self.out_seq[self.draw_out[i]]],
                                    self.draw_tokens[i])

    cdef bint _host_samples(self, int i) noexcept nogil:
        """Whether the host samples output i: one the device did not choose, outside the graph
        or with a bitmask."""
        return not self.out_on_device[i] and (not self.in_graph[self.out_seq[i]]
                                              or self.out_mask[i] != NULL)

    cdef void _host_logits(self, int n) noexcept nogil:
        """Point out_host[i] at the host's logits of output i, once the step is over. With
        backend sampling, only the rows the host samples (_host_samples: after the device's
        masked choice) come back from the slot table, each
        run of adjacent slots in one copy, into page-locked memory (with a copy a row into
        malloc's memory, sampling a constrained 64-row step took 4.1 ms on an H200 host; 2.6 ms
        this way)."""
        cdef int i, j, seq_id
        cdef bint read
        cdef float * all_logits
        if not self.backend_sampling:
            all_logits = llama_get_logits(self.ctx)
            for i in range(n):
                self.out_host[i] = (all_logits + <size_t> i * self.n_vocab
                                    if all_logits is not NULL else NULL)
            return
        cdef float * rows = cllm_slot_table_host_rows(self.slot_table)
        i = 0
        while i < n:
            seq_id = self.out_seq[i]
            self.out_host[i] = NULL
            if not self._host_samples(i):
                i += 1
                continue
            j = i + 1
            while j < n and self.out_seq[j] == seq_id + j - i and self._host_samples(j):
                j += 1
            read = cllm_slot_table_read_logits(self.slot_table, seq_id, j - i) == 0
            while i < j:
                self.out_host[i] = rows + <size_t> self.out_seq[i] * self.n_vocab if read else NULL
                i += 1

    cdef void _await_masks(self, int n) noexcept nogil:
        """Wait until the step's bitmasks are filled, if a row of these n outputs has one."""
        cdef int i
        if self.masks_ready == NULL:
            return
        for i in range(n):
            if self.out_mask[i] != NULL:
                while cllm_load_acquire(self.masks_ready) == 0:
                    sched_yield()  # the filling takes well under a millisecond
                return

    cdef void _check_logprob_rows(self, const int[::1] seq_ids, const int[::1] sample,
                                  const int[::1] top_logprobs) except *:
        """Log-probabilities need a row's logits on the host (a bitmask is applied where
        the row is sampled)."""
        cdef Py_ssize_t r
        for r in range(seq_ids.shape[0]):
            if (sample[r] and self.in_graph[seq_ids[r]] and top_logprobs is not None
                    and top_logprobs[r] >= 0):
                raise ValueError(f"sequence {seq_ids[r]} is sampled in the graph: "
                                 "log-probabilities need set_sampler(host_logits=True)")

    cdef void _check_rows(self, const int[::1] seq_ids, const int[::1] n_tokens,
                          const int[::1] tokens) except *:
        cdef Py_ssize_t r, total = 0
        for r in range(seq_ids.shape[0]):
            self._check_seq(seq_ids[r])
            if n_tokens[r] < 1:
                raise ValueError(f"row {r} feeds {n_tokens[r]} tokens")
            total += n_tokens[r]
        if total != tokens.shape[0]:
            raise ValueError(f"rows feed {total} tokens, {tokens.shape[0]} given")
        if total > self.n_batch:
            raise ValueError(f"{total} tokens exceed the batch size {self.n_batch}")
        for r in range(total):
            if tokens[r] < 0 or tokens[r] >= self.n_vocab:
                raise ValueError(f"token id {tokens[r]} outside the vocabulary [0, {self.n_vocab})")

    cdef const uint32_t * _check_masks(self, Py_ssize_t n_rows, const int[::1] mask_rows,
                                       const int[::1] masks) except? NULL:
        """The bitmasks' first word, or NULL when no row is constrained."""
        if mask_rows is None and masks is None:
            return NULL
        if mask_rows is None or masks is None or mask_rows.shape[0] != n_rows:
            raise ValueError("mask_rows (one entry per row) and masks go together")
        cdef Py_ssize_t r, n_masks = masks.shape[0] // self.mask_words
        if masks.shape[0] != n_masks * self.mask_words:
            raise ValueError(f"masks must hold whole bitmasks of {self.mask_words} words")
        for r in range(n_rows):
            if mask_rows[r] < -1 or mask_rows[r] >= n_masks:
                raise ValueError(f"row {r} names bitmask {mask_rows[r]} of {n_masks}")
        return <const uint32_t *> &masks[0] if n_masks else NULL

    cdef int32_t _decode_pieces(self, _Pieces pieces, const int[::1] seq_ids,
                                const int[::1] positions, const int[::1] n_tokens,
                                const int[::1] sample, const int[::1] tokens,
                                const uint32_t * masks, const int * mask_rows, int * out,
                                _RowLogprobs * wanted, int * failed_call) noexcept nogil:
        """One llama_decode per call of the plan, sampling the rows that end in it (and their
        log-probabilities, while that call's logits are there)."""
        cdef int c, p, j, r, i, n_out, first = 0
        cdef int32_t rc
        for r in range(pieces.n_rows):
            out[r] = -1
        for c in range(pieces.n_calls):
            i = 0
            n_out = 0
            for p in range(first, pieces.call_end[c]):
                r = pieces.row[p]
                for j in range(pieces.length[p]):
                    self._put(i, tokens[pieces.row_first[r] + pieces.offset[p] + j],
                              positions[r] + pieces.offset[p] + j, seq_ids[r], False)
                    i += 1
                if sample[r] and pieces.offset[p] + pieces.length[p] == n_tokens[r]:
                    self.batch.logits[i - 1] = 1
                    self.out_seq[n_out] = seq_ids[r]
                    self.out_idx[n_out] = i - 1
                    self.out_row[n_out] = r
                    self.out_mask[n_out] = NULL
                    if masks != NULL and mask_rows[r] >= 0:
                        self.out_mask[n_out] = masks + <size_t> mask_rows[r] * self.mask_words
                    n_out += 1
            self.batch.n_tokens = <int32_t> i
            rc = llama_decode(self.ctx, self.batch)
            if rc != 0:
                failed_call[0] = c
                return rc
            llama_synchronize(self.ctx)
            self._sample_outputs(n_out, self.out_tokens)
            for i in range(n_out):
                r = self.out_row[i]
                out[r] = self.out_tokens[i]
                if (wanted.top != NULL and wanted.top[r] >= 0 and self.out_host[i] != NULL
                        and out[r] >= 0):  # a row that sampled no token has none to weigh
                    _fill_logprobs(self.out_host[i], self.n_vocab,
                                   out[r], min(wanted.top[r], wanted.k), &wanted.chosen[r],
                                   &wanted.top_ids[r * wanted.k],
                                   &wanted.top_lps[r * wanted.k])
            first = pieces.call_end[c]
        return 0


# With aligned_prefill (split streams on a CPU), a prompt's whole blocks of this many positions
# are decoded in a llama_decode of their own, and the rest of it with the step's other short
# pieces. ggml's CPU flash attention computes 64 query rows or more of a stream together, in
# tiles (GGML_FA_TILE_Q is 64), and fewer one row at a time; llama.cpp cuts a batch of several
# streams into micro-batches at places that depend on the other streams. So a prompt token goes
# through the same kernels whether its prefix came from the prefix cache (which reuses whole
# blocks, or any part of a last partial block: see PrefixCache) or was computed with it, and
# whatever else is in the step.
PREFILL_BLOCK = 64


cdef struct _RowLogprobs:
    const int * top  # per row: -1, or how many top log-probabilities it wants; NULL: none
    int k
    float * chosen
    int * top_ids
    float * top_lps


cdef class _Pieces:
    """A step's rows as llama_decode calls: `length[p]` tokens of row `row[p]` from its token
    `offset[p]`; call c feeds pieces [call_end[c - 1], call_end[c])."""
    cdef int n_rows, n_pieces, n_calls
    cdef int * row
    cdef int * offset
    cdef int * length
    cdef int * call_end
    cdef int * row_first  # index of each row's first token in the flat token array

    def __cinit__(self, const int[::1] positions, const int[::1] n_tokens, bint split):
        cdef int n = positions.shape[0]
        self.n_rows = n
        self.row = <int *> malloc((2 * n + 1) * sizeof(int))
        self.offset = <int *> malloc((2 * n + 1) * sizeof(int))
        self.length = <int *> malloc((2 * n + 1) * sizeof(int))
        self.call_end = <int *> malloc((2 * n + 1) * sizeof(int))
        self.row_first = <int *> malloc((n + 1) * sizeof(int))
        if (self.row is NULL or self.offset is NULL or self.length is NULL
                or self.call_end is NULL or self.row_first is NULL):
            raise MemoryError()
        cdef int r, total = 0
        for r in range(n):
            self.row_first[r] = total
            total += n_tokens[r]
        if split:
            self._plan_split(positions, n_tokens)
        else:  # one call for every row
            for r in range(n):
                self._add(r, 0, n_tokens[r])
            self._end_call()

    def __dealloc__(self):
        free(self.row)
        free(self.offset)
        free(self.length)
        free(self.call_end)
        free(self.row_first)

    cdef void _plan_split(self, const int[::1] positions, const int[::1] n_tokens):
        """Each row's whole blocks in a call of their own (ggml's tiled attention, whose result
        depends on which rows share a tile), then one call for the rest: decodes and the pieces
        short of a block, whose rows ggml computes one by one, whatever else is in the call."""
        cdef int r
        cdef int * whole = <int *> malloc(self.n_rows * sizeof(int))
        if whole is NULL:
            raise MemoryError()
        for r in range(self.n_rows):
            whole[r] = 0
            if positions[r] % PREFILL_BLOCK == 0:
                whole[r] = ((positions[r] + n_tokens[r]) // PREFILL_BLOCK * PREFILL_BLOCK
                            - positions[r])
            if whole[r] > 0:
                self._add(r, 0, whole[r])
                self._end_call()
        for r in range(self.n_rows):
            if whole[r] < n_tokens[r]:
                self._add(r, whole[r], n_tokens[r] - whole[r])
        self._end_call()
        free(whole)

    cdef void _add(self, int r, int offset, int length):
        self.row[self.n_pieces] = r
        self.offset[self.n_pieces] = offset
        self.length[self.n_pieces] = length
        self.n_pieces += 1

    cdef void _end_call(self):
        if self.n_pieces > (self.call_end[self.n_calls - 1] if self.n_calls else 0):
            self.call_end[self.n_calls] = self.n_pieces
            self.n_calls += 1


cdef carray.array _ones(Py_ssize_t n):
    return array("i", [1]) * n


_POOLING = {"mean": LLAMA_POOLING_TYPE_MEAN, "cls": LLAMA_POOLING_TYPE_CLS,
            "last": LLAMA_POOLING_TYPE_LAST}


cdef bint _flag_is_set(void * flag) noexcept nogil:
    return (<int *> flag)[0] != 0


cdef class Embedder:
    """A llama_context of its own over a Model, with embeddings on: `embed()` turns token
    sequences into one pooled, unit-length vector each, packing several sequences into each
    llama_decode. Kept apart from the generating Context, whose KV cells and logits it would
    otherwise disturb. A sequence must fit one micro-batch (llama.cpp pools per micro-batch),
    so n_batch = n_ubatch = n_ctx: `n_batch` tokens per decode, and per input at most."""
    cdef llama_context * ctx
    cdef llama_batch batch
    cdef readonly Model model
    cdef readonly int n_batch, n_seq_max, n_embd
    cdef readonly str pooling
    cdef int aborting  # read by llama.cpp between graph nodes (_flag_is_set)

    def __cinit__(self, Model model, int n_ctx=2048, int n_seq_max=16, int n_threads=0,
                  str pooling="mean"):
        if n_ctx < 1 or n_seq_max < 1:
            raise ValueError("n_ctx and n_seq_max must be positive")
        if pooling not in _POOLING:
            raise ValueError(f"pooling must be one of {sorted(_POOLING)}")
        cdef llama_context_params params = llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_ctx
        params.n_ubatch = n_ctx
        params.n_seq_max = n_seq_max
        params.embeddings = True
        params.pooling_type = _POOLING[pooling]
        params.kv_unified = True
        self.model = model
        self.ctx = _new_context(model, params, n_threads, f"an embeddings context "
                                f"(n_ctx={n_ctx}, n_seq_max={n_seq_max})")
        llama_set_abort_callback(self.ctx, _flag_is_set, &self.aborting)
        self.n_batch = llama_n_batch(self.ctx)  # n_ctx itself may be rounded up
        self.n_seq_max = llama_n_seq_max(self.ctx)
        self.n_embd = llama_model_n_embd_out(model.model)
        self.pooling = pooling
        self.batch = llama_batch_init(self.n_batch, 0, 1)

    def __dealloc__(self):
        if self.batch.token is not NULL:
            llama_batch_free(self.batch)
        if self.ctx is not NULL:
            llama_free(self.ctx)

    def abort(self):
        """Stop the decode in progress, from any thread: embed() raises DecodeAborted. One that
        comes before the decode has begun (before `before_decode` has returned) stops nothing."""
        self.aborting = 1

    def embed(self, inputs, before_decode=None):
        """One array('f') of n_embd per input (a sequence of 1 to n_batch token ids), in order.
        Not thread-safe: one caller at a time. `before_decode()`, if given, is called before
        each llama_decode: what it raises stops the call there (a request whose client left)."""
        for tokens in inputs:
            if not 0 < len(tokens) <= self.n_batch:
                raise ValueError(f"an input has {len(tokens)} tokens; 1 to {self.n_batch} fit")
            if min(tokens) < 0 or max(tokens) >= self.model.n_vocab:
                raise ValueError(f"token ids must be in [0, {self.model.n_vocab})")
        out = []
        cdef Py_ssize_t start = 0, end, used
        while start < len(inputs):
            end, used = start, 0
            while (end < len(inputs) and end - start < self.n_seq_max
                   and used + len(inputs[end]) <= self.n_batch):
                used += len(inputs[end])
                end += 1
            if before_decode is not None:
                before_decode()
            self.aborting = 0  # an abort() before here was for a decode that has ended
            out += self._embed_group(inputs[start:end])
            start = end
        return out

    cdef list _embed_group(self, group):
        cdef int s, i, n = 0, rc
        for s, tokens in enumerate(group):
            for i, token in enumerate(tokens):
                self.batch.token[n] = token
                self.batch.pos[n] = i
                self.batch.n_seq_id[n] = 1
                self.batch.seq_id[n][0] = s
                self.batch.logits[n] = 1
                n += 1
        self.batch.n_tokens = n
        # Each group starts from an empty cache: earlier inputs must not be attended over.
        llama_memory_clear(llama_get_memory(self.ctx), True)
        with nogil:
            rc = llama_decode(self.ctx, self.batch)
        if rc == 2 and self.aborting:
            raise DecodeAborted(rc, "the embedding batch was aborted")
        if rc != 0:
            raise DecodeError(rc, "embedding batch failed")
        return [self._unit_vector(s) for s in range(len(group))]

    cdef carray.array _unit_vector(self, int seq_id):
        cdef const float * pooled = llama_get_embeddings_seq(self.ctx, seq_id)
        if pooled is NULL:
            raise DecodeError(-1, f"no pooled embedding for sequence {seq_id}")
        cdef carray.array vector = carray.clone(_FLOAT_ARRAY, self.n_embd, False)
        cdef double norm = 0.0
        cdef int i
        for i in range(self.n_embd):
            norm += pooled[i] * pooled[i]
        norm = sqrt(norm) if norm > 0.0 else 1.0
        for i in range(self.n_embd):
            vector.data.as_floats[i] = <float> (pooled[i] / norm)
        return vector


cdef cllm_row_sampler * _new_row_sampler(
        float temperature, int top_k, float top_p, float min_p, float repeat_penalty,
        float presence_penalty, float frequency_penalty, int penalty_last_n, seed, history,
        bint keep_distribution) except NULL:
    """A row sampler (row_sampler.c) that has seen the last `penalty_last_n` tokens of
    `history`; seed None draws one."""
    cdef cllm_sampling params
    params.temperature, params.top_k, params.top_p, params.min_p = (
        temperature, top_k, top_p, min_p)
    params.repeat_penalty, params.presence_penalty, params.frequency_penalty = (
        repeat_penalty, presence_penalty, frequency_penalty)
    params.penalty_last_n = max(0, penalty_last_n)
    params.seed = (secrets.randbits(64) if seed is None else seed) & 0xFFFFFFFFFFFFFFFF
    params.keep_distribution = keep_distribution
    cdef cllm_row_sampler * sampler = cllm_row_sampler_new(&params)
    if sampler is NULL:
        raise MemoryError()
    for token in history[-penalty_last_n:] if penalty_last_n > 0 else ():
        cllm_row_sampler_accept(sampler, token)
    return sampler


cdef class RowSampler:
    """One sequence's sampler on the host, as a step samples a row with it: the parameters of
    Context.set_sampler, drawing from logits given here (changed in place: bans, penalties and,
    with `keep_distribution`, the distribution drawn from, whose log-softmax the row then is)."""
    cdef cllm_row_sampler * sampler
    cdef cllm_sampler_scratch * scratch
    cdef int n_vocab

    def __cinit__(self, int n_vocab, float temperature=1.0, int top_k=0, float top_p=1.0,
                  float min_p=0.0, float repeat_penalty=1.0, float presence_penalty=0.0,
                  float frequency_penalty=0.0, int penalty_last_n=64, seed=None, history=(),
                  bint keep_distribution=False):
        if n_vocab < 1:
            raise ValueError("n_vocab must be positive")
        self.n_vocab = n_vocab
        self.sampler = _new_row_sampler(temperature, top_k, top_p, min_p, repeat_penalty,
                                        presence_penalty, frequency_penalty, penalty_last_n,
                                        seed, history, keep_distribution)
        self.scratch = cllm_sampler_scratch_new(n_vocab)
        if self.scratch is NULL:
            raise MemoryError()

    def __dealloc__(self):
        cllm_row_sampler_free(self.sampler)
        cllm_sampler_scratch_free(self.scratch)

    def sample(self, float[::1] logits, banned=()):
        """The token drawn from `logits` (n_vocab of them) with `banned` tokens never drawn, and
        accepted as the sequence's latest; -1 where no token is allowed."""
        if logits.shape[0] != self.n_vocab:
            raise ValueError(f"{logits.shape[0]} logits for a vocabulary of {self.n_vocab}")
        cdef carray.array ids = array("i", banned)
        for token in ids:
            if not 0 <= token < self.n_vocab:
                raise ValueError(f"banned token {token} outside the vocabulary")
        return cllm_row_sampler_sample(self.sampler, &logits[0], self.n_vocab,
                                       <const int32_t *> ids.data.as_ints, len(ids),
                                       self.scratch)


cdef class ParkedSampler:
    """A sequence's sampler while it is preempted (Context.park_sampler); freed if unused."""
    cdef cllm_row_sampler * sampler
    cdef unsigned char ban_eog, in_graph

    def __dealloc__(self):
        cllm_row_sampler_free(self.sampler)


cdef class Logprobs:
    """Log-probabilities from one step: per row, the chosen token's and the top `k` tokens'
    (ids -1 where a row asked for fewer)."""
    cdef readonly int k
    cdef readonly carray.array chosen, top_ids, top_logprobs

    def __cinit__(self, Py_ssize_t n_rows, int k):
        self.k = k
        self.chosen = carray.clone(_FLOAT_ARRAY, n_rows, True)
        self.top_ids = array("i", [-1]) * (n_rows * k)
        self.top_logprobs = carray.clone(_FLOAT_ARRAY, n_rows * k, True)

    def row(self, Py_ssize_t r):
        """(chosen token's log-probability, [(token id, log-probability), ...] best first)."""
        top = [(self.top_ids[r * self.k + i], self.top_logprobs[r * self.k + i])
               for i in range(self.k) if self.top_ids[r * self.k + i] >= 0]
        return self.chosen[r], top


cdef int _greedy(float * logits, int n, const int * banned, int n_banned) noexcept nogil:
    """The most likely token once the banned ones are set to -inf (in the logits themselves, so
    log-probabilities read afterwards see the same distribution); -1 where none is left (a
    bitmask that allows no token), as ggml's CUDA argmax answers on the device."""
    cdef int i
    for i in range(n_banned):
        logits[banned[i]] = -INFINITY
    i = _argmax(logits, n)
    return i if logits[i] > -INFINITY else -1


cdef void _apply_mask(float * logits, int n, const uint32_t * mask) noexcept nogil:
    """Set the logit of every token whose bit in `mask` is clear to -inf; a word whose 32
    tokens are all allowed is skipped whole."""
    cdef int w, b, first
    cdef uint32_t bits
    for w in range((n + 31) // 32):
        bits = mask[w]
        if ~bits == 0:
            continue
        first = w * 32
        for b in range(min(32, n - first)):
            if not (bits >> b) & 1:
                logits[first + b] = -INFINITY


cdef int _argmax(const float * logits, int n) noexcept nogil:
    """Index of the first largest value. The maximum is taken over 16 interleaved lanes first,
    which compilers turn into vector instructions; a second pass finds where it sits."""
    cdef float lanes[16]
    cdef float best
    cdef int i, j, whole = n - n % 16
    if whole == 0:
        best = logits[0]
    else:
        for j in range(16):
            lanes[j] = logits[j]
        for i in range(16, whole, 16):
            for j in range(16):
                lanes[j] = lanes[j] if lanes[j] >= logits[i + j] else logits[i + j]
        best = lanes[0]
        for j in range(1, 16):
            best = lanes[j] if lanes[j] > best else best
    for i in range(whole, n):
        best = logits[i] if logits[i] > best else best
    for i in range(n):
        if logits[i] == best:
            return i
    return 0  # only NaN logits get here


cdef void _fill_logprobs(const float * logits, int n, int chosen, int k, float * chosen_out,
                         int * top_ids, float * top_lps) noexcept nogil:
    """Log-softmax of the raw logits: the chosen token's value and the k largest, best first."""
    cdef int i, j
    cdef float max_logit = logits[_argmax(logits, n)]
    cdef double total = 0.0
    for i in range(n):
        total += expf(logits[i] - max_logit)
    cdef float log_norm = max_logit + logf(<float> total)
    chosen_out[0] = logits[chosen] - log_norm
    for j in range(k):
        top_ids[j] = -1
        top_lps[j] = -INFINITY
    for i in range(n):  # insertion into the k best seen so far; k is small (<= 20)
        if k == 0 or logits[i] - log_norm <= top_lps[k - 1]:
            continue
        j = k - 1
        while j > 0 and top_lps[j - 1] < logits[i] - log_norm:
            top_ids[j] = top_ids[j - 1]
            top_lps[j] = top_lps[j - 1]
            j -= 1
        top_ids[j] = i
        top_lps[j] = logits[i] - log_norm
