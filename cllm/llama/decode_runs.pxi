# Context.decode_run's steps, in C with the GIL released: each step's batch, its outputs, and
# the constrained rows handed to after_step between steps.
# Included by _core.pyx, whose imports it uses.

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


cdef int32_t _run(Context self, const int[::1] seq_ids, const int[::1] positions,
                  const int[::1] last_tokens, const int[::1] budgets, int n_steps,
                  const uint32_t * masks, const int * row_masks,
                  int * tokens, int * counts, bint end_at_stop) noexcept nogil:
    """decode_run's steps. With bitmasks, each step's tokens go to after_step while the next
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
            live[r] = not ended[r] and _continues(self, tokens + r * n_steps, counts[r],
                                                  budgets[r])
            n_live += live[r]
        if step == 0:
            first_live = n_live
        elif self._interrupted or (end_at_stop and n_live < first_live):
            break
        if n_live == 0:
            break
        if not (hold and step > 0
                and _can_hold(self, n, rows, live, positions, tokens, counts, n_steps)):
            n = 0
            for r in range(n_rows):
                if live[r]:
                    rows[n] = <int> r
                    n += 1
        _batch_run_step(self, n, rows, seq_ids, positions, last_tokens, tokens, counts, n_steps)
        if hold:
            for i in range(n):  # a held row's generator stays where its sequence left it
                cllm_slot_sampler_hold(self.graph_chains[seq_ids[rows[i]]],
                                       not live[rows[i]])
        t0 = _now()
        rc = llama_decode(self.ctx, self.batch)
        self._t_decode += _now() - t0
        if rc != 0:
            _forget_step(self, n, rows, seq_ids, positions, counts)
            break
        if unheard:
            t0 = _now()
            if not _end_constrained_rows(self, unheard, sampled, tokens, counts, budgets,
                                         n_steps, ended, True):
                unheard = 0
                _forget_step(self, n, rows, seq_ids, positions, counts)
                break
            self._t_after_step += _now() - t0
            unheard = 0
        _name_outputs(self, n, rows, live, seq_ids, masks, row_masks)
        t0 = _now()
        llama_synchronize(self.ctx)  # the step's end, timed apart from its sampling
        t1 = _now()
        self._t_wait += t1 - t0
        _sample_outputs(self, n_live, self.out_tokens)
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
        _end_constrained_rows(self, unheard, sampled, tokens, counts, budgets, n_steps, ended,
                              False)
    if hold:
        for r in range(n_rows):
            cllm_slot_sampler_hold(self.graph_chains[seq_ids[r]], False)
    free(rows)
    free(sampled)
    free(ended)
    free(live)
    return rc


cdef bint _can_hold(Context self, Py_ssize_t n, const int * rows, const unsigned char * live,
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


cdef void _batch_run_step(Context self, int n, const int * rows, const int[::1] seq_ids,
                          const int[::1] positions, const int[::1] last_tokens,
                          const int * tokens, const int * counts,
                          int n_steps) noexcept nogil:
    """The batch of a run's step: row rows[i]'s next token at batch index i."""
    cdef int i, r
    for i in range(n):
        r = rows[i]
        _put(self, i,
             last_tokens[r] if counts[r] == 0 else tokens[r * n_steps + counts[r] - 1],
             positions[r] + counts[r], seq_ids[r], True)
        self.out_idx[i] = i
    self.batch.n_tokens = n


cdef void _name_outputs(Context self, Py_ssize_t n, const int * rows, const unsigned char * live,
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


cdef bint _end_constrained_rows(Context self, int step, const int * sampled, const int * tokens,
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
                and _continues(self, tokens + r * n_steps, counts[r], budgets[r])):
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


cdef void _forget_step(Context self, Py_ssize_t n, const int * rows, const int[::1] seq_ids,
                       const int[::1] positions, const int * counts) noexcept nogil:
    """Remove what a failed step wrote: llama.cpp rolls back only its last micro-batch."""
    cdef llama_memory_t mem = llama_get_memory(self.ctx)
    cdef Py_ssize_t i
    cdef int r
    for i in range(n):
        r = rows[i]
        llama_memory_seq_rm(mem, seq_ids[r], positions[r] + counts[r], -1)


cdef bint _continues(Context self, const int * row_tokens, int count, int budget) noexcept nogil:
    """Whether a run's row goes on: not at its budget, and its last token neither an end of
    generation nor the -1 of a step that sampled none (fed on, llama.cpp would refuse the
    next step for every row)."""
    if count >= budget:
        return False
    return count == 0 or (row_tokens[count - 1] >= 0
                           and not llama_vocab_is_eog(self.model.vocab, row_tokens[count - 1]))


cdef carray.array _ones(Py_ssize_t n):
    return array("i", [1]) * n
