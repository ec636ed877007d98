"""Load: N concurrent clients for T seconds, streamed and non-streamed mixed, some leaving mid-stream.

Each client loops until the deadline: chat or completion (half each), streamed or not (half each); a
``disconnect_share`` of requests are streams the client closes after the first content chunk. Prompts
share a few system prompts (prefix reuse across requests, so blocks are shared and freed concurrently)
plus a distinct user part. Failures: any status other than 200 and the designed 503 (``queue_full``,
``shutting_down``), a transport error (reset, timeout), or a stream that ends without ``[DONE]`` or with an
error event. Latency is request start to the last byte of a completed request.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

MODEL = "smollm2-135m"

SYSTEM_PROMPTS = [
    "You are a concise assistant for a hardware store. Answer in one sentence and never invent prices.",
    "You are a travel helper. Suggest one place to visit and say why, in plain words, without lists.",
    "You are a patient math tutor. Give the next step only, not the full solution, and ask a question.",
    "You summarise support tickets for engineers: name the component, the symptom and the urgency.",
]


@dataclass
class LoadReport:
    clients: int
    seconds: float
    completed: int = 0
    disconnected: int = 0
    designed_503: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    by_kind: Counter = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        lat = sorted(self.latencies_s)
        ttft = sorted(self.ttft_s)
        return {
            "clients": self.clients,
            "seconds": self.seconds,
            "wall_s": round(self.wall_s, 2),
            "completed": self.completed,
            "disconnected_on_purpose": self.disconnected,
            "designed_503": self.designed_503,
            "failed": self.failed,
            "failure_samples": self.failures[:10],
            "by_kind": dict(sorted(self.by_kind.items())),
            "requests_per_s": round(self.completed / self.wall_s, 2) if self.wall_s else None,
            "latency_s": _percentiles(lat),
            "stream_ttft_s": _percentiles(ttft),
        }


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}

    def pct(p: float) -> float:
        return round(values[min(len(values) - 1, int(p * len(values)))], 3)

    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": round(values[-1], 3),
            "mean": round(statistics.fmean(values), 3)}  # fmt: skip


def _body(rng: random.Random, chat: bool, stream: bool, max_tokens: int) -> dict:
    system = rng.choice(SYSTEM_PROMPTS)
    user = f"Question {rng.randrange(10**6)}: what should I know about item {rng.randrange(1000)}?"
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    else:
        body["prompt"] = f"{system}\n\n{user}\nAnswer:"
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, report: LoadReport, *,
               max_tokens: int, disconnect_share: float) -> None:  # fmt: skip
    chat = rng.random() < 0.5
    leave = rng.random() < disconnect_share
    stream = leave or rng.random() < 0.5
    kind = ("chat" if chat else "completion") + ("_stream" if stream else "") + ("_leave" if leave else "")
    route = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(rng, chat, stream, max_tokens)
    t0 = time.perf_counter()
    try:
        if not stream:
            resp = await client.post(url + route, json=body)
            status, ok = resp.status_code, resp.status_code == 200 and "choices" in resp.json()
        else:
            async with client.stream("POST", url + route, json=body) as resp:
                status, ok, first = resp.status_code, False, None
                if status == 200:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if first is None:
                            first = time.perf_counter() - t0
                        if leave:
                            break  # closing the response mid-stream: the client is gone
                        payload = line[6:]
                        if payload == "[DONE]":
                            ok = True
                            break
                        if "error" in json.loads(payload):
                            report.failures.append(f"{kind}: stream error event {payload[:200]}")
                            break
                    if first is not None and not leave:
                        report.ttft_s.append(first)
                else:
                    await resp.aread()
            if leave and status == 200:
                report.disconnected += 1
                report.by_kind[kind] += 1
                return
    except httpx.HTTPError as exc:
        report.failed += 1
        report.failures.append(f"{kind}: {type(exc).__name__}: {exc}")
        return
    report.by_kind[kind] += 1
    if status == 503:
        report.designed_503 += 1
    elif ok:
        report.completed += 1
        report.latencies_s.append(time.perf_counter() - t0)
    else:
        report.failed += 1
        report.failures.append(f"{kind}: status {status}")


async def _client(url: str, seed: int, deadline: float, report: LoadReport, **kw) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        while time.monotonic() < deadline:
            await _one(client, url, rng, report, **kw)


async def _run(url: str, clients: int, seconds: float, seed: int, **kw) -> LoadReport:
    report = LoadReport(clients=clients, seconds=seconds)
    t0 = time.monotonic()
    deadline = t0 + seconds
    await asyncio.gather(*(_client(url, seed * 1000 + i, deadline, report, **kw) for i in range(clients)))
    report.wall_s = time.monotonic() - t0
    return report


def run_load(url: str, *, clients: int = 64, seconds: float = 60.0, seed: int = 13, max_tokens: int = 16,
             disconnect_share: float = 0.1) -> LoadReport:  # fmt: skip
    """Run the load; returns when every client finished its last request (after ``seconds``)."""
    return asyncio.run(
        _run(url, clients, seconds, seed, max_tokens=max_tokens, disconnect_share=disconnect_share)
    )
