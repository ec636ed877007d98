"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvb_cache.core.kv_dtype import check_kv_cache_dtype
from kvb_cache.core.pool_kernel import check_backend
from kvb_cache.errors import ConfigError
from kvb_cache.stitch_config import StitchConfig

if TYPE_CHECKING:
    from kvb_cache.tiers.config import TierConfig


GiB = 1 << 30
#: Default byte budget of the in-memory chunk store.
DEFAULT_MAX_CACHE_BYTES = 2 * GiB

#: ``chunk_size`` when it is not given: exact prefix reuse works at the pool's block granularity whatever the
#: chunk size, so large chunks keep the chunk store and tier records few.
DEFAULT_CHUNK_SIZE = 128
#: ``chunk_size`` when it is not given and stitching is on: a document is stitched only in whole stored
#: chunks, so a 128-token chunk rarely fits inside a RAG passage of 100-250 tokens (it straddles the
#: neighbouring document, whose order changes). 32 is the size every stitching figure in docs/fidelity.md was
#: measured with; three 90-token documents reordered through the server: 78% of the prompt reused at 32,
#: 5% at 128; over a 16-request replay of 300-token documents each request computes 34% of its prompt at 32,
#: 55% at 128 (docs/fidelity.md, "Chunk size over a stream of requests").
STITCHING_CHUNK_SIZE = 32


#: Quantization group of ``kv_cache_bits`` 8/4 when none is given.
DEFAULT_KV_GROUP_SIZE = 32


#: vLLM's ``--scheduling-policy`` values (:attr:`EngineConfig.scheduling_policy`).
SCHEDULING_POLICIES = ("fcfs", "priority")
#: EngineConfig fields that are True or False only.
_FLAGS = ("store_outputs", "store_partial_tail", "enforce_eager")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How the engine chunks, stores and reuses KV.

    Attributes:
        chunk_size: tokens per cached chunk (the unit of the chunk store, the disk/Redis records and
            stitching's lookups). None: ``DEFAULT_CHUNK_SIZE`` (128), or ``STITCHING_CHUNK_SIZE`` (32) when
            ``stitching`` is on, since a document is only stitched in whole chunks. Smaller chunks reuse
            more of a reordered prompt but cost more lookups and more small tensor copies.
        boundary_window: let a cut slide up to this many tokens either way to a natural break
            (newline, sentence end). 0 keeps fixed-size chunks. Cuts depend only on the token ids, so the
            same prefix always cuts the same way.
        max_cache_bytes: byte budget of the in-memory chunk store (KV tensors only).
        store_outputs: also store chunks of generated text (their KV already exists after decoding), so
            the next chat turn hits without ``warm()``.
        store_partial_tail: store the last, partial chunk of a request too, so the next request can reuse
            it token by token (radix-style) instead of recomputing up to ``chunk_size - 1`` tokens.
        stitching: reuse cached chunks seen after a *different* history too (approximate, re-positioned and
            seam-repaired; :class:`kvb_cache.StitchConfig`). None: exact prefix reuse only.
        kv_cache_bits: precision of the records in the disk/Redis tiers: 16 keeps KV as computed (exact
            reuse); 8 or 4 store it KIVI-quantized (per-block records 0.63x / 0.38x the bytes of fp16 KV at
            group 32, header included; approximate reuse, measured in docs/tiers.md). The RAM block pool holds KV in ``kv_cache_dtype``
            (its blocks are shared by running requests); a request's own ``kv_cache_bits`` quantizes its
            live KV instead.
        kv_group_size: quantization group of ``kv_cache_bits`` 8/4 (tokens per key group, channels per value
            group).
        kv_cache_dtype: precision the paged pool holds KV in (vLLM's ``kv_cache_dtype``): ``"auto"`` (the
            model's), ``"bfloat16"``, ``"float16"``, ``"fp8"`` (= ``"fp8_e4m3"``) or ``"fp8_e5m2"``
            (:mod:`kvb_cache.core.kv_dtype`). Every request attends its KV in that precision, its own prompt
            included, so exact prefix reuse equals the same engine without reuse; against KV as computed it
            is approximate (docs/kv_cache_dtype.md).
        tiers: disk and Redis tiers below RAM (:class:`kvb_cache.tiers.TierConfig`); None: RAM only.
        block_size: tokens per KV block of the paged pool (the unit of prefix sharing between requests).
        num_blocks: blocks in the pool; None derives it from ``max_cache_bytes`` (the pool *is* the RAM
            cache: running requests' KV and cached prefixes share it).
        max_num_seqs: most requests decoded together in one step (as asked; the engine runs at most
            :attr:`running_seqs`, since each running request decodes one token a step).
        max_num_batched_tokens: most tokens (prefill + decode) one step feeds the model; long prompts are
            prefilled in slices of at most this size, interleaved with the running requests' decode.
        prefill_chunk_size: default per-request prefill slice (a request's own value overrides it); None:
            bounded only by ``max_num_batched_tokens``.
        max_model_len: most prompt + generated tokens one request may take, below the model's context
            (vLLM's ``max_model_len``); None: the model's context. Above it is a :class:`ConfigError`.
        attention_backend: the engine loop's attention over the pool: ``"kvb_kernels"`` (kvb-kernels'
            block-table kernel reads the blocks in place; CUDA), ``"sdpa"`` (each context gathered, then
            torch SDPA), ``"auto"`` (the kernel on CUDA when kvb-kernels is installed with Triton, else SDPA).
        enforce_eager: run every step eagerly (vLLM's). False: on CUDA, decode-only steps replay CUDA graphs
            (:mod:`kvb_cache.core.decode_graphs`); steps with a prefill, and every step off CUDA, run eagerly.
        scheduling_policy: ``"fcfs"`` (arrival order, longest cached prefix first among waiting requests)
            or ``"priority"`` (vLLM's: a request's ``priority``, lower first, then arrival; the running
            request of the lowest priority is preempted first). Only ``"priority"`` takes ``priority != 0``.
    """

    chunk_size: int | None = None
    boundary_window: int = 0
    max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES
    store_outputs: bool = True
    store_partial_tail: bool = True
    stitching: StitchConfig | None = None
    kv_cache_bits: int = 16
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    kv_cache_dtype: str = "auto"
    tiers: TierConfig | None = None
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    prefill_chunk_size: int | None = None
    max_model_len: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    scheduling_policy: str = "fcfs"

    @property
    def running_seqs(self) -> int:
        """Most requests running at once: ``max_num_seqs``, but no more than ``max_num_batched_tokens`` (every
        running request decodes a token per step: admitted beyond the budget, the last ones held KV blocks and
        got no token until the first finished; vLLM refuses the combination). The scheduler, CUDA-graph
        capture, memory profiling and step limits all read this; the build warns once when it is lower."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.chunk_size is None:
            # Frozen: resolved once here, so every reader sees the int (and dataclasses.replace keeps it).
            size = DEFAULT_CHUNK_SIZE if self.stitching is None else STITCHING_CHUNK_SIZE
            object.__setattr__(self, "chunk_size", size)
        check_backend(self.attention_backend)
        check_kv_cache_dtype(self.kv_cache_dtype)
        for flag in _FLAGS:  # "false" is truthy and None falsy: both were taken silently
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.prefill_chunk_size is not None and (
            isinstance(self.prefill_chunk_size, bool)
            or not isinstance(self.prefill_chunk_size, int)
            or self.prefill_chunk_size < 1
        ):
            raise ConfigError(
                f"prefill_chunk_size must be a positive int or None, got {self.prefill_chunk_size!r}"
            )
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool)
            or not isinstance(self.max_model_len, int)
            or self.max_model_len < 2
        ):
            # 2: a prompt of one token and one new token; vLLM's smallest useful value too.
            raise ConfigError(
                f"max_model_len must be an int >= 2 or None (the model's context), got {self.max_model_len!r}"
            )
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 2
        ):
            raise ConfigError(
                f"num_blocks must be an int >= 2 or None (derived from max_cache_bytes), got {self.num_blocks!r}"
            )
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive int (e.g. 128), got {self.chunk_size!r}")
        if (
            isinstance(self.boundary_window, bool)
            or not isinstance(self.boundary_window, int)
            or not 0 <= self.boundary_window < self.chunk_size // 2 + 1
        ):
            raise ConfigError(
                f"boundary_window must be an int in [0, chunk_size // 2] = [0, {self.chunk_size // 2}], "
                f"got {self.boundary_window!r}"
            )
        if (
            isinstance(self.max_cache_bytes, bool)
            or not isinstance(self.max_cache_bytes, int)
            or self.max_cache_bytes < 0
        ):
            raise ConfigError(
                f"max_cache_bytes must be a non-negative int of bytes, got {self.max_cache_bytes!r}"
            )
        if self.stitching is not None and not isinstance(self.stitching, StitchConfig):
            raise ConfigError(
                f"stitching must be a StitchConfig or None, got {type(self.stitching).__name__}"
            )
        # An int, not merely equal to one: 8.0 passed "in (16, 8, 4)" and then failed every tier write.
        bits = self.kv_cache_bits
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (16, 8, 4):
            raise ConfigError(f"kv_cache_bits must be 16 (exact), 8 or 4 (quantized), got {bits!r}")
        group = self.kv_group_size
        if isinstance(group, bool) or not isinstance(group, int) or group < 2:
            raise ConfigError(f"kv_group_size must be an int >= 2 (32 or 128 are typical), got {group!r}")
        if bits == 4 and group % 2:
            # 4-bit codes are packed two per byte within a group: an odd group failed every write.
            raise ConfigError(f"kv_group_size must be even with kv_cache_bits=4, got {group}")
        from kvb_cache.tiers.config import TierConfig  # deferred: kvb_cache.tiers imports this module

        if self.tiers is not None and not isinstance(self.tiers, TierConfig):
            raise ConfigError(
                f"tiers must be a kvb_cache.tiers.TierConfig or None, got {type(self.tiers).__name__}"
            )
        # Both were accepted and silently did nothing; "--kv-cache-bits 8" reads like vLLM's
        # --kv-cache-dtype (smaller live KV), which is a per-request kv_cache_bits here.
        if bits != 16 and (self.tiers is None or not self.tiers.enabled):
            raise ConfigError(
                f"kv_cache_bits={bits} quantizes disk/Redis records only, and no tier is configured: add "
                "tiers=TierConfig(disk_cache_dir=... or remote_url=...) (from_pretrained and the CLI: "
                "disk_cache_dir / --disk-cache-dir, remote_url / --remote-url), or drop it (a request's own "
                "kv_cache_bits quantizes its live KV)"
            )
        if self.max_cache_bytes == 0 and self.tiers is not None and self.tiers.enabled:
            # Accepted before and silently wrote nothing: with reuse off nothing is stored, so no tier is read.
            raise ConfigError(
                "max_cache_bytes=0 turns reuse off, so a disk/Redis tier would never be written or read: raise "
                "max_cache_bytes (--max-cache-bytes) or drop the tier (disk_cache_dir / remote_url, --disk-cache-dir / "
                "--remote-url)"
            )
        if bits == 16 and group != DEFAULT_KV_GROUP_SIZE:
            raise ConfigError(
                f"kv_group_size={group} has no effect with kv_cache_bits=16: add kv_cache_bits 8 or 4 "
                "(--kv-cache-bits), or drop it"
            )
