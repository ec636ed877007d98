"""Index safetensors shards (name -> shard, offset, shape, dtype) from their headers, without loading data.

The safetensors layout is ``u64 little-endian header length | JSON header | raw bytes``; each header entry
gives ``dtype``, ``shape`` and ``data_offsets`` relative to the end of the header.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from kvb_streaming.errors import AWQFormatError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# A header larger than this is not a safetensors file (the format caps it at 100 MB).
_MAX_HEADER = 100 * (1 << 20)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    """Where one tensor's bytes live.

    Attributes:
        name: checkpoint key, e.g. ``model.layers.0.mlp.up_proj.qweight``.
        shard: the ``.safetensors`` file.
        offset: absolute byte offset of the data in ``shard``.
        nbytes: data length in bytes.
        shape: tensor shape.
        dtype: torch dtype.
    """

    name: str
    shard: Path
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def read_header(shard: Path) -> dict[str, TensorInfo]:
    """Parses one shard's header.

    Raises:
        AWQFormatError: the file is not a valid safetensors file or uses an unsupported dtype.
    """
    with open(shard, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise AWQFormatError(f"{shard} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER:
            raise AWQFormatError(
                f"{shard}: header length {header_len} is implausible; is it a safetensors file?"
            )
        raw = f.read(header_len)
    data_start = 8 + header_len
    infos: dict[str, TensorInfo] = {}
    try:
        if len(raw) != header_len:
            raise ValueError(f"the header is cut short ({len(raw)} of {header_len} bytes)")
        header = json.loads(raw)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                raise AWQFormatError(f"{shard}: tensor {name} has unsupported dtype {entry['dtype']}")
            begin, end = entry["data_offsets"]
            dtype = _DTYPES[entry["dtype"]]
            expected = math.prod(entry["shape"]) * dtype.itemsize
            if not 0 <= begin <= end or end - begin != expected:
                raise ValueError(
                    f"tensor {name}: data_offsets {[begin, end]} do not hold shape {entry['shape']}"
                )
            infos[name] = TensorInfo(
                name=name,
                shard=shard,
                offset=data_start + begin,
                nbytes=end - begin,
                shape=tuple(entry["shape"]),
                dtype=dtype,
            )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONDecodeError is a ValueError
        if isinstance(exc, AWQFormatError):
            raise
        raise AWQFormatError(
            f"{shard} has a corrupt safetensors header ({type(exc).__name__}: {exc}); re-download or re-save it"
        ) from exc
    return infos


def index_folder(folder: Path) -> dict[str, TensorInfo]:
    """Indexes every ``*.safetensors`` shard of a checkpoint folder.

    Raises:
        AWQFormatError: no shard, or a tensor name appears in two shards.
    """
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise AWQFormatError(f"no *.safetensors file in {folder}; pass a checkpoint folder")
    index: dict[str, TensorInfo] = {}
    for shard in shards:
        for name, info in read_header(shard).items():
            if name in index:
                raise AWQFormatError(f"tensor {name} is in both {index[name].shard.name} and {shard.name}")
            index[name] = info
    return index


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Reads one tensor's bytes into a fresh CPU tensor (one ``readinto``, no intermediate copy)."""
    raw = torch.empty(info.nbytes, dtype=torch.uint8)
    with open(info.shard, "rb") as f:
        f.seek(info.offset)
        got = f.readinto(memoryview(raw.numpy()))
    if got != info.nbytes:
        raise AWQFormatError(f"{info.shard}: truncated data for {info.name} ({got} of {info.nbytes} bytes)")
    return raw.view(info.dtype).reshape(info.shape)
