"""The paged pool's storage precision (vLLM's ``--kv-cache-dtype``): keys and values computed in the model's
dtype, held in the pool in a narrower one.

``"auto"`` keeps KV as computed. ``"bfloat16"`` / ``"float16"`` halve an fp32 model's pool; ``"fp8"``
(= ``"fp8_e4m3"``) and ``"fp8_e5m2"`` halve a 16-bit model's and quarter an fp32 one's, so the same memory holds
2-4x the tokens (more requests in flight, more cached prefixes). As in vLLM, fp8 uses a scale of 1.0 (no
calibration): values beyond the format's range saturate at its largest finite value (clamped before the cast:
``e5m2`` would overflow to ``inf``, and a NaN in one key poisons every later token of the sequence).

Every read of the pool goes through :func:`gather` and every write through :func:`put`: a step writes its new
tokens' KV *before* attending, so a request attends its own prompt in pool precision as well, and a prefix
read back from the pool by a later request is exactly what the request that computed it attended. Exact
prefix reuse therefore stays exact *relative to the same engine without reuse*; against the model with KV as
computed, the difference is the rounding, measured in docs/kv_cache_dtype.md.

One-byte float formats are moved as ``uint8`` views: CPU ``index_copy_`` / ``index_select`` have no fp8
kernels in every torch version we admit, while the bytes are the same.
"""

from __future__ import annotations

import torch

from kvb_cache.errors import ConfigError

#: Accepted names, vLLM's spellings (``fp8`` is ``fp8_e4m3``, as in vLLM).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def check_kv_cache_dtype(name: object) -> str:
    """``name`` when it is one of :data:`KV_CACHE_DTYPES`, else a :class:`ConfigError` listing them."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return name


def pool_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """The dtype the pool holds a layer computed in ``compute`` in (``compute`` itself for ``"auto"``)."""
    return _DTYPES.get(check_kv_cache_dtype(name), compute)


def check_narrower(name: str, compute: torch.dtype) -> torch.dtype:
    """The pool dtype of a layer computed in ``compute``; a :class:`ConfigError` when ``name`` asks for
    another dtype of the same size (bfloat16 under a float16 model, or the reverse): no room is gained, and
    the conversion loses precision or range (65504 rounds up to bfloat16's 65536, read back as inf)."""
    pool = pool_dtype(name, compute)
    if pool != compute and pool.itemsize >= compute.itemsize:
        raise ConfigError(
            f"kv_cache_dtype={name!r} holds a {compute} model's KV in {pool}, no smaller: nothing is gained and "
            "range or precision is lost; use 'auto' (or fp8 to halve it)"
        )
    return pool


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the pool's ``dtype``: a narrower float saturates at its largest finite value."""
    if x.dtype == dtype:
        return x
    limit = torch.finfo(dtype).max
    if limit < 1e6:  # float16 and fp8; bfloat16 spans fp32's range (one op less per layer)
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def as_pool(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as a pool held in ``kv_cache_dtype`` ``name`` holds it, read back in ``x``'s dtype (``x`` itself
    when the pool keeps that dtype)."""
    pool = pool_dtype(name, x.dtype)
    return x if pool == x.dtype else encode(x, pool).to(x.dtype)


def put(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x`` ``[kv_heads, n, dim]`` into ``pool`` ``[kv_heads, slots, dim]`` at ``slots`` ``[n]``."""
    if x.dtype == pool.dtype:
        pool.index_copy_(1, slots, x)
    else:
        _bytes_view(pool).index_copy_(1, slots, _bytes_view(encode(x, pool.dtype)))


def gather(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pool[:, slots]`` ``[kv_heads, n, dim]`` in ``dtype`` (a copy)."""
    if pool.dtype == dtype:
        return pool.index_select(1, slots)
    if pool.element_size() == 1:
        return pool.view(torch.uint8).index_select(1, slots).view(pool.dtype).to(dtype)
    return pool.index_select(1, slots).to(dtype)
