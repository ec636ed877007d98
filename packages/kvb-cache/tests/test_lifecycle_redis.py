"""Salts, reset_cache and the exit flush against a real redis-server (skipped without one, failed in CI)."""

from __future__ import annotations

from test_tiers_redis import redis_server  # noqa: F401 - the fixture (skips without the redis package)

from kvb_cache import EngineConfig, KVBoost
from kvb_cache.tiers import TierConfig

PROMPT = list(range(5, 75))


def engine(model, tok, url: str) -> KVBoost:
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16, tiers=TierConfig(remote_url=url)))


def test_salted_chains_are_isolated_in_redis(redis_server, llama, tokenizer):  # noqa: F811
    with engine(llama, tokenizer, redis_server.url) as first:
        first.generate(PROMPT, max_new_tokens=2, cache_salt="a")
    second = engine(llama, tokenizer, redis_server.url)  # another process sharing Redis
    assert second.generate(PROMPT, max_new_tokens=2, cache_salt="b").cached_tokens == 0
    second.clear_cache()
    assert second.generate(PROMPT, max_new_tokens=2, cache_salt="a").cached_tokens == 64


def test_reset_cache_with_lower_tiers_empties_the_namespace(redis_server, llama, tokenizer):  # noqa: F811
    eng = engine(llama, tokenizer, redis_server.url)
    eng.generate(PROMPT, max_new_tokens=2)
    eng.flush()
    prefix = eng.tiers.lower[0].tier.prefix
    client = redis_server.client()
    records = [k for k in client.scan_iter(match=prefix + "*") if not k.endswith(b"__stats__")]
    assert eng.reset_cache()["lower_tier_records_dropped"] == 0 and client.exists(*records) == len(records)
    assert eng.reset_cache(lower_tiers=True)["lower_tier_records_dropped"] == len(records) >= 4
    assert list(client.scan_iter(match=prefix + "*")) == []
    assert eng.generate(PROMPT, max_new_tokens=2).cached_tokens == 0
