"""Re-express a chunk entry in another codec (RAM and a lower tier may store different forms)."""

from __future__ import annotations

from kvb_cache.codecs import EncodedKV, KVCodec
from kvb_cache.store import ChunkEntry


def with_codec(entry: ChunkEntry, codec: KVCodec) -> ChunkEntry:
    """``entry`` held in ``codec``: itself when already so, else a new entry (dense for the exact codec).

    Going from one lossy codec to another decodes to dense first, so errors add up: keep RAM and lower
    tiers on the same codec unless the wire codec is wanted for transfer size.
    """
    current = entry.encoded.codec.name if entry.encoded is not None else "none"
    if current == codec.name:
        return entry
    dense = entry.dense()
    kv, encoded = (dense, None) if codec.exact else ((), EncodedKV.from_dense(codec, dense))
    return ChunkEntry(
        key=entry.key,
        parent=entry.parent,
        content=entry.content,
        token_ids=entry.token_ids,
        kv=kv,
        encoded=encoded,
        start=entry.start,
        complete=entry.complete,
    )
