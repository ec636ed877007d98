"""Model fingerprints: what must match for two engines to share cached KV."""

from __future__ import annotations

import hashlib
import json

import torch
from transformers import PreTrainedModel

from kvb_cache.config import EngineConfig
from kvb_cache.tiers.factory import codec_label

# Elements hashed from each end of every parameter: enough to tell fine-tunes and revisions apart without
# reading gigabytes of weights at start-up.
_SAMPLE = 4096


def weights_digest(model: PreTrainedModel) -> str:
    """SHA-256 over each parameter's name, shape, dtype and its first and last elements."""
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        if param.device.type == "meta" or param.numel() == 0:
            continue
        flat = param.detach().reshape(-1)
        sample = torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]]) if flat.numel() > 2 * _SAMPLE else flat
        h.update(sample.to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(model: PreTrainedModel, config: EngineConfig, *, codec: str | None = None) -> str:
    """Identity of the KV a model produces: architecture config, weights, dtype, chunking and codec.

    ``codec`` defaults to every codec ``config`` stores KV in (``"none"`` for exact KV), so quantized and
    exact entries never share a namespace.
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
        "chunk_size": config.chunk_size,
        "boundary_window": config.boundary_window,
        "codec": codec,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
