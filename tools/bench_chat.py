"""Multi-turn chat replay benchmark: no-cache Hugging Face vs KVBoost vs the floor, same run.

Replays real chitchat-dataset conversations (users' messages; the model's own replies fed back) on the
embedded SmolLM2-135M-Instruct with ``torch.set_num_threads(1)``, and per turn measures:

* HF no-cache TTFT: chat template + tokenize + one full forward + argmax (median of ``--repeats``);
* KVBoost TTFT: chat template + ``engine.generate``'s ``ttft_ms`` (tokenization, lookup, assembly,
  prefill, first token), measured once per turn in the live replay (the cache state a real chat sees);
* floor: copying the cached KV into a fresh cache + a forward over the uncached suffix only (median).

Then a long-document chat (a ~900-token pydoc topic in the system prompt) for the ~1000-token point, the
full-miss overhead (cache cleared) and decode tokens/s against ``model.generate``.

Writes ``docs/bench_chat.json`` and ``docs/bench_chat.png`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from plotting import pyplot  # tools/ is on sys.path when a script here runs

from kvb_cache.forward import prefill
from kvboost import KVBoost
from kvboost.replay import SYSTEM_PROMPT, chat_turns, load_user_turns

DOCS = Path(__file__).resolve().parent.parent / "docs"


def timed(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def hf_ttft(engine: KVBoost, messages) -> None:
    ids = engine.chat_prompt(messages)
    with torch.inference_mode():
        int(engine.model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax())


def floor_ms(engine: KVBoost, ids: list[int], repeats: int) -> tuple[float, int]:
    """Copy of the cached prefix out of the pool + suffix-only forward, for the prefix the engine would reuse
    right now (the physical floor of a cache hit: no scheduling, no sampling)."""
    cached = engine._prepare(ids, max_reuse=len(ids) - 1).cached_tokens

    def run() -> None:
        cache = engine._prepare(ids, max_reuse=len(ids) - 1).cache
        with torch.inference_mode():
            suffix = torch.tensor([ids[cached:]])
            positions = torch.arange(cached, len(ids)).unsqueeze(0)
            int(prefill(engine.model, engine.traits, cache, suffix, positions)[0].argmax())

    return timed(run, repeats), cached


def kvboost_turn(engine: KVBoost, messages, max_new_tokens: int):
    t0 = time.perf_counter()
    ids = engine.chat_prompt(messages)
    template_ms = (time.perf_counter() - t0) * 1e3
    result = engine.generate(ids, max_new_tokens=max_new_tokens)
    return ids, result, result.ttft_ms + template_ms


def seen_prefix(ids: list[int], previous: list[int]) -> int:
    """Leading tokens of ``ids`` that the previous turn already ran through the model (prompt + reply,
    minus the reply's last token, which is sampled but never fed back), capped at ``len(ids) - 1``: the most
    any cache could reuse. The rest (the new user message, the template around it) was never seen."""
    n = 0
    for a, b in zip(ids, previous[:-1]):
        if a != b:
            break
        n += 1
    return min(n, len(ids) - 1)


def replay(
    engine: KVBoost,
    conversations,
    turns: int,
    max_new_tokens: int,
    repeats: int,
    label: str,
    timings: bool = True,
):
    rows = []
    for c, user_turns in enumerate(conversations):
        previous: list[int] = []
        for turn, messages in chat_turns(user_turns, turns):
            ids = engine.chat_prompt(messages)
            hf = timed(lambda m=messages: hf_ttft(engine, m), repeats) if timings else float("nan")
            floor = floor_ms(engine, ids, repeats)[0] if timings else float("nan")
            ids, result, ttft = kvboost_turn(engine, messages, max_new_tokens)
            seen = seen_prefix(ids, previous) if turn > 1 else 0
            rows.append(
                {
                    "set": label,
                    "conversation": c,
                    "turn": turn,
                    "context_tokens": len(ids),
                    "hf_ttft_ms": hf,
                    "kvboost_ttft_ms": ttft,
                    "floor_ms": floor,
                    "reuse": result.kv_reuse_ratio,
                    "seen_tokens": seen,
                    "reuse_of_seen": result.cached_tokens / seen if seen else float("nan"),
                }
            )
            previous = ids + list(result.output_ids)
            messages.append({"role": "assistant", "content": result.output_text})
        print(f"  [{label}] conversation {c + 1}/{len(conversations)} done", flush=True)
    return rows


def per_turn(rows):
    table = []
    for turn in sorted({r["turn"] for r in rows}):
        sel = [r for r in rows if r["turn"] == turn]
        med = {
            k: statistics.median(r[k] for r in sel)
            for k in ("context_tokens", "hf_ttft_ms", "kvboost_ttft_ms", "floor_ms", "reuse")
        }
        med["speedup"] = statistics.median(r["hf_ttft_ms"] / r["kvboost_ttft_ms"] for r in sel)
        med["vs_floor"] = statistics.median(r["kvboost_ttft_ms"] / r["floor_ms"] for r in sel)
        table.append({"turn": turn, "n": len(sel), **med})
    return table


def long_document_conversations(n: int, user_turns: list[list[str]]):
    """A ~900-token pydoc topic in the system prompt, then real users' messages."""
    from pydoc_data.topics import topics

    docs = sorted((t for t in topics.values() if 3500 < len(t) < 6000), key=len)[:n]
    return [(doc[:3800], turns) for doc, turns in zip(docs, user_turns)]


def full_miss(engine: KVBoost, prompts, repeats: int):
    ratios = []
    for messages in prompts:
        hf = timed(lambda m=messages: hf_ttft(engine, m), repeats)
        samples = []
        for _ in range(repeats):
            engine.clear_cache()
            samples.append(kvboost_turn(engine, messages, 1)[2])
        ratios.append(statistics.median(samples) / hf)
    return statistics.median(ratios)


def decode_rate(engine: KVBoost, prompts, new_tokens: int):
    ours, hf = [], []
    for messages in prompts:
        ids = engine.chat_prompt(messages)
        result = engine.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
        ours.append(result.decode_tokens_per_s)
        x = torch.tensor([ids])
        prefill_ms = timed(lambda m=messages: hf_ttft(engine, m), 3)
        gen_ms = timed(
            lambda x=x: engine.model.generate(
                x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            ),
            1,
        )
        hf.append((new_tokens - 1) / ((gen_ms - prefill_ms) / 1e3))
    return statistics.median(ours), statistics.median(hf)


def reuse_table(rows):
    """Per turn: median context, tokens already seen, tokens reused, and reused / seen (turn 1 excluded)."""
    table = []
    for turn in sorted({r["turn"] for r in rows if r["turn"] > 1}):
        sel = [r for r in rows if r["turn"] == turn]
        table.append(
            {
                "turn": turn,
                "n": len(sel),
                "context_tokens": statistics.median(r["context_tokens"] for r in sel),
                "seen_tokens": statistics.median(r["seen_tokens"] for r in sel),
                "seen_share": statistics.median(r["seen_tokens"] / r["context_tokens"] for r in sel),
                "reuse": statistics.median(r["reuse"] for r in sel),
                "reuse_of_seen": statistics.median(r["reuse_of_seen"] for r in sel),
                "reuse_of_seen_min": min(r["reuse_of_seen"] for r in sel),
            }
        )
    return table


def reuse_markdown(table) -> str:
    lines = [
        "| turn | n | context tokens | already seen | seen share | reuse | reused / seen (median, min) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['turn']} | {r['n']} | {r['context_tokens']:.0f} | {r['seen_tokens']:.0f} | {r['seen_share']:.1%} "
            f"| {r['reuse']:.1%} | {r['reuse_of_seen']:.1%}, {r['reuse_of_seen_min']:.1%} |"
        )
    return "\n".join(lines)


def plot(table, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    turns = [r["turn"] for r in table]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(turns, [r["hf_ttft_ms"] for r in table], "o-", label="HF, no cache")
    ax.plot(turns, [r["kvboost_ttft_ms"] for r in table], "s-", label="KVBoost")
    ax.plot(turns, [r["floor_ms"] for r in table], "^--", label="floor (cache copy + suffix forward)")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, median ms (1 CPU thread)")
    ax.set_title("SmolLM2-135M, chitchat replay")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(table) -> str:
    lines = [
        "| turn | n | context tokens | HF no-cache TTFT ms | KVBoost TTFT ms | floor ms | speedup | KVBoost/floor | reuse |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['turn']} | {r['n']} | {r['context_tokens']:.0f} | {r['hf_ttft_ms']:.1f} | {r['kvboost_ttft_ms']:.1f} "
            f"| {r['floor_ms']:.1f} | {r['speedup']:.1f}x | {r['vs_floor']:.2f} | {r['reuse']:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--long-docs", type=int, default=8, help="long-document chats for the ~1000-token point"
    )
    parser.add_argument("--out", type=Path, default=DOCS / "bench_chat.json")
    parser.add_argument(
        "--reuse-only",
        action="store_true",
        help="replay with KVBoost only: reuse vs the tokens already seen, per turn (no timings)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    engine = KVBoost.from_pretrained("smollm2-135m", device="cpu")
    conversations = load_user_turns(args.conversations, min_turns=3)
    if args.reuse_only:
        rows = replay(engine, conversations, args.turns, args.max_new_tokens, 0, "chitchat", timings=False)
        table = reuse_table(rows)
        args.out.with_name("bench_chat_reuse.json").write_text(
            json.dumps({"per_turn": table, "rows": rows}, indent=1)
        )
        print(reuse_markdown(table))
        return
    print(f"replaying {len(conversations)} conversations x up to {args.turns} turns", flush=True)
    chat_rows = replay(engine, conversations, args.turns, args.max_new_tokens, args.repeats, "chitchat")

    long_rows = []
    for doc, turns in long_document_conversations(args.long_docs, conversations):
        global_prompt = SYSTEM_PROMPT + "\n\nReference document:\n" + doc

        def with_doc(user_turns, max_turns, system=global_prompt):
            for turn, messages in chat_turns(user_turns, max_turns):
                messages[0] = {"role": "system", "content": system}
                yield turn, messages

        for turn, messages in with_doc(turns, 4):
            ids = engine.chat_prompt(messages)
            hf = timed(lambda m=messages: hf_ttft(engine, m), args.repeats)
            floor, _ = floor_ms(engine, ids, args.repeats)
            ids, result, ttft = kvboost_turn(engine, messages, args.max_new_tokens)
            long_rows.append(
                {
                    "set": "long-doc",
                    "turn": turn,
                    "context_tokens": len(ids),
                    "hf_ttft_ms": hf,
                    "kvboost_ttft_ms": ttft,
                    "floor_ms": floor,
                    "reuse": result.kv_reuse_ratio,
                }
            )
            messages.append({"role": "assistant", "content": result.output_text})

    miss_prompts = [list(chat_turns(c, 2))[-1][1] for c in conversations[:8]]
    miss_ratio = full_miss(engine, miss_prompts, args.repeats)
    ours_tps, hf_tps = decode_rate(engine, miss_prompts[:4], 64)

    chat_table, long_table = per_turn(chat_rows), per_turn(long_rows)
    around_1k = [r for r in long_rows if r["turn"] >= 2]
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, 1 torch thread, torch {torch.__version__}",
        "reuse_from_turn_3_median": statistics.median(r["reuse"] for r in chat_rows if r["turn"] >= 3),
        "kvboost_over_floor_median": statistics.median(
            r["kvboost_ttft_ms"] / r["floor_ms"] for r in chat_rows if r["turn"] >= 2
        ),
        "speedup_at_long_context_median": statistics.median(
            r["hf_ttft_ms"] / r["kvboost_ttft_ms"] for r in around_1k
        ),
        "long_context_tokens_median": statistics.median(r["context_tokens"] for r in around_1k),
        "full_miss_ttft_ratio_median": miss_ratio,
        "decode_tokens_per_s": {"kvboost": ours_tps, "hf_generate": hf_tps, "ratio": ours_tps / hf_tps},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "summary": summary,
                "per_turn": chat_table,
                "long_doc_per_turn": long_table,
                "rows": chat_rows + long_rows,
            },
            indent=1,
        )
    )
    plot(chat_table, args.out.with_suffix(".png"))
    print("\n## Chitchat replay (medians over conversations)\n")
    print(markdown(chat_table))
    print("\n## Long-document chat (~900-token document in the system prompt)\n")
    print(markdown(long_table))
    print("\n## Summary\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
