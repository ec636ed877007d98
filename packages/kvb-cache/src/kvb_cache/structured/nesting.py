"""How deeply a grammar nests, bounded before llguidance compiles it.

llguidance compiles a grammar recursively in native code: a JSON schema whose ``$defs`` chain ``$ref`` to
``$ref`` about a thousand times (75 KB, nesting only six levels deep as JSON), or a Lark grammar whose
rules chain three thousand deep (67 KB), overflowed the thread's stack and the whole process died (a
segfault; an audit, 2026-11-30): one request took a server down, under its body-size and JSON-depth
limits. So the longest chain of nested subschemas (local ``$ref`` followed) or of rule references (from
``start``) is measured first, and past :data:`MAX_GRAMMAR_NESTING` the request is refused by name.
Recursion (a ``$ref`` or rule that refers back to itself) is fine: llguidance expands it lazily, so a
cycle does not lengthen a chain here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from kvb_cache.structured.schema_compat import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES

#: Longest chain of nested subschemas or rules accepted. The crash came past ~1,600 (a ``$ref`` chain of
#: ~800 links compiled, ~1,000 did not) and ~2,000 rules on an 8 MiB stack; a worker thread's may be
#: smaller. Hand-written schemas and grammars nest a few dozen levels.
MAX_GRAMMAR_NESTING = 256


def longest_chain(root: Any, children: Callable[[Any], Iterable[Any]], key: Callable[[Any], Hashable]) -> int:
    """Nodes on the longest path from ``root`` that revisits no node (an edge back into the path, a
    cycle, is skipped), counted iteratively (Python's own recursion limit is lower than what is measured);
    stops counting once the path passes :data:`MAX_GRAMMAR_NESTING` (returns more than the limit)."""
    memo: dict[Hashable, int] = {}
    on_path = {key(root)}
    best = {key(root): 0}
    stack = [(root, iter(children(root)))]
    while stack:
        node, pending = stack[-1]
        k = key(node)
        child = next(pending, None)
        if child is None:
            stack.pop()
            on_path.discard(k)
            memo[k] = 1 + best.pop(k)
            if stack:
                parent = key(stack[-1][0])
                best[parent] = max(best[parent], memo[k])
            continue
        ck = key(child)
        if ck in on_path:
            continue
        if ck in memo:
            best[k] = max(best[k], memo[ck])
            continue
        if len(stack) > MAX_GRAMMAR_NESTING:
            return len(stack) + 1
        on_path.add(ck)
        best[ck] = 0
        stack.append((child, iter(children(child))))
    return memo[key(root)]


def _pointer(document: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#/$defs/a``) names in ``document``; None when it names none."""
    if not ref.startswith("#"):
        return None
    node = document
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_nesting(schema: Any) -> int:
    """The longest chain of nested subschemas in ``schema``, local ``$ref`` targets followed."""

    def children(node: Any) -> list[Any]:
        if not isinstance(node, dict):
            return []
        out: list[Any] = []
        for name, value in node.items():
            if name in SCHEMA_MAPS and isinstance(value, dict):
                out += value.values()
            elif name in SCHEMA_LISTS or (name == "items" and isinstance(value, list)):
                out += value if isinstance(value, list) else []
            elif name in SCHEMA_VALUES:
                out.append(value)
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _pointer(schema, ref)
            if target is not None:
                out.append(target)
        return [c for c in out if isinstance(c, dict)]

    return longest_chain(schema, children, id)


#: A rule's definition: Lark's ``name:`` (``?name:``, ``!name:``, ``name.2:``) or GBNF's ``name ::=``.
#: ``[ \t]`` at the line's start, not ``\s``: ``\s`` spans newlines, and a search from every line start over
#: a run of blank lines was quadratic (40 KB of newlines took 30 s).
_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(?:::=|:)", re.MULTILINE)
#: What names no rule in a body: string literals, regular expressions, character classes.
_NOT_NAMES = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|/(?:[^/\\\n]|\\.)+/|\[(?:[^\]\\]|\\.)*\]')
_NAME = re.compile(r"[A-Za-z_][\w-]*")


def grammar_nesting(source: str) -> int:
    """The longest chain of rule references from ``start`` (Lark), ``root`` (GBNF) or else the first rule; 0 when no rule is found (llguidance then refuses the grammar itself)."""
    definitions = list(_DEFINITION.finditer(source))
    bodies: dict[str, str] = {}
    for i, match in enumerate(definitions):
        end = definitions[i + 1].start() if i + 1 < len(definitions) else len(source)
        bodies[match.group(1)] = bodies.get(match.group(1), "") + " " + source[match.end() : end]
    if not bodies:
        return 0
    refs = {
        name: [
            n for n in dict.fromkeys(_NAME.findall(_NOT_NAMES.sub(" ", body))) if n in bodies and n != name
        ]
        for name, body in bodies.items()
    }
    root = next((r for r in ("start", "root") if r in bodies), next(iter(bodies)))  # Lark's, GBNF's
    return longest_chain(root, lambda name: refs[name], lambda name: name)
