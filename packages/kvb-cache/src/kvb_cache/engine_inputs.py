"""What ``KVBoost(model, tokenizer, config=...)`` is given, checked before anything is built.

Common slips (a model name where a model belongs, ``config=EngineArgs(...)``, a tokenizer path, a base model
without a language-modelling head, a skeleton on the meta device) ended in a bare ``AttributeError`` or
``TypeError`` from deep inside the engine, or, for ``tokenizer=None``, only after a forward had run. Each is
now a typed error that names the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from kvb_cache.config import EngineConfig
from kvb_cache.engine_args import EngineArgs
from kvb_cache.errors import ConfigError, ModelLoadError, UnsupportedModelError

#: Class-name endings of transformers' heads that produce next-token logits.
_LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def check_engine_inputs(model: Any, tokenizer: Any, config: Any) -> None:
    """Raise a typed error naming the fix when ``model``, ``tokenizer`` or ``config`` cannot be what the
    engine needs.

    Raises:
        ConfigError: ``model`` is not a ``torch.nn.Module`` (a name or path: use ``KVBoost.from_pretrained``),
            ``tokenizer`` is not a tokenizer object, or ``config`` is not an :class:`EngineConfig`.
        UnsupportedModelError: a base model without a language-modelling head (``LlamaModel``).
        ModelLoadError: the model's weights are on the meta device (never loaded).
    """
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        raise ConfigError(
            f"KVBoost(model, tokenizer) takes a loaded model, got the name {model!r}: "
            "use KVBoost.from_pretrained(name_or_path) to load one"
        )
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"KVBoost(model, tokenizer) takes a transformers causal LM (a torch.nn.Module), got "
            f"{type(model).__name__}: load one with AutoModelForCausalLM.from_pretrained(...) or use "
            "KVBoost.from_pretrained(name_or_path)"
        )
    name = type(model).__name__
    heads = getattr(model, "get_output_embeddings", None)
    if not name.endswith(_LM_HEADS) and callable(heads) and heads() is None:
        raise UnsupportedModelError(
            f"{name} has no language-modelling head (it returns hidden states, not next-token logits): load "
            "the model with AutoModelForCausalLM.from_pretrained(...) instead of AutoModel"
        )
    if any(p.is_meta for p in model.parameters()):
        raise ModelLoadError(
            f"{name}'s weights are on the meta device (never loaded: a skeleton from init_empty_weights or "
            "device_map='meta'): load the weights, e.g. AutoModelForCausalLM.from_pretrained(path)"
        )
    if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
        raise ConfigError(
            f"KVBoost(model, tokenizer) takes a tokenizer object, got the path {tokenizer!r}: pass "
            "AutoTokenizer.from_pretrained(path)"
        )
    if not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise ConfigError(
            f"KVBoost(model, tokenizer) needs the model's tokenizer (callable, with decode), got "
            f"{type(tokenizer).__name__}: pass AutoTokenizer.from_pretrained(path)"
        )
    if config is not None and not isinstance(config, EngineConfig):
        if isinstance(config, EngineArgs):
            fix = "pass config=args.engine_config()"
        elif isinstance(config, dict):
            fix = "pass config=EngineConfig(**options)"
        else:
            fix = "pass an EngineConfig"
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}: {fix}")
