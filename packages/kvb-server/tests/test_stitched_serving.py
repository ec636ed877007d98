"""A stitched (non-prefix reuse) request served over HTTP (#16): documents reordered after another question
reuse their KV, the request decodes in the engine loop, and its text equals the library's on a twin engine."""

from __future__ import annotations

import httpx
from conftest import CORPUS, build_tiny_engine, serve

from kvb_cache import StitchConfig
from kvb_server import ServerConfig, create_app

DOCS = [CORPUS[0], CORPUS[1], CORPUS[2]]


def _prompt(order: list[int], question: str) -> str:
    return "Documents:\n" + "".join(f"{DOCS[i]}\n" for i in order) + f"Question: {question}\nAnswer:"


FIRST = _prompt([0, 1, 2], "which city is in Italy?")
SECOND = _prompt([2, 0, 1], "what does a cache keep?")


def test_stitched_completion_over_http_matches_the_library() -> None:
    stitch = StitchConfig(recompute_strategy="selective", overlap_k=4)
    engine = build_tiny_engine(stitching=stitch)
    twin = build_tiny_engine(stitching=stitch)
    twin.generate(FIRST, max_new_tokens=6)
    expected = twin.generate(SECOND, max_new_tokens=6)
    assert expected.recomputed_tokens > 0  # the library stitched and repaired it

    config = ServerConfig(model_names=("tiny-llama",), max_tokens=48)
    with serve(create_app(engine, config)) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = {"model": "tiny-llama", "max_tokens": 6, "temperature": 0}
        first = client.post("/v1/completions", json={**body, "prompt": FIRST})
        assert first.status_code == 200, first.text
        second = client.post("/v1/completions", json={**body, "prompt": SECOND})
        assert second.status_code == 200, second.text
        stats = client.get("/v1/stats").json()

    assert second.json()["choices"][0]["text"] == expected.output_text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == expected.cached_tokens > 0
    stitching = stats["cache"]["stitching"]
    assert stitching["enabled"] and stitching["strategy"] == "selective" and stitching["stitched_chunks"] > 0
    assert not engine.core.solo and engine.paged_stats().blocks_used == 0


def test_the_server_computes_a_stitched_prompt_while_idle() -> None:
    """Between requests the worker runs the engine's idle work (StitchConfig.idle_copies): the stitched
    prompt is computed exactly, so asked again it is served from cache past its last token but one, with
    the same text as a fresh engine's."""
    import time

    engine = build_tiny_engine(stitching=StitchConfig(recompute_strategy="selective", overlap_k=4))
    plain = build_tiny_engine().generate(SECOND, max_new_tokens=6)
    config = ServerConfig(model_names=("tiny-llama",), max_tokens=48)
    with serve(create_app(engine, config)) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = {"model": "tiny-llama", "max_tokens": 6, "temperature": 0}
        assert client.post("/v1/completions", json={**body, "prompt": FIRST}).status_code == 200
        second = client.post("/v1/completions", json={**body, "prompt": SECOND})
        assert second.status_code == 200, second.text
        deadline = time.monotonic() + 60
        while True:
            stats = client.get("/v1/stats").json()
            if stats["cache"]["stitching"]["idle"]["computed_prompts"] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert stats["cache"]["stitching"]["idle"]["computed_prompts"] == 1
        assert stats["queue"]["idle_steps"] > 0
        again = client.post("/v1/completions", json={**body, "prompt": SECOND})
    usage = again.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert again.json()["choices"][0]["text"] == plain.output_text
    assert engine.paged_stats().blocks_used == 0 and not engine.has_idle_work()
