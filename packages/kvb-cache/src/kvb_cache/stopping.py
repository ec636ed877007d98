"""Stop strings: find them in generated text, and know how much text is safe to stream."""

from __future__ import annotations

from typing import NamedTuple


class StopMatch(NamedTuple):
    #: Index in the text where the stop string starts (the text is cut there).
    index: int
    stop: str


class StopStrings:
    """Matches any of ``stops`` in generated text; the stop string itself is never emitted."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._longest = max((len(s) for s in stops), default=0)

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
        """Characters at the end of ``text`` that might be the start of a stop string (do not stream yet)."""
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self.stops):
                return n
        return 0
