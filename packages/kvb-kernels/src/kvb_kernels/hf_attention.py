"""``attn_implementation="kvb_attention"``: the kernels plugged into transformers through its registries.

Why not ``"kvb_flash"`` (the name first asked for): transformers 5.x decides "is this flash-attn?" by testing
whether the name *contains* ``"flash"`` (``utils.generic.is_flash_attention_requested``). A name like
``kvb_flash`` is then treated as a flash-attn kernel: ``set_attn_implementation`` tries to load it from the
Hugging Face hub (and raises), and models switch to flash-attn-only code paths. So the registered name avoids
that substring.

transformers looks attention up by name in ``AttentionInterface`` and builds the mask with the function of the
same name in ``AttentionMaskInterface``; a name missing from the mask registry makes transformers pass *no mask
at all* (it assumes a backend that handles masking itself), which silently breaks padding. ``kvb_attention``
is therefore registered in both, with transformers' own ``sdpa_mask``: the attention function then receives exactly
what ``sdpa`` receives (``None`` for plain causal, else a ``[batch, 1, q_len, kv_len]`` boolean mask encoding
padding, sliding windows, static-cache slots and packed sequences), so both paths agree by construction and the
fallback can hand the call to transformers' ``sdpa_attention_forward`` unchanged.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvb_kernels.attention import flash_attention
from kvb_kernels.backend import device_supported, dtype_supported
from kvb_kernels.checks import MAX_HEAD_DIM
from kvb_kernels.tier import flash_attention_available

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "kvb_attention"

# Keyword arguments whose non-default value the kernel does not implement; SDPA handles (or rejects) them.
_UNSERVED_KWARGS = ("position_bias", "softcap", "s_aux", "cache")
# Of those, the ones SDPA refuses (it raises on ``softcap``; ``s_aux`` sinks need the model's own eager code):
# such calls go to the model's eager attention instead, so installing the kernel never breaks a working model
# (Gemma 2's soft-capping is the known case).
_SDPA_REFUSES = ("softcap", "s_aux")


def register_kvb_attention() -> None:
    """Register ``kvb_attention`` in transformers' attention and mask registries (idempotent).

    Afterwards ``from_pretrained(..., attn_implementation="kvb_attention")`` and
    ``model.set_attn_implementation("kvb_attention")`` work.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvb_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def kvb_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention function (the ``AttentionInterface`` contract).

    NOTE: ``**kwargs`` is part of that contract (models pass position ids, sliding windows, ...); they are only
    forwarded to the SDPA fallback.

    Args:
        module: The calling attention module (``is_causal`` is read from it when not passed).
        query: ``[batch, heads, q_len, head_dim]``.
        key: ``[batch, kv_heads, kv_len, head_dim]`` (the whole cache, prefix plus new tokens).
        value: Same shape as ``key``.
        attention_mask: ``None`` or a boolean ``[batch, 1, q_len, kv_len]`` mask from ``sdpa_mask``.
        dropout: Attention dropout; any non-zero value goes to SDPA.
        scaling: Softmax scale.
        is_causal: Overrides ``module.is_causal``.

    Returns:
        ``([batch, q_len, heads, head_dim], None)``, like every transformers attention function; where it
        falls back to the model's eager attention (soft-capping, sinks, ``output_attentions``), that
        function's ``(output, attention weights [batch, heads, q_len, kv_len])``.
    """
    reason = _unserved_reason(query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        eager = _eager_attention(module) if _sdpa_refuses(kwargs) else None
        if eager is not None:
            _log_fallback_once(reason, "the model's eager attention (SDPA refuses this call)")
            return _call_eager(
                eager, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs
            )
        _log_fallback_once(reason)
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len = query.shape[2]
    if attention_mask is None:
        # Same reading of "no mask" as sdpa_attention_forward: a single query sees every key; with q_len > 1 the
        # mask was only skipped because keys == queries, or (static-cache prefill) the keys past q_len are empty
        # slots, which SDPA drops by slicing.
        causal = causal and q_len > 1
        if causal and key.shape[2] > q_len:
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    else:
        causal = False  # the mask already holds the causal pattern
    out = flash_attention(query, key, value, causal=causal, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2), None


def _unserved_reason(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict,
) -> str | None:
    """Why the kernel cannot serve this call (``None``: it can)."""
    if not device_supported(query.device):
        return f"kernel cannot run on {query.device.type} here (needs CUDA and Triton)"
    if not dtype_supported(query.dtype, query.device):
        return f"dtype {query.dtype} on {query.device.type}"
    if query.shape[-1] > MAX_HEAD_DIM or key.shape[-1] != query.shape[-1] or value.shape[-1] != key.shape[-1]:
        # A value head wider or narrower than the keys' (DeepSeek-V3's MLA) raised ShapeError from the kernel.
        return f"head_dim {query.shape[-1]} (key {key.shape[-1]}, value {value.shape[-1]})"
    if dropout:
        return "attention dropout > 0 (training)"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        # The kernel is forward-only: its output has no grad_fn, so training through it would silently give the
        # attention projections no gradient.
        return "autograd (query/key/value require grad; the kernel is forward-only: run inference under torch.no_grad())"
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4):
        return f"non-boolean or non-4D attention mask ({attention_mask.dtype}, {attention_mask.dim()}D)"
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    for name in _UNSERVED_KWARGS:
        if kwargs.get(name) is not None:
            return f"unsupported argument {name!r}"
    return None


def _sdpa_refuses(kwargs: dict) -> bool:
    return any(kwargs.get(name) is not None for name in _SDPA_REFUSES) or bool(
        kwargs.get("output_attentions")
    )


def _eager_attention(module: nn.Module) -> Callable | None:
    """The calling model's own ``eager_attention_forward`` (each transformers model module defines one)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _call_eager(
    eager: Callable,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run eager attention on what ``sdpa_mask`` produced for us.

    Eager code adds its mask to the scores, so the boolean keep-mask becomes an additive one, and "no mask"
    (transformers skipped it for plain causal attention) becomes the bottom-right causal mask it stands for -
    with a static cache, keys past ``q_len`` are then empty slots, dropped like ``sdpa_attention_forward`` does.
    """
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = attention_mask
    if mask is None and causal and q_len > 1:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        mask = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()[None, None]
    if mask is not None and mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        mask = additive.masked_fill(~mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


@functools.cache
def _log_fallback_once(reason: str, target: str = "transformers' SDPA attention") -> None:
    logger.warning("kvb_attention falls back to %s: %s (logged once per reason)", target, reason)


def _attention_modules(model: nn.Module, implementation: str) -> int:
    """Attention modules whose config selects ``implementation``.

    NOTE: transformers has no public list of attention modules; every modern one is a ``*Attention`` module that
    reads ``self.config._attn_implementation`` on each call, which is what this counts.
    """
    return sum(
        1
        for module in model.modules()
        if type(module).__name__.endswith("Attention")
        and getattr(getattr(module, "config", None), "_attn_implementation", None) == implementation
    )


def install_flash_attention(model: PreTrainedModel) -> int:
    """Switch ``model`` to ``kvb_attention`` through ``set_attn_implementation``.

    Calls the kernel cannot serve (CPU without the interpreter, an unsupported dtype or head dim) fall back to
    transformers' SDPA, logged once per reason.

    Returns:
        How many attention modules now use ``kvb_attention``.
    """
    register_kvb_attention()
    if not flash_attention_available():
        logger.warning("kvb_attention installed, but no kernel can run here: every call will use SDPA")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return _attention_modules(model, ATTN_IMPLEMENTATION)


def uninstall_flash_attention(model: PreTrainedModel, *, restore: str = "sdpa") -> int:
    """Switch a model that uses ``kvb_attention`` back to ``restore`` (default ``"sdpa"``).

    Returns:
        How many attention modules were switched away from ``kvb_attention`` (0 if it was not installed).
    """
    before = _attention_modules(model, ATTN_IMPLEMENTATION)
    if before:
        model.set_attn_implementation(restore)
    return before - _attention_modules(model, ATTN_IMPLEMENTATION)
