"""The kvb-planner admission gate over real HTTP: 413 bodies, auto-truncation, engine overrides, calibration."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from conftest import serve
from fakes import FakeEngine
from transformers import LlamaConfig

from kvb_planner import (
    CalibrationTracker,
    DeviceProfile,
    Ladder,
    LadderStep,
    ModelShape,
    PlannerPolicy,
    PlanRequest,
    estimate_memory,
    plan,
)
from kvb_server import AdmissionRequest, PlannerGate, ServerConfig, create_app
from kvb_server.truncation import TRUNCATION_HEADER

MODEL = "fake-model"
MIB = 1 << 20
MARGIN = 0.1
MAX_TOKENS = 8
SHAPE = ModelShape.from_config(
    LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    ),
    dtype="float32",
)


class FixedMeter:
    """A deterministic peak meter: every run "measured" ``actual`` bytes."""

    name = "fixed"

    def __init__(self, actual: int) -> None:
        self.actual = actual
        self.starts = 0

    def start(self) -> None:
        self.starts += 1

    def peak_bytes(self) -> int:
        return self.actual


def cheapest_peak(prompt_tokens: int, max_new: int = MAX_TOKENS, ladder: Ladder | None = None) -> int:
    ladder = ladder or Ladder.default()
    request = PlanRequest(prompt_tokens=prompt_tokens, max_new_tokens=max_new)
    return min(estimate_memory(request, step, SHAPE, device="cpu").peak_bytes for step in ladder.steps)


def profile_fitting(prompt_tokens: int) -> DeviceProfile:
    """Free memory in which a ``prompt_tokens`` prompt just fits (on the cheapest step) and longer ones do not."""
    free = int(cheapest_peak(prompt_tokens) / (1 - MARGIN)) + 1
    return DeviceProfile(device="cpu", total_bytes=1 << 30, free_bytes=free)


def expected_plan(profile: DeviceProfile, prompt_tokens: int, *, auto_truncate: bool = False):
    return plan(
        PlanRequest(prompt_tokens=prompt_tokens, max_new_tokens=MAX_TOKENS, auto_truncate=auto_truncate),
        profile,
        SHAPE,
        PlannerPolicy(safety_margin=MARGIN),
    )


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30, **kw)


def completion(prompt: str, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


@pytest.fixture()
def fake() -> FakeEngine:
    return FakeEngine()


def gate_for(profile: DeviceProfile, **kw) -> PlannerGate:
    return PlannerGate(shape=SHAPE, profile=profile, safety_margin=kw.pop("safety_margin", MARGIN), **kw)


@pytest.fixture()
def small_memory(fake: FakeEngine) -> Iterator[tuple[str, PlannerGate]]:
    gate = gate_for(profile_fitting(40))
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100), gate=gate)) as url:
        yield url, gate


def test_refusal_is_413_with_the_planner_numbers(small_memory, fake: FakeEngine) -> None:
    url, gate = small_memory
    prompt = "x" * 150  # FakeEngine: one token per character
    resp = post(url, "/v1/completions", completion(prompt))
    assert resp.status_code == 413
    err = resp.json()["error"]
    want = expected_plan(gate.profile, 150).refusal.to_dict()["error"]
    assert want["suggested_max_tokens"] >= 40 and want["suggested_max_tokens"] < 150
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert err["param"] == "prompt"
    for field in ("prompt_tokens", "predicted_peak_mb", "free_mb", "suggested_max_tokens", "budget_mb"):
        assert err[field] == want[field], field
    assert err["prompt_tokens"] == 150
    assert err["predicted_peak_mb"] > err["budget_mb"]
    assert err["free_mb"] == round(gate.profile.free_bytes / MIB, 1)
    assert f"at most {want['suggested_max_tokens']} tokens" in err["message"]
    assert fake.added == []  # never queued
    chat = post(
        url,
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": prompt}]},
    )
    assert chat.status_code == 413 and chat.json()["error"]["param"] == "messages"
    ok = post(url, "/v1/completions", completion("y" * 30))
    assert ok.status_code == 200 and fake.overrides[-1] == {}  # fits at 16 bits single shot: no overrides
    assert gate.stats()["decisions"] == {"run": 1, "truncate": 0, "refuse": 2}


def test_streaming_refusal_arrives_before_any_chunk(small_memory) -> None:
    url, _ = small_memory
    with httpx.stream(
        "POST", url + "/v1/completions", json=completion("x" * 150, stream=True), timeout=30
    ) as resp:
        text = resp.read().decode()
    assert resp.status_code == 413
    assert resp.headers["content-type"].startswith("application/json")
    assert "data:" not in text
    assert json.loads(text)["error"]["code"] == "request_too_large"


def test_auto_truncate_keeps_the_end_of_the_prompt(fake: FakeEngine) -> None:
    profile = profile_fitting(40)
    gate = gate_for(profile, auto_truncate=True)
    keep = expected_plan(profile, 150, auto_truncate=True).prompt_tokens
    assert 40 <= keep < 150
    prompt = "".join(chr(ord("a") + i % 26) for i in range(150))
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100), gate=gate)) as url:
        resp = post(url, "/v1/completions", completion(prompt))
        assert resp.status_code == 200
        body = resp.json()
        assert resp.headers[TRUNCATION_HEADER] == str(150 - keep)
        assert body["usage"]["prompt_tokens"] == keep
        assert body["prompt_truncation"] == {
            "kept": "last_tokens",
            "original_prompt_tokens": [150],
            "prompt_tokens": [keep],
            "dropped_tokens": 150 - keep,
        }
        assert fake.added[-1].prompt == [ord(c) for c in prompt[-keep:]]
        with httpx.stream(
            "POST", url + "/v1/completions", json=completion(prompt, stream=True), timeout=30
        ) as s:
            s.read()
        assert s.status_code == 200 and s.headers[TRUNCATION_HEADER] == str(150 - keep)
    assert gate.stats()["decisions"]["truncate"] == 2


def test_no_planning_admits_everything(fake: FakeEngine) -> None:
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100))) as url:
        resp = post(url, "/v1/completions", completion("x" * 150))
        assert resp.status_code == 200
        assert httpx.get(url + "/v1/stats").json()["planner"] == {"enabled": False}


def test_chosen_step_reaches_the_engine(fake: FakeEngine) -> None:
    ladder = Ladder(steps=(LadderStep(prefill_chunk_size=None), LadderStep(prefill_chunk_size=8, kv_bits=4)))
    request = PlanRequest(prompt_tokens=150, max_new_tokens=MAX_TOKENS)
    single, sliced = (estimate_memory(request, step, SHAPE, device="cpu").peak_bytes for step in ladder.steps)
    assert sliced < single
    profile = DeviceProfile(device="cpu", total_bytes=1 << 30, free_bytes=(single + sliced) // 2)
    gate = gate_for(profile, ladder=ladder, safety_margin=0.0)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100), gate=gate)) as url:
        assert post(url, "/v1/completions", completion("x" * 150)).status_code == 200
        assert fake.overrides[-1] == {"prefill_chunk_size": 8, "kv_cache_bits": 4}
        assert post(url, "/v1/completions", completion("x" * 20)).status_code == 200
        assert fake.overrides[-1] == {}
    assert gate.stats()["last_plan"]["verdict"] == "run"


def test_constrained_requests_are_never_quantized(fake: FakeEngine) -> None:
    """A response_format request decodes in the batched loop, which has no quantized private KV: the gate
    plans it with full-precision steps only (here: refused), where a plain one gets 4-bit KV."""
    ladder = Ladder(steps=(LadderStep(prefill_chunk_size=None), LadderStep(prefill_chunk_size=8, kv_bits=4)))
    request = PlanRequest(prompt_tokens=150, max_new_tokens=MAX_TOKENS)
    single, sliced = (estimate_memory(request, step, SHAPE, device="cpu").peak_bytes for step in ladder.steps)
    profile = DeviceProfile(device="cpu", total_bytes=1 << 30, free_bytes=(single + sliced) // 2)
    gate = gate_for(profile, ladder=ladder, safety_margin=0.0)
    regex = {"response_format": {"type": "regex", "pattern": "[a-z]+"}}
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100), gate=gate)) as url:
        assert post(url, "/v1/completions", completion("x" * 150)).status_code == 200
        assert fake.overrides[-1]["kv_cache_bits"] == 4
        refused = post(url, "/v1/completions", completion("x" * 150, **regex))
        assert refused.status_code == 413, refused.text
        assert post(url, "/v1/completions", completion("x" * 20, **regex)).status_code == 200
        assert fake.overrides[-1] == {}


def test_stats_report_calibration_as_strict_json(fake: FakeEngine) -> None:
    profile = profile_fitting(100)
    meter = FixedMeter(actual=50_000)
    gate = gate_for(profile, meter=meter, tracker=CalibrationTracker())
    prompts = ["a" * 30, "b" * 60]
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100), gate=gate)) as url:
        assert post(url, "/v1/completions", completion(prompts[0])).status_code == 200
        with httpx.stream(
            "POST", url + "/v1/completions", json=completion(prompts[1], stream=True), timeout=30
        ) as s:
            s.read()
        assert (
            post(url, "/v1/completions", completion("c" * 10, n=2)).status_code == 200
        )  # 2 jobs: not probed
        resp = httpx.get(url + "/v1/stats")

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-JSON constant {name}")

    stats = json.loads(resp.text, parse_constant=no_constants)["planner"]
    assert meter.starts == 2
    residuals = sorted(
        (meter.actual - expected_plan(profile, len(p)).estimate.peak_bytes)
        / expected_plan(profile, len(p)).estimate.peak_bytes
        for p in prompts
    )
    calib = stats["calibration"]
    assert calib["samples"] == calib["overall"]["count"] == 2
    assert calib["overall"]["p50"] == round(sum(residuals) / 2, 4)
    assert calib["overall"]["p95"] == round(residuals[0] + 0.95 * (residuals[1] - residuals[0]), 4)
    assert calib["cohorts"] == [{"prefill_chunk_size": None, "kv_bits": 16, **calib["overall"]}]
    assert calib["suggested_margin"] == 0.1  # fewer than 16 samples: the default margin
    assert stats["measurement"] == "fixed" and stats["safety_margin"] == {"fixed": MARGIN, "in_use": MARGIN}
    assert stats["decisions"] == {"run": 3, "truncate": 0, "refuse": 0}
    assert stats["device"]["free_mb"] == round(profile.free_bytes / MIB, 1)


def test_margin_follows_the_tracker_and_free_memory_shrinks_with_use() -> None:
    used = [0]
    tracker = CalibrationTracker()
    gate = PlannerGate(shape=SHAPE, profile=profile_fitting(40), tracker=tracker, used_bytes=lambda: used[0])
    assert gate.margin() == tracker.suggested_margin() == 0.1
    for _ in range(16):
        tracker.record(predicted_bytes=100, actual_bytes=130, step=LadderStep(prefill_chunk_size=None))
    assert gate.margin() == pytest.approx(0.3)
    before = gate.free_bytes()
    used[0] = 1000
    assert gate.free_bytes() == before - 1000
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        PlannerGate(shape=SHAPE, profile=profile_fitting(40), safety_margin=1.0)


def test_gate_leaves_the_context_check_to_the_server() -> None:
    """The server checks the context before the gate and lets a prompt that is only scored fill it (echo with
    ``max_tokens: 0``), asking the gate about one new token: the gate plans memory only, so that prompt is
    admitted although prompt + 1 exceeds the shape's context length (the planner's own rule would refuse)."""
    context = SHAPE.context_length
    assert context == LlamaConfig().max_position_embeddings
    gate = PlannerGate(
        shape=SHAPE, profile=DeviceProfile(device="cpu", total_bytes=8 << 30, free_bytes=4 << 30)
    )
    full = AdmissionRequest(
        endpoint="completions", model=MODEL, prompt_tokens=(context,), max_new_tokens=1, n=1, queue_depth=0
    )
    decision = gate.admit(full)
    assert decision.admitted and decision.keep_last_tokens is None, decision.message
    assert gate.shape is SHAPE  # what it was given, context length included
