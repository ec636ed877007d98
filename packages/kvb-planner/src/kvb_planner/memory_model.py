"""Predicted peak memory of one request, term by term.

Notation: ``B`` batch, ``P`` prompt tokens, ``N`` max new tokens, ``T = P + N``, ``C`` prefill slice
(``min(chunk, P)``, or ``P`` single-shot), ``L`` layers, ``H`` hidden, ``I`` MLP width, ``Hq``/``Hkv``
query/KV heads, ``d`` head dim, ``V`` vocab, ``e`` bytes per element. Everything is *on top of* the
loaded weights, i.e. what a request adds to a warm server::

    peak = kv(T, bits) + cache_growth + logits + max(attention_phase, mlp_phase) + weight_transient

- ``kv``: the whole request's KV reserved up front at the chosen bits (see :mod:`kvb_planner.kv_layout`).
- ``cache_growth``: appending to a ``DynamicCache`` layer is a ``torch.cat``, so the old and new tensors of
  one layer coexist: ``2 * B * Hkv * d * T * e`` (the widest layer's, for models whose layers differ:
  ``ModelShape.kv_layer_channels``). A quantized cache also dequantizes one layer's full context for
  attention, doubling it.
- ``logits``: ``B * rows * V * e`` (``rows`` = 1 with ``logits_to_keep=1``, ``C`` when prompt logprobs are
  needed) plus the fp32 copy the sampler takes, ``B * V * 4``.
- ``weight_transient``: ``ModelShape.weight_transient_bytes``, what a dequantizing int4 kernel
  materializes of one linear's weight while it runs (0 for weights used as stored); a linear runs in
  either phase, so it is added to the larger one.
- Activations of one slice. No-grad forwards free each layer's intermediates, so only the largest phase
  of one layer is live:
  - ``mlp_phase = B * C * (3 I + 4 H) * e``: ``act(gate)``, ``up`` and their product (``3 I``), plus the
    residual stream, the normed input, the RMSNorm temporaries and the output (``4 H``).
  - ``attention_phase = B * C * (3 H + 4 Hq d + 4 Hkv d) * e + scratch``: residual, normed input and
    output; q/k/v and their RoPE'd copies and temporaries.
  - ``scratch`` (slice x context x heads): eager attention materialises the ``[B, Hq, C, P]`` scores and
    their softmax (2 buffers, at least fp32); SDPA/flash kernels tile them (0 buffers). When a mask is
    present (chunked prefill, batch > 1, eager) add the mask, ``B * C * P * e`` for eager and
    ``B * C * P * (1 + e)`` for SDPA (transformers' bool mask plus the float copy torch's SDPA converts it
    to), and, under GQA, ``repeat_kv``'s expanded K and V: ``2 * B * Hq * P * d * e``.
    One exception to SDPA's 0 buffers: on CUDA, fp32 grouped-query attention without a mask (single-shot
    prefill of one request) runs torch's *math* backend, because transformers passes ``enable_gqa``, the
    flash kernel takes only fp16/bf16 and the memory-efficient one does not take ``enable_gqa``. It
    materialises the scores, their softmax and a causal mask: ``3`` score buffers (found on an H200,
    2026-11-28: a 1024-token fp32 prefill of a 2-layer GQA model peaked at 44 MB against 3.4 MB predicted).

The sum is conservative: the full ``T`` KV is charged during prefill, when only ``P`` exists. The
per-term constants were checked against ``torch.profiler`` tensor peaks on SmolLM2 (see docs/planner.md).

That is a request run on its own cache (``model.generate``, a solo ``DynamicCache``). For an engine that
keeps KV in a preallocated block pool and runs steps of bounded size, pass a
:class:`~kvb_planner.paged_loop.PagedLoop`: its terms are in :mod:`kvb_planner.paged_loop`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvb_planner.kv_layout import DEFAULT_KV_LAYOUT, KVQuantLayout, kv_cache_bytes
from kvb_planner.ladder import LadderStep
from kvb_planner.paged_loop import SAMPLER_FP32_COPIES, PagedLoop
from kvb_planner.request import PlanRequest
from kvb_planner.shape import ModelShape

#: ``[B, Hq, C, P]`` score-sized buffers live at once, per attention backend. Unknown backends get the
#: eager value: assuming materialised scores is the safe side.
SCORE_BUFFERS = {"eager": 2, "sdpa": 0, "flash_attention_2": 0, "flash_attention_3": 0, "flex_attention": 0}
EAGER_SCORE_BUFFERS = 2
#: Score-sized buffers of torch's math SDPA backend (scores, softmax, the float causal mask it builds).
MATH_SDPA_SCORE_BUFFERS = 3
#: torch's CPU flash-attention kernel (SDPA on the CPU) splits keys into blocks of at most this many.
CPU_SDPA_KEY_BLOCK = 512
SAMPLER_FP32_BYTES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Predicted bytes of one request at one ladder step; ``peak_bytes`` is what must fit."""

    kv_bytes: int
    cache_growth_bytes: int
    logits_bytes: int
    mlp_phase_bytes: int
    attention_phase_bytes: int
    #: Part of ``attention_phase_bytes`` that scales with slice x context (scores, mask, repeat_kv; in a
    #: paged loop the gathered context and its masks).
    attention_scratch_bytes: int
    peak_bytes: int
    #: A paged loop's sampler phase (fp32 copies of the sampled rows), after the forward; 0 otherwise.
    sampler_bytes: int = 0
    #: Whether this is the paged-loop estimate (KV in the engine's pool, not charged here).
    paged: bool = False
    #: ``ModelShape.weight_transient_bytes``, included in ``peak_bytes`` (on top of the larger phase).
    weight_transient_bytes: int = 0
    #: A paged loop's prompt scoring (``prompt_logprobs``): one scoring slice's peak beside the scorer's own
    #: cache (``kv_bytes``); 0 otherwise.
    scoring_bytes: int = 0


def _masked_scratch(shape: ModelShape, b: int, c: int, p: int, e: int, eager: bool) -> int:
    """A masked slice's extra: the mask (transformers' bool one and, for SDPA, the float copy torch makes of
    it with aten::where) and, under GQA, ``repeat_kv``'s expanded keys and values."""
    scratch = b * c * p * (e if eager else 1 + e)
    if shape.num_attention_heads != shape.num_kv_heads:
        scratch += 2 * b * shape.num_attention_heads * p * shape.head_dim * e
    return scratch


def _device_type(device: str | None) -> str | None:
    """``torch.device(device).type`` ("cpu", "cuda", ...); None for None or a string torch does not parse."""
    if device is None:
        return None
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        return None


def _on_cuda(device: str | None) -> bool:
    """Whether the CUDA rules (the costlier ones) apply: every device but the CPU, and an unknown one.

    By prefix, "CUDA:0", "gpu" or "xpu:0" got the CPU's cheaper rule (16x less for an fp32 GQA prefill)."""
    return _device_type(device) != "cpu"


def cpu_sdpa_tile_bytes(q_len: int, kv_len: int, value_dim: int, dtype_bytes: int, threads: int) -> int:
    """Scratch torch's CPU flash-attention kernel allocates for one call, per intra-op thread: an fp32
    ``[q_block, key_block]`` score tile, two row statistics and a ``[q_block, Dv]`` output block (plus a
    half-precision copy of the tile for bf16/fp16). Query blocks are 256 rows from 768 queries, 64 from 192,
    else 32; key blocks 512. Measured on a tiny model: 58.6 KB more per thread, as this gives."""
    q_block = min(q_len, 256 if q_len >= 768 else 64 if q_len >= 192 else 32)
    k_block = min(kv_len, CPU_SDPA_KEY_BLOCK)
    per_thread = (q_block * k_block + 2 * q_block + q_block * value_dim) * 4
    if dtype_bytes < 4:
        per_thread += q_block * k_block * dtype_bytes
    return threads * per_thread


def _cpu_tile(device: str | None, threads: int | None, q_len: int, kv_len: int, shape: ModelShape) -> int:
    """:func:`cpu_sdpa_tile_bytes` when the device is the CPU and its thread count is known, else 0."""
    if threads is None or _device_type(device) != "cpu":
        return 0
    return cpu_sdpa_tile_bytes(q_len, kv_len, shape.head_dim, shape.dtype_bytes, threads)


def sdpa_falls_back_to_math(shape: ModelShape, *, batch_size: int, device: str | None) -> bool:
    """Whether torch's SDPA runs its math backend (materialised scores) on an unmasked slice: fp32
    grouped-query attention of one request on CUDA (module doc). ``device`` None (unknown) counts as CUDA,
    the safe side."""
    return (
        _on_cuda(device)
        and shape.attn_implementation == "sdpa"
        and shape.dtype_bytes == 4
        and shape.num_attention_heads != shape.num_kv_heads
        and batch_size == 1
    )


def estimate_memory(
    request: PlanRequest,
    step: LadderStep,
    shape: ModelShape,
    *,
    layout: KVQuantLayout = DEFAULT_KV_LAYOUT,
    device: str | None = None,
    loop: PagedLoop | None = None,
    cpu_threads: int | None = None,
) -> MemoryEstimate:
    """Predict the peak of ``request`` run with ``step`` on a model of ``shape`` (formula in the module doc).

    ``device`` (``"cpu"``, ``"cuda:0"``; a :class:`~kvb_planner.DeviceProfile`'s ``device``) picks the SDPA
    backend rule; None assumes the costlier one. ``loop``: the engine runs 16-bit requests in a paged loop
    (:mod:`kvb_planner.paged_loop`); a quantized step still runs on a cache of its own. ``cpu_threads``
    (a probed :class:`~kvb_planner.DeviceProfile`'s): on the CPU, the paged loop's attention calls are
    charged SDPA's per-thread score tiles (:func:`cpu_sdpa_tile_bytes`; measured there, where they scale
    with the thread count; transformers' own SDPA calls in the solo estimate did not show them); None
    leaves them out."""
    solo = _solo_estimate(request, step, shape, layout=layout, device=device)
    if loop is None or step.kv_bits != 16:
        return solo
    paged = _loop_estimate(request, step, shape, loop, device=device, threads=cpu_threads)
    if loop.solo_paths and solo.peak_bytes > paged.peak_bytes:
        paged = solo
    if request.prompt_logprobs:
        paged = _with_scoring(paged, request, shape, loop, layout=layout, device=device)
    return paged


def _with_scoring(
    estimate: MemoryEstimate,
    request: PlanRequest,
    shape: ModelShape,
    loop: PagedLoop,
    *,
    layout: KVQuantLayout,
    device: str | None,
) -> MemoryEstimate:
    """``estimate`` plus the prompt's scoring beside the loop (:mod:`kvb_planner.paged_loop`): the scorer's
    ``DynamicCache`` of the whole prompt stays while steps run, and each scoring slice is a solo forward of
    ``score_slice_tokens`` rows keeping every row's logits, plus their fp32 copy and ``log_softmax``
    (``C * V * 4`` each; no copy when the logits already are fp32). Prompts are scored one at a time.

    NOTE: charged as plain generation, an lm-eval loglikelihood request (echo + logprobs) of 4000 tokens
    peaked at 3.3x the plan in bf16 (2026-11-29 audit): the fp32 terms do not shrink with the model's dtype.
    """
    scored = PlanRequest(prompt_tokens=request.prompt_tokens, max_new_tokens=0, prompt_logprobs=True)
    scorer = _solo_estimate(
        scored, LadderStep(prefill_chunk_size=loop.score_slice_tokens), shape, layout=layout, device=device
    )
    rows = min(loop.score_slice_tokens, request.prompt_tokens)
    vocab = shape.vocab_size
    fp32 = rows * vocab * ((SAMPLER_FP32_BYTES if shape.dtype_bytes != 4 else 0) + SAMPLER_FP32_BYTES)
    # _solo_estimate's logits term ends with a sampler's [V] fp32 row; scoring has its [C, V] rows instead.
    slice_peak = scorer.peak_bytes - scorer.kv_bytes - vocab * SAMPLER_FP32_BYTES + fp32
    return replace(
        estimate,
        kv_bytes=estimate.kv_bytes + scorer.kv_bytes,
        scoring_bytes=slice_peak,
        peak_bytes=max(estimate.peak_bytes, slice_peak) + scorer.kv_bytes,
    )


def _loop_estimate(
    request: PlanRequest,
    step: LadderStep,
    shape: ModelShape,
    loop: PagedLoop,
    *,
    device: str | None,
    threads: int | None,
) -> MemoryEstimate:
    """The paged loop's terms (:mod:`kvb_planner.paged_loop`). ``batch_size`` sequences are separate
    engine requests sharing steps, so they add nothing a full step does not already charge."""
    p, t = request.prompt_tokens, request.total_tokens
    s = loop.step_tokens
    c = min(step.slice_tokens(p), s)
    e = shape.dtype_bytes
    hq, hkv, d = shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    groups = max(1, hq // hkv)
    channels = max(k + v for k, v in shape.layer_channels)

    rows = min(c, max(1, loop.mask_elements // (groups * p)))
    mask_elements = groups * rows * p
    mask_bytes = mask_elements * (1 + (2 if _on_cuda(device) else 1) * e)
    prefill = p * channels * e + mask_bytes
    gathered = max(loop.decode_gather_tokens, t)
    decode = gathered * (channels * e + 1 + e)
    if loop.eager_attention:
        prefill += 2 * 4 * hkv * mask_elements
        decode += 2 * 4 * hq * gathered
    else:
        # Grouped queries are attended as one [G * rows] block per key head.
        prefill += _cpu_tile(device, threads, groups * rows, p, shape)
        decode += _cpu_tile(device, threads, groups, t, shape)
    scratch = max(prefill, decode)

    mlp = s * (3 * shape.intermediate_size + 4 * shape.hidden_size) * e
    attention = s * (3 * shape.hidden_size + 4 * hq * d + 4 * hkv * d) * e + scratch
    logits = loop.kept_rows * shape.vocab_size * e  # scored prompts are charged apart (_with_scoring)
    sampler = loop.sampled_rows * shape.vocab_size * (e + SAMPLER_FP32_COPIES * SAMPLER_FP32_BYTES)
    return MemoryEstimate(
        kv_bytes=0,
        cache_growth_bytes=0,
        logits_bytes=logits,
        mlp_phase_bytes=mlp,
        attention_phase_bytes=attention,
        attention_scratch_bytes=scratch,
        sampler_bytes=sampler,
        weight_transient_bytes=shape.weight_transient_bytes,
        peak_bytes=max(logits + max(mlp, attention) + shape.weight_transient_bytes, sampler),
        paged=True,
    )


def _solo_estimate(
    request: PlanRequest, step: LadderStep, shape: ModelShape, *, layout: KVQuantLayout, device: str | None
) -> MemoryEstimate:
    b, p, t = request.batch_size, request.prompt_tokens, request.total_tokens
    c = step.slice_tokens(p)
    e = shape.dtype_bytes
    hq, hkv, d = shape.num_attention_heads, shape.num_kv_heads, shape.head_dim

    kv = kv_cache_bytes(shape, tokens=t, batch_size=b, kv_bits=step.kv_bits, layout=layout)
    one_layer = b * max(k + v for k, v in shape.layer_channels) * t * e
    growth = one_layer * (1 if step.kv_bits == 16 else 2)
    rows = c if request.prompt_logprobs else 1
    logits = b * rows * shape.vocab_size * e + b * shape.vocab_size * SAMPLER_FP32_BYTES

    mlp = b * c * (3 * shape.intermediate_size + 4 * shape.hidden_size) * e
    eager = shape.attn_implementation == "eager"
    buffers = SCORE_BUFFERS.get(shape.attn_implementation, EAGER_SCORE_BUFFERS)
    scratch = buffers * b * hq * c * p * max(e, 4)
    if sdpa_falls_back_to_math(shape, batch_size=b, device=device):
        # The unmasked slice: the whole prompt single-shot, else the first slice (nothing cached before it,
        # so transformers passes no mask either). Later slices are masked (below); the larger one is the peak.
        math = MATH_SDPA_SCORE_BUFFERS * hq * c * c * 4
        scratch = math if c == p else max(math, _masked_scratch(shape, b, c, p, e, eager))
    elif eager or c < p or b > 1:
        scratch += _masked_scratch(shape, b, c, p, e, eager)

    attention = b * c * (3 * shape.hidden_size + 4 * hq * d + 4 * hkv * d) * e + scratch
    return MemoryEstimate(
        kv_bytes=kv,
        cache_growth_bytes=growth,
        logits_bytes=logits,
        mlp_phase_bytes=mlp,
        attention_phase_bytes=attention,
        attention_scratch_bytes=scratch,
        weight_transient_bytes=shape.weight_transient_bytes,
        peak_bytes=kv + growth + logits + max(mlp, attention) + shape.weight_transient_bytes,
    )
