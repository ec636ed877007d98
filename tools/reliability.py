"""Reliability harness of issue 13: fuzz, load and faults against real ``kvboost-server`` processes.

Loopback only, bounded in time and request count; every server and ``redis-server`` is started here on a
free port and stopped by its PID. Parts (``--parts``, default all):

- ``schemathesis``: ``schemathesis run`` over the server's ``/openapi.json`` (all checks, examples,
  coverage, fuzzing and stateful phases), bounded by ``--st-max-time`` and ``--st-max-examples``. Needs the
  schemathesis CLI, kept out of the project's environment: ``python -m venv /tmp/st-venv &&
  /tmp/st-venv/bin/pip install 'schemathesis>=4,<5'`` and pass ``--schemathesis /tmp/st-venv/bin/schemathesis``.
- ``fuzz``: the hand-written body fuzzer (tools/reliability_fuzz.py).
- ``load``: ``--clients`` concurrent clients for ``--seconds`` (after a warm-up of the same load), 10%
  leaving mid-stream; RSS after warm-up vs after the run, the block pool after the run.
- ``faults``: Redis outage, corrupted disk and Redis records, kill -9 during disk writes, disk full.
- ``races``: ``/v1/warm`` while completions run (a bug schemathesis found with 2 workers).

Every part uses the embedded SmolLM2-135M on CPU with small ``max_tokens``. Writes ``docs/reliability.json``
(merged with what is there, part by part) and prints it; docs/reliability.md holds the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_faults import (
    corrupted_disk_record,
    corrupted_redis_record,
    disk_full,
    kill9_during_disk_writes,
    redis_outage,
    warm_during_requests,
)
from reliability_fuzz import run_fuzz
from reliability_load import run_load
from reliability_procs import Server

DOCS = Path(__file__).resolve().parent.parent / "docs"
FUZZ_FLAGS = ("--max-tokens", "4", "--request-timeout", "120")


def part_schemathesis(args: argparse.Namespace, log_dir: Path) -> dict:
    server = Server(flags=FUZZ_FLAGS, log_dir=log_dir, name="schemathesis").start()
    report_dir = Path(tempfile.mkdtemp(prefix="kvb-st-"))
    cmd = [
        args.schemathesis, "run", server.url + "/openapi.json",
        "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", str(args.st_max_examples), "--max-time", str(args.st_max_time),
        "--seed", str(args.seed), "--generation-database", "none", "--no-color",
        "--workers", str(args.st_workers), "--request-timeout", "120",
        "--report", "junit", "--report-dir", str(report_dir),
    ]  # fmt: skip
    try:
        version = subprocess.run(
            [args.schemathesis, "--version"], capture_output=True, text=True
        ).stdout.strip()
        t0 = time.monotonic()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.st_max_time + 600)
        wall = time.monotonic() - t0
        alive = server.alive()
    finally:
        server.stop()
    out = run.stdout
    (log_dir / "schemathesis.txt").write_text(out + run.stderr)
    summary = out[out.rfind("SUMMARY") :] if "SUMMARY" in out else out[-4000:]
    server_log = server.log.read_text(errors="replace")
    return {
        "version": version,
        "command": " ".join(["schemathesis", *cmd[1:2], "<url>/openapi.json", *cmd[3:]]).replace(
            str(report_dir), "<dir>"
        ),
        "exit_code": run.returncode,
        "wall_s": round(wall, 1),
        "summary": summary.strip(),
        "server_alive_after": alive,
        "server_log_errors": [line for line in server_log.splitlines() if "ERROR" in line][:20],
        "server_flags": list(FUZZ_FLAGS),
    }


def part_fuzz(args: argparse.Namespace, log_dir: Path) -> dict:
    server = Server(flags=FUZZ_FLAGS, log_dir=log_dir, name="fuzz").start()
    try:
        t0 = time.monotonic()
        report = run_fuzz(
            server.port, seed=args.seed, random_cases=args.fuzz_cases, max_seconds=args.fuzz_max_s
        )
        wall = time.monotonic() - t0
        alive = server.alive()
    finally:
        server.stop()
    return {
        **report.as_dict(),
        "wall_s": round(wall, 1),
        "server_alive_after": alive,
        "server_flags": list(FUZZ_FLAGS),
    }


def part_load(args: argparse.Namespace, log_dir: Path) -> dict:
    flags = ("--max-tokens", str(args.max_tokens), "--max-num-seqs", str(args.max_num_seqs))
    server = Server(flags=flags, log_dir=log_dir, name="load").start()
    try:
        rss_start = server.rss_mb()
        warm = run_load(server.url, clients=args.clients, seconds=args.warmup_s, seed=args.seed + 1,
                        max_tokens=args.max_tokens)  # fmt: skip
        server.wait_idle()
        rss_warm = server.rss_mb()
        report = run_load(server.url, clients=args.clients, seconds=args.seconds, seed=args.seed,
                          max_tokens=args.max_tokens)  # fmt: skip
        stats = server.wait_idle()
        rss_after = server.rss_mb()
        alive = server.alive()
    finally:
        server.stop()
    paged, queue = stats["paged"], stats["queue"]
    return {
        "server_flags": list(flags),
        "max_tokens_per_request": args.max_tokens,
        "warmup": {"seconds": args.warmup_s, "completed": warm.completed, "failed": warm.failed},
        "run": report.as_dict(),
        "rss_mb": {
            "start": round(rss_start, 1),
            "after_warmup": round(rss_warm, 1),
            "after_run": round(rss_after, 1),
            "ratio_after_run_to_after_warmup": round(rss_after / rss_warm, 4),
        },
        "after_run": {
            "blocks_used": paged["blocks_used"],
            "running": paged["running"],
            "waiting": paged["waiting"],
            "blocks_cached": paged["blocks_cached"],
            "blocks_total": paged["blocks_total"],
            "queue": queue,
        },
        "server_alive_after": alive,
    }


def part_faults(args: argparse.Namespace, log_dir: Path) -> dict:
    results = {}
    for name, fn in (
        ("redis_outage", redis_outage),
        ("corrupted_disk_record", corrupted_disk_record),
        ("corrupted_redis_record", corrupted_redis_record),
        ("kill9_during_disk_writes", kill9_during_disk_writes),
        ("disk_full", disk_full),
    ):
        t0 = time.monotonic()
        try:
            results[name] = fn(log_dir)
        except Exception as exc:  # one broken fault run must not hide the others' figures
            results[name] = {"harness_error": f"{type(exc).__name__}: {exc}"}
        results[name]["wall_s"] = round(time.monotonic() - t0, 1)
        print(name, json.dumps(results[name]), flush=True)
    return results


def part_races(args: argparse.Namespace, log_dir: Path) -> dict:
    return {"warm_during_requests": warm_during_requests(log_dir)}


PARTS = {
    "schemathesis": part_schemathesis,
    "fuzz": part_fuzz,
    "load": part_load,
    "faults": part_faults,
    "races": part_races,
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--parts", default="fuzz,schemathesis,load,faults,races", help="comma-separated: " + ", ".join(PARTS)
    )
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--schemathesis", default="/tmp/st-venv/bin/schemathesis", help="the schemathesis CLI")
    p.add_argument(
        "--st-max-examples", type=int, default=30, help="schemathesis cases per operation and phase"
    )
    p.add_argument("--st-max-time", type=int, default=420, help="schemathesis time budget (s)")
    p.add_argument("--st-workers", type=int, default=1, help="schemathesis concurrent workers")
    p.add_argument("--fuzz-cases", type=int, default=400, help="random bodies on top of the fixed cases")
    p.add_argument("--fuzz-max-s", type=float, default=600, help="fuzzer time budget (s)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--warmup-s", type=float, default=20)
    p.add_argument(
        "--max-tokens", type=int, default=8, help="max_tokens of every load request (and the server cap)"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvb-reliability")
    p.add_argument("--out", type=Path, default=DOCS / "reliability.json")
    args = p.parse_args()

    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data["environment"] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": __import__("os").cpu_count(),
        "model": "smollm2-135m (embedded SmolLM2-135M-Instruct, fp32, CPU)",
    }
    for name in args.parts.split(","):
        t0 = time.monotonic()
        data[name] = PARTS[name](args, args.log_dir)
        data[name]["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        print(f"== {name} ({time.monotonic() - t0:.0f} s)\n{json.dumps(data[name], indent=1)}", flush=True)
        args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
