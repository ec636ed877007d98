import json

import pytest

from kvb_planner import (
    DeviceProfile,
    Ladder,
    LadderStep,
    PlannerConfigError,
    PlannerPolicy,
    PlanRequest,
    Verdict,
    estimate_memory,
    plan,
)

MIB = 1 << 20


def gpu(free_bytes: int) -> DeviceProfile:
    return DeviceProfile(device="cuda:0", total_bytes=max(free_bytes, 80 << 30), free_bytes=free_bytes)


def fits_somewhere(request, shape, budget, ladder=None) -> bool:
    steps = (ladder or Ladder.default()).steps
    return any(estimate_memory(request, s, shape).peak_bytes <= budget for s in steps)


def test_roomy_device_runs_single_shot_full_precision(smollm2_shape):
    request = PlanRequest(prompt_tokens=1000, max_new_tokens=100)
    result = plan(request, gpu(8 << 30), smollm2_shape)
    assert result.verdict is Verdict.RUN and result.admitted
    assert (result.prefill_chunk_size, result.kv_bits) == (None, 16)
    assert result.estimate == estimate_memory(request, LadderStep(prefill_chunk_size=None), smollm2_shape)
    assert result.budget_bytes == int((8 << 30) * 0.9)


def test_tight_device_picks_chunked_int8(smollm2_shape):
    # 8100 tokens of fp32 KV alone is 8100 * 46,080 B = 356 MiB > the 270 MiB budget, so no 16-bit step
    # fits; 8-bit single-shot still needs 8000 * 6912 * 4 B = 211 MiB of MLP activations on top of the
    # ~100 MiB KV (339 MiB); 8-bit with 2048-token slices needs 279 MiB (2048-wide slices attend over 8000
    # tokens: mask + repeat_kv); 8-bit with 1024-token slices (221 MiB) is the first step that fits.
    result = plan(PlanRequest(prompt_tokens=8000, max_new_tokens=100), gpu(300 * MIB), smollm2_shape)
    assert (result.verdict, result.prefill_chunk_size, result.kv_bits) == (Verdict.RUN, 1024, 8)
    assert result.estimate.peak_bytes <= result.budget_bytes == 270 * MIB


def test_budget_boundary_is_inclusive(smollm2_shape):
    request = PlanRequest(prompt_tokens=4000, max_new_tokens=50)
    target = estimate_memory(request, LadderStep(prefill_chunk_size=512), smollm2_shape).peak_bytes
    exact = PlannerPolicy(safety_margin=0.0)
    assert plan(request, gpu(target), smollm2_shape, exact).step == LadderStep(prefill_chunk_size=512)
    assert plan(request, gpu(target - 1), smollm2_shape, exact).step == LadderStep(prefill_chunk_size=256)


def test_safety_margin_shrinks_the_budget(smollm2_shape):
    request = PlanRequest(prompt_tokens=4000, max_new_tokens=50)
    target = estimate_memory(request, LadderStep(prefill_chunk_size=512), smollm2_shape).peak_bytes
    free = int(target / 0.8) + 1  # fits at a 20% margin ...
    assert plan(request, gpu(free), smollm2_shape, PlannerPolicy(safety_margin=0.2)).step == LadderStep(
        prefill_chunk_size=512
    )
    # ... but not at 30%, where a later rung is chosen: the first one under the smaller budget.
    tighter = plan(request, gpu(free), smollm2_shape, PlannerPolicy(safety_margin=0.3))
    assert tighter.budget_bytes == int(free * 0.7) < target
    steps = Ladder.default().steps
    chosen = steps.index(tighter.step)
    assert chosen > steps.index(LadderStep(prefill_chunk_size=512))
    assert tighter.estimate.peak_bytes <= tighter.budget_bytes
    assert all(
        estimate_memory(request, st, smollm2_shape).peak_bytes > tighter.budget_bytes for st in steps[:chosen]
    )


def test_custom_ladder_is_walked_in_order(tiny_shape):
    ladder = Ladder(steps=(LadderStep(prefill_chunk_size=64, kv_bits=8), LadderStep(prefill_chunk_size=None)))
    result = plan(
        PlanRequest(prompt_tokens=10, max_new_tokens=1),
        gpu(1 << 30),
        tiny_shape,
        PlannerPolicy(ladder=ladder),
    )
    assert result.step == LadderStep(prefill_chunk_size=64, kv_bits=8)


def test_refusal_carries_binary_searched_suggestions(smollm2_shape):
    request = PlanRequest(prompt_tokens=80_000, max_new_tokens=100)
    result = plan(request, gpu(300 * MIB), smollm2_shape)
    assert result.verdict is Verdict.REFUSE and not result.admitted
    assert result.step is None and result.estimate is None and result.kv_bits is None
    refusal = result.refusal
    budget = result.budget_bytes
    s = refusal.suggested_max_tokens
    assert 1 <= s < request.prompt_tokens
    assert fits_somewhere(PlanRequest(prompt_tokens=s, max_new_tokens=100), smollm2_shape, budget)
    assert not fits_somewhere(PlanRequest(prompt_tokens=s + 1, max_new_tokens=100), smollm2_shape, budget)
    # Even with no generation the 80k prompt does not fit.
    assert refusal.suggested_max_new_tokens == 0
    assert refusal.predicted_peak_bytes == min(
        estimate_memory(request, st, smollm2_shape).peak_bytes for st in Ladder.default().steps
    )
    assert refusal.free_bytes == 300 * MIB and refusal.prompt_tokens == 80_000


def test_refusal_suggests_a_smaller_max_new_tokens(smollm2_shape):
    request = PlanRequest(prompt_tokens=1000, max_new_tokens=200_000)
    refusal = plan(request, gpu(300 * MIB), smollm2_shape).refusal
    n = refusal.suggested_max_new_tokens
    assert n >= 1
    budget = int(300 * MIB * 0.9)
    assert fits_somewhere(PlanRequest(prompt_tokens=1000, max_new_tokens=n), smollm2_shape, budget)
    assert not fits_somewhere(PlanRequest(prompt_tokens=1000, max_new_tokens=n + 1), smollm2_shape, budget)


def test_auto_truncate_keeps_the_longest_prompt_that_fits(smollm2_shape):
    refused = plan(PlanRequest(prompt_tokens=80_000, max_new_tokens=100), gpu(300 * MIB), smollm2_shape)
    result = plan(
        PlanRequest(prompt_tokens=80_000, max_new_tokens=100, auto_truncate=True),
        gpu(300 * MIB),
        smollm2_shape,
    )
    assert result.verdict is Verdict.TRUNCATE and result.admitted
    assert result.prompt_tokens == refused.refusal.suggested_max_tokens
    assert result.dropped_tokens == 80_000 - result.prompt_tokens
    truncated = PlanRequest(prompt_tokens=result.prompt_tokens, max_new_tokens=100)
    assert result.estimate == estimate_memory(truncated, result.step, smollm2_shape)
    assert result.estimate.peak_bytes <= result.budget_bytes
    # The chosen step is the first rung that fits the truncated prompt.
    assert plan(truncated, gpu(300 * MIB), smollm2_shape).step == result.step


def test_auto_truncate_refuses_when_one_token_does_not_fit(tiny_shape):
    result = plan(PlanRequest(prompt_tokens=50, max_new_tokens=10, auto_truncate=True), gpu(1000), tiny_shape)
    assert result.verdict is Verdict.REFUSE
    assert result.refusal.suggested_max_tokens == 0
    assert "even a one-token prompt does not fit" in result.refusal.message


def test_plan_is_pure(smollm2_shape):
    request, profile = PlanRequest(prompt_tokens=80_000, max_new_tokens=100), gpu(300 * MIB)
    assert plan(request, profile, smollm2_shape) == plan(request, profile, smollm2_shape)


def test_plan_to_dict_is_json_safe_on_a_probed_cpu(tiny_shape):
    profile = DeviceProfile.probe("cpu")
    for request in (
        PlanRequest(prompt_tokens=100, max_new_tokens=10),
        PlanRequest(prompt_tokens=10**9, max_new_tokens=10),
    ):
        payload = plan(request, profile, tiny_shape).to_dict()
        json.dumps(payload, allow_nan=False)
        json.dumps(profile.to_dict(), allow_nan=False)
    assert payload["verdict"] == "refuse" and payload["refusal"]["code"] == "request_too_large_for_memory"


def test_policy_validation():
    with pytest.raises(PlannerConfigError, match="safety_margin"):
        PlannerPolicy(safety_margin=1.0)
