"""From a validated generation request to a :class:`GenerationPlan`: refuse what is unsupported, tokenize, cap.

The body is read and validated first (:mod:`kvb_server.request_body`); the sampling settings come from
:mod:`kvb_server.sampling_params` and a chat request's prompt and reply constraint from
:mod:`kvb_server.chat_prompt`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from kvb_cache.sampling import SamplingParams
from kvb_cache.structured import ResponseFormat
from kvb_server import constraints
from kvb_server.chat_prompt import (
    chat_messages,
    check_tool_schemas,
    render_chat,
    reply_format,
)
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine, encode_text
from kvb_server.errors import InvalidParameterError, ModelNotFoundError
from kvb_server.reasoning import ReasoningPlan, closes_block, opens_block, parser_syntax
from kvb_server.request_checks import (
    check_logprobs,
    check_priority,
    check_prompt_logprobs,
    check_queue_room,
    reject_chat,
    reject_completion,
)
from kvb_server.sampling_params import (
    choice_count,
    choice_params,
    continuous_usage,
    default_max_tokens,
    max_new_tokens,
    sampling_params,
)
from kvb_server.schemas.generation_requests import ChatCompletionRequest, CompletionRequest
from kvb_server.tag_tokens import keeps_special_tags
from kvb_server.tenancy import request_salt
from kvb_server.tool_calls import ToolPlan, ToolSyntax, detect, tool_plan

Endpoint = Literal["completions", "chat.completions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationPlan:
    """A validated generation request, ready to become engine jobs.

    Attributes:
        prompts: token ids of each prompt (chat: exactly one).
        n: choices per prompt; choice ``i`` of prompt ``p`` gets index ``p * n + i`` (OpenAI's order) and
            the sampling of :func:`kvb_server.sampling_params.choice_params`.
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
        service_tier: the tier a chat response reports (``"default"``, the only one, when the request named
            one; None otherwise: OpenAI reports it when asked).
        reasoning: how a chat reply's thinking is split out (``--reasoning-parser``); None: not at all.
        priority: vLLM's request priority (lower first), checked against the engine's scheduling policy.
        budgets: each prompt's ``max_new_tokens`` (a default shrinks to each prompt's own room; ``sampling``
            holds the largest); empty: ``sampling``'s for every prompt.
        prompt_logprobs: vLLM's ``prompt_logprobs``: alternatives per prompt position (the prompt is scored,
            its own tokens' logprobs and ranks reported); None: not asked.
        tokens_as_ids: vLLM's ``return_tokens_as_token_ids``: logprobs name tokens ``"token_id:<id>"``.
        format_field: the request field the output constraint came in (``guided_regex``,
            ``structured_outputs.choice``, ``response_format``), which a grammar failure while decoding names.
    """

    endpoint: Endpoint
    model: str
    prompts: tuple[list[int], ...]
    n: int
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    chat_logprobs: bool
    tokens_as_ids: bool = False
    format_field: str = "response_format"
    #: The request sent a ``prediction`` (its usage then reports the prediction's accepted / rejected tokens).
    predicted: bool = False
    cache_salt: str | None = None
    tools: ToolPlan | None = None
    echo: tuple[str, ...] | None = None
    generate: bool = True
    continuous_usage: bool = False
    service_tier: str | None = None
    reasoning: ReasoningPlan | None = None
    budgets: tuple[int, ...] = ()
    priority: int = 0
    prompt_logprobs: int | None = None

    @property
    def scored(self) -> bool:
        """The response carries logprobs (of the output, or of an echoed or scored prompt): its body may run
        to tens of MB, built off the event loop (:meth:`GenerationService.complete`)."""
        return self.sampling.logprobs is not None or self.prompt_logprobs is not None

    def prompt_sampling(self, prompt: int, choice: int) -> SamplingParams:
        """The sampling of choice ``choice`` of prompt ``prompt``: its own seed and its prompt's budget."""
        params = choice_params(self.sampling, choice)
        if self.budgets and self.budgets[prompt] != params.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=self.budgets[prompt])
        return params


def served_model(model: str | None, config: ServerConfig) -> str:
    """The served model a request names (404 for another); left out, the first one, as vLLM answers."""
    if model is None:
        return config.model_names[0]
    if model not in config.model_names:
        raise ModelNotFoundError(model, config.model_names)
    return model


def _echo_text(engine: ServingEngine, ids: list[int]) -> str:
    """The echo of a token-id prompt. Decoded before the engine checks the ids against its vocabulary (at
    admission), so an id the tokenizer cannot take (>= 2**32: OverflowError) is refused here: it was a 500."""
    try:
        return engine.tokenizer.decode(ids)
    except (OverflowError, ValueError, TypeError, IndexError) as exc:
        raise InvalidParameterError(
            f"prompt holds a token id the tokenizer cannot decode ({exc}); token ids index the model's "
            "vocabulary",
            param="prompt",
        ) from None


def completion_plan(
    req: CompletionRequest, engine: ServingEngine, config: ServerConfig, *, key_salt: str | None = None
) -> GenerationPlan:
    """The plan of a ``/v1/completions`` request; ``key_salt`` is the caller's API-key salt, if any."""
    model = served_model(req.model, config)
    cache_salt = request_salt(key_salt, req.cache_salt)
    reject_completion(req)
    check_logprobs(req.logprobs, config, param="logprobs")
    raw = req.prompt
    special = req.add_special_tokens
    if isinstance(raw, str):
        prompts = (encode_text(engine, raw, add_special_tokens=special),)
    elif raw and all(isinstance(p, str) for p in raw):
        prompts = tuple(encode_text(engine, p, add_special_tokens=special) for p in raw)  # type: ignore[arg-type]
    elif raw and all(isinstance(p, int) for p in raw):
        prompts = (list(raw),)  # type: ignore[arg-type]
    else:
        prompts = tuple(list(p) for p in raw)  # type: ignore[union-attr]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidParameterError("prompt must not be empty.", param="prompt")
    truncated = truncate_prompts(prompts, req.truncate_prompt_tokens, engine)
    generate = req.max_tokens != 0
    max_new = max_new_tokens(
        req.max_tokens if generate else None,
        default_max_tokens(config.default_completion_max_tokens, config.sampling_defaults),
        truncated,
        engine,
        config,
        prompt_param="prompt",
        room_needed=1 if generate else 0,
    )
    echo = None
    if req.echo:
        # A text prompt is echoed as sent; token ids as the tokenizer decodes them (special tokens kept).
        texts = [raw] if isinstance(raw, str) else raw if isinstance(raw[0], str) else None
        # Echoed as the model saw it: a truncated prompt's kept tokens only (an id in the cut part, decoded,
        # made the same request a 400 with echo and a 200 without).
        if truncated is not prompts or texts is None:
            echo = tuple(_echo_text(engine, p) for p in truncated)
        else:
            echo = tuple(texts)  # type: ignore[arg-type]
    prompts = truncated
    n = choice_count(req, config)
    if generate:  # a prompt that is only scored (echo, max_tokens 0) queues no generation
        check_queue_room(len(prompts), n, config, prompt_param="prompt")
    return GenerationPlan(
        endpoint="completions",
        model=model,
        prompts=prompts,
        n=n,
        sampling=sampling_params(
            req,
            max_new,
            req.logprobs,
            constraints.requested_format(req)[1],
            config.sampling_defaults,
            engine.tokenizer,
        ),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=continuous_usage(req),
        chat_logprobs=False,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        cache_salt=cache_salt,
        echo=echo,
        generate=generate,
        budgets=max_new,
        priority=check_priority(req.priority, engine),
        prompt_logprobs=check_prompt_logprobs(req, config),
        format_field=constraints.constraint_field(req),
    )


def _keep_tags(sampling: SamplingParams, keep: bool) -> SamplingParams:
    """``sampling`` decoding special tokens into the text when the reply's tags are special tokens
    (:func:`kvb_server.tag_tokens.keeps_special_tags`)."""
    return dataclasses.replace(sampling, skip_special_tokens=False) if keep else sampling


def chat_plan(
    req: ChatCompletionRequest, engine: ServingEngine, config: ServerConfig, *, key_salt: str | None = None
) -> GenerationPlan:
    """The plan of a ``/v1/chat/completions`` request; ``key_salt`` is the caller's API-key salt, if any."""
    model = served_model(req.model, config)
    cache_salt = request_salt(key_salt, req.cache_salt)
    reject_chat(req)
    check_logprobs(req.top_logprobs if req.logprobs else None, config, param="top_logprobs")
    syntax, tools, prompt = _chat_prompt(req, engine, config)
    prompts = truncate_prompts((prompt,), req.truncate_prompt_tokens, engine)
    requested = constraints.requested_format(req)  # compile-checks the grammar: once per request
    thinking = _reasoning_plan(config, engine, prompts[0], req, tools, requested[1])
    fmt = reply_format(requested, tools, engine, syntax, thinking)
    budget_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_new = max_new_tokens(
        getattr(req, budget_param),
        default_max_tokens(config.max_tokens, config.sampling_defaults),
        prompts,
        engine,
        config,
        prompt_param="messages",
        budget_param=budget_param,
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    n = choice_count(req, config)
    check_queue_room(len(prompts), n, config, prompt_param="messages")
    return GenerationPlan(
        endpoint="chat.completions",
        model=model,
        prompts=prompts,
        n=n,
        sampling=_keep_tags(
            sampling_params(req, max_new, logprobs, fmt, config.sampling_defaults, engine.tokenizer),
            keeps_special_tags(engine, tools, thinking),
        ),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=continuous_usage(req),
        chat_logprobs=True,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        predicted=req.prediction is not None,
        cache_salt=cache_salt,
        tools=tools if tools is not None and tools.parses_calls else None,
        service_tier="default" if req.service_tier is not None else None,
        reasoning=thinking,
        budgets=max_new,
        priority=check_priority(req.priority, engine),
        prompt_logprobs=check_prompt_logprobs(req, config),
        format_field=constraints.constraint_field(req),
    )


def truncate_prompts(
    prompts: tuple[list[int], ...], keep: int | None, engine: ServingEngine
) -> tuple[list[int], ...]:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``keep`` tokens of each prompt (-1: the context
    length); ``prompts`` itself when nothing is cut.

    As in vLLM the *end* is kept (a chat prompt loses its system prompt and oldest turns first) and the cut
    comes before the reply's budget is checked against the context.
    """
    if keep is None:
        return prompts
    context = engine.context_length
    if keep == -1:
        if context is None:
            return prompts
        keep = context
    if keep == 0:
        raise InvalidParameterError(
            "truncate_prompt_tokens must be -1 (the model's context length) or >= 1, got 0.",
            param="truncate_prompt_tokens",
        )
    if context is not None and keep > context:
        raise InvalidParameterError(
            f"truncate_prompt_tokens ({keep}) is greater than this model's maximum context length "
            f"({context}); select a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    if not any(len(p) > keep for p in prompts):
        return prompts
    return tuple(p[-keep:] for p in prompts)


def _chat_prompt(
    req: ChatCompletionRequest, engine: ServingEngine, config: ServerConfig
) -> tuple[ToolSyntax, ToolPlan | None, list[int]]:
    """The tool syntax, the tool plan and the prompt ids of a chat request (its tools rendered)."""
    syntax = detect(engine.tokenizer)
    tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, syntax)
    check_tool_schemas(tools)
    messages = chat_messages(req, syntax, engine, tools)
    return syntax, tools, render_chat(engine, messages, tools, req, config.chat_template_content_format)


def chat_prompt_tokens(req: ChatCompletionRequest, engine: ServingEngine, config: ServerConfig) -> list[int]:
    """The prompt ids ``chat_plan`` would queue for ``req``, without its generation checks (the reply's
    budget against the context, the queue's room): what ``POST /v1/responses/input_tokens`` counts."""
    served_model(req.model, config)
    reject_chat(req)
    return _chat_prompt(req, engine, config)[2]


def _reasoning_plan(
    config: ServerConfig,
    engine: ServingEngine,
    prompt: list[int],
    req: ChatCompletionRequest,
    tools: ToolPlan | None,
    fmt: ResponseFormat | None,
) -> ReasoningPlan | None:
    """How the reply's thinking is split out: None without ``--reasoning-parser``, and for a reply held to
    a regex or grammar ``response_format`` (it starts at the first token, leaving no room to think first);
    the tools' and JSON grammars admit a thinking block first (:mod:`kvb_server.tool_calls.grammar`)."""
    if config.reasoning_parser is None:
        return None
    calls = tools is not None and tools.mode != "none"
    if fmt is not None and fmt.kind != "json_schema" and not calls:
        return None
    syntax = parser_syntax(config.reasoning_parser)
    # The last few tokens hold the generation prompt's end: "<think>\n" when the template opens the block,
    # "</think>\n\n" when it closed an empty one (thinking off): then there is nothing to split, and the
    # tools' / JSON grammar holds the reply from its first token (it admitted a new block before, and a
    # forced tool_choice could end with thinking and no call: an audit, 2026-12-01).
    tail = engine.tokenizer.decode(prompt[-16:])
    if closes_block(tail, syntax):
        return None
    return ReasoningPlan(syntax, opens_block(tail, syntax), include=req.include_reasoning)
