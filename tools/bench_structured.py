"""Structured outputs benchmark: decode tokens/s with a response_format vs without, grammar compile times,
and (``--compare-libraries``) xgrammar vs llguidance on this machine's tokenizers.

Decode: the embedded SmolLM2-135M-Instruct, ``torch.set_num_threads(1)``, the same chat prompts in the same
run. Each prompt first decodes constrained by its schema (it stops when the JSON is complete, ``n`` tokens),
then unconstrained for exactly ``n`` tokens (``ignore_eos``); decode rate = tokens after the first / (total -
TTFT). Medians over prompts and ``--repeats`` (alternating which variant runs first); batch 1 (the mask is the largest share of a step there) and
all prompts as one batch.

Compile: a cold ``GrammarCache`` per schema (the llguidance tokenizer is built once, timed separately).

Library comparison: for SmolLM2's tokenizer and two trained here (GPT-2-style byte-level BPE, Llama-style
Metaspace BPE with byte fallback, on this venv's Python sources): compile time per schema, mask time per
token (p50/p99 over teacher-forced valid instances and random constrained walks), correctness (valid
instances accepted; random walks that finish validate with jsonschema; keywords the library cannot enforce
are refused, not ignored).

Writes docs/bench_structured.json and prints markdown tables (copied into docs/structured.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"],
    },
    "address": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "review": {
        "type": "object",
        "properties": {
            "movie": {"type": "string"},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "pros": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
        },
        "required": ["movie", "rating", "pros", "sentiment"],
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "online": {"type": "boolean"},
        },
        "required": ["title", "date", "attendees", "online"],
    },
    "shape": {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}}},
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
        "required": ["name", "arguments"],
    },
}
ASKS = {
    "person": "Give me a famous scientist.",
    "address": "Give me the address of a museum.",
    "review": "Review the movie Inception.",
    "event": "Plan a team meeting.",
    "shape": "Describe a circle of radius 2.",
    "tool_call": "What is the weather in Paris? Call the tool.",
}


def decode_rate(result) -> float:
    tokens = len(result.output_ids) - 1
    seconds = (result.total_ms - result.ttft_ms) / 1e3
    return tokens / seconds if seconds > 0 else float("nan")


def bench_decode(engine, repeats: int) -> dict:
    prompts = {
        name: engine.chat_prompt(
            [
                {"role": "system", "content": "Reply with JSON matching: " + json.dumps(schema)},
                {"role": "user", "content": ASKS[name]},
            ]
        )
        for name, schema in SCHEMAS.items()
    }
    common = {"repetition_penalty": 1.1, "max_new_tokens": 128}
    rows = {name: {"constrained": [], "plain": [], "tokens": 0} for name in SCHEMAS}
    batch_ratio = []
    lengths = {
        name: len(engine.generate(prompts[name], response_format=schema, **common).output_ids)
        for name, schema in SCHEMAS.items()
    }  # also warms the prompts' KV in the prefix cache, for both variants alike
    for repeat in range(repeats):
        for name, schema in SCHEMAS.items():
            n = lengths[name]
            # Alternate which variant runs first (background load drifts within a pair).
            variants = {
                "con": {**common, "response_format": schema},
                "plain": {**common, "max_new_tokens": n, "ignore_eos": True},
            }
            order = ["plain", "con"] if repeat % 2 else ["con", "plain"]
            out = {v: engine.generate(prompts[name], **variants[v]) for v in order}
            con, plain = out["con"], out["plain"]
            assert len(con.output_ids) == n
            rows[name]["constrained"].append(decode_rate(con))
            rows[name]["plain"].append(decode_rate(plain))
            rows[name]["tokens"] = n
        # One batch: every prompt constrained, then every prompt unconstrained with the same lengths.
        names = list(SCHEMAS)
        t0 = time.perf_counter()
        con = engine.generate_batch(
            [prompts[n] for n in names], sampling=[{"response_format": SCHEMAS[n]} for n in names], **common
        )
        con_s = time.perf_counter() - t0
        batch_lengths = [len(r.output_ids) for r in con]
        t0 = time.perf_counter()
        engine.generate_batch(
            [prompts[n] for n in names],
            sampling=[{"max_new_tokens": k, "ignore_eos": True} for k in batch_lengths],
            repetition_penalty=1.1,
        )
        plain_s = time.perf_counter() - t0
        batch_ratio.append(con_s / plain_s)
    table = {}
    for name, row in rows.items():
        c, p = statistics.median(row["constrained"]), statistics.median(row["plain"])
        table[name] = {
            "tokens": row["tokens"],
            "constrained_tok_s": c,
            "plain_tok_s": p,
            "cost_pct": 100 * (p / c - 1),
        }
    overall = statistics.median(v["cost_pct"] for v in table.values())
    return {
        "per_schema": table,
        "median_cost_pct": overall,
        "batch_time_ratio": statistics.median(batch_ratio),
    }


def bench_compile(engine) -> dict:
    from kvb_cache.structured import GrammarCache, ResponseFormat

    vocab = engine._logits_width
    cache = GrammarCache()
    t0 = time.perf_counter()
    cache.state(ResponseFormat.parse({"type": "regex", "pattern": "a"}), engine.tokenizer, vocab)
    out = {"tokenizer_init_ms": (time.perf_counter() - t0) * 1e3, "per_schema_ms": {}}
    for name, schema in SCHEMAS.items():
        times = []
        for trial in range(5):
            # A different $comment is a different cache key: a cold compile with the tokenizer warm.
            fmt = ResponseFormat.parse({**schema, "$comment": f"trial {trial}"})
            t0 = time.perf_counter()
            cache.state(fmt, engine.tokenizer, vocab)
            times.append(time.perf_counter() - t0)
        out["per_schema_ms"][name] = statistics.median(times) * 1e3
    fmt = ResponseFormat.parse(SCHEMAS["review"])
    cache.state(fmt, engine.tokenizer, vocab)
    t0 = time.perf_counter()
    for _ in range(100):
        cache.state(fmt, engine.tokenizer, vocab)
    out["cached_state_us"] = (time.perf_counter() - t0) / 100 * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every prompt (medians)")
    parser.add_argument("--compare-libraries", action="store_true", help="also run xgrammar vs llguidance")
    parser.add_argument("--out", type=Path, default=DOCS / "bench_structured.json", help="JSON results")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from kvb_cache import KVBoost

    engine = KVBoost.from_pretrained("smollm2-135m", device="cpu", dtype="float32")
    results = {"machine": platform.processor() or platform.machine(), "torch_threads": 1}
    results["compile"] = bench_compile(engine)
    results["decode"] = bench_decode(engine, args.repeats)
    if args.compare_libraries:
        from compare_grammar_libs import compare

        results["libraries"] = compare()
    args.out.write_text(json.dumps(results, indent=2))
    print("| schema | compile ms (cold) | tokens | tok/s constrained | tok/s plain | cost |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in results["decode"]["per_schema"].items():
        print(
            f"| {name} | {results['compile']['per_schema_ms'][name]:.2f} | {row['tokens']} | "
            f"{row['constrained_tok_s']:.1f} | {row['plain_tok_s']:.1f} | {row['cost_pct']:+.1f}% |"
        )
    d = results["decode"]
    print(
        f"\nmedian cost (batch 1): {d['median_cost_pct']:+.1f}%; batch of {len(SCHEMAS)} time ratio: {d['batch_time_ratio']:.3f}"
    )
    c = results["compile"]
    print(
        f"llguidance tokenizer init: {c['tokenizer_init_ms']:.0f} ms; cached grammar per request: {c['cached_state_us']:.0f} us"
    )


if __name__ == "__main__":
    main()
