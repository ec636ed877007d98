"""Value types and actions of the server's own flags (argparse ``type=`` / ``action=``): a bad value is a
usage error when the flags are parsed, before the model loads."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when it says something: not for None or an empty list (each such help
    already says what leaving it out does, and "(default: None)" or "(default: [])" after "unset: the model's"
    only repeated it in Python's words), nor when the help names its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or (isinstance(default, (list, tuple)) and not default):
            return action.help
        if action.help and "(default" in action.help:
            return action.help
        return super()._get_help_string(action)


def port(text: str) -> int:
    """``--port``: a TCP port, 1..65535 (uvicorn otherwise fails after the model loaded, with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1..65535)")
    return value


def api_key(text: str) -> str:
    """``--api-key``: a non-blank key. ``--api-key ""`` (``--api-key "$KEY"`` with KEY unset) started the
    server without authentication and without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "the key is empty; pass a key, or leave --api-key out to serve without one"
        )
    return text


def margin(text: str) -> float:
    """``--planner-safety-margin``: a fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a fraction in [0, 1); e.g. 0.1 keeps 10% of free memory back"
        )
    return value


def logprobs_cap(text: str) -> int:
    """``--max-logprobs``: an int >= 0, or -1 for the whole vocabulary (vLLM's spelling)."""
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0, or -1 for the whole vocabulary")
    return value


class DeprecatedFlag(argparse.Action):
    """A flag kept so old command lines still start: it warns, and stores into ``replacement``'s value or,
    without a replacement, is ignored."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, replacement: str | None = None, **kwargs: Any
    ) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if self.replacement is None:
            logger.warning("%s is deprecated and ignored: requests join the next engine step", option_string)
            return
        logger.warning("%s is deprecated; use %s", option_string, self.replacement)
        setattr(namespace, self.dest, values)
