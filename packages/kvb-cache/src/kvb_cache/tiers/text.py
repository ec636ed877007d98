"""Real text for benchmarks, from the standard library (no download)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from kvb_cache.errors import InvalidRequestError


def benchmark_token_ids(tokenizer: PreTrainedTokenizerBase, tokens: int) -> list[int]:
    """At least ``tokens`` token ids of Python's own documentation (``pydoc_data.topics``), in a fixed order."""
    from pydoc_data.topics import topics

    # ~4 characters per token for English prose and code; 8 leaves a wide margin.
    text = "\n\n".join(topics[name] for name in sorted(topics))[: tokens * 8]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise InvalidRequestError(f"pydoc topics give only {len(ids)} tokens; ask for fewer than {tokens}")
    return ids[:tokens]
