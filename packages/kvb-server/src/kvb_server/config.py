"""Server settings: what the CLI flags become, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """How the HTTP layer queues, batches, caps and guards requests.

    Attributes:
        model_names: names clients may put in ``model``; the first is the one ``/v1/models`` reports first.
        max_queue_size: requests waiting for the engine before new ones get 503.
        max_batch_size: most requests one engine call serves together.
        batch_window_ms: how long the worker waits for more requests to batch with the first one.
        request_timeout_s: a request not finished this long after it arrived gets 504.
        max_tokens: server-side cap on generated tokens per choice (requests asking for more are clamped).
        default_completion_max_tokens: ``/v1/completions`` default when ``max_tokens`` is omitted (OpenAI: 16).
        group_prefix_tokens: requests whose first this-many prompt tokens agree are batched together
            (the engine's chunk size, so they share their first cached chunk).
        api_key: when set, every ``/v1/*`` route requires ``Authorization: Bearer <api_key>``.
        max_n: most choices one request may ask for.
    """

    model_names: tuple[str, ...]
    max_queue_size: int = 256
    max_batch_size: int = 8
    batch_window_ms: float = 5.0
    request_timeout_s: float = 600.0
    max_tokens: int = 1024
    default_completion_max_tokens: int = 16
    group_prefix_tokens: int = 128
    api_key: str | None = None
    max_n: int = 16

    def __post_init__(self) -> None:
        if not self.model_names or not all(isinstance(n, str) and n for n in self.model_names):
            raise ValueError(
                "model_names must hold at least one non-empty model name, e.g. ('smollm2-135m',)"
            )
        positive_ints = {
            "max_queue_size": self.max_queue_size,
            "max_batch_size": self.max_batch_size,
            "max_tokens": self.max_tokens,
            "default_completion_max_tokens": self.default_completion_max_tokens,
            "group_prefix_tokens": self.group_prefix_tokens,
            "max_n": self.max_n,
        }
        for name, value in positive_ints.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0 (0 disables waiting), got {self.batch_window_ms}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string, or None to disable authentication")
