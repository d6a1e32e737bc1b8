# Embedder: pooled embeddings, in a llama_context of their own.
# Included by _core.pyx, whose imports it uses.

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
