"""KVBoost: chunk-level KV-cache reuse for Hugging Face causal LMs (meta-package: re-exports only)."""

from kvb_cache import (
    ChunkHit,
    ConfigError,
    ContextLengthError,
    CPUPagedEngine,
    EngineConfig,
    GenerationResult,
    HitKind,
    InvalidRequestError,
    KVBoostError,
    ModelLoadError,
    PagedStats,
    PromptTypeError,
    RequestOutput,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
    UnsupportedModelError,
    WarmResult,
)
from kvboost._version import __version__
from kvboost.compose import KVBoost

__all__ = [
    "CPUPagedEngine",
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
    "PagedStats",
    "PromptTypeError",
    "RequestOutput",
    "SamplingParams",
    "StreamEvent",
    "TokenLogprob",
    "UnsupportedModelError",
    "WarmResult",
    "__version__",
]
