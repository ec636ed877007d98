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

:func:`~kvb_cache.core.attention_routing.check_attention_routing` checks with a one-token probe that every
decoder layer's attention goes through this function (the attention arithmetic itself is
:mod:`kvb_cache.core.attend`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvb_cache.core.attend import attend, causal_mask, group_queries, sink_column
from kvb_cache.core.attention_routing import record_layer
from kvb_cache.core.kv_dtype import gather, put
from kvb_cache.core.paged_batch import DecodeGroup, PagedBatch, PrefillSeq
from kvb_cache.core.pool_kernel import KERNEL_MAX_HEAD_DIM, pages

NAME = "kvb_paged"
#: Most context positions decoding rows gather from the pool at once (rows x padded width), per layer.
DECODE_GATHER_TOKENS = 1 << 16
#: Most elements of one prefill attention call's position mask (grouped query rows x keys); longer slices
#: over longer contexts are attended in blocks of query rows.
PREFILL_MASK_ELEMENTS = 1 << 24
#: Config attribute recording the implementation calls without paged metadata go to.
FALLBACK_ATTR = "kvb_fallback_attn_implementation"


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


#: The batch of the packed forward running now (set by :func:`paged_call`).
_PAGED: ContextVar[PagedBatch | None] = ContextVar("kvb_paged", default=None)
#: The row attention of the repair forward running now (set by :func:`row_call`).
_ROWS: ContextVar[Callable[..., torch.Tensor] | None] = ContextVar("kvb_row_attention", default=None)


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
    record_layer(module, key, value, attention_mask)
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
    source = batch.storage.shared.get(layer, layer)
    keys, values = batch.storage.keys[source], batch.storage.values[source]
    if source == layer:
        # NOTE: written before reading, so a request's own new tokens are part of the context it reads back
        # (in the pool's precision: a prefix read back later is exactly what its request attended).
        # (No conversion when the dtypes agree, the usual case: even a no-op is host work in every layer.)
        put(keys, batch.slot_mapping, key[0])
        put(values, batch.slot_mapping, value[0])
    # else: a KV-shared layer (Gemma 3n / Gemma 4 E2B) is passed its producer's keys/values, which that
    # earlier layer of this forward already wrote into the slots read here.
    heads = query.shape[1]
    chunk = _attention_chunk(module)
    if batch.kernel is not None and _kernel_serves(query, keys, values, chunk, softcap, s_aux):
        return _kernel_attention(batch, query, keys, values, sliding_window, scaling), None
    group = batch.decode
    if batch.decode_only:
        assert group is not None
        rows_n, width = group.slots.shape
        if rows_n * width <= DECODE_GATHER_TOKENS:
            # A decode-only step in one gather: its result is the layer's output as it is (no buffer, no
            # copy; decode steps of small models are bound by the host's work per op, not by the GPU).
            whole = slice(0, rows_n)
            o = _decode_rows(
                query, keys, values, group, whole, sliding_window, chunk, scaling, softcap, s_aux
            )
            return o.unsqueeze(0), None
    out = query.new_empty((query.shape[2], heads, value.shape[-1]))  # [T, H, Dv]
    # Prefill masks are kept for the step's other layers only while all of them together stay within one
    # block's bound (PREFILL_MASK_ELEMENTS, what the GPU budget charges); beyond it every layer rebuilds.
    groups = heads // keys.shape[0]
    keep = groups * sum(p.q_len * p.slots.shape[0] for p in batch.prefills) <= PREFILL_MASK_ELEMENTS
    for seq in batch.prefills:
        # In a function of its own so that its gathered context and masks are freed before the decoding
        # rows gather theirs (they held on as loop variables, and the two peaks added up).
        _prefill_rows(seq, query, keys, values, out, sliding_window, chunk, scaling, softcap, s_aux, keep)
    if group is not None:
        rows_n, width = group.slots.shape
        # Decoding rows gather their context padded to the longest one; in sub-batches of at most
        # DECODE_GATHER_TOKENS gathered positions, so the step's transient keys/values stay bounded
        # (gather_bytes) however many long requests decode together.
        per = max(1, DECODE_GATHER_TOKENS // width)
        for first in range(0, rows_n, per):
            part = slice(first, min(first + per, rows_n))
            out[group.rows_at(part)] = _decode_rows(
                query, keys, values, group, part, sliding_window, chunk, scaling, softcap, s_aux
            )
    return out.unsqueeze(0), None


def _kernel_serves(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> bool:
    """Whether the block-table kernel computes this layer's attention: causal with an optional sliding window,
    one head size for queries, keys and values (at most :data:`KERNEL_MAX_HEAD_DIM`), the pool's dtype.
    Soft-capped (Gemma 2), sink (gpt-oss) and chunked (Llama 4) layers keep the gather + SDPA path."""
    return (
        chunk is None
        and softcap is None
        and s_aux is None
        and query.dtype == keys.dtype
        and query.shape[-1] == keys.shape[-1] == values.shape[-1] <= KERNEL_MAX_HEAD_DIM
    )


def _kernel_attention(
    batch: PagedBatch,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sliding_window: int | None,
    scaling: float | None,
) -> torch.Tensor:
    """``[1, T, H, D]``: every prefilling request's rows, then all decoding rows in one call, attended by
    ``batch.kernel`` over the pool's blocks in place (no gathered context, no mask)."""
    block_size = batch.storage.block_size
    key_pages, value_pages = pages(keys, block_size), pages(values, block_size)
    # A decode-only step returns the kernel's output as it is: no buffer to copy it into.
    out = None if batch.decode_only else query.new_empty((query.shape[2], query.shape[1], query.shape[-1]))
    for seq in batch.prefills:
        assert out is not None
        rows = slice(seq.start, seq.start + seq.q_len)
        o = batch.kernel(
            query[:, :, rows],
            key_pages,
            value_pages,
            seq.block_table,
            seq.kv_len,
            window=sliding_window,
            scale=scaling,
            max_len=seq.slots.shape[0],
        )  # [1, H, q, D]
        out[rows] = o[0].transpose(0, 1)
    group = batch.decode
    if group is not None:
        rows = group.rows_at(slice(0, group.slots.shape[0]))
        q = query[0, :, rows].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        o = batch.kernel(
            q,
            key_pages,
            value_pages,
            group.block_table,
            group.kv_lens,
            window=sliding_window,
            scale=scaling,
            max_len=group.slots.shape[1],  # the padded width: the longest context, known on the host
        )
        if out is None:
            return o[:, :, 0].unsqueeze(0)
        out[rows] = o[:, :, 0]
    return out.unsqueeze(0)


def _prefill_rows(
    seq: PrefillSeq,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    out: torch.Tensor,
    sliding_window: int | None,
    chunk: int | None,
    scaling: float | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    keep_mask: bool = False,
) -> None:
    """Attention of one prefilling request's ``q_len`` new rows over its whole context, written into
    ``out`` ``[T, H, Dv]`` at the request's packed offsets. ``keep_mask``: a mask built in one block is kept
    in ``seq.masks`` for the step's other layers."""
    heads, kv_heads = query.shape[1], keys.shape[0]
    groups = heads // kv_heads
    q_len, ctx = seq.q_len, seq.slots.shape[0]
    k = gather(keys, seq.slots, query.dtype).unsqueeze(0)  # [1, KVH, ctx, D]
    v = gather(values, seq.slots, query.dtype).unsqueeze(0)
    if ctx == q_len and sliding_window is None and chunk is None and groups == 1:
        q = query[:, :, seq.start : seq.start + q_len]  # [1, H, q, D]: no mask at all
        sinks = None if s_aux is None else sink_column(s_aux, kv_heads, q_len)
        o = attend(q, k, v, None, scaling=scaling, softcap=softcap, causal=True, sinks=sinks)
        out[seq.start : seq.start + q_len] = o[0].transpose(0, 1)
        return
    # The [G * rows, keys] position mask is built for a block of query rows at a time, at most
    # PREFILL_MASK_ELEMENTS, so a long slice over a long context does not hold one of G * q * ctx (SDPA
    # also makes a float copy of it); each block attends the keys up to its own last position.
    block = prefill_block_rows(groups, ctx)
    # One block (the usual case): its mask is the same in every layer of this window, built once per step.
    # Several blocks are built one at a time in every layer instead, holding one at once (bounded memory).
    cached = (groups, sliding_window, chunk) if keep_mask and block >= q_len else None
    for first in range(0, q_len, block):
        last = min(first + block, q_len)
        seen = ctx - q_len + last
        q = group_queries(query[:, :, seq.start + first : seq.start + last], kv_heads)  # [1, KVH, G*b, D]
        mask = seq.masks.get(cached) if cached is not None else None
        if mask is None:
            mask = causal_mask(last - first, seen, sliding_window, q.device, chunk).repeat(groups, 1)[
                None, None
            ]
            if cached is not None:
                seq.masks[cached] = mask
        sinks = None if s_aux is None else sink_column(s_aux, kv_heads, last - first)
        o = attend(
            q,
            k[:, :, :seen],
            v[:, :, :seen],
            mask,
            scaling=scaling,
            softcap=softcap,
            sinks=sinks,
        )  # [1, KVH, G*b, Dv]
        out[seq.start + first : seq.start + last] = o[0].reshape(heads, last - first, -1).transpose(0, 1)


def _decode_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: DecodeGroup,
    part: slice,
    sliding_window: int | None,
    chunk: int | None,
    scaling: float | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of the decoding rows ``part`` of ``group``: ``[b, H, Dv]`` for its ``b`` rows."""
    slots = group.slots[part]
    rows_n, width = slots.shape
    heads, kv_heads = query.shape[1], keys.shape[0]
    q = query[0, :, group.rows_at(part)].transpose(0, 1).reshape(rows_n, kv_heads, heads // kv_heads, -1)
    flat = slots.reshape(-1)
    k = gather(keys, flat, query.dtype).view(kv_heads, rows_n, width, -1).transpose(0, 1)  # [b, KVH, L, D]
    v = gather(values, flat, query.dtype).view(kv_heads, rows_n, width, -1).transpose(0, 1)
    key = (part.start, part.stop, sliding_window, chunk)
    mask = group.masks.get(key)
    if mask is None:  # the first layer of the step with this window builds it; the others reuse it
        mask = group.masks[key] = _decode_mask(group, part, sliding_window, chunk)
    sinks = None if s_aux is None else sink_column(s_aux, kv_heads, 1)
    o = attend(q, k, v, mask, scaling=scaling, softcap=softcap, sinks=sinks)
    return o.reshape(rows_n, heads, -1)  # o: [b, KVH, G, Dv]


def _decode_mask(
    group: DecodeGroup, part: slice, sliding_window: int | None, chunk: int | None
) -> torch.Tensor:
    """``[b, 1, 1, L]`` bool: the keys each decoding row of ``part`` sees (its context, within the window and
    its own attention chunk when the layer has one)."""
    mask, lengths = group.valid[part], group.lengths[part]
    k_pos = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    q_pos = lengths.unsqueeze(1) - 1  # [b, 1]: each row's query is its last context token
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - sliding_window)
    if chunk is not None:
        mask = mask & (k_pos // chunk == q_pos // chunk)
    return mask[:, None, None, :]


def prefill_block_rows(groups: int, ctx: int) -> int:
    """Query rows of one prefill attention call over ``ctx`` keys: its ``[groups * rows, ctx]`` mask holds at
    most :data:`PREFILL_MASK_ELEMENTS` elements (one row at least)."""
    return max(1, PREFILL_MASK_ELEMENTS // (groups * ctx))


def gather_bytes(max_model_len: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    """Most bytes one layer's gathered keys + values take during a step: a prefill gathers its request's
    whole context (at most ``max_model_len``), decoding rows at most :data:`DECODE_GATHER_TOKENS` positions
    at a time (or one row of ``max_model_len``). What the GPU budget charges beside the profiled forward."""
    return 2 * max(DECODE_GATHER_TOKENS, max_model_len) * kv_heads * head_dim * element_size


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


#: A prepared (early-exit) 4D mask: transformers returns 4D masks as they are, so paged calls build none.
def no_mask(device: torch.device) -> torch.Tensor:
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
