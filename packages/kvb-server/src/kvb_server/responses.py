"""OpenAI response and stream-chunk objects, built from engine results."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvb_cache.results import GenerationResult, TokenLogprob
from kvb_server.echo import Echo, as_token_ids, completion_top
from kvb_server.reasoning import FIELDS as REASONING_FIELDS
from kvb_server.reasoning import ReasoningPlan
from kvb_server.reasoning import split as split_reasoning
from kvb_server.request_plan import GenerationPlan
from kvb_server.token_bytes import TextOffsets, TokenBytesFn, utf8
from kvb_server.tool_calls import ToolPlan, split_reply
from kvb_server.tool_calls.ids import new_call_id


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseIds:
    """The id and creation time every object of one response shares."""

    id: str
    created: int

    @classmethod
    def new(cls, plan: GenerationPlan) -> ResponseIds:
        prefix = "chatcmpl" if plan.endpoint == "chat.completions" else "cmpl"
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()))


def usage(plan: GenerationPlan, results: Sequence[GenerationResult]) -> dict[str, Any]:
    """Token accounting: each prompt counts once however many choices it has (as OpenAI bills ``n``).

    ``results`` are indexed by choice (``prompt_index * n + i``).
    """
    prompt_tokens = cached = 0
    for p in range(len(plan.prompts)):
        choices = results[p * plan.n : (p + 1) * plan.n]
        prompt_tokens += choices[0].prompt_tokens
        # Choices of one prompt may start in the same step (no hit yet) or after one another (later ones hit).
        cached += max(r.cached_tokens for r in choices)
    completion = sum(r.completion_tokens for r in results)
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if (
        plan.predicted
    ):  # predicted outputs: OpenAI's accounting of the prediction's tokens (an empty one: 0 / 0)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(r.accepted_prediction_tokens for r in results),
            "rejected_prediction_tokens": sum(r.rejected_prediction_tokens for r in results),
        }
    return out


def _completion_logprobs(
    entries: Sequence[TokenLogprob], offsets: TextOffsets, echo: Echo | None = None, *, tokens_as_ids: bool
) -> dict[str, Any]:
    """Completions-style arrays; with ``echo`` the prompt's tokens come first (and ``offsets`` run on);
    ``tokens_as_ids``: tokens named ``"token_id:<id>"`` (``text_offset`` still counts their text)."""
    arrays: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if echo is not None:
        arrays = echo.logprob_arrays(offsets, tokens_as_ids=tokens_as_ids)
    for e in entries:
        shown = as_token_ids(e) if tokens_as_ids else e
        arrays["tokens"].append(shown.token)
        arrays["token_logprobs"].append(e.logprob)
        arrays["top_logprobs"].append(completion_top(shown))
        arrays["text_offset"].append(offsets.advance(e.token_id, e.token))
    return arrays


def _chat_logprob_entry(e: TokenLogprob, token_bytes: TokenBytesFn) -> dict[str, Any]:
    return {
        "token": e.token,
        "logprob": e.logprob,
        "bytes": token_bytes(e.token_id, e.token),
        "top_logprobs": [
            {"token": text, "logprob": lp, "bytes": token_bytes(token_id, text)}
            for token_id, text, lp in e.top
        ],
    }


def _chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytesFn) -> dict[str, Any]:
    return {"content": [_chat_logprob_entry(e, token_bytes) for e in entries], "refusal": None}


def _logprobs(
    plan: GenerationPlan,
    entries: Sequence[TokenLogprob] | None,
    offsets: TextOffsets | None = None,
    echo: Echo | None = None,
    token_bytes: TokenBytesFn = utf8,
) -> dict[str, Any] | None:
    """``offsets``: where a streamed choice's text stands (a fresh one counts from the text's start)."""
    if plan.sampling.logprobs is None or entries is None:
        return None
    if plan.chat_logprobs:
        if plan.tokens_as_ids:  # vLLM's: the label's own bytes
            return _chat_logprobs([as_token_ids(e) for e in entries], utf8)
        return _chat_logprobs(entries, token_bytes)
    return _completion_logprobs(
        entries,
        offsets if offsets is not None else TextOffsets(token_bytes),
        echo if echo is not None and echo.logprobs is not None else None,
        tokens_as_ids=plan.tokens_as_ids,
    )


def cut_short(tools: ToolPlan, finish_reason: str) -> bool:
    """Whether a reply under ``tools`` may have ended inside a call: ``max_tokens`` cut it, or, under a
    forced ``tool_choice`` (whose grammar admits nothing but calls, so the model cannot end it early), a
    stop string or stop token did. Such a cut call stays a (partial) call, streamed or not."""
    return finish_reason == "length" or (tools.mode == "calls" and finish_reason == "stop")


def assistant_message(
    tools: ToolPlan | None, text: str, finish_reason: str, reasoning: ReasoningPlan | None = None
) -> tuple[dict[str, Any], str]:
    """A chat choice's ``message`` and ``finish_reason``: a reply made of tool calls becomes ``tool_calls``
    (``content`` null, finish ``"tool_calls"``, or ``"length"`` when max_tokens cut a later call off; a call
    that a stop string cut under a forced ``tool_choice`` stays that partial call, finish ``"stop"``).

    A call forced by a named ``tool_choice`` finishes ``"stop"``, as OpenAI's and vLLM's do: ``"tool_calls"``
    says the model chose to call tools (``auto`` / ``required``), and clients branch on it that way.
    With ``reasoning``, the reply's thinking goes to ``reasoning`` / ``reasoning_content``
    (:mod:`kvb_server.reasoning`)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if reasoning is not None:
        thought, message["content"] = split_reasoning(text, reasoning)
        if reasoning.include:
            message.update(dict.fromkeys(REASONING_FIELDS, thought))
    if tools is None:
        return message, finish_reason
    reply = split_reply(
        message["content"] or "",
        tools.syntax,
        truncated=cut_short(tools, finish_reason),
        forced=tools.mode == "calls",
        names=tuple(tool.name for tool in tools.callable),
    )
    if not reply.calls:
        if reply.content is None:  # a forced call cut before its tool was known: no text, no call
            message["content"] = None
        return message, finish_reason
    message["content"] = None
    message["tool_calls"] = [
        {
            "id": new_call_id(tools.syntax),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in reply.calls
    ]
    if finish_reason == "length":
        return message, "length"
    if finish_reason == "stop" and not all(call.complete for call in reply.calls):
        return message, "stop"  # a stop string cut the forced call: "stop", as with any stop string
    return message, "stop" if tools.named else "tool_calls"


def _service_tier(plan: GenerationPlan) -> dict[str, Any]:
    """OpenAI's ``service_tier`` of a chat completion or chunk: ``"default"`` when the request named a tier,
    else null. Completions objects have no such field."""
    return {"service_tier": plan.service_tier} if plan.chat_logprobs else {}


def final_response(
    plan: GenerationPlan,
    ids: ResponseIds,
    results: Sequence[GenerationResult],
    echoes: Sequence[Echo] | None = None,
    token_bytes: TokenBytesFn = utf8,
    scores: Sequence[Sequence[TokenLogprob]] | None = None,
) -> dict[str, Any]:
    """The non-streamed ``text_completion`` or ``chat.completion`` object; ``echoes`` (per prompt) lead each
    completions choice's text and logprobs; ``token_bytes`` gives chat logprobs' ``bytes``; ``scores`` (per
    prompt) give vLLM's ``prompt_logprobs`` when the plan asks for them."""
    choices = []
    for index, r in enumerate(results):
        echo = echoes[index // plan.n] if echoes is not None else None
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason,
            "logprobs": _logprobs(plan, r.logprobs, echo=echo, token_bytes=token_bytes),
        }
        if plan.chat_logprobs:
            choice["message"], choice["finish_reason"] = assistant_message(
                plan.tools, r.output_text, r.finish_reason, plan.reasoning
            )
        else:
            choice["text"] = (echo.text if echo is not None else "") + r.output_text
            if plan.prompt_logprobs is not None and scores is not None:
                choice["prompt_logprobs"] = prompt_logprobs(scores[index // plan.n], plan.prompt_logprobs)
        choices.append(choice)
    extra = {}
    if plan.chat_logprobs and plan.prompt_logprobs is not None and scores is not None:
        extra["prompt_logprobs"] = prompt_logprobs(scores[0], plan.prompt_logprobs)  # vLLM: not per choice
    return {
        "id": ids.id,
        "object": "chat.completion" if plan.chat_logprobs else "text_completion",
        "created": ids.created,
        "model": plan.model,
        "system_fingerprint": None,
        **_service_tier(plan),
        "choices": choices,
        "usage": usage(plan, results),
        **extra,
    }


def prompt_logprobs(scored: Sequence[TokenLogprob], top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token (nothing precedes it), then for each
    position the prompt's own token and its ``top`` most likely alternatives, keyed by token id (as a JSON
    object's keys are strings), each ``{"logprob", "rank", "decoded_token"}``; the prompt's token first."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for e in scored:
        entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for place, (token_id, text, logprob) in enumerate(e.top[:top], start=1):
            entry.setdefault(str(token_id), {"logprob": logprob, "rank": place, "decoded_token": text})
        out.append(entry)
    return out


def chunk(
    plan: GenerationPlan,
    ids: ResponseIds,
    *,
    index: int,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    offsets: TextOffsets | None = None,
    delta: dict[str, Any] | None = None,
    echo: Echo | None = None,
    token_bytes: TokenBytesFn = utf8,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One streamed chunk for choice ``index``: a text delta, the opening role delta, the finish marker (with
    ``stop_reason``, the stop string that ended the choice), (chat) an explicit ``delta`` such as a tool-call
    piece, or (completions) the ``echo`` of its prompt. ``offsets``: the choice's text offsets so far, which
    this chunk's completions logprobs advance. ``usage``: the running usage of the choice
    (``stream_options.continuous_usage_stats``; see :func:`running_usage`)."""
    if echo is not None:
        text = echo.text
        lp = _logprobs(plan, (), offsets, echo, token_bytes) if echo.logprobs is not None else None
    else:
        lp = _logprobs(plan, logprobs, offsets, token_bytes=token_bytes) if logprobs else None
    if plan.chat_logprobs:
        delta = dict(delta or {})
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
    else:
        choice = {
            "index": index,
            "text": text or "",
            "logprobs": lp,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
    out: dict[str, Any] = {
        "id": ids.id,
        "object": "chat.completion.chunk" if plan.chat_logprobs else "text_completion",
        "created": ids.created,
        "model": plan.model,
        "system_fingerprint": None,
        **_service_tier(plan),
        "choices": [choice],
    }
    if plan.include_usage:
        out["usage"] = usage if plan.continuous_usage else None
    return out


def running_usage(plan: GenerationPlan, choice: int, completion_tokens: int) -> dict[str, int]:
    """vLLM's continuous usage of choice ``choice``: its prompt's tokens and its tokens generated so far."""
    prompt_tokens = len(plan.prompts[choice // plan.n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage_chunk(
    plan: GenerationPlan, ids: ResponseIds, results: Sequence[GenerationResult]
) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the request's usage."""
    return {
        "id": ids.id,
        "object": "chat.completion.chunk" if plan.chat_logprobs else "text_completion",
        "created": ids.created,
        "model": plan.model,
        "system_fingerprint": None,
        **_service_tier(plan),
        "choices": [],
        "usage": usage(plan, results),
    }
