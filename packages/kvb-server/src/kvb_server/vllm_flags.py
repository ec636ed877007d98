"""``vllm serve`` flags this server does not take, each refused with what to use here instead.

A vLLM command line pasted into ``kvboost-server`` used to stop at argparse's bare "unrecognized arguments:
--max-model-len 4096", which says neither that the flag is known nor what replaces it. These flags are
declared (hidden from ``--help``) only to exit with status 2 and that explanation; none is silently ignored.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

#: flag -> why it is refused and what to use instead (one line each; docs/server.md lists them too).
REFUSED_VLLM_FLAGS: dict[str, str] = {
    "--gpu-memory-utilization": "size the KV block pool in bytes with --max-cache-bytes (e.g. 20GiB) or in "
    "blocks with --num-blocks; the planner keeps --planner-safety-margin of free memory back",
    "--enable-prefix-caching": "prefix caching is always on; drop the flag (--max-cache-bytes 0 disables reuse)",
    "--no-enable-prefix-caching": "use --max-cache-bytes 0 to disable prefix reuse",
    "--seed": "there is no server-wide seed: send 'seed' in each request (greedy decoding needs none)",
    "--tensor-parallel-size": "one engine runs on one device; start one server per GPU",
    "--pipeline-parallel-size": "one engine runs on one device; start one server per GPU",
    "--quantization": "AWQ int4 checkpoints load with --awq-streaming (kvboost serve); KV quantization of "
    "the disk/Redis tiers is --kv-cache-bits",
    "--kv-cache-dtype": "the block pool holds KV in --dtype; --kv-cache-bits 8/4 quantizes the disk/Redis tiers",
    "--tokenizer": "the tokenizer is loaded from --model's folder",
    "--trust-remote-code": "models load without remote code: only architectures transformers ships are served",
    "--enable-auto-tool-choice": "tool calling is always on (constrained decoding); drop the flag",
    "--tool-call-parser": "tool calls are decoded under a grammar and need no parser; drop the flag",
    "--uvicorn-log-level": "use --log-level",
}


class RefusedFlag(argparse.Action):
    """Exit with status 2 and the flag's explanation as soon as the flag is parsed."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        # nargs="?": both `--seed 1` and `--enable-prefix-caching` parse, so the explanation, not a
        # "expected one argument" error, is what the user sees.
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flag = self.option_strings[0]  # the full spelling, also when an abbreviation was typed
        parser.error(f"{flag} (a vLLM flag) is not supported: {REFUSED_VLLM_FLAGS[flag]}")


def add_refused_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Declare every flag of :data:`REFUSED_VLLM_FLAGS` on ``parser`` (hidden; each refuses itself)."""
    for flag in REFUSED_VLLM_FLAGS:
        parser.add_argument(flag, dest=f"_refused_{flag.lstrip('-').replace('-', '_')}", action=RefusedFlag)
