"""The keyword a model's forward takes its ``Cache`` under, across transformers 5.x.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name is deprecated until 5.40 and warns
on every call); 5.0-5.23 know only ``past_key_values``. Callers pass ``**cache_kwargs(module, cache)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing

import torch
from transformers import Cache


@functools.cache
def _name_for(forward_type: type) -> str | None:
    # NOTE: keyed by the module's class (its forward's signature is the class's), so the signature is read
    # once per architecture, not per call.
    params = inspect.signature(forward_type.forward).parameters
    if "cache" in params:
        # 5.24 also renamed recurrent models' own state (xLSTM's ``cache_params``) to ``cache``, annotated
        # with their own class: only a forward that takes any transformers Cache takes our KV.
        return "cache" if _takes_any_cache(params["cache"].annotation) else None
    if "past_key_values" in params:
        return "past_key_values"
    return None


def _takes_any_cache(annotation: object) -> bool:
    if annotation is inspect.Parameter.empty:
        return True
    if isinstance(annotation, str):  # postponed annotations: "Cache | None"
        return re.search(r"\bCache\b", annotation) is not None
    return annotation is Cache or any(_takes_any_cache(arg) for arg in typing.get_args(annotation))


def cache_argument(module: torch.nn.Module) -> str | None:
    """``"cache"`` (transformers >= 5.24) or ``"past_key_values"``; None when the forward takes neither (a
    model that keeps no transformers Cache: a recurrent state of its own, or no cache at all)."""
    return _name_for(type(module))


def cache_kwargs(module: torch.nn.Module, cache: Cache | None) -> dict[str, Cache | None]:
    """``{name: cache}`` for ``module(**..., **cache_kwargs(module, cache))``."""
    return {cache_argument(module) or "past_key_values": cache}


def output_cache(output: object) -> Cache | None:
    """The ``Cache`` a forward or ``generate`` returned: ``output.cache`` on transformers >= 5.24, else
    ``output.past_key_values`` (reading the old name on 5.24 logs a deprecation warning)."""
    names = (
        {field.name for field in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    )
    return getattr(output, "cache" if "cache" in names else "past_key_values", None)
