"""Attention over the paged pool, registered with transformers as the ``kvb_paged`` implementation.

The engine calls the model with packed tokens ``[1, T]`` (every scheduled request's new tokens back to
back) and ``use_cache=False`` inside :func:`paged_call`, which makes a :class:`PagedBatch` current for
every attention layer. Per layer this function writes the new keys/values into their pool slots, then
attends each request's queries to its whole context read back through its slot table: a prefilling
request alone (causal inside its new tokens), decoding requests together in one padded batch. The mask
comes from positions: causal, within the sliding window of sliding layers, within the attention chunk of
chunked layers (Llama 4).

The batch travels in a context variable, not a keyword argument: some decoder layers (StableLM's, for one)
do not forward extra keyword arguments to their attention, and a batch lost on the way would silently turn
the packed forward into a plain one over the new tokens only.

Outside :func:`paged_call` (a plain ``model(...)`` call: references, stitching repair, speculative drafts
on a ``DynamicCache``) it defers to the implementation the model had before, and the mask interface does
the same, so such calls compute exactly what they did before installation. Inside :func:`row_call` a plain
call runs the given row attention instead (the stitching repair: only its recomputed rows attend, each over
the keys up to its position, without a dense mask over every row).

:func:`check_attention_routing` checks with a one-token probe that every decoder layer's attention goes
through this function, sees keys/values of the shape its cache holds and gets the mask the model's mask
function made; models that route attention elsewhere (GPT-J, Falcon, Bloom: no ``AttentionInterface``),
cache something else than per-head keys and values (DeepSeek's multi-head latent attention caches the
compressed latent) or build their own mask inside the attention module (Doge's dynamic mask) are declined
with :class:`~kvb_cache.errors.UnsupportedModelError`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvb_cache.core.kv_storage import KVStorage, LayerShape
from kvb_cache.errors import UnsupportedModelError

NAME = "kvb_paged"
#: Config attribute recording the implementation calls without paged metadata go to.
FALLBACK_ATTR = "kvb_fallback_attn_implementation"


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillSeq:
    """A request feeding ``q_len`` tokens at packed offsets ``[start, start + q_len)``; ``slots`` ``[ctx]``
    index its whole context (cached + new), ``positions`` ``[ctx]`` are their positions (0..ctx-1)."""

    start: int
    q_len: int
    slots: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeGroup:
    """Requests feeding one token each: ``rows`` ``[B]`` packed offsets, ``slots`` ``[B, L]`` context slots
    padded with slot 0, ``valid`` ``[B, L]`` bool (False on pads), ``lengths`` ``[B]`` context lengths."""

    rows: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedBatch:
    """Everything attention needs for one step; plain tensors, built by the model runner."""

    storage: KVStorage
    #: ``[T]`` pool slot of every packed token.
    slot_mapping: torch.Tensor
    prefills: tuple[PrefillSeq, ...]
    decode: DecodeGroup | None


def _group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, Q, D]`` -> ``[B, KVH, G * Q, D]``: each key/value head attended by its ``G`` query heads at
    once (grouped-query attention without repeating keys and values; query rows are independent)."""
    b, heads, q_len, d = q.shape
    return q.reshape(b, kv_heads, (heads // kv_heads) * q_len, d)


def sink_column(sinks: torch.Tensor, kv_heads: int, q_len: int) -> torch.Tensor:
    """Per-head sink logits ``[H]`` laid out for grouped queries: ``[KVH, G * q_len, 1]`` (row ``g * q + i`` of
    key head ``h`` is query head ``h * G + g``)."""
    groups = sinks.shape[0] // kv_heads
    return sinks.view(kv_heads, groups, 1, 1).expand(kv_heads, groups, q_len, 1).reshape(kv_heads, -1, 1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float | None,
    softcap: float | None,
    causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` ``[B, H, Q, D]``, ``k``/``v`` ``[B, H, L, D]``, bool ``mask`` ``[B, 1, Q, L]`` -> ``[B, H, Q, Dv]``.

    ``sinks`` ``[H, Q, 1]`` (gpt-oss): a learned logit per head that joins every row's softmax as one more
    "key" with a zero value, so a row may give part of its attention to nothing.
    """
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, is_causal=causal)
    # SDPA has neither logit soft-capping (Gemma 2) nor sinks (gpt-oss): the eager formula, as transformers'
    # eager paths compute it.
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(
            k.shape[-2] - q.shape[-2]
        )
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:
        column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, column], dim=-1).float()
        probs = torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)


def _causal_mask(
    q_len: int, ctx: int, window: int | None, device: torch.device, chunk: int | None = None
) -> torch.Tensor:
    """``[q_len, ctx]`` bool: query ``i`` (position ``ctx - q_len + i``) sees key ``j <= `` its position,
    within the sliding window when there is one and inside its own attention chunk when there is one."""
    q_pos = torch.arange(ctx - q_len, ctx, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if chunk is not None:
        mask &= k_pos // chunk == q_pos // chunk
    return mask


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """Chunk size of a chunked-attention layer (Llama 4's local layers: a token sees only the keys of its own
    ``attention_chunk_size``-token chunk), else None. transformers puts the chunking in the mask, which paged
    calls do not build, so it is read from the config: ``layer_types[layer_idx] == "chunked_attention"``."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None) or ()
    layer = getattr(module, "layer_idx", -1)
    if 0 <= layer < len(layer_types) and layer_types[layer] == "chunked_attention":
        return config.attention_chunk_size
    return None


def _biased(mask: torch.Tensor | None) -> bool:
    """Whether a one-token probe's mask does more than let the token see itself (bool True / float 0)."""
    if not isinstance(mask, torch.Tensor):
        return False
    return bool((~mask).any()) if mask.dtype == torch.bool else bool((mask != 0).any())


#: The batch of the packed forward running now (set by :func:`paged_call`).
_PAGED: ContextVar[PagedBatch | None] = ContextVar("kvb_paged", default=None)
#: The row attention of the repair forward running now (set by :func:`row_call`).
_ROWS: ContextVar[Callable[..., torch.Tensor] | None] = ContextVar("kvb_row_attention", default=None)
#: Per layer, the ``(kv_heads, key_dim, value_dim, biased mask)`` attention saw during
#: :func:`check_attention_routing`.
_PROBE: ContextVar[dict[int, tuple[int, int, int, bool]] | None] = ContextVar("kvb_probe", default=None)


@contextlib.contextmanager
def paged_call(batch: PagedBatch) -> Iterator[None]:
    """Every attention layer of a model forward run inside reads and writes ``batch``'s pool slots."""
    token = _PAGED.set(batch)
    try:
        yield
    finally:
        _PAGED.reset(token)


@contextlib.contextmanager
def row_call(rows: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Every attention layer of a (plain, cached) forward run inside attends with ``rows``:
    ``rows(query, key, value, scaling=, softcap=, sinks=)`` -> ``[1, Q, H, Dv]``."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: ``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, KVH, T, D]`` ->
    ``([1, T, H, Dv], None)``. ``s_aux`` ``[H]``: gpt-oss's per-head attention-sink logits."""
    probe = _PROBE.get()
    if probe is not None:
        shape = (key.shape[1], key.shape[-1], value.shape[-1], _biased(attention_mask))
        probe[getattr(module, "layer_idx", -1)] = shape
    rows = _ROWS.get()
    if rows is not None:
        return rows(query, key, value, scaling=scaling, softcap=softcap, sinks=s_aux), None
    batch = _PAGED.get()
    if batch is None:
        extra = {
            k: v
            for k, v in (("sliding_window", sliding_window), ("softcap", softcap), ("s_aux", s_aux))
            if v is not None
        }
        return _fallback(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **extra, **kwargs
        )
    layer = module.layer_idx
    keys, values = batch.storage.keys[layer], batch.storage.values[layer]
    # NOTE: written before reading, so a request's own new tokens are part of the context it reads back.
    keys.index_copy_(1, batch.slot_mapping, key[0].to(keys.dtype))
    values.index_copy_(1, batch.slot_mapping, value[0].to(values.dtype))
    heads, kv_heads = query.shape[1], keys.shape[0]
    groups = heads // kv_heads
    chunk = _attention_chunk(module)
    out = query.new_empty((query.shape[2], heads, value.shape[-1]))  # [T, H, Dv]
    for seq in batch.prefills:
        q_len, ctx = seq.q_len, seq.slots.shape[0]
        q = _group_queries(query[:, :, seq.start : seq.start + q_len], kv_heads)  # [1, KVH, G*q, D]
        k = keys.index_select(1, seq.slots).unsqueeze(0)  # [1, KVH, ctx, D]
        v = values.index_select(1, seq.slots).unsqueeze(0)
        sinks = None if s_aux is None else sink_column(s_aux, kv_heads, q_len)
        if ctx == q_len and sliding_window is None and chunk is None and groups == 1:
            o = _attend(q, k, v, None, scaling=scaling, softcap=softcap, causal=True, sinks=sinks)
        else:
            mask = _causal_mask(q_len, ctx, sliding_window, q.device, chunk).repeat(groups, 1)[None, None]
            o = _attend(q, k, v, mask, scaling=scaling, softcap=softcap, sinks=sinks)  # [1, KVH, G*q, Dv]
        out[seq.start : seq.start + q_len] = o[0].reshape(heads, q_len, -1).transpose(0, 1)
    group = batch.decode
    if group is not None:
        rows_n, width = group.slots.shape
        q = query[0, :, group.rows].transpose(0, 1).reshape(rows_n, kv_heads, groups, -1)  # [B, KVH, G, D]
        flat = group.slots.reshape(-1)
        k = keys.index_select(1, flat).view(kv_heads, rows_n, width, -1).transpose(0, 1)  # [B, KVH, L, D]
        v = values.index_select(1, flat).view(kv_heads, rows_n, width, -1).transpose(0, 1)
        mask = group.valid
        k_pos = torch.arange(width, device=mask.device).unsqueeze(0)
        q_pos = group.lengths.unsqueeze(1) - 1  # [B, 1]: each row's query is its last context token
        if sliding_window is not None:
            mask = mask & (k_pos > q_pos - sliding_window)
        if chunk is not None:
            mask = mask & (k_pos // chunk == q_pos // chunk)
        sinks = None if s_aux is None else sink_column(s_aux, kv_heads, 1)
        o = _attend(q, k, v, mask[:, None, None, :], scaling=scaling, softcap=softcap, sinks=sinks)
        out[group.rows] = o.reshape(rows_n, heads, -1)  # o: [B, KVH, G, Dv]
    return out.unsqueeze(0), None


def _fallback(module: torch.nn.Module):
    name = getattr(module.config, FALLBACK_ATTR, "sdpa")
    if name == "eager":
        # transformers keeps each architecture's eager attention in its modeling module, not in the registry.
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _paged_mask(*args, config=None, **kwargs):
    """Mask interface for ``kvb_paged``: paged calls pass a prepared 4D mask (never reaching here); plain
    calls get the mask of the implementation the model had before."""
    fallback = getattr(config, FALLBACK_ATTR, "sdpa")
    return ALL_MASK_ATTENTION_FUNCTIONS[fallback](*args, config=config, **kwargs)


def _configs(model: PreTrainedModel) -> Sequence:
    config = model.config
    subs = [
        getattr(config, name) for name in getattr(config, "sub_configs", {}) if getattr(config, name, None)
    ]
    return [config, *subs]


def install_paged_attention(model: PreTrainedModel) -> None:
    """Register ``kvb_paged`` with transformers and switch ``model`` to it (idempotent).

    Plain forwards keep computing with the model's previous implementation (see the module docstring).
    """
    AttentionInterface.register(NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, _paged_mask)
    current = model.config._attn_implementation
    if current == NAME:
        return
    if current is None or current not in ALL_MASK_ATTENTION_FUNCTIONS:
        # An implementation registered without a mask function: plain calls get SDPA semantics.
        current = "sdpa"
    for config in _configs(model):
        setattr(config, FALLBACK_ATTR, current)
    model.set_attn_implementation(NAME)


def check_attention_routing(model: PreTrainedModel, shapes: Sequence[LayerShape]) -> None:
    """Raise :class:`UnsupportedModelError` unless a one-token forward of the (installed) model calls this
    module's attention once per layer with keys/values shaped as the layer's cache (``shapes``).

    A layer that never calls it computes attention some other way (the paged pool would never be written:
    every output wrong); keys that differ from the cached ones mean the cache holds something else (a
    compressed latent), which the pool's per-head layout cannot serve.
    """
    name = type(model).__name__
    seen: dict[int, tuple[int, int, int, bool]] = {}
    token = _PROBE.set(seen)
    try:
        ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
        with torch.inference_mode():
            model(input_ids=ids, position_ids=ids, use_cache=False)
    finally:
        _PROBE.reset(token)
    missing = [i for i in range(len(shapes)) if i not in seen]
    if missing:
        raise UnsupportedModelError(
            f"{name} does not compute attention through transformers' AttentionInterface (layers {missing[:4]}"
            f"{'...' if len(missing) > 4 else ''} never called it), so KVBoost's paged attention cannot serve "
            "it; supported are models whose attention honours `attn_implementation` (Llama, Qwen, Mistral, "
            "Gemma, Phi, GPT-2, GPT-NeoX, OLMo, gpt-oss, ...)"
        )
    for i, shape in enumerate(shapes):
        *got, biased = seen[i]
        if biased:
            raise UnsupportedModelError(
                f"{name} builds its own attention mask inside the attention module (layer {i}: a one-token "
                "forward's mask already masks or biases the token's own key, e.g. Doge's dynamic mask computed "
                "from the values of every cached token); KVBoost's paged attention builds the causal / "
                "sliding-window mask from positions and cannot reproduce it"
            )
        if tuple(got) != (shape.kv_heads, shape.key_dim, shape.value_dim):
            raise UnsupportedModelError(
                f"{name} caches something other than the keys/values its attention uses (layer {i}: cache "
                f"{shape.kv_heads} heads x {shape.key_dim}/{shape.value_dim} channels, attention "
                f"{got[0]} heads x {got[1]}/{got[2]}), e.g. the compressed latent of multi-head latent "
                "attention; KVBoost's pool stores per-head keys and values and cannot serve it"
            )


#: A prepared (early-exit) 4D mask: transformers returns 4D masks as they are, so paged calls build none.
def no_mask(device: torch.device) -> torch.Tensor:
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
