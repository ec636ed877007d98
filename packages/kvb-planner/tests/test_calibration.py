import json
import math

import pytest

from kvb_planner import CalibrationSettings, CalibrationTracker, Cohort, LadderStep, PlannerConfigError
from kvb_planner.calibration import percentile

SINGLE = LadderStep(prefill_chunk_size=None)
CHUNKED8 = LadderStep(prefill_chunk_size=512, kv_bits=8)


def test_percentile_interpolates_linearly():
    values = [0.4, 0.0, 0.2, 0.1, 0.3]
    assert percentile(values, 50) == pytest.approx(0.2)
    assert percentile(values, 95) == pytest.approx(0.38)  # h = 4 * 0.95 = 3.8 -> 0.3 + 0.8 * 0.1
    assert percentile([7.0], 95) == 7.0


def test_record_returns_relative_residual():
    tracker = CalibrationTracker()
    assert tracker.record(predicted_bytes=1000, actual_bytes=1100, step=SINGLE) == pytest.approx(0.1)
    assert tracker.record(predicted_bytes=1000, actual_bytes=800, step=SINGLE) == pytest.approx(-0.2)


def test_default_margin_until_min_samples_then_p95():
    tracker = CalibrationTracker(CalibrationSettings(min_samples=16))
    for i in range(15):
        tracker.record(predicted_bytes=100, actual_bytes=100 + i, step=SINGLE)  # residuals 0.00 .. 0.14
    assert tracker.suggested_margin() == 0.10
    tracker.record(predicted_bytes=100, actual_bytes=115, step=SINGLE)  # 16 residuals: 0.00 .. 0.15
    assert tracker.suggested_margin() == pytest.approx(0.1425)  # h = 15 * 0.95 = 14.25 -> 0.14 + 0.25 * 0.01


def test_margin_is_floored_and_capped():
    over = CalibrationTracker(CalibrationSettings(min_samples=1))
    over.record(predicted_bytes=100, actual_bytes=50, step=SINGLE)  # always over-predicting
    assert over.suggested_margin() == 0.05
    under = CalibrationTracker(CalibrationSettings(min_samples=1))
    under.record(predicted_bytes=100, actual_bytes=300, step=SINGLE)
    assert under.suggested_margin() == 0.50


def test_window_rolls():
    tracker = CalibrationTracker(CalibrationSettings(window=3, min_samples=1))
    for actual in (200, 100, 100, 100):  # the +100% residual falls out of the 3-wide window
        tracker.record(predicted_bytes=100, actual_bytes=actual, step=SINGLE)
    stats = tracker.stats()
    assert stats.overall.count == 3 and stats.overall.p95 == 0.0 and stats.suggested_margin == 0.05


def test_cohorts_are_tracked_separately():
    tracker = CalibrationTracker(CalibrationSettings(min_samples=2))
    for actual in (110, 120):
        tracker.record(predicted_bytes=100, actual_bytes=actual, step=SINGLE)
    for actual in (130, 140, 150):
        tracker.record(predicted_bytes=100, actual_bytes=actual, step=CHUNKED8)
    stats = tracker.stats()
    assert stats.overall.count == 5
    by_cohort = {c.cohort: c.residuals for c in stats.cohorts}
    assert by_cohort[Cohort(None, 16)].p50 == pytest.approx(0.15)
    assert by_cohort[Cohort(512, 8)].p50 == pytest.approx(0.4)
    assert by_cohort[Cohort(512, 8)].mean_abs == pytest.approx(0.4)
    assert tracker.suggested_margin(CHUNKED8) == pytest.approx(0.49)  # p95 of (0.3, 0.4, 0.5)
    assert tracker.suggested_margin(SINGLE) == pytest.approx(0.195)  # p95 of (0.1, 0.2)
    # A cohort with too few samples falls back to the overall window.
    assert tracker.suggested_margin(LadderStep(prefill_chunk_size=128, kv_bits=4)) == pytest.approx(
        tracker.suggested_margin()
    )


def test_stats_to_dict_is_json_safe_even_when_empty():
    empty = CalibrationTracker().stats().to_dict()
    assert json.loads(json.dumps(empty, allow_nan=False)) == {
        "overall": {"count": 0, "p50": None, "p95": None, "mean_abs": None},
        "cohorts": [],
        "suggested_margin": 0.1,
    }
    tracker = CalibrationTracker()
    tracker.record(predicted_bytes=3, actual_bytes=0, step=CHUNKED8)
    payload = tracker.stats().to_dict()
    text = json.dumps(payload, allow_nan=False)
    assert payload["cohorts"] == [
        {"prefill_chunk_size": 512, "kv_bits": 8, "count": 1, "p50": -1.0, "p95": -1.0, "mean_abs": 1.0}
    ]
    assert all(math.isfinite(v) for v in json.loads(text)["overall"].values() if isinstance(v, float))


def test_rejects_bad_observations_and_settings():
    tracker = CalibrationTracker()
    with pytest.raises(PlannerConfigError, match="predicted_bytes"):
        tracker.record(predicted_bytes=0, actual_bytes=1, step=SINGLE)
    with pytest.raises(PlannerConfigError, match="actual_bytes"):
        tracker.record(predicted_bytes=1, actual_bytes=-1, step=SINGLE)
    with pytest.raises(PlannerConfigError, match="min_samples"):
        CalibrationSettings(window=8, min_samples=16)
    with pytest.raises(PlannerConfigError, match="default_margin"):
        CalibrationSettings(default_margin=0.9)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "100", None])
def test_non_finite_observations_are_refused(bad):
    # A NaN passed the <= 0 / < 0 checks and poisoned the window: mean_abs became NaN (emitted by to_dict()).
    tracker = CalibrationTracker()
    for field in ("predicted_bytes", "actual_bytes"):
        kwargs = {"predicted_bytes": 100, "actual_bytes": 105, field: bad}
        with pytest.raises(PlannerConfigError, match=field):
            tracker.record(**kwargs, step=SINGLE)
    assert tracker.stats().overall.count == 0
