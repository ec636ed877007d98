"""Short versions of the reliability harness (tools/reliability.py, docs/reliability.md) for CI.

Real ``kvboost-server`` processes on the embedded SmolLM2-135M (CPU), loopback only. Nothing here asserts
a timing: only outcomes (no 5xx, no reset connection, no failed request, blocks back in the pool, tier
counters). The Redis tests are skipped locally without ``redis-server``; under CI (``CI=true``) a missing
server fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from reliability_faults import corrupted_disk_record, corrupted_redis_record, redis_outage
from reliability_fuzz import Case, generate_cases, health_ms, send, send_truncated
from reliability_load import run_load
from reliability_procs import Redis, Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(flags=("--max-tokens", "4"), log_dir=tmp_path_factory.mktemp("logs"), name="short").start()
    yield srv
    srv.stop()


@pytest.fixture
def needs_redis():
    pytest.importorskip("redis", reason="pip install 'kvb-cache[redis]' for the Redis tier")
    if Redis.binary() is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("redis-server is not installed but CI=true: install the Debian package redis-server")
        pytest.skip("redis-server not installed (apt-get install redis-server)")


def test_fuzzed_bodies_get_no_5xx_and_no_reset(server):
    # The fixed cases (deep nesting up to 100000 levels, invalid UTF-8, BOM, UTF-16, surrogates, 5 MiB
    # bodies chunked and not, odd bodies) on both routes plus 60 random ones. ``Connection: close`` with
    # an oversized body is left out: its 413 can lose a race with the TCP reset (see docs/reliability.md).
    cases = [c for c in generate_cases(seed=7, random_cases=60) if not c.kind.endswith("_conn_close")]
    outcomes = {(c.kind, c.route): send(server.port, c) for c in cases}
    bad = {k: v for k, v in outcomes.items() if not v.isdigit() or int(v) >= 500}
    assert not bad
    assert {outcomes[("deep_array_100000", r)] for r in ("/v1/completions", "/v1/chat/completions")} == {
        "400"
    }
    assert outcomes[("utf8_stray_byte", "/v1/chat/completions")] == "400"
    for _ in range(4):
        send_truncated(
            server.port, Case(kind="truncated", route="/v1/completions", body=b'{"prompt": "abc"}')
        )
    assert health_ms(server.port) is not None
    assert server.alive()


def test_load_with_disconnects_fails_nothing_and_returns_every_block(server):
    report = run_load(server.url, clients=8, seconds=10, max_tokens=4, disconnect_share=0.25)
    assert report.failed == 0, report.failures[:5]
    assert report.completed > 0
    stats = server.wait_idle()
    assert stats["paged"]["blocks_used"] == 0
    assert stats["paged"]["running"] == 0
    assert stats["queue"]["in_flight"] == 0


def test_redis_killed_and_restarted_requests_succeed_then_hit_again(needs_redis, tmp_path):
    got = redis_outage(tmp_path, down_requests=2, words=40)
    assert got["failed"] == 0, got.get("error")
    assert got["before_outage"]["cached_tokens_from_redis"] > 0
    assert got["while_down"]["requests_ok"] == 2
    assert got["while_down"]["redis"]["errors"] > 0
    assert got["hits_again_after_s"] is not None
    assert got["after_restart"]["cached_tokens"] > 0
    assert got["server_alive"]


def test_corrupted_disk_record_is_counted_and_recomputed(tmp_path):
    got = corrupted_disk_record(tmp_path, words=40, heal=False)
    assert "error" not in got, got.get("error")
    for how in ("flipped_byte", "truncated"):
        assert got[how]["same_text"]
        assert got[how]["corrupt_counted"] >= 1
        assert got[how]["cached_tokens"] == 0


def test_corrupted_redis_record_is_counted_and_recomputed(needs_redis, tmp_path):
    got = corrupted_redis_record(tmp_path, words=40)
    assert "error" not in got, got.get("error")
    for how in ("flipped_byte", "garbage"):
        assert got[how]["same_text"]
        assert got[how]["corrupt_counted"] >= 1
        assert got[how]["cached_tokens"] == 0


def test_a_full_disk_pauses_the_disk_tier_with_one_warning(tmp_path, monkeypatch, caplog):
    import errno

    from kvb_cache.hashing import ChunkHash
    from kvb_cache.tiers import disk as disk_module
    from kvb_cache.tiers.disk import DiskTier

    tier = DiskTier(tmp_path, namespace="ns", max_bytes=10**6)
    stored = [ChunkHash(bytes([200 + i]) * 32) for i in range(3)]
    for k in stored:
        assert tier.put(k, b"record")  # the disk works: stored
    real_write = Path.write_bytes

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    keys = [ChunkHash(bytes([i]) * 32) for i in range(1, 6)]
    with caplog.at_level("WARNING", logger="kvb_cache.tiers.disk"):
        assert not any(tier.put(k, b"record") for k in keys)
    stats = tier.stats()
    # The first store evicts the two oldest records to make room and retries once; the retry fails too,
    # so the tier pauses: the other four are skipped without touching the disk.
    assert (stats.errors, stats.evictions, stats.dropped) == (2, 2, 4)
    assert sum("cannot store records" in r.getMessage() for r in caplog.records) == 1
    assert tier.get(stored[2]) == b"record"  # reads go on
    monkeypatch.setattr(Path, "write_bytes", real_write)
    monkeypatch.setattr(disk_module.time, "monotonic", lambda: 1e12)  # the pause is over
    assert tier.put(keys[0], b"record")
