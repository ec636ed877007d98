"""Predicted peak memory of one request, term by term.

Notation: ``B`` batch, ``P`` prompt tokens, ``N`` max new tokens, ``T = P + N``, ``C`` prefill slice
(``min(chunk, P)``, or ``P`` single-shot), ``L`` layers, ``H`` hidden, ``I`` MLP width, ``Hq``/``Hkv``
query/KV heads, ``d`` head dim, ``V`` vocab, ``e`` bytes per element. Everything is *on top of* the
loaded weights, i.e. what a request adds to a warm server::

    peak = kv(T, bits) + cache_growth + logits + max(attention_phase, mlp_phase)

- ``kv``: the whole request's KV reserved up front at the chosen bits (see :mod:`kvb_planner.kv_layout`).
- ``cache_growth``: appending to a ``DynamicCache`` layer is a ``torch.cat``, so the old and new tensors of
  one layer coexist: ``2 * B * Hkv * d * T * e`` (the widest layer's, for models whose layers differ:
  ``ModelShape.kv_layer_channels``). A quantized cache also dequantizes one layer's full context for
  attention, doubling it.
- ``logits``: ``B * rows * V * e`` (``rows`` = 1 with ``logits_to_keep=1``, ``C`` when prompt logprobs are
  needed) plus the fp32 copy the sampler takes, ``B * V * 4``.
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
"""

from __future__ import annotations

from dataclasses import dataclass

from kvb_planner.kv_layout import DEFAULT_KV_LAYOUT, KVQuantLayout, kv_cache_bytes
from kvb_planner.ladder import LadderStep
from kvb_planner.request import PlanRequest
from kvb_planner.shape import ModelShape

#: ``[B, Hq, C, P]`` score-sized buffers live at once, per attention backend. Unknown backends get the
#: eager value: assuming materialised scores is the safe side.
SCORE_BUFFERS = {"eager": 2, "sdpa": 0, "flash_attention_2": 0, "flash_attention_3": 0, "flex_attention": 0}
EAGER_SCORE_BUFFERS = 2
#: Score-sized buffers of torch's math SDPA backend (scores, softmax, the float causal mask it builds).
MATH_SDPA_SCORE_BUFFERS = 3
SAMPLER_FP32_BYTES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Predicted bytes of one request at one ladder step; ``peak_bytes`` is what must fit."""

    kv_bytes: int
    cache_growth_bytes: int
    logits_bytes: int
    mlp_phase_bytes: int
    attention_phase_bytes: int
    #: Part of ``attention_phase_bytes`` that scales with slice x context (scores, mask, repeat_kv).
    attention_scratch_bytes: int
    peak_bytes: int


def _masked_scratch(shape: ModelShape, b: int, c: int, p: int, e: int, eager: bool) -> int:
    """A masked slice's extra: the mask (transformers' bool one and, for SDPA, the float copy torch makes of
    it with aten::where) and, under GQA, ``repeat_kv``'s expanded keys and values."""
    scratch = b * c * p * (e if eager else 1 + e)
    if shape.num_attention_heads != shape.num_kv_heads:
        scratch += 2 * b * shape.num_attention_heads * p * shape.head_dim * e
    return scratch


def sdpa_falls_back_to_math(shape: ModelShape, *, batch_size: int, device: str | None) -> bool:
    """Whether torch's SDPA runs its math backend (materialised scores) on an unmasked slice: fp32
    grouped-query attention of one request on CUDA (module doc). ``device`` None (unknown) counts as CUDA,
    the safe side."""
    on_cuda = device is None or str(device).startswith("cuda")
    return (
        on_cuda
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
) -> MemoryEstimate:
    """Predict the peak of ``request`` run with ``step`` on a model of ``shape`` (formula in the module doc).

    ``device`` (``"cpu"``, ``"cuda:0"``; a :class:`~kvb_planner.DeviceProfile`'s ``device``) picks the SDPA
    backend rule; None assumes the costlier one."""
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
        peak_bytes=kv + growth + logits + max(mlp, attention),
    )
