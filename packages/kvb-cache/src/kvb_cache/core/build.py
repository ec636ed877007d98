"""Assemble the engine loop for a model: pool size, storage, tiers, scheduler, runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvb_cache.config import EngineConfig
from kvb_cache.core.attention_routing import check_attention_routing, check_causal_positions
from kvb_cache.core.block_pool import BlockPool
from kvb_cache.core.block_tiers import BlockTiers
from kvb_cache.core.decode_graphs import Capture, DecodeGraphs, cuda_capture
from kvb_cache.core.kv_manager import KVCacheManager
from kvb_cache.core.kv_storage import KVStorage, bytes_per_block, probe_layer_shapes
from kvb_cache.core.paged_attention import install_paged_attention
from kvb_cache.core.pool_kernel import PoolKernel, resolve_backend
from kvb_cache.core.runner import ModelRunner
from kvb_cache.core.scheduler import Scheduler
from kvb_cache.errors import ConfigError, UnsupportedModelError
from kvb_cache.hashing import ChunkHash
from kvb_cache.kv_sharing import shared_map
from kvb_cache.model_traits import ModelTraits

logger = logging.getLogger(__name__)

#: With ``max_cache_bytes == 0`` (no reuse across requests) the pool still needs room for running requests.
WORKING_POOL_BYTES = 256 << 20
#: Upper bound on a derived block count (an explicit ``num_blocks`` may exceed it): a tiny model with a
#: large byte budget would otherwise get millions of blocks it cannot use.
MAX_DERIVED_BLOCKS = 16384


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopParts:
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    tiers: BlockTiers | None


def derive_num_blocks(config: EngineConfig, block_bytes: int) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    budget = config.max_cache_bytes or WORKING_POOL_BYTES
    return max(2, min(MAX_DERIVED_BLOCKS, budget // max(block_bytes, 1)))


def packed_budget(traits: ModelTraits, config: EngineConfig) -> int:
    """The scheduler's token budget per step (decodes included): ``max_num_batched_tokens``, lowered to
    ``traits.position_limit`` for models whose packed forwards must stay below it."""
    if traits.position_limit is not None and traits.position_limit < config.max_num_batched_tokens:
        logger.info(
            "max_num_batched_tokens lowered to %d (the model's position limit)", traits.position_limit
        )
        return traits.position_limit
    return config.max_num_batched_tokens


def running_seats(config: EngineConfig, budget: int) -> int:
    """Most requests running at once: :attr:`EngineConfig.running_seqs`, and no more than ``budget`` when a
    model's position limit lowered the step below it (every running request decodes one token a step);
    warns once, here, when that is below the ``max_num_seqs`` asked for."""
    seats = min(config.running_seqs, budget)
    if seats < config.max_num_seqs:
        logger.warning(
            "max_num_seqs=%d is above the %d tokens a step may feed (max_num_batched_tokens): at most %d "
            "requests run at once",
            config.max_num_seqs,
            budget,
            seats,
        )
    return seats


def graph_capture(device: torch.device) -> Capture | None:
    """How decode steps are captured on ``device``: CUDA graphs on CUDA, none elsewhere (no eager-mode
    overhead to save on a CPU, where the ops themselves dominate)."""
    if device.type != "cuda":
        return None
    return cuda_capture(device)


def pool_attention(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, pool: torch.dtype
) -> PoolKernel | None:
    """:func:`resolve_backend` for a pool held in ``pool`` by a model computing in ``dtype``: the block-table
    kernel reads blocks in the queries' dtype, so a narrower ``kv_cache_dtype`` attends by gather + SDPA
    (the gathered context is converted back to ``dtype``)."""
    if pool == dtype:
        return resolve_backend(config.attention_backend, device, dtype)
    if config.attention_backend == "kvb_kernels":
        raise ConfigError(
            f"attention_backend='kvb_kernels' reads the pool in the model's dtype ({dtype}), and "
            f"kv_cache_dtype={config.kv_cache_dtype!r} holds it in {pool}: use attention_backend='sdpa' (or "
            "'auto'), or kv_cache_dtype='auto'"
        )
    return None


def build_loop(
    model: PreTrainedModel, traits: ModelTraits, config: EngineConfig, *, root: ChunkHash, fingerprint: str
) -> LoopParts:
    shapes = probe_layer_shapes(model)
    install_paged_attention(model)
    sources = traits.kv_sources or tuple(range(len(shapes)))
    if len(shapes) != traits.kv_layers:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s cache holds keys/values for {len(shapes)} layers, but {traits.kv_layers} "
            "of its layers compute their own; KVBoost cannot tell which layers its pool should hold"
        )
    check_attention_routing(model, shapes, sources)
    check_causal_positions(model)
    if len(shapes) < len(sources):
        logger.info(
            "%s: layers %d-%d attend to earlier layers' keys/values; the KV pool holds the other %d layers",
            type(model).__name__,
            len(shapes),
            len(sources) - 1,
            len(shapes),
        )
    num_blocks = derive_num_blocks(config, bytes_per_block(shapes, config.block_size, config.kv_cache_dtype))
    capture = None if config.enforce_eager else graph_capture(model.device)
    storage = KVStorage(
        shapes,
        num_blocks=num_blocks,
        block_size=config.block_size,
        device=model.device,
        shared=shared_map(sources),
        scratch=capture is not None,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    pool = BlockPool(num_blocks, config.block_size)
    tiers = BlockTiers.from_config(config, fingerprint=fingerprint, shapes=shapes)
    caching = config.max_cache_bytes > 0
    kv = KVCacheManager(
        pool,
        storage,
        root,
        tiers=tiers,
        caching=caching,
        store_outputs=config.store_outputs,
        store_partial_tail=config.store_partial_tail,
    )
    budget = packed_budget(traits, config)
    scheduler = Scheduler(
        kv,
        max_num_seqs=running_seats(config, budget),
        max_num_batched_tokens=budget,
        priority=config.scheduling_policy == "priority",
    )
    kernel = pool_attention(config, model.device, shapes[0].dtype, storage.keys[0].dtype)
    graphs = None
    if capture is not None:
        pool_tokens = num_blocks * config.block_size
        graphs = DecodeGraphs(
            model,
            storage,
            kernel=kernel,
            max_rows=config.running_seqs,
            max_width=min(pool_tokens, config.max_model_len or pool_tokens),
            capture=capture,
        )
    runner = ModelRunner(model, storage, logits_to_keep=traits.logits_to_keep, kernel=kernel, graphs=graphs)
    return LoopParts(kv=kv, scheduler=scheduler, runner=runner, tiers=tiers)
