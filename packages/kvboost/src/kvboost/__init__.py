"""KVBoost: chunk-level KV-cache reuse for Hugging Face causal LMs (meta-package: re-exports only)."""

from kvb_cache import (
    ChunkHit,
    ConfigError,
    ContextLengthError,
    EngineConfig,
    GenerationResult,
    HitKind,
    InvalidRequestError,
    KVBoostError,
    ModelLoadError,
    PromptTypeError,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
    UnsupportedModelError,
    WarmResult,
)
from kvboost._version import __version__
from kvboost.compose import KVBoost

__all__ = [
    "ChunkHit",
    "ConfigError",
    "ContextLengthError",
    "EngineConfig",
    "GenerationResult",
    "HitKind",
    "InvalidRequestError",
    "KVBoost",
    "KVBoostError",
    "ModelLoadError",
    "PromptTypeError",
    "SamplingParams",
    "StreamEvent",
    "TokenLogprob",
    "UnsupportedModelError",
    "WarmResult",
    "__version__",
]
