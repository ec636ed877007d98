"""``lookup_cache`` / ``store_cache``: the pool as plain ``transformers`` caches for any Hugging Face code path.

The contract: ``model.generate(ids, **cache_kwargs(model, hit.cache), ...)`` on a hit gives exactly what the same
call gives without a cache (its own logits processors, streamers, assisted decoding included), and KV
stored from a Hugging Face cache is hit by the engine's own requests.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from conftest import PATH_ARCHITECTURES, make_model
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.generation.streamers import BaseStreamer

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost, PromptTypeError
from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.hf_bridge import PrefixCache, assisted_decoding_resumes_exactly
from kvb_cache.tiers import TierConfig

PROMPT = list(range(5, 75))  # 70 tokens: 4 full blocks of 16 and a 6-token tail


def engine(model, tok, **config) -> KVBoost:
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16, **config))


def prefilled(model, ids) -> T.DynamicCache:
    """The cache a plain forward over ``ids`` leaves (every layer full, whatever the architecture)."""
    cache = T.DynamicCache()
    with torch.no_grad():
        model(torch.tensor([ids]), **cache_kwargs(model, cache), use_cache=True)
    return cache


def hf_generate(model, ids, cache=None, **kwargs):
    x = torch.tensor([ids])
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, **kwargs}
    with torch.no_grad():
        return model.generate(x, attention_mask=torch.ones_like(x), **cache_kwargs(model, cache), **kwargs)


def assert_logits_match(cached, plain) -> None:
    """``generate``'s per-step logits with the handed-over cache vs without: the first step (the prefix's KV)
    within 1e-5 (fp32); later steps within 5e-5, since each decode step adds its own summation-order noise
    to both runs (measured up to 1.6e-5 by the 12th step: Gemma 4 with shared KV layers, transformers 5.17,
    an AVX-512 CPU; 8e-6 on 5.24). The greedy tokens are compared exactly by the callers."""
    assert torch.allclose(cached.logits[0], plain.logits[0], atol=1e-5)
    assert all(torch.allclose(a, b, atol=5e-5) for a, b in zip(cached.logits[1:], plain.logits[1:]))


class Collect(BaseStreamer):
    """A streamer recording every token it is handed (the prompt first, then each new token)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


@pytest.fixture
def warm(llama, tokenizer) -> KVBoost:
    eng = engine(llama, tokenizer)
    eng.store_cache(PROMPT, prefilled(llama, PROMPT))
    return eng


# -------------------------------------------------------------------------------------- lookup / store
def test_miss_gives_an_empty_cache_and_every_token_to_feed(llama, tokenizer):
    hit = engine(llama, tokenizer).lookup_cache(PROMPT)
    assert isinstance(hit, PrefixCache) and isinstance(hit.cache, T.DynamicCache)
    assert hit.cached_tokens == 0 and hit.cache.get_seq_length() == 0
    assert hit.remaining_ids == PROMPT and hit.token_ids == tuple(PROMPT)


def test_storing_a_misses_empty_cache_stores_nothing(llama, tokenizer):
    """lookup then store is a natural round trip; a miss's empty cache was a 400 ("holds no dense KV")."""
    eng = engine(llama, tokenizer)
    assert eng.store_cache(PROMPT, eng.lookup_cache(PROMPT).cache) == 0
    assert eng.store_cache(PROMPT, T.DynamicCache()) == 0
    assert eng.lookup_cache(PROMPT).cached_tokens == 0


def test_store_then_lookup_is_a_full_hit_cropped_for_generate(llama, tokenizer):
    eng = engine(llama, tokenizer)
    assert eng.store_cache(PROMPT, prefilled(llama, PROMPT)) == len(PROMPT)
    assert eng.paged_stats().blocks_cached == 5  # 4 full blocks and the indexed 6-token tail
    hit = eng.lookup_cache(PROMPT)
    # generate must feed at least one token: the last one stays uncached.
    assert hit.cached_tokens == len(PROMPT) - 1 and hit.remaining_ids == PROMPT[-1:]
    assert hit.cache.get_seq_length() == len(PROMPT) - 1
    ref = prefilled(llama, PROMPT)
    for got, want in zip(hit.cache.layers, ref.layers):
        assert torch.equal(got.keys, want.keys[:, :, :-1]) and torch.equal(got.values, want.values[:, :, :-1])
    assert eng.lookup_cache(PROMPT, min_uncached=0).cached_tokens == len(PROMPT)
    assert eng.lookup_cache([*PROMPT, 9, 9, 9]).cached_tokens == len(PROMPT)
    assert eng.lookup_cache(PROMPT[:40]).cached_tokens == 39  # a prefix of a stored sequence


def test_lookup_accepts_tensors_and_counts_prefix_cache_queries(warm):
    before = warm.paged_stats()
    hit = warm.lookup_cache(torch.tensor([PROMPT]))
    assert hit.cached_tokens == len(PROMPT) - 1
    assert warm.lookup_cache(torch.tensor(PROMPT)).cached_tokens == len(PROMPT) - 1
    after = warm.paged_stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * (len(PROMPT) - 1)
    # numpy arrays and numpy ints, as generate takes them (they were refused here: "must hold ints only").
    np = pytest.importorskip("numpy")
    assert warm.lookup_cache(np.array(PROMPT)).cached_tokens == len(PROMPT) - 1
    assert warm.lookup_cache([np.int64(t) for t in PROMPT]).cached_tokens == len(PROMPT) - 1
    assert warm.lookup_cache(range(len(PROMPT))).cached_tokens >= 0  # any sequence of ints, as before
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * (len(PROMPT) - 1)


def test_the_returned_cache_is_a_private_copy(warm, llama):
    hit = warm.lookup_cache(PROMPT)
    for layer in hit.cache.layers:
        layer.keys.fill_(7.0)
    again = warm.lookup_cache(PROMPT)
    assert not torch.equal(again.cache.layers[0].keys, hit.cache.layers[0].keys)
    ref = prefilled(llama, PROMPT)
    assert torch.equal(again.cache.layers[0].keys, ref.layers[0].keys[:, :, :-1])


def test_engine_requests_hit_a_stored_cache_and_lookups_hit_engine_requests(llama, tokenizer):
    eng = engine(llama, tokenizer)
    eng.store_cache(PROMPT, prefilled(llama, PROMPT))
    res = eng.generate([*PROMPT, 3, 4], max_new_tokens=4, ignore_eos=True)
    assert res.cached_tokens == len(PROMPT)
    ref = engine(llama, tokenizer).generate([*PROMPT, 3, 4], max_new_tokens=4, ignore_eos=True)
    assert res.output_ids == ref.output_ids
    other = list(range(100, 150))
    eng.generate(other, max_new_tokens=4, ignore_eos=True)
    assert eng.lookup_cache(other).cached_tokens == len(other) - 1


def test_store_after_hf_generate_stores_prompt_and_output(warm, llama):
    hit = warm.lookup_cache(PROMPT)
    out = hf_generate(llama, PROMPT, hit.cache, return_dict_in_generate=True, max_new_tokens=20)
    seq = out.sequences[0]
    assert out.past_key_values is hit.cache and hit.cache.get_seq_length() == len(seq) - 1
    # The last generated token was never fed: its KV does not exist, and is not stored.
    assert warm.store_cache(seq, out.past_key_values) == len(seq) - 1
    res = warm.generate(seq.tolist(), max_new_tokens=2, ignore_eos=True)
    assert res.cached_tokens == len(seq) - 1


def test_salted_stores_are_seen_by_their_salt_only(llama, tokenizer):
    eng = engine(llama, tokenizer)
    eng.store_cache(PROMPT, prefilled(llama, PROMPT), cache_salt="tenant-a")
    assert eng.lookup_cache(PROMPT).cached_tokens == 0
    assert eng.lookup_cache(PROMPT, cache_salt="tenant-b").cached_tokens == 0
    assert eng.lookup_cache(PROMPT, cache_salt="tenant-a").cached_tokens == len(PROMPT) - 1
    assert eng.generate(PROMPT, max_new_tokens=2, cache_salt="tenant-b").cached_tokens == 0
    assert eng.generate(PROMPT, max_new_tokens=2, cache_salt="tenant-a").cached_tokens == len(PROMPT) - 1
    with pytest.raises(InvalidRequestError) as err:
        eng.lookup_cache(PROMPT, cache_salt="")
    assert err.value.param == "cache_salt"


def test_stores_are_written_behind_to_the_disk_tier(llama, tokenizer, tmp_path):
    tiers = TierConfig(disk_cache_dir=tmp_path)
    first = engine(llama, tokenizer, tiers=tiers)
    first.store_cache(PROMPT, prefilled(llama, PROMPT), cache_salt="t")
    first.close()
    second = engine(llama, tokenizer, tiers=tiers)  # a new process: empty pool, same folder
    assert second.lookup_cache(PROMPT).cached_tokens == 0
    hit = second.lookup_cache(PROMPT, cache_salt="t")
    assert hit.cached_tokens == 64  # the 4 full blocks (a partial tail lives in RAM only)
    assert torch.equal(hit.cache.layers[1].values, prefilled(llama, PROMPT).layers[1].values[:, :, :64])
    second.close()


def test_no_caching_engine_stores_nothing(llama, tokenizer):
    eng = engine(llama, tokenizer, max_cache_bytes=0)
    assert eng.store_cache(PROMPT, prefilled(llama, PROMPT)) == 0
    assert eng.lookup_cache(PROMPT).cached_tokens == 0


# -------------------------------------------------------------------------------------- HF generate on a hit
def test_first_token_logits_equal_no_cache(warm, llama):
    hit = warm.lookup_cache(PROMPT)
    with torch.no_grad():
        ref = llama(torch.tensor([PROMPT])).logits[0, -1]
        got = llama(torch.tensor([hit.remaining_ids]), **cache_kwargs(llama, hit.cache)).logits[0, -1]
    assert torch.allclose(got, ref, atol=1e-5)
    cached = hf_generate(
        llama, PROMPT, warm.lookup_cache(PROMPT).cache, output_logits=True, return_dict_in_generate=True
    )
    plain = hf_generate(llama, PROMPT, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(cached.sequences, plain.sequences)
    assert_logits_match(cached, plain)


def test_generate_with_own_logits_processors_matches_no_cache(warm, llama):
    def processors():
        return T.LogitsProcessorList(
            [
                T.RepetitionPenaltyLogitsProcessor(1.3),
                T.NoBadWordsLogitsProcessor([[40], [41, 42]], eos_token_id=1),
            ]
        )

    plain = hf_generate(llama, PROMPT, logits_processor=processors(), max_new_tokens=16)
    cached = hf_generate(
        llama, PROMPT, warm.lookup_cache(PROMPT).cache, logits_processor=processors(), max_new_tokens=16
    )
    assert cached.tolist() == plain.tolist()
    assert 40 not in cached[0, len(PROMPT) :].tolist()


def test_sampling_with_a_seed_matches_no_cache(warm, llama):
    torch.manual_seed(3)
    plain = hf_generate(llama, PROMPT, do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(3)
    cached = hf_generate(
        llama, PROMPT, warm.lookup_cache(PROMPT).cache, do_sample=True, top_k=20, temperature=0.8
    )
    assert cached.tolist() == plain.tolist()


def test_streamers_see_the_same_tokens(warm, llama, tokenizer):
    plain, cached = Collect(), Collect()
    hf_generate(llama, PROMPT, streamer=plain)
    out = hf_generate(llama, PROMPT, warm.lookup_cache(PROMPT).cache, streamer=cached)
    assert cached.ended and cached.tokens == plain.tokens == out[0].tolist()
    text = T.TextIteratorStreamer(tokenizer, skip_prompt=True)
    hf_generate(llama, PROMPT, warm.lookup_cache(PROMPT).cache, streamer=text)
    assert "".join(text).split() == tokenizer.decode(out[0, len(PROMPT) :]).split()


def assisted_on_hit(model, hit, **kwargs):
    """Assisted generation on a hit: only the uncached suffix as ``input_ids`` (see ``generate_inputs``)."""
    inputs = hit.generate_inputs(suffix_only=True)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, pad_token_id=0, max_new_tokens=16, **kwargs)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


needs_exact_assisted_decoding = pytest.mark.skipif(
    not assisted_decoding_resumes_exactly(),
    reason="transformers 5.17's assisted decoding from any prefilled cache differs (fixed in 5.18)",
)


@needs_exact_assisted_decoding
@pytest.mark.parametrize("extra", [0, 11], ids=["full-hit", "partial-hit"])
def test_assisted_generation_matches_no_cache(warm, llama, extra):
    ids = PROMPT + list(range(200, 200 + extra))
    assistant = make_model("llama", seed=1)  # same vocabulary, different weights: some drafts rejected
    plain = hf_generate(llama, ids, assistant_model=assistant, max_new_tokens=16)[0, len(ids) :].tolist()
    hit = warm.lookup_cache(ids)
    assert hit.cached_tokens == min(len(ids) - 1, len(PROMPT))
    assert assisted_on_hit(llama, hit, assistant_model=assistant) == plain
    assert plain == hf_generate(llama, ids, max_new_tokens=16)[0, len(ids) :].tolist()  # greedy-exact


def test_the_assisted_form_warns_on_a_transformers_whose_assisted_loop_is_wrong_there(warm, monkeypatch):
    hit = warm.lookup_cache(PROMPT)
    monkeypatch.setattr(T, "__version__", "5.17.0")
    with pytest.warns(UserWarning, match="fixed in 5.18"):
        hit.generate_inputs(suffix_only=True)
    hit.generate_inputs()  # the plain form continues exactly on 5.17 too: no warning (filterwarnings=error)
    monkeypatch.setattr(T, "__version__", "5.18.0")
    hit.generate_inputs(suffix_only=True)


@needs_exact_assisted_decoding
@pytest.mark.parametrize("extra", [0, 11], ids=["full-hit", "partial-hit"])
def test_prompt_lookup_decoding_matches_no_cache(warm, llama, extra):
    ids = PROMPT + list(range(200, 200 + extra))
    plain = hf_generate(llama, ids, prompt_lookup_num_tokens=4, max_new_tokens=16)[0, len(ids) :].tolist()
    assert assisted_on_hit(llama, warm.lookup_cache(ids), prompt_lookup_num_tokens=4) == plain


@pytest.mark.xfail(
    reason="transformers 5.x assisted decoding feeds the whole input_ids on its first step even when "
    "past_key_values already holds a prefix; generate_inputs(suffix_only=True) is the working form",
    strict=False,
)
def test_assisted_generation_with_the_whole_prompt_on_a_hit(warm, llama):
    assistant = make_model("llama", seed=1)
    plain = hf_generate(llama, PROMPT, assistant_model=assistant, max_new_tokens=8)
    cached = hf_generate(
        llama, PROMPT, warm.lookup_cache(PROMPT).cache, assistant_model=assistant, max_new_tokens=8
    )
    assert cached.tolist() == plain.tolist()


def test_generate_inputs_feed_generate_directly(warm, llama):
    hit = warm.lookup_cache(PROMPT)
    inputs = hit.generate_inputs()
    assert inputs["input_ids"].tolist() == [PROMPT] and inputs["attention_mask"].shape == (1, len(PROMPT))
    with torch.no_grad():
        out = llama.generate(**inputs, do_sample=False, pad_token_id=0, max_new_tokens=12)
    assert out.tolist() == hf_generate(llama, PROMPT).tolist()
    assert warm.lookup_cache(PROMPT).generate_inputs(suffix_only=True)["input_ids"].tolist() == [PROMPT[-1:]]


@pytest.mark.parametrize("arch", [*PATH_ARCHITECTURES, "mistral"])
def test_other_architectures_match_no_cache(arch, tokenizer):
    """Both directions on every structurally different architecture: KV the engine computed, handed to
    ``generate``, and KV a plain forward computed, hit by the engine (fp32: within 1e-5, greedy identical)."""
    model = make_model(arch)
    warmed = engine(model, tokenizer)
    warmed.warm(PROMPT[:48])
    hit = warmed.lookup_cache(PROMPT)
    assert hit.cached_tokens == 48
    cached = hf_generate(model, PROMPT, hit.cache, output_logits=True, return_dict_in_generate=True)
    plain = hf_generate(model, PROMPT, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(cached.sequences, plain.sequences)
    assert_logits_match(cached, plain)
    stored = engine(model, tokenizer)
    assert stored.store_cache(PROMPT[:40], prefilled(model, PROMPT[:40])) == 40
    got = stored.next_token_logits(PROMPT)
    assert got.cached_tokens == 40
    torch.testing.assert_close(got.logits, plain.logits[0][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_layers_and_full_layers_round_trip(arch, tokenizer):
    """Sliding-window layers (window 24) drop positions past the window; ``full_layers`` keeps them, so the
    cache generate grows can be stored."""
    model = make_model(arch)
    eng = engine(model, tokenizer)
    eng.store_cache(PROMPT, prefilled(model, PROMPT))
    windowed = eng.lookup_cache(PROMPT)
    assert any(isinstance(layer, DynamicSlidingWindowLayer) for layer in windowed.cache.layers)
    out = hf_generate(model, PROMPT, windowed.cache, return_dict_in_generate=True)
    with pytest.raises(InvalidRequestError, match="full_layers=True") as err:
        eng.store_cache(out.sequences[0], out.past_key_values)
    assert err.value.param == "cache"
    full = eng.lookup_cache(PROMPT, full_layers=True)
    assert not any(isinstance(layer, DynamicSlidingWindowLayer) for layer in full.cache.layers)
    out_full = hf_generate(model, PROMPT, full.cache, return_dict_in_generate=True)
    assert torch.equal(out_full.sequences, out.sequences)
    seq = out_full.sequences[0]
    assert eng.store_cache(seq, out_full.past_key_values) == len(seq) - 1
    assert eng.generate(seq.tolist(), max_new_tokens=1).cached_tokens == len(seq) - 1


# -------------------------------------------------------------------------------------- errors
def test_bad_token_ids_raise_typed_errors(warm):
    with pytest.raises(PromptTypeError, match="tokenize text"):
        warm.lookup_cache("w1 w2")
    with pytest.raises(PromptTypeError, match=r"token_ids must be 1-D or \[1, S\]") as err:
        warm.lookup_cache(torch.tensor([PROMPT, PROMPT]))
    assert err.value.param == "token_ids"
    with pytest.raises(PromptTypeError, match=r"token_ids\[0\] is float"):
        warm.lookup_cache(torch.tensor(PROMPT, dtype=torch.float32))
    with pytest.raises(InvalidRequestError, match="empty"):
        warm.lookup_cache([])
    with pytest.raises(InvalidRequestError, match=r"\[0, 300\)"):
        warm.lookup_cache([5, 300])
    with pytest.raises(InvalidRequestError, match="min_uncached"):
        warm.lookup_cache(PROMPT, min_uncached=-1)


def test_caches_that_do_not_fit_the_model_are_refused(warm, llama):
    cache = prefilled(llama, PROMPT)
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    cases = {
        "dtype": T.DynamicCache([(k.half(), v.half()) for k, v in layers]),
        "batch size 2": T.DynamicCache([(k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)) for k, v in layers]),
        "1 layers": T.DynamicCache(layers[:1]),
        "kv heads": T.DynamicCache([(k[:, :1], v[:, :1]) for k, v in layers]),
    }
    for fragment, bad in cases.items():
        with pytest.raises(InvalidRequestError, match=fragment):
            warm.store_cache(PROMPT, bad)
    with pytest.raises(PromptTypeError):
        warm.store_cache(PROMPT, layers)
