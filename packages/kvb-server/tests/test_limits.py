"""Input limits over real HTTP (uvicorn): body size (Content-Length and chunked), nesting depth, UTF-8."""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest
from conftest import serve
from fakes import FakeEngine
from test_app_errors import assert_openai_error

from kvb_server import ServerConfig, create_app
from kvb_server.errors import InvalidParameterError
from kvb_server.limits import decode_json, json_depth

MODEL = "fake-model"
LIMIT = 64 * 2**10
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/warm", "/v1/cache/reset")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    config = ServerConfig(model_names=(MODEL,), max_body_bytes=LIMIT, max_json_depth=16)
    with serve(create_app(fake, config)) as url:
        yield fake, url


def post_raw(url: str, path: str, content: bytes | Iterator[bytes]) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("{}", 1),
        ('[[1], {"a": [2]}]', 3),
        ('{"a": "[[[[{{{{"}', 1),  # brackets in strings do not count
        ('{"a": "q\\"[[[["}', 1),  # nor after an escaped quote
        ('"unterminated [[[', 0),  # the parser fails at the string, never entering its brackets
        ('[[{"a": "\\"\\"[[[', 3),  # an unterminated string of escaped quotes
        ('[["a\\', 2),  # a lone backslash last
        ("[" * 100_000, 100_000),
        ("[]]][[[[", 2),  # the parser stops after "[]" ("Extra data"): 2 is an upper bound
    ],
)
def test_json_depth(text: str, depth: int) -> None:
    assert json_depth(text) == depth


def test_a_string_match_from_any_quote_never_fails() -> None:
    """What keeps the nesting check linear: a match attempt that failed (an unterminated string) was retried
    from every quote after it, each scanning to the end (60 KB of escaped quotes: 21 s on the event loop)."""
    from kvb_server.limits import _STRING

    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice('"\\[a') for _ in range(rng.randint(1, 40)))
        for i, ch in enumerate(text):
            if ch == '"':
                assert _STRING.match(text, i) is not None, (text, i)
    body = b"[" * 70 + b'"' + b'\\"' * 30_000  # the audit's body: refused as too deep, not parsed
    with pytest.raises(InvalidParameterError, match="deeper than"):
        decode_json(body, max_depth=64)


def test_decode_json_refuses_before_parsing() -> None:
    with pytest.raises(InvalidParameterError, match="deeper than this server's limit of 8"):
        decode_json(b"[" * 100_000 + b"]" * 100_000, max_depth=8)
    assert decode_json(b"[" * 8 + b"]" * 8, max_depth=8) == [[[[[[[[]]]]]]]]
    with pytest.raises(InvalidParameterError, match="UTF-8"):
        decode_json(b'{"prompt": "\xff"}', max_depth=8)
    with pytest.raises(InvalidParameterError, match="surrogate"):
        decode_json(b'{"prompt": ["\\ud800"]}', max_depth=8)
    assert decode_json(b'{"p": "\\ud83d\\ude00"}', max_depth=8) == {"p": "\U0001f600"}


@pytest.mark.parametrize("path", ROUTES)
def test_body_over_the_limit_is_413_stating_it(server: tuple[FakeEngine, str], path: str) -> None:
    fake, url = server
    body = json.dumps({"model": MODEL, "prompt": "x" * (LIMIT + 1)}).encode()
    err = assert_openai_error(post_raw(url, path, body), 413, code="body_too_large")
    assert str(LIMIT) in err["message"] and "--max-body-bytes" in err["message"]
    assert err["max_body_bytes"] == LIMIT
    assert fake.added == [] and fake.resets == []


def test_chunked_body_over_the_limit_is_413(server: tuple[FakeEngine, str]) -> None:
    fake, url = server
    sent = []

    def chunks() -> Iterator[bytes]:  # no length known up front: httpx sends Transfer-Encoding: chunked
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(64):
            sent.append(1)
            yield b"x" * 4096
        yield b'"}'

    err = assert_openai_error(post_raw(url, "/v1/completions", chunks()), 413, code="body_too_large")
    assert str(LIMIT) in err["message"]
    assert fake.added == []
    # The server still answers on new connections (nothing hung or crashed).
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_declared_length_over_the_limit_is_answered_without_a_reset(server: tuple[FakeEngine, str]) -> None:
    """Refused on its Content-Length before any byte is read; the client still reads a clean 413."""
    _, url = server
    body = b'{"prompt": "' + b"x" * (4 * LIMIT) + b'"}'
    host = urlparse(url)
    with socket.create_connection((host.hostname, host.port), timeout=10) as s:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        s.sendall(head + body)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"body_too_large" in reply


def test_chunked_body_over_the_limit_with_connection_close_gets_the_413_not_a_reset(
    server: tuple[FakeEngine, str],
) -> None:
    """The fuzzer's case: a chunked body many times the limit on a `Connection: close` request. Answering
    before the client finished sending made the kernel reset the connection; the rest is now drained."""
    _, url = server
    host = urlparse(url)
    chunk = b"x" * 65536
    with socket.create_connection((host.hostname, host.port), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) * 80)  # 5 MiB, far over the limit
        s.sendall(b"0\r\n\r\n")
        reply = b""
        while True:
            data = s.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"body_too_large" in reply


@pytest.mark.parametrize("path", ROUTES)
def test_deep_nesting_is_400_not_a_recursion_error(server: tuple[FakeEngine, str], path: str) -> None:
    _, url = server
    nested = b"[" * 30_000 + b"]" * 30_000  # under the body limit, far over the depth limit
    for body in (b"[" * 60_000, b'{"model": "fake-model", "prompt": ' + nested + b"}"):
        err = assert_openai_error(post_raw(url, path, body), 400, code="json_too_deep")
        assert "16" in err["message"]


def test_nesting_within_the_limit_reaches_validation(server: tuple[FakeEngine, str]) -> None:
    _, url = server
    body = {"model": MODEL, "prompt": "hi", "logit_bias": {"a": [[[[1]]]]}}
    assert_openai_error(post_raw(url, "/v1/completions", json.dumps(body).encode()), 400, param="logit_bias")


DEEP_TEXT = "[" * 30_000 + "]" * 30_000  # JSON nested past the interpreter's recursion limit


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "guided_json": DEEP_TEXT}, "guided_json"),
        (
            "/v1/completions",
            {"prompt": "hi", "structured_outputs": {"json": DEEP_TEXT}},
            "structured_outputs",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": DEEP_TEXT},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            },
            "arguments",
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_TEXT},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                ],
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            },
            "",
        ),
    ],
)
def test_json_text_nested_inside_a_string_is_400_not_a_recursion_error(
    server: tuple[FakeEngine, str], path: str, body: dict, param: str
) -> None:
    """The body's nesting check skips strings; JSON text held in one (a schema sent as text, a tool call's
    arguments) was parsed later without it: a RecursionError, a 500 with a long traceback."""
    _, url = server
    resp = post_raw(url, path, json.dumps({"model": MODEL, **body}).encode())
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert param in (err["param"] or ""), err


@pytest.mark.parametrize("path", ROUTES)
def test_invalid_utf8_is_400(server: tuple[FakeEngine, str], path: str) -> None:
    _, url = server
    err = assert_openai_error(post_raw(url, path, b'{"model": "fake-model", "prompt": "\xc3\x28"}'), 400)
    assert "UTF-8" in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"null",
        b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark
        b'{"model": "fake-model", "prompt": "\\ud800"}',
        b'{"model": "fake-model", "prompt": "hi", "seed": 18446744073709551616}',
        b'{"model": "fake-model", "prompt": "hi", "temperature": 1e400}',
        b'{"model": "fake-model", "prompt": [[1, 2], []]}',
        b'{"model": "fake-model", "prompt": "hi", "cache_salt": ""}',
        b'{"model": "fake-model", "prompt": "hi", "cache_salt": 5}',
        b'{"model": {"a": 1}, "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\udfff"}]}',
        b"\x00\x01\x02",
        # Past Python's int_max_str_digits (4300): json.loads' ValueError was a 500 and a dropped connection.
        b'{"model": "fake-model", "prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}",
        b'{"model": "fake-model", "prompt": "hi", "user": ' + b"9" * 5000 + b"}",
        '{"model": "fake-model", "prompt": "\u2028"}'.encode("utf-16"),
    ],
)
def test_odd_bodies_are_4xx_never_5xx(server: tuple[FakeEngine, str], body: bytes) -> None:
    _, url = server
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = post_raw(url, path, body)
        assert 400 <= resp.status_code < 500, (path, body, resp.text)
        assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}


def test_client_leaving_mid_body_is_not_an_error(server: tuple[FakeEngine, str], caplog) -> None:
    _, url = server
    host = urlparse(url)
    with socket.create_connection((host.hostname, host.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": "fake-'
        )
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    assert "unhandled error" not in caplog.text
