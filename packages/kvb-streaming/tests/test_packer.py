from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvb_streaming.awq_format import AWQTensors, dequantize
from kvb_streaming.config import StreamingConfig
from kvb_streaming.errors import AWQFormatError
from kvb_streaming.loader import AWQLoader
from kvb_streaming.model import StreamingCausalLM, get_runtime
from kvb_streaming.packer import save_awq_checkpoint, save_random_awq_checkpoint

GROUP_SIZE = 32  # the fixtures' group size


def test_checkpoint_layout(awq_llama_dir: Path, tiny_llama: torch.nn.Module) -> None:
    config = json.loads((awq_llama_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP_SIZE,
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": None,
    }
    loader = AWQLoader(awq_llama_dir)
    assert "model.layers.0.mlp.up_proj.weight" not in loader
    awq = loader.read_awq("model.layers.2.mlp.down_proj")
    assert awq.qweight.shape == (128, 8) and awq.scales.dtype == torch.float16
    # The stored int4 weight dequantizes to the fp weight within half a quantization step.
    w = dequantize(awq, GROUP_SIZE, torch.float32)
    fp = tiny_llama.model.layers[2].mlp.down_proj.weight.t()
    step = awq.scales.float().repeat_interleave(GROUP_SIZE, 0)
    assert bool(((w - fp).abs() <= step * 0.51 + 1e-6).all())
    assert loader.read("model.norm.weight").dtype == torch.float16


def test_small_shards_and_index(tiny_llama: torch.nn.Module, tmp_path: Path) -> None:
    save_awq_checkpoint(tiny_llama, tmp_path, group_size=GROUP_SIZE, max_shard_bytes=20_000)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    loader = AWQLoader(tmp_path)
    assert set(loader.index) == set(index["weight_map"])


def test_group_size_must_divide(tiny_llama: torch.nn.Module, tmp_path: Path) -> None:
    with pytest.raises(AWQFormatError, match="must divide"):
        save_awq_checkpoint(tiny_llama, tmp_path, group_size=48)


def test_random_checkpoint_loads_and_runs(tmp_path: Path, make_tiny_config) -> None:
    config = make_tiny_config(num_hidden_layers=3)
    save_random_awq_checkpoint(config, tmp_path, group_size=GROUP_SIZE, seed=7, max_shard_bytes=50_000)
    again = save_random_awq_checkpoint(config, tmp_path / "again", group_size=GROUP_SIZE, seed=7)
    a, b = AWQLoader(tmp_path), AWQLoader(again)
    assert torch.equal(
        a.read("model.layers.1.self_attn.q_proj.qweight"), b.read("model.layers.1.self_attn.q_proj.qweight")
    )
    model = StreamingCausalLM.from_pretrained(
        tmp_path, streaming_config=StreamingConfig(simulate_on_host=True, quant_kernel="torch"), device="cpu"
    )
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 128) and torch.isfinite(logits).all()
    assert get_runtime(model).plan.streamed_layers == (0, 1, 2)


def test_loader_rejects_non_awq(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{truncated")  # was json's JSONDecodeError
    with pytest.raises(AWQFormatError, match="not valid JSON"):
        AWQLoader(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(AWQFormatError, match="no quantization_config"):
        AWQLoader(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "awq", "group_size": 128, "version": "gemv"}})
    )
    with pytest.raises(AWQFormatError, match="gemv"):
        AWQLoader(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(AWQFormatError, match="AWQ checkpoints only"):
        AWQLoader(tmp_path)


def test_read_awq_checks_shapes(awq_llama_dir: Path) -> None:
    loader = AWQLoader(awq_llama_dir)
    loader.quant = type(loader.quant)(group_size=16)  # pretend the config lies about the group size
    with pytest.raises(AWQFormatError, match="do not match AWQ GEMM"):
        loader.read_awq("model.layers.0.mlp.up_proj")
    assert isinstance(AWQLoader(awq_llama_dir).read_awq("model.layers.0.mlp.up_proj"), AWQTensors)


def test_saving_again_into_a_folder_replaces_its_shards(tiny_llama: torch.nn.Module, tmp_path: Path) -> None:
    """A second save with larger shards left the first save's extra shards behind; the loader indexes every
    *.safetensors, so the checkpoint no longer loaded ("tensor ... is in both ...")."""
    save_awq_checkpoint(tiny_llama, tmp_path, group_size=GROUP_SIZE, max_shard_bytes=20_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    save_awq_checkpoint(tiny_llama, tmp_path, group_size=GROUP_SIZE)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model-00001.safetensors"]
    loader = AWQLoader(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(loader.index) == set(index["weight_map"])


def test_group_size_must_be_an_int(tiny_llama: torch.nn.Module, tmp_path: Path) -> None:
    with pytest.raises(AWQFormatError, match="must be an int"):
        save_awq_checkpoint(tiny_llama, tmp_path, group_size=32.0)


def test_non_llama_layout_is_a_typed_error(tmp_path: Path) -> None:
    """GPT-2 keeps its blocks in transformer.h: this failed with AttributeError ('GPT2Model' ... 'layers')."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100, n_positions=32))
    with pytest.raises(AWQFormatError, match="Llama-family"):
        save_awq_checkpoint(gpt2, tmp_path, group_size=GROUP_SIZE)
    with pytest.raises(AWQFormatError, match="Llama-family"):
        save_random_awq_checkpoint(gpt2.config, tmp_path, group_size=GROUP_SIZE)


def test_loading_a_non_llama_awq_checkpoint_is_a_typed_error(awq_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import GPT2Config

    raw = GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100, n_positions=32).to_dict()
    raw["quantization_config"] = json.loads((awq_llama_dir / "config.json").read_text())[
        "quantization_config"
    ]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for shard in awq_llama_dir.glob("*.safetensors"):
        (tmp_path / shard.name).write_bytes(shard.read_bytes())
    with pytest.raises(AWQFormatError, match="Llama-family"):
        StreamingCausalLM.from_pretrained(tmp_path, device="cpu")


def test_generation_config_survives_the_awq_round_trip(tmp_path: Path, make_tiny_config) -> None:
    """The packer wrote only config.json and the loader built the model from it, so a checkpoint's
    generation_config.json (e.g. Llama 3's extra EOS <|eot_id|>) was lost: generate ran past end of turn."""
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(make_tiny_config()).eval()
    model.generation_config = GenerationConfig(eos_token_id=[7, 9], bos_token_id=1, do_sample=True, top_p=0.9)
    save_awq_checkpoint(model, tmp_path, group_size=GROUP_SIZE)
    loaded = StreamingCausalLM.from_pretrained(tmp_path, device="cpu")
    assert loaded.generation_config.eos_token_id == [7, 9]
    assert loaded.generation_config.do_sample is True and loaded.generation_config.top_p == 0.9
    # A config transformers loads with a warning (temperature without do_sample, common on the hub) is kept
    # too; GenerationConfig.save_pretrained would refuse it after the weights were written.
    model.generation_config = GenerationConfig(eos_token_id=[7, 9], temperature=0.6)
    save_awq_checkpoint(model, tmp_path / "lenient", group_size=GROUP_SIZE)
    lenient = StreamingCausalLM.from_pretrained(tmp_path / "lenient", device="cpu")
    assert lenient.generation_config.temperature == 0.6 and lenient.generation_config.eos_token_id == [7, 9]


def test_an_unreadable_generation_config_is_ignored_like_transformers_does(
    awq_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for item in awq_llama_dir.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    (tmp_path / "generation_config.json").write_text("{not json")
    model = StreamingCausalLM.from_pretrained(tmp_path, device="cpu")
    assert model.generation_config is not None
    assert any("generation_config.json" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "raw",
    [
        {"quant_method": "awq"},  # KeyError
        {"quant_method": "awq", "group_size": None},  # TypeError
        {"quant_method": "awq", "group_size": "x"},  # ValueError from int()
        {"quant_method": "awq", "group_size": 128.5},  # silently truncated to 128
        {"quant_method": "awq", "group_size": 128, "bits": "four"},
        "awq",  # AttributeError: not an object
    ],
)
def test_malformed_quantization_config_is_a_format_error(raw: object) -> None:
    from kvb_streaming.loader import AWQQuantConfig

    with pytest.raises(AWQFormatError, match=r"group_size|bits|JSON object"):
        AWQQuantConfig.from_dict(raw)  # type: ignore[arg-type]
    assert AWQQuantConfig.from_dict({"quant_method": "awq", "group_size": "64"}).group_size == 64
