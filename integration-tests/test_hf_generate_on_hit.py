"""On SmolLM2, plain Hugging Face ``generate`` on a KVBoost cache hit gives exactly the tokens it gives without.

The composition API (``lookup_cache`` / ``store_cache``, docs/composition.md) hands the engine's cached
prefix to any Hugging Face code path and takes the KV such a path computed back into the engine's pool.
"""

from __future__ import annotations

import torch
import transformers as T

from kvb_cache import EngineConfig, KVBoost
from kvb_cache.cache_kwarg import cache_kwargs, output_cache

NEW_TOKENS = 16
SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in two sentences, name the aisle, and never "
    "recommend a product the store does not sell. The store sells paint, brushes, rollers, tape, ladders, "
    "screws, nails, hammers, saws, drills and garden hoses."
)


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def hf(model, ids: list[int], cache=None, **kwargs) -> list[int]:
    x = torch.tensor([ids])
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, **kwargs}
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), **cache_kwargs(model, cache), **kwargs)
    return out[0, len(ids) :].tolist()


def test_hf_generate_on_an_engine_hit_gives_the_no_cache_tokens(smollm2):
    model, tokenizer = smollm2
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32))
    ids = engine.chat_prompt(messages("Where do I find painter's tape?"))
    assert engine.lookup_cache(ids).cached_tokens == 0
    engine.generate(ids, max_new_tokens=4)  # the engine's own request caches the prompt
    hit = engine.lookup_cache(ids)
    assert hit.cached_tokens == len(ids) - 1
    assert hf(model, ids, hit.cache) == hf(model, ids)

    # Another question after the same system prompt: a partial hit (the shared blocks).
    other = engine.chat_prompt(messages("Do you sell garden hoses longer than twenty metres?"))
    hit = engine.lookup_cache(other)
    assert 0 < hit.cached_tokens < len(other) - 1
    penalty = T.LogitsProcessorList([T.RepetitionPenaltyLogitsProcessor(1.2)])
    assert hf(model, other, hit.cache, logits_processor=penalty) == hf(model, other, logits_processor=penalty)


def test_prompt_lookup_decoding_on_a_hit_gives_the_no_cache_tokens(smollm2):
    model, tokenizer = smollm2
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32))
    ids = engine.chat_prompt(messages("Repeat the list of what the store sells."))
    engine.generate(ids, max_new_tokens=1)
    hit = engine.lookup_cache(ids)
    inputs = hit.generate_inputs(suffix_only=True)  # the form assisted decoding needs (see the docs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=4)
    assert out[0, inputs["input_ids"].shape[1] :].tolist() == hf(model, ids, prompt_lookup_num_tokens=4)


def test_kv_stored_from_hf_generate_serves_the_engine_exactly(smollm2):
    model, tokenizer = smollm2
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32))
    ids = engine.chat_prompt(messages("Which aisle has ladders?"))
    cache = T.DynamicCache()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            **cache_kwargs(model, cache),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
        )
    seq = out.sequences[0].tolist()
    assert engine.store_cache(seq, output_cache(out), cache_salt="hf-app") == len(seq) - 1
    follow = seq + tokenizer("\nAnd screws?", add_special_tokens=False)["input_ids"]
    assert engine.generate(follow, max_new_tokens=1).cached_tokens == 0  # another tenant's chain
    result = engine.generate(follow, max_new_tokens=NEW_TOKENS, cache_salt="hf-app")
    assert result.cached_tokens == len(seq) - 1
    assert result.output_ids == hf(model, follow)
