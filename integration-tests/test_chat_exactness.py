"""On SmolLM2, a multi-turn chat through KVBoost gives the same greedy tokens as plain Hugging Face."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvb_cache.cache_kwarg import cache_kwargs
from kvboost import EngineConfig, KVBoost
from kvboost.replay import chat_turns, load_user_turns

NEW_TOKENS = 32


def hf_greedy(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_three_turn_chat_identical_to_hf(smollm2):
    model, tokenizer = smollm2
    engine = KVBoost(model, tokenizer)
    user_turns = load_user_turns(1)[0]
    for turn, messages in chat_turns(user_turns, 3):
        ids = engine.chat_prompt(messages)
        result = engine.generate(ids, max_new_tokens=NEW_TOKENS)
        assert result.output_ids == hf_greedy(model, ids), f"turn {turn}"
        if turn >= 2:
            assert result.cached_tokens > 0, f"turn {turn} reused nothing"
        messages.append({"role": "assistant", "content": result.output_text})


def test_first_token_logits_match_no_cache_with_small_chunks(smollm2):
    """Reused KV gives the logits Hugging Face's own incremental forward gives at the same split.

    Against one single forward over the whole prompt, fp32 differs by ~2.5e-5 on SmolLM2 (30 layers, logits
    up to ~20): that is HF's own prefix-then-suffix rounding (measured below in the same test), not reuse.
    """
    model, tokenizer = smollm2
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32))
    text = "The quick brown fox jumps over the lazy dog. " * 12
    engine.warm(text)
    longer = tokenizer(text + "Then it ran into the forest and")["input_ids"]
    cached = engine.next_token_logits(longer)
    assert cached.cached_tokens >= 96
    with torch.no_grad():
        single = model(torch.tensor([longer])).logits[0, -1]
        hf_cache = DynamicCache()
        model(torch.tensor([longer[: cached.cached_tokens]]), **cache_kwargs(model, hf_cache))
        incremental = model(
            torch.tensor([longer[cached.cached_tokens :]]), **cache_kwargs(model, hf_cache)
        ).logits[0, -1]
    hf_own_drift = (incremental - single).abs().max().item()
    torch.testing.assert_close(cached.logits, incremental, atol=1e-5, rtol=0)
    assert (cached.logits - single).abs().max().item() <= max(2 * hf_own_drift, 1e-5)
    assert int(cached.logits.argmax()) == int(single.argmax())


def test_from_pretrained_embedded_short_name():
    engine = KVBoost.from_pretrained("smollm2-135m", device="cpu")
    result = engine.generate("The capital of France is", max_new_tokens=8, temperature=0)
    assert result.output_text.strip()
    assert result.finish_reason in ("stop", "length")
