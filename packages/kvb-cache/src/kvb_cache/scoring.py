"""Log-probabilities of a prompt's own tokens: OpenAI's ``echo`` + ``logprobs``, lm-eval's loglikelihood.

Scoring needs the model's output at *every* prompt position, and a cached prefix has KV but no outputs, so
this is a plain forward over the whole prompt (no cache read, nothing stored), in slices with a
:class:`~transformers.DynamicCache` so the ``[slice, vocab]`` logits stay bounded; vLLM does the same for
``prompt_logprobs`` (it skips its prefix cache for such requests). :class:`PromptScorer` runs those slices
one call at a time, so a server can step its running requests between them.

The numbers follow the generation path's convention (:func:`kvb_cache.emitter.token_logprob`): log-softmax
of the model's raw logits in fp32, so a prompt token and a generated token are scored alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.emitter import TokenTexts
from kvb_cache.results import TokenLogprob

#: Prompt positions per forward: bounds the fp32 logits to ``SLICE * vocab * 4`` bytes (~50 MB at 49k).
SLICE = 256


class PromptScorer:
    """Scores a prompt one slice at a time, so a caller can interleave other work (the server's engine
    steps) between slices: :meth:`advance` runs the next forward of at most ``slice_size`` positions.

    Entry ``j - 1`` of :meth:`result` is token ``ids[j]`` under the model's distribution after ``ids[:j]``,
    with the ``top`` most likely tokens there (best first); the first token has no entry (nothing precedes
    it). Equal to ``log_softmax(model(ids).logits[0, :-1])`` gathered at ``ids[1:]``, up to float summation
    order across slices.

    Holds the prompt's KV (a :class:`~transformers.DynamicCache`, ``[1, kv_heads, scored, head_dim]`` per
    layer) until it is done or dropped; dropping it part-way is how a caller cancels.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        texts: TokenTexts,
        ids: Sequence[int],
        *,
        top: int = 0,
        slice_size: int = SLICE,
        device: torch.device | None = None,
    ) -> None:
        if slice_size < 1:
            raise ValueError(f"slice_size must be >= 1, got {slice_size}")
        self._model = model
        self._texts = texts
        self._ids = list(ids)
        self._top = top
        self._slice = slice_size
        self._device = model.device if device is None else device
        self._cache: DynamicCache | None = DynamicCache(config=model.config)
        #: One per position fed so far (so also the next position to feed); the last prompt token is never
        #: fed: nothing in the prompt follows it.
        self._entries: list[TokenLogprob] = []

    @property
    def done(self) -> bool:
        """Whether every prompt token after the first is scored."""
        return self.scored >= len(self._ids) - 1

    @property
    def scored(self) -> int:
        """Entries so far (of ``len(ids) - 1``)."""
        return len(self._entries)

    def advance(self) -> bool:
        """Score the next slice; returns :attr:`done`. A no-op once done."""
        if self.done:
            return True
        start = self.scored
        end = min(start + self._slice, len(self._ids) - 1)
        device = self._device
        with torch.inference_mode():
            logits = self._model(
                input_ids=torch.tensor([self._ids[start:end]], device=device),
                position_ids=torch.arange(start, end, device=device)[None],
                **cache_kwargs(self._model, self._cache),
                use_cache=True,
            ).logits[0]  # [S, V]
            logp = torch.log_softmax(logits.float(), dim=-1)
            targets = self._ids[start + 1 : end + 1]
            picked = logp.gather(1, torch.tensor(targets, device=device)[:, None])  # [S, 1]
            # Rank: 1 + the tokens strictly more likely (vLLM's rank); read with the logprobs, one transfer.
            ranks = (logp > picked).sum(dim=-1) + 1
            chosen, rank = torch.stack([picked[:, 0].double(), ranks.double()]).tolist()
            best: list[list[tuple[int, float]]] = [[] for _ in targets]
            if self._top:
                values, indices = torch.topk(logp, min(self._top, logp.shape[-1]), dim=-1)
                best = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        text = self._texts.token_text
        for token, logprob, place, alternatives in zip(targets, chosen, rank, best):
            self._entries.append(
                TokenLogprob(
                    token_id=token,
                    token=text(token),
                    logprob=logprob,
                    top=tuple((i, text(i), v) for i, v in alternatives),
                    rank=int(place),
                )
            )
        if self.done:
            self._cache = None  # the KV is no longer needed
        return self.done

    def result(self) -> list[TokenLogprob]:
        """The entries (``len == len(ids) - 1``); raises :class:`RuntimeError` before :attr:`done`."""
        if not self.done:
            raise RuntimeError(f"prompt scored {self.scored} of {len(self._ids) - 1} tokens; call advance()")
        return list(self._entries)
