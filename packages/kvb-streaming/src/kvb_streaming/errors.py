"""The exceptions kvb-streaming raises. Every one derives from :class:`StreamingError`.

User mistakes also subclass the matching builtin (``ValueError``, ``ImportError``, ...) so callers that only
know the builtins still catch them; each message says what to change.
"""

from __future__ import annotations


class StreamingError(Exception):
    """Base class of every error raised by kvb-streaming."""


class StreamingConfigError(StreamingError, ValueError):
    """A :class:`~kvb_streaming.config.StreamingConfig` value is invalid or does not fit the model."""


class AWQFormatError(StreamingError, ValueError):
    """A checkpoint or tensor is not in the AWQ GEMM int4 format this package reads."""


class KernelUnavailableError(StreamingError, ImportError):
    """The requested int4 GEMM backend cannot run here (missing package, device or dtype)."""


class WeightsNotStagedError(StreamingError, RuntimeError):
    """A streamed linear layer ran while its weights were not in a staging slot.

    This means the layer was called outside the decoder layer's forward (the hooks that stage it), e.g.
    by calling ``layer.mlp`` directly. Call the whole model, or load with ``residency_mode="full_resident"``.
    """


class NotAStreamingModelError(StreamingError, TypeError):
    """The model was not loaded by :meth:`kvb_streaming.StreamingCausalLM.from_pretrained`."""


class SaveUnsupportedError(StreamingError, NotImplementedError):
    """``save_pretrained`` / ``push_to_hub`` on a model loaded by
    :meth:`kvb_streaming.StreamingCausalLM.from_pretrained`: its int4 linears are not the architecture's
    ``nn.Linear`` weights, so what transformers would write loads back with those weights random."""
