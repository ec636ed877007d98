"""Speculative generation without an engine: prefill, decode through :class:`SpeculativeDecoder`, stop."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel

from kvb_speculative.cache_ops import cache_kwargs, new_cache
from kvb_speculative.decoder import SpeculativeConfig, SpeculativeDecoder
from kvb_speculative.errors import SpeculativeConfigError
from kvb_speculative.processing import LogitsTokenProcessor, SamplingParams
from kvb_speculative.protocols import Drafter
from kvb_speculative.stats import SpeculativeStats


class SpeculativeOutput(NamedTuple):
    """Result of :func:`speculative_generate`.

    Attributes:
        tokens: ``[n]`` int64 generated token ids (the stop token included when one was produced).
        stats: what this call's decoding did.
        prefill_seconds: wall time of the prompt forward.
        decode_seconds: wall time of everything after it.
    """

    tokens: torch.Tensor
    stats: SpeculativeStats
    prefill_seconds: float
    decode_seconds: float


def _eos_ids(model: PreTrainedModel, eos_token_id: int | list[int] | None) -> frozenset[int]:
    generation_config = getattr(model, "generation_config", None)
    value = eos_token_id if eos_token_id is not None else getattr(generation_config, "eos_token_id", None)
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)


def prefill(model: PreTrainedModel, input_ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Run the prompt through ``model`` into a fresh ``DynamicCache``.

    Args:
        model: the target causal LM.
        input_ids: ``[1, S]`` prompt ids.

    Returns:
        The cache (``S`` positions) and the ``[V]`` float32 logits at position ``S - 1``.
    """
    cache = new_cache(model)
    ids = input_ids.to(model.device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    return cache, out.logits[0, -1].float()


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    drafter: Drafter,
    *,
    gamma: int = 5,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` tokens speculatively (batch size 1).

    Greedy (``temperature=0``) output equals ``model.generate(do_sample=False)``; sampled output follows
    the same distribution as ordinary sampling with these parameters.

    Args:
        model: the target causal LM.
        input_ids: ``[1, S]`` prompt ids.
        drafter: source of draft tokens.
        gamma: maximum drafted tokens per verification forward.
        max_new_tokens: generation budget (>= 1).
        temperature, top_k, top_p, repetition_penalty, min_p: the sampling rule (see :class:`SamplingParams`).
        generator: seeded RNG for sampling.
        eos_token_id: stop token(s); default ``model.generation_config.eos_token_id``.

    Raises:
        SpeculativeConfigError: a setting is out of range.
    """
    # NOTE: an int: nan and inf compared False against every length, so generation ran until end-of-sequence
    # (forever without one); 2.5 gave 3 tokens.
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpeculativeConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise SpeculativeConfigError(
            f"input_ids has shape {tuple(input_ids.shape)}; pass one non-empty sequence as [1, S] (batch size 1, S >= 1)."
        )
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(gamma=gamma))
    processor = LogitsTokenProcessor(
        SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            min_p=min_p,
        ),
        generator,
    )
    stop = _eos_ids(model, eos_token_id)
    start = time.perf_counter()
    cache, next_logits = prefill(model, input_ids)
    prefilled = time.perf_counter()
    ids = input_ids.to(model.device)
    tokens: list[int] = []
    stream = decoder.decode(model, cache, ids, next_logits, processor, max_new_tokens=max_new_tokens)
    try:
        for token in stream:
            tokens.append(token)
            if token in stop or len(tokens) >= max_new_tokens:
                break
    finally:
        stream.close()
    end = time.perf_counter()
    return SpeculativeOutput(
        tokens=torch.tensor(tokens, dtype=torch.long),
        stats=decoder.speculative_stats(),
        prefill_seconds=prefilled - start,
        decode_seconds=end - prefilled,
    )
