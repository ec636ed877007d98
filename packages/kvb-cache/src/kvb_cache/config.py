"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from kvb_cache.errors import ConfigError

GiB = 1 << 30
#: Default byte budget of the in-memory chunk store.
DEFAULT_MAX_CACHE_BYTES = 2 * GiB


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How the engine chunks, stores and reuses KV.

    Attributes:
        chunk_size: tokens per cached chunk. Smaller chunks reuse more of a diverging prompt but cost
            more lookups and more small tensor copies; 128 is a good default for chat and RAG.
        boundary_window: let a cut slide up to this many tokens either way to a natural break
            (newline, sentence end). 0 keeps fixed-size chunks. Cuts depend only on the token ids, so the
            same prefix always cuts the same way.
        max_cache_bytes: byte budget of the in-memory chunk store (KV tensors only).
        store_outputs: also store chunks of generated text (their KV already exists after decoding), so
            the next chat turn hits without ``warm()``.
        store_partial_tail: store the last, partial chunk of a request too, so the next request can reuse
            it token by token (radix-style) instead of recomputing up to ``chunk_size - 1`` tokens.
    """

    chunk_size: int = 128
    boundary_window: int = 0
    max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES
    store_outputs: bool = True
    store_partial_tail: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive int (e.g. 128), got {self.chunk_size!r}")
        if not isinstance(self.boundary_window, int) or not 0 <= self.boundary_window < self.chunk_size // 2 + 1:
            raise ConfigError(
                f"boundary_window must be an int in [0, chunk_size // 2] = [0, {self.chunk_size // 2}], "
                f"got {self.boundary_window!r}"
            )
        if not isinstance(self.max_cache_bytes, int) or self.max_cache_bytes < 0:
            raise ConfigError(f"max_cache_bytes must be a non-negative int of bytes, got {self.max_cache_bytes!r}")
