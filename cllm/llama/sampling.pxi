# A step's outputs sampled, after the step: on the device where it can, else spread over the
# host's threads (argmax, bitmasks, row samplers); the log-probabilities of a row.
# Included by _core.pyx, whose imports it uses.

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


# Greedy rows per thread of the argmax: fewer do not repay waking a thread.
cdef int _ROWS_PER_THREAD = 4


cdef void _sample_outputs(Context self, int n, int * out) noexcept nogil:
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
    _await_masks(self, n)
    _masked_on_device(self, n, out)
    _filtered_on_device(self, n, out)
    _host_logits(self, n)
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


cdef void _masked_on_device(Context self, int n, int * out) noexcept nogil:
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


cdef void _filtered_on_device(Context self, int n, int * out) noexcept nogil:
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


cdef bint _host_samples(Context self, int i) noexcept nogil:
    """Whether the host samples output i: one the device did not choose, outside the graph
    or with a bitmask."""
    return not self.out_on_device[i] and (not self.in_graph[self.out_seq[i]]
                                          or self.out_mask[i] != NULL)


cdef void _host_logits(Context self, int n) noexcept nogil:
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
        if not _host_samples(self, i):
            i += 1
            continue
        j = i + 1
        while j < n and self.out_seq[j] == seq_id + j - i and _host_samples(self, j):
            j += 1
        read = cllm_slot_table_read_logits(self.slot_table, seq_id, j - i) == 0
        while i < j:
            self.out_host[i] = rows + <size_t> self.out_seq[i] * self.n_vocab if read else NULL
            i += 1


cdef void _await_masks(Context self, int n) noexcept nogil:
    """Wait until the step's bitmasks are filled, if a row of these n outputs has one."""
    cdef int i
    if self.masks_ready == NULL:
        return
    for i in range(n):
        if self.out_mask[i] != NULL:
            while cllm_load_acquire(self.masks_ready) == 0:
                sched_yield()  # the filling takes well under a millisecond
            return


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
