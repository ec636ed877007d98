"""Tenant isolation in the server: ``cache_salt`` reaches the engine; per-key salts apply and combine."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from conftest import build_tiny_engine, serve
from fakes import FakeEngine
from test_app_errors import assert_openai_error

from kvb_server import InvalidParameterError, ServerConfig, create_app
from kvb_server.config import TenantKey
from kvb_server.tenancy import TENANT_SALT_PREFIX, request_salt

MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def keyed(key_salt: str, body_salt: str | None) -> str:
    return TENANT_SALT_PREFIX + json.dumps([key_salt, body_salt], separators=(",", ":"))


def test_request_salt() -> None:
    assert request_salt(None, None) is None
    assert request_salt(None, "mine") == "mine"  # vLLM's meaning of a body salt, unchanged
    assert request_salt("t1", None) == keyed("t1", None)
    assert request_salt("t1", "mine") == keyed("t1", "mine")
    # A body salt subdivides its key's namespace and can never name another's.
    assert request_salt("a:b", "c") != request_salt("a", "b:c")
    assert request_salt("t1", None) != request_salt("t1", "null")
    with pytest.raises(InvalidParameterError, match="reserved") as err:
        request_salt(None, keyed("t1", None))
    assert err.value.param == "cache_salt"


@pytest.fixture()
def fake() -> FakeEngine:
    return FakeEngine()


def test_cache_salt_reaches_the_engine(fake: FakeEngine) -> None:
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            for extra in ({}, {"stream": True}, {"n": 2}):
                resp = httpx.post(url + path, json={**body, **extra, "cache_salt": "s-1"})
                assert resp.status_code == 200, resp.text
        httpx.post(url + "/v1/completions", json=COMPLETION)
        assert httpx.post(url + "/v1/warm", json={"text": "doc", "cache_salt": "s-1"}).status_code == 200
        assert_openai_error(httpx.post(url + "/v1/completions", json={**COMPLETION, "cache_salt": ""}), 400)
    # The warm is an engine request too (the last one added).
    assert [a.cache_salt for a in fake.added] == ["s-1"] * 8 + [None, "s-1"]
    assert fake.warm_salts == ["s-1"]


@pytest.fixture()
def tenants(fake: FakeEngine) -> Iterator[str]:
    config = ServerConfig(
        model_names=(MODEL,),
        api_key="operator",
        tenant_keys=(TenantKey(key="key-a", salt="a"), TenantKey(key="key-b", salt="b")),
    )
    with serve(create_app(fake, config)) as url:
        yield url


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_per_key_salts_apply_and_combine(fake: FakeEngine, tenants: str) -> None:
    url = tenants
    calls = [
        ("key-a", {}),
        ("key-a", {"cache_salt": "x"}),
        ("key-b", {}),
        ("operator", {}),
        ("operator", {"cache_salt": "x"}),
    ]
    for key, extra in calls:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            resp = httpx.post(url + path, json={**body, **extra}, headers=bearer(key))
            assert resp.status_code == 200, resp.text
    salts = [a.cache_salt for a in fake.added]
    assert salts == [
        *[keyed("a", None)] * 2,
        *[keyed("a", "x")] * 2,
        *[keyed("b", None)] * 2,
        None,
        None,
        "x",
        "x",
    ]
    # A tenant's warm lands in its own namespace.
    assert httpx.post(url + "/v1/warm", json={"text": "doc"}, headers=bearer("key-b")).status_code == 200
    assert fake.warm_salts == [keyed("b", None)]


def test_tenant_keys_require_auth_and_salts_cannot_be_forged(fake: FakeEngine, tenants: str) -> None:
    url = tenants
    assert_openai_error(httpx.post(url + "/v1/completions", json=COMPLETION), 401, code="invalid_api_key")
    resp = httpx.post(url + "/v1/completions", json=COMPLETION, headers=bearer("key-c"))
    assert_openai_error(resp, 401, code="invalid_api_key")
    forged = {**COMPLETION, "cache_salt": keyed("a", None)}  # the operator's clients cannot enter tenant a
    assert_openai_error(
        httpx.post(url + "/v1/completions", json=forged, headers=bearer("operator")), 400, param="cache_salt"
    )
    assert httpx.get(url + "/v1/models", headers=bearer("key-a")).status_code == 200
    assert fake.added == []


def test_stats_are_the_operators_when_an_operator_key_is_set(fake: FakeEngine, tenants: str) -> None:
    """/v1/stats carries every tenant's traffic (the planner's last plan names the last prompt's length, the
    cache counters move by another tenant's cached tokens): tenant keys get 403, as on the cache reset."""
    url = tenants
    resp = httpx.get(url + "/v1/stats", headers=bearer("key-a"))
    assert_openai_error(resp, 403, code="permission_denied")
    assert httpx.get(url + "/v1/stats", headers=bearer("operator")).status_code == 200


def test_tenants_share_no_cached_prefix_on_the_real_engine() -> None:
    """Same prompt: another tenant gets no hit; the same tenant (and the same body salt) a full one."""
    config = ServerConfig(
        model_names=("tiny-llama",),
        max_tokens=4,
        tenant_keys=(TenantKey(key="key-a", salt="a"), TenantKey(key="key-b", salt="b")),
    )
    prompt = "You are a helpful assistant. Answer briefly and precisely, one sentence at a time. " * 3
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0}

    def cached(key: str, **extra: str) -> int:
        resp = httpx.post(url + "/v1/completions", json={**body, **extra}, headers=bearer(key), timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with serve(create_app(build_tiny_engine(), config)) as url:
        assert cached("key-a") == 0
        assert cached("key-b") == 0
        assert cached("key-a") > 0
        assert cached("key-a", cache_salt="x") == 0
        assert cached("key-a", cache_salt="x") > 0
