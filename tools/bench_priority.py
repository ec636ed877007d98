"""What ``--scheduling-policy priority`` buys an urgent request on a busy engine (SmolLM2, CPU).

A backlog of low-priority requests (a batch job) fills the engine: ``--backlog`` requests queued at once,
at most ``--max-num-seqs`` running. Every ``--every`` steps an urgent request arrives (priority -1 under
the priority policy; the same request, unranked, under FCFS). For each policy the engine loop is driven step
by step, and each request's time to first token (arrival to its first output) is recorded, in steps and in
seconds. Same prompts, same tokens (greedy), same run.

    python tools/bench_priority.py [--out docs/priority_bench.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvb_cache import EngineConfig, KVBoost, SamplingParams
from kvb_cache.embedded import embedded_model_path
from kvb_cache.loading import load_model_and_tokenizer


def _prompts(tokenizer, count: int, seed: int, words: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    text = " ".join(topics.values()).split()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - words, (count,), generator=g).tolist()
    return [tokenizer(" ".join(text[s : s + words]))["input_ids"] for s in starts]


def run(policy: str, loaded, args) -> dict:
    engine = KVBoost(
        loaded.model,
        loaded.tokenizer,
        config=EngineConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.step_tokens, scheduling_policy=policy
        ),
    )
    backlog = _prompts(loaded.tokenizer, args.backlog, 1, args.words)
    urgent = _prompts(loaded.tokenizer, args.urgent, 2, args.words // 4)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    arrived: dict[str, tuple[int, float]] = {}
    first: dict[str, tuple[int, float]] = {}
    for i, ids in enumerate(backlog):
        engine.add_request(ids, params, request_id=f"bulk-{i}", priority=0)
        arrived[f"bulk-{i}"] = (0, time.perf_counter())
    step = 0
    pending = list(enumerate(urgent))
    while engine.has_unfinished() or pending:
        if pending and step >= (pending[0][0] + 1) * args.every:
            i, ids = pending.pop(0)
            rid = f"urgent-{i}"
            engine.add_request(ids, params, request_id=rid, priority=-1 if policy == "priority" else 0)
            arrived[rid] = (step, time.perf_counter())
        for out in engine.step():
            if out.request_id not in first:
                first[out.request_id] = (step, time.perf_counter())
        step += 1

    def ttft(kind: str) -> dict:
        rids = [r for r in arrived if r.startswith(kind)]
        steps = [first[r][0] - arrived[r][0] for r in rids]
        secs = [first[r][1] - arrived[r][1] for r in rids]
        return {
            "requests": len(rids),
            "ttft_steps_median": statistics.median(steps),
            "ttft_steps_max": max(steps),
            "ttft_s_median": round(statistics.median(secs), 3),
            "ttft_s_max": round(max(secs), 3),
        }

    return {"policy": policy, "steps": step, "urgent": ttft("urgent"), "bulk": ttft("bulk")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=16)
    parser.add_argument("--urgent", type=int, default=4)
    parser.add_argument("--every", type=int, default=12, help="steps between urgent arrivals")
    parser.add_argument("--words", type=int, default=160, help="words per backlog prompt (urgent: a quarter)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--step-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model_and_tokenizer(embedded_model_path(), device="cpu", dtype="float32")
    rows = [run(policy, loaded, args) for policy in ("fcfs", "priority")]
    print(
        "| policy | urgent TTFT median (steps / s) | urgent TTFT max (steps / s) | backlog TTFT median (s) | steps |"
    )
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        u, b = r["urgent"], r["bulk"]
        print(
            f"| {r['policy']} | {u['ttft_steps_median']} / {u['ttft_s_median']} | {u['ttft_steps_max']} / "
            f"{u['ttft_s_max']} | {b['ttft_s_median']} | {r['steps']} |"
        )
    if args.out is not None:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
