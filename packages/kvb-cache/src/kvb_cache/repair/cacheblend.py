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

Both passes can run in slices (:class:`CacheBlendRepair`): the check pass's deviations are collected per
slice and concatenated (each is per token), the selection needs all of them, then the blend pass runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from kvb_cache.repair.recompute import RecomputeLayout, RecomputePass


class CacheBlendRepair:
    """The two passes as sliced work (:class:`~kvb_cache.repair.recompute.RepairWork`).

    Args:
        layers: per layer ``[keys, values]``, each ``[1, kv_heads, N, head_dim]`` (repaired in place).
        stitched: positions holding stitched (cached) KV.
        forced: positions always recomputed through all layers (gaps, seams).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layers: list[list[torch.Tensor]],
        ids: Sequence[int],
        *,
        stitched: Sequence[int],
        forced: Sequence[int],
        layout: RecomputeLayout,
        recompute_ratio: float,
        check_layer: int,
    ) -> None:
        self._recompute = (model, layers, ids)
        self._layout = layout
        self._stitched = list(stitched)
        self._forced = set(forced)
        self._ratio = recompute_ratio
        candidates = [p for p in stitched if p not in self._forced]
        self._num_candidates = len(candidates)
        self.check: RecomputePass | None = None
        self.blend: RecomputePass | None = None
        if candidates and recompute_ratio > 0 and check_layer < len(layers) - 1:
            every = sorted(self._forced | set(candidates))
            self.check = RecomputePass(
                model, layers, ids, every, layout, last_layer=check_layer, capture_layer=check_layer
            )
        else:
            # A check layer that is the last costs a full pass: then every candidate is recomputed.
            self._start_blend(candidates if candidates and recompute_ratio > 0 else [])

    @property
    def done(self) -> bool:
        return self.blend is not None and self.blend.done

    def run(self, budget: int | None = None) -> int:
        ran = 0
        if self.blend is None:
            assert self.check is not None
            ran = self.check.run(budget)
            if not self.check.done:
                return ran
            self._select(self.check)
            if budget is not None:
                budget -= ran
                if budget <= 0:
                    return ran
        assert self.blend is not None
        return ran + self.blend.run(budget)

    @property
    def repaired(self) -> list[int]:
        """The stitched positions recomputed through all layers (selected or forced), ascending."""
        assert self.blend is not None, "the check pass has not finished"
        stitched = set(self._stitched)
        return [p for p in self.blend.positions if p in stitched]

    def _select(self, check: RecomputePass) -> None:
        """The top ``recompute_ratio`` candidates by check-layer deviation (the HKVD tokens)."""
        deviation = check.deviation()
        assert deviation is not None
        every = torch.tensor(check.positions, dtype=torch.long)
        is_candidate = torch.tensor([p not in self._forced for p in check.positions], device=deviation.device)
        scores = deviation.masked_fill(~is_candidate, float("-inf"))
        k = min(self._num_candidates, max(1, round(self._ratio * len(self._stitched))))
        top = torch.topk(scores, k).indices.cpu()
        self._start_blend(every[top].tolist())

    def _start_blend(self, selected: list[int]) -> None:
        model, layers, ids = self._recompute
        self.blend = RecomputePass(model, layers, ids, sorted(self._forced | set(selected)), self._layout)
