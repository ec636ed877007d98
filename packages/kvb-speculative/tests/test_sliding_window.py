"""Speculative decoding on sliding-window models: rejected drafts are cropped past the window.

transformers' ``DynamicCache(config=...)`` gives Mistral / gpt-oss their sliding layers, which forget all but
the last ``window - 1`` positions; a rollback past the window used to raise ``CacheRollbackError`` (measured:
Mistral and gpt-oss, target and draft caches alike, as soon as a draft was rejected past position 8 here).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    GptOssConfig,
    GptOssForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvb_speculative import (
    DraftModelDrafter,
    PromptLookupDrafter,
    cache_ops,
    make_croppable,
    prefill,
    rollback,
    speculative_generate,
)
from kvb_speculative.cache_ops import cache_kwargs

WINDOW = 8
_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
    initializer_range=0.2,
    sliding_window=WINDOW,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def mistral(seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**_COMMON)).eval()


def gpt_oss(seed: int) -> PreTrainedModel:
    """Alternating sliding / full layers, attention sinks, MoE (no SDPA path in transformers: eager)."""
    torch.manual_seed(seed)
    config = GptOssConfig(**_COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    config._attn_implementation = "eager"
    return GptOssForCausalLM(config).eval()


FACTORIES = {"mistral": mistral, "gpt_oss": gpt_oss}


def sliding_lengths(cache: DynamicCache) -> list[int]:
    return [layer.keys.shape[-2] for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]


@pytest.mark.parametrize("arch", sorted(FACTORIES))
def test_greedy_equals_generate_with_a_sliding_window_draft_model(arch, prompt):
    target, draft = FACTORIES[arch](0), FACTORIES[arch](1)  # a different draft: many rejections
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    for drafter in (DraftModelDrafter(target, draft), PromptLookupDrafter()):
        out = speculative_generate(target, prompt, drafter, gamma=4, max_new_tokens=20, eos_token_id=[])
        assert out.tokens.tolist() == expected[0, prompt.shape[1] :].tolist(), type(drafter).__name__
        assert out.stats.accepted_tokens < out.stats.drafted_tokens  # rollbacks past the window happened


# transformers 5.17's masks do not cover a sliding layer's recorded past, so there new_cache() builds full layers
# (no window to stay within, nothing refused): these two describe the windowed caches of 5.18 and later.
windowed_caches = pytest.mark.skipif(
    not cache_ops._masks_cover_recorded_past(),
    reason="transformers < 5.18: speculation uses full-layer caches",
)


@windowed_caches
def test_rollback_past_the_window_continues_exactly_and_stays_bounded(prompt):
    model = mistral(0)
    drafts = torch.tensor([[7, 8, 9, 10, 11]])
    cache, _ = prefill(model, prompt)  # 24 positions: the sliding layers hold their last 7
    assert sliding_lengths(cache) == [WINDOW - 1] * 2
    make_croppable(cache)
    with torch.no_grad():
        model(drafts, **cache_kwargs(model, cache), use_cache=True)
    rollback(cache, prompt.shape[1] + 2)  # two drafts accepted, three rejected
    assert cache.get_seq_length() == prompt.shape[1] + 2
    assert sliding_lengths(cache) == [WINDOW - 1] * 2  # trimmed back to the window
    kept = torch.cat([prompt, drafts[:, :2]], dim=1)
    with torch.no_grad():
        got = model(torch.tensor([[5]]), **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
        expected = model(torch.cat([kept, torch.tensor([[5]])], dim=1)).logits[0, -1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # Every draft accepted: nothing to crop, but the recorded past is trimmed to the window anyway.
    rollback(cache, cache.get_seq_length())
    assert sliding_lengths(cache) == [WINDOW - 1] * 2


@windowed_caches
def test_without_recording_a_crop_past_the_window_is_a_typed_error(prompt):
    from kvb_speculative import CacheRollbackError

    model = mistral(0)
    cache, _ = prefill(model, prompt)
    with torch.no_grad():
        model(prompt[:, -3:], **cache_kwargs(model, cache), use_cache=True)
    with pytest.raises(CacheRollbackError, match="make_croppable"):
        rollback(cache, prompt.shape[1])
