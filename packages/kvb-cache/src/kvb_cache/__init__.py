"""kvb-cache: content-addressed, chunk-level KV reuse for Hugging Face causal LMs."""

from kvb_cache._version import __version__
from kvb_cache.config import EngineConfig
from kvb_cache.core.outputs import PagedStats, RequestId, RequestOutput
from kvb_cache.decoding import SpeculativeDecoder, TokenProcessor
from kvb_cache.engine import KVBoost
from kvb_cache.engine_args import EngineArgs
from kvb_cache.errors import (
    CacheBusyError,
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    KVBoostError,
    ModelLoadError,
    NonFiniteLogitsError,
    PromptTypeError,
    RequestAbortedError,
    RequestInterruptedError,
    UnknownOptionError,
    UnsupportedModelError,
)
from kvb_cache.paged_engine import CPUPagedEngine
from kvb_cache.request_stream import RequestStream
from kvb_cache.results import ChunkHit, GenerationResult, HitKind, StreamEvent, TokenLogprob, WarmResult
from kvb_cache.sampling import SamplingParams
from kvb_cache.stitch_config import RecomputeStrategy, StitchConfig
from kvb_cache.tiers import TierConfig

__all__ = [
    "CPUPagedEngine",
    "CacheBusyError",
    "ChunkHit",
    "ConfigError",
    "ContextLengthError",
    "EngineArgs",
    "EngineConfig",
    "GenerationResult",
    "HitKind",
    "InvalidRequestError",
    "KVBoost",
    "KVBoostError",
    "ModelLoadError",
    "NonFiniteLogitsError",
    "PagedStats",
    "PromptTypeError",
    "RecomputeStrategy",
    "RequestAbortedError",
    "RequestId",
    "RequestInterruptedError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SpeculativeDecoder",
    "StitchConfig",
    "StreamEvent",
    "TierConfig",
    "TokenLogprob",
    "TokenProcessor",
    "UnknownOptionError",
    "UnsupportedModelError",
    "WarmResult",
    "__version__",
]
