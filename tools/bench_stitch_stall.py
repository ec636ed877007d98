"""How long a running request stalls when a stitched (non-prefix reuse) request arrives (#16).

A short chat request decodes; after its 8th token a 1.7k-token pydoc RAG prompt arrives whose documents
were cached in other orders (two warm-up prompts), so it stitches and repairs ~15% of its positions
(``StitchConfig()`` default). We record the running request's inter-token gaps and the arrival's TTFT for:

- ``cold``: the same prompt on an engine without stitching (an ordinary chunked prefill);
- ``stitched, one go``: the whole repair runs when the request is added (kvb-cache before #16's sliced
  preparation; emulated with an unbounded preparation budget);
- ``stitched, sliced``: the repair runs in slices that share each step's ``max_num_batched_tokens``.

SmolLM2-135M-Instruct fp32, CPU, one torch thread; medians over ``--repeats`` runs. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from eval_fidelity import CACHE_BYTES, WARMUP_QUESTIONS, prompt, pydoc_groups, qa_item, test_prompt
from stall_probe import gaps_around_arrival
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvb_cache import EngineConfig, KVBoost, SamplingParams, StitchConfig
from kvb_cache.embedded import embedded_model_path

MODES = ("cold", "stitched, one go", "stitched, sliced")


def run_once(model, tokenizer, mode: str, budget: int, group) -> dict[str, float]:
    docs = [d for d, _ in group]
    order = [*range(1, len(docs), 2), *range(0, len(docs), 2)]
    snippet, _ = qa_item(group[order[1]][1])
    ids = tokenizer(test_prompt(docs, order, snippet))["input_ids"]
    stitching = None if mode == "cold" else StitchConfig()
    engine = KVBoost(
        model,
        tokenizer,
        config=EngineConfig(
            chunk_size=32, stitching=stitching, max_cache_bytes=CACHE_BYTES, max_num_batched_tokens=budget
        ),
    )
    if mode == "stitched, one go":
        engine.core.preparing.budget = 10**9
    for i, question in enumerate(WARMUP_QUESTIONS):
        warm_order = list(range(len(docs))) if i == 0 else list(reversed(range(len(docs))))
        engine.next_token_logits(tokenizer(prompt(docs, warm_order, question))["input_ids"])
    gaps = gaps_around_arrival(
        engine, lambda: engine.add_request(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
    )
    return {
        "max_gap": gaps["max_gap"],
        "median_gap_before": gaps["median_gap_before"],
        "ttft": gaps["ttft"],
        "prompt_tokens": len(ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budgets", type=int, nargs="*", default=[256, 1024], help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group", type=int, default=0, help="pydoc group index")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    group = pydoc_groups(tokenizer, args.group + 1, 400)[args.group]
    print(
        "| max_num_batched_tokens | arrival | running request: max gap after arrival | its median gap before "
        "| arrival TTFT |"
    )
    print("|---|---|---|---|---|")
    for budget in args.budgets:
        for mode in MODES:
            runs = [run_once(model, tokenizer, mode, budget, group) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(
                f"| {budget} | {mode} ({med['prompt_tokens']:.0f} tokens) | {med['max_gap'] * 1e3:.0f} ms "
                f"| {med['median_gap_before'] * 1e3:.0f} ms | {med['ttft']:.2f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
