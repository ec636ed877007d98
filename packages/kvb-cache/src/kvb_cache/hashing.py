"""Content-addressed chunk keys.

``prefix_hash = SHA-256(parent.prefix_hash || tokens)`` identifies a chunk *and everything before it*: equal
prefix hashes mean equal KV (exact reuse). ``content_hash = SHA-256(root || "content" || tokens)`` identifies
the tokens alone (the KV differs by position and history: approximate reuse). Tokens are hashed as
little-endian uint32 so keys are identical across processes and machines; the chain is rooted in the
model fingerprint, so two models or two codecs never share an entry.

A request's ``cache_salt`` (tenant isolation) re-roots its chain: ``salted_root(root, salt)`` replaces the
fingerprint root, so every key below it (RAM blocks, stitching chunks, disk and Redis records) differs from
the unsalted chain and from every other salt. Without a salt the root is the fingerprint root unchanged,
so records written before salts existed keep hitting.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

ChunkHash = NewType("ChunkHash", bytes)

_CONTENT_TAG = b"\x00content\x00"
_SALT_TAG = b"kvboost/salt/v1\x00"
_APPROX_TAG = b"kvboost/approximate/v1\x00"


def token_bytes(ids: Sequence[int]) -> bytes:
    """Little-endian uint32 encoding of token ids (vocabularies stay far below 2**32)."""
    words = array("I", ids)
    if sys.byteorder != "little":
        words.byteswap()
    return words.tobytes()


def root_hash(fingerprint: str) -> ChunkHash:
    """The parent of every first chunk: the model fingerprint itself."""
    return ChunkHash(hashlib.sha256(b"kvboost/chunk/v1\x00" + fingerprint.encode()).digest())


def prefix_hash(parent: ChunkHash, ids: Sequence[int]) -> ChunkHash:
    return ChunkHash(hashlib.sha256(parent + token_bytes(ids)).digest())


def content_hash(root: ChunkHash, ids: Sequence[int]) -> ChunkHash:
    return ChunkHash(hashlib.sha256(root + _CONTENT_TAG + token_bytes(ids)).digest())


def salted_root(root: ChunkHash, salt: str | None) -> ChunkHash:
    """The chain root of requests carrying ``salt``: ``root`` itself for None, else a root no other salt
    (and no unsalted request) can reach. The fixed-length ``root`` comes first, so ``(root, salt)`` pairs
    never collide by concatenation."""
    if salt is None:
        return root
    return ChunkHash(hashlib.sha256(_SALT_TAG + root + salt.encode("utf-8", "surrogatepass")).digest())


def approximate_root(root: ChunkHash) -> ChunkHash:
    """The chain root of chunks whose KV is approximate (computed over stitched KV): their keys are prefix
    hashes from this root, which no prefix lookup starts from, so only a content lookup (stitching) can
    reach them. Their content hashes stay rooted in ``root``."""
    return ChunkHash(hashlib.sha256(_APPROX_TAG + root).digest())
