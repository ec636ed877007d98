"""What bounds the memory one engine-loop step adds beside the KV pool: the facts a memory planner needs.

The pool is allocated when the engine is built; a step then feeds at most ``max_num_batched_tokens`` tokens,
keeps and samples at most ``max_num_seqs`` logits rows, and its attention gathers contexts from the pool in
bounded pieces (:mod:`kvb_cache.core.paged_attention`). kvb-planner's ``PagedLoop`` takes these fields as
they are (``PagedLoop(**dataclasses.asdict(engine.step_limits))``), so its estimate charges a step instead
of a per-request ``DynamicCache``.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from kvb_cache.core.paged_attention import DECODE_GATHER_TOKENS, PREFILL_MASK_ELEMENTS
from kvb_cache.scoring import SLICE


@dataclass(frozen=True, slots=True, kw_only=True)
class StepLimits:
    """One engine's step bounds.

    Attributes:
        step_tokens: most tokens one step feeds the model (``max_num_batched_tokens``).
        sampled_rows: most logits rows one step keeps and samples or verifies (``max_num_seqs``; with
            speculation inside the step, ``1 + gamma`` per request, at most the step's tokens).
        logits_rows: rows of logits the forward materialises: None when it keeps only the sampled rows
            (``logits_to_keep``), else every step token.
        mask_elements: most elements of one prefill attention call's position mask.
        decode_gather_tokens: most context positions the decoding rows of a step gather at once per layer
            (one row of the whole context when that is longer; at most ``max_num_seqs`` full contexts).
        eager_attention: the loop's attention runs the eager formula (soft-capping or attention sinks), which
            materialises scores.
        solo_paths: a request may run outside the pool on a cache of its own: speculative decoding (on an
            idle engine) or a stitched prompt whose KV is assembled and repaired before it joins the pool.
        score_slice_tokens: prompt positions per forward of :class:`~kvb_cache.scoring.PromptScorer` (echo
            with logprobs), which scores beside the steps on a cache of its own.
    """

    step_tokens: int
    sampled_rows: int
    logits_rows: int | None
    mask_elements: int
    decode_gather_tokens: int
    eager_attention: bool
    solo_paths: bool
    score_slice_tokens: int


def eager_loop_attention(model: PreTrainedModel) -> bool:
    """Whether the loop's attention runs the eager formula for ``model``: logit soft-capping (Gemma 2) or
    attention sinks (gpt-oss), neither of which SDPA has (:func:`kvb_cache.core.attend.attend`)."""
    text = model.config.get_text_config()
    return getattr(text, "attn_logit_softcapping", None) is not None or any(
        name.endswith("sinks") for name, _ in model.named_parameters()
    )


def decode_gather_tokens(context: int, max_num_seqs: int) -> int:
    """Most positions a step's decoding rows gather at once: sub-batches of ``DECODE_GATHER_TOKENS`` padded
    positions, one row alone when its context is longer, never more than ``max_num_seqs`` whole contexts."""
    return min(max(DECODE_GATHER_TOKENS, context), max_num_seqs * context)


def step_limits(
    model: PreTrainedModel,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    context: int,
    logits_to_keep: bool,
    solo_paths: bool,
    score_slice_tokens: int = SLICE,
    sampled_rows: int | None = None,
) -> StepLimits:
    """The step bounds of a loop over ``model`` whose requests reach at most ``context`` tokens."""
    return StepLimits(
        step_tokens=max_num_batched_tokens,
        sampled_rows=max_num_seqs if sampled_rows is None else sampled_rows,
        logits_rows=None if logits_to_keep else max_num_batched_tokens,
        mask_elements=PREFILL_MASK_ELEMENTS,
        decode_gather_tokens=decode_gather_tokens(context, max_num_seqs),
        eager_attention=eager_loop_attention(model),
        solo_paths=solo_paths,
        score_slice_tokens=score_slice_tokens,
    )
