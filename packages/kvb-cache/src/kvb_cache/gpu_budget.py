"""``gpu_memory_utilization`` (vLLM's ``--gpu-memory-utilization``): size the KV block pool from a share of
the GPU's memory instead of a byte budget.

The share (``total x fraction``) holds the weights, the activations of the largest step and the pool; the
pool gets what the other two leave. As vLLM does, the activations are measured, not modelled: one forward
of ``max_num_batched_tokens`` tokens (the most a step feeds the model) before the pool exists, its peak
above the weights taken as the step's. It is a plain forward with the model's own attention, not the
engine loop's attention over the pool, so it approximates the loop's peak rather than replaying it.

Only CUDA devices: on CPU the pool is sized by ``max_cache_bytes`` or ``num_blocks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.config import EngineConfig
from kvb_cache.errors import ConfigError

logger = logging.getLogger(__name__)

GiB = float(1 << 30)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    """Bytes on one device when the pool is sized: ``total`` and ``free`` as the driver reports them,
    ``weights`` held by torch once the model is loaded, ``activations`` the profiled step's peak above it."""

    total: int
    free: int
    reserved: int
    weights: int
    activations: int


def kv_pool_bytes(memory: DeviceMemory, utilization: float) -> int:
    """Bytes left for the KV pool in ``utilization`` of the device.

    Raises:
        ConfigError: the device has less free memory than the share asks for (other processes hold it),
            or the weights and activations already fill the share.
    """
    wanted = int(memory.total * utilization)
    # What this process already holds (torch's reserved memory) counts as part of the share; what other
    # processes hold does not fit in it. vLLM refuses the same way at startup.
    available = memory.free + memory.reserved
    if available < wanted:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} asks for {wanted / GiB:.2f} GiB of the device's "
            f"{memory.total / GiB:.2f} GiB, but only {available / GiB:.2f} GiB is free for this process "
            "(other processes hold the rest): lower gpu_memory_utilization"
        )
    left = wanted - memory.weights - memory.activations
    if left <= 0:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} gives {wanted / GiB:.2f} GiB, and the weights "
            f"({memory.weights / GiB:.2f} GiB) and one step's activations ({memory.activations / GiB:.2f} "
            "GiB) take all of it: raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return left


def check_utilization(utilization: object) -> None:
    """Raises ConfigError unless ``utilization`` is None or a number in (0, 1]."""
    if utilization is None:
        return
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
        raise ConfigError(
            f"gpu_memory_utilization must be a fraction in (0, 1] (e.g. 0.9), got {utilization!r}"
        )


def _not_cuda(device: object) -> ConfigError:
    return ConfigError(
        f"gpu_memory_utilization sizes the KV pool from a CUDA device's memory, and the model is on {device}: "
        "size it with max_cache_bytes (--max-cache-bytes) or num_blocks (--num-blocks)"
    )


def check_cuda_device(device: str | torch.device | None) -> None:
    """Before the load: refuse ``gpu_memory_utilization`` when the model will not be on a CUDA device
    (``device`` as ``from_pretrained`` takes it; None: CUDA when available)."""
    from kvb_cache.loading import resolve_device

    resolved = resolve_device(device)
    if resolved.type != "cuda":
        raise _not_cuda(resolved)


def profile_step_peak(model: PreTrainedModel, tokens: int) -> int:
    """Peak CUDA bytes above the current allocation during one forward of ``tokens`` tokens (logits of the
    last position only, as the engine loop keeps only the sampled rows')."""
    device = model.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros((1, tokens), dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device).unsqueeze(0)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        # use_cache with a fresh cache: the step's keys/values are written too, as the loop writes them into
        # its pool (here they are freed with the cache right after).
        model(
            input_ids=ids,
            position_ids=positions,
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache
    torch.cuda.empty_cache()
    return max(0, peak)


def measure(model: PreTrainedModel, tokens: int) -> DeviceMemory:
    """The device's memory with ``model`` loaded, and one ``tokens``-token step profiled."""
    device = model.device
    activations = profile_step_peak(model, tokens)
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        total=total,
        free=free,
        reserved=torch.cuda.memory_reserved(device),
        weights=torch.cuda.memory_allocated(device),
        activations=activations,
    )


def blocks_for_utilization(
    model: PreTrainedModel,
    utilization: float,
    *,
    block_bytes: int,
    step_tokens: int,
    measure_memory: Callable[[PreTrainedModel, int], DeviceMemory] = measure,
) -> int:
    """KV blocks (``block_bytes`` each) that fit in ``utilization`` of the model's CUDA device.

    Raises:
        ConfigError: the model is not on a CUDA device, or :func:`kv_pool_bytes` refuses.
    """
    if model.device.type != "cuda":
        raise _not_cuda(model.device)
    memory = measure_memory(model, step_tokens)
    pool = kv_pool_bytes(memory, utilization)
    blocks = pool // max(block_bytes, 1)
    if blocks < 2:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} leaves {pool / GiB:.3f} GiB for the KV pool, less than two "
            f"blocks of {block_bytes} bytes: raise gpu_memory_utilization"
        )
    logger.info(
        "KV pool sized for gpu_memory_utilization=%s: %d blocks (%.2f GiB; weights %.2f GiB, step "
        "activations %.2f GiB of %.2f GiB total)",
        utilization,
        blocks,
        blocks * block_bytes / GiB,
        memory.weights / GiB,
        memory.activations / GiB,
        memory.total / GiB,
    )
    return int(blocks)


def apply_utilization(
    model: PreTrainedModel, config: EngineConfig, utilization: float | None
) -> EngineConfig:
    """``config`` with ``num_blocks`` sized for ``utilization`` of ``model``'s device (None: unchanged)."""
    if utilization is None:
        return config
    from kvb_cache.core.kv_storage import bytes_per_block, probe_layer_shapes

    block_bytes = bytes_per_block(probe_layer_shapes(model), config.block_size)
    blocks = blocks_for_utilization(
        model, utilization, block_bytes=block_bytes, step_tokens=config.max_num_batched_tokens
    )
    return replace(config, num_blocks=blocks)
