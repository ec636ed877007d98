"""KVBoost.step_limits: what bounds one engine step's memory beside the pool (a memory planner's input)."""

from __future__ import annotations

import pytest
from conftest import make_model

from kvb_cache import EngineConfig, KVBoost, StitchConfig
from kvb_cache.core.paged_attention import DECODE_GATHER_TOKENS, PREFILL_MASK_ELEMENTS
from kvb_cache.step_limits import decode_gather_tokens, eager_loop_attention


def test_the_limits_follow_the_engine_config(llama, tokenizer) -> None:
    engine = KVBoost(
        llama, tokenizer, config=EngineConfig(max_num_batched_tokens=96, max_num_seqs=3, max_model_len=256)
    )
    limits = engine.step_limits
    assert (limits.step_tokens, limits.sampled_rows) == (96, 3)
    assert limits.logits_rows is None  # Llama keeps only the sampled rows' logits
    assert limits.mask_elements == PREFILL_MASK_ELEMENTS
    assert limits.decode_gather_tokens == 3 * 256  # three whole 256-token contexts, below the sub-batch cap
    assert not limits.eager_attention and not limits.solo_paths


def test_requests_that_may_leave_the_pool_are_flagged(llama, tokenizer) -> None:
    stitched = KVBoost(llama, tokenizer, config=EngineConfig(stitching=StitchConfig()))
    assert stitched.step_limits.solo_paths  # stitched prompts are assembled on a cache of their own


def test_decode_gather_bound() -> None:
    assert decode_gather_tokens(512, 2) == 1024
    assert decode_gather_tokens(8192, 32) == DECODE_GATHER_TOKENS  # sub-batches of at most 65536 positions
    assert decode_gather_tokens(200_000, 4) == 200_000  # one row longer than a sub-batch goes alone


@pytest.mark.parametrize(("arch", "eager"), [("llama", False), ("gemma2", True), ("gpt_oss", True)])
def test_eager_formula_models(arch: str, eager: bool) -> None:
    assert eager_loop_attention(make_model(arch)) is eager
