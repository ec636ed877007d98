"""Stop strings: find them in generated text, and know how much text is safe to stream."""

from __future__ import annotations

from typing import NamedTuple


class StopMatch(NamedTuple):
    #: Index in the text where the stop string starts (the text is cut there).
    index: int
    stop: str


class StopStrings:
    """Matches any of ``stops`` in generated text; the stop string itself is never emitted.

    One per request: :meth:`holdback` follows the text as it grows (it is only ever appended to).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._borders = [_borders(stop) for stop in stops]
        # Per stop, the longest prefix of it that the text fed so far ends with (a KMP automaton's state).
        self._state = [0] * len(stops)
        self._fed = ""

    def find(self, text: str, new_from: int) -> StopMatch | None:
        """Earliest stop string in ``text`` that ends past ``new_from`` (only new text can complete one).

        Each stop is looked for from ``len(stop) - 1`` characters before ``new_from``, its own length: with
        the longest stop's reach for all, a short stop lying wholly before ``new_from`` was found, which
        with ``min_tokens`` is one completed (and streamed) before stops counted (vLLM's
        ``check_stop_strings`` sizes the window per stop the same way).
        """
        if not self.stops:
            return None
        best: StopMatch | None = None
        for stop in self.stops:
            index = text.find(stop, max(0, new_from - len(stop) + 1))
            if index != -1 and (best is None or index < best.index):
                best = StopMatch(index, stop)
        return best

    def holdback(self, text: str) -> int:
        """Characters at the end of ``text`` that might be the start of a stop string (do not stream yet):
        the longest ``n < len(longest stop)`` such that ``text`` ends with the first ``n`` characters of a
        stop.

        NOTE: tried suffix by suffix this cost O(longest stop²) per token: 64 stops of 60,000 characters
        (a 3.7 MB body) took 427 ms a token on the server's one engine thread, stalling every request. Each
        stop's KMP state follows the text instead (amortized O(1) per new character and stop).
        """
        if not self.stops:
            return 0
        if not text.startswith(self._fed):  # not the text fed so far (never, from the emitter): start over
            self._state = [0] * len(self.stops)
            self._fed = ""
        new = text[len(self._fed) :]
        for i, (stop, borders) in enumerate(zip(self.stops, self._borders)):
            k = self._state[i]
            for ch in new:
                if k == len(stop):  # a whole stop matched: go on from its longest border
                    k = borders[k]
                while k and stop[k] != ch:
                    k = borders[k]
                if stop[k] == ch:
                    k += 1
            self._state[i] = k
        self._fed = text
        best = 0
        for borders, k in zip(self._borders, self._state):
            if k >= self._longest:  # the whole longest stop: what is held is at most one character less
                k = borders[k]
            best = max(best, k)
        return best


def _borders(stop: str) -> list[int]:
    """``b[k]``: the length of the longest proper prefix of ``stop[:k]`` that is also its suffix (KMP's
    failure function), for ``k`` in ``0..len(stop)``."""
    b = [0] * (len(stop) + 1)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = b[k]
        if stop[i] == stop[k]:
            k += 1
        b[i + 1] = k
    return b
