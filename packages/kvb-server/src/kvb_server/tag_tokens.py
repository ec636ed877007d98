"""Tags (tool-call tags, a thinking block's, markers) that the tokenizer holds as one added token.

The call and JSON grammars must name such a tag by its id: llguidance reads every added token as a special
token, whose text no literal in a grammar matches (:mod:`kvb_server.tool_calls.grammar`). And a reply read
by a tag that is a *special* token must be decoded with special tokens kept, or the tag is gone from the
text before the parser could see it.
"""

from __future__ import annotations

import weakref
from typing import Any

from kvb_cache.structured.backend import added_tokens
from kvb_server.engine import ServingEngine
from kvb_server.reasoning import ReasoningPlan
from kvb_server.tool_calls import ToolPlan, ToolSyntax

#: Per tokenizer (weakly: a dropped engine's tokenizer is freed), per tag set: what :func:`_added` found.
_FOUND: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], dict[str, tuple[int, bool]]]] = (
    weakref.WeakKeyDictionary()
)


def _added(tokenizer: Any, tags: tuple[str, ...]) -> dict[str, tuple[int, bool]]:
    """``tags`` that ``tokenizer`` holds as one added token -> (its id, whether it is special). Cached per
    tokenizer and tag set: a fast tokenizer rebuilds ``added_tokens_decoder`` (every added token) on each
    read, and this is asked for every chat request. (Tokens added to the tokenizer after its first request
    are not seen: an engine's tokenizer does not change while it serves.)"""
    try:
        cached = _FOUND.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: not cached
        cached = {}
    if tags not in cached:
        cached[tags] = added_tokens(tokenizer, tags)
    return cached[tags]


def tag_tokens(engine: ServingEngine, *tags: str) -> dict[str, int]:
    """The ``tags`` (stripped; empty ones skipped) that the tokenizer holds as one added token -> its id
    (added tokens only: a tag that is an ordinary vocabulary entry matches as text)."""
    found = _added(engine.tokenizer, tuple(t.strip() for t in tags if t.strip()))
    return {tag: token for tag, (token, _) in found.items()}


def _syntax_tags(syntax: ToolSyntax | None, thinking: ReasoningPlan | None) -> list[str]:
    texts = []
    if syntax is not None:
        texts += [syntax.marker, syntax.optional_marker, syntax.call_open, syntax.call_close]
        texts += [syntax.args_tag, syntax.call_id_tag]
    if thinking is not None:
        texts += [thinking.syntax.start, thinking.syntax.end]
    return texts


def grammar_tags(
    engine: ServingEngine, syntax: ToolSyntax | None, thinking: ReasoningPlan | None
) -> dict[str, int]:
    """The tool syntax's and the thinking block's tags held as one added token -> id, for the grammar."""
    return tag_tokens(engine, *_syntax_tags(syntax, thinking))


def keeps_special_tags(engine: ServingEngine, tools: ToolPlan | None, thinking: ReasoningPlan | None) -> bool:
    """Whether the reply must be decoded with special tokens kept: some tag the calls or the thinking are
    read by is a *special* token, which ``skip_special_tokens`` drops from the text before the parser could
    see it (Hermes-2-Pro / Hermes-3 tokenizers mark ``<tool_call>`` special; a forced call came back as
    its bare JSON in ``content``). vLLM's tool parsers turn ``skip_special_tokens`` off the same way,
    whatever the request sent. Markers the parser reads with or without them do not count."""
    syntax = tools.syntax if tools is not None and tools.parses_calls else None
    if syntax is None and thinking is None:
        return False
    skippable = {m.strip() for m in (syntax.marker, syntax.optional_marker)} if syntax is not None else set()
    tags = tuple(
        t.strip() for t in _syntax_tags(syntax, thinking) if t.strip() and t.strip() not in skippable
    )
    return any(special for _, special in _added(engine.tokenizer, tags).values())
