"""What the HTTP layer takes before a route runs: web pages' requests from other origins, the body's media
type and encoding, early refusals that close the connection, ``--root-path`` in metrics and messages."""

from __future__ import annotations

import gzip
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest
import uvicorn
from conftest import free_port
from fakes import FakeEngine
from test_app_errors import assert_openai_error

from kvb_server import ServerConfig, create_app
from kvb_server.cross_origin import is_same_origin
from kvb_server.http_options import CorsPolicy

MODEL = "fake-model"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def fake_url() -> Iterator[tuple[FakeEngine, str]]:
    from conftest import serve

    fake = FakeEngine()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_body_bytes=2**16))) as url:
        yield fake, url


def _post(url: str, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(url + path, content=body, headers=headers, timeout=30)


# ------------------------------------------------------------------------------------------ cross-origin


def test_a_web_page_from_another_origin_cannot_drive_the_server(fake_url) -> None:
    """A page's no-cors fetch or form post carries an Origin header and no preflight: it generated, warmed
    and wiped the cache (lower tiers included) for any site the user visited. Now 403, nothing run."""
    fake, url = fake_url
    evil = {"origin": "http://evil.example", "content-type": "text/plain;charset=UTF-8"}
    before = len(fake.resets)
    for path, body in (
        ("/v1/completions", json.dumps(BODY)),
        ("/v1/warm", json.dumps({"prompt": "attacker text"})),
        ("/v1/cache/reset", json.dumps({"lower_tiers": True})),
        ("/reset_prefix_cache", ""),
    ):
        resp = _post(url, path, body.encode(), **evil)
        assert_openai_error(resp, 403, code="cross_origin_refused")
        assert "--allowed-origins" in resp.json()["error"]["message"]
    assert len(fake.resets) == before
    assert_openai_error(_post(url, "/reset_prefix_cache", b"", origin="null"), 403)


def test_requests_without_an_origin_or_from_the_servers_own_are_served(fake_url) -> None:
    _, url = fake_url
    port = urlparse(url).port
    assert _post(url, "/v1/completions", json.dumps(BODY).encode()).status_code == 200  # SDKs, curl
    own = {"origin": f"http://127.0.0.1:{port}", "content-type": "application/json"}
    assert _post(url, "/v1/completions", json.dumps(BODY).encode(), **own).status_code == 200


@pytest.mark.parametrize(
    ("origins", "allowed"),
    [(("http://ui.example",), True), (("http://other.example",), False), (("*",), True)],
)
def test_allowed_origins_let_their_pages_in(origins, allowed) -> None:
    from conftest import serve

    config = ServerConfig(model_names=(MODEL,), cors=CorsPolicy(allowed_origins=origins))
    with serve(create_app(FakeEngine(), config)) as url:
        resp = httpx.post(url + "/v1/completions", json=BODY, headers={"origin": "http://ui.example"})
    assert resp.status_code == (200 if allowed else 403), resp.text
    if allowed:
        assert resp.headers["access-control-allow-origin"] in ("*", "http://ui.example")


@pytest.mark.parametrize(
    ("origin", "host", "scheme", "same"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", "http", True),
        ("http://LOCALHOST:8000", "localhost:8000", "http", True),
        ("https://api.example", "api.example", "http", True),  # TLS ended at a proxy
        ("https://api.example", "api.example:443", "http", True),
        ("http://localhost:3000", "localhost:8000", "http", False),
        ("http://evil.example", "127.0.0.1:8000", "http", False),
        ("null", "127.0.0.1:8000", "http", False),
        ("http://x:notaport", "x:80", "http", False),
    ],
)
def test_same_origin(origin: str, host: str, scheme: str, same: bool) -> None:
    assert is_same_origin(origin, host, scheme) is same


# ------------------------------------------------------------------------------------ media type, encoding


@pytest.mark.parametrize(
    "content_type",
    ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "x"],
)
def test_a_body_that_is_not_json_by_its_content_type_is_415(fake_url, content_type: str) -> None:
    """As FastAPI (vLLM) reads bodies; they were parsed as JSON whatever they said."""
    _, url = fake_url
    resp = _post(url, "/v1/completions", json.dumps(BODY).encode(), **{"content-type": content_type})
    assert_openai_error(resp, 415, code="unsupported_media_type")


@pytest.mark.parametrize(
    "headers",
    [{}, {"content-type": "application/json; charset=utf-8"}, {"content-type": "application/vnd.x+json"}],
)
def test_json_media_types_and_no_content_type_are_read(fake_url, headers: dict) -> None:
    _, url = fake_url
    assert _post(url, "/v1/completions", json.dumps(BODY).encode(), **headers).status_code == 200


def test_a_compressed_body_is_415_and_a_byte_order_mark_is_read(fake_url) -> None:
    """A gzip body got a misleading "not valid UTF-8" 400 (and plain JSON labelled gzip was served); a
    UTF-8 byte-order mark was a 400 where Starlette's request.json() (vLLM) reads the body."""
    _, url = fake_url
    raw = json.dumps(BODY).encode()
    for body in (gzip.compress(raw), raw):
        resp = _post(url, "/v1/completions", body, **{"content-encoding": "gzip"})
        assert_openai_error(resp, 415, code="unsupported_media_type")
    assert _post(url, "/v1/completions", b"\xef\xbb\xbf" + raw).status_code == 200


def test_an_empty_chunked_body_resets_with_the_defaults(fake_url) -> None:
    """An empty body means the defaults however it is framed (an empty chunked one was a 400)."""
    fake, url = fake_url
    before = len(fake.resets)
    for path in ("/reset_prefix_cache", "/v1/cache/reset"):
        resp = httpx.post(url + path, content=iter([b""]), timeout=30)  # no length: chunked
        assert resp.status_code == 200, resp.text
    assert fake.resets[before:] == [False, False]


# ------------------------------------------------------------------------- early refusals close the connection


def _raw_head(url: str, head: str) -> bytes:
    """Send a request head only (as a client waiting on ``Expect: 100-continue`` does) and read the reply."""
    host = urlparse(url)
    with socket.create_connection((host.hostname, host.port), timeout=10) as s:
        s.sendall(head.encode())
        reply = b""
        while not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    return reply


def _expecting(method: str, path: str, length: int, content_type: str = "application/json") -> str:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
        f"Expect: 100-continue\r\nContent-Length: {length}\r\n\r\n"
    )


def test_refusals_before_the_body_is_read_close_the_connection(fake_url) -> None:
    """A 413 on the declared length, a 415, a 404 or 405 from the router answer before the body is read:
    without ``Connection: close`` a client that withholds its body (``Expect: 100-continue``) had its next
    request on the connection read as that body, and hung."""
    _, url = fake_url
    for head, status in (
        (_expecting("POST", "/v1/completions", 10_000_000), b"413"),
        (_expecting("POST", "/v1/completions", 100, "text/plain"), b"415"),
        (_expecting("POST", "/v1/embeddings", 100), b"404"),
        (_expecting("PUT", "/v1/completions", 100), b"405"),
    ):
        reply = _raw_head(url, head)
        assert reply.startswith(b"HTTP/1.1 " + status), reply[:100]
        assert b"connection: close" in reply.lower()
    # A request whose body was read keeps its connection.
    with httpx.Client() as client:
        resp = client.post(url + "/v1/completions", json=BODY)
        assert resp.status_code == 200 and resp.headers.get("connection") != "close"


def test_a_401_and_a_tenants_403_close_the_connection() -> None:
    from conftest import serve

    from kvb_server.config import TenantKey

    config = ServerConfig(model_names=(MODEL,), api_key="k", tenant_keys=(TenantKey(key="t", salt="s"),))
    with serve(create_app(FakeEngine(), config)) as url:
        unauthorized = _raw_head(url, _expecting("POST", "/v1/completions", 100))
        tenant = _raw_head(
            url,
            "POST /v1/cache/reset HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n"
            "Content-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: 20\r\n\r\n",
        )
    assert unauthorized.startswith(b"HTTP/1.1 401") and b"connection: close" in unauthorized.lower()
    assert tenant.startswith(b"HTTP/1.1 403") and b"connection: close" in tenant.lower()


def test_an_unexpected_error_carries_the_request_id(caplog) -> None:
    """Starlette answers an unhandled error outside the request-id middleware: the 500 had no x-request-id
    and its log line said None."""
    from conftest import serve

    app = create_app(FakeEngine(), ServerConfig(model_names=(MODEL,)))

    def boom() -> None:
        raise RuntimeError("boom")

    app.add_api_route("/boom", boom)
    with caplog.at_level("ERROR", logger="kvb_server.app"), serve(app) as url:
        resp = httpx.get(url + "/boom", headers={"x-request-id": "trace-9"})
    assert resp.status_code == 500 and resp.headers["x-request-id"] == "trace-9"
    assert "x-request-id trace-9" in caplog.text


@pytest.mark.parametrize("key", ["kéy", "a key", "k\x01"])
def test_an_api_key_no_header_can_carry_is_refused_at_start(key: str) -> None:
    with pytest.raises(ValueError, match="printable ASCII"):
        ServerConfig(model_names=(MODEL,), api_key=key)


# ------------------------------------------------------------------------------------------------ root path


def test_root_path_requests_are_counted_under_their_routes() -> None:
    """uvicorn puts ``--root-path`` in front of the scope's path: every request was counted as ``other``,
    no generation latency was observed, and a 404 named the prefix twice."""
    app = create_app(FakeEngine(), ServerConfig(model_names=(MODEL,)))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", root_path="/llm")
    )
    import threading
    import time

    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        missing = httpx.get(url + "/nothing-here", timeout=30)
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert 'kvboost_requests_total{route="/v1/completions",status="200"} 1.0' in metrics
    assert 'kvboost_request_latency_seconds_count{route="/v1/completions"} 1.0' in metrics
    message = missing.json()["error"]["message"]
    assert "/llm/llm" not in message and "/nothing-here" in message
