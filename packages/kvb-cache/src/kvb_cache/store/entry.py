"""One cached chunk: its keys, its tokens and its KV."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvb_cache.hashing import ChunkHash

if TYPE_CHECKING:
    from kvb_cache.codecs import EncodedKV

#: Per layer, ``(keys, values)`` each ``[1, kv_heads, tokens, head_dim]``.
LayerKV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(slots=True, kw_only=True, eq=False)
class ChunkEntry:
    """A chunk's KV as computed in context by the forward that produced it.

    ``key`` is the prefix hash (this chunk plus everything before it), ``parent`` the prefix hash of the
    preceding chunk (or the fingerprint root). ``complete`` is False for a stored partial tail, which only
    serves token-granular matches and never has children.

    The KV is either dense (``kv``, the exact path: no copy, no conversion) or ``encoded`` by a codec
    (quantized tiers; ``kv`` is then empty). Read it through :meth:`layer`, which works for both.
    """

    key: ChunkHash
    parent: ChunkHash
    content: ChunkHash
    token_ids: tuple[int, ...]
    kv: LayerKV = ()
    start: int
    complete: bool = True
    nbytes: int = 0
    encoded: EncodedKV | None = None
    #: False for KV computed over stitched (approximate) KV: stored under an approximate chain
    #: (:func:`kvb_cache.hashing.approximate_root`), reachable by stitching's content lookup only.
    exact: bool = True
    #: True when some of its tokens' KV was copied from another stored chunk (stitched, not recomputed): an
    #: approximate entry that is not an independent copy of its tokens, so stitching never averages it with
    #: the copy it came from (:func:`kvb_cache.stitch_lookup.copy_pieces`).
    derived: bool = False
    # Bookkeeping owned by the store (under its lock).
    hits: int = field(default=0)
    last_used: int = field(default=0)

    def __post_init__(self) -> None:
        if self.encoded is not None and self.kv:
            raise ValueError("a ChunkEntry holds either dense kv or encoded kv, not both")
        if not self.nbytes:
            if self.encoded is not None:
                self.nbytes = self.encoded.nbytes
            else:
                self.nbytes = sum(
                    k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv
                )

    @property
    def num_layers(self) -> int:
        return self.encoded.num_layers if self.encoded is not None else len(self.kv)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``(keys, values)`` of layer ``index``, each ``[1, kv_heads, tokens, head_dim]``.

        Dense entries return their stored tensors (views, never written in place); encoded entries
        decode a fresh pair.
        """
        if self.encoded is None:
            return self.kv[index]
        return tuple(self.encoded.layer(index))

    def dense(self) -> LayerKV:
        """Every layer's dense ``(keys, values)``."""
        return self.kv if self.encoded is None else tuple(self.layer(i) for i in range(self.num_layers))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
