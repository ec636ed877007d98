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
