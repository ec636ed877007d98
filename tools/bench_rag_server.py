"""RAG serving benchmark: stitched reuse in kvboost-server against ``transformers serve --continuous-batching``.

Chat users of a RAG service send the same few documents again and again, in another order and after
another question each time. A prefix cache (the peer's block sharing, kvboost's default) reuses only the
system prompt before the first document; kvboost with stitching on also reuses the documents it has seen
elsewhere (docs/fidelity.md). Four servers, one after the other, same model (the embedded
SmolLM2-135M-Instruct), same torch thread count:

- ``kvboost``: exact prefix reuse only (the server's defaults);
- ``kvboost-stitch``: ``--recompute-strategy selective --chunk-size 32`` (the measured default repair;
  between requests the worker computes stitched prompts exactly, ``StitchConfig.idle_copies``);
- ``kvboost-stitch-noidle``: the same with ``--idle-copies 1`` (no idle work: what idle work costs a
  request that arrives while it runs, and what it buys);
- ``transformers``: ``transformers serve --continuous-batching`` (paged attention, prefix-block sharing).

Workload: 8 pydoc topics (``pydoc_data.topics``) of ~300 tokens; each request is a system prompt, 4 of the
8 documents in a seeded random order under their titles, and a question about one of them (~1400 tokens),
sent by the official ``openai`` client, streamed, greedy, ``--max-tokens`` tokens. Per concurrency level,
that many users at once, each sending ``--requests`` requests one after the other; the same requests for
every server, levels in the same order (so each server's cache holds the same history). Reported per
server and level: TTFT p50/p90 (request sent -> first streamed token), the share of prompt tokens the
server says it served from cache (``usage.prompt_tokens_details.cached_tokens``), and per request whether
the reply equals the exact kvboost server's (greedy: stitched reuse is approximate, so it may differ).

Results: a markdown table on stdout, ``docs/rag_server_bench.json`` and ``docs/rag_server_ttft.png``.
``--quick`` is a smoke run (1 level of 2 users x 2 requests) under the temp folder.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from chat_load import client, one_turn, warm_up
from server_procs import (
    TRANSFORMERS_VERSION,
    ServerSpec,
    ensure_transformers_venv,
    kvboost_spec,
    running,
    save_results,
    transformers_spec,
)

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a helpful assistant. Answer from the documents the user gives you, briefly."
SERVERS = ("kvboost", "kvboost-stitch", "kvboost-stitch-noidle", "transformers")
QUESTIONS = (
    "In one sentence, what is the document titled {title!r} about?",
    "Quote the first sentence of the document titled {title!r}.",
    "Which Python statement or feature does the document titled {title!r} describe?",
)


def documents(count: int = 8, chars: int = 1200) -> list[tuple[str, str]]:
    """``count`` (title, text) pairs: long pydoc topics cut at a sentence end near ``chars`` characters."""
    import pydoc_data.topics

    out = []
    for title, text in sorted(pydoc_data.topics.topics.items()):
        text = " ".join(text.split())
        if len(text) < 2 * chars:
            continue
        cut = text.rfind(". ", 0, chars)
        out.append((title, text[: cut + 1 if cut > chars // 2 else chars]))
        if len(out) == count:
            return out
    raise RuntimeError(f"pydoc_data.topics has fewer than {count} long topics")


def rag_message(docs: list[tuple[str, str]], question: str) -> str:
    body = "\n\n".join(f"## {title}\n{text}" for title, text in docs)
    return f"{body}\n\nQuestion: {question}"


def workload(levels: list[int], requests: int, docs: list[tuple[str, str]], seed: int) -> dict[int, list]:
    """Per level: one list of user messages per user (seeded; the same for every server)."""
    rng = random.Random(seed)
    out: dict[int, list[list[str]]] = {}
    for users in levels:
        out[users] = []
        for _ in range(users):
            mine = []
            for _ in range(requests):
                chosen = rng.sample(docs, 4)
                title = rng.choice(chosen)[0]
                mine.append(rag_message(chosen, rng.choice(QUESTIONS).format(title=title)))
            out[users].append(mine)
    return out


async def run_level(url: str, model: str, users: list[list[str]], max_tokens: int, timeout_s: float) -> dict:
    """Every user at once; each sends its requests one after the other (a new conversation each)."""
    api = client(url, timeout_s)
    records = []

    async def user(index: int, messages: list[str]) -> None:
        for turn, text in enumerate(messages, start=1):
            history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
            records.append(await one_turn(api, model, history, max_tokens, session=index, turn=turn))

    t0 = time.perf_counter()
    await asyncio.gather(*(user(i, m) for i, m in enumerate(users)))
    wall = time.perf_counter() - t0
    await api.close()
    ordered = sorted(records, key=lambda r: (r.session, r.turn))
    return {"wall_s": wall, "requests": [r.to_dict() for r in ordered]}


def serve(spec: ServerSpec, work: dict[int, list], args: argparse.Namespace, log_dir: Path) -> dict:
    out: dict = {"argv": list(spec.argv), "levels": {}}
    try:
        with running(spec, threads=args.threads, log_dir=log_dir, startup_timeout_s=900) as srv:
            out["startup_s"] = srv.startup_s
            out["warmup_s"] = asyncio.run(warm_up(srv.url, spec.model_field, args.request_timeout))
            for users, messages in work.items():
                t0 = time.monotonic()
                out["levels"][users] = asyncio.run(
                    run_level(srv.url, spec.model_field, messages, args.max_tokens, args.request_timeout)
                )
                print(f"  {spec.name}: {users} users done in {time.monotonic() - t0:.0f} s", flush=True)
    except Exception as exc:  # one server failing must not lose the others' numbers
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  {spec.name}: FAILED: {out['error'][:2000]}", flush=True)
    return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: dict) -> list[dict]:
    """One row per server and level; replies compared with the exact kvboost server's, request by request."""
    rows = []
    exact = results["servers"].get("kvboost", {}).get("levels", {})
    for name, server in results["servers"].items():
        for users, level in server.get("levels", {}).items():
            reqs = [r for r in level["requests"] if not r["error"]]
            ttft = [r["ttft_ms"] for r in reqs]
            cached = [r["cached_tokens"] / r["prompt_tokens"] for r in reqs if r["cached_tokens"] is not None]
            same = None
            if users in exact and name != "kvboost":
                ref = {(r["session"], r["turn"]): r["reply"] for r in exact[users]["requests"]}
                pairs = [r["reply"] == ref.get((r["session"], r["turn"])) for r in reqs]
                same = sum(pairs) / len(pairs) if pairs else None
            rows.append(
                {
                    "server": name,
                    "users": users,
                    "requests": len(reqs),
                    "errors": len(level["requests"]) - len(reqs),
                    "ttft_p50_ms": _quantile(ttft, 0.5),
                    "ttft_p90_ms": _quantile(ttft, 0.9),
                    "ttft_mean_after_first_ms": statistics.mean([r["ttft_ms"] for r in reqs if r["turn"] > 1])
                    if any(r["turn"] > 1 for r in reqs)
                    else None,
                    "cached_share": statistics.mean(cached) if cached else None,
                    "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] or 0 for r in reqs)
                    if reqs
                    else None,
                    "same_reply_as_kvboost_exact": same,
                    "wall_s": level["wall_s"],
                }
            )
    return rows


def report(rows: list[dict]) -> None:
    def f(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    peer = {r["users"]: r for r in rows if r["server"] == "transformers"}
    print(
        "\n| server | users | requests | TTFT p50 | TTFT p90 | p50 vs transformers | cached share | "
        "reply = exact kvboost |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = peer.get(r["users"])
        ratio = (
            r["ttft_p50_ms"] / base["ttft_p50_ms"]
            if base and base["ttft_p50_ms"] and r["ttft_p50_ms"] is not None
            else None
        )
        print(
            f"| {r['server']} | {r['users']} | {r['requests']} | {f(r['ttft_p50_ms'], '.0f')} ms | "
            f"{f(r['ttft_p90_ms'], '.0f')} ms | {f(ratio, '.2f')}x | {f(r['cached_share'], '.0%')} | "
            f"{f(r['same_reply_as_kvboost_exact'], '.0%')} |"
        )


def plot(results: dict, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = results["summary"]
    levels = sorted({r["users"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(SERVERS)
    for i, name in enumerate(SERVERS):
        values = [
            next((r["ttft_p50_ms"] or 0 for r in rows if r["server"] == name and r["users"] == u), 0) / 1e3
            for u in levels
        ]
        ax.bar([x + i * width for x in range(len(levels))], values, width, label=name)
    ax.set_xticks(
        [x + width for x in range(len(levels))], [f"{u} user{'s' if u > 1 else ''}" for u in levels]
    )
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("RAG prompts (4 of 8 documents, reordered), SmolLM2-135M, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--users", type=int, nargs="+", default=[1, 4], help="concurrency levels (users at once)")
    p.add_argument("--requests", type=int, default=4, help="requests per user and level")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per reply")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server (OMP_NUM_THREADS)")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peer-cb-memory", type=float, default=0.3, help="transformers serve --cb-max-memory-percent"
    )
    p.add_argument("--request-timeout", type=float, default=600, help="seconds one request may take")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 users x 2 requests, output under /tmp")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default docs/rag_server_bench.json)")
    args = p.parse_args()
    if args.quick:
        args.users, args.requests = [2], 2
    out = args.out or (
        Path(tempfile.gettempdir()) / "kvboost-bench" / "rag_server_bench.json"
        if args.quick
        else ROOT / "docs" / "rag_server_bench.json"
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    t_start = time.monotonic()

    from kvb_cache.embedded import cache_root, embedded_model_path

    model_path = embedded_model_path()
    exact = kvboost_spec(model_path)
    specs = {
        "kvboost": exact,
        "kvboost-stitch": dataclasses.replace(
            exact,
            name="kvboost-stitch",
            argv=(*exact.argv, "--recompute-strategy", "selective", "--chunk-size", "32"),
        ),
    }
    specs["kvboost-stitch-noidle"] = dataclasses.replace(
        specs["kvboost-stitch"],
        name="kvboost-stitch-noidle",
        argv=(*specs["kvboost-stitch"].argv, "--idle-copies", "1"),
    )
    if "transformers" in args.servers:
        venv = ensure_transformers_venv(
            cache_root() / "bench-venvs" / f"transformers-{TRANSFORMERS_VERSION[:4]}"
        )
        specs["transformers"] = transformers_spec(venv, model_path, cb_max_memory_percent=args.peer_cb_memory)
    docs = documents()
    work = workload(args.users, args.requests, docs, args.seed)
    results: dict = {
        "config": vars(args) | {"out": str(out), "model_path": model_path, "documents": [t for t, _ in docs]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "servers": {},
    }
    for name in args.servers:
        print(f"{name} server ...", flush=True)
        results["servers"][name] = serve(specs[name], work, args, out.parent / "logs")
    results["summary"] = summarize(results)
    results["elapsed_s"] = time.monotonic() - t_start
    report(results["summary"])
    save_results(results, out, plot, "rag_server_ttft.png")


if __name__ == "__main__":
    main()
