"""``/metrics`` under vLLM's names (``vllm:*`` with ``model_name`` and ``engine`` labels), parsed as Prometheus
text."""

from __future__ import annotations

import math
import threading

import httpx
from conftest import serve
from fakes import FakeEngine
from prometheus_client.parser import text_string_to_metric_families
from test_app_errors import wait_until

from kvb_cache import KVBoost
from kvb_cache.results import GenerationResult
from kvb_cache.sampling import SamplingParams
from kvb_server import ServerConfig, create_app
from kvb_server.metrics import ServerMetrics
from kvb_server.worker_stats import WorkerStats

MODEL = "fake-model"
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``/metrics``: (sample name, labels) -> value."""
    text = httpx.get(url + "/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (NaN if absent); a ``vllm:*`` sample carries vLLM's ``engine`` label, index 0."""
    if name.startswith("vllm:"):
        labels = {"engine": "0", **labels}
    return samples.get((name, frozenset(labels.items())), math.nan)


def test_vllm_names_types_and_labels_from_the_start() -> None:
    with serve(create_app(FakeEngine(), ServerConfig(model_names=(MODEL, "alias")))) as url:
        wait_until(lambda: not math.isnan(value(scrape(url), "vllm:kv_cache_usage_perc", model_name=MODEL)))
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
        for name, kind in VLLM_FAMILIES.items():
            assert families[name].type == kind, name
            for sample in families[name].samples:
                # vLLM labels with the first served name, whatever alias a request used, and the engine's
                # index (data-parallel rank; one engine here).
                assert sample.labels["model_name"] == MODEL, sample
                assert sample.labels["engine"] == "0", sample
        samples = scrape(url)
        # No *_created series (vLLM disables them; they doubled the series count).
        assert not [name for name, _ in samples if name.endswith("_created")]
        # Counters and histograms exist at zero before any request, as vLLM's do.
        assert value(samples, "vllm:prompt_tokens_total", model_name=MODEL) == 0
        assert value(samples, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 0
        assert value(samples, "vllm:request_success_total", model_name=MODEL, finished_reason="stop") == 0


def test_vllm_metrics_move_with_requests() -> None:
    fake = FakeEngine(max_num_seqs=1)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL, "alias")))) as url:
        for model, prompt, extra in ((MODEL, "abcd", {}), ("alias", "efgh", {"stop": "b"})):
            body = {"model": model, "prompt": prompt, "max_tokens": 3, **extra}
            assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        wait_until(lambda: value(scrape(url), "vllm:prefix_cache_queries_total", model_name=MODEL) == 8)
        s = scrape(url)
        m = {"model_name": MODEL}
        # The fake's engine counters: 8 prompt tokens looked up, half of them hit (same as kvboost:*).
        assert value(s, "vllm:prefix_cache_hits_total", **m) == 4
        assert value(s, "kvboost:prefix_cache_queries_total") == 8
        assert value(s, "kvboost:prefix_cache_hits_total") == 4
        assert value(s, "vllm:num_preemptions_total", **m) == 0
        assert value(s, "vllm:num_requests_running", **m) == value(s, "vllm:num_requests_waiting", **m) == 0
        assert value(s, "vllm:kv_cache_usage_perc", **m) == 0
        assert value(s, "vllm:prompt_tokens_total", **m) == 8
        # "abcd" decodes 3 tokens (length); "efgh" decodes "a" then "b", its stop string (2 tokens, stop).
        assert value(s, "vllm:generation_tokens_total", **m) == 5
        assert value(s, "vllm:request_success_total", **m, finished_reason="length") == 1
        assert value(s, "vllm:request_success_total", **m, finished_reason="stop") == 1
        for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
            assert value(s, name + "_count", **m) == 2
            assert value(s, name + "_bucket", **m, le="+Inf") == 2
            assert value(s, name + "_sum", **m) > 0
        assert value(s, "kvboost_time_to_first_token_seconds_count") == 2  # kvboost names kept
        # Request-level histograms (vLLM's names and buckets): token counts per request ...
        assert value(s, "vllm:request_prompt_tokens_count", **m) == 2
        assert value(s, "vllm:request_prompt_tokens_sum", **m) == 8
        assert value(s, "vllm:request_prompt_tokens_bucket", **m, le="5.0") == 2  # 4 tokens each
        assert value(s, "vllm:request_prompt_tokens_bucket", **m, le="2.0") == 0
        assert value(s, "vllm:request_generation_tokens_sum", **m) == 5
        # ... one observation per interval between two tokens (2 + 1) ...
        for name in ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"):
            assert value(s, name + "_count", **m) == 3
        # ... and the phases of each request: decode + prefill = inference.
        for phase in ("queue", "inference", "prefill", "decode"):
            assert value(s, f"vllm:request_{phase}_time_seconds_count", **m) == 2
        phases = value(s, "vllm:request_prefill_time_seconds_sum", **m) + value(
            s, "vllm:request_decode_time_seconds_sum", **m
        )
        assert math.isclose(phases, value(s, "vllm:request_inference_time_seconds_sum", **m), rel_tol=1e-9)
        tpot = value(s, "vllm:inter_token_latency_seconds_sum", **m)
        assert math.isclose(tpot, value(s, "vllm:request_decode_time_seconds_sum", **m), rel_tol=1e-9)


def test_running_and_waiting_mid_flight() -> None:
    fake = FakeEngine(max_num_seqs=1)
    fake.pause_before_step = 2
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            results: list[int] = []
            threads = [
                threading.Thread(
                    target=lambda p=p: results.append(
                        client.post(
                            "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 3}
                        ).status_code
                    )
                )
                for p in "ab"
            ]
            for t in threads:
                t.start()
            m = {"model_name": MODEL}
            wait_until(
                lambda: value(scrape(url), "vllm:num_requests_waiting", **m) == 1 and fake.stalled.is_set()
            )
            s = scrape(url)
            assert value(s, "vllm:num_requests_running", **m) == 1
            assert 0 < value(s, "vllm:kv_cache_usage_perc", **m) < 1
            fake.hold.set()
            for t in threads:
                t.join(30)
        assert results == [200, 200]


def test_real_engine_counts_prefix_cache_tokens(tiny_url: str, tiny_engine: KVBoost) -> None:
    m = {"model_name": "tiny-llama"}
    before = scrape(tiny_url)
    prompt = "You are a helpful assistant. Answer briefly and precisely. " * 3
    usages = []
    for _ in range(2):
        resp = httpx.post(
            tiny_url + "/v1/completions",
            json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "temperature": 0},
        )
        assert resp.status_code == 200
        usages.append(resp.json()["usage"])
    after = scrape(tiny_url)

    def delta(name: str, **labels: str) -> float:
        b = value(before, name, **labels)
        return value(after, name, **labels) - (0 if math.isnan(b) else b)

    prompt_tokens = usages[0]["prompt_tokens"]
    assert delta("vllm:prompt_tokens_total", **m) == 2 * prompt_tokens
    assert delta("vllm:generation_tokens_total", **m) == sum(u["completion_tokens"] for u in usages)
    # Tokens, not blocks: each admission looks up (almost) the whole prompt; the second one hits what the
    # first stored, and the hit count is the cached tokens the response reports.
    queries = delta("vllm:prefix_cache_queries_total", **m)
    assert 2 * (prompt_tokens - 1) <= queries <= 2 * prompt_tokens
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16
    assert delta("vllm:prefix_cache_hits_total", **m) == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    assert delta("vllm:prefix_cache_hits_total", **m) == delta("kvboost:prefix_cache_hits_total")
    assert delta("vllm:time_to_first_token_seconds_count", **m) == 2
    assert delta("vllm:e2e_request_latency_seconds_count", **m) == 2
    assert 0 <= value(after, "vllm:kv_cache_usage_perc", **m) <= 1


def test_a_warm_is_no_prefix_lookup_and_a_prompt_only_echo_is_a_request(tiny_url: str) -> None:
    """/v1/warm added its whole text to vllm:prefix_cache_queries_total (it is cache management, not a
    request); an echo with max_tokens 0 (lm-eval's scoring) computed its prompt and moved no counter."""
    m = {"model_name": "tiny-llama"}
    before = scrape(tiny_url)
    text = "A text warmed before any request asks for it, long enough for a few blocks. " * 3
    assert httpx.post(tiny_url + "/v1/warm", json={"text": text}).status_code == 200
    mid = scrape(tiny_url)
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
    ):
        assert value(mid, name, **m) == value(before, name, **m), name
    body = {
        "model": "tiny-llama",
        "prompt": "score these words",
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
    }
    resp = httpx.post(tiny_url + "/v1/completions", json=body)
    assert resp.status_code == 200
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    after = scrape(tiny_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(mid, name, **labels)

    assert delta("vllm:prompt_tokens_total", **m) == prompt_tokens
    assert delta("vllm:request_success_total", **m, finished_reason="length") == 1
    assert delta("vllm:request_prompt_tokens_count", **m) == 1
    assert delta("vllm:time_to_first_token_seconds_count", **m) == 0  # no first token to time


def test_aborted_requests_are_counted_as_vllm_counts_them() -> None:
    fake = FakeEngine(token_delay_s=0.05)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), request_timeout_s=0.4))) as url:
        m = {"model_name": MODEL}
        assert value(scrape(url), "vllm:request_success_total", **m, finished_reason="abort") == 0
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 100}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 504
        body["max_tokens"] = 3
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        wait_until(
            lambda: value(scrape(url), "vllm:request_success_total", **m, finished_reason="length") == 1
        )
        # The timed-out one was aborted in the engine: finished_reason="abort", not missing.
        wait_until(
            lambda: value(scrape(url), "vllm:request_success_total", **m, finished_reason="abort") == 1
        )
        assert value(scrape(url), "vllm:request_success_total", **m, finished_reason="stop") == 0
        # Its prompt was computed and its tokens generated before the abort: the token counters count them
        # (vLLM's do; they counted finished choices only).
        aborted_tokens = sum(fake.added[0].request_id in step for step in fake.step_log)
        after = scrape(url)
        prompts = sum(len(a.prompt) for a in fake.added)
        assert aborted_tokens > 1
        assert value(after, "vllm:generation_tokens_total", **m) == 3 + aborted_tokens
        assert value(after, "kvboost_completion_tokens_total") == 3 + aborted_tokens
        assert (
            value(after, "vllm:prompt_tokens_total", **m)
            == value(after, "kvboost_prompt_tokens_total")
            == prompts
        )


def test_a_streams_inter_token_latency_is_timed_per_token() -> None:
    """A streamed choice's intervals are timed as its tokens leave the engine: one step held for 0.5 s
    shows as one long interval among short ones (each interval as the mean would put all four together)."""
    fake = FakeEngine()
    fake.pause_before_step = 3  # the third token waits until the test releases it
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        done: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": "abcd", "max_tokens": 5, "stream": True}
        thread = threading.Thread(target=lambda: done.append(httpx.post(url + "/v1/completions", json=body)))
        thread.start()
        wait_until(fake.stalled.is_set)
        threading.Event().wait(0.5)
        fake.hold.set()
        thread.join(30)
        assert done and done[0].status_code == 200
        m = {"model_name": MODEL}
        wait_until(lambda: value(scrape(url), "vllm:inter_token_latency_seconds_count", **m) == 4)
        s = scrape(url)
        assert value(s, "vllm:inter_token_latency_seconds_bucket", **m, le="0.3") == 3
        assert value(s, "vllm:inter_token_latency_seconds_bucket", **m, le="+Inf") == 4
        assert value(s, "vllm:inter_token_latency_seconds_sum", **m) >= 0.5


def _phase_sums(registry_text: str) -> dict[str, float]:
    m = {"model_name": MODEL}
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(registry_text)
        for s in family.samples
    }
    return {
        phase: value(samples, f"vllm:request_{phase}_time_seconds_sum", **m)
        for phase in ("queue", "prefill", "decode", "inference")
    } | {
        name: value(samples, f"vllm:{name}_sum", **m)
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds")
    }


def test_the_engines_queue_time_is_waiting_not_prefill() -> None:
    """vLLM's phases: WAITING is arrival to first scheduling, so the engine's own queue (``queued_ms``: a full
    batch or pool) is queue time on top of the server's, and prefill starts at the scheduling; TTFT and e2e
    still cover everything."""
    stats = WorkerStats(
        waiting=0, running=0, in_flight=0, max_queue_size=1, steps=0, step_errors=0, largest_step=0,
        added=0, finished=0, aborted=0, rejected=0, calls=0, busy_s=0.0,
    )  # fmt: skip
    metrics = ServerMetrics(lambda: stats, lambda: None, model_name=MODEL)
    result = GenerationResult(
        output_text="abc", output_ids=[1, 2, 3], prompt_tokens=4, cached_tokens=0,
        queued_ms=300.0, ttft_ms=500.0, total_ms=900.0, finish_reason="length",
    )  # fmt: skip
    metrics.observe_result(result, queue_s=0.25)
    sums = _phase_sums(metrics.render().decode())
    expected = {
        "queue": 0.25 + 0.3,  # the server's queue, then the engine's
        "prefill": 0.2,  # first scheduling to first token
        "decode": 0.4,
        "inference": 0.6,  # first scheduling to last token
        "time_to_first_token_seconds": 0.75,
        "e2e_request_latency_seconds": 1.15,
    }
    for name, seconds in expected.items():
        assert math.isclose(sums[name], seconds, rel_tol=1e-9), name
    # A queue time past the first token (not produced by the engine) never makes a phase negative.
    odd = GenerationResult(
        output_text="a", output_ids=[1], prompt_tokens=4, cached_tokens=0,
        queued_ms=800.0, ttft_ms=500.0, total_ms=500.0, finish_reason="length",
    )  # fmt: skip
    metrics.observe_result(odd, queue_s=0.0)
    after = _phase_sums(metrics.render().decode())
    assert math.isclose(after["prefill"], sums["prefill"], rel_tol=1e-9)
    assert math.isclose(after["queue"], sums["queue"] + 0.5, rel_tol=1e-9)


def test_a_request_waiting_for_a_batch_slot_shows_in_queue_time() -> None:
    """Through the server: two prompts of one request reach the (fake) engine together; the second waits in
    its queue while the first, holding the only sequence slot, is stalled for a wait the test controls.
    That wait is queue time, not prefill."""
    fake = FakeEngine(max_num_seqs=1)
    fake.pause_before_step = 2
    hold_s = 0.5
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        m = {"model_name": MODEL}
        done: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 3}
        thread = threading.Thread(target=lambda: done.append(httpx.post(url + "/v1/completions", json=body)))
        thread.start()
        wait_until(fake.stalled.is_set)
        assert fake.paged_stats().waiting == 1  # "b" is inside the engine, not in the server's queue
        threading.Event().wait(hold_s)
        fake.hold.set()
        thread.join(30)
        assert done and done[0].status_code == 200
        wait_until(lambda: value(scrape(url), "vllm:request_queue_time_seconds_count", **m) == 2)
        sums = _phase_sums(httpx.get(url + "/metrics").text)
        # The fake samples a request's first token in the step that schedules it: its prefill is ~0.
        assert sums["queue"] >= hold_s > sums["prefill"]
        assert math.isclose(sums["prefill"] + sums["decode"], sums["inference"], rel_tol=1e-9)


def test_a_stream_the_client_left_still_counts_the_choice_the_engine_finished() -> None:
    """The engine finishes a streamed choice after its client closed the connection: the server learns
    of the disconnect only when it writes that last chunk, and the choice must still count as finished
    (``vllm:request_success_total`` and the token counters), as vLLM counts at the engine; before, it
    was in neither ``length`` nor ``abort``, so finished + aborted fell short of the requests served."""
    fake = FakeEngine()
    fake.pause_before_step = 2  # the second (last) token waits until the client has gone
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        body = {"model": MODEL, "prompt": "abcd", "max_tokens": 2, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
        wait_until(fake.stalled.is_set)
        fake.hold.set()
        m = {"model_name": MODEL}
        wait_until(
            lambda: value(scrape(url), "vllm:request_success_total", **m, finished_reason="length") == 1
        )
        s = scrape(url)
        assert value(s, "vllm:request_success_total", **m, finished_reason="abort") == 0
        assert value(s, "vllm:generation_tokens_total", **m) == 2
        stats = httpx.get(url + "/v1/stats").json()["queue"]
        assert (stats["finished"], stats["aborted"]) == (1, 0)


class SpeculatingFake(FakeEngine):
    """A fake whose drafter has run 5 rounds of up to 3 drafted tokens (accepted 0, 1, 3, 3, 2)."""

    def speculative_stats(self) -> dict:
        return {"rounds": 5, "drafted_tokens": 15, "accepted_tokens": 9, "accepted_histogram": [1, 1, 1, 2]}


def test_speculative_counters_under_vllms_names() -> None:
    """vLLM's spec-decode counters, from the worker's snapshot; none for an engine without a drafter."""
    with serve(create_app(SpeculatingFake(), ServerConfig(model_names=(MODEL,)))) as url:
        wait_until(
            lambda: not math.isnan(value(scrape(url), "vllm:spec_decode_num_drafts_total", model_name=MODEL))
        )
        samples = scrape(url)
        assert value(samples, "vllm:spec_decode_num_drafts_total", model_name=MODEL) == 5
        assert value(samples, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL) == 15
        assert value(samples, "vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL) == 9
        per_pos = [
            value(
                samples,
                "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                model_name=MODEL,
                position=str(p),
            )
            for p in range(3)
        ]
        assert per_pos == [4, 3, 2] and sum(per_pos) == 9  # rounds accepting more than p tokens
    with serve(create_app(FakeEngine(), ServerConfig(model_names=(MODEL,)))) as url:
        wait_until(lambda: not math.isnan(value(scrape(url), "vllm:kv_cache_usage_perc", model_name=MODEL)))
        assert not any(name.startswith("vllm:spec_decode") for name, _ in scrape(url))


def test_cache_config_info_reports_the_pool_as_vllm_does(tiny_url: str, tiny_engine: KVBoost) -> None:
    """vLLM's ``vllm:cache_config_info`` (value 1, settings as labels): dashboards read the KV dtype there."""
    stats = tiny_engine.cache_stats()
    labels = {
        "block_size": str(stats["block_size"]),
        "cache_dtype": stats["kv_cache_dtype"],
        "num_gpu_blocks": str(stats["paged"]["blocks_total"]),
        "enable_prefix_caching": "True",
    }
    assert value(scrape(tiny_url), "vllm:cache_config_info", **labels) == 1.0


def test_cache_config_info_says_prefix_caching_is_off_when_it_is() -> None:
    """It read the pool's size, which is never 0: --max-cache-bytes 0 was reported as caching."""
    from kvb_server.metrics import cache_config_labels

    assert cache_config_labels({"prefix_caching": False, "paged": {}})["enable_prefix_caching"] == "False"


def test_an_abandoned_warm_is_no_aborted_request() -> None:
    """A /v1/warm that timed out (or whose client left) moved vllm:request_success_total{finished_reason=
    "abort"} although no request stood behind it (metrics audit); /v1/stats still counts it, as a warm."""

    class SlowWarm(FakeEngine):
        def add_warm_request(self, prompt, *, cache_salt=None, prefill_chunk_size=None):
            # A warm the fake computes over 100 steps (5 s): it cannot finish within its 0.3 s timeout.
            return self.add_request(prompt, SamplingParams(max_new_tokens=100), cache_salt=cache_salt)

    fake = SlowWarm(token_delay_s=0.05)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), request_timeout_s=0.3))) as url:
        m = {"model_name": MODEL}
        assert httpx.post(url + "/v1/warm", json={"text": "warm " * 20}, timeout=30).status_code == 504
        stats = lambda: httpx.get(url + "/v1/stats").json()["queue"]  # noqa: E731
        wait_until(lambda: stats()["aborted"] == 1)
        assert stats()["warm_aborted"] == 1
        assert value(scrape(url), "vllm:request_success_total", **m, finished_reason="abort") == 0


def test_a_choice_whose_grammar_failed_is_no_success() -> None:
    """The client gets an error for it (400, or an error event in a stream): it was counted as a "stop"
    success as well (metrics audit). Its tokens still count: the work was done."""
    stats = WorkerStats(
        waiting=0, running=0, in_flight=0, max_queue_size=1, steps=0, step_errors=0, largest_step=0,
        added=0, finished=0, aborted=0, rejected=0, calls=0, busy_s=0.0,
    )  # fmt: skip
    metrics = ServerMetrics(lambda: stats, lambda: None, model_name=MODEL)
    for grammar_error in (None, "too wide"):
        result = GenerationResult(
            output_text='{"a": ', output_ids=[1, 2, 3], prompt_tokens=4, cached_tokens=0, ttft_ms=1.0,
            total_ms=3.0, finish_reason="stop", grammar_error=grammar_error,
        )  # fmt: skip
        metrics.observe_result(result, queue_s=0.0)
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    m = {"model_name": MODEL}
    assert value(samples, "vllm:request_success_total", **m, finished_reason="stop") == 1
    assert value(samples, "vllm:generation_tokens_total", **m) == 6
