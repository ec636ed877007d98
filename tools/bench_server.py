"""Serving benchmark: kvboost-server against ``transformers serve --continuous-batching``, same run, same model.

Both servers load the embedded SmolLM2-135M-Instruct from the same safetensors folder, get the same torch
thread count (``OMP_NUM_THREADS``, ``--threads``) and run one after the other, never together. The official
``openai`` client drives each with 1, 4 and 8 concurrent streamed multi-turn chat sessions (real
chitchat-dataset conversations behind a shared ~3000-character system prompt from ``pydoc_data.topics``),
greedy, 24 tokens per turn. Per server and concurrency: TTFT p50/p90 from turn 2 on (request sent -> first
streamed content token), generated tokens/s (completion tokens / wall time of the phase), per-request
decode tokens/s, and whether the two servers' replies are identical.

Library phase, in this process with ``torch.set_num_threads(1)``: ``KVBoost.generate_batch`` against
transformers' ``model.generate_batch`` on 32 prompts sharing a ~800-token system prompt, 32 greedy tokens
each; tokens/s and whether every row equals plain ``model.generate`` greedy.

Results: markdown tables on stdout, ``docs/server_bench.json`` (every request's raw numbers, summary,
environment, targets) and ``docs/server_ttft.png``. ``--quick`` is a smoke run of the same plumbing (1 and
2 sessions, 2 turns, 4 library prompts) that writes under the temp folder instead of docs/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# tools/ is on sys.path when a script here runs: the helper modules beside this one
from chat_load import conversations, reference_document, run_sessions, short_questions, system_prompt, warm_up
from server_procs import (
    TRANSFORMERS_VERSION,
    ServerSpec,
    ensure_transformers_venv,
    kvboost_spec,
    running,
    save_results,
    torch_threads_seen,
    transformers_spec,
    versions,
)
from server_report import SERVERS, analyze, plot, report

ROOT = Path(__file__).resolve().parent.parent


def serve_phases(
    spec: ServerSpec,
    workloads: dict[int, list[list[str]]],
    system: str,
    args: argparse.Namespace,
    log_dir: Path,
) -> dict:
    """Start one server, warm it, run every concurrency level on it, stop it."""
    out: dict = {"phases": {}}
    try:
        with running(
            spec, threads=args.threads, log_dir=log_dir, startup_timeout_s=args.startup_timeout
        ) as srv:
            out |= {"startup_s": srv.startup_s, "log": str(srv.log)}
            out["warmup_s"] = asyncio.run(warm_up(srv.url, spec.model_field, args.request_timeout))
            for c, sessions in workloads.items():
                t0 = time.monotonic()
                phase = asyncio.run(
                    run_sessions(
                        srv.url,
                        spec.model_field,
                        system,
                        sessions,
                        max_tokens=args.max_tokens,
                        request_timeout_s=args.request_timeout,
                        phase_timeout_s=args.phase_timeout,
                    )
                )
                out["phases"][c] = {
                    "wall_s": phase.wall_s,
                    "timed_out": phase.timed_out,
                    "requests": [r.to_dict() for r in phase.records],
                }
                print(f"  {spec.name}: {c} sessions done in {time.monotonic() - t0:.0f} s", flush=True)
    except Exception as exc:  # one server failing must not lose the other's numbers
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  {spec.name}: FAILED: {out['error'][:2000]}", flush=True)
    return out


def environment(args: argparse.Namespace, venv: Path, specs: dict[str, ServerSpec]) -> dict:
    def git(*cmd: str) -> str:
        try:  # a copied tree (a GPU machine's) may have no git
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # run from the source tree (PYTHONPATH)
            return "source tree"

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty_paths": len(git("status", "--porcelain").splitlines()),
        "kvboost_env": versions(sys.executable) | {d: version(d) for d in ("kvb-cache", "kvb-server")},
        "transformers_venv": {"path": str(venv), **versions(specs["transformers"].python)},
        "server_threads_env": {"OMP_NUM_THREADS": args.threads, "MKL_NUM_THREADS": args.threads},
        "server_torch_threads_seen": {
            name: torch_threads_seen(s.python, args.threads) for name, s in specs.items()
        },
        "library_torch_threads": 1,
        "server_argv": {name: list(s.argv) for name, s in specs.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--sessions", type=int, nargs="+", default=[1, 4, 8], help="concurrency levels (sessions at once)"
    )
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per turn")
    p.add_argument("--system-chars", type=int, default=3000, help="characters of the shared system prompt")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server (OMP_NUM_THREADS)")
    p.add_argument(
        "--servers",
        nargs="*",
        choices=SERVERS,
        default=list(SERVERS),
        help="servers to run (none: library phase only)",
    )
    p.add_argument(
        "--library-prompts", type=int, default=32, help="prompts of the library phase (0: skip it)"
    )
    p.add_argument(
        "--library-system-tokens", type=int, default=800, help="shared system prompt tokens (library)"
    )
    p.add_argument(
        "--peer-cb-memory",
        type=float,
        default=0.3,
        help="transformers serve --cb-max-memory-percent, and the same cap for the library phase's "
        "model.generate_batch (its default, 0.6-0.9 of free memory, got it OOM-killed)",
    )
    p.add_argument("--library-new-tokens", type=int, default=32, help="greedy tokens per prompt (library)")
    p.add_argument("--request-timeout", type=float, default=300, help="seconds one request may take")
    p.add_argument("--phase-timeout", type=float, default=1800, help="seconds one concurrency level may take")
    p.add_argument(
        "--startup-timeout", type=float, default=900, help="seconds a server may take to answer /health"
    )
    p.add_argument(
        "--transformers-venv",
        type=Path,
        default=None,
        help=f"venv for transformers serve (default: <kvboost cache>/bench-venvs/transformers-{TRANSFORMERS_VERSION[:4]})",
    )
    p.add_argument(
        "--peer-venv",
        type=Path,
        default=None,
        help="an existing environment with transformers[serving] (its bin/transformers), used as it is: "
        "no version check, nothing installed (a GPU machine's image)",
    )
    p.add_argument("--device", default="cpu", help="both servers' device (cuda on a GPU machine)")
    p.add_argument("--dtype", default=None, help="both servers' dtype (unset: each server's default)")
    p.add_argument(
        "--model-path", default=None, help="model folder for both servers (default: the embedded SmolLM2)"
    )
    p.add_argument(
        "--kvboost-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more kvboost-server flag, repeatable (--kvboost-flag=--enforce-eager, "
        "--kvboost-flag=--max-num-seqs=64)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 and 2 sessions, 2 turns, 4 library prompts, output under the temp folder",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default docs/server_bench.json; the plot goes beside it as server_ttft.png)",
    )
    args = p.parse_args()
    if args.quick:
        args.sessions, args.turns, args.library_prompts = [1, 2], 2, 4
    out = args.out or (
        Path(tempfile.gettempdir()) / "kvboost-bench" / "server_bench.json"
        if args.quick
        else ROOT / "docs" / "server_bench.json"
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    t_start = time.monotonic()

    from kvb_cache.embedded import cache_root, embedded_model_path

    model_path = args.model_path or embedded_model_path()
    venv = args.peer_venv or ensure_transformers_venv(
        args.transformers_venv or cache_root() / "bench-venvs" / f"transformers-{TRANSFORMERS_VERSION[:4]}"
    )
    specs = {
        "kvboost": kvboost_spec(
            model_path, device=args.device, dtype=args.dtype, extra=tuple(args.kvboost_flag)
        ),
        "transformers": transformers_spec(
            venv, model_path, cb_max_memory_percent=args.peer_cb_memory, device=args.device, dtype=args.dtype
        ),
    }
    system = system_prompt(args.system_chars)
    workloads, used = {}, 0
    for c in args.sessions:  # disjoint conversations per level, the same ones for both servers
        workloads[c] = conversations(c, args.turns, skip=used)
        used += c
    results: dict = {
        "config": vars(args) | {"out": str(out), "transformers_venv": str(venv), "model_path": model_path},
        "environment": environment(args, venv, specs),
        "servers": {},
    }
    for name in args.servers:
        print(f"{name} server ...", flush=True)
        results["servers"][name] = serve_phases(specs[name], workloads, system, args, out.parent / "logs")
    if args.library_prompts:
        print("library phase ...", flush=True)
        try:
            from library_batch import run_library_phase

            results["library"] = run_library_phase(
                model_path=model_path,
                document=reference_document(),
                questions=short_questions(args.library_prompts),
                system_tokens=args.library_system_tokens,
                max_new_tokens=args.library_new_tokens,
                cb_max_memory_percent=args.peer_cb_memory,
            )
        except Exception as exc:  # keep the server numbers when the library phase breaks
            results["library"] = {"error": f"{type(exc).__name__}: {exc}"}

    analyze(results, args.sessions)
    results["elapsed_s"] = time.monotonic() - t_start
    report(results)
    save_results(results, out, plot, "server_ttft.png")


if __name__ == "__main__":
    main()
