"""``kvboost cache status`` and ``kvboost cache bench``: argparse subcommands the kvboost CLI mounts.

Wire it with ``add_cache_commands(subparsers)``; each subcommand sets ``func`` (call ``args.func(args)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvb_cache.tiers.base import TierStats

#: URL schemes redis-py accepts (``TierConfig`` checks the same).
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (``--lengths -5`` tokenized every pydoc topic and prefilled them all,
    ``--repeats 0`` crashed on an empty median, ``--threads 0`` inside torch)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def redis_url(text: str) -> str:
    """argparse type: a URL redis-py can open (anything else crashed with a traceback from redis-py, as
    did ``redis://host:notaport/0``: redis-py's own parse raised ValueError when the tier was opened)."""
    if not text.startswith(_REDIS_SCHEMES):
        raise argparse.ArgumentTypeError(f"must look like redis://host:6379/0, got {text!r}")
    try:
        from redis.connection import parse_url
    except ImportError:  # the tier itself says redis-py is missing
        return text
    try:
        parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} in {text!r}; expected redis://host:6379/0") from None
    return text


def add_cache_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``cache`` with ``status`` and ``bench`` under ``subparsers``; returns the ``cache`` parser."""
    cache = subparsers.add_parser("cache", help="inspect and benchmark the KV cache tiers (disk, Redis)")
    sub = cache.add_subparsers(dest="cache_command", required=True)

    status = sub.add_parser(
        "status", help="entries, bytes and hit rates per tier and model; Redis round trip"
    )
    status.add_argument(
        "--disk-cache-dir", help="disk tier folder to inspect (one sub-folder per model fingerprint)"
    )
    status.add_argument(
        "--remote-url", type=redis_url, help="Redis to inspect, e.g. redis://127.0.0.1:6379/0"
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=run_status)

    bench = sub.add_parser("bench", help="cold prefill vs restoring the prefix from RAM, disk and Redis")
    bench.add_argument("--model", default="smollm2-135m", help="model folder or 'smollm2-135m' (embedded)")
    bench.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[512, 2048], help="prompt lengths in tokens"
    )
    bench.add_argument(
        "--remote-url", type=redis_url, help="also restore from this Redis (redis://host:port/db)"
    )
    bench.add_argument("--disk-cache-dir", help="disk tier folder (default: a temporary folder)")
    bench.add_argument("--kv-cache-bits", type=int, default=16, choices=[16, 8, 4], help="codec of stored KV")
    bench.add_argument(
        "--repeats", type=positive_int, default=3, help="runs per cell (the median is reported)"
    )
    bench.add_argument(
        "--threads", type=positive_int, default=1, help="torch CPU threads (1 gives stable timings)"
    )
    bench.set_defaults(func=run_bench)
    return cache


def _row(tier: str, namespace: str, s: TierStats) -> str:
    unknown = "?"
    entries = unknown if s.entries is None else str(s.entries)
    size = unknown if s.bytes is None else f"{s.bytes / 2**20:.1f}"
    return f"{tier:<6} {namespace:<34} {entries:>8} {size:>10} {s.hits:>8} {s.misses:>8} {s.hit_rate:>7.1%} {s.corrupt:>7}"


def run_status(args: argparse.Namespace) -> int:
    from kvb_cache.tiers.status import disk_status, redis_status

    if not args.disk_cache_dir and not args.remote_url:
        print("nothing to inspect: pass --disk-cache-dir and/or --remote-url", file=sys.stderr)
        return 2
    rows, report = [], {}
    if args.disk_cache_dir:
        if not Path(args.disk_cache_dir).exists():
            # A typo listed nothing and exited 0, as if the folder were an empty cache.
            print(
                f"kvboost cache status: --disk-cache-dir {args.disk_cache_dir!r} does not exist",
                file=sys.stderr,
            )
            return 2
        try:
            found = disk_status(args.disk_cache_dir)
        except NotADirectoryError as exc:
            print(f"kvboost cache status: {exc}", file=sys.stderr)
            return 2
        rows += found
        report["disk"] = {
            "dir": str(args.disk_cache_dir),
            "namespaces": {n.namespace: n.stats.as_dict() for n in found},
        }
    if args.remote_url:
        reach, found = redis_status(args.remote_url)
        rows += found
        report["redis"] = {
            "url": reach.url,
            "reachable": reach.reachable,
            "round_trip_ms": reach.round_trip_ms,
            "error": reach.error,
            "namespaces": {n.namespace: n.stats.as_dict() for n in found},
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("RAM is per process: see the server's /v1/stats or KVBoost.cache_stats().")
    if "redis" in report:
        r = report["redis"]
        rtt = f"{r['round_trip_ms']:.2f} ms round trip" if r["reachable"] else f"UNREACHABLE ({r['error']})"
        print(f"redis {r['url']}: {rtt}")
    print(
        f"{'tier':<6} {'namespace (model fingerprint)':<34} {'entries':>8} {'MiB':>10} {'hits':>8} {'misses':>8} {'hit rate':>7} {'corrupt':>7}"
    )
    for n in rows:
        print(_row(n.tier, n.namespace, n.stats))
    return 0


def _bench_precheck(args: argparse.Namespace) -> str | None:
    """What makes ``bench`` unable to run, found before the model loads (None when nothing does)."""
    if args.disk_cache_dir and Path(args.disk_cache_dir).exists() and not Path(args.disk_cache_dir).is_dir():
        return f"--disk-cache-dir {args.disk_cache_dir!r} is a file; pass a folder (created if missing)"
    if args.remote_url:
        from kvb_cache.tiers.remote import RedisTier, redact_url

        probe = RedisTier(args.remote_url, namespace="probe", timeout_s=2.0)
        try:
            reachable = probe.ping_ms() is not None
        finally:
            probe.close()
        if not reachable:
            # It benchmarked anyway: the tier logged a warning and the redis row read "0 cached, 0.9x".
            return (
                f"Redis at {redact_url(args.remote_url)} is unreachable (PING within 2 s: {probe.ping_error})"
            )
    return None


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from kvb_cache.errors import KVBoostError
    from kvb_cache.loading import load_model_and_tokenizer
    from kvb_cache.tiers.bench import bench_restore, format_table
    from kvb_cache.tiers.text import benchmark_token_ids

    problem = _bench_precheck(args)
    if problem is not None:
        print(f"kvboost cache bench: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        loaded = load_model_and_tokenizer(args.model, device="cpu", dtype=None, attn_implementation=None)
        ids = benchmark_token_ids(loaded.tokenizer, max(args.lengths) + 1)
        rows = bench_restore(
            loaded.model,
            loaded.tokenizer,
            ids,
            lengths=args.lengths,
            remote_url=args.remote_url,
            disk_cache_dir=args.disk_cache_dir,
            kv_cache_bits=args.kv_cache_bits,
            repeats=args.repeats,
        )
    except KVBoostError as exc:
        # An unknown --model, a --lengths beyond the model's context: one line, not a traceback.
        print(f"kvboost cache bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return 0
