"""Streaming text of one request: incremental detokenization and stop strings.

``TextStream.add(tokens)`` returns the text that became final with these tokens. The whole output
is decoded each time (``tokenizer.decode(ids, skip_special_tokens=True)``), so the streamed pieces
always concatenate to exactly the decode of the final token ids (no drift on byte-level or
SentencePiece merges). Two kinds of text are held back until the next call:

- a trailing U+FFFD (a multi-byte character whose remaining bytes are in later tokens);
- a trailing piece that is a prefix of a stop string (it may become a stop).

A stop string ends the output: the text is cut just before it (OpenAI semantics: the stop string is
not returned) and ``stopped`` is set.
"""
from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Detokenizes a growing list of token ids (``tokenizer``: a ``transformers`` tokenizer)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""          # final text so far (what has been returned)
        self.stopped = False

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        """Append ``tokens`` → the newly final text (``final``: the output ends here, release all)."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            end = cut
        elif final:
            end = len(full)
        else:
            end = len(full) - self._held_back(full)
        end = max(end, len(self.text))
        delta, self.text = full[len(self.text):end], full[:end]
        return delta

    def _first_stop(self, full: str) -> int | None:
        """Index of the earliest stop string in ``full`` (searching from where new text may start one)."""
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, full: str) -> int:
        """How many trailing characters of ``full`` may still change or become a stop string."""
        hold = 0
        if full.endswith(REPLACEMENT):
            hold = len(full) - len(full.rstrip(REPLACEMENT))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold
