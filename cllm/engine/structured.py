"""Constrained decoding with llguidance: grammars (JSON Schema, GBNF, Lark) compiled against the
GGUF's own vocabulary, one matcher per sequence, and each step's token bitmasks filled with the
GIL released. The core applies the bitmasks (Context.step's and Context.decode_run's `masks`).

docs/design/grammar.md has the measurements that chose llguidance over xgrammar."""
from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from cllm.engine.grammar_depth import TooDeep, check_source, schema_height
from cllm.engine.json_schema import as_compiled
from cllm.engine.sequence import FINISH_GRAMMAR, FINISH_STOP

# Compact JSON with one space after ',' and ':': no free whitespace, which a small model can
# otherwise fill with newlines until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128  # compiled grammars kept, least recently used out first


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message says why."""


class Grammar:
    """A compiled, validated grammar. Each sequence it constrains gets its own matcher: a copy
    of one built at compile time (copying is cheap; building parses the grammar). It keeps its
    model alive: its matchers tokenize with the model's vocabulary, in C (tokenizer_of)."""
    __slots__ = ("source", "_prototype", "_model")

    def __init__(self, source: str, prototype: llguidance.LLMatcher, model) -> None:
        self.source = source
        self._prototype = prototype
        self._model = model

    def matcher(self) -> llguidance.LLMatcher:
        return self._prototype.deep_copy()


def _token_bytes(model) -> list[bytes]:
    """Each token's bytes as llguidance reads them, control tokens marked with a leading 0xff
    byte (text never spells them)."""
    return [b"\xff" + model.token_to_piece(t, True) if model.is_control(t)
            else model.token_to_piece(t, True) for t in range(model.n_vocab)]


def tokenizer_of(model) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a cllm Model (about a second for a 50k vocabulary), which
    tokenizes through llama.cpp directly: a Python tokenizer would take the GIL each time a
    matcher tokenizes (forced text, hundreds of times in a thousand tokens of a JSON schema),
    and on a busy server each wait for the GIL costs up to Python's 5 ms switch interval
    (docs/design/grammar.md). The model must outlive it: Grammars and each
    Grammar keep it."""
    eog = list(model.eog_tokens) or [model.eos_token]
    vocab, tokenize = model.native_tokenizer
    return llguidance.LLTokenizer.from_llamacpp(tokens=_token_bytes(model), vocab_ptr=vocab,
                                                tokenize_fptr=tokenize, eos_token=eog)


class Grammars:
    """Compiles grammars for one model and keeps the last CACHE_SIZE by their text. Safe to call
    from any thread; compiling takes milliseconds to a second, so callers on an event loop run it
    in a worker thread."""

    def __init__(self, model, cache_size: int = CACHE_SIZE) -> None:
        self._model = model
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._compiling: dict[tuple[str, str], Future] = {}  # by the thread compiling it
        self._lock = threading.Lock()

    def json_schema(self, schema: dict | bool) -> Grammar:
        try:
            schema_height(schema)  # before as_compiled, which recurses
        except TooDeep as exc:
            raise GrammarError(f"the schema is {exc}") from None
        text = json.dumps(as_compiled(schema), separators=(",", ":"))  # order matters
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
        """The cached grammar, else compiled once: requests that bring the same new grammar
        together (64 clients with one schema) wait for one compilation instead of each doing it."""
        key = (kind, text)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
            pending = self._compiling.get(key)
            compiling_here = pending is None
            if compiling_here:
                pending = self._compiling[key] = Future()
        if not compiling_here:
            return pending.result()  # or raises its GrammarError
        try:
            grammar = self._compile(translate)
        except BaseException as exc:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[key]
            self._cache[key] = grammar
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        pending.set_result(grammar)
        return grammar

    def _compile(self, translate) -> Grammar:
        try:
            source = translate()
            check_source(source)
        except TooDeep as exc:
            raise GrammarError(f"the grammar is {exc}") from None
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(str(exc)) from None
        tokenizer = self.tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
        if is_error:
            raise GrammarError(messages[0])
        prototype = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if prototype.is_error():
            raise GrammarError(prototype.get_error())
        # A grammar no text can satisfy (a schema that is only a reference to itself) compiles,
        # then fails at its first bitmask: found here, it is the request's 400, not a 500 after
        # the prompt was computed. Once a grammar, as it is cached.
        first = prototype.deep_copy()
        first.compute_bitmask()
        if first.is_error():
            raise GrammarError(f"the grammar admits no text ({_first_line(first.get_error())})")
        return Grammar(source, prototype, self._model)


class Masks:
    """One step's bitmasks, as Context.step takes them: `data`, and `ready` (a flag another
    thread sets once `data` is filled; None when it was filled before the step)."""
    __slots__ = ("data", "ready", "_pending")

    def __init__(self, data: memoryview, ready: array | None = None, pending: Future | None = None):
        self.data, self.ready, self._pending = data, ready, pending

    def wait(self) -> None:
        """Return once the filling is over; raise what it raised."""
        if self._pending is not None:
            self._pending.result()


class MaskFiller:
    """Fills one step's bitmasks, one per constrained row, `words` uint32 words each, in one
    call into llguidance (LLExecutor, on `threads` threads of its own) that lets go of the GIL
    once for all of them: a call a row let go of it a row at a time, and on a busy server each
    row then waited for the event loop to hand the GIL back (on the 2-core Xeon, beside a
    thread running Python, 64 rows took 231 ms that way against 7 in one call;
    docs/design/grammar.md).
    `overlap`: the bitmasks are filled on a thread of their own while the step decodes, and the
    core waits for them before it samples: on a GPU the decode leaves the CPU idle."""

    def __init__(self, words: int, overlap: bool = False, threads: int = 1) -> None:
        self.words = words
        self._buffer = array("i")
        self._ready = array("i", [1])  # one flag, so that a decode run's pointer to it holds
        self._executor = llguidance.LLExecutor(threads)
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="cllm-masks") if overlap
                        else None)

    def fill(self, matchers: list[llguidance.LLMatcher | None], now: bool = False) -> Masks:
        """The bitmasks of `matchers`, in order (None: leave that one as it is), in one flat
        int32 buffer: reused, so wait for them and pass them to the core before filling again.
        Filling as many as last time keeps the buffer where it was. `now`: filled before this
        returns, also where they would overlap (the caller's step is decoding already)."""
        size = len(matchers) * self.words
        if len(self._buffer) < size:
            self._buffer = array("i", bytes(4 * size))
        data = memoryview(self._buffer)[:size]
        if self._worker is None or now:
            self._fill(matchers)
            return Masks(data)
        self._ready[0] = 0
        return Masks(data, self._ready, self._worker.submit(self._fill, matchers, self._ready))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False)

    def _fill(self, matchers: list[llguidance.LLMatcher | None],
              ready: array | None = None) -> None:
        try:
            rows = [(matcher, i) for i, matcher in enumerate(matchers) if matcher is not None]
            if rows:
                self._executor.unsafe_compute_mask_ptr(rows, self._buffer.buffer_info()[0],
                                                       4 * self.words, len(matchers))
        finally:
            if ready is not None:
                ready[0] = 1  # also after a failure: the core must never wait forever


def _first_line(error: str) -> str:
    """A matcher's error without the parser state and grammar llguidance appends on the lines
    after it: internals, and kilobytes of them, that a client's error has no use for."""
    return error.split("\n", 1)[0]


def matcher_failure(matcher: llguidance.LLMatcher) -> str | None:
    """What went wrong in a matcher that failed after it was built (computing a bitmask past a
    parser limit, say: it then lets only an end token through), else None."""
    if not matcher.is_error():
        return None
    return _failed(matcher)


def grammar_end(matcher: llguidance.LLMatcher, token: int) -> tuple[str, str | None] | None:
    """Feed a sequence's new token to its matcher: (finish reason, error) when the sequence
    ends there (its grammar is complete, or refused the token: a matcher that had failed
    lets only an end token through, which it then refuses), else None."""
    if not matcher.consume_token(token):
        return FINISH_GRAMMAR, _failed(matcher)
    if matcher.is_stopped():
        return FINISH_STOP, None
    return None


def _failed(matcher: llguidance.LLMatcher) -> str:
    """A failed matcher's error as its request's: the request brought the grammar, and a
    grammar fails mid-reply where its parse goes past the matcher's limits."""
    return f"the request's grammar failed mid-reply: {_first_line(matcher.get_error())}"


class RunMatchers:
    """The constrained rows of a decode run, as Context.decode_run's `after_step`, which the
    core calls while the next step decodes: each row that goes on feeds its token to its
    matcher; the rows whose grammar that ends stop, and the others' bitmasks are refilled for
    the next step, in the same places of the buffer (`mask_rows` keeps naming them), at once:
    handing them to the filler's thread would cost two more handovers of the GIL a step."""

    def __init__(self, filler: MaskFiller, mask_rows: array, matchers: list) -> None:
        self.masks = filler.fill(matchers)  # the first step's
        self.ends: dict[int, tuple[str, str | None]] = {}  # run row → (finish reason, error)
        self._filler = filler
        self._matchers = list(matchers)  # per bitmask; None once its row has stopped
        # mask_rows[r]: run row r's bitmask, or -1; so the rows of the bitmasks, in order
        self._rows = [r for r, m in enumerate(mask_rows) if m >= 0]

    def after_step(self, going_on: array, more: bool) -> list[int]:
        self.masks.wait()  # the core waited for them, unless none of their rows ran
        ended = []
        for m, r in enumerate(self._rows):
            matcher = self._matchers[m]
            if matcher is None:
                continue
            if going_on[r] < 0:  # an end token or its budget stopped it in the core
                self._matchers[m] = None
                continue
            end = grammar_end(matcher, going_on[r])
            if end is not None:
                self.ends[r] = end
                self._matchers[m] = None
                ended.append(r)
        if more and any(m is not None for m in self._matchers):
            self.masks = self._filler.fill(self._matchers, now=True)
        return ended
