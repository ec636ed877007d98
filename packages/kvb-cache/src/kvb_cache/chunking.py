"""Cut token ids into chunks whose boundaries depend only on the tokens themselves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class ChunkSpan(NamedTuple):
    """Tokens ``[start, end)`` of a sequence.

    ``complete`` chunks have a final cut: every token that can move the cut was visible. The last span of a
    sequence is usually incomplete (its cut could still move as more tokens arrive).
    """

    start: int
    end: int
    complete: bool

    @property
    def length(self) -> int:
        return self.end - self.start


class Chunker:
    """Fixed-size chunks with an optional boundary window.

    With ``boundary_window = W > 0`` the cut after a chunk may slide within ``[nominal - W, nominal + W]`` to
    just after a break token (newline, sentence end), choosing the break closest to the nominal cut
    (earlier wins a tie). A chunk only counts as complete once all ``nominal + W`` tokens are visible, so a
    prefix of a longer sequence always cuts its complete chunks exactly as the longer sequence does.
    """

    def __init__(
        self, chunk_size: int, boundary_window: int = 0, break_ids: frozenset[int] = frozenset()
    ) -> None:
        self.chunk_size = chunk_size
        self.boundary_window = boundary_window if break_ids else 0
        self.break_ids = break_ids

    def split(self, ids: Sequence[int]) -> list[ChunkSpan]:
        """Return the spans covering ``ids`` in order; only the last one may be incomplete."""
        size, window, n = self.chunk_size, self.boundary_window, len(ids)
        spans: list[ChunkSpan] = []
        start = 0
        while start < n:
            nominal = start + size
            if nominal + window > n:
                spans.append(ChunkSpan(start, n, False))
                break
            cut = self._cut(ids, nominal) if window else nominal
            spans.append(ChunkSpan(start, cut, True))
            start = cut
        return spans

    def _cut(self, ids: Sequence[int], nominal: int) -> int:
        # A cut at position p means token p-1 ends the chunk; prefer p-1 being a break token.
        for offset in range(self.boundary_window + 1):
            for p in (nominal - offset, nominal + offset):
                if ids[p - 1] in self.break_ids:
                    return p
        return nominal


def natural_break_ids(tokenizer) -> frozenset[int]:
    """Token ids whose text ends a line or a sentence (for the boundary window)."""
    breaks = set()
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text.endswith(("\n", ". ", "? ", "! ")) or (
            text.rstrip(" ").endswith((".", "?", "!")) and text.strip()
        ):
            breaks.add(token_id)
    return frozenset(breaks)
