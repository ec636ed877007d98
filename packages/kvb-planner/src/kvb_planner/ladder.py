"""The ladder of (prefill chunk size, KV bits) settings the planner walks, cheapest first."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvb_planner.errors import PlannerConfigError

#: KV cache precisions an engine may be asked for: 16 = the model's own dtype (no quantization).
SUPPORTED_KV_BITS = (16, 8, 4)
DEFAULT_CHUNK_SIZES = (2048, 1024, 512, 256, 128)


@dataclass(frozen=True, slots=True, kw_only=True)
class LadderStep:
    """One per-request engine setting.

    Attributes:
        prefill_chunk_size: Prompt tokens per prefill forward; ``None`` = the whole prompt in one forward.
        kv_bits: KV cache precision, one of 16 (model dtype), 8 or 4.
    """

    prefill_chunk_size: int | None
    kv_bits: int = 16

    def __post_init__(self) -> None:
        chunk = self.prefill_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise PlannerConfigError(
                f"prefill_chunk_size must be an int >= 1 or None for single-shot prefill (got {chunk!r})"
            )
        if self.kv_bits not in SUPPORTED_KV_BITS:
            raise PlannerConfigError(f"kv_bits must be one of {SUPPORTED_KV_BITS} (got {self.kv_bits})")

    def slice_tokens(self, prompt_tokens: int) -> int:
        """Tokens in the largest prefill slice for a prompt of ``prompt_tokens``."""
        if self.prefill_chunk_size is None:
            return prompt_tokens
        return min(self.prefill_chunk_size, prompt_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ladder:
    """Settings in preference order: the planner returns the first that fits.

    The default puts every chunk size at full precision before any quantized step, because chunked
    prefill is exact (same logits, only slower) while a quantized KV cache changes the outputs.
    """

    steps: tuple[LadderStep, ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise PlannerConfigError(
                "a Ladder needs at least one step, e.g. LadderStep(prefill_chunk_size=None)"
            )
        if len(set(self.steps)) != len(self.steps):
            raise PlannerConfigError("Ladder steps must be distinct; remove the repeated step")

    @classmethod
    def default(
        cls, *, chunk_sizes: Iterable[int] = DEFAULT_CHUNK_SIZES, kv_bits: Iterable[int] = SUPPORTED_KV_BITS
    ) -> Ladder:
        """``for bits in kv_bits: [single shot, *chunk_sizes]`` — pass ``kv_bits=(16,)`` for an engine
        without KV quantization. Chunk sizes are tried in the order given (largest first is fastest)."""
        sizes: list[int | None] = [None, *chunk_sizes]
        return cls(steps=tuple(LadderStep(prefill_chunk_size=c, kv_bits=b) for b in kv_bits for c in sizes))
