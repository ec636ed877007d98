"""What holding the block pool in a narrower dtype (``kv_cache_dtype``) costs in fidelity and buys in room.

For each prompt (long pydoc pages to summarize, and chitchat conversations rendered with the chat template):

1. no cache: the model's greedy continuation (``--new-tokens``) and, by one plain forward over prompt +
   continuation, its next-token distribution at every position of it;
2. per ``kv_cache_dtype``, an engine whose pool holds KV in that dtype: the distribution at every position of
   the *same* continuation (teacher forcing), each through the pool (``next_token_logits`` of the prompt plus
   the continuation so far: the prefix is read back from the pool, the rest computed and written to it, as a
   decode step would), and the engine's own greedy continuation.

Reported per dtype: top-1 agreement and mean / p95 KL(no-cache || pool) over all positions, greedy
continuations identical to no-cache, pool tokens per GiB, and (``--timing``) the CPU time of a batch of
decoding requests relative to ``auto`` (one torch thread, median of ``--repeats``).

Model: the embedded SmolLM2-135M-Instruct, fp32 on CPU (``--model`` / ``--dtype`` for another). Writes
``docs/kv_cache_dtype.json`` and prints a markdown table.

``--reuse`` measures instead how far a prefix hit is from the same engine without reuse, per dtype
(``docs/kv_cache_dtype_reuse.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from eval_fidelity import add_model_args, load_model

from kvb_cache import EngineConfig, KVBoost
from kvb_cache.core.kv_storage import bytes_per_block, probe_layer_shapes
from kvb_cache.fidelity import compare_distributions, reference_continuation_logits

DOCS = Path(__file__).resolve().parent.parent / "docs"
DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
CACHE_BYTES = 256 << 20
GiB = 1 << 30


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pydoc_prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    """``n`` long pydoc topics, cut to ``tokens`` tokens, each asked to be summarized (chat template)."""
    from pydoc_data.topics import topics

    names = [name for name in sorted(topics) if len(topics[name]) > 4000][:n]
    out = []
    for name in names:
        text = tokenizer.decode(tokenizer(topics[name].strip())["input_ids"][:tokens])
        messages = [{"role": "user", "content": f"{text}\n\nSummarize the document above in two sentences."}]
        out.append(chat_ids(tokenizer, messages))
    return out


def chitchat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first ``n`` chitchat-dataset conversations with at least 4 messages, all but the last one as chat
    history (alternating user / assistant), the model to write the next reply."""
    import chitchat_dataset

    out = []
    for conv in chitchat_dataset.ConversationDataset():
        messages = [" ".join(m) if isinstance(m, list | tuple) else str(m) for m in conv]
        if len(messages) < 4:
            continue
        chat = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(messages[: len(messages) - (len(messages) % 2 == 0)])
        ]
        out.append(chat_ids(tokenizer, chat))
        if len(out) == n:
            break
    return out


@torch.inference_mode()
def greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    # eos_token_id=None: the argmax path through an end-of-sequence too, as the engine's ignore_eos runs it
    # (min_new_tokens would ban the token instead, and the two continuations part there).
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def pool_logits(engine: KVBoost, ids: list[int], continuation: list[int]) -> torch.Tensor:
    """``[T, V]``: the next-token logits after ``ids + continuation[:t]`` for every ``t``, through the pool."""
    return torch.stack(
        [engine.next_token_logits(ids + continuation[:t]).logits for t in range(len(continuation))]
    )


def reuse_row(model, tokenizer, dtype: str, ids: list[int], new_tokens: int) -> dict:
    """A prefix hit against the same engine without reuse: the first 3/4 of ``ids`` warmed (computed in a
    forward of its own length), then ``ids`` asked with that prefix cached, and on a fresh engine cold. Both
    attend the pool's precision; they differ by the float noise of different forward shapes (~1e-6 in fp32),
    which a narrow format turns into whole rounding steps wherever it straddles a rounding boundary."""

    def fresh() -> KVBoost:
        return KVBoost(
            model, tokenizer, config=EngineConfig(kv_cache_dtype=dtype, max_cache_bytes=CACHE_BYTES)
        )

    prefix = ids[: 3 * len(ids) // 4]
    warm, cold = fresh(), fresh()
    warm.warm(prefix)
    hit, miss = warm.next_token_logits(ids), cold.next_token_logits(ids)
    warm_text, cold_text = fresh(), fresh()
    warm_text.warm(prefix)
    a = warm_text.generate(ids, max_new_tokens=new_tokens, ignore_eos=True).output_ids
    b = cold_text.generate(ids, max_new_tokens=new_tokens, ignore_eos=True).output_ids
    return {
        "dtype": dtype,
        "cached_tokens": hit.cached_tokens,
        "max_abs_logit_diff": float((hit.logits - miss.logits).abs().max()),
        "kl": compare_distributions(miss.logits[None], hit.logits[None]).mean_kl,
        "argmax_equal": int(hit.logits.argmax()) == int(miss.logits.argmax()),
        "greedy_identical": a == b,
    }


def reuse_report(model, tokenizer, prompts, dtypes, new_tokens: int, out: Path) -> None:
    """``--reuse``: :func:`reuse_row` for every prompt and dtype; a table and ``out`` (JSON)."""
    rows = []
    for i, (source, ids) in enumerate(prompts):
        for dtype in dtypes:
            rows.append(
                {"source": source, "prompt": i, **reuse_row(model, tokenizer, dtype, ids, new_tokens)}
            )
            print(rows[-1], flush=True)
    print(
        "\n| kv_cache_dtype | prompts | max abs logit difference (median / max) | mean KL | next token equal | greedy identical |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in dtypes:
        mine = [r for r in rows if r["dtype"] == dtype]
        diffs = [r["max_abs_logit_diff"] for r in mine]
        print(
            f"| {dtype} | {len(mine)} | {statistics.median(diffs):.2g} / {max(diffs):.2g} | "
            f"{statistics.mean(r['kl'] for r in mine):.1e} | {sum(r['argmax_equal'] for r in mine)}/{len(mine)} | "
            f"{sum(r['greedy_identical'] for r in mine)}/{len(mine)} |"
        )
    out.write_text(json.dumps({"new_tokens": new_tokens, "rows": rows}, indent=1))


def decode_cpu_seconds(model, tokenizer, dtype: str, prompts: list[list[int]], new_tokens: int) -> float:
    """CPU time of ``prompts`` generated together (greedy), prefill included, on a fresh engine."""
    engine = KVBoost(model, tokenizer, config=EngineConfig(kv_cache_dtype=dtype, max_cache_bytes=CACHE_BYTES))
    start = time.thread_time()
    engine.generate_batch(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--pydoc", type=int, default=12, help="pydoc prompts")
    parser.add_argument("--pydoc-tokens", type=int, default=700, help="tokens of each pydoc page")
    parser.add_argument("--chitchat", type=int, default=12, help="chitchat prompts")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--only", nargs="*", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--timing", action="store_true", help="also time a batch of 8 decoding requests")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DOCS / "kv_cache_dtype.json")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="instead: a prefix hit against the same engine without reuse, per dtype "
        "(writes docs/kv_cache_dtype_reuse.json)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model, args.dtype)
    prompts = [("pydoc", p) for p in pydoc_prompts(tokenizer, args.pydoc, args.pydoc_tokens)]
    prompts += [("chitchat", p) for p in chitchat_prompts(tokenizer, args.chitchat)]
    if args.reuse:
        reuse_report(
            model, tokenizer, prompts, args.only, args.new_tokens, DOCS / "kv_cache_dtype_reuse.json"
        )
        return
    shapes = probe_layer_shapes(model)
    rows: list[dict] = []
    for i, (source, ids) in enumerate(prompts):
        continuation = greedy(model, ids, args.new_tokens)
        reference = reference_continuation_logits(model, ids, continuation)
        for dtype in args.only:
            engine = KVBoost(
                model, tokenizer, config=EngineConfig(kv_cache_dtype=dtype, max_cache_bytes=CACHE_BYTES)
            )
            got = engine.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True).output_ids
            agreement = compare_distributions(reference, pool_logits(engine, ids, continuation))
            rows.append(
                {
                    "source": source,
                    "prompt": i,
                    "prompt_tokens": len(ids),
                    "dtype": dtype,
                    "top1": agreement.top1_agreement,
                    "kl": list(agreement.kl),
                    "greedy_identical": got == continuation,
                }
            )
            print(
                source,
                i,
                len(ids),
                dtype,
                f"top1 {agreement.top1_agreement:.3f}",
                f"KL {agreement.mean_kl:.2e}",
            )
    timing: dict[str, float] = {}
    if args.timing:
        batch = [ids for _, ids in prompts[:: max(1, len(prompts) // 8)]][:8]
        runs: dict[str, list[float]] = {d: [] for d in args.only}
        for _ in range(args.repeats):
            for dtype in args.only:  # interleaved: a slow spell of the shared machine hits every dtype
                runs[dtype].append(decode_cpu_seconds(model, tokenizer, dtype, batch, args.new_tokens))
        timing = {d: statistics.median(v) for d, v in runs.items()}
    summary = {}
    for dtype in args.only:
        mine = [r for r in rows if r["dtype"] == dtype]
        kls = sorted(k for r in mine for k in r["kl"])
        positions = len(kls)
        summary[dtype] = {
            "prompts": len(mine),
            "top1": sum(r["top1"] * len(r["kl"]) for r in mine) / positions,
            "mean_kl": sum(kls) / positions,
            "p95_kl": kls[min(positions - 1, int(0.95 * positions))],
            "greedy_identical": sum(r["greedy_identical"] for r in mine) / len(mine),
            "tokens_per_gib": GiB // bytes_per_block(shapes, 1, dtype),
            "cpu_time_vs_auto": timing[dtype] / timing["auto"] if timing and "auto" in timing else None,
        }
    print()
    print(
        "| kv_cache_dtype | pool tokens per GiB | TF top-1 | TF mean KL | TF p95 KL | greedy identical | CPU time vs auto |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype, s in summary.items():
        cpu = "" if s["cpu_time_vs_auto"] is None else f"{s['cpu_time_vs_auto']:.2f}x"
        print(
            f"| {dtype} | {s['tokens_per_gib']:,} | {100 * s['top1']:.1f}% | {s['mean_kl']:.2e} | "
            f"{s['p95_kl']:.2e} | {100 * s['greedy_identical']:.0f}% | {cpu} |"
        )
    args.out.write_text(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "new_tokens": args.new_tokens,
                "summary": summary,
                "timing_cpu_s": timing,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
