# One step (Context.step): its rows checked, planned into llama_decode calls, decoded and
# sampled.
# Included by _core.pyx, whose imports it uses.

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


cdef void _check_rows(Context self, const int[::1] seq_ids, const int[::1] n_tokens,
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


cdef const uint32_t * _check_masks(Context self, Py_ssize_t n_rows, const int[::1] mask_rows,
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


cdef void _check_logprob_rows(Context self, const int[::1] seq_ids, const int[::1] sample,
                              const int[::1] top_logprobs) except *:
    """Log-probabilities need a row's logits on the host (a bitmask is applied where
    the row is sampled)."""
    cdef Py_ssize_t r
    for r in range(seq_ids.shape[0]):
        if (sample[r] and self.in_graph[seq_ids[r]] and top_logprobs is not None
                and top_logprobs[r] >= 0):
            raise ValueError(f"sequence {seq_ids[r]} is sampled in the graph: "
                             "log-probabilities need set_sampler(host_logits=True)")


cdef int32_t _decode_pieces(Context self, _Pieces pieces, const int[::1] seq_ids,
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
                _put(self, i, tokens[pieces.row_first[r] + pieces.offset[p] + j],
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
        _sample_outputs(self, n_out, self.out_tokens)
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


cdef inline void _put(Context self, int b, int token, llama_pos pos, int seq_id,
                      bint output) noexcept nogil:
    self.batch.token[b] = token
    self.batch.pos[b] = pos
    self.batch.n_seq_id[b] = 1
    self.batch.seq_id[b][0] = seq_id
    self.batch.logits[b] = output
