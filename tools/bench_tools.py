"""Tool-calling benchmark: constrained decode cost, grammar compile time, and an agent loop on both servers.

Engine (in process, SmolLM2-135M-Instruct, ``torch.set_num_threads(1)``): the grammar is built exactly as
kvb-server builds it (``tool_plan`` -> ``tool_grammar`` -> ``ResponseFormat(kind="grammar")``) and the
prompt is rendered as the server renders it (``template_messages``: the tool list and the Hermes-tag format
in the system prompt). Each prompt first decodes constrained (it stops when the grammar is complete, ``n``
tokens), then unconstrained for exactly ``n`` tokens (``ignore_eos``); decode rate = tokens after the first /
(total - TTFT); medians over prompts and ``--repeats``, alternating which variant runs first. Plans
(``--engine-plans``): ``tool_choice="required"`` with one call (what the agent loop sends), with parallel
calls on (up to 8 calls), and ``"auto"`` (text or calls). Compile: cold ``GrammarCache`` entries for 1, 4
and 16 tools (``required`` and ``auto``), plus the server's pre-queue ``check_grammar`` (no tokenizer).

Transformers serve's paged cache is capped (``--peer-cb-memory``): at its default share of free memory it
was OOM-killed on this shared machine. Logs go to ``<out folder>/logs/bench_tools/``.

Servers (kvboost-server, then ``transformers serve --continuous-batching`` from its own venv; same
``OMP_NUM_THREADS``, one at a time, tools/server_procs.py): ``--loops`` agent loops of ``--calls`` streamed
greedy calls each (4 tools, one user task per loop; ``tool_choice="required"`` then ``"auto"`` for the last
call), each tool call answered with a canned ``tool`` result. Per call: prompt / cached tokens, TTFT (first
content or tool-call delta), latency, whether each call names a declared tool and its arguments validate
(jsonschema), whether the tool is one the task needs, finish_reason. The peer renders SmolLM2's template,
which has no tools, so it runs two ways: ``as-is`` (the same request; it ignores what it cannot use) and
``prompted`` (the client sends the exact messages kvboost renders, tool list and format in the system
prompt, and parses ``<tool_call>`` tags from the text itself: the best an unconstrained server can do here).

Writes docs/bench_tools.json and docs/bench_tools.png and prints markdown tables (copied into
docs/tools_bench.md). ``--quick`` is a smoke run writing under the temp folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUGS = Path(tempfile.gettempdir()) / "bench_tools_bugs.md"

SYSTEM = "You are a concise assistant that plans errands for the user. Use the tools to get facts."


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS = [
    _fn(
        "get_weather",
        "Weather forecast for a city.",
        {
            "city": {"type": "string", "minLength": 1, "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        ["city", "unit"],
    ),
    _fn(
        "create_event",
        "Add an event to the user's calendar.",
        {
            "title": {"type": "string", "minLength": 1, "maxLength": 60},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "start_hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 480},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        },
        ["title", "date", "start_hour"],
    ),
    _fn(
        "web_search",
        "Search the web.",
        {
            "query": {"type": "string", "minLength": 1, "maxLength": 80},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
            "recency": {"enum": ["day", "week", "month", "any"]},
        },
        ["query"],
    ),
    _fn(
        "calculate",
        "Evaluate an arithmetic expression.",
        {
            "expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,60}$"},
            "decimals": {"type": "integer", "minimum": 0, "maximum": 6},
        },
        ["expression"],
    ),
]
TOOL_RESULTS = {
    "get_weather": {"city": "Lyon", "forecast": [{"day": 1, "high": 14, "low": 6, "sky": "light rain"}]},
    "create_event": {"status": "created", "event_id": "evt_1042"},
    "web_search": {"results": [{"title": "Le Bouchon des Filles", "url": "https://example.org/bouchon"}]},
    "calculate": {"result": 135.0},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One agent loop's user message and the tools the task needs (the semantic check)."""

    user: str
    needs: tuple[str, ...]


TASKS = [
    Task(
        user="I'm in Lyon on 2026-12-05. Check the weather, find a restaurant near the old town, work out "
        "3 people at 45 euros each, and put dinner at 19:00 on my calendar.",
        needs=("get_weather", "web_search", "calculate", "create_event"),
    ),
    Task(
        user="Plan a bike ride in Amsterdam this Saturday 2026-12-12: is it going to rain? Add it to my "
        "calendar at 10:00 for two hours with Sam.",
        needs=("get_weather", "create_event"),
    ),
    Task(
        user="Find the opening hours of the Berlin science museum, then book a visit on 2026-12-19 at 14:00 "
        "for 90 minutes.",
        needs=("web_search", "create_event"),
    ),
    Task(
        user="How much is 12.5% of 2480, and what was the latest news about the Tour de France this week?",
        needs=("calculate", "web_search"),
    ),
    Task(
        user="Tomorrow is 2026-11-24. What's the weather in Oslo in fahrenheit for 3 days?",
        needs=("get_weather",),
    ),
    Task(
        user="Set up a team lunch on 2026-12-01 at noon with Ana and Li, and search for vegan places in Porto.",
        needs=("create_event", "web_search"),
    ),
]
NUDGE = "That was not a tool call. Call one of the tools now."

_EXTRA_NAMES = [
    "send_email",
    "translate_text",
    "set_reminder",
    "get_stock_price",
    "book_taxi",
    "find_flights",
    "play_music",
    "convert_currency",
    "get_news",
    "create_note",
    "lookup_contact",
    "order_food",
]


def tool_set(count: int) -> list[dict]:
    """``count`` tools: the four realistic ones, then varied synthetic ones (enum, bounded int, string)."""
    tools = list(TOOLS[:count])
    for i, name in enumerate(_EXTRA_NAMES[: max(0, count - len(TOOLS))]):
        props = {
            "text": {"type": "string", "maxLength": 20 + 10 * i},
            "priority": {"enum": ["low", "normal", "high", f"level{i}"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 10 * (i + 1)},
            "confirm": {"type": "boolean"},
        }
        tools.append(_fn(name, f"The {name.replace('_', ' ')} tool.", props, ["text", "priority"]))
    return tools


# -- engine level -------------------------------------------------------------------------------------------


def server_prompt(
    engine: Any, messages: list[dict], tools: list[dict], choice: Any, parallel: bool
) -> list[int]:
    """Token ids of ``messages`` exactly as kvb-server renders them for this tool request."""
    from kvb_server.schemas.generation_requests import ChatMessage
    from kvb_server.tool_calls import detect, template_messages, tool_plan

    syntax = detect(engine.tokenizer)
    plan = tool_plan(tools, choice, parallel, syntax)
    msgs = [ChatMessage.model_validate(m) for m in messages]
    return engine.chat_prompt(template_messages(msgs, syntax, plan))


def server_grammar(tokenizer: Any, tools: list[dict], choice: Any, parallel: bool) -> Any:
    """The ``ResponseFormat`` kvb-server constrains this tool request's reply to."""
    from kvb_cache.structured import ResponseFormat
    from kvb_server.tool_calls import detect, tool_grammar, tool_plan

    plan = tool_plan(tools, choice, parallel, detect(tokenizer))
    return ResponseFormat(kind="grammar", source=tool_grammar(plan))


def bench_compile(engine: Any, trials: int) -> dict:
    """Cold compile per tool set and mode (tokenizer warm), and the server's pre-queue check."""
    from kvb_cache.structured import GrammarCache, ResponseFormat, check_grammar

    vocab = engine._logits_width
    cache = GrammarCache()
    t0 = time.perf_counter()
    cache.state(ResponseFormat(kind="regex", source="a"), engine.tokenizer, vocab)
    out: dict = {"tokenizer_init_ms": (time.perf_counter() - t0) * 1e3, "per_set": {}}
    server_grammar(engine.tokenizer, TOOLS, "auto", True)  # imports kvb_server's modules before timing
    for count in (1, 4, 16):
        for choice in ("required", "auto"):
            build, compile_, check = [], [], []
            for trial in range(trials):
                # A $comment in a schema changes the grammar text: a new cache key, a cold compile.
                tools = json.loads(json.dumps(tool_set(count)))
                tools[0]["function"]["parameters"]["$comment"] = f"trial {trial}"
                t0 = time.perf_counter()
                fmt = server_grammar(engine.tokenizer, tools, choice, True)
                t1 = time.perf_counter()
                check_grammar(fmt)
                t2 = time.perf_counter()
                cache.state(fmt, engine.tokenizer, vocab)
                t3 = time.perf_counter()
                build.append(t1 - t0)
                check.append(t2 - t1)
                compile_.append(t3 - t2)
            out["per_set"][f"{count}/{choice}"] = {
                "tools": count,
                "tool_choice": choice,
                "grammar_chars": len(fmt.source),
                "build_ms": statistics.median(build) * 1e3,
                "check_ms": statistics.median(check) * 1e3,
                "compile_ms": statistics.median(compile_) * 1e3,
                "compile_ms_max": max(compile_) * 1e3,
            }
    fmt = server_grammar(engine.tokenizer, TOOLS, "required", True)
    cache.state(fmt, engine.tokenizer, vocab)
    t0 = time.perf_counter()
    for _ in range(100):
        cache.state(fmt, engine.tokenizer, vocab)
    out["cached_state_us"] = (time.perf_counter() - t0) / 100 * 1e6
    return out


ENGINE_PLANS = {"single": ("required", False), "parallel": ("required", True), "auto": ("auto", False)}


def bench_decode(
    engine: Any, repeats: int, prompts_n: int, max_new_tokens: int, plan_names: list[str]
) -> dict:
    """Decode tok/s constrained by the tool grammar vs unconstrained, same prompts, per plan."""
    from bench_structured import decode_rate  # tokens after the first / (total - TTFT)

    plans = {name: ENGINE_PLANS[name] for name in plan_names}
    users = [t.user for t in TASKS[:prompts_n]]
    out: dict = {}
    for label, (choice, parallel) in plans.items():
        fmt = server_grammar(engine.tokenizer, TOOLS, choice, parallel)
        prompts = [
            server_prompt(
                engine,
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}],
                TOOLS,
                choice,
                parallel,
            )
            for u in users
        ]
        # Warm: compiles the grammar and puts every prompt's KV in the prefix cache, for both variants.
        lengths = [
            len(engine.generate(p, response_format=fmt, max_new_tokens=max_new_tokens).output_ids)
            for p in prompts
        ]
        rows: list[dict] = [{"tokens": n, "con": [], "plain": [], "texts": []} for n in lengths]
        for repeat in range(repeats):
            for i, prompt in enumerate(prompts):
                variants = {
                    "con": {"response_format": fmt, "max_new_tokens": max_new_tokens},
                    "plain": {"max_new_tokens": lengths[i], "ignore_eos": True},
                }
                order = ["plain", "con"] if (repeat + i) % 2 else ["con", "plain"]
                res = {v: engine.generate(prompt, **variants[v]) for v in order}
                rows[i]["con"].append(decode_rate(res["con"]))
                rows[i]["plain"].append(decode_rate(res["plain"]))
                rows[i]["texts"] = [res["con"].output_text]
        per_prompt = []
        for i, row in enumerate(rows):
            c, p = statistics.median(row["con"]), statistics.median(row["plain"])
            per_prompt.append(
                {
                    "prompt": i,
                    "tokens": row["tokens"],
                    "constrained_tok_s": c,
                    "plain_tok_s": p,
                    "cost_pct": 100 * (p / c - 1),
                    "constrained_text": row["texts"][0],
                }
            )
        all_con = [x for r in rows for x in r["con"]]
        all_plain = [x for r in rows for x in r["plain"]]
        out[label] = {
            "per_prompt": per_prompt,
            "median_cost_pct": statistics.median(r["cost_pct"] for r in per_prompt),
            "median_constrained_tok_s": statistics.median(all_con),
            "median_plain_tok_s": statistics.median(all_plain),
            "median_tokens": statistics.median(lengths),
            "samples": len(all_con),
        }
    return out


def run_engine(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    from kvb_cache import KVBoost

    engine = KVBoost.from_pretrained("smollm2-135m", device="cpu", dtype="float32")
    results = {"torch_threads": torch.get_num_threads()}
    results["compile"] = bench_compile(engine, args.compile_trials)
    print("  compile done", flush=True)
    results["decode"] = bench_decode(
        engine, args.repeats, args.prompts, args.engine_max_tokens, args.engine_plans
    )
    del engine
    gc.collect()  # the servers come next: give the memory back
    return results


# -- server level -------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class CallRecord:
    """One chat request of an agent loop, as the client saw it."""

    loop: int
    call: int
    tool_choice: str
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    latency_ms: float | None = None
    finish_reason: str | None = None
    content: str | None = None
    calls: list[dict] = field(
        default_factory=list
    )  # {"name", "arguments", "parsed", "valid", "needed", "source"}
    error: str | None = None

    @property
    def valid_call(self) -> bool:
        """At least one call, and every call names a declared tool with schema-valid arguments."""
        return bool(self.calls) and all(c["valid"] for c in self.calls)


_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def judge_calls(raw: list[tuple[str, str]], task: Task, source: str) -> list[dict]:
    """Parse and validate ``(name, arguments text)`` pairs against the declared tools."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = []
    for name, arguments in raw:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        valid = False
        if name in schemas and isinstance(parsed, dict):
            valid = not any(True for _ in jsonschema.Draft202012Validator(schemas[name]).iter_errors(parsed))
        out.append(
            {
                "name": name,
                "arguments": arguments,
                "parsed": parsed is not None,
                "valid": valid,
                "needed": name in task.needs,
                "source": source,
            }
        )
    return out


def text_calls(text: str) -> list[tuple[str, str]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks written as text (lenient)."""
    found = []
    for block in _TAG.findall(text or ""):
        try:
            obj = json.loads(block)
        except ValueError:
            found.append(("<unparsable>", block))
            continue
        if isinstance(obj, dict):
            found.append((str(obj.get("name")), json.dumps(obj.get("arguments", obj.get("parameters")))))
    return found


def record_bug(server: str, request: dict, response: str) -> None:
    with BUGS.open("a") as f:
        f.write(
            f"\n## {server}: {time.strftime('%H:%M:%S')}\n\nrequest:\n```json\n{json.dumps(request)[:20000]}\n```\n"
        )
        f.write(f"\nresponse:\n```\n{response[:20000]}\n```\n")


def stream_call(api: Any, server: str, request: dict, rec: CallRecord) -> None:
    """Send one streamed chat request; fill ``rec`` with usage, timings, text and raw tool calls."""
    import openai

    t0 = time.perf_counter()
    pieces: list[str] = []
    calls: dict[int, dict] = {}
    try:
        stream = api.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content or delta.tool_calls:
                    rec.ttft_ms = rec.ttft_ms or (time.perf_counter() - t0) * 1e3
                if delta.content:
                    pieces.append(delta.content)
                for tc in delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function and tc.function.name:
                        slot["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        slot["arguments"] += tc.function.arguments
                if choice.finish_reason:
                    rec.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                rec.prompt_tokens = chunk.usage.prompt_tokens
                rec.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                rec.cached_tokens = details.cached_tokens if details is not None else None
    except openai.APIStatusError as exc:
        rec.error = f"HTTP {exc.status_code}: {exc.response.text[:2000]}"
        if exc.status_code >= 500 and server == "kvboost":
            record_bug(server, request, rec.error)
    except Exception as exc:  # a transport failure is a failed call to record, not a crash
        rec.error = f"{type(exc).__name__}: {exc}"
        if server == "kvboost":
            record_bug(server, request, rec.error)
    rec.latency_ms = (time.perf_counter() - t0) * 1e3
    rec.content = "".join(pieces) or None
    rec.calls = [calls[i] for i in sorted(calls)]  # raw; judged by the caller


def agent_loop(
    api: Any, model: str, server: str, variant: str, loop: int, task: Task, args: argparse.Namespace
) -> list[CallRecord]:
    """One agent loop: ``args.calls`` requests, each answered with tool results (or a nudge)."""
    from kvb_server.schemas.generation_requests import ChatMessage
    from kvb_server.tool_calls import tool_plan
    from kvb_server.tool_calls.prompt import template_messages
    from kvb_server.tool_calls.syntax import hermes

    history: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.user}]
    records = []
    for call in range(args.calls):
        choice = "auto" if call == args.calls - 1 else "required"
        request: dict = {"model": model, "max_tokens": args.max_tokens, "temperature": 0}
        if variant == "prompted":
            # What kvboost feeds SmolLM2's template, rendered by the client (tools in the system prompt).
            syntax = hermes(native=False)
            plan = tool_plan(TOOLS, choice, False, syntax)
            msgs = [ChatMessage.model_validate(m) for m in history]
            request["messages"] = template_messages(msgs, syntax, plan)
        else:
            request |= {
                "messages": list(history),
                "tools": TOOLS,
                "tool_choice": choice,
                "parallel_tool_calls": args.parallel,
            }
        rec = CallRecord(loop=loop, call=call + 1, tool_choice=choice)
        stream_call(api, server, request, rec)
        raw = [(c["name"], c["arguments"]) for c in rec.calls]
        rec.calls = judge_calls(raw, task, "tool_calls")
        if not rec.calls and variant == "prompted":
            rec.calls = judge_calls(text_calls(rec.content or ""), task, "text tags")
        if server == "kvboost" and rec.calls and rec.finish_reason not in ("tool_calls", "length"):
            record_bug(server, request, f"tool_calls present but finish_reason={rec.finish_reason!r}")
        records.append(rec)
        print(
            f"    {server}/{variant} loop {loop} call {rec.call}: prompt {rec.prompt_tokens} cached "
            f"{rec.cached_tokens} ttft {rec.ttft_ms or 0:.0f} ms total {rec.latency_ms:.0f} ms "
            f"calls {[c['name'] for c in rec.calls]} valid {rec.valid_call} {rec.finish_reason} {rec.error or ''}",
            flush=True,
        )
        if rec.error:
            break
        usable = [c for c in rec.calls if c["parsed"] and c["name"] in TOOL_RESULTS]
        if usable:
            ids = [f"call_{loop}_{call}_{j}" for j in range(len(usable))]
            history.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": i,
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for i, c in zip(ids, usable)
                    ],
                }
            )
            for i, c in zip(ids, usable):
                history.append(
                    {"role": "tool", "tool_call_id": i, "content": json.dumps(TOOL_RESULTS[c["name"]])}
                )
        else:
            history.append({"role": "assistant", "content": rec.content or ""})
            history.append({"role": "user", "content": NUDGE})
    return records


def warm_up(api: Any, model: str, attempts: int = 3) -> dict:
    """One short greedy request unrelated to the loops (transformers' CB manager is built by the first).

    NOTE: transformers serve sometimes drops the connection of its very first request (``Server
    disconnected without sending a response``, seen twice in ~5 starts here); the warm-up retries and the
    failures are recorded.
    """
    import openai

    failures = []
    for _ in range(attempts):
        t0 = time.perf_counter()
        try:
            api.chat.completions.create(
                model=model, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "Say hello."}]
            )
            return {"seconds": time.perf_counter() - t0, "failures": failures}
        except openai.APIConnectionError as exc:
            failures.append(f"after {time.perf_counter() - t0:.1f} s: {exc!r} (cause {exc.__cause__!r})")
    raise RuntimeError(f"warm-up failed {attempts} times: {failures}")


def parallel_probe(api: Any, model: str, args: argparse.Namespace) -> list[dict]:
    """First call of each task with parallel tool calls on (OpenAI's default): how many calls come back."""
    out = []
    for loop, task in enumerate(TASKS[: args.loops]):
        rec = CallRecord(loop=loop, call=1, tool_choice="required")
        request = {
            "model": model,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "tools": TOOLS,
            "tool_choice": "required",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.user}],
        }
        stream_call(api, "kvboost", request, rec)
        calls = judge_calls([(c["name"], c["arguments"]) for c in rec.calls], task, "tool_calls")
        out.append(
            {
                "loop": loop,
                "calls": len(calls),
                "valid": sum(c["valid"] for c in calls),
                "distinct": len({(c["name"], c["arguments"]) for c in calls}),
                "finish_reason": rec.finish_reason,
                "completion_tokens": rec.completion_tokens,
                "error": rec.error,
            }
        )
    return out


def run_server(spec: Any, variants: dict[str, int], args: argparse.Namespace, log_dir: Path) -> dict:
    import openai
    from server_procs import running

    out: dict = {"variants": {}}
    try:
        with running(
            spec, threads=args.threads, log_dir=log_dir, startup_timeout_s=args.startup_timeout
        ) as srv:
            out |= {"startup_s": srv.startup_s, "log": str(srv.log)}
            api = openai.OpenAI(
                base_url=f"{srv.url}/v1", api_key="bench", timeout=args.request_timeout, max_retries=0
            )
            out["warmup"] = warm_up(api, spec.model_field)
            for variant, loops in variants.items():
                records = []
                for loop, task in enumerate(TASKS[:loops]):
                    records += agent_loop(api, spec.model_field, spec.name, variant, loop, task, args)
                out["variants"][variant] = [asdict(r) | {"valid_call": r.valid_call} for r in records]
            if spec.name == "kvboost" and args.parallel_probe:
                out["parallel_probe"] = parallel_probe(api, spec.model_field, args)
            log = srv.log.read_text(errors="replace")
            out["log_tail"] = log[-4000:]
            # What the server says it ignored (transformers logs it at info level, once per request).
            out["ignored_fields"] = sorted({line.strip() for line in log.splitlines() if "Ignoring" in line})
    except Exception as exc:  # one server failing must not lose the other's numbers
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  {spec.name}: FAILED: {out['error'][:2000]}", flush=True)
    return out


# -- summary ------------------------------------------------------------------------------------------------


def _med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _cached_share(records: list[dict]) -> float | None:
    """Median share of the prompt served from cache, over the records whose server reported it."""
    return _med(
        [
            r["cached_tokens"] / r["prompt_tokens"]
            for r in records
            if r["cached_tokens"] is not None and r["prompt_tokens"]
        ]
    )


def summarize_loops(records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None]
    by_call: dict[int, list[dict]] = {}
    for r in ok:
        by_call.setdefault(r["call"], []).append(r)
    per_call = {
        k: {
            "n": len(rs),
            "prompt_tokens": _med([r["prompt_tokens"] for r in rs]),
            "cached_tokens": _med([r["cached_tokens"] for r in rs]),
            "cached_share": _cached_share(rs),
            "ttft_ms": _med([r["ttft_ms"] for r in rs]),
            "latency_ms": _med([r["latency_ms"] for r in rs]),
            "completion_tokens": _med([r["completion_tokens"] for r in rs]),
            "valid": sum(r["valid_call"] for r in rs),
        }
        for k, rs in sorted(by_call.items())
    }
    required = [r for r in ok if r["tool_choice"] == "required"]
    calls = [c for r in ok for c in r["calls"]]
    later = [r for r in ok if r["call"] >= 2]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "valid_required": sum(r["valid_call"] for r in required),
        "required": len(required),
        "calls_total": len(calls),
        "calls_valid": sum(c["valid"] for c in calls),
        "calls_needed_tool": sum(c["needed"] for c in calls),
        "final_auto": [("calls" if r["calls"] else "text") for r in ok if r["tool_choice"] == "auto"],
        "finish_reasons": {
            f: sum(r["finish_reason"] == f for r in ok) for f in {r["finish_reason"] for r in ok}
        },
        "cached_reported": any(r["cached_tokens"] is not None for r in ok),
        "cached_share_call2plus": _cached_share(later),
        "ttft_ms_call2plus": _med([r["ttft_ms"] for r in later]),
        "latency_ms_all": _med([r["latency_ms"] for r in ok]),
        "per_call": per_call,
    }


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def report(results: dict) -> str:
    lines: list[str] = []
    eng = results.get("engine", {})
    if "compile" in eng:
        c = eng["compile"]
        lines += [
            "### Grammar compile (cold GrammarCache entry, tokenizer warm; medians)",
            "",
            "| tools | tool_choice | grammar chars | build (tool_plan + tool_grammar) ms | check_grammar ms | compile ms (max) |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for row in c["per_set"].values():
            lines.append(
                f"| {row['tools']} | {row['tool_choice']} | {row['grammar_chars']} | {row['build_ms']:.2f} | "
                f"{row['check_ms']:.2f} | {row['compile_ms']:.1f} ({row['compile_ms_max']:.1f}) |"
            )
        lines += [
            "",
            f"llguidance tokenizer init (once per tokenizer): {c['tokenizer_init_ms']:.0f} ms; cached grammar per request: {c['cached_state_us']:.0f} us",
            "",
        ]
    if "decode" in eng:
        lines += [
            "### Decode, constrained by the tool grammar vs unconstrained (batch 1, medians)",
            "",
            "| plan | prompts x repeats | median tokens | tok/s constrained | tok/s plain | cost (median of per-prompt) | per-prompt range | target <= 10% |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for label, d in eng["decode"].items():
            met = "met" if d["median_cost_pct"] <= 10 else "missed"
            costs = [r["cost_pct"] for r in d["per_prompt"]]
            lines.append(
                f"| {label} | {d['samples']} | {d['median_tokens']:.0f} | {d['median_constrained_tok_s']:.1f} | "
                f"{d['median_plain_tok_s']:.1f} | {d['median_cost_pct']:+.1f}% | "
                f"{min(costs):+.1f}% .. {max(costs):+.1f}% | {met} |"
            )
        lines.append("")
    for name, srv in results.get("servers", {}).items():
        if "error" in srv:
            lines += [f"{name}: FAILED: {srv['error'][:500]}", ""]
        for variant, summary in srv.get("summary", {}).items():
            lines += [
                f"### {name} ({variant}): per call index, medians over loops",
                "",
                "| call | tool_choice | n | prompt tokens | cached tokens | cached share | TTFT ms | latency ms | completion tokens | valid tool call |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for k, row in summary["per_call"].items():
                choice = "auto" if int(k) == max(int(x) for x in summary["per_call"]) else "required"
                share = (
                    fmt(row["cached_share"] * 100, ".0f") + "%" if row["cached_share"] is not None else "n/a"
                )
                lines.append(
                    f"| {k} | {choice} | {row['n']} | {fmt(row['prompt_tokens'])} | {fmt(row['cached_tokens'])} | "
                    f"{share} | {fmt(row['ttft_ms'])} | {fmt(row['latency_ms'])} | {fmt(row['completion_tokens'])} | "
                    f"{row['valid']}/{row['n']} |"
                )
            lines += [
                "",
                f"valid on required calls: {summary['valid_required']}/{summary['required']}; calls "
                f"schema-valid {summary['calls_valid']}/{summary['calls_total']}, of a tool the task needs "
                f"{summary['calls_needed_tool']}/{summary['calls_total']}; last (auto) call: {summary['final_auto']}; "
                f"finish reasons {summary['finish_reasons']}; errors {summary['errors']}",
                "",
            ]
        for variant, recs in srv.get("variants", {}).items():
            loops = sorted({r["loop"] for r in recs})
            calls = sorted({r["call"] for r in recs})
            cell = {(r["loop"], r["call"]): r for r in recs}
            lines += [
                f"{name} ({variant}) per loop: tool called (+ schema-valid, ~ invalid, - none), [cached/]prompt tokens, TTFT",
                "",
                "| task | " + " | ".join(f"call {c}" for c in calls) + " |",
                "|---" * (len(calls) + 1) + "|",
            ]
            for loop in loops:
                cells = []
                for c in calls:
                    r = cell.get((loop, c))
                    if r is None:
                        cells.append("")
                        continue
                    names = ",".join(x["name"] + ("+" if x["valid"] else "~") for x in r["calls"]) or "-"
                    tokens = (
                        f"{r['cached_tokens']}/{r['prompt_tokens']}"
                        if r["cached_tokens"] is not None
                        else f"{r['prompt_tokens']}"
                    )
                    cells.append(f"{names} {tokens}, {fmt((r['ttft_ms'] or 0) / 1e3, '.1f')} s")
                lines.append(f"| {loop} | " + " | ".join(cells) + " |")
            lines.append("")
        if srv.get("ignored_fields"):
            lines += [f"{name} log: " + "; ".join(srv["ignored_fields"]), ""]
        if srv.get("parallel_probe"):
            p = srv["parallel_probe"]
            lines += [
                f"{name} first call with parallel tool calls on: calls per reply {[x['calls'] for x in p]}, "
                f"distinct {[x['distinct'] for x in p]}, finish {[x['finish_reason'] for x in p]}",
                "",
            ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = []
    for name, srv in results.get("servers", {}).items():
        for variant, summary in srv.get("summary", {}).items():
            series.append((f"{name} ({variant})", summary["per_call"]))
    if not series:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, per_call in series:
        xs = [int(k) for k in per_call]
        ax2.plot(xs, [per_call[k]["latency_ms"] for k in per_call], marker="o", label=label)
        if label.startswith("kvboost"):
            ax1.plot(xs, [per_call[k]["prompt_tokens"] for k in per_call], marker="o", label="prompt tokens")
            ax1.plot(xs, [per_call[k]["cached_tokens"] for k in per_call], marker="s", label="cached tokens")
    ax1.set(
        title="kvboost: prompt vs cached tokens per call", xlabel="call in the agent loop", ylabel="tokens"
    )
    # NOTE: latency, not TTFT: kvboost streams a tool call once its name is complete (~12 tokens in).
    ax2.set(
        title="latency of a whole reply (median over loops)", xlabel="call in the agent loop", ylabel="ms"
    )
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--loops", type=int, default=4, help=f"agent loops per server (one task each, at most {len(TASKS)})"
    )
    p.add_argument(
        "--calls", type=int, default=6, help="requests per agent loop (the last uses tool_choice auto)"
    )
    p.add_argument("--repeats", type=int, default=3, help="engine decode: repetitions of every prompt")
    p.add_argument("--prompts", type=int, default=6, help=f"engine decode: prompts (at most {len(TASKS)})")
    p.add_argument("--compile-trials", type=int, default=5, help="cold compiles per tool set (median)")
    p.add_argument("--engine-max-tokens", type=int, default=96, help="engine decode: max new tokens")
    p.add_argument(
        "--engine-plans",
        nargs="+",
        choices=list(ENGINE_PLANS),
        default=list(ENGINE_PLANS),
        help="engine decode plans: single (required, parallel_tool_calls off), parallel (required, up to 8 "
        "calls), auto (text or calls)",
    )
    p.add_argument("--max-tokens", type=int, default=80, help="server calls: max_tokens")
    p.add_argument("--parallel", action="store_true", help="agent loops with parallel_tool_calls on")
    p.add_argument(
        "--no-parallel-probe",
        dest="parallel_probe",
        action="store_false",
        help="skip kvboost's first-call probe with parallel tool calls on",
    )
    p.add_argument("--peer-asis-loops", type=int, default=1, help="peer loops with the unchanged request")
    p.add_argument(
        "--peer-cb-memory",
        type=float,
        default=0.1,
        help="transformers serve --cb-max-memory-percent (its default, 0.6-0.9 of free memory, got it OOM-killed)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server (OMP_NUM_THREADS)")
    p.add_argument(
        "--skip", nargs="*", default=[], choices=["engine", "kvboost", "transformers"], help="phases to skip"
    )
    p.add_argument("--request-timeout", type=float, default=300, help="seconds one request may take")
    p.add_argument(
        "--startup-timeout", type=float, default=900, help="seconds a server may take to answer /health"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 1 loop of 3 calls, 2 prompts, 1 repeat, temp folder"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="JSON path (default docs/bench_tools.json; plot beside it)"
    )
    args = p.parse_args()
    if args.quick:
        args.loops, args.calls, args.prompts, args.repeats, args.compile_trials = 1, 3, 2, 1, 2
    args.loops, args.prompts = min(args.loops, len(TASKS)), min(args.prompts, len(TASKS))
    out = args.out or (
        Path(tempfile.gettempdir()) / "kvboost-bench" / "bench_tools.json"
        if args.quick
        else ROOT / "docs" / "bench_tools.json"
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    t_start = time.monotonic()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_server import environment
    from server_procs import (
        TRANSFORMERS_VERSION,
        ensure_transformers_venv,
        kvboost_spec,
        save_results,
        transformers_spec,
    )

    from kvb_cache.embedded import cache_root, embedded_model_path

    model_path = embedded_model_path()
    venv = ensure_transformers_venv(cache_root() / "bench-venvs" / f"transformers-{TRANSFORMERS_VERSION[:4]}")
    # Its paged KV cache defaults to 60-90% of the free memory: on this shared machine the kernel OOM-killed
    # it (13.4 GB resident) on its first request; 10% (~2 GB, far more than one agent loop needs) keeps it
    # alive.
    peer = transformers_spec(venv, model_path, cb_max_memory_percent=args.peer_cb_memory)
    # At info level transformers serve logs the request fields it ignores (tool_choice, ...).
    peer = dataclasses.replace(peer, argv=tuple("info" if a == "warning" else a for a in peer.argv))
    specs = {"kvboost": kvboost_spec(model_path), "transformers": peer}
    results: dict = {
        "config": vars(args) | {"out": str(out), "model_path": model_path},
        "environment": environment(args, venv, specs),
        "tools": TOOLS,
        "tasks": [asdict(t) for t in TASKS[: args.loops]],
        "servers": {},
    }
    if "engine" not in args.skip:
        print("engine ...", flush=True)
        t0 = time.monotonic()
        results["engine"] = run_engine(args)
        results["engine"]["phase_s"] = time.monotonic() - t0
    plans = {
        "kvboost": {"as-is": args.loops},
        "transformers": {"as-is": args.peer_asis_loops, "prompted": args.loops},
    }
    for name in ("kvboost", "transformers"):
        if name in args.skip:
            continue
        print(f"{name} server ...", flush=True)
        t0 = time.monotonic()
        srv = run_server(
            specs[name],
            {k: v for k, v in plans[name].items() if v},
            args,
            out.parent / "logs" / "bench_tools",
        )
        srv["phase_s"] = time.monotonic() - t0
        srv["summary"] = {v: summarize_loops(recs) for v, recs in srv.get("variants", {}).items()}
        results["servers"][name] = srv
    results["elapsed_s"] = time.monotonic() - t_start
    table = report(results)
    print("\n" + table)
    results["tables_md"] = table
    save_results(results, out, plot, "bench_tools.png")
    failed = [name for name, srv in results["servers"].items() if "error" in srv]
    if failed:  # the numbers of the others are saved; the run still failed (nox, CI scripts see it)
        sys.exit(f"bench_tools: the {', '.join(failed)} phase failed (see 'error' in {out})")


if __name__ == "__main__":
    main()
