"""Decode steps through captured graphs (core/decode_graphs.py).

CUDA graphs need CUDA (tools/gpu_checks.py checks real captures there); here the capture is the identity
(every replay re-runs the step function over the bucket's static inputs), which exercises everything but the
recording itself: padding to row and width buckets, the scratch slot of padding rows, the static inputs
refreshed every step, the slot mapping, block tables and masks derived from them inside the step, and the
fallback when capturing fails. Every step's logits must match an eager engine's on the same schedule.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from conftest import make_model, words
from test_pool_kernel import ReferenceKernel

from kvb_cache import ConfigError, EngineConfig, KVBoost, SamplingParams
from kvb_cache.core import build
from kvb_cache.core.decode_graphs import bucket, row_buckets, width_buckets


class BucketKernel(ReferenceKernel):
    """The reference kernel, but a replayed step passes its width bucket as ``max_len`` (a bound, not the
    longest length: a graph's launch is fixed while lengths change)."""

    def __call__(self, query, key_pages, value_pages, table, kv_lens, *, window, scale, max_len):
        assert max_len >= int(kv_lens.max()) and max_len <= table.shape[1] * key_pages.shape[2]
        return super().__call__(
            query,
            key_pages,
            value_pages,
            table,
            kv_lens,
            window=window,
            scale=scale,
            max_len=int(kv_lens.max()),
        )


@pytest.fixture
def identity_capture(monkeypatch):
    """Engines built inside the test get decode graphs on a CPU, captured as the identity."""
    monkeypatch.setattr(build, "graph_capture", lambda device: lambda fn: fn)


def schedule(engine: KVBoost, prompts: list[str], new_tokens: int) -> list[tuple[int, torch.Tensor]]:
    """Every step's (rows, sampled logits): the first prompt alone, then the others joining, finishing at
    different times (rows 1..4 and back), a later prompt hitting the first one's cached blocks."""
    seen: list[tuple[int, torch.Tensor]] = []
    forward = engine.core.runner.forward

    def recording(seqs):
        out = forward(seqs)
        seen.append((len(seqs), out.clone()))
        return out

    engine.core.runner.forward = recording
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    for i, prompt in enumerate(prompts[1:-1]):
        engine.add_request(
            prompt, SamplingParams(max_new_tokens=new_tokens + 3 * i, temperature=0, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompts[-1], SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return seen


def prompts() -> list[str]:
    shared = words(40, seed=5)
    return [
        shared + words(9, seed=6),
        shared + words(30, seed=7),
        words(50, seed=8),
        words(3, seed=9),
        shared,
    ]


CONFIG = EngineConfig(block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
EAGER = dataclasses.replace(CONFIG, enforce_eager=True)


@pytest.mark.parametrize(
    "arch", ["llama", "mistral", "gpt_neox", "gemma2", "gemma3", "gpt_oss", "gpt2", "gemma3n"]
)
def test_replayed_decode_steps_give_the_eager_logits(arch: str, tokenizer, identity_capture) -> None:
    model = make_model(arch)
    reference = schedule(KVBoost(model, tokenizer, config=EAGER), prompts(), 8)
    engine = KVBoost(model, tokenizer, config=CONFIG)
    graphs = engine.core.runner.graphs
    assert graphs is not None and engine.kv.storage.scratch_slot == engine.kv.pool.num_blocks * 8
    got = schedule(engine, prompts(), 8)
    assert [rows for rows, _ in got] == [rows for rows, _ in reference]
    # gpt-oss routes the padding rows through its experts too, which changes the rows each expert's matmul
    # sums over: 1.7e-5 apart at most here (3.8e-6 without row padding); dense models stay within 1e-5.
    tol = 5e-5 if arch == "gpt_oss" else 1e-5
    for (_, g), (_, want) in zip(got, reference, strict=True):
        torch.testing.assert_close(g, want, atol=tol, rtol=tol)
    # Decode-only steps of 1, 2, 3 (padded to 4) and 4 rows were replayed; the mixed ones were not.
    assert graphs.captures >= 3 and graphs.replays > graphs.captures and graphs.disabled is None
    assert set(graphs._replays) >= {(1, 256), (2, 256), (4, 256)}
    stats = engine.cache_stats()["cuda_graphs"]
    assert stats == {"captures": graphs.captures, "replays": graphs.replays, "disabled": None}


def test_replays_through_a_pool_kernel(tokenizer, identity_capture) -> None:
    model = make_model("mistral")  # sliding window: the kernel gets the window, the bucket as its bound
    eager = KVBoost(model, tokenizer, config=EAGER)
    eager.core.runner.kernel = ReferenceKernel()
    reference = schedule(eager, prompts(), 6)
    engine = KVBoost(model, tokenizer, config=CONFIG)
    kernel = BucketKernel()
    engine.core.runner.kernel = engine.core.runner.graphs.kernel = kernel
    got = schedule(engine, prompts(), 6)
    for (_, g), (_, want) in zip(got, reference, strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    assert engine.core.runner.graphs.replays > 0 and kernel.calls > 0


def test_padding_rows_write_only_the_scratch_slot(tokenizer, identity_capture) -> None:
    model = make_model("llama")
    engine = KVBoost(model, tokenizer, config=CONFIG)
    storage = engine.kv.storage
    marker = 1234.5
    for keys in storage.keys:
        keys.fill_(marker)
    # Three requests decode together: padded to four rows, one padding row at position 0.
    for i in range(3):
        engine.add_request(
            words(12, seed=i), SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()
    assert engine.core.runner.graphs.replays > 0
    owned = storage.keys[0][:, : storage.scratch_slot]
    untouched = (owned == marker).all(dim=(0, 2))
    written = int((~untouched).sum())
    assert written == 3 * (12 + 6 - 1)  # each request's prompt and fed tokens, nothing else
    assert not (storage.keys[0][:, storage.scratch_slot] == marker).all()  # the padding row wrote here


def test_a_failed_capture_falls_back_to_eager_steps(tokenizer, monkeypatch, caplog) -> None:
    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(build, "graph_capture", lambda device: broken)
    model = make_model("llama")
    reference = schedule(KVBoost(model, tokenizer, config=EAGER), prompts(), 5)
    engine = KVBoost(model, tokenizer, config=CONFIG)
    with caplog.at_level(logging.WARNING, logger="kvb_cache.core.decode_graphs"):
        got = schedule(engine, prompts(), 5)
    for (_, g), (_, want) in zip(got, reference, strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    graphs = engine.core.runner.graphs
    assert graphs.replays == 0
    assert (
        graphs.disabled == "capturing failed (RuntimeError: operation not permitted when stream is capturing)"
    )
    assert sum("run eagerly from now on" in r.message for r in caplog.records) == 1
    assert graphs._logits is None and not graphs._slots  # nothing kept for graphs that will never run


def test_a_bucket_out_of_memory_runs_eagerly_alone(tokenizer, monkeypatch) -> None:
    """Capturing the largest bucket may not fit beside a full pool: that bucket runs eagerly, the others
    keep their graphs."""
    calls = []

    def capture(fn):
        calls.append(fn)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fn

    monkeypatch.setattr(build, "graph_capture", lambda device: capture)
    model = make_model("llama")
    reference = schedule(KVBoost(model, tokenizer, config=EAGER), prompts(), 6)
    engine = KVBoost(model, tokenizer, config=CONFIG)
    got = schedule(engine, prompts(), 6)
    for (_, g), (_, want) in zip(got, reference, strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    graphs = engine.core.runner.graphs
    assert graphs.disabled is None and len(graphs._eager) == 1 and graphs.captures >= 2
    assert not graphs._eager & set(graphs._replays) and graphs.replays > 0


def test_a_model_with_forward_hooks_is_not_captured(tokenizer, identity_capture, caplog) -> None:
    """A hook is Python a replay would skip (its state frozen at the captured step): such a model runs
    eagerly, hooks and all."""
    model = make_model("llama")
    seen = []
    handle = model.model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(1))
    try:
        engine = KVBoost(model, tokenizer, config=CONFIG)
        with caplog.at_level(logging.WARNING, logger="kvb_cache.core.decode_graphs"):
            got = schedule(engine, prompts(), 4)
    finally:
        handle.remove()
    graphs = engine.core.runner.graphs
    assert graphs.replays == 0 and "forward hooks" in graphs.disabled
    assert len(seen) >= len(got)  # the hook ran in every step (and in the engine's start-up probes)


def test_no_graphs_off_cuda_or_when_eager(llama, tokenizer) -> None:
    engine = KVBoost(llama, tokenizer)  # a CPU: nothing to capture
    assert engine.core.runner.graphs is None and engine.kv.storage.scratch_slot is None
    assert engine.cache_stats()["cuda_graphs"] is None
    assert build.graph_capture(torch.device("cpu")) is None
    with pytest.raises(ConfigError, match="enforce_eager must be True or False"):
        EngineConfig(enforce_eager="yes")


def test_buckets() -> None:
    assert row_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert row_buckets(6) == (1, 2, 4, 6) and row_buckets(1) == (1,)
    assert width_buckets(1000, 16) == (256, 512, 1008)
    assert width_buckets(100, 16) == (112,)
    assert width_buckets(4096, 16) == (256, 512, 1024, 2048, 4096)
    assert bucket((1, 2, 4), 3) == 4 and bucket((1, 2, 4), 5) is None
