"""The engine loop's attention through a block-table kernel (``attention_backend``, core/pool_kernel.py).

kvb-kernels' Triton kernel runs on CUDA (checked there by tools/gpu_checks.py); here a plain-torch kernel with
the same contract stands in for it, so what is tested is kvb-cache's side: the pool seen as pages without a
copy, the block tables and lengths the runner builds, the rows the kernel's outputs land in, and which layers
keep the gather + SDPA path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model, words

from kvb_cache import ConfigError, EngineConfig, KVBoost, SamplingParams
from kvb_cache.core import pool_kernel
from kvb_cache.core.pool_kernel import block_table, pages, resolve_backend


class ReferenceKernel:
    """kvb-kernels' ``paged_attention`` contract in plain torch: each sequence's pages gathered in table order,
    its queries at the last ``q`` positions, causal, an optional sliding window."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, query, key_pages, value_pages, table, kv_lens, *, window, scale, max_len):
        self.calls += 1
        batch, heads, q_len, dim = query.shape
        kv_heads, page = key_pages.shape[1], key_pages.shape[2]
        assert table.dtype == torch.int32 and kv_lens.dtype == torch.int32 and table.shape[0] == batch
        # The host-side bound the runner passes (so the real kernel reads nothing back) is the longest length.
        assert isinstance(max_len, int) and max_len == int(kv_lens.max())
        out = []
        for b in range(batch):
            n = int(kv_lens[b])
            used = table[b, : -(-n // page)].long()
            k = key_pages[used].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
            v = value_pages[used].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
            q_pos = torch.arange(n - q_len, n).unsqueeze(1)
            k_pos = torch.arange(n).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            group = heads // kv_heads
            o = F.scaled_dot_product_attention(
                query[b : b + 1],
                k.repeat_interleave(group, 0)[None],
                v.repeat_interleave(group, 0)[None],
                attn_mask=mask,
                scale=scale,
            )
            out.append(o)
        return torch.cat(out)


def run_schedule(engine: KVBoost, prompts: list[str], new_tokens: int) -> list[torch.Tensor]:
    """Every step's sampled logits while ``prompts`` run: the first alone (so the others hit its prefix
    blocks), then the rest together with it (prefills beside decodes, decodes of different lengths)."""
    logits: list[torch.Tensor] = []
    forward = engine.core.runner.forward

    def recording(seqs):
        out = forward(seqs)
        logits.append(out.clone())
        return out

    engine.core.runner.forward = recording
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.add_request(prompts[0], params)
    engine.step()
    for prompt in prompts[1:]:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return logits


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt_neox"])  # GQA, sliding window (24), MHA
def test_kernel_path_gives_the_sdpa_paths_logits(arch: str, tokenizer) -> None:
    model = make_model(arch)
    shared = words(70, seed=5)
    prompts = [shared + words(9, seed=6), shared + words(30, seed=7), words(50, seed=8), shared]
    config = EngineConfig(block_size=8, max_num_batched_tokens=64, max_num_seqs=4, attention_backend="sdpa")
    reference = run_schedule(KVBoost(model, tokenizer, config=config), prompts, 6)
    engine = KVBoost(model, tokenizer, config=config)
    kernel = engine.core.runner.kernel = ReferenceKernel()
    through_kernel = run_schedule(engine, prompts, 6)
    assert kernel.calls > 0
    assert len(through_kernel) == len(reference) >= 8  # sliced prefills, mixed steps, decodes
    for got, want in zip(through_kernel, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert engine.paged_stats().prefix_cache_hits > 0  # the shared prefix was read from shared blocks
    assert engine.cache_stats()["attention_backend"] == "kvb_kernels"


def test_the_stats_name_the_resolved_backend(llama, tokenizer) -> None:
    engine = KVBoost(llama, tokenizer)  # auto on a CPU: gather + SDPA
    assert engine.core.runner.kernel is None
    assert engine.cache_stats()["attention_backend"] == "sdpa"


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])  # soft-capping, attention sinks
def test_layers_the_kernel_cannot_compute_keep_the_sdpa_path(arch: str, tokenizer) -> None:
    model = make_model(arch)
    config = EngineConfig(block_size=8, attention_backend="sdpa")
    reference = run_schedule(KVBoost(model, tokenizer, config=config), [words(40), words(20, seed=1)], 3)
    engine = KVBoost(model, tokenizer, config=config)
    kernel = engine.core.runner.kernel = ReferenceKernel()
    got = run_schedule(engine, [words(40), words(20, seed=1)], 3)
    if arch == "gemma2":  # every Gemma 2 layer soft-caps its scores
        assert kernel.calls == 0
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pool_pages_and_block_tables() -> None:
    pool = torch.arange(2 * 6 * 4 * 3, dtype=torch.float32).view(2, 24, 3)  # [KVH, 6 blocks x 4, D]
    paged = pages(pool, 4)
    assert paged.shape == (6, 2, 4, 3) and paged.data_ptr() == pool.data_ptr()  # a view, no copy
    assert torch.equal(paged[5, 1, 2], pool[1, 5 * 4 + 2])
    slots = torch.tensor([[20, 21, 22, 23, 4, 5, 6, 7, 12, 13], [8, 9, 10, 11, 0, 0, 0, 0, 0, 0]])
    assert block_table(slots, 4).tolist() == [[5, 1, 3], [2, 0, 0]]
    assert block_table(slots, 4).dtype == torch.int32


def test_backend_choice(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("sdpa", cpu, torch.float32) is None
    assert resolve_backend("auto", cpu, torch.float32) is None  # the Triton interpreter is never a default
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        resolve_backend("flash", cpu, torch.float32)
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    monkeypatch.setattr(
        pool_kernel, "_kvb_kernels", lambda device, dtype: (None, "kvb-kernels is not installed")
    )
    with pytest.raises(ConfigError, match=r"kvb-kernels is not installed.*attention_backend='sdpa'"):
        resolve_backend("kvb_kernels", cpu, torch.float32)
    assert resolve_backend("auto", torch.device("cuda"), torch.float16) is None  # auto falls back quietly
    kernel = ReferenceKernel()
    monkeypatch.setattr(pool_kernel, "_kvb_kernels", lambda device, dtype: (kernel, "a kernel"))
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) is kernel
    assert resolve_backend("auto", torch.device("cuda"), torch.float32) is None  # slower than SDPA in fp32
    assert resolve_backend("kvb_kernels", torch.device("cuda"), torch.float32) is kernel  # asked for: served
    assert resolve_backend("auto", cpu, torch.float32) is None


def test_which_layers_the_kernel_serves() -> None:
    from kvb_cache.core.paged_attention import _kernel_serves

    def qkv(dim: int, value_dim: int | None = None, dtype=torch.float32):
        return (
            torch.zeros(1, 4, 3, dim, dtype=dtype),
            torch.zeros(2, 16, dim, dtype=torch.float32),
            torch.zeros(2, 16, value_dim or dim, dtype=torch.float32),
        )

    assert _kernel_serves(*qkv(64), None, None, None)
    assert _kernel_serves(*qkv(256), None, None, None)
    assert not _kernel_serves(*qkv(512), None, None, None)  # wider than the kernel's tiles
    assert not _kernel_serves(*qkv(64, 128), None, None, None)  # value width differs
    assert not _kernel_serves(*qkv(64, dtype=torch.float16), None, None, None)  # not the pool's dtype
    assert not _kernel_serves(*qkv(64), 8, None, None)  # chunked attention (Llama 4)
    assert not _kernel_serves(*qkv(64), None, 50.0, None)  # soft-capping
    assert not _kernel_serves(*qkv(64), None, None, torch.zeros(4))  # attention sinks


def test_stitched_requests_read_their_private_blocks_through_the_kernel(llama, tokenizer) -> None:
    """A stitched prompt's repaired KV is adopted into private blocks; its suffix prefill and decodes then
    read them through the kernel and get the SDPA path's logits."""
    from conftest import rag_prompts

    from kvb_cache import StitchConfig

    first, second = rag_prompts(tokenizer)
    config = EngineConfig(chunk_size=16, block_size=8, stitching=StitchConfig(), attention_backend="sdpa")
    runs = []
    for kernel in (None, ReferenceKernel()):
        engine = KVBoost(llama, tokenizer, config=config)
        engine.core.runner.kernel = kernel
        engine.generate(first, max_new_tokens=2)  # stores the documents
        runs.append(run_schedule(engine, [second, first[:40]], 5))
        assert engine.cache_stats()["stitching"]["stitched_tokens"] > 0
    assert runs[1] and len(runs[0]) == len(runs[1])
    for got, want in zip(runs[1], runs[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
