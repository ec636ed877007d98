"""How much a codec changes KV: signal-to-noise ratio and bytes against a dense reference."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvb_cache.codecs.base import EncodedKV


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """``10 log10(sum(ref^2) / sum((ref - approx)^2))`` in dB (``inf`` when identical)."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def chunk_snr_db(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], encoded: EncodedKV) -> float:
    """SNR over every key and value of a chunk, each layer decoded from ``encoded``."""
    ref = torch.cat([t.double().flatten() for pair in kv for t in pair])
    approx = torch.cat([t.double().flatten() for i in range(encoded.num_layers) for t in encoded.layer(i)])
    return snr_db(ref, approx)


def bytes_ratio(
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]], encoded: EncodedKV, *, element_size: int = 2
) -> float:
    """Encoded bytes (codes, scales and zero points) over the dense bytes at ``element_size`` (2 = fp16)."""
    dense = sum(t.numel() * element_size for pair in kv for t in pair)
    return encoded.nbytes / dense
