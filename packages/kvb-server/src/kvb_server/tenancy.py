"""Who is calling (API keys) and which prefix-cache namespace their requests get (cache salts).

A prefix-cache hit makes the first token arrive sooner, so a client can time requests to learn whether
someone else recently sent a given prefix (a document, a system prompt): a known side channel of shared
prefix caches. A *cache salt* roots the engine's hash chain, so requests with different salts never share
a cached block. Salts come from two places:

- the request's ``cache_salt`` field (vLLM's name): a client opts its own requests into a namespace;
- the API key: each ``--api-key-salt KEY=SALT`` tenant gets its salt on every request, and a body
  ``cache_salt`` only subdivides that tenant's namespace (:func:`request_salt`), so no tenant can leave it.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from fastapi import Request

from kvb_server.config import ServerConfig
from kvb_server.errors import AuthenticationError, InvalidParameterError, PermissionDeniedError

#: Salts derived from a key start with this; a body salt may not, so it cannot name a tenant's namespace.
TENANT_SALT_PREFIX = "tenant:"


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """The authenticated sender of a request.

    Attributes:
        key_salt: the tenant salt of the key used (None: the operator's ``--api-key``, or no auth).
        is_operator: may use operator routes (cache reset): authenticated with ``--api-key``, or no
            ``--api-key`` is set.
    """

    key_salt: str | None
    is_operator: bool


def request_salt(key_salt: str | None, body_salt: str | None) -> str | None:
    """The ``cache_salt`` handed to the engine for a request.

    Without a key salt the body's salt is used as is (as vLLM does). With one, both are encoded together
    unambiguously (a JSON array: ``"a:b" + "c"`` and ``"a" + "b:c"`` differ) behind
    :data:`TENANT_SALT_PREFIX`, which body salts may not use.

    Raises:
        InvalidParameterError: a body salt starting with :data:`TENANT_SALT_PREFIX`.
    """
    if body_salt is not None and body_salt.startswith(TENANT_SALT_PREFIX):
        raise InvalidParameterError(
            f"cache_salt may not start with {TENANT_SALT_PREFIX!r} (reserved for per-API-key salts).",
            param="cache_salt",
        )
    if key_salt is None:
        return body_salt
    return TENANT_SALT_PREFIX + json.dumps([key_salt, body_salt], separators=(",", ":"))


class ApiKeys:
    """FastAPI dependency authenticating ``Authorization: Bearer <key>`` against the configured keys."""

    def __init__(self, config: ServerConfig) -> None:
        self._operator = config.api_key.encode() if config.api_key is not None else None
        self._tenants = [(t.key.encode(), t.salt) for t in config.tenant_keys]
        self._required = config.requires_auth

    async def __call__(self, request: Request) -> Caller:
        if not self._required:
            return Caller(key_salt=None, is_operator=True)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' (a key given to "
                "--api-key or --api-key-salt)."
            )
        given = token.strip().encode()
        # Compare against every key (no early exit), so the time taken does not tell which one matched.
        operator = self._operator is not None and hmac.compare_digest(given, self._operator)
        salt = None
        for key, key_salt in self._tenants:
            if hmac.compare_digest(given, key):
                salt = key_salt
        if operator:
            return Caller(key_salt=None, is_operator=True)
        if salt is not None:
            return Caller(key_salt=salt, is_operator=self._operator is None)
        raise AuthenticationError(
            "Incorrect API key provided. Use a key given to the server's --api-key or --api-key-salt."
        )

    async def operator(self, request: Request) -> Caller:
        """Like the dependency itself, but refuses tenant keys when an operator ``--api-key`` is set (403)."""
        caller = await self(request)
        if not caller.is_operator:
            raise PermissionDeniedError(
                "This route needs the operator's key (--api-key); tenant keys may not use it."
            )
        return caller
