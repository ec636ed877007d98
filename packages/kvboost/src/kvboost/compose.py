"""``kvboost.KVBoost``: the kvb-cache engine, with ``from_pretrained`` composing the optional parts.

The engine class is kvb_cache's own; this subclass only adds the options whose providers live in sibling
distributions (declared once in :mod:`kvboost.args`):

- speculative decoding: kvb_cache defines the protocol its engine calls
  (:class:`kvb_cache.decoding.SpeculativeDecoder`); kvb_speculative satisfies it without importing
  kvb_cache, and this module is where the two meet;
- AWQ layer streaming: the streamed model (:meth:`kvb_streaming.StreamingCausalLM.from_pretrained`) is just
  the engine's model;
- kernels: ``attn_implementation="kvb_attention"`` registers kvb-kernels' attention with transformers first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from kvb_cache import KVBoost as _Engine
from kvb_cache import StitchConfig
from kvb_cache.config import DEFAULT_MAX_CACHE_BYTES
from kvb_cache.decoding import SpeculativeDecoder
from kvb_cache.engine_args import EngineArgs
from kvb_cache.errors import ConfigError, ModelLoadError
from kvb_cache.loading import check_local_model, load_model_and_tokenizer
from kvb_cache.options import pick_keywords
from kvb_cache.tiers import DEFAULT_DISK_CACHE_BYTES, DEFAULT_REMOTE_TIMEOUT_S
from kvb_streaming import StreamingConfig
from kvboost.args import KVB_ATTENTION, SpeculativeArgs, StreamingArgs

logger = logging.getLogger(__name__)


class KVBoost(_Engine):
    """:class:`kvb_cache.KVBoost` plus speculative decoding, AWQ layer streaming and kernels."""

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        model_name_or_path: str,
        *,
        # kvb_cache.EngineArgs
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
        # kvboost.args.SpeculativeArgs
        speculative: str | None = None,
        draft_model: str | PreTrainedModel | None = None,
        gamma: int = 5,
        prompt_lookup_max: int = 3,
        prompt_lookup_min: int = 2,
        speculative_config: str | dict | None = None,
        # kvboost.args.StreamingArgs
        awq_streaming: bool = False,
        streaming_mode: str = "full_stream",
        keep_first_k: int = 0,
        keep_last_k: int = 0,
        staging_slots: int = 2,
        streaming_quant_kernel: str = "auto",
        streaming_simulate_on_host: bool = False,
    ) -> KVBoost:
        """Load a model and wrap it.

        The keywords are the fields of :class:`kvb_cache.EngineArgs` (the cache, tiers, stitching, block pool
        and scheduler; ``attn_implementation="kvb_attention"`` uses kvb-kernels), :class:`kvboost.args.SpeculativeArgs`
        and :class:`kvboost.args.StreamingArgs`; each field's help text is its documentation. A test fails when
        this signature and those classes disagree.

        Raises:
            kvb_cache.ConfigError: a bad cache option, or both ``drafter`` and ``speculative``/``draft_model``.
            kvb_speculative.SpeculativeConfigError: an unknown ``speculative`` mode, an inconsistent setting, or
                ``gamma`` without ``speculative``/``draft_model``.
            kvb_speculative.VocabularyMismatchError: the draft model's vocabulary differs from the target's.
            kvb_streaming.StreamingConfigError: streaming options without ``awq_streaming``, or inconsistent.
        """
        values = locals()
        return cls.from_args(
            model_name_or_path,
            EngineArgs(**pick_keywords(EngineArgs, values)),
            speculative=SpeculativeArgs(**pick_keywords(SpeculativeArgs, values)),
            streaming=StreamingArgs(**pick_keywords(StreamingArgs, values)),
        )

    @classmethod
    def from_args(
        cls,
        model_name_or_path: str,
        engine: EngineArgs,
        *,
        speculative: SpeculativeArgs | None = None,
        streaming: StreamingArgs | None = None,
    ) -> KVBoost:
        """:meth:`from_pretrained` with its options as one options object per part."""
        speculative = speculative or SpeculativeArgs()
        streaming_config = (streaming or StreamingArgs()).streaming_config()
        if speculative.enabled and engine.drafter is not None:
            raise ConfigError("pass either drafter or speculative/draft_model, not both")
        if not speculative.enabled and speculative != SpeculativeArgs():
            from kvb_speculative import SpeculativeConfigError

            given = ", ".join(
                f"{f}={getattr(speculative, f)!r}"
                for f in ("gamma", "prompt_lookup_max", "prompt_lookup_min")
                if getattr(speculative, f) != getattr(SpeculativeArgs(), f)
            )
            raise SpeculativeConfigError(
                f"{given} has no effect without speculative='prompt_lookup'/'draft_model' or "
                "draft_model (--speculative / --draft-model); add one or drop them"
            )
        if speculative.speculative == "draft_model" and speculative.draft_model is None:
            from kvb_speculative import SpeculativeConfigError

            # Before the target loads (kvb_speculative says the same, after it).
            raise SpeculativeConfigError(
                "speculative='draft_model' needs draft_model (--draft-model): a smaller model with the "
                "target's vocabulary; or use speculative='prompt_lookup' (no extra model)"
            )
        if speculative.enabled:
            from kvb_speculative import DRAFTERS, SpeculativeConfig, SpeculativeConfigError
            from kvb_speculative.prompt_lookup import PromptLookupConfig

            # These were said only after the target (and the draft) had loaded: minutes on a large model.
            if speculative.speculative is not None and speculative.speculative not in DRAFTERS:
                raise SpeculativeConfigError(
                    f"speculative={speculative.speculative!r} is unknown; use one of {sorted(DRAFTERS)}"
                )
            SpeculativeConfig(gamma=speculative.gamma)  # gamma's range (1..64)
            lookup = (speculative.prompt_lookup_max, speculative.prompt_lookup_min)
            if speculative.speculative == "prompt_lookup" or (
                speculative.speculative is None and speculative.draft_model is None
            ):
                PromptLookupConfig(max_ngram=lookup[0], min_ngram=lookup[1])  # min <= max
            elif lookup != (SpeculativeArgs().prompt_lookup_max, SpeculativeArgs().prompt_lookup_min):
                raise SpeculativeConfigError(
                    "prompt_lookup_max / prompt_lookup_min (--prompt-lookup-max / --prompt-lookup-min) apply to "
                    "speculative='prompt_lookup' only; drop them with a draft model"
                )
            if speculative.speculative == "prompt_lookup" and speculative.draft_model is not None:
                raise SpeculativeConfigError(
                    "speculative='prompt_lookup' uses no draft model; drop draft_model (--draft-model) or use "
                    "speculative='draft_model'"
                )
        if isinstance(speculative.draft_model, str):
            # Checked before the target loads (minutes on a large model), and named: the draft's load error
            # read like the target's ("model path '/x' does not exist") and came only after that load.
            try:
                check_local_model(speculative.draft_model)
            except ModelLoadError as exc:
                raise ModelLoadError(f"draft_model (--draft-model): {exc}") from None
        if engine.attn_implementation == KVB_ATTENTION:
            from kvb_kernels import register_kvb_attention

            register_kvb_attention()
        if streaming_config is None:
            composed = cls.from_engine_args(model_name_or_path, engine)
        else:
            composed = cls._from_streamed(model_name_or_path, engine, streaming_config)
        if speculative.enabled:
            composed.drafter = _drafter(composed, speculative, engine.attn_implementation)
            # NOTE: said at start (kvboost serve's log showed only "engine composed by kvboost"): the flag is
            # the only other sign that outputs come from the speculative path.
            logger.info("speculative decoding on: %s", _describe(speculative))
        return composed  # type: ignore[return-value]

    @classmethod
    def _from_streamed(
        cls, model_name_or_path: str, engine: EngineArgs, streaming: StreamingConfig
    ) -> KVBoost:
        """The engine over a :class:`kvb_streaming.StreamingCausalLM` (an AWQ checkpoint folder)."""
        from transformers import AutoTokenizer

        from kvb_cache.embedded import resolve_model_path
        from kvb_cache.engine_args import seed_torch
        from kvb_cache.gpu_budget import apply_utilization, check_cuda_device
        from kvb_cache.loading import check_vocabulary, load_own_tokenizer, resolve_device, resolve_dtype
        from kvb_streaming import StreamingCausalLM

        config = engine.engine_config()  # before the model loads: a bad option fails fast
        if not isinstance(model_name_or_path, str) or not model_name_or_path.strip():
            raise ModelLoadError(f"model must be a non-empty path, got {model_name_or_path!r}")
        path = resolve_model_path(model_name_or_path)
        if not Path(path).is_dir():
            raise ModelLoadError(
                f"{model_name_or_path!r} is not a local folder; awq_streaming loads a local AWQ checkpoint folder"
            )
        dtype = resolve_dtype(engine.dtype)
        device = resolve_device(engine.device)
        if engine.gpu_memory_utilization is not None:
            check_cuda_device(device)
        # NOTE: the tokenizer first: the packer writes none, and a missing one should not cost a model load.
        if engine.tokenizer is not None:
            tokenizer = load_own_tokenizer(engine.tokenizer)
        else:
            try:
                tokenizer = AutoTokenizer.from_pretrained(
                    path, trust_remote_code=False
                )  # never asks on stdin
            except (OSError, ValueError, KeyError) as exc:
                raise ModelLoadError(
                    f"could not load the tokenizer of {model_name_or_path!r}: {exc}. Save it into the AWQ "
                    "checkpoint folder (tokenizer.save_pretrained(folder)) or pass tokenizer (--tokenizer); "
                    "kvb_streaming.packer writes weights and config only."
                ) from exc
        model = StreamingCausalLM.from_pretrained(
            path,
            streaming_config=streaming,
            device=device,
            dtype=None if dtype == "auto" else dtype,  # type: ignore[arg-type]
        )
        if engine.attn_implementation is not None:
            try:
                model.set_attn_implementation(engine.attn_implementation)
            except ValueError as exc:
                raise ModelLoadError(f"could not load model {model_name_or_path!r}: {exc}") from exc
        if engine.tokenizer is not None:
            check_vocabulary(model, tokenizer, engine.tokenizer)
        seed_torch(engine.seed)
        # NOTE: no CUDA graphs over a streamed model: its forward moves layers through staging slots under
        # host control (events, slot bookkeeping), which a graph would freeze at the captured step's state.
        # (Before the pool is sized: then it charges no graph memory either.)
        config = dataclasses.replace(config, enforce_eager=True)
        config = apply_utilization(model, config, engine.gpu_memory_utilization)
        return cls(model, tokenizer, config=config, drafter=engine.drafter, model_name=model_name_or_path)

    def speculative_stats(self) -> dict[str, Any] | None:
        """Drafted / accepted tokens, acceptance rate and timings since load; None without a drafter."""
        stats = getattr(self.drafter, "speculative_stats", None)
        return stats().as_dict() if stats is not None else None

    def streaming_stats(self) -> dict[str, Any] | None:
        """Layer-streaming counters (hits, misses, bytes moved, ...) since load; None for a resident model."""
        from kvb_streaming import NotAStreamingModelError, get_runtime

        try:
            runtime = get_runtime(self.model)
        except NotAStreamingModelError:
            return None
        stats = runtime.stats()
        return {
            **dataclasses.asdict(stats),
            "hit_rate": stats.hit_rate,
            "streaming_enabled": runtime.streaming_enabled,
            "residency_mode": runtime.effective.residency_mode,
            "streamed_layers": len(runtime.scheduler.streamed_layers),
            "staging_slots": runtime.scheduler.n_slots,
            "quant_kernel": runtime.kernel_name,
        }

    def cache_stats(self) -> dict[str, Any]:
        """:meth:`kvb_cache.KVBoost.cache_stats` plus ``"speculative"`` / ``"streaming"`` when those are on."""
        stats = super().cache_stats()
        for name, part in (("speculative", self.speculative_stats()), ("streaming", self.streaming_stats())):
            if part is not None:
                stats[name] = part
        return stats


def _describe(args: SpeculativeArgs) -> str:
    """``"draft_model (PATH), gamma 4"`` / ``"prompt_lookup, gamma 5"``: the mode make_decoder picks."""
    mode = args.speculative or "draft_model"
    if args.draft_model is not None:
        name = args.draft_model if isinstance(args.draft_model, str) else type(args.draft_model).__name__
        mode = f"{mode} ({name})"
    return f"{mode}, gamma {args.gamma}"


def _drafter(engine: _Engine, args: SpeculativeArgs, attn_implementation: str | None) -> SpeculativeDecoder:
    from kvb_speculative import SpeculativeConfigError, make_decoder

    draft_model, draft_tokenizer = args.draft_model, None
    if draft_model is not None and not isinstance(draft_model, str | PreTrainedModel):
        raise SpeculativeConfigError(
            f"draft_model must be a model folder / hub id or a loaded transformers PreTrainedModel, got "
            f"{type(draft_model).__name__}"
        )
    if isinstance(draft_model, str):
        try:
            loaded = load_model_and_tokenizer(
                draft_model,
                device=engine.device,
                dtype=engine.model.dtype,
                attn_implementation=attn_implementation,
            )
        except ModelLoadError as exc:
            raise ModelLoadError(f"draft_model (--draft-model): {exc}") from exc
        draft_model, draft_tokenizer = loaded.model, loaded.tokenizer
    return make_decoder(
        engine.model,
        speculative=args.speculative,  # type: ignore[arg-type]
        draft_model=draft_model,
        gamma=args.gamma,
        max_ngram=args.prompt_lookup_max,
        min_ngram=args.prompt_lookup_min,
        # NOTE: kvb_speculative compares tokenizers only given both; a loaded draft model comes without one, and
        # passing the target's alone was itself reported as a vocabulary mismatch.
        target_tokenizer=engine.tokenizer if draft_tokenizer is not None else None,
        draft_tokenizer=draft_tokenizer,
    )
