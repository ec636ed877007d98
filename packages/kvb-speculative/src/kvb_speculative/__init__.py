"""Exact speculative decoding for Hugging Face causal LMs, with pluggable drafters.

Quick start::

    from kvb_speculative import PromptLookupDrafter, speculative_generate

    out = speculative_generate(model, input_ids, PromptLookupDrafter(), gamma=5, max_new_tokens=128)
    out.tokens, out.stats.acceptance_rate
"""

from kvb_speculative._version import __version__
from kvb_speculative.cache_ops import extend, make_croppable, rollback
from kvb_speculative.decoder import SpeculativeConfig, SpeculativeDecoder
from kvb_speculative.draft_model import DraftModelDrafter, DraftModelSession
from kvb_speculative.errors import (
    CacheRollbackError,
    NonFiniteLogitsError,
    SpeculativeConfigError,
    SpeculativeError,
    VocabularyMismatchError,
)
from kvb_speculative.factory import DRAFTERS, SpeculativeMode, make_decoder
from kvb_speculative.generate import SpeculativeOutput, prefill, speculative_generate
from kvb_speculative.processing import LogitsTokenProcessor, SamplingParams
from kvb_speculative.prompt_lookup import PromptLookupConfig, PromptLookupDrafter, PromptLookupSession
from kvb_speculative.protocols import Draft, Drafter, DraftSession, TokenId, TokenProcessor
from kvb_speculative.stats import SpeculativeStats
from kvb_speculative.verification import ExactVerifier, Verdict, Verifier
from kvb_speculative.vocab import check_vocab_parity

__all__ = [
    "DRAFTERS",
    "CacheRollbackError",
    "Draft",
    "DraftModelDrafter",
    "DraftModelSession",
    "DraftSession",
    "Drafter",
    "ExactVerifier",
    "LogitsTokenProcessor",
    "NonFiniteLogitsError",
    "PromptLookupConfig",
    "PromptLookupDrafter",
    "PromptLookupSession",
    "SamplingParams",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "SpeculativeDecoder",
    "SpeculativeError",
    "SpeculativeMode",
    "SpeculativeOutput",
    "SpeculativeStats",
    "TokenId",
    "TokenProcessor",
    "Verdict",
    "Verifier",
    "VocabularyMismatchError",
    "__version__",
    "check_vocab_parity",
    "extend",
    "make_croppable",
    "make_decoder",
    "prefill",
    "rollback",
    "speculative_generate",
]
