"""Write AWQ GEMM checkpoints (safetensors shards + ``config.json``) from fp models or random weights.

Quantization is round-to-nearest (:func:`kvb_streaming.awq_format.quantize`): the *format* is AutoAWQ's GEMM
format, but without its activation-aware scale search, so quality is that of plain RTN int4.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import GENERATION_CONFIG_NAME

from kvb_streaming.awq_format import check_shapes, quantize
from kvb_streaming.errors import AWQFormatError
from kvb_streaming.residency import decoder_layers

logger = logging.getLogger(__name__)

GiB = 1 << 30


class _ShardWriter:
    """Accumulates tensors and writes ``model-0000k.safetensors`` shards of at most ``max_shard_bytes``."""

    def __init__(self, folder: Path, max_shard_bytes: int) -> None:
        self._folder = folder
        self._max = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._weight_map: dict[str, str] = {}
        self._total = 0
        self._shards = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self._max:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        self._shards += 1
        shard = f"model-{self._shards:05d}.safetensors"
        save_file(self._pending, str(self._folder / shard), metadata={"format": "pt"})
        self._weight_map.update(dict.fromkeys(self._pending, shard))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending:
            self._flush()
        # NOTE: shards of an earlier save into this folder would be indexed with the new ones (the loader reads
        # every *.safetensors), so a tensor would appear twice; remove the ones this save did not write.
        written = set(self._weight_map.values())
        for stale in self._folder.glob("model-*.safetensors"):
            if stale.name not in written:
                stale.unlink()
        index = {"metadata": {"total_size": self._total}, "weight_map": self._weight_map}
        (self._folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _write_config(config: PretrainedConfig, folder: Path, group_size: int, kept: list[str]) -> None:
    raw = config.to_dict()
    raw["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "version": "gemm",
        "zero_point": True,
        # AutoAWQ's field: linears left in fp16 (the loader reads them as plain resident linears).
        "modules_to_not_convert": kept or None,
    }
    raw["torch_dtype"] = "float16"
    (folder / "config.json").write_text(json.dumps(raw, indent=1, default=str))


def save_awq_checkpoint(
    model: PreTrainedModel, folder: str | Path, *, group_size: int = 128, max_shard_bytes: int = 2 * GiB
) -> Path:
    """Quantizes every ``nn.Linear`` of the decoder layers to AWQ GEMM int4 and saves the checkpoint.

    Other tensors (embeddings, norms, biases, LM head) are saved in fp16. A tied LM head is not saved, as
    Hugging Face does. A decoder linear whose outputs do not fill whole int32 words (not a multiple of 8:
    Qwen2-MoE's one-output ``shared_expert_gate``) stays fp16 too, listed in ``modules_to_not_convert`` as
    AutoAWQ lists the modules it leaves out.

    Args:
        model: a Hugging Face causal LM (Llama-family layout: ``model.get_decoder().layers``).
        folder: output folder (created).
        group_size: AWQ group size; must divide every quantized layer's ``in_features``.
        max_shard_bytes: shard size limit.

    Returns:
        ``folder``.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    linears = _decoder_linears(model)
    # Refused before: "out_features=1 must be a multiple of 8", naming no module, for a gate AutoAWQ keeps fp16.
    kept = sorted(name for name, linear in linears.items() if linear.out_features % 8)
    quantized = {name: linear for name, linear in linears.items() if name not in kept}
    if kept:
        logger.info("kept in fp16 (outputs not a multiple of 8, no int32 AWQ word): %s", ", ".join(kept))
    for name, linear in quantized.items():
        try:
            check_shapes(linear.in_features, linear.out_features, group_size)
        except AWQFormatError as exc:
            raise AWQFormatError(f"{name}: {exc}") from None
    writer = _ShardWriter(out, max_shard_bytes)
    for name, tensor in model.state_dict().items():
        module_name, _, leaf = name.rpartition(".")
        if module_name in quantized and leaf == "weight":
            awq = quantize(tensor, group_size)
            for suffix, value in awq._asdict().items():
                writer.add(f"{module_name}.{suffix}", value)
        elif not (_is_tied(model, name)):
            writer.add(name, tensor.to(torch.float16) if tensor.is_floating_point() else tensor)
    writer.close()
    _write_config(model.config, out, group_size, kept)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        # Extra EOS ids and sampling defaults, as save_pretrained keeps them. NOTE: written as is: save_pretrained
        # refuses configs transformers only warns about when loading (temperature without do_sample), and the
        # quantized weights are already on disk by now.
        model.generation_config.to_json_file(out / GENERATION_CONFIG_NAME, use_diff=True)
    return out


def save_random_awq_checkpoint(
    config: PretrainedConfig,
    folder: str | Path,
    *,
    group_size: int = 128,
    seed: int = 0,
    device: str | torch.device = "cpu",
    init_std: float = 0.02,
    max_shard_bytes: int = 2 * GiB,
) -> Path:
    """Writes a random-weight AWQ checkpoint for ``config`` one tensor at a time (never the whole fp model).

    Meant for benchmarks of models larger than host RAM in fp16: each linear's fp16 weight is drawn on
    ``device``, quantized by :func:`~kvb_streaming.awq_format.quantize` and written out.

    Args:
        config: a Llama-family config.
        folder: output folder (created).
        group_size: AWQ group size.
        seed: RNG seed (same seed, same checkpoint).
        device: where weights are drawn and quantized (a GPU makes multi-GB checkpoints fast).
        init_std: std of the normal init of linear and embedding weights.
        max_shard_bytes: shard size limit.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    linears = _decoder_linears(skeleton)
    kept = sorted(name for name, linear in linears.items() if linear.out_features % 8)
    quantized = {name: linear for name, linear in linears.items() if name not in kept}
    generator = torch.Generator(device=device).manual_seed(seed)
    writer = _ShardWriter(out, max_shard_bytes)
    for name, tensor in _skeleton_tensors(skeleton):
        module_name, _, leaf = name.rpartition(".")
        if _is_tied(skeleton, name):
            continue
        if module_name in quantized and leaf == "weight":
            check_shapes(tensor.shape[1], tensor.shape[0], group_size)
            w = torch.randn(tensor.shape, generator=generator, device=device, dtype=torch.float16) * init_std
            for suffix, value in quantize(w, group_size)._asdict().items():
                writer.add(f"{module_name}.{suffix}", value)
        elif leaf == "weight" and tensor.dim() == 1:  # norms
            writer.add(name, torch.ones(tensor.shape, dtype=torch.float16))
        elif tensor.dim() >= 1:
            value = (
                torch.randn(tensor.shape, generator=generator, device=device, dtype=torch.float16) * init_std
            )
            writer.add(name, value)
    writer.close()
    _write_config(config, out, group_size, kept)
    return out


def _skeleton_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    persistent = set(model.state_dict())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in persistent:
            yield name, tensor


def _decoder_linears(model: PreTrainedModel) -> dict[str, nn.Linear]:
    """Full name -> module for every ``nn.Linear`` inside the decoder layers."""
    layers = decoder_layers(model)
    layer_ids = {id(layer) for layer in layers}
    found: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if id(module) in layer_ids:
            for sub, child in module.named_modules():
                if isinstance(child, nn.Linear):
                    found[f"{name}.{sub}"] = child
    return found


def _is_tied(model: PreTrainedModel, name: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name in tied
