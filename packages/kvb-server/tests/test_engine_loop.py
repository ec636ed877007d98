"""The engine loop over real HTTP: shared steps, joining mid-flight, aborts, failures, paged stats and metrics.

The fake engine stalls at a chosen step (``pause_before_step``) so every scenario is arranged
deterministically; waits are bounded polls for a condition, never sleeps that a slow machine could outrun.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import threading
import time

import httpx
import pytest
from conftest import serve
from fakes import FakeEngine
from test_app_errors import assert_openai_error, wait_until

from kvb_cache.errors import InvalidRequestError
from kvb_server import ServerConfig, create_app

MODEL = "fake-model"


def completion(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}


def sse_text(body: str) -> str:
    """The completion text of an SSE body (``choices[0].text`` of every data event)."""
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if json.loads(e).get("choices"))


def steps_with(fake: FakeEngine, index: int) -> list[int]:
    """Indices of the steps that decoded the ``index``-th added request."""
    request_id = fake.added[index].request_id
    return [i for i, ids in enumerate(fake.step_log) if request_id in ids]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return math.nan


async def depth(client: httpx.AsyncClient) -> int:
    return (await client.get("/health")).json()["queue_depth"]


async def polled(fetch, ok, timeout: float = 10.0) -> None:
    """Await ``fetch()`` until ``ok`` holds for its result; fail after ``timeout`` seconds (an unbounded poll
    hung a whole test run when the server misbehaved: Python 3.10's asyncio timeouts, before they were caught)."""
    deadline = time.monotonic() + timeout
    while not ok(await fetch()):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def until(predicate, timeout: float = 10.0) -> None:
    await asyncio.to_thread(wait_until, predicate, timeout)


def test_streamed_and_non_streamed_requests_share_steps() -> None:
    fake = FakeEngine()
    fake.pause_before_step = 1  # hold the first request's first step until the others are queued
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                first = asyncio.create_task(c.post("/v1/completions", json=completion("hi", 4, stream=True)))
                await until(fake.stalled.is_set)
                others = [
                    asyncio.create_task(c.post("/v1/completions", json=completion("hj", 4))),
                    asyncio.create_task(c.post("/v1/completions", json=completion("hk", 4, stream=True))),
                ]
                await polled(
                    lambda: depth(c), lambda d: d >= 3
                )  # the stalled one (waiting in the engine) and the two new ones
                fake.hold.set()
                return list(await asyncio.gather(first, *others))

        streamed_a, plain_b, streamed_c = asyncio.run(scenario())
    assert [r.status_code for r in (streamed_a, plain_b, streamed_c)] == [200, 200, 200]
    assert sse_text(streamed_a.text) == "bcde" and sse_text(streamed_c.text) == "defg"
    assert plain_b.json()["choices"][0]["text"] == "cdef"
    assert [steps_with(fake, i) for i in range(3)] == [[0, 1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]]
    ids = {a.request_id for a in fake.added}
    assert len(ids) == 3 and sum(step == ids for step in fake.step_log) >= 3  # all three decoded together


def test_a_new_request_joins_running_ones_at_the_next_step() -> None:
    fake = FakeEngine()
    fake.pause_before_step = 3  # the long request has run two steps when the short one arrives
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=150))) as url:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                long = asyncio.create_task(c.post("/v1/completions", json=completion("hi", 120)))
                await until(fake.stalled.is_set)
                short = asyncio.create_task(c.post("/v1/completions", json=completion("hj", 2)))
                await polled(lambda: depth(c), lambda d: d >= 1)
                fake.hold.set()
                short_done = await short
                return await long, short_done

        long, short = asyncio.run(scenario())
    assert long.status_code == short.status_code == 200
    assert short.json()["choices"][0]["text"] == "cd"
    long_steps, short_steps = steps_with(fake, 0), steps_with(fake, 1)
    # The short request started after the long one's stalled step, rode along for two steps, and finished
    # long before the long one did: it never waited for it.
    assert short_steps == [3, 4]
    assert long_steps == list(range(120)) and long_steps[-1] > short_steps[-1]
    assert fake.aborted == []


def test_stream_disconnect_aborts_within_one_step() -> None:
    fake = FakeEngine()
    fake.pause_before_step = 3  # stall after two tokens were streamed
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=150))) as url:
        with httpx.stream(
            "POST", url + "/v1/completions", json=completion("hi", 150, stream=True), timeout=30
        ) as r:
            data = (line for line in r.iter_lines() if line.startswith("data: "))
            assert [json.loads(next(data)[6:])["choices"][0]["text"] for _ in range(2)] == ["b", "c"]
        wait_until(fake.stalled.is_set)
        # The handler is done (its SSE generator was cancelled) once the request shows up in the metrics.
        done = 'kvboost_requests_total{route="/v1/completions",status="200"}'
        wait_until(lambda: metric(httpx.get(url + "/metrics").text, done) == 1)
        assert fake.aborted == []
        fake.hold.set()
        wait_until(lambda: len(fake.aborted) == 1)
    assert fake.aborted == [fake.added[0].request_id]
    assert steps_with(fake, 0) == [0, 1, 2]  # the stalled step finished; no step after it decoded the request


def test_non_stream_disconnect_aborts_within_one_step() -> None:
    fake = FakeEngine()
    fake.pause_before_step = 2
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=150))) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                request = asyncio.create_task(c.post("/v1/completions", json=completion("hi", 150)))
                await until(fake.stalled.is_set)
                request.cancel()  # the client goes away
                closed = 'kvboost_requests_total{route="/v1/completions",status="499"}'
                await polled(lambda: c.get("/metrics"), lambda r: metric(r.text, closed) == 1)

        asyncio.run(scenario())
        assert fake.aborted == []
        fake.hold.set()
        wait_until(lambda: len(fake.aborted) == 1)
    assert steps_with(fake, 0) == [0, 1]


class RejectsSeed13(FakeEngine):
    """``add_request`` refuses seed 13 (as the engine refuses input it cannot serve)."""

    def add_request(self, prompt, params, **overrides):
        if params.seed == 13:
            raise InvalidRequestError("seed 13 is unlucky; pick another", param="seed")
        return super().add_request(prompt, params, **overrides)


def test_an_add_request_error_fails_only_that_request() -> None:
    fake = RejectsSeed13()
    fake.pause_before_step = 2
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                bystander = asyncio.create_task(
                    c.post("/v1/completions", json=completion("hi", 5, stream=True))
                )
                await until(fake.stalled.is_set)
                # n=3 with seed 11: choices get seeds 11, 12 and 13; the third is refused by the engine.
                unlucky = asyncio.create_task(
                    c.post("/v1/completions", json=completion("hj", 5, n=3, seed=11))
                )
                await polled(lambda: depth(c), lambda d: d >= 3)
                fake.pause_before_step = (
                    3  # stall again once the choices are in, until their handler answered
                )
                fake.hold.set()
                refused = await unlucky
                await until(lambda: len(fake.step_log) == 2 and fake.stalled.is_set())
                fake.hold.set()
                return await bystander, refused

        bystander, unlucky = asyncio.run(scenario())
        err = assert_openai_error(unlucky, 400, param="seed")
        assert "unlucky" in err["message"]
        assert bystander.status_code == 200 and sse_text(bystander.text) == "bcdef"
        # The unlucky request's accepted choices were aborted; the bystander finished normally.
        wait_until(lambda: len(fake.aborted) == 2)
        assert sorted(fake.aborted) == sorted(a.request_id for a in fake.added[1:3])
        assert [a.params.seed for a in fake.added] == [None, 11, 12]
        stats = httpx.get(url + "/v1/stats").json()["queue"]
        assert stats["rejected"] == 1 and stats["in_flight"] == 0


async def second_joins_the_stalled_first(
    url: str, fake: FakeEngine, first: dict, second: dict
) -> tuple[httpx.Response, httpx.Response]:
    """Post ``first``; once the engine stalls on ``fake.hold`` (``pause_before_step``), post ``second``, wait
    until it is queued, release the engine and return both responses."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        one = asyncio.create_task(c.post("/v1/completions", json=first))
        await until(fake.stalled.is_set)
        two = asyncio.create_task(c.post("/v1/completions", json=second))
        await polled(lambda: depth(c), lambda d: d >= 1)
        fake.hold.set()
        return await one, await two


def test_a_failing_step_fails_the_requests_in_flight_and_serving_goes_on() -> None:
    fake = FakeEngine()
    fake.pause_before_step = 2
    fake.fail_step(3, RuntimeError("kernel exploded"))
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        # step 2 runs the first request, step 3 (both in flight) raises
        streamed, plain = asyncio.run(
            second_joins_the_stalled_first(url, fake, completion("hi", 9, stream=True), completion("hj", 9))
        )
        assert streamed.status_code == 200  # the stream had started: the error is its last event
        assert sse_text(streamed.text) == "bc" and '"type":"server_error"' in streamed.text
        assert "kernel exploded" in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
        err = assert_openai_error(plain, 500)
        assert "kernel exploded" in err["message"]
        assert sorted(fake.aborted) == sorted(a.request_id for a in fake.added)  # the engine freed both
        ok = httpx.post(url + "/v1/completions", json=completion("hi", 3), timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "bcd"
        queue = httpx.get(url + "/v1/stats").json()["queue"]
        assert queue["step_errors"] == 1 and queue["aborted"] == 2 and queue["finished"] == 1


def test_out_of_memory_in_a_shared_step_is_a_retryable_503_and_alone_a_413() -> None:
    """An OOM in a step two requests shared answered both 413 "retry with a shorter prompt", though the
    small one only shared the step; alone, the request's own size is the likely cause (413 stays)."""
    fake = FakeEngine()
    fake.pause_before_step = 2
    fake.fail_step(3, MemoryError())
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        # step 3, with both in flight, runs out of memory
        pair = second_joins_the_stalled_first(url, fake, completion("hi", 9), completion("hj", 9))
        for resp in asyncio.run(pair):
            assert_openai_error(resp, 503, code="out_of_memory")
            assert resp.headers["retry-after"] == "1"
        fake.fail_step(len(fake.step_log) + 1, MemoryError())
        alone = httpx.post(url + "/v1/completions", json=completion("hi", 3), timeout=30)
        assert_openai_error(alone, 413, code="request_too_large")


def test_a_failing_row_fails_its_request_alone() -> None:
    """The engine ended one request because its token could not be chosen (a sampler row failed): that
    request gets the error (a 500, or the last event of its stream), the requests beside it finish, no step
    failed, and ``/v1/stats`` counts it as failed."""
    fake = FakeEngine()
    fake.pause_before_step = 1
    fake.fail_row(0, 2, RuntimeError("probability tensor contains either inf, nan or element < 0"))
    fake.fail_row(2, 1, RuntimeError("row exploded"))
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                plain_bad = asyncio.create_task(c.post("/v1/completions", json=completion("hi", 6)))
                await until(fake.stalled.is_set)
                bystander = asyncio.create_task(c.post("/v1/completions", json=completion("hj", 6)))
                await polled(lambda: depth(c), lambda d: d >= 1)
                streamed_bad = asyncio.create_task(
                    c.post("/v1/completions", json=completion("hk", 6, stream=True))
                )
                await polled(lambda: depth(c), lambda d: d >= 2)
                fake.hold.set()
                return [await plain_bad, await bystander, await streamed_bad]

        plain_bad, bystander, streamed_bad = asyncio.run(scenario())
        err = assert_openai_error(plain_bad, 500)
        assert "inf, nan" in err["message"]
        assert bystander.status_code == 200 and bystander.json()["choices"][0]["text"] == "cdefgh"
        assert streamed_bad.status_code == 200  # the stream had started: the error is its last event
        assert sse_text(streamed_bad.text) == "d" and "row exploded" in streamed_bad.text
        assert streamed_bad.text.rstrip().endswith("data: [DONE]")
        assert fake.aborted == []  # the engine already ended them; nothing to abort
        queue = httpx.get(url + "/v1/stats").json()["queue"]
        assert queue["failed"] == 2 and queue["finished"] == 1 and queue["step_errors"] == 0
        assert queue["in_flight"] == 0


def test_warm_runs_between_steps_while_requests_are_running() -> None:
    fake = FakeEngine()
    fake.pause_before_step = 2
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                running = asyncio.create_task(c.post("/v1/completions", json=completion("hi", 6)))
                await until(fake.stalled.is_set)
                warm = asyncio.create_task(c.post("/v1/warm", json={"text": "shared prefix"}))
                await polled(lambda: depth(c), lambda d: d >= 1)
                fake.hold.set()
                return await warm, await running

        warm, running = asyncio.run(scenario())
    assert warm.status_code == running.status_code == 200
    assert fake.warmed == ["shared prefix"] and running.json()["choices"][0]["text"] == "bcdefg"


def test_warm_shares_steps_with_running_requests_and_is_aborted_when_it_times_out() -> None:
    """/v1/warm is an engine request like the others (audit: as one engine call its whole prefill ran on
    the engine thread, 16 s of stall for every stream at 3.3k tokens, and it ran on after its client left):
    it is stepped beside the running request, and a warm past its deadline is answered 504 and aborted."""
    fake = FakeEngine(token_delay_s=0.05)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), request_timeout_s=1.0))) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            running = threading.Thread(
                target=c.post, args=("/v1/completions",), kwargs={"json": completion("hi", 40)}
            )
            running.start()
            wait_until(lambda: len(fake.added) == 1)
            warm = c.post("/v1/warm", json={"text": "shared prefix"})
            assert warm.status_code == 200 and warm.json()["results"][0]["tokens"] == len("shared prefix")
            running.join()
        warm_id = fake.added[1].request_id
        assert any(warm_id in step and fake.added[0].request_id in step for step in fake.step_log)
    # One slot, taken by a long request: the warm waits inside the engine; the engine then stalls past the
    # warm's deadline (a long step), and the warm is aborted in the engine, not left queued.
    fake = FakeEngine(max_num_seqs=1, token_delay_s=0.01)
    config = ServerConfig(model_names=(MODEL,), request_timeout_s=1.0)
    with serve(create_app(fake, config)) as url, httpx.Client(base_url=url, timeout=30) as c:
        running = threading.Thread(
            target=c.post, args=("/v1/completions",), kwargs={"json": completion("hi", 190)}
        )
        running.start()
        wait_until(lambda: len(fake.added) == 1)
        warm = threading.Thread(target=lambda: results.append(c.post("/v1/warm", json={"text": "never"})))
        results: list[httpx.Response] = []
        warm.start()
        wait_until(lambda: len(fake.added) == 2)  # handed to the engine, waiting for the slot
        fake.hold.clear()
        warm.join()
        assert_openai_error(results[0], 504, code="timeout")
        fake.hold.set()
        wait_until(lambda: fake.added[1].request_id in fake.aborted)
        running.join()


def test_stats_and_metrics_show_the_engine_loop() -> None:
    fake = FakeEngine(max_num_seqs=1)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        for prompt in ("abcd", "efgh"):
            assert httpx.post(url + "/v1/completions", json=completion(prompt, 3)).status_code == 200
        wait_until(lambda: httpx.get(url + "/v1/stats").json()["paged"]["steps"] == 6)
        body = httpx.get(url + "/v1/stats").json()
        # Two 4-token prompts, 3 tokens each: 2 blocks of 4 per request, now cached; half of the prompt hit.
        assert body["paged"] == {
            "block_size": 4,
            "blocks_total": 256,
            "blocks_used": 0,
            "blocks_cached": 4,
            "blocks_free": 252,
            "running": 0,
            "waiting": 0,
            "prefix_cache_queries": 8,
            "prefix_cache_hits": 4,
            "preemptions": 0,
            "steps": 6,
            "max_num_seqs": 1,
            "tier_loads": 0,
            "loading": 0,
            "hit_rate": 0.5,
            "kv_cache_usage": 0.0,
        }
        queue = body["queue"]
        assert (queue["steps"], queue["added"], queue["finished"], queue["largest_step"]) == (6, 2, 2, 1)
        assert queue["waiting"] == queue["running"] == queue["in_flight"] == 0
        text = httpx.get(url + "/metrics").text
        assert metric(text, "kvboost:num_requests_running") == 0
        assert metric(text, "kvboost:num_requests_waiting") == 0
        assert metric(text, "kvboost:kv_cache_usage_perc") == 0
        assert metric(text, "kvboost:prefix_cache_queries_total") == 8
        assert metric(text, "kvboost:prefix_cache_hits_total") == 4
        assert metric(text, "kvboost:num_preemptions_total") == 0
        assert metric(text, "kvboost:num_requests_loading") == 0
        assert metric(text, "kvboost:tier_loads_total") == 0
        assert metric(text, 'kvboost_kv_blocks{state="cached"}') == 4
        assert metric(text, 'kvboost_kv_blocks{state="free"}') == 252
        assert metric(text, 'kvboost_kv_blocks{state="used"}') == 0
        assert metric(text, "kvboost_engine_steps_total") == 6
        assert metric(text, "kvboost_queue_depth") == 0


def test_metrics_count_running_and_waiting_requests_mid_flight() -> None:
    fake = FakeEngine(max_num_seqs=1)
    fake.pause_before_step = 2
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:

        async def scenario() -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                requests = [
                    asyncio.create_task(c.post("/v1/completions", json=completion(p, 3))) for p in "ab"
                ]
                await until(fake.stalled.is_set)  # step 1 ran one request; the other waits (max_num_seqs=1)
                await polled(lambda: depth(c), lambda d: d >= 1)
                text = (await c.get("/metrics")).text
                assert metric(text, "kvboost:num_requests_running") == 1
                assert metric(text, "kvboost:num_requests_waiting") == 1
                assert 0 < metric(text, "kvboost:kv_cache_usage_perc") < 1
                assert metric(text, 'kvboost_kv_blocks{state="used"}') == 1
                fake.hold.set()
                return [r.status_code for r in await asyncio.gather(*requests)]

        assert asyncio.run(scenario()) == [200, 200]


def test_scoring_an_echoed_prompt_leaves_running_requests_stepping() -> None:
    """``echo`` + ``logprobs`` scores its prompt one slice per engine-thread call: a request already decoding
    takes a step between every two slices instead of waiting for the whole prompt, and the scores are
    the same as in one go."""
    fake = FakeEngine(token_delay_s=0.002)
    prompt = "abcdefghijklmnopqrstuvwxyz" * 3  # 77 entries: 10 slices of 8
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                long = asyncio.create_task(c.post("/v1/completions", json=completion("hi", 150)))
                await until(lambda: len(fake.step_log) >= 2)
                echo = await c.post(
                    "/v1/completions", json=completion(prompt, 1, echo=True, logprobs=1, temperature=0)
                )
                return echo, await long

        echo, long = asyncio.run(scenario())
    assert echo.status_code == 200 and long.status_code == 200
    scores = [i for i, (kind, _) in enumerate(fake.timeline) if kind == "score"]
    assert [fake.timeline[i][1] for i in scores] == [min(8 * k, 77) for k in range(1, 11)]
    assert long.json()["usage"]["completion_tokens"] == 150  # it ran all along
    for a, b in itertools.pairwise(scores):
        assert any(kind == "step" and running for kind, running in fake.timeline[a + 1 : b]), fake.timeline
    token_logprobs = echo.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert token_logprobs[0] is None and token_logprobs[1:78] == [
        -((ord(b) - ord(a) - 1) % 26) / 10 for a, b in itertools.pairwise(prompt)
    ]


class StallsScoring(FakeEngine):
    """Its prompt scorer blocks in its ``stall_at``-th ``advance()`` until ``score_hold`` is set."""

    def __init__(self, stall_at: int) -> None:
        super().__init__()
        self.score_hold = threading.Event()
        self.score_stalled = threading.Event()
        self._stall_at = stall_at

    def prompt_scorer(self, prompt, *, top_logprobs=0):
        scorer = super().prompt_scorer(prompt, top_logprobs=top_logprobs)
        advance, calls = scorer.advance, itertools.count(1)

        def stalling_advance() -> bool:
            if next(calls) == self._stall_at:
                self.score_stalled.set()
                self.score_hold.wait()
            return advance()

        scorer.advance = stalling_advance
        return scorer


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_while_its_echoed_prompt_is_scored_stops_the_scoring(stream: bool) -> None:
    """A disconnect during ``echo`` + ``logprobs`` scoring ends the request at the slice in progress: the
    scoring used to run every remaining slice of a prompt nobody would read (and queued prompts behind it)."""
    fake = StallsScoring(stall_at=2)
    prompt = "abcdefghijklmnopqrstuvwxyz" * 3  # 10 slices of 8
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                body = completion(prompt, 1, echo=True, logprobs=1, stream=stream)
                request = asyncio.create_task(c.post("/v1/completions", json=body))
                await until(fake.score_stalled.is_set)
                request.cancel()  # the client goes away while slice 2 is scored
                # The handler gives up while the slice is still running (before the fix: only after
                # scoring every slice, so never while this one is held).
                closed = 'kvboost_requests_total{route="/v1/completions",status="499"}'
                await until(lambda: metric(httpx.get(url + "/metrics").text, closed) == 1)

        try:
            asyncio.run(scenario())
        finally:
            fake.score_hold.set()
        wait_until(lambda: httpx.get(url + "/v1/stats").json()["queue"]["in_flight"] == 0)
    assert [n for kind, n in fake.timeline if kind == "score"] == [8, 16]


def test_a_request_waiting_for_the_scorer_honours_its_deadline_and_its_client() -> None:
    """Prompts are scored one at a time; a request queued behind a long one used to notice its deadline
    or its client going away only once it got its turn (after the whole other prompt was scored)."""
    fake = StallsScoring(stall_at=2)
    prompt = "abcdefghijklmnopqrstuvwxyz" * 3
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), request_timeout_s=60))) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                body = completion(prompt, 1, echo=True, logprobs=1)
                first = asyncio.create_task(c.post("/v1/completions", json=body))
                await until(fake.score_stalled.is_set)  # the first holds the scorer, stuck in slice 2
                second = asyncio.create_task(c.post("/v1/completions", json=body))
                await asyncio.sleep(0.3)  # queued for the scorer
                second.cancel()
                closed = 'kvboost_requests_total{route="/v1/completions",status="499"}'
                await until(lambda: metric(httpx.get(url + "/metrics").text, closed) == 1)
                fake.score_hold.set()
                assert (await first).status_code == 200

        try:
            asyncio.run(scenario())
        finally:
            fake.score_hold.set()
    # The second prompt was never scored: only the first one's 10 slices ran.
    assert [n for kind, n in fake.timeline if kind == "score"] == [min(8 * k, 77) for k in range(1, 11)]

    fake = StallsScoring(stall_at=2)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), request_timeout_s=1.5))) as url:

        async def timed_out() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                body = completion(prompt, 1, echo=True, logprobs=1)
                first = asyncio.create_task(c.post("/v1/completions", json=body))
                await until(fake.score_stalled.is_set)
                # Answered while the first still holds the scorer (before: only once it was free, so here
                # never: the client's own timeout would fire).
                second = await c.post("/v1/completions", json=body, timeout=20)
                assert second.status_code == 504 and second.json()["error"]["code"] == "timeout"
                assert not fake.score_hold.is_set()
                fake.score_hold.set()
                await first

        try:
            asyncio.run(timed_out())
        finally:
            fake.score_hold.set()


def test_aborting_the_last_requests_in_flight_refreshes_the_queue_counts() -> None:
    """Clients that all go away at once leave nothing in flight, so no step follows their aborts: the
    queue depth, running count and KV usage stayed as of the last step, and a waiting count at
    ``max_queue_size`` answered every later request 503 ``queue_full`` on an idle server."""
    fake = FakeEngine(max_num_seqs=1)
    fake.pause_before_step = 2
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_queue_size=2))) as url:

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                post = functools.partial(c.post, "/v1/completions")
                requests = [asyncio.create_task(post(json=completion("a", 100)))]
                await until(fake.stalled.is_set)  # "a" runs; its second step is held
                requests += [asyncio.create_task(post(json=completion(p, 100))) for p in "bc"]
                await polled(lambda: depth(c), lambda d: d >= 2)  # "b" and "c" are queued: the queue is full
                fake.pause_before_step = 3
                fake.hold.set()  # step 2 ends, "b" and "c" enter the engine (waiting), step 3 is held
                await until(lambda: len(fake.step_log) == 2 and fake.stalled.is_set())
                for request in requests:
                    request.cancel()  # every client goes away
                closed = 'kvboost_requests_total{route="/v1/completions",status="499"}'
                await polled(lambda: c.get("/metrics"), lambda r: metric(r.text, closed) == 3)
                fake.hold.set()  # step 3 ends ("b" and "c" still waiting); then all three are aborted
                await until(lambda: len(fake.aborted) == 3)
                await until(lambda: httpx.get(url + "/health").json()["queue_depth"] == 0)
                text = (await c.get("/metrics")).text
                assert metric(text, "kvboost:num_requests_running") == 0
                assert metric(text, 'kvboost_kv_blocks{state="used"}') == 0
                return await post(json=completion("d", 2))

        assert asyncio.run(scenario()).status_code == 200


def test_a_crashed_engine_loop_fails_health_and_refuses_requests_at_once() -> None:
    """A bug escaping the loop itself (not a failing step) ended the engine thread while /health kept
    answering ok and every later request waited for its --request-timeout (then 504, then a growing queue
    refused as queue_full). Now the request in flight gets a 500, /health a 503 and new requests a 503
    ``engine_dead`` at once (vLLM's EngineDeadError)."""
    fake = FakeEngine()
    crash = threading.Event()
    original = fake.has_unfinished

    def has_unfinished() -> bool:
        if crash.is_set():
            raise RuntimeError("a bug in the loop")
        return original()

    fake.has_unfinished = has_unfinished
    config = ServerConfig(model_names=(MODEL,), request_timeout_s=60)
    with serve(create_app(fake, config)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        crash.set()
        first = httpx.post(f"{url}/v1/completions", json=completion("hi", 3), timeout=30)
        assert_openai_error(first, 500)
        health = httpx.get(f"{url}/health")
        assert_openai_error(health, 503, code="engine_dead")
        started = time.monotonic()
        later = httpx.post(f"{url}/v1/completions", json=completion("hi", 3), timeout=30)
        assert_openai_error(later, 503, code="engine_dead")
        assert time.monotonic() - started < 10  # refused at once, not after --request-timeout (60 s)
