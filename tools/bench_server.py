"""Benchmark kvb-server on the embedded SmolLM2: concurrent chat sessions sharing a system prompt.

Every number is measured by the official ``openai`` client against real ``kvboost-server`` processes
started by this script on loopback, all in the same run:

1. TTFT per turn (client-side: request sent -> first streamed content token) and throughput, for the
   same load on the same server with the KV cache on and off (``--max-cache-bytes 0``).
2. Throughput of non-streamed requests from N concurrent clients with batching (``--max-batch-size N``)
   against one-at-a-time (``--max-batch-size 1``).

Conversations are real (chitchat-dataset); the shared system prompt embeds a real document (Python's
``pydoc_data.topics``). Greedy decoding, so every configuration sees the same conversation.
Results: a table on stdout, ``docs/server_bench.json`` and ``docs/server_ttft.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(*flags: str) -> Iterator[str]:
    """A ``python -m kvb_server`` process on a free loopback port (one torch thread, as all benchmarks)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvb_server", "--port", str(port), "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        # Generous: on a shared, oversubscribed CPU importing torch and loading the model takes minutes.
        deadline = time.monotonic() + 1800
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start in 1800 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def system_prompt(chars: int) -> str:
    from pydoc_data.topics import topics

    doc = topics["with"] + topics["try"]
    return ("You are a helpful assistant for Python programmers. Answer using this reference.\n\n"
            + doc[:chars])


def user_turns(sessions: int, turns: int) -> list[list[str]]:
    """The first user messages of ``sessions`` real chit-chat conversations (one message group per turn)."""
    import chitchat_dataset

    out = []
    for convo in chitchat_dataset.Dataset().values():
        groups = [" ".join(m["text"] for m in group) for group in convo["messages"]]
        if len(groups) >= 2 * turns:
            out.append(groups[0::2][:turns])
        if len(out) == sessions:
            return out
    raise RuntimeError("not enough long conversations")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def chat_sessions(url: str, system: str, turns: list[list[str]], max_tokens: int) -> dict:
    """All sessions at once; each sends its turns one after another, streaming, keeping its history."""
    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64))
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", http_client=http, max_retries=0)
    ttft: dict[int, list[float]] = {}
    cached: dict[int, list[int]] = {}
    tokens = 0

    async def session(user_msgs: list[str]) -> None:
        nonlocal tokens
        history = [{"role": "system", "content": system}]
        for turn, text in enumerate(user_msgs, start=1):
            history.append({"role": "user", "content": text})
            t0 = time.perf_counter()
            first = None
            reply = []
            stream = await api.chat.completions.create(
                model=MODEL, messages=history, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    reply.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
                    cached.setdefault(turn, []).append(chunk.usage.prompt_tokens_details.cached_tokens)
            ttft.setdefault(turn, []).append(((first or time.perf_counter()) - t0) * 1e3)
            history.append({"role": "assistant", "content": "".join(reply)})

    t0 = time.perf_counter()
    await asyncio.gather(*(session(m) for m in turns))
    wall = time.perf_counter() - t0
    await api.close()
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_ms_by_turn": {t: {"p50": statistics.median(v), "p95": pct(v, 0.95), "n": len(v)}
                            for t, v in sorted(ttft.items())},
        "cached_tokens_by_turn": {t: statistics.median(v) for t, v in sorted(cached.items())},
        "ttft_ms_turn3plus": {"p50": statistics.median([x for t, v in ttft.items() if t >= 3 for x in v]),
                              "p95": pct([x for t, v in ttft.items() if t >= 3 for x in v], 0.95)},
    }


async def concurrent_throughput(url: str, system: str, prompts: list[str], clients: int, requests: int,
                                max_tokens: int) -> dict:
    """``clients`` clients each sending ``requests`` non-streamed chat requests back to back."""
    http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64))
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", http_client=http, max_retries=0)
    # One identical request first, so both configurations start with the system prompt cached.
    await api.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "hello"}])
    tokens = 0
    latencies: list[float] = []

    async def client(i: int) -> None:
        nonlocal tokens
        for r in range(requests):
            t0 = time.perf_counter()
            resp = await api.chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0, messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": prompts[(i * requests + r) % len(prompts)]}])
            latencies.append((time.perf_counter() - t0) * 1e3)
            tokens += resp.usage.completion_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    stats = (await http.get(f"{url}/v1/stats")).json()["queue"]
    await api.close()
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_ms_p50": statistics.median(latencies), "largest_batch": stats["largest_batch"],
            "batched_calls": stats["batched_calls"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, key in (("cache on", "cache_on"), ("cache off", "cache_off")):
        by_turn = results["sessions"][key]["ttft_ms_by_turn"]
        turns = [int(t) for t in by_turn]
        ax.plot(turns, [by_turn[t]["p50"] for t in by_turn], marker="o", label=f"{label} (p50)")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("kvb-server, SmolLM2-135M, concurrent chat sessions (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=4, help="concurrent chat sessions")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--max-tokens", type=int, default=16, help="reply length per turn")
    p.add_argument("--system-chars", type=int, default=3000, help="characters of the shared system prompt")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients for the batching comparison")
    p.add_argument("--requests", type=int, default=2, help="requests per client for the batching comparison")
    p.add_argument("--batch-tokens", type=int, default=32, help="reply length for the batching comparison")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "server_bench.json")
    args = p.parse_args()

    system = system_prompt(args.system_chars)
    turns = user_turns(args.sessions, args.turns)
    prompts = [t for conv in user_turns(args.clients * args.requests, 1) for t in conv]
    results: dict = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
                     "config": vars(args) | {"out": str(args.out)}, "sessions": {}, "batching": {}}
    for key, flags in (("cache_on", ()), ("cache_off", ("--max-cache-bytes", "0"))):
        with server(*flags) as url:
            results["sessions"][key] = asyncio.run(chat_sessions(url, system, turns, args.max_tokens))
    for key, size in (("batched", args.clients), ("one_at_a_time", 1)):
        with server("--max-batch-size", str(size), "--batch-window-ms", "10") as url:
            results["batching"][key] = asyncio.run(concurrent_throughput(
                url, system, prompts, args.clients, args.requests, args.batch_tokens))

    on, off = results["sessions"]["cache_on"], results["sessions"]["cache_off"]
    b, one = results["batching"]["batched"], results["batching"]["one_at_a_time"]
    results["ratios"] = {
        "ttft_p50_turn3plus_on_over_off": on["ttft_ms_turn3plus"]["p50"] / off["ttft_ms_turn3plus"]["p50"],
        "session_throughput_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
        "batched_over_one_at_a_time": b["tokens_per_s"] / one["tokens_per_s"],
    }
    print(f"\n{args.sessions} concurrent chat sessions x {args.turns} turns, shared system prompt, "
          f"{args.max_tokens} tokens/turn")
    print(f"{'turn':>4} | {'TTFT p50 on':>12} | {'p95 on':>8} | {'p50 off':>8} | {'p95 off':>8} | {'cached tok':>10}")
    for t in on["ttft_ms_by_turn"]:
        a, c = on["ttft_ms_by_turn"][t], off["ttft_ms_by_turn"][t]
        print(f"{t:>4} | {a['p50']:>10.0f}ms | {a['p95']:>6.0f}ms | {c['p50']:>6.0f}ms | {c['p95']:>6.0f}ms | "
              f"{on['cached_tokens_by_turn'][t]:>10.0f}")
    print(f"throughput: cache on {on['tokens_per_s']:.2f} tok/s, off {off['tokens_per_s']:.2f} tok/s")
    print(f"batching, {args.clients} clients x {args.requests} requests x {args.batch_tokens} tokens: "
          f"batched {b['tokens_per_s']:.2f} tok/s (largest batch {b['largest_batch']}), "
          f"one at a time {one['tokens_per_s']:.2f} tok/s")
    print("ratios:", json.dumps({k: round(v, 3) for k, v in results["ratios"].items()}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.out.with_name("server_ttft.png"))
    print(f"wrote {args.out} and {args.out.with_name('server_ttft.png')}")


if __name__ == "__main__":
    main()
