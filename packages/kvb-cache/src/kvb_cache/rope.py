"""Re-positioning cached keys: RoPE is a rotation, so moving a key from position p to q is one more rotation.

A rotary model stores ``k_rot(p) = s * (k * cos(p f) + rotate(k) * sin(p f))`` where ``f`` are the inverse
frequencies of its RoPE variant (default, linear, YaRN, llama3, ...) and ``s`` its ``attention_scaling``
(1 except YaRN/longrope, which scale cos and sin). Rotations compose, ``R(q f) = R((q - p) f) R(p f)``, so

    k_rot(q) = R((q - p) f) k_rot(p)        (with unscaled cos/sin: ``s`` is already inside k_rot(p))

We never hand-roll frequency tables or layouts: the cos/sin come from the model's own rotary-embedding
module (evaluated at the position *difference*, divided by its attention scaling) and the rotation is the
model module's own ``apply_rotary_pos_emb``. That function knows the model's layout (half-split
``rotate_half`` or interleaved; ``(q, k, cos, sin)`` or Gemma 3n/4's one-tensor ``(x, cos, sin)``); with
partial rotary (Phi, StableLM, GPT-NeoX) only the first ``partial_rotary_factor * head_dim`` channels are
handed to it, except with proportional RoPE (Gemma 4), whose tables span the whole head.

Declined, with a reason: absolute position embeddings (GPT-2: the position is added to the hidden state,
every layer's KV depends on it), models without a standard rotary module, and RoPE variants whose
frequencies depend on the sequence length (dynamic NTK, longrope): the frequencies a stored key was rotated
with depend on how long the request that computed it was, which the store does not record.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.kv_sharing import own_kv_layers

# Frequencies change with the sequence length: a stored key's rotation is not a function of its position.
_LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RepositionSupport:
    """Whether a model's cached keys can be moved to new positions, and if not, why."""

    supported: bool
    reason: str = ""


def _rotary_module(model: PreTrainedModel) -> nn.Module | None:
    base = getattr(model, "model", None) or getattr(model, model.base_model_prefix, None) or model
    rotary = getattr(base, "rotary_emb", None)
    return rotary if isinstance(rotary, nn.Module) else None


def _apply_function(model: PreTrainedModel) -> Callable | None:
    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None:
        return None
    params = list(inspect.signature(fn).parameters)
    # The Llama-family signature ``(q, k, cos, sin, ...)``; GPT-J style ``(tensor, sin, cos)`` is not it.
    if params[:4] == ["q", "k", "cos", "sin"]:
        return fn
    if params[:3] == ["x", "cos", "sin"]:
        # One tensor at a time (Gemma 3n, Gemma 4: the same function rotates queries and keys), with the
        # Llama-family default layout ``[batch, heads, tokens, head_dim]`` (unsqueeze_dim=1).
        return lambda q, k, cos, sin: (q, fn(k, cos, sin))
    return None


@torch.no_grad()
def _nope_layers(model: PreTrainedModel) -> frozenset[int]:
    """Layers whose keys carry no position (NoPE), found by computing one token's keys at positions 0 and 1.

    Configs say it in different ways (SmolLM3's and Llama 4's ``no_rope_layers``, Cohere 2's rotary-free
    full-attention layers, only visible in its modeling code), so the model is asked: with a single token,
    attention over one key returns its value whatever the position, so every layer's input is the same at
    both positions and a layer's keys differ exactly when it rotates them.
    """
    # Not the padding token: its embedding is often zero, and so would be its keys at every position.
    pad = model.config.get_text_config(decoder=True).pad_token_id
    ids = torch.full((1, 1), 2 if pad == 1 else 1, dtype=torch.long, device=model.device)
    keys = []
    for position in (0, 1):
        cache = DynamicCache(config=model.config)
        model(
            input_ids=ids,
            position_ids=torch.full_like(ids, position),
            **cache_kwargs(model, cache),
            use_cache=True,
        )
        keys.append([layer.keys for layer in own_kv_layers(cache)])
    return frozenset(i for i, (at0, at1) in enumerate(zip(*keys)) if torch.equal(at0, at1))


def _partial_factors(config, per_type: bool) -> dict[str | None, float]:
    """Share of each key's channels that :meth:`KeyRepositioner.reposition` hands to the rotation, per layer
    type: ``partial_rotary_factor`` (transformers 5 keeps it in ``rope_parameters``, per layer type for
    models with several RoPE tables; older configs as an attribute or GPT-NeoX's ``rotary_pct``).

    ``proportional`` RoPE (Gemma 4's global layers) is the exception: its tables span the whole head
    (frequency 0, the identity, on the channels past the factor), so every channel goes to the rotation.
    """
    params = getattr(config, "rope_parameters", None) or {}
    default = getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None) or 1.0

    def factor(p: dict) -> float:
        return 1.0 if p.get("rope_type") == "proportional" else float(p.get("partial_rotary_factor", default))

    if per_type:
        # A layer type without parameters has no RoPE (Beam's full-attention layers): its layers are found
        # to be NoPE by their keys (``_nope_layers``) and never rotated.
        return {kind: factor(p) for kind, p in params.items() if p is not None}
    return {None: factor(params)}


class KeyRepositioner:
    """Rotates cached keys of one model from their stored positions to new ones.

    Build it with :meth:`for_model`; check :attr:`support` before calling :meth:`reposition`.
    """

    def __init__(
        self,
        *,
        support: RepositionSupport,
        rotary: nn.Module | None = None,
        apply_fn: Callable | None = None,
        layer_types: tuple[str | None, ...] = (),
        partial: dict[str | None, float] | None = None,
        nope_layers: frozenset[int] = frozenset(),
    ) -> None:
        self.support = support
        #: Layers without RoPE (SmolLM3, Cohere 2, Llama 4 "NoPE" layers): their keys carry no position to move.
        self._nope = nope_layers
        #: Per layer type (None: every layer), the share of each key's channels that rotate.
        self._partial = partial or {}
        self._rotary = rotary
        self._apply = apply_fn
        self._layer_types = layer_types

    @classmethod
    def for_model(cls, model: PreTrainedModel, *, absolute_positions: bool) -> KeyRepositioner:
        name = type(model).__name__
        if absolute_positions:
            return cls(
                support=RepositionSupport(
                    supported=False,
                    reason=f"{name} uses absolute position embeddings: cached KV cannot be moved to a new position",
                )
            )
        rotary, apply_fn = _rotary_module(model), _apply_function(model)
        if rotary is None or apply_fn is None:
            return cls(
                support=RepositionSupport(
                    supported=False,
                    reason=f"{name} has no standard rotary embedding module / apply_rotary_pos_emb to re-position keys with",
                )
            )
        rope_type = getattr(rotary, "rope_type", "default")
        per_type = isinstance(rope_type, dict)
        kinds = set(rope_type.values()) if per_type else {rope_type}
        if kinds & _LENGTH_DEPENDENT:
            return cls(
                support=RepositionSupport(
                    supported=False,
                    reason=f"{name} uses {sorted(kinds & _LENGTH_DEPENDENT)} RoPE whose frequencies depend on the "
                    "request length; stored keys cannot be re-rotated reliably",
                )
            )
        config = model.config.get_text_config(decoder=True)
        if "chunked_attention" in (getattr(config, "layer_types", None) or ()):
            # NOTE: the stitching repair forward masks causally or by sliding window, never by chunk.
            return cls(
                support=RepositionSupport(
                    supported=False,
                    reason=f"{name} has chunked-attention layers, which the stitching repair forward cannot mask",
                )
            )
        num_layers = int(config.num_hidden_layers)
        layer_types = tuple(config.layer_types) if per_type else (None,) * num_layers
        return cls(
            support=RepositionSupport(supported=True),
            rotary=rotary,
            apply_fn=apply_fn,
            layer_types=layer_types,
            partial=_partial_factors(config, per_type),
            nope_layers=_nope_layers(model),
        )

    def _cos_sin(
        self, delta: torch.Tensor, layer_type: str | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscaled ``cos/sin(delta * f)`` ``[1, T, rotary_dim]`` from the model's own module."""
        assert self._rotary is not None
        probe = torch.zeros(1, dtype=dtype, device=delta.device)
        if layer_type is None:
            cos, sin = self._rotary(probe, delta)
            scaling = getattr(self._rotary, "attention_scaling", 1.0)
        else:
            cos, sin = self._rotary(probe, delta, layer_type)
            scaling = getattr(self._rotary, f"{layer_type}_attention_scaling", 1.0)
        return cos / scaling, sin / scaling

    @torch.no_grad()
    def reposition_many(self, items: Sequence[tuple[Any, int, int]]) -> list[tuple]:
        """:meth:`reposition` of several pieces, ``(layers_kv, old_start, new_start)`` each, with one rotation
        per layer over all of their keys (concatenated along the tokens, each token with its own position
        difference) instead of one per piece and layer.

        The rotation is elementwise, so every key equals :meth:`reposition`'s bit for bit; a stitch of 20
        chunks on a 30-layer model made 600 calls of about ten small ops each (14% of a bf16 prefill's CPU
        time on SmolLM2-135M, and as many kernel launches on a GPU). Pieces on other devices or in other
        dtypes than the first moving one are moved one by one.

        Returns:
            Per item, per layer ``(keys, values)``; the rotated keys are views of one tensor per layer.
        """
        if not self.support.supported:
            raise ValueError(f"cannot re-position keys: {self.support.reason}")
        moving = [i for i, (_, old, new) in enumerate(items) if old != new]
        if not moving:
            return [tuple((k, v) for k, v in kv) for kv, _, _ in items]
        first = items[moving[0]][0][0][0]
        if any((k := items[i][0][0][0]).device != first.device or k.dtype != first.dtype for i in moving):
            return [self.reposition_many([item])[0] for item in items]
        lengths = [items[i][0][0][0].shape[2] for i in moving]
        delta = torch.cat(
            [
                torch.full((1, n), items[i][2] - items[i][1], dtype=torch.long, device=first.device)
                for i, n in zip(moving, lengths)
            ],
            dim=1,
        )
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        per_layer: list[tuple[torch.Tensor, ...] | None] = []
        for layer in range(len(items[moving[0]][0])):
            if layer in self._nope:
                per_layer.append(None)
                continue
            keys = torch.cat([items[i][0][layer][0] for i in moving], dim=2)
            per_layer.append(self._rotate(keys, delta, layer, tables).split(lengths, dim=2))
        out: list[tuple] = [tuple((k, v) for k, v in kv) for kv, _, _ in items]
        for slot, i in enumerate(moving):
            out[i] = tuple(
                (kv[0] if rotated is None else rotated[slot], kv[1])
                for kv, rotated in zip(items[i][0], per_layer)
            )
        return out

    def _rotate(
        self,
        keys: torch.Tensor,
        delta: torch.Tensor,
        layer: int,
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """``keys`` ``[1, kv_heads, T, head_dim]`` rotated by ``delta`` ``[1, T]`` positions (fp32, returned
        in the keys' dtype); ``tables`` caches cos/sin per layer type for this ``delta``."""
        kind = self._layer_types[layer] if layer < len(self._layer_types) else None
        k32 = keys if keys.dtype == torch.float64 else keys.float()
        if kind not in tables:
            tables[kind] = self._cos_sin(delta, kind, k32.dtype)
        cos, sin = tables[kind]
        # Partial rotary (Phi, StableLM, GPT-NeoX, GLM): the first ``factor * head_dim`` channels rotate,
        # the rest pass through. Some modules split before calling ``apply_rotary_pos_emb`` (Phi,
        # StableLM), others inside it; splitting here serves both. (Not ``cos.shape[-1]``: gpt-oss's
        # tables are half the rotated width.)
        rot = int(k32.shape[-1] * self._partial.get(kind, 1.0))
        # The model's own rotation and layout (queries unused, k passed twice).
        _, rotated = self._apply(k32[..., :rot], k32[..., :rot], cos, sin)
        if rot < k32.shape[-1]:
            rotated = torch.cat([rotated, k32[..., rot:]], dim=-1)
        return rotated.to(keys.dtype)

    @torch.no_grad()
    def reposition(self, layers_kv, old_start: int, new_start: int):
        """Keys moved from positions ``[old_start, old_start + T)`` to ``[new_start, new_start + T)``.

        Args:
            layers_kv: per layer ``(keys, values)``, each ``[1, kv_heads, T, head_dim]``.

        Returns:
            The same structure with rotated keys (new tensors, in the keys' dtype) and the values unchanged.
            Rotation runs in fp32 whatever the storage dtype.
        """
        return self.reposition_many([(layers_kv, old_start, new_start)])[0]
