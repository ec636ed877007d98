"""Which stitched tokens to recompute, at matched budgets: an ablation of the ``selective`` position rule.

``tools/eval_fidelity.py`` compares the shipped strategies; this tool swaps only the rule that picks the
recomputed positions of each stitched run (``kvb_cache.stitching.selective_positions``) and measures the
teacher-forced mean KL and top-1 agreement of each rule on the same pydoc RAG prompts (same warm-ups, same
test prompt, same cache state), with the recomputed share, so rules can be compared at equal budgets:

- ``seam-kN``: the first N tokens of each run (the shipped rule);
- ``ratio-P``: the first P% of each run (at least 16): longer documents get more;
- ``seam32+tailN``: 32 seam tokens plus the last N stitched tokens before the uncached suffix (recency: the
  question attends its neighbourhood most);
- ``seam32+stride``: 32 seam tokens plus 32 of every 128 further tokens (spread over the run);
- ``seam64+quoted (oracle)``: 64 seam tokens plus every stitched token of the document the quote comes from
  (known here, not to the engine): how much a query-aware selection could at best buy.

Model: the embedded SmolLM2-135M-Instruct, fp32, CPU, one thread. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from eval_fidelity import CACHE_BYTES, SYSTEM, WARMUP_QUESTIONS, prompt, pydoc_groups, qa_item, test_prompt
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvb_cache.stitching as stitching
from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.embedded import embedded_model_path
from kvb_cache.fidelity import compare_distributions, reference_continuation_logits, teacher_forced_logits

Runs = Sequence[tuple[int, int]]
Rule = Callable[[Runs], set[int]]


def seam(k: int) -> Rule:
    return lambda runs: {p for a, b in runs for p in range(a, min(b, a + k))}


def ratio(share: float, minimum: int = 16) -> Rule:
    return lambda runs: {
        p for a, b in runs for p in range(a, min(b, a + max(minimum, round(share * (b - a)))))
    }


def seam_and_tail(k: int, tail: int) -> Rule:
    def rule(runs: Runs) -> set[int]:
        end = runs[-1][1]
        return seam(k)(runs) | {p for a, b in runs for p in range(max(a, end - tail), b)}

    return rule


def seam_and_stride(k: int, every: int, width: int) -> Rule:
    def rule(runs: Runs) -> set[int]:
        chosen = seam(k)(runs)
        for a, b in runs:
            for q in range(a + k, b, every):
                chosen.update(range(q, min(b, q + width)))
        return chosen

    return rule


#: Prompt positions ``[start, end)`` of the quoted document in the current test prompt (the oracle's input).
QUOTED: list[range] = [range(0)]


def seam_and_quoted(k: int) -> Rule:
    return lambda runs: seam(k)(runs) | {p for a, b in runs for p in range(a, b) if p in QUOTED[0]}


RULES: dict[str, Rule] = {
    "none": lambda runs: set(),
    "seam-k32": seam(32),
    "seam-k64": seam(64),
    "seam-k128": seam(128),
    "ratio-15": ratio(0.15),
    "ratio-30": ratio(0.30),
    "seam32+tail96": seam_and_tail(32, 96),
    "seam32+tail192": seam_and_tail(32, 192),
    "seam32+stride": seam_and_stride(32, 128, 32),
    "seam64+quoted (oracle)": seam_and_quoted(64),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, nargs="*", default=[0, 3, 6], help="pydoc group indices")
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    current: dict[str, Rule] = {}
    # NOTE: swapping the module's rule is this ablation's whole point; the engine has no public hook for it
    # (the shipped rules are StitchConfig strategies), and the sink tokens are an exact prefix here.
    stitching.selective_positions = lambda runs, **_: sorted(current["rule"](runs))  # type: ignore[assignment]
    groups = pydoc_groups(tokenizer, max(args.groups) + 1, 400)
    results: dict[str, list[dict]] = {name: [] for name in RULES}
    for index in args.groups:
        group = groups[index]
        docs = [d for d, _ in group]
        order = [*range(1, len(docs), 2), *range(0, len(docs), 2)]
        snippet, _ = qa_item(group[order[1]][1])
        ids = tokenizer(test_prompt(docs, order, snippet))["input_ids"]
        before = SYSTEM + docs[order[0]]  # the text ahead of the quoted document
        start = len(tokenizer(before)["input_ids"])
        QUOTED[0] = range(start, start + len(tokenizer(docs[order[1]])["input_ids"]))
        config = EngineConfig(chunk_size=args.chunk_size, max_cache_bytes=CACHE_BYTES)
        cold = KVBoost(model, tokenizer, config=config).generate(
            ids, max_new_tokens=args.new_tokens, ignore_eos=True
        )
        reference = reference_continuation_logits(model, ids, cold.output_ids)
        engine = KVBoost(
            model,
            tokenizer,
            config=EngineConfig(
                chunk_size=args.chunk_size, stitching=StitchConfig(), max_cache_bytes=CACHE_BYTES
            ),
        )
        current["rule"] = seam(64)
        for i, question in enumerate(WARMUP_QUESTIONS):
            warm_order = list(range(len(docs))) if i == 0 else list(reversed(range(len(docs))))
            engine.next_token_logits(tokenizer(prompt(docs, warm_order, question))["input_ids"])
        engine.next_token_logits(ids)
        for name, rule in RULES.items():
            current["rule"] = rule
            t0 = time.thread_time()
            forced = teacher_forced_logits(engine, ids, cold.output_ids)
            seconds = time.thread_time() - t0
            agreement = compare_distributions(reference, forced.logits)
            results[name].append(
                {
                    "kl": agreement.mean_kl,
                    "top1": agreement.top1_agreement,
                    "recomputed": forced.recomputed_tokens / len(ids),
                    "cpu_s": seconds,
                }
            )
        print(f"group {index} done", flush=True)
    print("| rule | prompts | recomputed | TF top-1 | TF mean KL | CPU s (prepare + forced pass) |")
    print("|---|---|---|---|---|---|")
    for name, rows in results.items():
        print(
            f"| {name} | {len(rows)} | {statistics.mean(r['recomputed'] for r in rows):.0%} "
            f"| {statistics.mean(r['top1'] for r in rows):.1%} | {statistics.mean(r['kl'] for r in rows):.4f} "
            f"| {statistics.mean(r['cpu_s'] for r in rows):.2f} |"
        )


if __name__ == "__main__":
    main()
