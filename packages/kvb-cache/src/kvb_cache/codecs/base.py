"""The codec interface: how a chunk's per-layer KV becomes a flat map of tensors and back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch

#: Flat, safetensors-ready tensors of one encoded chunk (names like ``"3.k.q"``).
TensorMap = Mapping[str, torch.Tensor]


class LayerPair(NamedTuple):
    """Dense keys and values of one layer, each ``[1, kv_heads, tokens, head_dim]``."""

    keys: torch.Tensor
    values: torch.Tensor


@runtime_checkable
class KVCodec(Protocol):
    """Turns dense per-layer KV into tensors and back.

    ``name`` identifies the codec *and its parameters* (``"kivi8-g32"``): it is written into every record
    and into the model fingerprint, so entries encoded differently never mix.
    """

    @property
    def name(self) -> str: ...

    @property
    def exact(self) -> bool:
        """True when decode(encode(x)) == x bit for bit."""
        ...

    def encode(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Encode every layer's ``(keys, values)``, each ``[1, kv_heads, tokens, head_dim]``."""
        ...

    def decode_layer(self, tensors: TensorMap, layer: int, *, tokens: int, dtype: torch.dtype) -> LayerPair:
        """Dense ``(keys, values)`` of ``layer``, each ``[1, kv_heads, tokens, head_dim]`` in ``dtype``."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodedKV:
    """A chunk's KV in encoded form, decoded one layer at a time when a cache is assembled.

    Attributes:
        codec: the codec that produced ``tensors``.
        tensors: the encoded tensors (what a record stores verbatim).
        num_layers: decoder layers.
        num_tokens: tokens of the chunk (the decoded sequence length).
        dtype: dtype of the dense KV that was encoded (and that decoding restores).
    """

    codec: KVCodec
    tensors: TensorMap
    num_layers: int
    num_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_tokens < 1:
            raise ValueError("an encoded chunk needs at least one layer and one token")

    @classmethod
    def from_dense(cls, codec: KVCodec, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> EncodedKV:
        keys = kv[0][0]
        return cls(
            codec=codec,
            tensors=codec.encode(kv),
            num_layers=len(kv),
            num_tokens=keys.shape[2],
            dtype=keys.dtype,
        )

    def layer(self, index: int) -> LayerPair:
        return self.codec.decode_layer(self.tensors, index, tokens=self.num_tokens, dtype=self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def layer_names(layer: int) -> tuple[str, str]:
    """Tensor-name prefixes of a layer's keys and values."""
    return f"{layer}.k", f"{layer}.v"
