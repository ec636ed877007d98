"""Self-describing, checksummed chunk records: the bytes the disk and Redis tiers store.

Layout: ``MAGIC (8 bytes) | sha256 of the rest (32 bytes) | safetensors blob``. The safetensors header
carries the tensor names, dtypes and shapes; its ``__metadata__`` carries the record fields (format version,
model fingerprint, codec, dense dtype, layer and token counts, the chunk's hashes and start position). The
token ids travel as an int64 tensor. Nothing is pickled: safetensors is plain JSON plus raw bytes.

A record is trusted only when the checksum matches, the fingerprint and codec are the reader's, and the
stored hashes recompute from the stored tokens (so a record can never be served under another key). A tier
that knows the model's KV layout also passes the decoded KV through :func:`checked_kv` before serving it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvb_cache.codecs import DenseCodec, EncodedKV, KVCodec
from kvb_cache.codecs.base import layer_names
from kvb_cache.errors import KVBoostError
from kvb_cache.hashing import ChunkHash, content_hash, prefix_hash, root_hash
from kvb_cache.store import ChunkEntry, LayerKV

if TYPE_CHECKING:
    from kvb_cache.core.kv_storage import LayerShape

MAGIC = b"KVBREC\x00\x01"
FORMAT_VERSION = "1"
_DIGEST = 32
_TOKENS = "__token_ids__"
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class RecordError(KVBoostError):
    """A stored record failed validation (corrupt, truncated, or written by another model or codec)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordFormat:
    """What a reader expects: records of another fingerprint or codec are rejected.

    Attributes:
        fingerprint: the model fingerprint (:func:`kvb_cache.fingerprint.model_fingerprint`).
        codec: the codec the tier stores tensors in.
    """

    fingerprint: str
    codec: KVCodec

    def __post_init__(self) -> None:
        if not self.fingerprint:
            raise ValueError("fingerprint must be the engine's non-empty model fingerprint")

    @property
    def root(self) -> ChunkHash:
        return root_hash(self.fingerprint)


def encode_record(entry: ChunkEntry, fmt: RecordFormat) -> bytes:
    """Serialize ``entry`` with ``fmt.codec`` (re-encoding from dense if it is held in another codec)."""
    if entry.encoded is not None and entry.encoded.codec.name == fmt.codec.name:
        tensors, dtype = dict(entry.encoded.tensors), entry.encoded.dtype
    else:
        dense = entry.dense()
        tensors, dtype = fmt.codec.encode(dense), dense[0][0].dtype
    tensors[_TOKENS] = torch.tensor(entry.token_ids, dtype=torch.int64)
    metadata = {
        "format": FORMAT_VERSION,
        "fingerprint": fmt.fingerprint,
        "codec": fmt.codec.name,
        "dtype": str(dtype),
        "num_layers": str(entry.num_layers),
        "num_tokens": str(entry.num_tokens),
        "key": entry.key.hex(),
        "parent": entry.parent.hex(),
        "content": entry.content.hex(),
        "start": str(entry.start),
        "complete": "1" if entry.complete else "0",
    }
    blob = st_save(tensors, metadata=metadata)
    return MAGIC + hashlib.sha256(blob).digest() + blob


def decode_record(data: bytes, fmt: RecordFormat) -> ChunkEntry:
    """Validate and load a record into a :class:`ChunkEntry` (dense for the ``none`` codec, else encoded).

    Raises:
        RecordError: the record is corrupt, truncated, or does not belong to ``fmt``.
    """
    if len(data) < len(MAGIC) + _DIGEST or not data.startswith(MAGIC):
        raise RecordError("not a KVBoost chunk record (bad magic or truncated)")
    view = memoryview(data)
    digest, blob = view[len(MAGIC) : len(MAGIC) + _DIGEST], view[len(MAGIC) + _DIGEST :]
    if hashlib.sha256(blob).digest() != digest:
        raise RecordError("record checksum mismatch (corrupted bytes)")
    try:
        meta = _metadata(blob)
        tensors = st_load(bytes(blob))
    except Exception as exc:  # safetensors raises its own error types for malformed headers
        raise RecordError(f"unreadable safetensors payload: {exc}") from exc
    # NOTE: the checksum only proves the bytes are those written; whoever can write the tier (another
    # version, another program sharing the Redis database) can write a well-checksummed record with
    # malformed fields. Every failure reading one is a RecordError, so tiers drop it as a miss instead of
    # letting a ValueError/KeyError/TypeError escape into the request.
    try:
        return _entry_from(meta, tensors, fmt)
    except RecordError:
        raise
    except Exception as exc:
        raise RecordError(f"malformed record fields: {type(exc).__name__}: {exc}") from exc


#: The largest ``start`` a record may carry (far past any model's context; bounds what a forged one can ask).
MAX_START = 1 << 40


def _entry_from(meta: dict[str, str], tensors: dict[str, torch.Tensor], fmt: RecordFormat) -> ChunkEntry:
    """The :class:`ChunkEntry` a checksummed record describes, after checking its fields agree."""
    _check(meta.get("format") == FORMAT_VERSION, f"unsupported record format {meta.get('format')!r}")
    _check(meta.get("fingerprint") == fmt.fingerprint, "record belongs to another model fingerprint")
    _check(meta.get("codec") == fmt.codec.name, f"record codec {meta.get('codec')!r} != {fmt.codec.name!r}")
    _check(meta.get("dtype") in _DTYPES, f"unknown dtype {meta.get('dtype')!r}")
    tokens = tensors.pop(_TOKENS, None)
    _check(tokens is not None and tokens.dim() == 1, "record has no token ids")
    _check(tokens.dtype == torch.int64, f"token ids must be int64, got {tokens.dtype}")
    token_ids = tuple(tokens.tolist())
    num_layers, num_tokens = int(meta["num_layers"]), int(meta["num_tokens"])
    _check(len(token_ids) == num_tokens and num_tokens > 0, "token count does not match the token ids")
    start = int(meta["start"])
    # Positions are re-rotated from it (stitching) and become tensors: a forged 10**30 overflowed int64 in
    # torch, a negative one rotated keys to positions no request has.
    _check(0 <= start <= MAX_START, f"record start {start} is not a position")
    key, parent, content = (ChunkHash(bytes.fromhex(meta[f])) for f in ("key", "parent", "content"))
    _check(prefix_hash(parent, token_ids) == key, "stored key does not hash from parent and tokens")
    _check(content_hash(fmt.root, token_ids) == content, "stored content hash does not match the tokens")
    for layer in range(num_layers):
        _check(any(n.startswith(f"{layer}.k") for n in tensors), f"layer {layer} keys missing")
        _check(any(n.startswith(f"{layer}.v") for n in tensors), f"layer {layer} values missing")
    encoded = EncodedKV(
        codec=fmt.codec,
        tensors=tensors,
        num_layers=num_layers,
        num_tokens=num_tokens,
        dtype=_DTYPES[meta["dtype"]],
    )
    kv: tuple = ()
    if isinstance(fmt.codec, DenseCodec):
        # Dense KV is stored in the dtype the metadata names: fp16 tensors under an fp32 label (another
        # program writing the shared folder) were upcast and served as an exact hit, 3e-3 off no-cache.
        _check(
            all(
                n in tensors and tensors[n].dtype == encoded.dtype
                for i in range(num_layers)
                for n in layer_names(i)
            ),
            "KV tensors are not in the record's dtype",
        )
        kv = tuple(tuple(encoded.layer(i)) for i in range(num_layers))
        _check(
            all(k.shape[2] == num_tokens and v.shape[2] == num_tokens for k, v in kv), "KV length != tokens"
        )
    return ChunkEntry(
        key=key,
        parent=parent,
        content=content,
        token_ids=token_ids,
        start=start,
        complete=meta["complete"] == "1",
        kv=kv,
        encoded=None if kv else encoded,
    )


def checked_kv(
    entry: ChunkEntry, shapes: Sequence[LayerShape] | None, *, tokens: int | None = None
) -> LayerKV:
    """``entry``'s dense KV, checked against the model's KV layout; RecordError when it differs.

    Every layer ``i`` must hold keys ``[1, kv_heads, tokens, key_dim]`` and values ``[1, kv_heads, tokens,
    value_dim]`` of ``shapes[i]`` (one entry per layer, no more, no fewer) in ``shapes[i].dtype``, with
    finite values. ``tokens`` defaults to the entry's own token count (a pool block passes ``block_size``).
    A record passing :func:`decode_record` can still fail this: another program (or another model's store
    pointed at the same namespace) may write a well-checksummed record of another layout, which would crash
    a later forward inside torch or, with fewer layers, leave the others' KV stale. ``shapes`` None (no
    model known) only decodes: a codec failing on malformed tensors is still a RecordError.
    """
    try:
        kv = entry.dense()
    except Exception as exc:  # a codec decoding malformed tensors (bad shapes, missing scales)
        raise RecordError(f"undecodable KV: {type(exc).__name__}: {exc}") from exc
    if shapes is None:
        return kv
    if len(kv) != len(shapes):
        raise RecordError(f"record has {len(kv)} layers, the model {len(shapes)}")
    tokens = entry.num_tokens if tokens is None else tokens
    for i, ((k, v), shape) in enumerate(zip(kv, shapes)):
        want_k = (1, shape.kv_heads, tokens, shape.key_dim)
        want_v = (1, shape.kv_heads, tokens, shape.value_dim)
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise RecordError(
                f"layer {i} KV shapes {tuple(k.shape)}/{tuple(v.shape)} != the model's {want_k}/{want_v}"
            )
        if k.dtype != shape.dtype or v.dtype != shape.dtype:
            raise RecordError(f"layer {i} KV dtype {k.dtype}/{v.dtype} != the model's {shape.dtype}")
        # NaN/inf KV poisons every later token of the request; a forward never stores it, so such a
        # record was written by someone else. Cheap next to the copy the reader makes of it.
        if not bool(torch.isfinite(k).all()) or not bool(torch.isfinite(v).all()):
            raise RecordError(f"layer {i} KV holds NaN or inf")
    return kv


def _metadata(blob: memoryview) -> dict[str, str]:
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(bytes(blob[8 : 8 + header_len]))
    return dict(header.get("__metadata__") or {})


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RecordError(message)
