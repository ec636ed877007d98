"""A deterministic stand-in engine for tests that need to control timing (queue full, timeouts, disconnects)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvb_cache.results import GenerationResult, StreamEvent, TokenLogprob, WarmResult
from kvb_cache.sampling import SamplingParams


class CharTokenizer:
    """One token per character (code point mod 256)."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 256 for c in text]}


class FakeEngine:
    """Generates ``a, b, c, ...`` shifted by the last prompt token (and the seed); one token per step.

    ``token_delay_s`` slows each token; ``hold`` (when cleared) blocks generation until set, so tests can
    fill the queue. ``calls`` records ``("stream"|"batch", [prompt lengths])`` per engine call and
    ``closed_early`` counts streams stopped before they finished. ``overrides`` records the per-request
    engine settings (``prefill_chunk_size``, ``kv_cache_bits``) each ``stream`` call received.
    """

    model_name = "fake-model"
    context_length = 200

    def __init__(self, *, token_delay_s: float = 0.0) -> None:
        self.tokenizer = CharTokenizer()
        self.token_delay_s = token_delay_s
        self.hold = threading.Event()
        self.hold.set()
        self.calls: list[tuple[str, list[list[int]]]] = []
        self.closed_early = 0
        self.warmed: list[str] = []
        self.overrides: list[dict[str, int]] = []

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.tokenizer(text)["input_ids"]

    def _tokens(self, prompt: list[int], seed: int | None) -> Iterator[int]:
        start = (prompt[-1] + (seed or 0)) % 26
        i = 0
        while True:
            yield ord("a") + (start + i) % 26
            i += 1

    def _events(self, prompt: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        t0 = time.perf_counter()
        self.hold.wait()
        out: list[int] = []
        text = ""
        finish = "length"
        lps: list[TokenLogprob] = []
        finished_normally = False
        try:
            for token in self._tokens(prompt, params.seed):
                if self.token_delay_s:
                    time.sleep(self.token_delay_s)
                out.append(token)
                lp = TokenLogprob(
                    token_id=token,
                    token=chr(token),
                    logprob=-0.5,
                    top=tuple((token + k, chr(token + k), -0.5 - k) for k in range(params.logprobs or 0)),
                )
                lps.append(lp)
                piece = chr(token)
                hit = next((s for s in params.stop if (text + piece).endswith(s)), None)
                if hit is not None:
                    text = (text + piece)[: -len(hit)]
                    finish = "stop"
                    break
                text += piece
                yield StreamEvent(
                    delta_text=piece,
                    token_ids=(token,),
                    logprobs=(lp,) if params.logprobs is not None else (),
                )
                if len(out) >= params.max_new_tokens:
                    break
            finished_normally = True
        finally:
            if not finished_normally:
                self.closed_early += 1
        result = GenerationResult(
            output_text=text,
            output_ids=out,
            prompt_tokens=len(prompt),
            cached_tokens=len(prompt) // 2,
            ttft_ms=1.0,
            total_ms=(time.perf_counter() - t0) * 1e3,
            finish_reason=finish,  # type: ignore[arg-type]
            logprobs=tuple(lps) if params.logprobs is not None else None,
        )
        yield StreamEvent(delta_text="", result=result)

    def stream(self, prompt: list[int], **sampling: Any) -> Iterator[StreamEvent]:
        self.overrides.append(
            {k: sampling.pop(k) for k in ("prefill_chunk_size", "kv_cache_bits") if k in sampling}
        )
        params = SamplingParams.build(**sampling)
        self.calls.append(("stream", [list(prompt)]))
        return self._events(list(prompt), params)

    def generate_batch(
        self, prompts: Sequence[list[int]], *, sampling: Sequence[Mapping[str, Any]]
    ) -> list[GenerationResult]:
        self.calls.append(("batch", [list(p) for p in prompts]))
        out = []
        for prompt, kw in zip(prompts, sampling):
            *_, last = self._events(list(prompt), SamplingParams.build(**kw))
            assert last.result is not None
            out.append(last.result)
        return out

    def warm(self, text: str) -> WarmResult:
        self.warmed.append(text)
        return WarmResult(tokens=len(text), chunks=1, new_chunks=1, already_cached_tokens=0)

    def cache_stats(self) -> dict[str, Any]:
        # Deliberately not JSON-native, like real engines' stats can be: the server must cope.
        return {"entries": 1, "ratio": float("nan"), "tiers": {"ram": {"bytes": 10}}, "kinds": {1: "x"}}
