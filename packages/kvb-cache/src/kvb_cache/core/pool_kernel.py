"""An attention kernel that reads the paged pool's blocks in place (kvb-kernels' ``paged_attention``).

The default loop attention (:mod:`kvb_cache.core.paged_attention`) gathers each request's context out of the
pool (``index_select``) and runs SDPA over the copy with a position mask: two transients per layer that grow
with the context, and the gather's bandwidth on top of the attention's. A block-table kernel reads keys and
values where they lie instead, so a step holds nothing but its output. kvb-kernels ships one (Triton, FA2
tiling, GQA without expanding K/V); this module only adapts the pool to its contract, so kvb-cache does not
depend on it: it is used when installed (``attention_backend``, :data:`ATTENTION_BACKENDS`).

The pool keeps keys ``[kv_heads, num_blocks * block_size, dim]`` per layer (slot = ``block * block_size +
offset``), so ``view(kv_heads, num_blocks, block_size, dim).permute(1, 0, 2, 3)`` is kvb-kernels'
``[num_pages, kv_heads, page_size, dim]`` without a copy, and a request's block table is its slots at every
``block_size``-th position divided by ``block_size`` (its position ``p`` sits at offset ``p % block_size``).
"""

from __future__ import annotations

import logging
from typing import Literal, Protocol, get_args

import torch

from kvb_cache.errors import ConfigError

logger = logging.getLogger(__name__)

AttentionBackend = Literal["auto", "sdpa", "kvb_kernels"]
#: ``auto``: kvb-kernels' block-table kernel on CUDA in fp16/bf16 when it is installed with Triton, else ``sdpa``.
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
#: dtypes ``auto`` attends through the kernel in (measured faster than gather + SDPA on an H200).
AUTO_DTYPES = (torch.float16, torch.bfloat16)
#: Widest head kvb-kernels serves; wider layers (Gemma 4's 512-wide global heads) keep gather + SDPA.
KERNEL_MAX_HEAD_DIM = 256
INSTALL_HINT = 'install kvb-kernels with its triton extra (from the source tree: pip install "./packages/kvb-kernels[triton]")'


class PoolKernel(Protocol):
    """Causal attention of ``query`` ``[b, H, q, D]`` over paged keys/values ``[num_pages, KVH, page, D]``.

    ``block_table`` ``[b, P]`` int32 pages per sequence, ``kv_lens`` ``[b]`` int32 context lengths; query
    ``i`` of sequence ``s`` sits at position ``kv_lens[s] - q + i`` (its own key already in the pages).
    ``window``: keys visible per query, itself included (transformers' sliding window); None: all.
    ``max_len``: the longest of ``kv_lens``, known on the host (the runner builds both from the same
    lengths), so the kernel need not read ``kv_lens`` back: on CUDA that read would be a host sync in every
    layer of every step. Returns ``[b, H, q, D]``.
    """

    def __call__(
        self,
        query: torch.Tensor,
        key_pages: torch.Tensor,
        value_pages: torch.Tensor,
        block_table: torch.Tensor,
        kv_lens: torch.Tensor,
        *,
        window: int | None,
        scale: float | None,
        max_len: int,
    ) -> torch.Tensor: ...


def check_backend(backend: object) -> None:
    """Raises :class:`ConfigError` unless ``backend`` is one of :data:`ATTENTION_BACKENDS`."""
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}"
        )


def pages(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """One layer's pool ``[KVH, num_blocks * block_size, D]`` as ``[num_blocks, KVH, block_size, D]`` (a view)."""
    kv_heads, slots, dim = pool.shape
    return pool.view(kv_heads, slots // block_size, block_size, dim).permute(1, 0, 2, 3)


def block_table(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[..., P]`` int32 blocks of context slots ``[..., L]`` (slot = block * block_size + position % block_size)."""
    return torch.div(slots[..., ::block_size], block_size, rounding_mode="floor").to(torch.int32)


def _kvb_kernels(device: torch.device, dtype: torch.dtype) -> tuple[PoolKernel | None, str]:
    """kvb-kernels' paged kernel for ``device``/``dtype``, or None and why not."""
    try:
        from kvb_kernels import PagedKV, paged_attention
        from kvb_kernels.backend import device_supported, dtype_supported
    except ImportError:
        return None, f"kvb-kernels is not installed ({INSTALL_HINT})"
    if not device_supported(device):
        if device.type == "cuda":
            return None, f"Triton is not installed ({INSTALL_HINT})"
        return None, f"kvb-kernels' Triton kernels run on CUDA, not on {device}"
    if not dtype_supported(dtype, device):
        return None, f"kvb-kernels does not serve {dtype} on {device.type}"

    def kernel(query, key_pages, value_pages, block_table, kv_lens, *, window, scale, max_len):
        kv = PagedKV(
            key_pages=key_pages,
            value_pages=value_pages,
            block_table=block_table,
            kv_lens=kv_lens,
            max_len=max_len,
        )
        return paged_attention(query, kv, causal=True, window=window, scale=scale)

    return kernel, "kvb-kernels paged_attention"


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> PoolKernel | None:
    """The kernel the engine loop attends with for ``attention_backend`` (None: gather + SDPA).

    Raises:
        ConfigError: ``backend`` is unknown, or ``"kvb_kernels"`` was asked for and cannot run here.
    """
    check_backend(backend)
    if backend == "sdpa":
        return None
    if backend == "auto" and (device.type != "cuda" or dtype not in AUTO_DTYPES):
        # The Triton interpreter on a CPU is for tests, never a default; in fp32 the kernel's IEEE dot
        # products lost to SDPA on an H200 (prefill 8.8x, decode 1.3x slower; docs/kernels.md).
        return None
    kernel, why = _kvb_kernels(device, dtype)
    if kernel is None and backend == "kvb_kernels":
        raise ConfigError(
            f"attention_backend='kvb_kernels' cannot run: {why}; or use attention_backend='sdpa'"
        )
    logger.info("engine loop attention: %s", why if kernel is not None else f"gather + SDPA ({why})")
    return kernel
