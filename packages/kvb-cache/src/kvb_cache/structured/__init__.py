"""Structured outputs: grammar-constrained decoding (JSON schema, regex, Lark/GBNF) as per-row token masks."""

from kvb_cache.structured.backend import GrammarCache, StructuredOutputsUnavailable, check_grammar
from kvb_cache.structured.spec import ResponseFormat
from kvb_cache.structured.state import GrammarState

__all__ = ["GrammarCache", "GrammarState", "ResponseFormat", "StructuredOutputsUnavailable", "check_grammar"]
