"""Options declared once: dataclass fields that carry their own help text, group and command-line form.

An *options class* is a frozen dataclass whose fields are made with :func:`option`. From it follow:

- command-line flags (:func:`add_option_arguments`: ``--chunk-size`` for ``chunk_size``, help, default,
  parser and choices from the field),
- the options back from a parsed namespace (:func:`from_namespace`) and as keyword arguments
  (:func:`as_keywords`), for a ``from_pretrained`` that takes them one by one,
- a check that a function's keyword-only parameters are exactly the fields (:func:`signature_mismatches`),
- a Markdown table for the docs (:func:`options_table`).

:class:`kvb_cache.EngineArgs` is the engine's options class; other distributions declare their own groups
(the meta-package composes them), and the server adds every group it is given to its parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, NoReturn

OPTION_KEY = "kvb_option"
_MISSING = dataclasses.MISSING


@dataclass(frozen=True, slots=True, kw_only=True)
class OptionSpec:
    """How one field of an options class appears on the command line and in the docs.

    Attributes:
        help: one or two sentences a user reads in ``--help`` (and in the docs table).
        group: the ``--help`` section (``"cache"``, ``"scheduling"``, ...); fields sharing a title share it.
        flag: the flag; None derives ``--field-name`` from the field name.
        aliases: more flags for the same option (kept for old command lines).
        parse: turns the command-line text into the value (argparse ``type``); None: ``int``/``float`` from
            the default's type, else ``str``.
        choices: the accepted values, when the set is closed.
        metavar: the placeholder shown in ``--help``.
        cli: False keeps the option out of the command line (a Python object such as a loaded model).
        cli_default: the default as written on a command line (``"2GiB"``), when that reads better than
            the value; ``parse(cli_default)`` must equal the field's default.
    """

    help: str
    group: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    cli: bool = True
    cli_default: str | None = None


def option(
    default: Any,
    *,
    help: str,
    group: str,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
    cli: bool = True,
    cli_default: str | None = None,
) -> Any:
    """A dataclass field with ``default`` and its :class:`OptionSpec`."""
    spec = OptionSpec(
        help=help,
        group=group,
        flag=flag,
        aliases=aliases,
        parse=parse,
        choices=choices,
        metavar=metavar,
        cli=cli,
        cli_default=cli_default,
    )
    return dataclasses.field(default=default, metadata={OPTION_KEY: spec})


def option_fields(cls: type) -> list[tuple[dataclasses.Field, OptionSpec]]:
    """``(field, spec)`` for every field of ``cls`` declared with :func:`option`, in declaration order."""
    return [(f, f.metadata[OPTION_KEY]) for f in dataclasses.fields(cls) if OPTION_KEY in f.metadata]


def flag_of(field: dataclasses.Field, spec: OptionSpec) -> str:
    """The main command-line flag of a field."""
    return spec.flag or "--" + field.name.replace("_", "-")


# -- command line ----------------------------------------------------------------------------------------
def add_option_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    groups: dict[str, argparse._ArgumentGroup] | None = None,
) -> dict[str, argparse._ArgumentGroup]:
    """Add a flag for every command-line field of ``cls`` to ``parser``; returns ``groups`` (title -> group).

    Fields go into the group titled by their ``group``, taken from ``groups`` or created (and added to it),
    so several options classes and hand-written flags can share sections.
    """
    groups = {} if groups is None else groups
    for f, spec in option_fields(cls):
        if not spec.cli:
            continue
        group = groups.get(spec.group)
        if group is None:
            group = groups[spec.group] = parser.add_argument_group(spec.group)
        kwargs: dict[str, Any] = {"dest": f.name, "help": spec.help}
        default = spec.cli_default if spec.cli_default is not None else f.default
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = spec.parse or _default_parser(f.default)
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if spec.metavar is not None:
                kwargs["metavar"] = spec.metavar
        group.add_argument(flag_of(f, spec), *spec.aliases, default=default, **kwargs)
    return groups


def _default_parser(default: Any) -> Callable[[str], Any]:
    if isinstance(default, int) and not isinstance(default, bool):
        return int
    if isinstance(default, float):
        return float
    return str


def from_namespace(cls: type, namespace: argparse.Namespace) -> Any:
    """An instance of options class ``cls`` from parsed flags (fields without a flag keep their default)."""
    values = {
        f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)
    }
    return cls(**values)


def pick_keywords(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` (e.g. a ``from_pretrained``'s ``locals()``) that are fields of ``cls``."""
    return {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}


def as_keywords(options: Any) -> dict[str, Any]:
    """An options instance as ``{field: value}`` (shallow: nested configs stay objects)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


# -- consistency checks and docs -------------------------------------------------------------------------
def signature_mismatches(func: Callable[..., Any], classes: Iterable[type]) -> list[str]:
    """How ``func``'s keyword-only parameters differ from the fields of ``classes`` (names and defaults).

    Empty when they agree. A test asserts this for every ``from_pretrained`` that spells the options out.
    """
    params = {name: p for name, p in inspect.signature(func).parameters.items() if p.kind is p.KEYWORD_ONLY}
    declared: dict[str, Any] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            declared[f.name] = f.default
    problems = [f"{func.__qualname__} lacks keyword {name!r}" for name in declared if name not in params]
    problems += [
        f"{func.__qualname__} has keyword {name!r} no options class declares"
        for name in params
        if name not in declared
    ]
    for name, default in declared.items():
        if name in params and params[name].default != default:
            problems.append(
                f"{func.__qualname__}({name}={params[name].default!r}) but the options class says {default!r}"
            )
    return problems


def parser_mismatches(parser: argparse.ArgumentParser, classes: Iterable[type]) -> list[str]:
    """How ``parser``'s flags differ from the command-line fields of ``classes`` (flag, dest, default)."""
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    problems = []
    for cls in classes:
        for f, spec in option_fields(cls):
            if not spec.cli:
                continue
            action = actions.get(flag_of(f, spec))
            if action is None:
                problems.append(f"the parser lacks {flag_of(f, spec)} ({cls.__name__}.{f.name})")
                continue
            default = action.default
            if isinstance(default, str) and action.type is not None and default is not None:
                default = action.type(default)
            if action.dest != f.name or default != f.default:
                problems.append(
                    f"{flag_of(f, spec)}: dest={action.dest!r} default={default!r}, but "
                    f"{cls.__name__}.{f.name} defaults to {f.default!r}"
                )
    return problems


def options_table(classes: Iterable[type]) -> str:
    """A Markdown table of every option of ``classes``: flag, keyword, default, meaning."""
    rows = ["| flag | keyword | default | meaning |", "|---|---|---|---|"]
    for cls in classes:
        for f, spec in option_fields(cls):
            flag = (
                " ".join(f"`{x}`" for x in (flag_of(f, spec), *spec.aliases)) if spec.cli else "(Python only)"
            )
            default = spec.cli_default if spec.cli_default is not None else repr(f.default)
            meaning = spec.help.replace("|", "\\|")
            if spec.choices:
                meaning += " (" + ", ".join(f"`{c}`" for c in spec.choices) + ")"
            rows.append(f"| {flag} | `{f.name}` | `{default}` | {meaning} |")
    return "\n".join(rows)


# -- value parsers shared by every CLI ---------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors are one line: ``prog: error: message (see prog --help)``.

    argparse's own ``error`` printed the whole usage block first (56 lines for the server), burying the one
    line that says which flag is wrong. Subcommand parsers made from it are of this class too.
    """

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # An action with ``expand_arguments(parser, args)`` rewrites the words first and one with
        # ``finish_namespace(parser, namespace)`` completes the result (kvb-server's ``--config FILE``);
        # subcommand parsers go through here too.
        words = [self._dashed(w) for w in (sys.argv[1:] if args is None else args)]
        for action in self._actions:
            expand = getattr(action, "expand_arguments", None)
            if expand is not None:
                words = expand(self, words)
        namespace, rest = super().parse_known_args(words, namespace)
        for action in self._actions:
            finish = getattr(action, "finish_namespace", None)
            if finish is not None:
                finish(self, namespace)
        return namespace, rest

    def _dashed(self, word: str) -> str:
        """``--max_num_seqs`` as ``--max-num-seqs`` (vLLM takes both spellings) when only that one is an
        option here."""
        flag, eq, value = word.partition("=")
        if not flag.startswith("--") or "_" not in flag or flag in self._option_string_actions:
            return word
        dashed = "--" + flag[2:].replace("_", "-")
        return dashed + eq + value if dashed in self._option_string_actions else word


def flag_hint(parser: argparse.ArgumentParser, message: str) -> str:
    """``message`` with the flag of the first option it names by its field name (one with an underscore),
    when it names no flag already: a value the argument type let through and the options class refused says
    ``num_blocks must be ...``, which is not how it was spelled on the command line."""
    found = []  # (where the name is in the message, its flag): the name said first is the one refused
    for action in parser._actions:  # argparse has no public iteration over its actions
        flags = [o for o in action.option_strings if o.startswith("--")]
        if not flags:
            continue
        if any(f in message for f in flags):
            return message
        # Only names with an underscore: "model" or "seed" would match plain words of a message.
        match = re.search(rf"\b{re.escape(action.dest)}(_s)?\b", message) if "_" in action.dest else None
        if match is not None:
            found.append((match.start(), flags[0]))
    return f"{message} ({min(found)[1]})" if found else message


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1048576"`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size; write e.g. 2GiB, 512MB or 1048576")
    return int(float(match.group(1)) * _UNITS[unit])


_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def model_len(text: str) -> int | None:
    """vLLM's ``--max-model-len``: an integer >= 1, or human-readable (``1k`` 1000, ``1K`` 1024, ``25.6k``
    25600; k/m/g decimal, K/M/G binary); ``-1`` and ``auto`` mean unset (the model's context, capped by
    what the block pool holds: the largest length that fits, as vLLM's ``auto``).

    NOTE: a ``vllm serve`` command line with ``--max-model-len 32k`` failed here at start-up.
    """
    if text.strip().lower() in ("auto", "-1"):
        return None
    body, scale = text.strip(), 1
    if body[-1:] in _SIZE_SUFFIXES:
        body, scale = body[:-1], _SIZE_SUFFIXES[body[-1]]
    try:
        # Decimal: in floats 1.001 * 1000 is 1000.9999999999999, and "1.001k" was refused.
        value = Decimal(body) * scale if scale != 1 else Decimal(int(body))
    except (ArithmeticError, ValueError):
        value = Decimal(0)
    if not value.is_finite() or value != value.to_integral_value() or value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a length: an integer >= 1, 1k / 1K style (k=1000, K=1024), or -1 / auto"
        )
    return int(value)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (block and scheduling sizes)."""
    return _int_at_least(text, 1)


def block_count(text: str) -> int:
    """An integer >= 2 (``num_blocks``: the config's own lower bound, said by the flag too)."""
    return _int_at_least(text, 2)
