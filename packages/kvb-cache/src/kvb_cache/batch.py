"""Several prompts decoded together in padded forwards, each with its own sampling rule.

Row layout inside the batch (``C`` = longest cached prefix, ``S`` = longest uncached suffix)::

    [ pad | cached_i (c_i) ][ pad | suffix_i (s_i) ][ decoded tokens ... ]
      <------- C ------->  <-------- S -------->

Pads are masked out of attention and positions come from ``position_ids``, so every row attends to exactly
its own tokens at their own positions, as it would alone. Sliding-window models get no pads between the
two parts (see :func:`_make_contiguous`). A finished row is stored and dropped from the
batch so it costs nothing afterwards.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from transformers import Cache, DynamicCache

from kvb_cache.detokenize import IncrementalDetokenizer
from kvb_cache.forward import decode_step, prefill
from kvb_cache.generation import _Emitter, chunk_hits, token_logprob
from kvb_cache.kv import batch_cache
from kvb_cache.live_quant import layer_kv, quantize_live
from kvb_cache.results import GenerationResult, TokenLogprob
from kvb_cache.sampling import RequestProcessor, SamplingParams
from kvb_cache.stopping import StopStrings

if TYPE_CHECKING:
    from kvb_cache.engine import KVBoost
    from kvb_cache.prepared import PreparedPrompt


def _row_cache(cache: Cache, row: int, index: torch.Tensor) -> DynamicCache:
    """Row ``row`` of a batch cache, compacted to the positions in ``index`` (pads dropped)."""
    kv = [layer_kv(layer) for layer in cache.layers]
    return DynamicCache([(k[row : row + 1, :, index], v[row : row + 1, :, index]) for k, v in kv])


def _make_contiguous(engine: KVBoost, prepared: list[PreparedPrompt]) -> None:
    """Trim cached prefixes so that no row has padding between its cached part and its suffix.

    Sliding-window masks count the window in cache-index space, not in positions, so a gap of pads inside
    a row would shrink that row's window. With every row's cached part cut to ``n_i - S`` tokens
    (``S`` = longest suffix) each row is one contiguous run of tokens, left-padded: exact again, at the
    price of recomputing a few cached tokens.
    """
    longest_suffix = max(len(p.ids) - p.cached_tokens for p in prepared)
    for p in prepared:
        keep = max(0, min(p.cached_tokens, len(p.ids) - longest_suffix))
        if keep < p.cached_tokens:
            p.cache.crop(keep - p.cached_tokens)
            p.cached_tokens = keep
            p.chunks = chunk_hits(p.spans, keep)


def run_batch(
    engine: KVBoost,
    prepared: list[PreparedPrompt],
    params: list[SamplingParams],
    t0: float,
    *,
    kv_cache_bits: int | None = None,
) -> list[GenerationResult]:
    """Serve ``prepared`` in one padded batch; ``kv_cache_bits`` 8/4 holds the batch's live KV quantized
    (and stores nothing, as :meth:`KVBoost.store_sequence` explains); None keeps it as computed."""
    device = engine.device
    rows = len(prepared)
    if engine.traits.sliding_window is not None:
        _make_contiguous(engine, prepared)
    cached = [p.cached_tokens for p in prepared]
    suffix = [len(p.ids) - p.cached_tokens for p in prepared]
    width_c, width_s = max(cached), max(suffix)
    pad = engine.tokenizer.pad_token_id
    pad = pad if pad is not None else next(iter(engine.eos_token_ids), 0)

    input_ids = torch.full((rows, width_s), pad, dtype=torch.long, device=device)
    positions = torch.zeros((rows, width_s), dtype=torch.long, device=device)
    mask = torch.zeros((rows, width_c + width_s), dtype=torch.long, device=device)
    for i, p in enumerate(prepared):
        input_ids[i, width_s - suffix[i] :] = torch.tensor(p.ids[cached[i] :], device=device)
        positions[i, width_s - suffix[i] :] = torch.arange(cached[i], len(p.ids), device=device)
        mask[i, width_c - cached[i] : width_c] = 1
        mask[i, width_c + width_s - suffix[i] :] = 1
    cache: Cache = batch_cache([p.cache for p in prepared], cached, engine.traits.num_layers, input_ids)
    if kv_cache_bits is not None:
        cache = quantize_live(cache, num_layers=engine.traits.num_layers, bits=kv_cache_bits)

    processors = [
        RequestProcessor(pr, prompt_len=len(p.ids), device=device) for p, pr in zip(prepared, params)
    ]
    emitters = [
        _Emitter(
            detok=IncrementalDetokenizer(engine.tokenizer),
            stops=StopStrings(pr.stop),
            eos=frozenset() if pr.ignore_eos else engine.eos_token_ids,
            max_new=pr.max_new_tokens,
        )
        for pr in params
    ]
    outputs: list[list[int]] = [[] for _ in prepared]
    logprobs: list[list[TokenLogprob]] = [[] for _ in prepared]
    ttft = [0.0] * rows
    results: list[GenerationResult | None] = [None] * rows
    active = list(range(rows))  # batch position -> request index

    with torch.inference_mode():
        logits = prefill(
            engine.model,
            engine.traits,
            cache,
            input_ids,
            positions,
            attention_mask=mask,
            slice_size=prepared[0].prefill_chunk_size,
        )
        while active:
            finished: list[int] = []
            next_tokens = []
            for b, i in enumerate(active):
                history = torch.tensor(prepared[i].ids + outputs[i], device=device)
                token = processors[i].choose(history, logits[b])
                if params[i].logprobs is not None:
                    logprobs[i].append(token_logprob(engine, logits[b], token, params[i].logprobs))
                outputs[i].append(token)
                if len(outputs[i]) == 1:
                    ttft[i] = (time.perf_counter() - t0) * 1e3
                emitters[i].push(token, len(outputs[i]))
                next_tokens.append(token)
                if emitters[i].finish:
                    finished.append(b)
            for b in finished:
                i = active[b]
                if kv_cache_bits is None:
                    index = mask[b].nonzero().squeeze(1)
                    engine.store_sequence(
                        _sequence(engine, prepared[i].ids, outputs[i]), _row_cache(cache, b, index)
                    )
                results[i] = _result(
                    engine, prepared[i], params[i], emitters[i], outputs[i], logprobs[i], ttft[i], t0
                )
            if finished:
                keep = [b for b in range(len(active)) if b not in finished]
                if not keep:
                    break
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask = mask[index]
                active = [active[b] for b in keep]
                next_tokens = [next_tokens[b] for b in keep]
            tokens = torch.tensor(next_tokens, device=device).unsqueeze(1)
            step_positions = torch.tensor(
                [[len(prepared[i].ids) + len(outputs[i]) - 1] for i in active], device=device
            )
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
            logits = decode_step(engine.model, cache, tokens, step_positions, attention_mask=mask)
    for result in results:
        assert result is not None
        engine.record_request(result)
    return results  # type: ignore[return-value]


def _sequence(engine: KVBoost, ids: list[int], out: list[int]) -> list[int]:
    # The last generated token was never fed back, so its KV does not exist.
    return ids + out[:-1] if engine.config.store_outputs else ids


def _result(engine, prepared, params, emitter, out, logprobs, ttft_ms, t0) -> GenerationResult:
    return GenerationResult(
        output_text=emitter.text,
        output_ids=list(out),
        prompt_tokens=len(prepared.ids),
        cached_tokens=prepared.cached_tokens,
        ttft_ms=ttft_ms,
        total_ms=(time.perf_counter() - t0) * 1e3,
        finish_reason=emitter.finish or "length",
        chunks=prepared.chunks,
        logprobs=tuple(logprobs) if params.logprobs is not None else None,
        stop_reason=emitter.stop_reason,
    )
