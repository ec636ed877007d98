"""Server settings: what the CLI flags become, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """How the HTTP layer queues, caps and guards requests (batching is the engine's: one step serves all).

    Attributes:
        model_names: names clients may put in ``model``; the first is the one ``/v1/models`` reports first.
        max_queue_size: requests not running yet (submitted, or waiting inside the engine) before new ones
            get 503; running requests do not count.
        request_timeout_s: a request not finished this long after it arrived gets 504.
        max_tokens: server-side cap on generated tokens per choice (requests asking for more are clamped).
        default_completion_max_tokens: ``/v1/completions`` default when ``max_tokens`` is omitted (OpenAI: 16).
        api_key: when set, every ``/v1/*`` route requires ``Authorization: Bearer <api_key>``.
        max_n: most choices one request may ask for.
    """

    model_names: tuple[str, ...]
    max_queue_size: int = 256
    request_timeout_s: float = 600.0
    max_tokens: int = 1024
    default_completion_max_tokens: int = 16
    api_key: str | None = None
    max_n: int = 16

    def __post_init__(self) -> None:
        if not self.model_names or not all(isinstance(n, str) and n for n in self.model_names):
            raise ValueError(
                "model_names must hold at least one non-empty model name, e.g. ('smollm2-135m',)"
            )
        positive_ints = {
            "max_queue_size": self.max_queue_size,
            "max_tokens": self.max_tokens,
            "default_completion_max_tokens": self.default_completion_max_tokens,
            "max_n": self.max_n,
        }
        for name, value in positive_ints.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string, or None to disable authentication")
