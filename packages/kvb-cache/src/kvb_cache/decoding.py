"""Contracts between the engine's decode loop and pluggable decoders (e.g. speculative decoding).

kvb_cache defines these protocols because it consumes them; providers such as ``kvb_speculative`` satisfy
them structurally and import nothing from kvb_cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import Cache, PreTrainedModel


@runtime_checkable
class TokenProcessor(Protocol):
    """One request's sampling rule, exactly as the engine's own decode loop applies it."""

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of :meth:`process` (temperature 0)."""
        ...

    @property
    def generator(self) -> torch.Generator | None:
        """The request's seeded RNG (None: torch's global RNG). Draw every random number from it."""
        ...

    def process(self, history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Apply penalties, temperature, top-k and top-p.

        Args:
            history: ``[S]`` int64 token ids seen so far (prompt + committed output).
            logits: ``[V]`` raw next-token logits that follow ``history``.

        Returns:
            ``[V]`` float32 processed logits; excluded tokens are ``-inf``. Sampling draws from their
            softmax; greedy takes their argmax.
        """
        ...


@runtime_checkable
class SpeculativeDecoder(Protocol):
    """Produces the tokens that follow a prefilled prompt, in place of the engine's one-token loop."""

    def decode(
        self,
        model: PreTrainedModel,
        cache: Cache,
        input_ids: torch.Tensor,
        next_logits: torch.Tensor,
        processor: TokenProcessor,
    ) -> Iterator[int]:
        """Yield committed tokens one at a time, indefinitely; the engine closes the iterator when the
        request ends (finished or cancelled) if it has a ``close`` (a generator's ``finally`` runs).

        Args:
            model: the target causal LM.
            cache: holds KV for every token of ``input_ids`` (``cache.get_seq_length() == S``).
            input_ids: ``[1, S]`` prompt token ids.
            next_logits: ``[V]`` raw target logits at position ``S - 1``.
            processor: the request's sampling rule; the output distribution must be the one obtained by
                sampling ``softmax(processor.process(...))`` token by token (argmax when greedy).

        When the i-th token is yielded, ``cache`` must hold KV for at least ``input_ids`` and the ``i - 1``
        tokens yielded before it (possibly more, from rejected drafts); the engine crops it afterwards.

        A decoder whose ``decode`` also takes a ``max_new_tokens`` keyword is given the request's budget:
        it must never run the model on more than ``S + max_new_tokens`` positions (``kvb_speculative``
        shortens its drafts), since the engine admitted the request for that many only.
        """
        ...


@runtime_checkable
class StepDraftSession(Protocol):
    """One request's drafter state when it speculates inside the engine's batched step."""

    def propose(self, history: torch.Tensor, max_tokens: int, processor: TokenProcessor) -> Any:
        """Up to ``max_tokens`` tokens to follow ``history`` (``[S]`` int64, committed tokens only), as an
        object whose ``tokens`` is a ``[k]`` int64 tensor (``k == 0``: nothing to propose) and whose
        ``probs``, when not None, is ``[k, V]``: the distributions the tokens were *sampled* from, under
        ``processor`` (a sampled request's drafts are then verified by ``min(1, p / q)``; exactness rests on
        these being the very distributions drawn from). None: the tokens are point masses (prompt lookup,
        argmax drafts), verified by ``p`` alone.

        ``history`` extends the previous call's, or equals it when that proposal was never verified (the
        step failed or was interrupted before its verification; no :meth:`rollback` came for it)."""
        ...

    def rollback(self, num_accepted: int) -> None:
        """Forget the proposals after the first ``num_accepted`` of the last :meth:`propose`."""
        ...


@runtime_checkable
class StepDrafter(Protocol):
    """A decoder whose drafts the engine verifies inside its batched step (vLLM v1's way): each request's
    last token and its drafts are one slice of the packed forward, verified by argmax (greedy requests) or
    by speculative sampling (unseeded sampled ones whose processing does not depend on their history)."""

    @property
    def gamma(self) -> int:
        """Most drafted tokens per request per step."""
        ...

    def draft_session(self, prompt_ids: torch.Tensor) -> StepDraftSession:
        """A session for a request whose prompt is ``prompt_ids`` (``[S]`` int64)."""
        ...

    def record_round(self, drafted: int, accepted: int) -> None:
        """Count one verification of ``drafted`` tokens of which ``accepted`` were kept (0 drafted: a plain
        decoding step)."""
        ...


def start_decode(
    decoder: SpeculativeDecoder,
    model: PreTrainedModel,
    cache: Cache,
    input_ids: torch.Tensor,
    next_logits: torch.Tensor,
    processor: TokenProcessor,
    *,
    max_new_tokens: int,
) -> Iterator[int]:
    """``decoder.decode(...)``, passing ``max_new_tokens`` when its ``decode`` accepts that keyword.

    Without the budget a drafter proposes ``gamma`` tokens past the request's last position: beyond the
    context window that is an ``IndexError`` on learned absolute positions (GPT-2) and a different RoPE
    scaling for the whole verification forward on LongRoPE models. Decoders written against the older
    five-argument protocol still work (without the bound).
    """
    if _accepts_max_new_tokens(decoder):
        return decoder.decode(model, cache, input_ids, next_logits, processor, max_new_tokens=max_new_tokens)
    return decoder.decode(model, cache, input_ids, next_logits, processor)


def _accepts_max_new_tokens(decoder: SpeculativeDecoder) -> bool:
    try:
        parameters = inspect.signature(decoder.decode).parameters.values()
    except (TypeError, ValueError):  # builtins / C callables without a signature
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "max_new_tokens" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )
