"""``kvboost cache status`` over a disk folder and a real Redis."""

from __future__ import annotations

import argparse
import json

import pytest
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


def test_status_reports_every_persisted_counter(tmp_path, capsys):
    # `dropped` (stores the tier skipped: too large for the budget here) was persisted but read back as 0.
    entries = chain(2)
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=len(record(entries[0])) // 2)
    assert disk.put(entries[0].key, record(entries[0])) is False
    disk.close()
    args = parse(["cache", "status", "--disk-cache-dir", str(tmp_path), "--json"])
    assert args.func(args) == 0
    stats = json.loads(capsys.readouterr().out)["disk"]["namespaces"][FINGERPRINT[:32]]
    assert (stats["dropped"], stats["stores"], stats["entries"]) == (1, 0, 0)


def test_status_skips_a_record_evicted_while_it_lists_the_folder(tmp_path, monkeypatch, capsys):
    """Another process sharing the folder may evict a record between the listing and its stat: status died
    with FileNotFoundError (1 call in 6 with two servers under load)."""
    from pathlib import Path

    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    for e in chain(2):
        disk.put(e.key, record(e))
    disk.close()
    listed = Path.glob
    evicted: list[Path] = []

    # Python 3.13's rglob goes through glob too (a Path pattern, case_sensitive=...): evict once, in the
    # status's listing, not again in this test's own rglob below.
    def glob_then_evict(self, pattern, **kwargs):
        found = list(listed(self, pattern, **kwargs))
        if str(pattern).endswith(".kvb") and found and not evicted:
            found[0].unlink()  # evicted by another server right after the listing
            evicted.append(found[0])
        return found

    monkeypatch.setattr(Path, "glob", glob_then_evict)
    args = parse(["cache", "status", "--disk-cache-dir", str(tmp_path), "--json"])
    assert args.func(args) == 0
    stats = json.loads(capsys.readouterr().out)["disk"]["namespaces"][FINGERPRINT[:32]]
    assert evicted and stats["entries"] == 1
    assert stats["bytes"] == sum(p.stat().st_size for p in tmp_path.rglob("*.kvb"))


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


def test_status_says_why_redis_did_not_answer(redis_server, capsys):  # noqa: F811
    # A wrong password read "UNREACHABLE" like a stopped server; redis-py's reason now follows, and the
    # password stays masked.
    host_port = redis_server.url.split("://", 1)[1].split("/", 1)[0]
    url = f"redis://nobody:s3cret@{host_port}/0"
    args = parse(["cache", "status", "--remote-url", url])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "UNREACHABLE (" in out and "password" in out.lower() and "s3cret" not in out
    args = parse(["cache", "status", "--remote-url", url, "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)["redis"]
    assert not report["reachable"] and "password" in report["error"].lower()


def test_status_survives_counters_written_by_someone_else(tmp_path, redis_server, capsys):  # noqa: F811
    # The counters are shared reports (a disk stats.json, a Redis hash anyone using the database can write):
    # a list, a non-integer field or a key of another type crashed `status` with a traceback.
    disk = DiskTier(tmp_path, namespace=FINGERPRINT, max_bytes=1 << 20)
    entries = chain(2)
    for e in entries:
        disk.put(e.key, record(e))
    disk.close()
    (disk.directory / "stats.json").write_text("[1, 2]")
    tier = RedisTier(redis_server.url, namespace=FINGERPRINT)
    tier.put(entries[0].key, record(entries[0]))
    client = redis_server.client()
    client.hset(tier.prefix + "__stats__", "hits", "not-a-number")
    client.set("kvb:" + "b" * 32 + ":__stats__", "a string, not a hash")
    args = parse(
        ["cache", "status", "--disk-cache-dir", str(tmp_path), "--remote-url", redis_server.url, "--json"]
    )
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["disk"]["namespaces"][FINGERPRINT[:32]]["entries"] == 2
    redis_ns = report["redis"]["namespaces"][FINGERPRINT[:32]]
    assert (redis_ns["entries"], redis_ns["stores"], redis_ns["hits"]) == (1, 1, 0)
    # ... and a store still succeeds (the SET lands; only the counters could not be added).
    assert tier.put(entries[1].key, record(entries[1])) and tier.stats().errors == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["cache", "bench", "--lengths", "-5"],
        ["cache", "bench", "--lengths", "0"],
        ["cache", "bench", "--repeats", "0"],
        ["cache", "bench", "--threads", "0"],
        ["cache", "bench", "--remote-url", "localhost:6379"],
        ["cache", "status", "--remote-url", "foo://bar"],
        # redis-py's own URL parse raised ValueError (a traceback) when the tier was opened.
        ["cache", "status", "--remote-url", "redis://127.0.0.1:notaport/0"],
        ["cache", "bench", "--remote-url", "redis://127.0.0.1:99999/0"],
    ],
)
def test_bad_arguments_are_usage_errors(argv, capsys):
    # --lengths -5 prefilled every pydoc topic (a hang); the others ended in tracebacks.
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_status_of_a_file_is_a_clear_error(tmp_path, capsys):
    target = tmp_path / "not-a-folder"
    target.write_text("x")
    args = parse(["cache", "status", "--disk-cache-dir", str(target)])
    assert args.func(args) == 2
    assert "not a disk cache folder" in capsys.readouterr().err


def test_status_of_a_missing_folder_is_a_clear_error(tmp_path, capsys):
    # A typo in the path listed nothing and exited 0, as if it were an empty cache.
    args = parse(["cache", "status", "--disk-cache-dir", str(tmp_path / "typo"), "--json"])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "does not exist" in captured.err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # It benchmarked anyway, and the redis row read "0 cached" after a logged warning.
        (["--remote-url", "redis://127.0.0.1:1/0"], "unreachable"),
        # These three were tracebacks (the last two after loading the model).
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--disk-cache-dir", "FILE"], "is a file"),
    ],
)
def test_bench_that_cannot_run_is_one_line_and_exit_2(argv, said, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = [str(afile) if a == "FILE" else a for a in argv]
    args = parse(["cache", "bench", "--model", "/nonexistent/model", *argv])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvboost cache bench: ") and said in err and "\n" not in err


def test_status_counts_the_hits_of_a_reader_that_never_stores(redis_server):  # noqa: F811
    # Hit/miss counts rode along with the next store only: a process that only restored (a replica,
    # `kvboost cache bench`'s restore runs) closed with its hits unsent, and status showed 0 hits.
    writer = RedisTier(redis_server.url, namespace=FINGERPRINT)
    entries = chain(2)
    for e in entries:
        writer.put(e.key, record(e))
    writer.close()
    reader = RedisTier(redis_server.url, namespace=FINGERPRINT)
    assert all(reader.get_many([e.key for e in entries]))
    assert reader.get(b"\x00" * 32) is None
    reader.close()
    _, [ns] = redis_status(redis_server.url)
    assert (ns.stats.hits, ns.stats.misses, ns.stats.stores) == (2, 1, 2)
