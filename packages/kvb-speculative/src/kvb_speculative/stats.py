"""Counters and timers of speculative decoding, as an immutable snapshot and its accumulator."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeStats:
    """What speculative decoding did since the decoder was created (or its stats were reset).

    Attributes:
        gamma: the maximum draft length ``K``.
        rounds: verification forwards (each checked ``1..K`` drafted tokens).
        plain_steps: one-token target forwards taken because the drafter had nothing to propose.
        drafted_tokens: tokens proposed in all rounds.
        accepted_tokens: drafted tokens the target accepted.
        committed_tokens: tokens produced (accepted + one correction or bonus per round + plain steps);
            the engine may consume fewer when it stops mid-round.
        accepted_histogram: ``K + 1`` counts; entry ``i`` is the number of rounds that accepted exactly ``i``.
        draft_seconds: wall time spent proposing (draft-model forwards, n-gram lookups).
        verify_seconds: wall time of target forwards (verification rounds and plain steps) and acceptance.
        rollback_seconds: wall time spent cropping the target and draft caches after partial acceptance.
    """

    gamma: int
    rounds: int = 0
    plain_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0
    accepted_histogram: tuple[int, ...] = ()
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rollback_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 before any round)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Average tokens committed per verification round: accepted + 1 (0.0 before any round)."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Committed tokens per target forward, plain steps included (1.0 is plain decoding)."""
        forwards = self.rounds + self.plain_steps
        return self.committed_tokens / forwards if forwards else 0.0

    def as_dict(self) -> dict[str, object]:
        """Plain-JSON form, derived rates included (for ``/v1/stats`` style endpoints and benchmarks)."""
        return {
            "gamma": self.gamma,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "committed_tokens": self.committed_tokens,
            "accepted_histogram": list(self.accepted_histogram),
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "tokens_per_forward": self.tokens_per_forward,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "rollback_seconds": self.rollback_seconds,
        }


@dataclass(slots=True)
class StatsRecorder:
    """Mutable accumulator owned by one decoder; :meth:`snapshot` freezes it."""

    gamma: int
    rounds: int = 0
    plain_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0
    histogram: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rollback_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.histogram = [0] * (self.gamma + 1)

    def record_round(self, drafted: int, accepted: int) -> None:
        """One verification round that checked ``drafted`` tokens and accepted ``accepted`` of them."""
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.committed_tokens += accepted + 1
        self.histogram[accepted] += 1

    def record_plain_step(self) -> None:
        """One ordinary decoding step (no draft)."""
        self.plain_steps += 1
        self.committed_tokens += 1

    def snapshot(self) -> SpeculativeStats:
        """An immutable copy of the counters."""
        return SpeculativeStats(
            gamma=self.gamma,
            rounds=self.rounds,
            plain_steps=self.plain_steps,
            drafted_tokens=self.drafted_tokens,
            accepted_tokens=self.accepted_tokens,
            committed_tokens=self.committed_tokens,
            accepted_histogram=tuple(self.histogram),
            draft_seconds=self.draft_seconds,
            verify_seconds=self.verify_seconds,
            rollback_seconds=self.rollback_seconds,
        )


class Stopwatch:
    """``with Stopwatch() as sw: ...; sw.seconds`` (perf_counter; callers synchronise devices first)."""

    __slots__ = ("_start", "seconds")

    def __init__(self) -> None:
        self._start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
