"""Tier lookups off the engine loop against a real Redis: a lookup that ends after a reset or a close.

Before the lookups moved off the loop, a reset or close could not interleave with one (both ran on the
engine's thread). Found by an audit: a lookup still reading Redis for an aborted request finished after
``reset_cache(lower_tiers=True)`` and wrote the old weights' records back into the disk tier (the next
request decoded from them), and after ``close()`` it started a new writer thread that wrote into the closed
disk tier and never ended.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_tiers_redis import redis_server  # noqa: F401  (the fixture)

from kvb_cache import EngineConfig, KVBoost, SamplingParams
from kvb_cache.tiers import TierConfig

pytest.importorskip("redis", reason="pip install 'kvb-cache[redis]' for the Redis tier tests")

STORED = list(range(3, 73))


class HeldAfterRead:
    """Wraps the Redis tier's ``get_many``: a chain read (more than the first probe) returns only once the
    test opens the gate, after the records were read."""

    def __init__(self, tier) -> None:
        self.inner, self.gate, self.read = tier.get_many, threading.Event(), threading.Event()
        tier.get_many = self

    def __call__(self, keys):
        out = self.inner(keys)
        if len(keys) > 1:
            self.read.set()
            assert self.gate.wait(30)
        return out


def _engine(model, tok, **tiers) -> KVBoost:
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16, tiers=TierConfig(**tiers)))


def _seed_redis(model, tok, url: str) -> None:
    seed = _engine(model, tok, remote_url=url)
    seed.generate(STORED, max_new_tokens=1)
    seed.close()


def test_a_lookup_ending_after_a_reset_is_dropped(redis_server, llama, tokenizer, tmp_path):  # noqa: F811
    _seed_redis(llama, tokenizer, redis_server.url)
    eng = _engine(llama, tokenizer, disk_cache_dir=tmp_path, remote_url=redis_server.url)
    held = HeldAfterRead(eng.tiers.lower[1].tier)
    rid = eng.add_request(STORED, SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.step()
    assert held.read.wait(10)  # the old records are read, not yet handed back
    assert eng.abort(rid)
    with torch.no_grad():  # the weights change in place (README: then reset the cache, lower tiers too)
        for p in llama.model.layers[0].parameters():
            p.mul_(1.5)
    try:
        eng.reset_cache(lower_tiers=True)
        held.gate.set()
        time.sleep(0.3)  # the lookup ends; before, it queued the old records for the disk tier here
        eng.flush()
        assert not list(tmp_path.rglob("*.kvb"))
        got = eng.generate(STORED, max_new_tokens=8, ignore_eos=True)
        fresh = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, max_cache_bytes=0))
        assert got.cached_tokens == 0
        assert got.output_ids == fresh.generate(STORED, max_new_tokens=8, ignore_eos=True).output_ids
    finally:
        with torch.no_grad():
            for p in llama.model.layers[0].parameters():
                p.div_(1.5)
        eng.close()


def test_a_lookup_ending_after_close_writes_nothing(redis_server, llama, tokenizer, tmp_path):  # noqa: F811
    _seed_redis(llama, tokenizer, redis_server.url)
    eng = _engine(llama, tokenizer, disk_cache_dir=tmp_path, remote_url=redis_server.url)
    held = HeldAfterRead(eng.tiers.lower[1].tier)
    eng.add_request(STORED, SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.step()
    assert held.read.wait(10)
    assert eng.close()
    writers = [t for t in threading.enumerate() if t.name == "kvb-tier-writer"]
    held.gate.set()
    time.sleep(0.3)
    assert [t for t in threading.enumerate() if t.name == "kvb-tier-writer" and t not in writers] == []
    assert not list(tmp_path.rglob("*.kvb"))
    while eng.has_unfinished():  # the closed engine still serves, from RAM alone
        for out in eng.step():
            assert out.error is None
