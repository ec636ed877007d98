"""The error body every route answers a non-2xx status with (OpenAI's shape)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ErrorDetail(BaseModel):
    """OpenAI's error object; some errors add fields (the planner's numbers, ``max_body_bytes``)."""

    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-2xx response (and an error event that ends a stream)."""

    error: ErrorDetail
