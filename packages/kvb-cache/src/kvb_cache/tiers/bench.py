"""Cold prefill against restoring the same prefix from each tier (``kvboost cache bench``)."""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvb_cache.config import EngineConfig
from kvb_cache.engine import KVBoost
from kvb_cache.errors import InvalidRequestError
from kvb_cache.tiers.config import TierConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreTiming:
    """Median milliseconds to the next-token logits of a ``tokens``-long prompt, by where its KV came from.

    ``source`` is ``"cold"`` (full prefill), ``"ram"``, ``"disk"`` or ``"redis"`` (RAM emptied before each
    run, so the chain is read from that tier, decoded and promoted). ``cached_tokens`` is what was reused.
    """

    tokens: int
    source: str
    median_ms: float
    cached_tokens: int
    speedup: float


def _median_ms(run: Callable[[], int], repeats: int, before: Callable[[], None]) -> tuple[float, int]:
    times, cached = [], 0
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        cached = run()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), cached


@contextlib.contextmanager
def _pool_warning_off() -> Iterator[None]:
    """The engine's "pool holds fewer tokens than the model's context" warning, off while a bench engine is
    built: the pools are sized to the prompt on purpose, and the warning advised flags (--num-blocks,
    --max-cache-bytes) this command does not take."""
    log = logging.getLogger("kvb_cache.engine")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def bench_restore(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    *,
    lengths: Sequence[int],
    remote_url: str | None = None,
    disk_cache_dir: str | None = None,
    kv_cache_bits: int = 16,
    repeats: int = 3,
) -> list[RestoreTiming]:
    """Time cold prefill and restores from RAM, disk and (when ``remote_url``) Redis, in the same run.

    For each length ``n`` the first ``n`` tokens are warmed, then the ``n + 1``-token prompt is timed: its
    whole ``n``-token prefix is restored (assembled from RAM, or read, verified, decoded and promoted from a
    lower tier) and one token is prefilled, which is what a request that extends a cached prefix pays.
    Cold computes all ``n + 1`` tokens. Redis records are left in place (namespaced by fingerprint).
    """
    rows: list[RestoreTiming] = []
    with tempfile.TemporaryDirectory(prefix="kvb-bench-") as tmp:
        folder = disk_cache_dir or tmp
        tiers = {"ram": None, "disk": TierConfig(disk_cache_dir=folder)}
        if remote_url:
            tiers["redis"] = TierConfig(remote_url=remote_url, remote_timeout_s=10.0)
        for n in lengths:
            ids = list(prompt_ids[: n + 1])
            if len(ids) < n + 1:
                raise InvalidRequestError(
                    f"the benchmark text has only {len(prompt_ids)} tokens; lower --lengths"
                )
            # Pools sized to the prompt: the derived ones (256 MiB with reuse off, the byte budget with it on)
            # held 5824 SmolLM2 tokens, so --lengths 6000 failed inside the model's context, advising a
            # --num-blocks this command does not take.
            blocks = -(-(n + 2) // EngineConfig().block_size) + 1
            with _pool_warning_off():
                cold = KVBoost(
                    model,
                    tokenizer,
                    config=EngineConfig(max_cache_bytes=0, kv_cache_bits=16, num_blocks=blocks),
                )
            cold_ms, _ = _median_ms(
                lambda e=cold, p=ids: e.next_token_logits(p).cached_tokens, repeats, lambda: None
            )
            rows.append(
                RestoreTiming(tokens=n, source="cold", median_ms=cold_ms, cached_tokens=0, speedup=1.0)
            )
            for source, tier in tiers.items():
                config = EngineConfig(kv_cache_bits=kv_cache_bits, tiers=tier, num_blocks=blocks)
                with _pool_warning_off():
                    engine = KVBoost(model, tokenizer, config=config)
                engine.warm(ids[:n])
                engine.flush()
                # Empty RAM (the pool's cached blocks) before each run so the chain comes from the tier
                # under test.
                reset = engine.clear_cache if tier is not None else (lambda: None)
                ms, cached = _median_ms(
                    lambda e=engine, p=ids: e.next_token_logits(p).cached_tokens, repeats, reset
                )
                rows.append(
                    RestoreTiming(
                        tokens=n, source=source, median_ms=ms, cached_tokens=cached, speedup=cold_ms / ms
                    )
                )
                engine.close()
    return rows


def format_table(rows: Sequence[RestoreTiming]) -> str:
    lines = [f"{'tokens':>7} {'source':>6} {'median ms':>10} {'cached':>7} {'speedup':>8}"]
    lines += [
        f"{r.tokens:>7} {r.source:>6} {r.median_ms:>10.1f} {r.cached_tokens:>7} {r.speedup:>7.1f}x"
        for r in rows
    ]
    return "\n".join(lines)
