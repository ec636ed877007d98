"""Benchmark: concurrent greedy requests through the engine loop, with and without speculative decoding.

Drives ``KVBoost.add_request`` / ``step`` as the server's worker does, in one process, round-robin over four
modes per repeat:

- ``plain``: no drafter (every request in the batched loop);
- ``solo``: prompt lookup, every request speculating solo (the routing before 2026-11-25, forced here by
  hiding the other requests from the admission check and the batched step's drafter);
- ``fixed``: prompt lookup routed as from 2026-11-25 to 2026-11-30 (only a request that arrives alone
  speculates, solo; the others decode in the batch without drafts);
- ``step``: prompt lookup verified inside the batched step (the engine's routing now: every greedy request
  drafts, its drafts ride in the packed forward beside the others', verified by argmax).

Two prompt sets: "repeat this pydoc topic" (prompt lookup drafts well) and chitchat_dataset conversations.
Reports wall seconds and process CPU seconds per run (on a shared machine CPU time is the steadier clock),
and checks that every mode's tokens equal plain greedy's (exit 1 otherwise).

Usage: ``python tools/bench_speculative_concurrency.py [--threads N] [--repeats 3] [--new-tokens 48]``
(needs kvboost, kvb-speculative, the embedded SmolLM2 and chitchat_dataset).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pydoc_data.topics
import statistics
import sys
import time

import chitchat_dataset
import torch

from kvb_cache import SamplingParams
from kvb_speculative import make_decoder
from kvboost import KVBoost

MODES = ("plain", "solo", "fixed", "step")
TOPICS = ("while", "for", "if", "try", "with", "assert", "return", "pass")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8, help="concurrent requests (at most 8)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="sample (unseeded; outputs then differ by mode)"
    )
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine = KVBoost.from_pretrained("smollm2-135m", dtype="float32", device="cpu", max_cache_bytes=0)
    decoder = make_decoder(engine.model, speculative="prompt_lookup", gamma=5)
    topics = pydoc_data.topics.topics
    convs = [list(c) for c in itertools.islice(chitchat_dataset.ConversationDataset(), 8)]
    sets = {
        "quote": [
            engine.chat_prompt(
                [{"role": "user", "content": "Repeat the following text exactly.\n\n" + topics[k][:700]}]
            )
            for k in TOPICS
        ],
        "chat": [
            engine.chat_prompt(
                [{"role": "user" if i % 2 == 0 else "assistant", "content": m} for i, m in enumerate(c[:5])]
            )
            for c in convs
        ],
    }

    def add(prompt: list[int], mode: str) -> str:
        if mode == "solo":  # NOTE: the admission check sees no other request: every request speculates
            engine.core.has_unfinished = lambda: False
        try:
            return engine.add_request(
                prompt,
                # Sampled runs generate every token (ignore_eos): their texts differ, their lengths must not.
                SamplingParams(
                    max_new_tokens=args.new_tokens,
                    temperature=args.temperature,
                    ignore_eos=bool(args.temperature),
                ),
            )
        finally:
            engine.core.__dict__.pop("has_unfinished", None)

    def run(prompts: list[list[int]], mode: str) -> tuple[float, float, list[list[int]]]:
        engine.drafter = None if mode == "plain" else decoder
        engine.core.drafter = decoder if mode == "step" else None
        wall, cpu = time.perf_counter(), time.process_time()
        ids = [add(p, mode) for p in prompts]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.result is not None:
                    done[out.request_id] = out.result.output_ids
        return time.perf_counter() - wall, time.process_time() - cpu, [done[i] for i in ids]

    sets = {name: prompts[: args.batch] for name, prompts in sets.items()}
    run(sets["chat"][:2], "plain")
    run(sets["chat"][:2], "solo")  # warm up
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {s: {m: [] for m in args.modes} for s in sets}
    identical = True
    for r in range(args.repeats):
        for name, prompts in sets.items():
            outs = {}
            for mode in args.modes:
                wall, cpu, outs[mode] = run(prompts, mode)
                runs[name][mode].append((wall, cpu))
            if not args.temperature:
                identical &= all(outs[m] == outs[args.modes[0]] for m in args.modes)
            row = {m: f"{v[-1][0]:.2f}s wall {v[-1][1]:.2f}s cpu" for m, v in runs[name].items()}
            print(r, name, row, flush=True)
    summary = {
        name: {
            mode: {
                "wall_median_s": statistics.median(w for w, _ in v),
                "cpu_median_s": statistics.median(c for _, c in v),
            }
            for mode, v in by_mode.items()
        }
        for name, by_mode in runs.items()
    }
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "batch": args.batch,
                "identical": identical,
                "medians": summary,
            },
            indent=1,
        )
    )
    print(f"\n| prompts ({args.batch}) | " + " | ".join(f"{m} cpu / wall (s)" for m in args.modes) + " |")
    print("|---|" + "---:|" * len(args.modes))
    for name, by_mode in summary.items():
        cells = " | ".join(f"{v['cpu_median_s']:.2f} / {v['wall_median_s']:.2f}" for v in by_mode.values())
        print(f"| {name} | {cells} |")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
