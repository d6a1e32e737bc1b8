"""Constrained decoding with llguidance: grammars (JSON Schema, GBNF, Lark) compiled against the
GGUF's own vocabulary, one matcher per sequence, and each step's token bitmasks filled with the
GIL released. The core applies the bitmasks (Context.step's `masks`).

ARCHITECTURE.md has the measurements that chose llguidance over xgrammar."""
from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict

import llguidance

# Compact JSON with one space after ',' and ':': no free whitespace, which a small model can
# otherwise fill with newlines until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128  # compiled grammars kept, least recently used out first


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message says why."""


class Grammar:
    """A compiled, validated grammar. Each sequence it constrains gets its own matcher: a copy
    of one built at compile time (copying is cheap; building parses the grammar)."""
    __slots__ = ("source", "_prototype")

    def __init__(self, source: str, prototype: llguidance.LLMatcher) -> None:
        self.source = source
        self._prototype = prototype

    def matcher(self) -> llguidance.LLMatcher:
        return self._prototype.deep_copy()


class _Vocabulary:
    """The model's vocabulary as llguidance's TokenizerWrapper reads it: each token's bytes,
    control tokens marked with a leading 0xff byte (text never spells them)."""

    def __init__(self, model) -> None:
        self._model = model
        self.eos_token_id = model.eos_token
        self.bos_token_id = model.bos_token if model.bos_token >= 0 else None
        self.tokens = [b"\xff" + model.token_to_piece(t, True) if model.is_control(t)
                       else model.token_to_piece(t, True) for t in range(model.n_vocab)]

    def __call__(self, text):
        if isinstance(text, bytes):
            raise TypeError("text only")  # TokenizerWrapper then passes str
        return self._model.tokenize(text, add_special=False, parse_special=False)


def tokenizer_of(model) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a cllm Model (about a second for a 50k vocabulary)."""
    eog = list(model.eog_tokens) or [model.eos_token]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(model)),
                                  n_vocab=model.n_vocab, eos_token=eog)


class Grammars:
    """Compiles grammars for one model and keeps the last CACHE_SIZE by their text. Safe to call
    from any thread; compiling takes milliseconds to a second, so callers on an event loop run it
    in a worker thread."""

    def __init__(self, model, cache_size: int = CACHE_SIZE) -> None:
        self._model = model
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def json_schema(self, schema: dict | bool) -> Grammar:
        text = json.dumps(schema, separators=(",", ":"))  # property order matters
        return self._get("json_schema", text, lambda: llguidance.LLMatcher.grammar_from_json_schema(
            text, overrides=_JSON_OPTIONS))

    def gbnf(self, text: str) -> Grammar:
        return self._get("gbnf", text, lambda: llguidance.grammar_from("gbnf", text))

    def lark(self, text: str) -> Grammar:
        return self._get("lark", text, lambda: llguidance.LLMatcher.grammar_from_lark(text))

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = tokenizer_of(self._model)
            return self._tokenizer

    def _get(self, kind: str, text: str, translate) -> Grammar:
        key = (kind, text)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(translate)
        with self._lock:
            self._cache[key] = grammar
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, translate) -> Grammar:
        try:
            source = translate()
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(str(exc)) from None
        tokenizer = self.tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
        if is_error:
            raise GrammarError(messages[0])
        prototype = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if prototype.is_error():
            raise GrammarError(prototype.get_error())
        return Grammar(source, prototype)


class MaskFiller:
    """Fills one step's bitmasks, one per constrained row, `words` uint32 words each. Each
    matcher computes its mask on the engine thread with the GIL released. llguidance's
    LLExecutor spreads rows over a thread pool, but waking it cost 150-800 us a row on the
    2-core CPU against ~15 us done in turn (bench/structured_libs.py; ARCHITECTURE.md)."""

    def __init__(self, words: int) -> None:
        self.words = words
        self._buffer = array("i")

    def fill(self, matchers: list[llguidance.LLMatcher]) -> memoryview:
        """The bitmasks of `matchers`, in order, as one flat int32 array (reused by the next
        call: pass it to the core before filling again)."""
        size = len(matchers) * self.words
        if len(self._buffer) < size:
            self._buffer = array("i", bytes(4 * size))
        address, nbytes = self._buffer.buffer_info()[0], 4 * self.words
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(address + i * nbytes, nbytes)
        return memoryview(self._buffer)[:size]
