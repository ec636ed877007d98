"""The decoder satisfies kvb_cache's engine contract structurally (checked only when kvb_cache is installed)."""

import inspect

import pytest

from kvb_speculative import (
    Drafter,
    DraftModelDrafter,
    DraftModelSession,
    DraftSession,
    PromptLookupDrafter,
    PromptLookupSession,
    SpeculativeDecoder,
)


def test_drafters_satisfy_the_protocols(target, other_model, prompt):
    for drafter in (PromptLookupDrafter(), DraftModelDrafter(target, other_model)):
        assert isinstance(drafter, Drafter)
        session = drafter.start(prompt[0])
        assert isinstance(session, DraftSession)
        assert isinstance(session, PromptLookupSession | DraftModelSession)


def test_engine_protocol_from_kvb_cache(target):
    decoding = pytest.importorskip(
        "kvb_cache.decoding", reason="kvb-cache is not installed (not a dependency)"
    )
    decoder = SpeculativeDecoder(PromptLookupDrafter())
    assert isinstance(decoder, decoding.SpeculativeDecoder)
    ours = inspect.signature(SpeculativeDecoder.decode).parameters
    theirs = inspect.signature(decoding.SpeculativeDecoder.decode).parameters
    assert list(theirs) == [name for name in ours if ours[name].kind is not inspect.Parameter.KEYWORD_ONLY]
