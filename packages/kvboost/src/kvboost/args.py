"""The option groups of the optional parts, declared once like :class:`kvb_cache.EngineArgs`.

The leaves (kvb-speculative, kvb-streaming, kvb-kernels) import no sibling, so their engine options are
declared here, where they are composed: :meth:`kvboost.KVBoost.from_pretrained`'s keywords and
``kvboost serve``'s flags both come from these fields. kvb-kernels has no field of its own: it adds the
value ``kvb_attention`` to ``EngineArgs.attn_implementation`` (``--attn-implementation``).
"""

# option() returns a dataclasses.field (with metadata), which RUF009 cannot tell from a shared default.
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
import json
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
        "speculate inside the batched step beside every other request; penalised ones speculate solo when they "
        "arrive alone, seeded sampled ones solo under any load. Unset: off unless --draft-model is given",
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
        self._check_bounds()

    def _check_bounds(self) -> None:
        """The ranges kvb-speculative checks, said in the names the user typed (its own messages name its
        parameters, ``gamma`` / ``max_ngram``, which neither the flags nor vLLM's JSON keys are)."""
        from kvb_speculative import SpeculativeConfigError

        gamma, low, high = self.gamma, self.prompt_lookup_min, self.prompt_lookup_max
        if isinstance(gamma, int) and not isinstance(gamma, bool) and not 1 <= gamma <= 64:
            raise SpeculativeConfigError(
                f"gamma={gamma} (--gamma, or num_speculative_tokens in --speculative-config) must be in 1..64 "
                "(typical: 3-10)"
            )
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) and low > high:
            raise SpeculativeConfigError(
                f"prompt_lookup_min={low} is above prompt_lookup_max={high} (--prompt-lookup-min / "
                "--prompt-lookup-max, or the same keys in --speculative-config): the shortest n-gram looked "
                "up cannot be longer than the longest"
            )

    @property
    def enabled(self) -> bool:
        return self.speculative is not None or self.draft_model is not None


#: vLLM ``speculative_config`` methods served here, and the ``speculative`` mode each one is (``prompt_lookup``,
#: kvb-speculative's own name for ngram, taken too).
VLLM_METHODS = {"ngram": "prompt_lookup", "draft_model": "draft_model", "prompt_lookup": "prompt_lookup"}
#: vLLM's other methods, and why they are not served.
_HEADS = "it needs trained draft heads or layers, which this server does not load"
REFUSED_METHODS = {
    **dict.fromkeys(
        (
            "eagle",
            "eagle3",
            "medusa",
            "mlp_speculator",
            "mtp",
            "deepseek_mtp",
            "ernie_mtp",
            "qwen3_next_mtp",
            "glm4_moe_mtp",
            "longcat_flash_mtp",
            "mimo_mtp",
        ),
        _HEADS,
    ),
    "suffix": "suffix decoding (Arctic Inference's) is not served; ngram drafts from the prompt and output too",
}
#: vLLM ``speculative_config`` keys taken here, and the :class:`SpeculativeArgs` field each one sets.
VLLM_KEYS = {
    "method": "speculative",
    "model": "draft_model",
    "num_speculative_tokens": "gamma",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
}


#: vLLM's other ``speculative_config`` keys: what is done here instead, and the values that ask for just that
#: (accepted; any other value, or a key with none, is refused with the reason).
OTHER_KEYS: dict[str, tuple[str, tuple[object, ...]]] = {
    "draft_tensor_parallel_size": ("one engine runs on one device", (1,)),
    "enforce_eager": ("the draft model always runs eagerly", (True, None)),
    "disable_logprobs": ("requests asking for logprobs never speculate, so drafts carry none", (True, None)),
    "acceptance_method": ("drafts are verified by exact speculative sampling", ("rejection_sampler", None)),
    "disable_by_batch_size": (
        "speculation inside the batched step is not turned off by load: drafts are planned after every "
        "request's token, so they take only room that would go unused (docs/speculative.md)",
        (),
    ),
    "max_model_len": ("the draft model's context is the target's", ()),
    "quantization": ("the draft model is loaded as its checkpoint is", ()),
    "revision": ("nothing is downloaded: model is a local folder or a hub id already in the local cache", ()),
    "code_revision": ("a checkpoint's own code is never run", ()),
}


def _refusal(key: str) -> str:
    """Why ``key`` (with a value other than those accepted) is refused."""
    if key not in OTHER_KEYS:
        return f"not one of vLLM's keys served here ({', '.join(sorted(VLLM_KEYS))})"
    why, accepted = OTHER_KEYS[key]
    shown = [v if isinstance(v, str) else json.dumps(v) for v in accepted if v is not None]
    return f"{why} (accepted: {', '.join(shown)})" if shown else why


def vllm_speculative_config(config: str | dict, given: SpeculativeArgs) -> dict[str, object]:
    """The :class:`SpeculativeArgs` fields a vLLM ``speculative_config`` (a JSON object, or its dict) sets.

    Raises:
        StreamingConfigError's sibling ``kvb_speculative.SpeculativeConfigError``: not a JSON object, an
            unknown key or method (EAGLE, Medusa, MTP... need trained heads this server does not load), a
            value of the wrong type, or a field also given by its own flag.
    """
    from kvb_speculative import SpeculativeConfigError

    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"speculative_config is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise SpeculativeConfigError(
            f'speculative_config must be a JSON object like {{"method": "ngram", '
            f'"num_speculative_tokens": 5}}, got {config!r}'
        )
    for key in sorted(set(config) - set(VLLM_KEYS)):
        if key in OTHER_KEYS and config[key] in OTHER_KEYS[key][1]:
            continue
        raise SpeculativeConfigError(
            f"speculative_config key {key!r} (= {config[key]!r}) is refused: {_refusal(key)}"
        )
    config = {k: v for k, v in config.items() if k in VLLM_KEYS}
    method = config.get("method")
    if method is None:
        method = "draft_model" if config.get("model") is not None else "ngram"
    if config.get("model") == "[ngram]":  # vLLM's older spelling of the n-gram method
        method, config = "ngram", {k: v for k, v in config.items() if k != "model"}
    if not isinstance(method, str) or method not in VLLM_METHODS:
        why = REFUSED_METHODS.get(method, "unknown method") if isinstance(method, str) else "not a string"
        raise SpeculativeConfigError(
            f"speculative_config method {method!r} is not served here ({why}); use ngram or draft_model"
        )
    if VLLM_METHODS[method] == "prompt_lookup" and config.get("model") is not None:
        raise SpeculativeConfigError(
            f"speculative_config method {method!r} drafts from the prompt and takes no model; drop "
            f"'model' ({config['model']!r}) or use method draft_model"
        )
    # vLLM: with one n-gram bound given, the other equals it ({"prompt_lookup_max": 4} looks up 4-grams only).
    for one, other in (
        ("prompt_lookup_max", "prompt_lookup_min"),
        ("prompt_lookup_min", "prompt_lookup_max"),
    ):
        if one in config and other not in config and getattr(given, other) == _DEFAULTS[other]:
            config = {**config, other: config[one]}
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
    # NOTE: "also given" means given with another value than the default: a flag set to its default cannot
    # be told from one left out (the JSON's value is then taken).
    clashes = sorted(
        name for name in fields if getattr(given, name) != _DEFAULTS[name] and name != "speculative_config"
    )
    if clashes:
        raise SpeculativeConfigError(
            f"speculative_config sets {clashes}, which were also given on their own (--"
            f"{clashes[0].replace('_', '-')}); give them once"
        )
    return fields


#: Each :class:`SpeculativeArgs` field's default.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SpeculativeArgs)}


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
        "(Triton, from kvb-kernels; not yet measured on a GPU) or auto (int4pack where it runs, else kvb_kernels, "
        "else torch)",
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


# -- the generated options tables ---------------------------------------------------------------------------
TABLE_START, TABLE_END = "<!-- options-table:start -->", "<!-- options-table:end -->"
#: The server's own options (``kvb_server.ServerConfig``'s declared fields), in docs/server.md.
SERVER_TABLE_START, SERVER_TABLE_END = (
    "<!-- server-options-table:start -->",
    "<!-- server-options-table:end -->",
)


def options_markdown() -> str:
    """Every option of the full stack (``EngineArgs`` then :data:`PART_ARGS`) as a Markdown table."""
    from kvb_cache.engine_args import EngineArgs
    from kvb_cache.options import options_table

    return options_table([EngineArgs, *PART_ARGS])


def server_options_markdown() -> str:
    """The HTTP layer's declared options (``kvb_server.ServerConfig``: queue, caps, limits, logging) as a
    Markdown table; its "keyword" column is the ``ServerConfig`` field."""
    from kvb_cache.options import options_table
    from kvb_server.config import ServerConfig

    return options_table([ServerConfig])


def replace_options_table(text: str, table: str, markers: tuple[str, str] = (TABLE_START, TABLE_END)) -> str:
    """``text`` with ``table`` between ``markers`` (unchanged when they are missing)."""
    begin, finish = markers
    start, end = text.find(begin), text.find(finish)
    if start < 0 or end < start:
        return text
    return text[: start + len(begin)] + "\n" + table + "\n" + text[end:]
