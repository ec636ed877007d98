"""The memory model: exact arithmetic on a synthetic shape, and the slice assumption on a real HF model."""

import dataclasses

import pytest
import torch

from kvb_planner import Ladder, LadderStep, ModelShape, PlanRequest, estimate_memory, tensor_peak
from kvb_planner.probes import cache_keyword

SINGLE = LadderStep(prefill_chunk_size=None)


def test_single_shot_terms(tiny_shape):
    est = estimate_memory(PlanRequest(prompt_tokens=100, max_new_tokens=28), SINGLE, tiny_shape, device="cpu")
    assert est.kv_bytes == 2 * 2 * 2 * 16 * 128 * 4 == 65_536  # T = 128
    assert est.cache_growth_bytes == 32_768  # one layer's K+V at T
    assert est.logits_bytes == 128 * 4 + 128 * 4  # last-position logits + sampler fp32 copy
    assert est.mlp_phase_bytes == 100 * (3 * 128 + 4 * 64) * 4 == 256_000
    assert est.attention_scratch_bytes == 0  # SDPA, no mask
    assert est.attention_phase_bytes == 100 * (3 * 64 + 4 * 64 + 4 * 32) * 4 == 230_400
    assert est.peak_bytes == 65_536 + 32_768 + 1_024 + 256_000 == 355_328


def test_a_weight_transient_is_added_on_top_of_the_larger_phase(tiny_shape):
    """A dequantizing int4 kernel's block (kvb-streaming's "torch" kernel) lives while a linear runs, in
    either phase: both the solo and the paged-loop estimates add it once, and report it."""
    from kvb_planner import PagedLoop

    request = PlanRequest(prompt_tokens=100, max_new_tokens=28)
    with_block = dataclasses.replace(tiny_shape, weight_transient_bytes=1_000_000)
    for loop in (None, PagedLoop(step_tokens=32, sampled_rows=4, decode_gather_tokens=64)):
        plain = estimate_memory(request, SINGLE, tiny_shape, device="cpu", loop=loop)
        est = estimate_memory(request, SINGLE, with_block, device="cpu", loop=loop)
        assert est.weight_transient_bytes == 1_000_000 and plain.weight_transient_bytes == 0
        assert est.peak_bytes == plain.peak_bytes + 1_000_000, loop


def test_chunked_prefill_charges_mask_and_repeat_kv(tiny_shape):
    est = estimate_memory(
        PlanRequest(prompt_tokens=100, max_new_tokens=28),
        LadderStep(prefill_chunk_size=25),
        tiny_shape,
        device="cpu",
    )
    assert est.mlp_phase_bytes == 25 * 640 * 4 == 64_000
    # bool + float mask [25, 100] (1 + 4 bytes) and repeat_kv's K,V expanded to 4 heads over 100 tokens.
    assert est.attention_scratch_bytes == 25 * 100 * 5 + 2 * 4 * 100 * 16 * 4 == 63_700
    assert est.attention_phase_bytes == 25 * 576 * 4 + 63_700 == 121_300
    assert est.peak_bytes == 65_536 + 32_768 + 1_024 + 121_300 == 220_628


def test_eager_attention_materialises_scores(tiny_shape):
    eager = dataclasses.replace(tiny_shape, attn_implementation="eager")
    est = estimate_memory(PlanRequest(prompt_tokens=100, max_new_tokens=28), SINGLE, eager)
    # 2 score buffers [4 heads, 100, 100] fp32 + float mask [100, 100] + repeat_kv.
    assert est.attention_scratch_bytes == 2 * 4 * 100 * 100 * 4 + 100 * 100 * 4 + 51_200 == 411_200
    assert est.peak_bytes == 99_328 + 230_400 + 411_200
    unknown = dataclasses.replace(tiny_shape, attn_implementation="some_new_kernel")
    assert (
        estimate_memory(
            PlanRequest(prompt_tokens=100, max_new_tokens=28), SINGLE, unknown
        ).attention_scratch_bytes
        == 2 * 4 * 100 * 100 * 4
    )  # unknown backends are assumed to materialise scores


def test_prompt_logprobs_and_quantized_growth(tiny_shape):
    request = PlanRequest(prompt_tokens=100, max_new_tokens=28, prompt_logprobs=True)
    assert estimate_memory(request, SINGLE, tiny_shape, device="cpu").logits_bytes == 100 * 128 * 4 + 128 * 4
    int8 = estimate_memory(
        PlanRequest(prompt_tokens=100, max_new_tokens=28),
        LadderStep(prefill_chunk_size=None, kv_bits=8),
        tiny_shape,
        device="cpu",
    )
    assert int8.kv_bytes == 65_536  # all 128 tokens inside the fp32 residual window
    assert int8.cache_growth_bytes == 65_536  # dequantized layer + cat
    assert int8.peak_bytes == 388_096


def test_batch_scales_every_term(tiny_shape):
    one = estimate_memory(
        PlanRequest(prompt_tokens=64, max_new_tokens=0), LadderStep(prefill_chunk_size=16), tiny_shape
    )
    three = estimate_memory(
        PlanRequest(prompt_tokens=64, max_new_tokens=0, batch_size=3),
        LadderStep(prefill_chunk_size=16),
        tiny_shape,
    )
    assert three.peak_bytes == 3 * one.peak_bytes


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("step", Ladder.default().steps)
def test_peak_is_monotone_in_prompt_and_generation(smollm2_shape, step, device):
    # plan()'s binary searches rely on this (on CUDA too, where fp32 GQA runs SDPA's math backend).
    def peak(p: int, n: int) -> int:
        request = PlanRequest(prompt_tokens=p, max_new_tokens=n)
        return estimate_memory(request, step, smollm2_shape, device=device).peak_bytes

    peaks = [peak(p, 16) for p in range(1, 3000, 37)]
    assert peaks == sorted(peaks)
    peaks = [peak(500, n) for n in range(0, 3000, 41)]
    assert peaks == sorted(peaks)


def test_cuda_fp32_gqa_without_a_mask_runs_the_math_backend(tiny_shape):
    """transformers passes enable_gqa when there is no mask; on CUDA the flash kernel takes no fp32 and the
    memory-efficient one no enable_gqa, so torch's math SDPA materialises 3 score-sized buffers."""
    request = PlanRequest(prompt_tokens=100, max_new_tokens=28)
    single = estimate_memory(request, SINGLE, tiny_shape, device="cuda:0")
    assert single.attention_scratch_bytes == 3 * 4 * 100 * 100 * 4
    # Sliced: the first slice is unmasked (math, [25, 25]); later ones masked ([25, 100] mask + repeat_kv).
    sliced = estimate_memory(request, LadderStep(prefill_chunk_size=25), tiny_shape, device="cuda:0")
    assert sliced.attention_scratch_bytes == max(3 * 4 * 25 * 25 * 4, 63_700)
    # Unknown device: the costlier rule; half precision or no GQA: a fused kernel (no scores).
    assert estimate_memory(request, SINGLE, tiny_shape).attention_scratch_bytes == 3 * 4 * 100 * 100 * 4
    # Only the CPU gets the CPU's rules: by prefix, "CUDA:0", "gpu" or "xpu:0" were planned as the CPU (0 B).
    for device in ("CUDA:0", "gpu", "xpu:0", "cuda"):
        got = estimate_memory(request, SINGLE, tiny_shape, device=device).attention_scratch_bytes
        assert got == 3 * 4 * 100 * 100 * 4, device
    half = dataclasses.replace(tiny_shape, dtype_bytes=2)
    assert estimate_memory(request, SINGLE, half, device="cuda:0").attention_scratch_bytes == 0
    mha = dataclasses.replace(tiny_shape, num_kv_heads=tiny_shape.num_attention_heads)
    assert estimate_memory(request, SINGLE, mha, device="cuda:0").attention_scratch_bytes == 0


def _tensor_peak_bytes(model, ids: torch.Tensor, chunk: int) -> int:
    """Peak of live CPU tensor bytes (torch.profiler memory events) while prefilling ``ids`` in slices."""
    from transformers import DynamicCache

    def prefill() -> None:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            for start in range(0, ids.shape[1], chunk):
                model(
                    ids[:, start : start + chunk],
                    **{cache_keyword(model): cache},
                    use_cache=True,
                    logits_to_keep=1,
                )

    return tensor_peak(prefill)


@pytest.mark.parametrize(("prompt", "chunk"), [(512, 512), (512, 128), (1024, 1024), (1024, 256)])
def test_prediction_brackets_profiled_tensor_peak(tiny_llama, prompt, chunk):
    ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(0))
    actual = _tensor_peak_bytes(tiny_llama, ids, chunk)
    step = LadderStep(prefill_chunk_size=None if chunk == prompt else chunk)
    predicted = estimate_memory(
        PlanRequest(prompt_tokens=prompt, max_new_tokens=0),
        step,
        ModelShape.from_model(tiny_llama),
        device="cpu",
    ).peak_bytes
    # Designed to be conservative (measured 1.04-1.09x here with torch 2.13 / transformers 5.23); the
    # lower bound leaves room for allocation-pattern changes across versions.
    assert 0.95 * actual <= predicted <= 1.25 * actual


def test_sliced_prefill_matches_single_shot_logits(tiny_llama):
    """The memory model assumes a prompt can be prefilled in slices without changing the result (fp32)."""
    from transformers import DynamicCache

    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = tiny_llama(ids).logits  # [1, 40, vocab]
        cache = DynamicCache(config=tiny_llama.config)
        parts = [
            tiny_llama(ids[:, s : s + 7], **{cache_keyword(tiny_llama): cache}, use_cache=True).logits
            for s in range(0, 40, 7)
        ]
    sliced = torch.cat(parts, dim=1)
    assert cache.get_seq_length() == 40
    torch.testing.assert_close(sliced, full, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("prompt", "chunk"), [(1024, 1024), (1024, 256)])
def test_prediction_brackets_cuda_peak(tiny_llama, prompt, chunk):  # pragma: no cover - needs a GPU
    from transformers import DynamicCache

    model = tiny_llama.cuda()
    ids = torch.randint(0, 128, (1, prompt), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        for start in range(0, prompt, chunk):
            model(
                ids[:, start : start + chunk],
                **{cache_keyword(model): cache},
                use_cache=True,
                logits_to_keep=1,
            )
    torch.cuda.synchronize()
    actual = torch.cuda.max_memory_allocated() - before
    step = LadderStep(prefill_chunk_size=None if chunk == prompt else chunk)
    predicted = estimate_memory(
        PlanRequest(prompt_tokens=prompt, max_new_tokens=0), step, ModelShape.from_model(model), device="cuda"
    ).peak_bytes
    print(f"prompt {prompt} chunk {chunk}: predicted {predicted} actual {actual}")
    # Run on an H200 (torch 2.11) on 2026-11-28: single-shot 1024 failed (3.4 MB predicted, 44 MB actual)
    # before the math-backend rule; see the module doc of kvb_planner.memory_model.
    assert predicted >= 0.95 * actual
