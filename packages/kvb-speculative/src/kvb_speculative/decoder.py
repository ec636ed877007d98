"""The speculative decode loop: draft, verify in one target forward, commit, roll back.

``SpeculativeDecoder.decode`` has the signature of ``kvb_cache.decoding.SpeculativeDecoder`` (structural
typing; nothing is imported from kvb_cache), so the engine can decode through it after its own prefill,
with chunk reuse unchanged. :func:`~kvb_speculative.generate.speculative_generate` drives it without an
engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel

from kvb_speculative.cache_ops import extend, make_croppable, rollback
from kvb_speculative.errors import NonFiniteLogitsError, SpeculativeConfigError
from kvb_speculative.protocols import Draft, Drafter, DraftSession, TokenProcessor
from kvb_speculative.sampling import sample_token
from kvb_speculative.stats import SpeculativeStats, StatsRecorder, Stopwatch
from kvb_speculative.verification import ExactVerifier, Verifier

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """Settings of the decode loop.

    Attributes:
        gamma: maximum number of drafted tokens verified per target forward (``K``).
    """

    gamma: int = 5

    def __post_init__(self) -> None:
        # NOTE: an int, checked first: gamma=2.5 passed the range check and failed at the first decode with
        # "can't multiply sequence by non-int of type 'float'"; gamma="3" with an untyped TypeError.
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or not 1 <= self.gamma <= 64:
            raise SpeculativeConfigError(
                f"gamma={self.gamma!r} must be an int in 1..64 (typical: 3-10; larger drafts waste target "
                "compute)."
            )


def _synchronize(device: torch.device) -> None:
    # Timers read host time; without a sync they would only measure kernel launches on GPU.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeDecoder:
    """Decodes speculatively with a pluggable drafter; exact in greedy and in sampling mode.

    Args:
        drafter: source of draft tokens (:class:`~kvb_speculative.PromptLookupDrafter`,
            :class:`~kvb_speculative.DraftModelDrafter`, or anything satisfying ``Drafter``).
        config: the decode-loop settings.
        verifier: the acceptance rule; the default :class:`ExactVerifier` preserves the target's output.

    Stats accumulate over every request decoded (read them with :meth:`speculative_stats`). A decoder
    serves one request at a time; per-request state lives in the drafter's session.
    """

    def __init__(
        self, drafter: Drafter, config: SpeculativeConfig | None = None, *, verifier: Verifier | None = None
    ) -> None:
        self.drafter = drafter
        self.config = config or SpeculativeConfig()
        self.verifier: Verifier = verifier or ExactVerifier()
        self._stats = StatsRecorder(self.config.gamma)

    @property
    def gamma(self) -> int:
        """Most drafted tokens verified per target forward."""
        return self.config.gamma

    def draft_session(self, prompt_ids: torch.Tensor) -> DraftSession:
        """A drafter session for one request (``prompt_ids`` ``[S]`` int64) whose drafts an engine verifies
        in its own batched forward (``kvb_cache.decoding.StepDrafter``): greedy requests by argmax, unseeded
        sampled ones by speculative sampling with the draft model's distributions (``Draft.probs``)."""
        return self.drafter.start(prompt_ids)

    def record_round(self, drafted: int, accepted: int) -> None:
        """Count a round verified outside :meth:`decode` (an engine's batched step); 0 drafted is a plain
        decoding step."""
        if drafted:
            self._stats.record_round(drafted, accepted)
        else:
            self._stats.record_plain_step()

    def speculative_stats(self) -> SpeculativeStats:
        """Counters and timings since construction or the last :meth:`reset_stats`."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._stats = StatsRecorder(self.config.gamma)

    def decode(
        self,
        model: PreTrainedModel,
        cache: Cache,
        input_ids: torch.Tensor,
        next_logits: torch.Tensor,
        processor: TokenProcessor,
        *,
        max_new_tokens: int | None = None,
    ) -> Iterator[int]:
        """Yield committed tokens one at a time until the caller closes the iterator.

        Args:
            model: the target causal LM.
            cache: KV for every token of ``input_ids`` (``cache.get_seq_length() == S``); extended in place.
            input_ids: ``[1, S]`` prompt token ids.
            next_logits: ``[V]`` raw target logits at position ``S - 1``.
            processor: the request's sampling rule; outputs follow ``softmax(processor.process(...))``
                token by token exactly (its argmax when ``processor.greedy``).
            max_new_tokens: optional budget (an int >= 1): drafts are shortened so no round overshoots it, and
                the iterator ends once that many tokens are yielded. Without it the iterator never ends by
                itself (the caller stops at end-of-sequence or closes it).

        When the i-th token is yielded, ``cache`` holds KV for ``input_ids`` and at least the ``i - 1``
        tokens yielded before it (the last committed token of a round enters it in the next round).
        """
        # NOTE: self._stats is read at each use, never held: reset_stats() swaps the recorder, and a request
        # in flight across a reset recorded its plain steps into the discarded one (its rounds into the new).
        if max_new_tokens is not None and (
            isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
        ):
            raise SpeculativeConfigError(
                f"max_new_tokens must be None or an int >= 1, got {max_new_tokens!r}"
            )
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise SpeculativeConfigError(
                f"input_ids has shape {tuple(input_ids.shape)}; pass one non-empty sequence as [1, S] (batch size 1, S >= 1)."
            )
        if cache.get_seq_length() != input_ids.shape[1]:
            # The cache must hold exactly the prompt's KV: a shorter one silently gave wrong tokens.
            raise SpeculativeConfigError(
                f"cache holds {cache.get_seq_length()} positions but input_ids has {input_ids.shape[1]}; "
                "prefill the prompt into the cache first (kvb_speculative.prefill)"
            )
        device = next_logits.device
        history = input_ids[0]  # [S + committed]
        # The prompt is prefilled: from here on rejected drafts must be croppable, past a sliding window too.
        make_croppable(cache)
        session = self.drafter.start(history)
        pending_logits: torch.Tensor | None = next_logits  # raw logits after `history`, when known
        produced = 0
        while True:
            room = self.config.gamma if max_new_tokens is None else max_new_tokens - produced - 1
            with Stopwatch() as sw:
                if room > 0:
                    draft = session.propose(history, min(room, self.config.gamma), processor)
                else:
                    draft = Draft(torch.empty(0, dtype=torch.long), None)
                _synchronize(device)
            self._stats.draft_seconds += sw.seconds
            k = draft.tokens.shape[0]
            if k == 0:
                committed = self._plain_step(model, cache, history, pending_logits, processor)
                self._stats.record_plain_step()
            else:
                committed = self._round(model, cache, history, pending_logits, processor, session, draft)
            pending_logits = None
            history = torch.cat(
                [history, torch.tensor(committed, dtype=history.dtype, device=history.device)]
            )
            produced += len(committed)
            yield from committed
            if max_new_tokens is not None and produced >= max_new_tokens:
                return

    def _plain_step(
        self,
        model: PreTrainedModel,
        cache: Cache,
        history: torch.Tensor,
        pending_logits: torch.Tensor | None,
        processor: TokenProcessor,
    ) -> list[int]:
        with Stopwatch() as sw:
            if pending_logits is None:
                pending_logits = extend(model, cache, history[-1:])[-1]
            scores = processor.process(history, pending_logits)
            if bool(torch.isnan(scores).any()):  # argmax would return the NaN's index as a token
                raise NonFiniteLogitsError()
            if processor.greedy:
                token = int(torch.argmax(scores))
            else:
                token = sample_token(torch.softmax(scores, dim=-1), processor.generator)
            _synchronize(pending_logits.device)
        self._stats.verify_seconds += sw.seconds
        return [token]

    def _round(
        self,
        model: PreTrainedModel,
        cache: Cache,
        history: torch.Tensor,
        pending_logits: torch.Tensor | None,
        processor: TokenProcessor,
        session: DraftSession,
        draft: Draft,
    ) -> list[int]:
        stats = self._stats
        k = draft.tokens.shape[0]
        drafted = draft.tokens.to(history.device)
        with Stopwatch() as sw:
            if pending_logits is None:
                # The last committed token has no KV yet: verify it and the drafts in one forward.
                logits = extend(model, cache, torch.cat([history[-1:], drafted]))  # [k + 1, V]
            else:
                logits = torch.cat([pending_logits.float().unsqueeze(0), extend(model, cache, drafted)])
            extended = torch.cat([history, drafted])
            scores = torch.stack(
                [processor.process(extended[: history.shape[0] + j], logits[j]) for j in range(k + 1)]
            )  # [k + 1, V]
            verdict = self.verifier.verify(
                scores, draft, greedy=processor.greedy, generator=processor.generator
            )
            _synchronize(logits.device)
        stats.verify_seconds += sw.seconds
        with Stopwatch() as sw:
            # Keep the KV of the accepted drafts; the correction/bonus token enters the cache next round.
            rollback(cache, history.shape[0] + verdict.num_accepted)
            session.rollback(verdict.num_accepted)
        stats.rollback_seconds += sw.seconds
        stats.record_round(k, verdict.num_accepted)
        return [*drafted[: verdict.num_accepted].tolist(), verdict.next_token]
