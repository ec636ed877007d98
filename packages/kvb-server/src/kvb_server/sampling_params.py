"""The engine's :class:`~kvb_cache.sampling.SamplingParams` from a request's sampling fields.

OpenAI's defaults where a field is omitted (``temperature`` 1, not the engine's 0) unless the model's generation
config recommends another (``--generation-config``, :mod:`kvb_server.generation_config`), the server's caps
(``max_tokens``, ``n``), OpenAI's token-budget rule against the context window, and the per-choice seeds of
an ``n > 1`` request.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from kvb_cache.errors import InvalidRequestError
from kvb_cache.sampling import GREEDY_TEMPERATURE, SamplingParams
from kvb_cache.structured import ResponseFormat
from kvb_cache.token_bans import bad_words_ids
from kvb_server import constraints
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import CONTEXT_LENGTH_EXCEEDED, InvalidParameterError
from kvb_server.generation_config import NO_DEFAULTS, SamplingDefaults
from kvb_server.schemas.generation_requests import SamplingFields

T = TypeVar("T")


def _stop_strings(req: SamplingFields) -> tuple[str, ...]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise InvalidParameterError("stop strings must be non-empty.", param="stop")
    return tuple(stop)


def max_new_tokens(
    requested: int | None,
    default: int,
    prompts: tuple[list[int], ...],
    engine: ServingEngine,
    config: ServerConfig,
    *,
    prompt_param: str,
    budget_param: str = "max_tokens",
    room_needed: int = 1,
) -> tuple[int, ...]:
    """OpenAI's budget rule, one budget per prompt: an explicit request beyond the context window is a 400;
    a default shrinks to each prompt's own room (vLLM sizes each prompt of a batch by itself: sized by the
    longest, a 5-token prompt got 8 tokens instead of 16 beside a 120-token one in a 128-token window).

    The request is checked against the window before the server's ``--max-tokens`` clamp, as vLLM checks
    it: clamped first, ``max_tokens: 100000`` on an 8192-token model was served 1024 tokens as if that were
    what the client asked for. ``budget_param`` names the field the client sent (``max_tokens`` or
    ``max_completion_tokens``). ``room_needed`` is 0 for a prompt that is only scored (echo with
    ``max_tokens: 0``): it may fill the context. The budget is then at least 1 (what the admission gate
    plans for), never generated. The messages are vLLM's, so clients that parse them (to turn an
    over-long request into a ``length`` finish) read ours too; ``code`` is ``context_length_exceeded``."""
    longest = max(len(p) for p in prompts)
    context = engine.context_length
    if context is None:
        rooms = tuple(config.max_tokens for _ in prompts)
    else:
        rooms = tuple(context - len(p) for p in prompts)
    if min(rooms) < room_needed:
        raise InvalidParameterError(
            f"This model's maximum context length is {context} tokens. However, your request has {longest} "
            "input tokens. Please reduce the length of the input messages.",
            param=prompt_param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    if requested is None:
        return tuple(max(min(default, config.max_tokens, room), 1) for room in rooms)
    if context is not None and requested > min(rooms):
        raise InvalidParameterError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
            f"context length is {context} tokens and your request has {longest} input tokens "
            f"({requested} > {context} - {longest}).",
            param=budget_param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    return tuple(min(requested, config.max_tokens) for _ in prompts)


def default_max_tokens(endpoint_default: int, defaults: SamplingDefaults) -> int:
    """The budget of a request without ``max_tokens``: the endpoint's default (completions: 16, chat: the
    server cap), or the generation config's ``max_new_tokens`` when smaller (vLLM takes the least of them)."""
    if defaults.max_tokens is None:
        return endpoint_default
    return min(endpoint_default, defaults.max_tokens)


def _or(value: T | None, default: T | None, builtin: T) -> T:
    """A request's field, else the generation config's default, else OpenAI's."""
    if value is not None:
        return value
    return builtin if default is None else default


def sampling_params(
    req: SamplingFields,
    max_new_tokens: tuple[int, ...],
    logprobs: int | None,
    fmt: ResponseFormat | None = None,
    defaults: SamplingDefaults = NO_DEFAULTS,
    tokenizer: Any = None,
) -> SamplingParams:
    """OpenAI's parameters as the engine's sampling settings; a field the request omits (or sends as null)
    gets ``defaults``' value (``--generation-config``), else OpenAI's default. ``fmt`` constrains the reply
    (``response_format`` or a tool-call grammar). ``max_new_tokens``: each prompt's budget; the params
    hold the largest (:meth:`GenerationPlan.prompt_sampling` gives each prompt its own). ``tokenizer`` encodes vLLM's ``bad_words`` (required when
    the request has them)."""
    if req.spaces_between_special_tokens is False:
        raise InvalidParameterError(
            "spaces_between_special_tokens false is not supported: special tokens are decoded by the "
            "tokenizer's own rule.",
            param="spaces_between_special_tokens",
        )
    temperature = _or(req.temperature, defaults.temperature, 1.0)  # OpenAI's default, not the engine's 0
    if temperature < GREEDY_TEMPERATURE:
        # The engine already decodes these greedily; reporting them as 0 keeps the request's settings honest.
        temperature = 0.0
    if req.min_tokens is not None and req.min_tokens > min(max_new_tokens):
        # Checked here so the message names the request's fields; the engine's own check names its
        # internal ``max_new_tokens``, which no client sent.
        raise InvalidParameterError(
            f"min_tokens must be at most the completion's token budget ({min(max_new_tokens)}: max_tokens or "
            f"max_completion_tokens, capped by the context window and the server), got {req.min_tokens}.",
            param="min_tokens",
        )
    top_p = _or(req.top_p, defaults.top_p, 1.0)
    if top_p == 0.0:  # only the most likely token survives: that is greedy decoding
        temperature, top_p = 0.0, 1.0
    try:
        banned = bad_words_ids(tokenizer, req.bad_words) if req.bad_words else ()
        return SamplingParams(
            max_new_tokens=max(max_new_tokens),
            temperature=temperature,
            top_p=top_p,
            top_k=max(_or(req.top_k, defaults.top_k, 0), 0),  # -1 (vLLM's old "off") and 0 both disable it
            min_p=_or(req.min_p, defaults.min_p, 0.0),
            repetition_penalty=_or(req.repetition_penalty, defaults.repetition_penalty, 1.0),
            ignore_eos=bool(req.ignore_eos),
            min_tokens=req.min_tokens or 0,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            stop=_stop_strings(req),
            seed=req.seed,
            logprobs=logprobs,
            response_format=fmt,
            logit_bias=constraints.logit_bias(req.logit_bias),
            allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids else None,
            bad_words_ids=banned,
            prediction_ids=_prediction_ids(req, tokenizer),
        )
    except InvalidRequestError as exc:  # the schema checks ranges first; this is the engine's last word
        param = {"max_new_tokens": "max_tokens"}.get(exc.param or "", exc.param)
        raise InvalidParameterError(str(exc), param=param) from None


def _prediction_ids(req: SamplingFields, tokenizer: Any) -> tuple[int, ...] | None:
    """A chat request's ``prediction`` as token ids (encoded as the reply's text would be: no special tokens)."""
    prediction = getattr(req, "prediction", None)
    if prediction is None or not prediction.text or tokenizer is None:
        return None
    return tuple(tokenizer.encode(prediction.text, add_special_tokens=False))


def continuous_usage(req: SamplingFields) -> bool:
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
    """Sampling of choice ``index`` of an ``n > 1`` request: each choice gets its own seed (``seed + index``,
    as vLLM's child requests).

    Taken modulo 2**64, the range torch's generator reads (a negative seed draws as ``seed + 2**64``): ``seed=-2``
    gave choice 1 the seed -1, which ``SamplingParams`` reads as "no seed", so that one choice changed on every
    call; and ``2**64 - 1`` gave choice 1 a seed torch refuses."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)


def choice_count(req: SamplingFields, config: ServerConfig) -> int:
    """Choices per prompt (``n``; 400 above the server's ``max_n``)."""
    n = req.n or 1
    if n > config.max_n:
        raise InvalidParameterError(f"n must be at most {config.max_n} on this server, got {n}.", param="n")
    return n
