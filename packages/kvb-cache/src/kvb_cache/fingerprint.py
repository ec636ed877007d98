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


def weights_digest(model: PreTrainedModel) -> str:
    """SHA-256 over each parameter's and persistent buffer's name, shape, dtype and first and last elements."""
    h = hashlib.sha256()
    tensors = list(model.named_parameters()) + _persistent_buffers(model)
    for name, param in sorted(tensors, key=lambda item: item[0]):
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        if param.device.type == "meta" or param.numel() == 0:
            continue
        flat = param.detach().reshape(-1)
        sample = torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]]) if flat.numel() > 2 * _SAMPLE else flat
        if sample.is_floating_point():
            h.update(sample.to("cpu", torch.float32).numpy().tobytes())
        else:  # packed int4 words do not survive a float32 round trip
            h.update(sample.to("cpu").contiguous().numpy().tobytes())
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
