"""Turns one sequence's token pieces into the text a client sees: whole UTF-8 characters only,
and nothing from a stop string on, even when the stop string spans several tokens."""
from __future__ import annotations

import codecs


class TextStream:
    """Feed the bytes of each generated token; get back the text that is safe to emit now.

    Text that could still be the start of a stop string is held back until the next piece says
    whether it is; when a stop string completes, the text before it is emitted and `stopped`."""

    __slots__ = ("_decoder", "_stops", "_held", "stopped")

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        # 'replace': bytes that never form a valid character become U+FFFD instead of an error.
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = stop
        self._held = ""
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(piece)
        if not self._stops:
            self._held = ""
            return text
        return self._split_at_stop(text)

    def flush(self) -> str:
        """The text still held back, once generation has ended for another reason."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text

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
