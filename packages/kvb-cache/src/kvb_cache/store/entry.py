"""One cached chunk: its keys, its tokens and its KV."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvb_cache.hashing import ChunkHash

#: Per layer, ``(keys, values)`` each ``[1, kv_heads, tokens, head_dim]``.
LayerKV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(slots=True, kw_only=True, eq=False)
class ChunkEntry:
    """A chunk's KV as computed in context by the forward that produced it.

    ``key`` is the prefix hash (this chunk plus everything before it), ``parent`` the prefix hash of the
    preceding chunk (or the fingerprint root). ``complete`` is False for a stored partial tail, which only
    serves token-granular matches and never has children.
    """

    key: ChunkHash
    parent: ChunkHash
    content: ChunkHash
    token_ids: tuple[int, ...]
    kv: LayerKV
    start: int
    complete: bool = True
    nbytes: int = 0
    # Bookkeeping owned by the store (under its lock).
    hits: int = field(default=0)
    last_used: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
