"""How long a running request stalls while an echoed prompt is scored (``echo`` + ``logprobs``, lm-eval).

A short chat request decodes; after its 8th token a long pydoc prompt arrives to be scored (what lm-eval's
``local-completions`` loglikelihood requests ask for). The loop is the server worker's: one engine-thread
call, then one ``step()``. We record the running request's inter-token gaps and the scoring's latency for:

- ``one go``: the whole prompt scored in one call (``KVBoost.prompt_logprobs``; the server before
  ``PromptScoring``);
- ``sliced``: one ``prefill_chunk_size`` slice per call (``KVBoost.prompt_scorer``; the server now).

SmolLM2-135M-Instruct fp32, CPU, one torch thread; medians over ``--repeats`` runs. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from eval_fidelity import pydoc_groups
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvb_cache import EngineConfig, KVBoost, SamplingParams
from kvb_cache.embedded import embedded_model_path

MODES = ("one go", "sliced")


def run_once(engine: KVBoost, ids: list[int], mode: str) -> dict[str, float]:
    engine.clear_cache()
    chat = engine.chat_prompt([{"role": "user", "content": "Write a short poem about the sea."}])
    running = engine.add_request(chat, SamplingParams(max_new_tokens=400, ignore_eos=True))
    stamps: list[float] = []
    scorer, arrived_at, latency = None, 0.0, None
    while True:
        if len(stamps) == 8 and not arrived_at:  # the scoring request's call on the worker
            arrived_at = time.perf_counter()
            if mode == "one go":
                engine.prompt_logprobs(ids, top_logprobs=1)
                latency = time.perf_counter() - arrived_at
            else:
                scorer = engine.prompt_scorer(ids, top_logprobs=1)
        if scorer is not None and latency is None and scorer.advance():
            latency = time.perf_counter() - arrived_at
        for out in engine.step():  # then the worker's step
            if out.request_id == running:
                stamps.append(time.perf_counter())
        if latency is not None:
            break
    engine.abort(running)
    before = [b - a for a, b in itertools.pairwise(stamps[:8])]
    after = [b - a for a, b in itertools.pairwise(stamps[7:])]
    return {
        "max_gap": max(after),
        "median_gap_before": statistics.median(before),
        "latency": latency,
        "prompt_tokens": len(ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slices", type=int, nargs="*", default=[128, 256], help="prefill_chunk_size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--documents", type=int, default=4, help="pydoc topics of 400 tokens in the prompt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    group = pydoc_groups(tokenizer, 1, 400)[0][: args.documents]
    ids = tokenizer("\n\n".join(doc for doc, _ in group))["input_ids"]
    print(
        "| prefill_chunk_size | scoring | running request: max gap after arrival | its median gap before "
        "| scoring latency |"
    )
    print("|---|---|---|---|---|")
    for size in args.slices:
        engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32, prefill_chunk_size=size))
        for mode in MODES:
            runs = [run_once(engine, ids, mode) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(
                f"| {size} | {mode} ({med['prompt_tokens']:.0f} tokens) | {med['max_gap'] * 1e3:.0f} ms "
                f"| {med['median_gap_before'] * 1e3:.0f} ms | {med['latency']:.2f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
