"""``make_decoder``: the one call composition code (the kvboost meta-package) makes to get a decoder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvb_speculative.decoder import SpeculativeConfig, SpeculativeDecoder
from kvb_speculative.draft_model import DraftModelDrafter
from kvb_speculative.errors import SpeculativeConfigError
from kvb_speculative.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from kvb_speculative.protocols import Drafter

SpeculativeMode = Literal["prompt_lookup", "draft_model"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _DrafterRequest:
    target_model: PreTrainedModel
    draft_model: PreTrainedModel | None
    prompt_lookup: PromptLookupConfig
    target_tokenizer: PreTrainedTokenizerBase | None
    draft_tokenizer: PreTrainedTokenizerBase | None


def _prompt_lookup(request: _DrafterRequest) -> Drafter:
    if request.draft_model is not None:
        raise SpeculativeConfigError(
            "speculative='prompt_lookup' uses no draft model; drop draft_model or pass speculative='draft_model'."
        )
    return PromptLookupDrafter(request.prompt_lookup)


def _draft_model(request: _DrafterRequest) -> Drafter:
    if request.draft_model is None:
        raise SpeculativeConfigError(
            "speculative='draft_model' needs draft_model=<a smaller model with the target's vocabulary>, "
            "or use speculative='prompt_lookup'."
        )
    return DraftModelDrafter(
        request.target_model,
        request.draft_model,
        target_tokenizer=request.target_tokenizer,
        draft_tokenizer=request.draft_tokenizer,
    )


#: Drafter builders by ``speculative=`` name.
DRAFTERS: Mapping[str, Callable[[_DrafterRequest], Drafter]] = MappingProxyType(
    {"prompt_lookup": _prompt_lookup, "draft_model": _draft_model}
)


def make_decoder(
    target_model: PreTrainedModel,
    *,
    speculative: SpeculativeMode | None = None,
    draft_model: PreTrainedModel | None = None,
    gamma: int = 5,
    max_ngram: int = 3,
    min_ngram: int = 2,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
) -> SpeculativeDecoder:
    """Build a :class:`SpeculativeDecoder` for ``target_model``.

    Args:
        target_model: the model whose output is produced.
        speculative: ``"prompt_lookup"`` (n-gram drafts from the prompt and output, no model) or
            ``"draft_model"``; None picks ``"draft_model"`` when ``draft_model`` is given, else prompt lookup.
        draft_model: a smaller causal LM with the target's vocabulary (for ``"draft_model"``).
        gamma: maximum drafted tokens verified per target forward.
        max_ngram, min_ngram: suffix lengths tried by prompt lookup (longest first).
        target_tokenizer, draft_tokenizer: optional, compared as well when both are given.

    Raises:
        SpeculativeConfigError: unknown mode, or a setting inconsistent with it.
        VocabularyMismatchError: the draft model's vocabulary differs from the target's.
    """
    mode = speculative or ("draft_model" if draft_model is not None else "prompt_lookup")
    if mode not in DRAFTERS:
        raise SpeculativeConfigError(f"speculative={mode!r} is unknown; use one of {sorted(DRAFTERS)}.")
    request = _DrafterRequest(
        target_model=target_model,
        draft_model=draft_model,
        prompt_lookup=PromptLookupConfig(max_ngram=max_ngram, min_ngram=min_ngram),
        target_tokenizer=target_tokenizer,
        draft_tokenizer=draft_tokenizer,
    )
    return SpeculativeDecoder(DRAFTERS[mode](request), SpeculativeConfig(gamma=gamma))
