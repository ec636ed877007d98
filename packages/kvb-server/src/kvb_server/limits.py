"""Input limits checked before a request body is parsed: size, UTF-8, JSON nesting depth, lone surrogates.

Every body any route parses goes through :func:`read_body` and then :func:`decode_json`, so no body can
make the server allocate without bound, recurse without bound (``json.loads`` recurses once per nesting
level and raises ``RecursionError`` past ~1000) or hand the tokenizer a string it cannot encode. Each
failure is an OpenAI-style 400 or 413, never a 5xx. JSON text held in a string inside a body (a tool
call's arguments, a schema sent as text) is parsed with :func:`loads_inner`, under the same guard.
"""

from __future__ import annotations

import json
import operator
import re
import time
from collections.abc import AsyncIterator
from itertools import accumulate, count
from typing import Any

from fastapi import Request

from kvb_server.errors import InvalidParameterError, RequestTooLargeError, UnsupportedMediaTypeError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_JSON_DEPTH = 64
#: ``json.loads`` recurses once per level; the default interpreter limit is 1000 frames.
MAX_JSON_DEPTH_LIMIT = 512

# A JSON string, unrolled so the regex engine never backtracks: quote, runs of plain characters and
# escapes, then the closing quote, or the end of the text (an unterminated string, with a lone backslash
# last at most). NOTE: every match attempt from a quote must succeed. A string left unterminated failed to
# match, and the search retried from each quote inside it (escaped ones too), each retry scanning to the
# end: 60 KB of one quote and escaped quotes after it ("\"\"\"...) took 21 s on the event loop, quadratic
# (a 4 MiB body: about a day). Ignoring the brackets of an unterminated string keeps the count an upper
# bound of what the parser descends into: it fails at that string, never entering brackets inside it.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*\\?(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
# Opening brackets count 2 and closing ones 0, so after k brackets the running sum minus k is the depth.
_BRACKET_WEIGHTS = str.maketrans({"[": "\x02", "{": "\x02", "]": "\x00", "}": "\x00"})
# ``\ud800``-``\udfff`` escapes: only then can the parsed value hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class BodyTooLargeError(RequestTooLargeError):
    """The request body is larger than ``--max-body-bytes`` (413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            f"The request body is larger than this server's limit of {max_bytes} bytes "
            f"({max_bytes / 2**20:g} MiB, --max-body-bytes). Send a smaller body.",
            fields={"max_body_bytes": max_bytes},
        )
        self.code = "body_too_large"


def check_content_headers(request: Request) -> None:
    """Refuse (415) a body that is not JSON by its ``Content-Type`` or that is compressed.

    As FastAPI (hence vLLM) reads a body: ``application/json`` or ``application/*+json``, any charset
    parameter; no ``Content-Type`` at all is read as JSON too. ``text/plain`` and form bodies were parsed as
    JSON whatever they said (a web page can send those without a CORS preflight; see
    :mod:`kvb_server.cross_origin`). A ``Content-Encoding`` other than ``identity`` was ignored: a gzip
    body got a misleading "not UTF-8" 400, and plain JSON labelled gzip was served.

    Raises:
        UnsupportedMediaTypeError: either header says something else.
    """
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if not (
            media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
        ):
            raise UnsupportedMediaTypeError(
                f"Content-Type {content_type!r} is not JSON: send the body as JSON with "
                "'Content-Type: application/json'."
            )
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaTypeError(
            f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed."
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``max_bytes``.

    A ``Content-Length`` over the limit is refused before anything is read; a chunked body (no length) is
    counted while it streams in, so at most ``max_bytes`` plus one chunk is ever held; the rest is read and
    dropped (bounded: ``DRAIN_MAX_BYTES`` / ``DRAIN_MAX_S``) so the client reads the 413 rather than a reset.

    Raises:
        BodyTooLargeError: the body exceeds ``max_bytes``.
        starlette.requests.ClientDisconnect: the client went away mid-body (nobody is left to answer).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLargeError(max_bytes)  # unread: kvb_server.unread_body closes the connection
    body = bytearray()
    stream = request.stream()
    async for chunk in stream:
        body += chunk
        if len(body) > max_bytes:
            await _discard_rest(stream)
            raise BodyTooLargeError(max_bytes)
    return bytes(body)


# How much of an oversized chunked body is read (and dropped) before the 413 goes out. A server that answers
# and closes while the client is still sending makes the kernel reset the connection, and the client then sees
# the reset instead of the 413 (the fuzzer saw it with `Connection: close`). Bounded, so a client streaming
# forever only costs this much.
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_MAX_S = 10.0


async def _discard_rest(stream: AsyncIterator[bytes]) -> None:
    drained = 0
    deadline = time.monotonic() + DRAIN_MAX_S
    async for chunk in stream:
        drained += len(chunk)
        if drained > DRAIN_MAX_BYTES or time.monotonic() > deadline:
            return


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in ``text`` (JSON), without recursing.

    Brackets inside strings are ignored. For invalid JSON this is an upper bound of the depth a parser
    reaches before it fails, which is what makes it a safe guard in front of ``json.loads``.
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    weights = brackets.translate(_BRACKET_WEIGHTS).encode("latin-1")
    return max(0, max(map(operator.sub, accumulate(weights), count(1))))


def _deeper_than(text: str, max_depth: int) -> bool:
    """Whether JSON ``text`` nests deeper than ``max_depth``; the bracket count first, a cheap bound: most
    texts hold fewer brackets than the limit."""
    return text.count("[") + text.count("{") > max_depth and json_depth(text) > max_depth


def decode_json(raw: bytes, *, max_depth: int) -> Any:
    """Decode a body as UTF-8 JSON nested at most ``max_depth`` levels.

    Raises:
        InvalidParameterError: not UTF-8, nested too deeply, not JSON, or holding a lone surrogate
            (``"\\ud800"``, which no tokenizer can encode).
    """
    try:
        # "utf-8-sig": a leading byte-order mark is dropped, as Starlette's request.json() (vLLM) takes it.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidParameterError(
            f"The request body is not valid UTF-8 (byte {exc.start}: {exc.reason}). Send JSON encoded "
            "as UTF-8."
        ) from None
    if _deeper_than(text, max_depth):
        raise InvalidParameterError(
            f"The JSON body nests arrays/objects deeper than this server's limit of {max_depth} levels "
            "(--max-json-depth).",
            code="json_too_deep",
        )
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's int_max_str_digits (was a 500)
        raise InvalidParameterError(
            f"We could not parse the JSON body of your request ({exc}). Send a valid JSON object with "
            "Content-Type: application/json."
        ) from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(data):
        raise InvalidParameterError(
            "The JSON body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff not in a pair); send "
            "valid Unicode text."
        )
    return data


def loads_inner(text: str) -> Any:
    """``json.loads`` of JSON text held in a string *inside* a request (a tool call's ``arguments``, a
    schema sent as text), which :func:`decode_json`'s nesting check never looks into.

    Raises:
        ValueError: invalid JSON, an integer longer than Python's ``int_max_str_digits``, or nesting deeper
            than ``MAX_JSON_DEPTH_LIMIT`` (checked before parsing: ``json.loads`` would recurse into a
            ``RecursionError``, which callers catching ``ValueError`` turned into a 500).
    """
    if _deeper_than(text, MAX_JSON_DEPTH_LIMIT):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH_LIMIT} levels")
    return json.loads(text)


def _has_lone_surrogate(data: Any) -> bool:
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False
