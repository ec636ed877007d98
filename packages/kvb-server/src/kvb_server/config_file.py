"""``--config FILE``: server options from a YAML file, as ``vllm serve --config`` reads them.

Each key is an option's long name without the dashes (``max-num-seqs`` or ``max_num_seqs``), each value what
the flag would take: ``port: 8000``, ``enable-prefix-caching: true``, ``served-model-name: [a, b]``,
``speculative-config: {method: ngram, num_speculative_tokens: 4}``. The file becomes command-line words put
*before* the ones typed, so every value goes through the flag's own parsing and checks, and a flag typed on
the command line wins over the file (as in vLLM). ``model:`` names the model unless the command line does.

The file is parsed by ``yaml.safe_load`` (plain data only; PyYAML comes with transformers).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FLAG = "--config"
#: Hidden flag carrying the file's ``model:``: it sets the model without counting as "given" on the command
#: line, so ``--model`` or the positional model typed after it replaces it instead of conflicting.
MODEL_FLAG = "--config-model"


class ConfigFileAction(argparse.Action):
    """``--config FILE``. :meth:`expand_arguments` replaces the flag and its file by the file's options before argparse
    sees them (the parser calls it: :class:`kvb_cache.options.ArgumentParser`), so this action only runs
    for a ``--config`` that :meth:`expand_arguments` did not find, which cannot happen; it refuses rather than ignore."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("metavar", "FILE")
        super().__init__(option_strings, dest, default=None, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{FLAG} must be given as '{FLAG} FILE' or '{FLAG}=FILE'")

    def expand_arguments(self, parser: argparse.ArgumentParser, args: Sequence[str]) -> list[str]:
        """``args`` with ``--config FILE`` replaced by the file's options, put first."""
        args = list(args)
        found = [i for i, a in enumerate(args) if a == FLAG or a.startswith(f"{FLAG}=")]
        if not found:
            return args
        if len(found) > 1:
            parser.error(f"{FLAG} is given {len(found)} times: pass one file")
        i = found[0]
        if args[i] == FLAG:
            if i + 1 >= len(args):
                parser.error(f"{FLAG} needs a YAML file")
            path, rest = args[i + 1], args[:i] + args[i + 2 :]
        else:
            path, rest = args[i].split("=", 1)[1], args[:i] + args[i + 1 :]
        return [*file_arguments(parser, path), *rest]


def file_arguments(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line words of the options in the YAML file ``path`` (errors through ``parser.error``)."""
    import yaml

    where = f"{FLAG} {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        parser.error(f"{where}: cannot be read ({exc.strerror or exc})")
    except UnicodeDecodeError:
        parser.error(f"{where}: is not UTF-8 text")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        parser.error(f"{where}: is not valid YAML ({' '.join(str(exc).split())})")
    if data is None:
        return []
    if not isinstance(data, dict):
        parser.error(f"{where}: must be a mapping of option names to values, got a {type(data).__name__}")
    words: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str) or not key.strip("-"):
            parser.error(f"{where}: option names must be non-empty strings, got {key!r}")
        name = key.lstrip("-").replace("_", "-")
        if name == "config":
            parser.error(f"{where}: a config file cannot name another one ('{key}')")
        flag = MODEL_FLAG if name == "model" else f"--{name}"
        action = parser._option_string_actions.get(flag)  # argparse has no public lookup by flag
        if action is None:
            parser.error(
                f"{where}: unknown option '{key}' (the names are those of --help, without the dashes)"
            )
        words += _words(parser, where, key, flag, action, value)
    return words


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _words(
    parser: argparse.ArgumentParser, where: str, key: str, flag: str, action: argparse.Action, value: Any
) -> list[str]:
    """``flag`` with ``value`` as command-line words for ``action``."""
    if value is None:
        parser.error(f"{where}: '{key}' has no value")
    if isinstance(value, bool):
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag] if value else [f"--no-{flag[2:]}"]
        if action.nargs in (0, "?"):  # store_true and the like; vLLM flags taking an optional value
            return [flag] if value else []
        return [f"{flag}={_scalar(value)}"]
    if isinstance(value, (list, tuple)):
        items = [_scalar(v) for v in value]
        if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
            return [flag, *items] if items else []
        if isinstance(action, argparse._AppendAction):  # e.g. --warm: the flag once per item
            return [f"{flag}={item}" for item in items]
        return [f"{flag}={json.dumps(list(value))}"]  # a flag taking JSON (--allowed-origins)
    return [f"{flag}={_scalar(value)}"]


def add_config_arguments(parser: argparse.ArgumentParser, set_model) -> None:
    """Declare ``--config FILE`` and the hidden flag its ``model:`` becomes (``set_model``: the action that
    sets the model without counting as given on the command line)."""
    parser.add_argument(
        FLAG,
        action=ConfigFileAction,
        help="a YAML file of options, as vllm serve --config reads it: keys are option names without the "
        "dashes (port: 8000, max-num-seqs: 16, served-model-name: [a, b]); flags typed on the command line "
        "win over the file",
    )
    parser.add_argument(MODEL_FLAG, action=set_model, dest="model", help=argparse.SUPPRESS)
