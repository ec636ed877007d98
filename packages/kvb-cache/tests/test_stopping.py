"""Stop-string matching: what may be streamed while a stop string could still be completing."""

from __future__ import annotations

import random

import pytest

from kvb_cache.stopping import StopStrings


def _reference_holdback(stops: tuple[str, ...], text: str) -> int:
    """The definition, suffix by suffix: the longest tail shorter than the longest stop that starts a stop."""
    longest = max(len(s) for s in stops)
    for n in range(min(longest - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-n:]) for stop in stops):
            return n
    return 0


@pytest.mark.parametrize("alphabet", ["ab", "ab c", "aab"])
def test_holdback_follows_the_growing_text_as_the_definition_says(alphabet):
    """The incremental (KMP) holdback equals the definition after every append, over random stops with
    repeats and borders ("aba", "aa"), whole stops completed inside the text, and empty appends."""
    rng = random.Random(alphabet)
    for _ in range(400):
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))
        )
        matcher, text = StopStrings(stops), ""
        for _ in range(25):
            text += "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
            assert matcher.holdback(text) == _reference_holdback(stops, text), (stops, text)


def test_holdback_of_a_text_that_is_not_the_one_fed_so_far_starts_over():
    matcher = StopStrings(("abc",))
    assert matcher.holdback("xxab") == 2
    assert matcher.holdback("zza") == 1  # another text: computed afresh, not continued
    assert StopStrings(()).holdback("anything") == 0
