"""The Responses API's response object and output items, built from a request and chat results.

Shapes follow OpenAI's (and the ``openai`` SDK's ``openai.types.responses.Response``): the request's
settings are echoed with OpenAI's defaults where omitted, ``output`` holds a ``message`` item and/or
``function_call`` items, and ``usage`` counts input/output tokens (``cached_tokens``: prompt tokens served
from the prefix cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from kvb_server.generation_config import NO_DEFAULTS, SamplingDefaults
from kvb_server.limits import loads_inner
from kvb_server.responses_api.convert import new_id
from kvb_server.responses_api.schemas import (
    FunctionTool,
    ResponsesRequest,
    ToolChoiceAllowed,
    ToolChoiceFunction,
)
from kvb_server.responses_api.store import ChatMessage

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def _echo(req: ResponsesRequest, defaults: SamplingDefaults = NO_DEFAULTS) -> dict[str, Any]:
    """The request settings a response object repeats, in OpenAI's order, defaults filled in (the
    generation config's ``temperature`` / ``top_p`` where ``defaults`` sets them, as the chat plan does)."""
    temperature = req.temperature if req.temperature is not None else defaults.temperature
    top_p = req.top_p if req.top_p is not None else defaults.top_p
    text_format = req.text.format if req.text is not None else None
    tool_choice: Any = req.tool_choice or "auto"
    if isinstance(tool_choice, ToolChoiceFunction | ToolChoiceAllowed):
        tool_choice = tool_choice.model_dump()
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": req.model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_retention": req.prompt_cache_retention,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.store is not False,
        "temperature": 1.0 if temperature is None else temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True) if text_format else {"type": "text"},
            # Accepted and ignored (as chat's verbosity); echoed as asked, OpenAI's default otherwise.
            "verbosity": (req.text.verbosity if req.text is not None else None) or "medium",
        },
        "tool_choice": tool_choice,
        "tools": [t.model_dump() for t in req.tools or () if isinstance(t, FunctionTool)],
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if top_p is None else top_p,
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "metadata": dict(req.metadata or {}),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseEnvelope:
    """What every state of one response shares: its id, creation time and the echoed request settings."""

    id: str
    created_at: int
    echo: dict[str, Any]

    @classmethod
    def new(cls, req: ResponsesRequest, defaults: SamplingDefaults = NO_DEFAULTS) -> ResponseEnvelope:
        return cls(id=new_id("resp"), created_at=int(time.time()), echo=_echo(req, defaults))

    def object(
        self,
        status: Status,
        output: list[dict[str, Any]],
        *,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The response object in state ``status`` (``incomplete``: stopped at ``max_output_tokens``)."""
        done = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **{k: v for k, v in self.echo.items() if k not in ("user", "metadata")},
            "output": output if done or status == "failed" else [],
            "usage": usage,
            "user": self.echo["user"],
            "metadata": self.echo["metadata"],
        }


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat usage as Responses usage.

    ``cache_write_tokens`` (the SDK's field): prompt tokens this request computed, whose full blocks the
    engine keeps in its prefix cache.
    """
    prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(
    item_id: str, text: str, status: Status, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "content": [output_text(text, logprobs)] if status != "in_progress" else [],
        "role": "assistant",
    }


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` part; ``logprobs``: its tokens' ``{token, logprob, bytes, top_logprobs}`` entries
    (the chat route's ``logprobs.content`` entries have OpenAI's Responses shape already)."""
    return {"type": "output_text", "annotations": [], "logprobs": logprobs or [], "text": text}


def reasoning_item(item_id: str, text: str, status: Status) -> dict[str, Any]:
    """A reasoning model's thinking (``--reasoning-parser``), as OpenAI's open-weight models report it: the
    text in ``content`` (``reasoning_text`` parts), no summary, nothing encrypted."""
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [reasoning_text(text)] if status != "in_progress" else [],
        "encrypted_content": None,
        "status": status,
    }


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: Status
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }


def output_items(
    message: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """A non-streamed chat message as output items: its thinking (``--reasoning-parser``) as a
    ``reasoning`` item, its text (if any, or if there is nothing else) as a ``message`` item, then one
    ``function_call`` item per tool call; the last is ``incomplete`` when the generation stopped at
    ``max_output_tokens``. ``logprobs``: the chat choice's (``{"content": [...]}``), given only when the
    message text holds every generated token (no tools, no reasoning parser: the route refuses the others)."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_id("rs"), message["reasoning"], "completed"))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or items):
        entries = (logprobs or {}).get("content")
        items.append(message_item(new_id("msg"), message.get("content") or "", "completed", entries))
    for call in calls:
        fn = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"))
    if finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def _cut_call(item: dict[str, Any]) -> bool:
    """A function call ``max_output_tokens`` cut before its arguments were complete: left out of the
    history, since no tool message can answer it. Blank arguments count as cut only here (a call of a
    function without parameters may have them): cut before its arguments began, a streamed call kept them
    blank, and every previous_response_id follow-up was a 400 (an unanswered call)."""
    if item.get("status") != "incomplete":
        return False
    arguments = item.get("arguments") or ""
    if not arguments.strip():
        return True
    try:
        loads_inner(arguments)
    except ValueError:
        return True
    return False


def status_of(finish_reason: str | None) -> Status:
    return "incomplete" if finish_reason == "length" else "completed"


def assistant_message(output: list[dict[str, Any]]) -> ChatMessage:
    """Output items as the chat message a follow-up request's history holds."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call" and not _cut_call(item)
    ]
    message: ChatMessage = {"role": "assistant", "content": text or (None if calls else "")}
    thought = "".join(
        part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]
    )
    if thought:  # for templates that render an earlier turn's thinking (Qwen3's reasoning_content)
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = calls
    return message
