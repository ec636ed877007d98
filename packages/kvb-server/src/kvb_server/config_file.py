"""``--config FILE``: server options from a YAML file, as ``vllm serve --config`` reads them.

Each key is an option's long name without the dashes (``max-num-seqs`` or ``max_num_seqs``), each value what
the flag would take: ``port: 8000``, ``enable-prefix-caching: true``, ``served-model-name: [a, b]``,
``speculative-config: {method: ngram, num_speculative_tokens: 4}``. The file becomes command-line words put
*before* the ones typed, each self-delimited (``--flag=value``, a list as ``--flag=item`` per item), so every
value goes through the flag's own parsing and checks and none can take a typed word as its value. An option
typed on the command line wins: the file's is dropped (a list too, not merged). ``model:`` names the model
unless the command line does.

The file is parsed by ``yaml.safe_load`` (plain data only; PyYAML comes with transformers).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvb_server.vllm_flags import RefusedFlag, SatisfiedFlag

FLAG = "--config"


class ConfigFileAction(argparse.Action):
    """``--config FILE``. The parser (:class:`kvb_cache.options.ArgumentParser`) calls
    :meth:`expand_arguments` before parsing, which replaces the flag and its file by the file's options, and
    :meth:`finish_namespace` after, which settles the model. So this action itself only runs for a spelling
    :meth:`expand_arguments` did not take, and refuses it rather than ignore it."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("metavar", "FILE")
        super().__init__(option_strings, dest, default=None, **kwargs)
        self._file_model: str | None = None

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{FLAG} must be given as '{FLAG} FILE' or '{FLAG}=FILE'")

    def expand_arguments(self, parser: argparse.ArgumentParser, args: Sequence[str]) -> list[str]:
        """``args`` with ``--config FILE`` replaced by the file's options, put first; the file's ``model:``
        is kept aside for :meth:`finish_namespace`."""
        self._file_model = None
        args = list(args)
        found = [i for i, a in enumerate(args) if _is_config_flag(parser, a.split("=", 1)[0])]
        if not found:
            return args
        if len(found) > 1:
            parser.error(f"{FLAG} is given {len(found)} times: pass one file")
        i = found[0]
        if "=" in args[i]:
            path, rest = args[i].split("=", 1)[1], args[:i] + args[i + 1 :]
        elif i + 1 < len(args):
            path, rest = args[i + 1], args[:i] + args[i + 2 :]
        else:
            path, rest = "", args[:i]
        if not path:
            parser.error(f"{FLAG} needs a YAML file ({FLAG} FILE)")
        options = file_options(parser, path)
        self._file_model = options.pop("model", None)
        typed = {id(a) for a in (_typed_action(parser, w) for w in rest) if a is not None}
        words = [w for action, ws in options.values() if id(action) not in typed for w in ws]
        return [*words, *rest]

    def finish_namespace(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
        """The file's model unless one was typed; served names with no model named are refused (vLLM's
        rule): in ``--served-model-name x MODEL`` the model is taken as a second name, and the server
        started on the default model."""
        if getattr(namespace, "model_given", None) is None and self._file_model is not None:
            namespace.model = namespace.model_given = self._file_model
        if getattr(namespace, "model_given", None) is None and getattr(namespace, "served_model_name", None):
            parser.error(
                "--served-model-name is given but no model is: name the model first (MODEL "
                "--served-model-name NAME, or --model MODEL; the embedded one is smollm2-135m)"
            )


def _is_config_flag(parser: argparse.ArgumentParser, word: str) -> bool:
    """``--config``, or an abbreviation of it no other option shares (argparse's rule)."""
    if word == FLAG:
        return True
    if len(word) < 4 or not FLAG.startswith(word):
        return False
    return [o for o in parser._option_string_actions if o.startswith(word)] == [FLAG]


def _typed_action(parser: argparse.ArgumentParser, word: str) -> argparse.Action | None:
    """The option a typed word names (its exact flag or an unambiguous abbreviation), else None."""
    if not word.startswith("--"):
        return None
    flag = word.split("=", 1)[0]
    actions = parser._option_string_actions  # argparse has no public lookup by flag
    if flag in actions:
        return actions[flag]
    found = {id(a): a for o, a in actions.items() if o.startswith(flag)}
    return next(iter(found.values())) if len(found) == 1 else None


def file_options(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The options of the YAML file ``path``: option name -> ``(action, command-line words)``, and
    ``"model"`` -> the model (errors through ``parser.error``)."""
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
        return {}
    if not isinstance(data, dict):
        parser.error(f"{where}: must be a mapping of option names to values, got a {type(data).__name__}")
    options: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key.strip("-"):
            parser.error(f"{where}: option names must be non-empty strings, got {key!r}")
        name = key.lstrip("-").replace("_", "-")
        if name == "config":
            parser.error(f"{where}: a config file cannot name another one ('{key}')")
        if name in ("help", "version"):  # they print and exit: a file of options should serve
            parser.error(f"{where}: unknown option '{key}' (--{name} is for the command line)")
        if name == "model":
            if not isinstance(value, str) or not value:
                parser.error(f"{where}: 'model' must be a model folder or name, got {value!r}")
            options["model"] = value
            continue
        flag = f"--{name}"
        action = parser._option_string_actions.get(flag)
        if action is None:
            # The Python name of an option whose flag is shorter (remote_ttl_s: --remote-ttl), as
            # from_pretrained takes it: the file takes either.
            dest = name.replace("-", "_")
            action = next((a for a in parser._actions if a.dest == dest and a.option_strings), None)
            flag = next((o for o in action.option_strings if o.startswith("--")), flag) if action else flag
        if action is None:
            parser.error(
                f"{where}: unknown option '{key}' (the names are those of --help, without the dashes)"
            )
        options[name] = (action, _words(parser, where, key, flag, action, value))
    return options


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _words(
    parser: argparse.ArgumentParser, where: str, key: str, flag: str, action: argparse.Action, value: Any
) -> list[str]:
    """``flag`` with ``value`` as self-delimited command-line words for ``action``."""
    if value is None:
        parser.error(f"{where}: '{key}' has no value")
    if isinstance(value, bool):
        if value is False and isinstance(action, RefusedFlag) and flag.startswith("--enable-"):
            return []  # `enable-lora: false`: not asking for the feature this server does not have
        if isinstance(action, argparse.BooleanOptionalAction):
            # ``no-oom-planning: false`` is --oom-planning: the key may be either spelling.
            on = value != flag.startswith("--no-")
            positive = next(o for o in action.option_strings if not o.startswith("--no-"))
            return [positive if on else f"--no-{positive[2:]}"]
        if action.nargs == 0:  # a switch: true turns it on; false asks to turn it off
            if value:
                return [flag]
            opposite = f"--no-{flag[2:]}"
            if opposite in parser._option_string_actions:  # vLLM: `key: false` is --no-key
                return [opposite]
            if isinstance(action, SatisfiedFlag) and flag.startswith("--enable-"):
                # vLLM's --enable-prefix-caching: false asks to turn off what this server always does.
                parser.error(
                    f"{where}: '{key}: false' cannot be served: {flag} is what this server always does"
                )
            # A switch left off (vLLM YAML files spell out `enable-log-requests: false`,
            # `disable-log-stats: false`): its default, nothing to pass. Refused with "what this server always
            # does" before, which was not true of them.
            return []
        return [f"{flag}={_scalar(value)}"]
    if isinstance(value, (list, tuple)):
        items = [_scalar(v) for v in value]
        if isinstance(action, argparse._AppendAction):  # append and extend (--served-model-name, --warm)
            return [f"{flag}={item}" for item in items]
        if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
            parser.error(f"{where}: '{key}' takes its values on the command line, not from a file")
        return [f"{flag}={json.dumps(list(value))}"]  # a flag taking JSON (--allowed-origins)
    return [f"{flag}={_scalar(value)}"]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``--config FILE``."""
    parser.add_argument(
        FLAG,
        action=ConfigFileAction,
        help="a YAML file of options, as vllm serve --config reads it: keys are option names without the "
        "dashes (port: 8000, max-num-seqs: 16, served-model-name: [a, b]); an option typed on the command "
        "line replaces the file's",
    )
