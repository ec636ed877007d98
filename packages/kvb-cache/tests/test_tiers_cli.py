"""``kvboost cache status`` over a disk folder and a real Redis."""

from __future__ import annotations

import argparse
import json

from test_tiers_disk import FINGERPRINT, chain, record
from test_tiers_redis import redis_server  # noqa: F401  (fixture)

from kvb_cache.tiers import DiskTier, RedisTier
from kvb_cache.tiers.cli import add_cache_commands
from kvb_cache.tiers.status import redis_status


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvboost")
    add_cache_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_status_reports_disk_entries_bytes_and_hit_rate(tmp_path, capsys):
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    entries = chain(3)
    for e in entries:
        disk.put(e.key, record(e))
    disk.get(entries[0].key)
    disk.get(b"\x00" * 32)
    disk.close()
    args = parse(["cache", "status", "--disk-cache-dir", str(tmp_path), "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    stats = report["disk"]["namespaces"][FINGERPRINT[:32]]
    size = sum(p.stat().st_size for p in tmp_path.rglob("*.kvb"))
    assert (stats["entries"], stats["bytes"], stats["hits"], stats["misses"], stats["hit_rate"]) == (
        3,
        size,
        1,
        1,
        0.5,
    )


def test_status_reports_redis_round_trip_and_shared_counters(redis_server):  # noqa: F811
    tier = RedisTier(redis_server.url, namespace=FINGERPRINT)
    entries = chain(2)
    tier.get_many([e.key for e in entries])  # 2 misses, reported with the next store
    for e in entries:
        tier.put(e.key, record(e))
    reach, found = redis_status(redis_server.url)
    assert reach.reachable and 0 < reach.round_trip_ms < 1000
    [ns] = found
    assert ns.namespace == FINGERPRINT[:32]
    assert (ns.stats.entries, ns.stats.misses, ns.stats.stores) == (2, 2, 2) and ns.stats.bytes > 0


def test_status_of_an_unreachable_redis_says_so(capsys):
    args = parse(["cache", "status", "--remote-url", "redis://127.0.0.1:1/0"])
    assert args.func(args) == 0
    assert "UNREACHABLE" in capsys.readouterr().out
