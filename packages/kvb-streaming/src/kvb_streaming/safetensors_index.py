"""Index safetensors shards (name -> shard, offset, shape, dtype) from their headers, without loading data.

The safetensors layout is ``u64 little-endian header length | JSON header | raw bytes``; each header entry
gives ``dtype``, ``shape`` and ``data_offsets`` relative to the end of the header.
"""

from __future__ import annotations

import json
import math
import os
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
#: The sharded checkpoint's map of tensor -> shard file (transformers' and AutoAWQ's name).
INDEX_FILE = "model.safetensors.index.json"


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
        file_size = os.fstat(f.fileno()).st_size
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
            shape = entry["shape"]
            # Types first: a float or negative dimension passed math.prod and failed later in reshape
            # with a bare torch error (bool is an int subclass: refused too).
            if not all(type(x) is int for x in (begin, end, *shape)) or min(shape, default=0) < 0:
                raise ValueError(f"tensor {name}: shape {shape} / data_offsets {[begin, end]} are not sizes")
            dtype = _DTYPES[entry["dtype"]]
            expected = math.prod(shape) * dtype.itemsize
            if not 0 <= begin <= end or end - begin != expected:
                raise ValueError(f"tensor {name}: data_offsets {[begin, end]} do not hold shape {shape}")
            # Past the end of the file: caught here, before read_tensor allocates what the header claims
            # (a 100-byte file claiming 4 GiB allocated 4 GiB, then found the data missing).
            if data_start + end > file_size:
                raise ValueError(
                    f"tensor {name} ends at byte {data_start + end}, past the end of the file "
                    f"({file_size} bytes): truncated download?"
                )
            infos[name] = TensorInfo(
                name=name,
                shard=shard,
                offset=data_start + begin,
                nbytes=end - begin,
                shape=tuple(shape),
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
        pickles = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in folder.glob(pattern))
        if pickles:
            raise AWQFormatError(
                f"{folder} holds its weights only as pickle files ({', '.join(pickles[:3])}), which are never "
                "loaded (unpickling runs code from the file); save the checkpoint as safetensors "
                "(AutoAWQ: model.save_quantized(folder, safetensors=True))"
            )
        raise AWQFormatError(f"no *.safetensors file in {folder}; pass a checkpoint folder")
    _check_listed_shards(folder, {shard.name for shard in shards})
    index: dict[str, TensorInfo] = {}
    for shard in shards:
        for name, info in read_header(shard).items():
            if name in index:
                raise AWQFormatError(f"tensor {name} is in both {index[name].shard.name} and {shard.name}")
            index[name] = info
    return index


def _check_listed_shards(folder: Path, present: set[str]) -> None:
    """Every shard ``model.safetensors.index.json`` lists is there: a missing one read as a missing tensor
    (or as a layer with no AWQ-quantized linear), pointing at quantization instead of the download."""
    listing = folder / INDEX_FILE
    if not listing.is_file():
        return
    try:
        weight_map = json.loads(listing.read_text(encoding="utf-8"))["weight_map"]
        listed = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        raise AWQFormatError(f"{listing} is not a safetensors index ({type(exc).__name__}: {exc})") from exc
    missing = sorted(name for name in listed if name not in present)
    if missing:
        raise AWQFormatError(
            f"{folder}: shard(s) {', '.join(missing[:3])} listed in {INDEX_FILE} are missing "
            "(an incomplete download or copy?)"
        )


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Reads one tensor's bytes into a fresh CPU tensor (one ``readinto``, no intermediate copy)."""
    raw = torch.empty(info.nbytes, dtype=torch.uint8)
    with open(info.shard, "rb") as f:
        f.seek(info.offset)
        got = f.readinto(memoryview(raw.numpy()))
    if got != info.nbytes:
        raise AWQFormatError(f"{info.shard}: truncated data for {info.name} ({got} of {info.nbytes} bytes)")
    return raw.view(info.dtype).reshape(info.shape)
