"""One request's grammar matcher: which tokens may come next, advanced by each sampled token."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


class GrammarState:
    """Wraps an ``llguidance.LLMatcher`` (a per-request copy of a cached compiled grammar).

    :attr:`finished` turns true once the grammar admits nothing more (the output is complete): the engine
    then finishes the request with ``finish_reason="stop"``. It also turns true when the matcher fails
    (:attr:`error`): the output is then *not* complete, and the result says so
    (:attr:`GenerationResult.grammar_error <kvb_cache.results.GenerationResult.grammar_error>`).
    """

    __slots__ = ("_matcher", "_on_error", "error", "vocab_size")

    def __init__(self, matcher: Any, *, vocab_size: int, on_error: Callable[[], None] | None = None) -> None:
        """``on_error``: called once when the matcher fails (the grammar cache drops the compiled grammar
        this matcher was copied from: see :class:`~kvb_cache.structured.backend.GrammarCache`)."""
        self._matcher = matcher
        self._on_error = on_error
        self.vocab_size = vocab_size
        #: Why the matcher failed, or None. llguidance refuses a token the mask allowed when the grammar
        #: outgrows its limits while decoding (``a{1000000}``: "too many expressions constructed"; 20000
        #: alternatives: "Current row has 20001 items; max is 2000"), which compiling does not catch.
        self.error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into ``row`` (``[ceil(V / 32)]`` int32, CPU, contiguous)."""
        assert row.dtype == torch.int32 and row.is_contiguous() and not row.is_cuda
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def advance(self, token: int) -> None:
        """Consume the sampled ``token``."""
        if not self._matcher.consume_token(token):
            # A grammar past the library's limits (see ``error``), or a token forced in outside the mask:
            # end this request rather than fail the whole engine step.
            self._record_error()
            logger.warning("grammar rejected token %d: %s", token, self.error)

    def _record_error(self) -> None:
        self.error = self._matcher.get_error().split("\n", 1)[0][:500] or "the grammar matcher failed"
        on_error, self._on_error = self._on_error, None
        if on_error is not None:
            on_error()

    @property
    def finished(self) -> bool:
        # A limit can also be hit while computing a mask (the matcher then allows only end-of-sequence,
        # which it may accept): an errored matcher is a failure however it stopped.
        if self.error is None and self._matcher.is_error():
            self._record_error()
        return self.failed or self._matcher.is_stopped()
