"""RAG replay with stitching: what the store options cost and buy over a stream of requests.

A corpus of pydoc topics; each request is the system prompt, a random subset of the documents in a random
order, and a question, so documents keep arriving next to other documents, often first seen in a request
that already stitches others. One engine per variant replays the same requests (``StitchConfig`` defaults
otherwise): ``default``; ``keep_approximate`` (a stitched request's KV from its first stitched position on
kept as approximate chunks); ``collect_copies=2`` (a document stored once is computed again on its second
sighting and kept, so later requests average two copies: ``average_copies``); both; and ``idle`` (the
default, given idle time after each request: ``KVBoost.run_idle`` computes the stitched prompts whose
documents were held once, ``idle_copies``), alone and with ``keep_approximate``. Per request,
through the teacher-forced path: served tokens (exact + stitched), recomputed share, and top-1 agreement
and mean KL against no-cache over the request's own 16-token greedy continuation; each request then runs
once through the engine loop, which stores its chunks as a served request would.

    python tools/eval_stitch_replay.py [--docs 8] [--per-request 4] [--requests 16] [--out docs]
        [--variants idle ...] [--merge docs/fidelity_replay.json]
        [--doc-tokens 300] [--chunk-sizes 32] [--name fidelity_replay]

Writes ``<name>.json`` under ``--out`` and prints a markdown table; ``--merge`` first loads the variants of
an earlier run of the same requests (rows are deterministic) and keeps those not rerun. ``--chunk-sizes
16 32 64 128`` runs each variant at each ``chunk_size`` (a document is stitched only in whole chunks, so
the size decides how much of a short document can be reused; ``--doc-tokens`` sets the documents' length).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_fidelity import SYSTEM, pydoc_groups

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.embedded import embedded_model_path
from kvb_cache.fidelity import (
    compare_distributions,
    reference_continuation_logits,
    teacher_forced_logits,
)

NEW_TOKENS = 16
CACHE_BYTES = 512 << 20


def requests(
    tokenizer, n_docs: int, per_request: int, n_requests: int, seed: int, doc_tokens: int = 300
) -> list[list[int]]:
    docs = [d for group in pydoc_groups(tokenizer, (n_docs + 3) // 4, doc_tokens) for d, _ in group][:n_docs]
    rng = random.Random(seed)
    out = []
    for q in range(n_requests):
        order = rng.sample(range(n_docs), per_request)
        text = (
            SYSTEM
            + "".join(docs[i] for i in order)
            + f"Question {q}: which document is the most technical?\nAnswer:"
        )
        out.append(tokenizer(text)["input_ids"])
    return out


#: name -> (stitching, whether the engine gets idle time after each request)
VARIANTS = {
    "default": (StitchConfig(), False),
    "keep_approximate": (StitchConfig(keep_approximate=True), False),
    "collect_copies=2": (StitchConfig(collect_copies=2), False),
    "keep_approximate + collect_copies=2": (StitchConfig(keep_approximate=True, collect_copies=2), False),
    "idle": (StitchConfig(), True),
    "keep_approximate + idle": (StitchConfig(keep_approximate=True), True),
}


def replay(
    model, tokenizer, prompts, references, stitching: StitchConfig, idle: bool, chunk_size: int = 32
) -> list[dict]:
    engine = KVBoost(
        model,
        tokenizer,
        config=EngineConfig(chunk_size=chunk_size, stitching=stitching, max_cache_bytes=CACHE_BYTES),
    )
    rows = []
    for ids, (continuation, reference) in zip(prompts, references):
        started = time.thread_time()
        forced = teacher_forced_logits(engine, ids, continuation)
        forced_s = time.thread_time() - started
        agreement = compare_distributions(reference, forced.logits)
        engine.generate(ids, max_new_tokens=1)  # served once: its chunks are stored as a request's would be
        before = engine.idle_stats()["computed_tokens"]
        if idle:
            engine.run_idle()  # the gap before the next request: a server's worker runs it when idle
        rows.append(
            {
                "prompt_tokens": len(ids),
                "served": forced.cached_tokens / len(ids),
                "recomputed": forced.recomputed_tokens / len(ids),
                # the prompt's prefill work: its uncached tokens plus the stitched ones recomputed
                "work": 1 - forced.cached_tokens / len(ids) + forced.recomputed_tokens / len(ids),
                "tf_top1": agreement.top1_agreement,
                "tf_mean_kl": agreement.mean_kl,
                # tokens computed in the idle time after this request, as a share of its prompt
                "idle_work": (engine.idle_stats()["computed_tokens"] - before) / len(ids),
                # CPU seconds of the teacher-forced pass: preparation (lookup, repair) + one forward
                "forced_cpu_s": forced_s,
            }
        )
    return rows


def summary(rows: list[dict], skip: int) -> dict:
    def mean(key, part):
        return statistics.mean(r[key] for r in part)

    tail = rows[skip:]
    return {
        key: {"all": mean(key, rows), "after_warmup": mean(key, tail)}
        for key in ("served", "recomputed", "work", "tf_top1", "tf_mean_kl", "idle_work", "forced_cpu_s")
        if all(key in r for r in rows)
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--per-request", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4, help="requests left out of the 'after warm-up' means")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    p.add_argument("--merge", type=Path, help="an earlier fidelity_replay.json of the same requests")
    p.add_argument("--doc-tokens", type=int, default=300, help="tokens per document")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[32], help="chunk_size values to replay")
    p.add_argument("--name", default="fidelity_replay", help="output file stem under --out")
    args = p.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = requests(tokenizer, args.docs, args.per_request, args.requests, args.seed, args.doc_tokens)
    references = []
    for ids in prompts:
        cold = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32, max_cache_bytes=CACHE_BYTES))
        out = cold.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True).output_ids
        references.append((out, reference_continuation_logits(model, ids, out)))
    results = {}
    if args.merge is not None:
        earlier = json.loads(args.merge.read_text())
        same = ("docs", "per_request", "requests", "warmup", "seed", "doc_tokens")
        if any(earlier["config"].get(k, 300) != getattr(args, k) for k in same):
            raise SystemExit(f"--merge {args.merge}: another replay ({earlier['config']})")
        for name, result in earlier["results"].items():
            if name not in args.variants:
                rows = [{"idle_work": 0.0, **row} for row in result["rows"]]
                results[name] = {"rows": rows, "summary": summary(rows, args.warmup)}
    for name in args.variants:
        for chunk_size in args.chunk_sizes:
            label = name if args.chunk_sizes == [32] else f"{name}, chunk_size={chunk_size}"
            rows = replay(model, tokenizer, prompts, references, *VARIANTS[name], chunk_size=chunk_size)
            results[label] = {"rows": rows, "summary": summary(rows, args.warmup)}
            print(f"{label} done after {time.time() - started:.0f}s", flush=True)
    after = f"after {args.warmup}"
    print(
        f"| variant | served (all / {after}) | recomputed | prefill work (all / {after}) "
        f"| TF top-1 (all / {after}) | TF mean KL (all / {after}) | idle work (all / {after}) "
        "| forced pass CPU s (median) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        s = result["summary"]

        def both(key, fmt, s=s):
            return f"{s[key]['all']:{fmt}} / {s[key]['after_warmup']:{fmt}}"

        rows = result["rows"]
        cpu = (
            statistics.median(r["forced_cpu_s"] for r in rows) if "forced_cpu_s" in rows[0] else float("nan")
        )
        print(
            f"| {name} | {both('served', '.1%')} | {s['recomputed']['all']:.1%} | {both('work', '.1%')} "
            f"| {both('tf_top1', '.1%')} | {both('tf_mean_kl', '.4f')} | {both('idle_work', '.1%')} "
            f"| {cpu:.2f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "config": {k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()},
        "new_tokens": NEW_TOKENS,
        "date": time.strftime("%Y-%m-%d"),
        "elapsed_s": time.time() - started,
        "results": results,
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
