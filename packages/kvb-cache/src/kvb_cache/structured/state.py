"""One request's grammar matcher: which tokens may come next, advanced by each sampled token."""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class GrammarState:
    """Wraps an ``llguidance.LLMatcher`` (a per-request copy of a cached compiled grammar).

    :attr:`finished` turns true once the grammar admits nothing more (the output is complete): the engine
    then finishes the request with ``finish_reason="stop"``.
    """

    __slots__ = ("_matcher", "failed", "vocab_size")

    def __init__(self, matcher: Any, *, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.failed = False

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into ``row`` (``[ceil(V / 32)]`` int32, CPU, contiguous)."""
        assert row.dtype == torch.int32 and row.is_contiguous() and not row.is_cuda
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def advance(self, token: int) -> None:
        """Consume the sampled ``token``."""
        if not self._matcher.consume_token(token):
            # Only reachable if a token outside the mask was forced in (cannot happen through the
            # sampler); end the request rather than fail the whole engine step.
            logger.warning("grammar rejected token %d: %s", token, self._matcher.get_error()[:200])
            self.failed = True

    @property
    def finished(self) -> bool:
        return self.failed or self._matcher.is_stopped()
