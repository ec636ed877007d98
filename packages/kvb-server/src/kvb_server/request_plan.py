"""From a raw request body to a :class:`GenerationPlan`: parse, refuse what is unsupported, tokenize, cap."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import jinja2
from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvb_cache.errors import InvalidRequestError
from kvb_cache.sampling import GREEDY_TEMPERATURE, SamplingParams
from kvb_cache.structured import ResponseFormat
from kvb_server import constraints
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine, encode_text
from kvb_server.errors import InvalidParameterError, ModelNotFoundError, UnsupportedFeatureError
from kvb_server.limits import DEFAULT_MAX_JSON_DEPTH, decode_json, read_body
from kvb_server.schemas.generation_requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvb_server.tenancy import request_salt
from kvb_server.tool_calls import ToolPlan, ToolSyntax, detect, template_messages, tool_grammar, tool_plan
from kvb_server.validation import invalid_parameter

Endpoint = Literal["completions", "chat.completions"]
ModelT = TypeVar("ModelT", bound=BaseModel)

#: Bodies larger than this are decoded on a worker thread.
OFFLOAD_PARSE_BYTES = 256 * 2**10


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationPlan:
    """A validated generation request, ready to become engine jobs.

    Attributes:
        prompts: token ids of each prompt (chat: exactly one).
        n: choices per prompt; choice ``i`` of prompt ``p`` gets index ``p * n + i`` (OpenAI's order) and
            the sampling of :func:`choice_params`.
        sampling: the engine's :class:`~kvb_cache.sampling.SamplingParams`, after OpenAI's defaults and the
            server's caps.
        chat_logprobs: chat-style logprobs (``content`` list) rather than completions-style arrays.
        cache_salt: the engine's prefix-cache salt (:func:`kvb_server.tenancy.request_salt`); None: unsalted.
        tools: a chat request's tools (its reply is parsed into ``tool_calls``); None: no tools.
        echo: a completions request's ``echo``: the text repeated before each choice of prompt ``p`` is
            ``echo[p]``; None: no echo.
        generate: False for ``max_tokens: 0`` with echo: nothing is queued (``sampling`` then holds one
            token, which only the admission gate reads).
        continuous_usage: ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk
            carries the usage so far.
    """

    endpoint: Endpoint
    model: str
    prompts: tuple[list[int], ...]
    n: int
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    chat_logprobs: bool
    cache_salt: str | None = None
    tools: ToolPlan | None = None
    echo: tuple[str, ...] | None = None
    generate: bool = True
    continuous_usage: bool = False


def parse_body(raw: bytes, schema: type[ModelT], *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> ModelT:
    """Decode JSON and validate it against ``schema``, mapping every failure to a 400 naming the parameter.

    The nesting limit is checked before ``json.loads`` runs (see :func:`kvb_server.limits.decode_json`).
    """
    data = decode_json(raw, max_depth=max_depth)
    if not isinstance(data, dict):
        raise InvalidParameterError("The request body must be a JSON object.")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise invalid_parameter(exc) from None


async def parse_request(request: Request, schema: type[ModelT], config: ServerConfig) -> ModelT:
    """Read the body under ``config``'s size limit, then :func:`parse_body` it (413 / 400 on failure)."""
    raw = await read_body(request, config.max_body_bytes)
    if len(raw) > OFFLOAD_PARSE_BYTES:
        # Scanning and decoding a few MiB takes up to ~1 s of CPU: keep it off the event loop.
        return await asyncio.to_thread(parse_body, raw, schema, max_depth=config.max_json_depth)
    return parse_body(raw, schema, max_depth=config.max_json_depth)


def served_model(model: str | None, config: ServerConfig) -> str:
    """The served model a request names (404 for another); left out, the first one, as vLLM answers."""
    if model is None:
        return config.model_names[0]
    if model not in config.model_names:
        raise ModelNotFoundError(model, config.model_names)
    return model


def _reject_completion(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise InvalidParameterError(
            "max_tokens must be at least 1; 0 (generate nothing) is only meaningful with echo=true.",
            param="max_tokens",
        )
    if req.suffix:
        raise UnsupportedFeatureError("suffix (insertion) is not supported by this server.", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise UnsupportedFeatureError(
            "best_of is not supported; use n to get several choices.", param="best_of"
        )


def _reject_chat(req: ChatCompletionRequest) -> None:
    for name in ("functions", "function_call"):
        if getattr(req, name) not in (None, [], "none"):
            raise UnsupportedFeatureError(
                f"{name}: the deprecated function calling is not supported; use tools and tool_choice.",
                param=name,
            )
    if req.modalities is not None and req.modalities != ["text"]:
        raise UnsupportedFeatureError("modalities: only ['text'] is supported.", param="modalities")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if getattr(req, name) is not None:
            raise UnsupportedFeatureError(f"{name} is not supported by this server; remove it.", param=name)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidParameterError("top_logprobs requires logprobs to be true.", param="top_logprobs")


def chat_messages(
    req: ChatCompletionRequest, syntax: ToolSyntax, tools: ToolPlan | None = None
) -> list[dict[str, Any]]:
    """Messages as the tokenizer's chat template expects them (tool calls and results included; see
    :func:`kvb_server.tool_calls.template_messages`)."""
    return template_messages(req.messages, syntax, tools)


def _stop(req: SamplingFields) -> tuple[str, ...]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise InvalidParameterError("stop strings must be non-empty.", param="stop")
    return tuple(stop)


def _max_new_tokens(
    requested: int | None,
    default: int,
    prompts: tuple[list[int], ...],
    engine: ServingEngine,
    config: ServerConfig,
    *,
    prompt_param: str,
    room_needed: int = 1,
) -> int:
    """OpenAI's budget rule: an explicit request beyond the context window is a 400; a default shrinks.

    ``room_needed`` is 0 for a prompt that is only scored (echo with ``max_tokens: 0``): it may fill the
    context. The result is then at least 1 (what the admission gate plans for), never generated."""
    longest = max(len(p) for p in prompts)
    context = engine.context_length
    room = config.max_tokens if context is None else context - longest
    if room < room_needed:
        raise InvalidParameterError(
            f"This model's maximum context length is {engine.context_length} tokens, but the prompt has "
            f"{longest} tokens. Shorten the prompt.",
            param=prompt_param,
        )
    if requested is None:
        return max(min(default, config.max_tokens, room), 1)
    capped = min(requested, config.max_tokens)
    if capped > room:
        raise InvalidParameterError(
            f"This model's maximum context length is {engine.context_length} tokens. However, you requested "
            f"{longest + capped} tokens ({longest} in the prompt, {capped} for the completion). Reduce the "
            "prompt or max_tokens.",
            param="max_tokens",
        )
    return capped


def _sampling(
    req: SamplingFields, max_new_tokens: int, logprobs: int | None, fmt: ResponseFormat | None = None
) -> SamplingParams:
    """OpenAI's parameters as the engine's sampling settings (OpenAI's defaults where omitted); ``fmt``
    constrains the reply (``response_format`` or a tool-call grammar)."""
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default, not the engine's 0
    if temperature < GREEDY_TEMPERATURE:
        # The engine already decodes these greedily; reporting them as 0 keeps the request's settings honest.
        temperature = 0.0
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0.0:  # only the most likely token survives: that is greedy decoding
        temperature, top_p = 0.0, 1.0
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=max(req.top_k or 0, 0),  # -1 (vLLM's old "off") and 0 both disable it
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            ignore_eos=bool(req.ignore_eos),
            min_tokens=req.min_tokens or 0,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            stop=_stop(req),
            seed=req.seed,
            logprobs=logprobs,
            response_format=fmt,
            logit_bias=constraints.logit_bias(req.logit_bias),
        )
    except InvalidRequestError as exc:  # the schema checks ranges first; this is the engine's last word
        param = {"max_new_tokens": "max_tokens"}.get(exc.param or "", exc.param)
        raise InvalidParameterError(str(exc), param=param) from None


def _continuous_usage(req: SamplingFields) -> bool:
    """Whether every chunk carries usage; ``stream_options`` without ``stream`` is a 400 (as OpenAI and vLLM
    answer: the options would silently do nothing)."""
    options = req.stream_options
    if options is None:
        return False
    if not req.stream:
        raise InvalidParameterError(
            "stream_options is only allowed when stream is true.", param="stream_options"
        )
    return options.include_usage and options.continuous_usage_stats


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sampling of choice ``index`` of an ``n > 1`` request: each choice gets its own seed (``seed + index``)."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def _n(req: SamplingFields, config: ServerConfig) -> int:
    n = req.n or 1
    if n > config.max_n:
        raise InvalidParameterError(f"n must be at most {config.max_n} on this server, got {n}.", param="n")
    return n


def completion_plan(
    req: CompletionRequest, engine: ServingEngine, config: ServerConfig, *, key_salt: str | None = None
) -> GenerationPlan:
    """The plan of a ``/v1/completions`` request; ``key_salt`` is the caller's API-key salt, if any."""
    model = served_model(req.model, config)
    cache_salt = request_salt(key_salt, req.cache_salt)
    _reject_completion(req)
    raw = req.prompt
    if isinstance(raw, str):
        prompts = (encode_text(engine, raw),)
    elif raw and all(isinstance(p, str) for p in raw):
        prompts = tuple(encode_text(engine, p) for p in raw)  # type: ignore[arg-type]
    elif raw and all(isinstance(p, int) for p in raw):
        prompts = (list(raw),)  # type: ignore[arg-type]
    else:
        prompts = tuple(list(p) for p in raw)  # type: ignore[union-attr]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidParameterError("prompt must not be empty.", param="prompt")
    generate = req.max_tokens != 0
    max_new = _max_new_tokens(
        req.max_tokens if generate else None,
        config.default_completion_max_tokens,
        prompts,
        engine,
        config,
        prompt_param="prompt",
        room_needed=1 if generate else 0,
    )
    echo = None
    if req.echo:
        # A text prompt is echoed as sent; token ids as the tokenizer decodes them (special tokens kept).
        texts = [raw] if isinstance(raw, str) else raw if isinstance(raw[0], str) else None
        echo = tuple(texts) if texts is not None else tuple(engine.tokenizer.decode(p) for p in prompts)  # type: ignore[arg-type]
    return GenerationPlan(
        endpoint="completions",
        model=model,
        prompts=prompts,
        n=_n(req, config),
        sampling=_sampling(req, max_new, req.logprobs, constraints.requested_format(req)[1]),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=_continuous_usage(req),
        chat_logprobs=False,
        cache_salt=cache_salt,
        echo=echo,
        generate=generate,
    )


def _marker_token(engine: ServingEngine, syntax: ToolSyntax) -> int | None:
    """The id of the syntax's marker when the tokenizer has it as one (special) token."""
    if not syntax.marker:
        return None
    tokenizer = engine.tokenizer
    token = tokenizer.convert_tokens_to_ids(syntax.marker)
    return None if token is None or token == getattr(tokenizer, "unk_token_id", None) else int(token)


def _check_tool_schemas(tools: ToolPlan | None) -> None:
    """Each tool's ``parameters`` must be a schema the grammar library handles: a 400 naming the tool."""
    for i, tool in enumerate(tools.tools if tools is not None else ()):
        schema = ResponseFormat(kind="json_schema", source=json.dumps(tool.parameters, allow_nan=False))
        constraints.check(schema, f"tools[{i}].function.parameters")


def _reply_format(
    req: ChatCompletionRequest, tools: ToolPlan | None, engine: ServingEngine, syntax: ToolSyntax
) -> ResponseFormat | None:
    """What the reply is constrained to: the tools' call grammar, else ``response_format`` (or vLLM's
    guided-decoding fields)."""
    raw, fmt = constraints.requested_format(req)
    if tools is None or tools.mode == "none":
        return fmt
    text_schema = None
    if tools.mode == "auto" and fmt is not None:
        text_schema = constraints.json_schema_of(raw)
        if text_schema is None:
            raise InvalidParameterError(
                "response_format: only json_object and json_schema combine with tools (tool_choice 'auto').",
                param="response_format",
            )
    grammar = tool_grammar(tools, marker_token=_marker_token(engine, syntax), text_schema=text_schema)
    tool_format = ResponseFormat(kind="grammar", source=grammar)
    constraints.check(tool_format, "tools")
    return tool_format


def _render_chat(
    engine: ServingEngine, messages: list[dict[str, Any]], tools: ToolPlan | None, req: ChatCompletionRequest
) -> list[int]:
    definitions = [t.definition() for t in tools.tools] if tools is not None and tools.syntax.native else None
    options: dict[str, Any] = {}  # vLLM's template options, passed only when sent (the protocol's defaults)
    if req.add_generation_prompt is not None:
        options["add_generation_prompt"] = req.add_generation_prompt
    if req.continue_final_message:
        options["continue_final_message"] = True
        options.setdefault("add_generation_prompt", False)  # vLLM's rule: continuing implies no new turn
    if req.chat_template_kwargs:
        options["chat_template_kwargs"] = req.chat_template_kwargs
    if definitions:
        options["tools"] = definitions
    try:
        return engine.chat_prompt(messages, **options)
    except jinja2.TemplateError as exc:  # the template refused the conversation (its raise_exception)
        raise InvalidParameterError(
            f"The chat template refused these messages: {exc}", param="messages"
        ) from None
    except InvalidRequestError as exc:  # the engine's checks of those options
        raise InvalidParameterError(str(exc), param=exc.param or "messages") from None


def chat_plan(
    req: ChatCompletionRequest, engine: ServingEngine, config: ServerConfig, *, key_salt: str | None = None
) -> GenerationPlan:
    """The plan of a ``/v1/chat/completions`` request; ``key_salt`` is the caller's API-key salt, if any."""
    model = served_model(req.model, config)
    cache_salt = request_salt(key_salt, req.cache_salt)
    _reject_chat(req)
    syntax = detect(engine.tokenizer)
    tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, syntax)
    _check_tool_schemas(tools)
    fmt = _reply_format(req, tools, engine, syntax)
    prompts = (_render_chat(engine, chat_messages(req, syntax, tools), tools, req),)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_new = _max_new_tokens(requested, config.max_tokens, prompts, engine, config, prompt_param="messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return GenerationPlan(
        endpoint="chat.completions",
        model=model,
        prompts=prompts,
        n=_n(req, config),
        sampling=_sampling(req, max_new, logprobs, fmt),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=_continuous_usage(req),
        chat_logprobs=True,
        cache_salt=cache_salt,
        tools=tools if tools is not None and tools.parses_calls else None,
    )
