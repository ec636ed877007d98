"""``vllm serve`` flags this server has no option for: those whose request is already how it works are
accepted with a warning; the others are refused with what to use here instead.

A vLLM command line pasted into ``kvboost-server`` used to stop at argparse's bare "unrecognized arguments:
--swap-space", which says neither that the flag is known nor what replaces it; and flags that ask for
what this server always does (``--enable-prefix-caching``, ``--enable-auto-tool-choice --tool-call-parser
hermes``, in most vLLM tool-calling recipes) were refused, so such a command line had to be edited first.
Both kinds are declared hidden from ``--help``; none is silently ignored. The vLLM flags this server does
serve (``--max-model-len``, ``--chat-template``, ``--generation-config``, the CORS and TLS flags ...) are
ordinary options declared where they belong.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

#: flag -> why it is refused and what to use instead (one line each; docs/server.md lists them too).
REFUSED_VLLM_FLAGS: dict[str, str] = {
    "--no-enable-prefix-caching": "use --max-cache-bytes 0 to disable prefix reuse",
    "--quantization": "AWQ int4 checkpoints load with --awq-streaming (kvboost serve); KV is held in fp8 with "
    "--kv-cache-dtype fp8, and quantized in the disk/Redis tiers with --kv-cache-bits",
    "--swap-space": "there is no CPU swap space: a preempted request is recomputed (its prefix usually "
    "still cached)",
    "--revision": "nothing is downloaded: --model is a local folder or a hub id already in the local "
    "Hugging Face cache, loaded as cached",
    "--download-dir": "nothing is downloaded: --model is a local folder or a hub id already in the local "
    "Hugging Face cache",
    "--enable-lora": "LoRA adapters are not served: merge one into the weights (peft's merge_and_unload) and "
    "serve that folder",
    "--lora-modules": "LoRA adapters are not served: merge one into the weights (peft's merge_and_unload) and "
    "serve that folder",
    "--speculative-config": "speculative decoding is part of the full stack: kvboost serve takes "
    "--speculative-config (method ngram or draft_model) or --speculative prompt_lookup|draft_model",
    # vLLM's spellings from before --speculative-config (older recipes): argparse read "3" of
    # "--num-speculative-tokens 3" as a second model ("the model is given twice").
    **dict.fromkeys(
        (
            "--num-speculative-tokens",
            "--speculative-model",
            "--ngram-prompt-lookup-max",
            "--ngram-prompt-lookup-min",
        ),
        "vLLM's older speculative flags: kvboost serve takes --speculative-config, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3}\' or '
        '\'{"model": "<draft folder>", "num_speculative_tokens": 3}\'',
    ),
    "--limit-mm-per-prompt": "text only: image and audio parts are refused",
    "--calculate-kv-scales": "fp8 KV uses a scale of 1.0 (no calibration), as vLLM does without this flag "
    "(docs/kv_cache_dtype.md)",
    "--trust-request-chat-template": "a request's chat_template is never rendered (it would run the client's "
    "Jinja on this server): start the server with --chat-template",
    "--enable-sleep-mode": "there is no sleep mode: the weights and the block pool stay loaded until the server "
    "stops",
    "--async-scheduling": "one engine thread schedules each step and then runs it (scheduling does not "
    "overlap the forward)",
    "--long-prefill-token-threshold": "prefills are sliced by --max-num-batched-tokens (a request's "
    "prefill_chunk_size per step at most); long prefills have no separate limit",
    "--max-num-partial-prefills": "prefills are sliced by --max-num-batched-tokens (a request's "
    "prefill_chunk_size per step at most); long prefills have no separate limit",
    "--max-long-partial-prefills": "prefills are sliced by --max-num-batched-tokens (a request's "
    "prefill_chunk_size per step at most); long prefills have no separate limit",
    "--kv-transfer-config": "there is no KV connector (LMCache, NIXL): servers share KV through "
    "--remote-url (Redis) or a common --disk-cache-dir",
    "--hf-overrides": "the model config is the checkpoint's: edit a copy of its config.json",
    "--otlp-traces-endpoint": "there is no OpenTelemetry tracing: /metrics (Prometheus), /v1/stats and the "
    "x-request-id header report requests",
    "--return-tokens-as-token-ids": "logprobs carry each token's text and its UTF-8 bytes (`bytes`), which "
    "identify a token that is not valid text alone",
}


class _JsonWithKeys:
    """The values that are a JSON object with no key beyond ``keys`` (``in`` and ``join`` as a tuple)."""

    def __init__(self, *keys: str) -> None:
        self.keys = frozenset(keys)

    def __contains__(self, value: object) -> bool:
        import json

        try:
            parsed = json.loads(value) if isinstance(value, str) else None
        except ValueError:
            return False
        return isinstance(parsed, dict) and set(parsed) <= self.keys

    def __iter__(self):
        yield f"a JSON object with only {', '.join(sorted(self.keys))}"


#: flag -> (what this server already does that the flag asks for, the values that ask for it; None: any).
#: Accepted with a warning saying so.
SATISFIED_VLLM_FLAGS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "--enable-prefix-caching": ("prefix caching is always on", None),
    "--enable-chunked-prefill": (
        "long prompts are always prefilled in slices of at most --max-num-batched-tokens",
        None,
    ),
    "--enable-auto-tool-choice": ("tool calling is always on, decoded under a grammar", None),
    "--tool-call-parser": (
        "tool calls are decoded under a grammar and returned as OpenAI tool_calls; no parser is used",
        None,
    ),
    "--trust-remote-code": (
        "a checkpoint's own modeling code is never run; one that needs it is refused at load, naming "
        "auto_map",
        None,
    ),
    "--guided-decoding-backend": ("structured outputs always use llguidance", None),
    # Only the backend choice asks for nothing else: other keys (disable_any_whitespace ...) change outputs.
    "--structured-outputs-config": ("structured outputs always use llguidance", _JsonWithKeys("backend")),
    "--response-role": ("chat replies always have the role assistant", ("assistant",)),
    "--load-format": (
        "weights load through transformers' from_pretrained (safetensors when the folder has them)",
        ("auto", "safetensors"),
    ),
    "--tokenizer-mode": ("the tokenizer is the model folder's, loaded by transformers", ("auto", "hf")),
    "--max-seq-len-to-capture": (
        "decode steps replay CUDA graphs captured per batch size and context-width bucket, at any context "
        "length (--enforce-eager turns them off)",
        None,
    ),
    "--disable-log-requests": (
        "prompts and sampling parameters are logged only with --enable-log-requests",
        None,
    ),
    "--disable-log-stats": ("no periodic stats are logged; /metrics and /v1/stats report them", None),
    "--enable-prompt-tokens-details": (
        "usage.prompt_tokens_details.cached_tokens is always reported",
        None,
    ),
    "--enable-request-id-headers": ("every response carries an x-request-id header", None),
    # Explicit single-device values are common in vLLM command lines (-tp 1): accepted, larger ones refused.
    "--tensor-parallel-size": ("one engine runs on one device; start one server per GPU", ("1",)),
    "--pipeline-parallel-size": ("one engine runs on one device; start one server per GPU", ("1",)),
    "--data-parallel-size": ("one engine runs on one device; start one server per GPU", ("1",)),
    "--distributed-executor-backend": ("one engine runs on one device, in this process", ("mp", "uni")),
    "--cpu-offload-gb": (
        "weights are not offloaded (AWQ checkpoints larger than the GPU stream from host memory with "
        "--awq-streaming under kvboost serve)",
        ("0", "0.0"),
    ),
    # -O0 asks for no torch.compile, which is how the model runs here; -O3 and the like are refused.
    "--compilation-config": (
        "there is no torch.compile: decode steps replay CUDA graphs (off with --enforce-eager), everything "
        "else runs eagerly",
        ("0", '{"level": 0}', '{"level":0}', '{"mode": 0}', '{"mode":0}'),
    ),
    "--optimization-level": (
        "there is no torch.compile: decode steps replay CUDA graphs (off with --enforce-eager), everything "
        "else runs eagerly",
        ("0",),
    ),
}

#: Flags vLLM declares as booleans (no value). Taking an optional value, ``--enable-prefix-caching MODEL``
#: took the model as the flag's value and the server started on the default model.
BOOLEAN_VLLM_FLAGS = frozenset(
    {
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--enable-auto-tool-choice",
        "--trust-remote-code",
        "--disable-log-requests",
        "--disable-log-stats",
        "--enable-prompt-tokens-details",
        "--enable-request-id-headers",
    }
)

#: vLLM's short spellings of the flags above.
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "--tensor-parallel-size": ("-tp",),
    "--pipeline-parallel-size": ("-pp",),
    "--data-parallel-size": ("-dp",),
    "--quantization": ("-q",),
    "--compilation-config": ("-O",),
}


class _VllmFlag(argparse.Action):
    """A hidden flag taking an optional value (``--swap-space 4`` and ``--swap-space`` both parse, so the
    explanation, not argparse's "expected one argument", is what the user sees), or none when vLLM's flag
    is a boolean (:data:`BOOLEAN_VLLM_FLAGS`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        nargs = 0 if option_strings[0] in BOOLEAN_VLLM_FLAGS else "?"
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class RefusedFlag(_VllmFlag):
    """Exit with status 2 and ``why`` as soon as the flag is parsed (default: its vLLM explanation)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, why: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        flag = option_strings[0]  # the full spelling, also when an abbreviation was typed
        self.why = why or f"{flag} (a vLLM flag) is not supported: {REFUSED_VLLM_FLAGS[flag]}"

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(self.why)


class SatisfiedFlag(_VllmFlag):
    """Warn that the flag asks for what the server already does and go on; a value outside the ones that
    ask for it (``--distributed-executor-backend ray``) is refused like a :class:`RefusedFlag`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flag = self.option_strings[0]
        why, accepted = SATISFIED_VLLM_FLAGS[flag]
        if accepted is not None and values not in accepted:
            parser.error(
                f"{flag} {values} (a vLLM flag) is not supported: {why} (accepted: {', '.join(accepted)})"
            )
        # NOTE: a warning, not an error: the command line asks for what happens anyway.
        logger.warning("%s (a vLLM flag) changes nothing here: %s", flag, why)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Declare every flag of :data:`REFUSED_VLLM_FLAGS` and :data:`SATISFIED_VLLM_FLAGS` on ``parser``
    (hidden from ``--help``), except those ``parser`` already has (an engine composer's own option: the full
    stack serves ``--speculative-config``)."""
    have = parser._option_string_actions
    for flag in REFUSED_VLLM_FLAGS:
        if flag in have:
            continue
        dest = f"_refused_{flag.lstrip('-').replace('-', '_')}"
        parser.add_argument(flag, *VLLM_ALIASES.get(flag, ()), dest=dest, action=RefusedFlag)
    for flag in SATISFIED_VLLM_FLAGS:
        dest = f"_vllm_{flag.lstrip('-').replace('-', '_')}"
        parser.add_argument(flag, *VLLM_ALIASES.get(flag, ()), dest=dest, action=SatisfiedFlag)


#: Flags of the full stack's option groups (the ``kvboost`` meta-package's composer adds them): without it,
#: ``--speculative prompt_lookup`` was taken as an abbreviation of vLLM's ``--speculative-config`` and
#: refused under that name, and ``--gamma`` / ``--awq-streaming`` were merely "unrecognized".
FULL_STACK_FLAGS = (
    "--speculative",
    "--draft-model",
    "--gamma",
    "--prompt-lookup-max",
    "--prompt-lookup-min",
    "--awq-streaming",
    "--streaming-mode",
    "--residency-mode",
    "--keep-first-k",
    "--keep-last-k",
    "--staging-slots",
    "--streaming-quant-kernel",
    "--streaming-simulate-on-host",
)


def add_full_stack_flags(parser: argparse.ArgumentParser) -> None:
    """Declare :data:`FULL_STACK_FLAGS` (hidden) on a parser without the full stack's option groups: each
    exits 2 saying what provides it."""
    for flag in FULL_STACK_FLAGS:
        why = (
            f"{flag} is an option of the full stack (speculative decoding, AWQ layer streaming): install the "
            "kvboost meta-package (from this tree: pip install './packages/kvboost[all]') and run kvboost "
            "serve (or kvboost-server, which then composes it)"
        )
        dest = f"_full_stack_{flag.lstrip('-').replace('-', '_')}"
        parser.add_argument(flag, dest=dest, action=RefusedFlag, why=why)
