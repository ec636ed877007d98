"""vLLM's tokenizer routes: ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` returns exactly the ids the generation routes would queue for the same input: a ``prompt``
goes through :func:`kvb_server.engine.encode_text` (``/v1/completions``), ``messages`` through the engine's
chat template (``/v1/chat/completions``). Like those routes it tokenizes on the event loop, never on the
engine thread, so it neither waits for a step nor counts against the queue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request

from kvb_server.chat_prompt import chat_messages, template_options
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine, encode_text
from kvb_server.engine_errors import engine_error
from kvb_server.errors import EngineError, InvalidParameterError, ServerError, UnsupportedFeatureError
from kvb_server.openapi import json_body, responses
from kvb_server.request_body import off_loop, parse_request
from kvb_server.request_plan import served_model
from kvb_server.schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from kvb_server.tool_calls import detect, tool_plan

T = TypeVar("T")

#: Statuses the tokenizer routes answer besides 200.
TOKENIZE_ERRORS = (400, 401, 404, 413)


def tokenize_router(*, engine: ServingEngine, config: ServerConfig) -> APIRouter:
    """The root-level ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` routes (mount them behind the
    API key)."""
    router = APIRouter()

    @router.get("/tokenizer_info", responses=responses(TokenizerInfoResponse, errors=(401,)))
    async def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's class, special tokens, chat template and limits."""
        tok = engine.tokenizer
        template = getattr(tok, "chat_template", None)

        def token(name: str) -> str | None:
            value = getattr(tok, name, None)
            return None if value is None else str(value)

        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": token("eos_token"),
            "bos_token": token("bos_token"),
            "pad_token": token("pad_token"),
            "unk_token": token("unk_token"),
            # A tokenizer may carry several named templates (a dict); clients render the default one.
            "chat_template": template.get("default") if isinstance(template, dict) else template,
            "model_max_length": engine.context_length,
            "vocab_size": _vocab_size(engine),
        }

    @router.post(
        "/tokenize",
        openapi_extra=json_body(TokenizeRequest),
        responses=responses(TokenizeResponse, errors=TOKENIZE_ERRORS),
    )
    async def tokenize(request: Request) -> dict[str, Any]:
        """Token ids of a ``prompt`` or of chat ``messages``, with their count and the context length."""
        req = await parse_request(request, TokenizeRequest, config)
        served_model(req.model, config)
        tokens = await off_loop(request, _encode, engine, req, config.chat_template_content_format)
        body: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": engine.context_length,
            "tokens": tokens,
            "token_strs": None,
        }
        if req.return_token_strs:
            body["token_strs"] = _call(lambda: list(engine.tokenizer.convert_ids_to_tokens(tokens)))
        return body

    @router.post(
        "/detokenize",
        openapi_extra=json_body(DetokenizeRequest),
        responses=responses(DetokenizeResponse, errors=TOKENIZE_ERRORS),
    )
    async def detokenize(request: Request) -> dict[str, Any]:
        """The text of token ids (special tokens included, as vLLM decodes them)."""
        req = await parse_request(request, DetokenizeRequest, config)
        served_model(req.model, config)
        vocab = _vocab_size(engine)
        bad = next((t for t in req.tokens if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise InvalidParameterError(
                f"Token id {bad} is out of range: this model's vocabulary has {vocab} tokens (0 to "
                f"{vocab - 1}).",
                param="tokens",
            )
        return {"prompt": _call(lambda: engine.tokenizer.decode(req.tokens))}

    return router


def _encode(engine: ServingEngine, req: TokenizeRequest, content_format: str = "auto") -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise InvalidParameterError("Give exactly one of 'prompt' (a string) and 'messages' (a chat).")
    if req.tools is not None and req.messages is None:
        raise InvalidParameterError("tools go with 'messages' (a chat), not with 'prompt'.", param="tools")
    if req.messages is not None:
        syntax = detect(engine.tokenizer)
        # Parsed and rendered as the chat route does (tool_choice auto): definitions through the template
        # for a native syntax, in the system message otherwise.
        tools = tool_plan(req.tools, None, None, syntax)
        messages = chat_messages(req, syntax, engine, tools)  # type: ignore[arg-type]
        options = template_options(
            tools,
            # True is the default here (a plain bool, not sent when left): continuing the last message wins
            add_generation_prompt=None if req.add_generation_prompt else False,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
            content_format=content_format,
        )
        try:
            return _call(lambda: engine.chat_prompt(messages, **options))
        except EngineError as exc:
            cause = exc.__cause__
            name = next((n for n in options if n in str(cause)), None)
            if isinstance(cause, TypeError) and name is not None:
                raise UnsupportedFeatureError(
                    f"{name} is not supported by this engine.", param=name
                ) from None
            raise
    return _call(lambda: encode_text(engine, req.prompt, add_special_tokens=req.add_special_tokens))


def _vocab_size(engine: ServingEngine) -> int | None:
    # len() counts added tokens too (``vocab_size`` does not): every id the tokenizer can decode.
    try:
        return len(engine.tokenizer)
    except TypeError:
        return None


def _call(fn: Callable[[], T]) -> T:
    """Run a tokenizer call; its errors become the HTTP errors the generation routes give (400 / 500)."""
    try:
        return fn()
    except ServerError:
        raise
    except Exception as exc:
        raise engine_error(exc) from exc
