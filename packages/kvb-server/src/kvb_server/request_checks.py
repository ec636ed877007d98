"""Checks of a generation request against what this server does and how it was started (``--max-logprobs``,
``--max-queue-size``, ``--scheduling-policy``): each refusal is a 400 naming the field and the fix."""

from __future__ import annotations

from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import InvalidParameterError, UnsupportedFeatureError
from kvb_server.schemas.generation_requests import ChatCompletionRequest, CompletionRequest, SamplingFields


def reject_completion(req: CompletionRequest) -> None:
    """Refuse what /v1/completions does not do (``suffix``, ``best_of`` above ``n``) and ``max_tokens: 0``
    without ``echo``."""
    if req.max_tokens == 0 and not req.echo:
        raise InvalidParameterError(
            "max_tokens must be at least 1; 0 (generate nothing) is only meaningful with echo=true.",
            param="max_tokens",
        )
    if req.suffix:
        raise UnsupportedFeatureError("suffix (insertion) is not supported by this server.", param="suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of < n:
        # OpenAI's rule (best_of candidates, n of them returned); 0 and negatives land here too.
        raise InvalidParameterError(f"best_of must be at least n ({n}); got {req.best_of}.", param="best_of")
    if req.best_of is not None and req.best_of != n:
        raise UnsupportedFeatureError(
            "best_of above n is not supported (no server-side choice of the best candidates); use n to "
            "get several choices and rank them with logprobs.",
            param="best_of",
        )


def reject_chat(req: ChatCompletionRequest) -> None:
    """Refuse what /v1/chat/completions does not do (deprecated function calling, audio, other modalities,
    web search, ``add_special_tokens``) and ``top_logprobs`` without ``logprobs``."""
    for name in ("functions", "function_call"):
        if getattr(req, name) not in (None, [], "none"):
            raise UnsupportedFeatureError(
                f"{name}: the deprecated function calling is not supported; use tools and tool_choice.",
                param=name,
            )
    if req.modalities is not None and req.modalities != ["text"]:
        raise UnsupportedFeatureError("modalities: only ['text'] is supported.", param="modalities")
    for name in ("audio", "reasoning_effort", "web_search_options"):
        if getattr(req, name) is not None:
            raise UnsupportedFeatureError(f"{name} is not supported by this server; remove it.", param=name)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidParameterError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    if req.add_special_tokens:
        raise UnsupportedFeatureError(
            "add_special_tokens: true is not supported on chat: the chat template places the model's special "
            "tokens (send the rendered text to /v1/completions to add them yourself).",
            param="add_special_tokens",
        )


#: ``prompt_logprobs: -1`` (every token) on a server without a ``--max-logprobs`` cap: the scorer clamps it to
#: the vocabulary.
EVERY_TOKEN = 1 << 31


def check_prompt_logprobs(req: SamplingFields, config: ServerConfig) -> int | None:
    """vLLM's ``prompt_logprobs`` as an alternatives count (None: not asked): within ``--max-logprobs``
    (-1, every token, only without a cap), and not with ``stream`` (vLLM's rule: they come with the whole
    response)."""
    count = req.prompt_logprobs
    if count is None:
        return None
    if req.stream:
        raise InvalidParameterError(
            "prompt_logprobs are not available with stream=true (as on vLLM); send the request without "
            "stream, or score the prompt with /v1/completions, echo and logprobs.",
            param="prompt_logprobs",
        )
    if count == -1:
        if config.max_logprobs != -1:
            raise InvalidParameterError(
                f"prompt_logprobs=-1 (every token) needs a server started with --max-logprobs -1; this one "
                f"returns at most {config.max_logprobs} alternatives.",
                param="prompt_logprobs",
            )
        return EVERY_TOKEN
    check_logprobs(count, config, param="prompt_logprobs")
    return count


def check_logprobs(count: int | None, config: ServerConfig, *, param: str) -> None:
    """Refuse more alternatives per token than ``--max-logprobs`` allows (vLLM's check; the schema
    cannot hold a limit the command line sets)."""
    if count is not None and config.max_logprobs != -1 and count > config.max_logprobs:
        raise InvalidParameterError(
            f"{param} must be at most {config.max_logprobs} (this server's --max-logprobs), got {count}.",
            param=param,
        )


def check_queue_room(prompts: int, n: int, config: ServerConfig, *, prompt_param: str) -> None:
    """A request is queued whole or not at all (:meth:`EngineWorker.submit`), so one with more choices than
    ``max_queue_size`` could never be: a 400 naming what to send less of, not a 503 ``queue_full`` that
    invites retries which can never succeed."""
    choices = prompts * n
    if choices > config.max_queue_size:
        raise InvalidParameterError(
            f"This request has {choices} choices ({prompts} prompt(s) x n={n}), but this server queues at "
            f"most {config.max_queue_size} requests. Send fewer prompts per request, or a smaller n.",
            param=prompt_param if prompts > 1 else "n",
        )


def check_priority(priority: int | None, engine: ServingEngine) -> int:
    """vLLM's ``priority`` (default 0): any other value needs an engine scheduling by priority (vLLM refuses
    it otherwise too), checked before anything is queued."""
    if not priority:
        return 0
    config = getattr(engine, "config", None)
    if getattr(config, "scheduling_policy", None) != "priority":
        raise InvalidParameterError(
            f"priority {priority} needs priority scheduling, which is off: start the server with "
            "--scheduling-policy priority.",
            param="priority",
        )
    return priority
