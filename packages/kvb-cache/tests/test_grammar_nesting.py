"""Schemas and grammars nested past what llguidance's native stack takes are refused by name before it
compiles them (kvb_cache.structured.nesting): a ~1,000-link ``$ref`` chain or a 3,000-rule Lark chain
crashed the whole process (a segfault; an audit, 2026-11-30)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvb_cache import InvalidRequestError
from kvb_cache.structured import ResponseFormat, check_grammar
from kvb_cache.structured.nesting import MAX_GRAMMAR_NESTING, grammar_nesting, schema_nesting

pytest.importorskip("llguidance")


def ref_chain(links: int) -> dict:
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(links)
    }
    defs[f"d{links}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(rules: int, start: str = "start") -> str:
    body = "\n".join(f'r{i}: "x" r{i + 1} | "y"' for i in range(rules))
    return f'{start}: r0\n{body}\nr{rules}: "z"'


def test_nesting_is_measured_along_refs_and_rules() -> None:
    assert schema_nesting(ref_chain(10)) == 2 * 10 + 2  # each link: the object, then its property
    tree = {
        "$defs": {
            "n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}
        },
        "$ref": "#/$defs/n",
    }
    assert schema_nesting(tree) == 4  # root, n, kids, items: the cycle back to n does not lengthen it
    assert grammar_nesting(rule_chain(10)) == 12
    assert grammar_nesting(rule_chain(10, start="?start")) == 12
    gbnf = 'root ::= a\na ::= "x" b | "y"\nb ::= "z"'
    assert grammar_nesting(gbnf) == 3
    # Names inside strings, regexes and classes are not references.
    assert grammar_nesting('start: "b" /c+/ [d]\nb: "x"\nc: "y"\nd: "z"') == 1


@pytest.mark.parametrize(
    "fmt",
    [
        ResponseFormat(kind="json_schema", source=__import__("json").dumps(ref_chain(2_000))),
        ResponseFormat(kind="grammar", source=rule_chain(5_000)),
    ],
    ids=["ref-chain", "rule-chain"],
)
def test_a_chain_past_the_limit_is_refused_not_compiled(fmt: ResponseFormat) -> None:
    with pytest.raises(InvalidRequestError, match=f"more than {MAX_GRAMMAR_NESTING} deep") as err:
        check_grammar(fmt)
    assert err.value.param == "response_format"


def test_a_chain_within_the_limit_compiles_in_a_small_thread_stack() -> None:
    """What the limit admits compiles on a 2 MiB thread stack (a crash would kill the child process)."""
    code = (
        "import json, threading\n"
        "from kvb_cache.structured import ResponseFormat, check_grammar\n"
        "import test_grammar_nesting as t\n"
        "def run():\n"
        "    check_grammar(ResponseFormat(kind='json_schema', source=json.dumps(t.ref_chain(120))))\n"
        "    check_grammar(ResponseFormat(kind='grammar', source=t.rule_chain(250)))\n"
        "    print('ok')\n"
        "threading.stack_size(2 << 20)\n"
        "th = threading.Thread(target=run); th.start(); th.join()\n"
    )
    here = __import__("pathlib").Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=here, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-500:]


def test_a_lark_grammar_whose_start_rule_has_a_modifier_is_read_as_lark() -> None:
    """llguidance took "?start:" for GBNF ("Failed to convert the grammar from GBNF to Lark")."""
    check_grammar(ResponseFormat(kind="grammar", source='?start: "a" b\nb: "c"'))
    check_grammar(ResponseFormat(kind="grammar", source='root ::= "a" b\nb ::= "c"'))  # GBNF still GBNF
    # "::=" inside a Lark string does not make it GBNF; GBNF's own "start ::=" is GBNF (an ordinary rule there,
    # renamed before llguidance's converter, which names root so: test_structured.py).
    check_grammar(ResponseFormat(kind="grammar", source='root ::= "a" start\nstart ::= "b"'))
    check_grammar(ResponseFormat(kind="grammar", source='?start: "a ::= b" c\nc: "d"'))
    with pytest.raises(InvalidRequestError, match="not a valid Lark or GBNF grammar"):
        check_grammar(ResponseFormat(kind="grammar", source="root ::= @@@"))


def test_chains_the_measure_does_not_follow_compile_on_the_large_stack() -> None:
    """``$anchor`` references are not followed by the measure (nesting 3 here): a 2,000-link chain
    segfaulted the process (a review, 2026-11-30); compiled on big_stack.py's thread it compiles. Run in a
    child process, so that a crash fails this test instead of ending the run."""
    code = (
        "import json\n"
        "from kvb_cache.structured import ResponseFormat, check_grammar\n"
        "defs = {f'd{i}': {'$anchor': f'a{i}', 'type': 'object', 'properties': {'a': {'$ref': f'#a{i + 1}'}}}"
        " for i in range(2000)}\n"
        "defs['d2000'] = {'$anchor': 'a2000', 'type': 'integer'}\n"
        "check_grammar(ResponseFormat(kind='json_schema', source=json.dumps({'$defs': defs, '$ref': '#a0'})))\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-500:])


def test_blank_lines_do_not_make_the_measure_quadratic() -> None:
    """``^\\s*`` over MULTILINE searched on from every line start through a run of blank lines: 40 KB of
    newlines took 30 s (a review). A hang guard (the limit is hours away from what linear takes), not a
    timing: run in a child process with a timeout."""
    code = (
        "from kvb_cache.structured.nesting import grammar_nesting\n"
        "from kvb_cache.structured.backend import _LARK_START\n"
        "src = '\\n' * 400_000 + 'start: \"a\"'\n"
        "print(grammar_nesting(src), bool(_LARK_START.search(src)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["1", "True"], done.stderr[-500:]
