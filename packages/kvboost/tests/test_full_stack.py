"""Options once: ``kvboost.KVBoost.from_pretrained``, ``kvboost serve`` and the option classes agree; the
full stack composes stitching, speculative decoding, AWQ layer streaming and kvb_attention."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import transformers as T
from test_compose import PROMPT, _save_tiny_model

import kvboost
from kvb_cache import EngineArgs
from kvb_cache import KVBoost as CacheEngine
from kvb_cache.options import from_namespace, options_table, parser_mismatches, signature_mismatches
from kvboost import KVBoost, SpeculativeArgs, StreamingArgs
from kvboost.args import PART_ARGS
from kvboost.cli import build_parser
from kvboost.serving import FullStack

ALL_ARGS = (EngineArgs, *PART_ARGS)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _save_tiny_model(tmp_path_factory.mktemp("target"), seed=0)


def test_from_pretrained_signatures_match_the_option_classes():
    assert signature_mismatches(KVBoost.from_pretrained, ALL_ARGS) == []
    assert signature_mismatches(CacheEngine.from_pretrained, [EngineArgs]) == []


def test_serve_flags_match_the_option_classes():
    commands = build_parser()._subparsers._group_actions[0].choices
    serve = commands["serve"]
    assert parser_mismatches(serve, ALL_ARGS) == []
    args = serve.parse_args(
        [
            "--speculative",
            "prompt_lookup",
            "--gamma",
            "3",
            "--awq-streaming",
            "--residency-mode",
            "partial_resident",
        ]
    )
    assert from_namespace(SpeculativeArgs, args) == SpeculativeArgs(speculative="prompt_lookup", gamma=3)
    assert from_namespace(StreamingArgs, args).streaming_mode == "partial_resident"
    text = serve.format_help()
    for flag in (
        "--recompute-strategy",
        "--draft-model",
        "--keep-first-k",
        "--staging-slots",
        "--oom-planning",
    ):
        assert flag in text


def test_everything_from_pretrained_takes_is_importable_from_kvboost():
    # The errors from_pretrained raises for bad speculative / streaming options too (they are not KVBoostErrors:
    # kvb-speculative and kvb-streaming do not depend on kvb-cache), so `from kvboost import ...` catches them.
    for name in (
        "StitchConfig",
        "EngineArgs",
        "TierConfig",
        "SpeculativeDecoder",
        "CacheBusyError",
        "SpeculativeConfigError",
        "StreamingConfigError",
    ):
        assert hasattr(kvboost, name) and name in kvboost.__all__
    assert "`--awq-streaming`" in options_table(ALL_ARGS)


def test_streaming_options_need_awq_streaming(target):
    from kvb_streaming import StreamingConfigError

    with pytest.raises(StreamingConfigError, match="awq_streaming"):
        KVBoost.from_pretrained(str(target), device="cpu", keep_first_k=1)


def test_full_stack_composer_builds_stitching_and_speculative(target):
    commands = build_parser()._subparsers._group_actions[0].choices
    flags = ["--device", "cpu", "--chunk-size", "8", "--recompute-strategy", "selective"]
    args = commands["serve"].parse_args([*flags, "--speculative", "prompt_lookup", "--gamma", "4"])
    engine = FullStack().build_engine(str(target), args)
    assert engine.config.stitching.recompute_strategy == "selective"
    out = engine.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    plain = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8)
    assert (
        out.output_ids
        == plain.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True).output_ids
    )
    stats = engine.cache_stats()
    assert stats["speculative"]["gamma"] == 4 and stats["speculative"]["drafted_tokens"] > 0
    assert "streaming" not in stats and engine.streaming_stats() is None


def _streamed_engine(folder) -> KVBoost:
    """The engine over an AWQ checkpoint folder, its first layer resident and the rest streamed on the host."""
    return KVBoost.from_pretrained(
        str(folder),
        device="cpu",
        chunk_size=8,
        awq_streaming=True,
        streaming_mode="partial_resident",
        keep_first_k=1,
        streaming_quant_kernel="torch",
        streaming_simulate_on_host=True,
    )


def test_awq_streaming_engine_streams_layers_on_host(target, tmp_path):
    from kvb_streaming.packer import save_awq_checkpoint

    model = T.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    awq = save_awq_checkpoint(model, tmp_path / "awq", group_size=32)
    T.AutoTokenizer.from_pretrained(target).save_pretrained(awq)
    engine = _streamed_engine(awq)
    first = engine.generate(PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    again = engine.generate(PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert first.output_ids == again.output_ids and again.cached_tokens > 0
    stats = engine.cache_stats()["streaming"]
    assert stats["streaming_enabled"] and stats["streamed_layers"] == 1
    assert stats["hits"] + stats["misses"] > 0 and stats["bytes_moved"] > 0
    # A streamed forward is host-driven: never captured as a CUDA graph, whatever enforce_eager said.
    assert engine.config.enforce_eager and engine.core.runner.graphs is None


def test_the_planner_charges_the_torch_int4_kernels_dequantized_block(target, tmp_path):
    """A streamed model's "torch" int4 kernel dequantizes a block of each linear's weight per call: the
    server's planner gate charges it (``weight_transient_bytes``), so the estimate of a forward covers its
    measured tensor peak (without it, the estimate was a fraction of the peak)."""
    from kvb_cache.cache_kwarg import cache_kwargs
    from kvb_planner import LadderStep, PlanRequest, estimate_memory, tensor_peak
    from kvb_server.planner_gate import PlannerGate
    from kvb_streaming import get_runtime
    from kvb_streaming.packer import save_awq_checkpoint

    model = T.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    awq = save_awq_checkpoint(model, tmp_path / "awq", group_size=32)
    T.AutoTokenizer.from_pretrained(target).save_pretrained(awq)
    engine = _streamed_engine(awq)
    transient = get_runtime(engine.model).transient_bytes
    assert transient > 0
    shape = PlannerGate.for_engine(engine).shape
    assert shape.weight_transient_bytes == transient
    ids = torch.arange(5, 21).unsqueeze(0)

    def forward() -> None:
        with torch.no_grad():
            cache = T.DynamicCache(config=engine.model.config)
            engine.model(input_ids=ids, **cache_kwargs(engine.model, cache), use_cache=True, logits_to_keep=1)

    forward()
    measured = tensor_peak(forward)
    request = PlanRequest(prompt_tokens=ids.shape[1], max_new_tokens=1)
    step = LadderStep(prefill_chunk_size=None)
    assert estimate_memory(request, step, shape, device="cpu").peak_bytes >= measured
    without = dataclasses.replace(shape, weight_transient_bytes=0)
    assert estimate_memory(request, step, without, device="cpu").peak_bytes < measured


def test_the_torch_int4_kernels_transient_bounds_what_a_call_allocates():
    """kvb-streaming's ``transient_bytes`` for its "torch" kernel against a call's measured allocations: its
    dequantized block and int32 temporaries, plus its output, stay within it plus the output, chunked or not,
    and it is not a gross over-estimate."""
    from kvb_planner import tensor_peak
    from kvb_streaming.awq_format import quantize
    from kvb_streaming.kernels.base import KernelContext, LinearShape
    from kvb_streaming.kernels.torch_dequant import TorchDequantKernel

    awq = quantize(torch.randn(1000, 2048, generator=torch.Generator().manual_seed(0)), 32)
    x = torch.randn(3, 2048)
    output = 3 * 1000 * 4
    for budget in (1 << 20, 256 << 20):
        context = KernelContext(
            device=torch.device("cpu"), dtype=torch.float32, group_size=32, dequant_chunk_bytes=budget
        )
        kernel = TorchDequantKernel(context)
        payload = kernel.prepare(awq)
        transient = kernel.transient_bytes(LinearShape(2048, 1000))
        measured = tensor_peak(lambda k=kernel, p=payload: k.linear(x, p))
        assert transient // 2 <= measured <= transient + output, (budget, measured, transient)


def test_awq_streaming_fingerprint_sees_the_streamed_layers(target, tmp_path):
    # The streamed layers' int4 weights live in host buffers outside the module tree: the fingerprint (the
    # disk/Redis namespace) missed them, so checkpoints differing only there shared records as exact hits.
    from kvb_streaming.packer import save_awq_checkpoint

    model = T.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    first = save_awq_checkpoint(model, tmp_path / "a", group_size=32)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.mul_(1.5)  # only the streamed (last) layer changes
    second = save_awq_checkpoint(model, tmp_path / "b", group_size=32)
    for folder in (first, second):
        T.AutoTokenizer.from_pretrained(target).save_pretrained(folder)
    a, b, a_again = _streamed_engine(first), _streamed_engine(second), _streamed_engine(first)
    assert a.cache_stats()["streaming"]["streamed_layers"] == 1
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == a_again.fingerprint


def test_awq_streaming_load_errors_are_model_load_errors(target, tmp_path):
    """The streamed path skipped the plain path's checks: a folder without a tokenizer (the packer writes
    none) raised transformers' ValueError after loading the whole model, a bad attn_implementation its
    ValueError, a None path AttributeError."""
    from kvb_streaming.packer import save_awq_checkpoint
    from kvboost import ModelLoadError

    model = T.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    awq = save_awq_checkpoint(model, tmp_path / "awq", group_size=32)
    options = dict(device="cpu", awq_streaming=True, streaming_simulate_on_host=True)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        KVBoost.from_pretrained(str(awq), **options)
    T.AutoTokenizer.from_pretrained(target).save_pretrained(awq)
    with pytest.raises(ModelLoadError, match="bogus"):
        KVBoost.from_pretrained(str(awq), attn_implementation="bogus", **options)
    with pytest.raises(ModelLoadError, match="non-empty path"):
        KVBoost.from_pretrained(None, **options)
    with pytest.raises(ModelLoadError, match="not a local folder"):
        KVBoost.from_pretrained(str(tmp_path / "missing"), **options)


def test_kvb_attention_registers_and_falls_back_on_cpu(target, caplog):
    with caplog.at_level(logging.WARNING):
        engine = KVBoost.from_pretrained(
            str(target), device="cpu", chunk_size=8, attn_implementation="kvb_attention"
        )
    plain = KVBoost.from_pretrained(str(target), device="cpu", chunk_size=8)
    got = engine.generate(PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True).output_ids
    assert got == plain.generate(PROMPT, max_new_tokens=6, temperature=0.0, ignore_eos=True).output_ids


def test_readme_options_table_is_generated_from_the_classes():
    from pathlib import Path

    from kvboost.args import TABLE_START, options_markdown, replace_options_table

    readme = Path(__file__).resolve().parents[3] / "README.md"
    if not readme.exists():
        pytest.skip("README.md is not above this package (tests run outside the repository)")
    text = readme.read_text(encoding="utf-8")
    assert TABLE_START in text
    assert replace_options_table(text, options_markdown()) == text, "stale: run python tools/options_table.py"


def test_server_options_table_is_generated_from_server_config():
    from pathlib import Path

    from kvboost.args import (
        SERVER_TABLE_END,
        SERVER_TABLE_START,
        replace_options_table,
        server_options_markdown,
    )

    doc = Path(__file__).resolve().parents[3] / "docs" / "server.md"
    if not doc.exists():
        pytest.skip("docs/server.md is not above this package (tests run outside the repository)")
    text = doc.read_text(encoding="utf-8")
    assert SERVER_TABLE_START in text
    assert "`--request-timeout`" in server_options_markdown()
    markers = (SERVER_TABLE_START, SERVER_TABLE_END)
    assert replace_options_table(text, server_options_markdown(), markers) == text, (
        "stale: run python tools/options_table.py"
    )


def test_the_servers_metrics_carry_the_drafters_counters(target):
    """``kvboost serve --speculative``: /metrics has vLLM's spec-decode counters, equal to the drafter's
    own statistics (they were only in /v1/stats)."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from kvb_server import ServerConfig, create_app

    engine = KVBoost.from_pretrained(
        str(target), device="cpu", chunk_size=8, speculative="prompt_lookup", gamma=4
    )
    with TestClient(create_app(engine, ServerConfig(model_names=("m",)))) as client:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    stats = engine.speculative_stats()
    assert stats["drafted_tokens"] > 0
    assert samples["vllm:spec_decode_num_drafts_total"] == stats["rounds"]
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == stats["drafted_tokens"]
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == stats["accepted_tokens"]
