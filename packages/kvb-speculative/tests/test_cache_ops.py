import pytest
import torch
from transformers import DynamicCache

from kvb_speculative import CacheRollbackError, extend, prefill, rollback


def test_extend_matches_a_full_forward(target, prompt):
    cache, _ = prefill(target, prompt[:, :10])
    logits = extend(target, cache, prompt[0, 10:])
    with torch.no_grad():
        full = target(prompt).logits[0, 10:]
    assert cache.get_seq_length() == prompt.shape[1]
    assert torch.allclose(logits, full, atol=1e-5)


def test_rollback_crops_to_the_given_length(target, prompt):
    cache, _ = prefill(target, prompt)
    rollback(cache, 20)
    assert cache.get_seq_length() == 20
    assert all(layer.keys.shape[-2] == 20 for layer in cache.layers)
    rollback(cache, 25)  # longer than the cache: nothing to do
    assert cache.get_seq_length() == 20


def test_uncroppable_cache_raises_a_typed_error():
    class Frozen(DynamicCache):
        def crop(self, tokens_to_remove):
            raise NotImplementedError("frozen")

    cache = Frozen()
    cache.update(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), 0)
    with pytest.raises(CacheRollbackError, match="DynamicCache"):
        rollback(cache, 2)


class _TakesCache(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=True):  # transformers >= 5.24
        return cache


class _TakesPastKeyValues(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=True):  # transformers 5.0-5.23
        return past_key_values


@pytest.mark.parametrize("module_type", [_TakesCache, _TakesPastKeyValues])
def test_cache_is_passed_under_the_keyword_the_forward_takes(module_type):
    from kvb_speculative.cache_ops import cache_kwargs

    cache = DynamicCache()
    module = module_type()
    assert module(torch.zeros(1, 1), **cache_kwargs(module, cache)) is cache
