"""``EngineArgs``: every engine option, declared once (in the spirit of vLLM's ``EngineArgs``).

:meth:`kvb_cache.KVBoost.from_pretrained`'s keywords, :class:`kvb_cache.EngineConfig` (through
:meth:`EngineArgs.engine_config`) and ``kvboost-server``'s engine flags (through
:func:`kvb_cache.options.add_option_arguments`) all come from the fields below; tests fail when a signature
or the parser disagrees with them. Options of the optional distributions (speculative decoding, layer
streaming, ...) are declared by the meta-package ``kvboost`` in groups of their own, so this hub imports
no sibling.
"""

# option() returns a dataclasses.field (with metadata), which RUF009 cannot tell from a shared default.
# ruff: noqa: RUF009

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, get_args

from kvb_cache.config import DEFAULT_MAX_CACHE_BYTES, SCHEDULING_POLICIES, EngineConfig
from kvb_cache.core.kv_dtype import KV_CACHE_DTYPES
from kvb_cache.core.pool_kernel import ATTENTION_BACKENDS
from kvb_cache.errors import ConfigError
from kvb_cache.gpu_budget import check_utilization
from kvb_cache.options import block_count, model_len, option, parse_bytes, positive_int
from kvb_cache.stitch_config import RecomputeStrategy, StitchConfig
from kvb_cache.tiers.config import DEFAULT_DISK_CACHE_BYTES, DEFAULT_REMOTE_TIMEOUT_S, TierConfig

if TYPE_CHECKING:
    import torch

    from kvb_cache.decoding import SpeculativeDecoder

#: ``auto`` (the checkpoint's, as when unset) and ``half`` are vLLM's spellings: ``--dtype auto`` is in most
#: vLLM command lines and was an "invalid choice" here.
#: vLLM's ``--dtype`` values ("float" is float32, "half" float16).
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
RECOMPUTE_STRATEGIES: tuple[str, ...] = get_args(RecomputeStrategy)


def check_seed(seed: object) -> None:
    """Refuse a ``seed`` that :func:`torch.manual_seed` would not take (it takes 64 bits, negative ones
    wrapped; anything wider raised a bare RuntimeError after the model had loaded).

    Raises:
        ConfigError: ``seed`` is neither None nor such an int.
    """
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64
    ):
        raise ConfigError(f"seed must be an int in [-2**63, 2**64) or None (not seeded), got {seed!r}")


def seed_torch(seed: int | None) -> None:
    """Seed torch's global generators (the CPU one and every CUDA device's) as vLLM's ``--seed`` does;
    None leaves them alone. Sampling without a request seed draws from them."""
    if seed is not None:
        import torch

        torch.manual_seed(seed)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """What :meth:`kvb_cache.KVBoost.from_pretrained` takes besides the model (each field's help is its doc).

    The values are validated where they are used (:class:`EngineConfig`, :class:`TierConfig`, the loader),
    so a bad value raises the same :class:`kvb_cache.ConfigError` whichever way it came in.
    """

    # -- model ---------------------------------------------------------------------------------------------
    device: str | torch.device | None = option(
        None, group="model", help="cpu, cuda, cuda:1 ...; unset: CUDA when available"
    )
    dtype: str | torch.dtype | None = option(
        None,
        group="model",
        choices=DTYPES,
        help="weights and KV dtype (half: float16); unset or auto: the checkpoint's (with awq_streaming: fp16 on "
        "CUDA, fp32 on CPU)",
    )
    attn_implementation: str | None = option(
        None,
        group="model",
        metavar="NAME",
        help="transformers attention for plain forwards: sdpa, eager, or kvb_attention (kvb-kernels' Triton "
        "kernels, installed with kvb-kernels' triton extra); the paged engine loop runs its own attention over the block pool",
    )
    attention_backend: str = option(
        "auto",
        group="model",
        choices=ATTENTION_BACKENDS,
        help="the engine loop's attention over the block pool: kvb_kernels reads the blocks in place with "
        "kvb-kernels' Triton paged kernel (CUDA; kvb-kernels with its triton extra), sdpa gathers each request's "
        "context and runs torch SDPA; auto: kvb_kernels on CUDA in fp16/bf16 when installed, else sdpa. Soft-capped, "
        "attention-sink and chunked-attention layers always use sdpa",
    )
    enforce_eager: bool = option(
        False,
        group="model",
        help="run every step eagerly (vLLM's): no CUDA graphs. By default on CUDA a decode-only step is "
        "padded to a batch/context bucket and replayed from a CUDA graph captured at the bucket's first step; "
        "steps with a prefill always run eagerly",
    )
    max_model_len: int | None = option(
        None,
        group="model",
        parse=model_len,
        metavar="TOKENS",
        help="most prompt + generated tokens one request may take, below the model's context (vLLM's; "
        "also 32k / 32K, k=1000 and K=1024, and -1 or auto for unset); unset: the model's context "
        "(reported as max_model_len)",
    )
    tokenizer: str | None = option(
        None,
        group="model",
        metavar="PATH",
        help="the tokenizer's folder or hub id (in the local Hugging Face cache) when it is not the model's "
        "(vLLM's); unset: the model's",
    )
    seed: int | None = option(
        None,
        group="model",
        parse=int,
        metavar="N",
        help="seed torch's global random generators once the model is loaded (vLLM's): sampled requests "
        "without a seed of their own then draw the same numbers after every start (the same outputs while "
        "the same requests run together); unset: not seeded",
    )
    # -- cache ---------------------------------------------------------------------------------------------
    chunk_size: int | None = option(
        None,
        group="cache",
        parse=positive_int,
        metavar="N",
        help="tokens per cached chunk; unset: 128, or 32 with stitching (a document is stitched only in "
        "whole chunks, and 32 is the measured setting)",
    )
    boundary_window: int = option(
        0,
        group="cache",
        help="let a chunk cut slide up to this many tokens to a natural break (newline, sentence end); "
        "0 keeps fixed-size chunks",
    )
    max_cache_bytes: int = option(
        DEFAULT_MAX_CACHE_BYTES,
        group="cache",
        parse=parse_bytes,
        cli_default="2GiB",
        help="byte budget of the in-memory KV cache; also sizes the paged block pool (running requests' KV "
        "and reusable prefixes) when --num-blocks is not given, at most 16384 blocks (0 disables reuse)",
    )
    kv_cache_bits: int = option(
        16,
        group="cache",
        choices=(16, 8, 4),
        help="precision of cached blocks in the disk/Redis tiers: 16 exact, 8/4 KIVI-quantized (more blocks "
        "per byte, approximate reuse), so 8/4 need --disk-cache-dir or --remote-url (the RAM block pool's "
        "precision is --kv-cache-dtype)",
    )
    kv_group_size: int = option(
        32, group="cache", help="quantization group of --kv-cache-bits 8/4 (only with them)"
    )
    kv_cache_dtype: str = option(
        "auto",
        group="cache",
        choices=KV_CACHE_DTYPES,
        help="precision the paged block pool holds KV in (vLLM's): auto keeps the model's dtype; bfloat16 / "
        "float16 halve an fp32 model's pool; fp8 (= fp8_e4m3) / fp8_e5m2 halve a 16-bit model's and quarter an "
        "fp32 one's (scale 1.0, saturating). More tokens per byte, approximate KV (docs/kv_cache_dtype.md)",
    )
    block_size: int = option(
        16,
        group="cache",
        parse=positive_int,
        help="tokens per KV block of the paged pool (the unit of prefix sharing between requests)",
    )
    num_blocks: int | None = option(
        None,
        group="cache",
        parse=block_count,
        help="KV blocks in the paged pool; unset: as many as --max-cache-bytes holds",
    )
    gpu_memory_utilization: float | None = option(
        None,
        group="cache",
        parse=float,
        metavar="FRACTION",
        help="size the paged pool so that weights, one step's activations (profiled at load) and the pool "
        "take this fraction of the CUDA device's memory (vLLM's; e.g. 0.9); CUDA only; unset: "
        "--max-cache-bytes or --num-blocks sizes it",
    )
    # -- tiers ---------------------------------------------------------------------------------------------
    disk_cache_dir: str | os.PathLike[str] | None = option(
        None,
        group="cache",
        metavar="DIR",
        help="add a disk tier under RAM in DIR (survives restarts); unset: no disk tier",
    )
    disk_cache_bytes: int = option(
        DEFAULT_DISK_CACHE_BYTES,
        group="cache",
        parse=parse_bytes,
        cli_default="16GiB",
        help="byte budget of this model's sub-folder in the disk tier, shared by every process writing it: give "
        "each the folder's budget (only with --disk-cache-dir; docs/tiers.md)",
    )
    remote_url: str | None = option(
        None,
        group="cache",
        metavar="URL",
        help="redis://host:port/db of a Redis shared by several engine processes (pip install "
        "'kvb-cache[redis]'); unset: no remote tier",
    )
    remote_codec: str | None = option(
        None,
        group="cache",
        choices=("absmax8",),
        help="send Redis records through the int8 wire codec (lossy; records 0.57x the bytes of fp16 KV, 0.28x of fp32); unset: as in RAM",
    )
    remote_ttl_s: int | None = option(
        None,
        group="cache",
        flag="--remote-ttl",
        metavar="SECONDS",
        parse=positive_int,
        help="expire Redis records after this many seconds; with Redis' maxmemory-policy volatile-lru only "
        "records are evicted, never the shared counters hash (only with --remote-url); unset: no TTL",
    )
    remote_timeout_s: float = option(
        DEFAULT_REMOTE_TIMEOUT_S,
        group="cache",
        flag="--remote-timeout",
        metavar="SECONDS",
        help="connect/read timeout of every Redis call; past it the call is a miss and the tier pauses (a "
        "big model's records are megabytes: give a slow link room for the transfer; only with --remote-url)",
    )
    exit_flush_timeout_s: float = option(
        10.0,
        group="cache",
        flag="--exit-flush-timeout",
        metavar="SECONDS",
        help="how long engine.close() and the interpreter-exit hook wait for queued disk/Redis writes",
    )
    # -- stitching -----------------------------------------------------------------------------------------
    stitching: StitchConfig | None = option(
        None,
        group="stitching",
        cli=False,
        help="reuse chunks cached after a *different* history too (approximate): a kvb_cache.StitchConfig; "
        "None: exact prefix reuse only",
    )
    recompute_strategy: str | None = option(
        None,
        group="stitching",
        choices=RECOMPUTE_STRATEGIES,
        help="turn stitching on (reuse chunks seen after a different history, re-rotated) and repair the "
        "seams this way; unset: exact prefix reuse only",
    )
    collect_copies: int | None = option(
        None,
        group="stitching",
        parse=positive_int,
        metavar="N",
        help="with stitching: compute a document held by fewer than N stored copies instead of stitching it, "
        "and keep it, so later prompts average N copies (StitchConfig.collect_copies); unset: 1",
    )
    idle_copies: int | None = option(
        None,
        group="stitching",
        parse=positive_int,
        metavar="N",
        help="with stitching: while no request is running, compute exactly each stitched prompt that had a "
        "document held by fewer than N stored copies, so it becomes an exact hit and its documents gain a "
        "copy to average (StitchConfig.idle_copies); 1: never; unset: 2",
    )
    # -- scheduling ----------------------------------------------------------------------------------------
    max_num_seqs: int = option(
        32,
        group="scheduling",
        parse=positive_int,
        help="most requests decoded together in one engine step (at most max_num_batched_tokens: each "
        "decodes a token per step)",
    )
    max_num_batched_tokens: int = option(
        1024,
        group="scheduling",
        parse=positive_int,
        help="most tokens (prefill + decode) one engine step feeds the model; longer prompts are prefilled "
        "in slices interleaved with the running requests' decoding",
    )
    scheduling_policy: str = option(
        "fcfs",
        group="scheduling",
        choices=SCHEDULING_POLICIES,
        help="fcfs: arrival order (longest cached prefix first among waiting requests); priority: each "
        "request's priority (lower first, then arrival; the lowest running one is preempted first), vLLM's "
        "--scheduling-policy",
    )
    prefill_chunk_size: int | None = option(
        None,
        group="scheduling",
        parse=positive_int,
        help="default slice (tokens) in which each request's uncached prompt is prefilled, bounding its "
        "activation memory (a request's own prefill_chunk_size overrides it); unset: as large as "
        "--max-num-batched-tokens allows",
    )
    # -- speculative decoding (the protocol; providers come from kvb-speculative via kvboost) ---------------
    drafter: SpeculativeDecoder | None = option(
        None,
        group="speculative decoding",
        cli=False,
        help="a kvb_cache.SpeculativeDecoder the engine decodes with (kvboost builds one from --speculative)",
    )

    def stitch_config(self) -> StitchConfig | None:
        """``stitching``, or the one ``recompute_strategy`` stands for, with ``collect_copies`` and
        ``idle_copies`` applied.

        Raises:
            ConfigError: they disagree, ``collect_copies`` / ``idle_copies`` is given without stitching, or
                the strategy is unknown.
        """
        config = self.stitching
        if self.recompute_strategy is not None:
            if config is not None and config.recompute_strategy != self.recompute_strategy:
                raise ConfigError(
                    f"recompute_strategy={self.recompute_strategy!r} contradicts stitching.recompute_strategy="
                    f"{config.recompute_strategy!r}: pass one of them"
                )
            config = config or StitchConfig(recompute_strategy=self.recompute_strategy)  # type: ignore[arg-type]
        for name in ("collect_copies", "idle_copies"):
            value = getattr(self, name)
            if value is None:
                continue
            if config is None:
                raise ConfigError(
                    f"{name} needs stitching: pass recompute_strategy (--recompute-strategy) too"
                )
            given = getattr(self.stitching, name, None)
            default = getattr(StitchConfig(), name)
            if given is not None and given not in (default, value):
                raise ConfigError(f"{name}={value} contradicts stitching.{name}={given}: pass one of them")
            config = replace(config, **{name: value})
        return config

    def tier_config(self) -> TierConfig | None:
        """The disk / Redis tiers asked for; None: RAM only.

        Raises:
            ConfigError: a tier option without its tier (``disk_cache_bytes`` without ``disk_cache_dir``).
        """
        if self.disk_cache_dir is None and self.disk_cache_bytes != DEFAULT_DISK_CACHE_BYTES:
            # Accepted, it was silently ignored (there is no disk tier to size), as remote_codec without
            # remote_url is refused.
            raise ConfigError(
                "disk_cache_bytes sizes the disk tier, and there is none: add disk_cache_dir (--disk-cache-dir) "
                "or drop disk_cache_bytes"
            )
        if self.remote_url is None and self.remote_timeout_s != DEFAULT_REMOTE_TIMEOUT_S:
            raise ConfigError(
                "remote_timeout_s bounds the Redis tier's calls, and there is none: add remote_url "
                "(--remote-url) or drop remote_timeout_s"
            )
        tiers = TierConfig(
            disk_cache_dir=self.disk_cache_dir,
            disk_cache_bytes=self.disk_cache_bytes,
            remote_url=self.remote_url,
            remote_codec=self.remote_codec,
            remote_ttl_s=self.remote_ttl_s,
            remote_timeout_s=self.remote_timeout_s,
            exit_flush_timeout_s=self.exit_flush_timeout_s,
        )
        return tiers if tiers.enabled else None

    def engine_config(self) -> EngineConfig:
        """The :class:`EngineConfig` these options describe (validated there).

        Raises:
            ConfigError: an invalid value (``seed`` and ``tokenizer`` are checked here too, though they are
                not part of it), or an option that would have no effect: ``kv_cache_bits`` 8/4
                without a disk or Redis tier (it quantizes their records only), ``kv_group_size`` without
                ``kv_cache_bits`` 8/4.
        """
        check_seed(self.seed)
        check_utilization(self.gpu_memory_utilization)
        if self.gpu_memory_utilization is not None and self.num_blocks is not None:
            raise ConfigError("gpu_memory_utilization and num_blocks both size the KV pool: pass one of them")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer.strip()):
            raise ConfigError(
                f"tokenizer must be a folder or a hub id, or None (the model's), got {self.tokenizer!r}"
            )
        tiers = self.tier_config()
        return EngineConfig(
            chunk_size=self.chunk_size,
            stitching=self.stitch_config(),
            boundary_window=self.boundary_window,
            max_cache_bytes=self.max_cache_bytes,
            kv_cache_bits=self.kv_cache_bits,
            kv_group_size=self.kv_group_size,
            tiers=tiers,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefill_chunk_size=self.prefill_chunk_size,
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            kv_cache_dtype=self.kv_cache_dtype,
            scheduling_policy=self.scheduling_policy,
        )
