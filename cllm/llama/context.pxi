# Context: one llama_context, its sequences and their KV cells, and the entry points of a
# step (step.pxi) and of a decode run (decode_runs.pxi).
# Included by _core.pyx, whose imports it uses.

_FLASH_ATTN = {"auto": LLAMA_FLASH_ATTN_TYPE_AUTO, "on": LLAMA_FLASH_ATTN_TYPE_ENABLED,
               "off": LLAMA_FLASH_ATTN_TYPE_DISABLED}


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
            configs = _slot_samplers(self, n_seq_max)
            params.samplers, params.n_samplers = configs, n_seq_max
        try:
            self.ctx = _new_context(model, params, n_threads, f"a context (n_ctx={n_ctx}, "
                                    f"n_seq_max={n_seq_max}, n_batch={n_batch})")
        finally:
            free(configs)
        if backend_sampling and not cllm_slot_table_ready(self.slot_table):
            _detach_slot_samplers(self)  # then the host samples every row
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
        _free_sampler(self, seq_id)
        _ban_eog(self, seq_id, ban_eog)
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
        _draw_in_graph(self, seq_id)

    def park_sampler(self, int seq_id):
        """Take `seq_id`'s sampler out with its state (a seeded generator's position, the
        penalties' history), for a preempted sequence to resume with: `restore_sampler` puts it
        back, in whichever slot the sequence gets next."""
        self._check_seq(seq_id)
        cdef ParkedSampler parked = ParkedSampler.__new__(ParkedSampler)
        parked.sampler, parked.ban_eog = self.samplers[seq_id], self.ban_eog[seq_id]
        parked.in_graph = self.in_graph[seq_id]
        self.samplers[seq_id], self.ban_eog[seq_id] = NULL, 0
        _draw_in_graph(self, seq_id)
        return parked

    def restore_sampler(self, int seq_id, ParkedSampler parked):
        self._check_seq(seq_id)
        _free_sampler(self, seq_id)
        self.samplers[seq_id] = parked.sampler
        _ban_eog(self, seq_id, parked.ban_eog)
        self.in_graph[seq_id] = parked.in_graph
        parked.sampler = NULL
        _draw_in_graph(self, seq_id)

    def remove_sequence(self, int seq_id):
        """Free every KV cell of `seq_id` and its sampler, so the id can start a new sequence."""
        self._check_seq(seq_id)
        llama_memory_seq_rm(llama_get_memory(self.ctx), seq_id, -1, -1)
        _free_sampler(self, seq_id)
        self.ban_eog[seq_id] = 0

    def end_sequence(self, int seq_id):
        """Free `seq_id`'s sampler; its KV cells stay, as a prefix a later sequence may reuse."""
        self._check_seq(seq_id)
        _free_sampler(self, seq_id)
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

    def save_sequence(self, int seq_id):
        """A copy of `seq_id`'s KV cells in host memory (llama.cpp's sequence state: its
        positions and each layer's K and V rows), for load_sequence to put back. The copy is an
        anonymous memory map of its own, so that dropping it gives the memory back to the
        system at once: as heap blocks, copies of a few MiB left freed holes behind, and under
        churn the process outgrew a 16 MiB budget by 10 MiB."""
        self._check_seq(seq_id)
        cdef size_t size = llama_state_seq_get_size(self.ctx, seq_id)
        data = mmap.mmap(-1, size)
        cdef unsigned char[::1] view = data
        with nogil:
            size = llama_state_seq_get_data(self.ctx, <uint8_t *> &view[0], size, seq_id)
        if size != len(data):
            raise RuntimeError(f"llama.cpp copied {size} of {len(data)} bytes of sequence {seq_id}")
        return data

    def load_sequence(self, int seq_id, const unsigned char[::1] data):
        """Make `seq_id` hold exactly the cells save_sequence copied (any sequence's, from this
        model and layout). Raises ValueError when llama.cpp refuses them (no room, or state of
        another shape); `seq_id` then holds nothing."""
        self._check_seq(seq_id)
        cdef size_t read
        if data.shape[0] == 0:
            raise ValueError("no sequence state to load")
        with nogil:
            read = llama_state_seq_set_data(self.ctx, <const uint8_t *> &data[0], data.shape[0],
                                            seq_id)
        if read == 0:
            llama_memory_seq_rm(llama_get_memory(self.ctx), seq_id, -1, -1)
            raise ValueError(f"llama.cpp could not load the state into sequence {seq_id}")

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
        _check_rows(self, seq_ids, n_tokens, tokens)
        cdef const uint32_t * mask_data = _check_masks(self, n_rows, mask_rows, masks)
        _check_logprob_rows(self, seq_ids, sample, top_logprobs)
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
            rc = _decode_pieces(self, pieces, seq_ids, positions, n_tokens, sample, tokens,
                                mask_data, row_masks, out.data.as_ints, &wanted, &failed_call)
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
        _check_rows(self, seq_ids, _ones(n_rows), last_tokens)
        cdef const uint32_t * mask_data = _check_masks(self, n_rows, mask_rows, masks)
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
                rc = _run(self, seq_ids, positions, last_tokens, budgets, n_steps, mask_data,
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
