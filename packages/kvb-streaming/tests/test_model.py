from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvb_streaming.config import StreamingConfig
from kvb_streaming.errors import (
    AWQFormatError,
    NotAStreamingModelError,
    SaveUnsupportedError,
    StreamingConfigError,
    WeightsNotStagedError,
)
from kvb_streaming.model import StreamingCausalLM, get_runtime
from kvb_streaming.qlinear import StreamingQLinear

MODES = [
    ("full_stream", {}),
    ("partial_resident", {"keep_first_k": 1, "keep_last_k": 1}),
    ("partial_resident", {"keep_first_k": 0, "keep_last_k": 0}),
    ("ffn_only_stream", {}),
    ("ffn_only_stream", {"keep_first_k": 2}),
]


def load(path: Path, kernel: str = "torch", **config: object):
    streaming = StreamingConfig(quant_kernel=kernel, simulate_on_host=True, **config)  # type: ignore[arg-type]
    return StreamingCausalLM.from_pretrained(path, streaming_config=streaming, device="cpu")


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def resident_logits(awq_llama_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    model = load(awq_llama_dir, residency_mode="full_resident")
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.mark.parametrize(("mode", "keep"), MODES)
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_streamed_logits_equal_fully_resident(
    awq_llama_dir: Path,
    input_ids: torch.Tensor,
    resident_logits: torch.Tensor,
    mode: str,
    keep: dict,
    slots: int,
) -> None:
    model = load(awq_llama_dir, residency_mode=mode, n_staging_slots=slots, **keep)
    runtime = get_runtime(model)
    assert runtime.streaming_enabled
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert torch.equal(logits, resident_logits)  # same kernel, same bytes: bit-identical
    stats = runtime.stats()
    assert stats.forwards == 1 and stats.layer_calls == 4
    assert stats.hits + stats.misses == len(runtime.plan.streamed_layers)


def test_resident_awq_model_is_close_to_the_fp_model(
    tiny_llama: torch.nn.Module, input_ids: torch.Tensor, resident_logits: torch.Tensor
) -> None:
    with torch.no_grad():
        fp = tiny_llama(input_ids=input_ids).logits
    error = (resident_logits - fp).abs().max()
    assert 0 < float(error) < 0.25 * float(fp.abs().max())


def test_generate_with_dynamic_cache_matches_resident(awq_llama_dir: Path) -> None:
    prompt = torch.tensor([[5, 17, 99, 3, 42]])
    resident = load(awq_llama_dir, residency_mode="full_resident")
    streamed = load(awq_llama_dir, residency_mode="full_stream", n_staging_slots=2)
    expected = resident.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    cache = DynamicCache(config=streamed.config)
    # transformers 5.24 renamed generate's and forward's past_key_values to cache (the old name warns).
    name = "cache" if "cache" in inspect.signature(streamed.forward).parameters else "past_key_values"
    got = streamed.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, **{name: cache})
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == prompt.shape[1] + 8 - 1
    stats = get_runtime(streamed).stats()
    assert stats.forwards == 8 and stats.misses == 0 and stats.hit_rate == 1.0
    assert stats.bytes_moved > 0


def test_int4pack_kernel_streams_identically(awq_llama_dir: Path, input_ids: torch.Tensor) -> None:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("torch build without the CPU tinygemm op")
    resident = load(awq_llama_dir, kernel="int4pack", residency_mode="full_resident")
    streamed = load(awq_llama_dir, kernel="int4pack", residency_mode="full_stream")
    assert get_runtime(streamed).kernel_name == "int4pack"
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=input_ids).logits, resident(input_ids=input_ids).logits)


def test_biases_and_tied_embeddings(awq_qwen_dir: Path) -> None:
    model = load(awq_qwen_dir, residency_mode="partial_resident", keep_first_k=1)
    resident = load(awq_qwen_dir, residency_mode="full_resident")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    q_proj = model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, StreamingQLinear) and q_proj.bias is not None and q_proj.bias.abs().sum() > 0
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, resident(input_ids=ids).logits)


def test_streaming_is_disabled_on_cpu_unless_simulated(
    awq_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvb_streaming.model"):
        model = StreamingCausalLM.from_pretrained(
            awq_llama_dir, streaming_config=StreamingConfig(residency_mode="full_stream"), device="cpu"
        )
    runtime = get_runtime(model)
    assert not runtime.streaming_enabled
    assert runtime.requested.residency_mode == "full_stream"
    assert runtime.effective.residency_mode == "full_resident"
    assert any("streaming disabled on cpu" in r.getMessage() for r in caplog.records)
    model(input_ids=torch.tensor([[1, 2, 3]]))
    assert runtime.stats().bytes_moved == 0


def test_fused_moe_experts_are_loaded_resident_and_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from conftest import tiny_mixtral_config
    from transformers import MixtralForCausalLM

    from kvb_streaming.packer import save_awq_checkpoint

    torch.manual_seed(0)
    save_awq_checkpoint(MixtralForCausalLM(tiny_mixtral_config()).eval(), tmp_path, group_size=32)
    with caplog.at_level(logging.WARNING, logger="kvb_streaming.builder"):
        model = StreamingCausalLM.from_pretrained(tmp_path, device="cpu")
    # transformers 5 keeps the experts as fused parameters: no nn.Linear to quantize or stream.
    assert any(
        "fused weight tensors" in r.getMessage() and "experts" in r.getMessage() for r in caplog.records
    )
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_persistent_buffers_are_read_from_the_checkpoint(tmp_path: Path) -> None:
    """A DeepSeek-V3-style router's ``e_score_correction_bias`` (GLM4-MoE) is a persistent buffer: the skeleton
    built under ``init_empty_weights`` held its init value (zeros) and routed tokens to other experts than the
    checkpoint's model, silently (an audit, 2026-11-30; Gemma 4's ``layer_scalar`` the same)."""
    import transformers

    from kvb_streaming.packer import save_awq_checkpoint

    config_class = getattr(transformers, "Glm4MoeConfig", None)
    if config_class is None:
        pytest.skip("this transformers has no GLM4-MoE")
    torch.manual_seed(0)
    config = config_class(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    fp = transformers.AutoModelForCausalLM.from_config(config).eval()
    biases = {n: b for n, b in fp.named_buffers() if n.endswith("e_score_correction_bias")}
    assert biases, "the model has no router bias buffer: the test no longer tests anything"
    with torch.no_grad():
        for b in biases.values():
            b.copy_(torch.linspace(-2, 2, b.numel()))
    save_awq_checkpoint(fp, tmp_path, group_size=32)
    for mode in ("full_resident", "full_stream"):
        model = load(tmp_path, residency_mode=mode)
        loaded = dict(model.named_buffers())
        for name, value in biases.items():
            assert torch.allclose(loaded[name].float(), value.float(), atol=1e-3), (mode, name)


def test_too_many_kept_layers_fail_on_cpu_too(awq_llama_dir: Path) -> None:
    """Streaming is off on CPU, so the plan saw only the all-resident config: the same options loaded here
    and failed on the first GPU."""
    config = StreamingConfig(residency_mode="partial_resident", keep_first_k=3, keep_last_k=2)
    with pytest.raises(StreamingConfigError, match="exceeds the model's 4 decoder layers"):
        StreamingCausalLM.from_pretrained(awq_llama_dir, streaming_config=config, device="cpu")


def test_streamed_linear_called_outside_its_layer_raises(awq_llama_dir: Path) -> None:
    model = load(awq_llama_dir, residency_mode="ffn_only_stream")
    with pytest.raises(WeightsNotStagedError):
        model.model.layers[0].mlp(torch.randn(1, 2, 64))
    model.model.layers[0].self_attn.q_proj(torch.randn(1, 2, 64))  # attention stays resident


def test_save_pretrained_is_refused_not_written_broken(
    awq_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers wrote the int4 payloads under names the architecture does not read, and the folder
    loaded back through AutoModelForCausalLM (warnings only) with random linears."""
    model = StreamingCausalLM.from_pretrained(awq_llama_dir, device="cpu")
    with pytest.raises(SaveUnsupportedError, match="save_awq_checkpoint") as info:
        model.save_pretrained(tmp_path / "saved")
    assert str(awq_llama_dir) in str(info.value) and isinstance(info.value, NotImplementedError)
    assert not (tmp_path / "saved").exists()
    # push_to_hub created the Hub repository before it reached save_pretrained: refused before any call.
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda *a, **k: calls.append(a))
    with pytest.raises(SaveUnsupportedError):
        model.push_to_hub("someone/some-model")
    assert calls == []


def test_get_runtime_rejects_other_models(tiny_llama: torch.nn.Module) -> None:
    with pytest.raises(NotAStreamingModelError):
        get_runtime(tiny_llama)


def test_runtime_reports_plan_and_memory(awq_llama_dir: Path) -> None:
    model = load(awq_llama_dir, residency_mode="partial_resident", keep_first_k=1, keep_last_k=1)
    runtime = get_runtime(model)
    assert runtime.plan.streamed_layers == (1, 2)
    assert runtime.scheduler.n_slots == 2
    assert runtime.resident_int4_bytes > 0
    assert runtime.pinned is False  # pinning is only requested for CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("mode", "keep"), MODES)
def test_cuda_streamed_logits_equal_resident(
    awq_llama_dir: Path, input_ids: torch.Tensor, mode: str, keep: dict
) -> None:
    def cuda_model(**config: object):
        streaming = StreamingConfig(quant_kernel="torch", **config)  # type: ignore[arg-type]
        return StreamingCausalLM.from_pretrained(awq_llama_dir, streaming_config=streaming, device="cuda")

    resident = cuda_model(residency_mode="full_resident")
    streamed = cuda_model(residency_mode=mode, n_staging_slots=2, **keep)
    ids = input_ids.cuda()
    with torch.no_grad():
        expected = resident(input_ids=ids).logits
        for _ in range(3):  # later forwards run on prefetched (wrapped-around) slots
            assert torch.equal(streamed(input_ids=ids).logits, expected)
    runtime = get_runtime(streamed)
    assert runtime.pinned and runtime.stats().hit_rate == 1.0
    assert runtime.stats().synchronous_prefetches == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "gpu"}, "not a torch device"),
        ({"device": "meta"}, "holds no data"),
        ({"dtype": torch.int32}, "floating-point"),
        ({"dtype": "half-ish"}, "floating-point"),
        ({"streaming_config": {"residency_mode": "full_stream"}}, "must be a StreamingConfig"),
    ],
)
def test_bad_load_arguments_are_typed_errors(awq_llama_dir: Path, kwargs: dict, match: str) -> None:
    """These failed inside torch / transformers (RuntimeError, ValueError, AttributeError); a dtype given by
    name failed with "Invalid device string: 'float16'"."""
    from kvb_streaming.errors import StreamingConfigError

    with pytest.raises(StreamingConfigError, match=match):
        StreamingCausalLM.from_pretrained(awq_llama_dir, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_typed_error(awq_llama_dir: Path) -> None:
    from kvb_streaming.errors import StreamingConfigError

    with pytest.raises(StreamingConfigError, match="CUDA is not available"):
        StreamingCausalLM.from_pretrained(awq_llama_dir, device="cuda")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the no-MPS message")
def test_mps_without_mps_is_a_typed_error(awq_llama_dir: Path) -> None:
    """It failed with torch's RuntimeError ('PyTorch is not linked with support for mps devices')."""
    from kvb_streaming.errors import StreamingConfigError

    with pytest.raises(StreamingConfigError, match="MPS is not available"):
        StreamingCausalLM.from_pretrained(awq_llama_dir, device="mps")


def test_dtype_by_name(awq_llama_dir: Path) -> None:
    model = StreamingCausalLM.from_pretrained(awq_llama_dir, device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16


def test_a_config_group_size_that_disagrees_with_the_tensors_names_the_right_one(
    awq_llama_dir: Path, tmp_path: Path
) -> None:
    """The error listed three shapes and the configured group size, leaving the user to work out that the
    tensors say group_size=32 and config.json is what to fix."""
    import json
    import shutil

    folder = tmp_path / "awq"
    shutil.copytree(awq_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        AWQFormatError, match=r"quantized with group_size=32: set quantization_config\.group_size"
    ):
        StreamingCausalLM.from_pretrained(str(folder), device="cpu")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            {"num_key_value_heads": 4},
            r"k_proj: the checkpoint holds a 64 -> 32 linear, config\.json says 64 -> 64",
        ),
        ({"intermediate_size": 256}, r"the checkpoint holds a 64 -> 128 linear, config\.json says 64 -> 256"),
        ({"num_hidden_layers": 2}, r"never reads \(model\.layers\.2\."),
    ],
)
def test_a_config_that_disagrees_with_the_weights_is_refused_at_load(
    awq_llama_dir: Path, tmp_path: Path, edit: dict, match: str
) -> None:
    """num_key_value_heads edited: loaded, then a bare RuntimeError in the first forward; intermediate_size
    edited: loaded and ran with modules describing shapes they did not have; fewer layers: the last ones'
    weights silently unused."""
    import json
    import shutil

    folder = tmp_path / "awq"
    shutil.copytree(awq_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(AWQFormatError, match=match):
        StreamingCausalLM.from_pretrained(str(folder), device="cpu")


def test_integer_scales_are_refused(awq_llama_dir: Path, tmp_path: Path) -> None:
    """int32 scales loaded and were multiplied as they were: wrong weights, silently."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "awq"
    shutil.copytree(awq_llama_dir, folder)
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(str(shard))
        tensors = {k: v.to(torch.int32) if k.endswith(".scales") else v for k, v in tensors.items()}
        save_file(tensors, str(shard))
    with pytest.raises(AWQFormatError, match="scales must be floating point"):
        StreamingCausalLM.from_pretrained(str(folder), device="cpu")


def test_a_file_or_no_path_is_a_typed_error_about_the_folder(awq_llama_dir: Path, tmp_path: Path) -> None:
    """A file gave "<file>/config.json not found" and None a bare TypeError."""
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(
        AWQFormatError, match=r"is a file; pass the AWQ checkpoint folder.*GGUF files are not read"
    ):
        StreamingCausalLM.from_pretrained(str(gguf), device="cpu")
    with pytest.raises(AWQFormatError, match="is a file"):
        StreamingCausalLM.from_pretrained(str(awq_llama_dir / "config.json"), device="cpu")
    with pytest.raises(AWQFormatError, match="must be a checkpoint folder"):
        StreamingCausalLM.from_pretrained(None, device="cpu")  # type: ignore[arg-type]


def test_streamed_weights_are_exposed_for_cache_fingerprints(awq_llama_dir: Path) -> None:
    """Streamed layers' weights live in host buffers, bound to their modules only while they run: the KV
    cache's model fingerprint (kvb_cache.fingerprint, which names the disk and Redis namespaces) reads them
    through ``kvb_extra_weights``; without it two fine-tunes differing only in streamed layers shared records."""
    model = load(awq_llama_dir, residency_mode="partial_resident", keep_first_k=1, keep_last_k=1)
    streamed = model.kvb_extra_weights()
    assert {name.split(".")[1] for name, _ in streamed} == {"1", "2"}  # layers 0 and 3 are kept resident
    assert all(t.numel() > 0 for _, t in streamed)
    # They are not in the module tree while no layer runs (what the fingerprint saw before).
    listed = {t.data_ptr() for t in model.buffers()} | {t.data_ptr() for t in model.parameters()}
    assert not any(t.data_ptr() in listed for _, t in streamed)
    # Only the payloads (the packed buffer's alignment padding is uninitialized): equal across loads.
    again = load(awq_llama_dir, residency_mode="partial_resident", keep_first_k=1, keep_last_k=1)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(streamed, again.kvb_extra_weights()))
    assert load(awq_llama_dir, residency_mode="full_resident").kvb_extra_weights() == []
