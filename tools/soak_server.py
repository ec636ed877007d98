"""Soak: drive one ``kvboost-server`` with a mixed workload for many minutes, then check it is idle again.

Earlier load runs (``tools/reliability_load.py``) checked latency and failures over a minute. This one
runs longer and asks whether the server *returns to its idle state*: after the load stops, nothing is
running or waiting, no KV block is still owned by a finished or aborted request, the engine's counters add
up, Prometheus counters never went down and no gauge went negative, RSS stopped climbing once the block
pool was warm, a greedy request answers as it did right after startup, and no client call hung.

Workload (``--concurrency`` client tasks until the deadline, each picking a kind by weight): chat and
completions, streamed and not, ``n=2``, stop strings, logprobs / top_logprobs, tools (``tool_choice``
required and auto), ``response_format`` json_schema, ``/v1/responses`` with a ``previous_response_id``
follow-up, ``max_tokens: 1``, long prompts (``pydoc_data.topics`` documents; chat turns from
``chitchat_dataset`` when installed), streams the client closes after a few chunks, clients that time
out, requests the server must refuse (bad parameters, a prompt past the context), ``/tokenize`` and a rare
``POST /v1/cache/reset``.

```bash
python tools/soak_server.py --start --minutes 16 --concurrency 8          # spawns the server on :8041
python tools/soak_server.py --url http://127.0.0.1:8041 --pid 1234 --log server.log --minutes 5
```

Exit status 1 when a check fails. Timings are those of the machine; the checks are about state, not speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

MODEL = "smollm2-135m"
#: Client timeout of every call but the ``timeout`` kind: a call past it counts as hung.
CALL_TIMEOUT_S = 240.0

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

#: (kind, weight). ``refused_*`` must get a 4xx; ``disconnect`` and ``timeout`` leave on purpose.
KINDS = (
    ("chat", 10),
    ("chat_stream", 10),
    ("completion", 8),
    ("completion_stream", 8),
    ("chat_n2", 5),
    ("completion_stop", 5),
    ("chat_logprobs", 5),
    ("completion_logprobs", 4),
    ("tools_required", 4),
    ("tools_auto", 4),
    ("json_schema", 4),
    ("responses", 5),
    ("max_tokens_1", 4),
    ("long_prompt", 5),
    ("long_prompt_stream", 3),
    ("disconnect", 6),
    ("timeout", 2),
    ("refused_params", 3),
    ("refused_too_long", 2),
    ("tokenize", 4),
    ("cache_reset", 0.3),
)

#: Reference requests (temperature 0) sent right after startup and again at the end.
GREEDY = (
    ("/v1/completions", {"prompt": "The three primary colours are", "max_tokens": 24, "temperature": 0}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Name two planets and say one fact about each."}],
            "max_tokens": 32,
            "temperature": 0,
        },
    ),
)


# --------------------------------------------------------------------------------------------- texts
@dataclass
class Texts:
    """Real text to build prompts from: Python's reference topics and human chit-chat turns."""

    docs: list[str]
    chats: list[list[str]]

    @classmethod
    def load(cls) -> Texts:
        import pydoc_data.topics

        docs = [v for v in pydoc_data.topics.topics.values() if len(v) > 400]
        chats: list[list[str]] = []
        try:
            import chitchat_dataset

            for i, conv in enumerate(chitchat_dataset.Dataset().values()):
                turns = [" ".join(m["text"] for m in group) for group in conv["messages"]]
                if len(turns) >= 2:
                    chats.append(turns)
                if i >= 2000:
                    break
        except ImportError:
            pass
        if not chats:  # no chit-chat: short snippets of the docs play the conversation
            chats = [[d[i : i + 160] for i in range(0, 800, 160)] for d in docs[:200]]
        return cls(docs=docs, chats=chats)

    def doc(self, rng: random.Random, chars: int) -> str:
        d = rng.choice(self.docs)
        start = rng.randrange(max(1, len(d) - chars))
        return d[start : start + chars]

    def messages(self, rng: random.Random, turns: int = 3) -> list[dict]:
        conv = rng.choice(self.chats)
        k = min(len(conv), rng.randint(1, turns))
        start = rng.randrange(len(conv) - k + 1)
        msgs = []
        for j, text in enumerate(conv[start : start + k]):
            role = "user" if (k - j) % 2 == 1 else "assistant"
            msgs.append({"role": role, "content": text[:600]})
        return msgs


# ------------------------------------------------------------------------------------------ outcomes
@dataclass
class Outcomes:
    """What the clients saw, by kind and by (route, status)."""

    by_kind: Counter = field(default_factory=Counter)
    by_route_status: Counter = field(default_factory=Counter)
    left_on_purpose: Counter = field(default_factory=Counter)
    expected_timeouts: int = 0
    hung: list[str] = field(default_factory=list)  # calls past CALL_TIMEOUT_S
    failures: list[str] = field(default_factory=list)  # unexpected status / transport error / bad body
    #: Requests cut by the client before a status line arrived, by route (the server may still log them).
    no_status: Counter = field(default_factory=Counter)

    def fail(self, kind: str, what: str) -> None:
        self.failures.append(f"{kind}: {what}"[:300])


# ---------------------------------------------------------------------------------------- requests
class Driver:
    def __init__(self, client: httpx.AsyncClient, texts: Texts, outcomes: Outcomes) -> None:
        self.c = client
        self.t = texts
        self.o = outcomes

    async def post(self, kind: str, route: str, body: dict, *, expect: int = 200) -> dict | None:
        try:
            r = await self.c.post(route, json=body, timeout=CALL_TIMEOUT_S)
        except httpx.TimeoutException:
            self.o.no_status[route] += 1
            self.o.hung.append(f"{kind} {route}")
            return None
        except httpx.HTTPError as exc:
            self.o.no_status[route] += 1
            self.o.fail(kind, f"{route} {type(exc).__name__}: {exc}")
            return None
        self.o.by_route_status[(route, r.status_code)] += 1
        ok = r.status_code == expect if expect != 400 else 400 <= r.status_code < 500
        if kind == "cache_reset":  # 200 when the engine happened to be idle, else 409
            ok = r.status_code in (200, 409)
        if not ok:
            self.o.fail(kind, f"{route} -> {r.status_code} {r.text[:200]}")
            return None
        return r.json()

    async def stream(self, kind: str, route: str, body: dict, *, leave_after: int | None = None) -> None:
        """Read an SSE stream to ``[DONE]`` (or leave after ``leave_after`` data events)."""
        events = 0
        try:
            async with self.c.stream("POST", route, json=body, timeout=CALL_TIMEOUT_S) as r:
                self.o.by_route_status[(route, r.status_code)] += 1
                if r.status_code != 200:
                    await r.aread()
                    self.o.fail(kind, f"{route} -> {r.status_code} {r.text[:200]}")
                    return
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]" or re.search(
                        r'"type": ?"response\.(completed|incomplete|failed)"', data
                    ):
                        done = True  # Responses API streams end with a terminal event, no [DONE]
                        break
                    if '"error"' in data and json.loads(data).get("error"):
                        self.o.fail(kind, f"{route} error event {data[:200]}")
                        return
                    events += 1
                    if leave_after is not None and events >= leave_after:
                        self.o.left_on_purpose[kind] += 1
                        return  # closing the response here drops the connection mid-stream
                if not done and leave_after is None:
                    self.o.fail(kind, f"{route} stream ended without [DONE] after {events} events")
        except httpx.TimeoutException:
            self.o.hung.append(f"{kind} {route} (stream, {events} events)")
        except httpx.HTTPError as exc:
            self.o.fail(kind, f"{route} stream {type(exc).__name__}: {exc}")

    async def run(self, kind: str, rng: random.Random) -> None:
        t = self.t
        mt = rng.choice([8, 16, 32])
        temp = rng.choice([0, 0.7, 1.0])
        chat = {"model": MODEL, "max_tokens": mt, "temperature": temp}
        comp = {"model": MODEL, "max_tokens": mt, "temperature": temp}
        if kind == "chat":
            await self.post(kind, "/v1/chat/completions", chat | {"messages": t.messages(rng)})
        elif kind == "chat_stream":
            body = chat | {"messages": t.messages(rng), "stream": True}
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            await self.stream(kind, "/v1/chat/completions", body)
        elif kind == "completion":
            await self.post(kind, "/v1/completions", comp | {"prompt": t.doc(rng, 400)})
        elif kind == "completion_stream":
            await self.stream(kind, "/v1/completions", comp | {"prompt": t.doc(rng, 400), "stream": True})
        elif kind == "chat_n2":
            body = chat | {"messages": t.messages(rng), "n": 2, "temperature": 0.8}
            if rng.random() < 0.5:
                await self.stream(kind, "/v1/chat/completions", body | {"stream": True})
            else:
                await self.post(kind, "/v1/chat/completions", body)
        elif kind == "completion_stop":
            body = comp | {"prompt": t.doc(rng, 300), "stop": [".", "\n", " the"], "max_tokens": 32}
            if rng.random() < 0.5:
                await self.stream(kind, "/v1/completions", body | {"stream": True})
            else:
                await self.post(kind, "/v1/completions", body)
        elif kind == "chat_logprobs":
            body = chat | {
                "messages": t.messages(rng),
                "logprobs": True,
                "top_logprobs": rng.choice([0, 3, 5]),
            }
            if rng.random() < 0.5:
                await self.stream(kind, "/v1/chat/completions", body | {"stream": True})
            else:
                await self.post(kind, "/v1/chat/completions", body)
        elif kind == "completion_logprobs":
            await self.post(
                kind,
                "/v1/completions",
                comp | {"prompt": t.doc(rng, 300), "logprobs": 2, "echo": rng.random() < 0.3},
            )
        elif kind in ("tools_required", "tools_auto"):
            city = rng.choice(["Paris", "Lima", "Osaka", "Accra", "Oslo"])
            body = chat | {
                "messages": [{"role": "user", "content": f"What is the weather in {city} right now?"}],
                "tools": [WEATHER_TOOL],
                "tool_choice": "required" if kind == "tools_required" else "auto",
                "max_tokens": 48,
            }
            if rng.random() < 0.4:
                await self.stream(kind, "/v1/chat/completions", body | {"stream": True})
            else:
                await self.post(kind, "/v1/chat/completions", body)
        elif kind == "json_schema":
            body = chat | {
                "messages": [
                    {"role": "user", "content": "Invent a person. " + t.messages(rng, 1)[0]["content"][:200]}
                ],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
                },
                "max_tokens": 48,
            }
            await self.post(kind, "/v1/chat/completions", body)
        elif kind == "responses":
            first = await self.post(
                kind,
                "/v1/responses",
                {
                    "model": MODEL,
                    "input": t.messages(rng, 1)[0]["content"],
                    "max_output_tokens": mt,
                    "temperature": temp,
                },
            )
            if first is not None and rng.random() < 0.7:
                follow = {
                    "model": MODEL,
                    "input": "And then?",
                    "previous_response_id": first["id"],
                    "max_output_tokens": mt,
                }
                if rng.random() < 0.3:
                    await self.stream(kind, "/v1/responses", follow | {"stream": True})
                else:
                    await self.post(kind, "/v1/responses", follow)
        elif kind == "max_tokens_1":
            if rng.random() < 0.5:
                await self.post(
                    kind, "/v1/chat/completions", chat | {"messages": t.messages(rng), "max_tokens": 1}
                )
            else:
                await self.stream(
                    kind,
                    "/v1/completions",
                    comp | {"prompt": t.doc(rng, 200), "max_tokens": 1, "stream": True},
                )
        elif kind == "long_prompt":
            doc = t.doc(rng, rng.choice([3000, 6000, 9000]))
            await self.post(
                kind, "/v1/completions", comp | {"prompt": doc + "\n\nIn short,", "max_tokens": 16}
            )
        elif kind == "long_prompt_stream":
            doc = t.doc(rng, rng.choice([3000, 6000]))
            msgs = [{"role": "user", "content": f"Summarise this:\n{doc}"}]
            await self.stream(
                kind, "/v1/chat/completions", chat | {"messages": msgs, "max_tokens": 24, "stream": True}
            )
        elif kind == "disconnect":
            route, body = rng.choice(
                [
                    ("/v1/chat/completions", chat | {"messages": t.messages(rng)}),
                    ("/v1/completions", comp | {"prompt": t.doc(rng, 600)}),
                    (
                        "/v1/chat/completions",
                        chat | {"messages": t.messages(rng), "n": 2, "temperature": 0.9},
                    ),
                ]
            )
            await self.stream(
                kind, route, body | {"stream": True, "max_tokens": 64}, leave_after=rng.randint(1, 4)
            )
        elif kind == "timeout":
            await self._timeout(rng)
        elif kind == "refused_params":
            bad = rng.choice(
                [
                    {"temperature": -1},
                    {"max_tokens": -5},
                    {"n": 0},
                    {"top_p": 7},
                    {"logprobs": True, "top_logprobs": 99},
                    {"stop": 42},
                    {"tool_choice": "required"},  # without tools
                    {"response_format": {"type": "json_schema"}},
                ]
            )
            await self.post(
                kind, "/v1/chat/completions", chat | {"messages": t.messages(rng, 1)} | bad, expect=400
            )
        elif kind == "refused_too_long":
            prompt = " ".join(t.docs[i % len(t.docs)] for i in range(rng.randrange(8), 30))
            if rng.random() < 0.5:
                await self.post(kind, "/v1/completions", comp | {"prompt": prompt[:200000]}, expect=400)
            else:
                await self.post(
                    kind, "/v1/completions", comp | {"prompt": "Hi", "max_tokens": 10**7}, expect=400
                )
        elif kind == "tokenize":
            if rng.random() < 0.5:
                await self.post(kind, "/tokenize", {"model": MODEL, "prompt": t.doc(rng, 1000)})
            else:
                await self.post(kind, "/tokenize", {"model": MODEL, "messages": t.messages(rng)})
        elif kind == "cache_reset":
            # The engine refuses a reset while requests run (409 cache_busy, docs/server.md): under this
            # load that is the usual answer; the idle reset at the end checks that a reset empties the pool.
            await self.post(kind, "/v1/cache/reset", {})
        else:  # pragma: no cover
            raise ValueError(kind)

    async def _timeout(self, rng: random.Random) -> None:
        """A client that gives up after 0.5-2 s on a long generation (non-streamed or streamed)."""
        kind = "timeout"
        body = {"model": MODEL, "prompt": self.t.doc(rng, 2000), "max_tokens": 200, "temperature": 0.7}
        give_up = rng.uniform(0.5, 2.0)
        try:
            if rng.random() < 0.5:
                r = await self.c.post("/v1/completions", json=body, timeout=give_up)
                self.o.by_route_status[("/v1/completions", r.status_code)] += 1
            else:
                async with self.c.stream(
                    "POST", "/v1/completions", json=body | {"stream": True}, timeout=give_up
                ) as r:
                    self.o.by_route_status[("/v1/completions", r.status_code)] += 1
                    async for _ in r.aiter_lines():
                        pass
        except httpx.TimeoutException:
            self.o.no_status["/v1/completions"] += 1  # or cut mid-stream after a 200: an upper bound
            self.o.expected_timeouts += 1
            self.o.left_on_purpose[kind] += 1
        except httpx.HTTPError as exc:
            self.o.fail(kind, f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------ server state
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to ``{sample name with labels: value}`` (``_created`` samples dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if "_created" in name.split("{")[0]:
            continue
        out[name] = float(value)
    return out


def metric_types(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def is_monotone_sample(name: str, types: dict[str, str]) -> bool:
    base = name.split("{")[0]
    for suffix in ("_total", "_count", "_sum", "_bucket"):
        if base.endswith(suffix) and types.get(base[: -len(suffix)]) in ("counter", "histogram"):
            return True
    return types.get(base) == "counter"


@dataclass
class Snapshot:
    at_s: float
    rss_mib: float | None
    stats: dict
    metrics: dict[str, float]
    types: dict[str, str]


async def snapshot(client: httpx.AsyncClient, proc: psutil.Process | None, t0: float) -> Snapshot:
    stats = (await client.get("/v1/stats", timeout=60)).json()
    text = (await client.get("/metrics", timeout=60)).text
    rss = proc.memory_info().rss / 2**20 if proc is not None else None
    return Snapshot(time.monotonic() - t0, rss, stats, parse_metrics(text), metric_types(text))


async def greedy_texts(client: httpx.AsyncClient) -> list[str]:
    texts = []
    for route, body in GREEDY:
        r = await client.post(route, json={"model": MODEL} | body, timeout=CALL_TIMEOUT_S)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        texts.append(choice["message"]["content"] if "message" in choice else choice["text"])
    return texts


# --------------------------------------------------------------------------------------------- run
async def client_task(
    driver: Driver, rng: random.Random, deadline: float, kinds: list[str], weights: list[float]
) -> None:
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        driver.o.by_kind[kind] += 1
        try:
            await driver.run(kind, rng)
        except Exception as exc:  # a bug of the driver or an unreadable body: record, keep going
            driver.o.fail(kind, f"driver {type(exc).__name__}: {exc}")


async def load(
    client: httpx.AsyncClient, texts: Texts, outcomes: Outcomes, seconds: float, concurrency: int, seed: int
) -> None:
    driver = Driver(client, texts, outcomes)
    kinds = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    deadline = time.monotonic() + seconds
    await asyncio.gather(
        *(
            client_task(driver, random.Random(seed * 1000 + i), deadline, kinds, weights)
            for i in range(concurrency)
        )
    )


async def settle(client: httpx.AsyncClient, timeout_s: float = 60.0) -> float:
    """Wait until the server reports nothing in flight; returns the seconds it took (or ``timeout_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        q = (await client.get("/v1/stats", timeout=30)).json()["queue"]
        if q["in_flight"] == 0 and q["waiting"] == 0 and q["running"] == 0:
            return time.monotonic() - t0
        await asyncio.sleep(1.0)
    return timeout_s


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_idle(base: Snapshot, end: Snapshot) -> list[Check]:
    q, p, cp = end.stats["queue"], end.stats["paged"], end.stats["cache"].get("paged", {})
    checks = [
        Check(
            "queue idle",
            q["running"] == 0 and q["waiting"] == 0 and q["in_flight"] == 0,
            f"running {q['running']}, waiting {q['waiting']}, in_flight {q['in_flight']}",
        ),
        Check(
            "engine idle (last step)",
            p["running"] == 0 and p["waiting"] == 0 and p["blocks_used"] == 0,
            f"running {p['running']}, waiting {p['waiting']}, blocks_used {p['blocks_used']}",
        ),
        Check(
            "blocks back (engine now)",
            cp.get("blocks_used") == 0
            and cp.get("running") == 0
            and cp.get("waiting") == 0
            and cp["blocks_cached"] + cp["blocks_free"] == cp["blocks_total"],
            f"used {cp.get('blocks_used')}, cached {cp.get('blocks_cached')}, free {cp.get('blocks_free')} of {cp.get('blocks_total')}"
            f" (after warm-up: used {base.stats['cache']['paged']['blocks_used']}, cached {base.stats['cache']['paged']['blocks_cached']})",
        ),
    ]
    d = {k: q[k] - base.stats["queue"][k] for k in ("added", "finished", "aborted", "rejected")}
    checks.append(
        Check(
            "added = finished + aborted",
            q["added"] == q["finished"] + q["aborted"] + q["in_flight"],
            f"total added {q['added']} = finished {q['finished']} + aborted {q['aborted']} + in flight {q['in_flight']};"
            f" soak: +{d['added']} = +{d['finished']} + +{d['aborted']} (rejected +{d['rejected']}), step_errors {q['step_errors']}",
        )
    )
    m0, m1 = base.metrics, end.metrics
    label = f'model_name="{MODEL}"'

    def succ(m: dict, reason: str) -> float:
        return m.get(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",{label}}}', 0.0)

    stop_len = succ(m1, "stop") + succ(m1, "length") - succ(m0, "stop") - succ(m0, "length")
    abort = succ(m1, "abort") - succ(m0, "abort")
    checks.append(
        Check(
            "vllm:request_success_total matches",
            abort == d["aborted"] and stop_len == d["finished"],
            f"soak: stop+length +{stop_len:.0f} (choices) vs finished +{d['finished']} (engine requests);"
            f" abort +{abort:.0f} vs aborted +{d['aborted']}",
        )
    )
    return checks


def check_metrics_series(snaps: list[Snapshot]) -> list[Check]:
    drops, negatives = [], []
    for a, b in itertools.pairwise(snaps):
        for name, v in a.metrics.items():
            if is_monotone_sample(name, b.types) and name in b.metrics and b.metrics[name] < v:
                drops.append(f"{name} {v} -> {b.metrics[name]} at {b.at_s:.0f}s")
    for s in snaps:
        for name, v in s.metrics.items():
            if v < 0:
                negatives.append(f"{name}={v} at {s.at_s:.0f}s")
    return [
        Check(
            "prometheus counters monotone",
            not drops,
            f"{len(snaps)} scrapes; " + ("; ".join(drops[:5]) or "no decrease"),
        ),
        Check("no negative sample", not negatives, "; ".join(negatives[:5]) or "none"),
    ]


def check_route_counts(base: Snapshot, end: Snapshot, outcomes: Outcomes) -> Check:
    """``kvboost_requests_total{route,status}`` over the soak against what the clients received."""
    off = []
    routes = {r for r, _ in outcomes.by_route_status} | set(outcomes.no_status)
    for route in sorted(routes):
        server: Counter = Counter()
        for name, v in end.metrics.items():
            m = re.fullmatch(r'kvboost_requests_total\{route="([^"]+)",status="(\d+)"\}', name)
            if m and m.group(1) == route:
                server[int(m.group(2))] += int(v - base.metrics.get(name, 0.0))
        client = Counter({s: n for (r, s), n in outcomes.by_route_status.items() if r == route})
        diff = {s: server[s] - client[s] for s in set(server) | set(client) if server[s] != client[s]}
        # a client that left before the status line was counted by the server under some status
        if sum(abs(v) for v in diff.values()) > 0 and not (
            all(v > 0 for v in diff.values()) and sum(diff.values()) <= outcomes.no_status[route]
        ):
            off.append(f"{route}: server-client {diff}")
    return Check(
        "HTTP counts match clients",
        not off,
        "; ".join(off)
        or f"{len(routes)} routes: kvboost_requests_total = responses seen (+ calls cut before a status)",
    )


def check_rss(samples: list[tuple[float, float]], max_ratio: float) -> Check:
    if len(samples) < 3:
        return Check("RSS growth", True, "not measured (no PID)")
    warm = samples[0][1]
    end = samples[-1][1]
    half = samples[len(samples) // 2 :]
    slope = (half[-1][1] - half[0][1]) / max(1e-9, (half[-1][0] - half[0][0]) / 60)
    ratio = end / warm
    return Check(
        "RSS growth",
        ratio <= max_ratio,
        f"{warm:.1f} MiB after warm-up -> {end:.1f} MiB at the end ({ratio:.4f}x, limit {max_ratio}x);"
        f" second half {slope:+.2f} MiB/min; peak {max(s[1] for s in samples):.1f} MiB",
    )


def check_log(log: Path | None, offset: int) -> Check:
    if log is None or not log.exists():
        return Check("server log clean", True, "not checked (no --log)")
    text = log.read_text(errors="replace")[offset:]
    tracebacks = text.count("Traceback")
    five = len(re.findall(r'" 5\d\d ', text))
    errors = [ln for ln in text.splitlines() if " ERROR " in ln]
    return Check(
        "server log clean",
        tracebacks == 0 and five == 0 and not errors,
        f"{tracebacks} tracebacks, {five} 5xx access lines, {len(errors)} ERROR lines"
        + (f": {errors[0][:200]}" if errors else ""),
    )


# -------------------------------------------------------------------------------------------- main
def start_server(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "kvb_server",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--max-num-seqs",
        "8",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    fh = log.open("w")
    return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


async def wait_healthy(client: httpx.AsyncClient, timeout_s: float, proc: subprocess.Popen | None) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/health", timeout=5)).status_code == 200:
                return
        await asyncio.sleep(1.0)
    raise TimeoutError("the server did not answer /health")


async def soak(args: argparse.Namespace) -> int:
    log = Path(args.log) if args.log else None
    server = None
    if args.start:
        log = log or Path(f"/tmp/soak_server_{args.port}.log")
        server = start_server(args.port, args.server_arg or [], log)
        pid = server.pid
        url = f"http://127.0.0.1:{args.port}"
    else:
        url, pid = args.url, args.pid
    proc = psutil.Process(pid) if pid else None
    texts = Texts.load()
    limits = httpx.Limits(
        max_connections=args.concurrency * 2 + 4, max_keepalive_connections=args.concurrency * 2 + 4
    )
    try:
        async with httpx.AsyncClient(base_url=url, limits=limits) as client:
            await wait_healthy(client, 180, server)
            t0 = time.monotonic()
            reference = await greedy_texts(client)
            print(f"[soak] reference greedy texts: {reference}", flush=True)
            log_offset = len(log.read_text(errors="replace")) if log and log.exists() else 0
            warm = Outcomes()
            await load(client, texts, warm, args.warmup_s, args.concurrency, args.seed + 1)
            await settle(client)
            base = await snapshot(client, proc, t0)
            print(
                f"[soak] warm-up done: {sum(warm.by_kind.values())} requests, RSS {base.rss_mib} MiB",
                flush=True,
            )

            outcomes = Outcomes()
            snaps = [base]
            rss = [(0.0, base.rss_mib)] if base.rss_mib is not None else []
            started = time.monotonic()
            load_task = asyncio.create_task(
                load(client, texts, outcomes, args.minutes * 60, args.concurrency, args.seed)
            )
            while not load_task.done():
                await asyncio.wait({load_task}, timeout=args.sample_s)
                s = await snapshot(client, proc, t0)
                snaps.append(s)
                if s.rss_mib is not None:
                    rss.append((time.monotonic() - started, s.rss_mib))
                q = s.stats["queue"]
                print(
                    f"[soak] {time.monotonic() - started:6.0f}s RSS {s.rss_mib} MiB, requests {sum(outcomes.by_kind.values())},"
                    f" in flight {q['in_flight']}, blocks used {s.stats['paged']['blocks_used']}"
                    f" cached {s.stats['paged']['blocks_cached']}, failures {len(outcomes.failures)}",
                    flush=True,
                )
            await load_task
            load_wall = time.monotonic() - started
            settle_s = await settle(client)
            await asyncio.sleep(2.0)
            end = await snapshot(client, proc, t0)
            snaps.append(end)
            if end.rss_mib is not None:
                rss[-1:] = [
                    (time.monotonic() - started, end.rss_mib)
                ]  # the idle state replaces the last sample
            again = await greedy_texts(client)
            await settle(client)
            reset = await client.post("/v1/cache/reset", json={}, timeout=60)
            after_reset = (await client.get("/v1/stats", timeout=60)).json()["cache"]["paged"]
            again_uncached = await greedy_texts(client)
    finally:
        if server is not None and not args.keep:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()

    checks = check_idle(base, end)
    checks += check_metrics_series(snaps)
    checks.append(check_route_counts(base, end, outcomes))
    checks.append(check_rss(rss, args.max_rss_ratio))
    checks.append(
        Check(
            "greedy text unchanged",
            again == reference,
            "identical" if again == reference else f"{reference} -> {again}",
        )
    )
    checks.append(
        Check(
            "idle reset empties the pool",
            reset.status_code == 200 and after_reset["blocks_free"] == after_reset["blocks_total"],
            f"reset {reset.status_code} {reset.text[:120]}; then free {after_reset['blocks_free']} of"
            f" {after_reset['blocks_total']} (cached {after_reset['blocks_cached']}, used {after_reset['blocks_used']})",
        )
    )
    checks.append(
        Check(
            "greedy text unchanged without cache",
            again_uncached == reference,
            "identical" if again_uncached == reference else f"{reference} -> {again_uncached}",
        )
    )
    checks.append(
        Check(
            "no hung call",
            not outcomes.hung and load_wall <= args.minutes * 60 + CALL_TIMEOUT_S and settle_s < 60,
            f"{len(outcomes.hung)} calls past {CALL_TIMEOUT_S:.0f}s; load ended {load_wall - args.minutes * 60:.0f}s after its deadline;"
            f" idle {settle_s:.0f}s after the last call",
        )
    )
    checks.append(
        Check(
            "no unexpected failure",
            not outcomes.failures,
            f"{len(outcomes.failures)}: " + " | ".join(outcomes.failures[:5]),
        )
    )
    checks.append(check_log(log, log_offset))
    report(args, outcomes, rss, checks, base, end, load_wall)
    if args.json:
        Path(args.json).write_text(
            json.dumps(report_dict(args, outcomes, rss, checks, base, end, load_wall), indent=2)
        )
    return 0 if all(c.ok for c in checks) else 1


def report_dict(args, outcomes, rss, checks, base, end, load_wall) -> dict:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "load_wall_s": round(load_wall, 1),
        "requests_by_kind": dict(sorted(outcomes.by_kind.items())),
        "left_on_purpose": dict(outcomes.left_on_purpose),
        "by_route_status": {f"{r} {s}": n for (r, s), n in sorted(outcomes.by_route_status.items())},
        "failures": outcomes.failures,
        "hung": outcomes.hung,
        "rss_mib": [(round(t), round(v, 1)) for t, v in rss],
        "queue_base": base.stats["queue"],
        "queue_end": end.stats["queue"],
        "paged_end": end.stats["cache"].get("paged"),
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
    }


def report(args, outcomes, rss, checks, base, end, load_wall) -> None:
    total = sum(outcomes.by_kind.values())
    print(f"\nSoak: {args.minutes} min x {args.concurrency} clients, {total} requests in {load_wall:.0f}s")
    print("\n| kind | requests |\n|---|---|")
    for k, n in sorted(outcomes.by_kind.items(), key=lambda kv: -kv[1]):
        extra = f" ({outcomes.left_on_purpose[k]} left on purpose)" if outcomes.left_on_purpose.get(k) else ""
        print(f"| {k} | {n}{extra} |")
    print("\n| route | status | responses |\n|---|---|---|")
    for (r, s), n in sorted(outcomes.by_route_status.items()):
        print(f"| {r} | {s} | {n} |")
    print("\n| minute | RSS MiB |\n|---|---|")
    for t, v in rss:
        print(f"| {t / 60:.1f} | {v:.1f} |")
    print("\n| check | result | detail |\n|---|---|---|")
    for c in checks:
        print(f"| {c.name} | {'ok' if c.ok else 'FAIL'} | {c.detail} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8041")
    where.add_argument(
        "--start",
        action="store_true",
        help=f"spawn kvboost-server --model {MODEL} --max-num-seqs 8 on --port",
    )
    p.add_argument("--port", type=int, default=8041, help="port for --start (default 8041)")
    p.add_argument(
        "--server-arg", action="append", help="extra kvboost-server argument for --start (repeatable)"
    )
    p.add_argument("--keep", action="store_true", help="leave the --start server running at the end")
    p.add_argument(
        "--pid", type=int, help="server PID with --url, for RSS samples (without it RSS is not checked)"
    )
    p.add_argument(
        "--log", help="server log to scan for tracebacks / 5xx (with --start: where it is written)"
    )
    p.add_argument("--minutes", type=float, default=16.0, help="soak duration after the warm-up (default 16)")
    p.add_argument(
        "--warmup-s", type=float, default=60.0, help="mixed load before the baseline snapshot (default 60)"
    )
    p.add_argument("--concurrency", type=int, default=8, help="concurrent client tasks (default 8)")
    p.add_argument(
        "--sample-s", type=float, default=60.0, help="seconds between RSS / stats / metrics samples"
    )
    p.add_argument(
        "--max-rss-ratio", type=float, default=1.10, help="end RSS / after-warm-up RSS allowed (default 1.10)"
    )
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--json", help="also write the report as JSON here")
    args = p.parse_args(argv)
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
