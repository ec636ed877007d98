"""vLLM's ``--generation-config``: the sampling defaults a model's ``generation_config.json`` recommends.

``auto`` (the default, as vLLM's): a request that omits ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` or ``max_tokens`` gets the value the served model's generation config sets (its
``max_new_tokens`` for ``max_tokens``); ``vllm``: OpenAI's / vLLM's built-in defaults; a folder: its
``generation_config.json`` instead of the model's. Only fields the config sets explicitly count
(``GenerationConfig.to_diff_dict()``, as vLLM reads them; transformers 5's own defaults are all unset, so an
untouched config overrides nothing). As vLLM does, the numeric fields are taken whatever ``do_sample`` says:
a config with ``do_sample: false`` and ``temperature: 0.7`` makes 0.7 the default.

``--override-generation-config '{"temperature": 0.5}'`` (vLLM's) sets fields over that source, key by key:
over ``auto`` or a folder the override wins where both set a field; with ``vllm`` only the override's fields
are defaults. A ``null`` value drops the source's default for that field, as vLLM's merge does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kvb_server.schemas.fields import MaxTokens, RepetitionPenalty, Temperature, TopK, TopP

logger = logging.getLogger(__name__)

#: ``--generation-config`` values that are not a folder.
AUTO, VLLM = "auto", "vllm"

#: generation_config field -> (request field, the range a request may send).
_FIELDS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", TypeAdapter(Temperature)),
    "top_p": ("top_p", TypeAdapter(TopP)),
    "top_k": ("top_k", TypeAdapter(TopK)),
    "min_p": ("min_p", TypeAdapter(TopP)),  # the same 0..1 range
    "repetition_penalty": ("repetition_penalty", TypeAdapter(RepetitionPenalty)),
    "max_new_tokens": ("max_tokens", TypeAdapter(MaxTokens)),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingDefaults:
    """What a request that omits a sampling field gets instead of OpenAI's default (None: OpenAI's).

    Attributes:
        max_tokens: the default completion budget (the generation config's ``max_new_tokens``); an
            endpoint's own smaller default (``/v1/completions``' 16) still wins, as in vLLM.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def as_dict(self) -> dict[str, float | int]:
        """The fields that are set (what ``/v1/stats`` and the startup log report)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


#: No overrides: OpenAI's defaults everywhere (``--generation-config vllm``, or a config that sets none).
NO_DEFAULTS = SamplingDefaults()


#: ``--override-generation-config`` as parsed: generation_config field name -> value (None: no default).
Override = Mapping[str, float | int | None]


def _checked(name: str, value: Any, source: str, fix: str) -> float | int:
    """``value`` of generation_config field ``name`` in the range a request may send it in.

    Raises:
        ValueError: out of that range (names the field, ``source`` and ``fix``).
    """
    try:
        return _FIELDS[name][1].validate_python(value)
    except ValidationError as exc:
        reason = exc.errors()[0].get("msg", "out of range")
        raise ValueError(
            f"{source} sets {name}={value!r}, which no request may ask for ({reason}); {fix}"
        ) from None


def defaults_from(generation_config: Any, source: str) -> SamplingDefaults:
    """The supported fields ``generation_config`` (a ``transformers.GenerationConfig``) sets explicitly.

    Raises:
        ValueError: a field outside what a request may send (names it and ``source``): every request
            leaving the field out would otherwise be refused.
    """
    if generation_config is None:
        return NO_DEFAULTS
    diff = generation_config.to_diff_dict()
    values: dict[str, Any] = {}
    for name, (field, _) in _FIELDS.items():
        value = diff.get(name)
        if value is None:
            continue
        values[field] = _checked(
            name, value, f"--generation-config: {source}", "fix it or pass --generation-config vllm"
        )
    return SamplingDefaults(**values)


def parse_override(text: str) -> dict[str, float | int | None]:
    """``--override-generation-config``: a JSON object of generation_config fields, each checked as a
    request's value would be.

    Raises:
        ValueError: not JSON, not an object, an unknown key (the message lists the supported ones) or a
            value out of range (names the key).
    """
    supported = ", ".join(_FIELDS)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"--override-generation-config: not JSON ({exc}); pass an object such as "
            f"'{{\"temperature\": 0.5}}' with keys among {supported}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"--override-generation-config: expected a JSON object with keys among {supported}")
    # NOTE: vLLM keeps keys it does not use and ignores them; refused here, because a typo ("temprature")
    # would otherwise leave the server sampling with another default than the one asked for, silently.
    unknown = sorted(set(data) - _FIELDS.keys())
    if unknown:
        raise ValueError(
            f"--override-generation-config: unsupported key(s) {', '.join(unknown)}; the supported keys are "
            f"{supported}"
        )
    bools = sorted(name for name, value in data.items() if isinstance(value, bool))
    if bools:  # pydantic's lax mode would read true as 1
        raise ValueError(f"--override-generation-config: {', '.join(bools)} must be a number, not true/false")
    return {
        name: None
        if value is None
        else _checked(name, value, "--override-generation-config", "pass a value in that range")
        for name, value in data.items()
    }


def merge(defaults: SamplingDefaults, override: Override) -> SamplingDefaults:
    """``defaults`` with ``override``'s fields set over them (a None value drops that field's default)."""
    values: dict[str, Any] = defaults.as_dict()
    for name, value in override.items():
        field = _FIELDS[name][0]
        if value is None:
            values.pop(field, None)
        else:
            values[field] = value
    return SamplingDefaults(**values)


def check_flag(value: str) -> None:
    """Refuse a ``--generation-config`` value that is neither ``auto``, ``vllm`` nor a folder holding a
    ``generation_config.json`` (before the model loads).

    Raises:
        ValueError: names the value and what is accepted.
    """
    if value in (AUTO, VLLM):
        return
    folder = Path(value)
    if not folder.is_dir():
        raise ValueError(
            f"--generation-config {value!r}: not a folder (expected auto, vllm or a folder holding "
            "generation_config.json)"
        )
    if not (folder / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {value!r}: the folder holds no generation_config.json")


def resolve(
    value: str, engine: object, model_path: str | None = None, override: Override | None = None
) -> SamplingDefaults:
    """The sampling defaults ``--generation-config value`` gives the served ``engine``, with
    ``--override-generation-config``'s fields (:func:`parse_override`) set over them (:func:`merge`).

    ``auto`` reads the engine's ``model.generation_config`` (what transformers loaded with the weights);
    an engine without one falls back to ``model_path``'s ``generation_config.json`` when that is a local
    folder holding one, and to no defaults otherwise.

    Raises:
        ValueError / OSError: a bad folder or generation config (see :func:`check_flag`, :func:`defaults_from`).
    """
    return merge(_source_defaults(value, engine, model_path), override or {})


def _warn_if_unreadable(model_path: str | None) -> None:
    """Say so when the model folder's ``generation_config.json`` is not JSON: transformers (and vLLM) then
    fall back to the model config without a word, dropping its sampling defaults and its eos ids."""
    if not model_path:
        return
    path = Path(model_path).expanduser() / "generation_config.json"
    if not path.is_file():
        return
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning(
            "%s is not valid JSON (%s): its sampling defaults and end-of-sequence ids are ignored; fix or "
            "remove it",
            path,
            exc,
        )


def _source_defaults(value: str, engine: object, model_path: str | None) -> SamplingDefaults:
    if value == VLLM:
        return NO_DEFAULTS
    from transformers import GenerationConfig

    if value != AUTO:
        check_flag(value)
        return defaults_from(GenerationConfig.from_pretrained(value, local_files_only=True), value)
    _warn_if_unreadable(model_path)
    generation_config = getattr(getattr(engine, "model", None), "generation_config", None)
    source = "the model's generation config"
    if generation_config is None and model_path and (Path(model_path) / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(model_path, local_files_only=True)
        source = f"{model_path}/generation_config.json"
    return defaults_from(generation_config, source)
