import json
from dataclasses import replace

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
    for bad in (1.0, "0.1", None, True, float("nan")):  # a string or None was a bare TypeError
        with pytest.raises(PlannerConfigError, match="safety_margin"):
            PlannerPolicy(safety_margin=bad)


# ----------------------------------------------------------------------------------- context length


def test_request_over_the_context_length_is_refused(smollm2_shape):
    shape = replace(smollm2_shape, context_length=2048)
    request = PlanRequest(prompt_tokens=2000, max_new_tokens=100)
    assert plan(request, gpu(8 << 30), smollm2_shape).verdict is Verdict.RUN  # memory is not the problem
    result = plan(request, gpu(8 << 30), shape)
    assert result.verdict is Verdict.REFUSE and not result.admitted and result.step is None
    refusal = result.refusal
    assert refusal.code == "context_length_exceeded" and refusal.exceeds_context
    # Either fix alone fits the context: prompt <= 2048 - 100, new tokens <= 2048 - 2000.
    assert (refusal.suggested_max_tokens, refusal.suggested_max_new_tokens) == (1948, 48)
    body = refusal.to_dict()
    assert json.loads(json.dumps(body, allow_nan=False)) == body
    error = body["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "context_length_exceeded",
        "invalid_request_error",
        "max_tokens",
    )
    assert error["context_length"] == 2048
    assert error["message"] == (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2000 in the "
        "prompt, 100 for the completion). Shorten the prompt to at most 1948 tokens or lower max_tokens to at "
        "most 48."
    )
    summary = result.to_dict()
    json.dumps(summary, allow_nan=False)
    assert summary["verdict"] == "refuse" and summary["refusal"]["code"] == "context_length_exceeded"


def test_request_filling_the_context_exactly_runs(smollm2_shape):
    shape = replace(smollm2_shape, context_length=2048)
    result = plan(PlanRequest(prompt_tokens=1948, max_new_tokens=100), gpu(8 << 30), shape)
    assert result.verdict is Verdict.RUN and result.prompt_tokens == 1948


def test_auto_truncate_cuts_the_prompt_to_the_context(smollm2_shape):
    shape = replace(smollm2_shape, context_length=2048)
    request = PlanRequest(prompt_tokens=5000, max_new_tokens=100, auto_truncate=True)
    result = plan(request, gpu(8 << 30), shape)
    assert result.verdict is Verdict.TRUNCATE and result.admitted
    assert (result.prompt_tokens, result.dropped_tokens) == (2048 - 100, 5000 - 1948)
    assert (result.prefill_chunk_size, result.kv_bits) == (None, 16)  # memory is roomy: the first step
    truncated = PlanRequest(prompt_tokens=1948, max_new_tokens=100)
    assert result.estimate == estimate_memory(truncated, result.step, shape)


@pytest.mark.parametrize("context", [8192, 32_768])
def test_memory_and_context_truncation_compose(smollm2_shape, context):
    request = PlanRequest(prompt_tokens=80_000, max_new_tokens=100, auto_truncate=True)
    by_memory = plan(request, gpu(300 * MIB), smollm2_shape).prompt_tokens  # no context length: memory only
    assert 8192 - 100 < by_memory < 32_768 - 100  # the context binds at 8k, memory at 32k
    result = plan(request, gpu(300 * MIB), replace(smollm2_shape, context_length=context))
    assert result.verdict is Verdict.TRUNCATE
    assert result.prompt_tokens == min(by_memory, context - 100)
    assert result.dropped_tokens == 80_000 - result.prompt_tokens
    assert result.estimate.peak_bytes <= result.budget_bytes


def test_suggestions_never_exceed_the_context(smollm2_shape):
    # The prompt: memory alone would allow ~18k tokens, the 8k context only 8092 with 100 new tokens.
    memory_only = plan(PlanRequest(prompt_tokens=80_000, max_new_tokens=100), gpu(300 * MIB), smollm2_shape)
    assert memory_only.refusal.suggested_max_tokens > 8192
    refusal = plan(
        PlanRequest(prompt_tokens=80_000, max_new_tokens=100),
        gpu(300 * MIB),
        replace(smollm2_shape, context_length=8192),
    ).refusal
    assert refusal.code == "context_length_exceeded" and refusal.to_dict()["error"]["param"] == "messages"
    assert (refusal.suggested_max_tokens, refusal.suggested_max_new_tokens) == (8092, 0)
    # The generation length: memory allows more new tokens than the 4k context leaves after the prompt.
    request = PlanRequest(prompt_tokens=1000, max_new_tokens=200_000)
    memory_new = plan(request, gpu(300 * MIB), smollm2_shape).refusal.suggested_max_new_tokens
    assert memory_new > 4096
    capped = plan(request, gpu(300 * MIB), replace(smollm2_shape, context_length=4096)).refusal
    assert capped.suggested_max_new_tokens == 4096 - 1000
    assert capped.suggested_max_tokens == 0  # 200k new tokens leave no room for any prompt


def test_memory_refusal_within_the_context_is_unchanged(smollm2_shape):
    request = PlanRequest(prompt_tokens=80_000, max_new_tokens=100)
    without = plan(request, gpu(300 * MIB), smollm2_shape).refusal
    within = plan(request, gpu(300 * MIB), replace(smollm2_shape, context_length=131_072)).refusal
    assert within.code == without.code == "request_too_large_for_memory"
    assert within.message == without.message
    assert (within.suggested_max_tokens, within.suggested_max_new_tokens) == (
        without.suggested_max_tokens,
        without.suggested_max_new_tokens,
    )
    assert within.to_dict()["error"]["context_length"] == 131_072


def test_unknown_context_length_plans_as_before(tiny_shape):
    assert tiny_shape.context_length is None
    result = plan(PlanRequest(prompt_tokens=1_000_000, max_new_tokens=1000), gpu(80 << 30), tiny_shape)
    assert result.verdict is Verdict.RUN and result.prompt_tokens == 1_000_000
    refusal = plan(PlanRequest(prompt_tokens=10**9, max_new_tokens=10), gpu(1 << 30), tiny_shape).refusal
    assert (
        refusal.code == "request_too_large_for_memory" and "context_length" not in refusal.to_dict()["error"]
    )


def test_max_new_tokens_alone_over_the_context_is_refused_even_with_auto_truncate(smollm2_shape):
    shape = replace(smollm2_shape, context_length=2048)
    for max_new in (2048, 5000):
        result = plan(
            PlanRequest(prompt_tokens=1, max_new_tokens=max_new, auto_truncate=True), gpu(8 << 30), shape
        )
        assert result.verdict is Verdict.REFUSE  # no prompt is short enough: truncation cannot help
        refusal = result.refusal
        assert refusal.code == "context_length_exceeded"
        assert (refusal.suggested_max_tokens, refusal.suggested_max_new_tokens) == (0, 2047)
        assert refusal.message.endswith("Lower max_tokens to at most 2047.")


def test_arguments_of_the_wrong_type_are_typed_errors(smollm2_shape):
    """plan(request, "cpu", shape) failed with an AttributeError deep inside the ladder walk."""
    request = PlanRequest(prompt_tokens=8, max_new_tokens=8)
    with pytest.raises(PlannerConfigError, match=r"profile must be a DeviceProfile \(DeviceProfile\.probe"):
        plan(request, "cpu", smollm2_shape)
    with pytest.raises(PlannerConfigError, match="shape must be a ModelShape"):
        plan(request, gpu(8 << 30), {"num_layers": 2})
    with pytest.raises(PlannerConfigError, match="request must be a PlanRequest"):
        plan(8, gpu(8 << 30), smollm2_shape)
