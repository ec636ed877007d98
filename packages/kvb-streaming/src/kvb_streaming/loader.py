"""Read AWQ GEMM checkpoints lazily: index the shards, read single tensors or whole layers on demand."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kvb_streaming.awq_format import AWQTensors
from kvb_streaming.errors import AWQFormatError
from kvb_streaming.host_memory import HostAllocator, PackedLayer, pack_layer
from kvb_streaming.safetensors_index import TensorInfo, index_folder, read_tensor

AWQ_SUFFIXES = ("qweight", "qzeros", "scales")


@dataclass(frozen=True, slots=True, kw_only=True)
class AWQQuantConfig:
    """The ``quantization_config`` of an AWQ GEMM checkpoint (only the variant this package reads)."""

    group_size: int
    bits: int = 4

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise AWQFormatError(f"only 4-bit AWQ is supported, the checkpoint says bits={self.bits}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise AWQFormatError(f"group_size must be a positive int, got {self.group_size!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> AWQQuantConfig:
        """Validates a ``config.json`` ``quantization_config`` entry."""
        if not isinstance(raw, Mapping):
            raise AWQFormatError(f"quantization_config must be a JSON object, got {type(raw).__name__}")
        method = str(raw.get("quant_method", "")).lower()
        if method != "awq":
            raise AWQFormatError(f"quant_method is {method!r}; this loader reads AWQ checkpoints only")
        version = str(raw.get("version", "gemm")).lower()
        if version == "exllama":
            # AutoAWQ's exllama is a kernel chosen at load time over GEMM-packed tensors, not a layout.
            raise AWQFormatError(
                "AWQ version 'exllama' names a load-time kernel, not a tensor layout: if the tensors were saved "
                "as GEMM (qweight [in, out / 8]), set quantization_config.version to 'gemm'"
            )
        if version != "gemm":
            raise AWQFormatError(
                f"AWQ version {version!r} is not supported; re-export the model as AWQ 'gemm'"
            )
        if raw.get("zero_point", True) is not True:
            raise AWQFormatError("AWQ without zero points is not supported; export with zero_point=True")
        if "group_size" not in raw:
            raise AWQFormatError("quantization_config has no group_size; the AWQ export must record it")
        return cls(group_size=_as_int(raw, "group_size"), bits=_as_int(raw, "bits", 4))


def _quantization_config(raw_config: Mapping[str, object], folder: Path) -> Mapping[str, object]:
    """``config.json``'s ``quantization_config``, or, for older AutoAWQ exports that kept it apart, the
    ``quant_config.json`` beside it (``w_bit``, ``q_group_size``, ``zero_point``, ``version``) in the same
    terms."""
    if "quantization_config" in raw_config:
        return raw_config["quantization_config"]  # type: ignore[return-value]
    legacy = folder / "quant_config.json"
    if legacy.is_file():
        try:
            old = json.loads(legacy.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise AWQFormatError(f"{legacy} is not valid JSON ({exc})") from exc
        if not isinstance(old, dict):
            raise AWQFormatError(f"{legacy} must hold a JSON object")
        converted = {
            "quant_method": old.get("quant_method", "awq"),
            "bits": old.get("w_bit", old.get("bits", 4)),
            "group_size": old.get("q_group_size", old.get("group_size")),
            "zero_point": old.get("zero_point", True),
            "version": old.get("version", "gemm"),
        }
        return {key: value for key, value in converted.items() if value is not None}
    raise AWQFormatError(
        f"{folder / 'config.json'} has no quantization_config (nor is there an AutoAWQ quant_config.json "
        "beside it); quantize the model first (kvb_streaming.packer.save_awq_checkpoint)"
    )


def _as_int(raw: Mapping[str, object], key: str, default: int | None = None) -> int:
    """An integer field of ``quantization_config`` (an int, or a string of digits)."""
    value = raw.get(key, default)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        # NOTE: int() would truncate 128.5 to 128 and accept True as 1.
        raise AWQFormatError(f"quantization_config {key} must be an integer, got {value!r}")
    return value


class AWQLoader:
    """Lazy reader of an AWQ GEMM checkpoint folder (``config.json`` + ``*.safetensors`` shards).

    Construction reads only the JSON config and the shard headers; tensor data is read on demand.

    Args:
        path: checkpoint folder.
        pin_memory: pin the buffers built by :meth:`pack_layer` (falls back to pageable with a warning).
    """

    def __init__(self, path: str | Path, *, pin_memory: bool = True) -> None:
        if not isinstance(path, str | os.PathLike):
            raise AWQFormatError(f"path must be a checkpoint folder (str or Path), got {type(path).__name__}")
        self.path = Path(path)
        if self.path.is_file():
            # Said of the file itself: "<file>/config.json not found" pointed at a path that cannot exist.
            raise AWQFormatError(
                f"{self.path} is a file; pass the AWQ checkpoint folder that holds config.json and *.safetensors"
                + (
                    " (GGUF files are not read: use an AWQ GEMM safetensors export)"
                    if self.path.suffix == ".gguf"
                    else ""
                )
            )
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise AWQFormatError(f"{config_file} not found; pass a Hugging Face checkpoint folder")
        try:
            raw_config = json.loads(config_file.read_text())
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise AWQFormatError(
                f"{config_file} is not valid JSON ({exc}); re-download or re-save it"
            ) from exc
        if not isinstance(raw_config, dict):
            raise AWQFormatError(f"{config_file} must hold a JSON object")
        self.quant = AWQQuantConfig.from_dict(_quantization_config(raw_config, self.path))
        self.index: dict[str, TensorInfo] = index_folder(self.path)
        self.allocator = HostAllocator(pin=pin_memory)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def info(self, name: str) -> TensorInfo:
        try:
            return self.index[name]
        except KeyError:
            raise AWQFormatError(f"tensor {name!r} is not in the checkpoint at {self.path}") from None

    def read(self, name: str) -> torch.Tensor:
        """Reads one tensor into pageable CPU memory."""
        return read_tensor(self.info(name))

    def is_quantized(self, module_prefix: str) -> bool:
        """Whether ``<module_prefix>.qweight`` exists (the module is an AWQ linear)."""
        return f"{module_prefix}.qweight" in self.index

    def read_awq(self, module_prefix: str) -> AWQTensors:
        """Reads one AWQ linear's ``qweight`` / ``qzeros`` / ``scales`` and checks their dtypes and shapes."""
        qweight, qzeros, scales = (self.read(f"{module_prefix}.{suffix}") for suffix in AWQ_SUFFIXES)
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise AWQFormatError(f"{module_prefix}: qweight/qzeros must be int32 (AWQ GEMM)")
        if not scales.is_floating_point():  # int32 scales loaded and multiplied: wrong weights, silently
            raise AWQFormatError(f"{module_prefix}: scales must be floating point (fp16), got {scales.dtype}")
        in_features, words = qweight.shape
        g = self.quant.group_size
        if (
            in_features % g
            or qzeros.shape != (in_features // g, words)
            or scales.shape != (in_features // g, words * 8)
        ):
            raise AWQFormatError(
                f"{module_prefix}: shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                f"scales {tuple(scales.shape)} do not match AWQ GEMM with group_size={g}"
                + _group_size_hint(in_features, words, qzeros.shape, scales.shape, g)
            )
        return AWQTensors(qweight=qweight, qzeros=qzeros, scales=scales)

    def pack_layer(self, tensors: Mapping[str, torch.Tensor]) -> PackedLayer:
        """Packs already-prepared tensors of one layer into one host (pinned if possible) buffer."""
        return pack_layer(tensors, self.allocator)


def _group_size_hint(
    in_features: int, words: int, qzeros: tuple[int, ...], scales: tuple[int, ...], configured: int
) -> str:
    """The fix when the tensors are consistent with another group size (a config.json edited or copied from
    another export): without it the error listed shapes and left the arithmetic to the user."""
    groups = scales[0] if len(scales) == 2 else 0
    if (
        groups < 1
        or in_features % groups
        or tuple(qzeros) != (groups, words)
        or tuple(scales) != (groups, words * 8)
    ):
        return ""
    actual = in_features // groups
    return (
        f"; the tensors were quantized with group_size={actual}: set quantization_config.group_size to "
        f"{actual} in config.json (it says {configured})"
    )
