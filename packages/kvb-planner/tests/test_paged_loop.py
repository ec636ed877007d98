"""The paged-loop estimate: exact arithmetic on a synthetic shape, and how it composes with the ladder."""

import dataclasses

import pytest

from kvb_planner import (
    DeviceProfile,
    Ladder,
    LadderStep,
    PagedLoop,
    PlannerConfigError,
    PlannerPolicy,
    PlanRequest,
    Verdict,
    estimate_memory,
    plan,
)
from kvb_planner.memory_model import cpu_sdpa_tile_bytes

SINGLE = LadderStep(prefill_chunk_size=None)
LOOP = PagedLoop(step_tokens=32, sampled_rows=4, decode_gather_tokens=64)


def test_loop_terms(tiny_shape):
    """tiny_shape: Hq 4, Hkv 2 (G = 2), d 16, so 64 key + value channels per token and layer; fp32."""
    est = estimate_memory(
        PlanRequest(prompt_tokens=100, max_new_tokens=28), SINGLE, tiny_shape, device="cpu", loop=LOOP
    )
    assert est.paged and est.kv_bytes == 0 and est.cache_growth_bytes == 0  # the KV is in the pool
    # Prefill: the whole 100-token context gathered, a [G * 32 rows, 100] mask (bool + float copy on the CPU).
    prefill = 100 * 64 * 4 + 2 * 32 * 100 * (1 + 4)
    # Decode: max(decode_gather_tokens 64, the request's own T = 128) positions gathered, and their mask.
    decode = 128 * (64 * 4 + 1 + 4)
    assert est.attention_scratch_bytes == max(prefill, decode) == 57_600
    # Activations of a full 32-token step, whoever fills it.
    assert est.mlp_phase_bytes == 32 * (3 * 128 + 4 * 64) * 4 == 81_920
    assert est.attention_phase_bytes == 32 * (3 * 64 + 4 * 64 + 4 * 32) * 4 + 57_600 == 131_328
    assert est.logits_bytes == 4 * 128 * 4  # the 4 sampled rows
    assert est.sampler_bytes == 4 * 128 * (4 + 8 * 4)
    assert est.peak_bytes == 2_048 + 131_328


def test_the_pool_holds_the_kv_so_generation_length_costs_nothing(tiny_shape):
    loop = dataclasses.replace(LOOP, decode_gather_tokens=4096)
    short, long = (
        estimate_memory(PlanRequest(prompt_tokens=100, max_new_tokens=n), SINGLE, tiny_shape, loop=loop)
        for n in (28, 2000)
    )
    assert short.peak_bytes == long.peak_bytes
    solo = [
        estimate_memory(PlanRequest(prompt_tokens=100, max_new_tokens=n), SINGLE, tiny_shape).peak_bytes
        for n in (28, 2000)
    ]
    assert solo[1] > solo[0]  # on a cache of its own the KV is the request's


def test_prefill_slices_are_capped_by_the_step(tiny_shape):
    request = PlanRequest(prompt_tokens=100, max_new_tokens=0)
    peaks = {
        chunk: estimate_memory(
            request, LadderStep(prefill_chunk_size=chunk), tiny_shape, device="cpu", loop=LOOP
        ).peak_bytes
        for chunk in (None, 2048, 32, 8)
    }
    assert peaks[None] == peaks[2048] == peaks[32]  # the loop feeds at most 32 tokens a step anyway
    assert peaks[8] < peaks[32]  # a smaller slice: a smaller mask


def test_masks_are_built_a_block_of_rows_at_a_time(tiny_shape):
    loop = dataclasses.replace(LOOP, mask_elements=4096)
    est = estimate_memory(
        PlanRequest(prompt_tokens=10_000, max_new_tokens=0), SINGLE, tiny_shape, device="cpu", loop=loop
    )
    # 4096 // (G * 10000) = 0 -> one query row per call: a [2, 10000] mask.
    assert est.attention_scratch_bytes == 10_000 * 64 * 4 + 2 * 1 * 10_000 * 5


def test_cuda_masks_and_eager_scores(tiny_shape):
    request = PlanRequest(prompt_tokens=100, max_new_tokens=0)
    cuda = estimate_memory(request, SINGLE, tiny_shape, device="cuda:0", loop=LOOP)
    assert cuda.attention_scratch_bytes == 100 * 64 * 4 + 6_400 * (1 + 2 * 4)  # + the kernel's aligned copy
    eager = estimate_memory(
        request, SINGLE, tiny_shape, device="cpu", loop=dataclasses.replace(LOOP, eager_attention=True)
    )
    # fp32 scores and probabilities of each key head's [G * rows, ctx] block.
    assert eager.attention_scratch_bytes == 57_600 + 2 * 4 * 2 * 6_400


def test_logits_rows(tiny_shape):
    request = PlanRequest(prompt_tokens=100, max_new_tokens=0)
    every_token = dataclasses.replace(LOOP, logits_rows=32)  # a model that cannot keep only sampled rows
    assert estimate_memory(request, SINGLE, tiny_shape, loop=every_token).logits_bytes == 32 * 128 * 4
    echo = dataclasses.replace(request, prompt_logprobs=True)  # scoring is charged apart (next test)
    assert estimate_memory(echo, SINGLE, tiny_shape, loop=LOOP).logits_bytes == 4 * 128 * 4


@pytest.mark.parametrize("dtype_bytes", [4, 2])
def test_a_scored_prompt_adds_the_scorers_cache_and_fp32_slice(tiny_shape, dtype_bytes):
    """Echo + logprobs: the engine scores the prompt beside its steps, on a DynamicCache of the whole prompt
    and one slice of fp32 logits at a time. Charged as plain generation, a bf16 4000-token request peaked at
    3.3x the plan; the fp32 terms do not halve with the model's dtype."""
    shape = dataclasses.replace(tiny_shape, dtype_bytes=dtype_bytes)
    plain = PlanRequest(prompt_tokens=100, max_new_tokens=0)
    scored = dataclasses.replace(plain, prompt_logprobs=True)
    loop = dataclasses.replace(LOOP, score_slice_tokens=64)
    base = estimate_memory(plain, SINGLE, shape, loop=loop)
    est = estimate_memory(scored, SINGLE, shape, loop=loop)
    assert est.logits_bytes == base.logits_bytes  # the steps keep their rows; scoring is charged apart
    kv = 2 * 2 * (2 * 16) * 100 * dtype_bytes  # layers x (K + V) x kv_heads * head_dim x prompt x e
    assert est.kv_bytes == kv
    fp32 = 64 * 128 * ((4 if dtype_bytes != 4 else 0) + 4)  # the fp32 copy (16-bit logits) and log_softmax
    assert est.scoring_bytes >= 64 * 128 * dtype_bytes + fp32
    assert est.peak_bytes == max(base.peak_bytes, est.scoring_bytes) + kv


def test_quantized_steps_run_on_a_cache_of_their_own(tiny_shape):
    request = PlanRequest(prompt_tokens=100, max_new_tokens=28)
    int8 = LadderStep(prefill_chunk_size=None, kv_bits=8)
    looped = estimate_memory(request, int8, tiny_shape, device="cpu", loop=LOOP)
    assert looped == estimate_memory(request, int8, tiny_shape, device="cpu")
    assert not looped.paged and looped.kv_bytes > 0


def test_solo_paths_charge_the_larger_estimate(tiny_shape):
    loop = dataclasses.replace(LOOP, solo_paths=True)
    long = PlanRequest(prompt_tokens=3000, max_new_tokens=100)
    est = estimate_memory(long, SINGLE, tiny_shape, device="cpu", loop=loop)
    assert not est.paged and est == estimate_memory(long, SINGLE, tiny_shape, device="cpu")
    short = PlanRequest(prompt_tokens=4, max_new_tokens=4)
    est = estimate_memory(short, SINGLE, tiny_shape, device="cpu", loop=loop)
    assert est.paged and est.peak_bytes > estimate_memory(short, SINGLE, tiny_shape, device="cpu").peak_bytes


def test_a_long_prompt_runs_exactly_in_the_loop_where_alone_it_would_be_quantized(smollm2_shape):
    """SmolLM2-135M fp32, a 6000-token prompt: on a cache of its own it needs its 266 MiB of KV (plus a
    concatenation copy of one layer), so 200 MiB free sends it to 8-bit KV; in a loop (1024-token steps, 32
    rows) its KV is in the pool and it runs as asked."""
    request = PlanRequest(prompt_tokens=6000, max_new_tokens=64)
    profile = DeviceProfile(device="cpu", total_bytes=1 << 34, free_bytes=200 << 20)
    solo = plan(request, profile, smollm2_shape, PlannerPolicy(safety_margin=0.0))
    assert solo.verdict is Verdict.RUN and solo.kv_bits == 8
    loop = PagedLoop(step_tokens=1024, sampled_rows=32)
    looped = plan(request, profile, smollm2_shape, PlannerPolicy(safety_margin=0.0, loop=loop))
    assert looped.verdict is Verdict.RUN and looped.kv_bits == 16 and looped.prefill_chunk_size is None
    assert looped.estimate.paged and looped.estimate.peak_bytes < solo.estimate.peak_bytes
    # With too little memory for even one step, the loop refuses (and suggests nothing shorter that fits
    # at 16 bits only).
    tight = DeviceProfile(device="cpu", total_bytes=1 << 34, free_bytes=32 << 20)
    policy = PlannerPolicy(safety_margin=0.0, loop=loop, ladder=Ladder.default(kv_bits=(16,)))
    refused = plan(request, tight, smollm2_shape, policy)
    assert refused.verdict is Verdict.REFUSE and refused.refusal.suggested_max_tokens == 0
    # The fix is not the request's lengths: the message names the engine's step limits.
    assert refused.refusal.step_bound and "max_num_batched_tokens" in refused.refusal.message
    assert "Lower max_tokens" not in refused.refusal.message
    solo = plan(request, tight, smollm2_shape, dataclasses.replace(policy, loop=None))
    assert not solo.refusal.step_bound and "max_num_batched_tokens" not in solo.refusal.message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"step_tokens": 0, "sampled_rows": 1},
        {"step_tokens": 8, "sampled_rows": True},
        {"step_tokens": 8, "sampled_rows": 1, "logits_rows": 0},
        {"step_tokens": 8, "sampled_rows": 1, "mask_elements": 1.5},
    ],
)
def test_loop_validation(kwargs):
    with pytest.raises(PlannerConfigError, match="PagedLoop"):
        PagedLoop(**kwargs)


def test_policy_takes_only_a_paged_loop():
    with pytest.raises(PlannerConfigError, match="PagedLoop"):
        PlannerPolicy(loop={"step_tokens": 8})


def test_cpu_attention_tiles_are_charged_per_thread(tiny_shape):
    """torch's CPU flash-attention kernel allocates a score tile per intra-op thread; the loop folds the G
    query heads of a key head into one [G * rows] block (here 2 x 32 = 64 queries, in blocks of 32 rows below 192 queries)."""
    assert cpu_sdpa_tile_bytes(64, 100, 16, 4, 1) == (32 * 100 + 2 * 32 + 32 * 16) * 4
    assert cpu_sdpa_tile_bytes(1024, 4000, 64, 2, 3) == 3 * ((256 * 512 + 512 + 256 * 64) * 4 + 256 * 512 * 2)
    request = PlanRequest(prompt_tokens=100, max_new_tokens=28)
    base = estimate_memory(request, SINGLE, tiny_shape, device="cpu", loop=LOOP)
    for threads in (1, 8):
        est = estimate_memory(request, SINGLE, tiny_shape, device="cpu", loop=LOOP, cpu_threads=threads)
        tile = cpu_sdpa_tile_bytes(64, 100, 16, 4, threads)
        assert est.attention_scratch_bytes == base.attention_scratch_bytes + tile
    # Not on CUDA, and not without a thread count (a profile written by hand).
    cuda = estimate_memory(request, SINGLE, tiny_shape, device="cuda:0", loop=LOOP, cpu_threads=8)
    assert cuda == estimate_memory(request, SINGLE, tiny_shape, device="cuda:0", loop=LOOP)


def test_plan_charges_the_probed_thread_count(tiny_shape):
    request = PlanRequest(prompt_tokens=100, max_new_tokens=28)
    policy = PlannerPolicy(safety_margin=0.0, loop=LOOP)
    profiles = [
        DeviceProfile(device="cpu", total_bytes=1 << 30, free_bytes=1 << 29, cpu_threads=threads)
        for threads in (None, 16)
    ]
    plain, threaded = (plan(request, profile, tiny_shape, policy) for profile in profiles)
    tile = cpu_sdpa_tile_bytes(64, 100, 16, 4, 16)
    assert threaded.estimate.peak_bytes == plain.estimate.peak_bytes + tile
    with pytest.raises(PlannerConfigError, match="cpu_threads"):
        DeviceProfile(device="cpu", total_bytes=1, free_bytes=1, cpu_threads=0)
