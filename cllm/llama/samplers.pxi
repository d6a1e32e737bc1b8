# Each sequence's samplers: the slot sampler llama.cpp runs in the decode graph
# (slot_sampler.c) and the row sampler the host draws with (row_sampler.c); RowSampler and
# ParkedSampler hand the latter to Python.
# Included by _core.pyx, whose imports it uses.

cdef llama_sampler_seq_config * _slot_samplers(Context self, int n_seq_max) except NULL:
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


cdef void _detach_slot_samplers(Context self):
    """Where their table could not be made on the device (or llama.cpp attached none),
    llama.cpp still holds the samplers it attached, and with them it would copy no logits
    for the host: take them back (one more reserve, on this failure path only)."""
    cdef int seq_id
    for seq_id in range(self.n_seq_max):
        llama_set_sampler(self.ctx, seq_id, NULL)


cdef void _ban_eog(Context self, int seq_id, bint ban):
    """Whether `seq_id` may sample end-of-generation tokens, on the host and in the graph
    (whose bias row for the slot is written now, between decodes, if it changes)."""
    self.ban_eog[seq_id] = ban
    if self.backend_sampling and cllm_slot_sampler_bans_eog(self.graph_chains[seq_id]) != ban:
        llama_synchronize(self.ctx)  # no decode may still read the row
        cllm_slot_sampler_ban_eog(self.graph_chains[seq_id], ban)


cdef void _draw_in_graph(Context self, int seq_id):
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


cdef void _free_sampler(Context self, int seq_id):
    cdef cllm_row_sampler * sampler = self.samplers[seq_id]
    self.samplers[seq_id] = NULL
    _draw_in_graph(self, seq_id)  # the graph lets go of it first
    cllm_row_sampler_free(sampler)


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
