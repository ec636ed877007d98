"""The worker runs the engine's idle work (KVBoost.has_idle_work) only after a grace period with no request
in flight, one step at a time, and stops on shutdown."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import serve
from fakes import FakeEngine
from test_app_errors import wait_until

from kvb_server import ServerConfig, create_app, idle_work
from kvb_server import worker as worker_module

MODEL = "fake-model"


class IdleFake(FakeEngine):
    """A fake with ``idle_left`` steps of idle work, done by steps taken while no request is unfinished."""

    def __init__(self, idle_left: int) -> None:
        super().__init__()
        self.idle_left = idle_left
        self.idle_at: list[float] = []
        self.request_steps_at: list[float] = []
        self.cleared = 0

    def has_idle_work(self) -> bool:
        return self.idle_left > 0

    def clear_idle_work(self) -> None:
        self.cleared += 1

    def step(self):
        if self.has_unfinished():
            out = super().step()
            self.request_steps_at.append(time.monotonic())
            return out
        assert self.idle_left > 0, "an idle step with no idle work"
        self.idle_left -= 1
        self.idle_at.append(time.monotonic())
        return []


def test_idle_work_waits_for_the_grace_period_after_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idle_work, "IDLE_GRACE_S", 0.3)
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 0.01)  # the idle thread notices new idle work at once
    fake = IdleFake(idle_left=0)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert resp.status_code == 200
        fake.idle_left = 3  # the request left idle work behind (as a stitched one does)
        wait_until(lambda: fake.idle_left == 0, timeout=10)
        stats = httpx.get(url + "/v1/stats").json()["queue"]
        metrics = httpx.get(url + "/metrics").text
    assert len(fake.idle_at) == 3 and stats["idle_steps"] == 3
    assert "kvboost_idle_steps_total 3.0" in metrics and "kvboost_idle_seconds_total" in metrics
    assert fake.idle_at[0] - fake.request_steps_at[-1] >= 0.3 * 0.95
    assert fake.cleared == 1  # on shutdown: the prompt part-way is let go


def test_an_engine_without_idle_work_is_never_stepped_idle() -> None:
    fake = FakeEngine()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        time.sleep(0.2)
        assert httpx.get(url + "/v1/stats").json()["queue"]["idle_steps"] == 0
