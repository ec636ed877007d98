"""Measured, not built: repair a stitched request exactly at its first near-tie?

The remaining teacher-forced top-1 misses of the default strategy are near-ties (docs/fidelity.md). A request
could watch its own greedy margin: at the first step whose *warm* top-2 logit gap is below ``tau``, drop its
stitched KV and recompute the prompt exactly (what a preempted stitched request does), so every later
position equals no-cache. This tool measures what that would buy and cost on ``tools/eval_fidelity.py``'s
prompts (same documents, warm-ups with idle time, test orders; the default ``StitchConfig()``): per prompt,
the warm and no-cache margins, top-1 agreement and KL at each of the 32 teacher-forced positions; then, per
``tau``, top-1 and KL with the positions from the first near-tie on taken as exact, and how many prompts
would be recomputed within the 32 tokens (at the first token: the TTFT pays a cold prefill too).

    python tools/eval_tie_repair.py --pydoc 0 1 2 --humaneval 0 1 --rows rows.jsonl
    python tools/eval_tie_repair.py --from-rows rows.jsonl      # the table again, no model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_fidelity as ef

NEW_TOKENS = 32
TAUS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)


def measure(model, tokenizer, groups, rows_path: Path | None) -> list[dict]:
    from kvb_cache import EngineConfig, KVBoost, StitchConfig
    from kvb_cache.fidelity import reference_continuation_logits, teacher_forced_logits

    rows = []
    for source, index, group in groups:
        warmups, text, _ = ef.group_prompts(group)
        ids = tokenizer(text)["input_ids"]
        cold = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32))
        continuation = cold.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True).output_ids
        reference = reference_continuation_logits(model, ids, continuation).float()
        engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32, stitching=StitchConfig()))
        for warmup in warmups:
            engine.next_token_logits(tokenizer(warmup)["input_ids"])
            engine.run_idle()
        warm = teacher_forced_logits(engine, ids, continuation).logits.float()
        kl = torch.nn.functional.kl_div(
            warm.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none"
        ).sum(-1)
        top2, ref_top2 = warm.topk(2, dim=-1).values, reference.topk(2, dim=-1).values
        row = {
            "source": source,
            "group": index,
            "warm_margin": (top2[:, 0] - top2[:, 1]).tolist(),
            "cold_margin": (ref_top2[:, 0] - ref_top2[:, 1]).tolist(),
            "agree": (warm.argmax(-1) == reference.argmax(-1)).tolist(),
            "kl": kl.tolist(),
        }
        rows.append(row)
        if rows_path is not None:
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        print(f"{source} {index}: top-1 {sum(row['agree'])}/{NEW_TOKENS}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"{len(rows)} prompts x {NEW_TOKENS} teacher-forced positions",
        "",
        "| tau (warm top-2 gap) | TF top-1 | TF mean KL | prompts recomputed within 32 tokens | of them at the first token |",
        "|---|---|---|---|---|",
    ]
    for tau in TAUS:
        agree = kl = repaired = first = 0
        for r in rows:
            j = next((i for i, m in enumerate(r["warm_margin"]) if m < tau), NEW_TOKENS)
            agree += sum(r["agree"][:j]) + NEW_TOKENS - j
            kl += sum(r["kl"][:j])
            repaired += j < NEW_TOKENS
            first += j == 0
        n = NEW_TOKENS * len(rows)
        label = "0 (today)" if tau == 0 else f"{tau:g}"
        lines.append(f"| {label} | {agree / n:.1%} | {kl / n:.4f} | {repaired} | {first} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ef.add_group_args(parser)
    parser.add_argument("--rows", type=Path, default=None, help="append each prompt's row here (JSON lines)")
    parser.add_argument("--from-rows", type=Path, nargs="*", default=[], help="print the table of saved rows")
    args = parser.parse_args()
    if args.from_rows:
        rows = [json.loads(line) for path in args.from_rows for line in path.read_text().splitlines()]
    else:
        torch.set_num_threads(1)
        model, tokenizer = ef.load_smollm2()
        rows = measure(model, tokenizer, ef.chosen_groups(tokenizer, args), args.rows)
    print(table(rows))


if __name__ == "__main__":
    main()
