"""The server's memo of llguidance's verdicts on request grammars (:mod:`kvb_server.constraints`)."""

from __future__ import annotations

import gc
import inspect

import pytest

from kvb_cache.structured import ResponseFormat
from kvb_server import constraints
from kvb_server.errors import InvalidParameterError

pytest.importorskip("llguidance", reason='needs the structured extra: pip install "kvb-cache[structured]"')


def _schema(description: str) -> ResponseFormat:
    schema = {"type": "object", "description": description, "properties": {"a": {"type": "integer"}}}
    return ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})


def test_verdicts_are_remembered_without_holding_the_grammar(monkeypatch):
    # functools.lru_cache kept every format checked, its schema text with it: 1024 distinct multi-MB
    # schemas held GBs.
    calls = []
    check_grammar = constraints.check_grammar
    monkeypatch.setattr(constraints, "check_grammar", lambda fmt: calls.append(fmt) or check_grammar(fmt))
    fmt = _schema("held? " * 1000)
    constraints.check(fmt, "response_format")
    constraints.check(_schema("held? " * 1000), "response_format")  # an equal grammar: remembered
    assert len(calls) == 1
    calls.clear()
    holders = [r for r in gc.get_referrers(fmt) if not inspect.isframe(r)]
    assert holders == []


def test_a_refused_grammar_is_refused_again_from_memory(monkeypatch):
    bad = ResponseFormat.parse({"type": "regex", "pattern": "(unclosed"})
    with pytest.raises(InvalidParameterError) as first:
        constraints.check(bad, "guided_regex")
    monkeypatch.setattr(constraints, "check_grammar", lambda fmt: pytest.fail("checked again"))
    with pytest.raises(InvalidParameterError) as again:
        constraints.check(bad, "guided_regex")
    assert str(again.value) == str(first.value) and again.value.param == "guided_regex"


def test_the_memo_forgets_the_least_recently_used(monkeypatch):
    verdicts = constraints._Verdicts(max_entries=2)
    formats = [ResponseFormat.parse({"type": "regex", "pattern": p}) for p in ("a+", "b+", "c+")]
    for fmt in (*formats, formats[2]):
        verdicts.error(fmt)
    assert list(verdicts._verdicts) == [formats[1].key, formats[2].key]
