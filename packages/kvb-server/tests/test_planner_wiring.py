"""Planner wiring: CLI flags, the missing-extra ImportError, OOM during a run, the real engine."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import build_tiny_engine, build_tokenizer, serve
from fakes import FakeEngine

from kvb_planner import DeviceProfile, Ladder, LadderStep, ModelShape, PlanRequest, estimate_memory
from kvb_server import EngineSettings, PlannerGate, ServerConfig, create_app, require_planner
from kvb_server.cli import build_gate, build_parser, main
from kvb_server.peak_memory import RssPeakMeter
from kvb_server.planner_gate import cache_growth


# ------------------------------------------------------------------------------------------------- CLI
def test_planning_and_tier_flags_parse() -> None:
    args = build_parser().parse_args([])
    assert args.oom_planning is None and args.auto_truncate is False and args.planner_safety_margin is None
    assert args.kv_cache_bits == 16 and args.disk_cache_dir is None and args.remote_url is None
    args = build_parser().parse_args(
        [
            "--oom-planning",
            "--auto-truncate",
            "--planner-safety-margin",
            "0.2",
            "--kv-cache-bits",
            "4",
            "--disk-cache-dir",
            "/tmp/kv",
            "--disk-cache-bytes",
            "1GiB",
            "--remote-url",
            "redis://127.0.0.1:6379/0",
        ]
    )
    assert (args.oom_planning, args.auto_truncate, args.planner_safety_margin) == (True, True, 0.2)
    assert (args.kv_cache_bits, args.disk_cache_dir, args.disk_cache_bytes) == (4, "/tmp/kv", 2**30)
    assert args.remote_url == "redis://127.0.0.1:6379/0"
    assert build_parser().parse_args(["--no-oom-planning"]).oom_planning is False
    for bad in (
        ["--planner-safety-margin", "1.5"],
        ["--planner-safety-margin", "x"],
        ["--kv-cache-bits", "3"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    text = build_parser().format_help()
    for flag in (
        "--oom-planning",
        "--no-oom-planning",
        "--auto-truncate",
        "--planner-safety-margin",
        "--kv-cache-bits",
        "--disk-cache-dir",
        "--disk-cache-bytes",
        "--remote-url",
    ):
        assert flag in text


def test_contradictory_planning_flags_fail_before_loading(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--no-oom-planning", "--auto-truncate"])
    assert "need OOM planning" in capsys.readouterr().err


class TinyLlamaEngine:
    """Just what PlannerGate.for_engine reads: a model on the CPU and cache byte counts."""

    def __init__(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=64,
                vocab_size=64,
            )
        )
        self.device = torch.device("cpu")
        self.stored = 0

    def cache_stats(self) -> dict:
        return {"bytes": self.stored}


def test_build_gate_follows_the_flags() -> None:
    engine = TinyLlamaEngine()
    assert build_gate(build_parser().parse_args(["--no-oom-planning"]), engine) is None
    gate = build_gate(
        build_parser().parse_args(["--auto-truncate", "--planner-safety-margin", "0.3"]), engine
    )
    assert isinstance(gate, PlannerGate)  # on by default: kvb-planner is installed here
    assert gate.auto_truncate and gate.margin() == 0.3
    assert gate.shape.num_layers == 1 and gate.shape.num_kv_heads == 1 and gate.shape.dtype_bytes == 4
    assert gate.profile.device == "cpu" and gate.profile.free_bytes > 0
    free = gate.free_bytes()
    engine.stored = 4096  # the chunk store grew after the probe
    assert gate.free_bytes() == free - 4096
    with pytest.raises(ValueError, match="need OOM planning"):
        build_gate(build_parser().parse_args(["--no-oom-planning", "--auto-truncate"]), engine)


def test_the_gate_counts_the_kv_the_engines_pool_keeps() -> None:
    """A Gemma 4 E2B-style model: its global layers are wider (32 vs 16 channels per head) and its last two
    layers hold no KV (they read an earlier layer's). Its config's head_dim says 8 layers of 2 heads x 16 (and
    transformers 5.24 refuses to read it: the planner crashed on Gemma 4); the gate plans with what the pool
    really keeps per token (6 layers, the global ones wider)."""
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from kvb_cache import EngineConfig, KVBoost

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        sliding_window=24,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=len(tokenizer),
        num_kv_shared_layers=2,
        layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    gate = PlannerGate.for_engine(engine)
    pool = sum(s.kv_heads * (s.key_dim + s.value_dim) for s in engine.kv_layer_shapes) * 4
    assert len(engine.kv_layer_shapes) == 6
    assert gate.shape.kv_bytes_per_token == pool
    assert pool == 1792 and pool != 8 * 2 * (2 * 16) * 4  # not 8 layers of 2 heads x 16 channels
    assert gate.shape.head_dim == 32  # the attention phase is sized by the widest head
    # The engine loop's paged attention is planned as the SDPA it runs (an unknown name is charged as eager).
    assert model.config._attn_implementation == "kvb_paged" and gate.shape.attn_implementation == "sdpa"


def test_the_gate_subtracts_the_chunk_store_not_the_preallocated_pool() -> None:
    """The KV pool is allocated (and zero-filled) when the engine is built, before the probe: blocks filling
    it take no memory the probe counted as free (subtracting them emptied the budget once the pool had
    filled). The stitching chunk store grows outside the pool: that is subtracted."""
    from kvb_cache import StitchConfig

    engine = build_tiny_engine(stitching=StitchConfig())
    growth = cache_growth(engine)
    before = engine.cache_stats()["bytes"]
    engine.generate("The quick brown fox jumps over the lazy dog. " * 4, max_new_tokens=4)
    engine.generate(
        "Paris is the capital of France; Berlin is the capital of Germany. " * 3, max_new_tokens=4
    )
    assert engine.cache_stats()["bytes"] > before  # the pool holds cached blocks now
    assert growth() == engine.store.stats().bytes > 0  # only the store's chunks count


def test_missing_planner_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "kvb_planner", None)  # makes `import kvb_planner` raise ImportError
    with pytest.raises(ImportError, match=r"pip install kvb-server\[planner\]"):
        require_planner()
    with pytest.raises(ImportError, match=r"pip install kvb-server\[planner\]"):
        build_gate(build_parser().parse_args(["--oom-planning"]), TinyLlamaEngine())
    assert build_gate(build_parser().parse_args([]), TinyLlamaEngine()) is None  # default: off without it


# ------------------------------------------------------------------------------------------ run time
def test_engine_settings_are_validated() -> None:
    assert EngineSettings().is_default and EngineSettings(kv_cache_bits=16).is_default
    assert not EngineSettings(prefill_chunk_size=256).is_default
    with pytest.raises(ValueError, match="kv_cache_bits"):
        EngineSettings(kv_cache_bits=3)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        EngineSettings(prefill_chunk_size=0)


class RunsOutOfMemory(FakeEngine):
    """Decodes two tokens of a request, then fails its step the way an allocator does."""

    def step(self):
        if any(len(request.out) >= 2 for request in self._running.values()):
            raise MemoryError("simulated")
        return super().step()


def test_out_of_memory_mid_stream_is_the_final_event_before_done() -> None:
    with serve(create_app(RunsOutOfMemory(), ServerConfig(model_names=("fake-model",)))) as url:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 10, "stream": True}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 200
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"code":"request_too_large"' in events[-2]
        plain = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert plain.status_code == 413 and plain.json()["error"]["code"] == "request_too_large"


def test_rss_meter_reads_the_kernel_peak(tmp_path: Path) -> None:
    (tmp_path / "clear_refs").write_text("")
    (tmp_path / "status").write_text("Name:\tpython\nVmHWM:\t  1000 kB\nVmRSS:\t   600 kB\n")
    meter = RssPeakMeter(tmp_path)
    assert RssPeakMeter.available(tmp_path)
    meter.start()
    assert (tmp_path / "clear_refs").read_text() == "5"
    (tmp_path / "status").write_text("VmHWM:\t  1500 kB\nVmRSS:\t   700 kB\n")
    assert meter.peak_bytes() == (1500 - 600) * 1024
    assert not RssPeakMeter.available(tmp_path / "missing")


def test_real_engine_runs_the_planned_step(tiny_engine) -> None:
    """A prompt that only fits with 8-token prefill slices and 4-bit KV runs with exactly those settings."""
    model = tiny_engine.model
    shape = ModelShape.from_config(model.config, dtype=model.dtype)
    ladder = Ladder(steps=(LadderStep(prefill_chunk_size=None), LadderStep(prefill_chunk_size=8, kv_bits=4)))
    text = "Paris is the capital of France; Berlin is the capital of Germany. " * 3
    ids = tiny_engine.tokenizer(text, add_special_tokens=True)["input_ids"]
    request = PlanRequest(prompt_tokens=len(ids), max_new_tokens=6)
    single, sliced = (estimate_memory(request, step, shape, device="cpu").peak_bytes for step in ladder.steps)
    profile = DeviceProfile(device="cpu", total_bytes=1 << 30, free_bytes=(single + sliced) // 2)
    meter = RssPeakMeter() if RssPeakMeter.available() else None
    gate = PlannerGate(shape=shape, profile=profile, ladder=ladder, safety_margin=0.0, meter=meter)
    expected = tiny_engine.generate(ids, max_new_tokens=6, prefill_chunk_size=8, kv_cache_bits=4)
    with serve(create_app(tiny_engine, ServerConfig(model_names=("tiny-llama",)), gate=gate)) as url:
        body = {"model": "tiny-llama", "prompt": text, "max_tokens": 6, "temperature": 0}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected.output_text
        stats = httpx.get(url + "/v1/stats").json()["planner"]
    assert stats["last_plan"]["prefill_chunk_size"] == 8 and stats["last_plan"]["kv_bits"] == 4
    if meter is not None:  # Linux: the run was measured against its prediction
        assert stats["calibration"]["cohorts"][0]["kv_bits"] == 4
        assert stats["calibration"]["samples"] == 1
        assert stats["last_measurement"]["predicted_mb"] == round(sliced / (1 << 20), 3)
