"""The option groups of the optional parts, declared once like :class:`kvb_cache.EngineArgs`.

The leaves (kvb-speculative, kvb-streaming, kvb-kernels) import no sibling, so their engine options are
declared here, where they are composed: :meth:`kvboost.KVBoost.from_pretrained`'s keywords and
``kvboost serve``'s flags both come from these fields. kvb-kernels has no field of its own: it adds the
value ``kvb_attention`` to ``EngineArgs.attn_implementation`` (``--attn-implementation``).
"""

# option() returns a dataclasses.field (with metadata), which RUF009 cannot tell from a shared default.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvb_cache.options import option, positive_int
from kvb_streaming import StreamingConfig, StreamingConfigError
from kvb_streaming.config import QUANT_KERNELS, RESIDENCY_MODES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SPECULATIVE_MODES = ("prompt_lookup", "draft_model")
#: The attention implementation kvb-kernels registers with transformers.
KVB_ATTENTION = "kvb_attention"


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeArgs:
    """Speculative decoding (kvb-speculative): draft several tokens, verify them in one target forward."""

    speculative: str | None = option(
        None,
        group="speculative decoding",
        choices=SPECULATIVE_MODES,
        help="prompt_lookup: n-gram drafts copied from the prompt (no extra model); draft_model: a small "
        "model with the target's vocabulary (--draft-model). Outputs stay exactly those of plain decoding. "
        "Greedy and unseeded sampled requests without penalties, banned words, min_tokens, grammar or logprobs "
        "speculate inside the batched step beside every other request; the others speculate solo when they "
        "arrive alone. Unset: off unless --draft-model is given",
    )
    draft_model: str | PreTrainedModel | None = option(
        None,
        group="speculative decoding",
        metavar="PATH",
        help="the draft model: a local folder or a hub id already in the local cache (in Python also a loaded "
        "model), loaded on the target's device and dtype",
    )
    gamma: int = option(
        5,
        group="speculative decoding",
        parse=positive_int,
        help="most drafted tokens verified per target forward",
    )
    prompt_lookup_max: int = option(
        3,
        group="speculative decoding",
        parse=positive_int,
        help="prompt_lookup: longest suffix n-gram looked up in the prompt and output (tried first)",
    )
    prompt_lookup_min: int = option(
        2,
        group="speculative decoding",
        parse=positive_int,
        help="prompt_lookup: shortest suffix n-gram looked up",
    )
    speculative_config: str | dict | None = option(
        None,
        group="speculative decoding",
        metavar="JSON",
        help="vLLM's --speculative-config, as JSON: method ngram (prompt_lookup) or draft_model, "
        "num_speculative_tokens (gamma), prompt_lookup_max / prompt_lookup_min, model (the draft model), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}\'; instead of the flags above',
    )

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            # Resolved into the fields above once (frozen): every reader sees the plain options.
            for name, value in vllm_speculative_config(self.speculative_config, self).items():
                object.__setattr__(self, name, value)
            object.__setattr__(self, "speculative_config", None)

    @property
    def enabled(self) -> bool:
        return self.speculative is not None or self.draft_model is not None


#: vLLM ``speculative_config`` methods served here, and the ``speculative`` mode each one is.
VLLM_METHODS = {"ngram": "prompt_lookup", "draft_model": "draft_model"}
#: vLLM ``speculative_config`` keys taken here, and the :class:`SpeculativeArgs` field each one sets.
VLLM_KEYS = {
    "method": "speculative",
    "model": "draft_model",
    "num_speculative_tokens": "gamma",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
}


def vllm_speculative_config(config: str | dict, given: SpeculativeArgs) -> dict[str, object]:
    """The :class:`SpeculativeArgs` fields a vLLM ``speculative_config`` (a JSON object, or its dict) sets.

    Raises:
        StreamingConfigError's sibling ``kvb_speculative.SpeculativeConfigError``: not a JSON object, an
            unknown key or method (EAGLE, Medusa, MTP... need trained heads this server does not load), a
            value of the wrong type, or a field also given by its own flag.
    """
    from kvb_speculative import SpeculativeConfigError

    if isinstance(config, str):
        import json

        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"speculative_config is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise SpeculativeConfigError(
            f'speculative_config must be a JSON object like {{"method": "ngram", '
            f'"num_speculative_tokens": 5}}, got {config!r}'
        )
    unknown = sorted(set(config) - set(VLLM_KEYS))
    if unknown:
        raise SpeculativeConfigError(
            f"speculative_config keys {unknown} are not supported here; use {sorted(VLLM_KEYS)}"
        )
    method = config.get("method")
    if method is None:
        method = "draft_model" if config.get("model") is not None else "ngram"
    if config.get("model") == "[ngram]":  # vLLM's older spelling of the n-gram method
        method, config = "ngram", {k: v for k, v in config.items() if k != "model"}
    if method not in VLLM_METHODS:
        raise SpeculativeConfigError(
            f"speculative_config method {method!r} is not served here (it needs trained draft heads); use "
            f"{' or '.join(VLLM_METHODS)} (kvb-speculative's prompt_lookup / draft_model)"
        )
    fields = {"speculative": VLLM_METHODS[method]}
    for key, value in config.items():
        if key == "method":
            continue
        if key == "model":
            if not isinstance(value, str) or not value:
                raise SpeculativeConfigError(
                    f"speculative_config model must be a path or hub id, got {value!r}"
                )
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpeculativeConfigError(f"speculative_config {key} must be an int >= 1, got {value!r}")
        fields[VLLM_KEYS[key]] = value
    defaults = SpeculativeArgs()
    clashes = sorted(
        name
        for name in fields
        if getattr(given, name) != getattr(defaults, name) and name != "speculative_config"
    )
    if clashes:
        raise SpeculativeConfigError(
            f"speculative_config sets {clashes}, which were also given on their own (--"
            f"{clashes[0].replace('_', '-')}); give them once"
        )
    return fields


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamingArgs:
    """AWQ layer streaming (kvb-streaming): decoder layers live in pinned host RAM and stream to the GPU."""

    awq_streaming: bool = option(
        False,
        group="AWQ layer streaming",
        help="load the model as an AWQ int4 (GEMM) checkpoint through kvb_streaming.StreamingCausalLM: layers "
        "not kept resident stream from pinned host RAM through staging slots (models larger than VRAM)",
    )
    streaming_mode: str = option(
        "full_stream",
        group="AWQ layer streaming",
        aliases=("--residency-mode",),
        choices=RESIDENCY_MODES,
        help="what stays on the device: full_resident (nothing streamed), partial_resident (the first/last k "
        "layers), ffn_only_stream (all attention; MLPs of the other layers stream), full_stream (every layer "
        "streams)",
    )
    keep_first_k: int = option(
        0,
        group="AWQ layer streaming",
        help="leading decoder layers kept resident (partial_resident, ffn_only_stream)",
    )
    keep_last_k: int = option(
        0,
        group="AWQ layer streaming",
        help="trailing decoder layers kept resident (partial_resident, ffn_only_stream)",
    )
    staging_slots: int = option(
        2,
        group="AWQ layer streaming",
        parse=positive_int,
        help="device buffers streamed layers are copied into; 2 copies the next layer while this one computes",
    )
    streaming_quant_kernel: str = option(
        "auto",
        group="AWQ layer streaming",
        choices=QUANT_KERNELS,
        help="int4 GEMM: torch (dequantize + matmul, everywhere), int4pack (torch's tinygemm), kvb_kernels "
        "(Triton, from kvb-kernels) or auto (the fastest available)",
    )
    streaming_simulate_on_host: bool = option(
        False,
        group="AWQ layer streaming",
        help="run the streaming machinery on CPU too, where device memory is host memory (no speed gain: for "
        "tests and debugging); without it streaming is off on CPU and every layer is resident",
    )

    def streaming_config(self) -> StreamingConfig | None:
        """The :class:`kvb_streaming.StreamingConfig` asked for; None when ``awq_streaming`` is off.

        Raises:
            StreamingConfigError: a streaming option without ``awq_streaming``, or an inconsistent setting.
        """
        if not self.awq_streaming:
            if self != StreamingArgs():
                raise StreamingConfigError(
                    "streaming options were given without awq_streaming=True (--awq-streaming); add it or drop them"
                )
            return None
        return StreamingConfig(
            residency_mode=self.streaming_mode,  # type: ignore[arg-type]
            keep_first_k=self.keep_first_k,
            keep_last_k=self.keep_last_k,
            n_staging_slots=self.staging_slots,
            quant_kernel=self.streaming_quant_kernel,  # type: ignore[arg-type]
            simulate_on_host=self.streaming_simulate_on_host,
        )


#: Every option group the meta-package adds to :class:`kvb_cache.EngineArgs`, in ``--help`` order.
PART_ARGS: tuple[type, ...] = (SpeculativeArgs, StreamingArgs)


# -- the README's options table ---------------------------------------------------------------------------
TABLE_START, TABLE_END = "<!-- options-table:start -->", "<!-- options-table:end -->"


def options_markdown() -> str:
    """Every option of the full stack (``EngineArgs`` then :data:`PART_ARGS`) as a Markdown table."""
    from kvb_cache.engine_args import EngineArgs
    from kvb_cache.options import options_table

    return options_table([EngineArgs, *PART_ARGS])


def replace_options_table(text: str, table: str) -> str:
    """``text`` with ``table`` between the options-table markers (unchanged when they are missing)."""
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        return text
    return text[: start + len(TABLE_START)] + "\n" + table + "\n" + text[end:]
