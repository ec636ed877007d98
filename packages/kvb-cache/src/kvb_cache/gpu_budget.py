"""``gpu_memory_utilization`` (vLLM's ``--gpu-memory-utilization``): size the KV block pool from a share of
the GPU's memory instead of a byte budget.

The share (``total x fraction``) holds the weights, the activations of the largest step and the pool; the
pool gets what the other two leave. As vLLM does, the activations are measured, not modelled: one forward
of ``max_num_batched_tokens`` tokens (the most a step feeds the model) before the pool exists, with the
logits of ``max_num_seqs`` rows and their fp32 softmax (the sampler's share), its peak above the weights
taken as the step's, in memory torch *reserves* (what the process holds, allocator rounding included).

That forward runs the model's own attention over its own tokens. The engine loop's attention also reads
each request's cached context back from the pool: one layer's gathered keys and values, the prefill's
position mask (and the copies SDPA makes of it) and, where the eager formula runs (soft-capping,
attention sinks), the scores, all over contexts up to ``max_model_len`` (masks and scores are built a block
of query rows at a time, ``paged_attention.PREFILL_MASK_ELEMENTS``). Those are charged from their
shapes (:func:`loop_attention_bytes`). Measured on an H200 (docs/server.md, ``tools/gpu_checks.py``
memory_share): without them 16 prompts of 1500 tokens ended 12 MiB above a 0.6 share; with them and the
prefill masks built in blocks of query rows, 16 x 1500 ends 106-119 MiB and 32 prompts near the context
(7900 tokens) 22-35 MiB inside a 0.3 and a 0.6 share, in torch's reserved memory (before the blocks, the
long prompts ended 340-350 MiB above it). A thin margin measured on one model, not a guaranteed cap.

With CUDA graphs on (the default; ``enforce_eager`` off), the captured decode steps keep memory of their own
beside that: their shared graph pool (one decode step of ``max_num_seqs`` rows, profiled the same way, plus
its gathered context on the SDPA path), the logits buffer they all write and each bucket's static inputs.
Those are charged too (:func:`decode_graph_bytes`).

As in vLLM, the share counts memory torch holds after CUDA is initialised: the CUDA context itself
(~0.5 GiB, outside torch's allocator) is not in it.

Only CUDA devices: on CPU the pool is sized by ``max_cache_bytes`` or ``num_blocks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.config import EngineConfig
from kvb_cache.core.kv_storage import LayerShape, bytes_per_block, probe_layer_shapes
from kvb_cache.errors import ConfigError
from kvb_cache.step_limits import eager_loop_attention

logger = logging.getLogger(__name__)

GiB = float(1 << 30)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    """Bytes on one device when the pool is sized: ``total`` and ``free`` as the driver reports them,
    ``weights`` held by torch once the model is loaded, ``activations`` the profiled step's peak above it,
    ``loop_attention`` what the loop's attention adds beside it (:func:`loop_attention_bytes`), ``graphs``
    what captured decode steps hold (:func:`decode_graph_bytes`)."""

    total: int
    free: int
    reserved: int
    weights: int
    activations: int
    loop_attention: int = 0
    graphs: int = 0


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
    step = memory.activations + memory.loop_attention + memory.graphs
    left = wanted - memory.weights - step
    if left <= 0:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} gives {wanted / GiB:.2f} GiB, and the weights "
            f"({memory.weights / GiB:.2f} GiB) and one step's activations ({step / GiB:.2f} GiB) take all "
            "of it: raise gpu_memory_utilization, or lower max_num_batched_tokens or max_model_len"
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


def profile_step_peak(model: PreTrainedModel, tokens: int, rows: int = 1) -> int:
    """Peak CUDA bytes torch reserves above what it held before, during one forward of ``tokens`` tokens
    that keeps the logits of the last ``rows`` positions and takes their fp32 softmax (as the loop keeps and
    samples one row per scheduled request)."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros((1, tokens), dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device).unsqueeze(0)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        # use_cache with a fresh cache: the step's keys/values are written too, as the loop writes them into
        # its pool (here they are freed with the cache right after).
        logits = model(
            input_ids=ids,
            position_ids=positions,
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=max(1, min(rows, tokens)),
        ).logits
        logits.float().softmax(-1)
    torch.cuda.synchronize(device)
    # Reserved, not only allocated: the caching allocator rounds and splits segments, and what it reserves
    # is what the process holds.
    peak = max(
        torch.cuda.max_memory_allocated(device) - allocated,
        torch.cuda.max_memory_reserved(device) - reserved,
    )
    del cache, logits
    torch.cuda.empty_cache()
    return max(0, peak)


def gathered_element_bytes(shapes: Sequence[LayerShape], kv_cache_dtype: str = "auto") -> int:
    """Bytes per gathered key/value element: the model's dtype, plus the pool's narrower copy it is converted
    from when ``kv_cache_dtype`` holds the pool in another dtype (both are alive during the conversion)."""
    from kvb_cache.core.kv_dtype import pool_dtype

    def size(dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    def element(shape: LayerShape) -> int:
        pool = pool_dtype(kv_cache_dtype, shape.dtype)
        return size(shape.dtype) + (0 if pool == shape.dtype else size(pool))

    return max(element(s) for s in shapes)


def loop_attention_bytes(
    model: PreTrainedModel,
    shapes: Sequence[LayerShape],
    *,
    step_tokens: int,
    context: int,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes the engine loop's attention holds at once in one layer beyond a plain forward's: gathered keys
    and values (:func:`~kvb_cache.core.paged_attention.gather_bytes`); a prefill block's ``[G * rows, ctx]``
    bool position mask (``rows`` at most ``step_tokens`` and :func:`~kvb_cache.core.paged_attention.
    prefill_block_rows`), the float copy SDPA makes of it and the copy its memory-efficient kernel pads to an
    aligned width; and, where the eager formula runs (soft-capping, sinks), that block's fp32 scores and
    probabilities. ``shapes``: the model's per-layer KV shapes (``kv_storage.probe_layer_shapes``)."""
    from kvb_cache.core.paged_attention import gather_bytes, prefill_block_rows

    text = model.config.get_text_config()
    heads = text.num_attention_heads
    element = max(torch.empty((), dtype=s.dtype).element_size() for s in shapes)
    moved = gathered_element_bytes(shapes, kv_cache_dtype)
    gathered = max(gather_bytes(context, s.kv_heads, max(s.key_dim, s.value_dim), moved) for s in shapes)
    kv_heads = min(s.kv_heads for s in shapes)
    groups = heads // kv_heads
    rows = min(step_tokens, context, prefill_block_rows(groups, context))
    mask_elements = groups * rows * context
    mask = mask_elements * (1 + 2 * element)
    eager = eager_loop_attention(model)
    scores = 2 * 4 * kv_heads * mask_elements if eager else 0
    return gathered + mask + scores


def measure(model: PreTrainedModel, tokens: int, rows: int = 1) -> DeviceMemory:
    """The device's memory with ``model`` loaded, and one ``tokens``-token step keeping ``rows`` logits
    profiled."""
    device = model.device
    activations = profile_step_peak(model, tokens, rows)
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)  # the weights, after the profile's cache was emptied
    return DeviceMemory(total=total, free=free, reserved=held, weights=held, activations=activations)


def blocks_for_utilization(
    model: PreTrainedModel,
    utilization: float,
    *,
    block_bytes: int,
    step_tokens: int,
    sample_rows: int = 1,
    loop_attention: int = 0,
    graphs: int = 0,
    measure_memory: Callable[[PreTrainedModel, int, int], DeviceMemory] = measure,
) -> int:
    """KV blocks (``block_bytes`` each) that fit in ``utilization`` of the model's CUDA device, beside one
    profiled step of ``step_tokens`` tokens sampling ``sample_rows`` rows, ``loop_attention`` bytes and
    ``graphs`` bytes.

    Raises:
        ConfigError: the model is not on a CUDA device, or :func:`kv_pool_bytes` refuses.
    """
    if model.device.type != "cuda":
        raise _not_cuda(model.device)
    memory = replace(
        measure_memory(model, step_tokens, sample_rows), loop_attention=loop_attention, graphs=graphs
    )
    pool = kv_pool_bytes(memory, utilization)
    blocks = pool // max(block_bytes, 1)
    if blocks < 2:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} leaves {pool / GiB:.3f} GiB for the KV pool, less than two "
            f"blocks of {block_bytes} bytes: raise gpu_memory_utilization"
        )
    logger.info(
        "KV pool sized for gpu_memory_utilization=%s: %d blocks (%.2f GiB; weights %.2f GiB, step "
        "activations %.2f GiB measured + %.2f GiB loop attention + %.2f GiB CUDA graphs, of %.2f GiB total)",
        utilization,
        blocks,
        blocks * block_bytes / GiB,
        memory.weights / GiB,
        memory.activations / GiB,
        memory.loop_attention / GiB,
        memory.graphs / GiB,
        memory.total / GiB,
    )
    return int(blocks)


def apply_utilization(
    model: PreTrainedModel, config: EngineConfig, utilization: float | None
) -> EngineConfig:
    """``config`` with ``num_blocks`` sized for ``utilization`` of ``model``'s device (None: unchanged)."""
    if utilization is None:
        return config
    from kvb_cache.model_traits import cap_context, inspect_model

    shapes = probe_layer_shapes(model)
    block_bytes = bytes_per_block(shapes, config.block_size, config.kv_cache_dtype)
    step = config.max_num_batched_tokens
    context = cap_context(inspect_model(model), config.max_model_len).context_length or step
    blocks = blocks_for_utilization(
        model,
        utilization,
        block_bytes=block_bytes,
        step_tokens=step,
        sample_rows=config.running_seqs,
        loop_attention=loop_attention_bytes(
            model, shapes, step_tokens=step, context=context, kv_cache_dtype=config.kv_cache_dtype
        ),
        graphs=0
        if config.enforce_eager
        else decode_graph_bytes(
            model,
            shapes,
            rows=config.running_seqs,
            context=context,
            kv_cache_dtype=config.kv_cache_dtype,
            step_peak=profile_step_peak(model, config.running_seqs, config.running_seqs),
        ),
    )
    return replace(config, num_blocks=blocks)


#: cuBLAS and cuBLASLt keep a workspace per stream, allocated through torch's caching allocator (32 MiB each
#: on Hopper by default): the capture stream gets its own pair.
CAPTURE_STREAM_WORKSPACES = 64 << 20


def decode_graph_bytes(
    model: PreTrainedModel,
    shapes: Sequence[LayerShape],
    *,
    rows: int,
    context: int,
    step_peak: int,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes captured decode steps (:mod:`kvb_cache.core.decode_graphs`) hold for good: their shared graph
    pool, at most one decode step of ``rows`` rows (``step_peak``, profiled) and its gathered keys/values on
    the SDPA path (at most ``DECODE_GATHER_TOKENS`` positions); the ``[rows, V]`` logits buffer; the static
    inputs (token/position/length ``[3, rows]`` and, per width bucket ``w``, slots ``[rows, w]`` int64: the
    widths add up to under ``2 * context``); the capture stream's cuBLAS workspaces."""
    from kvb_cache.core.paged_attention import DECODE_GATHER_TOKENS

    element = gathered_element_bytes(shapes, kv_cache_dtype)
    gathered = max(
        2 * min(DECODE_GATHER_TOKENS, rows * context) * s.kv_heads * max(s.key_dim, s.value_dim) * element
        for s in shapes
    )
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size
    logits = rows * vocab * 4  # fp32 at most
    static = rows * (2 * context + 3) * 8
    return step_peak + gathered + logits + static + CAPTURE_STREAM_WORKSPACES
