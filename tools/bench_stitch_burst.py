"""A burst of RAG prompts on a cold engine: held stitched requests (core/deferred.py) against planning each
prompt when it is added.

Four prompts (system prompt, 4 of 8 pydoc topics in a seeded order, a question; tools/bench_rag_server.py's
workload) go to ``KVBoost.generate_batch`` at once on an empty engine with ``StitchConfig()``
(``--chunk-size 32``). Planned when added, none can stitch from another (nothing is stored yet), so every
document is prefilled by every prompt that has it; held, a prompt whose documents an earlier one is
computing waits for that prompt and stitches them. Per mode, medians over ``--runs`` runs (modes alternate):
wall time of the batch, mean TTFT, prompt tokens served from cache, tokens recomputed by seam repair.
SmolLM2-135M fp32, CPU, one torch thread. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from unittest import mock

import torch
from bench_rag_server import QUESTIONS, SYSTEM, documents, rag_message

from kvb_cache.chat import render_chat


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    docs = documents()
    out = []
    for _ in range(count):
        chosen = rng.sample(docs, 4)
        question = rng.choice(QUESTIONS).format(title=rng.choice(chosen)[0])
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": rag_message(chosen, question)},
        ]
        out.append(render_chat(tokenizer, messages))
    return out


def run(model, tokenizer, ids: list[list[int]], *, hold: bool, new_tokens: int) -> dict:
    from kvb_cache import EngineConfig, KVBoost, StitchConfig

    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32, stitching=StitchConfig()))
    patch = mock.patch("kvb_cache.loop_api.stitch_sources", return_value=frozenset())
    with contextlib.nullcontext() if hold else patch:
        t0 = time.perf_counter()
        results = engine.generate_batch(ids, max_new_tokens=new_tokens, ignore_eos=True)
        wall = time.perf_counter() - t0
    prompt_tokens = sum(r.prompt_tokens for r in results)
    return {
        "wall_s": wall,
        "mean_ttft_s": statistics.mean(r.ttft_ms for r in results) / 1e3,
        "served": sum(r.cached_tokens for r in results) / prompt_tokens,
        "recomputed": sum(r.recomputed_tokens for r in results) / prompt_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvb_cache.embedded import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = prompts(tokenizer, args.prompts, args.seed)
    rows: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.runs):
        for hold in (False, True):
            rows[hold].append(run(model, tokenizer, ids, hold=hold, new_tokens=args.new_tokens))
    print(
        f"\n{args.prompts} prompts of {statistics.mean(len(i) for i in ids):.0f} tokens, medians of {args.runs} runs"
    )
    print("| planning | batch wall | mean TTFT | prompt served from cache | recomputed |")
    print("|---|---|---|---|---|")
    for hold, label in ((False, "each prompt when added (before)"), (True, "held until sources computed")):
        med = {k: statistics.median(r[k] for r in rows[hold]) for k in rows[hold][0]}
        print(
            f"| {label} | {med['wall_s']:.2f} s | {med['mean_ttft_s']:.2f} s | {med['served']:.0%} | "
            f"{med['recomputed']:.0%} |"
        )


if __name__ == "__main__":
    main()
