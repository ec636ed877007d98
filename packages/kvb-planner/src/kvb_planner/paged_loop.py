"""What an engine that serves from a paged KV pool in an iteration-level loop is like, memory-wise.

vLLM v1, nano-vllm and kvb-cache's engine loop keep every request's keys/values in a block pool allocated
when the engine starts, and feed the model one *step* at a time: at most ``step_tokens`` tokens (prefill
slices of some requests, one token of each decoding request), packed into one forward. For such an engine a
request's memory is not its own ``DynamicCache``: its KV goes into the pool (which the engine refuses to
overfill and the device probe already counted as used), and what a step adds on top is bounded by the
step's size, not by the request. :func:`kvb_planner.estimate_memory` takes a :class:`PagedLoop` and then
charges (notation of :mod:`kvb_planner.memory_model`; ``S`` step tokens, ``R`` sampled rows, ``G = Hq / Hkv``,
``ch`` the widest layer's key + value channels)::

    peak = max(forward, sampler)
    forward = logits + max(mlp_phase(S), attention_phase(S) + max(prefill_gather, decode_gather))
    sampler = R * V * (e + SAMPLER_FP32_COPIES * 4)

- The activations are the memory model's phases at ``S`` tokens, whichever requests fill the step: a
  request prefilling a few tokens may share its step with others filling it.
- ``prefill_gather``: the attention gathers the request's whole context from the pool, ``P * ch * e``, and
  builds a position mask for a block of query rows at a time, ``G * rows * P`` elements with
  ``rows = min(C, mask_elements // (G * P))``: the bool mask and the float copy SDPA makes of it
  (``1 + e`` bytes; on CUDA also the memory-efficient kernel's aligned copy, ``1 + 2e``), and for an
  eager formula (soft-capping, sinks) that block's fp32 scores and probabilities.
- ``decode_gather``: decoding rows gather their contexts, padded to the longest, at most
  ``decode_gather_tokens`` positions at a time (one row of the request's own ``T`` if longer).
- ``logits``: ``logits_rows`` rows (``R`` when the forward keeps only the sampled rows, else every step
  token); the sampler then holds fp32 copies of the ``R`` rows (processing, sorting for top-k/top-p, the
  softmax and its cumulative sum).

Not charged: the request's KV (in the pool) and a ``DynamicCache``'s concatenation copies (the loop writes
slots in place). A request whose prompt is scored (``prompt_logprobs``) is scored outside the steps, as
kvb-cache's ``PromptScorer`` does: its own ``DynamicCache`` of the prompt, held while the steps go on, and
one slice of ``score_slice_tokens`` positions at a time with fp32 logits (``log_softmax`` of an fp32 copy). A ladder step with quantized KV (8/4 bits) runs outside the pool with a cache of its own,
so it is estimated as such; so is a 16-bit request when the engine has ``solo_paths`` (the larger of both).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvb_planner.errors import PlannerConfigError

#: fp32 ``[R, V]`` buffers the sampler holds at once beside the logits (measured 8.5 logits-sized buffers
#: for 32 sampled top-k/top-p rows of SmolLM2's 49152-token vocabulary, 2026-11-28; greedy rows hold one).
SAMPLER_FP32_COPIES = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedLoop:
    """An engine whose requests' KV lives in a block pool allocated before the device was probed.

    Attributes:
        step_tokens: Most tokens one step feeds the model (vLLM's ``max_num_batched_tokens``).
        sampled_rows: Most rows one step samples (``max_num_seqs``).
        logits_rows: Rows of logits the step's forward materialises: ``sampled_rows`` when it keeps only
            the sampled rows (``logits_to_keep``), ``step_tokens`` when it cannot. None: ``sampled_rows``.
        mask_elements: Most elements of one prefill attention call's position mask; longer slices over
            longer contexts are attended in blocks of query rows.
        decode_gather_tokens: Most context positions the decoding rows of a step gather at once, per layer.
        eager_attention: The loop's attention materialises scores (logit soft-capping or attention sinks,
            which SDPA lacks).
        solo_paths: 16-bit requests may run outside the pool with a cache of their own (speculative decoding
            on an idle engine, a stitched prompt's KV being prepared): each is charged the larger estimate.
        score_slice_tokens: Prompt positions per forward when a prompt is scored (``prompt_logprobs``: echo
            with logprobs). The engine scores outside its steps, on a ``DynamicCache`` of the whole prompt
            held between slices, with the slice's logits in fp32 (:func:`kvb_planner.estimate_memory`).
    """

    step_tokens: int
    sampled_rows: int
    logits_rows: int | None = None
    mask_elements: int = 1 << 24
    decode_gather_tokens: int = 1 << 16
    eager_attention: bool = False
    solo_paths: bool = False
    score_slice_tokens: int = 256

    def __post_init__(self) -> None:
        for name in (
            "step_tokens",
            "sampled_rows",
            "mask_elements",
            "decode_gather_tokens",
            "score_slice_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerConfigError(f"PagedLoop.{name} must be an int >= 1, got {value!r}")
        rows = self.logits_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise PlannerConfigError(f"PagedLoop.logits_rows must be an int >= 1 or None, got {rows!r}")

    @property
    def kept_rows(self) -> int:
        """Rows of logits one step's forward holds."""
        return self.logits_rows if self.logits_rows is not None else self.sampled_rows
