"""The engine contract the server drives, defined here because the server consumes it.

``kvb_cache.KVBoost`` satisfies it structurally; tests drive the server with small fakes. Every method is
called from the server's single engine worker thread, except tokenization (:func:`encode_text` and
:meth:`ServingEngine.chat_prompt`), which runs on the event loop so requests can be measured (and refused
by an admission gate) before they are queued.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from kvb_cache.results import GenerationResult, StreamEvent, WarmResult


@runtime_checkable
class ServingEngine(Protocol):
    """What the server needs from a generation engine."""

    @property
    def model_name(self) -> str:
        """The model id clients put in ``model``."""
        ...

    @property
    def context_length(self) -> int | None:
        """Maximum prompt + generated tokens (None: unknown, the engine checks nothing)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (callable: ``tokenizer(text, add_special_tokens=True)["input_ids"]``)."""
        ...

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat conversation through the tokenizer's chat template (generation prompt added)."""
        ...

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI's logprobs report it."""
        ...

    def stream(self, prompt: list[int], **sampling: Any) -> Iterator[StreamEvent]:
        """Stream one generation; closing the iterator stops it. ``sampling``: see :class:`SamplingParams`."""
        ...

    def generate_batch(
        self, prompts: Sequence[list[int]], *, sampling: Sequence[Mapping[str, Any]]
    ) -> list[GenerationResult]:
        """Generate for several prompts at once, one sampling dict per prompt."""
        ...

    def warm(self, text: str) -> WarmResult:
        """Prefill ``text`` and store its chunks so later prompts that start with it hit the cache."""
        ...

    def cache_stats(self) -> Mapping[str, Any]:
        """Cache counters and tier state (the server makes them JSON-safe)."""
        ...


def encode_text(engine: ServingEngine, text: str) -> list[int]:
    """Token ids of a completion prompt, as ``KVBoost.generate(text)`` tokenizes it (special tokens added).

    The server tokenizes before queueing (for the admission gate, batching groups and usage) and hands the
    engine ids, so both must agree; this mirrors ``KVBoost._tokenize``.
    """
    return list(engine.tokenizer(text, add_special_tokens=True)["input_ids"])
