"""Turns one sequence's token pieces into the text a client sees: whole UTF-8 characters only,
and nothing from a stop string on, even when the stop string spans several tokens; and, for
requests that asked for logprobs, which tokens that text has reached (their logprobs go out with
it, and those of a stop string's tokens never)."""
from __future__ import annotations

import codecs


class TextStream:
    """Feed the bytes of each generated token; get back the text that is safe to emit now.

    Text that could still be the start of a stop string is held back until the next piece says
    whether it is; when a stop string completes, the text before it is emitted and `stopped`.

    count_tokens: also count the pieces the emitted text has reached (take_reached). A piece is
    reached once one of its characters is emitted, so a token partly before a stop string and
    partly in it counts and one wholly in it never does: llama-server's rule, which drops from
    the logprobs as many tokens as the stop string's own tokenization has, the tokens that lie
    in it when the reply's tokens split the text as that tokenization does."""

    __slots__ = ("_decoder", "_stops", "_held", "stopped", "_starts", "_decoded", "_emitted",
                 "_flushed")

    def __init__(self, stop: tuple[str, ...] = (), count_tokens: bool = False) -> None:
        # 'replace': bytes that never form a valid character become U+FFFD instead of an error.
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = stop
        self._held = ""
        self.stopped = False
        # Where each piece not reached yet starts in the decoded text, in characters; and how
        # many characters were decoded and emitted.
        self._starts: list[int] | None = [] if count_tokens else None
        self._decoded = self._emitted = 0
        self._flushed = False

    def feed(self, piece: bytes) -> str:
        if self.stopped:
            return ""
        decoded = self._decoder.decode(piece)
        if self._starts is not None:
            return self._counted(decoded)
        return self._emit(decoded)

    def _emit(self, decoded: str) -> str:
        text = self._held + decoded
        if not self._stops:
            self._held = ""
            return text
        return self._split_at_stop(text)

    def _counted(self, decoded: str) -> str:
        """_emit(), counting the piece's start and the characters decoded and emitted (apart,
        so that requests without logprobs do not pay for it)."""
        self._starts.append(self._decoded)
        self._decoded += len(decoded)
        text = self._emit(decoded)
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """The text still held back, once generation has ended for another reason."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        self._flushed = True
        return text

    def take_reached(self) -> int:
        """How many more of the pieces fed so far the emitted text has reached; after flush(),
        all of them."""
        starts = self._starts
        reached = 0
        while reached < len(starts) and (self._flushed or starts[reached] < self._emitted):
            reached += 1
        del starts[:reached]
        return reached

    def _split_at_stop(self, text: str) -> str:
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best
