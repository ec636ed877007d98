"""A stream whose client stops reading ends at the request's deadline (:class:`EventStreamResponse`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvb_server import streaming
from kvb_server.streaming import EventStreamResponse


class _Stream:
    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.released = 0

    def release_unread(self) -> None:
        self.released += 1


# uvicorn's path (ASGI 2.3: a task group watching for disconnects) and 2.4's; asyncio.timeout and 3.10's wait_for
@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("timer", ["timeout", "wait_for"])
def test_a_send_blocked_past_the_deadline_ends_the_response(monkeypatch, spec: str, timer: str) -> None:
    # A client that stops reading blocks the send once the socket's buffers fill; nothing bounded that wait,
    # so the handler and every update queued for it were held for as long as the connection stayed open.
    monkeypatch.setattr(streaming, "_SEND_GRACE_S", 0.05)
    if timer == "wait_for":
        monkeypatch.setattr(streaming, "_timeout", None)
    cancelled = []

    async def body():
        try:
            for i in range(10**6):
                yield f"data: {i}\n\n".encode()
        finally:
            cancelled.append(True)  # where the real stream cancels its jobs

    sent = []

    async def send(message) -> None:
        sent.append(message["type"])
        if len(sent) > 3:  # the socket is full from the fourth message on: this send never completes
            await asyncio.Event().wait()

    async def receive():
        await asyncio.Event().wait()

    async def run() -> float:
        stream = _Stream(time.monotonic() + 0.2)
        response = EventStreamResponse(body(), stream, {})
        started = time.monotonic()
        await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": spec}}, receive, send), 10)
        assert stream.released == 1
        return time.monotonic() - started

    assert asyncio.run(run()) < 10
    assert cancelled == [True] and len(sent) == 4


def test_a_reader_that_keeps_up_gets_the_whole_stream() -> None:
    async def body():
        for i in range(100):
            yield f"data: {i}\n\n".encode()

    sent = []

    async def send(message) -> None:
        sent.append(message)

    async def receive():
        await asyncio.Event().wait()

    stream = _Stream(time.monotonic() + 60)
    asyncio.run(EventStreamResponse(body(), stream, {})({"type": "http"}, receive, send))
    assert len(sent) == 102 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
