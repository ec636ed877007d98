"""Which keyword a forward takes its Cache under (transformers 5.24 renamed ``past_key_values`` to ``cache``)."""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache

from kvb_cache.cache_kwarg import cache_argument, cache_kwargs


class _OwnState:  # a recurrent model's own state class (xLSTM's xLSTMCache)
    pass


class Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values: Cache | None = None): ...


class New(torch.nn.Module):
    def forward(self, input_ids=None, cache: Cache | None = None): ...


class NewPostponed(torch.nn.Module):
    def forward(self, input_ids=None, cache: "Cache | None" = None): ...  # noqa: UP037


class Recurrent(torch.nn.Module):
    def forward(self, input_ids=None, cache: _OwnState | None = None): ...


class RecurrentPostponed(torch.nn.Module):
    def forward(self, input_ids=None, cache: "xLSTMCache | None" = None): ...  # noqa: F821, UP037


class Stateful(torch.nn.Module):
    def forward(self, input_ids=None, state=None): ...


def test_the_keyword_each_forward_takes():
    assert cache_argument(Old()) == "past_key_values"
    assert cache_argument(New()) == "cache"
    assert cache_argument(NewPostponed()) == "cache"
    # 5.24 also calls recurrent models' own state `cache`: not a KV cache, so no keyword for ours.
    assert cache_argument(Recurrent()) is None
    assert cache_argument(RecurrentPostponed()) is None
    assert cache_argument(Stateful()) is None


def test_cache_kwargs_names_the_cache():
    cache = DynamicCache()
    assert cache_kwargs(Old(), cache) == {"past_key_values": cache}
    assert cache_kwargs(New(), cache) == {"cache": cache}
