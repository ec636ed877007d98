"""Tool-call ids: OpenAI's ``call_<24 alphanumerics>``, or the 9 alphanumerics Mistral's templates require."""

from __future__ import annotations

import secrets
import string

from kvb_server.tool_calls.syntax import ToolSyntax

_ALPHANUMERIC = string.ascii_letters + string.digits


def _random(n: int) -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(n))


def new_call_id(syntax: ToolSyntax) -> str:
    """A fresh id for one tool call (the client sends it back as the ``tool`` message's ``tool_call_id``)."""
    return _random(9) if syntax.short_ids else f"call_{_random(24)}"
