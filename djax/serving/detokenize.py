"""Answer token ids, block by block, to text a client may be sent, and stop strings.

Text is final once no later token can change it: each push decodes the whole answer so far
(so tokenizer merges and multi-byte characters split over tokens come out right) and sends
the part past what was sent, holding back a trailing incomplete UTF-8 sequence (decoded as
U+FFFD until its last byte arrives) and any tail that could be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """One answer's incremental detokenizer.

    tokenizer: anything with `decode(ids, skip_special_tokens=True) -> str`. stop: strings
    that end the answer: the text is cut before the first one to be completed reading left
    to right (the one a token-by-token stream would meet first), and `stopped` turns True.
    `tokens`: the answer's tokens so far; once stopped, those up to the one that completed
    the stop string (the answer a token-by-token stream would have generated).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError(f"stop={list(stop)!r} holds an empty string; expected non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self.text = ""  # everything handed out so far
        self.stopped = False
        self._stop_tokens = 0

    @property
    def tokens(self) -> int:
        return self._stop_tokens if self.stopped else len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add a block's token ids; returns the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        return self._advance(self._decode().rstrip(_INCOMPLETE), final=False)

    def finish(self) -> str:
        """The answer is complete: returns the held-back text (cut at a stop string)."""
        if self.stopped:
            return ""
        return self._advance(self._decode(), final=True)

    def _decode(self, n: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[:n], skip_special_tokens=True)

    def _advance(self, decoded: str, final: bool) -> str:
        sent = len(self.text)
        stop = self._first_stop(decoded, sent)
        if stop is not None:
            self.stopped = True
            end = stop[0]
            self._stop_tokens = self._tokens_through(stop[1])
        elif final:
            end = len(decoded)
        else:
            end = len(decoded) - self._stop_prefix(decoded, sent)
        new = decoded[sent:end]
        self.text += new
        return new

    def _first_stop(self, decoded: str, start: int) -> tuple[int, int] | None:
        """Where the stop string completed first (smallest end, then smallest start) begins
        and ends in `decoded[start:]`, or None. No stop string begins before `start`: a
        tail that could begin one is never sent."""
        found = []
        for s in self._stop:
            i = decoded.find(s, start)
            if i >= 0:
                found.append((i + len(s), i))
        return (min(found)[1], min(found)[0]) if found else None

    def _tokens_through(self, end: int) -> int:
        """The fewest leading tokens whose text reaches `end` characters (complete ones: a
        trailing incomplete UTF-8 sequence does not count), by bisection: a prefix's text
        grows with its tokens."""
        low, high = 1, len(self._ids)
        while low < high:
            mid = (low + high) // 2
            if len(self._decode(mid).rstrip(_INCOMPLETE)) >= end:
                high = mid
            else:
                low = mid + 1
        return high

    def _stop_prefix(self, decoded: str, start: int) -> int:
        """Length of the longest tail of `decoded[start:]` that a stop string begins with."""
        for k in range(min(self._longest_stop - 1, len(decoded) - start), 0, -1):
            tail = decoded[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
