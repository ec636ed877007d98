"""Run AWQ int4 causal LMs larger than device memory by streaming layer weights from pinned host RAM."""

from kvb_streaming._version import __version__
from kvb_streaming.awq_format import AWQ_ORDER, AWQTensors, dequantize, pack_int4, quantize, unpack_int4
from kvb_streaming.config import QuantKernelName, ResidencyMode, StreamingConfig
from kvb_streaming.errors import (
    AWQFormatError,
    KernelUnavailableError,
    NotAStreamingModelError,
    SaveUnsupportedError,
    StreamingConfigError,
    StreamingError,
    WeightsNotStagedError,
)
from kvb_streaming.loader import AWQLoader, AWQQuantConfig
from kvb_streaming.model import StreamingCausalLM, StreamingRuntime, get_runtime
from kvb_streaming.qlinear import StreamingQLinear
from kvb_streaming.scheduler import StreamingScheduler, StreamingStats

__all__ = [
    "AWQ_ORDER",
    "AWQFormatError",
    "AWQLoader",
    "AWQQuantConfig",
    "AWQTensors",
    "KernelUnavailableError",
    "NotAStreamingModelError",
    "QuantKernelName",
    "ResidencyMode",
    "SaveUnsupportedError",
    "StreamingCausalLM",
    "StreamingConfig",
    "StreamingConfigError",
    "StreamingError",
    "StreamingQLinear",
    "StreamingRuntime",
    "StreamingScheduler",
    "StreamingStats",
    "WeightsNotStagedError",
    "__version__",
    "dequantize",
    "get_runtime",
    "pack_int4",
    "quantize",
    "unpack_int4",
]
