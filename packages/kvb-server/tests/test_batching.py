from __future__ import annotations

import asyncio

import pytest

from kvb_server.batching import next_unit
from kvb_server.jobs import CallJob, GenerationJob, Inbox, JobId
from kvb_server.sampling import SamplingParams


@pytest.fixture(scope="module")
def inbox() -> Inbox:
    return Inbox(asyncio.new_event_loop())


def job(i: int, prompt: list[int], inbox: Inbox, *, stream: bool = False) -> GenerationJob:
    return GenerationJob(
        id=JobId(i),
        prompt=prompt,
        sampling=SamplingParams(max_new_tokens=1),
        stream=stream,
        choice=0,
        inbox=inbox,
        deadline=1e18,
    )


def ids(jobs) -> list[int]:
    return [j.id for j in jobs]


def test_oldest_job_leads_and_its_prefix_group_joins_first(inbox: Inbox) -> None:
    pending = [
        job(1, [1, 2, 3, 9], inbox),
        job(2, [5, 5, 5], inbox),
        job(3, [1, 2, 3, 7], inbox),
        job(4, [6, 6], inbox),
        job(5, [5, 5, 5, 1], inbox),
    ]
    unit, rest = next_unit(pending, max_batch_size=4, prefix_tokens=3)
    # 1 and 3 share [1, 2, 3]; then 2 and 5 (sharing [5, 5, 5]) side by side before 4.
    assert ids(unit) == [1, 3, 2, 5]
    assert ids(rest) == [4]


def test_streaming_jobs_run_alone_and_are_not_pulled_into_batches(inbox: Inbox) -> None:
    pending = [job(1, [1], inbox, stream=True), job(2, [1], inbox), job(3, [1], inbox)]
    unit, rest = next_unit(pending, max_batch_size=8, prefix_tokens=4)
    assert ids(unit) == [1] and ids(rest) == [2, 3]
    pending = [job(2, [1], inbox), job(4, [1], inbox, stream=True), job(3, [1], inbox)]
    unit, rest = next_unit(pending, max_batch_size=8, prefix_tokens=4)
    assert ids(unit) == [2, 3] and ids(rest) == [4]


def test_calls_run_alone_and_batch_size_is_respected(inbox: Inbox) -> None:
    call = CallJob(id=JobId(9), fn=lambda: None, future=None, deadline=1e18)  # type: ignore[arg-type]
    unit, rest = next_unit([call, job(1, [1], inbox)], max_batch_size=8, prefix_tokens=4)
    assert unit == [call] and ids(rest) == [1]
    pending = [job(i, [i % 2], inbox) for i in range(6)]
    unit, rest = next_unit(pending, max_batch_size=1, prefix_tokens=4)
    assert ids(unit) == [0]
    unit, rest = next_unit(pending, max_batch_size=2, prefix_tokens=4)
    assert ids(unit) == [0, 2] and ids(rest) == [1, 3, 4, 5]


def test_empty_pending_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        next_unit([], max_batch_size=2, prefix_tokens=4)
