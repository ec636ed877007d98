"""A solo request (its own ``transformers`` cache): prefill, decode loop, stop handling, store.

The engine loop advances it one event per step beside the batched forward (see ``core/engine_core.py``):
speculative decoding and per-request quantized KV need a private cache (a stitched prompt runs here only
combined with one of them; otherwise it decodes in the batched loop).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from kvb_cache.decoding import start_decode
from kvb_cache.emitter import Emitter, token_logprob
from kvb_cache.forward import decode_step, prefill
from kvb_cache.request_processor import RequestProcessor
from kvb_cache.results import ChunkHit, GenerationResult, HitKind, StreamEvent, TokenLogprob
from kvb_cache.sampling import SamplingParams

if TYPE_CHECKING:
    from kvb_cache.engine import KVBoost
    from kvb_cache.prepared import PreparedPrompt


def run(
    engine: KVBoost, prepared: PreparedPrompt, params: SamplingParams, t0: float
) -> Iterator[StreamEvent]:
    """Generate for one prompt; yields text deltas, then a final event carrying the result."""
    ids = prepared.ids
    n = len(ids)
    device = engine.device
    cache = prepared.cache
    hist = torch.empty(n + params.max_new_tokens, dtype=torch.long, device=device)
    hist[:n] = torch.tensor(ids, dtype=torch.long, device=device)
    emitter = Emitter.build(engine.tokenizer, engine.eos_token_ids, params, ids)
    processor = RequestProcessor(params, prompt_len=n, device=device, eos=emitter.stop_tokens)
    out: list[int] = []
    streamed = 0  # tokens of ``out`` already carried by an event
    logprobs_sent = 0  # entries of ``logprobs`` already carried by an event
    logprobs: list[TokenLogprob] = []
    ttft_ms = 0.0
    stored = False
    tokens: Iterator[int] | None = None
    try:
        with torch.inference_mode():
            suffix = hist[prepared.cached_tokens : n].unsqueeze(0)
            positions = torch.arange(prepared.cached_tokens, n, device=device).unsqueeze(0)
            logits = prefill(
                engine.model, engine.traits, cache, suffix, positions, slice_size=prepared.prefill_chunk_size
            )[0]
            speculative = engine.drafter is not None and params.logprobs is None
            tokens = (
                start_decode(
                    engine.drafter,
                    engine.model,
                    cache,
                    hist[:n].unsqueeze(0),
                    logits,
                    processor,
                    max_new_tokens=params.max_new_tokens,
                )
                if speculative
                else None
            )
            while True:
                if tokens is not None:
                    token = next(tokens)
                else:
                    token = processor.choose(hist[: n + len(out)], logits)
                if params.logprobs is not None:
                    logprobs.append(token_logprob(engine, logits, token, params.logprobs))
                hist[n + len(out)] = token
                out.append(token)
                if len(out) == 1:
                    ttft_ms = (time.perf_counter() - t0) * 1e3
                delta = emitter.push(token, len(out))
                if delta or emitter.finish or params.logprobs is not None:
                    # Tokens whose text was held back ride on this event (each event covers its tokens); their
                    # logprobs wait with their text (a stop string's are never sent).
                    covered = emitter.covered() if logprobs else 0
                    yield StreamEvent(
                        delta_text=delta,
                        token_ids=tuple(out[streamed:]),
                        logprobs=tuple(logprobs[logprobs_sent:covered]),
                    )
                    streamed, logprobs_sent = len(out), max(logprobs_sent, covered)
                if emitter.finish:
                    break
                if tokens is None:
                    pos = torch.tensor([[n + len(out) - 1]], device=device)
                    logits = decode_step(
                        engine.model, cache, hist[n + len(out) - 1 : n + len(out)].unsqueeze(0), pos
                    )[0]
            tokens = _close(tokens)
        stored = True
        _store(engine, prepared, ids, out, cache)
    finally:
        _close(tokens)  # a drafter's generator releases what it holds before the cache is stored
        if not stored:
            # Cancelled (the consumer closed the stream) or failed: keep what is valid, never more.
            _store(engine, prepared, ids, out, cache)
    result = GenerationResult(
        output_text=emitter.text,
        output_ids=out,
        prompt_tokens=n,
        cached_tokens=prepared.served_tokens,
        recomputed_tokens=prepared.recomputed_tokens,
        ttft_ms=ttft_ms,
        total_ms=(time.perf_counter() - t0) * 1e3,
        finish_reason=emitter.finish or "length",
        chunks=prepared.chunks,
        logprobs=tuple(logprobs[: emitter.covered()]) if params.logprobs is not None else None,
        stop_reason=emitter.stop_reason,
    )
    # The lookup counters (cache_stats' lookups / hits / partial_tokens) as the batched path records them: a
    # speculative or kv_cache_bits server reported 0 lookups and hits.
    partial = sum(c.cached_tokens for c in prepared.chunks if c.kind is HitKind.PARTIAL)
    engine.counters.record_chunks(prepared.chunks, partial_tokens=partial)
    engine.record_request(result)
    yield StreamEvent(delta_text="", result=result)


def _store(engine: KVBoost, prepared: PreparedPrompt, ids: list[int], out: list[int], cache) -> None:
    """Write the solo request's KV back to the pool, unless the pool holds a narrower dtype
    (``kv_cache_dtype``): this KV was attended in the model's own precision, and a prefix hit on it would
    not be what the same engine computes without reuse (every loop request attends its KV as the pool
    holds it)."""
    if engine.kv.storage.narrowed:
        return
    engine.store_sequence(
        prepared.storable(ids + out[:-1] if engine.config.store_outputs else ids), cache, root=prepared.root
    )


def chunk_hits(prepared_spans, cached_tokens: int) -> tuple[ChunkHit, ...]:
    """Describe each prompt span as exact / partial / miss given how many leading tokens were cached."""
    hits = []
    for span in prepared_spans:
        cached = max(0, min(span.end, cached_tokens) - span.start)
        if cached == span.length:
            kind = HitKind.EXACT
        elif cached > 0:
            kind = HitKind.PARTIAL
        else:
            kind = HitKind.MISS
        hits.append(ChunkHit(start=span.start, end=span.end, kind=kind, cached_tokens=cached))
    return tuple(hits)


def _close(tokens: Iterator[int] | None) -> None:
    """Close a speculative decoder's token iterator when it can be closed (a generator's ``finally`` runs;
    a plain iterator, which the :class:`~kvb_cache.decoding.SpeculativeDecoder` protocol allows, has nothing
    to close). Returns None, so ``tokens = _close(tokens)`` marks it closed."""
    close = getattr(tokens, "close", None)
    if close is not None:
        close()
