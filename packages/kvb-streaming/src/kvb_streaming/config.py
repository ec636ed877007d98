"""What to keep on the device, what to stream, and how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kvb_streaming.errors import StreamingConfigError

ResidencyMode = Literal["full_resident", "partial_resident", "ffn_only_stream", "full_stream"]
QuantKernelName = Literal["auto", "torch", "int4pack", "kvb_kernels"]

MiB = 1 << 20

RESIDENCY_MODES: tuple[str, ...] = get_args(ResidencyMode)
QUANT_KERNELS: tuple[str, ...] = get_args(QuantKernelName)
_MODES_WITH_KEEP = ("partial_resident", "ffn_only_stream")


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamingConfig:
    """How a quantized model's decoder layers are split between device memory and pinned host memory.

    Attributes:
        residency_mode: ``"full_resident"`` puts every weight on the device (no streaming);
            ``"partial_resident"`` keeps the first ``keep_first_k`` and last ``keep_last_k`` decoder layers on
            the device and streams the others whole; ``"ffn_only_stream"`` keeps every attention block on the
            device and streams the MLP weights of the layers outside the kept ranges (MLPs are ~2/3 of the
            bytes, attention stays latency-free); ``"full_stream"`` streams every decoder layer.
            Embeddings, norms, biases and the LM head are always resident.
        keep_first_k: leading decoder layers kept fully resident (``partial_resident`` / ``ffn_only_stream``).
        keep_last_k: trailing decoder layers kept fully resident (``partial_resident`` / ``ffn_only_stream``).
        n_staging_slots: device buffers that streamed layers are copied into. 2 lets the next layer copy
            while the current one computes; more slots prefetch further ahead (useful when copy time jitters).
        quant_kernel: int4 GEMM backend: ``"torch"`` (chunked dequantize + matmul, runs everywhere),
            ``"int4pack"`` (torch's ``_weight_int4pack_mm``; CPU, or CUDA sm80+ in bf16),
            ``"kvb_kernels"`` (Triton kernel from the optional ``kvb-kernels`` distribution) or ``"auto"``
            (the fastest one available for the device and dtype).
        dequant_chunk_bytes: peak bytes of dequantized weight the ``"torch"`` kernel materializes at once.
        pin_memory: pin streamed layers in host memory (needed for asynchronous DMA). Pinning that fails
            (memlock limits) falls back to pageable memory with a warning.
        simulate_on_host: run the streaming machinery even when the device *is* host memory (CPU) or
            shares it (MPS). It brings no speed there; it exists for tests and debugging. When False,
            streaming is disabled on such devices and every layer is loaded resident.
    """

    residency_mode: ResidencyMode = "full_stream"
    keep_first_k: int = 0
    keep_last_k: int = 0
    n_staging_slots: int = 2
    quant_kernel: QuantKernelName = "auto"
    dequant_chunk_bytes: int = 32 * MiB
    pin_memory: bool = True
    simulate_on_host: bool = False

    def __post_init__(self) -> None:
        if self.residency_mode not in RESIDENCY_MODES:
            raise StreamingConfigError(
                f"residency_mode must be one of {RESIDENCY_MODES}, got {self.residency_mode!r}"
            )
        for name in ("keep_first_k", "keep_last_k"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise StreamingConfigError(f"{name} must be a non-negative int (layers), got {value!r}")
            if value and self.residency_mode not in _MODES_WITH_KEEP:
                raise StreamingConfigError(
                    f"{name}={value} has no effect with residency_mode={self.residency_mode!r}; set it to 0 "
                    f"or use residency_mode='partial_resident' (or 'ffn_only_stream')"
                )
        if not _is_int(self.n_staging_slots) or self.n_staging_slots < 1:
            raise StreamingConfigError(
                f"n_staging_slots must be an int >= 1 (2 overlaps copy and compute), got {self.n_staging_slots!r}"
            )
        if self.quant_kernel not in QUANT_KERNELS:
            raise StreamingConfigError(
                f"quant_kernel must be one of {QUANT_KERNELS}, got {self.quant_kernel!r}"
            )
        if not _is_int(self.dequant_chunk_bytes) or self.dequant_chunk_bytes < 1 * MiB:
            raise StreamingConfigError(
                f"dequant_chunk_bytes must be an int >= 1 MiB ({MiB}), got {self.dequant_chunk_bytes!r}"
            )
        for name in ("pin_memory", "simulate_on_host"):
            if not isinstance(getattr(self, name), bool):
                raise StreamingConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
