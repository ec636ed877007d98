"""How a model writes tool calls: its chat template's own format where it has one, else Hermes tags.

Three syntaxes cover the templates we know (detected from the template text, see :func:`detect`):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call. Qwen2.5 /
  Qwen3 / Hermes templates render tools themselves and teach this format; it is also the documented fallback
  for templates without tool support (SmolLM2 and most small models), where the server writes the tool list
  and the format into the system prompt (:mod:`kvb_server.tool_calls.prompt`).
- ``llama3_json``: a bare ``{"name": ..., "parameters": {...}}`` object (Llama 3.1-3.3 JSON tool calling); the
  templates allow one call per turn, so ``parallel_tool_calls`` cannot add more.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (``[TOOL_CALLS]`` is a special token,
  dropped from the decoded text, so parsing accepts the array with or without it).
- ``mistral_v11``: ``[TOOL_CALLS]get_weather[ARGS]{...}`` per call (Mistral Small 3.1 and later, Magistral,
  Devstral: tokenizers v11+, whose templates write ``[ARGS]``), optionally ``[CALL_ID]<9 characters>``
  before ``[ARGS]``; the name is outside the JSON, which holds the arguments alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SyntaxName = Literal["hermes", "llama3_json", "mistral", "mistral_v11"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSyntax:
    """One tool-call format.

    Attributes:
        name: the format's name (reported in docs and ``/v1/models``-style introspection).
        native: the chat template renders ``tools`` and tool history itself (else the server does).
        marker: text (usually a special token) written once before the calls; ``""`` for none.
        bracket: the calls are the items of one JSON array.
        call_open / call_close: tags around each call's JSON object.
        separator: what the grammar puts between two calls.
        args_key: the key holding the arguments (``"arguments"``, Llama's ``"parameters"``).
        max_calls: most calls in one reply (the template's limit; parallel calls are capped by the server).
        short_ids: tool-call ids are 9 alphanumerics (Mistral's templates refuse anything else).
        args_tag: each call is ``marker``, the tool's name, this tag, then the arguments' JSON object (no
            ``{"name": ...}`` object; ``mistral_v11``).
        call_id_tag: a tag the model may write between the name and ``args_tag``, followed by a 9-character
            call id (``[CALL_ID]``).
        optional_marker: a special token the model may write before its calls (Llama 3.1-3.3 open a JSON
            call with ``<|python_tag|>`` as often as not); admitted by the grammar when the tokenizer holds
            it as one token, skipped by the parser.
    """

    name: SyntaxName
    native: bool
    marker: str = ""
    bracket: bool = False
    call_open: str = ""
    call_close: str = ""
    separator: str = ""
    args_key: str = "arguments"
    max_calls: int | None = None
    short_ids: bool = False
    args_tag: str = ""
    call_id_tag: str = ""
    optional_marker: str = ""

    @property
    def triggers(self) -> tuple[str, ...]:
        """Text a reply starts with when it is calls, as decoded (special tokens may be dropped)."""
        optional = (self.optional_marker,) if self.optional_marker else ()
        if self.args_tag:
            return (self.marker,)
        if self.call_open:
            return (*optional, self.call_open.strip())
        if self.bracket:
            return optional + ((self.marker,) if self.marker else ()) + ("[",)
        return optional + ((self.marker,) if self.marker else ()) + ("{",)


def hermes(*, native: bool) -> ToolSyntax:
    # Between calls: the newline Qwen-style templates write; with our system prompt, nothing. A model that
    # was never trained on the format treats "\n" after </tool_call> as the natural next token and, with
    # the grammar offering only "another call" or the end there, repeats its call until max_tokens
    # (SmolLM2: 3 of 3 prompts); without the newline it ends after its call (3 of 3).
    return ToolSyntax(
        name="hermes",
        native=native,
        call_open="<tool_call>\n",
        call_close="\n</tool_call>",
        separator="\n" if native else "",
    )


LLAMA3_JSON = ToolSyntax(
    name="llama3_json", native=True, args_key="parameters", max_calls=1, optional_marker="<|python_tag|>"
)
MISTRAL = ToolSyntax(
    name="mistral", native=True, marker="[TOOL_CALLS]", bracket=True, separator=", ", short_ids=True
)
MISTRAL_V11 = ToolSyntax(
    name="mistral_v11",
    native=True,
    marker="[TOOL_CALLS]",
    args_tag="[ARGS]",
    call_id_tag="[CALL_ID]",
    short_ids=True,
)


def template_text(tokenizer: Any) -> str:
    """The chat template's source (all named templates, when there are several)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):  # the older serialized form: [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template or ""


def detect(tokenizer: Any) -> ToolSyntax:
    """The tool syntax of ``tokenizer``'s chat template (Hermes tags in the system prompt when unknown).

    A template counts as native only when it both mentions ``tools`` and uses a format we parse: templates
    with another format (Granite, Phi, Command-R...) get the documented system-prompt format instead, so
    what the server parses is always what the model was told to write.
    """
    text = template_text(tokenizer)
    if "tools" not in text:
        return hermes(native=False)
    if "<tool_call>" in text:
        return hermes(native=True)
    if "[TOOL_CALLS]" in text:
        return MISTRAL_V11 if "[ARGS]" in text else MISTRAL
    if "<|python_tag|>" in text or ('"parameters"' in text and "ipython" in text):
        return LLAMA3_JSON
    return hermes(native=False)
