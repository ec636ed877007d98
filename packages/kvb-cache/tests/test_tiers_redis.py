"""Redis tier against a real redis-server on 127.0.0.1 (a free port, started and killed by PID).

Skipped locally when ``redis-server`` is not installed; under CI (``CI=true``) a missing server fails.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvb_cache import KVBoost
from kvb_cache.codecs import DenseCodec
from kvb_cache.config import EngineConfig
from kvb_cache.hashing import prefix_hash
from kvb_cache.records import RecordFormat
from kvb_cache.store import ChunkStore
from kvb_cache.tiers import BackgroundWriter, LowerTier, RedisTier, TierConfig, TieredStore

redis = pytest.importorskip("redis", reason="pip install 'kvb-cache[redis]' for the Redis tier tests")

from test_tiers_disk import FINGERPRINT, ROOT, chain  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway redis-server process (no persistence) that tests may stop and restart."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self):
        return redis.Redis(port=self.port)


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("redis-server is not installed but CI=true: install the Debian package redis-server")
        pytest.skip("redis-server not installed (apt-get install redis-server); Redis tier tests skipped")
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def tiered(url: str) -> TieredStore:
    codec = DenseCodec()
    tier = RedisTier(url, namespace=FINGERPRINT, timeout_s=0.5, retry_after_s=0.2)
    return TieredStore(
        ChunkStore(1 << 20),
        root=ROOT,
        codec=codec,
        lower=[LowerTier(tier=tier, format=RecordFormat(fingerprint=FINGERPRINT, codec=codec))],
        writer=BackgroundWriter(64),
    )


def commands(client, name: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


def test_a_chain_is_fetched_in_one_round_trip(redis_server):
    entries = chain(6)
    writer = tiered(redis_server.url)
    for e in entries:
        writer.put(e, root=ROOT)
    writer.flush()
    client = redis_server.client()
    assert len([k for k in client.scan_iter("kvb:*") if not k.endswith(b"__stats__")]) == 6
    reader = tiered(redis_server.url)
    mget, get = commands(client, "mget"), commands(client, "get")
    assert reader.prefetch([e.key for e in entries]) == 6
    assert commands(client, "mget") - mget == 1 and commands(client, "get") == get
    got = reader.get(entries[5].key)
    assert got.parent == entries[4].key and torch.equal(got.kv[1][0], entries[5].kv[1][0])
    s = reader.lower[0].tier.stats()
    assert (s.hits, s.misses, s.errors) == (6, 0, 0)
    # A shared namespace is not counted (that needs a scan): unknown is null, not a made-up number.
    assert (s.entries, s.bytes) == (None, None)
    assert json.loads(json.dumps(s.as_dict()))["entries"] is None


def test_ttl_is_set_on_records(redis_server):
    tier = RedisTier(redis_server.url, namespace=FINGERPRINT, ttl_s=120)
    e = chain(1)[0]
    assert tier.put(e.key, b"x")
    assert 0 < redis_server.client().ttl(tier._name(e.key)) <= 120


@pytest.mark.parametrize(
    "url",
    ["redis://:s3cret@127.0.0.1:{port}/0", "redis://kvb:s3cret@127.0.0.1:{port}/0"],
)
def test_outage_warning_and_status_never_show_the_password(url, caplog):
    # No server on the port: the first call fails. The warning printed the URL as given, password included,
    # into every log that collects warnings (and `kvboost cache status` printed it too).
    from kvb_cache.tiers.status import redis_status

    url = url.format(port=_free_port())
    tier = RedisTier(url, namespace=FINGERPRINT, timeout_s=0.5)
    with caplog.at_level("WARNING", logger="kvb_cache.tiers.remote"):
        assert tier.get(chain(1)[0].key) is None
    assert "failed" in caplog.text and "***@127.0.0.1" in caplog.text
    assert "s3cret" not in caplog.text
    reach, _ = redis_status(url)
    assert not reach.reachable and "s3cret" not in reach.url and "***" in reach.url
    assert tier.url == url  # the connection itself still uses the real one


def test_an_unreachable_redis_is_reported_when_the_engine_is_built(caplog):
    """A wrong port or password showed only at the first request (a failed lookup); now one warning when the
    tiers are built, the password masked, and the engine starts."""
    from kvb_cache.tiers.factory import lower_tiers

    url = f"redis://:s3cret@127.0.0.1:{_free_port()}/0"
    config = EngineConfig(tiers=TierConfig(remote_url=url, remote_timeout_s=0.5))
    with caplog.at_level("WARNING", logger="kvb_cache.tiers.remote"):
        (remote,) = lower_tiers(config, fingerprint=FINGERPRINT)
    assert "PING" in caplog.text and "***@127.0.0.1" in caplog.text and "s3cret" not in caplog.text
    assert remote.tier.stats().errors == 1


@pytest.mark.parametrize("timeout", [None, "2", True, float("inf"), float("nan"), 0, -1.0])
def test_remote_timeout_must_be_a_finite_positive_number(timeout):
    # None and "2" raised a bare TypeError; inf passed and every Redis call then raised OverflowError.
    from kvb_cache.errors import ConfigError

    with pytest.raises(ConfigError, match="remote_timeout_s must be a finite number"):
        TierConfig(remote_url="redis://127.0.0.1:6379/0", remote_timeout_s=timeout)
    assert TierConfig(remote_url="redis://127.0.0.1:6379/0", remote_timeout_s=1).remote_timeout_s == 1


def test_stores_skipped_while_redis_is_down_are_counted_as_dropped():
    # After the first failure the tier skips Redis for retry_after_s: those skipped stores were counted
    # nowhere (one error for the whole outage).
    tier = RedisTier(f"redis://127.0.0.1:{_free_port()}/0", namespace=FINGERPRINT, timeout_s=0.5)
    entries = chain(3)
    assert not tier.put(entries[0].key, b"x")  # connection refused: an error, the tier pauses
    assert not tier.put(entries[1].key, b"x") and not tier.put(entries[2].key, b"x")
    s = tier.stats()
    assert (s.errors, s.dropped, s.stores) == (1, 2, 0)


def test_redact_url_masks_only_the_password():
    from kvb_cache.tiers.remote import redact_url

    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("rediss://bob:p@ss@host/1") == "rediss://bob:***@host/1"
    assert redact_url("unix:///run/r.sock?db=0&password=s3cret") == "unix:///run/r.sock?db=0&password=***"


def test_redis_down_degrades_to_misses_with_a_counter_then_recovers(redis_server, caplog):
    entries = chain(3)
    store = tiered(redis_server.url)
    redis_server.stop()
    t0 = time.perf_counter()
    assert store.get(entries[0].key) is None
    for e in entries:
        assert store.put(e, root=ROOT)  # RAM still works, the Redis write is skipped
    store.flush()
    assert time.perf_counter() - t0 < 5
    tier = store.lower[0].tier
    assert tier.stats().errors >= 1 and tier.stats().misses >= 1
    assert any("Redis" in r.message and "failed" in r.message for r in caplog.records)
    redis_server.start()
    time.sleep(0.3)  # past retry_after_s
    assert tier.put(entries[0].key, b"y") and tier.get(entries[0].key) == b"y"


def test_counts_a_failed_store_carried_reach_the_shared_counters_with_the_next_one(redis_server):
    # The pending hit/miss counts were taken out before the pipeline ran and lost when it failed, so the
    # shared counters (`kvboost cache status`) undercounted after every outage.
    tier = RedisTier(redis_server.url, namespace=FINGERPRINT, timeout_s=0.5, retry_after_s=0.2)
    tier.count("hits", 3)
    redis_server.stop()
    assert not tier.put(chain(1)[0].key, b"x")
    redis_server.start()
    time.sleep(0.3)  # past retry_after_s
    assert tier.put(chain(1)[0].key, b"x")
    shared = redis.Redis.from_url(redis_server.url).hgetall(tier.prefix + "__stats__")
    assert int(shared[b"hits"]) == 3


def test_corrupted_record_in_redis_is_dropped_and_counted(redis_server):
    entries = chain(2)
    store = tiered(redis_server.url)
    for e in entries:
        store.put(e, root=ROOT)
    store.flush()
    client = redis_server.client()
    name = store.lower[0].tier._name(entries[1].key)
    data = bytearray(client.get(name))
    data[100] ^= 0x40
    client.set(name, bytes(data))
    fresh = tiered(redis_server.url)
    assert fresh.prefetch([e.key for e in entries]) == 1
    fresh.flush()
    assert fresh.lower[0].tier.stats().corrupt == 1 and client.get(name) is None
    fresh.close()
    # The shared counters `kvboost cache status` reads got it too (they said corrupt 0 for Redis).
    from kvb_cache.tiers.status import redis_status

    _, namespaces = redis_status(redis_server.url)
    [shared] = [n.stats for n in namespaces if FINGERPRINT.startswith(n.namespace)]
    assert (shared.hits, shared.corrupt, shared.hit_rate) == (2, 1, 0.5)  # two found, one refused


def test_a_key_of_another_type_under_a_record_name_is_replaced_not_skipped(redis_server):
    entries = chain(1)
    store = tiered(redis_server.url)
    client = redis_server.client()
    name = store.lower[0].tier._name(entries[0].key)
    client.hset(name, "someone", "else")  # not a record: MGET reads it as nil
    assert not store.lower[0].tier.contains(entries[0].key)
    store.demote(entries[0])  # the write path that skips keys the tier already holds
    store.flush()
    assert client.type(name) == b"string"
    assert tiered(redis_server.url).prefetch([entries[0].key]) == 1


# ---------------------------------------------------------------------------------------- engines

CHILD = textwrap.dedent(
    """
    import json, sys
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from kvb_cache import EngineConfig, KVBoost
    from kvb_cache.tiers import TierConfig

    folder, url, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    engine = KVBoost(model, tok, config=EngineConfig(chunk_size=16, tiers=TierConfig(remote_url=url)))
    result = engine.generate(prompt, max_new_tokens=12, ignore_eos=True)
    engine.flush()
    print(json.dumps({"ids": result.output_ids, "cached": result.cached_tokens}))
    """
)


def _run_child(folder, url, prompt) -> dict:
    import json

    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), url, json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_processes_share_exact_hits_through_redis(redis_server, tmp_path, llama, tokenizer):
    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompt = list(range(10, 60))  # 50 tokens: 3 full chunks of 16
    a = _run_child(tmp_path, redis_server.url, prompt)
    b = _run_child(tmp_path, redis_server.url, prompt)
    assert a["cached"] == 0
    assert b["cached"] == 48
    assert b["ids"] == a["ids"]


def test_engine_survives_redis_stopping_mid_run(redis_server, llama, tokenizer):
    config = EngineConfig(chunk_size=16, tiers=TierConfig(remote_url=redis_server.url, remote_timeout_s=0.3))
    engine = KVBoost(llama, tokenizer, config=config)
    reference = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, max_cache_bytes=0))
    prompt = list(range(20, 70))
    first = engine.generate(prompt, max_new_tokens=8, ignore_eos=True)
    redis_server.stop()
    engine.clear_cache()  # RAM empty: the next lookup must go to the (dead) Redis
    second = engine.generate(prompt, max_new_tokens=8, ignore_eos=True)
    expected = reference.generate(prompt, max_new_tokens=8, ignore_eos=True)
    assert second.cached_tokens == 0
    assert first.output_ids == second.output_ids == expected.output_ids
    assert engine.tiers.lower[0].tier.stats().errors >= 1


def test_a_full_redis_refusing_writes_still_serves_reads(redis_server, caplog):
    """Under ``maxmemory-policy noeviction`` a full Redis answers SET with an OOM error: that took the tier
    off for ``retry_after_s`` as if Redis were down (reads of records still there missed), and the log
    flapped between "failed" and "reachable again". Now the write is dropped (counted) and reads go on."""
    entries = chain(3)
    store = tiered(redis_server.url)
    tier = store.lower[0].tier
    assert tier.put(entries[0].key, b"kept")
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", max(1, int(client.info("memory")["used_memory"]) - 1))
    try:
        with caplog.at_level(logging.WARNING, logger="kvb_cache.tiers.remote"):
            for _ in range(3):
                assert not tier.put(entries[1].key, b"x" * 100_000)
            assert tier.get(entries[0].key) == b"kept"  # read right after the refusals
    finally:
        client.config_set("maxmemory", 0)
    stats = tier.stats()
    assert stats.dropped == 3 and stats.errors == 3
    warnings = [r.getMessage() for r in caplog.records if "Redis" in r.getMessage()]
    assert len(warnings) == 1 and "refused a write" in warnings[0], warnings
    assert tier.put(entries[1].key, b"y") and tier.get(entries[1].key) == b"y"


def test_blocks_written_while_redis_was_down_reach_it_on_a_ram_hit(
    redis_server, llama, tokenizer, monkeypatch
):
    """The records of a prompt computed while Redis was down were never sent once it came back (RAM hits
    only TOUCHed records Redis held): other processes and restarts reused nothing of that prompt."""
    from kvb_cache.core import block_tiers

    monkeypatch.setattr(block_tiers, "TOUCH_INTERVAL_S", 0.0)  # a missed block is due again at once
    config = EngineConfig(chunk_size=16, tiers=TierConfig(remote_url=redis_server.url, remote_timeout_s=0.3))
    engine = KVBoost(llama, tokenizer, config=config)
    tier = engine.tiers.lower[0].tier
    prompt = list(range(20, 70))  # three full blocks of 16
    redis_server.stop()
    expected = engine.generate(prompt, max_new_tokens=4, ignore_eos=True)
    engine.flush()
    assert tier.stats().stores == 0
    redis_server.start()
    tier._down_until = 0.0  # skip the outage's retry wait
    assert engine.generate(prompt, max_new_tokens=4, ignore_eos=True).cached_tokens >= 48  # a RAM hit
    engine.close()
    assert tier.stats().stores == 3
    other = KVBoost(llama, tokenizer, config=config)  # another process: nothing in its RAM
    got = other.generate(prompt, max_new_tokens=4, ignore_eos=True)
    other.close()
    assert got.cached_tokens == 48 and got.output_ids == expected.output_ids  # before: 0


def test_a_value_far_larger_than_a_record_is_read_only_up_to_the_bound(redis_server, llama, tokenizer):
    """A value of any size under a record's name was read whole into memory by every lookup (MGET) before
    it failed validation. The engine now bounds what it reads of each value by its records' size: the
    value is cut there, fails validation like any damaged record (corrupt, deleted) and is recomputed."""
    config = EngineConfig(chunk_size=16, tiers=TierConfig(remote_url=redis_server.url))
    prompt = list(range(20, 70))  # three full blocks of 16
    writer = KVBoost(llama, tokenizer, config=config)
    expected = writer.generate(prompt, max_new_tokens=4, ignore_eos=True)
    writer.close()
    engine = KVBoost(llama, tokenizer, config=config)
    tier = engine.tiers.lower[0].tier
    cap = tier.max_record_bytes
    client = redis_server.client()
    first = prefix_hash(engine.root, prompt[:16])
    second = tier._name(prefix_hash(first, prompt[16:32]))
    record = client.get(second)
    assert cap is not None and len(record) < cap  # a real record fits, with room
    client.set(second, record + b"\0" * (16 << 20))  # 16 MiB more than a record
    got = tier.get_many([first, prefix_hash(first, prompt[16:32])])
    assert len(got[0]) == len(record) and len(got[1]) == cap + 1  # read up to the bound, no further
    result = engine.generate(prompt, max_new_tokens=4, ignore_eos=True)
    engine.flush()
    assert result.cached_tokens == 16 and result.output_ids == expected.output_ids  # used up to the bad one
    assert tier.stats().corrupt == 1
    assert len(client.get(second)) == len(record)  # dropped, then written afresh by the recompute
    client.delete(second)
    client.hset(second, "someone", "else")  # another type under the name: a miss, as MGET had it
    assert tier.get_many([prefix_hash(first, prompt[16:32])]) == [None]
