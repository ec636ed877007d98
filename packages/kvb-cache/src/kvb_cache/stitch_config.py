"""Options of non-prefix (stitched) reuse: how cached chunks seen after another history are repaired."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvb_cache.errors import ConfigError

RecomputeStrategy = Literal["none", "selective", "cacheblend"]
_STRATEGIES = ("none", "selective", "cacheblend")
#: ``overlap_k`` when left out: each strategy's measured setting (docs/fidelity.md, 24 RAG prompts): seam
#: tokens alone need 64 (the knee: 97.9% teacher-forced top-1 at 0.41x warm TTFT); CacheBlend's own
#: selection adds to 32 of them (cacheblend-r15-k32: 97.5%, KL 0.0045, 0.48x).
DEFAULT_OVERLAP_K = {"none": 0, "selective": 64, "cacheblend": 32}


@dataclass(frozen=True, slots=True, kw_only=True)
class StitchConfig:
    """Reuse of chunks whose tokens were cached after a *different* history (approximate).

    Pass ``EngineConfig(stitching=StitchConfig(...))`` to enable it; without it the engine only reuses exact
    prefixes and its logits equal no-cache. Exact prefix hits are never repaired either way.

    Attributes:
        recompute_strategy: ``"none"`` re-positions the stitched keys only; ``"selective"`` (the default) also
            recomputes the first ``overlap_k`` tokens after each seam (and the sink tokens); ``"cacheblend"``
            recomputes every stitched token on the layers up to ``check_layer``, then, through all layers, only
            the ``recompute_ratio`` of them whose KV deviates most there (plus the ``overlap_k`` seam tokens).
            Defaults chosen by ``tools/eval_fidelity.py`` (docs/fidelity.md): on 24 RAG prompts with SmolLM2,
            seam tokens buy more teacher-forced agreement per recomputed token than CacheBlend's selection,
            which also pays a check pass over every stitched token.
        recompute_ratio: fraction of stitched tokens CacheBlend recomputes (Yao et al. use 0.15).
        check_layer: the early layer on which CacheBlend measures each token's KV deviation (0-based).
        overlap_k: tokens right after each seam that ``selective`` and ``cacheblend`` always recompute. A seam
            is the start of a run of stitched chunks that were neighbours where they were computed (usually a
            whole document): those first tokens lost the context they were computed with. Left out: the
            strategy's measured default (:data:`DEFAULT_OVERLAP_K`: 64 selective, 32 cacheblend).
        sink_tokens: the prompt's first tokens (attention sinks), recomputed when they are stitched.
        min_reuse_tokens: a stitched chunk shorter than this is not worth a seam and is computed instead.
        keep_approximate: also keep a finished stitched request's chunks from its first stitched position on,
            as approximate entries that only stitching's content lookup finds (never a prefix hit), so a
            document first seen next to stitched ones is reused next time. Off by default: in a RAG replay it
            served 10 points more of each prompt with no fidelity loss, but on ``verify_correctness``'s
            prompts it flipped the first token of 2 of 3 stitched prompts (docs/fidelity.md).
        average_copies: a stitched token stored after several histories (a document seen in several
            prompts) gets the mean KV of up to this many of its copies, each re-positioned, instead of one
            copy's: what is particular to each foreign history partly cancels (docs/fidelity.md). Only
            independent copies (computed, not themselves stitched) that saw the prompt's own tokens as far
            back as the chosen one are averaged (:func:`kvb_cache.stitch_lookup.copy_pieces`). 1 keeps the
            single chosen copy. Costs nothing when a document has one copy. Default 2: the mean of two copies
            halved the KL on long documents; a third copy (computed right after the system prompt) made it
            worse in every group measured.
        collect_copies: a stitched run (a document) held by fewer than this many independent copies is
            computed in the request's own context instead of stitched, and that KV is kept as one more
            copy (an approximate entry when it follows stitched KV), so later prompts average them. 1 (the
            default) never computes a run it could stitch; 2 pays one more full computation of each
            document, on its second sighting, for the averaged KV of every later one.
        idle_copies: a stitched prompt one of whose runs is held by fewer than this many independent copies
            is queued to be computed exactly while the engine is idle (:mod:`kvb_cache.core.idle`: the
            server's worker between requests, or :meth:`kvb_cache.KVBoost.run_idle`): its chunks are then
            stored under its own prefix keys, so the same prompt asked again is an exact prefix hit and each
            of its documents has one more copy to average. Default 2: the fidelity of ``collect_copies=2``
            (docs/fidelity.md) without the second sighting paying for it, when the engine gets idle time. 1:
            never.
    """

    recompute_strategy: RecomputeStrategy = "selective"
    recompute_ratio: float = 0.15
    check_layer: int = 1
    overlap_k: int = None  # type: ignore[assignment]  # set in __post_init__ from the strategy
    sink_tokens: int = 4
    min_reuse_tokens: int = 16
    keep_approximate: bool = False
    average_copies: int = 2
    collect_copies: int = 1
    idle_copies: int = 2

    def __post_init__(self) -> None:
        if self.recompute_strategy not in _STRATEGIES:
            raise ConfigError(
                f"recompute_strategy must be one of {_STRATEGIES}, got {self.recompute_strategy!r}"
            )
        if self.overlap_k is None:
            object.__setattr__(self, "overlap_k", DEFAULT_OVERLAP_K[self.recompute_strategy])
        if not isinstance(self.recompute_ratio, (int, float)) or not 0.0 <= self.recompute_ratio <= 1.0:
            raise ConfigError(
                f"recompute_ratio must be a fraction in [0, 1] (e.g. 0.15), got {self.recompute_ratio!r}"
            )
        if not isinstance(self.keep_approximate, bool):
            raise ConfigError(f"keep_approximate must be a bool, got {self.keep_approximate!r}")
        for name in ("average_copies", "collect_copies", "idle_copies"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1 (1: off), got {value!r}")
        for name in ("check_layer", "overlap_k", "sink_tokens", "min_reuse_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
