"""Decode steps replayed from real CUDA graphs (skipped without CUDA; the CPU suite checks the bookkeeping
with an identity capture, tests/test_decode_graphs.py).

On CUDA the capture records the step's launches once; every later step of the bucket only refreshes the
static inputs and replays. The logits must stay those of eager steps on the same schedule (padding rows may
change a matmul's blocking: fp32 within 1e-4 here), and a model whose forward cannot be captured must fall
back to eager steps with the CUDA context still usable.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_model, words
from test_decode_graphs import CONFIG, EAGER, prompts, schedule

from kvb_cache import KVBoost

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt_neox", "gemma2", "gemma3", "gpt2"])
def test_cuda_graph_steps_give_the_eager_logits(arch: str, tokenizer) -> None:
    model = make_model(arch).to("cuda")
    reference = schedule(KVBoost(model, tokenizer, config=EAGER), prompts(), 8)
    engine = KVBoost(model, tokenizer, config=CONFIG)
    got = schedule(engine, prompts(), 8)
    graphs = engine.core.runner.graphs
    assert graphs is not None and graphs.disabled is None, graphs.disabled
    assert graphs.captures >= 3 and graphs.replays > graphs.captures
    for (_, g), (_, want) in zip(got, reference, strict=True):
        torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)


def test_a_forward_that_reads_the_device_falls_back(tokenizer) -> None:
    model = make_model("llama").to("cuda")
    norm = model.model.norm
    plain = norm.forward

    def reads_back(hidden):  # a host read inside the forward: not capturable
        if float(hidden.abs().sum()) < 0:
            raise AssertionError
        return plain(hidden)

    norm.forward = reads_back
    reference = schedule(KVBoost(model, tokenizer, config=EAGER), prompts(), 6)
    engine = KVBoost(model, tokenizer, config=CONFIG)
    got = schedule(engine, prompts(), 6)
    graphs = engine.core.runner.graphs
    assert graphs.disabled is not None and graphs.replays == 0
    # The failed capture left this thread on its own stream (torch.cuda.graph's exit did not restore it).
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    for (_, g), (_, want) in zip(got, reference, strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("long", [False, True])  # long: 300-400 token contexts, the 512-wide bucket
def test_bf16_graphs_through_the_pool_kernel(long: bool, tokenizer) -> None:
    pytest.importorskip("kvb_kernels")
    model = make_model("llama" if long else "mistral").to("cuda", torch.bfloat16)
    config = dataclasses.replace(CONFIG, attention_backend="kvb_kernels", max_num_batched_tokens=512)
    # The tiny configs' context is 512 positions: prompts of ~300-400 tokens reach the 512-wide bucket.
    texts = [words(300, seed=i) + " " + p for i, p in enumerate(prompts())] if long else prompts()
    reference = schedule(
        KVBoost(model, tokenizer, config=dataclasses.replace(config, enforce_eager=True)), texts, 8
    )
    engine = KVBoost(model, tokenizer, config=config)
    got = schedule(engine, texts, 8)
    graphs = engine.core.runner.graphs
    assert graphs.disabled is None and graphs.replays > 0 and graphs.kernel is not None
    for (_, g), (_, want) in zip(got, reference, strict=True):
        # bf16; the replay's kernel launch is sized for the width bucket, the eager one for the longest row
        torch.testing.assert_close(g.float(), want.float(), atol=0.05, rtol=0.05)
