"""llguidance behind a compiled-grammar LRU: one pristine matcher per (grammar, tokenizer), copied per request.

llguidance is an optional extra (``pip install "kvb-cache[structured]"``), imported on first use. Why
llguidance and not xgrammar: docs/structured.md (measured on this project's tokenizers).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from kvb_cache.errors import InvalidRequestError, KVBoostError
from kvb_cache.structured import structural_tag
from kvb_cache.structured.big_stack import on_big_stack
from kvb_cache.structured.nesting import MAX_GRAMMAR_NESTING, grammar_nesting, schema_nesting
from kvb_cache.structured.schema_compat import (
    DATA_KEYWORDS,
    JSON_OPTIONS,
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_VALUES,
    llguidance_compatible,
)
from kvb_cache.structured.spec import ResponseFormat
from kvb_cache.structured.state import GrammarState

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

TokenizerKey = NewType("TokenizerKey", str)


def llguidance_schema(schema: Any) -> Any:
    """``schema`` as it is compiled: zod's always-true spellings rewritten
    (:func:`kvb_cache.structured.schema_compat.llguidance_compatible`), then made strict
    (:func:`strict_schema`). Every JSON schema reaching llguidance goes through it, those embedded in a
    grammar (a server's tool calls) included."""
    return strict_schema(llguidance_compatible(schema))


# Only schema positions are walked (schema_compat's keyword sets): const / enum / default / examples hold
# *data*, which may look like a schema and must stay as given (a const of {"properties": ...} got
# "additionalProperties": false added, so no reply matched).
_COMBINATORS = ("allOf", "anyOf", "oneOf")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists ``properties`` and says
    nothing about extra keys (OpenAI's strict mode and xgrammar's default).

    Outputs stay valid against the original schema (they are a subset); without it a model may keep
    inventing keys until ``max_new_tokens`` cuts the JSON short. Objects whose keys other subschemas supply
    stay open, or closing them would make a satisfiable schema unsatisfiable: members of an ``allOf`` (and
    the ``$defs`` an ``allOf`` of several members refers to), an object with ``properties`` beside
    ``allOf`` / ``anyOf`` / ``oneOf`` and those combinators' members, and an object whose ``required``
    names keys its ``properties`` do not list.
    """
    return _strict(schema, closable=True, composed=_composed_refs(schema))


def _strict(schema: Any, *, closable: bool, composed: frozenset[str]) -> Any:
    if not isinstance(schema, dict):
        return schema  # true / false schemas
    out = dict(schema)
    properties = schema.get("properties")
    has_properties = isinstance(properties, dict)
    combined = any(key in schema for key in _COMBINATORS)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            defs = key in ("$defs", "definitions")
            out[key] = {
                name: _strict(sub, closable=not (defs and f"#/{key}/{name}" in composed), composed=composed)
                for name, sub in schema[key].items()
            }
    for key in SCHEMA_VALUES:
        if key in schema:
            value = schema[key]
            out[key] = (
                [_strict(v, closable=True, composed=composed) for v in value]
                if isinstance(value, list)  # draft-4 tuple items
                else _strict(value, closable=True, composed=composed)
            )
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            # Alternatives of an object that is itself open (an allOf member) add to the same object's keys.
            members_closable = key == "prefixItems" or (key != "allOf" and not has_properties and closable)
            out[key] = [_strict(v, closable=members_closable, composed=composed) for v in schema[key]]
    required = schema.get("required")
    # A non-string entry (a client's [["a"]]) is unhashable: `in` raised TypeError, a 500; llguidance refuses it.
    listed = not isinstance(required, list) or (
        has_properties and all(isinstance(r, str) and r in properties for r in required)
    )
    if closable and has_properties and not combined and listed and not any(k in schema for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _composed_refs(schema: Any) -> frozenset[str]:
    """``$ref`` targets that are members of an ``allOf`` of several members, or alternatives (``anyOf`` /
    ``oneOf``) of such a member, anywhere in ``schema``."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            members = node.get("allOf")
            if isinstance(members, list) and len(members) > 1:
                # A member, or an alternative (anyOf / oneOf, at any depth) of a member, that is a $ref.
                pending = list(members)
                while pending:
                    m = pending.pop()
                    if not isinstance(m, dict):
                        continue
                    if isinstance(m.get("$ref"), str):
                        found.add(m["$ref"])
                    for key in ("anyOf", "oneOf"):
                        if isinstance(m.get(key), list):
                            pending.extend(m[key])
            stack.extend(v for k, v in node.items() if k not in DATA_KEYWORDS)
    return frozenset(found)


class StructuredOutputsUnavailable(KVBoostError, ImportError):
    """``response_format`` needs the grammar library: ``pip install "kvb-cache[structured]"``."""


def import_llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:
        raise StructuredOutputsUnavailable(
            f'response_format needs llguidance: pip install "kvb-cache[structured]" ({e})'
        ) from e
    return llguidance


@dataclass(frozen=True, slots=True)
class _Tokenizer:
    key: TokenizerKey
    ll: Any  # llguidance.LLTokenizer
    #: Held so the ``id()`` this entry is found by cannot be reused by another tokenizer.
    source: Any


class GrammarCache:
    """Compiled grammars, least recently used evicted past ``max_entries``; thread-safe.

    Keyed by (:attr:`ResponseFormat.key`, tokenizer key): the tokenizer key hashes the serialized fast
    tokenizer and the logits width, so engines may share one cache. A grammar that fails to compile raises
    :class:`InvalidRequestError` naming ``response_format`` (llguidance's message says which feature).

    A grammar whose matcher fails while decoding (past llguidance's limits: ``((a{100}){100}){100}``) is
    dropped from the cache: the lexer state it built up is shared with the cached grammar (about 150 MB for
    that pattern), so 256 distinct 25-byte patterns could pin tens of GB. Dropped, it is freed with its
    request (measured: six such patterns grew the process by 150 MB each kept, by nothing dropped).
    """

    def __init__(self, *, max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, TokenizerKey], Any] = OrderedDict()
        self._tokenizers: dict[tuple[int, int], _Tokenizer] = {}
        self._unreadable: dict[tuple[int, int], str] = {}  # tokenizers llguidance cannot read: why
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def state(self, fmt: ResponseFormat, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> GrammarState:
        """A fresh matcher for one request (``vocab_size``: the model's logits width)."""
        tok = self._tokenizer(tokenizer, vocab_size)
        key = (fmt.key, tok.key)
        with self._lock:
            template = self._entries.get(key)
            if template is not None:
                self._entries.move_to_end(key)
                self.hits += 1
        if template is None:
            template = self._compile(fmt, tok)
            with self._lock:
                self.misses += 1
                self._entries[key] = template
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        return GrammarState(
            template.deep_copy(), vocab_size=vocab_size, on_error=functools.partial(self._drop, key, template)
        )

    def _drop(self, key: tuple[str, TokenizerKey], template: Any) -> None:
        """Forget ``template``, the compiled grammar ``key`` (its matcher failed while decoding: see the class
        docs); not a fresh compile of the same grammar that replaced it meanwhile."""
        with self._lock:
            if self._entries.get(key) is template:
                del self._entries[key]

    def _tokenizer(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> _Tokenizer:
        ident = (id(tokenizer), vocab_size)
        found = self._tokenizers.get(ident)
        if found is not None:
            return found
        unreadable = self._unreadable.get(ident)
        if unreadable is not None:  # said once already: not converted again for every request
            raise InvalidRequestError(unreadable, param="response_format")
        llguidance = import_llguidance()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequestError(
                "response_format needs a fast (Rust) Hugging Face tokenizer", param="response_format"
            )
        serialized = backend.to_str()
        key = TokenizerKey(hashlib.sha256(f"{vocab_size}\0{serialized}".encode()).hexdigest())
        # ~1 s for a 50k vocabulary (it builds the token trie), once per tokenizer.
        try:
            ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        except (ValueError, TypeError, RuntimeError) as e:
            # A tokenizer whose decoder llguidance cannot map to bytes (a word-level vocabulary without a
            # decoder, say): no grammar can be enforced with it. Was a bare ValueError (HTTP 500).
            message = self._unreadable[ident] = (
                f"response_format is not available with this model's tokenizer: the grammar library cannot "
                f"read it ({e})"
            )
            raise InvalidRequestError(message, param="response_format") from None
        found = self._tokenizers[ident] = _Tokenizer(key, ll, tokenizer)
        return found

    @staticmethod
    def _compile(fmt: ResponseFormat, tok: _Tokenizer) -> Any:
        matcher_cls = import_llguidance().LLMatcher
        token_ids = None
        if fmt.kind == "structural_tag":
            token_ids = added_token_ids(tok.source, structural_tag.tag_texts(fmt.source))
            eos = getattr(tok.source, "eos_token_id", None)
            for text, token in token_ids.items():
                if token == eos:  # the grammar library reads it as the end of the output, never as a tag
                    raise InvalidRequestError(
                        f"response_format structural_tag: {text!r} is the tokenizer's end-of-sequence token, "
                        "which ends the output rather than a segment; use another tag",
                        param="response_format",
                    )
        # Compiled on a large stack (big_stack.py): a deeply nested grammar overflowed a request thread's.
        matcher = on_big_stack(lambda: matcher_cls(tok.ll, grammar_of(fmt, token_ids), log_level=0))
        if matcher.is_error():
            message = matcher.get_error().strip().splitlines()
            raise InvalidRequestError(
                f"response_format {fmt.kind} is not supported or invalid: {_explained(message[:4])}",
                param="response_format",
            )
        return matcher


def grammar_of(fmt: ResponseFormat, token_ids: Mapping[str, int] | None = None) -> Any:
    """llguidance's grammar object for ``fmt`` (a JSON schema prepared first: :func:`llguidance_schema`);
    ``token_ids``: a structural tag's texts that the tokenizer holds as one added token (written by id).

    Raises:
        InvalidRequestError: the schema, regex or grammar does not parse (``param="response_format"``).
    """
    llguidance = import_llguidance()
    matcher_cls = llguidance.LLMatcher
    try:
        schema = json.loads(fmt.source) if fmt.kind == "json_schema" else None
    except ValueError as e:
        raise InvalidRequestError(f"response_format is invalid: {e}", param="response_format") from None
    _check_nesting(fmt, schema)
    try:
        if fmt.kind == "json_schema":
            return matcher_cls.grammar_from_json_schema(llguidance_schema(schema), defaults=JSON_OPTIONS)
        if fmt.kind == "regex":
            return matcher_cls.grammar_from_regex(fmt.source)
        if fmt.kind == "structural_tag":
            return matcher_cls.grammar_from_lark(
                structural_tag.lark(fmt.source, llguidance_schema, token_ids)
            )
        # Lark or GBNF, told apart here, not by llguidance's "grammar" kind: it reads a grammar as Lark only
        # when a line starts with "start:" (so "?start:" / "!start:" Lark was converted as GBNF and refused,
        # and GBNF's "start ::=" was taken for Lark), with a regex quadratic on blank lines.
        if _LARK_START.search(fmt.source):
            return matcher_cls.grammar_from_lark(fmt.source)
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark
        except ImportError:  # a llguidance without its converter module: its own detection, as before
            return llguidance.grammar_from("grammar", fmt.source)
        try:
            lark = gbnf_to_lark(_free_start(fmt.source))
        except Exception as e:  # the converter's own parse errors, whatever their type
            raise ValueError(f"not a valid Lark or GBNF grammar: {e}") from None
        return matcher_cls.grammar_from_lark(lark)
    except ValueError as e:
        raise InvalidRequestError(f"response_format is invalid: {e}", param="response_format") from None


#: A Lark start rule, whatever its modifier (``start:``, ``?start:``, ``!start:``).
#: A Lark grammar: a start rule, whatever its modifier (``start:``, ``?start:``, ``!start:``; not GBNF's
#: ``start ::=``), or llguidance's ``%llguidance`` header. ``[ \t]``, not ``\s``: linear on blank lines.
_LARK_START = re.compile(r"^[ \t]*(?:%llguidance\b|[?!]?start[ \t]*:(?!:=))", re.MULTILINE)


#: What in GBNF is not a rule name: string literals, character classes, comments; else a name (GBNF names
#: hold letters, digits and ``-``).
_GBNF_PARTS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]|#[^\n]*|(?<![\w-])start(?![\w-])')


def _free_start(gbnf: str) -> str:
    """``gbnf`` with a rule named ``start`` renamed: llguidance's converter names ``root`` ``start`` (Lark's
    entry rule) and refused a grammar that already had one ("Rule 'start' already exists"), which GBNF
    allows (only ``root`` is special there)."""
    if not re.search(r"^[ \t]*start[ \t]*::=", gbnf, re.MULTILINE):
        return gbnf
    taken = set(re.findall(r"[\w-]+", gbnf))
    name = next(f"start-{i}" for i in range(len(taken) + 1) if f"start-{i}" not in taken)
    return _GBNF_PARTS.sub(lambda m: name if m.group(0) == "start" else m.group(0), gbnf)


def _check_nesting(fmt: ResponseFormat, schema: Any) -> None:
    """Refuse a schema or grammar nested deeper than llguidance's native stack takes (:mod:`.nesting`)."""
    if fmt.kind == "regex":
        return  # the regex parser bounds its own nesting (an error, not a crash)
    if fmt.kind == "json_schema":
        depth = schema_nesting(schema)
    elif fmt.kind == "structural_tag":
        depth = max(schema_nesting(s) for s in structural_tag.schemas(fmt.source))
    else:
        depth = grammar_nesting(fmt.source)
    if depth > MAX_GRAMMAR_NESTING:
        what = "rule references" if fmt.kind == "grammar" else "subschemas (counting $ref targets)"
        raise InvalidRequestError(
            f"response_format {fmt.kind} nests {what} more than {MAX_GRAMMAR_NESTING} deep; flatten it "
            "(the grammar library compiles nesting recursively and would run out of stack)",
            param="response_format",
        )


def added_tokens(tokenizer: Any, texts: Iterable[str]) -> dict[str, tuple[int, bool]]:
    """``texts`` that ``tokenizer`` holds as one added token -> (its id, whether it is special). An ordinary
    vocabulary entry is not listed (it is matched as text); llguidance reads added tokens as special ones,
    which no text literal matches. Empty texts are skipped."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if not added:  # no added tokens (or not a Hugging Face tokenizer): every text is text
        return {}
    out = {}
    for text in texts:
        token = tokenizer.convert_tokens_to_ids(text) if text else None
        if isinstance(token, int) and token in added and token != getattr(tokenizer, "unk_token_id", None):
            out[text] = (token, bool(getattr(added[token], "special", False)))
    return out


def added_token_ids(tokenizer: Any, texts: Iterable[str]) -> dict[str, int]:
    """``texts`` that ``tokenizer`` holds as one added token -> its id (:func:`added_tokens`)."""
    return {text: token for text, (token, _) in added_tokens(tokenizer, texts).items()}


def check_grammar(fmt: ResponseFormat) -> None:
    """Compile-check ``fmt`` without a tokenizer (about as costly as parsing it): a server refuses a bad
    schema with a 400 before queueing the request, naming the feature llguidance does not support.

    Raises:
        InvalidRequestError: ``param="response_format"``, llguidance's message (first lines).
        StructuredOutputsUnavailable: llguidance is not installed.
    """
    validate = import_llguidance().LLMatcher.validate_grammar
    error = on_big_stack(lambda: validate(grammar_of(fmt)))  # a large stack: big_stack.py
    if error:
        lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
        raise InvalidRequestError(
            f"response_format {fmt.kind} is not supported or invalid: {_explained(lines[:3])}",
            param="response_format",
        )


def _explained(lines: list[str]) -> str:
    """llguidance's message, with what a client can do about it where its wording names an option of the
    library's API (``coerce_one_of``) or hides what this backend did to the schema (closed objects)."""
    text = " ".join(lines)
    if "coerce_one_of" in text:
        return (
            "oneOf branches that one value can match are not supported (a grammar cannot keep a value to "
            "exactly one of them); use anyOf, or make the branches exclusive (e.g. a const discriminator)"
        )
    if "nsatisfiable" in text:
        text += (
            " (objects listing properties are closed with additionalProperties: false unless the schema "
            "says otherwise; set additionalProperties: true on an object whose keys another subschema adds)"
        )
    return text
