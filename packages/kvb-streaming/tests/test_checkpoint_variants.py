"""Checkpoints shaped as other exporters write them: what loads, and what is refused naming its cause (an
audit of real AutoAWQ layouts, 2026-11-30)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import GROUP_SIZE, tiny_mixtral_config
from safetensors.torch import load_file, save_file

from kvb_streaming.awq_format import quantize
from kvb_streaming.config import StreamingConfig
from kvb_streaming.errors import AWQFormatError
from kvb_streaming.model import StreamingCausalLM
from kvb_streaming.packer import save_awq_checkpoint


def load(path: Path, mode: str = "full_resident") -> StreamingCausalLM:
    config = StreamingConfig(residency_mode=mode, quant_kernel="torch", simulate_on_host=True)  # type: ignore[arg-type]
    return StreamingCausalLM.from_pretrained(path, streaming_config=config, device="cpu")


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def rewrite(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One shard holding ``tensors`` (the index, if any, dropped)."""
    for stale in [*folder.glob("*.safetensors"), *folder.glob("*.index.json")]:
        stale.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def edit_config(folder: Path, **changes: object) -> dict:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return raw


IDS = torch.tensor([[3, 17, 5, 99, 42, 7]])


def logits(model: StreamingCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_a_linear_with_outputs_not_a_multiple_of_8_is_kept_fp16_and_listed(tmp_path: Path) -> None:
    """Qwen2-MoE's one-output ``shared_expert_gate``: the packer refused the whole model, naming no module."""
    import transformers

    config_class = getattr(transformers, "Qwen2MoeConfig", None)
    if config_class is None:
        pytest.skip("this transformers has no Qwen2-MoE")
    torch.manual_seed(0)
    config = config_class(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_experts=4,
        num_experts_per_tok=2,
    )
    fp = transformers.AutoModelForCausalLM.from_config(config).eval()
    save_awq_checkpoint(fp, tmp_path, group_size=GROUP_SIZE)
    kept = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert kept and all(name.endswith("shared_expert_gate") for name in kept)
    assert f"{kept[0]}.weight" in tensors_of(tmp_path)
    resident, streamed = logits(load(tmp_path)), logits(load(tmp_path, "full_stream"))
    assert torch.equal(resident, streamed) and resident.isfinite().all()


def test_an_unpackable_linear_is_named_by_the_packer(tmp_path: Path, tiny_llama) -> None:
    with pytest.raises(AWQFormatError, match=r"model\.layers\.0\.\w+\.\w+_proj: group_size=48"):
        save_awq_checkpoint(tiny_llama, tmp_path, group_size=48)


def test_an_older_autoawq_quant_config_json_is_read(awq_llama_dir: Path, tmp_path: Path) -> None:
    """Older AutoAWQ exports keep the settings in quant_config.json, not config.json: they were told to
    "quantize the model first"."""
    folder = copy_of(awq_llama_dir, tmp_path / "old")
    raw = json.loads((folder / "config.json").read_text())
    del raw["quantization_config"]
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "quant_config.json").write_text(
        json.dumps({"zero_point": True, "q_group_size": GROUP_SIZE, "w_bit": 4, "version": "GEMM"})
    )
    assert torch.equal(logits(load(folder)), logits(load(awq_llama_dir)))
    (folder / "quant_config.json").unlink()
    with pytest.raises(AWQFormatError, match="has no quantization_config"):
        load(folder)


def test_exllama_is_named_a_kernel_choice(awq_llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(awq_llama_dir, tmp_path / "exllama")
    raw = json.loads((folder / "config.json").read_text())
    edit_config(folder, quantization_config={**raw["quantization_config"], "version": "exllama"})
    with pytest.raises(AWQFormatError, match=r"set quantization_config\.version to 'gemm'"):
        load(folder)


def test_a_quantized_lm_head_is_named(awq_llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(awq_llama_dir, tmp_path / "qhead")
    tensors = tensors_of(folder)
    head = tensors.pop("lm_head.weight")
    for suffix, value in quantize(head.float(), GROUP_SIZE)._asdict().items():
        tensors[f"lm_head.{suffix}"] = value
    rewrite(folder, tensors)
    with pytest.raises(AWQFormatError, match="lm_head is int4 in the checkpoint"):
        load(folder)


def test_other_tensor_names_are_named(awq_llama_dir: Path, tmp_path: Path) -> None:
    """A transformers-4 export (``language_model.model.layers``): "has no AWQ-quantized linear" blamed the
    quantization, not the names."""
    folder = copy_of(awq_llama_dir, tmp_path / "renamed")
    rewrite(folder, {f"language_model.{k}": v for k, v in tensors_of(folder).items()})
    with pytest.raises(AWQFormatError, match=r"named like 'language_model\.model\.layers\.0\."):
        load(folder)


def test_per_expert_int4_experts_are_named(tmp_path: Path) -> None:
    """AutoAWQ's MoE exports quantize each expert's linears on their own (transformers 4 names): refused
    with "lacks tensors" and nothing about why."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    config = tiny_mixtral_config(vocab_size=128, num_local_experts=2, num_experts_per_tok=1)
    save_awq_checkpoint(MixtralForCausalLM(config).eval(), tmp_path, group_size=GROUP_SIZE)
    tensors = {}
    for name, value in tensors_of(tmp_path).items():
        if ".mlp.experts." not in name:
            tensors[name] = value
            continue
        base = name.split(".mlp.experts.")[0] + ".block_sparse_moe.experts"
        for expert in range(value.shape[0]):
            for suffix, part in quantize(value[expert].float(), GROUP_SIZE)._asdict().items():
                tensors[f"{base}.{expert}.{name.rsplit('.', 1)[1]}.{suffix}"] = part
    rewrite(tmp_path, tensors)
    with pytest.raises(AWQFormatError, match="stores each MoE expert's linears on their own"):
        load(tmp_path)


def test_a_layer_kept_in_fp16_loads_resident(awq_llama_dir: Path, tiny_llama, tmp_path: Path) -> None:
    """``modules_to_not_convert`` naming a whole decoder layer (its linears plain fp16 weights): it was refused
    as "has no AWQ-quantized linear". Layer 0 then holds the fp model's own weights, the rest int4."""
    folder = copy_of(awq_llama_dir, tmp_path / "layer0")
    tensors = {k: v for k, v in tensors_of(folder).items() if not k.startswith("model.layers.0.")}
    for name, value in tiny_llama.state_dict().items():
        if name.startswith("model.layers.0."):
            tensors[name] = value.to(torch.float16)
    rewrite(folder, tensors)
    raw = json.loads((folder / "config.json").read_text())
    edit_config(
        folder,
        quantization_config={**raw["quantization_config"], "modules_to_not_convert": ["model.layers.0"]},
    )
    resident, streamed = load(folder), load(folder, "full_stream")
    assert torch.equal(logits(resident), logits(streamed))
    weight = resident.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(
        weight, tiny_llama.model.layers[0].self_attn.q_proj.weight.to(torch.float16).to(weight.dtype)
    )
    # Every layer plain is no AWQ checkpoint at all.
    rewrite(folder, {k: v.to(torch.float16) for k, v in tiny_llama.state_dict().items()})
    with pytest.raises(AWQFormatError, match=r"no decoder layer .* holds an AWQ-quantized linear"):
        load(folder)


def test_each_checkpoint_tensor_is_read_once(awq_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass that reads persistent buffers also met the resident int4 payloads (buffers under the
    checkpoint's names) and read every one a second time (a review, 2026-11-30)."""
    from collections import Counter

    from kvb_streaming.loader import AWQLoader

    reads: Counter[str] = Counter()
    original = AWQLoader.read

    def counted(self, name: str) -> torch.Tensor:
        reads[name] += 1
        return original(self, name)

    monkeypatch.setattr(AWQLoader, "read", counted)
    load(awq_llama_dir)
    assert reads and max(reads.values()) == 1, [n for n, c in reads.items() if c > 1][:3]
