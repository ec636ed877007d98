"""Bodies of vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from kvb_server.schemas.fields import STRICT, TokenId
from kvb_server.schemas.generation_requests import ChatMessage


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``, never both."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
    )

    # Fields may be left out, not null: the schema says so, so fuzzers generate what is accepted.
    model: str = Field(default=None, description="a served model; left out: the first one")  # type: ignore[assignment]
    prompt: str = None  # type: ignore[assignment]
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None  # type: ignore[assignment]
    add_special_tokens: bool = Field(
        default=True,
        description="with prompt: add the tokenizer's special tokens (BOS), as /v1/completions does; "
        "no effect with messages (the chat template places its own)",
    )
    add_generation_prompt: bool = Field(
        default=True,
        description="with messages: end with the assistant's turn opener, as /v1/chat/completions "
        "does; no effect with prompt",
    )
    continue_final_message: bool = Field(
        default=False,
        description="with messages: leave the last (assistant) message open instead of adding a generation "
        "prompt (as /v1/chat/completions does)",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default=None, description="with messages: extra chat template variables (as /v1/chat/completions)"
    )  # type: ignore[assignment]
    tools: list[Any] = Field(
        default=None,
        description="with messages: function tools, rendered into the prompt as /v1/chat/completions "
        "renders them (vLLM's chat tokenize takes them too)",
    )  # type: ignore[assignment]
    return_token_strs: bool = Field(default=False, description="also return each token's string")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    model_config = STRICT

    model: str = Field(default=None, description="a served model; left out: the first one")  # type: ignore[assignment]
    tokens: list[TokenId]


class TokenizeResponse(BaseModel):
    """``POST /tokenize``: the ids the generation routes would queue for the same input."""

    count: int
    max_model_len: int | None = Field(description="prompt + generated tokens the model takes (null: unknown)")
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, description="with return_token_strs: each token")


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``."""

    prompt: str


class TokenizerInfoResponse(BaseModel):
    """``GET /tokenizer_info`` (vLLM's route): what a client needs to tokenize as the server does (lm-eval's
    remote tokenizer reads the special tokens and the chat template here, then calls ``/tokenize``)."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int | None = Field(description="the served context length (null: unknown)")
    vocab_size: int | None = Field(description="ids the tokenizer can decode, added tokens included")
