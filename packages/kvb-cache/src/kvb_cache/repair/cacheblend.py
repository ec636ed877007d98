"""CacheBlend (Yao et al., EuroSys 2025): recompute only the stitched tokens whose KV deviates most.

Two passes over the model's own forward (see :mod:`kvb_cache.repair.recompute`):

1. *Check pass*: every stitched (and uncached) token through layers ``0..check_layer`` only. Those layers
   now hold fresh KV for all of them, and on ``check_layer`` we measure per token
   ``||K_fresh - K_cached||^2 + ||V_fresh - V_cached||^2`` (high-KV-deviation tokens, "HKVD").
2. *Blend pass*: the top ``recompute_ratio`` stitched tokens by deviation, the forced ones (seam overlap,
   sinks) and the uncached gaps through *all* layers; every other stitched token keeps its cached KV on
   layers after ``check_layer``.

Cost: ``(check_layer + 1) / L`` of a forward over the stitched tokens plus a full forward over about
``recompute_ratio`` of them, instead of a full prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from kvb_cache.repair.recompute import RecomputeLayout, recompute_tokens


def cacheblend_repair(
    model: PreTrainedModel,
    layers: list[list[torch.Tensor]],
    ids: Sequence[int],
    *,
    stitched: Sequence[int],
    forced: Sequence[int],
    layout: RecomputeLayout,
    recompute_ratio: float,
    check_layer: int,
) -> list[int]:
    """Repair ``stitched`` positions in place; ``forced`` positions (gaps, seams) are always recomputed.

    Returns:
        The stitched positions recomputed through all layers (selected or forced), ascending.
    """
    forced_set = set(forced)
    num_layers = len(layers)
    candidates = [p for p in stitched if p not in forced_set]
    selected: list[int] = []
    if candidates and recompute_ratio > 0 and check_layer < num_layers - 1:
        every = torch.tensor(sorted(forced_set | set(candidates)), dtype=torch.long)
        deviation = recompute_tokens(
            model, layers, ids, every, layout, last_layer=check_layer, capture_layer=check_layer
        )
        assert deviation is not None
        is_candidate = torch.tensor([p not in forced_set for p in every.tolist()], device=deviation.device)
        scores = deviation.masked_fill(~is_candidate, float("-inf"))
        k = min(len(candidates), max(1, round(recompute_ratio * len(stitched))))
        top = torch.topk(scores, k).indices.cpu()
        selected = every[top].tolist()
    elif candidates and recompute_ratio > 0:
        selected = candidates  # the check layer is the last: checking costs a full pass, so recompute all
    final = torch.tensor(sorted(forced_set | set(selected)), dtype=torch.long)
    recompute_tokens(model, layers, ids, final, layout)
    stitched_set = set(stitched)
    return [p for p in final.tolist() if p in stitched_set]
