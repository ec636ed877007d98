"""Request bodies of the cache routes: ``POST /v1/warm`` and ``POST /v1/cache/reset``."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvb_server.schemas.fields import STRICT, CacheSalt


class WarmRequest(BaseModel):
    """``POST /v1/warm``: texts whose KV to precompute (e.g. a shared system prompt or document)."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={"anyOf": [{"required": ["text"]}, {"required": ["texts"]}]},
    )

    # Either field may be left out, not null: the schema says so, so fuzzers generate what is accepted.
    text: Annotated[str, Field(min_length=1)] = None  # type: ignore[assignment]
    texts: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] = None  # type: ignore[assignment]
    #: Warm under this salt (combined with the API key's, as for generation requests).
    cache_salt: CacheSalt | None = None


class CacheResetRequest(BaseModel):
    """``POST /v1/cache/reset`` (and vLLM's ``POST /reset_prefix_cache``); the body is optional."""

    model_config = STRICT

    lower_tiers: bool = Field(
        default=False, description="also drop the disk and Redis tiers' records, not only RAM"
    )
