"""The KVBoost engine: chunk-level KV reuse around a Hugging Face causal LM."""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections import deque
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvb_cache.chat import render_chat
from kvb_cache.chunking import Chunker, natural_break_ids
from kvb_cache.config import DEFAULT_MAX_CACHE_BYTES, EngineConfig
from kvb_cache.core.build import build_loop
from kvb_cache.core.engine_core import EngineCore
from kvb_cache.core.kv_storage import LayerShape
from kvb_cache.core.outputs import RequestId, RequestOutput
from kvb_cache.decoding import SpeculativeDecoder, StepDrafter
from kvb_cache.detokenize import token_text as piece_text
from kvb_cache.engine_args import EngineArgs, seed_torch
from kvb_cache.engine_inputs import check_engine_inputs
from kvb_cache.errors import ConfigError, ContextLengthError
from kvb_cache.fingerprint import model_fingerprint
from kvb_cache.gpu_budget import apply_utilization, check_cuda_device
from kvb_cache.hashing import ChunkHash, root_hash, salted_root
from kvb_cache.hf_bridge import HFCacheBridge
from kvb_cache.idle_work import IdleWork
from kvb_cache.lifecycle import EngineLifecycle, weak_method
from kvb_cache.loading import load_model_and_tokenizer
from kvb_cache.logit_queries import LogitQueries
from kvb_cache.loop_api import LoopAPI
from kvb_cache.loops import EngineLoops
from kvb_cache.model_traits import cap_context, inspect_model
from kvb_cache.options import pick_keywords
from kvb_cache.prepared import Prompt
from kvb_cache.request_checks import check_cache_salt, check_context, tokenize_prompt
from kvb_cache.scoring import SLICE
from kvb_cache.serialized import new_engine_lock, serialized
from kvb_cache.stats import EngineCounters
from kvb_cache.step_limits import StepLimits, step_limits
from kvb_cache.stitch_config import StitchConfig
from kvb_cache.stitching import Stitcher
from kvb_cache.store import ChunkStore
from kvb_cache.structured.backend import GrammarCache
from kvb_cache.tiers import DEFAULT_DISK_CACHE_BYTES, DEFAULT_REMOTE_TIMEOUT_S, TieredStore
from kvb_cache.transfers import CacheTransfers

logger = logging.getLogger(__name__)


class KVBoost(LoopAPI, EngineLoops, LogitQueries, CacheTransfers, EngineLifecycle, HFCacheBridge, IdleWork):
    """Generation with content-addressed, chunk-level KV reuse across requests.

    Every request runs through one iteration-level loop (:meth:`add_request` / :meth:`step` /
    :meth:`abort`) over a paged KV block pool: full blocks are keyed by the hash of their tokens *and
    everything before them*, so a prompt's cached prefix maps onto shared blocks with no copy and only the
    rest is prefilled, exactly as a no-cache run would compute it. Finished requests leave their blocks
    cached (generated text included) for the next turn. :meth:`generate`, :meth:`stream`,
    :meth:`generate_batch` and :meth:`warm` are loops over it; several of them may interleave (open
    streams share steps).

    Tenants: a request's ``cache_salt`` roots its hash chain, so requests with different salts (or a salt
    and none) never share cached KV in any tier; equal salts share as unsalted requests do.

    Lifecycle: :meth:`close` (or ``with``) drains queued disk/Redis writes and closes the tiers; an engine
    still alive at interpreter exit is closed by an ``atexit`` hook, bounded by
    ``TierConfig.exit_flush_timeout_s``. :meth:`reset_cache` forgets every cached prefix (admin).

    Threads: one engine may be called from several threads; each engine operation (a step, an
    ``add_request``, a cache reset) runs under the engine's lock, and library loops take it one step at a
    time, so several threads' ``generate`` calls share batched steps (:mod:`kvb_cache.serialized`).

    The model: the engine is built for its dtype, device and weights. Moving it to another dtype or device
    afterwards is refused (``ConfigError``, build a new engine); changing its weights in place
    (``load_state_dict``, training steps) is not detected: call :meth:`reset_cache` with
    ``lower_tiers=True`` (or build a new engine), or the KV cached from the old weights is served.
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
        check_engine_inputs(model, tokenizer, config)
        self._engine_lock = new_engine_lock()  # serialized.py: engine calls from several threads
        self.model = model.eval()
        self._built_for = (model.dtype, model.device)  # checked by add_request (LoopAPI._check_model_unmoved)
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.traits = cap_context(inspect_model(model), self.config.max_model_len)
        self._drafter: SpeculativeDecoder | None = None
        self.drafter = drafter
        self.model_name = model_name or getattr(model.config, "name_or_path", None) or type(model).__name__
        breaks = natural_break_ids(tokenizer) if self.config.boundary_window else frozenset()
        self.chunker = Chunker(self.config.chunk_size, self.config.boundary_window, breaks)
        self.fingerprint = model_fingerprint(model, self.config)
        self.root = root_hash(self.fingerprint)
        self.counters = EngineCounters()
        self._token_text: dict[int, str] = {}
        # The paged pool is the RAM cache (cached chunks are cached blocks); disk/Redis tiers sit under it.
        parts = build_loop(model, self.traits, self.config, root=self.root, fingerprint=self.fingerprint)
        self._built_attention = getattr(model.config, "_attn_implementation", None)  # kvb_paged, checked too
        self.kv, self.tiers = parts.kv, parts.tiers
        _warn_if_the_pool_caps_the_context(
            self.kv.capacity_tokens, self.traits.context_length, caching=self.config.max_cache_bytes > 0
        )
        # The core calls back into the engine through weak references: a cycle engine <-> core would keep
        # the block pool (2 GiB by default) alive after `del engine` until the cyclic collector happens by.
        self.core = EngineCore(
            parts.scheduler,
            parts.kv,
            parts.runner,
            weakref.proxy(self),
            build_result=weak_method(self._paged_result),
            before_free=weak_method(self._store_approximate),
            after_prefill=weak_method(self._prompt_computed),
            plan_deferred=weak_method(self._queue_stitched),
            make_idle=weak_method(self._make_idle),
        )
        self.drafter = drafter  # now that the core exists: it verifies drafts inside its step
        # Non-prefix reuse needs chunks indexed by content: with stitching on, finished requests also store
        # their chunks in a ChunkStore (its own max_cache_bytes budget) that the stitcher searches.
        self.store = store if store is not None else ChunkStore(self.config.max_cache_bytes)
        if isinstance(self.store, TieredStore):
            if self.store.shapes is None:
                # Built without a model (build_store): check the records it promotes against this model's KV.
                self.store.shapes = self.kv.storage.shapes
            elif tuple(self.store.shapes) != tuple(self.kv.storage.shapes):
                raise ConfigError(
                    "store= is a TieredStore built for another KV layout (its shapes= differ from this "
                    "model's): it would drop every record it promotes. Build it with shapes=None (the engine "
                    "fills them in) or with this model's probe_layer_shapes(model)."
                )
        # response_format: compiled grammars per (grammar, tokenizer); llguidance is imported on first use.
        self.grammars = GrammarCache()
        self.stitcher = Stitcher(
            model,
            self.traits,
            self.store,
            self.root,
            self.config.stitching,
            chunk_size=self.config.chunk_size,
            boundary_window=self.chunker.boundary_window,
            kv_cache_dtype=self.config.kv_cache_dtype,
        )
        self._ids = itertools.count()
        # Outputs of requests followed by library loops (stream/generate), until their loop reads them.
        self._mailbox: dict[RequestId, deque[RequestOutput]] = {}
        # Requests those loops follow; outputs of the others (a server's) wait for take_unfollowed_outputs().
        self._followed: set[RequestId] = set()
        self._unfollowed: list[RequestOutput] = []
        self._register_exit_flush()

    @property
    def drafter(self) -> SpeculativeDecoder | None:
        """The speculative decoder (None: none). One that is also a :class:`~kvb_cache.decoding.StepDrafter`
        (kvb-speculative's) has greedy requests' drafts verified inside the batched step; the others (and
        sampled requests) decode solo when they arrive alone. Settable after construction (the kvboost
        meta-package composes its drafter once the engine is built)."""
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: SpeculativeDecoder | None) -> None:
        if drafter is not None and not isinstance(drafter, SpeculativeDecoder):
            raise TypeError(
                "drafter must have a decode(model, cache, input_ids, next_logits, processor) method"
            )
        self._drafter = drafter
        core = getattr(self, "core", None)
        if core is not None:
            core.drafter = drafter if isinstance(drafter, StepDrafter) else None

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str,
        *,
        chunk_size: int | None = None,
        boundary_window: int = 0,
        max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        attn_implementation: str | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        tokenizer: str | None = None,
        seed: int | None = None,
        drafter: SpeculativeDecoder | None = None,
        kv_cache_bits: int = 16,
        kv_group_size: int = 32,
        disk_cache_dir: str | os.PathLike[str] | None = None,
        disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES,
        remote_url: str | None = None,
        remote_codec: str | None = None,
        remote_ttl_s: int | None = None,
        remote_timeout_s: float = DEFAULT_REMOTE_TIMEOUT_S,
        stitching: StitchConfig | None = None,
        recompute_strategy: str | None = None,
        collect_copies: int | None = None,
        idle_copies: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 1024,
        scheduling_policy: str = "fcfs",
        prefill_chunk_size: int | None = None,
        exit_flush_timeout_s: float = 10.0,
    ) -> KVBoost:
        """Load a model and tokenizer and wrap them.

        Every keyword is a field of :class:`kvb_cache.EngineArgs` (its help text is the full reference).

        Args:
            model_name_or_path: a local folder, a hub id already in the local Hugging Face cache, or
                ``"smollm2-135m"`` for the embedded model (``kvb_cache.embedded.INSTALL_HINT``).
            device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default CUDA when available.
            dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype; default the checkpoint's.
            attention_backend: the engine loop's attention over the block pool: ``"kvb_kernels"``
                (kvb-kernels' Triton kernel reads the blocks in place; CUDA), ``"sdpa"`` (gather + SDPA) or
                ``"auto"`` (the kernel on CUDA when installed).
            enforce_eager: no CUDA graphs (vLLM's); by default decode-only steps on CUDA replay captured graphs.
            kv_cache_dtype: precision the block pool holds KV in (vLLM's): ``"auto"`` (the model's),
                ``"bfloat16"``, ``"float16"``, ``"fp8"`` / ``"fp8_e4m3"``, ``"fp8_e5m2"``.
            max_model_len: most prompt + generated tokens per request, below the model's context (vLLM's);
                None: the model's context.
            tokenizer: the tokenizer's folder or cached hub id when it is not the model's (vLLM's).
            seed: seed torch's global generators once the model is loaded (vLLM's ``seed``): sampling
                without a request seed draws from them. None: not seeded.
            kv_cache_bits: 16 stores KV as computed (exact); 8 or 4 store disk/Redis records KIVI-quantized
                (the RAM block pool holds KV in ``kv_cache_dtype``).
            kv_group_size: quantization group for ``kv_cache_bits`` 8/4.
            disk_cache_dir: folder of a disk tier under RAM (survives restarts); None: no disk tier.
            disk_cache_bytes: byte budget of the disk tier.
            remote_url: ``redis://host:port/db`` of a Redis shared by engine processes
                (``pip install "kvb-cache[redis]"``); None: no remote tier.
            remote_codec: ``"absmax8"`` to send Redis records through the int8 wire codec (lossy).
            remote_ttl_s: expire Redis records after this many seconds (None: no TTL).
            remote_timeout_s: connect/read timeout of every Redis call (a miss past it).
            stitching: reuse chunks cached after a *different* history too (approximate; see
                :class:`kvb_cache.StitchConfig`). None: exact prefix reuse only.
            recompute_strategy: shorthand for ``stitching=StitchConfig(recompute_strategy=...)``:
                ``"none"``, ``"selective"`` or ``"cacheblend"``.
            collect_copies: with stitching, ``StitchConfig.collect_copies`` (compute a document held by
                fewer stored copies, and keep it, so later prompts average them).
            idle_copies: with stitching, ``StitchConfig.idle_copies`` (compute such a stitched prompt
                exactly while the engine is idle: :meth:`run_idle`); 1: never.
            block_size, num_blocks, max_num_seqs, max_num_batched_tokens, prefill_chunk_size: the paged pool
                and the scheduler (see :class:`EngineConfig`).
            gpu_memory_utilization: size the pool so that the weights, one profiled step and the pool take
                this fraction of the CUDA device's memory (vLLM's; CUDA only; instead of ``num_blocks``).
            exit_flush_timeout_s: how long :meth:`close` and the interpreter-exit hook wait for queued
                disk/Redis writes.
        """
        # The keywords above are EngineArgs' fields, spelled out for readers and type checkers; a test
        # fails when they drift apart.
        args = EngineArgs(**pick_keywords(EngineArgs, locals()))
        return cls.from_engine_args(model_name_or_path, args)

    @classmethod
    def from_engine_args(cls, model_name_or_path: str, args: EngineArgs) -> KVBoost:
        """:meth:`from_pretrained` with its options as one :class:`kvb_cache.EngineArgs`."""
        config = args.engine_config()  # before the model loads: a bad option fails fast
        if args.gpu_memory_utilization is not None:
            check_cuda_device(args.device)
        loaded = load_model_and_tokenizer(
            model_name_or_path,
            device=args.device,
            dtype=args.dtype,
            attn_implementation=args.attn_implementation,
            tokenizer=args.tokenizer,
            max_model_len=args.max_model_len,
        )
        seed_torch(args.seed)
        config = apply_utilization(loaded.model, config, args.gpu_memory_utilization)
        return cls(
            loaded.model, loaded.tokenizer, config=config, drafter=args.drafter, model_name=loaded.name
        )

    # ----------------------------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def context_length(self) -> int:
        """Most prompt + generated tokens one request may take: the model's context window, capped by what
        the KV block pool holds (``num_blocks * block_size``), as vLLM's ``max_model_len`` is by its cache.
        The server reports it as ``max_model_len`` and shrinks a default ``max_tokens`` to it."""
        pool = self.kv.capacity_tokens
        model = self.traits.context_length
        return pool if model is None else min(model, pool)

    @property
    def kv_layer_shapes(self) -> tuple[LayerShape, ...]:
        """Per decoder layer holding keys/values of its own, the shape the pool keeps per token (KV-shared
        layers of Gemma 3n / Gemma 4 E2B hold none); what a memory plan should count."""
        return self.kv.storage.shapes

    @property
    def step_limits(self) -> StepLimits:
        """What bounds the memory one engine step adds beside the pool (a memory planner's input:
        kvb-planner's ``PagedLoop`` takes its fields)."""
        rows = self.config.running_seqs
        if self.core.drafter is not None:  # a speculating request keeps a logits row per draft, and one more
            rows = min(self.config.max_num_batched_tokens, rows * (1 + self.core.drafter.gamma))
        return step_limits(
            self.model,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.running_seqs,
            sampled_rows=rows,
            context=self.context_length or self.config.max_num_batched_tokens,
            logits_to_keep=self.traits.logits_to_keep,
            solo_paths=self.drafter is not None or self.stitcher.enabled,
            score_slice_tokens=self.config.prefill_chunk_size or SLICE,
        )

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
            text = self._token_text[token_id] = piece_text(self.tokenizer, token_id)
        return text

    # ----------------------------------------------------------------------------------- public API
    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        content_format: str = "auto",
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the tokenizer's chat template.

        ``tools``: function definitions (OpenAI's ``{"type": "function", "function": {...}}``) handed to the
        template, for templates that render tools themselves (Qwen2.5, Llama 3.x, Mistral).
        ``continue_final_message``: leave the last (assistant) message open so generation continues it
        (instead of a generation prompt). ``chat_template_kwargs``: extra template variables, e.g. Qwen3's
        ``{"enable_thinking": False}`` (vLLM's request field). ``content_format``: a message's content
        reaches the template as one string (``"string"``) or a list of text parts (``"openai"``); ``"auto"``
        reads which from the template's source (vLLM's ``--chat-template-content-format``;
        :mod:`kvb_cache.chat_content`).
        """
        return render_chat(
            self.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            content_format=content_format,
        )

    @serialized
    def cache_stats(self) -> dict[str, Any]:
        """Pool, reuse and tier counters (JSON-safe)."""
        paged = self.paged_stats()
        stats = {
            "entries": paged.blocks_used + paged.blocks_cached,
            "bytes": (paged.blocks_used + paged.blocks_cached) * self._block_bytes,
            "max_bytes": paged.blocks_total * self._block_bytes,
            "inserts": self.kv.pool.registrations,
            "evictions": self.kv.pool.evictions,
            "block_size": paged.block_size,
            "chunk_size": self.config.chunk_size,
            # What the loop attends with, resolved from ``attention_backend`` (``auto`` names neither).
            "attention_backend": "sdpa" if self.core.runner.kernel is None else "kvb_kernels",
            "kv_cache_dtype": self.config.kv_cache_dtype,
            # Whether blocks are kept for reuse (off with max_cache_bytes=0: the pool then serves requests only).
            "prefix_caching": self.kv.caching,
            # None when every step runs eagerly (enforce_eager, or not on CUDA).
            "cuda_graphs": None if self.core.runner.graphs is None else self.core.runner.graphs.stats(),
            **self.counters.as_dict(),
            "paged": paged.as_dict(),
            "stitching": {**self.stitcher.stats(), "idle": self.idle_stats()},
        }
        if self.tiers is not None:
            stats["tiers"] = [t.as_dict() for t in self.tiers.stats()]
        return stats

    @serialized
    def clear_cache(self) -> None:
        """Forget every cached block (RAM); lower tiers keep their records. See also :meth:`reset_cache`."""
        self.core.clear_idle()
        self.kv.clear()
        self.store.clear()

    # ----------------------------------------------------------------------------------- internals
    @property
    def _block_bytes(self) -> int:
        storage = self.kv.storage
        return sum(
            k[:, : storage.block_size].nbytes + v[:, : storage.block_size].nbytes
            for k, v in zip(storage.keys, storage.values)
        )

    @property
    def _logits_width(self) -> int:
        head = self.model.get_output_embeddings()
        return head.weight.shape[0] if head is not None else self.model.config.get_text_config().vocab_size

    def _salted_root(self, cache_salt: object) -> ChunkHash | None:
        """The chain root of requests with ``cache_salt`` (validated); None for unsalted requests."""
        salt = check_cache_salt(cache_salt)
        return None if salt is None else salted_root(self.root, salt)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.model, prompt, eos_ids=self.eos_token_ids)

    def _check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        check_context(
            self.traits.context_length, prompt_tokens, max_new_tokens, reason=self.traits.context_reason
        )
        pool = self.kv.capacity_tokens
        if not self.kv.can_fit(prompt_tokens + max_new_tokens):
            # NOTE: every path is held to the pool (speculative and kv_cache_bits requests decode outside it),
            # so that context_length, which the server reports and sizes default max_tokens by, is one limit.
            raise ContextLengthError(
                f"prompt ({prompt_tokens} tokens)"
                + (f" + max_new_tokens ({max_new_tokens})" if max_new_tokens else "")
                + " is more tokens than "
                f"the KV pool holds ({self.kv.pool.num_blocks} x {self.kv.block_size} = {pool} tokens); raise "
                "num_blocks or max_cache_bytes, or shorten the prompt"
                + (" / lower max_new_tokens" if max_new_tokens else ""),
                prompt_tokens=prompt_tokens,
                max_new_tokens=max_new_tokens,
                context_length=pool,
            )


def _warn_if_the_pool_caps_the_context(pool_tokens: int, model_tokens: int | None, *, caching: bool) -> None:
    """Say at load time when the block pool holds fewer tokens than the model's context: every longer
    request is refused, and ``max_model_len`` reports the smaller number, which was otherwise found out only
    from the first refusal (vLLM refuses to start in that case; here the pool is a budget you chose).
    With ``max_cache_bytes=0`` (reuse off) only ``num_blocks`` is named: raising the other turns reuse on."""
    if model_tokens is not None and pool_tokens < model_tokens:
        fix = (
            "raise max_cache_bytes (--max-cache-bytes) or num_blocks (--num-blocks)"
            if caching
            else "raise num_blocks (--num-blocks; max_cache_bytes=0 keeps reuse off)"
        )
        logger.warning(
            "the KV block pool holds %d tokens, less than the context a request may take (%d: max_model_len, "
            "else the model's): requests are limited to %d prompt + generated tokens; %s to serve the full "
            "context (vLLM refuses to start here; the pool is the budget you gave)",
            pool_tokens,
            model_tokens,
            pool_tokens,
            fix,
        )
