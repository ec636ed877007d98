"""Body fuzzer for ``/v1/completions`` and ``/v1/chat/completions``: every answer must be a non-5xx response.

Cases (seeded, so a run is reproducible): random JSON values, valid bodies with fields replaced by values of
random types, deep nesting (arrays, objects, unbalanced, inside ``messages``), huge bodies (Content-Length
and chunked), invalid UTF-8 (stray bytes, BOM, UTF-16, overlong sequences, lone surrogate escapes), random
bytes, odd content types, truncated bodies (the client leaves mid-body) and slow partial bodies
(slowloris-ish: a few bytes a second until a client-side timeout) while the server must keep answering.

Each request goes over a raw socket so the exact bytes are sent; an outcome is the status code, or
``reset`` (the server closed or reset a connection that sent a whole request), or ``timeout``.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

MODEL = "smollm2-135m"
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    kind: str
    route: str
    body: bytes
    content_type: str | None = "application/json"
    chunked: bool = False
    #: ``Connection: keep-alive`` (what httpx and the openai SDK send) instead of ``close``; only the status
    #: line is read then.
    keep_alive: bool = False


@dataclass
class FuzzReport:
    """Counts per case kind and per outcome; ``server_errors`` and ``resets`` must stay 0."""

    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)
    server_errors: list[dict] = field(default_factory=list)
    resets: list[dict] = field(default_factory=list)
    truncated: int = 0
    slow_bodies: int = 0
    slow_timeouts: int = 0
    health_during_slow_ms: float | None = None
    healthy_after: bool = False

    def record(self, case: Case, outcome: str) -> None:
        self.cases += 1
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(case.kind, Counter())[outcome] += 1
        sample = {"kind": case.kind, "route": case.route, "body_head": case.body[:200].decode("latin-1")}
        if outcome.isdigit() and int(outcome) >= 500:
            self.server_errors.append({**sample, "status": outcome})
        elif outcome == "reset":
            self.resets.append(sample)

    def as_dict(self) -> dict:
        return {
            "cases": self.cases,
            "outcomes": dict(sorted(self.outcomes.items())),
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(self.by_kind.items())},
            "server_errors": len(self.server_errors),
            "server_error_samples": self.server_errors[:10],
            "resets": len(self.resets),
            "reset_samples": self.resets[:10],
            "truncated_bodies": self.truncated,
            "slow_bodies": self.slow_bodies,
            "slow_bodies_timed_out_client_side": self.slow_timeouts,
            "health_during_slow_bodies_ms": self.health_during_slow_ms,
            "healthy_after": self.healthy_after,
        }


# ---------------------------------------------------------------------------------------------- transport
def _request_bytes(port: int, case: Case) -> bytes:
    connection = "keep-alive" if case.keep_alive else "close"
    head = [f"POST {case.route} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Connection: {connection}"]
    if case.content_type is not None:
        head.append(f"Content-Type: {case.content_type}")
    if case.chunked:
        head.append("Transfer-Encoding: chunked")
        step = 64 * 1024
        parts = [
            f"{len(case.body[i : i + step]):x}\r\n".encode() + case.body[i : i + step] + b"\r\n"
            for i in range(0, len(case.body), step)
        ]
        payload = b"".join(parts) + b"0\r\n\r\n"
    else:
        head.append(f"Content-Length: {len(case.body)}")
        payload = case.body
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


def send(port: int, case: Case, *, timeout: float = 120.0) -> str:
    """Send ``case`` whole; the status code as a string, ``reset`` or ``timeout``."""
    data = _request_bytes(port, case)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            # The server may answer (413) before reading everything: read what it said.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(data)
            buf = b""
            while b"\r\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
            # Drain the rest (streams end with [DONE]) so the server finishes the request normally.
            while not case.keep_alive and sock.recv(65536):
                pass
    except TimeoutError:
        return "timeout"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    if not buf.startswith(b"HTTP/1."):
        return "reset"
    return buf.split(b" ", 2)[1].decode()


def health_ms(port: int, timeout: float = 30.0) -> float | None:
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            ok = sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return None
    return (time.perf_counter() - t0) * 1e3 if ok else None


def send_truncated(port: int, case: Case) -> None:
    """Announce the whole body, send half of it, leave (no answer is expected)."""
    data = _request_bytes(port, case)
    cut = len(data) - max(1, len(case.body) // 2)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data[:cut])


def send_slowly(port: int, case: Case, *, seconds: float, interval: float = 0.5) -> str:
    """Send a few bytes every ``interval`` for ``seconds``, never finishing; ``timeout`` unless answered."""
    data = _request_bytes(port, case)
    deadline = time.monotonic() + seconds
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=seconds + 5) as sock:
            i = 0
            while time.monotonic() < deadline and i < len(data) - 1:
                sock.sendall(data[i : i + 3])
                i += 3
                sock.settimeout(interval)
                try:
                    got = sock.recv(64)
                except TimeoutError:
                    continue
                if not got:
                    return "closed"
                return got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.") else "closed"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    return "timeout"


# -------------------------------------------------------------------------------------------------- cases
def _rand_scalar(rng: random.Random):
    return rng.choice(
        [
            None,
            True,
            False,
            rng.randint(-(2**70), 2**70),
            rng.randint(-5, 40),
            rng.uniform(-1e6, 1e6),
            rng.choice([0.0, -0.0, 1e308, -1e308, 5e-324, 1e-83]),
            "",
            "x" * rng.randint(1, 300),
            "".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 40))),
            MODEL,
            "\u0000\u0001\u202e",
        ]
    )


def _rand_json(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 5 or roll < 0.5:
        return _rand_scalar(rng)
    if roll < 0.75:
        return [_rand_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    keys = ["model", "prompt", "messages", "max_tokens", "stream", "n", "role", "content", "x"]
    return {rng.choice(keys): _rand_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}


#: vLLM's extra sampling and guided-decoding fields, which both routes take.
VLLM_EXTRAS = (
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs",
)  # fmt: skip
FIELDS = {
    "/v1/completions": [
        "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "logprobs", "seed",
        "presence_penalty", "frequency_penalty", "stream_options", "cache_salt", "best_of", "echo",
        "suffix", "logit_bias", "user", "max_completion_tokens", "model", *VLLM_EXTRAS,
    ],
    "/v1/chat/completions": [
        "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "logprobs",
        "top_logprobs", "seed", "presence_penalty", "frequency_penalty", "stream_options", "cache_salt",
        "tools", "tool_choice", "response_format", "user", "max_completion_tokens", "model", *VLLM_EXTRAS,
    ],
}  # fmt: skip


def _valid(route: str, rng: random.Random) -> dict:
    text = f"fuzz {rng.randrange(10**6)}"
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 4)}
    if route == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def _mutated(route: str, rng: random.Random) -> dict:
    body = _valid(route, rng)
    for _ in range(rng.randint(1, 3)):
        name = rng.choice([*FIELDS[route], f"unknown_{rng.randrange(100)}"])
        body[name] = _rand_json(rng) if rng.random() < 0.5 else _rand_scalar(rng)
    if route == "/v1/chat/completions" and rng.random() < 0.3:
        body["messages"] = [
            {rng.choice(["role", "content", "name", "x"]): _rand_json(rng) for _ in range(rng.randint(0, 3))}
            for _ in range(rng.randint(0, 3))
        ]
    return body


def _deep(rng: random.Random, route: str) -> Iterator[Case]:
    for depth in (63, 64, 65, 512, 5000, 100_000):
        yield Case(kind=f"deep_array_{depth}", route=route, body=b"[" * depth + b"]" * depth)
        obj = '{"a":' * depth + "1" + "}" * depth
        yield Case(kind=f"deep_object_{depth}", route=route, body=obj.encode())
    yield Case(kind="deep_unbalanced", route=route, body=b"[" * 200_000)
    inner = "[" * 3000 + "]" * 3000
    body = f'{{"model":"{MODEL}","prompt":{inner},"messages":[{{"role":"user","content":{inner}}}]}}'
    yield Case(kind="deep_in_field", route=route, body=body.encode())
    # Brackets inside strings do not nest: must be accepted as text (or refused as too long), never 5xx.
    body = json.dumps({**_valid(route, rng), "user": "[" * 100_000})
    yield Case(kind="brackets_in_string", route=route, body=body.encode())


def _huge(rng: random.Random, route: str) -> Iterator[Case]:
    big = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    for chunked in (False, True):
        kind = "huge_5MiB" + ("_chunked" if chunked else "")
        yield Case(kind=kind, route=route, body=big, chunked=chunked, keep_alive=True)
        # NOTE: with ``Connection: close`` the server closes right after its 413 with the unread rest of
        # the body still arriving, so the kernel may answer with a TCP RST that discards the 413 before
        # the client reads it (no lingering close). Kept as its own kind to show how often.
        yield Case(kind=kind + "_conn_close", route=route, body=big, chunked=chunked)
    many = json.dumps({**_valid(route, rng), "stop": ["x"] * 200_000}).encode()
    yield Case(kind="huge_list", route=route, body=many)
    prompt = json.dumps({"model": MODEL, "prompt": "word " * 600_000, "max_tokens": 1}).encode()
    yield Case(kind="huge_prompt_3MiB", route="/v1/completions", body=prompt)


def _bad_utf8(rng: random.Random, route: str) -> Iterator[Case]:
    valid = json.dumps(_valid(route, rng)).encode()
    yield Case(kind="utf8_stray_byte", route=route, body=valid.replace(b"fuzz", b"f\xffz\xfe"))
    yield Case(kind="utf8_overlong", route=route, body=valid.replace(b"fuzz", b"\xc0\xaf\xe0\x80\xaf"))
    yield Case(kind="utf8_truncated_seq", route=route, body=valid.replace(b"fuzz", b"\xe2\x82"))
    yield Case(kind="utf8_bom", route=route, body=b"\xef\xbb\xbf" + valid)
    yield Case(kind="utf16", route=route, body=valid.decode().encode("utf-16"))
    yield Case(kind="lone_surrogate", route=route, body=valid.replace(b"fuzz", b"\\ud800"))
    yield Case(kind="surrogate_bytes", route=route, body=valid.replace(b"fuzz", b"\xed\xa0\x80"))
    yield Case(kind="nul_bytes", route=route, body=valid.replace(b"fuzz", b"\\u0000\x00"))


def _odd(rng: random.Random, route: str) -> Iterator[Case]:
    valid = json.dumps(_valid(route, rng)).encode()
    for body in (b"", b"null", b"[]", b"1", b'"x"', b"{", b"}", b"{}", b"NaN", b'{"a":NaN}', b"\x00" * 32):
        yield Case(kind="odd_body", route=route, body=body)
    yield Case(kind="no_content_type", route=route, body=valid, content_type=None)
    yield Case(kind="text_plain", route=route, body=valid, content_type="text/plain")
    yield Case(
        kind="form_content_type", route=route, body=valid, content_type="application/x-www-form-urlencoded"
    )
    yield Case(kind="duplicate_keys", route=route, body=valid[:-1] + b', "model": 5}')


def generate_cases(seed: int, random_cases: int) -> list[Case]:
    """The fixed cases for both routes plus ``random_cases`` random/mutated/byte bodies."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for route in ROUTES:
        for family in (_deep, _huge, _bad_utf8, _odd):
            cases.extend(family(rng, route))
    for _ in range(random_cases):
        route = rng.choice(ROUTES)
        roll = rng.random()
        if roll < 0.45:
            body, kind = json.dumps(_mutated(route, rng)).encode(), "mutated_fields"
        elif roll < 0.7:
            body, kind = json.dumps(_rand_json(rng)).encode(), "random_json"
        elif roll < 0.8:
            body, kind = json.dumps(_valid(route, rng)).encode(), "valid"
        elif roll < 0.9:
            raw = bytearray(json.dumps(_valid(route, rng)).encode())
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            body, kind = bytes(raw), "flipped_bytes"
        else:
            body, kind = rng.randbytes(rng.randint(1, 2000)), "random_bytes"
        cases.append(Case(kind=kind, route=route, body=body))
    return cases


def run_fuzz(
    port: int,
    *,
    seed: int = 13,
    random_cases: int = 300,
    truncated: int = 20,
    slow_bodies: int = 4,
    slow_seconds: float = 8.0,
    max_seconds: float = 600.0,
) -> FuzzReport:
    """Send every case (bounded by ``max_seconds``), then truncated and slow bodies; check health after."""
    report = FuzzReport()
    rng = random.Random(seed + 1)
    started = time.monotonic()
    for case in generate_cases(seed, random_cases):
        if time.monotonic() - started > max_seconds:
            break
        report.record(case, send(port, case))
    for i in range(truncated):
        route = ROUTES[i % 2]
        send_truncated(
            port, Case(kind="truncated", route=route, body=json.dumps(_valid(route, rng)).encode())
        )
        report.truncated += 1
    # Slow bodies in threads; meanwhile the server must still answer /health (and a real request after).
    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda r=ROUTES[i % 2]: results.append(
                send_slowly(
                    port,
                    Case(kind="slow", route=r, body=json.dumps(_valid(r, rng)).encode() * 20),
                    seconds=slow_seconds,
                )
            )
        )
        for i in range(slow_bodies)
    ]
    for t in threads:
        t.start()
    time.sleep(min(2.0, slow_seconds / 2))
    report.health_during_slow_ms = health_ms(port)
    for t in threads:
        t.join()
    report.slow_bodies = len(results)
    report.slow_timeouts = sum(r == "timeout" for r in results)
    for r in results:
        if r == "reset" or (r.isdigit() and int(r) >= 500):
            report.record(Case(kind="slow", route="", body=b""), r)
    valid = Case(kind="valid_after", route=ROUTES[1], body=json.dumps(_valid(ROUTES[1], rng)).encode())
    report.healthy_after = health_ms(port) is not None and send(port, valid) == "200"
    return report
