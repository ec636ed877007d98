"""Where stitched reuse flips the teacher-forced top-1 token: the no-cache margin there.

For some of ``tools/eval_fidelity.py``'s prompts (same documents, warm-ups and test orders), the default
``StitchConfig()`` with idle time after each warm-up (``--idle`` there), and per flipped position of the
32-token continuation the gap between no-cache's top two logits. Small gaps mean the flips are near-ties
(docs/fidelity.md, "Against the #16 targets").

    python tools/eval_flip_margins.py --pydoc 1 5 8 9 --humaneval 0 5
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_fidelity as ef

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.fidelity import reference_continuation_logits, teacher_forced_logits

NEW_TOKENS = 32


def flip_margins(model, tokenizer, group: list[tuple[str, str]]) -> list[float]:
    """The no-cache top-2 logit gaps at the flipped positions of one group's test prompt."""
    warmups, text, _ = ef.group_prompts(group)
    ids = tokenizer(text)["input_ids"]
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
    model, tokenizer, groups = ef.follow_up_setup(__doc__)
    print("| set | group | flips | no-cache top-2 gap at each flip |\n|---|---|---|---|")
    for source, index, group in groups:
        margins = flip_margins(model, tokenizer, group)
        gaps = ", ".join(f"{m:.3f}" for m in sorted(margins)) or "-"
        print(f"| {source} | {index} | {len(margins)} | {gaps} |", flush=True)


if __name__ == "__main__":
    main()
