"""Building the engine loop's :class:`~kvb_cache.core.request.Request` for a tokenized prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvb_cache.core.outputs import RequestId
from kvb_cache.core.request import Request
from kvb_cache.emitter import Emitter
from kvb_cache.hashing import ChunkHash
from kvb_cache.request_processor import RequestProcessor
from kvb_cache.sampling import SamplingParams

if TYPE_CHECKING:
    from kvb_cache.engine import KVBoost


def new_request(
    engine: KVBoost,
    rid: RequestId,
    ids: list[int],
    params: SamplingParams,
    t0: float,
    *,
    prefill_chunk_size: int | None = None,
    root: ChunkHash | None = None,
) -> Request:
    """A loop request with its sampling processor and text emitter (``root``: its salted chain root)."""
    emitter = Emitter.build(engine.tokenizer, engine.eos_token_ids, params, ids)
    return Request(
        request_id=rid,
        tokens=list(ids),
        prompt_len=len(ids),
        params=params,
        processor=RequestProcessor(
            params, prompt_len=len(ids), device=engine.device, eos=emitter.stop_tokens
        ),
        emitter=emitter,
        arrival=t0,
        prefill_chunk_size=prefill_chunk_size,
        spans=tuple(engine.chunker.split(ids)),
        root=root,
    )
