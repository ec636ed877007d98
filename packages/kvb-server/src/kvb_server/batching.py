"""Which waiting jobs the engine serves next, and together.

The oldest waiting job is always served next (no starvation). Non-streaming generation jobs are batched:
first those whose prompts start with the same leading tokens as the oldest (the same first chunk, so the
engine loads that KV once for all of them), then other waiting ones, kept adjacent by leading tokens.
Streaming jobs run alone, so each client sees its tokens as they are produced, and so do jobs the admission
gate gave engine overrides (the planner picked them because memory is tight).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvb_server.jobs import GenerationJob, Job

LeadingKey = tuple[int, ...]


class NextUnit(NamedTuple):
    """The jobs to run in one engine call, and the jobs left waiting (in arrival order)."""

    unit: list[Job]
    rest: list[Job]


def leading_key(job: GenerationJob, prefix_tokens: int) -> LeadingKey:
    """The first ``prefix_tokens`` prompt tokens: jobs with equal keys share their first cached chunk."""
    return tuple(job.prompt[:prefix_tokens])


def is_batchable(job: Job) -> bool:
    # A job with gate overrides (prefill slices, quantized KV) was planned to run alone in tight memory.
    return isinstance(job, GenerationJob) and not job.stream and job.settings.is_default


def next_unit(pending: Sequence[Job], *, max_batch_size: int, prefix_tokens: int) -> NextUnit:
    """Pick the next engine call from ``pending`` (oldest first; expired jobs must already be removed).

    Args:
        pending: waiting jobs in arrival order; must not be empty.
        max_batch_size: most jobs one call serves.
        prefix_tokens: leading tokens that define a sharing group (the engine's chunk size).
    """
    if not pending:
        raise ValueError("next_unit needs at least one pending job")
    head = pending[0]
    if not is_batchable(head) or max_batch_size == 1:
        return NextUnit([head], list(pending[1:]))
    assert isinstance(head, GenerationJob)
    head_key = leading_key(head, prefix_tokens)
    batchable = [j for j in pending if is_batchable(j)]
    same = [j for j in batchable if leading_key(j, prefix_tokens) == head_key]  # type: ignore[arg-type]
    others = [j for j in batchable if leading_key(j, prefix_tokens) != head_key]  # type: ignore[arg-type]
    # Stable sort keeps arrival order within a group while putting equal leading tokens side by side.
    first_seen: dict[LeadingKey, int] = {}
    for i, j in enumerate(others):
        first_seen.setdefault(leading_key(j, prefix_tokens), i)  # type: ignore[arg-type]
    others.sort(key=lambda j: first_seen[leading_key(j, prefix_tokens)])  # type: ignore[arg-type]
    unit = (same + others)[:max_batch_size]
    chosen = {id(j) for j in unit}
    return NextUnit(unit, [j for j in pending if id(j) not in chosen])
