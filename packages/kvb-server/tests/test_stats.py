from __future__ import annotations

import enum
import json
from dataclasses import dataclass

import torch

from kvb_server.stats import ThroughputMeter, json_safe


class Color(enum.Enum):
    RED = "red"


@dataclass
class Point:
    x: float


def test_json_safe_converts_everything_to_plain_json() -> None:
    value = {
        1: float("inf"),
        "t": torch.tensor([1.5, 2.0]),
        "s": torch.tensor(3),
        "e": Color.RED,
        "d": Point(x=float("nan")),
        "set": {4},
        "obj": object,
        "nested": [{"a": (1, 2)}],
    }
    out = json_safe(value)
    json.dumps(out, allow_nan=False)
    assert out["1"] is None and out["t"] == [1.5, 2.0] and out["s"] == 3 and out["e"] == "red"
    assert out["d"] == {"x": None} and out["set"] == [4] and out["nested"] == [{"a": [1, 2]}]
    assert isinstance(out["obj"], str)


def test_throughput_meter_counts_tokens() -> None:
    meter = ThroughputMeter(window_s=60)
    meter.add(10)
    meter.add(5)
    snap = meter.snapshot()
    assert snap["completion_tokens"] == 15 and snap["completed_choices"] == 2
    assert snap["tokens_per_s_recent"] > 0
