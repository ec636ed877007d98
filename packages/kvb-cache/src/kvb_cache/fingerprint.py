"""Model fingerprints: what must match for two engines to share cached KV."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import PreTrainedModel

from kvb_cache.config import EngineConfig
from kvb_cache.core.kv_dtype import pool_dtype
from kvb_cache.tiers.factory import codec_label

#: Elements per reduction step of :func:`_device_checksums` (a few int64 temporaries of this size).
_CHUNK = 1 << 22
#: The checksums' modulus (a Mersenne prime: chunk sums stay exact in int64).
_PRIME = (1 << 61) - 1
#: Integer views of a tensor's bytes, by element size: the checksums read bit patterns, never values.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # other sizes: bytes


def _persistent_buffers(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """Buffers saved with the checkpoint: quantized models (AWQ layers, kvb-streaming) keep their int4
    weights, zeros and scales as buffers, so two checkpoints can differ only there. Non-persistent buffers
    (rotary tables, causal masks) are derived from the config, which is hashed already."""
    found = []
    for module_name, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                found.append((f"{module_name}.{name}" if module_name else name, buf))
    return found


#: Attribute of a model holding weights outside its parameters and buffers: a callable returning
#: ``(name, tensor)`` pairs (kvb-streaming's streamed layers live in packed host buffers, bound to their
#: modules only while they run), so they are fingerprinted too.
EXTRA_WEIGHTS_ATTR = "kvb_extra_weights"


def weights_digest(model: PreTrainedModel) -> str:
    """SHA-256 over each parameter's and persistent buffer's name, shape, dtype and **every** element.

    Two checkpoints that differ in a single element get different digests: sampling a few elements per
    tensor (the first and last 4096, before) let a model whose edit lay inside a tensor (one embedding row,
    a slice of a projection) read another's disk and Redis records as exact hits. CPU tensors are hashed
    byte for byte, on a few threads (hashlib releases the GIL; about 0.3 s for SmolLM2-135M in fp32 on one
    core); tensors on an accelerator are reduced where they live to exact integer checksums
    (:func:`_device_checksums`) instead of being copied to the host. Weights a model keeps outside its
    modules (:data:`EXTRA_WEIGHTS_ATTR`) are included.
    """
    tensors = list(model.named_parameters()) + _persistent_buffers(model)
    extra = getattr(model, EXTRA_WEIGHTS_ATTR, None)
    if callable(extra):
        tensors += [(f"extra:{name}", t) for name, t in extra()]
    tensors = sorted(tensors, key=lambda item: item[0])
    on_host = [t.detach() for _, t in tensors if _hashable(t) and t.device.type == "cpu"]
    workers = max(1, min(8, os.cpu_count() or 1, len(on_host)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        host_digests = iter(list(pool.map(_bytes_digest, on_host)))
    h = hashlib.sha256()
    for name, tensor in tensors:
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if not _hashable(tensor):
            continue
        if tensor.device.type == "cpu":
            h.update(b"bytes:" + next(host_digests))
        else:
            h.update(b"checksums:" + _device_checksums(tensor.detach().reshape(-1)))
    return h.hexdigest()


def _hashable(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "meta" and tensor.numel() > 0


def _bytes_digest(tensor: torch.Tensor) -> bytes:
    """SHA-256 of a CPU tensor's bytes (any dtype: read as raw bytes, never as values)."""
    flat = tensor.reshape(-1).contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).digest()


def _device_checksums(flat: torch.Tensor) -> bytes:
    """Two position-weighted sums of ``flat``'s bit patterns modulo a 61-bit prime, computed on its device.

    ``flat``: ``[n]``, any dtype. Each element's bits split into 16-bit halves ``lo`` and ``hi``; the sums
    are ``sum(lo * a + hi * b)`` and ``sum(lo * b + hi * a)`` with per-position weights ``a`` odd and ``b``
    even (so never equal) below 2**20: every product stays below 2**37 and a chunk's sum below 2**59, exact
    in int64. Changing one element changes both sums unless both of its halves' changes cancel in both, which
    distinct weights rule out. Checksums, not a cryptographic hash: they tell checkpoints apart, they do not
    resist an adversary crafting a collision.
    """
    bits = flat.contiguous().view(_BITS.get(flat.element_size(), torch.uint8))
    mask = (1 << (8 * bits.element_size())) - 1
    totals = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        word = bits[start : start + _CHUNK].to(torch.int64) & mask
        lo, hi = word & 0xFFFF, word >> 16
        pos = torch.arange(start, start + word.numel(), dtype=torch.int64, device=flat.device)
        a = 2 * ((pos * 40503 + 12345) % 524287) + 1
        b = 2 * ((pos * 69069 + 1013) % 524269) + 2
        sums = torch.stack([(lo * a + hi * b).sum(), (lo * b + hi * a).sum()])
        totals = (totals + sums % _PRIME) % _PRIME
    return totals.cpu().numpy().tobytes()


def model_fingerprint(model: PreTrainedModel, config: EngineConfig, *, codec: str | None = None) -> str:
    """Identity of the KV a model produces: architecture config, weights, dtype and codec.

    ``codec`` defaults to every codec ``config`` stores KV in (``"none"`` for exact KV), so quantized and
    exact entries never share a namespace. Chunking is left out: a record's key is the prefix hash of its
    own tokens (a block's, or a chunk's), so records cut differently never share a key, and records cut
    alike hold the same KV. With ``chunk_size`` in it, an engine with stitching (32-token chunks) and one
    without (128) shared no disk/Redis record, although both write 16-token blocks.
    """
    if codec is None:
        codec = codec_label(config)
    cfg = model.config.to_dict()
    volatile = (
        "_name_or_path",
        "transformers_version",
        "_commit_hash",
        "_attn_implementation_autoset",
        # Set by the first engine's install_paged_attention: without this, a second engine on the same model
        # object got another fingerprint (and missed every record the first one wrote).
        "kvb_fallback_attn_implementation",
    )
    for key in volatile:
        cfg.pop(key, None)
    payload = {
        "class": type(model).__name__,
        "config": cfg,
        "weights": weights_digest(model),
        "dtype": str(model.dtype),
        "codec": codec,
    }
    pool = pool_dtype(config.kv_cache_dtype, model.dtype)
    if pool != model.dtype:
        # KV rounded to the pool's precision is not the model's: no record or prefix key in common. By the
        # dtype itself ("fp8" and "fp8_e4m3" are one), and left out when the pool keeps the model's dtype, so
        # the records written before the option existed keep their keys.
        payload["kv_cache_dtype"] = str(pool)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
