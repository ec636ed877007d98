"""A pydantic :class:`ValidationError` as the one OpenAI-style 400 a client reads.

pydantic reports every branch of a union: ``"stop": ["a", ...]`` fails the string branch ("Input should be a
valid string") before the list branch says what is really wrong ("at most 64 items"). The error that explains
a failure is the one from a branch whose type the input matched, so type mismatches rank last.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvb_server.errors import InvalidParameterError

_TEMPLATE = (
    "messages are rendered with the model's own chat template; to render them otherwise, send the prompt "
    "text to /v1/completions (POST /tokenize with messages shows this server's rendering)"
)
#: vLLM's request extras this server does not take, with what to do instead: an unknown field stays a 400
#: (never silently ignored), and for these the message names the fix.
VLLM_EXTRAS: dict[str, str] = {
    "spaces_between_special_tokens": "special tokens are decoded by the tokenizer's own rule",
    "chat_template": _TEMPLATE,
    "documents": _TEMPLATE,
    "use_beam_search": "beam search is not supported; sample several choices with 'n'",
    "length_penalty": "beam search is not supported; sample several choices with 'n'",
    "bad_words": "ban tokens with 'logit_bias' (-100)",
    "allowed_token_ids": "constrain the reply with 'logit_bias' or 'response_format' (e.g. a regex)",
    "prompt_logprobs": "score the prompt with /v1/completions, 'echo': true and 'logprobs'",
    "truncate_prompt_tokens": "shorten the prompt on the client (POST /tokenize counts its tokens)",
    "priority": "requests are served first come, first served",
    "request_id": "the server assigns response ids",
    "guided_decoding_backend": "the server picks the grammar library",
    "guided_whitespace_pattern": "the server picks the grammar library",
}


def _is_type_mismatch(error: Any) -> bool:
    # pydantic names type mismatches "<type>_type" (string_type, list_type, int_type, model_type, ...).
    return str(error.get("type", "")).endswith("_type")


def _is_field(part: str | int) -> bool:
    # Union branches appear in ``loc`` under their type's name ("str", "list[constrained-str]", "TextPart");
    # request fields are lower-case identifiers.
    return isinstance(part, int) or (
        part.isidentifier() and part[:1].islower() and part not in {"str", "int", "float", "bool", "list"}
    )


def field_path(loc: tuple[str | int, ...]) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``, without union branch names."""
    path = ""
    for part in loc:
        if not _is_field(part):
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def invalid_parameter(exc: ValidationError) -> InvalidParameterError:
    """The 400 for ``exc``: ``param`` is the top-level field, the message names the full path."""
    errors = exc.errors()
    first = next((e for e in errors if not _is_type_mismatch(e)), errors[0])
    loc = tuple(first.get("loc", ()))
    param = str(loc[0]) if loc else None
    where = field_path(loc) or param
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {where}"
        if where in VLLM_EXTRAS:
            message += f" (vLLM's; not supported by this server: {VLLM_EXTRAS[where]})."
    elif first.get("type") == "missing":
        message = f"Missing required parameter: '{where}'."
    else:
        message = f"Invalid value for '{where}': {first.get('msg')} (got {first.get('input')!r})."
    return InvalidParameterError(message, param=param)
