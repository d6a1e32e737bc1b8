# A loaded GGUF model and its vocabulary, the errors the core raises, and llama.cpp's log.
# Included by _core.pyx, whose imports it uses.

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


# A vocabulary's fill-in-the-middle tokens (Model.fim_tokens), -1 where it has none.
FimTokens = namedtuple("FimTokens", "prefix suffix middle pad repo file_sep")


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
    def fim_tokens(self):
        """The fill-in-the-middle tokens llama.cpp found in the vocabulary (declared in the GGUF
        or known by their text): prefix, suffix, middle, pad, repository, file separator; -1
        for each it has not."""
        v = self.vocab
        return FimTokens(llama_vocab_fim_pre(v), llama_vocab_fim_suf(v), llama_vocab_fim_mid(v),
                         llama_vocab_fim_pad(v), llama_vocab_fim_rep(v), llama_vocab_fim_sep(v))

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
