from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvb_streaming.errors import AWQFormatError
from kvb_streaming.safetensors_index import index_folder, read_header, read_tensor


def test_index_matches_the_bytes_safetensors_wrote(tmp_path: Path) -> None:
    tensors = {
        "a": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "b": torch.randn(5, dtype=torch.float16),
        "c": torch.randn(2, 3, dtype=torch.bfloat16),
    }
    save_file({"a": tensors["a"], "b": tensors["b"]}, str(tmp_path / "one.safetensors"))
    save_file({"c": tensors["c"]}, str(tmp_path / "two.safetensors"))
    index = index_folder(tmp_path)
    assert set(index) == {"a", "b", "c"}
    assert index["a"].shape == (3, 4) and index["a"].dtype == torch.int32 and index["a"].nbytes == 48
    assert index["c"].shard.name == "two.safetensors"
    for name, tensor in tensors.items():
        assert torch.equal(read_tensor(index[name]), tensor)
    # Offsets are absolute file offsets: the raw bytes at that position are the tensor's bytes.
    raw = (tmp_path / "one.safetensors").read_bytes()
    info = index["a"]
    assert raw[info.offset : info.offset + info.nbytes] == tensors["a"].numpy().tobytes()


def test_rejects_non_safetensors_and_duplicates(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(AWQFormatError, match="implausible"):
        read_header(bad)
    bad.unlink()
    with pytest.raises(AWQFormatError, match=r"no \*\.safetensors"):
        index_folder(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(AWQFormatError, match="in both"):
        index_folder(tmp_path)


def test_unsupported_dtype(tmp_path: Path) -> None:
    header = json.dumps({"x": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}).encode()
    path = tmp_path / "f8.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(AWQFormatError, match="unsupported dtype"):
        read_header(path)


def _shard(header: bytes, declared: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if declared is None else declared) + header


@pytest.mark.parametrize(
    "data",
    [
        _shard(b"{not json}"),  # JSONDecodeError
        _shard(b"\xff\xfe\xfd\xfc"),  # not UTF-8
        _shard(b"{}", declared=100),  # header cut short
        _shard(json.dumps({"a": {"dtype": "F32", "shape": [2]}}).encode()),  # KeyError: data_offsets
        _shard(json.dumps([1, 2]).encode()),  # AttributeError: not an object
        # offsets that do not fit the shape: read_tensor's view / reshape raised RuntimeError
        _shard(json.dumps({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}).encode()),
        _shard(json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}).encode()),
        # dimensions that are not sizes passed math.prod, then failed in reshape with a bare torch error
        _shard(json.dumps({"a": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}).encode()),
        _shard(json.dumps({"a": {"dtype": "F32", "shape": [2.0, 2.0], "data_offsets": [0, 16]}}).encode()),
        # data past the end of the file: read_tensor allocated what the header claimed (4 GiB here) first
        _shard(
            json.dumps({"a": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 1 << 32]}}).encode()
        ),
    ],
)
def test_corrupt_headers_are_format_errors(tmp_path: Path, data: bytes) -> None:
    """A damaged shard (an interrupted download) raised json / KeyError / AttributeError from the parser."""
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(data)
    with pytest.raises(AWQFormatError, match="corrupt safetensors header"):
        read_header(shard)


def test_shards_the_index_lists_must_be_there(tmp_path: Path) -> None:
    """A missing shard read as a missing tensor (or a layer with no quantized linear)."""
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(AWQFormatError, match=r"model-00002-of-00002\.safetensors listed in .* are missing"):
        index_folder(tmp_path)


def test_a_pickle_only_folder_says_why_it_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(AWQFormatError, match=r"only as pickle files \(pytorch_model\.bin\)"):
        index_folder(tmp_path)
